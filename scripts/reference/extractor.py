"""Our extraction against the reference's own Python code, image by image, without Caffe.

The reference is peteanderson80/bottom-up-attention run as LXMERT's `extract_coco_image.py` (airsplay/
lxmert) runs it: `get_detections_from_im` (36 boxes) -> `fast_rcnn/test.py: im_detect, _get_blobs,
_get_image_blob` -> the net of `models/vg/ResNet-101/faster_rcnn_end2end_final/test.prototxt` with the
config of `experiments/cfgs/faster_rcnn_end2end_resnet.yml`, whose Python layer is the reference's own
`rpn/proposal_layer.py` (with `generate_anchors.py`, `fast_rcnn/bbox_transform.py`, `nms_wrapper.py`) and
whose NMS is the reference's `nms/cpu_nms.pyx` once built (else its `nms/py_cpu_nms.py`, which keeps a
box at an overlap exactly equal to the threshold where cpu_nms drops it). All those files are imported
from the given checkouts, unchanged (common.py); Caffe is the stand-in of caffe.py. The proposal
layer's call of `nms` is watched to record the candidates in the order NMS visits them (for the
comparison's tie proof).

numpy: the reference ran under numpy <= 1.16 (Python 2), whose float32 exp was libm's expf and whose
arithmetic promoted by value. `reference` refuses numpy 2 (under NEP 50 the LXMERT script's
`rois[:, 1:5] / im_scales[0]` is float64); run it with a numpy 1.x on PYTHONPATH and NPY_DISABLE_CPU_FEATURES
naming numpy's AVX2 / AVX-512 targets, whose float32 exp differs from libm's in the last bit of 40 % of
values (info.json records the share measured in the run).

    python scripts/reference/extractor.py photos PHOTOS                  # the photographs (photos.py)
    python scripts/reference/extractor.py weights W.pkl [--net resnet101|tiny] [--seed 0] [--rpn-size-bias 1.75]
    NPY_DISABLE_CPU_FEATURES="AVX512F ... FMA3 AVX2" PYTHONPATH=NUMPY_1_DIR:platform \\
        python scripts/reference/extractor.py reference --reference BUA --lxmert-script extract_coco_image.py \\
        --weights W.pkl PHOTOS --out REF                                 # one .npz per image
    python scripts/reference/extractor.py ours --weights W.pkl PHOTOS --out OURS [--batch-size 8]
    python scripts/reference/extractor.py compare REF OURS [--out table.json]   # or: compare REF --tsv OURS.tsv
    python scripts/reference/extractor.py keep REF --out expected.npz    # a run's regions, small, for a test

`ours` runs the job's own code without Ray: its decode task (`pipeline.decode_batch`: OpenCV's decode and
the input blob) and its detector actor (`pipeline.DetectorActor`) on batches of `--batch-size` images in
name order (1: one at a time; more: images of several sizes in one batch, as the job batches them).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a file: the repository's root makes `scripts.reference` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from scripts.reference import common  # noqa: E402
from scripts.reference.common import Parser, UserError  # noqa: E402

PROG = "extractor.py"
TINY, FULL = "tiny", "resnet101"
KEPT = ("boxes", "features", "obj", "attr", "obj_conf", "attr_conf", "max_conf", "rois", "candidates", "scale", "size")


# ============================================================================ weights


def write_weights(path: Path, net: str, seed: int, logit_scale: float, rpn_size_bias: float) -> None:
    """A random detector in the detectron2 pickle layout (the reference's ResNet-101, or the tiny net of
    the same structure: one block a stage, narrow).

    logit_scale multiplies the class and attribute logits (confidences neither near-uniform nor
    saturated at 1.0: at 1.0 in float32 the reference's order among them is its unstable sort's).
    rpn_size_bias is added to every anchor's dw and dh: the random RPN's boxes grow by e^bias, overlap
    more, and its NMS keeps fewer than 300 proposals, which makes res5 (nearly all the time) cheaper."""
    from xmodal.models.butd.detector import DetectorConfig, random_detector
    from xmodal.models.butd.weights import save_in_layout

    cfg = DetectorConfig.tiny() if net == TINY else DetectorConfig()
    sd = {k: v.clone() for k, v in random_detector(cfg, seed).state_dict().items()}
    for key in ("head.cls_score.weight", "head.cls_score.bias", "head.attr_score.weight", "head.attr_score.bias"):
        sd[key] *= logit_scale
    sd["rpn.deltas.bias"].reshape(-1, 4)[:, 2:] += rpn_size_bias
    save_in_layout(sd, "detectron2", path)


def net_of(weights: Path) -> str:
    """Which net a detectron2 pickle holds: the reference's 23 res4 blocks or the tiny net's one."""
    from xmodal.models.butd.weights import WeightsError, _read_file

    try:
        kind, tensors = _read_file(weights)
    except WeightsError as e:
        raise UserError(f"--weights: {e}") from None
    if kind != "pickle" or "backbone.res4.0.conv1.weight" not in tensors:
        raise UserError(f"--weights {str(weights)!r}: not a detectron2-layout pickle of the detector (write one "
                        f"with `{PROG} weights`)")
    return FULL if "backbone.res4.22.conv1.weight" in tensors else TINY


def identity(weights: Path) -> dict:
    from xmodal.core.checkpoint import sha256_of

    return {"weights": weights.name, "weights_sha256": sha256_of(weights)}


# ============================================================================ the two runs


def _resume(out, info: dict) -> list[str]:
    """The images this command's own earlier run into `out` did with the same weights and environment (their
    .npz files); an earlier run with other weights or another numpy is refused, naming the difference."""
    files = common.earlier(out)
    if not files:
        return []
    before = json.loads((out.path / "info.json").read_text()) if "info.json" in files else {}
    for key in ("weights_sha256", "net", "numpy", "cv2", "npy_disable_cpu_features", "nms", "batch_size"):
        if key in info and before.get(key) != info[key]:
            raise UserError(f"--out {str(out.path)!r}: holds an earlier run with {key} {before.get(key)!r}, not "
                            f"{info[key]!r}; choose a new folder (nothing there is changed)")
    return [f for f in files if f.endswith(".npz")]


def _carry(out, stage, done: list[str]) -> None:
    for name in done:
        os.link(out.path / name, stage.tmp / name)


def install_reference(reference: Path, lxmert_script: Path):
    """The reference importable under Python 3 with the stand-ins -> (cfg, get_detections_from_im, test, nms
    used, the `Watch` of its NMS calls)."""
    from scripts.reference import caffe

    common.python2_runtime()
    caffe.install()
    # the C++/CUDA extensions of lib/: gpu_nms and cython_bbox are not on this path
    common.stand_in("nms.gpu_nms", gpu_nms=lambda *a, **k: (_ for _ in ()).throw(RuntimeError("USE_GPU_NMS is False")))
    common.stand_in("utils.cython_bbox", bbox_overlaps=None)
    lib = reference / "lib"
    common.import_from([lib, lib / "rpn", reference / "tools"])
    sys.path[:0] = [str(lib), str(lib / "rpn")]  # proposal_layer's Python 2 implicit `from generate_anchors import`
    import importlib

    try:
        importlib.import_module("nms.cpu_nms")
        nms_used = "cpu_nms (lib/nms/cpu_nms.pyx, built)"
    except ImportError:
        py = importlib.import_module("nms.py_cpu_nms")
        common.stand_in("nms.cpu_nms", cpu_nms=py.py_cpu_nms, cpu_soft_nms=None)
        nms_used = "py_cpu_nms (lib/nms/py_cpu_nms.py; cpu_nms not built)"
    config = importlib.import_module("fast_rcnn.config")
    config.cfg_from_file(str(reference / "experiments/cfgs/faster_rcnn_end2end_resnet.yml"))
    test = importlib.import_module("fast_rcnn.test")
    layer = importlib.import_module("rpn.proposal_layer")
    script = common.load_file("extract_coco_image", lxmert_script)
    watch = Watch(layer.nms, script.nms)
    layer.nms, script.nms = watch.proposals, watch.per_class
    return config.cfg, script.get_detections_from_im, test, nms_used, watch


class Watch:
    """The reference's NMS calls, watched: the proposal layer's candidates in the order cpu_nms visits them
    (it sorts what it is given once more, by the same numpy argsort, deterministic for one input, which
    orders equal scores anew), and each class's scores and kept boxes in `get_detections_from_im`, from
    which its max_conf (a local there) is rebuilt with its own arithmetic."""

    def __init__(self, layer_nms, script_nms):
        self.layer_nms, self.script_nms = layer_nms, script_nms
        self.candidates: list[np.ndarray] = []
        self.classes: list[tuple[np.ndarray, np.ndarray]] = []

    def clear(self) -> None:
        self.candidates.clear()
        self.classes.clear()

    def proposals(self, dets, thresh, *a, **k):
        d = np.asarray(dets, np.float32)
        self.candidates.append(d[d[:, 4].argsort()[::-1]].copy())
        return self.layer_nms(dets, thresh, *a, **k)

    def per_class(self, dets, thresh, *a, **k):
        keep = self.script_nms(dets, thresh, *a, **k)
        self.classes.append((np.asarray(dets)[:, 4].copy(), np.asarray(keep, dtype=np.int64)))
        return keep

    def max_conf(self, n: int) -> np.ndarray:
        max_conf = np.zeros(n)
        for scores, keep in self.classes:
            max_conf[keep] = np.where(scores[keep] > max_conf[keep], scores[keep], max_conf[keep])
        return max_conf


def run_reference(a) -> int:
    """The reference over the images: per image an .npz of its TSV row's arrays and its intermediate blobs."""
    import cv2

    from scripts.reference import caffe

    common.require_numpy1("under NEP 50 its `rois[:, 1:5] / im_scales[0]` is float64 and its boxes change")
    net_kind = net_of(a.weights)
    torch.set_num_threads(a.threads or torch.get_num_threads())
    info = {"command": "reference", "net": net_kind, **identity(a.weights),
            "numpy_float32_exp_not_correctly_rounded": common.float32_exp_off(),
            "npy_disable_cpu_features": os.environ.get("NPY_DISABLE_CPU_FEATURES", ""), "numpy": np.__version__,
            "cv2": cv2.__version__, "ipp": bool(cv2.ipp.useIPP()), "threads": torch.get_num_threads()}
    _, detections, test, nms_used, watch = install_reference(a.reference.resolve(), a.lxmert_script.resolve())
    info.update(nms=nms_used, rewritten={Path(k).name: v for k, v in common.REWRITTEN.items()})
    done = _resume(a.output, info)

    net = caffe.Net(str(a.reference / "models/vg/ResNet-101/faster_rcnn_end2end_final/test.prototxt"), caffe.TEST,
                    weights=str(a.weights))
    print(json.dumps(info), flush=True)
    with a.output.stage() as stage:
        _carry(a.output, stage, done)
        (stage.tmp / "info.json").write_text(json.dumps(info))
        with common.kept_on_interrupt(stage):
            _reference_images(a, stage, done, detections, test, net, watch)
        stage.publish()
    return 0


def _reference_images(a, stage, done, detections, test, net, watch) -> None:
    import cv2

    from scripts.reference.compare import decode_row

    for path in a.image_paths:
        if f"{path.stem}.npz" in done:
            continue
        watch.clear()
        t0 = time.perf_counter()
        row = detections(net, str(path), path.stem)
        seconds = time.perf_counter() - t0
        im = cv2.imread(str(path))
        blobs, scales = test._get_blobs(im, None)
        rois = net.blobs["rois"].data
        common.save_npz(stage.tmp / f"{path.stem}.npz", seconds=seconds, scale=scales[0], size=np.array(im.shape[:2]),
                        max_conf=watch.max_conf(rois.shape[0]), blob=blobs["data"][0].transpose(1, 2, 0),
                        rois=rois[:, 1:5].copy(), candidates=watch.candidates[0], backbone=net.blobs[net.res4].data[0],
                        rpn_cls_prob_reshape=net.blobs["rpn_cls_prob_reshape"].data[0],
                        rpn_bbox_pred=net.blobs["rpn_bbox_pred"].data[0], **decode_row(row))
        print(f"{path.name}: {seconds:.1f} s", flush=True)


@torch.no_grad()
def _stages(detector, blob: np.ndarray, scale: float) -> dict:
    """Our stages' tensors of one image, for the diagnosis: the backbone, the RPN, the candidates of the
    proposal NMS (boxes and scores in the order it visits them), the rois."""
    from xmodal.models.butd.boxes import big_enough, clip, decode, descending_order
    from xmodal.models.butd.proposals import proposal_layer

    cfg = detector.cfg
    x = torch.from_numpy(blob.copy()).permute(2, 0, 1)[None].contiguous()
    features = detector.backbone(x)
    prob, deltas = detector.rpn(features)
    rois, _, kept, _ = proposal_layer(prob, deltas, tuple(x.shape[2:]), torch.tensor([scale], dtype=torch.float32),
                                      cfg.rpn, cfg.box_offset, "sequential")
    from xmodal.models.butd.anchors import generate_anchors, shifted_anchors

    a = cfg.rpn.num_anchors
    anchors = shifted_anchors(prob.shape[2], prob.shape[3], cfg.rpn.feat_stride,
                              generate_anchors(cfg.rpn.feat_stride, cfg.rpn.anchor_ratios, cfg.rpn.anchor_scales))
    props = clip(decode(anchors, deltas[0].permute(1, 2, 0).reshape(-1, 4)), float(x.shape[2]), float(x.shape[3]))
    scores = prob[0, a:].permute(1, 2, 0).reshape(-1)
    ok = big_enough(props, torch.tensor(scale, dtype=torch.float32) * cfg.rpn.min_size)
    order = descending_order(torch.where(ok, scores, torch.full_like(scores, -1.0)))[:cfg.rpn.pre_nms_top_n]
    order = order[ok[order]]
    return {"blob": blob, "backbone": features[0].numpy(), "rpn_cls_prob_reshape": prob[0].numpy(),
            "rpn_bbox_pred": deltas[0].numpy(), "rois": rois[0][kept[0]].numpy(),
            "candidates": torch.cat((props[order], scores[order, None]), dim=1).numpy()}


def run_ours(a) -> int:
    """Our regions as the job makes them (its decode task and detector actor, batches of --batch-size), and our
    stages' tensors for the diagnosis: per image an .npz."""
    from xmodal.extract.pipeline import DetectorActor, DetectorSpec
    from xmodal.models.butd.detector import DetectorConfig

    net_kind = net_of(a.weights)
    torch.set_num_threads(a.threads or torch.get_num_threads())
    info = {"command": "ours", "net": net_kind, **identity(a.weights), "batch_size": a.batch_size,
            "threads": torch.get_num_threads(), "numpy": np.__version__}
    done = _resume(a.output, info)
    spec = DetectorSpec(DetectorConfig.tiny() if net_kind == TINY else DetectorConfig(), weights=str(a.weights))
    actor = DetectorActor(spec)
    todo = [p for p in a.image_paths if f"{p.stem}.npz" not in done]
    print(json.dumps(info), flush=True)
    with a.output.stage() as stage, torch.inference_mode():
        _carry(a.output, stage, done)
        (stage.tmp / "info.json").write_text(json.dumps(info))
        with common.kept_on_interrupt(stage):
            for start in range(0, len(todo), a.batch_size):
                _our_batch(todo[start:start + a.batch_size], spec, actor, stage)
        stage.publish()
    return 0


def _our_batch(group: list[Path], spec, actor, stage) -> None:
    """One batch through the job's decode task and detector actor; per image its regions and stages."""
    import pyarrow as pa

    from xmodal.extract.pipeline import decode_batch

    stats = [p.stat() for p in group]  # what the job's items carry on to its write tasks (pipeline.CARRIED)
    table = pa.table({"path": [str(p) for p in group], "img_id": [p.stem for p in group], "given": [b""] * len(group),
                      "source": [p.name for p in group], "size": [s.st_size for s in stats],
                      "mtime": [s.st_mtime_ns for s in stats]})
    t0 = time.perf_counter()
    decoded = decode_batch(table, "opencv", spec.cfg.input)
    found = actor(decoded)
    seconds = (time.perf_counter() - t0) / len(group)
    for i, row in enumerate(decoded.to_pylist()):
        if row["reject"]:
            raise UserError(f"{group[i]}: the extraction rejects it ({row['reject']})")
        k = int(found["num_boxes"][i])
        blob = np.frombuffer(row["pixels"], np.float32).reshape(row["bh"], row["bw"], 3)
        common.save_npz(stage.tmp / f"{group[i].stem}.npz", seconds=seconds, scale=row["scale"],
                        size=np.array([row["h"], row["w"]]), **_stages(actor.detector, blob, row["scale"]),
                        boxes=found["boxes"][i, :k], features=found["features"][i, :k], obj=found["obj_ids"][i, :k],
                        attr=found["attr_ids"][i, :k], obj_conf=found["obj_conf"][i, :k],
                        attr_conf=found["attr_conf"][i, :k])
    print(f"{', '.join(p.name for p in group)}: {seconds:.1f} s an image", flush=True)


# ============================================================================ the comparison and the kept file


def read_run(option: str, path: Path) -> tuple[str, dict[str, dict]]:
    """('reference' | 'ours' | 'keep', {image: arrays}) of a run's folder or a `keep` file."""
    from scripts.reference.compare import load_run

    if path.is_file() and path.suffix == ".npz":
        try:
            with np.load(path) as z:
                flat = {k: z[k] for k in z.files}
            kept = json.loads(bytes(flat.pop("__info__")).decode())
        except (OSError, ValueError, KeyError) as e:
            raise UserError(f"{option} {str(path)!r}: not a file `{PROG} keep` wrote ({type(e).__name__})") from None
        runs: dict[str, dict] = {}
        for key, value in flat.items():
            image, _, field = key.partition("/")
            runs.setdefault(image, {})[field] = value
        return kept["kind"], runs
    common.existing_folder(option, path, f"a folder `{PROG} reference` or `{PROG} ours` wrote, or a `keep` file")
    made_by = common.command_of(path)
    if made_by not in (f"{PROG} reference", f"{PROG} ours"):
        raise UserError(f"{option} {str(path)!r}: holds no run of `{PROG} reference` or `{PROG} ours` (no record of "
                        "one there); give the folder such a run wrote")
    return made_by.split()[-1], load_run(path)


def run_compare(a) -> int:
    from scripts.reference.compare import compare_one, read_tsv

    ref_kind, ref = read_run("REF", a.ref)
    if a.tsv is not None:
        ours_kind, ours = "tsv", read_tsv(common.existing_file("--tsv", a.tsv, "an extraction's TSV"), "--tsv")
    else:
        ours_kind, ours = read_run("OURS", a.ours)
    if ref_kind == "ours" and ours_kind == "reference":
        raise UserError(f"REF {str(a.ref)!r} is a run of `ours` and OURS {str(a.ours)!r} one of `reference`: the "
                        "arguments are swapped; give the reference's run first")
    for side, mine, other in (("OURS", ref, ours), ("REF", ours, ref)):
        missing = sorted(set(mine) - set(other))
        if missing:
            raise UserError(f"{side} has no image {missing[0]!r}{f' (and {len(missing) - 1} more)' if len(missing) > 1 else ''}"
                            f" that the other run has; compare runs over the same images")
    rows = []
    for image in sorted(ref):
        row = {"image": image, "size": np.asarray(ref[image]["size"]).tolist(), "scale": float(ref[image]["scale"]),
               **compare_one(ref[image], ours[image])}
        rows.append(row)
        print(json.dumps(row), flush=True)
    summary = {"images": len(rows), **{v: sum(r["verdict"] == v for r in rows) for v in ("identical", "tie", "DIFFERS")}}
    print(json.dumps(summary), flush=True)
    if a.output is not None:
        with a.output.stage() as stage:
            stage.tmp.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1) + "\n")
            stage.publish()
    return 1 if summary["DIFFERS"] else 0


def run_keep(a) -> int:
    """A run's regions and selection stages (no network blobs) in one small .npz, for a test to compare against."""
    kind, runs = read_run("RUN", a.run)
    flat = {f"{image}/{k}": v for image, arrays in runs.items() for k, v in arrays.items() if k in KEPT}
    info = json.loads((a.run / "info.json").read_text()) if (a.run / "info.json").is_file() else {}
    with a.output.stage() as stage:
        with open(stage.tmp, "wb") as f:
            np.savez_compressed(f, __info__=np.frombuffer(json.dumps({"kind": kind, **info}).encode(), np.uint8), **flat)
        stage.publish()
    print(f"kept {len(runs)} images of {a.run} in {a.output.path}")
    return 0


def run_photos(a) -> int:
    from scripts.reference.photos import make

    with a.output.stage() as stage:
        rows = make(stage.tmp)
        stage.publish()
    for row in rows:
        print(json.dumps(row))
    return 0


def run_weights(a) -> int:
    with a.output.stage() as stage:
        write_weights(stage.tmp, a.net, a.seed, a.logit_scale, a.rpn_size_bias)
        stage.publish()
    return 0


# ============================================================================ the command line


def parser() -> Parser:
    p = Parser(prog=PROG, description=(__doc__ or "").split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=Parser)
    ph = sub.add_parser("photos", help="write the photographs (a new or empty folder)")
    ph.add_argument("out", type=Path)
    w = sub.add_parser("weights", help="write random weights in the detectron2 pickle layout")
    w.add_argument("out", type=Path)
    w.add_argument("--net", choices=(FULL, TINY), default=FULL,
                   help="the reference's ResNet-101, or a tiny net of the same structure (one block a stage)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--logit-scale", type=float, default=1.0)
    w.add_argument("--rpn-size-bias", type=float, default=0.0)
    w.add_argument("--overwrite", action="store_true", help="replace an existing file")
    for name, text in (("reference", "run the reference (under numpy 1.x)"), ("ours", "run our detector as the job does")):
        r = sub.add_parser(name, help=text)
        if name == "reference":
            r.add_argument("--reference", type=Path, required=True, help="a checkout of peteanderson80/bottom-up-attention")
            r.add_argument("--lxmert-script", type=Path, required=True,
                           help="airsplay/lxmert's data/mscoco_imgfeat/extract_coco_image.py (get_detections_from_im, 36 boxes)")
        else:
            r.add_argument("--batch-size", type=int, default=1, help="images per detector call, as the job's batches (1-64)")
        r.add_argument("--weights", type=Path, required=True, help="a detectron2-layout pickle (`weights`)")
        r.add_argument("images", type=Path, help="a folder of images")
        r.add_argument("--out", type=Path, required=True,
                       help="a folder: one .npz per image (new, empty, or this command's earlier run: its images are kept)")
        r.add_argument("--limit", type=int, default=0, help="the first N images by name (0: all)")
        r.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    c = sub.add_parser("compare", help="the table: the reference's run against ours (or our extraction's TSV)")
    c.add_argument("ref", type=Path, help="a run's folder (reference or ours) or a `keep` file")
    c.add_argument("ours", type=Path, nargs="?", help="a run's folder (ours or reference) or a `keep` file")
    c.add_argument("--tsv", type=Path, help="our extraction's TSV (jobs/extract.py --format tsv) in place of OURS")
    c.add_argument("--out", type=Path, help="write the table as JSON to this new file")
    c.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    k = sub.add_parser("keep", help="a run's regions in one small .npz (the expected output a test compares with)")
    k.add_argument("run", type=Path)
    k.add_argument("--out", type=Path, required=True, help="a new .npz file")
    k.add_argument("--overwrite", action="store_true", help="replace an existing --out file")
    return p


def check(a) -> None:
    """Every argument checked before any work; sets a.output (the output policy's Output) and a.image_paths."""
    name = f"{PROG} {a.cmd}"
    if a.cmd == "weights":
        common.integer("--seed", a.seed, 0, 2**31 - 1)
        common.real("--logit-scale", a.logit_scale, 0.0, 1e4, open_low=True)
        common.real("--rpn-size-bias", a.rpn_size_bias, -10.0, 10.0)
        a.output = common.output(a.out, "OUT", name, file=True, overwrite=a.overwrite)
    elif a.cmd == "photos":
        a.output = common.output(a.out, "OUT", name)
    elif a.cmd in ("reference", "ours"):
        common.integer("--limit", a.limit, 0, meaning=" (0: all images)")
        common.integer("--threads", a.threads, 0, 1024, " (0: torch's default)")
        if a.cmd == "ours":
            common.integer("--batch-size", a.batch_size, 1, 64)
        else:
            common.existing_folder("--reference", a.reference, "a checkout of peteanderson80/bottom-up-attention",
                                   ("lib/fast_rcnn/test.py", "lib/rpn/proposal_layer.py",
                                    "experiments/cfgs/faster_rcnn_end2end_resnet.yml",
                                    "models/vg/ResNet-101/faster_rcnn_end2end_final/test.prototxt"))
            common.existing_file("--lxmert-script", a.lxmert_script, "airsplay/lxmert's extract_coco_image.py")
            if "def get_detections_from_im" not in a.lxmert_script.read_text(errors="replace"):
                raise UserError(f"--lxmert-script {str(a.lxmert_script)!r}: defines no get_detections_from_im; "
                                "expected airsplay/lxmert's data/mscoco_imgfeat/extract_coco_image.py")
        common.existing_file("--weights", a.weights, f"a detectron2-layout pickle (`{PROG} weights`)")
        a.image_paths = common.images_in("IMAGES", a.images, a.limit)
        if a.out.resolve() == a.images.resolve():
            raise UserError(f"--out {str(a.out)!r} is the IMAGES folder; choose a new folder for the run")
        a.output = common.output(a.out, "--out", name)
    elif a.cmd == "compare":
        if (a.ours is None) == (a.tsv is None):
            raise UserError("compare: give OURS (a run's folder) or --tsv (an extraction's TSV), one of the two")
        for option, path in (("REF", a.ref), ("OURS", a.ours)):
            if path is not None and not path.exists():
                raise UserError(f"{option} {str(path)!r}: does not exist; expected a run's folder or a `keep` file")
        a.output = None if a.out is None else common.output(a.out, "--out", name, file=True, overwrite=a.overwrite)
    else:
        if not (a.run.is_dir() or a.run.is_file()):
            raise UserError(f"RUN {str(a.run)!r}: does not exist; expected a folder `{PROG} reference` or `ours` wrote")
        a.output = common.output(a.out, "--out", name, file=True, overwrite=a.overwrite)


COMMANDS = {"photos": run_photos, "weights": run_weights, "reference": run_reference, "ours": run_ours,
            "compare": run_compare, "keep": run_keep}


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    check(a)
    return COMMANDS[a.cmd](a)


if __name__ == "__main__":
    sys.exit(common.command(main))
