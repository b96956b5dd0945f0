"""The extractor's comparison: two runs' regions image by image, where they first part, and proven ties.

Each run is a folder of one `.npz` per image (`extractor.py reference` or `ours`) or an extraction's TSV
(`jobs/extract.py ... --format tsv`). An image is
- "identical": its 36 regions equal slot by slot, boxes bit for bit (features within float32 rounding:
  Caffe's and our res5 sum in other orders);
- "tie": the runs part only where scores are exactly equal and the reference's order among them is
  numpy's unstable `argsort()[::-1]`: the proposal layer's sort of the RPN scores (the two orders sort
  the same scores, and our NMS in the reference's order gives the reference's proposals) or the
  selection's sort of `max_conf` (the regions that differ all have one max_conf, printed);
- "DIFFERS": anything else, with the first stage that differs (the input blob, the backbone's output, the
  RPN's outputs, the proposals' order before NMS, the proposals, max_conf, the selection).
"""

from __future__ import annotations

import base64
import csv
import sys
from pathlib import Path

import numpy as np

from xmodal.base.errors import UserError

FIELDS = ["img_id", "img_h", "img_w", "objects_id", "objects_conf", "attrs_id", "attrs_conf", "num_boxes", "boxes",
          "features"]
STAGES = ("blob", "backbone", "rpn_cls_prob_reshape", "rpn_bbox_pred", "candidates", "rois", "max_conf")


def _b64(value, dtype, shape):
    raw = value if isinstance(value, bytes) else value.encode()
    return np.frombuffer(base64.b64decode(raw), dtype=dtype).reshape(shape)


def decode_row(row: dict) -> dict:
    """A TSV row's arrays (the boxes as written: float32 under numpy 1.x, float64 under numpy 2)."""
    n = int(row["num_boxes"])
    boxes = base64.b64decode(row["boxes"])
    box_dtype = np.float32 if len(boxes) == n * 16 else np.float64
    return {"boxes": np.frombuffer(boxes, box_dtype).reshape(n, 4), "features": _b64(row["features"], np.float32, (n, -1)),
            "obj": _b64(row["objects_id"], np.int64, (n,)), "attr": _b64(row["attrs_id"], np.int64, (n,)),
            "obj_conf": _b64(row["objects_conf"], np.float32, (n,)), "attr_conf": _b64(row["attrs_conf"], np.float32, (n,))}


def read_tsv(path: Path, option: str) -> dict[str, dict]:
    csv.field_size_limit(sys.maxsize)
    out = {}
    try:
        with open(path, newline="") as f:
            for lineno, r in enumerate(csv.DictReader(f, delimiter="\t", fieldnames=FIELDS), 1):
                try:
                    out[r["img_id"]] = decode_row(r)
                except (TypeError, ValueError) as e:
                    raise UserError(f"{option} {str(path)!r}: line {lineno} is not a row of the reference's TSV "
                                    f"({FIELDS[0]} .. {FIELDS[-1]}, base64 arrays): {e}") from None
    except UnicodeDecodeError:
        raise UserError(f"{option} {str(path)!r}: is not text; expected an extraction's TSV (--format tsv)") from None
    if not out:
        raise UserError(f"{option} {str(path)!r}: holds no row; expected an extraction's TSV (--format tsv)")
    return out


def _maxdiff(a, b) -> float | None:
    if a is None or b is None or a.shape != b.shape:
        return None
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max()) if a.size else 0.0


def _same(a, b) -> bool | None:
    if a is None or b is None:
        return None
    return a.shape == b.shape and bool(np.array_equal(a, b))


def proposal_tie(ref: dict, ours: dict) -> dict | None:
    """Where the two runs' candidates of the RPN's NMS (boxes and scores, in the order NMS visits them) part;
    whether they differ only in the order of equal scores (the same score at every position; the same boxes
    for each score, except the score cut at the pre-NMS top-N, whose members the sort chose among equals);
    and whether our NMS visiting the reference's candidates in its order gives the reference's proposals."""
    a, b = ref.get("candidates"), ours.get("candidates")
    if a is None or b is None or a.shape != b.shape or np.array_equal(a, b):
        return None
    at = int(np.flatnonzero((a != b).any(axis=1))[0])

    def canonical(c):  # by score, then by box
        return c[np.lexsort((c[:, 3], c[:, 2], c[:, 1], c[:, 0], c[:, 4]))]

    cut = a[-1, 4]
    reordered = bool(np.array_equal(a[:, 4], b[:, 4])
                     and np.array_equal(canonical(a[a[:, 4] != cut]), canonical(b[b[:, 4] != cut])))
    return {"position": at, "score": float(a[at, 4]), "our_score": float(b[at, 4]),
            "candidates_with_that_score": int((a[:, 4] == a[at, 4]).sum()),
            "same_scores_ties_reordered": reordered,
            "our_nms_in_ref_order_gives_ref_rois": rerun_nms(a, ref["rois"]) if reordered else False}


def rerun_nms(candidates: np.ndarray, rois: np.ndarray) -> bool:
    """Our NMS (`boxes.greedy_nms`) visiting the candidates in their order: are its proposals `rois`?"""
    import torch

    from xmodal.models.butd.boxes import greedy_nms
    from xmodal.models.butd.config import RPNConfig

    cfg = RPNConfig()
    boxes = torch.from_numpy(np.ascontiguousarray(candidates[:, :4]))[None]
    keep, ok = greedy_nms(boxes, torch.ones(boxes.shape[:2], dtype=torch.bool), cfg.nms_thresh, cfg.post_nms_top_n)
    return bool(np.array_equal(boxes[0][keep[0][ok[0]]].numpy(), rois))


def selection_tie(ref: dict, ours: dict) -> dict | None:
    """The regions in one run's selection and not the other's, and whether they all share one max_conf."""
    if ref.get("max_conf") is None or ref.get("rois") is None:
        return None
    index = {tuple(r): i for i, r in enumerate(ref["rois"].tolist())}
    scale = float(ref["scale"])

    def slots(boxes):  # the proposal slot each selected box came from (its rois / scale is the box)
        rois = {tuple((np.asarray(r, np.float32) / np.float32(scale)).tolist()): i for r, i in index.items()}
        return {rois.get(tuple(b), -1) for b in boxes.astype(np.float32).tolist()}

    a, b = slots(ref["boxes"]), slots(ours["boxes"])
    only = sorted((a ^ b) - {-1})
    if not only or -1 in a ^ b:
        return None
    values = sorted({float(ref["max_conf"][i]) for i in only})
    return {"regions_in_one_run_only": len(only), "their_max_conf": values, "one_value": len(values) == 1}


def compare_one(ref: dict, ours: dict) -> dict:
    k = len(ref["boxes"])
    n = min(k, len(ours["boxes"]))
    same = [i for i in range(n) if np.array_equal(ref["boxes"][i], ours["boxes"][i])]
    ref_set = {tuple(b) for b in ref["boxes"].astype(np.float32).tolist()}
    row = {
        "num_boxes": [k, len(ours["boxes"])],
        "identical": len(same),
        "in_both": sum(tuple(b) in ref_set for b in ours["boxes"].astype(np.float32).tolist()),
        "max_box_diff": _maxdiff(ref["boxes"], ours["boxes"]),
        "max_feature_diff": _maxdiff(ref["features"][same], ours["features"][same]) if same else None,
        "obj_agree": int((ref["obj"][same] == ours["obj"][same]).sum()),
        "attr_agree": int((ref["attr"][same] == ours["attr"][same]).sum()),
        "max_conf_diff": _maxdiff(ref["obj_conf"][same], ours["obj_conf"][same]) if same else None,
    }
    all_same = len(same) == k == len(ours["boxes"]) and row["obj_agree"] == row["attr_agree"] == k
    stages = {s: _same(ref.get(s), ours.get(s)) for s in STAGES}
    row["stages_equal"] = {s: v for s, v in stages.items() if v is not None}
    first = next((s for s in STAGES if stages[s] is False), None)
    if all_same:
        row["verdict"] = "identical"
        return row
    tie = proposal_tie(ref, ours) if first == "candidates" else selection_tie(ref, ours) if first in (None, "max_conf") else None
    row["first_difference"] = first or "selection"
    row["tie"] = tie
    proven = tie is not None and (tie.get("our_nms_in_ref_order_gives_ref_rois") or tie.get("one_value"))
    row["verdict"] = "tie" if proven else "DIFFERS"
    return row


def load_run(folder: Path) -> dict[str, dict]:
    return {p.stem: dict(np.load(p)) for p in sorted(folder.glob("*.npz"))}
