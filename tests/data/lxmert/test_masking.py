"""Sample construction: masking rates, mismatches, QA targets, fixed-size batches, determinism."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from xmodal.data.lxmert.loader import batches_from_blocks, block_rng, iter_local_batches
from xmodal.data.lxmert.masking import IGNORE, LxmertBatchBuilder
from xmodal.data.lxmert.rows import ImageBlock
from xmodal.data.lxmert.store import LxmertStore
from xmodal.data.options import MaskingOptions


def _cat_batches(batches) -> dict[str, torch.Tensor]:
    return {k: torch.cat([getattr(b, k) for b in batches]) for k in batches[0].__dataclass_fields__}


def test_masking_rates(small_store: LxmertStore):
    builder = LxmertBatchBuilder.from_store(small_store)
    tok = small_store.tokenizer()
    batches = [b for epoch in range(5) for b in iter_local_batches(small_store, "train", builder, 100, epoch=epoch,
                                                                   prefetch=0)]
    x = _cat_batches(batches)
    ids, labels, att = x["input_ids"], x["mlm_labels"], x["attention_mask"]
    special = (ids == tok.cls_id) | (ids == tok.sep_id) | (ids == tok.pad_id)
    chosen = labels != IGNORE
    eligible = att & (labels != tok.cls_id) & (labels != tok.sep_id) & ~((ids == tok.cls_id) | (ids == tok.sep_id))
    assert not (chosen & ~att).any(), "a [PAD] position was masked"
    assert (ids[:, 0] == tok.cls_id).all() and not chosen[:, 0].any(), "[CLS] was masked"
    assert not (chosen & special).any()
    rate = chosen.sum().item() / eligible.sum().item()
    print(f"word mask rate {rate:.4f}")
    assert abs(rate - 0.15) < 0.01, rate
    orig = labels[chosen]
    new = ids[chosen]
    n = orig.numel()
    to_mask = (new == tok.mask_id).sum().item() / n
    kept = (new == orig).sum().item() / n
    rand = ((new != orig) & (new != tok.mask_id)).sum().item() / n
    print(f"words: [MASK] {to_mask:.3f} random {rand:.3f} kept {kept:.3f} of {n}")
    assert abs(to_mask - 0.8) < 0.02 and abs(kept - 0.1) < 0.015 and abs(rand - 0.1) < 0.015, (to_mask, kept, rand)
    random_ids = new[(new != orig) & (new != tok.mask_id)]
    assert not np.isin(random_ids.numpy(), list(tok.special_ids.values())).any()

    vm, om = x["visual_mask"], x["obj_masked"]
    assert not (om & ~vm).any()
    assert abs(om.sum().item() / vm.sum().item() - 0.15) < 0.01
    feats, targets = x["visual_feats"].float(), x["feat_targets"].float()
    zeroed = (feats == 0).all(-1) & om
    same = (feats == targets).all(-1)
    assert same[~om].all(), "an object that was not chosen for masking changed"
    m = om.sum().item()
    z, k = zeroed.sum().item() / m, (same & om).sum().item() / m
    r = (om & ~zeroed & ~same).sum().item() / m
    print(f"objects: rate {m / vm.sum().item():.4f}; zeroed {z:.3f} replaced {r:.3f} kept {k:.3f} of {m}")
    assert abs(z - 0.8) < 0.02 and abs(k - 0.1) < 0.02 and abs(r - 0.1) < 0.02, (z, k, r)
    assert x["visual_feats"].dtype == torch.float16 and x["boxes"].dtype == torch.float32

    matched = x["is_matched"]
    assert abs(matched.float().mean().item() - 0.5) < 0.03
    assert (x["qa_labels"][matched == 0] == IGNORE).all(), "a mismatched pair has a QA target"
    assert (x["qa_labels"][matched == 1] != IGNORE).float().mean() > 0.3  # half the synthetic sentences are questions
    assert (x["obj_labels"][~vm] == IGNORE).all() and (x["obj_labels"][vm] >= 0).all()


def test_mismatches_and_replacements_come_from_other_images(small_store: LxmertStore):
    builder = LxmertBatchBuilder.from_store(small_store)
    block = small_store.read_split("train")
    sent_img = np.repeat(np.arange(block.num_images), block.sentences_per_image)
    for seed in range(3):
        drawn = builder.draw(block, block_rng(seed, 0, 0))
        mis = drawn.is_matched == 0
        assert abs(mis.mean() - 0.5) < 0.03
        assert (sent_img[drawn.sentence[mis]] != drawn.img[mis]).all(), "mismatched sentence from the same image"
        assert (sent_img[drawn.sentence[~mis]] == drawn.img[~mis]).all()
        assert len(np.unique(drawn.sentence[~mis])) == int((~mis).sum()), "a matched sentence used twice"
        assert len(drawn.repl_sample) > 0
        assert (drawn.donor_img != drawn.img[drawn.repl_sample]).all(), "replacement feature from the same image"
        # The replacement feature is the donor's object feature, in the materialised batch too.
        batch = builder.materialize([(drawn, 0, drawn.size)])
        got = batch.visual_feats[drawn.repl_sample, drawn.repl_obj].numpy()
        np.testing.assert_array_equal(got, block.features[drawn.donor_img, drawn.donor_obj])
        # Every image yields one sample per sentence: the block is a permutation of its sentences.
        np.testing.assert_array_equal(np.bincount(drawn.img, minlength=block.num_images), block.sentences_per_image)


def _qa_block() -> ImageBlock:
    """Two images with one question each: answers {3: 0.75, 5: 0.25} and {7: 1.0}."""
    k, n, f, t = 2, 4, 8, 6
    ids = np.array([[2, 10, 11, 12, 3, 0], [2, 13, 14, 3, 0, 0]], np.int32)
    return ImageBlock(
        img_id=np.array(["a", "b"], object), img_h=np.ones(k, np.int32), img_w=np.ones(k, np.int32),
        num_boxes=np.array([4, 2], np.int32), features=np.ones((k, n, f), np.float16),
        boxes=np.zeros((k, n, 4), np.float32), obj_ids=np.zeros((k, n), np.int32), obj_conf=np.ones((k, n), np.float32),
        attr_ids=np.zeros((k, n), np.int32), attr_conf=np.ones((k, n), np.float32),
        sent_offsets=np.array([0, 1, 2]), input_ids=ids[:, :t], ans_offsets=np.array([0, 2, 3]),
        ans_ids=np.array([3, 5, 7], np.int32), ans_scores=np.array([0.75, 0.25, 1.0], np.float32))


@pytest.mark.parametrize("mode", ["sample", "argmax"])
def test_qa_target_from_soft_scores(mode: str):
    block = _qa_block()
    builder = LxmertBatchBuilder(vocab_size=20, special_ids={"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4},
                                 num_objects=4, feat_dim=8, store_seq_len=6,
                                 masking=MaskingOptions(mismatch_prob=0.0, max_seq_len=6, qa_target=mode))
    rng = np.random.default_rng(0)
    picks = {3: 0, 5: 0, 7: 0}
    for _ in range(2000):
        drawn = builder.draw(block, rng)
        for img, qa in zip(drawn.img, drawn.qa_labels, strict=True):
            picks[int(qa)] += 1
            assert (img == 0 and qa in (3, 5)) or (img == 1 and qa == 7)
    assert picks[7] == 2000
    if mode == "sample":
        assert abs(picks[3] / 2000 - 0.75) < 0.04
    else:
        assert picks[3] == 2000


def test_fixed_size_batches_carry_over_and_determinism(small_store: LxmertStore):
    builder = LxmertBatchBuilder.from_store(small_store)
    total = small_store.manifest.sentences("train")
    batches = list(iter_local_batches(small_store, "train", builder, 96, epoch=1, seed=7, prefetch=2))
    assert len(batches) == total // 96 and all(len(b) == 96 for b in batches)
    tail = list(iter_local_batches(small_store, "train", builder, 96, epoch=1, seed=7, drop_last=False))
    assert len(tail[-1]) == total % 96 and sum(len(b) for b in tail) == total
    again = list(iter_local_batches(small_store, "train", builder, 96, epoch=1, seed=7, prefetch=0))
    for a, b in zip(batches, again, strict=True):
        for k in a.__dataclass_fields__:
            assert torch.equal(getattr(a, k), getattr(b, k)), k
    other = next(iter_local_batches(small_store, "train", builder, 96, epoch=2, seed=7))
    assert not torch.equal(other.input_ids, batches[0].input_ids)
    # Resuming at batch 5 gives exactly the batches an uninterrupted epoch gives from there on.
    resumed = list(iter_local_batches(small_store, "train", builder, 96, epoch=1, seed=7, start_batch=5))
    assert len(resumed) == len(batches) - 5
    for a, b in zip(batches[5:], resumed, strict=True):
        assert torch.equal(a.visual_feats, b.visual_feats) and torch.equal(a.mlm_labels, b.mlm_labels)


def test_batches_span_blocks():
    """Blocks smaller than a batch: every batch is still full, samples are carried across blocks."""
    block = _qa_block()
    builder = LxmertBatchBuilder(vocab_size=20, special_ids={"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4},
                                 num_objects=4, feat_dim=8, store_seq_len=6, masking=MaskingOptions(max_seq_len=8))
    batches = list(batches_from_blocks([block] * 7, builder, 3, seed=0, epoch=0, rank=0))
    assert len(batches) == 4 and all(len(b) == 3 for b in batches)
    assert batches[0].input_ids.shape == (3, 8)  # padded to masking.max_seq_len
    with pytest.raises(ValueError, match="max_seq_len=4.*tokenised to 6"):
        LxmertBatchBuilder(vocab_size=20, special_ids={"[PAD]": 0, "[UNK]": 1, "[CLS]": 2, "[SEP]": 3, "[MASK]": 4},
                           num_objects=4, feat_dim=8, store_seq_len=6, masking=MaskingOptions(max_seq_len=4))


def test_local_ranks_are_disjoint_and_cover(small_store: LxmertStore):
    """The blocks `iter_local_batches` builds for each of two ranks: disjoint images that cover the split."""
    from xmodal.data.lxmert.loader import DEFAULT_MIX_UNITS, unit_blocks
    from xmodal.data.units import epoch_units, read_unit

    seen = []
    for rank in range(2):
        units = epoch_units(small_store.units("train"), seed=3, epoch=1, rank=rank, world=2)
        blocks = unit_blocks((read_unit(u) for u in units), units, images_per_block=64, mix_units=DEFAULT_MIX_UNITS,
                             seed=3, epoch=1, rank=rank)
        ids = [i for blk in blocks for i in blk.img_id]
        seen.append(set(ids))
        assert len(ids) == len(set(ids))
    assert not seen[0] & seen[1]
    assert len(seen[0] | seen[1]) == small_store.manifest.images("train")


def test_builder_pickles_and_never_overwrites_a_live_batch(small_store: LxmertStore):
    import pickle

    builder = LxmertBatchBuilder.from_store(small_store)
    it = iter_local_batches(small_store, "train", builder, 64, prefetch=0)
    held = next(it)
    snapshot = held.visual_feats.clone()
    later = [next(it) for _ in range(4)]  # the pool may recycle only arrays no tensor refers to
    assert torch.equal(held.visual_feats, snapshot)
    assert all(b.visual_feats.data_ptr() != held.visual_feats.data_ptr() for b in later)
    view = later[-1].feat_targets[:3]
    ptr = later[-1].feat_targets.data_ptr()
    del later
    fresh = [next(it) for _ in range(4)]
    assert all(b.feat_targets.data_ptr() != ptr for b in fresh), "a buffer still viewed was reused"
    assert view.shape[0] == 3
    ptrs = {b.visual_feats.data_ptr() for b in fresh}
    del fresh
    assert next(it).visual_feats.data_ptr() in ptrs, "a free buffer was not recycled"
    clone = pickle.loads(pickle.dumps(builder))
    assert clone.masking == builder.masking and clone._buffers._arrays == []
