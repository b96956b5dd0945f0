"""The Ray Data graph of an extraction: read and decode in CPU tasks, detect in an actor pool, write
the shards in write tasks; the driver gets each shard's name, ids and rows.

    from_items(images to do) -> map_batches(decode_batch)            tasks: bytes (local or URI), OpenCV's
                                                                     decode and the reference's input blob
                             -> map_batches(DetectorActor)           actors: the detector, a share of a GPU
                                                                     each when the cluster has GPUs
                             -> map_batches(write.write_batch)       tasks: `--images-per-shard` images a
                                                                     shard, written to the output's place
                             -> iter_batches in `Coordinator`        one small record a shard, passed
                                                                     on to the driver

A decoded image travels as the network's input blob, made where it is decoded exactly as the reference's
`_get_image_blob` makes it with OpenCV (`prepare_blob`: float32 (h, w, 3) bytes and the scale), or, for a
detector configured to resize on its device ("generic"), as its raw BGR bytes; a rejected one travels
with its reason and no pixels, through the actors (which pass it on) to the driver, which lists it. An
actor runs `Detector.detect` over its whole batch on its device and copies the regions back once; its
output is padded to the run's `num_objects` slots (`write.Regions`), and carries each image's path, source,
size and modification time on to the write tasks. Ray Data schedules every block from the process that
iterates the dataset; that process is `Coordinator`, an actor on the driver's node, so that the driver
spends its CPU on the records only. The only module of the package that imports Ray Data.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import ray.data

from xmodal.base import console
from xmodal.extract.spec import DetectorSpec
from xmodal.extract.write import BOXES, IMAGE, ShardWrite, write_batch

CARRIED = ("path", "source", "size", "mtime")  # what the actors pass on to the write tasks, image by image
WRITE_CPUS = 0.25  # a write task's CPU reservation: it encodes and sends a shard, mostly waiting on I/O
# The fewest pixels a side of the network's input (the image after the reference's scaling, `image.py:
# target_size`) may have. The backbone's stem (`backbone.py: Stem`, the reference's conv1 and pool1) is a
# 7x7 convolution, stride 2, pad 3 (n -> floor((n - 1) / 2) + 1), then a 3x3 max pool, stride 2, ceil
# rounding, no padding (m -> ceil((m - 3) / 2) + 1): a side of 1 or 2 becomes 1, then 0, and torch's pool
# raises (Caffe's `PoolingLayer::Reshape` computes the same 0); 3 becomes 2, then 1, and the rest of the network runs
# (measured for DetectorConfig() and DetectorConfig.tiny(): 1000x3 and 3x1000 inputs). Only an extreme
# aspect ratio comes to this: `--input-size` takes a SHORT of `plan.MIN_INPUT_SIDE` (32) at least.
MIN_SCALED_SIDE = 3


def prepare_blob(image_bgr: np.ndarray, cfg) -> tuple[np.ndarray, float]:
    """The reference's input blob of one decoded image (`_get_image_blob` of `lib/fast_rcnn/test.py`):
    `im.astype(np.float32) - PIXEL_MEANS` (a float64 subtraction rounded once), then OpenCV's own
    `cv2.resize(im, None, None, fx=scale, fy=scale, interpolation=cv2.INTER_LINEAR)` -> (h, w, 3) float32, scale.

    cfg is the detector's `InputConfig`."""
    import cv2

    from xmodal.models.butd.image import target_size

    scale, _ = target_size(image_bgr.shape[0], image_bgr.shape[1], cfg)
    im = image_bgr.astype(np.float32, copy=True)
    im -= np.asarray(cfg.pixel_means, dtype=np.float64)
    return cv2.resize(im, None, None, fx=scale, fy=scale, interpolation=cv2.INTER_LINEAR), scale


def too_thin(h: int, w: int, cfg) -> str:
    """Why an image of h x w pixels is too thin for the detector once scaled as the reference scales it
    (a side under `MIN_SCALED_SIDE`), or "". cfg is the detector's `InputConfig`."""
    from xmodal.models.butd.image import target_size

    _, (sh, sw) = target_size(h, w, cfg)
    if min(sh, sw) >= MIN_SCALED_SIDE:
        return ""
    # SHORT >= 32 scales the short side past MIN_SCALED_SIDE: only the long side's cap (short * max_size / long)
    # makes it thinner, and that rounds (half to even) to MIN_SCALED_SIDE or more for a ratio under this
    ratio = cfg.max_size / (MIN_SCALED_SIDE - 0.5)
    return (f"{w}x{h} pixels (width x height), scaled to {sw}x{sh} for the detector (short side to {cfg.scale}, "
            f"long side at most {cfg.max_size}): a side under {MIN_SCALED_SIDE} pixels leaves the backbone nothing; "
            f"expected a less extreme aspect ratio (under {ratio:g}:1)")


def decode_batch(batch: pa.Table, resize: str = "opencv", input_cfg: Any = None) -> pa.Table:
    """Read and decode each image of the batch (columns path, img_id, given); add h, w (the image's size),
    bh, bw, scale and pixels (the blob's float32 bytes, or the image's uint8 BGR bytes where `resize` is
    "generic"), and reject. input_cfg: the detector's `InputConfig` (None: the reference's), which both
    ways of resizing scale by."""
    from xmodal.data.location import Location
    from xmodal.extract.boxes import outside
    from xmodal.extract.images import decode
    from xmodal.models.butd.config import InputConfig

    cfg = InputConfig() if input_cfg is None else input_cfg
    hs, ws, bhs, bws, scales, pixels, rejects, kinds = [], [], [], [], [], [], [], []
    for row in batch.to_pylist():
        im, why, kind = None, "", ""
        try:
            data = Location(row["path"]).read_bytes()
        except OSError as e:
            why, kind = f"cannot be read ({type(e).__name__}: {e})", IMAGE
        else:
            im, why = decode(data)
            kind = IMAGE if im is None else ""
        if im is not None and (thin := too_thin(im.shape[0], im.shape[1], cfg)):
            # checked here for both resizes: OpenCV's would raise in this task, the device's in the actor
            im, why, kind = None, thin, IMAGE
        if im is not None and row["given"]:
            boxes = np.frombuffer(row["given"], np.float32).reshape(-1, 4)
            bad = outside(boxes, im.shape[0], im.shape[1])
            if bad:
                im, why, kind = None, bad, BOXES
        hs.append(0 if im is None else im.shape[0])
        ws.append(0 if im is None else im.shape[1])
        blob, scale = (im, 1.0) if im is None or resize != "opencv" else prepare_blob(im, cfg)
        bhs.append(0 if blob is None else blob.shape[0])
        bws.append(0 if blob is None else blob.shape[1])
        scales.append(scale)
        pixels.append(b"" if blob is None else np.ascontiguousarray(blob).tobytes())
        rejects.append(why)
        kinds.append(kind)
    columns = {"h": pa.array(hs, pa.int32()), "w": pa.array(ws, pa.int32()), "bh": pa.array(bhs, pa.int32()),
               "bw": pa.array(bws, pa.int32()), "scale": pa.array(scales, pa.float64()),
               "pixels": pa.array(pixels, pa.large_binary()), "reject": pa.array(rejects),
               "reject_kind": pa.array(kinds)}
    for name, column in columns.items():
        batch = batch.append_column(name, column)
    return batch


class DetectorActor:
    """One detector, built once per actor; `__call__` turns a decoded batch into padded regions."""

    def __init__(self, spec: DetectorSpec):
        import torch

        self.spec = spec
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        if self.device.type == "cpu" and spec.threads:
            # Ray sets OMP_NUM_THREADS to the one CPU the actor reserves: torch would run on one core.
            # The spec's share counts Ray's logical CPUs (a local Ray has at least 4, even on 2 cores):
            # no more threads than this node's cores.
            torch.set_num_threads(max(1, min(spec.threads, len(os.sched_getaffinity(0)))))
        self.detector = spec.build().to(self.device).eval()

    def __call__(self, batch: pa.Table) -> dict[str, np.ndarray]:
        import torch

        from xmodal.models.butd.config import DetectOptions
        from xmodal.models.butd.image import PreparedImage

        rows = batch.to_pylist()
        n, s = len(rows), self.spec
        ok = [i for i, r in enumerate(rows) if not r["reject"]]
        images: list[Any] = []
        for i in ok:
            r = rows[i]
            if self.detector.cfg.input.resize == "opencv":
                blob = np.frombuffer(r["pixels"], np.float32).reshape(r["bh"], r["bw"], 3)
                images.append(PreparedImage(torch.from_numpy(blob.copy()), r["scale"], r["h"], r["w"]))
            else:
                images.append(torch.from_numpy(np.frombuffer(r["pixels"], np.uint8).reshape(r["h"], r["w"], 3).copy()))
        given = [torch.from_numpy(np.frombuffer(rows[i]["given"], np.float32).reshape(-1, 4).copy()) for i in ok] \
            if s.given else None
        # The configured width, not the found features': a batch whose images are all rejects must
        # give arrays of the same shape as the others (Ray Data would make a ragged column of them).
        width, k = self.detector.cfg.feature_dim, s.num_objects
        out: dict[str, Any] = {
            "img_id": np.array([r["img_id"] for r in rows], dtype=object),
            **{c: np.array([r[c] for r in rows], dtype=np.int64 if c in ("size", "mtime") else object)
               for c in CARRIED},
            "reject": np.array([r["reject"] for r in rows], dtype=object),
            "reject_kind": np.array([r["reject_kind"] for r in rows], dtype=object),
            "img_h": np.zeros(n, np.int32), "img_w": np.zeros(n, np.int32), "num_boxes": np.zeros(n, np.int32),
            "features": np.zeros((n, k, width), np.float32), "boxes": np.zeros((n, k, 4), np.float32),
            "obj_ids": np.full((n, k), -1, np.int64), "obj_conf": np.zeros((n, k), np.float32),
            "attr_ids": np.full((n, k), -1, np.int64), "attr_conf": np.zeros((n, k), np.float32),
        }
        if not images:
            return out
        with torch.inference_mode():
            # one copy of the batch to the host (and a second pass for an image the NMS could not certify)
            found = self.detector.regions(images, DetectOptions(precision=s.precision), given_boxes=given)
        m = found.boxes.shape[1]
        if m > k:
            raise RuntimeError(f"the detector gave {m} region slots per image, more than the run's {k}")
        at = np.asarray(ok)
        out["img_h"][at], out["img_w"][at] = found.img_h.numpy(), found.img_w.numpy()
        out["num_boxes"][at] = found.num_boxes.numpy()
        for name in ("features", "boxes", "obj_ids", "obj_conf", "attr_ids", "attr_conf"):
            out[name][at, :m] = getattr(found, name).numpy()
        for i in at[found.num_boxes.numpy() == 0]:  # a store row and a TSV line need one box at least
            out["reject"][i], out["reject_kind"][i] = "the detector found no region in it", IMAGE
        return out


def run(items: Sequence[dict[str, Any]], spec: DetectorSpec, write: ShardWrite, *, batch_size: int, actors: int,
        gpus_per_actor: float, decode_tasks: int, images_per_shard: int) -> Iterator[pa.Table]:
    """Extract `items` ({"path", "img_id", "given": float32 bytes or b"", and the `CARRIED` fields}) and
    write them as shards of `images_per_shard` images; yields the write tasks' records (`write.RECORD`)
    as they finish. gpus_per_actor: 0 on CPU; a fraction puts several actors on one GPU."""
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = console.verbose()
    console.quiet_ray_data(logging.getLogger("ray.data"))
    blocks = max(1, min(len(items), (len(items) + batch_size - 1) // batch_size))
    ds = ray.data.from_items(list(items), override_num_blocks=blocks)
    ds = ds.map_batches(decode_batch, fn_kwargs={"resize": spec.cfg.input.resize, "input_cfg": spec.cfg.input},
                        batch_size=batch_size, batch_format="pyarrow", num_cpus=1,
                        compute=ray.data.TaskPoolStrategy(size=max(1, decode_tasks)))
    ds = ds.map_batches(DetectorActor, fn_constructor_kwargs={"spec": spec}, batch_size=batch_size,
                        batch_format="pyarrow", compute=ray.data.ActorPoolStrategy(size=max(1, actors)), num_cpus=1,
                        num_gpus=gpus_per_actor)
    ds = ds.map_batches(write_batch, fn_kwargs={"write": write}, batch_size=images_per_shard, batch_format="numpy",
                        num_cpus=WRITE_CPUS, compute=ray.data.TaskPoolStrategy(size=max(1, actors)))
    return ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=1)


@ray.remote(num_cpus=0, max_restarts=0)
class Coordinator:
    """`run` in an actor of its own: Ray Data's streaming executor (measured in the driver: about 54 ms of
    CPU a second of run) works here, and the driver asks for the write tasks' records, one table a call.
    Killing the actor ends the pipeline: the detector actors and tasks it started end with their owner."""

    def __init__(self, verbose: bool, items: Sequence[dict[str, Any]], spec: DetectorSpec, write: ShardWrite,
                 **options: Any):
        console.set_verbose(verbose)
        self.tables = iter(run(items, spec, write, **options))

    def next_table(self) -> pa.Table | None:
        """The next finished write task's records (`write.RECORD`), None once every shard is done."""
        return next(self.tables, None)
