"""Ray Data input pipelines for MulT.

The training path, `iter_rank_batches`: each Train worker reads its own units of the epoch (row
groups dealt out from the seed, `units.epoch_units`) through Ray Data (`data/reader.py`): the
same batches as `batches_from_tables` over `read_unit` of the same units (the in-process path), so
runs are reproducible and resume exactly (docs/reliability.md, "Reproducible runs").

The streaming path (benchmarks and tests):   ds = mult_dataset(store, "train", seed=cfg.train.seed)
               TorchTrainer(..., datasets={"train": ds})  # DataConfig splits it: streaming_split(n, equal=True)
Worker side:   it = ray.train.get_dataset_shard("train")
               for batch in iter_mult_batches(it, store.dims, batch_size, epoch=e, seed=s, rank=r): ...

Read tasks decode whole Parquet shards into the object store; each worker pulls whole blocks as
Arrow tables (`batch_format="pyarrow"`: the binary feature columns stay zero-copy buffers, no
object arrays and no collate_fn), turns them into packed `MultSplit`s and pads batches with the
same vectorised numpy code as the Ray-free iterator (`MultSplit.batches`), in a background
thread, `prefetch` batches ahead of the training step.

Shuffling: the shard order is reshuffled every epoch from the seed (FileShuffleConfig with
reseed_after_execution); rows are permuted within each block (of at least `min_block_rows`
rows, small blocks merged) by a generator seeded by (seed, epoch, rank, block). Streaming split
hands blocks to whichever worker asks first, so the clip-to-worker assignment varies between
runs; the Ray-free `MultSplit.batches` is bit-for-bit reproducible. `MultBatch.index` holds each
clip's row in its split, so predictions can be joined with ids after gathering.

Leave CPUs to the read tasks (docs/training.md, "The pretraining job"): Train workers holding every CPU starve them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Mapping

import numpy as np
import pyarrow as pa
import ray
import ray.data
from ray.data import FileShuffleConfig

from xmodal.core.batches import MultBatch
from xmodal.data.errors import StoreError
from xmodal.data.mult.store import MultStore, PadTo, table_to_split
from xmodal.data.prefetch import prefetch_iter
from xmodal.data.reader import quiet_ray_data, read_units
from xmodal.data.units import epoch_units


def mult_dataset(store: MultStore | str, split: str, *, seed: int | None = 0, shuffle: bool = True) -> ray.data.Dataset:
    """A lazy Dataset over a store split's shards, one row per clip. With `shuffle`, the shard order
    changes every epoch, reproducibly from `seed`. For evaluation sets that every worker should read
    whole, use DataConfig(datasets_to_split=["train"])."""
    if not isinstance(store, MultStore):
        store = MultStore.open(store)
    quiet_ray_data()
    paths = store.shard_paths(split)
    if not paths:
        raise StoreError(f"{store.path}: split {split!r} has no shards")
    file_shuffle = FileShuffleConfig(seed=seed, reseed_after_execution=True) if shuffle else None
    return ray.data.read_parquet(paths, shuffle=file_shuffle)


def batches_from_tables(tables: Iterable[pa.Table], dims: Mapping[str, int], batch_size: int, *, seed: int = 0,
                        epoch: int = 0, rank: int = 0, shuffle: bool = True, drop_last: bool = True,
                        pad_to: PadTo = "batch", max_len: Mapping[str, int] | None = None,
                        min_block_rows: int = 256) -> Iterator[MultBatch]:
    """Arrow tables (any block sizes) -> MultBatches of `batch_size` clips (Ray-free; the pipeline's core).

    Rows left over from one block are carried into the next, so only the very last batch can be
    short (dropped with `drop_last`). `max_len` is the static target of pad_to="store" (the
    manifest's max_len)."""
    pending: list[pa.Table] = []
    rows = 0
    block = 0

    def emit(table: pa.Table, final: bool) -> tuple[list[MultBatch], pa.Table | None]:
        nonlocal block
        part = table_to_split(table, "block", dims, f"block {block}", max_len=dict(max_len) if max_len else None)
        n = len(part)
        order = np.random.default_rng([seed, epoch, rank, block]).permutation(n) if shuffle else np.arange(n)
        block += 1
        full = n - n % batch_size
        out = [part.batch(order[i:i + batch_size], pad_to) for i in range(0, full, batch_size)]
        rest = order[full:]
        if final:
            if len(rest) and not drop_last:
                out.append(part.batch(rest, pad_to))
            return out, None
        return out, (table.take(pa.array(np.sort(rest))) if len(rest) else None)

    for t in tables:
        if t.num_rows == 0:
            continue
        pending.append(t)
        rows += t.num_rows
        if rows >= max(min_block_rows, batch_size):
            batches, rest = emit(pa.concat_tables(pending), final=False)
            yield from batches
            pending = [rest] if rest is not None else []
            rows = rest.num_rows if rest is not None else 0
    if rows:
        batches, _ = emit(pa.concat_tables(pending), final=True)
        yield from batches


def iter_mult_batches(data_iterator: ray.data.DataIterator, dims: Mapping[str, int], batch_size: int, *,
                      epoch: int, seed: int = 0, rank: int = 0, shuffle: bool = True, drop_last: bool = True,
                      pad_to: PadTo = "batch", max_len: Mapping[str, int] | None = None, prefetch: int = 2,
                      prefetch_blocks: int = 2, min_block_rows: int = 256,
                      pin_memory: bool = False) -> Iterator[MultBatch]:
    """One epoch of this worker's MultBatches. `data_iterator` is `ray.train.get_dataset_shard(name)`
    on a Train worker (or one iterator of `Dataset.streaming_split`); call once per epoch (each call
    is a new execution of the dataset). `dims` / `max_len`: `store.dims`, `store.manifest.max_len`."""
    tables = data_iterator.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=prefetch_blocks)
    batches = batches_from_tables(tables, dims, batch_size, seed=seed, epoch=epoch, rank=rank, shuffle=shuffle,
                                  drop_last=drop_last, pad_to=pad_to, max_len=max_len,
                                  min_block_rows=min_block_rows)
    yield from prefetch_iter(batches, prefetch, pin_memory=pin_memory)


def iter_rank_batches(store: MultStore, split: str, batch_size: int, *, seed: int, epoch: int, rank: int,
                      world: int, start_batch: int = 0, prefetch: int = 2, pin_memory: bool = False
                      ) -> Iterator[MultBatch]:
    """One epoch of this rank's MultBatches, read through Ray Data; `start_batch` skips the first
    batches (resume within an epoch: the rest are those the interrupted run would have seen)."""
    units = epoch_units(store.units(split), seed=seed, epoch=epoch, rank=rank, world=world)
    batches = batches_from_tables(read_units(units), store.dims, batch_size, seed=seed, epoch=epoch, rank=rank)
    yield from prefetch_iter(itertools.islice(batches, start_batch, None), prefetch, pin_memory=pin_memory)
