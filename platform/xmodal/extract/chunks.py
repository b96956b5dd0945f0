"""The detector's output written down, and the work folder that holds it until the run is published.

A batch of regions (`Regions`: numpy arrays, padded to the run's `num_objects` slots, with each image's
`num_boxes`) becomes either store rows (`store_table`: the image columns of `store.image_schema`, float16
features, boxes normalised by the image size, exactly as `ingest.parse_tsv_line` + `pack_images` make
them from a TSV line) or reference TSV lines (`tsv_lines`: float32 features and pixel boxes, base64,
the fields `ingest.TSV_FIELDS` in order, as LXMERT's `extract_coco_image.py` writes them).

The work folder, `.OUT.extract` beside OUT (hidden, same file system, so publishing is a rename):

    extract.json                 the options that decide the features (a rerun with others is refused)
    images/part-NNNNN.parquet    store format: finished shards (become the store's shards as they are)
    chunks/part-NNNNN.tsv        tsv format: finished chunks of lines (concatenated into OUT)
    rejects.jsonl                this run's rejected images: {"path", "img_id", "reason"} a line

A chunk is written under a temporary name and renamed when whole, so after an interrupt or a crash the
folder holds finished chunks only (a leftover temporary file is removed at the next start); the images
in them are what a rerun skips. Rejected images are tried again by a rerun.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from xmodal.data.common import options_diff, options_json
from xmodal.data.lxmert.features import SHARD_DIR
from xmodal.data.lxmert.store import image_columns, image_schema, write_shard
from xmodal.extract.images import ExtractError

STATE_FILE = "extract.json"
TSV_DIR = "chunks"
REJECTS_FILE = "rejects.jsonl"
TMP_PREFIX = ".tmp-"

Regions = Mapping[str, np.ndarray]  # img_id, img_h, img_w, num_boxes, features, boxes, obj_ids, obj_conf, ...
REGION_FIELDS = ("img_id", "img_h", "img_w", "num_boxes", "features", "boxes", "obj_ids", "obj_conf", "attr_ids",
                 "attr_conf")


def take(batches: Iterable[tuple[Regions, np.ndarray]]) -> dict[str, np.ndarray]:
    """The rows `idx` of each batch, concatenated (one array per field)."""
    parts = list(batches)
    return {f: np.concatenate([np.asarray(b[f])[idx] for b, idx in parts]) for f in REGION_FIELDS}


def _valid(r: Regions) -> np.ndarray:
    return np.arange(r["features"].shape[1])[None, :] < np.asarray(r["num_boxes"])[:, None]


def store_table(r: Regions) -> pa.Table:
    """Store rows of a batch of regions: padded slots zero (features, boxes, confidences) and -1 (ids)."""
    n, feat_dim = r["features"].shape[1:]
    valid = _valid(r)
    feats = np.where(valid[..., None], r["features"], 0).astype(np.float32)
    if not np.isfinite(feats).all() or np.abs(feats).max(initial=0.0) > float(np.finfo(np.float16).max):
        bad = int(np.nonzero(~np.isfinite(feats).all((1, 2)) | (np.abs(feats).max((1, 2)) > 65504))[0][0])
        raise ExtractError(f"img_id {r['img_id'][bad]!r}: the detector gave features that are not finite or do not "
                           "fit float16 (max 65504); check the weights")
    h = np.asarray(r["img_h"], np.float32)[:, None]
    w = np.asarray(r["img_w"], np.float32)[:, None]
    scale = np.stack([w, h, w, h], -1)  # (B, 1, 4)
    boxes = np.where(valid[..., None], np.clip(r["boxes"].astype(np.float32) / scale, 0.0, 1.0), 0)
    cols = image_columns({
        "img_id": np.asarray(r["img_id"], dtype=object), "img_h": np.asarray(r["img_h"]),
        "img_w": np.asarray(r["img_w"]), "num_boxes": np.asarray(r["num_boxes"]),
        "features": feats.astype(np.float16), "boxes": boxes.astype(np.float32),
        "obj_ids": np.where(valid, r["obj_ids"], -1), "attr_ids": np.where(valid, r["attr_ids"], -1),
        "obj_conf": np.where(valid, np.clip(r["obj_conf"], 0, 1), 0),
        "attr_conf": np.where(valid, np.clip(r["attr_conf"], 0, 1), 0)})
    return pa.Table.from_pydict(cols, schema=image_schema(n, feat_dim))


def _b64(a: np.ndarray, dtype: type) -> str:
    return base64.b64encode(np.ascontiguousarray(a, dtype=dtype).tobytes()).decode("ascii")


def tsv_lines(r: Regions) -> list[str]:
    """The reference's TSV lines (fields `ingest.TSV_FIELDS`) of a batch of regions."""
    lines = []
    for i in range(len(r["img_id"])):
        k = int(r["num_boxes"][i])
        fields = [str(r["img_id"][i]), str(int(r["img_h"][i])), str(int(r["img_w"][i])),
                  _b64(r["obj_ids"][i, :k], np.int64), _b64(r["obj_conf"][i, :k], np.float32),
                  _b64(r["attr_ids"][i, :k], np.int64), _b64(r["attr_conf"][i, :k], np.float32), str(k),
                  _b64(r["boxes"][i, :k], np.float32), _b64(r["features"][i, :k], np.float32)]
        lines.append("\t".join(fields) + "\n")
    return lines


class WorkDir:
    """The resumable work folder of one extraction (module docstring)."""

    def __init__(self, path: Path, fmt: str):
        self.path = path
        self.fmt = fmt
        self.chunk_dir = path / (SHARD_DIR if fmt == "store" else TSV_DIR)
        self.suffix = ".parquet" if fmt == "store" else ".tsv"

    @staticmethod
    def beside(out: Path) -> Path:
        return out.parent / f".{out.name}.extract"

    @classmethod
    def open(cls, out: Path, fmt: str, fingerprint: dict[str, Any], restart: bool) -> WorkDir:
        """The work folder for `out`: made, or an earlier run's kept when its options match (else refused,
        unless `restart`, which starts over). Leftover temporary files of a killed run are removed."""
        path = cls.beside(out)
        wanted = options_json(fingerprint)
        if path.exists():
            state = path / STATE_FILE
            try:
                recorded = json.loads(state.read_text())
            except (OSError, ValueError):
                recorded = None
            if not isinstance(recorded, dict):  # killed before its state was written: nothing to keep
                shutil.rmtree(path)
            elif recorded != wanted:
                if not restart:
                    diff = "; ".join(options_diff(recorded, wanted))
                    raise ExtractError(f"{path}: an unfinished extraction to {out} with other options is kept here "
                                       f"({diff}); rerun it with its options to finish it, or pass --restart to "
                                       "discard it and start over")
                shutil.rmtree(path)
            elif restart:
                shutil.rmtree(path)
        work = cls(path, fmt)
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.parent / f"{TMP_PREFIX}{path.name}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            (tmp / STATE_FILE).write_text(json.dumps(wanted, indent=2) + "\n")
            os.rename(tmp, path)
        work.chunk_dir.mkdir(exist_ok=True)
        for p in work.chunk_dir.iterdir():
            if p.name.startswith(TMP_PREFIX):
                p.unlink()
        (path / REJECTS_FILE).write_text("")  # rejects are tried again: this run's list starts empty
        return work

    def chunks(self) -> list[Path]:
        return sorted(p for p in self.chunk_dir.iterdir() if p.name.endswith(self.suffix)
                      and not p.name.startswith(TMP_PREFIX))

    def done(self) -> dict[str, str]:
        """img_id -> the chunk holding it, over the finished chunks. An image in two chunks (or twice in
        one) is refused: publishing them would put it in OUT twice."""
        out: dict[str, str] = {}
        for p in self.chunks():
            if self.fmt == "store":
                ids = pq.read_table(p, columns=["img_id"]).column("img_id").to_pylist()
            else:
                with open(p, encoding="utf-8") as f:
                    ids = [line.split("\t", 1)[0] for line in f if line.strip()]
            for i in ids:
                if i in out:
                    raise ExtractError(f"{self.path}: img_id {i!r} is in {out[i]} and in {p.name}: the unfinished "
                                       "extraction kept here holds an image twice; pass --restart to discard it and "
                                       "start over")
                out[i] = p.name
        return out

    def _next(self) -> Path:
        have = self.chunks()
        k = int(have[-1].name.removeprefix("part-").split(".")[0]) + 1 if have else 0
        return self.chunk_dir / f"part-{k:05d}{self.suffix}"

    def write(self, r: Regions, row_group_images: int) -> Path:
        """One finished chunk of regions, whole or not at all."""
        final = self._next()
        tmp = final.with_name(TMP_PREFIX + final.name)
        if self.fmt == "store":
            write_shard(store_table(r), tmp, row_group_images)
        else:
            with open(tmp, "w", encoding="utf-8") as f:
                f.writelines(tsv_lines(r))
        os.rename(tmp, final)
        return final

    def reject(self, path: str, img_id: str, reason: str) -> None:
        with open(self.path / REJECTS_FILE, "a", encoding="utf-8") as f:
            f.write(json.dumps({"path": path, "img_id": img_id, "reason": reason}) + "\n")
