"""The detector's structure against the reference's prototxt, and its pipeline's invariants.

Sizes and counts are derived by hand from `models/vg/ResNet-101/faster_rcnn_end2end_final/test.prototxt`
of peteanderson80/bottom-up-attention (Caffe's output size floor((H + 2p - k) / s) + 1 for
convolutions, ceil for pooling), not from this implementation.
"""

from __future__ import annotations

import math

import pytest
import torch

from xmodal.models.butd.backbone import FrozenBatchNorm
from xmodal.models.butd.config import BackboneConfig, DetectOptions, DetectorConfig, RoIHeadConfig, RPNConfig
from xmodal.models.butd.detector import Detector, random_detector
from xmodal.models.butd.image import PreparedImage, prepare_image, target_size

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
    assert out.shape == (1, TINY.backbone.stage_out(4), *expected)
    with torch.no_grad():  # res5 keeps the 14 x 14 of ROIPool
        assert det.head.res5(torch.zeros(2, TINY.backbone.stage_out(4), 14, 14)).shape == (2, TINY.feature_dim, 14, 14)


def test_rpn_softmax_pairs_background_then_foreground_channels(det):
    # `rpn_cls_score_reshape` (1, 2, A*H, W): channel a pairs with channel A + a
    rpn = Detector(TINY).rpn
    a = TINY.rpn.num_anchors
    with torch.no_grad():
        rpn.objectness.weight.zero_()
        bias = torch.zeros(2 * a)
        bias[a + 3] = math.log(3.0)  # anchor 3: foreground odds 3:1
        rpn.objectness.bias.copy_(bias)
        prob, deltas = rpn.predict(torch.randn(1, TINY.backbone.stage_out(4), 4, 5))
    prob, deltas = prob[0], deltas[0]
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
        pooled = torch.randn(3, TINY.backbone.stage_out(4), 14, 14)
        pool5, cls_prob, attr_prob = head.predict(pooled)
        concat = torch.cat((pool5, head.cls_embedding.weight[9].expand(3, -1)), dim=1)
        expected = torch.softmax(head.attr_score(torch.relu(head.fc_attr(concat))), dim=1)
    assert torch.equal(attr_prob, expected)
    assert torch.allclose(cls_prob.sum(1), torch.ones(3)) and pool5.shape == (3, TINY.feature_dim)


def test_prepare_image_scales_as_the_reference():
    for h, w in ((480, 640), (640, 480), (100, 1000), (600, 600)):
        p = prepare_image(images((h, w))[0])
        scale, (rh, rw) = target_size(h, w)
        assert p.blob.shape == (rh, rw, 3) and p.scale == scale and (p.img_h, p.img_w) == (h, w)
    with pytest.raises(ValueError, match="expected an"):
        prepare_image(torch.zeros(10, 10, 4, dtype=torch.uint8))


def test_extract_gives_36_regions_in_original_pixels(det):
    ims = images((60, 80), (90, 50))
    out = det.extract(ims)
    for im, r in zip(ims, out, strict=True):
        assert (r.img_h, r.img_w) == tuple(im.shape[:2])
        assert r.boxes.shape == (36, 4) and r.features.shape == (36, TINY.feature_dim)
        assert r.obj_ids.shape == r.obj_conf.shape == r.attr_ids.shape == r.attr_conf.shape == (36,)
        # proposals are clipped to the resized image, then divided by the scale
        assert (r.boxes[:, :2] >= 0).all() and (r.boxes[:, 2] <= r.img_w).all() and (r.boxes[:, 3] <= r.img_h).all()
        assert ((r.obj_ids >= 0) & (r.obj_ids < TINY.num_classes)).all()
        assert ((r.attr_ids >= 0) & (r.attr_ids < TINY.num_attributes)).all()
    wide = random_detector(TINY.with_boxes((10, 100)), seed=0).extract(ims[:1])[0]  # the same weights
    assert 10 <= wide.boxes.shape[0] <= 100


def test_regions_of_several_images_in_one_res5_call_equal_one_image_at_a_time(det):
    ims = images((60, 80), (90, 50), (40, 40))
    together = det.extract(ims)
    for im, batched in zip(ims, together, strict=True):
        alone = det.extract([im])[0]
        for a, b in zip(alone, batched, strict=True):
            assert a == b if isinstance(a, int) else torch.equal(a, b)
    chunked = Detector(TINY.replace_in("roi_head", region_batch=7))  # res5 in chunks of 7 regions
    chunked.load_state_dict(det.state_dict())
    assert all(torch.equal(a.features, b.features) for a, b in zip(together, chunked.eval().extract(ims), strict=True))


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
    bf16 = det.extract(ims, DetectOptions(precision="bf16"), given_boxes=boxes)[0]
    rel = (bf16.features - fp32.features).norm() / fp32.features.norm()
    # bf16 over the backbone and the RoI head (8 bits of mantissa, about 0.4 % per value): measured 0.0037
    # on this tiny random network
    assert rel < 0.02, rel
    with pytest.raises(ValueError, match="precision 'fp16': expected one of fp32, tf32, bf16"):
        DetectOptions(precision="fp16")


def test_folded_batch_norm_equals_the_pair_up_to_float_rounding():
    ims = images((60, 80))
    plain = random_detector(TINY, seed=5)
    folded = random_detector(TINY, seed=5).fold_batch_norm()
    assert not any(isinstance(m, FrozenBatchNorm) for m in folded.modules())
    with torch.no_grad():
        x = prepare_image(ims[0]).blob.permute(2, 0, 1)[None]
        a, b = plain.backbone(x), folded.backbone(x)
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-4 * a.abs().max().item())


def test_the_pipeline_reads_nothing_back_before_its_one_copy():
    """The whole detector on the meta device, where tensors have shapes and no values: any read of a value
    by the host (`.item()`, `.tolist()`, `nonzero`, a Python `if` on a tensor) would raise. So from the
    input blob to the selected regions nothing waits on the device; `to_host` is the one copy."""
    with torch.device("meta"):
        det = Detector(TINY).eval()
    ims = [torch.zeros(h, w, 3, dtype=torch.uint8, device="meta") for h, w in ((60, 80), (90, 50), (48, 64))]
    out = det.detect(ims)
    assert out.boxes.device.type == "meta" and out.boxes.shape == (3, 36, 4)
    given = [torch.zeros(5, 4, device="meta"), torch.zeros(2, 4, device="meta"), torch.zeros(7, 4, device="meta")]
    assert det.detect_given_boxes(ims, given).features.shape == (3, 7, TINY.feature_dim)
    with torch.device("meta"):
        wide_det = Detector(TINY.with_boxes((10, 100))).eval()
    wide = wide_det.detect(ims)
    assert wide.obj_ids.shape == (3, 100)


def test_an_image_given_as_a_blob_equals_the_image_prepared_by_the_detector(det):
    im = images((60, 80))[0]
    blob = prepare_image(im)
    a, b = det.extract([im])[0], det.extract([PreparedImage(*blob)])[0]
    assert all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b, strict=True))


# The reference's widths with one block a stage: oneDNN's convolutions at the tiny widths (8 channels)
# gave other last bits for one image than for several on one of this project's CPUs, not at these.
WIDE = DetectorConfig(backbone=BackboneConfig(blocks=(1, 1, 1)), rpn=RPNConfig(post_nms_top_n=30),
                      roi_head=RoIHeadConfig(res5_blocks=1))


# One torch thread: what the test proves is that a batch mixes nothing between its images, which any
# leak would break bit for bit. On two threads the BLAS may split a GEMM by its row count: measured on
# an AVX-512 Xeon, the attribute head's 2,304 x 512 layer over 30 rows against 120 gave other last bits
# (attr_conf within 4e-9), at the reference's 300 rows an image not.
@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_images_of_one_size_batched_give_what_each_gives_alone():
    det = random_detector(WIDE, seed=2)
    ims = images((30, 40), (60, 80), (45, 60), (40, 30))  # three resize to 600 x 800, one to 800 x 600
    together = det.extract(ims, DetectOptions(backbone_batch=8))
    alone = [det.extract([im], DetectOptions(backbone_batch=1))[0] for im in ims]
    for a, b in zip(together, alone, strict=True):
        assert all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b, strict=True))


def test_an_image_the_window_nms_cannot_certify_is_detected_again_sequentially(det):
    ims = images((60, 80), (90, 50))
    stats: dict[str, float] = {}
    hurried = Detector(TINY.replace_in("rpn", nms_iterations=1))  # one step certifies nothing real
    hurried.load_state_dict(det.state_dict())
    got = hurried.eval().extract(ims, DetectOptions(stats=stats))
    assert stats["recomputed"] == 2
    assert not hurried.detect(ims).certified.any()
    want = det.extract(ims)
    for a, b in zip(got, want, strict=True):
        assert all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b, strict=True))


def test_options_refuse_an_unknown_nms_and_an_empty_backbone_batch():
    with pytest.raises(ValueError, match="nms 'fast': expected one of window, sequential"):
        DetectOptions(nms="fast")
    with pytest.raises(ValueError, match="backbone_batch 0: expected None or at least 1"):
        DetectOptions(backbone_batch=0)
    assert DetectOptions(stats={}) == DetectOptions()  # the stats sink is no option of the computation
