"""The static HTML of the example pages: `index.html` (the summary: accuracy by question and answer type,
the most frequent confusions, the examples grouped wrong and right; with a second run, the 2x2 table,
McNemar's test and the disagreements first) and one page per example. No server and no framework: the
pictures are PNG files beside the pages, and a few lines of inline script pick the layer, the head and
the word whose cross-attention the boxes show (their opacity is the weight over the largest weight of
that row). Without the script a page shows the last layer's attention of [CLS], averaged over heads.
The pages carry their pictures inline as well (data: URIs; the index shows them small), so that a page
opened alone, as MLflow's artifact viewer opens it in a sandboxed frame, still shows them.

The weights sit in each page as JSON (`<script type="application/json" id="att-A">`): per layer, per
picture, per head, per token, per box, the probabilities the model computed, rounded to 6 decimals.
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from xmodal.examples.collect import Example, RunExamples
from xmodal.examples.stats import Comparison, answer_type, by, confusions, question_type

DECIMALS = 6  # of the attention weights in a page

CSS = """
body{font-family:system-ui,sans-serif;margin:1.5em;color:#222;max-width:1400px}
table{border-collapse:collapse;margin:.5em 0}td,th{border:1px solid #ccc;padding:2px 8px;text-align:left}
.right{color:#11772d}.wrong{color:#b3261e}.grid{display:flex;flex-wrap:wrap;gap:10px}
.card{border:1px solid #ddd;padding:4px;width:210px;font-size:12px}.card img{max-width:100%}
.pic{position:relative;display:inline-block;margin:4px}.pic img{display:block}
.w{position:absolute;background:#1040ff;outline:2px solid #1040ff;pointer-events:none}
.runs{display:flex;gap:2em;flex-wrap:wrap}.run{flex:1;min-width:420px}
.tok{margin:1px;padding:1px 5px;border:1px solid #bbb;background:#fff;cursor:pointer}.tok.on{background:#ffd7cc}
.note{background:#fff6d6;padding:4px 8px;border-left:3px solid #e0b000}
"""

SCRIPT = """
function show(r){var d=JSON.parse(document.getElementById('att-'+r).textContent);
var l=+document.getElementById('layer-'+r).value,h=document.getElementById('head-'+r).value,
t=+document.getElementById('tok-'+r).value;
d.pics.forEach(function(_,p){var w=h==='avg'?d.avg[l][p][t]:d.att[l][p][+h][t],m=Math.max.apply(null,w)||1;
w.forEach(function(x,b){var e=document.getElementById('w-'+r+'-'+p+'-'+b);if(e){e.style.opacity=(0.5*x/m).toFixed(3);
e.title='box '+b+': '+x.toFixed(4);}var c=document.getElementById('v-'+r+'-'+p+'-'+b);if(c){c.textContent=x.toFixed(4);}});});
document.querySelectorAll('.tok-'+r).forEach(function(e){e.classList.toggle('on',+e.dataset.t===t);});}
function pick(r,t){document.getElementById('tok-'+r).value=t;show(r);}
"""


def esc(x: object) -> str:
    return html.escape(str(x))


def page_name(i: int) -> str:
    return f"example-{i:04d}.html"


def picture_name(img_id: str) -> str:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in img_id)
    return f"img/{safe}.png"


class Drawn(NamedTuple):
    """A picture as the pages show it: its size in pixels and its PNG as a data: URI."""

    width: int
    height: int
    uri: str


def weights(e: Example, avg: np.ndarray | None = None) -> dict:
    """The JSON a page holds for one run's example: the weights and their head average (`avg`, (L, P, T, N)
    float64, where the caller has it)."""
    att = e.attention.astype(np.float64)
    avg = att.mean(axis=2) if avg is None else avg
    return {"att": np.round(att, DECIMALS).tolist(), "avg": np.round(avg, DECIMALS).tolist(),
            "pics": [p.img_id for p in e.pictures], "tokens": e.tokens}


def document(title: str, body: str) -> str:
    return (f"<!doctype html><html><head><meta charset='utf-8'><title>{esc(title)}</title><style>{CSS}</style>"
            f"</head><body>{body}</body></html>\n")


def verdict(e: Example) -> str:
    """Right, wrong, or partly right: a VQA answer that only some annotators gave (soft score below 1)."""
    if not e.right:
        return "<b class='wrong'>wrong</b>"
    return "<b class='right'>right</b>" if e.score >= 1 else "<b class='right'>partly right</b>"


def answers_block(e: Example) -> str:
    gold = "".join(f"<tr><td>{esc(a)}</td><td>{s:.2f}</td></tr>" for a, s in e.gold) or \
        "<tr><td colspan=2>(unlabelled)</td></tr>"
    top = "".join(f"<tr><td>{'<b>' + esc(a) + '</b>' if a == e.pred else esc(a)}</td><td>{p:.4f}</td></tr>"
                  for a, p in e.top)
    return (f"<p>predicted <b>{esc(e.pred)}</b> ({verdict(e)}, score {e.score:.2f})</p>"
            f"<table><tr><th>gold answer</th><th>score</th></tr>{gold}</table>"
            f"<table><tr><th>top {len(e.top)}</th><th>probability</th></tr>{top}</table>")


def attention_block(r: str, e: Example, drawn: dict[str, Drawn]) -> str:
    """Pictures with the attention overlay of run `r` ("A" or "B") and its layer/head/word pickers."""
    layers, _, heads, tokens, _ = e.attention.shape
    last = layers - 1
    avg = e.attention.astype(np.float64).mean(axis=2)  # (L, P, T, N): shown, and the page's JSON
    layer_opts = "".join(f"<option value={i}{' selected' if i == last else ''}>cross layer {i + 1}</option>"
                         for i in range(layers))
    head_opts = "<option value='avg'>mean of heads</option>" + "".join(
        f"<option value={h}>head {h + 1}</option>" for h in range(heads))
    toks = "".join(f"<button class='tok tok-{r}{' on' if t == 0 else ''}' data-t={t} onclick=\"pick('{r}',{t})\">"
                   f"{esc(tok)}</button>" for t, tok in enumerate(e.tokens[:tokens]))
    pics = []
    for p, pic in enumerate(e.pictures):
        w, h, uri = drawn[pic.img_id]
        row = avg[last, p, 0]
        m = float(row.max()) or 1.0
        over = "".join(
            f"<div class='w' id='w-{r}-{p}-{b}' title='box {b}: {row[b]:.4f}' style='left:{100 * x1:.2f}%;"
            f"top:{100 * y1:.2f}%;width:{100 * (x2 - x1):.2f}%;height:{100 * (y2 - y1):.2f}%;"
            f"opacity:{0.5 * row[b] / m:.3f}'></div>"
            for b, (x1, y1, x2, y2) in enumerate(bx.xyxy for bx in pic.boxes))
        table = "".join(f"<tr><td>{b}</td><td>{esc(bx.label)}</td><td id='v-{r}-{p}-{b}'>{row[b]:.4f}</td></tr>"
                        for b, bx in enumerate(pic.boxes))
        which = f"picture {p} " if len(e.pictures) > 1 else ""
        pics.append(f"<div><div class='pic'><img src='{uri}' width={w} height={h} "
                    f"alt='{esc(pic.img_id)}'>{over}</div><details><summary>{which}boxes and weights "
                    f"({esc(pic.img_id)})</summary><table><tr><th>box</th><th>detected</th><th>weight</th></tr>"
                    f"{table}</table></details></div>")
    return (f"<p>cross-attention of <select id='layer-{r}' onchange=\"show('{r}')\">{layer_opts}</select> "
            f"<select id='head-{r}' onchange=\"show('{r}')\">{head_opts}</select> from "
            f"<input type=hidden id='tok-{r}' value=0>{toks}</p>"
            f"<div class='grid'>{''.join(pics)}</div>"
            f"<script type='application/json' id='att-{r}'>{json.dumps(weights(e, avg))}</script>")


@dataclass
class Side:
    """One run's view of an example."""

    label: str  # "A" or "B"
    run: RunExamples
    example: Example


def example_page(i: int, n: int, sides: list[Side], drawn: dict[str, Drawn], notes: list[str]) -> str:
    e = sides[0].example
    nav = " · ".join(x for x in (
        f"<a href='{page_name(i - 1)}'>previous</a>" if i > 0 else "",
        "<a href='index.html'>index</a>",
        f"<a href='{page_name(i + 1)}'>next</a>" if i + 1 < n else "") if x)
    runs = []
    for s in sides:
        head = f"<h3>run {s.label}: {esc(s.run.run_name)} <small>({esc(s.run.run_id)})</small></h3>" \
            if len(sides) > 1 else ""
        runs.append(f"<div class='run'>{head}{answers_block(s.example)}{attention_block(s.label, s.example, drawn)}"
                    f"</div>")
    said = "".join(f"<p class='note'>{esc(x)}</p>" for x in notes)
    body = (f"<p>{nav}</p><h2>Example {i + 1} of {n}: {esc(e.id)}</h2>{said}"
            f"<p style='font-size:1.2em'>{esc(e.text)}</p><div class='runs'>{''.join(runs)}</div>"
            f"<script>{SCRIPT}{''.join(f'show({json.dumps(s.label)});' for s in sides)}</script>")
    return document(f"{e.id}: {e.text}", body)


def group_table(title: str, groups) -> str:
    rows = "".join(f"<tr><td>{esc(g.name)}</td><td>{g.count}</td><td>{g.right}</td><td>{g.score:.3f}</td></tr>"
                   for g in groups)
    return (f"<h3>{esc(title)}</h3><table><tr><th>{esc(title.split(' by ')[-1])}</th><th>examples</th>"
            f"<th>right</th><th>accuracy</th></tr>{rows}</table>")


def card(i: int, sides: list[Side], drawn: dict[str, Drawn]) -> str:
    e = sides[0].example
    marks = " ".join(f"{s.label}: {verdict(s.example)} ({esc(s.example.pred)})" for s in sides) \
        if len(sides) > 1 else f"{verdict(e)}: {esc(e.pred)}"
    return (f"<div class='card'><a href='{page_name(i)}'><img src='{drawn[e.pictures[0].img_id].uri}' "
            f"alt='{esc(e.id)}'></a><br><a href='{page_name(i)}'>{esc(e.text)}</a><br>{marks}</div>")


def summary(run: RunExamples) -> str:
    ex, t = run.examples, run.task
    right = sum(e.right for e in ex)
    score = sum(e.score for e in ex) / len(ex)
    conf = "".join(f"<tr><td>{esc(g)}</td><td>{esc(p)}</td><td>{n}</td></tr>" for g, p, n in confusions(ex))
    qkey = "sentence length" if t == "nlvr2" else "question type"
    return (f"<p>{len(ex)} of the {run.split_size} examples of split <b>{esc(run.split)}</b> ({esc(run.set_path)}): "
            f"{right} right, accuracy {score:.3f}</p>"
            + group_table(f"accuracy by {qkey}", by(ex, lambda e: question_type(e, t)))
            + group_table("accuracy by answer type", by(ex, lambda e: answer_type(e, t)))
            + "<h3>most frequent confusions</h3>"
            + (f"<table><tr><th>gold</th><th>predicted</th><th>count</th></tr>{conf}</table>" if conf else
               "<p>none: no example is wrong</p>"))


def index_page(a: RunExamples, b: RunExamples | None, cmp: Comparison | None, notes: list[str],
               drawn: dict[str, Drawn]) -> str:
    n = len(a.examples)
    said = "".join(f"<p class='note'>{esc(x)}</p>" for x in notes)
    title = f"{a.task} examples of run {a.run_name}"
    if b is None or cmp is None:
        sides = [[Side("A", a, e)] for e in a.examples]
        wrong = [i for i, e in enumerate(a.examples) if not e.right]
        right = [i for i, e in enumerate(a.examples) if e.right]
        body = (f"<h1>{esc(title)}</h1><p>run {esc(a.run_id)}</p>{said}{summary(a)}"
                f"<h2>wrong ({len(wrong)})</h2><div class='grid'>{''.join(card(i, sides[i], drawn) for i in wrong)}</div>"
                f"<h2>right ({len(right)})</h2><div class='grid'>{''.join(card(i, sides[i], drawn) for i in right)}</div>")
        return document(title, body)
    title = f"{a.task}: run {a.run_name} (A) against {b.run_name} (B)"
    sides = [[Side("A", a, x), Side("B", b, y)] for x, y in zip(a.examples, b.examples, strict=True)]
    table = (f"<table><tr><th></th><th>B right</th><th>B wrong</th></tr>"
             f"<tr><th>A right</th><td>{cmp.both_right}</td><td>{cmp.only_a}</td></tr>"
             f"<tr><th>A wrong</th><td>{cmp.only_b}</td><td>{cmp.both_wrong}</td></tr></table>"
             f"<p>both right {cmp.both_right}, only A {cmp.only_a}, only B {cmp.only_b}, both wrong "
             f"{cmp.both_wrong}: {cmp.total} examples. McNemar's test ({cmp.test}): p = {cmp.p_value:.4g}</p>")
    differ = [i for i, (x, y) in enumerate(zip(a.examples, b.examples, strict=True)) if x.right != y.right]
    same = [i for i in range(n) if i not in set(differ)]
    body = (f"<h1>{esc(title)}</h1><p>A: {esc(a.run_id)} · B: {esc(b.run_id)}</p>{said}{table}"
            f"<h2>A</h2>{summary(a)}<h2>B</h2>{summary(b)}"
            f"<h2>they disagree ({len(differ)})</h2><div class='grid'>{''.join(card(i, sides[i], drawn) for i in differ)}</div>"
            f"<h2>they agree ({len(same)})</h2><div class='grid'>{''.join(card(i, sides[i], drawn) for i in same)}</div>")
    return document(title, body)


def page_order(a: RunExamples, b: RunExamples | None) -> list[int]:
    """The order of the example pages: with two runs, their disagreements first; else as chosen."""
    if b is None:
        return list(range(len(a.examples)))
    differ = [i for i, (x, y) in enumerate(zip(a.examples, b.examples, strict=True)) if x.right != y.right]
    return differ + [i for i in range(len(a.examples)) if i not in set(differ)]
