"""Region-feature extraction throughput: the bottom-up-attention detector (`xmodal.models.butd`).

    python jobs/benchmark.py extract [--device cpu|cuda] [--config reference|tiny] [--images N]
                                     [--batch K] [--size HxW] [--input-size SHORT:MAX] [--threads T]
                                     [--job-images N] [--out DIR]

Rows, each over the same N synthetic images of one size (COCO's typical 480 x 640 by default):
- batched (K images per `Detector.detect` call: one backbone call for images of one input size, the
  RoI head over all their regions) vs one image at a time (the reference's way), each in fp32 (the
  exact mode: TF32 off), bf16 (backbone and heads under bfloat16 autocast) and, on a GPU, tf32:
  images/s of one detector (one actor), peak memory, the seconds per stage (prepare, backbone, rpn,
  roi_pool, head, select, to_host) from `DetectOptions.stats`, and the region slots per image
  that res5 ran over;
- host work per image: the operations the detector dispatches per image at the row's batch (counted
  on the meta device, where nothing computes), kernels and views, and host ms per image = operations
  times this machine's cost of one eager dispatch (timed in the run; a GPU adds its launch per kernel);
- FLOP rate: the detector's FLOPs per image (counted by torch's FlopCounterMode over the first
  batch: convolutions and matmuls) times images/s, as a fraction of this machine's own matmul rate
  (a square matmul timed in the same run, in the row's precision);
- decode: images/s of one CPU core reading JPEG bytes as the job's decode tasks do (`cv2.imdecode`)
  and preparing the network's input with OpenCV (`pipeline.prepare_blob`: means, `cv2.resize`);
- the job (`extract_job.job_row`): `jobs/extract.py`'s whole path over `--job-images` images, Ray Data,
  the write tasks and the commit: `driver per image: X ms CPU, Y bytes received` as the driver measures
  itself; one write task's MB/s and images/s on a shard of 256 images of the detector's output shape
  (`extract_job.write_row`).

The detector's weights are RANDOM: speed does not depend on their values, except the selection
(its NMS over 1,600 classes keeps more or fewer boxes per class), so its stage is indicative only.
Every line printed says so. GPU target: >= 100 images/s at 36 boxes (the reference pipeline:
about 5 images/s per GPU, docs/extract.md).
"""

from __future__ import annotations

import argparse
import dataclasses
import resource
import shutil
import time
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from xmodal.base.console import say
from xmodal.base.errors import UserError
from xmodal.models.butd.detector import DetectOptions, Detector, DetectorConfig, random_detector
from xmodal_bench import at_least, begin, cuda_arg, write_results

CONFIGS = {"reference": DetectorConfig, "tiny": DetectorConfig.tiny}
TARGET_IMAGES_S = 100.0  # one H200, 36 boxes
TAG = "[random weights]"
STAGES = ("prepare", "backbone", "rpn", "roi_pool", "head", "select", "to_host")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if available")
    p.add_argument("--config", default="reference", help=f"detector size: {', '.join(CONFIGS)}")
    p.add_argument("--images", type=int, default=None, help="images per row (default: 64 cuda, 2 cpu)")
    p.add_argument("--batch", type=int, default=None, help="images per extract call (default: 8 cuda, 2 cpu)")
    p.add_argument("--size", default="480x640", help="image height x width")
    p.add_argument("--input-size", default=None, metavar="SHORT:MAX",
                   help="the detector's input, as jobs/extract.py --input-size (default 600:1000, the reference's; "
                        "a small one makes a quick run on a CPU)")
    p.add_argument("--threads", type=int, default=0, help="CPU: torch.set_num_threads (0 = torch's default)")
    p.add_argument("--job-images", type=int, default=None,
                   help="images of the job's row: jobs/extract.py's whole path, Ray Data, write tasks, commit "
                        "(default: 1024 cuda, 64 cpu; 0: no job row)")
    p.add_argument("--out", default=None, help="folder for extract-<timestamp>.json and .md (default: print only)")
    p.add_argument("--work", default=None, help=argparse.SUPPRESS)


def _size(text: str) -> tuple[int, int]:
    try:
        h, w = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise UserError(f"--size {text!r}: expected HEIGHTxWIDTH, e.g. 480x640") from None
    if h < 1 or w < 1:
        raise UserError(f"--size {text!r}: expected positive sides")
    return h, w


def synthetic_images(n: int, size: tuple[int, int], seed: int = 0) -> list[torch.Tensor]:
    """n (H, W, 3) uint8 BGR images: smooth gradients plus noise (something a JPEG encoder works on)."""
    g = torch.Generator().manual_seed(seed)
    h, w = size
    ys = torch.linspace(0, 1, h)[:, None, None]
    xs = torch.linspace(0, 1, w)[None, :, None]
    out = []
    for _ in range(n):
        a = torch.rand(1, 1, 3, generator=g)
        base = 255 * (a * ys + (1 - a) * xs)
        out.append((base + 20 * torch.randn(h, w, 3, generator=g)).clamp(0, 255).to(torch.uint8))
    return out


def _peak_gib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # process peak RSS: monotone over rows


def matmul_tflops(device: torch.device, dtype: torch.dtype, n: int | None = None) -> float:
    """This machine's dense matmul rate (TFLOP/s): an n x n product, best of five after a warm-up."""
    n = n or (8192 if device.type == "cuda" else 2048)
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    best = float("inf")
    for i in range(6):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if i:
            best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e12


VIEW_OPS = {"aten.select.int", "aten.unsqueeze.default", "aten.slice.Tensor", "aten.view.default",
            "aten.expand.default", "aten.permute.default", "aten.transpose.int", "aten._unsafe_view.default",
            "aten.t.default", "aten.alias.default", "aten.as_strided.default", "aten.squeeze.dim", "aten.unbind.int",
            "aten.split.Tensor", "aten.split_with_sizes.default", "aten.detach.default"}


def host_work(cfg: DetectorConfig, size: tuple[int, int], batch: int) -> dict[str, float]:
    """The detector's host work per image at this batch, counted: `detect` on the meta device (shapes only)
    under a dispatch counter, operations split into kernels (a launch each on a GPU) and views (metadata
    only); and this machine's cost of one eager dispatch, timed on small CPU tensors, so that
    `host_ms_per_image` = operations x that cost (a GPU's launch adds its own few microseconds)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.kernels = self.views = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func) in VIEW_OPS:
                self.views += 1
            else:
                self.kernels += 1
            return func(*args, **(kwargs or {}))

    with torch.device("meta"):
        det = Detector(cfg).eval()
    images = [torch.zeros(*size, 3, dtype=torch.uint8, device="meta") for _ in range(batch)]
    with Count() as count:  # autocast has no meta device: fp32, whose operations bf16 adds only casts to
        det.detect(images, DetectOptions(backbone_batch=batch))
    a, b = torch.ones(64), torch.ones(64)
    t0 = time.perf_counter()
    for _ in range(5000):
        torch.add(a, b)
        torch.maximum(a, b)
    op_us = (time.perf_counter() - t0) / 10000 * 1e6
    return {"kernels_per_image": count.kernels / batch, "views_per_image": count.views / batch, "op_us": op_us,
            "host_ms_per_image": (count.kernels + count.views) * op_us / 1000 / batch}


def precisions(device: torch.device) -> tuple[str, ...]:
    return ("fp32", "tf32", "bf16") if device.type == "cuda" else ("fp32", "bf16")


def detector_rows(det, images: list[torch.Tensor], batch: int, device: torch.device,
                  peak_tflops: dict[str, float]) -> list[dict[str, Any]]:
    rows = []
    flops_per_image = 0.0
    for regions in ("batched", "per image"):
        for precision in precisions(device):
            step = batch if regions == "batched" else 1
            options = DetectOptions(precision=precision, backbone_batch=step)
            if not flops_per_image:  # counted once: the work per image is the same in every row
                counter = FlopCounterMode(display=False)
                with counter:
                    det.extract(images[:step], options)
                flops_per_image = counter.get_total_flops() / step
            det.extract(images[:step], options)  # warm-up: kernels, allocator
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            stages: dict[str, float] = {}
            t0 = time.perf_counter()
            boxes = 0
            for i in range(0, len(images), step):
                boxes += sum(r.boxes.shape[0] for r in det.extract(images[i:i + step],
                                                                    dataclasses.replace(options, stats=stages)))
            wall = time.perf_counter() - t0
            rois = stages.pop("regions")
            recomputed = stages.pop("recomputed", 0)  # images the window NMS could not certify: detected again
            row = {"regions": regions, "precision": precision,
                   "images": len(images), "batch": step, "images_s": len(images) / wall,
                   "s_per_image": wall / len(images), "boxes_per_image": boxes / len(images),
                   "rois_per_image": rois / len(images), "recomputed_share": recomputed / len(images),
                   **host_work(det.cfg, tuple(images[0].shape[:2]), step),
                   "peak_gib": _peak_gib(device), "stage_s_per_image": {k: v / len(images) for k, v in stages.items()}}
            say(f"  {TAG} {regions} (x{step}), {precision}: {row['images_s']:.2f} images/s "
                f"({1000 * row['s_per_image']:.0f} ms/image; host {row['kernels_per_image']:.0f} kernels + "
                f"{row['views_per_image']:.0f} views per image, {row['host_ms_per_image']:.1f} ms at "
                f"{row['op_us']:.1f} us each), "
                f"peak {row['peak_gib']:.2f} GiB")
            row["tflops"] = flops_per_image * row["images_s"] / 1e12
            row["flops_per_image"] = flops_per_image
            peak = peak_tflops["bf16" if precision == "bf16" else "fp32"]
            row["of_matmul"] = row["tflops"] / peak
            say(f"  {TAG}   {flops_per_image / 1e9:,.1f} GFLOP/image, {1000 * row['tflops']:.0f} GFLOP/s = "
                f"{100 * row['of_matmul']:.0f} % of this machine's {'bf16' if precision == 'bf16' else 'fp32'} "
                f"matmul rate ({1000 * peak:.0f} GFLOP/s)")
            rows.append(row)
    return rows


def precision_difference(det, images: list[torch.Tensor], batch: int, precision: str) -> dict[str, float]:
    """A fast mode against fp32 on the same images: how many of fp32's selected boxes it selects too, and on
    fp32's boxes (given to both) the features' relative L2 difference and the share of object and attribute
    ids that agree. With random weights the class scores are near ties, so the ids and the selection are
    more fragile than a trained head's: an upper bound on the disagreement."""
    kept = same_obj = same_attr = total = 0
    diff2 = norm2 = 0.0
    for i in range(0, len(images), batch):
        part = images[i:i + batch]
        exact = DetectOptions(precision="fp32", backbone_batch=batch)
        quick = dataclasses.replace(exact, precision=precision)
        full, fast = det.extract(part, exact), det.extract(part, quick)
        given = [r.boxes for r in full]
        on_full, ref = det.extract(part, quick, given_boxes=given), det.extract(part, exact, given_boxes=given)
        for f, h, a, b in zip(full, fast, on_full, ref, strict=True):
            kept += sum(bool((h.boxes == box).all(1).any()) for box in f.boxes)
            total += f.boxes.shape[0]
            diff2 += float((a.features.float() - b.features).square().sum())
            norm2 += float(b.features.square().sum())
            same_obj += int((a.obj_ids == b.obj_ids).sum())
            same_attr += int((a.attr_ids == b.attr_ids).sum())
    out = {"precision": precision, "boxes_kept": kept / total, "features_rel_l2": (diff2 / norm2) ** 0.5,
           "obj_ids_same": same_obj / total, "attr_ids_same": same_attr / total}
    say(f"  {TAG} {precision} vs fp32: {100 * out['boxes_kept']:.1f} % of fp32's boxes selected; on the same boxes "
        f"features differ by {100 * out['features_rel_l2']:.2f} % (relative L2), object ids agree "
        f"{100 * out['obj_ids_same']:.1f} %, attribute ids {100 * out['attr_ids_same']:.1f} %")
    return out


def decode_row(images: list[torch.Tensor]) -> dict[str, Any] | None:
    """One core: JPEG bytes -> cv2.imdecode -> the input blob with OpenCV, as a decode task does per image."""
    try:
        import cv2
        import numpy as np

        from xmodal.extract.pipeline import prepare_blob
    except ImportError:
        say(f"  {TAG} decode: skipped (OpenCV is not installed here)")
        return None
    blobs = [cv2.imencode(".jpg", im.numpy(), [cv2.IMWRITE_JPEG_QUALITY, 90])[1].tobytes() for im in images]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    cv2.setNumThreads(1)
    try:
        t0 = time.perf_counter()
        for b in blobs:
            prepare_blob(cv2.imdecode(np.frombuffer(b, np.uint8), cv2.IMREAD_COLOR), DetectorConfig().input)
        wall = time.perf_counter() - t0
    finally:
        torch.set_num_threads(threads)
    row = {"images": len(blobs), "images_s_per_core": len(blobs) / wall, "jpeg_kib": sum(map(len, blobs)) / len(blobs) / 1024}
    say(f"  {TAG} decode + prepare on one core: {row['images_s_per_core']:.1f} images/s")
    return row


def markdown(res: dict[str, Any]) -> str:
    m = res["meta"]
    lines = [f"Feature extraction {TAG}, {m['date']}, {m['device_name']}, torch {m['torch']}, config {m['config']}, "
             f"{m['size'][0]}x{m['size'][1]} images", "",
             "| images | precision | images/s | ms/image | host kernels/image | host ms/image | RoI slots/image | boxes/image | peak GiB "
             "| GFLOP/s | of matmul | " + " | ".join(STAGES) + " |",
             "|---|---|" + "---:|" * (11 + len(STAGES))]
    for r in res["detector"]:
        st = r["stage_s_per_image"]
        lines.append(f"| {r['regions']} (x{r['batch']}) | {r['precision']} | {r['images_s']:,.2f} | "
                     f"{1000 * r['s_per_image']:,.0f} | {r['kernels_per_image']:,.0f} | {r['host_ms_per_image']:,.1f} | "
                     f"{r['rois_per_image']:.0f} | "
                     f"{r['boxes_per_image']:.0f} | {r['peak_gib']:.2f} | "
                     f"{1000 * r['tflops']:,.0f} | {100 * r['of_matmul']:.0f} % | "
                     + " | ".join(f"{1000 * st.get(k, 0.0):,.1f}" for k in STAGES) + " |")
    flops = res["detector"][0]["flops_per_image"]
    peaks = res["matmul_tflops"]
    lines += ["", f"{TAG} {flops / 1e9:,.1f} GFLOP per image (FlopCounterMode: convolutions and matmuls). This machine's "
              f"matmul rate, measured in the same run: fp32 {1000 * peaks['fp32']:,.0f} GFLOP/s, bf16 "
              f"{1000 * peaks['bf16']:,.0f} GFLOP/s; 'of matmul' is the row's rate against its precision's "
              "(tf32 rows against fp32's)."]
    for b in res.get("precision", []):
        lines += ["", f"{TAG} {b['precision']} against fp32: {100 * b['boxes_kept']:.1f} % of fp32's boxes "
                  f"selected; on the same boxes features differ by {100 * b['features_rel_l2']:.2f} % (relative L2), "
                  f"object ids agree {100 * b['obj_ids_same']:.1f} %, attribute ids {100 * b['attr_ids_same']:.1f} % "
                  "(random weights: near-tied class scores, so ids and selection are more fragile than a trained head's)."]
    lines += ["", "Stage columns: ms per image (the device synchronised at each stage's end). Host: the operations "
              "dispatched per image (kernels; views besides) times this machine's eager dispatch cost. Peak: CUDA's max allocated; on a CPU the "
              "process's peak RSS (monotone across rows, an upper bound). One actor: on a GPU shared by several "
              "actors, images/s per device is the sum of theirs (the job, not this benchmark, measures that)."]
    if res.get("decode"):
        d = res["decode"]
        lines += ["", f"Decode + prepare (cv2.imdecode of {d['jpeg_kib']:.0f} KiB JPEGs, means, resize), one core: "
                  f"{d['images_s_per_core']:.1f} images/s"]
    from xmodal_bench.extract_job import markdown as job_markdown

    lines += job_markdown(res.get("job"), res.get("write"))
    lines += ["", f"Target on one H200: >= {TARGET_IMAGES_S:.0f} images/s at 36 boxes."]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import os
    import platform

    cuda_arg(args.device)
    at_least(args, 1, "images", "batch")
    at_least(args, 0, "threads", "job_images")
    if args.config not in CONFIGS:
        raise UserError(f"--config {args.config!r}: unknown; expected one of {', '.join(CONFIGS)}")
    size = _size(args.size)
    from xmodal.extract.plan import parse_input_size

    short, longest = parse_input_size(args.input_size)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    n = args.images or (64 if cuda else 2)
    batch = min(args.batch or (8 if cuda else 2), n)
    if args.threads:
        torch.set_num_threads(args.threads)
    work, stamp, meta = begin(args, "extract")
    name = torch.cuda.get_device_name(device) if cuda else (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads")
    meta.update(device=device.type, device_name=name, torch=torch.__version__, config=args.config, size=size,
                input_size=[short, longest], weights="random")
    say(f"{TAG} extraction benchmark on {name}: {args.config} detector, {n} images of {size[0]}x{size[1]}, "
        f"batch {batch}")
    t0 = time.perf_counter()
    det = random_detector(CONFIGS[args.config]().replace_in("input", scale=short, max_size=longest), seed=0).to(device)
    images = synthetic_images(n, size)
    peaks = {"fp32": matmul_tflops(device, torch.float32), "bf16": matmul_tflops(device, torch.bfloat16)}
    say(f"  {TAG} matmul rate here: fp32 {1000 * peaks['fp32']:,.0f} GFLOP/s, bf16 {1000 * peaks['bf16']:,.0f} GFLOP/s")
    res: dict[str, Any] = {"meta": meta, "matmul_tflops": peaks,
                           "detector": detector_rows(det, images, batch, device, peaks),
                           "precision": [precision_difference(det, images, batch, p) for p in precisions(device)[1:]],
                           "decode": decode_row(synthetic_images(32, size, seed=1))}
    jobs = args.job_images if args.job_images is not None else (1024 if cuda else 64)
    try:
        from xmodal_bench.extract_job import job_row, write_row

        res["write"] = write_row(DetectorConfig().feature_dim, work)  # the reference's shape: a real shard's size
        if jobs:
            res["job"] = job_row(args.config, synthetic_images(jobs, size, seed=2), work, batch, cuda,
                                 f"{short}:{longest}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["meta"]["wall_s"] = time.perf_counter() - t0
    text = markdown(res)
    if args.out:
        write_results(args.out, f"extract-{stamp}", res, text)
    else:
        say("")
        say(text)
    return 0
