"""Global mixing: ingest writes images in a seeded random order, and the readers' blocks (the pool
of matching negatives) mix the images of many units of different shards.

Measured here (`negative_shard_mix`, one epoch of rank 0 of 1, seeds 0-19 x epochs 0-1) on the
`sharded_store` below (1,080 train images, 9 shards of 120 images in row groups of 30, 36 units;
uniform sampling over the store gives sum_s (n_s/N)^2 = 0.111 of negatives from the sample's own
shard): old blocking (mix_units=0: blocks of consecutive units up to 64 images) 0.37-0.55, mean
0.46; mix_units=16 (the default) 0.12-0.19, mean 0.15. The bounds below (seeds 0-3) leave room
around those figures.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from refdata import SMALL, write_reference

from xmodal.data.lxmert.ingest import ingest_lxmert
from xmodal.data.lxmert.loader import iter_local_batches, negative_shard_mix
from xmodal.data.lxmert.masking import LxmertBatchBuilder
from xmodal.data.lxmert.store import LxmertStore, open_store
from xmodal.data.lxmert.synthetic import build_synthetic_store


@pytest.fixture(scope="module")
def sharded_store(tmp_path_factory) -> LxmertStore:
    """9 train shards of 4 units each: more units than one mixing window holds."""
    opts = dataclasses.replace(SMALL, num_images=1200, feat_dim=8, sentences_per_image=3, images_per_shard=120)
    return build_synthetic_store(tmp_path_factory.mktemp("mix") / "store", opts)


def test_mixed_blocks_draw_negatives_from_other_shards_about_as_uniform_sampling_does(sharded_store):
    store = sharded_store
    builder = LxmertBatchBuilder.from_store(store)
    assert len(store.manifest.shards["train"]) == 9 and len(store.units("train")) == 36

    def fractions(mix_units: int) -> list[float]:
        return [negative_shard_mix(store, "train", builder, seed=seed, epoch=epoch, mix_units=mix_units).fraction
                for seed in range(4) for epoch in range(2)]

    old, mixed = fractions(0), fractions(16)
    uniform = negative_shard_mix(store, "train", builder).uniform
    assert uniform == pytest.approx(1 / 9, abs=0.01)
    assert min(old) > 0.33, f"old blocking: {old}"  # a third or more from the sample's own unit
    assert max(mixed) < 0.22, f"mixed blocks: {mixed} (uniform {uniform:.3f})"
    assert min(mixed) > uniform - 0.03  # not below what sampling over the whole store gives


def test_mixing_is_deterministic_covers_the_epoch_and_resumes_exactly(sharded_store):
    store = sharded_store
    builder = LxmertBatchBuilder.from_store(store)
    kw = dict(seed=5, epoch=1, mix_units=4, prefetch=0)
    a = list(iter_local_batches(store, "train", builder, 32, **kw))
    b = list(iter_local_batches(store, "train", builder, 32, **kw))
    resumed = list(iter_local_batches(store, "train", builder, 32, start_batch=7, **kw))
    assert len(a) == store.manifest.sentences("train") // 32
    for x, y in zip(a, b, strict=True):
        assert np.array_equal(x.input_ids.numpy(), y.input_ids.numpy())
        assert np.array_equal(x.visual_feats.numpy(), y.visual_feats.numpy())
    assert len(resumed) == len(a) - 7
    for x, y in zip(resumed, a[7:], strict=True):
        assert np.array_equal(x.input_ids.numpy(), y.input_ids.numpy())
        assert np.array_equal(x.visual_feats.numpy(), y.visual_feats.numpy())
        assert np.array_equal(x.is_matched.numpy(), y.is_matched.numpy())
    other = next(iter_local_batches(store, "train", builder, 32, seed=5, epoch=1, mix_units=8, prefetch=0))
    assert not np.array_equal(other.input_ids.numpy(), a[0].input_ids.numpy())


def _shard_ids(store: LxmertStore, split: str = "train") -> list[list[str]]:
    return [list(store.read_table(s.file, columns=["img_id"]).column("img_id").to_pylist())
            for s in store.manifest.shards[split]]


def test_ingest_writes_a_seeded_random_order_that_mixes_the_sources(tmp_path: Path):
    ref = write_reference(tmp_path / "ref", num_images=64, feat_dim=8)
    first = {line.split("\t", 1)[0] for line in ref.tsv[0].read_text().splitlines()}  # source "a"

    def ingest(name: str, order_seed: int | None) -> LxmertStore:
        return ingest_lxmert(tmp_path / name, ref.tsv, ref.json, split="hash", minival_fraction=0.2,
                             images_per_shard=8, row_group_images=4, order_seed=order_seed, progress=False)

    source, s0, s0_again, s1 = ingest("source", None), ingest("s0", 0), ingest("s0b", 0), ingest("s1", 1)
    assert source.manifest.image_order.method == "source"
    assert s0.manifest.image_order.model_dump() == {"method": "seeded", "seed": 0}
    assert s0.manifest.options["order_seed"] == 0
    # In source order the first shards hold only the first TSV's images; in seeded order every
    # shard holds both sources.
    assert set(_shard_ids(source)[0]) <= first
    for shard in _shard_ids(s0):
        assert set(shard) & first and set(shard) - first, f"a shard of one source: {shard}"
    # Same seed, same store; another seed, another order; the split is the same in every order.
    assert _shard_ids(s0) == _shard_ids(s0_again) and _shard_ids(s0, "minival") == _shard_ids(s0_again, "minival")
    assert _shard_ids(s1) != _shard_ids(s0)
    for split in ("train", "minival"):
        ids = [{i for sh in _shard_ids(st, split) for i in sh} for st in (source, s0, s1)]
        assert ids[0] == ids[1] == ids[2]
    # The rows are the images' own, whatever the order.
    by_order = {st: st.read_split("train") for st in (source, s0)}
    pos = {i: k for k, i in enumerate(by_order[source].img_id)}
    blk = by_order[s0]
    back = by_order[source].take(np.array([pos[i] for i in blk.img_id]))
    assert np.array_equal(back.features, blk.features)
    text = [[st.tokenizer().decode(t) for t in b.input_ids] for st, b in ((source, back), (s0, blk))]
    assert text[0] == text[1]


def test_a_store_without_image_order_still_opens(tmp_path: Path):
    import json

    ref = write_reference(tmp_path / "ref", num_images=16, feat_dim=8)
    store = ingest_lxmert(tmp_path / "s", ref.tsv, ref.json, split="hash", minival_fraction=0.2,
                          images_per_shard=8, row_group_images=4, progress=False)
    mpath = store.path / "manifest.json"
    raw = json.loads(mpath.read_text())
    del raw["image_order"]
    mpath.write_text(json.dumps(raw))
    old = open_store(store.path).manifest
    assert old.image_order is None and old.older_format is None and "image_order" not in old.identity()
    assert store.manifest.identity()["image_order"] == {"method": "seeded", "seed": 0}
