"""The MulT feature store: Parquet shards + `manifest.json`, and the numpy batch iterator.

Layout:

    STORE/manifest.json                      schema version, dataset, task, dims, per-shard rows, source
    STORE/{train,valid,test}/part-NNNNN.parquet

Row schema (one row per clip):
    row           int64 position of the clip in its split (MultBatch.index, also under Ray)
    id            string
    label         float32 sentiment in [-3, 3]          (task "sentiment")
                  fixed_size_list<int8, 4> class 0/1     (task "emotions": neutral, happy, sad, angry)
    text          binary: the UNPADDED (len, dim) float16 sequence, little-endian, row-major
    text_len      int32 true length (>= 1)
    audio, audio_len, vision, vision_len      the same

Why unpadded binary values (and not padded fixed-size tensors or list<float16>):
- Unaligned sequences vary a lot in length (MOSEI audio / vision up to 500 steps in the reference
  pickles, most clips shorter). Storing them unpadded keeps no padding on disk, and the batch
  iterator pads each batch only to its longest member (or to a fixed length, for static shapes)
  and passes the true lengths on, which the model needs for its masks anyway.
- A binary value decodes as one contiguous buffer: the split's values are a zero-copy
  `np.frombuffer` of the column, at memory speed. Parquet decodes list<float16> one value at a
  time with repetition levels (~0.4 GB/s measured for the LXMERT store against 4-8 GB/s for
  binary); at MOSEI shapes a clip is ~100 KB, so that alone would cap one read core near 4 K
  samples/s, below the GPU target.
- Dims live in the manifest; every value's byte length is checked against len x dim x 2 on load.

Writes go to a hidden temporary directory that is renamed into place when complete
(`write_store`); `MultStore.open` checks the manifest against the shards' footers and schemas.
Imports numpy and pyarrow only (torch when a MultBatch is made, so ingesting does not load it).
"""

from __future__ import annotations

import datetime
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pydantic

from xmodal.data.atomic import StagedDir, check_target, local_target
from xmodal.data.errors import StoreError
from xmodal.data.location import Location, locate, open_parquet, store_path
from xmodal.data.manifest import Manifest
from xmodal.data.units import Unit, open_listed_parquet

SCHEMA_VERSION = 1
KIND = "mult"
MODALITIES: tuple[str, ...] = ("text", "audio", "vision")
SPLITS: tuple[str, ...] = ("train", "valid", "test")
TASKS: tuple[str, ...] = ("sentiment", "emotions")
EMOTIONS: tuple[str, ...] = ("neutral", "happy", "sad", "angry")
FEATURE_DTYPE = np.dtype("<f2")
# Rows of a shard: small enough that a worker's read unit stays a few hundred MB at MOSEI sizes.
DEFAULT_SHARD_ROWS = 2048
# Rows of a row group, the unit a split is dealt out to workers in (units.epoch_units): small, so
# that workers' shares differ little (an epoch takes the steps of the smallest share) and small
# stores still give every worker some.
ROW_GROUP_ROWS = 32

if TYPE_CHECKING:
    from xmodal.core.batches import MultBatch

PadTo = Literal["batch", "store"] | Mapping[str, int]


def arrow_schema(task: str) -> pa.Schema:
    label = pa.float32() if task == "sentiment" else pa.list_(pa.int8(), len(EMOTIONS))
    fields = [pa.field("row", pa.int64()), pa.field("id", pa.string()), pa.field("label", label)]
    for m in MODALITIES:
        fields += [pa.field(m, pa.binary()), pa.field(f"{m}_len", pa.int32())]
    return pa.schema(fields)


# ============================================================================ a split in memory


@dataclass
class MultSplit:
    """One split as numpy arrays: the unpadded sequences of each modality packed end to end.

    N clips; `values[m]` (sum of lengths, dim) float16; clip i owns rows offsets[m][i]:offsets[m][i+1].
    """

    name: str
    ids: np.ndarray  # (N,) object (str)
    labels: np.ndarray  # (N,) float32 sentiment, or (N, 4) int64 class per emotion
    values: dict[str, np.ndarray]  # modality -> (S_m, dim_m) float16
    lengths: dict[str, np.ndarray]  # modality -> (N,) int64, each >= 1
    max_len: dict[str, int] | None = None  # static padding target ("store"); defaults to this split's max
    row_index: np.ndarray | None = None  # (N,) rows in the whole split, when this holds a part of it

    def __post_init__(self):
        self.offsets = {m: np.concatenate([[0], np.cumsum(self.lengths[m])]).astype(np.int64) for m in MODALITIES}
        if self.max_len is None:
            self.max_len = {m: int(self.lengths[m].max(initial=1)) for m in MODALITIES}

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def task(self) -> str:
        return "sentiment" if self.labels.ndim == 1 else "emotions"

    def dims(self) -> dict[str, int]:
        return {m: int(self.values[m].shape[1]) for m in MODALITIES}

    def check(self, where: str) -> None:
        n = len(self.ids)
        if self.labels.shape[0] != n:
            raise StoreError(f"{where}: {self.labels.shape[0]} labels for {n} clips")
        for m in MODALITIES:
            lens = self.lengths[m]
            if lens.shape != (n,):
                raise StoreError(f"{where}: {m}_len has shape {lens.shape}, expected ({n},)")
            if n and lens.min() < 1:
                bad = int(np.argmin(lens))
                raise StoreError(f"{where}: {m}_len of clip {self.ids[bad]!r} is {int(lens[bad])}, expected >= 1")
            if self.values[m].ndim != 2 or self.values[m].shape[0] != int(lens.sum()):
                raise StoreError(f"{where}: {m} holds {self.values[m].shape} values, expected "
                                 f"({int(lens.sum())}, dim) for the lengths given")
            if self.values[m].dtype != np.float16:
                raise StoreError(f"{where}: {m} is {self.values[m].dtype}, expected float16")

    # -- batches -------------------------------------------------------------------------------

    def order(self, *, shuffle: bool, seed: int = 0, epoch: int = 0, rank: int = 0, world: int = 1,
              even_shards: bool = True) -> np.ndarray:
        """Row order of one epoch for one worker: a permutation fixed by (seed, epoch), dealt
        round-robin to `world` workers; `even_shards` trims the tail so that every worker
        gets the same number of rows (data-parallel steps must match)."""
        n = len(self)
        order = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)
        if world > 1:
            if not 0 <= rank < world:
                raise ValueError(f"rank {rank} outside world {world}")
            if even_shards:
                order = order[: (n // world) * world]
            order = order[rank::world]
        return order

    def pad_lengths(self, rows: np.ndarray, pad_to: PadTo) -> dict[str, int]:
        if pad_to == "batch":
            return {m: int(self.lengths[m][rows].max(initial=1)) for m in MODALITIES}
        if pad_to == "store":
            return dict(self.max_len)
        if isinstance(pad_to, Mapping):
            missing = [m for m in MODALITIES if m not in pad_to]
            if missing:
                raise ValueError(f"pad_to lacks {missing}; expected a length for each of {list(MODALITIES)}")
            return {m: int(pad_to[m]) for m in MODALITIES}
        raise ValueError(f"pad_to = {pad_to!r}; expected 'batch', 'store' or a mapping modality -> length")

    def batch(self, rows: np.ndarray, pad_to: PadTo = "batch") -> MultBatch:
        """The clips `rows` as a MultBatch: sequences zero-padded at the end, float16."""
        rows = np.asarray(rows, dtype=np.int64)
        target = self.pad_lengths(rows, pad_to)
        feats = {}
        for m in MODALITIES:
            lens = self.lengths[m][rows]
            if lens.max(initial=0) > target[m]:
                i = int(rows[np.argmax(lens)])
                raise ValueError(f"clip {self.ids[i]!r} has {int(self.lengths[m][i])} {m} steps, more than "
                                 f"pad_to {target[m]}")
            feats[m] = pad_packed(self.values[m], self.offsets[m][rows], lens, target[m])
        index = rows if self.row_index is None else self.row_index[rows]
        return make_batch(feats, {m: self.lengths[m][rows] for m in MODALITIES}, self.labels[rows], index)

    def batches(self, batch_size: int, *, shuffle: bool = False, seed: int = 0, epoch: int = 0,
                drop_last: bool = False, rank: int = 0, world: int = 1, even_shards: bool = True,
                pad_to: PadTo = "batch") -> Iterator[MultBatch]:
        """Batches of one epoch, deterministic given (seed, epoch, rank, world). No Ray needed."""
        if batch_size < 1:
            raise ValueError(f"batch_size = {batch_size}; expected >= 1")
        order = self.order(shuffle=shuffle, seed=seed, epoch=epoch, rank=rank, world=world,
                           even_shards=even_shards)
        stop = len(order) - (len(order) % batch_size if drop_last else 0)
        for start in range(0, stop, batch_size):
            yield self.batch(order[start:start + batch_size], pad_to)

    def num_batches(self, batch_size: int, *, drop_last: bool = False, world: int = 1,
                    even_shards: bool = True) -> int:
        n = len(self) // world if (world > 1 and even_shards) else -(-len(self) // world)
        return n // batch_size if drop_last else -(-n // batch_size)


def pad_packed(values: np.ndarray, starts: np.ndarray, lengths: np.ndarray, t: int) -> np.ndarray:
    """Gather B packed sequences (rows starts[b] : starts[b] + lengths[b] of `values` (S, F)) into a
    zero-padded (B, t, F) array, in one vectorised scatter (no per-clip Python loop)."""
    b, f = len(lengths), values.shape[1]
    out = np.zeros((b, t, f), dtype=values.dtype)
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total:
        row = np.repeat(np.arange(b), lengths)
        first = np.repeat(np.cumsum(lengths) - lengths, lengths)
        step = np.arange(total) - first  # position inside its sequence
        src = np.repeat(np.asarray(starts, dtype=np.int64), lengths) + step
        out[row, step] = values[src]
    return out


def make_batch(feats: dict[str, np.ndarray], lengths: dict[str, np.ndarray], labels: np.ndarray,
               index: np.ndarray) -> MultBatch:
    """numpy arrays -> MultBatch (sentiment labels (B, 1) float32, emotions (B, 4) long)."""
    import torch

    from xmodal.core.batches import MultBatch

    if labels.ndim == 1:
        lab = torch.from_numpy(np.ascontiguousarray(labels, dtype=np.float32))[:, None]
    else:
        lab = torch.from_numpy(np.ascontiguousarray(labels, dtype=np.int64))
    return MultBatch(
        text=torch.from_numpy(feats["text"]), audio=torch.from_numpy(feats["audio"]),
        vision=torch.from_numpy(feats["vision"]),
        text_lengths=torch.from_numpy(np.asarray(lengths["text"], dtype=np.int64)),
        audio_lengths=torch.from_numpy(np.asarray(lengths["audio"], dtype=np.int64)),
        vision_lengths=torch.from_numpy(np.asarray(lengths["vision"], dtype=np.int64)),
        labels=lab, index=torch.from_numpy(np.asarray(index, dtype=np.int64)),
    )


# ============================================================================ Arrow conversion


def _binary_array(values: np.ndarray, lengths: np.ndarray) -> pa.Array:
    """Packed (S, F) float16 + (N,) lengths -> binary array of N raw little-endian values (zero copy)."""
    data = np.ascontiguousarray(values, dtype=FEATURE_DTYPE)
    step_bytes = data.shape[1] * FEATURE_DTYPE.itemsize
    offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64) * step_bytes])
    if offsets[-1] >= 2**31:
        raise StoreError(f"{offsets[-1]} bytes in one shard column; lower the rows per shard")
    return pa.BinaryArray.from_buffers(pa.binary(), len(lengths), [None, pa.py_buffer(offsets.astype(np.int32)),
                                                                    pa.py_buffer(data)])


def split_to_table(split: MultSplit, rows: slice) -> pa.Table:
    ids = split.ids[rows]
    row = np.arange(rows.start, rows.stop) if split.row_index is None else split.row_index[rows]
    cols: dict[str, pa.Array] = {"row": pa.array(row.astype(np.int64), pa.int64()),
                                 "id": pa.array(ids.tolist(), pa.string())}
    labels = split.labels[rows]
    if labels.ndim == 1:
        cols["label"] = pa.array(labels.astype(np.float32), pa.float32())
    else:
        flat = pa.array(labels.astype(np.int8).ravel(), pa.int8())
        cols["label"] = pa.FixedSizeListArray.from_arrays(flat, labels.shape[1])
    for m in MODALITIES:
        lens = split.lengths[m][rows]
        o = split.offsets[m]
        start, stop = o[rows.start], o[rows.stop]
        cols[m] = _binary_array(split.values[m][start:stop], lens)
        cols[f"{m}_len"] = pa.array(lens.astype(np.int32), pa.int32())
    return pa.table(cols, schema=arrow_schema(split.task))


def decode_binary(col: pa.ChunkedArray | pa.Array, lengths: np.ndarray, dim: int, where: str) -> np.ndarray:
    """A binary feature column -> packed (S, dim) float16 (zero copy for a single chunk); every
    value's byte length is checked against its length x dim."""
    chunks = col.chunks if isinstance(col, pa.ChunkedArray) else [col]
    parts, start = [], 0
    for chunk in chunks:
        n = len(chunk)
        if chunk.null_count:
            raise StoreError(f"{where}: null value in a feature column")
        buffers = chunk.buffers()  # validity, offsets, data
        offsets = np.frombuffer(buffers[1], dtype=np.int32, count=n + 1, offset=chunk.offset * 4)
        sizes = np.diff(offsets)
        expected = lengths[start:start + n].astype(np.int64) * dim * FEATURE_DTYPE.itemsize
        if not np.array_equal(sizes, expected):
            i = int(np.flatnonzero(sizes != expected)[0])
            raise StoreError(f"{where}: row {start + i} holds {int(sizes[i])} bytes, expected "
                             f"{int(expected[i])} (length {int(lengths[start + i])} x dim {dim} x 2)")
        data = np.frombuffer(buffers[2], dtype=FEATURE_DTYPE, count=int(offsets[-1] - offsets[0]) // 2,
                             offset=int(offsets[0]))
        parts.append(data)
        start += n
    flat = parts[0] if len(parts) == 1 else np.concatenate(parts)
    return flat.reshape(-1, dim)


def table_to_split(table: pa.Table, name: str, dims: Mapping[str, int], where: str,
                   max_len: dict[str, int] | None = None, whole: bool = False) -> MultSplit:
    """Arrow rows -> MultSplit. `whole`: the table is the entire split in order (row == position)."""
    lengths = {m: table.column(f"{m}_len").to_numpy().astype(np.int64) for m in MODALITIES}
    values = {m: decode_binary(table.column(m), lengths[m], dims[m], f"{where}: column {m}") for m in MODALITIES}
    label = table.column("label")
    if pa.types.is_fixed_size_list(label.type):
        flat = pa.concat_arrays(label.chunks).flatten().to_numpy(zero_copy_only=False)  # respects slicing
        labels = flat.reshape(-1, label.type.list_size).astype(np.int64)
    else:
        labels = label.to_numpy().astype(np.float32)
    row = table.column("row").to_numpy().astype(np.int64)
    if whole and not np.array_equal(row, np.arange(len(row))):
        raise StoreError(f"{where}: the row column is not 0 .. {len(row) - 1} in order")
    split = MultSplit(name=name, ids=np.asarray(table.column("id").to_pylist(), dtype=object), labels=labels,
                      values=values, lengths=lengths, max_len=max_len, row_index=None if whole else row)
    split.check(where)
    return split


# ============================================================================ manifest and store


class ShardInfo(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    file: str  # relative to the store
    rows: pydantic.NonNegativeInt


class MultManifest(Manifest):
    """What `manifest.json` holds (kind "mult"); `MultStore.open` checks it against the shards."""

    KIND: ClassVar[str] = KIND
    SCHEMA_VERSION: ClassVar[int] = SCHEMA_VERSION

    dataset: str  # mosi | mosei | iemocap | synthetic | ...
    task: Literal["sentiment", "emotions"]
    dims: dict[str, int]  # modality -> feature width
    splits: dict[Literal["train", "valid", "test"], list[ShardInfo]]
    rows: dict[str, int]
    max_len: dict[str, int]  # longest sequence per modality over all splits
    source: dict[str, Any]  # how the store was built (format, input path, generator options)
    created: str
    label_names: list[str] = []
    stats: dict[str, Any] = {}

    @pydantic.field_validator("dims")
    @classmethod
    def _dims(cls, v: dict[str, int]) -> dict[str, int]:
        if sorted(v) != sorted(MODALITIES) or not all(x > 0 for x in v.values()):
            raise ValueError(f"a positive integer for each of {', '.join(MODALITIES)}")
        return v

    @pydantic.field_validator("splits")
    @classmethod
    def _some_split(cls, v: dict) -> dict:
        if not v:
            raise ValueError("at least one of train, valid, test")
        return v

    def check(self, where: str) -> None:
        for s, shards in self.splits.items():
            if self.rows.get(s) != sum(sh.rows for sh in shards):
                raise StoreError(f"{where}: field rows.{s} = {self.rows.get(s)!r}: expected "
                                 f"{sum(sh.rows for sh in shards)}, the rows its shards hold")


class MultStore:
    """An opened MulT store. `open()` validates; `split(name)` loads a split into memory (numpy);
    `batches(...)` iterates MultBatch without Ray (the Ray Data path is `xmodal.data.mult.pipeline`).
    `path`: a local folder or a URI (`location.Location`); shards are read where they are."""

    def __init__(self, path: Path | Location, manifest: MultManifest):
        self.path = path
        self.manifest = manifest
        self._units: dict[str, list[Unit]] = {}  # split -> its row groups (footers read on first use)

    def __repr__(self) -> str:
        return f"MultStore({str(self.path)!r}, {self.manifest.dataset}, rows {self.manifest.rows})"

    @classmethod
    def open(cls, path: str | Path) -> MultStore:
        """Read manifest.json and check it against every shard's footer (rows) and schema; `path` is a
        local folder or a URI such as s3://bucket/prefix/store (the footers are read, nothing else)."""
        path = locate(path)
        manifest = MultManifest.read(path)  # names the path and the kind expected when it is not a MulT store
        expected = arrow_schema(manifest.task)
        for shards in manifest.splits.values():
            for sh in shards:
                f = path / sh.file
                schema = open_listed_parquet(f, sh.rows).schema_arrow
                if not schema.remove_metadata().equals(expected):
                    raise StoreError(f"{f}: schema {schema.remove_metadata()} differs from the expected "
                                     f"{expected} for task {manifest.task!r}")
        return cls(store_path(path), manifest)

    @property
    def dims(self) -> dict[str, int]:
        return dict(self.manifest.dims)

    @property
    def task(self) -> str:
        return self.manifest.task

    @property
    def splits(self) -> tuple[str, ...]:
        return tuple(s for s in SPLITS if s in self.manifest.splits)

    def shard_paths(self, split: str) -> list[str]:
        self._check_split(split)
        return [str(self.path / sh.file) for sh in self.manifest.splits[split]]

    def units(self, split: str) -> list[Unit]:
        """The split's row groups, the units it is dealt out in to workers (samples = clips); the
        footers are read once per split and store object."""
        if split in self._units:
            return self._units[split]
        out = []
        for f in self.shard_paths(split):
            try:
                md = open_parquet(f).metadata
            except (OSError, pa.ArrowException) as e:
                raise StoreError(f"{f}: not a readable Parquet file ({type(e).__name__}: {e}); re-ingest the "
                                 "store") from None
            out += [Unit(f, g, md.row_group(g).num_rows, md.row_group(g).num_rows) for g in range(md.num_row_groups)]
        self._units[split] = out
        return out

    def _check_split(self, split: str) -> None:
        if split not in self.manifest.splits:
            raise StoreError(f"{self.path}: no split {split!r}; the store has {list(self.splits)}")

    def split(self, name: str) -> MultSplit:
        """Load split `name` into memory (values stay zero-copy views of the Arrow buffers)."""
        self._check_split(name)
        tables = []
        for sh in self.manifest.splits[name]:
            try:
                t = open_parquet(self.path / sh.file).read()
            except (OSError, pa.ArrowException) as e:
                raise StoreError(f"{self.path / sh.file}: cannot be read ({type(e).__name__}: {e}); re-ingest the "
                                 "store") from None
            if t.num_rows != sh.rows:
                raise StoreError(f"{self.path / sh.file}: read {t.num_rows} rows, manifest says {sh.rows}")
            tables.append(t)
        table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
        return table_to_split(table, name, self.dims, f"{self.path}/{name}", max_len=dict(self.manifest.max_len),
                              whole=True)

    def batches(self, split: str, batch_size: int, **kwargs) -> Iterator[MultBatch]:
        """`self.split(split).batches(batch_size, **kwargs)`: see `MultSplit.batches`."""
        return self.split(split).batches(batch_size, **kwargs)


def write_store(path: str | Path, splits: Mapping[str, MultSplit], *, dataset: str, source: Mapping[str, Any],
                overwrite: bool = False, shard_rows: int = DEFAULT_SHARD_ROWS,
                stats: Mapping[str, Any] | None = None) -> MultStore:
    """Write `splits` as a store at `path`: into a hidden temporary directory beside it, checked by
    reopening, then renamed into place (an existing store is replaced only with `overwrite`).
    Any failure removes the temporary directory: nothing half-written is left behind."""
    path = local_target(path)
    if not splits:
        raise StoreError(f"{path}: no split to write")
    bad = sorted(set(splits) - set(SPLITS))
    if bad:
        raise StoreError(f"{path}: unknown splits {bad}; expected some of {list(SPLITS)}")
    first = next(iter(splits.values()))
    task, dims = first.task, first.dims()
    for name, sp in splits.items():
        sp.check(f"split {name!r}")
        if sp.task != task or sp.dims() != dims:
            raise StoreError(f"split {name!r}: task {sp.task!r} dims {sp.dims()} differ from "
                             f"task {task!r} dims {dims} of the other splits")
    check_target(path, overwrite, KIND)
    with StagedDir(path, overwrite, KIND) as staged:
        tmp = staged.tmp
        shards: dict[str, list[ShardInfo]] = {}
        for name in SPLITS:
            if name not in splits:
                continue
            sp = splits[name]
            (tmp / name).mkdir()
            shards[name] = []
            for k, start in enumerate(range(0, max(len(sp), 1), shard_rows)):
                rows = slice(start, min(start + shard_rows, len(sp)))
                rel = f"{name}/part-{k:05d}.parquet"
                pq.write_table(split_to_table(sp, rows), tmp / rel, compression="NONE", use_dictionary=False,
                               write_statistics=False, row_group_size=ROW_GROUP_ROWS)
                shards[name].append(ShardInfo(file=rel, rows=rows.stop - rows.start))
        max_len = {m: max(int(sp.lengths[m].max(initial=1)) for sp in splits.values()) for m in MODALITIES}
        manifest = MultManifest(
            schema_version=SCHEMA_VERSION, kind=KIND, dataset=dataset, task=task, dims=dims, splits=shards,
            rows={s: len(splits[s]) for s in shards}, max_len=max_len, source=dict(source),
            created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            label_names=list(EMOTIONS) if task == "emotions" else [], stats=dict(stats or {}),
        )
        manifest.write(tmp)
        MultStore.open(tmp)  # check what was written before it becomes visible
        staged.publish()
    return MultStore.open(path)


def open_store(path: str | Path | Location) -> MultStore:
    return MultStore.open(path)
