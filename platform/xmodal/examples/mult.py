"""The MulT kind (sentiment stores): per clip the prediction against the label, and each crossmodal
transformer's attention over time (target steps over source steps, per layer, averaged over heads, as heat
maps on one absolute scale per map, each row's entropy beside it); the index counts the errors by label bin
(the label rounded to -3..3, the 7-class bins). Right: the sentiment's sign (MulT's binary accuracy).

The clips are read by their row groups only (`store.units`); the attention is recorded by a flag on the
model only while they are predicted (`models.mult.recording_crossmodal_attention`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from xmodal.base import run_tags
from xmodal.examples.draw import data_uri, heat_map, in_rows, png_bytes
from xmodal.examples.run import ExamplesError, Resolved, Shown, choose_rows, open_recorded, rows_of
from xmodal.examples.stats import by_pair, compare, row_entropy
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
    table,
    two_by_two,
)

NAMES = {"l": "text", "a": "audio", "v": "vision"}
SHOWN_SIDE = 240  # a map's longer side on the page, in CSS pixels
THUMB_SIDE = 96  # a map's longer side in a clip's file (its card, MLflow's table): the last layer, each direction


@dataclass
class MultExample:
    row: int
    id: str
    label: float
    pred: float
    lengths: dict[str, int]  # true steps per modality
    attention: dict[str, np.ndarray]  # "a->l": (L, H, T_target, S_source), real steps only

    @property
    def label_bin(self) -> int:
        return int(np.round(np.clip(self.label, -3, 3)))

    @property
    def right(self) -> bool:
        """The sign of the sentiment (MulT's binary accuracy; a neutral label: |prediction| < 0.5)."""
        if self.label == 0:
            return abs(self.pred) < 0.5
        return (self.pred > 0) == (self.label > 0)

    @property
    def score(self) -> float:
        return float(self.right)

    @property
    def loss(self) -> float:
        """MulT's L1 loss on the clip."""
        return abs(self.pred - self.label)

    @property
    def confidence(self) -> float:
        """How far from neutral the prediction is."""
        return abs(self.pred)

    @property
    def entropy(self) -> float:
        """The last layer's attention rows (mean of heads), their entropy over the uniform's (ln S), averaged
        over the rows and the directions: 1 = uniform everywhere."""
        shares = [float(np.mean(row_entropy(a[-1].mean(axis=0)) / math.log(a.shape[-1])))
                  for a in self.attention.values() if a.shape[-1] > 1]
        return float(np.mean(shares)) if shares else math.nan

    def identity(self) -> tuple[tuple[str, object], ...]:
        return (("id", self.id), ("label", round(self.label, 6)), ("steps", tuple(sorted(self.lengths.items()))))


class MultKind:
    name = "mult"
    what = "a MulT run"
    default_split = "test"

    def open(self, r: Resolved):
        from xmodal.data.mult.store import open_store

        store = open_recorded(r, run_tags.STORE, "store", open_store)
        if store.task != "sentiment":
            raise ExamplesError(f"{r.key}: run {r.run_id!r} read a {store.task!r} store ({store.path}); MulT's example "
                                "pages show sentiment stores")
        return store

    def check(self, r: Resolved, store, split: str, config: dict | None = None) -> None:
        evaluated = [s for s in store.splits if s != "train"]
        if split not in evaluated:
            raise ExamplesError(f"--split {split}: run {r.run_id!r} did not evaluate it; it evaluated "
                                f"{', '.join(evaluated)}")

    def collect(self, model, store, split: str, n: int, notes: list[str], ids: list[str] | None = None,
                config: dict | None = None) -> tuple[list[MultExample], int]:
        from xmodal.data.units import read_unit

        units = store.units(split)
        size = sum(u.rows for u in units)
        if ids is None:
            rows = choose_rows(size, n)
        else:
            every = [x for u in units for x in read_unit(u, ["id"]).column("id").to_pylist()]
            rows = rows_of(every, ids, f"{store.path} split {split}", "--compare")
        return collect_mult(model, store, split, rows), size

    def render(self, a: Shown, b: Shown | None = None) -> Rendered:
        return render_mult(a, b)


@torch.no_grad()
def collect_mult(model, store, split: str, rows: np.ndarray) -> list[MultExample]:
    """The model on the clips `rows` of `split`, with its crossmodal attention."""
    from xmodal.data.mult.store import table_to_split
    from xmodal.data.units import read_unit
    from xmodal.models.mult.model import recording_crossmodal_attention

    units = store.units(split)
    starts = np.cumsum([0] + [u.rows for u in units])
    model = model.float().eval()
    out: dict[int, MultExample] = {}
    for ui in sorted({int(np.searchsorted(starts, r, side="right") - 1) for r in rows.tolist()}):
        part = table_to_split(read_unit(units[ui]), split, store.dims, f"{store.path}/{split}")
        here = [r for r in rows.tolist() if starts[ui] <= r < starts[ui + 1]]
        b = part.batch(np.array([r - starts[ui] for r in here], np.int64))
        lengths = (b.text_lengths, b.audio_lengths, b.vision_lengths)
        with recording_crossmodal_attention(model) as found:
            pred = model(b.text.float(), b.audio.float(), b.vision.float(), lengths).output[:, 0]
        lens = {"l": b.text_lengths, "a": b.audio_lengths, "v": b.vision_lengths}
        layers = 1 + max(layer for layer, _ in found)
        for k, r in enumerate(here):
            att = {}
            for (src, tgt) in sorted({d for _, d in found}):
                t, s = int(lens[tgt][k]), int(lens[src][k])
                att[f"{src}->{tgt}"] = np.stack([found[(layer, (src, tgt))][k, :, :t, :s].cpu().numpy()
                                                 for layer in range(layers)]).astype(np.float32)
            out[r] = MultExample(r, str(part.ids[r - starts[ui]]), float(b.labels[k, 0]), float(pred[k]),
                                 {m: int(v[k]) for m, v in lens.items()}, att)
    return [out[r] for r in rows.tolist()]


# ----------------------------------------------------------------------------- the pages


COMPARED = ("only A right", "only B right", "both wrong", "both right")


def section(x: MultExample, y: MultExample | None) -> str:
    """Where a clip is listed: by its sign right or wrong, or, for two runs, by which of them is right."""
    if y is None:
        return "right" if x.right else "wrong"
    return {(True, False): COMPARED[0], (False, True): COMPARED[1], (False, False): COMPARED[2],
            (True, True): COMPARED[3]}[(x.right, y.right)]


def thumb(m: np.ndarray) -> Image.Image:
    """A map small enough for a card and MLflow's table: the longer side THUMB_SIDE pixels at most."""
    return heat_map(m, scale=max(1, THUMB_SIDE // max(m.shape)))


def bin_name(b: int) -> str:
    return f"{b:+d}" if b else "0"


def stem_of(i: int, e: MultExample, group: str) -> str:
    b = e.label_bin
    return f"{i + 1:04d}-{group.replace(' ', '-')}-label-{'pos' if b > 0 else 'neg' if b < 0 else ''}{abs(b)}"


def maps_block(e: MultExample, pics: dict[str, str], key: str) -> str:
    """Each direction's heat maps, one per layer, with the scale each is drawn on."""
    out = []
    for d, att in e.attention.items():
        src, tgt = d.split("->")
        t, s = att.shape[-2:]
        cells = []
        for layer in range(att.shape[0]):
            m = att[layer].mean(axis=0)
            pics[f"{key}:{d}:{layer}"] = data_uri(png_bytes(heat_map(m, scale=1)))
            h = float(np.mean(row_entropy(m))) / math.log(s) if s > 1 else math.nan
            k = max(1, SHOWN_SIDE // max(t, s))  # the browser enlarges the map, cells kept square
            cells.append(f"<figure><img data-pic='{esc(key)}:{d}:{layer}' width={(s + 2) * k} height={t * k} "
                         f"style='image-rendering:pixelated' alt='{d} layer {layer + 1}'><figcaption>"
                         f"layer {layer + 1}: largest weight {float(m.max()):.3f} (dark blue), rows' entropy "
                         f"{h:.2f} of uniform</figcaption></figure>")
        out.append(f"<h3>{NAMES[tgt]} attending to {NAMES[src]} ({src}&rarr;{tgt}): rows {NAMES[tgt]} steps "
                   f"(1..{t}), columns {NAMES[src]} steps (1..{s}); uniform 1/{s} = {1 / s:.4f}</h3>"
                   f"<div class='grid'>{''.join(cells)}</div>")
    return "".join(out)


def clip_line(e: MultExample) -> str:
    v = "<b class='right'>sign right</b>" if e.right else "<b class='wrong'>sign wrong</b>"
    return (f"predicted <b>{e.pred:+.3f}</b>, label <b>{e.label:+.3f}</b> (error {e.pred - e.label:+.3f}; {v}; label "
            f"bin {bin_name(e.label_bin)})")


def summary_mult(a: Shown, b: Shown | None) -> str:
    def mae(s: Shown) -> float:
        return float(np.mean([e.loss for e in s.examples]))

    head = (f"<h1>MulT examples of run {esc(a.run_name)}" + (f" (A) against run {esc(b.run_name)} (B)" if b else "")
            + f"</h1><p>{len(a.examples)} of the {a.split_size} clips of split <b>{esc(a.split)}</b> "
            f"({esc(a.data_path)})</p>{notes_html(a.notes)}")
    if b is None:
        bins: dict[int, list[MultExample]] = {}
        for e in a.examples:
            bins.setdefault(e.label_bin, []).append(e)
        rows = [[bin_name(k), len(v), sum(not e.right for e in v), f"{np.mean([e.loss for e in v]):.3f}",
                 sum(int(np.round(np.clip(e.pred, -3, 3))) == k for e in v)] for k, v in sorted(bins.items())]
        return (f"{head}<p><b>sign right {a.right} of {len(a.examples)}; mean absolute error {mae(a):.3f}</b></p>"
                "<h3>errors by label bin (the label rounded to -3..3)</h3>"
                + table(["label bin", "clips", "sign wrong", "mean abs error", "prediction in the bin"], rows,
                        {1, 2, 3, 4}))
    c = compare(a.examples, b.examples)
    rows = [[g.name, g.count, f"{g.a:.3f}", f"{g.b:.3f}", f"{g.difference:+.3f}"]
            for g in by_pair(a.examples, b.examples, lambda e: bin_name(e.label_bin))]
    return (f"{head}<p><b>sign right: A {a.right}, B {b.right}; mean absolute error: A {mae(a):.3f}, B {mae(b):.3f}"
            f"</b></p><div class='tables'><div>{two_by_two(c)}</div><div><h3>sign right by label bin</h3>"
            + table(["label bin", "clips", "A", "B", "B - A"], rows, {1, 2, 3, 4}) + "</div></div>")


def render_mult(a: Shown, b: Shown | None) -> Rendered:
    """A MulT run's pages (or two runs' on the same clips): a card per clip, its maps in the detail."""
    pics: dict[str, str] = {}
    order = list(COMPARED) if b is not None else ["wrong", "right"]
    a, b = in_sections(a, b, section, order)
    groups = [section(x, b.examples[i] if b is not None else None) for i, x in enumerate(a.examples)]
    stems = [stem_of(i, e, g) for i, (e, g) in enumerate(zip(a.examples, groups, strict=True))]
    files, images, items = {}, {}, []
    n = len(a.examples)
    for i, e in enumerate(a.examples):
        sides = [("A", a, e)] + ([("B", b, b.examples[i])] if b is not None else [])
        images[stems[i]] = in_rows([thumb(x.attention[d][-1].mean(axis=0)) for d, x in
                                    ((d, e) for d in e.attention)], 3)
        files[f"pictures/{stems[i]}.png"] = png_bytes(images[stems[i]])
        pics[stems[i]] = data_uri(files[f"pictures/{stems[i]}.png"])
        sorts: dict = {}
        for lab, _, x in sides:
            sfx = f" ({lab})" if b is not None else ""
            sorts.update({f"error{sfx}": x.loss, f"confidence{sfx}": x.confidence,
                          f"entropy{sfx}": None if math.isnan(x.entropy) else x.entropy})
        runs = "".join(f"<div class='run'>{f'<h3>run {lab}: {esc(r.run_name)}</h3>' if b is not None else ''}"
                       f"<p>{clip_line(x)}</p>{maps_block(x, pics, f'{lab}{i}')}</div>" for lab, r, x in sides)
        detail = (f"<h2>Clip {i + 1} of {n}: <code>{esc(e.id)}</code></h2><p>steps: text {e.lengths['l']}, audio "
                  f"{e.lengths['a']}, vision {e.lengths['v']}. Each map: the crossmodal attention averaged over heads, "
                  "one colour scale per map from 0 (white) to its largest weight (dark blue), not scaled per row; the "
                  "strip on its right: each row's entropy over the uniform's (black: uniform, white: one step).</p>"
                  f"<div class='runs'>{runs}</div>")
        card = (f"<img data-pic='{esc(stems[i])}' alt=''><div><code>{esc(e.id)}</code> label {e.label:+.2f}</div>"
                + "".join(f"<div>{lab + ' ' if b is not None else ''}predicted {x.pred:+.2f} "
                          f"{'<b class=right>sign right</b>' if x.right else '<b class=wrong>sign wrong</b>'}</div>"
                          for lab, _, x in sides))
        items.append(Item(id=e.id, card=card, detail=detail,
                          facets={"verdict": groups[i], "bin": bin_name(e.label_bin)}, sorts=sorts))
    labs = ("A", "B") if b is not None else ("A",)
    measures = [Measure(f"{m}{f' ({lab})' if b is not None else ''}", f"{what}{f' of {lab}' if b is not None else ''}",
                        first) for lab in labs for m, what, first in
                (("error", "absolute error", "highest"), ("confidence", "|prediction|", "highest"),
                 ("entropy", "attention entropy", "lowest"))]
    title = f"MulT examples of run {a.run_name}" + (f" against run {b.run_name}" if b is not None else "")
    v = Viewer(title=title, summary=summary_mult(a, b), items=items,
               facets=[Facet("verdict", "sign right or wrong" if b is None else "who is right"),
                       Facet("bin", "label bin")], measures=measures, group="verdict",
               groups=order,
               pictures=pics, documents=comparison_doc(a, b))
    line = (f"{n} {a.split} clips of run {a.run_name} ({a.right} with the sign right)" if b is None else
            f"{n} {a.split} clips: run A {a.run_name} {a.right} with the sign right, run B {b.run_name} {b.right}")
    tab = None if b is not None else {
        "clip_id": [e.id for e in a.examples], "attention": [images[s] for s in stems],
        "label": [e.label for e in a.examples],
        "prediction": [e.pred for e in a.examples], "error": [e.pred - e.label for e in a.examples],
        "sign_right": [bool(e.right) for e in a.examples], "label_bin": [e.label_bin for e in a.examples],
        "file": [f"pictures/{s}.png" for s in stems]}
    return Rendered(page(v), files, tab, line)
