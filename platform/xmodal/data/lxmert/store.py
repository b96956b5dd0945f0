"""The LXMERT feature store: Parquet shards + `manifest.json` + `vocab.txt` + `answers.json`.

Layout (one row per image, that image's sentences nested, so each image's 36 x 2048 features are
read once per epoch and expanded into its sentence samples on the CPU side):

    STORE/manifest.json          dims, per-shard row/sentence counts, how the store was built
    STORE/vocab.txt              WordPiece vocabulary the sentences were tokenised with
    STORE/answers.json           QA answer table (label index = position)
    STORE/{train,minival}/part-NNNNN.parquet

Rows: `xmodal.data.lxmert.rows` (the schema, and the numpy block each shard's rows become).

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
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pydantic

from xmodal.data.answers import AnswerTable
from xmodal.data.atomic import StagedDir, check_target, local_target
from xmodal.data.errors import StoreError
from xmodal.data.location import Location, locate, store_path
from xmodal.data.lxmert.rows import (
    ImageBlock,
    arrow_schema,
    block_to_table,
    read_shard,
    table_to_block,
    write_shard,
)
from xmodal.data.manifest import Manifest
from xmodal.data.tokenizer import VOCAB_FILE, WordPieceTokenizer
from xmodal.data.units import Unit, open_listed_parquet

SCHEMA_VERSION = 1
KIND = "lxmert"
SPLITS: tuple[str, ...] = ("train", "minival")


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
    folder or a URI (`location.Location`); its shards are read where they are, row group by row group."""

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
                         f"lxmert|synthetic`{', then upload it' if root.remote else ''})")
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
