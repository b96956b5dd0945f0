"""Region-feature extraction throughput: the bottom-up-attention detector (`xmodal.models.butd`).

    python jobs/benchmark.py extract [--device cpu|cuda] [--config reference|tiny] [--images N]
                                     [--batch K] [--size HxW] [--threads T] [--out DIR]

Rows, each over the same N synthetic images of one size (COCO's typical 480 x 640 by default):
- regions batched (the RoI head over the regions of K images in one call) vs one image at a time
  (the reference's way), each in fp32 (the exact default) and bf16 (the RoI head only):
  images/s of one detector worker, peak memory, and the seconds per stage (prepare, backbone+rpn,
  roi_pool, res5+heads, select) from `Detector.extract(stats=...)`, and the RoIs per image that res5 ran over;
- FLOP rate: the detector's FLOPs per image (counted by torch's FlopCounterMode over the first
  batch: convolutions and matmuls) times images/s, as a fraction of this machine's own matmul rate
  (a square matmul timed in the same run, in the row's precision);
- decode: images/s of one CPU core reading JPEG bytes as the job does (`cv2.imdecode`) and
  preparing the network's input (`prepare_image`: means, resize), when OpenCV is installed.

The detector's weights are RANDOM: speed does not depend on their values, except the selection
(its NMS over 1,600 classes keeps more or fewer boxes per class), so its stage is indicative only.
Every line printed says so. GPU target: >= 100 images/s at 36 boxes (the reference pipeline:
about 5 images/s per GPU, docs/extract.md).
"""

from __future__ import annotations

import argparse
import resource
import time
from typing import Any

import torch
from torch.utils.flop_counter import FlopCounterMode

from xmodal.console import say
from xmodal.errors import UserError
from xmodal.models.butd.detector import DetectorConfig, prepare_image, random_detector
from xmodal_bench import at_least, begin, cuda_arg, write_results

CONFIGS = {"reference": DetectorConfig, "tiny": DetectorConfig.tiny}
TARGET_IMAGES_S = 100.0  # one H200, 36 boxes
TAG = "[random weights]"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if available")
    p.add_argument("--config", default="reference", help=f"detector size: {', '.join(CONFIGS)}")
    p.add_argument("--images", type=int, default=None, help="images per row (default: 64 cuda, 2 cpu)")
    p.add_argument("--batch", type=int, default=None, help="images per extract call (default: 8 cuda, 2 cpu)")
    p.add_argument("--size", default="480x640", help="image height x width")
    p.add_argument("--threads", type=int, default=0, help="CPU: torch.set_num_threads (0 = torch's default)")
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


def detector_rows(det, images: list[torch.Tensor], batch: int, device: torch.device,
                  peak_tflops: dict[str, float]) -> list[dict[str, Any]]:
    rows = []
    flops_per_image = 0.0
    for regions in ("batched", "per image"):
        for dtype in (torch.float32, torch.bfloat16):
            step = batch if regions == "batched" else 1
            if not flops_per_image:  # counted once: the work per image is the same in every row
                counter = FlopCounterMode(display=False)
                with counter:
                    det.extract(images[:step], region_dtype=dtype)
                flops_per_image = counter.get_total_flops() / step
            det.extract(images[:step], region_dtype=dtype)  # warm-up: kernels, allocator
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            stages: dict[str, float] = {}
            t0 = time.perf_counter()
            boxes = 0
            for i in range(0, len(images), step):
                boxes += sum(r.boxes.shape[0] for r in det.extract(images[i:i + step], region_dtype=dtype,
                                                                    stats=stages))
            wall = time.perf_counter() - t0
            rois = stages.pop("regions")
            row = {"regions": regions, "precision": "fp32" if dtype == torch.float32 else "bf16",
                   "images": len(images), "batch": step, "images_s": len(images) / wall,
                   "s_per_image": wall / len(images), "boxes_per_image": boxes / len(images),
                   "rois_per_image": rois / len(images),
                   "peak_gib": _peak_gib(device), "stage_s_per_image": {k: v / len(images) for k, v in stages.items()}}
            say(f"  {TAG} regions {regions}, {row['precision']}: {row['images_s']:.2f} images/s "
                f"({1000 * row['s_per_image']:.0f} ms/image), peak {row['peak_gib']:.2f} GiB")
            row["tflops"] = flops_per_image * row["images_s"] / 1e12
            row["flops_per_image"] = flops_per_image
            row["of_matmul"] = row["tflops"] / peak_tflops[row["precision"]]
            say(f"  {TAG}   {flops_per_image / 1e9:,.1f} GFLOP/image, {1000 * row['tflops']:.0f} GFLOP/s = "
                f"{100 * row['of_matmul']:.0f} % of this machine's {row['precision']} matmul rate "
                f"({1000 * peak_tflops[row['precision']]:.0f} GFLOP/s)")
            rows.append(row)
    return rows


def bf16_difference(det, images: list[torch.Tensor], batch: int) -> dict[str, float]:
    """bf16's RoI head against fp32's on the same images: how many of fp32's selected boxes bf16 selects
    too, and on fp32's boxes (given to both) the features' relative L2 difference and the share of
    object and attribute ids that agree. With random weights the class scores are near ties, so the
    ids and the selection are more fragile than a trained head's: an upper bound on the disagreement."""
    kept = same_obj = same_attr = total = 0
    diff2 = norm2 = 0.0
    for i in range(0, len(images), batch):
        part = images[i:i + batch]
        full = det.extract(part, region_dtype=torch.float32)
        half = det.extract(part, region_dtype=torch.bfloat16)
        given = [r.boxes for r in full]
        on_full = det.extract(part, given_boxes=given, region_dtype=torch.bfloat16)
        ref = det.extract(part, given_boxes=given, region_dtype=torch.float32)
        for f, h, a, b in zip(full, half, on_full, ref, strict=True):
            kept += sum(bool((h.boxes == box).all(1).any()) for box in f.boxes)
            total += f.boxes.shape[0]
            diff2 += float((a.features.float() - b.features).square().sum())
            norm2 += float(b.features.square().sum())
            same_obj += int((a.objects_id == b.objects_id).sum())
            same_attr += int((a.attrs_id == b.attrs_id).sum())
    out = {"boxes_kept": kept / total, "features_rel_l2": (diff2 / norm2) ** 0.5, "objects_id_same": same_obj / total,
           "attrs_id_same": same_attr / total}
    say(f"  {TAG} bf16 vs fp32: {100 * out['boxes_kept']:.1f} % of fp32's boxes selected; on the same boxes "
        f"features differ by {100 * out['features_rel_l2']:.2f} % (relative L2), object ids agree "
        f"{100 * out['objects_id_same']:.1f} %, attribute ids {100 * out['attrs_id_same']:.1f} %")
    return out


def decode_row(images: list[torch.Tensor]) -> dict[str, Any] | None:
    """One core: JPEG bytes -> cv2.imdecode -> prepare_image, as a decode task does per image."""
    try:
        import cv2
        import numpy as np
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
            prepare_image(torch.from_numpy(cv2.imdecode(np.frombuffer(b, np.uint8), cv2.IMREAD_COLOR)))
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
             "| regions | precision | images/s | ms/image | RoIs/image | boxes/image | peak GiB | GFLOP/s | of matmul "
             "| prepare | backbone+rpn | roi_pool | res5+heads | select |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in res["detector"]:
        st = r["stage_s_per_image"]
        lines.append(f"| {r['regions']} (x{r['batch']}) | {r['precision']} | {r['images_s']:,.2f} | "
                     f"{1000 * r['s_per_image']:,.0f} | {r['rois_per_image']:.0f} | {r['boxes_per_image']:.0f} | {r['peak_gib']:.2f} | "
                     f"{1000 * r['tflops']:,.0f} | {100 * r['of_matmul']:.0f} % | "
                     + " | ".join(f"{1000 * st.get(k, 0.0):,.0f}" for k in
                                  ("prepare", "backbone+rpn", "roi_pool", "res5+heads", "select")) + " |")
    flops = res["detector"][0]["flops_per_image"]
    peaks = res["matmul_tflops"]
    lines += ["", f"{TAG} {flops / 1e9:,.1f} GFLOP per image (FlopCounterMode: convolutions and matmuls). This machine's "
              f"matmul rate, measured in the same run: fp32 {1000 * peaks['fp32']:,.0f} GFLOP/s, bf16 "
              f"{1000 * peaks['bf16']:,.0f} GFLOP/s; 'of matmul' is the row's rate against its precision's "
              "(bf16 rows run only the RoI head in bf16)."]
    if res.get("bf16"):
        b = res["bf16"]
        lines += ["", f"{TAG} bf16 against fp32 (the RoI head only): {100 * b['boxes_kept']:.1f} % of fp32's boxes "
                  f"selected; on the same boxes features differ by {100 * b['features_rel_l2']:.2f} % (relative L2), "
                  f"object ids agree {100 * b['objects_id_same']:.1f} %, attribute ids {100 * b['attrs_id_same']:.1f} % "
                  "(random weights: near-tied class scores, so ids and selection are more fragile than a trained head's)."]
    lines += ["", "Stage columns: ms per image. Peak: CUDA's max allocated; on a CPU the process's peak RSS "
              "(monotone across rows, an upper bound)."]
    if res.get("decode"):
        d = res["decode"]
        lines += ["", f"Decode + prepare (cv2.imdecode of {d['jpeg_kib']:.0f} KiB JPEGs, means, resize), one core: "
                  f"{d['images_s_per_core']:.1f} images/s"]
    lines += ["", f"Target on one H200: >= {TARGET_IMAGES_S:.0f} images/s at 36 boxes."]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import os
    import platform

    cuda_arg(args.device)
    at_least(args, 1, "images", "batch")
    at_least(args, 0, "threads")
    if args.config not in CONFIGS:
        raise UserError(f"--config {args.config!r}: unknown; expected one of {', '.join(CONFIGS)}")
    size = _size(args.size)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = device.type == "cuda"
    n = args.images or (64 if cuda else 2)
    batch = min(args.batch or (8 if cuda else 2), n)
    if args.threads:
        torch.set_num_threads(args.threads)
    work, stamp, meta = begin(args, "extract")
    os.rmdir(work)  # nothing is written but the results
    name = torch.cuda.get_device_name(device) if cuda else (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads")
    meta.update(device=device.type, device_name=name, torch=torch.__version__, config=args.config, size=size,
                weights="random")
    say(f"{TAG} extraction benchmark on {name}: {args.config} detector, {n} images of {size[0]}x{size[1]}, "
        f"batch {batch}")
    t0 = time.perf_counter()
    det = random_detector(CONFIGS[args.config](), seed=0).to(device)
    images = synthetic_images(n, size)
    peaks = {"fp32": matmul_tflops(device, torch.float32), "bf16": matmul_tflops(device, torch.bfloat16)}
    say(f"  {TAG} matmul rate here: fp32 {1000 * peaks['fp32']:,.0f} GFLOP/s, bf16 {1000 * peaks['bf16']:,.0f} GFLOP/s")
    res: dict[str, Any] = {"meta": meta, "matmul_tflops": peaks,
                           "detector": detector_rows(det, images, batch, device, peaks),
                           "bf16": bf16_difference(det, images, batch),
                           "decode": decode_row(synthetic_images(32, size, seed=1))}
    res["meta"]["wall_s"] = time.perf_counter() - t0
    text = markdown(res)
    if args.out:
        write_results(args.out, f"extract-{stamp}", res, text)
    else:
        say("")
        say(text)
    return 0
