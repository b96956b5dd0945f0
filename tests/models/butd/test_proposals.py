"""The proposal layer's arithmetic on hand-made boxes, with expected values worked out by hand."""

from __future__ import annotations

import math

import torch

from xmodal.models.butd.proposals import (
    bbox_transform_inv,
    clip_boxes,
    descending_order,
    filter_small_boxes,
    nms,
    proposal_layer,
)


def t(rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_zero_deltas_move_the_far_corner_one_pixel_out():
    # w = 15 - 0 + 1 = 16, ctr = 0 + 8 = 8 -> x1 = 8 - 8 = 0, x2 = 8 + 8 = 16 (no "- 1")
    assert bbox_transform_inv(t([[0, 0, 15, 15]]), t([[0, 0, 0, 0]])).tolist() == [[0, 0, 16, 16]]


def test_deltas_scale_and_shift_about_the_plus_one_centre():
    # box (10, 20, 29, 59): w 20, h 40, ctr (20, 40)
    # dx 0.5 -> ctr_x 30, dw ln 2 -> w 40: x 10..50; dy -0.25 -> ctr_y 30, dh 0 -> h 40: y 10..50
    got = bbox_transform_inv(t([[10, 20, 29, 59]]), t([[0.5, -0.25, math.log(2), 0]]))
    assert torch.allclose(got, t([[10, 10, 50, 50]]), atol=1e-4)


def test_large_dw_is_not_clamped():
    # exp(10) * 16 = 352,423.7; a log(1000 / 16) clamp would have given 1000
    got = bbox_transform_inv(t([[0, 0, 15, 15]]), t([[0, 0, 10, 0]]))
    assert math.isclose(float(got[0, 2] - got[0, 0]), 16 * math.exp(10), rel_tol=1e-6)


def test_clip_to_the_last_pixel():
    got = clip_boxes(t([[-5, -3, 700, 400], [600, 350, 700, 400], [10.5, 20.25, 30, 40]]), 300, 500)
    assert got.tolist() == [[0, 0, 499, 299], [499, 299, 499, 299], [10.5, 20.25, 30, 40]]


def test_min_size_counts_the_plus_one():
    # min 16 x scale 1.5 = 24: "+1" widths 23 (dropped), 24 (kept), height 23 (dropped)
    boxes = t([[0, 0, 22, 30], [0, 0, 23, 23], [5, 5, 40, 27]])
    assert filter_small_boxes(boxes, 16 * 1.5).tolist() == [1]


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


def _layer_inputs():
    """A 1 x 2 feature map (12 anchors per cell) on a 32 x 48 image, scale 1.25 (min side 20)."""
    a, height, width = 12, 1, 2
    prob = torch.zeros(2 * a, height, width)
    prob[:a] = 5.0  # the background half, which the layer must ignore
    deltas = torch.zeros(4 * a, height, width)
    # cell x=1, anchor 8 (ratio 2, scale 4: (2, -36, 45, 51) there; w 44, h 88), the best score, is
    # shrunk by dw = dh = ln 0.25 to 11 x 22 around (24, 8): (18.5, -3, 29.5, 19) -> clipped
    # (18.5, 0, 29.5, 19), "+1" width 12 < 20: dropped before the top-N
    prob[a + 8, 0, 1] = 0.95
    deltas[4 * 8 + 2, 0, 1] = deltas[4 * 8 + 3, 0, 1] = math.log(0.25)
    # cell x=1, anchor 4 (ratio 1, scale 4): (-8, -24, 55, 39) -> (-8, -24, 56, 40) -> (0, 0, 47, 31)
    prob[a + 4, 0, 1] = 0.9
    # cell x=0, anchor 4: (-24, -24, 39, 39) -> (-24, -24, 40, 40) -> (0, 0, 40, 31): IoU with the
    # one above 41 x 32 / (48 x 32) = 0.854 >= 0.7, suppressed
    prob[a + 4, 0, 0] = 0.8
    # cell x=0, anchor 8: (-14, -36, 29, 51) -> (-14, -36, 30, 52) -> (0, 0, 30, 31): IoU with the
    # first 31 x 32 / (48 x 32) = 0.646 < 0.7, kept
    prob[a + 8, 0, 0] = 0.7
    return prob, deltas, (32.0, 48.0, 1.25)


def test_proposal_layer_on_a_hand_made_map():
    prob, deltas, im_info = _layer_inputs()
    rois, scores = proposal_layer(prob, deltas, im_info, post_nms_top_n=2)
    assert rois.tolist() == [[0, 0, 47, 31], [0, 0, 30, 31]]
    assert scores.tolist() == [0.8999999761581421, 0.699999988079071]  # float32 0.9 and 0.7


def test_proposal_layer_filters_before_the_pre_nms_top_n():
    prob, deltas, im_info = _layer_inputs()
    rois, scores = proposal_layer(prob, deltas, im_info, pre_nms_top_n=1)
    assert rois.tolist() == [[0, 0, 47, 31]]


def test_proposal_layer_keeps_at_most_post_nms_top_n():
    prob, deltas, im_info = _layer_inputs()
    rois, scores = proposal_layer(prob, deltas, im_info)  # defaults: 6000, 300, 0.7, 16
    assert rois.shape[1] == 4 and 2 <= rois.shape[0] <= 24
    assert rois[:2].tolist() == [[0, 0, 47, 31], [0, 0, 30, 31]]
    assert bool((scores[:-1] >= scores[1:]).all())
