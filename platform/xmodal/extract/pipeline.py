"""The Ray Data graph of an extraction: read and decode in CPU tasks, detect in an actor pool.

    from_items(images to do) -> map_batches(decode_batch)            tasks: bytes (local or URI), OpenCV
                             -> map_batches(DetectorActor)           actors: the detector, a GPU each when
                                                                     the cluster has GPUs
                             -> iter_batches on the driver           the job writes chunks as they come

A decoded image travels as its raw BGR bytes with its height and width; a rejected one travels with its
reason and no pixels, through the actors (which pass it on) to the driver, which lists it. The actors'
output is padded to the run's `num_objects` slots (`chunks.Regions`). The only module of the package
that imports Ray Data.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import ray.data

from xmodal import console

# A reject's kind: a file that is not a usable image (counted against --max-rejected), or a given box
# outside its image (an error in --boxes-from: the run fails).
IMAGE, BOXES = "image", "boxes"


@dataclass(frozen=True)
class DetectorSpec:
    """How an actor builds its detector (pickled to every actor)."""

    weights: str | None  # the weights file; None: random weights (tests and benchmarks)
    weights_sha256: str | None = None  # the file the driver checked: an actor whose copy differs refuses it
    layout: str = "auto"
    tiny: bool = False
    seed: int = 0
    boxes_range: tuple[int, int] = (36, 36)
    given: bool = False  # boxes come with the images (--boxes-from)
    bf16: bool = False
    num_objects: int = 36

    def build(self):
        from xmodal.models.butd.detector import DetectorConfig, random_detector

        cfg = DetectorConfig.tiny() if self.tiny else DetectorConfig()
        if self.weights is None:
            return random_detector(cfg, seed=self.seed)
        from xmodal.core.checkpoint import sha256_of
        from xmodal.models.butd.weights import WeightsError, load_detector

        # On a cluster each node reads its own copy of the path: one that differs from the file the
        # driver checked (another version, a file replaced mid-run) would give other features silently.
        if self.weights_sha256 is not None and (found := sha256_of(Path(self.weights))) != self.weights_sha256:
            raise WeightsError(f"{self.weights}: sha256 {found} on this node, not the {self.weights_sha256} the "
                               "driver checked; give every node the same weights file")
        return load_detector(self.weights, layout=self.layout, cfg=cfg)


def decode_batch(batch: pa.Table) -> pa.Table:
    """Read and decode each image of the batch (columns path, img_id, given); add h, w, pixels, reject."""
    from xmodal.data.common import Location
    from xmodal.extract.boxes import outside
    from xmodal.extract.images import decode

    hs, ws, pixels, rejects, kinds = [], [], [], [], []
    for row in batch.to_pylist():
        im, why, kind = None, "", ""
        try:
            data = Location(row["path"]).read_bytes()
        except OSError as e:
            why, kind = f"cannot be read ({type(e).__name__}: {e})", IMAGE
        else:
            im, why = decode(data)
            kind = IMAGE if im is None else ""
        if im is not None and row["given"]:
            boxes = np.frombuffer(row["given"], np.float32).reshape(-1, 4)
            bad = outside(boxes, im.shape[0], im.shape[1])
            if bad:
                im, why, kind = None, bad, BOXES
        hs.append(0 if im is None else im.shape[0])
        ws.append(0 if im is None else im.shape[1])
        pixels.append(b"" if im is None else np.ascontiguousarray(im).tobytes())
        rejects.append(why)
        kinds.append(kind)
    return batch.append_column("h", pa.array(hs, pa.int32())).append_column("w", pa.array(ws, pa.int32())) \
        .append_column("pixels", pa.array(pixels, pa.large_binary())).append_column("reject", pa.array(rejects)) \
        .append_column("reject_kind", pa.array(kinds))


class DetectorActor:
    """One detector, built once per actor; `__call__` turns a decoded batch into padded regions."""

    def __init__(self, spec: DetectorSpec):
        import torch

        self.spec = spec
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.detector = spec.build().to(self.device).eval()

    def __call__(self, batch: pa.Table) -> dict[str, np.ndarray]:
        import torch

        rows = batch.to_pylist()
        n, s = len(rows), self.spec
        ok = [i for i, r in enumerate(rows) if not r["reject"]]
        images = [torch.from_numpy(np.frombuffer(rows[i]["pixels"], np.uint8).reshape(rows[i]["h"], rows[i]["w"], 3)
                                   .copy()).to(self.device) for i in ok]
        given = [torch.from_numpy(np.frombuffer(rows[i]["given"], np.float32).reshape(-1, 4).copy()).to(self.device)
                 for i in ok] if s.given else None
        found = []
        if images:
            with torch.inference_mode():
                found = self.detector.extract(images, boxes_range=s.boxes_range, given_boxes=given,
                                              region_dtype=torch.bfloat16 if s.bf16 else torch.float32)
        # The configured width, not the found features': a batch whose images are all rejects must
        # give arrays of the same shape as the others (Ray Data would make a ragged column of them).
        width = self.detector.cfg.feature_dim
        k = s.num_objects
        out: dict[str, Any] = {
            "img_id": np.array([r["img_id"] for r in rows], dtype=object),
            "path": np.array([r["path"] for r in rows], dtype=object),
            "reject": np.array([r["reject"] for r in rows], dtype=object),
            "reject_kind": np.array([r["reject_kind"] for r in rows], dtype=object),
            "img_h": np.zeros(n, np.int32), "img_w": np.zeros(n, np.int32), "num_boxes": np.zeros(n, np.int32),
            "features": np.zeros((n, k, width), np.float32), "boxes": np.zeros((n, k, 4), np.float32),
            "obj_ids": np.full((n, k), -1, np.int64), "obj_conf": np.zeros((n, k), np.float32),
            "attr_ids": np.full((n, k), -1, np.int64), "attr_conf": np.zeros((n, k), np.float32),
        }
        for i, reg in zip(ok, found, strict=True):
            m = int(reg.boxes.shape[0])
            if m > k:
                raise RuntimeError(f"the detector gave {m} boxes for {rows[i]['img_id']!r}, more than {k}")
            out["img_h"][i], out["img_w"][i], out["num_boxes"][i] = reg.img_h, reg.img_w, m
            if m == 0:  # a store row and a TSV line need one box at least
                out["reject"][i], out["reject_kind"][i] = "the detector found no region in it", IMAGE
                continue
            out["features"][i, :m] = reg.features.float().cpu().numpy()
            out["boxes"][i, :m] = reg.boxes.float().cpu().numpy()
            out["obj_ids"][i, :m] = reg.objects_id.cpu().numpy()
            out["obj_conf"][i, :m] = reg.objects_conf.float().cpu().numpy()
            out["attr_ids"][i, :m] = reg.attrs_id.cpu().numpy()
            out["attr_conf"][i, :m] = reg.attrs_conf.float().cpu().numpy()
        return out


def run(items: Sequence[dict[str, Any]], spec: DetectorSpec, *, batch_size: int, actors: int, gpus: bool,
        decode_tasks: int) -> Iterator[dict[str, np.ndarray]]:
    """The regions of `items` ({"path", "img_id", "given": float32 bytes or b""}), batch by batch, in the
    order they finish."""
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = console.verbose()
    console.quiet_ray_data(logging.getLogger("ray.data"))
    blocks = max(1, min(len(items), (len(items) + batch_size - 1) // batch_size))
    ds = ray.data.from_items(list(items), override_num_blocks=blocks)
    ds = ds.map_batches(decode_batch, batch_size=batch_size, batch_format="pyarrow", num_cpus=1,
                        compute=ray.data.TaskPoolStrategy(size=max(1, decode_tasks)))
    ds = ds.map_batches(DetectorActor, fn_constructor_kwargs={"spec": spec}, batch_size=batch_size,
                        batch_format="pyarrow", compute=ray.data.ActorPoolStrategy(size=max(1, actors)), num_cpus=1, num_gpus=1 if gpus else 0)
    return ds.iter_batches(batch_size=None, batch_format="numpy", prefetch_batches=1)
