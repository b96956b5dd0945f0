"""Caffe's ROIPooling on hand-made maps, with the pooled values worked out by hand, and against a loop port of
`ROIPoolingLayer::Forward_cpu` on random maps.

The map is a 6 x 6 ramp, cell (h, w) = 6h + w, so a bin's maximum is its bottom-right cell:
6 * (last row) + (last column). Pooling is 2 x 2 at the reference's 1/16 unless said otherwise.
"""

from __future__ import annotations

import torch
from reference_ops import roi_pool as caffe_roi_pool

from xmodal.models.butd.roi_pool import roi_bins, roi_pool, roi_pool_batch

RAMP = torch.arange(36, dtype=torch.float32).reshape(1, 6, 6)  # (C=1, H, W)


def pool(rois, features=RAMP, pooled=2):
    return roi_pool(features, torch.tensor(rois, dtype=torch.float32), pooled, 1 / 16)


def test_inside_roi_bins_overlap_by_floor_and_ceil():
    # (0, 0, 63, 63) / 16 -> start 0, end round(3.9375) = 4: size 5, bin 2.5
    # bin 0 [floor 0, ceil 2.5) = [0, 3), bin 1 [floor 2.5, ceil 5) = [2, 5): row/col 2 in both
    # maxima at (2, 2) 14, (2, 4) 16, (4, 2) 26, (4, 4) 28
    assert pool([[0, 0, 63, 63]]).tolist() == [[[[14, 16], [26, 28]]]]


def test_corners_round_half_away_from_zero():
    # (8, 8, 40, 40) / 16 = 0.5, 2.5 -> start 1, end 3 (half to even would give 0 and 2): size 3, bin 1.5
    # bins [1, 3), [2, 4): maxima at (2, 2) 14, (2, 3) 15, (3, 2) 20, (3, 3) 21
    assert pool([[8, 8, 40, 40]]).tolist() == [[[[14, 15], [20, 21]]]]
    rows, cols = roi_bins(torch.tensor([[8.0, -8.0, 40.0, 24.0]]), 6, 6, 2, 1 / 16)
    # x: 0.5 -> 1, 2.5 -> 3; y: -0.5 -> -1, 1.5 -> 2: size 4, bin 2: [0, 2) - 1 -> [0, 1), [2, 4) - 1 -> [1, 3)
    assert cols.tolist() == [[[1, 3], [2, 4]]]
    assert rows.tolist() == [[[0, 1], [1, 3]]]


def test_roi_partly_outside_the_map_is_clipped():
    # (-16, -16, 40, 40) / 16 -> start -1, end round(2.5) = 3: size 5, bin 2.5
    # bin 0 [0, 3) - 1 = [-1, 2) -> [0, 2); bin 1 [2, 5) - 1 = [1, 4)
    # maxima at (1, 1) 7, (1, 3) 9, (3, 1) 19, (3, 3) 21
    assert pool([[-16, -16, 40, 40]]).tolist() == [[[[7, 9], [19, 21]]]]


def test_zero_size_and_inverted_rois_pool_one_cell():
    # (32, 32, 32, 32) -> start = end = 2: size 1, bin 0.5: [floor 0, ceil 0.5) = [floor 0.5, ceil 1) = [0, 1)
    # every bin is cell (2, 2) = 14
    assert pool([[32, 32, 32, 32]]).tolist() == [[[[14, 14], [14, 14]]]]
    # (48, 48, 16, 16) -> start 3, end 1: size max(1 - 3 + 1, 1) = 1: every bin is cell (3, 3) = 21
    assert pool([[48, 48, 16, 16]]).tolist() == [[[[21, 21], [21, 21]]]]


def test_empty_bins_pool_zero_not_the_maximum():
    # map ramp - 100 (all negative). (64, 0, 127, 31): x 4 .. round(7.9375) = 8, size 5, bin 2.5:
    # cols [4, 7) -> [4, 6) and [6, 9) -> [6, 6) empty; y 0 .. round(1.9375) = 2, size 3, bin 1.5:
    # rows [0, 2), [1, 3). Maxima (1, 5) 11 - 100 = -89, (2, 5) 17 - 100 = -83; the empty column 0
    assert pool([[64, 0, 127, 31]], features=RAMP - 100).tolist() == [[[[-89, 0], [-83, 0]]]]
    # (48, 48, 127, 127): 3 .. 8, size 6, bin 3: [3, 6) and [6, 9) -> empty: only bin (0, 0) = 35
    assert pool([[48, 48, 127, 127]]).tolist() == [[[[35, 0], [0, 0]]]]


def test_channels_and_rois_are_pooled_independently():
    features = torch.cat((RAMP, -RAMP))  # (2, 6, 6): channel 1's maxima are the bins' top-left cells
    got = pool([[0, 0, 63, 63], [32, 32, 32, 32]], features=features)
    assert got.shape == (2, 2, 2, 2)
    assert got[0].tolist() == [[[14, 16], [26, 28]], [[0, -2], [-12, -14]]]  # top-left cells (0,0) (0,2) (2,0) (2,2)
    assert got[1].tolist() == [[[14, 14], [14, 14]], [[-14, -14], [-14, -14]]]


def test_reference_size_14_at_one_sixteenth():
    # (0, 0, 223, 223) -> 0 .. 14: size 15, bin 15/14: bin p covers [p, p + 2) (floor(p * 15/14) = p for
    # p < 14, ceil((p + 1) * 15/14) = p + 2), so on a 16 x 16 ramp (16h + w) bin (p, q) pools cell (p + 1, q + 1)
    ramp16 = torch.arange(256, dtype=torch.float32).reshape(1, 16, 16)
    got = roi_pool(ramp16, torch.tensor([[0.0, 0.0, 223.0, 223.0]]), 14, 1 / 16)
    assert got.shape == (1, 1, 14, 14)
    expected = [[16 * (p + 1) + (q + 1) for q in range(14)] for p in range(14)]
    assert got[0, 0].tolist() == expected


def test_300_rois_at_once_equal_each_alone():
    """The batched pooling of the reference's 300 proposals equals pooling each RoI by itself (its speed
    at 1024 channels is a benchmark's to report, not a test's)."""
    features = torch.randn(8, 38, 50)
    g = torch.Generator().manual_seed(0)
    corners = torch.rand(300, 2, generator=g) * torch.tensor([800.0, 600.0])
    sizes = torch.rand(300, 2, generator=g) * 300
    rois = torch.cat((corners, corners + sizes), dim=1)
    out = roi_pool(features, rois, 14, 1 / 16)
    assert out.shape == (300, 8, 14, 14)
    alone = torch.cat([roi_pool(features, r[None], 14, 1 / 16) for r in rois[::15]])
    assert torch.equal(out[::15], alone)


def test_lookup_table_version_equals_the_loop_on_random_maps():
    # random maps and RoIs inside the network's input (the detector's are: clipped proposals, checked
    # given boxes), up to its far edge (a given box may end at x2 = img_w), inverted and tiny, a -inf cell
    g = torch.Generator().manual_seed(0)
    for trial in range(25):
        h, w = int(torch.randint(1, 40, (1,), generator=g)), int(torch.randint(1, 64, (1,), generator=g))
        features = torch.randn(3, h, w, generator=g)
        features[:, 0, 0] = float("-inf") if trial % 3 == 0 else features[:, 0, 0]
        corners = torch.rand(12, 4, generator=g) * torch.tensor([w * 16, h * 16] * 2)
        rois = torch.cat((corners[:, :2].minimum(corners[:, 2:]), corners[:, :2].maximum(corners[:, 2:])), dim=1)
        rois[0] = torch.tensor([5.0, 5.0, 3.0, 3.0])
        rois[1] = torch.tensor([0.0, 0.0, w * 16.0, h * 16.0])
        for pooled in (14, 3, 2):
            assert torch.equal(roi_pool(features, rois, pooled, 1 / 16), caffe_roi_pool(features, rois, pooled, 1 / 16))
    assert roi_pool(RAMP, torch.zeros(0, 4), 14, 1 / 16).shape == (0, 1, 14, 14)


def test_images_pooled_together_equal_each_alone():
    g = torch.Generator().manual_seed(1)
    features = torch.randn(3, 4, 9, 13, generator=g)
    corners = torch.rand(3, 20, 4, generator=g) * torch.tensor([13 * 16, 9 * 16] * 2)
    rois = torch.cat((corners[..., :2].minimum(corners[..., 2:]), corners[..., :2].maximum(corners[..., 2:])), dim=2)
    together = roi_pool_batch(features, rois, 14, 1 / 16)
    assert together.shape == (3, 20, 4, 14, 14)
    for i in range(3):
        assert torch.equal(together[i], caffe_roi_pool(features[i], rois[i], 14, 1 / 16))
