"""The extraction job's own path, measured: `jobs/extract.py`'s job over N synthetic JPEGs (the benchmark's
detector config and image size, random weights), through Ray Data's decode tasks, the detector actors,
the write tasks and the driver's commit; what the detector costs is measured by the rows before it.

Each image gets two given boxes (`--boxes-from`: its top-left and bottom-right quarters), so that the
RoI head's share stays small and the row measures the path around the network. Reported, from the job's
own summary (`extract.publish.Summary`):
- the driver per image: its process's CPU time over the pipeline (Ray Data's executor included: it runs
  in the driver) and the bytes of the records it received, over the whole run, divided by the images;
  printed as `driver per image: X ms CPU, Y bytes received`;
- the write tasks: each one's own time and bytes writing its shard (encoding and sending), as MB/s and
  images/s of one write task, and the shards written;
- the job's images/s end to end (Ray's start and the actors' loading included).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from xmodal.base.console import say

TAG = "[random weights]"


def job_row(config: str, images: list, work: Path, batch: int, gpus: bool) -> dict[str, Any]:
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
                               boxes_from=str(work / "boxes.json"), batch_size=batch, progress=False,
                               gpus_per_actor=0.5 if gpus else None))
    n, shards = s.extracted, max(1, s.write_shards)
    row = {"images": n, "images_s": n / s.seconds, "seconds": s.seconds,
           "driver_cpu_ms_per_image": 1000 * s.driver_cpu_s / n, "driver_bytes_per_image": s.driver_bytes / n,
           "write_mb_s_per_task": s.write_bytes / s.write_s / 1e6 if s.write_s else 0.0,
           "write_images_s_per_task": n / s.write_s if s.write_s else 0.0, "shards": shards,
           "shard_mib": s.write_bytes / shards / 2**20}
    say(f"  {TAG} the job over {n} images (given boxes): {row['images_s']:.2f} images/s end to end in "
        f"{s.seconds:.1f} s")
    say(f"driver per image: {row['driver_cpu_ms_per_image']:.3f} ms CPU, {row['driver_bytes_per_image']:.0f} bytes "
        "received")
    say(f"  {TAG} write tasks: {row['write_mb_s_per_task']:.1f} MB/s and {row['write_images_s_per_task']:.0f} "
        f"images/s per write task ({shards} shard(s) of {row['shard_mib']:.1f} MiB)")
    return row


def markdown(row: dict[str, Any]) -> list[str]:
    return ["", f"The job over {row['images']} images (given boxes): {row['images_s']:.2f} images/s end to end; "
            f"driver per image: {row['driver_cpu_ms_per_image']:.3f} ms CPU, {row['driver_bytes_per_image']:.0f} "
            f"bytes received; write tasks {row['write_mb_s_per_task']:.1f} MB/s, "
            f"{row['write_images_s_per_task']:.0f} images/s each ({row['shards']} shard(s) of "
            f"{row['shard_mib']:.1f} MiB)."]
