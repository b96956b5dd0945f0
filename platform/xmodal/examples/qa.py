"""LXMERT's examples, a question (or NLVR2 statement) over one or two pictures: the `Example` a fine-tuning
run's and a pretraining run's QA head's examples both are, built from the model's logits and attention
(`answer_example`), and their pages (`QaRender.render`, the fine-tuning and pretraining kinds' render).

The attention is drawn honestly: over the picture (never into it), each box's outline is as wide as its
absolute weight says (1 px + OUTLINE_GAIN px x weight, never scaled to the row's largest), drawn outward
from the box's own outline so it covers neither the object nor its label, the weights
table beside the picture is open, each weight beside the uniform level 1/N (a dashed line in its bar,
and the weight over it), and the row's entropy beside the uniform's (ln N).
"""

from __future__ import annotations

import base64
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from xmodal.examples.draw import Chips, data_uri, hex_colour, picture, pixels, png_bytes, side_by_side
from xmodal.examples.pictures import Picture
from xmodal.examples.run import Shown
from xmodal.examples.stats import answer_type, by, by_pair, compare, confusions, question_type, row_entropy
from xmodal.examples.viewer import (
    Facet,
    Item,
    Measure,
    Rendered,
    Viewer,
    comparison_doc,
    esc,
    in_sections,
    notes_html,
    page,
    slug,
    table,
    two_by_two,
)

TOP = 5  # answers listed per example
OUTLINE_GAIN = 16  # a box's outline over the picture: 1 px + this many px x its attention weight


@dataclass
class Example:
    row: int  # in the split (a pretraining store: the question's place among the split's questions)
    id: str  # question_id or identifier
    text: str
    tokens: list[str]  # [CLS], the words, [SEP]: the attention's rows
    pictures: list[Picture]  # one (VQA, GQA, pretraining) or two (NLVR2)
    gold: list[tuple[str, float]]  # answers with their scores (NLVR2: the label, score 1)
    pred: str
    top: list[tuple[str, float]]  # the TOP answers and their probabilities
    score: float  # the job's own score of the prediction (VQA: its soft score; GQA, NLVR2: 0 or 1)
    attention: np.ndarray  # (L, P, H, T, N) float32: layer, picture, head, token, box
    loss: float = math.nan  # the run's loss on this example (nan: unlabelled)

    @property
    def right(self) -> bool:
        return self.score > 0

    @property
    def confidence(self) -> float:
        """The predicted answer's probability."""
        return self.top[0][1] if self.top else math.nan

    @property
    def entropy(self) -> float:
        """The entropy (nats) of [CLS]'s attention over each picture's real boxes in the last cross layer,
        mean of heads (the row a page shows first), averaged over the pictures."""
        rows = [row_entropy(self.attention[-1, p].mean(axis=0)[0, :len(pic.boxes)].astype(np.float64))
                for p, pic in enumerate(self.pictures)]
        return float(np.mean(rows)) if rows else math.nan

    def identity(self) -> tuple[tuple[str, object], ...]:
        """What another run's example must equal to be this example: (field, value) pairs."""
        return (("id", self.id), ("text", self.text), ("gold answers", tuple((a, round(s, 6)) for a, s in self.gold)),
                ("pictures", tuple(p.img_id for p in self.pictures)))


def token_names(store, ids: np.ndarray) -> list[str]:
    """The tokens of one input_ids row up to its [SEP]: special tokens by name, word pieces as they are."""
    tok = store.tokenizer()
    special = {v: k for k, v in tok.special_ids.items()}
    out = []
    for i in ids.tolist():
        if i == tok.pad_id:
            break
        out.append(special.get(i) or tok.decode([i]) or f"#{i}")
    return out


def example_loss(logits: torch.Tensor, targets: dict[int, float], loss: str) -> float:
    """The run's loss on one example, as its objective computes it: `bce` (VQA, GQA: binary cross-entropy
    on the soft scores, summed over the answers as the objective's mean times their count), `ce` (the
    best-scored answer's cross-entropy, times the answers' count), `pretrain` (the QA head's
    cross-entropy on the most-agreed answer); an NLVR2 logit pair or single sigmoid logit by its head.
    nan where the example has no label."""
    if not targets:
        return math.nan
    n = logits.shape[-1]
    best = max(targets, key=targets.get)
    if n == 1:  # NLVR2, the paper's sigmoid
        return float(F.binary_cross_entropy_with_logits(logits[0], torch.tensor(float(best))))
    ce = float(F.cross_entropy(logits[None], torch.tensor([best])))
    if loss == "pretrain" or n == 2 and len(targets) == 1 and loss != "bce":
        return ce
    if loss == "ce":
        return ce * n
    dense = torch.zeros(n)
    for a, s in targets.items():
        dense[a] = s
    return float(F.binary_cross_entropy_with_logits(logits, dense, reduction="sum"))


def answer_example(*, task: str, row: int, id: str, text: str, tokens: list[str], pictures: list[Picture],
                   gold: list[tuple[str, float]], targets: dict[int, float], logits: torch.Tensor,
                   names: Callable[[int], str], attention: np.ndarray, loss: str) -> Example:
    """An example from the model's logits over the answers (NLVR2: its one or two outputs) and its
    attention (L, P, H, T, N). Right: VQA's soft score of the prediction, GQA's exact match, NLVR2's
    label, a pretraining QA head's most-agreed answer (`qa_acc`)."""
    if task == "nlvr2":
        pt = float(torch.sigmoid(logits[0])) if logits.shape[-1] == 1 else float(logits.softmax(-1)[1])
        pred = "true" if (logits[0] > 0 if logits.shape[-1] == 1 else int(logits.argmax()) == 1) else "false"
        top = sorted([("true", pt), ("false", 1 - pt)], key=lambda t: -t[1])
        score = float(bool(gold) and gold[0][0] == pred)
        loss = "nlvr2"
    else:
        probs = logits.softmax(-1)
        pred = names(int(logits.argmax()))
        vals, idx = probs.topk(min(TOP, probs.shape[0]))
        top = [(names(int(i)), float(v)) for v, i in zip(vals, idx, strict=True)]
        s = dict(gold).get(pred, 0.0)
        score = float(s > 0) if task == "gqa" else float(bool(gold) and pred == gold[0][0]) \
            if task == "pretrain" else float(s)
    return Example(row=row, id=id, text=text, tokens=tokens, pictures=pictures, gold=gold, pred=pred, top=top,
                   score=score, attention=np.ascontiguousarray(attention, dtype=np.float32),
                   loss=example_loss(logits.float(), targets, loss))


# ----------------------------------------------------------------------------- the pages

VERDICTS = ["wrong", "right"]
COMPARED = ["only A right", "only B right", "both wrong", "both right"]


def verdict(e: Example) -> str:
    if not e.right:
        return "<b class='wrong'>wrong</b>"
    return "<b class='right'>right</b>" if e.score >= 1 else "<b class='part'>partly right</b>"


def compared(x: Example, y: Example) -> str:
    return {(True, False): "only A right", (False, True): "only B right", (False, False): "both wrong",
            (True, True): "both right"}[(x.right, y.right)]


def gold_text(e: Example) -> str:
    return e.gold[0][0] if e.gold else "(unlabelled)"


@dataclass
class Drawn:
    """The pictures of a set of pages: each image's picture with its boxes as a data: URI (key: img_id),
    its size, and the PNG of each example's picture(s) (key: the example's file stem)."""

    uris: dict[str, str]
    sizes: dict[str, tuple[int, int]]
    files: dict[str, bytes]
    images: dict[str, object]  # stem -> PIL image of the example (MLflow's table)


def draw_all(examples: list[Example], stems: list[str]) -> Drawn:
    """Every image drawn and encoded once; an NLVR2 pair is put side by side for its example's file."""
    uris, sizes, pngs, imgs = {}, {}, {}, {}
    chips: Chips = {}
    for e in examples:
        for p in e.pictures:
            if p.img_id not in uris:
                img = picture(p, chips)
                png = png_bytes(img)
                imgs[p.img_id], pngs[p.img_id], sizes[p.img_id], uris[p.img_id] = img, png, img.size, data_uri(png)
    files, images = {}, {}
    for e, stem in zip(examples, stems, strict=True):
        if len(e.pictures) == 1:
            files[stem], images[stem] = pngs[e.pictures[0].img_id], imgs[e.pictures[0].img_id]
        else:
            images[stem] = side_by_side([imgs[p.img_id] for p in e.pictures])
            files[stem] = png_bytes(images[stem])
    return Drawn(uris, sizes, files, images)


def attention_data(label: str, e: Example, drawn: Drawn) -> dict:
    """What the page's script draws a run's attention from: the weights (float32, base64) and each
    picture's boxes in its pixels, with their colours."""
    pics = []
    for p in e.pictures:
        size = drawn.sizes[p.img_id]
        rects = [pixels(b, size) for b in p.boxes]
        pics.append({"n": len(p.boxes), "rects": [[x1, y1, x2 - x1, y2 - y1] for x1, y1, x2, y2 in rects],
                     "colours": [hex_colour(i) for i in range(len(p.boxes))]})
    att = np.ascontiguousarray(e.attention, dtype="<f4")
    return {"label": label, "shape": list(att.shape), "att": base64.b64encode(att.tobytes()).decode("ascii"),
            "pics": pics}


def answers_block(e: Example) -> str:
    gold = "".join(f"<tr><td>{esc(a)}</td><td class=n>{s:.2f}</td></tr>" for a, s in e.gold) or \
        "<tr><td colspan=2>(unlabelled)</td></tr>"
    top = "".join(f"<tr><td>{'<b>' + esc(a) + '</b>' if a == e.pred else esc(a)}</td><td class=n>{p:.4f}</td></tr>"
                  for a, p in e.top)
    loss = "-" if math.isnan(e.loss) else f"{e.loss:.4f}"
    return (f"<p>gold <b>{esc(gold_text(e))}</b> · predicted <b>{esc(e.pred)}</b> ({verdict(e)}, score "
            f"{e.score:.2f}, probability {e.confidence:.4f}, loss {loss})</p><div class='tables'>"
            f"<table><tr><th>gold answer</th><th class=n>score</th></tr>{gold}</table>"
            f"<table><tr><th>top {len(e.top)}</th><th class=n>probability</th></tr>{top}</table></div>")


def pictures_block(label: str, e: Example, drawn: Drawn) -> str:
    """Each picture under its attention overlay (drawn by the script), its entropy line and its open
    weights table."""
    out = []
    for p, pic in enumerate(e.pictures):
        w, h = drawn.sizes[pic.img_id]
        rows = "".join(
            f"<tr data-side='{label}' data-p='{p}' data-b='{b}'><td style='color:{hex_colour(b)}'>&#9632; {b}</td>"
            f"<td>{esc(bx.label)}</td><td class='n xm-w'></td><td class='n xm-x'></td><td><div class='bar'><i></i>"
            f"<b style='left:{160 / max(1, len(pic.boxes)):.1f}px'></b></div></td></tr>"
            for b, bx in enumerate(pic.boxes))
        which = f"picture {p + 1} ({esc(pic.img_id)})" if len(e.pictures) > 1 else esc(pic.img_id)
        out.append(
            f"<div class='legend'>{which}</div><div class='picrow'><div class='pic'><img data-pic='{esc(pic.img_id)}' width={w} "
            f"height={h} alt='{esc(pic.img_id)}'><svg data-side='{label}' data-p='{p}' viewBox='0 0 {w} {h}'></svg>"
            f"</div><div><p class='legend xm-ent' data-side='{label}' data-p='{p}'></p><table class='weights'><tr><th>box</th>"
            f"<th>detected</th><th class=n>weight</th><th class=n>x uniform</th><th>weight (0 to 1; dashed: uniform "
            f"1/{len(pic.boxes)})</th></tr>{rows}</table></div></div>")
    return "".join(out)


def detail(i: int, n: int, sides: list[tuple[str, Shown, Example]], drawn: Drawn, notes: list[str]) -> str:
    e = sides[0][2]
    head = (f"<h2>Example {i + 1} of {n}: <code>{esc(e.id)}</code> "
            + " · ".join(f"{lab + ': ' if len(sides) > 1 else ''}{verdict(x)}" for lab, _, x in sides) + "</h2>")
    pickers = ("<p>cross-attention of <select class='xm-layer'></select> <select class='xm-head'></select> from the "
               "word <span class='xm-toks'></span></p><p class='legend'>Around each box, an outline 1 px + "
               f"{OUTLINE_GAIN} px x its weight wide (the weights as the model computed them, not scaled to the "
               "row's largest); the picture itself is not changed.</p>")
    runs = "".join(
        f"<div class='run'>{f'<h3>run {lab}: {esc(r.run_name)} <small>({esc(r.run_id)})</small></h3>' if len(sides) > 1 else ''}"
        f"{answers_block(x)}{pictures_block(lab, x, drawn)}</div>" for lab, r, x in sides)
    return f"{head}{notes_html(notes)}<p class='question'>{esc(e.text)}</p>{pickers}<div class='runs'>{runs}</div>"


def card(sides: list[tuple[str, Shown, Example]], drawn: Drawn) -> str:
    e = sides[0][2]
    pics = "".join(f"<img data-pic='{esc(p.img_id)}' alt=''>" for p in e.pictures[:1])
    preds = " · ".join(f"{lab + ' ' if len(sides) > 1 else 'predicted '}<b>{esc(x.pred)}</b> {verdict(x)} "
                       f"({x.confidence:.2f})" for lab, _, x in sides)
    return f"{pics}<div>{esc(e.text)}</div><div>gold <b>{esc(gold_text(e))}</b> · {preds}</div>"


HOOK = """
window.XM_HOOK=function(root,it){
var S=window.XM_QA||(window.XM_QA={layer:-1,head:'avg',tok:0}),d=it.data;
d.sides.forEach(function(s){if(s.w)return;var bin=atob(s.att),u=new Uint8Array(bin.length);
  for(var i=0;i<bin.length;i++)u[i]=bin.charCodeAt(i);s.w=new Float32Array(u.buffer);});
var sh=d.sides[0].shape,L=sh[0],H=sh[2],T=d.tokens.length;
var ls=root.querySelector('.xm-layer'),hs=root.querySelector('.xm-head'),tb=root.querySelector('.xm-toks');
var o='';for(var l=0;l<L;l++)o+='<option value='+l+'>cross layer '+(l+1)+' of '+L+'</option>';ls.innerHTML=o;
o='<option value=avg>mean of the '+H+' heads</option>';for(var h=0;h<H;h++)o+='<option value='+h+'>head '+(h+1)+'</option>';
hs.innerHTML=o;o='';d.tokens.forEach(function(t,k){var b=document.createElement('button');b.className='tok';
  b.dataset.t=k;b.textContent=t;b.onclick=function(){S.tok=k;draw();};tb.appendChild(b);});
function row(s,l,h,t,p){var z=s.shape,P=z[1],Hs=z[2],Ts=z[3],N=z[4],n=s.pics[p].n,out=[],k,b;
  l=Math.min(l,z[0]-1);t=Math.min(t,Ts-1);var heads=[];if(h==='avg'){for(k=0;k<Hs;k++)heads.push(k);}
  else heads.push(Math.min(+h,Hs-1));for(b=0;b<n;b++)out.push(0);
  heads.forEach(function(hh){var at=(((l*P+p)*Hs+hh)*Ts+t)*N;for(b=0;b<n;b++)out[b]+=s.w[at+b]/heads.length;});
  return out;}
function draw(){var l=S.layer<0||S.layer>=L?L-1:S.layer;S.tok=Math.min(S.tok,T-1);ls.value=l;hs.value=S.head;
  tb.querySelectorAll('.tok').forEach(function(b){b.classList.toggle('on',+b.dataset.t===S.tok);});
  d.sides.forEach(function(s){s.pics.forEach(function(pc,p){var w=row(s,l,S.head,S.tok,p),n=pc.n,sel='[data-side="'+
    s.label+'"][data-p="'+p+'"]',ent=0;
    root.querySelector('svg'+sel).innerHTML=pc.rects.map(function(r,b){var sw=1+"""+str(OUTLINE_GAIN)+"""*w[b];
      return '<rect x="'+(r[0]+1-sw/2)+'" y="'+(r[1]+1-sw/2)+'" width="'+(Math.max(0,r[2]-2)+sw)+'" height="'+
      (Math.max(0,r[3]-2)+sw)+'" fill="none" stroke="'+pc.colours[b]+'" stroke-opacity="0.9" stroke-width="'+
      sw.toFixed(2)+'" data-w="'+w[b]+'"><title>box '+b+': '+w[b].toFixed(4)+'</title></rect>';}).join('');
    w.forEach(function(x){if(x>0)ent-=x*Math.log(x);});
    root.querySelector('.xm-ent'+sel).textContent='this row: entropy '+ent.toFixed(3)+' nats; uniform over the '+n+
      ' boxes: 1/'+n+' = '+(1/n).toFixed(4)+' each, entropy ln '+n+' = '+Math.log(n).toFixed(3);
    root.querySelectorAll('tr'+sel).forEach(function(tr){var b=+tr.dataset.b;tr.querySelector('.xm-w').textContent=
      w[b].toFixed(4);tr.querySelector('.xm-x').textContent=(w[b]*n).toFixed(2);
      tr.querySelector('.bar i').style.width=(160*w[b]).toFixed(1)+'px';});});});}
ls.onchange=function(){S.layer=+ls.value;draw();};hs.onchange=function(){S.head=hs.value;draw();};
draw();};
"""


class QaRender:
    """The pages of LXMERT's examples (the fine-tuning and pretraining kinds): one run's, or two runs' on
    the same examples side by side."""

    name = ""

    def render(self, a: Shown, b: Shown | None = None) -> Rendered:
        groups = COMPARED if b is not None else VERDICTS
        a, b = in_sections(a, b, lambda x, y: compared(x, y) if y is not None else VERDICTS[x.right], groups)
        n = len(a.examples)
        group = [compared(x, y) for x, y in zip(a.examples, b.examples, strict=True)] if b is not None else \
            ["right" if e.right else "wrong" for e in a.examples]
        stems = [f"{i + 1:04d}-{slug(g)}-{slug(question_type(e, a.task))}" for i, (g, e) in
                 enumerate(zip(group, a.examples, strict=True))]
        drawn = draw_all(a.examples, stems)  # B's examples are the same, pictures and all (run.check_same_examples)
        notes = list(dict.fromkeys(a.notes + (b.notes if b is not None else [])))
        items = []
        for i, e in enumerate(a.examples):
            sides = [("A", a, e)] + ([("B", b, b.examples[i])] if b is not None else [])
            sorts = {}
            for lab, _, x in sides:
                suffix = f" ({lab})" if b is not None else ""
                sorts.update({f"confidence{suffix}": x.confidence, f"loss{suffix}": nan_none(x.loss),
                              f"entropy{suffix}": nan_none(x.entropy)})
            items.append(Item(
                id=e.id, card=card(sides, drawn), detail=detail(i, n, sides, drawn, notes),
                facets={"verdict": group[i], "qtype": question_type(e, a.task), "atype": answer_type(e, a.task)},
                sorts=sorts, data={"tokens": e.tokens, "sides": [attention_data(lab, x, drawn) for lab, _, x in sides]}))
        qkey = "sentence length" if a.task == "nlvr2" else "question type"
        measures = [Measure(f"{m}{f' ({lab})' if b is not None else ''}", f"{m}{f' of {lab}' if b is not None else ''}",
                            first) for lab in (("A", "B") if b is not None else ("A",))
                    for m, first in (("confidence", "highest"), ("loss", "highest"), ("entropy", "lowest"))]
        v = Viewer(title=title(a, b), summary=summary(a, b, notes), items=items,
                   facets=[Facet("verdict", "right or wrong" if b is None else "who is right"), Facet("qtype", qkey),
                           Facet("atype", "answer type")],
                   measures=measures, group="verdict", groups=groups,
                   pictures=drawn.uris, hook=HOOK, documents=comparison_doc(a, b))
        files = {f"pictures/{s}.png": drawn.files[s] for s in stems}
        return Rendered(page(v), files, None if b is not None else table_of(a, stems, drawn), line(a, b))


def nan_none(x: float) -> float | None:
    return None if math.isnan(x) else x


def title(a: Shown, b: Shown | None) -> str:
    if b is None:
        return f"{a.task} examples of run {a.run_name}"
    return f"{a.task}: run {a.run_name} (A) against run {b.run_name} (B)"


def accuracy(s: Shown) -> float:
    return sum(e.score for e in s.examples) / len(s.examples)


def line(a: Shown, b: Shown | None) -> str:
    """What the console says of the pages (the comparison's 2x2 is printed apart: build.py)."""
    what = f"{len(a.examples)} {a.split} examples"
    if b is None:
        return f"{what} of run {a.run_name} ({a.right} right, accuracy {accuracy(a):.3f})"
    return (f"{what}: run A {a.run_name} {a.right} right (accuracy {accuracy(a):.3f}), run B {b.run_name} {b.right} "
            f"right (accuracy {accuracy(b):.3f})")


def summary(a: Shown, b: Shown | None, notes: list[str]) -> str:
    """The head of the index: what is shown, how many are right, accuracy by question and answer type, the
    confusions; for two runs the 2x2 table, McNemar's test and the per-type table of both."""
    t = a.task
    qkey = "sentence length" if t == "nlvr2" else "question type"
    q, at = (lambda e: question_type(e, t)), (lambda e: answer_type(e, t))
    if b is None:
        ex = a.examples
        groups = [table([name, "examples", "right", "accuracy"], [[g.name, g.count, g.right, f"{g.score:.3f}"]
                                                                   for g in by(ex, k)], {1, 2, 3})
                  for k, name in ((q, qkey), (at, "answer type"))]
        conf = confusions(ex)
        return (f"<h1>{esc(title(a, b))}</h1><p>run {esc(a.run_id)} · {len(ex)} of the {a.split_size} examples of "
                f"split <b>{esc(a.split)}</b> ({esc(a.data_path)})</p>{notes_html(notes)}"
                f"<p><b>{a.right} right, {len(ex) - a.right} wrong: accuracy {accuracy(a):.3f}</b></p>"
                f"<div class='tables'><div><h3>by {qkey}</h3>{groups[0]}</div><div><h3>by answer type</h3>{groups[1]}"
                "</div><div><h3>most frequent confusions</h3>"
                + (table(["gold", "predicted", "count"], [list(c) for c in conf], {2}) if conf else
                   "<p>none: no example is wrong</p>") + "</div></div>")
    c = compare(a.examples, b.examples)
    pair = [table([qkey if k is q else "answer type", "examples", "A", "B", "B - A"],
                  [[g.name, g.count, f"{g.a:.3f}", f"{g.b:.3f}", f"{g.difference:+.3f}"]
                   for g in by_pair(a.examples, b.examples, k)], {1, 2, 3, 4}) for k in (q, at)]
    return (f"<h1>{esc(title(a, b))}</h1><p>A: {esc(a.run_id)} · B: {esc(b.run_id)} · {len(a.examples)} of the "
            f"{a.split_size} examples of split <b>{esc(a.split)}</b> ({esc(a.data_path)})</p>{notes_html(notes)}"
            f"<p><b>A {a.right} right (accuracy {accuracy(a):.3f}), B {b.right} right (accuracy {accuracy(b):.3f})"
            f"</b></p><div class='tables'><div>{two_by_two(c)}</div><div><h3>by {qkey}</h3>{pair[0]}</div><div><h3>by "
            f"answer type</h3>{pair[1]}</div></div>")


def table_of(a: Shown, stems: list[str], drawn: Drawn) -> dict[str, list]:
    """The run's examples as MLflow's table (one row per example): the picture as an image column, so
    its evaluation view shows it ("Compare: picture"), the example id to join runs by."""
    ex = a.examples
    return {
        "example_id": [e.id for e in ex],
        "question": [e.text for e in ex],
        "answers": [", ".join(f"{g} ({s:.2f})" for g, s in e.gold) for e in ex],
        "prediction": [e.pred for e in ex],
        "confidence": [round(e.confidence, 6) for e in ex],
        "right": [bool(e.right) for e in ex],
        "score": [e.score for e in ex],
        "loss": [None if math.isnan(e.loss) else round(e.loss, 6) for e in ex],
        "question_type": [question_type(e, a.task) for e in ex],
        "answer_type": [answer_type(e, a.task) for e in ex],
        "picture": [drawn.images[s] for s in stems],
        "file": [f"pictures/{s}.png" for s in stems],
    }
