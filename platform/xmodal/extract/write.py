"""The detector's output written where it is made: Ray Data's write tasks turn each bundle of detected
images into one shard of the output (`write_batch`, through the store's `ShardSink`) and send the driver
only what it commits: the shard's name, its image ids and rows, and the rejected images.

A batch of regions (`Regions`: numpy arrays, padded to the run's `num_objects` slots, with each image's
`num_boxes`) becomes either store rows (`store_table`: the image columns of `rows.image_schema`, float16
features, boxes normalised by the image size, exactly as `tsv.parse_tsv_line` + `pack_images` make
them from a TSV line, and each image's `source`) or reference TSV lines (`lines_table`: float32 features
and pixel boxes, base64, the fields `tsv.TSV_FIELDS` in order, as LXMERT's `extract_coco_image.py`
writes them; the TSV file is their concatenation at the end). A shard's rows are sorted by img_id, so a
retried task writes the same shard under the same name. Its footer keeps each image's input identity
(`INPUTS`: img_id, path, size, modification time), what a resume checks the images against.
"""

from __future__ import annotations

import base64
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from xmodal.data.lxmert.feature_writer import LINES, ShardSink
from xmodal.data.lxmert.rows import SOURCE, image_columns, image_schema
from xmodal.extract.images import ExtractError

REJECTS_FILE = "rejects.jsonl"
INPUTS = "inputs"  # a shard's kept footer data: [[img_id, path, size, mtime_ns], ...] in row order
# A reject's kind: a file that is not a usable image (counted against --max-rejected), or a given box
# outside its image (an error in --boxes-from: the run fails).
IMAGE, BOXES = "image", "boxes"

Regions = Mapping[str, np.ndarray]  # img_id, img_h, img_w, num_boxes, features, boxes, obj_ids, obj_conf, ...
REGION_FIELDS = ("img_id", "img_h", "img_w", "num_boxes", "features", "boxes", "obj_ids", "obj_conf", "attr_ids",
                 "attr_conf")


def _valid(r: Regions) -> np.ndarray:
    return np.arange(r["features"].shape[1])[None, :] < np.asarray(r["num_boxes"])[:, None]


def store_table(r: Regions) -> pa.Table:
    """Store rows of a batch of regions: padded slots zero (features, boxes, confidences) and -1 (ids)."""
    n, feat_dim = r["features"].shape[1:]
    valid = _valid(r)
    # one conversion, then the padded slots zeroed: a value past float16's range becomes inf and is found
    feats = np.asarray(r["features"], np.float32).astype(np.float16)
    feats[~valid] = 0
    finite = np.isfinite(feats).all((1, 2))
    if not finite.all():
        raise ExtractError(f"img_id {r['img_id'][int(np.nonzero(~finite)[0][0])]!r}: the detector gave features that "
                           "are not finite or do not fit float16 (max 65504); check the weights")
    h = np.asarray(r["img_h"], np.float32)[:, None]
    w = np.asarray(r["img_w"], np.float32)[:, None]
    scale = np.stack([w, h, w, h], -1)  # (B, 1, 4)
    boxes = np.where(valid[..., None], np.clip(r["boxes"].astype(np.float32) / scale, 0.0, 1.0), 0)
    cols = image_columns({
        "img_id": np.asarray(r["img_id"], dtype=object), "img_h": np.asarray(r["img_h"]),
        "img_w": np.asarray(r["img_w"]), "num_boxes": np.asarray(r["num_boxes"]),
        "features": feats, "boxes": boxes.astype(np.float32),
        "obj_ids": np.where(valid, r["obj_ids"], -1), "attr_ids": np.where(valid, r["attr_ids"], -1),
        "obj_conf": np.where(valid, np.clip(r["obj_conf"], 0, 1), 0),
        "attr_conf": np.where(valid, np.clip(r["attr_conf"], 0, 1), 0)})
    schema = image_schema(n, feat_dim)
    if "source" in r:  # where each image came from (rows.SOURCE)
        cols[SOURCE.name] = pa.array([str(x) for x in r["source"]], SOURCE.type)
        schema = schema.append(SOURCE)
    return pa.Table.from_pydict(cols, schema=schema)


def _b64(a: np.ndarray, dtype: type) -> str:
    return base64.b64encode(np.ascontiguousarray(a, dtype=dtype).tobytes()).decode("ascii")


def tsv_lines(r: Regions) -> list[str]:
    """The reference's TSV lines (fields `tsv.TSV_FIELDS`) of a batch of regions."""
    lines = []
    for i in range(len(r["img_id"])):
        k = int(r["num_boxes"][i])
        fields = [str(r["img_id"][i]), str(int(r["img_h"][i])), str(int(r["img_w"][i])),
                  _b64(r["obj_ids"][i, :k], np.int64), _b64(r["obj_conf"][i, :k], np.float32),
                  _b64(r["attr_ids"][i, :k], np.int64), _b64(r["attr_conf"][i, :k], np.float32), str(k),
                  _b64(r["boxes"][i, :k], np.float32), _b64(r["features"][i, :k], np.float32)]
        lines.append("\t".join(fields) + "\n")
    return lines




def lines_table(r: Regions) -> pa.Table:
    """A TSV output's shard: each image's id and its reference TSV line."""
    return pa.Table.from_pydict({"img_id": [str(x) for x in r["img_id"]], "line": tsv_lines(r)}, schema=LINES)


# The record a write task returns to the driver, one row per shard (a bundle of rejects only: shard "").
RECORD = pa.schema([("shard", pa.string()), ("ids", pa.list_(pa.string())), ("sha256", pa.string()),
                    ("seconds", pa.float64()), ("bytes", pa.int64()), ("rejects", pa.string()),
                    ("error", pa.string())])


@dataclass(frozen=True)
class ShardWrite:
    """How the write tasks write (pickled to each): where (`sink`), which output (`fmt`: store or tsv),
    and, for tests, `fault`: a marker file; the first write task that finds it missing makes it and dies
    after writing its shard, before returning (a write task lost: Ray runs it again)."""

    sink: ShardSink
    fmt: str = "store"
    fault: str | None = None


def _lose_the_task_once(marker: str | None) -> None:
    if marker is not None:
        try:
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            return
        os.close(fd)
        os._exit(1)  # noqa: SLF001 - the process dies as a lost node's would: no result, no cleanup


def write_batch(batch: dict[str, np.ndarray], write: ShardWrite) -> pa.Table:
    """One bundle of the detector's output (its images and rejects) -> one shard of its images, written
    by `write.sink`; returns the record the driver commits (names, ids, rows, rejects; no features)."""
    reject = np.asarray(batch["reject"], dtype=object)
    rejects = [[str(batch["path"][i]), str(batch["img_id"][i]), str(reject[i]), str(batch["reject_kind"][i])]
               for i in np.nonzero(reject != "")[0]]
    ok = np.nonzero(reject == "")[0]
    ok = ok[np.argsort(np.asarray(batch["img_id"], dtype=object)[ok].astype(str), kind="stable")]
    whole = len(ok) == len(reject) and bool((ok == np.arange(len(ok))).all())  # no copy of the features needed
    record = {"shard": "", "ids": [], "sha256": "", "seconds": 0.0, "bytes": 0, "rejects": json.dumps(rejects),
              "error": ""}
    if len(ok):
        rows = {f: np.asarray(batch[f]) if whole else np.asarray(batch[f])[ok] for f in (*REGION_FIELDS, "source")}
        try:
            table = store_table(rows) if write.fmt == "store" else lines_table(rows)
        except ExtractError as e:
            record["error"] = str(e)
            return pa.Table.from_pylist([record], schema=RECORD)
        inputs = [[str(batch["img_id"][i]), str(batch["path"][i]), int(batch["size"][i]), int(batch["mtime"][i])]
                  for i in ok]
        info = write.sink.write(table, {INPUTS: inputs})
        _lose_the_task_once(write.fault)
        record.update(shard=info.name, ids=list(info.ids), sha256=info.sha256, seconds=info.seconds, bytes=info.bytes)
    return pa.Table.from_pylist([record], schema=RECORD)
