"""The reference's box arithmetic and NMS on hand-made boxes (expected values worked out by hand), and the
batched device NMS against a plain port of `cpu_nms` on many random cases."""

from __future__ import annotations

import math

import pytest
import torch
from reference_ops import nms as cpu_nms

from xmodal.models.butd.boxes import big_enough, clip, decode, descending_order, greedy_nms, window_nms


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def nms(boxes, scores, thresh, max_keep=None):
    """The batched NMS on one image: sorted as the reference sorts, kept positions mapped back to indices."""
    order = descending_order(scores)
    n = boxes.shape[0]
    keep, ok = greedy_nms(boxes[order][None], torch.ones(1, n, dtype=torch.bool), thresh, n if max_keep is None else max_keep)
    return order[keep[0][ok[0]]]


def test_zero_deltas_move_the_far_corner_one_pixel_out():
    # w = 15 - 0 + 1 = 16, ctr = 0 + 8 = 8 -> x1 = 8 - 8 = 0, x2 = 8 + 8 = 16 (no "- 1")
    assert decode(t([[0, 0, 15, 15]]), t([[0, 0, 0, 0]])).tolist() == [[0, 0, 16, 16]]


def test_deltas_scale_and_shift_about_the_plus_one_centre():
    # box (10, 20, 29, 59): w 20, h 40, ctr (20, 40)
    # dx 0.5 -> ctr_x 30, dw ln 2 -> w 40: x 10..50; dy -0.25 -> ctr_y 30, dh 0 -> h 40: y 10..50
    got = decode(t([[10, 20, 29, 59]]), t([[0.5, -0.25, math.log(2), 0]]))
    assert torch.allclose(got, t([[10, 10, 50, 50]]), atol=1e-4)


def test_exp_is_rounded_once_from_float64_as_libm_expf_rounds():
    """The reference's numpy (<= 1.16) called libm's expf for float32 arrays; torch's float32 exp differs
    from the correctly rounded value in the last bit of about 1 % of values (later numpy's SIMD exp in
    40 %), which moves a proposal's corner by one ulp and can change what NMS keeps."""
    import numpy as np

    d = torch.from_numpy((np.random.default_rng(0).standard_normal((20000, 4)) * 0.7).astype(np.float32))
    boxes = torch.tensor([[3.0, 5.0, 130.0, 77.0]]).expand(20000, 4)
    got = decode(boxes, d)
    w = np.float32(128.0) * np.exp(d[:, 2].numpy().astype(np.float64)).astype(np.float32)
    ctr = np.float32(3.0) + np.float32(0.5) * np.float32(128.0)
    pred_ctr = d[:, 0].numpy() * np.float32(128.0) + ctr
    assert np.array_equal(got[:, 2].numpy(), pred_ctr + np.float32(0.5) * w)
    assert (torch.exp(d[:, 2]) != torch.from_numpy(np.exp(d[:, 2].numpy().astype(np.float64)).astype(np.float32))).any()


def test_large_dw_is_not_clamped():
    # exp(10) * 16 = 352,423.7; a log(1000 / 16) clamp would have given 1000
    got = decode(t([[0, 0, 15, 15]]), t([[0, 0, 10, 0]]))
    assert math.isclose(float(got[0, 2] - got[0, 0]), 16 * math.exp(10), rel_tol=1e-6)


def test_clip_to_the_last_pixel():
    got = clip(t([[-5, -3, 700, 400], [600, 350, 700, 400], [10.5, 20.25, 30, 40]]), 300, 500)
    assert got.tolist() == [[0, 0, 499, 299], [499, 299, 499, 299], [10.5, 20.25, 30, 40]]


def test_min_size_counts_the_plus_one():
    # min 16 x scale 1.5 = 24: "+1" widths 23 (dropped), 24 (kept), height 23 (dropped)
    boxes = t([[0, 0, 22, 30], [0, 0, 23, 23], [5, 5, 40, 27]])
    assert big_enough(boxes, torch.tensor(16 * 1.5)).tolist() == [False, True, False]


def test_nms_uses_plus_one_areas():
    # (0,0,9,9) and (5,0,14,9): inter 5 x 10 = 50, areas 100 -> IoU 50/150 = 1/3
    # (without "+1": 4 x 9 = 36 over 81 + 81 - 36 -> 0.286, which 0.3 would keep)
    boxes, scores = t([[0, 0, 9, 9], [5, 0, 14, 9]]), t([0.9, 0.8])
    assert nms(boxes, scores, 0.3).tolist() == [0]
    assert nms(boxes, scores, 0.34).tolist() == [0, 1]


def test_nms_suppresses_at_equality_in_float64():
    # IoU exactly 30/100 and 70/100, computed in float32: float32(0.3) > 0.3, float32(0.7) < 0.7,
    # and the reference's cpu_nms compares `ovr >= thresh` against the float64 threshold
    big = [0, 0, 9, 9]
    assert nms(t([big, [0, 0, 2, 9]]), t([0.9, 0.8]), 0.3).tolist() == [0]
    assert nms(t([big, [0, 0, 6, 9]]), t([0.9, 0.8]), 0.7).tolist() == [0, 1]


def test_nms_is_greedy_in_score_order():
    # B (index 1) is best and overlaps A and C by 1/3 each; A and C do not overlap each other
    boxes = t([[0, 0, 9, 9], [5, 0, 14, 9], [10, 0, 19, 9]])
    assert nms(boxes, t([0.5, 0.9, 0.7]), 0.3).tolist() == [1]
    assert nms(boxes, t([0.9, 0.5, 0.7]), 0.3).tolist() == [0, 2]  # B goes, then C survives


def test_ties_go_to_the_later_index_as_a_reversed_argsort():
    assert descending_order(t([0.5, 0.7, 0.5, 0.7])).tolist() == [3, 1, 2, 0]
    same = t([[0, 0, 9, 9], [0, 0, 9, 9]])
    assert nms(same, t([0.5, 0.5]), 0.7).tolist() == [1]
    apart = t([[0, 0, 9, 9], [20, 0, 29, 9], [40, 0, 49, 9]])
    assert nms(apart, t([0.5, 0.5, 0.5]), 0.7).tolist() == [2, 1, 0]
    assert nms(apart, t([0.5, 0.5, 0.5]), 0.7, max_keep=2).tolist() == [2, 1]


def test_nms_of_nothing():
    assert nms(torch.zeros(0, 4), torch.zeros(0), 0.7).tolist() == []


@pytest.mark.parametrize("seed", range(12))
def test_batched_nms_equals_cpu_nms_on_random_boxes(seed):
    # clustered boxes (many overlaps, long suppression chains), quantised scores (many ties), thresholds
    # at the reference's 0.7 and 0.3 and between; several images at once, with invalid boxes mixed in
    g = torch.Generator().manual_seed(seed)
    b, n = 3, 200
    centres = torch.rand(b, n, 2, generator=g) * 120
    sizes = torch.rand(b, n, 2, generator=g) * 60 + 2
    boxes = torch.cat((centres - sizes / 2, centres + sizes / 2), dim=2).round(decimals=1)
    scores = (torch.rand(b, n, generator=g) * 20).floor() / 20
    valid = torch.rand(b, n, generator=g) > 0.1
    thresh = (0.7, 0.3, 0.5, 0.9)[seed % 4]
    max_keep = (300, 40)[seed % 2]
    masked = torch.where(valid, scores, -1.0)
    order = descending_order(masked)
    keep, ok = greedy_nms(boxes.gather(1, order[..., None].expand(-1, -1, 4)), valid.gather(1, order), thresh, max_keep)
    for i in range(b):
        idx = torch.nonzero(valid[i]).flatten()  # the reference sees only the valid boxes
        want = [int(idx[j]) for j in cpu_nms(boxes[i, idx], scores[i, idx], thresh, max_keep)]
        got = order[i, keep[i][ok[i]]].tolist()
        assert got == want
        assert not ok[i, len(want):].any()


@pytest.mark.parametrize("seed", range(8))
def test_the_window_nms_equals_the_sequential_one_and_certifies_it(seed):
    # RPN-like: a smooth objectness map over a grid of anchors (long suppression chains), sorted
    g = torch.Generator().manual_seed(seed)
    b, n = 2, 1500
    centres = torch.rand(b, n, 2, generator=g) * 300
    sizes = torch.rand(b, n, 2, generator=g) * 120 + 8
    boxes = torch.cat((centres - sizes / 2, centres + sizes / 2), dim=2)
    scores = torch.rand(b, n, generator=g)
    order = descending_order(scores)
    boxes = boxes.gather(1, order[..., None].expand(-1, -1, 4))
    valid = torch.rand(b, n, generator=g) > 0.05
    want, want_ok = greedy_nms(boxes, valid, 0.7, 300)
    for window in (1000, 400, 1500):
        keep, ok, certified = window_nms(boxes, valid, 0.7, 300, window=window)
        assert certified.all() and torch.equal(ok, want_ok)
        assert torch.equal(torch.where(ok, keep, 0), torch.where(want_ok, want, 0))
    assert torch.equal(ok, want_ok) and torch.equal(torch.where(ok, keep, 0), torch.where(want_ok, want, 0))


def test_an_answer_the_window_cannot_certify_says_so():
    # a chain: each box overlaps the next (IoU >= 0.7), so the answer alternates keep / suppress and
    # needs one fixed-point step per link; two steps cannot certify a chain of 30
    chain = torch.tensor([[float(i), 0.0, i + 20.0, 20.0] for i in range(30)])[None]
    valid = torch.ones(1, 30, dtype=torch.bool)
    _, _, certified = window_nms(chain, valid, 0.7, 300, iterations=2)
    assert not certified.any()
    keep, ok, certified = window_nms(chain, valid, 0.7, 300, iterations=40)
    want, want_ok = greedy_nms(chain, valid, 0.7, 300)
    assert certified.all() and torch.equal(keep[ok], want[want_ok])
    # windows smaller than the chain: the later windows take the earlier ones' kept boxes into account
    keep, ok, certified = window_nms(chain, valid, 0.7, 300, window=7, iterations=40)
    assert certified.all() and torch.equal(keep[ok], want[want_ok])
