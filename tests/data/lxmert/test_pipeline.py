"""Ray Data pipeline: two workers see disjoint parts of an epoch that together cover it, as full batches."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from xmodal.data.lxmert.masking import LxmertBatchBuilder
from xmodal.data.lxmert.store import LxmertStore


def _run_in_parallel(fns):
    """streaming_split iterators start together (a barrier): consume them concurrently."""
    results: list = [None] * len(fns)
    errors: list = []

    def go(i):
        try:
            results[i] = fns[i]()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    if errors:
        raise errors[0]
    return results


def test_two_workers_split_an_epoch(ray_local, small_store: LxmertStore):
    from xmodal.data.lxmert.loader import blocks_from_tables
    from xmodal.data.lxmert.pipeline import iter_lxmert_batches, lxmert_dataset

    def image_ids(it) -> list[str]:  # the worker's share, as the batch builder receives it
        tables = it.iter_batches(batch_size=None, batch_format="pyarrow")
        return [i for blk in blocks_from_tables(tables) for i in blk.img_id]

    ds = lxmert_dataset(small_store, "train", seed=0)
    a, b = ds.streaming_split(2, equal=True)  # what TorchTrainer's DataConfig does for 2 workers

    # Epoch 0: the images each worker receives.
    ids = _run_in_parallel([lambda it=it: image_ids(it) for it in (a, b)])
    assert len(ids[0]) == len(set(ids[0])) and len(ids[1]) == len(set(ids[1]))
    assert not set(ids[0]) & set(ids[1]), "an image went to both workers"
    assert set(ids[0]) | set(ids[1]) == set(small_store.read_split("train").img_id), "the epoch was not covered"

    # Epoch 1: ready batches, every one full; each worker gets its share of the samples.
    builder = LxmertBatchBuilder.from_store(small_store)
    per_image = small_store.manifest.sentences("train") // small_store.manifest.images("train")
    counts = _run_in_parallel([
        lambda it=it, rank=rank: [len(x) for x in iter_lxmert_batches(it, builder, 64, epoch=1, seed=0, rank=rank)]
        for rank, it in enumerate((a, b))])
    for c in counts:
        assert c and all(n == 64 for n in c)
        assert len(c) == (len(ids[0]) * per_image) // 64


def test_dense_tensors_and_empty_split(ray_local, small_store: LxmertStore, tmp_path):
    import dataclasses

    from refdata import SMALL

    from xmodal.data.common import StoreError
    from xmodal.data.lxmert.pipeline import lxmert_dataset
    from xmodal.data.lxmert.synthetic import build_synthetic_store

    m = small_store.manifest
    rows = lxmert_dataset(small_store, "minival", shuffle=False).take_batch(4, batch_format="numpy")
    assert rows["features"].shape == (4, m.num_objects, m.feat_dim) and rows["features"].dtype == np.float16
    assert rows["boxes"].shape == (4, m.num_objects, 4)

    store = build_synthetic_store(tmp_path / "s", dataclasses.replace(SMALL, num_images=20, minival_fraction=0.0))
    with pytest.raises(StoreError, match="split 'minival' has no shards"):
        lxmert_dataset(store, "minival")


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
        local = list(iter_local_batches(small_store, "train", builder, 16, seed=3, epoch=1, rank=rank, world_size=2,
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
    from xmodal.data.common import epoch_units

    return epoch_units(store.units("train"), seed=3, epoch=1, rank=rank, world=2)


def _blocks(store: LxmertStore, rank: int):
    from xmodal.data.common import read_unit
    from xmodal.data.lxmert.loader import unit_blocks

    units = _units(store, rank)
    return list(unit_blocks((read_unit(u) for u in units), units, images_per_block=64, mix_units=3, seed=3, epoch=1,
                            rank=rank))
