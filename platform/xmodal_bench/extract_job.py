"""The extraction job's own path, measured: `jobs/extract.py`'s job over N synthetic JPEGs (the benchmark's
detector config and image size, random weights), through Ray Data's decode tasks, the detector actors,
the write tasks and the driver's commit; what the detector costs is measured by the rows before it.

The job runs the network at the benchmark's `--input-size` on two given boxes an image (`--boxes-from`:
its top-left and bottom-right quarters), so that the network's share stays small and the row measures
the path around it. Reported, from the job's own summary (`extract.publish.Summary`):
- the driver per image: its process's CPU time over the pipeline (Ray Data's executor runs in an actor
  beside it, `extract.pipeline.Coordinator`) and the bytes of the records it received, over the whole
  run, divided by the images; printed as `driver per image: X ms CPU, Y bytes received`; and that CPU
  time per second of the run (what the driver costs while it waits: per image it falls as the images
  come faster);
- the job's images/s end to end (Ray's start and the actors' loading included).

`write_row`: one write task's throughput on shards of the reference's size, in this process: a bundle of
`--images-per-shard` images of the detector's output shape (36 regions of the config's feature width,
float32, as the actors send them) through `extract.write.write_batch` into a local store's root: MB/s
of the shard written and images/s, the shard's size.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from xmodal.base.console import say

TAG = "[random weights]"


def job_row(config: str, images: list, work: Path, batch: int, gpus: bool, input_size: str) -> dict[str, Any]:
    """Extract `images` ((H, W, 3) uint8 tensors) with the job; the driver's and the write tasks' figures."""
    import cv2

    from xmodal.extract.job import extract
    from xmodal.extract.plan import ExtractOptions

    folder = work / "images"
    folder.mkdir()
    boxes = {}
    for i, im in enumerate(images):
        h, w = im.shape[:2]
        cv2.imwrite(str(folder / f"img{i:06d}.jpg"), im.numpy(), [cv2.IMWRITE_JPEG_QUALITY, 90])
        boxes[f"img{i:06d}"] = [[0, 0, w / 2, h / 2], [w / 2, h / 2, w - 1, h - 1]]
    (work / "boxes.json").write_text(json.dumps(boxes))
    s = extract(ExtractOptions(str(folder), str(work / "store"), random_weights=True, tiny=config == "tiny",
                               boxes_from=str(work / "boxes.json"), input_size=input_size,
                               batch_size=batch, progress=False, gpus_per_actor=0.5 if gpus else None))
    n = s.extracted
    row = {"images": n, "images_s": n / s.seconds, "seconds": s.seconds, "shards": s.write_shards,
           "driver_cpu_ms_per_image": 1000 * s.driver_cpu_s / n, "driver_bytes_per_image": s.driver_bytes / n,
           "driver_cpu_per_s": s.driver_cpu_s / s.seconds}
    say(f"  {TAG} the job over {n} images (given boxes, input {input_size}): {row['images_s']:.2f} images/s end "
        f"to end in {s.seconds:.1f} s, {s.write_shards} shard(s)")
    say(f"driver per image: {row['driver_cpu_ms_per_image']:.3f} ms CPU, {row['driver_bytes_per_image']:.0f} bytes "
        "received")
    say(f"  {TAG} the driver's CPU over the run: {1000 * row['driver_cpu_per_s']:.0f} ms a second")
    return row


def write_row(feat_dim: int, work: Path, images: int = 256, objects: int = 36) -> dict[str, Any]:
    """One write task on a bundle of `images` detected images of the reference's shape (module docstring)."""
    import numpy as np

    from xmodal.data.lxmert.feature_writer import FeatureWriter
    from xmodal.extract.write import ShardWrite, write_batch

    rng = np.random.default_rng(0)

    def bundle(n: int, first: int) -> dict:
        k, ids = objects, np.array([f"img{i:06d}" for i in range(first, first + n)], dtype=object)
        return {"img_id": ids, "path": ids, "source": ids, "size": np.full(n, 1), "mtime": np.full(n, 1),
                "reject": np.full(n, "", dtype=object), "reject_kind": np.full(n, "", dtype=object),
                "img_h": np.full(n, 480), "img_w": np.full(n, 640), "num_boxes": np.full(n, k),
                "features": rng.random((n, k, feat_dim), dtype=np.float32),
                "boxes": np.tile(np.float32([10, 20, 300, 400]), (n, k, 1)),
                "obj_ids": rng.integers(0, 1600, (n, k)), "obj_conf": rng.random((n, k), dtype=np.float32),
                "attr_ids": rng.integers(0, 400, (n, k)), "attr_conf": rng.random((n, k), dtype=np.float32)}

    writer = FeatureWriter(work / "write-row", options={}, work="extract")
    writer.start()
    write = ShardWrite(writer.sink())
    write_batch(bundle(8, 0), write)  # warm-up: imports, first allocations
    batch = bundle(images, 8)
    began, cpu = time.perf_counter(), time.process_time()
    record = write_batch(batch, write).to_pylist()[0]
    wall, cpu = time.perf_counter() - began, time.process_time() - cpu
    row = {"images": images, "objects": objects, "feat_dim": feat_dim, "shard_mib": record["bytes"] / 2**20,
           "mb_s": record["bytes"] / wall / 1e6, "images_s": images / wall, "seconds": wall,
           "cpu_ms_per_image": 1000 * cpu / images}
    say(f"  {TAG} one write task: {row['mb_s']:.0f} MB/s, {row['images_s']:.0f} images/s, "
        f"{row['cpu_ms_per_image']:.2f} ms CPU an image (a shard of {images} images of {objects} x {feat_dim}: "
        f"{row['shard_mib']:.1f} MiB in {wall:.2f} s, to this machine's disk)")
    return row


def markdown(job: dict[str, Any] | None, write: dict[str, Any] | None) -> list[str]:
    out = []
    if job:
        out += ["", f"The job over {job['images']} images (given boxes): {job['images_s']:.2f} "
                f"images/s end to end; driver per image: {job['driver_cpu_ms_per_image']:.3f} ms CPU, "
                f"{job['driver_bytes_per_image']:.0f} bytes received; the driver's CPU "
                f"{1000 * job['driver_cpu_per_s']:.0f} ms a second of the run."]
    if write:
        out += ["", f"One write task: {write['mb_s']:.0f} MB/s, {write['images_s']:.0f} images/s (a shard of "
                f"{write['images']} images of {write['objects']} x {write['feat_dim']}: {write['shard_mib']:.1f} MiB)."]
    return out
