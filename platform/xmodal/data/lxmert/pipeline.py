"""Ray Data input pipelines for LXMERT pretraining.

The training path, `iter_rank_batches`: each Train worker reads its own units of the epoch
(row groups dealt out from the seed, `units.epoch_units`) through Ray Data (`data/reader.py`) into
the same blocks and batches as the Ray-free `iter_local_batches`, so runs are reproducible and
resume exactly (docs/reliability.md, "Reproducible runs").

How it flows: read tasks decode the rank's row groups (one image a row, float16 features as a
fixed-shape tensor) into the object store; the worker takes them as Arrow tables (zero-copy, no
object arrays for the ragged sentence columns, so no collate_fn is needed), mixes them into blocks
and turns those into LxmertBatches with the vectorised builder in a background thread, `prefetch`
batches ahead of the training step.

Leave CPUs to the read tasks: Train workers that hold every CPU starve them and fit() hangs
(docs/training.md, "The pretraining job"); e.g. ScalingConfig(resources_per_worker={"CPU": 0.5}).
"""

from __future__ import annotations

from collections.abc import Iterator

from xmodal.core.batches import LxmertBatch
from xmodal.data.lxmert.loader import DEFAULT_MIX_UNITS, batches_from_blocks, unit_blocks
from xmodal.data.lxmert.masking import LxmertBatchBuilder
from xmodal.data.lxmert.store import LxmertStore
from xmodal.data.prefetch import prefetch_iter
from xmodal.data.reader import read_units
from xmodal.data.units import epoch_units

# What the batch builder reads (img_h / img_w are left in the shards).
BATCH_COLUMNS: tuple[str, ...] = (
    "img_id", "num_boxes", "features", "boxes", "obj_ids", "obj_conf", "attr_ids", "attr_conf",
    "input_ids", "answer_ids", "answer_scores",
)


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
