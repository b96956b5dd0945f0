"""From Arrow blocks of image rows to fixed-size LxmertBatches, with carry-over and prefetch.

`batches_from_tables` is shared by the Ray Data pipeline (`xmodal.data.lxmert.pipeline`, the training
path) and `iter_local_batches` (pyarrow only: benchmarks, evaluation, tests), so both build exactly
the same batches from the same blocks. Imports numpy, pyarrow and torch only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np
import pyarrow as pa

from xmodal.batches import LxmertBatch
from xmodal.data.common import prefetch_iter
from xmodal.data.lxmert.masking import BlockPlan, LxmertBatchBuilder
from xmodal.data.lxmert.store import ImageBlock, LxmertStore, table_to_block


def block_rng(seed: int, epoch: int, rank: int) -> np.random.Generator:
    """The one generator behind every random choice of a worker's epoch."""
    return np.random.default_rng(np.random.SeedSequence([seed & 0xFFFFFFFF, epoch, rank, 0xB10C]))


def blocks_from_tables(tables: Iterable[pa.Table], min_images: int = 16) -> Iterator[ImageBlock]:
    """Arrow tables -> ImageBlocks of at least `min_images` images (small tables, e.g. the slivers an
    equal streaming split cuts, are merged so mismatches and replacements have a pool to draw from)."""
    pending: list[pa.Table] = []
    rows = 0
    for t in tables:
        if t.num_rows == 0:
            continue
        pending.append(t)
        rows += t.num_rows
        if rows >= min_images:
            yield table_to_block(pending[0] if len(pending) == 1 else pa.concat_tables(pending))
            pending, rows = [], 0
    if pending:
        yield table_to_block(pending[0] if len(pending) == 1 else pa.concat_tables(pending))


def batches_from_blocks(blocks: Iterable[ImageBlock], builder: LxmertBatchBuilder, batch_size: int, *,
                        seed: int, epoch: int, rank: int, drop_last: bool = True,
                        start_batch: int = 0) -> Iterator[LxmertBatch]:
    """Plan each block, then cut the stream of samples into batches of exactly `batch_size`; samples
    left over at the end of a block are carried into the next batch. The final partial batch is
    dropped unless `drop_last=False`. Batches before `start_batch` (resume within an epoch) are
    planned but not materialised: cheap, and the later batches are unchanged."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: expected >= 1")
    rng = block_rng(seed, epoch, rank)
    pending: deque[list[Any]] = deque()  # [plan, next sample]
    available = 0
    index = 0

    def take(n: int) -> list[tuple[BlockPlan, int, int]]:
        nonlocal available
        segments = []
        while n > 0:
            plan, pos = pending[0]
            k = min(n, plan.size - pos)
            segments.append((plan, pos, pos + k))
            n -= k
            available -= k
            if pos + k == plan.size:
                pending.popleft()
            else:
                pending[0][1] = pos + k
        return segments

    for block in blocks:
        if block.num_sentences == 0:
            continue
        plan = builder.plan(block, rng)
        pending.append([plan, 0])
        available += plan.size
        while available >= batch_size:
            segments = take(batch_size)
            if index >= start_batch:
                yield builder.materialize(segments)
            index += 1
    if not drop_last and available > 0 and index >= start_batch:
        yield builder.materialize(take(available))


def batches_from_tables(tables: Iterable[pa.Table], builder: LxmertBatchBuilder, batch_size: int, *,
                        seed: int, epoch: int, rank: int, min_block_images: int = 16, drop_last: bool = True,
                        start_batch: int = 0) -> Iterator[LxmertBatch]:
    yield from batches_from_blocks(blocks_from_tables(tables, min_block_images), builder, batch_size,
                                   seed=seed, epoch=epoch, rank=rank, drop_last=drop_last,
                                   start_batch=start_batch)


def iter_local_batches(store: LxmertStore, split: str, builder: LxmertBatchBuilder, batch_size: int, *,
                       epoch: int = 0, seed: int = 0, rank: int = 0, world_size: int = 1, shuffle: bool = True,
                       drop_last: bool = True, images_per_block: int = 64, prefetch: int = 2,
                       start_batch: int = 0, pin_memory: bool = False) -> Iterator[LxmertBatch]:
    """Ray-free batches over a store split, fully deterministic given (seed, epoch, rank, world_size).

    Ranks read disjoint row groups (see `LxmertStore.iter_tables`); their batch counts can differ
    by one or two, so for DDP training use the Ray Data path (equal streaming split). For a fixed
    evaluation set: shuffle=False, a fixed seed and epoch, drop_last=False.
    """
    tables = store.iter_tables(split, seed=seed, epoch=epoch, rank=rank, world_size=world_size,
                               shuffle=shuffle, images_per_block=images_per_block)
    batches = batches_from_tables(tables, builder, batch_size, seed=seed, epoch=epoch, rank=rank,
                                  min_block_images=1, drop_last=drop_last, start_batch=start_batch)
    yield from prefetch_iter(batches, prefetch, pin_memory=pin_memory)
