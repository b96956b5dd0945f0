"""Ray Data pipeline: each rank reads its own row groups and gets the batches of the Ray-free reader."""

from __future__ import annotations

import numpy as np

from xmodal.data.lxmert.masking import LxmertBatchBuilder
from xmodal.data.lxmert.store import LxmertStore


def test_rank_batches_through_ray_data_are_the_local_batches(ray_local, small_store: LxmertStore):
    """The training path: each rank reads its own row groups through Ray Data and gets, bit for bit,
    the batches of the Ray-free reader, with blocks mixed across units (mix_units=3: several windows,
    images carried from one to the next); the ranks' images are disjoint and cover the epoch; a
    resumed epoch (start_batch) continues with exactly the batches the uninterrupted one had."""
    from xmodal.data.lxmert.loader import iter_local_batches
    from xmodal.data.lxmert.pipeline import iter_rank_batches

    builder = LxmertBatchBuilder.from_store(small_store)
    dealt = []
    for rank in (0, 1):
        via_ray = list(iter_rank_batches(small_store, "train", builder, 16, seed=3, epoch=1, rank=rank, world=2,
                                         mix_units=3))
        local = list(iter_local_batches(small_store, "train", builder, 16, seed=3, epoch=1, rank=rank, world=2,
                                        mix_units=3))
        assert len(via_ray) == len(local) > 0
        for a, b in zip(via_ray, local, strict=True):
            assert np.array_equal(a.input_ids.numpy(), b.input_ids.numpy())
            assert np.array_equal(a.visual_feats.numpy(), b.visual_feats.numpy())
            assert np.array_equal(a.is_matched.numpy(), b.is_matched.numpy())
        assert len({i for blk in _blocks(small_store, rank) for i in blk.img_id}) == sum(
            u.rows for u in _units(small_store, rank))
        resumed = list(iter_rank_batches(small_store, "train", builder, 16, seed=3, epoch=1, rank=rank, world=2,
                                         mix_units=3, start_batch=2))
        assert all(np.array_equal(a.input_ids.numpy(), b.input_ids.numpy()) for a, b in zip(resumed, via_ray[2:],
                                                                                            strict=True))
        dealt.append({(u.file, u.group) for u in _units(small_store, rank)})
    assert not dealt[0] & dealt[1]
    assert len(dealt[0] | dealt[1]) == len(small_store.units("train"))


def _units(store: LxmertStore, rank: int):
    from xmodal.data.units import epoch_units

    return epoch_units(store.units("train"), seed=3, epoch=1, rank=rank, world=2)


def _blocks(store: LxmertStore, rank: int):
    from xmodal.data.lxmert.loader import unit_blocks
    from xmodal.data.units import read_unit

    units = _units(store, rank)
    return list(unit_blocks((read_unit(u) for u in units), units, images_per_block=64, mix_units=3, seed=3, epoch=1,
                            rank=rank))
