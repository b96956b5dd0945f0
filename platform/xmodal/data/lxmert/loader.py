"""From Arrow blocks of image rows to fixed-size LxmertBatches, with carry-over and prefetch.

`unit_blocks` and `batches_from_blocks` are shared by the Ray Data pipeline
(`xmodal.data.lxmert.pipeline`, the training path) and `iter_local_batches` (pyarrow only:
benchmarks, evaluation, tests), so both build exactly the same batches from the same units.

Blocks (the pool that mismatched sentences and replacement objects are drawn from) mix units: a
rank's units of the epoch (row groups from all shards, `units.epoch_units`) are taken `mix_units`
at a time, and their images, with the few left over from the previous window, are permuted by a
generator seeded by (seed, epoch, rank) and cut into blocks of `images_per_block`. A block's
images thus come from about min(mix_units, images_per_block) units of different shards, and memory
stays bounded by one window of units. `mix_units=0` is the former blocking (consecutive units
concatenated). `negative_shard_mix` measures how mixed the negatives are.
Imports numpy, pyarrow and torch only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pyarrow as pa

from xmodal.core.batches import LxmertBatch
from xmodal.data.errors import StoreError
from xmodal.data.lxmert.masking import BlockSamples, LxmertBatchBuilder
from xmodal.data.lxmert.rows import ImageBlock, read_shard, table_to_block
from xmodal.data.lxmert.store import LxmertStore
from xmodal.data.prefetch import prefetch_iter
from xmodal.data.units import Unit, epoch_units, group_tables, read_unit

# Units (row groups, 32 images by default) mixed into the blocks at a time: with 64-image blocks,
# a block holds images of ~16 units. Memory: one window of units (paper dims: 16 x 32 images x
# 147 KB of features = 75 MB) plus its permuted copy.
DEFAULT_MIX_UNITS = 16


def block_rng(seed: int, epoch: int, rank: int) -> np.random.Generator:
    """The one generator behind every random choice of a worker's epoch."""
    return np.random.default_rng(np.random.SeedSequence([seed & 0xFFFFFFFF, epoch, rank, 0xB10C]))


def mix_rng(seed: int, epoch: int, rank: int) -> np.random.Generator:
    """The generator that deals a window's images into blocks (its own stream: the samples' draws do not
    depend on how many images were permuted)."""
    return np.random.default_rng(np.random.SeedSequence([seed & 0xFFFFFFFF, epoch, rank, 0x313C]))


def window_tables(tables: Iterable[pa.Table], sizes: Sequence[int]) -> Iterator[pa.Table]:
    """Tables re-cut into consecutive windows of exactly `sizes[i]` rows, whatever chunks the reader
    handed out (Ray Data may split or merge a unit's table)."""
    want = iter(sizes)
    target = next(want, None)
    while target == 0:
        target = next(want, None)
    pending: list[pa.Table] = []
    rows = 0
    for t in tables:
        while t.num_rows:
            if target is None:
                raise StoreError(f"the reader returned more rows than its units hold ({sum(sizes)}); the store "
                                 "changed while it was read")
            k = min(target - rows, t.num_rows)
            pending.append(t.slice(0, k))
            rows += k
            t = t.slice(k)
            if rows == target:
                yield pending[0] if len(pending) == 1 else pa.concat_tables(pending)
                pending, rows, target = [], 0, next(want, None)
            while target == 0:
                target = next(want, None)
    if target is not None:
        raise StoreError(f"the reader returned fewer rows than its units hold ({sum(sizes)}); the store "
                         "changed while it was read")


def mixed_blocks(windows: Iterable[pa.Table], images_per_block: int,
                 rng: np.random.Generator) -> Iterator[ImageBlock]:
    """Each window's images (plus the previous window's remainder) permuted by `rng` and cut into
    blocks of `images_per_block`; the remainder of the last window is the last, shorter block."""
    if images_per_block < 1:
        raise ValueError(f"images_per_block={images_per_block}: expected >= 1")
    carry: ImageBlock | None = None
    for t in windows:
        if t.num_rows == 0:
            continue
        block = table_to_block(t)
        if carry is not None:
            block = ImageBlock.concat([carry, block])
        order = rng.permutation(block.num_images)
        full = block.num_images // images_per_block
        for i in range(full):
            yield block.take(order[i * images_per_block:(i + 1) * images_per_block])
        rest = order[full * images_per_block:]
        carry = block.take(rest) if len(rest) else None
    if carry is not None:
        yield carry


def unit_blocks(tables: Iterable[pa.Table], units: Sequence[Unit], *, images_per_block: int, mix_units: int,
                seed: int, epoch: int, rank: int) -> Iterator[ImageBlock]:
    """The blocks of a rank's epoch from the tables of its `units` (read in that order, any chunking):
    mixed `mix_units` units at a time (see the module docstring), or with `mix_units=0` the former
    blocking, consecutive tables concatenated up to `images_per_block` images."""
    if mix_units < 0:
        raise ValueError(f"mix_units={mix_units}: expected >= 0 (0 = no mixing across units)")
    if mix_units == 0:
        yield from blocks_from_tables(group_tables(tables, images_per_block), min_images=1)
        return
    sizes = [sum(u.rows for u in units[i:i + mix_units]) for i in range(0, len(units), mix_units)]
    yield from mixed_blocks(window_tables(tables, sizes), images_per_block, mix_rng(seed, epoch, rank))


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
    """Draw the samples of each block, then cut their stream into batches of exactly `batch_size`;
    samples left over at the end of a block are carried into the next batch. The final partial
    batch is dropped unless `drop_last=False`. Batches before `start_batch` (resume within an epoch)
    are drawn but not materialised: cheap, and the later batches are unchanged."""
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: expected >= 1")
    rng = block_rng(seed, epoch, rank)
    pending: deque[list[Any]] = deque()  # [drawn, next sample]
    available = 0
    index = 0

    def take(n: int) -> list[tuple[BlockSamples, int, int]]:
        nonlocal available
        segments = []
        while n > 0:
            drawn, pos = pending[0]
            k = min(n, drawn.size - pos)
            segments.append((drawn, pos, pos + k))
            n -= k
            available -= k
            if pos + k == drawn.size:
                pending.popleft()
            else:
                pending[0][1] = pos + k
        return segments

    for block in blocks:
        if block.num_sentences == 0:
            continue
        drawn = builder.draw(block, rng)
        pending.append([drawn, 0])
        available += drawn.size
        while available >= batch_size:
            segments = take(batch_size)
            if index >= start_batch:
                yield builder.materialize(segments)
            index += 1
    if not drop_last and available > 0 and index >= start_batch:
        yield builder.materialize(take(available))


def iter_local_batches(store: LxmertStore, split: str, builder: LxmertBatchBuilder, batch_size: int, *,
                       epoch: int = 0, seed: int = 0, rank: int = 0, world: int = 1, shuffle: bool = True,
                       drop_last: bool = True, images_per_block: int = 64, mix_units: int = DEFAULT_MIX_UNITS,
                       prefetch: int = 2, start_batch: int = 0, pin_memory: bool = False) -> Iterator[LxmertBatch]:
    """Ray-free batches over a store split, fully deterministic given (seed, epoch, rank, world).

    Ranks read disjoint row groups (`units.epoch_units`), mixed into blocks `mix_units` at a time
    (`unit_blocks`); their batch counts can differ by one or two, so for DDP training use
    `pipeline.iter_rank_batches` (the same batches, with the engine's common step count). For a
    fixed evaluation set: shuffle=False, a fixed seed and epoch, drop_last=False.
    """
    units = epoch_units(store.units(split), seed=seed, epoch=epoch, rank=rank, world=world, shuffle=shuffle)
    blocks = unit_blocks((read_unit(u) for u in units), units, images_per_block=images_per_block,
                         mix_units=mix_units, seed=seed, epoch=epoch, rank=rank)
    batches = batches_from_blocks(blocks, builder, batch_size, seed=seed, epoch=epoch, rank=rank,
                                  drop_last=drop_last, start_batch=start_batch)
    yield from prefetch_iter(batches, prefetch, pin_memory=pin_memory)


# ============================================================================ how mixed the negatives are


@dataclass(frozen=True)
class NegativeMix:
    """Matching negatives of one rank's epoch: how many pair two images of the same shard."""

    negatives: int  # mismatched samples drawn
    same_shard: int  # of those, the sample's image and its sentence's image share a shard
    uniform: float  # what sampling over the whole split gives: sum over shards of (sentences_s / S)^2
    shards: int

    @property
    def fraction(self) -> float:
        return self.same_shard / self.negatives if self.negatives else float("nan")


def negative_shard_mix(store: LxmertStore, split: str, builder: LxmertBatchBuilder, *, seed: int = 0,
                       epoch: int = 0, rank: int = 0, world: int = 1, images_per_block: int = 64,
                       mix_units: int = DEFAULT_MIX_UNITS) -> NegativeMix:
    """Draw one epoch of a rank's samples exactly as `iter_local_batches` does (same blocks, same
    generator; nothing materialised) and count the mismatched samples whose sentence comes from an
    image of the same shard. A store written in source order (COCO then VG) has shards of one source,
    so this bounds how often a negative comes from the sample's own source."""
    shard_files = store.shard_paths(split)
    shard_of = {img: k for k, f in enumerate(shard_files) for img in read_shard_ids(f)}
    units = epoch_units(store.units(split), seed=seed, epoch=epoch, rank=rank, world=world)
    blocks = unit_blocks((read_unit(u) for u in units), units, images_per_block=images_per_block,
                         mix_units=mix_units, seed=seed, epoch=epoch, rank=rank)
    rng = block_rng(seed, epoch, rank)
    negatives = same = 0
    for block in blocks:
        if block.num_sentences == 0:
            continue
        drawn = builder.draw(block, rng)
        shard = np.array([shard_of[i] for i in block.img_id], dtype=np.int64)
        sent_img = np.repeat(np.arange(block.num_images), block.sentences_per_image)
        mis = drawn.is_matched == 0
        negatives += int(mis.sum())
        same += int((shard[drawn.img[mis]] == shard[sent_img[drawn.sentence[mis]]]).sum())
    counts = np.array([s.sentences for s in store.manifest.shards.get(split, [])], dtype=np.float64)
    uniform = float(((counts / counts.sum()) ** 2).sum()) if counts.sum() else float("nan")
    return NegativeMix(negatives=negatives, same_shard=same, uniform=uniform, shards=len(shard_files))


def read_shard_ids(file: str) -> list[str]:
    return read_shard(file, columns=["img_id"]).column("img_id").to_pylist()
