"""The detector's output written down, and the work folder that holds it until the run is published.

A batch of regions (`Regions`: numpy arrays, padded to the run's `num_objects` slots, with each image's
`num_boxes`) becomes either store rows (`store_table`: the image columns of `rows.image_schema`, float16
features, boxes normalised by the image size, exactly as `tsv.parse_tsv_line` + `pack_images` make
them from a TSV line, and each image's `source`) or reference TSV lines (`tsv_lines`: float32 features and pixel boxes, base64,
the fields `tsv.TSV_FIELDS` in order, as LXMERT's `extract_coco_image.py` writes them).

The work folder, `.OUT.extract` beside OUT (hidden, same file system, so publishing is a rename):

    extract.json                 the options that decide the features (a rerun with others is refused
                                 while the folder holds finished images)
    images/part-NNNNN.parquet    store format: finished shards (become the store's shards as they are)
    chunks/part-NNNNN.tsv        tsv format: finished chunks of lines (concatenated into OUT)
    rejects.jsonl                this run's rejected images: {"path", "img_id", "reason"} a line

A chunk is written under a temporary name and renamed when whole, so after an interrupt or a crash the
folder holds finished chunks only (a leftover temporary file is removed at the next start); the images
in them are what a rerun skips. Rejected images are tried again by a rerun. The folder is made when the
run's first results arrive, and removed again when the run ends without a finished chunk.
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
from xmodal.data.lxmert.rows import SOURCE, image_columns, image_schema, write_shard
from xmodal.extract.images import ExtractError

STATE_FILE = "extract.json"
TSV_DIR = "chunks"
REJECTS_FILE = "rejects.jsonl"
TMP_PREFIX = ".tmp-"

Regions = Mapping[str, np.ndarray]  # img_id, img_h, img_w, num_boxes, features, boxes, obj_ids, obj_conf, ...
REGION_FIELDS = ("img_id", "img_h", "img_w", "num_boxes", "features", "boxes", "obj_ids", "obj_conf", "attr_ids",
                 "attr_conf")


def take(batches: Iterable[tuple[Regions, np.ndarray]], sources: Mapping[str, str] | None = None
         ) -> dict[str, np.ndarray]:
    """The rows `idx` of each batch, concatenated (one array per field); with `sources` (img_id -> where
    the image came from), a `source` field too."""
    parts = list(batches)
    out = {f: np.concatenate([np.asarray(b[f])[idx] for b, idx in parts]) for f in REGION_FIELDS}
    if sources is not None:
        out["source"] = np.array([sources[str(i)] for i in out["img_id"]], dtype=object)
    return out


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


class WorkDir:
    """The resumable work folder of one extraction (module docstring). `find` only looks: the folder is
    made (or an earlier one discarded) by `start`, once the run's first results arrive, so that a run
    failing before that (Ray unreachable, a bad box, every image unreadable) leaves nothing; `discard_if_empty`
    removes a folder that ended up holding no finished chunk."""

    def __init__(self, path: Path, fmt: str, wanted: dict[str, Any] | None = None, keep: bool = False):
        self.path = path
        self.fmt = fmt
        self.chunk_dir = path / (SHARD_DIR if fmt == "store" else TSV_DIR)
        self.suffix = ".parquet" if fmt == "store" else ".tsv"
        self.wanted = wanted
        self.keep = keep  # an earlier run's folder with these options: its chunks are resumed
        self.started = False

    @staticmethod
    def beside(out: Path) -> Path:
        return out.parent / f".{out.name}.extract"

    @classmethod
    def find(cls, out: Path, fmt: str, fingerprint: dict[str, Any], restart: bool) -> WorkDir:
        """The work folder for `out`, nothing changed on disk: an earlier run's is kept when its options
        match, refused when they differ and it holds finished images (unless `restart`: it is then
        discarded when this run starts); one holding no finished image is simply replaced."""
        path = cls.beside(out)
        wanted = options_json(fingerprint)
        keep = False
        if path.exists():
            try:
                recorded = json.loads((path / STATE_FILE).read_text())
            except (OSError, ValueError):
                recorded = None
            held = cls(path, fmt).chunks()
            if isinstance(recorded, dict) and recorded != wanted and held and not restart:
                diff = "; ".join(options_diff(recorded, wanted))
                raise ExtractError(f"{path}: an unfinished extraction to {out} with other options is kept here "
                                   f"({len(cls(path, fmt).done())} images done; {diff}); rerun it with its options "
                                   "to finish it, or pass --restart to discard it and start over")
            keep = recorded == wanted and not restart
        return cls(path, fmt, wanted, keep)

    def start(self) -> None:
        """Make the folder (once): an earlier one that is not kept is discarded first. Leftover temporary
        files of a killed run are removed; the rejects list starts empty (rejects are tried again)."""
        if self.started:
            return
        path = self.path
        if path.exists() and not self.keep:
            shutil.rmtree(path)
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.parent / f"{TMP_PREFIX}{path.name}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            (tmp / STATE_FILE).write_text(json.dumps(self.wanted, indent=2) + "\n")
            os.rename(tmp, path)
        self.chunk_dir.mkdir(exist_ok=True)
        for p in self.chunk_dir.iterdir():
            if p.name.startswith(TMP_PREFIX):
                p.unlink()
        (path / REJECTS_FILE).write_text("")
        self.started = True

    def discard_if_empty(self) -> bool:
        """Remove the folder when it holds no finished chunk (nothing to resume); whether it did."""
        if self.path.exists() and not self.chunks():
            shutil.rmtree(self.path, ignore_errors=True)
            return True
        return False

    def chunks(self) -> list[Path]:
        if not self.chunk_dir.is_dir():
            return []
        return sorted(p for p in self.chunk_dir.iterdir() if p.name.endswith(self.suffix)
                      and not p.name.startswith(TMP_PREFIX))

    def done(self) -> dict[str, str]:
        """img_id -> the chunk holding it, over the finished chunks (none in a folder this run replaces). An
        image in two chunks (or twice in one) is refused: publishing them would put it in OUT twice."""
        out: dict[str, str] = {}
        if self.wanted is not None and not self.keep and not self.started:
            return out
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
