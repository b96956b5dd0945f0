"""The image inputs of an ingest: reference feature TSV lines, and extracted feature stores read as the same.

TSV (docs/papers.md#lxmert-data-formats), no header, one image a line: img_id, img_h, img_w,
objects_id (b64 int64[N]), objects_conf (b64 float32[N]), attrs_id (b64 int64[N]), attrs_conf (b64
float32[N]), num_boxes, boxes (b64 float32[N*4], pixel x1 y1 x2 y2), features (b64 float32[N*2048]).
`scan_tsv_ids` pre-scans every line's shape without decoding (field count, base64 lengths against
num_boxes, one feature width); `parse_tsv_line` decodes and checks a line (base64, box count, feature
width, finite values, boxes inside the image, label ranges), normalises the boxes by the image size
and casts the features to float16 (`TsvImage`); `pack_images` pads decoded images into arrays.
Used by `jobs/ingest.py lxmert` (`xmodal.data.lxmert.ingest`) and `features`
(`xmodal.data.lxmert.features`).
"""

from __future__ import annotations

import base64
import binascii
import bisect
import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import pyarrow as pa

from xmodal.base.console import progress_bar, say
from xmodal.base.errors import UserError
from xmodal.data.location import open_parquet
from xmodal.data.lxmert.rows import IMAGES_ROOT, SOURCE, absolute_source, read_shard
from xmodal.data.manifest import kind_at, read_manifest_json

TSV_FIELDS: tuple[str, ...] = ("img_id", "img_h", "img_w", "objects_id", "objects_conf", "attrs_id", "attrs_conf",
                               "num_boxes", "boxes", "features")
BOX_TOLERANCE_PX = 1.0  # detector boxes may poke a pixel past the border; more than that is bad data


class IngestError(UserError):
    """Bad input: the message names the file, the line or record, the field, the value and what was expected."""


def fail(where: str, msg: str) -> IngestError:
    return IngestError(f"{where}: {msg}")


# ============================================================================ TSV lines


def _b64(value: str, name: str, dtype: type, where: str) -> np.ndarray:
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as e:
        raise fail(where, f"field {name!r}: invalid base64 ({e}); value starts {value[:24]!r}") from None
    size = np.dtype(dtype).itemsize
    if len(raw) % size:
        raise fail(where, f"field {name!r}: decodes to {len(raw)} bytes, not a whole number of "
                   f"{np.dtype(dtype).name} ({size} bytes each)")
    return np.frombuffer(raw, dtype=dtype)


def _int(value: str, name: str, where: str, minimum: int = 1) -> int:
    try:
        v = int(value)
    except ValueError:
        raise fail(where, f"field {name!r}: expected an integer, got {value[:40]!r}") from None
    if v < minimum:
        raise fail(where, f"field {name!r}: expected >= {minimum}, got {v}")
    return v


@dataclass
class TsvImage:
    img_id: str
    img_h: int
    img_w: int
    num_boxes: int
    obj_ids: np.ndarray  # (n,) int32
    obj_conf: np.ndarray  # (n,) float32
    attr_ids: np.ndarray
    attr_conf: np.ndarray
    boxes: np.ndarray  # (n, 4) float32 normalised
    features: np.ndarray  # (n, F) float16
    source: str | None = None  # an extracted store's row: where the image came from (absolute path or URI)


def parse_tsv_line(line: str, where: str, *, feat_dim: int | None, num_objects: int, num_object_labels: int,
                   num_attr_labels: int) -> TsvImage:
    """Decode and check one reference TSV line (`where` = "file:line" for errors)."""
    fields = line.rstrip("\r\n").split("\t")
    if len(fields) != len(TSV_FIELDS):
        raise fail(where, f"expected {len(TSV_FIELDS)} tab-separated fields ({', '.join(TSV_FIELDS)}), "
                   f"got {len(fields)}")
    img_id = fields[0]
    where = f"{where} (img_id {img_id!r})"
    h, w = _int(fields[1], "img_h", where), _int(fields[2], "img_w", where)
    n = _int(fields[7], "num_boxes", where)
    if n > num_objects:
        raise fail(where, f"field 'num_boxes': {n} boxes, the store holds at most --num-objects {num_objects}")
    arrays = {}
    for name, dtype, per_box in (("objects_id", np.int64, 1), ("objects_conf", np.float32, 1),
                                 ("attrs_id", np.int64, 1), ("attrs_conf", np.float32, 1),
                                 ("boxes", np.float32, 4)):
        a = _b64(fields[TSV_FIELDS.index(name)], name, dtype, where)
        if a.size != n * per_box:
            raise fail(where, f"field {name!r}: {a.size} values, expected num_boxes * {per_box} = {n * per_box} "
                       "(wrong number of boxes)")
        arrays[name] = a
    feats = _b64(fields[9], "features", np.float32, where)
    if feats.size % n:
        raise fail(where, f"field 'features': {feats.size} float32 values is not a whole number per box "
                   f"(num_boxes={n}); expected num_boxes * feature width")
    width = feats.size // n
    if feat_dim is not None and width != feat_dim:
        raise fail(where, f"field 'features': width {width} per box ({feats.size} values / {n} boxes), "
                   f"expected {feat_dim} (--feat-dim, else the width of the first image)")
    feats = feats.reshape(n, width)
    if not np.isfinite(feats).all():
        bad = np.argwhere(~np.isfinite(feats))[0]
        raise fail(where, f"field 'features': non-finite value {feats[bad[0], bad[1]]} at box {bad[0]}, dim {bad[1]}")
    peak = float(np.abs(feats).max()) if feats.size else 0.0
    if peak > float(np.finfo(np.float16).max):
        raise fail(where, f"field 'features': value {peak:g} does not fit float16 (max 65504)")
    for name, limit in (("objects_id", num_object_labels), ("attrs_id", num_attr_labels)):
        ids = arrays[name]
        bad = np.nonzero((ids < 0) | (ids >= limit))[0]
        if len(bad):
            raise fail(where, f"field {name!r}: id {int(ids[bad[0]])} at box {bad[0]} outside [0, {limit}) "
                               f"(--num-{'object' if name == 'objects_id' else 'attr'}-labels {limit})")
    for name in ("objects_conf", "attrs_conf"):
        c = arrays[name]
        bad = np.nonzero(~np.isfinite(c) | (c < 0) | (c > 1.0 + 1e-3))[0]
        if len(bad):
            raise fail(where, f"field {name!r}: confidence {c[bad[0]]} at box {bad[0]}, expected in [0, 1]")
    boxes = arrays["boxes"].reshape(n, 4)
    t = BOX_TOLERANCE_PX
    bad = ~np.isfinite(boxes).all(1) | (boxes[:, 0] < -t) | (boxes[:, 1] < -t) | (boxes[:, 2] > w + t) \
        | (boxes[:, 3] > h + t) | (boxes[:, 2] < boxes[:, 0]) | (boxes[:, 3] < boxes[:, 1])
    if bad.any():
        i = int(np.nonzero(bad)[0][0])
        raise fail(where, f"field 'boxes': box {i} = {boxes[i].tolist()} (x1 y1 x2 y2, pixels) is not inside "
                   f"the {w}x{h} image (expected 0 <= x1 <= x2 <= img_w, 0 <= y1 <= y2 <= img_h)")
    norm = np.clip(boxes / np.array([w, h, w, h], np.float32), 0.0, 1.0)
    return TsvImage(img_id=img_id, img_h=h, img_w=w, num_boxes=n, obj_ids=arrays["objects_id"].astype(np.int32),
                    obj_conf=np.clip(arrays["objects_conf"], 0, 1), attr_ids=arrays["attrs_id"].astype(np.int32),
                    attr_conf=np.clip(arrays["attrs_conf"], 0, 1), boxes=norm, features=feats.astype(np.float16))


# base64 array fields: (name, bytes per value, values per box)
_B64_ARRAYS: tuple[tuple[str, int, int], ...] = (("objects_id", 8, 1), ("objects_conf", 4, 1), ("attrs_id", 8, 1),
                                                 ("attrs_conf", 4, 1), ("boxes", 4, 4))


def _b64_size(line: bytes, start: int, end: int) -> int | None:
    """Bytes that the base64 text line[start:end] decodes to; None if it is not whole 4-character groups."""
    n = end - start
    if n % 4:
        return None
    pad = (n >= 1 and line[end - 1] == 0x3D) + (n >= 2 and line[end - 2] == 0x3D)  # "="
    return n // 4 * 3 - pad


def check_line_shape(line: bytes, where: str, width: int | None, width_from: str) -> int:
    """The shape of one TSV line, without decoding: 10 fields, every base64 array holds num_boxes
    values, the features a whole `width` per box (None: any width). Returns the feature width. A
    line cut short (a truncated file) fails here, named by file:line, before images are matched."""
    cut = "" if line.endswith(b"\n") else " (the file ends in this line, without a line end: it looks cut off)"
    end = len(line)
    while end and line[end - 1] in (0x0A, 0x0D):
        end -= 1
    starts = [0]
    while len(starts) < len(TSV_FIELDS) and (tab := line.find(b"\t", starts[-1], end)) >= 0:
        starts.append(tab + 1)
    if len(starts) != len(TSV_FIELDS) or line.find(b"\t", starts[-1], end) >= 0:
        fields = line.count(b"\t", 0, end) + 1
        raise fail(where, f"expected {len(TSV_FIELDS)} tab-separated fields ({', '.join(TSV_FIELDS)}), "
                   f"got {fields}{cut}")
    bounds = [(a, b - 1) for a, b in zip(starts, starts[1:], strict=False)] + [(starts[-1], end)]
    img_id = line[:bounds[0][1]].decode("utf-8", errors="replace")
    where = f"{where} (img_id {img_id!r})"
    a, b = bounds[TSV_FIELDS.index("num_boxes")]
    n = _int(line[a:b].decode("utf-8", errors="replace"), "num_boxes", where)
    for name, itemsize, per_box in _B64_ARRAYS:
        a, b = bounds[TSV_FIELDS.index(name)]
        size = _b64_size(line, a, b)
        if size is None or size != n * per_box * itemsize:
            got = f"{size // itemsize} values" if size is not None and size % itemsize == 0 else \
                f"{b - a} base64 characters ({size} bytes)"
            raise fail(where, f"field {name!r}: {got}, expected num_boxes * {per_box} = {n * per_box} "
                       f"({itemsize}-byte values; wrong number of boxes){cut}")
    a, b = bounds[TSV_FIELDS.index("features")]
    size = _b64_size(line, a, b)
    if size is None or size % (4 * n):
        raise fail(where, f"field 'features': {b - a} base64 characters ({size} bytes) are not a whole number "
                   f"of float32 values per box (num_boxes={n}); expected num_boxes * feature width{cut}")
    got_width = size // (4 * n)
    if width is not None and got_width != width:
        raise fail(where, f"field 'features': width {got_width} per box ({size // 4} values / {n} boxes), "
                   f"expected {width} ({width_from}){cut}")
    return got_width


def scan_tsv_ids(paths: list[Path], progress: bool, feat_dim: int | None = None,
                 offsets: dict[str, tuple[int, int, int]] | None = None) -> dict[str, str]:
    """img_id -> "file:line", reading every line's shape but decoding nothing (`check_line_shape`):
    duplicate images, lines cut short and feature widths other than `feat_dim` (else the first
    line's) fail here. `offsets`, if given, receives img_id -> (file index, byte offset, line number)
    for `tsv_lines_at`."""
    seen: dict[str, str] = {}
    width, width_from = feat_dim, "--feat-dim"
    bar = progress_bar(sum(p.stat().st_size for p in paths if not p.is_dir()), "scan TSV", "B", progress)
    for k, p in enumerate(paths):
        if is_feature_store(p):  # an extracted store: its img_id column and its width
            shards, width_here, _ = _store_shards(p)
            if width is None:
                width, width_from = width_here, f"the width of the first image, in {p}"
            elif width_here != width:
                raise fail(str(p), f"features of width {width_here}, expected {width} ({width_from})")
            for j, (shard, _) in enumerate(shards):
                ids = read_shard(shard, columns=["img_id"]).column("img_id").to_pylist()
                for row, img_id in enumerate(ids):
                    where = f"{p}: {shard.name} row {row}"
                    if img_id in seen:
                        raise fail(where, f"img_id {img_id!r} already has features at {seen[img_id]}")
                    seen[img_id] = where
                    if offsets is not None:
                        offsets[img_id] = (k, j, row)
            continue
        with open(p, "rb") as f:
            pos = 0
            for lineno, line in enumerate(f, 1):
                start, pos = pos, pos + len(line)
                bar.update(len(line))
                if not line.strip():
                    continue
                where = f"{p}:{lineno}"
                got = check_line_shape(line, where, width, width_from)
                if width is None:
                    width, width_from = got, f"the width of the first image, at {where}"
                img_id = line.split(b"\t", 1)[0].decode("utf-8", errors="replace")
                if img_id in seen:
                    raise fail(where, f"img_id {img_id!r} already has features at {seen[img_id]}")
                seen[img_id] = where
                if offsets is not None:
                    offsets[img_id] = (k, start, lineno)
    bar.close()
    return seen


def pack_images(images: list[TsvImage], num_objects: int, feat_dim: int) -> dict[str, np.ndarray]:
    """Decoded TSV images -> the image fields (`rows.IMAGE_FIELDS`) as (K, ...) arrays, padded to
    `num_objects` slots (zero features/boxes, id -1)."""
    k, n = len(images), num_objects
    feats = np.zeros((k, n, feat_dim), np.float16)
    boxes = np.zeros((k, n, 4), np.float32)
    ints = {name: np.full((k, n), -1, np.int32) for name in ("obj_ids", "attr_ids")}
    confs = {name: np.zeros((k, n), np.float32) for name in ("obj_conf", "attr_conf")}
    for i, im in enumerate(images):  # per image (not per object or token): k <= a few hundred
        m = im.num_boxes
        feats[i, :m], boxes[i, :m] = im.features, im.boxes
        ints["obj_ids"][i, :m], ints["attr_ids"][i, :m] = im.obj_ids, im.attr_ids
        confs["obj_conf"][i, :m], confs["attr_conf"][i, :m] = im.obj_conf, im.attr_conf
    return dict(img_id=np.array([im.img_id for im in images], dtype=object),
                img_h=np.array([im.img_h for im in images], np.int32),
                img_w=np.array([im.img_w for im in images], np.int32),
                num_boxes=np.array([im.num_boxes for im in images], np.int32), features=feats, boxes=boxes,
                **ints, **confs)


# ============================================================================ extracted stores as TSV input
#
# Every --tsv input may instead be a feature-only store directory (`jobs/extract.py` writes them; kind
# "features"): its rows are read as the TsvImage a TSV line decodes to (features float16, boxes
# normalised), and checked as one. A store's "line number" is its row index over all its shards.

FEATURE_STORE_KIND = "features"


def is_feature_store(p: Path) -> bool:
    """A feature-only store directory (what `jobs/extract.py` and `jobs/ingest.py features` write)."""
    return p.is_dir() and kind_at(p) == FEATURE_STORE_KIND


def check_tsv_inputs(paths: list[Path]) -> None:
    """Each --tsv input exists and is a TSV file or a feature-only store directory."""
    for p in paths:
        if p.is_dir() and not is_feature_store(p):
            raise IngestError(f"{p}: is a directory but not a feature-only store (no manifest.json of kind "
                              f"{FEATURE_STORE_KIND!r}); expected a feature TSV file or a store from jobs/extract.py")
        if not p.exists():
            raise IngestError(f"{p}: input file does not exist")


RANDOM_WEIGHTS_KEY = "random_weights_inputs"  # a built store's option: its inputs of random-weight features


def random_weight_inputs(paths: list[Path]) -> list[str]:
    """The --tsv inputs that are stores of features from a detector with random weights (`jobs/extract.py
    --random-weights`, for tests and benchmarks), or stores built from such stores."""
    found = []
    for p in paths:
        if is_feature_store(p):
            options = read_manifest_json(p / "manifest.json").get("options")
            if isinstance(options, dict) and (options.get("random_weights") or options.get(RANDOM_WEIGHTS_KEY)):
                found.append(str(p))
    return found


def mark_random_weights(paths: list[Path], options: dict) -> None:
    """Say so on the console, and record it in the options the new store's manifest keeps, when inputs
    hold random-weight features: a model trained on them learns nothing about the images."""
    found = random_weight_inputs(paths)
    if found:
        say(f"[xmodal] warning: RANDOM WEIGHTS: {', '.join(found)} hold{'s' if len(found) == 1 else ''} features of a "
            "detector with random weights (jobs/extract.py --random-weights, for tests and benchmarks only); a "
            "model trained on this store learns nothing about the images")
        options[RANDOM_WEIGHTS_KEY] = found


class _StoreInput(NamedTuple):
    shards: list[tuple[Path, int]]  # (shard path, rows)
    feat_dim: int
    images_root: str | None  # what the store's relative sources are relative to


def _store_shards(p: Path) -> _StoreInput:
    """The shards of a feature-only store, its feature width and its images' root."""
    raw = read_manifest_json(p / "manifest.json")
    try:
        options = raw.get("options") or {}
        found = _StoreInput([(p / s["file"], int(s["rows"])) for s in raw["shards"]], int(raw["feat_dim"]),
                            options.get(IMAGES_ROOT) if isinstance(options, dict) else None)
    except (KeyError, TypeError, ValueError) as e:
        raise IngestError(f"{p / 'manifest.json'}: not a readable feature-only store manifest ({e})") from None
    if not isinstance(found.images_root, str | None):
        raise IngestError(f"{p / 'manifest.json'}: options.{IMAGES_ROOT} = {found.images_root!r}; expected a folder "
                          "or URI as text")
    for shard, _ in found.shards:
        _check_text_columns(p, shard)
    return found


def _check_text_columns(store: Path, shard: Path) -> None:
    """The columns read as text (`img_id`, and `source` where the store records it) hold text: a store
    written by other tools may hold numbers there, which no image id or path is."""
    schema = open_parquet(shard).schema_arrow
    for name, what in (("img_id", "each image's id"), (SOURCE.name, "where each image came from: a path or URI")):
        i = schema.get_field_index(name)
        if i >= 0 and not (pa.types.is_string(schema.field(i).type) or pa.types.is_large_string(schema.field(i).type)):
            raise IngestError(f"{store}: {shard.name}: column {name!r} holds {schema.field(i).type}; expected text "
                              f"({what})")


def records_sources(paths: list[Path]) -> bool:
    """Does any input record where its images came from (an extracted store's `source` column)?"""
    return any(SOURCE.name in open_parquet(shard).schema_arrow.names
               for p in paths if is_feature_store(p) for shard, _ in _store_shards(p).shards[:1])


def _store_images(p: Path, shard: Path, table, first_row: int = 0,
                  images_root: str | None = None) -> Iterator[tuple[str, TsvImage]]:
    """The rows of `table` (the shard's rows from `first_row` on) as the TsvImage a line decodes to, with
    the image's source where the store records one (made absolute against `images_root`)."""
    cols = {c: table.column(c).combine_chunks() for c in table.column_names}
    dense = {c: cols[c].to_numpy_ndarray() for c in ("features", "boxes", "obj_ids", "obj_conf", "attr_ids",
                                                     "attr_conf")}
    sources = cols[SOURCE.name].to_pylist() if SOURCE.name in cols else [None] * table.num_rows
    for i, img_id in enumerate(cols["img_id"].to_pylist()):
        n = int(cols["num_boxes"][i].as_py())
        yield f"{p}: {shard.name} row {first_row + i} (img_id {img_id!r})", TsvImage(
            img_id=img_id, img_h=int(cols["img_h"][i].as_py()), img_w=int(cols["img_w"][i].as_py()), num_boxes=n,
            obj_ids=dense["obj_ids"][i, :n].astype(np.int32), obj_conf=dense["obj_conf"][i, :n].astype(np.float32),
            attr_ids=dense["attr_ids"][i, :n].astype(np.int32), attr_conf=dense["attr_conf"][i, :n].astype(np.float32),
            boxes=dense["boxes"][i, :n].astype(np.float32), features=dense["features"][i, :n].astype(np.float16),
            source=None if sources[i] is None else absolute_source(sources[i], images_root))


def check_store_image(im: TsvImage, where: str, *, feat_dim: int | None, num_objects: int, num_object_labels: int,
                      num_attr_labels: int) -> TsvImage:
    """The checks `parse_tsv_line` makes, on a row of a feature-only store."""
    n = im.num_boxes
    if n < 1:
        raise fail(where, f"num_boxes {n}: expected >= 1")
    if n > num_objects:
        raise fail(where, f"{n} boxes, the store being built holds at most --num-objects {num_objects}")
    if feat_dim is not None and im.features.shape[1] != feat_dim:
        raise fail(where, f"feature width {im.features.shape[1]}, expected {feat_dim} (--feat-dim, else the width "
                   "of the first image)")
    for name, ids, limit in (("obj_ids", im.obj_ids, num_object_labels), ("attr_ids", im.attr_ids, num_attr_labels)):
        bad = np.nonzero((ids < 0) | (ids >= limit))[0]
        if len(bad):
            raise fail(where, f"{name}: id {int(ids[bad[0]])} at box {bad[0]} outside [0, {limit})")
    return im


def parse_item(item: str | TsvImage, where: str, **limits) -> TsvImage:
    """A TSV line (`parse_tsv_line`) or an extracted store's row (`check_store_image`)."""
    if isinstance(item, str):
        return parse_tsv_line(item, where, **limits)
    return check_store_image(item, where, **limits)


def item_bytes(item: str | TsvImage) -> bytes:
    """What a content fingerprint hashes of an input image: a TSV line's text, a store row's arrays."""
    if isinstance(item, str):
        return item.rstrip("\r\n").encode("utf-8")
    return b"\t".join([item.img_id.encode("utf-8"), str((item.img_h, item.img_w, item.num_boxes)).encode()]
                      + [np.ascontiguousarray(a).tobytes() for a in (item.obj_ids, item.obj_conf, item.attr_ids,
                                                                     item.attr_conf, item.boxes, item.features)])


def item_id(item: str | TsvImage) -> str:
    return item.split("\t", 1)[0] if isinstance(item, str) else item.img_id


def tsv_lines(paths: list[Path]) -> Iterator[tuple[str, str | TsvImage]]:
    """Every line of the TSV files (an extracted store's rows as TsvImage), in order."""
    for p in paths:
        if is_feature_store(p):
            store = _store_shards(p)
            for shard, _ in store.shards:
                yield from _store_images(p, shard, read_shard(shard), 0, store.images_root)
            continue
        with open(p, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                yield f"{p}:{lineno}", _text(raw, f"{p}:{lineno}")


def tsv_lines_at(paths: list[Path], locations: Iterable[tuple[int, int, int]]) -> Iterator[
        tuple[str, str | TsvImage]]:
    """The lines at (file index, byte offset, line number), in the order given (random access: one
    seek and one line read per image, every file kept open). For an extracted store, (store index,
    shard index, row): only the row group holding the row is read (and kept while the next rows come
    from it). In the seeded random order nearly every image is in another shard than the last: reading
    whole shards cost 85 ms per image at 36 x 2048 (256 images a shard), one row group 32x less."""
    stores = {k: _store_shards(p) for k, p in enumerate(paths) if is_feature_store(p)}
    files = {k: open(p, "rb") for k, p in enumerate(paths) if k not in stores}  # noqa: SIM115 - closed below
    starts: dict[tuple[int, int], list[int]] = {}  # (store, shard) -> first row of each row group, and the end
    cached: tuple[tuple[int, int, int], list[tuple[str, TsvImage]]] | None = None
    try:
        for k, offset, lineno in locations:
            if k in stores:
                shard = stores[k].shards[offset][0]
                if (k, offset) not in starts:
                    meta = open_parquet(shard).metadata
                    starts[(k, offset)] = list(itertools.accumulate(
                        (meta.row_group(g).num_rows for g in range(meta.num_row_groups)), initial=0))
                bounds = starts[(k, offset)]
                group = bisect.bisect_right(bounds, lineno) - 1
                if cached is None or cached[0] != (k, offset, group):
                    table = read_shard(shard, row_groups=[group])
                    cached = ((k, offset, group), list(_store_images(paths[k], shard, table, bounds[group],
                                                                     stores[k].images_root)))
                yield cached[1][lineno - bounds[group]]
                continue
            f = files[k]
            f.seek(offset)
            where = f"{paths[k]}:{lineno}"
            yield where, _text(f.readline(), where)
    finally:
        for f in files.values():
            f.close()


def _text(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise fail(where, f"not UTF-8 text ({e})") from None
