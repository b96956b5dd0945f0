"""The bottom-up-attention detector: Faster R-CNN, ResNet-101 C4, Visual Genome (Anderson et al., CVPR 2018).

The network of peteanderson80/bottom-up-attention's
`models/vg/ResNet-101/faster_rcnn_end2end_final/test.prototxt`, run as its `lib/fast_rcnn/test.py`
(`im_detect`) and LXMERT's `data/mscoco_imgfeat/extract_coco_image.py` (airsplay/lxmert) run it,
in pure torch on one device. The conventions live in the sibling modules (`image`, `anchors`,
`proposals`, `roi_pool`, `frozen_bn`, `select`); this module puts them together:

    image (H, W, 3) uint8 BGR -> minus the pixel means -> bilinear resize to the test scale
      -> backbone (conv1 .. res4b22, stride 16, 1024 channels)
      -> RPN (3 x 3 conv 512, ReLU; 2-way softmax per anchor; deltas) -> proposal layer -> 300 rois
      -> ROIPool 14 x 14 at 1/16 -> res5 (stride 1, dilation 2) -> average pool -> pool5 (2048)
      -> cls_score (1601) softmax; argmax class -> embedding (256) ++ pool5 -> fc_attr 512, ReLU
         -> attr_score (401) softmax
      -> the selection (36 boxes, or 10 to 100) over the proposals in original-image pixels.

Parameter names (the canonical layout that `weights.py` maps the public files onto) are the module
paths below: `backbone.stem.{conv,bn}`, `backbone.res{2,3,4}.{i}.{conv1,bn1,conv2,bn2,conv3,bn3}`
(+ `shortcut`, `shortcut_bn` in block 0), `rpn.{conv,objectness,deltas}`, `head.res5.{i}...`,
`head.{cls_score,bbox_pred,cls_embedding,fc_attr,attr_score}`. `rpn.objectness` keeps Caffe's 24
channels: background logits of anchors 0..11, then their foreground logits.

The RoI head runs over the regions of several images at once (one res5 call: the main cost, about
0.9 TMAC per image at 300 regions), optionally in bfloat16; fp32 is the exact default. Imports
only torch and the standard library.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from xmodal.models.butd.anchors import ANCHOR_SCALES
from xmodal.models.butd.frozen_bn import BN_EPS, fold_into_conv
from xmodal.models.butd.image import resize_linear, subtract_means, target_size
from xmodal.models.butd.proposals import POST_NMS_TOP_N, PRE_NMS_TOP_N, proposal_layer
from xmodal.models.butd.roi_pool import POOLED_SIZE, SPATIAL_SCALE, roi_pool_fast
from xmodal.models.butd.select import OBJ36, select_regions


@dataclass(frozen=True)
class DetectorConfig:
    """Sizes of the detector; the defaults are the reference's ResNet-101 on Visual Genome."""

    blocks: tuple[int, int, int, int] = (3, 4, 23, 3)  # res2..res5 bottlenecks
    stem_width: int = 64  # conv1's channels
    bottleneck_width: int = 64  # res2's 1x1/3x3 width; doubles per stage; outputs are 4x it
    num_classes: int = 1600  # objects, plus the background at index 0
    num_attributes: int = 400  # attributes, plus "no attribute" at index 0
    rpn_channels: int = 512
    class_embed: int = 256  # cls_embedding's width
    attr_hidden: int = 512  # fc_attr's width
    anchor_scales: tuple[int, ...] = ANCHOR_SCALES
    pre_nms_top_n: int = PRE_NMS_TOP_N
    post_nms_top_n: int = POST_NMS_TOP_N

    @classmethod
    def tiny(cls) -> DetectorConfig:
        """A very small network with the reference's structure and label spaces, for tests and CPU benchmarks."""
        return cls(blocks=(1, 1, 1, 1), stem_width=8, bottleneck_width=8, rpn_channels=16, class_embed=8,
                   attr_hidden=16)

    def replace(self, **changes: object) -> DetectorConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    @property
    def stage_out(self) -> tuple[int, int, int, int]:
        """Output channels of res2..res5 (256, 512, 1024, 2048 in the reference)."""
        return tuple(4 * self.bottleneck_width * 2**i for i in range(4))  # type: ignore[return-value]

    @property
    def feature_dim(self) -> int:
        """Width of a region's feature (`pool5_flat`): 2048 in the reference."""
        return self.stage_out[3]

    @property
    def num_anchors(self) -> int:
        return 3 * len(self.anchor_scales)  # ratios 0.5, 1, 2 times the scales


class FrozenBatchNorm(nn.Module):
    """Caffe's BatchNorm (global stats) + Scale as buffers: ((x - mean) / sqrt(var + eps)) * weight + bias.

    The operations in Caffe's order, in float32 (`frozen_bn.caffe_batch_norm`, `caffe_scale`); mean
    and var are the BatchNorm blobs already divided by their moving-average factor. Fold it into the
    convolution before it with `Detector.fold_batch_norm` (equal up to float32 rounding).
    """

    def __init__(self, channels: int):
        super().__init__()
        for name, value in (("weight", 1.0), ("bias", 0.0), ("running_mean", 0.0), ("running_var", 1.0)):
            self.register_buffer(name, torch.full((channels,), value))

    def forward(self, x: Tensor) -> Tensor:  # (N, C, H, W)
        std = torch.sqrt(self.running_var + BN_EPS)[:, None, None]
        return (x - self.running_mean[:, None, None]) / std * self.weight[:, None, None] + self.bias[:, None, None]


class Bottleneck(nn.Module):
    """A Caffe ResNet bottleneck: 1x1 (the stage's stride) -> 3x3 (dilation) -> 1x1, + shortcut, ReLU.

    The stride sits in the first 1x1 convolution and the shortcut (`res3a_branch2a`, `res3a_branch1`
    stride 2), not in the 3x3 as in torchvision's ResNet.
    """

    def __init__(self, c_in: int, width: int, c_out: int, stride: int, dilation: int, shortcut: bool):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, width, 1, stride=stride, bias=False)
        self.bn1 = FrozenBatchNorm(width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=dilation, dilation=dilation, bias=False)
        self.bn2 = FrozenBatchNorm(width)
        self.conv3 = nn.Conv2d(width, c_out, 1, bias=False)
        self.bn3 = FrozenBatchNorm(c_out)
        self.shortcut = nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False) if shortcut else None
        self.shortcut_bn = FrozenBatchNorm(c_out) if shortcut else None

    def forward(self, x: Tensor) -> Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        skip = x if self.shortcut is None else self.shortcut_bn(self.shortcut(x))  # type: ignore[misc]
        return F.relu(y + skip)  # the Eltwise sum, then ReLU


def _stage(c_in: int, width: int, c_out: int, blocks: int, stride: int, dilation: int = 1) -> nn.Sequential:
    return nn.Sequential(*(Bottleneck(c_in if i == 0 else c_out, width, c_out, stride if i == 0 else 1, dilation,
                                      shortcut=i == 0) for i in range(blocks)))


class Stem(nn.Module):
    """conv1 7x7 stride 2 pad 3, BatchNorm + Scale, ReLU, pool1 3x3 stride 2 pad 0 with Caffe's ceil rounding."""

    def __init__(self, width: int):
        super().__init__()
        self.conv = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn = FrozenBatchNorm(width)

    def forward(self, x: Tensor) -> Tensor:  # (N, 3, H, W) -> (N, C, ceil((H' - 3) / 2) + 1, ...)
        return F.max_pool2d(F.relu(self.bn(self.conv(x))), 3, stride=2, padding=0, ceil_mode=True)


class Backbone(nn.Module):
    """conv1 .. res4b22: (N, 3, H, W) -> (N, 1024, ~H/16, ~W/16)."""

    def __init__(self, cfg: DetectorConfig):
        super().__init__()
        w, out = cfg.bottleneck_width, cfg.stage_out
        self.stem = Stem(cfg.stem_width)
        self.res2 = _stage(cfg.stem_width, w, out[0], cfg.blocks[0], stride=1)
        self.res3 = _stage(out[0], 2 * w, out[1], cfg.blocks[1], stride=2)
        self.res4 = _stage(out[1], 4 * w, out[2], cfg.blocks[2], stride=2)

    def forward(self, x: Tensor) -> Tensor:
        return self.res4(self.res3(self.res2(self.stem(x))))


class RPN(nn.Module):
    """`rpn_conv` 3x3 + ReLU, `rpn_cls_score` (2A: background logits of the A anchors, then foreground), `rpn_bbox_pred` (4A)."""

    def __init__(self, cfg: DetectorConfig):
        super().__init__()
        a = cfg.num_anchors
        self.conv = nn.Conv2d(cfg.stage_out[2], cfg.rpn_channels, 3, padding=1)
        self.objectness = nn.Conv2d(cfg.rpn_channels, 2 * a, 1)
        self.deltas = nn.Conv2d(cfg.rpn_channels, 4 * a, 1)

    def forward(self, features: Tensor) -> tuple[Tensor, Tensor]:
        """(1, C, H, W) -> rpn_cls_prob (2A, H, W), rpn_bbox_pred (4A, H, W)."""
        h = F.relu(self.conv(features))
        score = self.objectness(h)  # (1, 2A, H, W)
        n, two_a, height, width = score.shape
        # `rpn_cls_score_reshape` (1, 2, A*H, W), softmax over the 2, `rpn_cls_prob_reshape` back to (1, 2A, H, W)
        prob = torch.softmax(score.reshape(n, 2, two_a // 2 * height, width), dim=1).reshape(n, two_a, height, width)
        return prob[0], self.deltas(h)[0]


class RegionHead(nn.Module):
    """res5 over pooled regions, the average pool, and the class, box and attribute heads."""

    def __init__(self, cfg: DetectorConfig):
        super().__init__()
        out = cfg.stage_out
        # `res5a` stride 1 (the reference's 14 x 14 regions stay 14 x 14), 3x3 convolutions dilation 2 pad 2
        self.res5 = _stage(out[2], 8 * cfg.bottleneck_width, out[3], cfg.blocks[3], stride=1, dilation=2)
        self.cls_score = nn.Linear(out[3], cfg.num_classes + 1)
        self.bbox_pred = nn.Linear(out[3], 4 * (cfg.num_classes + 1))
        self.cls_embedding = nn.Embedding(cfg.num_classes + 1, cfg.class_embed)
        self.fc_attr = nn.Linear(out[3] + cfg.class_embed, cfg.attr_hidden)
        self.attr_score = nn.Linear(cfg.attr_hidden, cfg.num_attributes + 1)

    def forward(self, pooled: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(R, 1024, 14, 14) -> pool5 (R, 2048), cls_prob (R, 1601), attr_prob (R, 401), all float32."""
        pool5 = self.res5(pooled).mean(dim=(2, 3)).float()  # `pool5`: global AVE pooling; `pool5_flat`
        cls_score = self.cls_score(pool5)  # (R, 1601)
        # `predicted_cls`: Caffe's ArgMax over cls_score; on a tie it takes the HIGHER index (its
        # partial sort compares (value, index) pairs), where torch's argmax would take the lower one
        flipped = cls_score.flip(1).argmax(dim=1)
        predicted = cls_score.shape[1] - 1 - flipped  # (R,)
        concat = torch.cat((pool5, self.cls_embedding(predicted)), dim=1)  # `concat_pool5`: pool5 then embedding
        attr_score = self.attr_score(F.relu(self.fc_attr(concat)))  # (R, 401)
        return pool5, torch.softmax(cls_score, dim=1), torch.softmax(attr_score, dim=1)


class ImageRegions(NamedTuple):
    """One image's regions, as the reference's TSV line holds them (boxes in original-image pixels)."""

    img_h: int
    img_w: int
    boxes: Tensor  # (K, 4) float32, x1 y1 x2 y2
    features: Tensor  # (K, feature_dim) float32: pool5_flat
    objects_id: Tensor  # (K,) int64, 0-based over classes 1..num_classes
    objects_conf: Tensor  # (K,) float32
    attrs_id: Tensor  # (K,) int64, 0-based over attributes 1..num_attributes
    attrs_conf: Tensor  # (K,) float32


class PreparedImage(NamedTuple):
    """An image as the network sees it: `prepare_image`'s output (CPU work a data task can do)."""

    blob: Tensor  # (3, h, w) float32: BGR minus the means, resized
    scale: float  # the test scale (`im_scales[0]`)
    img_h: int  # the original size
    img_w: int


def prepare_image(image_bgr: Tensor) -> PreparedImage:
    """(H, W, 3) uint8 BGR, as `cv2.imread` returns it -> the reference's input blob (`_get_image_blob`)."""
    if image_bgr.dim() != 3 or image_bgr.shape[2] != 3 or min(image_bgr.shape[:2]) < 1:
        raise ValueError(f"expected an (H, W, 3) BGR image, got shape {tuple(image_bgr.shape)}")
    height, width = int(image_bgr.shape[0]), int(image_bgr.shape[1])
    scale, _ = target_size(height, width)
    blob = resize_linear(subtract_means(image_bgr), scale)  # (h, w, 3)
    return PreparedImage(blob.permute(2, 0, 1).contiguous(), scale, height, width)


class Detector(nn.Module):
    """The whole detector; `extract` is the reference's per-image pipeline over a batch of images."""

    def __init__(self, cfg: DetectorConfig | None = None):
        super().__init__()
        self.cfg = cfg or DetectorConfig()
        self.backbone = Backbone(self.cfg)
        self.rpn = RPN(self.cfg)
        self.head = RegionHead(self.cfg)

    @property
    def device(self) -> torch.device:
        return self.rpn.conv.weight.device

    def proposals(self, prepared: PreparedImage) -> tuple[Tensor, Tensor]:
        """One image -> (res4b22 features (C, h/16, w/16) on the model's device, rois (R, 4) float32 on the CPU)."""
        features = self.backbone(prepared.blob.to(self.device)[None])  # (1, 1024, h/16, w/16)
        prob, deltas = self.rpn(features)
        h, w = prepared.blob.shape[1:]
        # The proposal layer runs on the CPU, as the reference's (`USE_GPU_NMS: False`): its NMS is a
        # short greedy loop over 6,000 boxes that a GPU would only synchronise on.
        rois, _ = proposal_layer(prob.float().cpu(), deltas.float().cpu(), (float(h), float(w), prepared.scale),
                                 anchor_scales=self.cfg.anchor_scales, pre_nms_top_n=self.cfg.pre_nms_top_n,
                                 post_nms_top_n=self.cfg.post_nms_top_n)
        return features[0], rois

    def pool(self, features: Tensor, rois: Tensor) -> Tensor:
        """`roi_pool5`: (C, H, W), (R, 4) -> (R, C, 14, 14), by `roi_pool_fast` (the same values as the
        loop `roi_pool`; measured on 2 CPU cores at 300 RoIs: 0.08 s vs 0.45 s at 128 channels, even at 1024)."""
        return roi_pool_fast(features, rois.to(features.device), POOLED_SIZE, SPATIAL_SCALE)

    def regions(self, pooled: Tensor, region_dtype: torch.dtype = torch.float32,
                region_batch: int = 1200) -> tuple[Tensor, Tensor, Tensor]:
        """The RoI head over (R, C, 14, 14) pooled regions of any number of images, region_batch at a time."""
        outs = []
        for chunk in pooled.split(region_batch):
            if region_dtype == torch.float32:
                outs.append(self.head(chunk))
            else:
                with torch.autocast(chunk.device.type, dtype=region_dtype):
                    outs.append(self.head(chunk))
        if not outs:
            z = pooled.new_zeros
            return z((0, self.cfg.feature_dim)), z((0, self.cfg.num_classes + 1)), z((0, self.cfg.num_attributes + 1))
        return tuple(torch.cat(parts).float() for parts in zip(*outs, strict=True))  # type: ignore[return-value]

    @torch.no_grad()
    def extract(
        self,
        images: Sequence[Tensor | PreparedImage],
        *,
        boxes_range: tuple[int, int] = OBJ36,
        given_boxes: Sequence[Tensor | None] | None = None,
        region_dtype: torch.dtype = torch.float32,
        region_batch: int = 1200,
        stats: dict[str, float] | None = None,
    ) -> list[ImageRegions]:
        """Regions of each image, as `get_detections_from_im` writes them.

        images: (H, W, 3) uint8 BGR tensors (as `cv2.imread` gives) or `prepare_image` outputs.
        boxes_range: (min_boxes, max_boxes) of the selection, `select.OBJ36` or `select.BOTTOM_UP_DEFAULT`.
        given_boxes: per image None or (K, 4) boxes in original-image pixels: the features of those
          boxes (the reference's `im_detect(net, im, boxes)`: rois = boxes * scale), no selection;
          their labels are still the heads' argmax.
        region_dtype: torch.float32 (exact) or torch.bfloat16 for the RoI head.
        stats: if given, seconds per stage are added to it (the device synchronised at each stage's
          end): prepare, backbone+rpn (with the proposal layer), roi_pool, res5+heads, select; and
          "regions", the number of regions that went through the RoI head.
        """
        clock = _StageClock(stats, self.device)
        if given_boxes is not None and len(given_boxes) != len(images):
            raise ValueError(f"given_boxes has {len(given_boxes)} entries for {len(images)} images")
        prepared = [im if isinstance(im, PreparedImage) else prepare_image(im) for im in images]
        clock.lap("prepare")
        pooled, rois_per_image = [], []
        for i, p in enumerate(prepared):
            fixed = None if given_boxes is None else given_boxes[i]
            if fixed is None:
                features, rois = self.proposals(p)
            else:
                features = self.backbone(p.blob.to(self.device)[None])[0]
                # `_project_im_rois`: boxes times the scale (float64 in numpy), then the float32 blob
                rois = (fixed.to(torch.float64) * p.scale).to(torch.float32)
            clock.lap("backbone+rpn")
            pooled.append(self.pool(features, rois))
            rois_per_image.append(rois)
            clock.lap("roi_pool")
        pool5, cls_prob, attr_prob = (t.cpu() for t in self.regions(torch.cat(pooled), region_dtype, region_batch))
        clock.lap("res5+heads")
        clock.count("regions", pool5.shape[0])
        out, start = [], 0
        for i, (p, rois) in enumerate(zip(prepared, rois_per_image, strict=True)):
            stop = start + rois.shape[0]
            feats, cls_p, attr_p = pool5[start:stop], cls_prob[start:stop], attr_prob[start:stop]
            start = stop
            # `cls_boxes = rois[:, 1:5] / im_scales[0]`: float32 rois over the scale, in float32
            boxes = rois / torch.tensor(p.scale, dtype=torch.float32)
            if given_boxes is not None and given_boxes[i] is not None:
                keep = torch.arange(rois.shape[0])
                obj_conf, obj_id = cls_p[:, 1:].max(dim=1)
                attr_conf, attr_id = attr_p[:, 1:].max(dim=1)
                boxes = given_boxes[i].to(torch.float32)
            else:
                sel = select_regions(boxes, cls_p, attr_p, boxes_range)
                keep, obj_id, obj_conf, attr_id, attr_conf = sel
            out.append(ImageRegions(p.img_h, p.img_w, boxes[keep], feats[keep], obj_id, obj_conf, attr_id, attr_conf))
        clock.lap("select")
        return out

    @torch.no_grad()
    def fold_batch_norm(self) -> Detector:
        """Fold every frozen BatchNorm + Scale into the convolution before it, in place (for speed).

        Equal to the unfolded network up to float32 rounding (`frozen_bn.fold_into_conv`), not bit
        for bit; the extraction's exact default leaves them unfolded.
        """
        for module in list(self.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, nn.Conv2d) and isinstance(getattr(module, _bn_name(name), None), FrozenBatchNorm):
                    bn = getattr(module, _bn_name(name))
                    scale64 = bn.weight.double() / torch.sqrt(bn.running_var.double() + BN_EPS)
                    scale, shift = scale64.float(), (bn.bias.double() - bn.running_mean.double() * scale64).float()
                    weight, bias = fold_into_conv(child.weight, child.bias, scale, shift)
                    conv = nn.Conv2d(child.in_channels, child.out_channels, child.kernel_size, child.stride,
                                     child.padding, child.dilation, bias=True).to(child.weight.device)
                    conv.weight.copy_(weight)
                    conv.bias.copy_(bias)  # type: ignore[union-attr]
                    setattr(module, name, conv)
                    setattr(module, _bn_name(name), nn.Identity())
        return self


class _StageClock:
    """Adds the seconds since the last lap to `stats[stage]`; does nothing when stats is None."""

    def __init__(self, stats: dict[str, float] | None, device: torch.device):
        self.stats, self.device = stats, device
        self.last = time.perf_counter()

    def lap(self, stage: str) -> None:
        if self.stats is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.stats[stage] = self.stats.get(stage, 0.0) + now - self.last
        self.last = now

    def count(self, name: str, n: int) -> None:
        if self.stats is not None:
            self.stats[name] = self.stats.get(name, 0) + n


def _bn_name(conv_name: str) -> str:
    """The BatchNorm that follows a convolution: conv -> bn, conv1 -> bn1, shortcut -> shortcut_bn."""
    return {"conv": "bn", "shortcut": "shortcut_bn"}.get(conv_name, conv_name.replace("conv", "bn"))


def random_detector(cfg: DetectorConfig | None = None, seed: int = 0) -> Detector:
    """A detector with random weights: for tests and benchmarks only (its regions mean nothing).

    BatchNorm statistics are drawn too (means near 0, variances near 1) so that every code path
    sees non-trivial values; convolutions are scaled to keep activations of order one, the heads
    drawn as the prototxt's fillers (std 0.01), so class probabilities start near uniform.
    """
    det = Detector(cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in det.state_dict().items():
            if name.endswith("running_var"):
                t.copy_(torch.rand(t.shape, generator=g) + 0.5)
            elif name.endswith(("running_mean", "bn.bias", "bn1.bias", "bn2.bias", "bn3.bias", "shortcut_bn.bias")):
                t.copy_(torch.randn(t.shape, generator=g) * 0.1)
            elif name.endswith("weight") and t.dim() == 1:  # BatchNorm's Scale gamma
                t.copy_(torch.rand(t.shape, generator=g) * 0.5 + 0.5)
            elif name.startswith("rpn.deltas"):
                # Zero deltas: proposals are the anchors, so NMS keeps the 300 a trained RPN gives.
                # Random deltas grow through 23 random res4 blocks until every box is the whole
                # image and NMS keeps a handful (the benchmark would time too few regions).
                t.zero_()
            elif name.startswith("rpn.objectness"):  # the prototxt's filler, std 0.01
                t.copy_(torch.randn(t.shape, generator=g) * 0.01)
            elif t.dim() > 2:  # convolutions: unit variance in, about unit variance out
                t.copy_(torch.randn(t.shape, generator=g) / t[0].numel() ** 0.5)
            elif t.dim() == 2:  # the heads and the embedding: Caffe's gaussian filler of the prototxt, std 0.01
                t.copy_(torch.randn(t.shape, generator=g) * 0.01)
            else:
                t.copy_(torch.randn(t.shape, generator=g) * 0.1)
    return det.eval()
