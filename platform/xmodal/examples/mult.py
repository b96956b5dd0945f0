"""MulT's example pages (sentiment stores): per clip the prediction against the label, and each crossmodal
transformer's attention over time (target steps over source steps, per layer, averaged over heads, as heat
maps); the index counts the errors by label bin (the label rounded to -3..3, the 7-class bins).

The clips are read by their row groups only (`store.units`); the attention is recorded by a flag on the
model only while they are predicted (`models.mult.recording_crossmodal_attention`).
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass

import numpy as np
import torch
from PIL import Image

from xmodal.examples.collect import ExamplesError, choose_rows
from xmodal.examples.pages import document, esc, page_name

NAMES = {"l": "text", "a": "audio", "v": "vision"}
MAP_SIDE = 360  # a heat map's longer side, in pixels


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


@torch.no_grad()
def collect_mult(model, store, split: str, n: int, rows: np.ndarray | None = None) -> tuple[list[MultExample], int]:
    """The model on `n` clips of `split` (or the clips `rows`), with its crossmodal attention."""
    from xmodal.data.common import read_unit
    from xmodal.data.mult.store import table_to_split
    from xmodal.models.mult import recording_crossmodal_attention

    if store.task != "sentiment":
        raise ExamplesError(f"{store.path}: a {store.task!r} store; MulT's example pages show sentiment stores")
    units = store.units(split)
    starts = np.cumsum([0] + [u.rows for u in units])
    size = int(starts[-1])
    chosen = choose_rows(size, n) if rows is None else rows
    model = model.float().eval()
    out: dict[int, MultExample] = {}
    for ui in sorted({int(np.searchsorted(starts, r, side="right") - 1) for r in chosen.tolist()}):
        part = table_to_split(read_unit(units[ui]), split, store.dims, f"{store.path}/{split}")
        here = [r for r in chosen.tolist() if starts[ui] <= r < starts[ui + 1]]
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
    return [out[r] for r in chosen.tolist()], size


def heat_map(m: np.ndarray) -> str:
    """A (T, S) weight matrix as a PNG data: URI: each row scaled by its largest weight, white to dark blue."""
    row_max = m.max(axis=1, keepdims=True)
    x = m / np.where(row_max > 0, row_max, 1)
    rgb = np.stack([255 * (1 - 0.9 * x), 255 * (1 - 0.75 * x), 255 - 90 * x], axis=-1).astype(np.uint8)
    t, s = m.shape
    scale = max(1, MAP_SIDE // max(t, s))
    img = Image.fromarray(rgb).resize((s * scale, t * scale), Image.NEAREST)
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=1)
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def example_page(i: int, n: int, e: MultExample) -> str:
    nav = " · ".join(x for x in (f"<a href='{page_name(i - 1)}'>previous</a>" if i > 0 else "",
                                 "<a href='index.html'>index</a>",
                                 f"<a href='{page_name(i + 1)}'>next</a>" if i + 1 < n else "") if x)
    verdict = "<b class='right'>sign right</b>" if e.right else "<b class='wrong'>sign wrong</b>"
    maps = []
    for d, att in e.attention.items():
        src, tgt = d.split("->")
        cells = "".join(f"<figure><img src='{heat_map(att[layer].mean(axis=0))}' alt='{d} layer {layer + 1}'>"
                        f"<figcaption>layer {layer + 1}</figcaption></figure>" for layer in range(att.shape[0]))
        maps.append(f"<h3>{NAMES[tgt]} attending to {NAMES[src]} ({src}&rarr;{tgt}): rows {NAMES[tgt]} steps "
                    f"(1..{e.lengths[tgt]}), columns {NAMES[src]} steps (1..{e.lengths[src]})</h3>"
                    f"<div class='grid'>{cells}</div>")
    body = (f"<p>{nav}</p><h2>Clip {i + 1} of {n}: {esc(e.id)}</h2>"
            f"<p style='font-size:1.2em'>predicted <b>{e.pred:+.3f}</b>, label <b>{e.label:+.3f}</b> "
            f"(error {e.pred - e.label:+.3f}; {verdict}; label bin {e.label_bin:+d})</p>"
            f"<p>steps: text {e.lengths['l']}, audio {e.lengths['a']}, vision {e.lengths['v']}. Each map: the "
            "crossmodal attention averaged over heads, each row scaled by its largest weight (darker = more).</p>"
            + "".join(maps))
    return document(f"{e.id}: {e.pred:+.2f} vs {e.label:+.2f}", body)


def index_page(run_name: str, run_id: str, split: str, size: int, ex: list[MultExample]) -> str:
    bins: dict[int, list[MultExample]] = {}
    for e in ex:
        bins.setdefault(e.label_bin, []).append(e)
    rows = "".join(
        f"<tr><td>{b:+d}</td><td>{len(v)}</td><td>{sum(not e.right for e in v)}</td>"
        f"<td>{np.mean([abs(e.pred - e.label) for e in v]):.3f}</td>"
        f"<td>{sum(int(np.round(np.clip(e.pred, -3, 3))) == b for e in v)}</td></tr>"
        for b, v in sorted(bins.items()))
    order = sorted(range(len(ex)), key=lambda i: -abs(ex[i].pred - ex[i].label))
    items = "".join(f"<tr><td><a href='{page_name(i)}'>{esc(ex[i].id)}</a></td><td>{ex[i].label:+.3f}</td>"
                    f"<td>{ex[i].pred:+.3f}</td><td>{abs(ex[i].pred - ex[i].label):.3f}</td>"
                    f"<td>{'right' if ex[i].right else '<b class=wrong>wrong</b>'}</td></tr>" for i in order)
    mae = np.mean([abs(e.pred - e.label) for e in ex])
    body = (f"<h1>MulT examples of run {esc(run_name)}</h1><p>run {esc(run_id)}</p>"
            f"<p>{len(ex)} of the {size} clips of split <b>{esc(split)}</b>: mean absolute error {mae:.3f}, "
            f"sign right {sum(e.right for e in ex)}</p>"
            "<h3>errors by label bin (the label rounded to -3..3)</h3><table><tr><th>label bin</th><th>clips</th>"
            f"<th>sign wrong</th><th>mean abs error</th><th>prediction in the bin</th></tr>{rows}</table>"
            "<h3>clips, largest error first</h3><table><tr><th>clip</th><th>label</th><th>prediction</th>"
            f"<th>abs error</th><th>sign</th></tr>{items}</table>")
    return document(f"MulT examples of run {run_name}", body)


def write_mult_pages(run_name: str, run_id: str, split: str, size: int, ex: list[MultExample], folder) -> int:
    for i, e in enumerate(ex):
        (folder / page_name(i)).write_text(example_page(i, len(ex), e), encoding="utf-8")
    (folder / "index.html").write_text(index_page(run_name, run_id, split, size, ex), encoding="utf-8")
    return len(ex) + 1
