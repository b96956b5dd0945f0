"""Our extraction against the reference's own Python code, image by image, without Caffe.

The reference is peteanderson80/bottom-up-attention run as LXMERT's `extract_coco_image.py` (airsplay/
lxmert) runs it: `get_detections_from_im` (36 boxes) -> `fast_rcnn/test.py: im_detect, _get_blobs,
_get_image_blob` -> the net of `models/vg/ResNet-101/faster_rcnn_end2end_final/test.prototxt` with the
config of `experiments/cfgs/faster_rcnn_end2end_resnet.yml`, whose Python layer is the reference's own
`rpn/proposal_layer.py` (with `generate_anchors.py`, `fast_rcnn/bbox_transform.py`, `nms_wrapper.py`) and
whose NMS is the reference's `nms/cpu_nms.pyx` once built (else its `nms/py_cpu_nms.py`, which keeps a
box at an overlap exactly equal to the threshold where cpu_nms drops it). All those files are imported
from the given checkouts, unchanged. What this script supplies is what Caffe would:

- a stand-in `caffe` module whose `Net` reads the prototxt and runs its layers in order, in Caffe's
  semantics: Convolution, BatchNorm (global stats) and Scale, ReLU, Pooling (MAX with Caffe's ceil
  rounding, global AVE), Eltwise sum, Reshape, Softmax, InnerProduct, Flatten, ArgMax (the higher index
  on a tie, as Caffe's partial sort of (value, index) pairs), Embed, Concat (with torch, float32), the
  ROIPooling of `roi_pooling_layer.cpp` (the line-by-line port in tests/models/butd/reference_ops.py),
  and the `Python` layer constructed and called as Caffe calls it (`param_str`, `phase`, `setup`,
  `reshape`, `forward` on blobs);
- the net's weights from the pickle our extractor reads (detectron2's layout), mapped onto Caffe's
  blobs here, independently of `models/butd/weights.py`;
- what Python 3 lacks of the Python 2 the reference was written in: its files' `print` statements are
  rewritten as calls by lib2to3's `fix_print` when imported (the only change; none of them runs on this
  path), `xrange`, `cPickle`, numpy's removed `np.int` / `np.float` aliases, and PyYAML's old
  `yaml.load` default loader (the proposal layer's `param_str` holds a `!!python/tuple`); `easydict` as
  a dict with attribute access and Python 2's `iteritems` / `has_key`.

numpy: the reference ran under numpy <= 1.16 (Python 2), whose float32 exp was libm's expf and whose
arithmetic promoted by value. `reference` refuses numpy 2 (under NEP 50 the LXMERT script's
`rois[:, 1:5] / im_scales[0]` is float64, its boxes and per-class NMS input other than the reference's);
run it with a numpy 1.x on PYTHONPATH, and with NPY_DISABLE_CPU_FEATURES naming numpy's AVX2 / AVX-512
targets, whose float32 exp differs from libm's in the last bit of 40 % of values (info.json records the
share of exp values that are not correctly rounded, as measured in the run).

Usage (the reference's cpu_nms built beforehand as its lib/Makefile builds it, or py_cpu_nms is used):

    python scripts/reference_check.py photos PHOTOS            # scikit-image's bundled photographs, cropped, rescaled
    python scripts/reference_check.py weights W.pkl [--seed 0] [--logit-scale 1] [--rpn-size-bias 1.75]
    NPY_DISABLE_CPU_FEATURES="AVX512F ... FMA3 AVX2" PYTHONPATH=NUMPY_1_DIR:platform \
        python scripts/reference_check.py reference --reference BUA --lxmert-script extract_coco_image.py \
        --weights W.pkl PHOTOS --out REF                        # one .npz per image
    python scripts/reference_check.py ours --weights W.pkl PHOTOS --out OURS
    python scripts/reference_check.py compare REF OURS [--out table.json]   # or: compare REF --tsv OURS.tsv

`ours` runs our detector as the job does (the decode task's blob, `Detector.regions`); `compare --tsv`
takes an extraction's TSV (`jobs/extract.py ... --format tsv`) instead. `compare` prints one row per
image: the boxes identical to the reference's (slot by slot, bit for bit), within 0.001 px, and in both
sets; the largest box and feature differences; the object and attribute ids that agree; whether the
36th and 37th max_conf tie; and, from `ours`, where the two first differ (input blob, res4b22, the RPN's
outputs, the proposals as a set and in order).
"""

from __future__ import annotations

import argparse
import base64
import builtins
import csv
import importlib
import importlib.abc
import importlib.util
import json
import os
import pickle
import re
import shutil
import sys
import time
import types
import warnings
from pathlib import Path

import numpy as np
import torch
from torch.nn import functional as F

REPO = Path(__file__).resolve().parent.parent
TEST, TRAIN = 1, 0  # caffe.TEST, caffe.TRAIN


# --- the prototxt -----------------------------------------------------------------------------------

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


# --- the stand-in caffe ---------------------------------------------------------------------------


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


class Net:
    """`caffe.Net(prototxt, phase, weights=...)`: the layers of the prototxt run in order on numpy blobs."""

    def __init__(self, prototxt, phase, weights=None):
        spec = parse_prototxt(Path(prototxt).read_text())
        self.phase = phase
        self.blobs: dict[str, Blob] = {}
        for name, shape in zip(spec.get("input", []), spec.get("input_shape", []), strict=True):
            self.blobs[name] = Blob(tuple(shape["dim"]))
        self.inputs = list(spec.get("input", []))
        self.layers = spec["layer"]
        self.params: dict[str, list[np.ndarray]] = caffe_blobs(weights) if weights else {}
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
    KEEP = ("rois", "cls_prob", "attr_prob", "pool5_flat", "bbox_pred", "cls_score", "res4b22",
            "rpn_cls_prob_reshape", "rpn_bbox_pred")

    def forward(self, **inputs):
        for name, value in inputs.items():
            self.blobs[name].reshape(*value.shape)
            self.blobs[name].data[...] = value
        last_use = {b: i for i, layer in enumerate(self.layers) for b in layer.get("bottom", [])}
        for i, layer in enumerate(self.layers):
            self._run(layer)
            for b in layer.get("bottom", []):
                if last_use[b] == i and b not in self.KEEP and b not in self.inputs:
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
        out = _run_layer(kind, layer, [b.data for b in bottom], self.params.get(name, []))
        top[0].data = np.ascontiguousarray(out, dtype=np.float32)


_WEIGHTED = {"Convolution", "BatchNorm", "Scale", "InnerProduct", "Embed"}


def _ints(p: dict, key: str, default: int) -> int:
    v = p.get(key, [default])
    return int(v[0])


def _run_layer(kind: str, layer: dict, x: list[np.ndarray], w: list[np.ndarray]) -> np.ndarray:
    with torch.no_grad():
        if kind == "Convolution":
            p = layer["convolution_param"][0]
            bias = _t(w[1]) if _one(p, "bias_term", "true") not in ("false", False) else None
            return F.conv2d(_t(x[0]), _t(w[0]), bias, stride=_ints(p, "stride", 1), padding=_ints(p, "pad", 0),
                            dilation=_ints(p, "dilation", 1)).numpy()
        if kind == "BatchNorm":
            p = _one(layer, "batch_norm_param", {})
            return REF_OPS.caffe_batch_norm(_t(x[0]), _t(w[0]), _t(w[1]), _t(w[2]), float(_one(p, "eps", 1e-5))).numpy()
        if kind == "Scale":
            return REF_OPS.caffe_scale(_t(x[0]), _t(w[0]), _t(w[1])).numpy()
        if kind == "ReLU":
            return np.maximum(x[0], np.float32(0))
        if kind == "Pooling":
            p = layer["pooling_param"][0]
            if _one(p, "global_pooling", "false") in ("true", True):
                assert _one(p, "pool") == "AVE"
                # Caffe's AVE pooling sums the window then divides by its size
                return (_t(x[0]).sum(dim=(2, 3), keepdim=True) / np.float32(x[0].shape[2] * x[0].shape[3])).numpy()
            assert _one(p, "pool") == "MAX" and _ints(p, "pad", 0) == 0
            # Caffe's pooled size: ceil((H - k) / s) + 1, what ceil_mode gives without padding
            return F.max_pool2d(_t(x[0]), _ints(p, "kernel_size", 1), _ints(p, "stride", 1), ceil_mode=True).numpy()
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
            return REF_OPS.roi_pool(_t(x[0][0]), _t(x[1][:, 1:5]), _ints(p, "pooled_h", 1),
                                    float(_one(p, "spatial_scale", 1.0))).numpy()
    raise NotImplementedError(f"layer type {kind} ({layer['name'][0]})")


# --- weights: the detectron2 pickle onto Caffe's blobs ------------------------------------------------

RATIOS, SCALES = 3, 4  # generate_anchors(ratios=[0.5, 1, 2], scales=[4, 8, 16, 32])


def _block(stage: int, i: int, blocks: int) -> str:
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
            name = f"{stage}{_block(stage, i, blocks)}"
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


# --- Python 2 files under Python 3 ------------------------------------------------------------------


class _Py2Loader(importlib.abc.SourceLoader):
    def __init__(self, path: str):
        self.path = path

    def get_filename(self, fullname):
        return self.path

    def get_data(self, path):
        source = Path(path).read_text()
        if path != self.path:
            return source.encode()
        try:
            compile(source, path, "exec")
            return source.encode()
        except SyntaxError:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                from lib2to3.refactor import RefactoringTool
            tool = RefactoringTool(["lib2to3.fixes.fix_print"])
            fixed = str(tool.refactor_string(source if source.endswith("\n") else source + "\n", path))
            REWRITTEN[path] = sum(a != b for a, b in zip(source.splitlines(), fixed.splitlines(), strict=False))
            return fixed.encode()

    def path_stats(self, path):
        raise OSError  # no bytecode cache: the source is compiled as rewritten


class _Py2Finder(importlib.abc.MetaPathFinder):
    def __init__(self, roots: list[Path]):
        self.roots = roots

    def find_spec(self, fullname, path=None, target=None):
        parts = fullname.split(".")
        for root in self.roots:
            for candidate in (root.joinpath(*parts).with_suffix(".py"), root.joinpath(*parts, "__init__.py")):
                if candidate.is_file():
                    is_pkg = candidate.name == "__init__.py"
                    return importlib.util.spec_from_file_location(
                        fullname, candidate, loader=_Py2Loader(str(candidate)),
                        submodule_search_locations=[str(candidate.parent)] if is_pkg else None)
        return None


REWRITTEN: dict[str, int] = {}
REF_OPS = None


class EasyDict(dict):
    """easydict's EasyDict (nested dicts become EasyDicts; keys are attributes), with Python 2's dict methods."""

    def __init__(self, d=None, **kw):
        super().__init__()
        for k, v in {**(d or {}), **kw}.items():
            self[k] = v

    def __setitem__(self, k, v):
        if isinstance(v, dict) and not isinstance(v, EasyDict):
            v = EasyDict(v)
        super().__setitem__(k, v)

    def __getattr__(self, k):
        try:
            return self[k]
        except KeyError as e:
            raise AttributeError(k) from e

    def __setattr__(self, k, v):
        self[k] = v

    def iteritems(self):
        return iter(self.items())

    def has_key(self, k):
        return k in self


def install_reference(reference: Path, lxmert_script: Path):
    """Make the reference importable under Python 3 with the stand-ins; -> (config module, detections fn)."""
    global REF_OPS
    spec = importlib.util.spec_from_file_location("reference_ops", REPO / "tests/models/butd/reference_ops.py")
    REF_OPS = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(REF_OPS)

    caffe = types.ModuleType("caffe")
    caffe.Layer, caffe.Net, caffe.TEST, caffe.TRAIN = Layer, Net, TEST, TRAIN
    caffe.set_mode_cpu = caffe.set_mode_gpu = lambda: None
    caffe.set_device = lambda i: None
    sys.modules["caffe"] = caffe
    easydict = types.ModuleType("easydict")
    easydict.EasyDict = EasyDict
    sys.modules["easydict"] = easydict
    sys.modules["cPickle"] = pickle
    builtins.xrange = range
    np.int, np.float = int, float  # removed in numpy 1.24; the reference (and its cpu_nms) use them
    import yaml as real_yaml

    shim = types.ModuleType("yaml")
    shim.__dict__.update({k: getattr(real_yaml, k) for k in dir(real_yaml) if not k.startswith("__")})
    shim.load = lambda stream, Loader=real_yaml.UnsafeLoader: real_yaml.load(stream, Loader=Loader)  # PyYAML < 5
    sys.modules["yaml"] = shim
    lib = reference / "lib"
    # the C++/CUDA extensions of lib/: gpu_nms and cython_bbox are not on this path
    gpu = types.ModuleType("nms.gpu_nms")
    gpu.gpu_nms = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("USE_GPU_NMS is False in the yml"))
    sys.modules["nms.gpu_nms"] = gpu
    bbox = types.ModuleType("utils.cython_bbox")
    bbox.bbox_overlaps = None
    sys.modules["utils.cython_bbox"] = bbox
    sys.meta_path.insert(0, _Py2Finder([lib, lib / "rpn", reference / "tools"]))
    sys.path[:0] = [str(lib), str(lib / "rpn")]  # proposal_layer's Python 2 implicit `from generate_anchors import`
    try:
        importlib.import_module("nms.cpu_nms")
        nms_used = "cpu_nms (lib/nms/cpu_nms.pyx, built)"
    except ImportError:
        py = importlib.import_module("nms.py_cpu_nms")
        stand_in = types.ModuleType("nms.cpu_nms")
        stand_in.cpu_nms = py.py_cpu_nms
        stand_in.cpu_soft_nms = None
        sys.modules["nms.cpu_nms"] = stand_in
        nms_used = "py_cpu_nms (lib/nms/py_cpu_nms.py; cpu_nms not built)"
    config = importlib.import_module("fast_rcnn.config")
    config.cfg_from_file(str(reference / "experiments/cfgs/faster_rcnn_end2end_resnet.yml"))
    test = importlib.import_module("fast_rcnn.test")
    spec = importlib.util.spec_from_file_location("extract_coco_image", lxmert_script,
                                                  loader=_Py2Loader(str(lxmert_script)))
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    return config.cfg, script.get_detections_from_im, test, nms_used


# --- the photographs ---------------------------------------------------------------------------------


def make_photos(out: Path) -> list[dict]:
    """scikit-image's bundled photographs and crops / rescales of them: >= 20 sizes and aspect ratios."""
    import cv2

    spec = importlib.util.find_spec("skimage")
    if spec is None:
        raise SystemExit("error: scikit-image is not installed (its bundled photographs are the set)")
    data = Path(spec.submodule_search_locations[0]) / "data"
    out.mkdir(parents=True, exist_ok=True)
    src = {n: cv2.imread(str(data / f), cv2.IMREAD_UNCHANGED) for n, f in (
        ("astronaut", "astronaut.png"), ("coffee", "coffee.png"), ("chelsea", "chelsea.png"), ("rocket", "rocket.jpg"),
        ("camera", "camera.png"), ("coins", "coins.png"), ("hubble", "hubble_deep_field.jpg"), ("ihc", "ihc.png"),
        ("motorcycle", "motorcycle_left.png"), ("retina", "retina.jpg"), ("moon", "moon.png"))}
    area, lin = cv2.INTER_AREA, cv2.INTER_LINEAR
    made = {
        "astronaut": src["astronaut"], "coffee": src["coffee"], "chelsea": src["chelsea"], "rocket": src["rocket"],
        "camera_grey": src["camera"], "coins_grey": src["coins"], "hubble": src["hubble"], "ihc": src["ihc"],
        "motorcycle": src["motorcycle"], "retina": src["retina"], "moon_grey": src["moon"],
        "coffee_x2_1200": cv2.resize(src["coffee"], None, fx=2, fy=2, interpolation=lin),  # long side 1200
        "chelsea_half_scale": cv2.resize(src["chelsea"], (1804, 1200), interpolation=lin),  # scale exactly 600 / 1200
        "rocket_wide_strip": src["rocket"][100:300, :],  # 200 x 640: capped by the long side
        "astronaut_tall_crop": src["astronaut"][:, 150:350],  # 512 x 200
        "coffee_small": cv2.resize(src["coffee"], (150, 100), interpolation=area),
        "chelsea_odd": cv2.resize(src["chelsea"], (517, 333), interpolation=area),
        "motorcycle_crop": src["motorcycle"][50:450, 100:700],
        "camera_grey_crop": src["camera"][37:300, 11:480],
        "hubble_square_small": cv2.resize(src["hubble"][:, :872], (97, 97), interpolation=area),
        "rocket_transposed": np.ascontiguousarray(src["rocket"].transpose(1, 0, 2)),  # portrait 640 x 427
        "astronaut_panorama_1400": cv2.resize(src["astronaut"][200:400], (1400, 350), interpolation=lin),
    }
    rows = []
    for name, im in made.items():
        if im is None:
            continue
        path = out / f"{name}.png"
        cv2.imwrite(str(path), im)
        rows.append({"image": name, "h": im.shape[0], "w": im.shape[1], "channels": 1 if im.ndim == 2 else im.shape[2]})
    return rows


# --- random weights --------------------------------------------------------------------------------


def write_weights(path: Path, seed: int, logit_scale: float, rpn_size_bias: float) -> None:
    """The random reference detector in the detectron2 pickle layout.

    logit_scale multiplies the class and attribute logits (confidences neither near-uniform nor
    saturated at 1.0: at 1.0 in float32 the reference's order among them is its unstable sort's).
    rpn_size_bias is added to every anchor's dw and dh: the random RPN's boxes grow by e^bias, overlap
    more, and its NMS keeps fewer than 300 proposals, which makes res5 (nearly all the time) cheaper."""
    from xmodal.models.butd.detector import DetectorConfig, random_detector
    from xmodal.models.butd.weights import save_in_layout

    sd = {k: v.clone() for k, v in random_detector(DetectorConfig(), seed).state_dict().items()}
    for key in ("head.cls_score.weight", "head.cls_score.bias", "head.attr_score.weight", "head.attr_score.bias"):
        sd[key] *= logit_scale
    sd["rpn.deltas.bias"].reshape(-1, 4)[:, 2:] += rpn_size_bias
    save_in_layout(sd, "detectron2", path)


# --- the two runs and the comparison --------------------------------------------------------------


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


def read_tsv(path: Path) -> dict[str, dict]:
    csv.field_size_limit(sys.maxsize)
    names = ["img_id", "img_h", "img_w", "objects_id", "objects_conf", "attrs_id", "attrs_conf", "num_boxes",
             "boxes", "features"]
    with open(path, newline="") as f:
        return {r["img_id"]: decode_row(r) for r in csv.DictReader(f, delimiter="\t", fieldnames=names)}


def _images(folder: Path, limit: int) -> list[Path]:
    images = sorted(p for p in folder.iterdir() if p.suffix.lower() in (".jpg", ".jpeg", ".png"))
    return images[:limit] if limit else images


def run_reference(args) -> int:
    """The reference over the images: per image an .npz of its TSV row's arrays and its intermediate blobs."""
    import cv2

    if int(np.__version__.split(".")[0]) >= 2:
        # NEP 50: `rois[:, 1:5] / im_scales[0]` (float32 array / numpy float64 scalar) is float64 under
        # numpy 2 and float32 under the numpy 1.x the reference ran with; its boxes and its per-class
        # NMS input would then not be the reference's.
        raise SystemExit("error: run the reference under numpy 1.x (value-based casting), e.g. "
                         "PYTHONPATH=DIR_WITH_NUMPY_1_26; this is numpy " + np.__version__)
    torch.set_num_threads(args.threads or torch.get_num_threads())
    cfg, detections, test, nms_used = install_reference(args.reference.resolve(), args.lxmert_script.resolve())
    from fast_rcnn.nms_wrapper import nms as ref_nms

    prototxt = args.reference / "models/vg/ResNet-101/faster_rcnn_end2end_final/test.prototxt"
    net = Net(str(prototxt), TEST, weights=str(args.weights))
    args.out.mkdir(parents=True, exist_ok=True)
    probe = (np.random.default_rng(0).standard_normal(100_000) + 1).astype(np.float32)
    exp_off = float((np.exp(probe) != np.exp(probe.astype(np.float64)).astype(np.float32)).mean())
    info = {"numpy_float32_exp_not_correctly_rounded": exp_off, "npy_disable_cpu_features":
            os.environ.get("NPY_DISABLE_CPU_FEATURES", ""), "nms": nms_used, "rewritten": {Path(k).name: v for k, v in REWRITTEN.items()}, "numpy": np.__version__,
            "cv2": cv2.__version__, "ipp": bool(cv2.ipp.useIPP()), "threads": torch.get_num_threads()}
    (args.out / "info.json").write_text(json.dumps(info))
    print(json.dumps(info), flush=True)
    for path in _images(args.images, args.limit):
        if (args.out / f"{path.stem}.npz").exists():
            continue  # done by an earlier run into the same folder
        t0 = time.perf_counter()
        row = detections(net, str(path), path.stem)
        seconds = time.perf_counter() - t0
        im = cv2.imread(str(path))
        blobs, scales = test._get_blobs(im, None)
        rois = net.blobs["rois"].data
        cls_prob = net.blobs["cls_prob"].data
        # the reference's own max_conf (get_detections_from_im keeps it local): for the diagnosis only
        cls_boxes = rois[:, 1:5] / scales[0]
        max_conf = np.zeros(rois.shape[0])
        for c in range(1, cls_prob.shape[1]):
            sc = cls_prob[:, c]
            keep = np.array(ref_nms(np.hstack((cls_boxes, sc[:, None])).astype(np.float32), cfg.TEST.NMS))
            max_conf[keep] = np.where(sc[keep] > max_conf[keep], sc[keep], max_conf[keep])
        np.savez(args.out / f"{path.stem}.npz", seconds=seconds, scale=scales[0], size=np.array(im.shape[:2]),
                 max_conf=max_conf, blob=blobs["data"][0].transpose(1, 2, 0), rois=rois[:, 1:5].copy(),
                 res4b22=net.blobs["res4b22"].data[0], rpn_cls_prob_reshape=net.blobs["rpn_cls_prob_reshape"].data[0],
                 rpn_bbox_pred=net.blobs["rpn_bbox_pred"].data[0], **decode_row(row))
        print(f"{path.name}: {seconds:.1f} s", flush=True)
    return 0


def run_ours(args) -> int:
    """Our regions as the job makes them (the decode task's blob, `Detector.regions`), and our stages'
    tensors for the diagnosis: per image an .npz."""
    from xmodal.extract.images import decode
    from xmodal.extract.pipeline import prepare_blob
    from xmodal.models.butd.image import PreparedImage
    from xmodal.models.butd.proposals import proposal_layer
    from xmodal.models.butd.weights import load_detector

    torch.set_num_threads(args.threads or torch.get_num_threads())
    detector = load_detector(args.weights).eval()
    cfg = detector.cfg
    args.out.mkdir(parents=True, exist_ok=True)
    for path in _images(args.images, args.limit):
        if (args.out / f"{path.stem}.npz").exists():
            continue  # done by an earlier run into the same folder
        t0 = time.perf_counter()
        im, why = decode(path.read_bytes())
        if im is None:
            raise SystemExit(f"error: {path}: {why}")
        blob, scale = prepare_blob(im, cfg.input)
        with torch.inference_mode():
            one = detector.regions([PreparedImage(torch.from_numpy(blob.copy()), scale, im.shape[0],
                                                  im.shape[1])]).images()[0]
            seconds = time.perf_counter() - t0
            x = torch.from_numpy(blob.copy()).permute(2, 0, 1)[None].contiguous()
            features = detector.backbone(x)
            prob, deltas = detector.rpn(features)
            rois, _, kept, _ = proposal_layer(prob, deltas, tuple(x.shape[2:]), torch.tensor([scale], dtype=torch.float32),
                                              cfg.rpn, cfg.box_offset, "sequential")
        np.savez(args.out / f"{path.stem}.npz", seconds=seconds, scale=scale, blob=blob, res4b22=features[0].numpy(),
                 rpn_cls_prob_reshape=prob[0].numpy(), rpn_bbox_pred=deltas[0].numpy(), rois=rois[0][kept[0]].numpy(),
                 boxes=one.boxes.numpy(), features=one.features.numpy(), obj=one.obj_ids.numpy(),
                 attr=one.attr_ids.numpy(), obj_conf=one.obj_conf.numpy(), attr_conf=one.attr_conf.numpy())
        print(f"{path.name}: {seconds:.1f} s", flush=True)
    return 0


def _maxdiff(a, b) -> float | None:
    if a is None or b is None or a.shape != b.shape:
        return None
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max()) if a.size else 0.0


STAGES = ("blob", "res4b22", "rpn_cls_prob_reshape", "rpn_bbox_pred", "rois")


def compare_one(ref, ours, stages: bool) -> dict:
    k = len(ref["boxes"])
    n = min(k, len(ours["boxes"]))
    same = [i for i in range(n) if np.array_equal(ref["boxes"][i], ours["boxes"][i])]
    ref_set = {tuple(b) for b in ref["boxes"].astype(np.float32).tolist()}
    max_conf = ref["max_conf"]
    order = np.argsort(max_conf)[::-1]
    row = {
        "num_boxes": [k, len(ours["boxes"])],
        "identical": len(same),
        "within_0.001": sum(i < n and float(np.abs(ref["boxes"][i].astype(np.float64) - ours["boxes"][i]).max()) <= 1e-3
                            for i in range(k)),
        "in_both": sum(tuple(b) in ref_set for b in ours["boxes"].astype(np.float32).tolist()),
        "max_box_diff": _maxdiff(ref["boxes"], ours["boxes"]),
        "max_feature_diff": _maxdiff(ref["features"][same], ours["features"][same]) if same else None,
        "obj_agree": int((ref["obj"][same] == ours["obj"][same]).sum()),
        "attr_agree": int((ref["attr"][same] == ours["attr"][same]).sum()),
        "max_conf_diff": _maxdiff(ref["obj_conf"][same], ours["obj_conf"][same]) if same else None,
        # equal max_conf at the 36-box cut: there the order is numpy's unstable argsort's choice
        "tie_at_cut": bool(k < len(order) and max_conf[order[k - 1]] == max_conf[order[k]]),
        "equal_proposal_scores": None,
    }
    if stages:
        row["stages"] = {s: _maxdiff(ref[s], ours[s]) for s in STAGES}
        ref_rois = {tuple(b) for b in ref["rois"].tolist()}
        row["rois_in_both"] = sum(tuple(b) in ref_rois for b in ours["rois"].tolist())  # of the 300, in any order
        row["rois_same_order"] = bool(np.array_equal(ref["rois"], ours["rois"]))
        scores = ref["rpn_cls_prob_reshape"][ref["rpn_cls_prob_reshape"].shape[0] // 2:].ravel()
        top = np.sort(scores)[::-1][:6000]
        row["equal_proposal_scores"] = int(len(top) - len(np.unique(top)))
    return row


def compare(args) -> int:
    info = json.loads((args.ref / "info.json").read_text())
    tsv = read_tsv(args.tsv) if args.tsv else None
    rows = []
    for path in sorted(args.ref.glob("*.npz")):
        ref = dict(np.load(path))
        ours = tsv[path.stem] if tsv is not None else dict(np.load(args.ours / path.name))
        row = {"image": path.stem, "size": ref["size"].tolist(), "scale": float(ref["scale"]),
               **compare_one(ref, ours, tsv is None), "ref_s": round(float(ref["seconds"]), 1),
               "ours_s": None if tsv is not None else round(float(ours["seconds"]), 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    summary = {"images": len(rows), "all_identical": sum(r["identical"] == r["num_boxes"][0] for r in rows), **info}
    print(json.dumps(summary))
    if args.out:
        args.out.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    ph = sub.add_parser("photos", help="write the photograph set")
    ph.add_argument("out", type=Path)
    w = sub.add_parser("weights", help="write random weights in the detectron2 pickle layout")
    w.add_argument("out", type=Path)
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--logit-scale", type=float, default=1.0)
    w.add_argument("--rpn-size-bias", type=float, default=0.0)
    for name, helptext in (("reference", "run the reference (under numpy 1.x)"), ("ours", "run our detector")):
        r = sub.add_parser(name, help=helptext)
        if name == "reference":
            r.add_argument("--reference", type=Path, required=True, help="a checkout of peteanderson80/bottom-up-attention")
            r.add_argument("--lxmert-script", type=Path, required=True,
                           help="airsplay/lxmert's data/mscoco_imgfeat/extract_coco_image.py (get_detections_from_im, 36 boxes)")
        r.add_argument("--weights", type=Path, required=True, help="a detectron2-layout pickle")
        r.add_argument("images", type=Path)
        r.add_argument("--out", type=Path, required=True, help="a folder: one .npz per image")
        r.add_argument("--limit", type=int, default=0)
        r.add_argument("--threads", type=int, default=0)
    c = sub.add_parser("compare", help="the table: the reference's run against ours (or our extraction's TSV)")
    c.add_argument("ref", type=Path)
    c.add_argument("ours", type=Path, nargs="?")
    c.add_argument("--tsv", type=Path, help="our extraction's TSV (jobs/extract.py --format tsv) in place of `ours`")
    c.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    if a.cmd == "photos":
        if a.out.exists():
            shutil.rmtree(a.out)
        for row in make_photos(a.out):
            print(json.dumps(row))
        return 0
    if a.cmd == "weights":
        write_weights(a.out, a.seed, a.logit_scale, a.rpn_size_bias)
        return 0
    if a.cmd == "reference":
        return run_reference(a)
    if a.cmd == "ours":
        return run_ours(a)
    if a.ours is None and a.tsv is None:
        p.error("compare: give OURS (a folder of `ours`) or --tsv")
    return compare(a)


if __name__ == "__main__":
    sys.exit(main())
