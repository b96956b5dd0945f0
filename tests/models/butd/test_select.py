"""LXMERT's 36-box and bottom-up-attention's 10-100 selection, on hand-made proposals and confidences."""

from __future__ import annotations

import pytest
import torch
from reference_ops import nms

from xmodal.models.butd import select
from xmodal.models.butd.config import BOTTOM_UP_DEFAULT, OBJ36, SelectionConfig
from xmodal.models.butd.select import labels

# A (0,0,9,9) and B (5,0,14,9) overlap by 50 / 150 = 1/3 >= 0.3 ("+1" areas); C is far from both
BOXES = torch.tensor([[0, 0, 9, 9], [5, 0, 14, 9], [100, 100, 109, 109]], dtype=torch.float32)
CLS_PROB = torch.tensor(
    [
        [0.1, 0.6, 0.1, 0.2],  # A
        [0.1, 0.5, 0.3, 0.1],  # B
        [0.5, 0.1, 0.1, 0.3],  # C: the background column is never a class
    ]
)
ATTR_PROB = torch.tensor(
    [
        [0.9, 0.02, 0.05, 0.05, 0.02],  # tie of attributes 2 and 3: the first wins
        [0.2, 0.2, 0.2, 0.2, 0.2],
        [0.1, 0.6, 0.1, 0.1, 0.1],
    ]
)


def f32(x):
    return float(torch.tensor(x, dtype=torch.float32))


def ones(n):
    return torch.ones(1, n, dtype=torch.bool)


def max_class_confidence(boxes, prob):
    """One image through the batched pass."""
    return select.max_class_confidence(boxes[None], prob[None], ones(len(boxes)), 0.3)[0]


def choose_boxes(conf, lo, hi):
    keep, count = select.choose_boxes(conf[None], ones(len(conf)), SelectionConfig(min_boxes=lo, max_boxes=hi))
    return keep[0, :count[0]]


def select_regions(boxes, cls_prob, attr_prob, boxes_range=OBJ36):
    cfg = SelectionConfig(min_boxes=boxes_range[0], max_boxes=boxes_range[1])
    sel = select.select_regions(boxes[None], cls_prob[None], attr_prob[None], ones(len(boxes)), cfg)
    k = int(sel.count[0])
    return select.Selection(*(t[0, :k] if t.dim() > 1 else t[0] for t in sel))


def test_max_confidence_counts_only_the_classes_that_keep_a_box():
    # class 1: A 0.6 keeps, B 0.5 suppressed by A, C 0.1 keeps
    # class 2: B 0.3 keeps; C and A tie at 0.1, C (the later index) first: C keeps, A suppressed by B
    # class 3: C 0.3, A 0.2 keep; B 0.1 suppressed by A
    # -> A max(0.6, 0.2) = 0.6; B 0.3 (its 0.5 of class 1 does not count); C max(0.1, 0.1, 0.3) = 0.3
    assert max_class_confidence(BOXES, CLS_PROB).tolist() == [f32(0.6), f32(0.3), f32(0.3)]


def test_a_box_suppressed_in_every_class_has_confidence_zero():
    boxes = torch.tensor([[0, 0, 9, 9], [0, 0, 9, 9]], dtype=torch.float32)
    prob = torch.tensor([[0.0, 0.7, 0.3], [0.0, 0.6, 0.2]])
    assert max_class_confidence(boxes, prob).tolist() == [f32(0.7), 0.0]


def test_the_batched_pass_equals_one_nms_per_class():
    # a cross-check of the all-classes pass against `nms` itself, over more than 64 boxes (two words)
    gen = torch.Generator().manual_seed(0)
    xy = torch.rand(70, 2, generator=gen) * 100
    boxes = torch.cat([xy, xy + torch.rand(70, 2, generator=gen) * 60 + 1], dim=1)
    prob = torch.softmax(torch.randn(70, 9, generator=gen) * 3, dim=1)
    expected = torch.zeros(70)
    for c in range(1, 9):
        keep = nms(boxes, prob[:, c], 0.3)
        expected[keep] = torch.maximum(expected[keep], prob[keep, c])
    assert torch.equal(max_class_confidence(boxes, prob), expected)


def test_passing_boxes_within_the_range_stay_in_proposal_order():
    assert choose_boxes(torch.tensor([0.1, 0.5, 0.3, 0.9]), 2, 3).tolist() == [1, 2, 3]


def test_fewer_than_36_passing_are_filled_up_by_confidence():
    conf = torch.zeros(40)
    for i, v in {3: 0.9, 7: 0.25, 10: 0.2, 12: 0.5, 20: 0.21, 30: 0.19, 31: 0.19}.items():
        conf[i] = v
    # five pass 0.2 (float32 0.2 is 0.2000000030 >= 0.2): fewer than 36, so all by confidence:
    # 3, 12, 7, 20, 10, then the 0.19 tie later index first (31, 30), then 29 of the zeros, later first
    zeros = [i for i in range(39, -1, -1) if i not in (3, 7, 10, 12, 20, 30, 31)][:29]
    assert choose_boxes(conf, *OBJ36).tolist() == [3, 12, 7, 20, 10, 31, 30, *zeros]


def test_exactly_36_passing_keep_proposal_order_but_37_are_sorted():
    conf = torch.zeros(300)
    passing = list(range(0, 288, 8))  # 36 boxes, rising confidence with the index
    conf[passing] = torch.linspace(0.3, 0.9, 36)
    assert choose_boxes(conf, *OBJ36).tolist() == passing
    conf[299] = 0.95
    assert choose_boxes(conf, *OBJ36).tolist() == [299, *passing[:0:-1]]  # the best 36, best first


def test_bottom_up_default_keeps_10_to_100():
    assert BOTTOM_UP_DEFAULT == (10, 100) and OBJ36 == (36, 36)
    conf = torch.zeros(300)
    conf[:3] = torch.tensor([0.3, 0.8, 0.5])
    conf[50] = 0.1
    # three pass: ten by confidence, then the zeros from the last index down
    assert choose_boxes(conf, *BOTTOM_UP_DEFAULT).tolist() == [1, 2, 0, 50, 299, 298, 297, 296, 295, 294]
    conf[100:220] = 0.3 + torch.arange(120) / 1000  # 123 pass, the 120 at 0.300 to 0.419: the best 100
    assert choose_boxes(conf, *BOTTOM_UP_DEFAULT).tolist() == [1, 2, *range(219, 121, -1)]
    conf[100:220] = 0.0
    conf[10:60] = 0.4  # 53 pass, within 10-100: index order
    assert choose_boxes(conf, *BOTTOM_UP_DEFAULT).tolist() == [0, 1, 2, *range(10, 60)]


def test_labels_skip_column_zero_and_take_the_first_of_ties():
    ids, conf = labels(ATTR_PROB)
    assert ids.tolist() == [1, 0, 0] and conf.tolist() == [f32(0.05), f32(0.2), f32(0.6)]


def test_select_regions_end_to_end():
    # max_conf (0.6, 0.3, 0.3), all >= 0.2
    regions = select_regions(BOXES, CLS_PROB, ATTR_PROB, (2, 2))  # 3 > 2: by confidence, tie C before B
    assert regions.keep.tolist() == [0, 2]
    assert regions.obj_ids.tolist() == [0, 2] and regions.obj_conf.tolist() == [f32(0.6), f32(0.3)]
    assert regions.attr_ids.tolist() == [1, 0] and regions.attr_conf.tolist() == [f32(0.05), f32(0.6)]
    assert select_regions(BOXES, CLS_PROB, ATTR_PROB, (1, 3)).keep.tolist() == [0, 1, 2]


def test_no_proposals():
    regions = select_regions(torch.zeros(0, 4), torch.zeros(0, 1601), torch.zeros(0, 401))
    assert regions.keep.tolist() == [] and regions.obj_ids.tolist() == []


@pytest.mark.parametrize("seed", range(4))
def test_a_padded_batch_gives_each_image_its_own_selection(seed):
    # images with different numbers of proposals padded to one slot count, against each image alone:
    # the empty slots change neither the confidences nor the choice (36 and 10-100)
    g = torch.Generator().manual_seed(seed)
    n, counts = 80, (80, 50, 20)
    xy = torch.rand(3, n, 2, generator=g) * 100
    boxes = torch.cat([xy, xy + torch.rand(3, n, 2, generator=g) * 60 + 1], dim=2)
    cls = torch.softmax(torch.randn(3, n, 12, generator=g) * 3, dim=2)
    attr = torch.softmax(torch.randn(3, n, 6, generator=g), dim=2)
    ok = torch.arange(n)[None, :] < torch.tensor(counts)[:, None]
    for lo, hi in (OBJ36, BOTTOM_UP_DEFAULT):
        cfg = SelectionConfig(min_boxes=lo, max_boxes=hi)
        batch = select.select_regions(boxes, cls, attr, ok, cfg)
        for i, c in enumerate(counts):
            alone = select_regions(boxes[i, :c], cls[i, :c], attr[i, :c], (lo, hi))
            k = int(batch.count[i])
            assert k == len(alone.keep) and k <= min(c, hi)
            assert batch.keep[i, :k].tolist() == alone.keep.tolist()
            assert torch.equal(batch.obj_conf[i, :k], alone.obj_conf) and torch.equal(batch.attr_ids[i, :k], alone.attr_ids)
