"""A stand-in `caffe` module: a prototxt's layers run in order, in Caffe's semantics, on numpy blobs.

`Net(prototxt, phase, weights=...)` reads the prototxt and runs Convolution, BatchNorm (global stats)
and Scale, ReLU, Pooling (MAX with Caffe's ceil rounding, global AVE), Eltwise sum, Reshape, Softmax,
InnerProduct, Flatten, ArgMax (the higher index on a tie, as Caffe's partial sort of (value, index)
pairs), Embed, Concat (with torch, float32), the ROIPooling of `roi_pooling_layer.cpp` (the line-by-line
port in tests/models/butd/reference_ops.py), and constructs and calls a `Python` layer as Caffe does
(`param_str`, `phase`, `setup`, `reshape`, `forward` on blobs).

The weights are a detectron2-layout pickle (what our extractor reads), mapped onto Caffe's blobs here
(`caffe_blobs`), independently of `models/butd/weights.py`. A residual block the weights do not hold
(a smaller network of the same structure: fewer blocks per stage) is left out of the net, and the
layers after its stage read the stage's last block that is there.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F

from scripts.reference.common import REPO, stand_in

TEST, TRAIN = 1, 0  # caffe.TEST, caffe.TRAIN
_OPS = None  # tests/models/butd/reference_ops.py, loaded on first use


def ops():
    global _OPS
    if _OPS is None:
        spec = importlib.util.spec_from_file_location("reference_ops", REPO / "tests/models/butd/reference_ops.py")
        _OPS = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(_OPS)
    return _OPS


def install() -> None:
    """`import caffe` gives this module's Net and Layer (modes and devices are no-ops)."""
    stand_in("caffe", Layer=Layer, Net=Net, TEST=TEST, TRAIN=TRAIN, set_mode_cpu=lambda: None,
             set_mode_gpu=lambda: None, set_device=lambda i: None)


# ============================================================================ the prototxt

_TOKEN = re.compile(r'\s*(?:#[^\n]*\n?|([A-Za-z_][\w./]*)|("(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\')|'
                    r'([-+]?[\d.]+(?:[eE][-+]?\d+)?)|([{}:]))')


def parse_prototxt(text: str) -> dict:
    """Protobuf text format -> {field: [values]} (every field a list; messages are dicts)."""
    tokens = []
    pos = 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m or m.end() == pos:
            if text[pos:].strip() == "":
                break
            raise ValueError(f"prototxt: cannot read at {text[pos:pos + 40]!r}")
        pos = m.end()
        ident, string, number, punct = m.groups()
        if ident is not None:
            tokens.append(("id", ident))
        elif string is not None:
            tokens.append(("str", bytes(string[1:-1], "utf-8").decode("unicode_escape")))
        elif number is not None:
            tokens.append(("num", float(number) if any(c in number for c in ".eE") else int(number)))
        elif punct is not None:
            tokens.append(("p", punct))

    def message(i: int) -> tuple[dict, int]:
        out: dict = {}
        while i < len(tokens) and tokens[i] != ("p", "}"):
            key = tokens[i][1]
            i += 1
            if tokens[i] == ("p", ":"):
                i += 1
            if tokens[i] == ("p", "{"):
                value, i = message(i + 1)
                i += 1
            else:
                value = tokens[i][1]
                i += 1
            out.setdefault(key, []).append(value)
        return out, i

    return message(0)[0]


def _one(p: dict, key: str, default=None):
    return p.get(key, [default])[0]


# Layers of residual block `{stage}{block}`: res2a_branch1, bn4b22_branch2a, scale3b3_branch2c, res5c_relu, res4a
_BLOCK = re.compile(r"^(?:res|bn|scale)(\d)([a-z]\d*)(?:_|$)")


def prune_blocks(layers: list[dict], params: dict) -> tuple[list[dict], dict[str, str]]:
    """The layers of the residual blocks `params` holds weights for, and {full net's blob: blob read instead}:
    each stage's output is its last block that is there."""
    stages: dict[str, list[str]] = {}
    for layer in layers:
        m = _BLOCK.match(layer["name"][0])
        if m and m.group(2) not in stages.setdefault(m.group(1), []):
            stages[m.group(1)].append(m.group(2))
    present = {s: [b for b in blocks if f"res{s}{b}_branch2a" in params] for s, blocks in stages.items()}
    renamed = {f"res{s}{blocks[-1]}": f"res{s}{present[s][-1]}" for s, blocks in stages.items() if present[s]}
    kept = []
    for layer in layers:
        m = _BLOCK.match(layer["name"][0])
        if m and m.group(2) not in present[m.group(1)]:
            continue
        layer = {**layer, "bottom": [renamed.get(b, b) for b in layer.get("bottom", [])]}
        kept.append(layer)
    return kept, renamed


class Blob:
    def __init__(self, shape=(1,)):
        self.data = np.zeros(shape, np.float32)

    def reshape(self, *shape):
        if tuple(self.data.shape) != tuple(shape):
            self.data = np.zeros(shape, np.float32)

    @property
    def shape(self):
        return self.data.shape


class Layer:
    """`caffe.Layer`: the base of Python layers (Caffe sets `param_str` and `phase` before `setup`)."""


def _t(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a, dtype=np.float32))


_WEIGHTED = {"Convolution", "BatchNorm", "Scale", "InnerProduct", "Embed"}


class Net:
    """`caffe.Net(prototxt, phase, weights=...)`: the layers of the prototxt run in order on numpy blobs."""

    def __init__(self, prototxt, phase, weights=None):
        spec = parse_prototxt(Path(prototxt).read_text())
        self.phase = phase
        self.params: dict[str, list[np.ndarray]] = caffe_blobs(weights) if weights else {}
        self.layers, renamed = prune_blocks(spec["layer"], self.params) if weights else (spec["layer"], {})
        self.res4 = renamed.get("res4b22", "res4b22")  # the backbone's output blob
        self.blobs: dict[str, Blob] = {}
        for name, shape in zip(spec.get("input", []), spec.get("input_shape", []), strict=True):
            self.blobs[name] = Blob(tuple(shape["dim"]))
        self.inputs = list(spec.get("input", []))
        consumed = {b for layer in self.layers for b in layer.get("bottom", [])}
        tops = [t for layer in self.layers for t in layer.get("top", [])]
        self.outputs = [t for t in dict.fromkeys(tops) if t not in consumed]
        self._python = {}
        for layer in self.layers:
            for t in layer.get("top", []):
                self.blobs.setdefault(t, Blob())
            if layer["type"][0] == "Python":
                p = layer["python_param"][0]
                cls = getattr(importlib.import_module(p["module"][0]), p["layer"][0])
                obj = cls()
                obj.param_str = _one(p, "param_str", "")
                obj.phase = phase
                obj.setup([self.blobs[b] for b in layer["bottom"]], [self.blobs[t] for t in layer["top"]])
                self._python[layer["name"][0]] = obj
        missing = [layer["name"][0] for layer in self.layers if layer["type"][0] in _WEIGHTED
                   and layer["name"][0] not in self.params]
        if weights and missing:
            raise KeyError(f"no weights for layers {missing[:5]} ({len(missing)})")
        # Blobs the reference's Python reads after `forward`, and those the comparison reads; the other
        # intermediate blobs are released once no later layer reads them (Caffe keeps them all: 6 GB here).
        self.keep = {"rois", "cls_prob", "attr_prob", "pool5_flat", "bbox_pred", "cls_score", self.res4,
                     "rpn_cls_prob_reshape", "rpn_bbox_pred"}

    def forward(self, **inputs):
        for name, value in inputs.items():
            self.blobs[name].reshape(*value.shape)
            self.blobs[name].data[...] = value
        last_use = {b: i for i, layer in enumerate(self.layers) for b in layer.get("bottom", [])}
        for i, layer in enumerate(self.layers):
            self._run(layer)
            for b in layer.get("bottom", []):
                if last_use[b] == i and b not in self.keep and b not in self.inputs:
                    self.blobs[b].data = np.zeros((0,), np.float32)
        return {name: self.blobs[name].data for name in self.outputs}

    def _run(self, layer) -> None:
        name, kind = layer["name"][0], layer["type"][0]
        bottom = [self.blobs[b] for b in layer.get("bottom", [])]
        top = [self.blobs[t] for t in layer.get("top", [])]
        if kind == "Python":
            self._python[name].reshape(bottom, top)
            self._python[name].forward(bottom, top)
            return
        out = run_layer(kind, layer, [b.data for b in bottom], self.params.get(name, []))
        top[0].data = np.ascontiguousarray(out, dtype=np.float32)


def _ints(p: dict, key: str, default: int) -> int:
    v = p.get(key, [default])
    return int(v[0])


def _pooling(layer: dict, x: np.ndarray) -> np.ndarray:
    p = layer["pooling_param"][0]
    if _one(p, "global_pooling", "false") in ("true", True):
        assert _one(p, "pool") == "AVE"
        # Caffe's AVE pooling sums the window then divides by its size
        return (_t(x).sum(dim=(2, 3), keepdim=True) / np.float32(x.shape[2] * x.shape[3])).numpy()
    assert _one(p, "pool") == "MAX" and _ints(p, "pad", 0) == 0
    # Caffe's pooled size: ceil((H - k) / s) + 1, what ceil_mode gives without padding
    return F.max_pool2d(_t(x), _ints(p, "kernel_size", 1), _ints(p, "stride", 1), ceil_mode=True).numpy()


def run_layer(kind: str, layer: dict, x: list[np.ndarray], w: list[np.ndarray]) -> np.ndarray:
    with torch.no_grad():
        if kind == "Convolution":
            p = layer["convolution_param"][0]
            bias = _t(w[1]) if _one(p, "bias_term", "true") not in ("false", False) else None
            return F.conv2d(_t(x[0]), _t(w[0]), bias, stride=_ints(p, "stride", 1), padding=_ints(p, "pad", 0),
                            dilation=_ints(p, "dilation", 1)).numpy()
        if kind == "BatchNorm":
            p = _one(layer, "batch_norm_param", {})
            return ops().caffe_batch_norm(_t(x[0]), _t(w[0]), _t(w[1]), _t(w[2]), float(_one(p, "eps", 1e-5))).numpy()
        if kind == "Scale":
            return ops().caffe_scale(_t(x[0]), _t(w[0]), _t(w[1])).numpy()
        if kind == "ReLU":
            return np.maximum(x[0], np.float32(0))
        if kind == "Pooling":
            return _pooling(layer, x[0])
        if kind == "Eltwise":
            assert _one(layer.get("eltwise_param", [{}])[0], "operation", "SUM") == "SUM"
            return x[0] + x[1]
        if kind == "Reshape":
            dims = layer["reshape_param"][0]["shape"][0]["dim"]
            shape = [x[0].shape[i] if d == 0 else d for i, d in enumerate(dims)]
            return x[0].reshape(shape)
        if kind == "Softmax":
            return torch.softmax(_t(x[0]), dim=1).numpy()
        if kind == "InnerProduct":
            return (_t(x[0].reshape(x[0].shape[0], -1)) @ _t(w[0]).T + _t(w[1])).numpy()
        if kind == "Flatten":
            return x[0].reshape(x[0].shape[0], -1)
        if kind == "ArgMax":
            # std::partial_sort over (value, index) pairs with std::greater: the higher index wins a tie
            v = x[0].reshape(x[0].shape[0], -1)
            return (v.shape[1] - 1 - np.argmax(v[:, ::-1], axis=1)).astype(np.float32).reshape(-1, 1)
        if kind == "Embed":
            return w[0][x[0].astype(np.int64)]  # (N, 1, num_output)
        if kind == "Concat":
            return np.concatenate(x, axis=1)
        if kind == "ROIPooling":
            p = layer["roi_pooling_param"][0]
            assert x[0].shape[0] == 1 and (x[1][:, 0] == 0).all()
            return ops().roi_pool(_t(x[0][0]), _t(x[1][:, 1:5]), _ints(p, "pooled_h", 1),
                                  float(_one(p, "spatial_scale", 1.0))).numpy()
    raise NotImplementedError(f"layer type {kind} ({layer['name'][0]})")


# ============================================================================ weights: the detectron2 pickle onto Caffe's blobs

RATIOS, SCALES = 3, 4  # generate_anchors(ratios=[0.5, 1, 2], scales=[4, 8, 16, 32])


def _block(i: int, blocks: int) -> str:
    """Caffe's ResNet-101 block names: res2a..c, res3a, res3b1..b3, res4a, res4b1..b22, res5a..c."""
    return "abc"[i] if blocks <= 3 else ("a" if i == 0 else f"b{i}")


def caffe_blobs(path) -> dict[str, list[np.ndarray]]:
    """{caffe layer name: its blobs} from a detectron2-layout pickle ({'model': {name: ndarray}})."""
    from xmodal.models.butd.weights import _read_file  # the restricted unpickler; no convention applied

    _, tensors = _read_file(Path(path))
    m = {k: v.numpy().astype(np.float32) for k, v in tensors.items()}
    out: dict[str, list[np.ndarray]] = {}

    def bn(caffe_suffix: str, prefix: str) -> None:
        out["bn" + caffe_suffix] = [m[prefix + "running_mean"], m[prefix + "running_var"], np.ones(1, np.float32)]
        out["scale" + caffe_suffix] = [m[prefix + "weight"], m[prefix + "bias"]]

    out["conv1"] = [m["backbone.stem.conv1.weight"]]
    bn("_conv1", "backbone.stem.conv1.norm.")
    stages = {2: "backbone.res2", 3: "backbone.res3", 4: "backbone.res4", 5: "roi_heads.res5"}
    for stage, prefix in stages.items():
        blocks = 1 + max(int(k.split(".")[len(prefix.split("."))]) for k in m if k.startswith(prefix + "."))
        for i in range(blocks):
            name = f"{stage}{_block(i, blocks)}"
            for theirs, branch in (("shortcut", "1"), ("conv1", "2a"), ("conv2", "2b"), ("conv3", "2c")):
                key = f"{prefix}.{i}.{theirs}."
                if key + "weight" not in m:
                    continue
                out[f"res{name}_branch{branch}"] = [m[key + "weight"]]
                bn(f"{name}_branch{branch}", key + "norm.")
    rpn, box = "proposal_generator.rpn_head.", "roi_heads.box_predictor."
    out["rpn_conv/3x3"] = [m[rpn + "conv.weight"], m[rpn + "conv.bias"]]
    # detectron2's anchors are size-major (for size: for ratio), Caffe's ratio-major: caffe a = r * 4 + s
    order = [s * RATIOS + r for r in range(RATIOS) for s in range(SCALES)]
    logit_w, logit_b = m[rpn + "objectness_logits.weight"][order], m[rpn + "objectness_logits.bias"][order]
    # one sigmoid logit l per anchor == softmax over (background 0, foreground l): 12 zero rows, then the logits
    out["rpn_cls_score"] = [np.concatenate([np.zeros_like(logit_w), logit_w]),
                            np.concatenate([np.zeros_like(logit_b), logit_b])]
    per4 = [4 * a + c for a in order for c in range(4)]
    out["rpn_bbox_pred"] = [m[rpn + "anchor_deltas.weight"][per4], m[rpn + "anchor_deltas.bias"][per4]]

    def bg_first(a: np.ndarray) -> np.ndarray:  # detectron2 keeps background / "no attribute" last
        return np.concatenate([a[-1:], a[:-1]])

    out["cls_score"] = [bg_first(m[box + "cls_score.weight"]), bg_first(m[box + "cls_score.bias"])]
    weights = np.tile(np.array([10, 10, 5, 5], np.float64), m[box + "bbox_pred.bias"].shape[0] // 4)
    bw = (m[box + "bbox_pred.weight"].astype(np.float64) / weights[:, None]).astype(np.float32)
    bb = (m[box + "bbox_pred.bias"].astype(np.float64) / weights).astype(np.float32)
    out["bbox_pred"] = [np.concatenate([np.zeros_like(bw[:4]), bw]), np.concatenate([np.zeros_like(bb[:4]), bb])]
    out["cls_embedding"] = [bg_first(m[box + "cls_embedding.weight"])]
    out["fc_attr"] = [m[box + "fc_attr.weight"], m[box + "fc_attr.bias"]]
    out["attr_score"] = [bg_first(m[box + "attr_score.weight"]), bg_first(m[box + "attr_score.bias"])]
    return out
