"""The detector's structure against the reference's prototxt, and its pipeline's invariants.

Sizes and counts are derived by hand from `models/vg/ResNet-101/faster_rcnn_end2end_final/test.prototxt`
of peteanderson80/bottom-up-attention (Caffe's output size floor((H + 2p - k) / s) + 1 for
convolutions, ceil for pooling), not from this implementation.
"""

from __future__ import annotations

import math

import pytest
import torch

from xmodal.models.butd.detector import (
    Detector,
    DetectorConfig,
    FrozenBatchNorm,
    prepare_image,
    random_detector,
)
from xmodal.models.butd.frozen_bn import caffe_batch_norm, caffe_scale
from xmodal.models.butd.image import target_size

TINY = DetectorConfig.tiny()


@pytest.fixture(scope="module")
def det() -> Detector:
    return random_detector(TINY, seed=0)


def images(*sizes: tuple[int, int], seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8) for h, w in sizes]


def caffe_conv(size: int, k: int, s: int, p: int, d: int = 1) -> int:
    return (size + 2 * p - (d * (k - 1) + 1)) // s + 1


def caffe_pool(size: int, k: int, s: int) -> int:
    return math.ceil((size - k) / s) + 1


def test_reference_sizes_match_the_prototxt():
    det = Detector()  # the reference's ResNet-101
    sd = det.state_dict()
    # 104 BatchNorm + Scale pairs (every convolution of the backbone and res5)
    assert sum(isinstance(m, FrozenBatchNorm) for m in det.modules()) == 104
    assert sd["backbone.stem.conv.weight"].shape == (64, 3, 7, 7)
    assert sd["backbone.res4.22.conv3.weight"].shape == (1024, 256, 1, 1)  # res4b22_branch2c
    assert sd["rpn.conv.weight"].shape == (512, 1024, 3, 3)
    assert sd["rpn.objectness.weight"].shape == (24, 512, 1, 1)
    assert sd["rpn.deltas.weight"].shape == (48, 512, 1, 1)
    assert sd["head.res5.2.conv3.weight"].shape == (2048, 512, 1, 1)
    assert sd["head.cls_score.weight"].shape == (1601, 2048)
    assert sd["head.bbox_pred.weight"].shape == (6404, 2048)
    assert sd["head.cls_embedding.weight"].shape == (1601, 256)
    assert sd["head.fc_attr.weight"].shape == (512, 2304)
    assert sd["head.attr_score.weight"].shape == (401, 512)
    assert not any(k.endswith("conv1.bias") or k.endswith("shortcut.bias") for k in sd)  # bias_term: false
    # the stride in the first 1x1 (res3a_branch2a, res3a_branch1), not the 3x3
    for stage in (det.backbone.res3, det.backbone.res4):
        assert stage[0].conv1.stride == (2, 2) and stage[0].shortcut.stride == (2, 2)
        assert stage[0].conv2.stride == (1, 1)
    for block in det.head.res5:  # res5: stride 1, 3x3 dilation 2 pad 2
        assert block.conv1.stride == (1, 1) and block.conv2.dilation == (2, 2) and block.conv2.padding == (2, 2)


@pytest.mark.parametrize("hw", [(600, 1000), (600, 800), (601, 999), (1000, 600)])
def test_feature_map_size_follows_caffe_rounding(det, hw):
    h, w = hw
    expected = []
    for side in hw:
        side = caffe_conv(side, 7, 2, 3)  # conv1
        side = caffe_pool(side, 3, 2)  # pool1, ceil
        side = caffe_conv(side, 1, 2, 0)  # res3a_branch2a
        side = caffe_conv(side, 1, 2, 0)  # res4a_branch2a
        expected.append(side)
    with torch.no_grad():
        out = det.backbone(torch.zeros(1, 3, h, w))
    assert out.shape == (1, TINY.stage_out[2], *expected)
    with torch.no_grad():  # res5 keeps the 14 x 14 of ROIPool
        assert det.head.res5(torch.zeros(2, TINY.stage_out[2], 14, 14)).shape == (2, TINY.stage_out[3], 14, 14)


def test_frozen_batch_norm_is_caffe_batch_norm_then_scale():
    g = torch.Generator().manual_seed(0)
    bn = FrozenBatchNorm(5)
    mean, var, gamma, beta = torch.randn(5, generator=g), torch.rand(5, generator=g) + 0.1, torch.randn(5, generator=g), torch.randn(5, generator=g)
    bn.running_mean.copy_(mean), bn.running_var.copy_(var), bn.weight.copy_(gamma), bn.bias.copy_(beta)
    x = torch.randn(2, 5, 3, 4, generator=g)
    expected = caffe_scale(caffe_batch_norm(x, mean, var, torch.ones(1)), gamma, beta)
    assert torch.equal(bn(x), expected)  # the same operations in the same order


def test_rpn_softmax_pairs_background_then_foreground_channels(det):
    # `rpn_cls_score_reshape` (1, 2, A*H, W): channel a pairs with channel A + a
    rpn = Detector(TINY).rpn
    a = TINY.num_anchors
    with torch.no_grad():
        rpn.objectness.weight.zero_()
        bias = torch.zeros(2 * a)
        bias[a + 3] = math.log(3.0)  # anchor 3: foreground odds 3:1
        rpn.objectness.bias.copy_(bias)
        prob, deltas = rpn(torch.randn(1, TINY.stage_out[2], 4, 5))
    assert prob.shape == (2 * a, 4, 5) and deltas.shape == (4 * a, 4, 5)
    assert torch.allclose(prob[a + 3], torch.full((4, 5), 0.75))
    assert torch.allclose(prob[3], torch.full((4, 5), 0.25))
    assert torch.allclose(prob[a + 4], torch.full((4, 5), 0.5))


def test_attribute_head_embeds_the_argmax_class_higher_index_on_ties():
    head = random_detector(TINY, seed=3).head
    with torch.no_grad():
        head.cls_score.weight.zero_()
        bias = torch.zeros(TINY.num_classes + 1)
        bias[[5, 9]] = 4.0  # a tie: Caffe's ArgMax takes the higher index
        head.cls_score.bias.copy_(bias)
        pooled = torch.randn(3, TINY.stage_out[2], 14, 14)
        pool5, cls_prob, attr_prob = head(pooled)
        concat = torch.cat((pool5, head.cls_embedding.weight[9].expand(3, -1)), dim=1)
        expected = torch.softmax(head.attr_score(torch.relu(head.fc_attr(concat))), dim=1)
    assert torch.equal(attr_prob, expected)
    assert torch.allclose(cls_prob.sum(1), torch.ones(3)) and pool5.shape == (3, TINY.feature_dim)


def test_prepare_image_scales_as_the_reference():
    for h, w in ((480, 640), (640, 480), (100, 1000), (600, 600)):
        p = prepare_image(images((h, w))[0])
        scale, (rh, rw) = target_size(h, w)
        assert p.blob.shape == (3, rh, rw) and p.scale == scale and (p.img_h, p.img_w) == (h, w)
    with pytest.raises(ValueError, match="expected an"):
        prepare_image(torch.zeros(10, 10, 4, dtype=torch.uint8))


def test_extract_gives_36_regions_in_original_pixels(det):
    ims = images((60, 80), (90, 50))
    out = det.extract(ims)
    for im, r in zip(ims, out, strict=True):
        assert (r.img_h, r.img_w) == tuple(im.shape[:2])
        assert r.boxes.shape == (36, 4) and r.features.shape == (36, TINY.feature_dim)
        assert r.objects_id.shape == r.objects_conf.shape == r.attrs_id.shape == r.attrs_conf.shape == (36,)
        # proposals are clipped to the resized image, then divided by the scale
        assert (r.boxes[:, :2] >= 0).all() and (r.boxes[:, 2] <= r.img_w).all() and (r.boxes[:, 3] <= r.img_h).all()
        assert ((r.objects_id >= 0) & (r.objects_id < TINY.num_classes)).all()
        assert ((r.attrs_id >= 0) & (r.attrs_id < TINY.num_attributes)).all()
    wide = det.extract(ims[:1], boxes_range=(10, 100))[0]
    assert 10 <= wide.boxes.shape[0] <= 100


def test_regions_of_several_images_in_one_res5_call_equal_one_image_at_a_time(det):
    ims = images((60, 80), (90, 50), (40, 40))
    together = det.extract(ims)
    for im, batched in zip(ims, together, strict=True):
        alone = det.extract([im])[0]
        for a, b in zip(alone, batched, strict=True):
            assert a == b if isinstance(a, int) else torch.equal(a, b)
    chunked = det.extract(ims, region_batch=7)  # res5 in chunks of 7 regions
    assert all(torch.equal(a.features, b.features) for a, b in zip(together, chunked, strict=True))


def test_given_boxes_get_their_features_and_no_selection(det):
    im = images((60, 80))[0]
    full = det.extract([im])[0]
    given = full.boxes[:5].clone()
    forced = det.extract([im], given_boxes=[given])[0]
    assert torch.equal(forced.boxes, given) and forced.features.shape == (5, TINY.feature_dim)
    # the same boxes through the forced path (rois = boxes * scale) pool the same cells: same features
    assert torch.allclose(forced.features, full.features[:5], rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="given_boxes has 2 entries for 1 images"):
        det.extract([im], given_boxes=[given, given])


def test_bf16_regions_stay_close_to_fp32(det):
    # on the same boxes: the selection's ranking of near-uniform random class scores would differ
    ims = images((60, 80))
    boxes = [det.extract(ims)[0].boxes]
    fp32 = det.extract(ims, given_boxes=boxes)[0]
    bf16 = det.extract(ims, given_boxes=boxes, region_dtype=torch.bfloat16)[0]
    rel = (bf16.features - fp32.features).norm() / fp32.features.norm()
    # measured 0.0016 on this tiny random network; bf16 keeps 8 bits of mantissa (about 0.4 % per value)
    assert rel < 0.01, rel


def test_folded_batch_norm_equals_the_pair_up_to_float_rounding():
    ims = images((60, 80))
    plain = random_detector(TINY, seed=5)
    folded = random_detector(TINY, seed=5).fold_batch_norm()
    assert not any(isinstance(m, FrozenBatchNorm) for m in folded.modules())
    with torch.no_grad():
        x = prepare_image(ims[0]).blob[None]
        a, b = plain.backbone(x), folded.backbone(x)
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-4 * a.abs().max().item())
