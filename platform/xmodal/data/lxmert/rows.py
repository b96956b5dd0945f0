"""An LXMERT store's rows: a block of images with their sentences in memory (`ImageBlock`, numpy), and
the same as Arrow columns and Parquet shards (`block_to_table`, `table_to_block`, `write_shard`,
`read_shard`).

Row schema (`arrow_schema`): img_id, img_h, img_w, num_boxes; features float16 and boxes float32
(normalised x1 y1 x2 y2) as `pa.fixed_shape_tensor` so Ray Data and pyarrow hand back dense
(B, N, F) arrays; detector obj/attr ids (int32) and confidences (float32) as (N,) tensors;
`input_ids` list<fixed_size_list<int32, T>> (pre-tokenised [CLS] ... [SEP] [PAD]...);
`answer_ids`/`answer_scores` list<list<...>>: the known answers of each sentence with their soft
scores (empty = not a question, or no answer in the table). Padding objects (num_boxes < N) have
zero features/boxes and id -1. The image columns (`image_schema`) are also all of a feature-only
store's (`xmodal.data.lxmert.features`). A store whose images came from `jobs/extract.py` has one more
column, `SOURCE` (string): where each image came from. An extraction's feature store records it relative
to its IMAGES folder (its manifest's `options.images_root`, `IMAGES_ROOT`); an LXMERT store ingested
from one records it as an absolute path or URI (`absolute_source`), null for an image from a TSV file.
Imports numpy and pyarrow only.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from xmodal.data.errors import StoreError
from xmodal.data.location import Location, open_parquet

SOURCE = pa.field("source", pa.string())  # where each image came from (a store of extracted images only)
IMAGES_ROOT = "images_root"  # a feature store's manifest option: what its relative sources are relative to


def absolute_source(source: str, root: str | None) -> str:
    """A recorded source as an absolute path or URI: a relative one is joined to `root` (a folder or a URI)."""
    if "://" in source or source.startswith("/") or not root:
        return source
    return f"{root.rstrip('/')}/{source}" if "://" in root else str(Path(root) / source)


# ============================================================================ rows in memory


@dataclass
class ImageBlock:
    """A block of image rows as numpy arrays: what the writer takes and the batch builder reads.

    K images, S sentences in all, A answer candidates in all; N objects, F feature dims, T tokens.
    """

    img_id: np.ndarray  # (K,) object (str)
    img_h: np.ndarray  # (K,) int32
    img_w: np.ndarray  # (K,) int32
    num_boxes: np.ndarray  # (K,) int32, real objects (the rest is padding)
    features: np.ndarray  # (K, N, F) float16
    boxes: np.ndarray  # (K, N, 4) float32 normalised x1 y1 x2 y2
    obj_ids: np.ndarray  # (K, N) int32, -1 on padding
    obj_conf: np.ndarray  # (K, N) float32
    attr_ids: np.ndarray  # (K, N) int32, -1 on padding
    attr_conf: np.ndarray  # (K, N) float32
    sent_offsets: np.ndarray  # (K + 1,) int64: image k owns sentences [o[k], o[k+1])
    input_ids: np.ndarray  # (S, T) int32
    ans_offsets: np.ndarray  # (S + 1,) int64: sentence s owns answers [o[s], o[s+1])
    ans_ids: np.ndarray  # (A,) int32 answer-table labels
    ans_scores: np.ndarray  # (A,) float32 soft scores
    source: np.ndarray | None = None  # (K,) object: str, or None where unknown; None: the store has no column

    @property
    def num_images(self) -> int:
        return int(self.img_id.shape[0])

    @property
    def num_sentences(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def sentences_per_image(self) -> np.ndarray:
        return np.diff(self.sent_offsets)  # (K,)

    @property
    def visual_mask(self) -> np.ndarray:
        return np.arange(self.features.shape[1])[None, :] < self.num_boxes[:, None]  # (K, N) bool

    def take(self, images: np.ndarray) -> ImageBlock:
        """The sub-block of the given image indices (in that order), sentences and answers included."""
        images = np.asarray(images, dtype=np.int64)
        s0, s1 = self.sent_offsets[images], self.sent_offsets[images + 1]
        sents = concat_ranges(s0, s1)  # (S',) sentence indices
        a0, a1 = self.ans_offsets[sents], self.ans_offsets[sents + 1]
        answers = concat_ranges(a0, a1)
        return ImageBlock(
            img_id=self.img_id[images], img_h=self.img_h[images], img_w=self.img_w[images],
            num_boxes=self.num_boxes[images], features=self.features[images], boxes=self.boxes[images],
            obj_ids=self.obj_ids[images], obj_conf=self.obj_conf[images], attr_ids=self.attr_ids[images],
            attr_conf=self.attr_conf[images], sent_offsets=_offsets(s1 - s0), input_ids=self.input_ids[sents],
            ans_offsets=_offsets(a1 - a0), ans_ids=self.ans_ids[answers], ans_scores=self.ans_scores[answers],
            source=None if self.source is None else self.source[images])

    @staticmethod
    def concat(blocks: Sequence[ImageBlock]) -> ImageBlock:
        if len(blocks) == 1:
            return blocks[0]

        def cat(name: str) -> np.ndarray:
            return np.concatenate([getattr(b, name) for b in blocks])

        return ImageBlock(
            img_id=cat("img_id"), img_h=cat("img_h"), img_w=cat("img_w"), num_boxes=cat("num_boxes"),
            features=cat("features"), boxes=cat("boxes"), obj_ids=cat("obj_ids"), obj_conf=cat("obj_conf"),
            attr_ids=cat("attr_ids"), attr_conf=cat("attr_conf"),
            sent_offsets=_offsets(np.concatenate([b.sentences_per_image for b in blocks])),
            input_ids=cat("input_ids"),
            ans_offsets=_offsets(np.concatenate([np.diff(b.ans_offsets) for b in blocks])),
            ans_ids=cat("ans_ids"), ans_scores=cat("ans_scores"),
            source=None if all(b.source is None for b in blocks) else np.concatenate(
                [np.full(b.num_images, None, object) if b.source is None else b.source for b in blocks]))

    def check(self, where: str) -> None:
        """Shape/dtype consistency (writer side): a bug here must not reach the shards."""
        k = self.num_images
        n, f = self.features.shape[1:]
        expect = {
            "img_h": (k,), "img_w": (k,), "num_boxes": (k,), "boxes": (k, n, 4), "obj_ids": (k, n),
            "obj_conf": (k, n), "attr_ids": (k, n), "attr_conf": (k, n), "sent_offsets": (k + 1,),
            "ans_offsets": (self.num_sentences + 1,),
        }
        for name, shape in expect.items():
            got = getattr(self, name).shape
            if got != shape:
                raise StoreError(f"{where}: field {name!r} has shape {got}, expected {shape}")
        if self.source is not None and self.source.shape != (k,):
            raise StoreError(f"{where}: field 'source' has shape {self.source.shape}, expected ({k},)")
        if self.features.dtype != np.float16:
            raise StoreError(f"{where}: features must be float16, got {self.features.dtype}")
        if int(self.sent_offsets[-1]) != self.num_sentences or int(self.ans_offsets[-1]) != self.ans_ids.shape[0]:
            raise StoreError(f"{where}: sentence/answer offsets do not match the arrays")


def _offsets(counts: np.ndarray) -> np.ndarray:
    out = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=out[1:])
    return out


def concat_ranges(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Concatenation of arange(s, e) for each pair, vectorised (no per-range Python)."""
    lengths = (ends - starts).astype(np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    ends_cum = np.cumsum(lengths)
    base = np.repeat(starts.astype(np.int64) - (ends_cum - lengths), lengths)
    return base + np.arange(total, dtype=np.int64)


# ============================================================================ Arrow <-> numpy


# The image columns, shared with the feature-only stores (`xmodal.data.lxmert.features`).
IMAGE_FIELDS: tuple[str, ...] = ("img_id", "img_h", "img_w", "num_boxes", "features", "boxes", "obj_ids", "obj_conf",
                                 "attr_ids", "attr_conf")


def image_schema(num_objects: int, feat_dim: int) -> pa.Schema:
    """The image columns of a shard (an LXMERT store's first columns; all of a feature-only store's)."""
    n = num_objects
    return pa.schema([
        ("img_id", pa.string()),
        ("img_h", pa.int32()),
        ("img_w", pa.int32()),
        ("num_boxes", pa.int32()),
        ("features", pa.fixed_shape_tensor(pa.float16(), [n, feat_dim])),
        ("boxes", pa.fixed_shape_tensor(pa.float32(), [n, 4])),
        ("obj_ids", pa.fixed_shape_tensor(pa.int32(), [n])),
        ("obj_conf", pa.fixed_shape_tensor(pa.float32(), [n])),
        ("attr_ids", pa.fixed_shape_tensor(pa.int32(), [n])),
        ("attr_conf", pa.fixed_shape_tensor(pa.float32(), [n])),
    ])


def arrow_schema(num_objects: int, feat_dim: int, max_seq_len: int) -> pa.Schema:
    return pa.schema([
        *image_schema(num_objects, feat_dim),
        ("input_ids", pa.list_(pa.list_(pa.int32(), max_seq_len))),
        ("answer_ids", pa.list_(pa.list_(pa.int32()))),
        ("answer_scores", pa.list_(pa.list_(pa.float32()))),
    ])


def _tensor_array(x: np.ndarray) -> pa.Array:
    return pa.FixedShapeTensorArray.from_numpy_ndarray(np.ascontiguousarray(x))


def image_columns(a: Mapping[str, np.ndarray]) -> dict[str, pa.Array]:
    """The image columns (`IMAGE_FIELDS`) of K images given as numpy arrays named like ImageBlock's."""
    return {
        "img_id": pa.array([str(x) for x in a["img_id"]], pa.string()),
        "img_h": pa.array(a["img_h"].astype(np.int32)),
        "img_w": pa.array(a["img_w"].astype(np.int32)),
        "num_boxes": pa.array(a["num_boxes"].astype(np.int32)),
        "features": _tensor_array(a["features"]),
        "boxes": _tensor_array(a["boxes"].astype(np.float32)),
        "obj_ids": _tensor_array(a["obj_ids"].astype(np.int32)),
        "obj_conf": _tensor_array(a["obj_conf"].astype(np.float32)),
        "attr_ids": _tensor_array(a["attr_ids"].astype(np.int32)),
        "attr_conf": _tensor_array(a["attr_conf"].astype(np.float32)),
    }


def write_shard(table: pa.Table, path: Path, row_group_images: int) -> None:
    """One Parquet shard: features and boxes uncompressed (they do not compress; reading them is the
    hot path), the rest Snappy."""
    pq.write_table(table, path, row_group_size=row_group_images, use_dictionary=False,
                   compression={c: ("NONE" if c in ("features", "boxes") else "SNAPPY") for c in table.schema.names},
                   write_statistics=False)


def read_shard(path: str | Path | Location, row_groups: Sequence[int] | None = None,
               columns: Sequence[str] | None = None) -> pa.Table:
    """Read one shard (or some of its row groups), local or remote; errors name the shard."""
    try:
        pf = open_parquet(path)
        if row_groups is None:
            return pf.read(columns=columns)
        return pf.read_row_groups(list(row_groups), columns=columns)
    except (OSError, pa.ArrowException) as e:
        raise StoreError(f"{path}: cannot read the shard ({type(e).__name__}: {e}); it is corrupted, "
                         "re-ingest the store") from None


def block_to_table(block: ImageBlock) -> pa.Table:
    n, f = block.features.shape[1:]
    t = block.input_ids.shape[1]
    sent_off = pa.array(block.sent_offsets.astype(np.int32))
    ans_off = pa.array(block.ans_offsets.astype(np.int32))
    tokens = pa.FixedSizeListArray.from_arrays(pa.array(block.input_ids.reshape(-1).astype(np.int32)), t)
    cols = {
        **image_columns({name: getattr(block, name) for name in IMAGE_FIELDS}),
        "input_ids": pa.ListArray.from_arrays(sent_off, tokens),
        "answer_ids": pa.ListArray.from_arrays(
            sent_off, pa.ListArray.from_arrays(ans_off, pa.array(block.ans_ids.astype(np.int32)))),
        "answer_scores": pa.ListArray.from_arrays(
            sent_off, pa.ListArray.from_arrays(ans_off, pa.array(block.ans_scores.astype(np.float32)))),
    }
    schema = arrow_schema(n, f, t)
    if block.source is not None:
        cols[SOURCE.name] = pa.array([None if x is None else str(x) for x in block.source], SOURCE.type)
        schema = schema.append(SOURCE)
    return pa.Table.from_pydict(cols, schema=schema)


def _chunks(col: pa.ChunkedArray | pa.Array) -> list[pa.Array]:
    return list(col.chunks) if isinstance(col, pa.ChunkedArray) else [col]


def _dense(col: pa.ChunkedArray | pa.Array, name: str) -> np.ndarray:
    """A tensor column -> (K, *shape) numpy, zero-copy for a single chunk.

    Accepts Arrow's fixed_shape_tensor and Ray Data's own tensor extension types (both store
    fixed-size rows in a list-like storage array); slicing offsets are honoured via flatten().
    """
    parts = []
    for arr in _chunks(col):
        typ = arr.type
        if isinstance(typ, pa.FixedShapeTensorType):
            shape = tuple(typ.shape)
        elif hasattr(typ, "shape"):  # Ray's ArrowTensorType(V2)
            shape = tuple(typ.shape)
        else:
            raise StoreError(f"column {name!r}: expected a tensor column, got type {typ}")
        storage = arr.storage if isinstance(arr, pa.ExtensionArray) else arr
        values = storage.flatten().to_numpy(zero_copy_only=False)
        parts.append(values.reshape((len(arr), *shape)))
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _nested(col: pa.ChunkedArray | pa.Array) -> tuple[list[np.ndarray], list[pa.Array]]:
    """list<X> column -> (per-chunk offsets rebased to 0, per-chunk flattened child arrays)."""
    offs, children = [], []
    for arr in _chunks(col):
        o = arr.offsets.to_numpy().astype(np.int64)
        offs.append(o - o[0])
        children.append(arr.flatten())
    return offs, children


def _join_offsets(parts: list[np.ndarray]) -> np.ndarray:
    return _offsets(np.concatenate([np.diff(p) for p in parts])) if len(parts) > 1 else parts[0]


def table_to_block(table: pa.Table) -> ImageBlock:
    """Arrow rows (from pyarrow or Ray Data, any chunking) -> ImageBlock, vectorised and zero-copy
    where Arrow allows (no per-row Python)."""
    sent_parts, tok_children = _nested(table.column("input_ids"))
    sent_offsets = _join_offsets(sent_parts)
    tok_values = [c.flatten().to_numpy(zero_copy_only=False) for c in tok_children]
    t = tok_children[0].type.list_size
    input_ids = (tok_values[0] if len(tok_values) == 1 else np.concatenate(tok_values)).reshape(-1, t)

    ans_outer, ans_inner = _nested(table.column("answer_ids"))
    _, score_inner = _nested(table.column("answer_scores"))
    ans_offs, ans_vals, score_vals = [], [], []
    for inner, sinner in zip(ans_inner, score_inner, strict=True):
        o = inner.offsets.to_numpy().astype(np.int64)
        ans_offs.append(o - o[0])
        ans_vals.append(inner.flatten().to_numpy(zero_copy_only=False))
        score_vals.append(sinner.flatten().to_numpy(zero_copy_only=False))
    img_id = table.column("img_id").to_numpy(zero_copy_only=False) if "img_id" in table.column_names \
        else np.zeros(table.num_rows, dtype=object)

    def ints(name: str) -> np.ndarray:
        return table.column(name).to_numpy().astype(np.int32, copy=False)

    return ImageBlock(
        img_id=img_id,
        img_h=ints("img_h") if "img_h" in table.column_names else np.zeros(table.num_rows, np.int32),
        img_w=ints("img_w") if "img_w" in table.column_names else np.zeros(table.num_rows, np.int32),
        num_boxes=ints("num_boxes"),
        features=_dense(table.column("features"), "features"),
        boxes=_dense(table.column("boxes"), "boxes"),
        obj_ids=_dense(table.column("obj_ids"), "obj_ids"),
        obj_conf=_dense(table.column("obj_conf"), "obj_conf"),
        attr_ids=_dense(table.column("attr_ids"), "attr_ids"),
        attr_conf=_dense(table.column("attr_conf"), "attr_conf"),
        sent_offsets=sent_offsets,
        input_ids=input_ids,
        ans_offsets=_join_offsets(ans_offs),
        ans_ids=ans_vals[0] if len(ans_vals) == 1 else np.concatenate(ans_vals),
        ans_scores=score_vals[0] if len(score_vals) == 1 else np.concatenate(score_vals),
        source=np.asarray(table.column(SOURCE.name).to_pylist(), dtype=object).reshape(-1)
        if SOURCE.name in table.column_names else None,
    )
