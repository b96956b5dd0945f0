"""The LXMERT feature store: Parquet shards + `manifest.json` + `vocab.txt` + `answers.json`.

Layout (one row per image, that image's sentences nested, so each image's 36 x 2048 features are
read once per epoch and expanded into its sentence samples on the CPU side):

    STORE/manifest.json          dims, per-shard row/sentence counts, how the store was built
    STORE/vocab.txt              WordPiece vocabulary the sentences were tokenised with
    STORE/answers.json           QA answer table (label index = position)
    STORE/{train,minival}/part-NNNNN.parquet

Row schema (`arrow_schema`): img_id, img_h, img_w, num_boxes; features float16 and boxes float32
(normalised x1 y1 x2 y2) as `pa.fixed_shape_tensor` so Ray Data and pyarrow hand back dense
(B, N, F) arrays; detector obj/attr ids (int32) and confidences (float32) as (N,) tensors;
`input_ids` list<fixed_size_list<int32, T>> (pre-tokenised [CLS] ... [SEP] [PAD]...);
`answer_ids`/`answer_scores` list<list<...>>: the known answers of each sentence with their soft
scores (empty = not a question, or no answer in the table). Padding objects (num_boxes < N) have
zero features/boxes and id -1.

Writes go to a hidden temporary directory beside the target that is renamed into place only when
complete (`StoreWriter`); `open_store` checks the manifest against the shards' footers.

Cost of the tensor layout (measured here, one core): Parquet stores a fixed-size list as a LIST
with a definition/repetition level per value, so decoding the float16 features runs at ~0.35-0.5
GB/s, against 4-8 GB/s for the same bytes as one fixed_size_binary value per image. At the paper's
~51 sentences per image that is ~3 KB of features per sample (>100 K samples/s per read core), so
the read is not the bottleneck; stores with few sentences per image pay more per sample.
Imports numpy and pyarrow only.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pydantic

from xmodal.data.answers import AnswerTable
from xmodal.data.atomic import StagedDir, check_target, local_target
from xmodal.data.common import (
    Location,
    Manifest,
    StoreError,
    Unit,
    locate,
    open_listed_parquet,
    open_parquet,
    store_path,
)
from xmodal.data.tokenizer import VOCAB_FILE, WordPieceTokenizer

SCHEMA_VERSION = 1
KIND = "lxmert"
SPLITS: tuple[str, ...] = ("train", "minival")


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
            ans_offsets=_offsets(a1 - a0), ans_ids=self.ans_ids[answers], ans_scores=self.ans_scores[answers])

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
            ans_ids=cat("ans_ids"), ans_scores=cat("ans_scores"))

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
    return pa.Table.from_pydict(cols, schema=arrow_schema(n, f, t))


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
    )


# ============================================================================ manifest


class ShardInfo(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    file: str  # relative to the store directory
    rows: int  # images
    sentences: int
    questions: int  # sentences with at least one known answer


class MinivalSplit(pydantic.BaseModel):
    """How the images were dealt into minival and train."""

    model_config = pydantic.ConfigDict(extra="forbid")

    # reference: the images of the minival JSON files (the reference's mscoco_minival.json);
    # hash: crc32(img_id) below a fraction; seeded: an exact seeded fraction (synthetic stores)
    method: Literal["reference", "hash", "seeded"]
    files: list[str] = []  # reference: the minival JSON files (absolute paths)
    chosen_by_name: bool = False  # reference: taken from --json by the reference's file name
    fraction: float | None = None  # hash, seeded: the fraction asked for


class ImageOrder(pydantic.BaseModel):
    """The order the images were written in (shards, row groups, rows)."""

    model_config = pydantic.ConfigDict(extra="forbid")

    # seeded: sorted by a keyed hash of img_id (`ingest.order_key`), so shards mix the sources;
    # source: the order of the input files (e.g. COCO then VG)
    method: Literal["seeded", "source"]
    seed: int | None = None  # seeded: the key


class LxmertManifest(Manifest):
    """What `manifest.json` holds (kind "lxmert"). `open_store` checks it against the shards.
    Stores written before the kind was recorded have no "kind" field: they open, and count as an
    older format (an embedded default is rebuilt)."""

    KIND: ClassVar[str] = KIND
    SCHEMA_VERSION: ClassVar[int] = SCHEMA_VERSION
    DERIVED: ClassVar[tuple[str, ...]] = ("totals",)

    num_objects: int
    feat_dim: int
    num_object_labels: int
    num_attr_labels: int
    num_answers: int
    vocab_size: int
    max_seq_len: int
    special_tokens: dict[str, int]
    shards: dict[Literal["train", "minival"], list[ShardInfo]]
    source: str  # "lxmert" (reference TSV + JSON) or "synthetic"
    inputs: list[str] = []  # absolute paths of the files ingested
    options: dict[str, Any] = {}  # the options that built it
    unknown_answers: int = 0  # answer candidates not in the answer table (ignored)
    unanswerable_questions: int = 0  # questions none of whose answers is in the table (no QA target)
    truncated_sentences: int = 0  # sentences longer than max_seq_len tokens
    dropped_images: int = 0  # images with features but no sentence (not stored)
    missing_labelf: int = 0  # JSON records without "labelf", taken as having no questions (--allow-missing-labelf)
    minival_split: MinivalSplit | None = None  # None: built before the split was recorded
    image_order: ImageOrder | None = None  # None: not recorded (synthetic, or built before it was)
    created: str = ""

    # Fields added after stores were first written: left out of `identity` at their defaults, so a
    # store's fingerprint does not change when this code reads an older manifest.
    _LATER_FIELDS: ClassVar[dict[str, Any]] = {"missing_labelf": 0, "minival_split": None, "image_order": None}

    @classmethod
    def upgrade(cls, raw: dict[str, Any]) -> str | None:
        if "kind" not in raw:
            raw["kind"] = KIND
            return 'no "kind" field'
        return None

    def images(self, split: str) -> int:
        return sum(s.rows for s in self.shards.get(split, []))

    def sentences(self, split: str) -> int:
        return sum(s.sentences for s in self.shards.get(split, []))

    def questions(self, split: str) -> int:
        return sum(s.questions for s in self.shards.get(split, []))

    def dump(self) -> dict[str, Any]:
        d = super().dump()
        # Per-split totals are derived, but written too so a reader of the JSON sees them.
        d["totals"] = {s: {"images": self.images(s), "sentences": self.sentences(s),
                           "questions": self.questions(s)} for s in self.shards}
        return d

    def identity(self) -> dict[str, Any]:
        """The manifest without its build date and kind (what a fine-tuning set's store fingerprint
        hashes; the same for a store written before kinds were recorded)."""
        d = super().dump()
        d.pop("created", None)
        d.pop("kind", None)
        for name, default in self._LATER_FIELDS.items():
            if d.get(name) == default:
                d.pop(name, None)
        return d


# ============================================================================ the store


class LxmertStore:
    """An opened, checked store. Cheap to pickle (path + manifest) for Ray workers. `path`: a local
    folder or a URI (`common.Location`); its shards are read where they are, row group by row group."""

    def __init__(self, path: Path | Location, manifest: LxmertManifest, row_groups: dict[str, list[tuple[int, int]]]):
        self.path = path
        self.manifest = manifest
        # shard file (relative) -> (images, sentences) per row group, read from the footers at open.
        self._row_groups = row_groups
        self._tokenizer: WordPieceTokenizer | None = None
        self._answers: AnswerTable | None = None

    def __repr__(self) -> str:
        m = self.manifest
        return (f"LxmertStore({str(self.path)!r}, {m.source}, train {m.images('train')} images / "
                f"{m.sentences('train')} sentences, minival {m.images('minival')} / {m.sentences('minival')})")

    def __getstate__(self) -> dict:
        return {"path": self.path, "manifest": self.manifest, "row_groups": self._row_groups}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"], state["manifest"], state["row_groups"])

    def shard_paths(self, split: str) -> list[str]:
        """Absolute paths of the split's shards (empty if the split has none)."""
        if split not in SPLITS:
            raise StoreError(f"{self.path}: unknown split {split!r}; expected one of {', '.join(SPLITS)}")
        return [str(self.path / s.file) for s in self.manifest.shards.get(split, [])]

    def tokenizer(self) -> WordPieceTokenizer:
        if self._tokenizer is None:
            self._tokenizer = WordPieceTokenizer.from_vocab(self.path / VOCAB_FILE, self.manifest.max_seq_len)
        return self._tokenizer

    def answers(self) -> AnswerTable:
        if self._answers is None:
            self._answers = AnswerTable.load(self.path)
        return self._answers

    # ----------------------------------------------------------------- Ray-free reading

    def read_table(self, file: str, row_groups: Sequence[int] | None = None,
                   columns: Sequence[str] | None = None) -> pa.Table:
        """Read one shard (or some of its row groups); errors name the shard."""
        return read_shard(self.path / file, row_groups, columns)

    def image_files(self) -> list[str]:
        """Every shard (relative paths), all splits: where a fine-tuning set looks its images up."""
        return [s.file for shards in self.manifest.shards.values() for s in shards]

    def read_split(self, split: str) -> ImageBlock:
        """The whole split in memory (tests, small stores)."""
        tables = [self.read_table(s.file) for s in self.manifest.shards.get(split, [])]
        if not tables:
            raise StoreError(f"{self.path}: split {split!r} has no shards")
        return table_to_block(pa.concat_tables(tables))

    def units(self, split: str) -> list[Unit]:
        """The split's row groups, the units it is dealt out in (samples = sentences)."""
        return [Unit(str(self.path / s.file), g, rows, sentences) for s in self.manifest.shards.get(split, [])
                for g, (rows, sentences) in enumerate(self._row_groups[s.file])]


def _count_vocab(path: Location) -> int:
    """Lines, as iterating over the file counts them (a last line without a newline counts)."""
    data = path.read_bytes()
    return data.count(b"\n") + (1 if data and not data.endswith(b"\n") else 0)


def open_store(path: str | Path | Location) -> LxmertStore:
    """Open a store (a local folder or a URI such as s3://bucket/prefix/store) and check its manifest
    against the shards' footers: the files exist, are Parquet, have the row counts, sentence counts and
    schema (incl. num_objects, feat_dim, max_seq_len) the manifest says; vocab.txt and answers.json
    match vocab_size and num_answers. Reads no feature data (of a remote store: the manifest, vocab,
    answers and footers only)."""
    root = locate(path)
    if not root.is_dir():
        raise StoreError(f"{root}: feature store does not exist (build it with `python jobs/ingest.py "
                         "lxmert|synthetic`{', then upload it' if root.remote else ''})")
    m = LxmertManifest.read(root)  # names the path and the kind expected when it is not an LXMERT store
    expected = arrow_schema(m.num_objects, m.feat_dim, m.max_seq_len)
    row_groups: dict[str, list[tuple[int, int]]] = {}  # file -> (images, sentences) per row group
    for shards in m.shards.values():
        for s in shards:
            p = root / s.file
            pf = open_listed_parquet(p, s.rows)
            schema, md = pf.schema_arrow, pf.metadata
            for want in expected:
                if want.name not in schema.names:
                    raise StoreError(f"{p}: column {want.name!r} is missing (expected {want.type})")
                got = schema.field(want.name).type
                if got != want.type:
                    raise StoreError(f"{p}: column {want.name!r} has type {got}, expected {want.type} "
                                     f"(manifest: num_objects={m.num_objects}, feat_dim={m.feat_dim}, "
                                     f"max_seq_len={m.max_seq_len})")
            # Leaf values of input_ids = sentences * T plus one placeholder per image without sentences.
            col = _leaf_index(pf, schema.get_field_index("input_ids"))
            leaves = [md.row_group(g).column(col).num_values for g in range(md.num_row_groups)]
            leaf = sum(leaves)
            lo, hi = s.sentences * m.max_seq_len, s.sentences * m.max_seq_len + s.rows
            if not lo <= leaf <= hi:
                raise StoreError(f"{p}: holds about {leaf // m.max_seq_len} sentences, manifest says {s.sentences}")
            # (images, sentences) per row group: every stored image has a sentence, so a row group's
            # leaf values are exactly its sentences x T.
            row_groups[s.file] = [(md.row_group(g).num_rows, n // m.max_seq_len) for g, n in enumerate(leaves)]
    vocab = root / VOCAB_FILE
    if not vocab.is_file():
        raise StoreError(f"{vocab}: missing (the store's tokenizer vocabulary)")
    if (n := _count_vocab(vocab)) != m.vocab_size:
        raise StoreError(f"{vocab}: has {n} tokens, manifest says vocab_size={m.vocab_size}")
    answers = AnswerTable.load(root)
    if len(answers) != m.num_answers:
        raise StoreError(f"{root / AnswerTable.FILE}: has {len(answers)} answers, manifest says "
                         f"num_answers={m.num_answers}")
    return LxmertStore(store_path(root), m, row_groups)


def _leaf_index(pf: pq.ParquetFile, arrow_col: int) -> int:
    """Index of the Parquet leaf column of a (single-leaf) Arrow column."""
    name = pf.schema_arrow.names[arrow_col]
    for i in range(pf.metadata.num_columns):
        if pf.schema.column(i).path.split(".")[0] == name:
            return i
    raise StoreError(f"{pf}: no Parquet leaf column for {name!r}")


# ============================================================================ writing


class StoreWriter(StagedDir):
    """Builds a store in a hidden temporary directory next to `path` (`StagedDir`); `finish()` renames it
    into place. Used as a context manager: any exception removes the temporary directory, so a failed
    ingest leaves nothing behind (and an existing store untouched)."""

    def __init__(self, path: str | Path, *, num_objects: int, feat_dim: int, max_seq_len: int,
                 images_per_shard: int = 256, row_group_images: int = 32, overwrite: bool = False):
        target = local_target(path)
        check_target(target, overwrite, KIND)
        super().__init__(target, overwrite, KIND)
        self.num_objects, self.feat_dim, self.max_seq_len = num_objects, feat_dim, max_seq_len
        self.images_per_shard = max(1, images_per_shard)
        self.row_group_images = max(1, min(row_group_images, self.images_per_shard))
        self._pending: dict[str, list[ImageBlock]] = {s: [] for s in SPLITS}
        self._pending_rows: dict[str, int] = dict.fromkeys(SPLITS, 0)
        self.shards: dict[str, list[ShardInfo]] = {s: [] for s in SPLITS}

    def add(self, split: str, block: ImageBlock) -> None:
        if split not in SPLITS:
            raise StoreError(f"unknown split {split!r}; expected one of {', '.join(SPLITS)}")
        if block.num_images == 0:
            return
        block.check(f"rows for {split}")
        if block.features.shape[1:] != (self.num_objects, self.feat_dim):
            raise StoreError(f"rows for {split}: features {block.features.shape[1:]}, store has "
                             f"({self.num_objects}, {self.feat_dim})")
        self._pending[split].append(block)
        self._pending_rows[split] += block.num_images
        while self._pending_rows[split] >= self.images_per_shard:
            self._flush(split, self.images_per_shard)

    def _flush(self, split: str, rows: int) -> None:
        block = ImageBlock.concat(self._pending[split])
        head = block.take(np.arange(rows)) if rows < block.num_images else block
        rest = block.take(np.arange(rows, block.num_images)) if rows < block.num_images else None
        self._pending[split] = [rest] if rest is not None else []
        self._pending_rows[split] = rest.num_images if rest is not None else 0
        rel = f"{split}/part-{len(self.shards[split]):05d}.parquet"
        (self.tmp / split).mkdir(exist_ok=True)
        table = block_to_table(head)
        write_shard(table, self.tmp / rel, self.row_group_images)
        questions = int((np.diff(head.ans_offsets) > 0).sum())
        self.shards[split].append(ShardInfo(file=rel, rows=head.num_images, sentences=head.num_sentences,
                                            questions=questions))

    def finish(self, *, tokenizer: WordPieceTokenizer, answers: AnswerTable, source: str,
               num_object_labels: int, num_attr_labels: int, inputs: Sequence[str] = (),
               options: dict[str, Any] | None = None, minival_split: MinivalSplit | None = None,
               image_order: ImageOrder | None = None, **counts: int) -> LxmertStore:
        for split in SPLITS:
            if self._pending_rows[split]:
                self._flush(split, self._pending_rows[split])
        if not any(self.shards.values()):
            raise StoreError(f"{self.path}: nothing to write (no image has a sentence)")
        tokenizer.save(self.tmp)
        answers.save(self.tmp)
        manifest = LxmertManifest(
            schema_version=SCHEMA_VERSION, kind=KIND, num_objects=self.num_objects, feat_dim=self.feat_dim,
            num_object_labels=num_object_labels, num_attr_labels=num_attr_labels, num_answers=len(answers),
            vocab_size=tokenizer.vocab_size, max_seq_len=self.max_seq_len,
            special_tokens=dict(tokenizer.special_ids), shards={s: v for s, v in self.shards.items() if v},
            source=source, inputs=list(inputs), options=dict(options or {}), minival_split=minival_split,
            image_order=image_order,
            created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **counts)
        manifest.write(self.tmp)
        open_store(self.tmp)  # check what was written before it becomes visible
        self.publish()
        return open_store(self.path)
