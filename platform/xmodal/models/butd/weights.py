"""Importing the public bottom-up-attention weight files into our canonical state dict, strictly and safely.

Our canonical layout is `Detector(cfg).state_dict()` of `xmodal.models.butd.detector`: the Caffe
model's conventions (class 0 = background, attribute 0 = "no attribute", two RPN logits per anchor
with the 12 background logits before the 12 foreground ones, anchors in `generate_anchors` order
(ratio-major), box deltas unnormalised). Four layouts are read (see `LAYOUTS`):

- "detectron2": airsplay/py-bottom-up-attention's pickles (`faster_rcnn_from_caffe_attr.pkl`, 36
  boxes; `faster_rcnn_from_caffe_attr_original.pkl`, 10 to 100). Its converter is not public (its
  README: "The Caffe2PyTorch conversion code (not released here)"), so the content follows from the
  code that loads and runs them: `DetectionCheckpointer._load_file` in
  `detectron2/checkpoint/detection_checkpoint.py` (a `.pkl` holding `{"model": {name: ndarray},
  "__author__": ...}` is taken as is), the module names of `detectron2/modeling/backbone/resnet.py`,
  `proposal_generator/rpn.py`, `roi_heads/roi_heads.py` (`Res5ROIHeads`) and
  `roi_heads/fast_rcnn.py` (`FastRCNNOutputLayers` with `use_attr`), and
  `configs/VG-Detection/faster_rcnn_R_101_C4_attr_caffemaxpool.yaml`. Conventions there:
  `cls_score` has the background LAST (`predict_probs` + `[:, :-1]` in
  `demo/demo_feature_extraction_attr.ipynb`), `cls_embedding` rows follow `cls_score` (it is
  indexed by the argmax over all of `cls_score`), `attr_score` has "no attribute" LAST (the demo's
  `pred_attr_logits[..., :-1]`), `bbox_pred` holds the 1,600 foreground classes only (`num_classes *
  box_dim` rows) for `Box2BoxTransform` weights (10, 10, 5, 5) (`ROI_BOX_HEAD.BBOX_REG_WEIGHTS` in
  `detectron2/config/defaults.py`), the RPN has ONE sigmoid logit per anchor
  (`StandardRPNHead.objectness_logits`, A channels), and the anchors are in
  `DefaultAnchorGenerator.generate_cell_anchors` order (`detectron2/modeling/anchor_generator.py`:
  size-major, `for size in sizes: for aspect_ratio in aspect_ratios`, sizes 64..512 = Caffe's
  scales 4..32 x 16). FrozenBatchNorm2d keeps weight, bias, running_mean, running_var
  (`detectron2/layers/batch_norm.py`, eps 1e-5).
- "milvlg": MILVLG/bottom-up-attention.pytorch's `bua-caffe-frcn-r101-k36.pth` and `-k10-100.pth`,
  read with `torch.load(weights_only=True)`. Caffe's conventions kept (`configs/caffe/test-caffe-r101.yaml`:
  `NUM_CLASSES: 1601`, `ATTRIBUTE.NUM_CLASSES: 401`, `BBOX_REG_WEIGHTS: (1, 1, 1, 1)`):
  `bua/caffe/modeling/fast_rcnn.py` (`BUACaffeFastRCNNOutputLayers`: `cls_score` 1601 with the
  background first, `bbox_pred` 4 x 1601, `cls_embed`, `attr_linear1`, `attr_linear2`),
  `bua/caffe/modeling/rpn.py` (`StandardBUARPNHead.objectness_logits` with 2A channels) and
  `rpn_outputs.py` (`predict_objectness_logits` views them as (N, 2, A, H, W) and softmaxes over the
  2: Caffe's layout). Its `.pth` holds no anchor buffer; the anchor channels are taken in Caffe's
  order (the blobs copied as they are), unless the file holds `cell_anchors`, which then decides.
- "hf-frcnn": transformers' `examples/research_projects/lxmert/modeling_frcnn.py`
  (`unc-nlp/frcnn-vg-finetuned`, `pytorch_model.bin`, loaded there with a strict
  `load_state_dict`): detectron2's names and conventions as above (`do_nms` drops `scores[:, :-1]`'s
  last column, `_predict_attrs` the last attribute; `FastRCNNOutputLayers` with `num_classes * 4`
  box rows; `RPNHead` with A logits), torch `BatchNorm2d` norms (with `num_batches_tracked`), and
  the anchors it used as a parameter, `proposal_generator.anchor_generator.cell_anchors.0`
  (`AnchorGenerator.generate_cell_anchors`, size-major).
- "xmodal": our own canonical state dict saved with `torch.save`.

Mappings that are exact only mathematically: one sigmoid logit l per anchor becomes the pair
(background 0, foreground l), as softmax([0, l]) = sigmoid(l); writing the pair back as one logit
takes foreground - background. Box deltas for weights (10, 10, 5, 5) are ours times the weights.
The background's box deltas, which detectron2's layout does not hold, are read as zeros (no
selection uses them).
"""

from __future__ import annotations

import io
import math
import pickle
import re
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from xmodal.models.butd.config import RPNConfig


class WeightsError(ValueError):
    """A weight file that cannot be read into our layout; the message is one line naming the file."""


LAYOUTS: dict[str, str] = {
    "detectron2": "airsplay/py-bottom-up-attention pickle {'model': {name: ndarray}}: background and "
    "'no attribute' last, 1,600 box classes with weights (10, 10, 5, 5), one sigmoid logit per anchor, "
    "anchors size-major",
    "milvlg": "MILVLG/bottom-up-attention.pytorch .pth: Caffe's orders (background first, two RPN logits "
    "per anchor), cls_embed / attr_linear1 / attr_linear2",
    "hf-frcnn": "transformers' lxmert research project pytorch_model.bin (unc-nlp/frcnn-vg-finetuned): "
    "detectron2's conventions, BatchNorm2d norms, the anchors as cell_anchors.0",
    "xmodal": "our canonical Detector state dict saved with torch.save",
}

ANCHOR_RATIOS, ANCHOR_SCALES = RPNConfig().anchor_ratios, RPNConfig().anchor_scales  # the files hold the reference's
NUM_ANCHORS = len(ANCHOR_RATIOS) * len(ANCHOR_SCALES)
D2_BOX_WEIGHTS = (10.0, 10.0, 5.0, 5.0)  # ROI_BOX_HEAD.BBOX_REG_WEIGHTS, detectron2/config/defaults.py
BN_PARAMS = ("weight", "bias", "running_mean", "running_var")
CELL_ANCHORS = "proposal_generator.anchor_generator.cell_anchors.0"
_TORCH_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C  # the first pickle of torch.save's pre-zip format

# The only globals a detectron2 pickle may name: numpy's array and dtype reconstruction (both numpy 1
# and numpy 2 module paths), plain containers and `_codecs.encode` (how protocol 2 writes bytes, such
# as an array's raw data, from Python 3). Everything else, os.system or builtins.eval
# included, is refused before it is called.
_SAFE_GLOBALS = frozenset(
    {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "scalar"),
        ("numpy._core.multiarray", "scalar"),
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy._core.numeric", "_frombuffer"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("collections", "OrderedDict"),
        ("_codecs", "encode"),
    }
)


def _fail(path: str | Path, message: str) -> WeightsError:
    return WeightsError(f"{path}: {message}")


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, file: io.BufferedIOBase, path: str | Path):
        super().__init__(file, encoding="latin1")  # detectron2's model zoo pickles are Python 2 ones
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _SAFE_GLOBALS:
            return super().find_class(module, name)
        raise _fail(self._path, f"refused: the pickle loads the global {module}.{name} (only numpy arrays allowed)")

    def persistent_load(self, pid: Any) -> Any:
        raise _fail(self._path, "refused: the pickle holds a persistent id (a torch.save file read as a pickle?)")


def _read_pickle(path: Path) -> Any:
    with open(path, "rb") as f:
        try:
            return _RestrictedUnpickler(f, path).load()
        except WeightsError:
            raise
        except Exception as e:  # any malformed stream: one line naming the file
            raise _fail(path, f"not a readable pickle ({type(e).__name__}: {e})") from None


def _read_torch(path: Path) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise _fail(path, f"refused by torch.load(weights_only=True): {first}") from None


def _read_file(path: Path) -> tuple[str, dict[str, Tensor]]:
    """('pickle' | 'torch', flat {name: float tensor or integer counter}) of a weight file."""
    if not path.is_file():
        raise _fail(path, "no such file")
    if path.stat().st_size == 0:
        raise _fail(path, "empty file (0 bytes): an interrupted download?")
    if zipfile.is_zipfile(path):
        kind, data = "torch", _read_torch(path)
    else:
        data = _read_pickle(path)
        if isinstance(data, int) and data == _TORCH_LEGACY_MAGIC:
            kind, data = "torch", _read_torch(path)
        else:
            kind = "pickle"
    if isinstance(data, Mapping) and "model" in data and isinstance(data["model"], Mapping):
        extra = sorted(set(data) - {"model", "__author__", "matching_heuristics"})
        if extra:
            raise _fail(path, f"unused top-level key {extra[0]!r} (expected 'model', '__author__')")
        data = data["model"]
    if not isinstance(data, Mapping):
        raise _fail(path, f"holds a {type(data).__name__}, not a mapping of names to arrays")
    tensors = {}
    for name, value in data.items():
        if isinstance(value, np.ndarray):
            if value.dtype.kind not in "fiub":
                raise _fail(path, f"key {name!r} holds a numpy array of dtype {value.dtype}")
            value = torch.from_numpy(np.ascontiguousarray(value))
        if not isinstance(value, Tensor):
            raise _fail(path, f"key {name!r} holds a {type(value).__name__}, not an array")
        tensors[str(name)] = value
    return kind, tensors


def detect_layout(path: str | Path) -> str:
    """The layout of a weight file, from its content (container and key names), not its name."""
    path = Path(path)
    kind, tensors = _read_file(path)
    return _layout_of(path, kind, tensors)


def _layout_of(path: Path, kind: str, tensors: Mapping[str, Tensor]) -> str:
    if "backbone.stem.conv.weight" in tensors:
        return "xmodal"
    if "roi_heads.box_predictor.attr_linear1.weight" in tensors:
        return "milvlg"
    if "roi_heads.box_predictor.cls_embedding.weight" in tensors:
        return "detectron2" if kind == "pickle" else "hf-frcnn"
    sample = ", ".join(sorted(tensors)[:3]) or "no keys"
    raise _fail(path, f"unknown layout ({kind} file, {len(tensors)} keys: {sample}, ...); expected one of {sorted(LAYOUTS)}")


# --- names -------------------------------------------------------------------------------------

_BLOCK = re.compile(r"(backbone\.res[234]|head\.res5)\.(\d+)\.(conv[123]\.weight|shortcut\.weight|bn[123]\.\w+|shortcut_bn\.\w+)$")


def _their_name(ours: str, layout: str) -> str:
    """The name our tensor has in a detectron2-family file (for the tensors that are only renamed)."""
    if ours == "backbone.stem.conv.weight":
        return "backbone.stem.conv1.weight"
    if ours.startswith("backbone.stem.bn."):
        return "backbone.stem.conv1.norm." + ours.rsplit(".", 1)[1]
    m = _BLOCK.match(ours)
    if m:
        stage, index, leaf = m.groups()
        stage = "roi_heads.res5" if stage == "head.res5" else stage
        leaf = re.sub(r"^bn([123])\.", r"conv\1.norm.", leaf)
        leaf = leaf.replace("shortcut_bn.", "shortcut.norm.")
        return f"{stage}.{index}.{leaf}"
    rpn = "proposal_generator.rpn_head."
    box = "roi_heads.box_predictor."
    milvlg = layout == "milvlg"
    table = {
        "rpn.conv": rpn + "conv",
        "rpn.objectness": rpn + "objectness_logits",
        "rpn.deltas": rpn + "anchor_deltas",
        "head.cls_score": box + "cls_score",
        "head.bbox_pred": box + "bbox_pred",
        "head.cls_embedding": box + ("cls_embed" if milvlg else "cls_embedding"),
        "head.fc_attr": box + ("attr_linear1" if milvlg else "fc_attr"),
        "head.attr_score": box + ("attr_linear2" if milvlg else "attr_score"),
    }
    module, leaf = ours.rsplit(".", 1)
    return f"{table[module]}.{leaf}"


def canonical_names(stage_blocks: Mapping[str, int]) -> list[str]:
    """Our state dict's names for the given block counts {'backbone.res2': 3, ..., 'head.res5': 3}.

    In `Detector.state_dict()`'s order: backbone, rpn, head."""

    def stage(name: str) -> list[str]:
        out = []
        for i in range(stage_blocks[name]):
            for k in (1, 2, 3):
                out.append(f"{name}.{i}.conv{k}.weight")
                out += [f"{name}.{i}.bn{k}.{p}" for p in BN_PARAMS]
            if i == 0:
                out.append(f"{name}.{i}.shortcut.weight")
                out += [f"{name}.{i}.shortcut_bn.{p}" for p in BN_PARAMS]
        return out

    names = ["backbone.stem.conv.weight"] + [f"backbone.stem.bn.{p}" for p in BN_PARAMS]
    names += stage("backbone.res2") + stage("backbone.res3") + stage("backbone.res4")
    for module in ("rpn.conv", "rpn.objectness", "rpn.deltas"):
        names += [f"{module}.weight", f"{module}.bias"]
    names += stage("head.res5")
    for module in ("head.cls_score", "head.bbox_pred"):
        names += [f"{module}.weight", f"{module}.bias"]
    names += ["head.cls_embedding.weight", "head.fc_attr.weight", "head.fc_attr.bias"]
    names += ["head.attr_score.weight", "head.attr_score.bias"]
    return names


def _stage_blocks(path: Path, names: set[str], layout: str) -> dict[str, int]:
    """How many blocks each stage has, from the highest block index the file names."""
    prefixes = {"backbone.res2": "backbone.res2", "backbone.res3": "backbone.res3", "backbone.res4": "backbone.res4"}
    prefixes["head.res5"] = "head.res5" if layout == "xmodal" else "roi_heads.res5"
    counts = {}
    for ours, theirs in prefixes.items():
        pattern = re.compile(re.escape(theirs) + r"\.(\d+)\.")
        found = [int(m.group(1)) for n in names if (m := pattern.match(n))]
        if not found:
            raise _fail(path, f"no block of {theirs} (expected keys like {theirs}.0.conv1.weight)")
        counts[ours] = max(found) + 1
    return counts


# --- the conventions that differ ---------------------------------------------------------------


def _reference_anchor_order(path: Path, cell_anchors: Tensor) -> Tensor:
    """order[j] = the index in `generate_anchors` order (ratio-major) of the file's anchor j.

    Each (x1, y1, x2, y2) row is named by its aspect ratio h / w (nearest of 0.5, 1, 2, within 10 %)
    and by the rank of its size sqrt(w h) among the file's sizes (smallest = scale 4); the absolute
    sizes and the centre do not matter, so detectron2's anchors (64..512, centred at 0) map as well.
    """
    if tuple(cell_anchors.shape) != (NUM_ANCHORS, 4):
        raise _fail(path, f"{CELL_ANCHORS} has shape {tuple(cell_anchors.shape)}, expected ({NUM_ANCHORS}, 4)")
    a = cell_anchors.to(torch.float64)
    w, h = a[:, 2] - a[:, 0], a[:, 3] - a[:, 1]
    ratio_index = []
    for r in (h / w).tolist():
        near = [i for i, want in enumerate(ANCHOR_RATIOS) if abs(math.log(r / want)) < 0.1] if r > 0 else []
        if len(near) != 1:
            raise _fail(path, f"{CELL_ANCHORS} holds an anchor of aspect ratio {r:.3f}, none of {ANCHOR_RATIOS}")
        ratio_index.append(near[0])
    sizes = torch.sqrt(w * h)
    ratios = torch.tensor(ratio_index)
    order = torch.empty(NUM_ANCHORS, dtype=torch.int64)
    for r in range(len(ANCHOR_RATIOS)):
        rows = (ratios == r).nonzero().flatten()
        if len(rows) != len(ANCHOR_SCALES):
            raise _fail(path, f"{CELL_ANCHORS} holds {len(rows)} anchors of ratio {ANCHOR_RATIOS[r]}, expected {len(ANCHOR_SCALES)}")
        ranks = torch.argsort(torch.argsort(sizes[rows]))
        order[rows] = r * len(ANCHOR_SCALES) + ranks
    return order


def detectron2_cell_anchors(sizes: tuple[float, ...] = (64, 128, 256, 512)) -> Tensor:
    """detectron2's `DefaultAnchorGenerator.generate_cell_anchors` for our ratios: (12, 4), size-major."""
    rows = []
    for size in sizes:
        for ratio in ANCHOR_RATIOS:
            w = math.sqrt(size * size / ratio)
            h = ratio * w
            rows.append([-w / 2, -h / 2, w / 2, h / 2])
    return torch.tensor(rows, dtype=torch.float32)


def _per_anchor(t: Tensor, per: int) -> Tensor:
    return t.reshape(NUM_ANCHORS, per, *t.shape[1:])


def _from_file_order(t: Tensor, order: Tensor, per: int) -> Tensor:
    """Rows grouped `per` per anchor, file order -> reference order."""
    grouped = _per_anchor(t, per)
    out = torch.empty_like(grouped)
    out[order] = grouped
    return out.reshape(t.shape)


def _to_file_order(t: Tensor, order: Tensor, per: int) -> Tensor:
    return _per_anchor(t, per)[order].reshape(t.shape)


def _box_weights(t: Tensor) -> Tensor:
    """(10, 10, 5, 5) repeated over a (4 K, ...) tensor's class blocks, shaped to broadcast."""
    w = torch.tensor(D2_BOX_WEIGHTS, dtype=torch.float64).repeat(t.shape[0] // 4)
    return w.reshape(-1, *([1] * (t.dim() - 1)))


def _bg_first(t: Tensor) -> Tensor:
    return torch.cat((t[-1:], t[:-1]))


def _bg_last(t: Tensor) -> Tensor:
    return torch.cat((t[1:], t[:1]))


# --- loading -------------------------------------------------------------------------------------


def _check_layout_name(layout: str) -> None:
    if layout != "auto" and layout not in LAYOUTS:
        raise WeightsError(f"unknown layout {layout!r}; valid: 'auto', {', '.join(repr(k) for k in LAYOUTS)}")


def load_state_dict(
    path: str | Path, layout: str = "auto", expected: Mapping[str, Tensor | torch.Size] | None = None
) -> dict[str, Tensor]:
    """A weight file as our canonical state dict (float32 tensors, our names and orders).

    Every key of the file must be used (or be one of the layout's counters and anchor buffers, which
    are checked), every key we need must be there, and with `expected` (our names -> tensors or
    shapes, e.g. `Detector(cfg).state_dict()`) every shape must match. Errors are `WeightsError`.
    """
    _check_layout_name(layout)
    path = Path(path)
    kind, tensors = _read_file(path)
    found = _layout_of(path, kind, tensors)
    if layout != "auto" and layout != found:
        raise _fail(path, f"holds the {found!r} layout, not {layout!r}")
    if found == "xmodal":
        out = _load_xmodal(path, tensors)
    else:
        out = _load_public(path, found, tensors)
    if expected is not None:
        _check_expected(path, out, expected)
    return out


def _load_xmodal(path: Path, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    names = canonical_names(_stage_blocks(path, set(tensors), "xmodal"))
    missing = [n for n in names if n not in tensors]
    if missing:
        raise _fail(path, f"missing key {missing[0]!r}")
    unused = sorted(set(tensors) - set(names))
    if unused:
        raise _fail(path, f"unused key {unused[0]!r}")
    return {n: _as_float(path, n, tensors[n]) for n in names}


def _as_float(path: Path, name: str, t: Tensor) -> Tensor:
    if not t.is_floating_point():
        raise _fail(path, f"key {name!r} holds {t.dtype}, expected floating point")
    return t.detach().to(torch.float32).contiguous()


def _load_public(path: Path, layout: str, tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    names = canonical_names(_stage_blocks(path, set(tensors), layout))
    used: set[str] = set()
    src: dict[str, Tensor] = {}
    for ours in names:
        theirs = _their_name(ours, layout)
        if theirs not in tensors:
            raise _fail(path, f"missing key {theirs!r} (for our {ours!r})")
        src[ours] = _as_float(path, theirs, tensors[theirs])
        used.add(theirs)
    order = _anchor_order(path, layout, tensors)
    if CELL_ANCHORS in tensors:
        used.add(CELL_ANCHORS)
    for name, t in tensors.items():
        if name.endswith(".num_batches_tracked") and layout != "detectron2":
            if name.rsplit(".", 1)[0] + ".running_mean" not in used or t.numel() != 1 or t.is_floating_point():
                raise _fail(path, f"unused key {name!r}")
            used.add(name)  # BatchNorm2d's training counter: no weight, nothing to map
    unused = sorted(set(tensors) - used)
    if unused:
        raise _fail(path, f"unused key {unused[0]!r}")
    _check_norms(path, src)
    return _convert(path, layout, src, order)


def _anchor_order(path: Path, layout: str, tensors: Mapping[str, Tensor]) -> Tensor:
    if CELL_ANCHORS in tensors:
        return _reference_anchor_order(path, tensors[CELL_ANCHORS])
    if layout == "hf-frcnn":
        raise _fail(path, f"missing key {CELL_ANCHORS!r} (modeling_frcnn.py's anchors, which fix the anchor order)")
    if layout == "milvlg":
        return torch.arange(NUM_ANCHORS)
    return _reference_anchor_order(path, detectron2_cell_anchors())


def _check_norms(path: Path, src: Mapping[str, Tensor]) -> None:
    """Each norm's four vectors as long as its convolution has output channels."""
    for name in src:
        if not name.endswith(".running_mean"):
            continue
        prefix = name[: -len("running_mean")]
        if prefix.endswith("stem.bn."):
            conv = prefix[: -len("bn.")] + "conv.weight"
        elif prefix.endswith("shortcut_bn."):
            conv = prefix[: -len("shortcut_bn.")] + "shortcut.weight"
        else:
            conv = prefix[: -len("bnK.")] + f"conv{prefix[-2]}.weight"
        channels = src[conv].shape[0]
        for p in BN_PARAMS:
            shape = tuple(src[prefix + p].shape)
            if shape != (channels,):
                raise _fail(path, f"shape mismatch for our {prefix + p!r}: {shape}, expected ({channels},) as {conv!r}")


def _check_expected(path: Path, out: Mapping[str, Tensor], expected: Mapping[str, Tensor | torch.Size]) -> None:
    missing = [n for n in expected if n not in out]
    if missing:
        raise _fail(path, f"missing key for our {missing[0]!r}")
    unused = [n for n in out if n not in expected]
    if unused:
        raise _fail(path, f"unused key for our {unused[0]!r} (the model has no such parameter)")
    for n, want in expected.items():
        want_shape = tuple(want.shape if isinstance(want, Tensor) else want)
        if tuple(out[n].shape) != want_shape:
            raise _fail(path, f"shape mismatch for our {n!r}: file {tuple(out[n].shape)}, model {want_shape}")


def _convert(path: Path, layout: str, src: dict[str, Tensor], order: Tensor) -> dict[str, Tensor]:
    out = dict(src)
    obj_w, obj_b = src["rpn.objectness.weight"], src["rpn.objectness.bias"]
    deltas_w, deltas_b = src["rpn.deltas.weight"], src["rpn.deltas.bias"]
    if deltas_w.shape[0] != 4 * NUM_ANCHORS:
        raise _fail(path, f"shape mismatch for rpn deltas: {tuple(deltas_w.shape)}, expected ({4 * NUM_ANCHORS}, ...)")
    out["rpn.deltas.weight"] = _from_file_order(deltas_w, order, 4)
    out["rpn.deltas.bias"] = _from_file_order(deltas_b, order, 4)
    classes = src["head.cls_score.weight"].shape[0]
    if layout == "milvlg":
        if obj_w.shape[0] != 2 * NUM_ANCHORS:
            raise _fail(path, f"shape mismatch for rpn objectness: {tuple(obj_w.shape)}, expected ({2 * NUM_ANCHORS}, ...)")
        for key, t in (("weight", obj_w), ("bias", obj_b)):
            bg, fg = t[:NUM_ANCHORS], t[NUM_ANCHORS:]
            out[f"rpn.objectness.{key}"] = torch.cat((_from_file_order(bg, order, 1), _from_file_order(fg, order, 1)))
        _check_rows(path, src, "head.bbox_pred.weight", 4 * classes)
        return out
    if obj_w.shape[0] != NUM_ANCHORS:
        raise _fail(path, f"shape mismatch for rpn objectness: {tuple(obj_w.shape)}, expected ({NUM_ANCHORS}, ...)")
    for key, t in (("weight", obj_w), ("bias", obj_b)):
        fg = _from_file_order(t, order, 1)
        out[f"rpn.objectness.{key}"] = torch.cat((torch.zeros_like(fg), fg))  # softmax([0, l]) = sigmoid(l)
    for key in ("head.cls_score.weight", "head.cls_score.bias", "head.cls_embedding.weight",
                "head.attr_score.weight", "head.attr_score.bias"):
        out[key] = _bg_first(src[key])
    _check_rows(path, src, "head.cls_embedding.weight", classes)
    _check_rows(path, src, "head.bbox_pred.weight", 4 * (classes - 1))
    for key in ("head.bbox_pred.weight", "head.bbox_pred.bias"):
        fg = (src[key].to(torch.float64) / _box_weights(src[key])).to(torch.float32)
        out[key] = torch.cat((torch.zeros_like(fg[:4]), fg))  # the background's deltas: not in the file
    return out


def _check_rows(path: Path, src: Mapping[str, Tensor], ours: str, rows: int) -> None:
    if src[ours].shape[0] != rows:
        raise _fail(path, f"shape mismatch for our {ours!r}: {tuple(src[ours].shape)}, expected {rows} rows")


def load_detector(path: str | Path, layout: str = "auto", cfg: Any = None) -> torch.nn.Module:
    """`Detector(cfg or DetectorConfig())` with the file's weights, loaded strictly; in eval mode."""
    from xmodal.models.butd.detector import Detector, DetectorConfig

    model = Detector(cfg if cfg is not None else DetectorConfig())
    state = load_state_dict(path, layout, expected=model.state_dict())
    model.load_state_dict(state, strict=True)
    return model.eval()


# --- writing (tests, benchmarks) -----------------------------------------------------------------


def save_in_layout(state_dict: Mapping[str, Tensor], layout: str, path: str | Path) -> None:
    """Write our canonical state dict as `layout`'s project writes it: its names, orders and container
    (scripts/reference/extractor.py writes its random detector with it for the reference's own code to read;
    the tests make weights files of known detectors).

    detectron2: a pickle of {'model': {name: float32 ndarray}, '__author__': 'xmodal'}; milvlg and
    hf-frcnn: torch.save of the flat state dict (hf-frcnn with `num_batches_tracked` per norm and
    `cell_anchors.0`, as modeling_frcnn.py's module has them); xmodal: torch.save as is. The
    detectron2 family's single RPN logit is foreground - background, and the background's box
    deltas are dropped.
    """
    if layout not in LAYOUTS:
        _check_layout_name(layout)
    path = Path(path)
    sd = {k: v.detach().to(torch.float32).cpu() for k, v in state_dict.items()}
    if layout == "xmodal":
        torch.save(sd, path)
        return
    out: dict[str, Tensor] = {}
    for ours, t in sd.items():
        out[_their_name(ours, layout)] = t
    rpn, box = "proposal_generator.rpn_head.", "roi_heads.box_predictor."
    if layout != "milvlg":
        order = _reference_anchor_order(path, detectron2_cell_anchors())
        for key in ("weight", "bias"):
            both = sd[f"rpn.objectness.{key}"]
            logit = both[NUM_ANCHORS:] - both[:NUM_ANCHORS]
            out[f"{rpn}objectness_logits.{key}"] = _to_file_order(logit, order, 1)
            out[f"{rpn}anchor_deltas.{key}"] = _to_file_order(sd[f"rpn.deltas.{key}"], order, 4)
            fg = sd[f"head.bbox_pred.{key}"][4:]
            out[f"{box}bbox_pred.{key}"] = (fg.to(torch.float64) * _box_weights(fg)).to(torch.float32)
        for ours in ("cls_score.weight", "cls_score.bias", "cls_embedding.weight", "attr_score.weight", "attr_score.bias"):
            out[box + ours] = _bg_last(sd["head." + ours])
    if layout == "hf-frcnn":
        out[CELL_ANCHORS] = detectron2_cell_anchors()
        for name in [n for n in out if n.endswith(".running_mean")]:
            out[name[: -len("running_mean")] + "num_batches_tracked"] = torch.tensor(0)
    if layout == "detectron2":
        arrays = {k: v.contiguous().numpy() for k, v in out.items()}
        with open(path, "wb") as f:
            pickle.dump({"model": arrays, "__author__": "xmodal"}, f, protocol=2)
    else:
        torch.save(out, path)


# --- vocabularies ----------------------------------------------------------------------------------


def read_vocab(path: str | Path, expected: int) -> list[str]:
    """The lines of `objects_vocab.txt` (1,600) or `attributes_vocab.txt` (400), index i = class i + 1.

    Each line is kept whole (stripped of surrounding white space), synonyms and all, e.g. a line
    "t-shirt,tshirt,tee shirt" stays one name; its first synonym is `name.split(",")[0]`.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise _fail(path, f"cannot read the vocabulary ({type(e).__name__})") from None
    names = [line.strip() for line in text.splitlines()]
    while names and names[-1] == "":
        names.pop()
    if len(names) != expected or any(n == "" for n in names):
        empty = sum(n == "" for n in names)
        detail = f" ({empty} empty)" if empty else ""
        raise _fail(path, f"{len(names)} names{detail}, expected {expected}")
    return names

