"""Ray Data input pipelines for LXMERT pretraining.

The training path, `iter_rank_batches`: each Train worker reads its own units of the epoch
(row groups dealt out from the seed, `common.epoch_units`) through Ray Data (`data/reader.py`) into
the same blocks and batches as the Ray-free `iter_local_batches`, so runs are reproducible and
resume exactly (docs/architecture.md, "Reproducible runs").

The streaming path (data benchmarks):   ds = lxmert_dataset(store, "train", seed=cfg.train.seed)
               TorchTrainer(..., datasets={"train": ds})  # DataConfig splits it: streaming_split(n, equal=True)
Worker side:   it = ray.train.get_dataset_shard("train")
               for batch in iter_lxmert_batches(it, builder, batch_size, epoch, seed, rank): ...

How it flows: read tasks decode whole Parquet shards (one image a row, float16 features as a
fixed-shape tensor) into the object store; each Train worker pulls whole blocks as Arrow tables
(`iter_batches(batch_size=None, batch_format="pyarrow")`: zero-copy, no object arrays for the
ragged sentence columns, so no collate_fn is needed) and turns them into LxmertBatches with the
vectorised builder in a background thread, `prefetch` batches ahead of the training step.

Shuffling: the shard order is reshuffled at every epoch (every execution of the dataset) from the
seed (`FileShuffleConfig(seed, reseed_after_execution=True)`); within a block, samples are
permuted by the builder's generator seeded by (seed, epoch, rank). Streaming split hands blocks to
whichever worker asks first, so the image-to-worker assignment (not the masking rule) varies from
run to run; the Ray-free `iter_local_batches` is bit-for-bit reproducible.

Leave CPUs to the read tasks: Train workers that hold every CPU starve them and fit() hangs
(docs/architecture.md, "The pretraining job"); e.g. ScalingConfig(resources_per_worker={"CPU": 0.5}).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import ray
import ray.data
from ray.data import FileShuffleConfig

from xmodal.batches import LxmertBatch
from xmodal.data.common import StoreError, epoch_units, prefetch_iter
from xmodal.data.lxmert.loader import DEFAULT_MIX_UNITS, batches_from_blocks, batches_from_tables, unit_blocks
from xmodal.data.lxmert.masking import LxmertBatchBuilder
from xmodal.data.lxmert.store import LxmertStore, open_store
from xmodal.data.reader import quiet_ray_data, read_units

# What the batch builder reads (img_h / img_w are left in the shards).
BATCH_COLUMNS: tuple[str, ...] = (
    "img_id", "num_boxes", "features", "boxes", "obj_ids", "obj_conf", "attr_ids", "attr_conf",
    "input_ids", "answer_ids", "answer_scores",
)


def lxmert_dataset(store: LxmertStore | str, split: str, *, seed: int | None = 0, shuffle: bool = True,
                   columns: Sequence[str] = BATCH_COLUMNS) -> ray.data.Dataset:
    """A lazy Dataset over a store split's shards, one row per image.

    With `shuffle`, the shard order changes every epoch, reproducibly from `seed`. Pass it to
    TorchTrainer(datasets={...}); for evaluation sets that every worker should read whole, use
    DataConfig(datasets_to_split=["train"]).
    """
    quiet_ray_data()
    if not isinstance(store, LxmertStore):
        store = open_store(store)
    paths = store.shard_paths(split)
    if not paths:
        raise StoreError(f"{store.path}: split {split!r} has no shards")
    file_shuffle = FileShuffleConfig(seed=seed, reseed_after_execution=True) if shuffle else None
    ds = ray.data.read_parquet(paths, shuffle=file_shuffle)
    return ds.select_columns(list(columns))


def iter_lxmert_batches(data_iterator: ray.data.DataIterator, builder: LxmertBatchBuilder, batch_size: int,
                        epoch: int, seed: int, rank: int, *, prefetch: int = 2, prefetch_blocks: int = 2,
                        min_block_images: int = 16, drop_last: bool = True, start_batch: int = 0,
                        pin_memory: bool = False) -> Iterator[LxmertBatch]:
    """One epoch of this worker's LxmertBatches (each exactly `batch_size` samples, remainder dropped).

    `data_iterator` is `ray.train.get_dataset_shard(name)` on a Train worker (or one iterator of
    `Dataset.streaming_split`). Call once per epoch: every call is a new execution of the dataset.
    `start_batch` skips the first batches (resume within an epoch; their samples differ from the
    interrupted run's, since the split is dynamic). `pin_memory` pins in the prefetch thread.
    """
    tables = data_iterator.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=prefetch_blocks)
    batches = batches_from_tables(tables, builder, batch_size, seed=seed, epoch=epoch, rank=rank,
                                  min_block_images=min_block_images, drop_last=drop_last,
                                  start_batch=start_batch)
    yield from prefetch_iter(batches, prefetch, pin_memory=pin_memory)


def iter_rank_batches(store: LxmertStore, split: str, builder: LxmertBatchBuilder, batch_size: int, *, seed: int,
                      epoch: int, rank: int, world: int, images_per_block: int = 64,
                      mix_units: int = DEFAULT_MIX_UNITS, start_batch: int = 0, prefetch: int = 2,
                      pin_memory: bool = False) -> Iterator[LxmertBatch]:
    """One epoch of this rank's LxmertBatches, read through Ray Data: bit for bit the batches of
    `iter_local_batches` with the same (seed, epoch, rank, world, mix_units). Blocks mix the images
    of `mix_units` units of different shards (`loader.unit_blocks`). `start_batch` skips the first
    batches (resume within an epoch: the rest are those the interrupted run would have seen)."""
    units = epoch_units(store.units(split), seed=seed, epoch=epoch, rank=rank, world=world)
    blocks = unit_blocks(read_units(units, BATCH_COLUMNS), units, images_per_block=images_per_block,
                         mix_units=mix_units, seed=seed, epoch=epoch, rank=rank)
    batches = batches_from_blocks(blocks, builder, batch_size, seed=seed, epoch=epoch, rank=rank,
                                  start_batch=start_batch)
    yield from prefetch_iter(batches, prefetch, pin_memory=pin_memory)
