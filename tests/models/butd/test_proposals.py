"""The proposal layer on a hand-made map, with expected values worked out by hand, and batched."""

from __future__ import annotations

import math

import torch

from xmodal.models.butd.config import RPNConfig
from xmodal.models.butd.proposals import proposal_layer


def layer(prob, deltas, im_info, **changes):
    """One image through the batched layer -> (rois, scores) of its filled slots."""
    cfg = RPNConfig(**changes)
    rois, scores, ok, certified = proposal_layer(prob[None], deltas[None], im_info[:2], torch.tensor([im_info[2]]), cfg)
    assert certified.all()
    return rois[0][ok[0]], scores[0][ok[0]]


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
    rois, scores = layer(prob, deltas, im_info, post_nms_top_n=2)
    assert rois.tolist() == [[0, 0, 47, 31], [0, 0, 30, 31]]
    assert scores.tolist() == [0.8999999761581421, 0.699999988079071]  # float32 0.9 and 0.7


def test_proposal_layer_filters_before_the_pre_nms_top_n():
    prob, deltas, im_info = _layer_inputs()
    rois, scores = layer(prob, deltas, im_info, pre_nms_top_n=1)
    assert rois.tolist() == [[0, 0, 47, 31]]


def test_proposal_layer_keeps_at_most_post_nms_top_n():
    prob, deltas, im_info = _layer_inputs()
    rois, scores = layer(prob, deltas, im_info)  # defaults: 6000, 300, 0.7, 16
    assert rois.shape[1] == 4 and 2 <= rois.shape[0] <= 24
    assert rois[:2].tolist() == [[0, 0, 47, 31], [0, 0, 30, 31]]
    assert bool((scores[:-1] >= scores[1:]).all())


def test_a_batch_gives_each_image_what_it_gets_alone():
    prob, deltas, im_info = _layer_inputs()
    other = torch.rand(prob.shape, generator=torch.Generator().manual_seed(0))
    probs, deltas2 = torch.stack((prob, other)), torch.stack((deltas, deltas))
    rois, scores, ok, _ = proposal_layer(probs, deltas2, (32.0, 48.0), torch.tensor([1.25, 0.5]), RPNConfig())
    for i, scale in enumerate((1.25, 0.5)):
        alone = layer(probs[i], deltas2[i], (32.0, 48.0, scale))
        assert torch.equal(rois[i][ok[i]], alone[0]) and torch.equal(scores[i][ok[i]], alone[1])
    assert ok[0].sum() != ok[1].sum()  # the two images keep different numbers: the slots are padded
