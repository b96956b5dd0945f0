"""The bottom-up-attention detector: Faster R-CNN, ResNet-101 C4, Visual Genome (Anderson et al., CVPR 2018).

The network of peteanderson80/bottom-up-attention's
`models/vg/ResNet-101/faster_rcnn_end2end_final/test.prototxt`, run as its `lib/fast_rcnn/test.py`
(`im_detect`) and LXMERT's `data/mscoco_imgfeat/extract_coco_image.py` (airsplay/lxmert) run it,
in pure torch on one device. A composition of stages, each built from its node of the config tree
(`config.DetectorConfig`) and living in its own module:

    input      (H, W, 3) uint8 BGR -> minus the means -> bilinear resize          image.py (or OpenCV at decode)
    backbone   conv1 .. res4b22, stride 16, 1024 channels                         backbone.py
    rpn        3 x 3 conv, 2-way softmax per anchor, deltas -> proposal layer     heads.RPN, proposals.py, boxes.py
    roi_head   ROIPool 14 x 14 at 1/16 -> res5 -> pool5 (2048), class, attributes roi_pool.py, heads.RoIHead
    selection  per-class NMS, 36 (or 10-100) regions in original-image pixels     select.py

`Detector.detect` runs a batch of images through all of it on the model's device: images of one
input size go through the backbone and the proposal layer together, the RoI head takes the regions
of the whole batch at once, and nothing is copied to the host until `RegionBatch.to_host`, one copy
of the final regions. On a CPU the same code is the exact path.

Parameter names (the canonical layout that `weights.py` maps the public files onto) are the module
paths: `backbone.stem.{conv,bn}`, `backbone.res{2,3,4}.{i}.{conv1,bn1,conv2,bn2,conv3,bn3}`
(+ `shortcut`, `shortcut_bn` in block 0), `rpn.{conv,objectness,deltas}`, `head.res5.{i}...`,
`head.{cls_score,bbox_pred,cls_embedding,fc_attr,attr_score}`. `rpn.objectness` keeps Caffe's 24
channels: background logits of anchors 0..11, then their foreground logits.

Precision (`PRECISIONS`): "fp32" is the exact mode (TF32 off for convolutions and matmuls while it
runs); "tf32" lets convolutions and matmuls use TF32 on GPUs that have it; "bf16" runs the backbone,
the RPN head and the RoI head under bfloat16 autocast. Box arithmetic, NMS and the selection are
float32 in every mode. Imports only torch and the standard library.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from typing import NamedTuple

import torch
from torch import Tensor, nn

from xmodal.models.butd.backbone import Backbone, fold_batch_norm
from xmodal.models.butd.config import PRECISIONS, DetectorConfig
from xmodal.models.butd.heads import RPN, RoIHead
from xmodal.models.butd.image import PreparedImage, check_image, prepare_image
from xmodal.models.butd.proposals import proposal_layer
from xmodal.models.butd.roi_pool import roi_pool_batch
from xmodal.models.butd.select import labels, select_regions


class ImageRegions(NamedTuple):
    """One image's regions, as the reference's TSV line holds them (boxes in original-image pixels)."""

    img_h: int
    img_w: int
    boxes: Tensor  # (K, 4) float32, x1 y1 x2 y2
    features: Tensor  # (K, feature_dim) float32: pool5_flat
    obj_ids: Tensor  # (K,) int64, 0-based over classes 1..num_classes
    obj_conf: Tensor  # (K,) float32
    attr_ids: Tensor  # (K,) int64, 0-based over attributes 1..num_attributes
    attr_conf: Tensor  # (K,) float32


class RegionBatch(NamedTuple):
    """The regions of a batch of images, padded to K slots each: what the detector hands back."""

    num_boxes: Tensor  # (B,) int64: slots [0, num_boxes) hold regions
    img_h: Tensor  # (B,) int64
    img_w: Tensor  # (B,) int64
    boxes: Tensor  # (B, K, 4) float32, original-image pixels; 0 in empty slots
    features: Tensor  # (B, K, D) float32; 0 in empty slots
    obj_ids: Tensor  # (B, K) int64; -1 in empty slots
    obj_conf: Tensor  # (B, K) float32
    attr_ids: Tensor  # (B, K) int64; -1 in empty slots
    attr_conf: Tensor  # (B, K) float32
    certified: Tensor  # (B,) bool: the proposal NMS's answer is certified (`boxes.window_nms`); else re-run

    def to_host(self) -> RegionBatch:
        """The batch on the CPU in ONE device-to-host copy (all fields packed into one float32 buffer;
        ids and sizes are integers far below 2^24, so float32 holds them exactly)."""
        if self.boxes.device.type == "cpu":
            return self
        b, k = self.obj_ids.shape
        d = self.features.shape[2]
        per_image = torch.stack((self.num_boxes, self.img_h, self.img_w, self.certified.long()), dim=1).float()
        per_slot = torch.cat((self.boxes, self.obj_ids[..., None].float(), self.obj_conf[..., None],
                              self.attr_ids[..., None].float(), self.attr_conf[..., None], self.features), dim=2)
        host = torch.cat((per_image, per_slot.reshape(b, -1)), dim=1).cpu()  # the one copy
        slots = host[:, 4:].reshape(b, k, 8 + d)
        as_int = lambda t: t.round().to(torch.int64)  # noqa: E731
        return RegionBatch(as_int(host[:, 0]), as_int(host[:, 1]), as_int(host[:, 2]), slots[..., :4].contiguous(),
                           slots[..., 8:].contiguous(), as_int(slots[..., 4]), slots[..., 5].contiguous(),
                           as_int(slots[..., 6]), slots[..., 7].contiguous(), host[:, 3] > 0.5)

    def images(self) -> list[ImageRegions]:
        """Per image, its regions without the empty slots (on the batch's device; call on a host batch)."""
        out = []
        for i, k in enumerate(self.num_boxes.tolist()):
            out.append(ImageRegions(int(self.img_h[i]), int(self.img_w[i]), self.boxes[i, :k], self.features[i, :k],
                                    self.obj_ids[i, :k], self.obj_conf[i, :k], self.attr_ids[i, :k],
                                    self.attr_conf[i, :k]))
        return out


class Detector(nn.Module):
    """The whole detector (module docstring)."""

    def __init__(self, cfg: DetectorConfig | None = None):
        super().__init__()
        self.cfg = cfg or DetectorConfig()
        self.backbone = Backbone(self.cfg.backbone)
        self.rpn = RPN(self.cfg)
        self.head = RoIHead(self.cfg)

    @property
    def device(self) -> torch.device:
        return self.rpn.conv.weight.device

    def prepare(self, image: Tensor | PreparedImage) -> PreparedImage:
        """An image on the model's device: a blob made at decode (OpenCV) is moved there; a uint8 image is
        prepared there by `image.prepare_image` (the generic resize)."""
        if isinstance(image, PreparedImage):
            return image._replace(blob=image.blob.to(self.device, non_blocking=True))
        check_image(image)
        return prepare_image(image.to(self.device, non_blocking=True), self.cfg.input)

    @torch.no_grad()
    def detect(self, images: Sequence[Tensor | PreparedImage], *, boxes_range: tuple[int, int] | None = None,
               given_boxes: Sequence[Tensor] | None = None, precision: str = "fp32", backbone_batch: int | None = None,
               nms: str = "window", stats: dict[str, float] | None = None) -> RegionBatch:
        """Regions of each image, as `get_detections_from_im` writes them, on the model's device.

        An image whose proposal NMS the window could not certify (`boxes.window_nms`; rare) has
        `certified` False and other regions than the reference's: `regions` detects it again sequentially.

        images: (H, W, 3) uint8 BGR tensors (as `cv2.imread` gives) or `PreparedImage`s (blobs made at decode).
        boxes_range: (min_boxes, max_boxes) for this call in place of the config's selection (36 or 10-100).
        given_boxes: None, or per image (K, 4) boxes in original-image pixels: the features of those boxes
          (the reference's `im_detect(net, im, boxes)`: rois = boxes * scale), no selection; their labels
          are still the heads' argmax.
        precision: one of PRECISIONS (module docstring).
        backbone_batch: at most this many images of one input size per backbone call; by default all of
          them on a GPU and one on a CPU (where batching the backbone gains nothing, 0.88x measured, and
          oneDNN's kernel for one image differs in the last bits from its kernel for several at small
          widths: one image at a time keeps a CPU run's features independent of its batches).
        nms: the proposal layer's NMS, "window" or "sequential" (`proposals.proposal_layer`).
        stats: if given, seconds per stage are added to it (the device synchronised at each stage's end,
          which costs time of its own): prepare, backbone, rpn, roi_pool, head, select; and "regions",
          the number of region slots that went through the RoI head.
        """
        if precision not in PRECISIONS:
            raise ValueError(f"precision {precision!r}: expected one of {', '.join(PRECISIONS)}")
        if given_boxes is not None and len(given_boxes) != len(images):
            raise ValueError(f"given_boxes has {len(given_boxes)} entries for {len(images)} images")
        cfg = self.cfg if boxes_range is None else self.cfg.with_boxes(boxes_range)
        with _precision(precision, self.device):
            most = backbone_batch or (len(images) if self.device.type == "cuda" else 1)
            return self._detect(cfg, images, given_boxes, precision, max(1, most), nms,
                                _StageClock(stats, self.device))

    def _detect(self, cfg: DetectorConfig, images: Sequence[Tensor | PreparedImage],
                given_boxes: Sequence[Tensor] | None, precision: str, backbone_batch: int, nms: str,
                clock: _StageClock) -> RegionBatch:
        dev = self.device
        prepared = [self.prepare(im) for im in images]
        clock.lap("prepare")
        n = len(prepared)
        slots = cfg.rpn.post_nms_top_n if given_boxes is None else max([g.shape[0] for g in given_boxes], default=0)
        rois = torch.zeros((n, slots, 4), dtype=torch.float32, device=dev)  # input pixels
        ok = torch.zeros((n, slots), dtype=torch.bool, device=dev)
        certified = torch.ones(n, dtype=torch.bool, device=dev)
        pooled = [torch.empty(0)] * n
        autocast = torch.autocast(dev.type, dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()
        for group in _same_size(prepared, backbone_batch):
            x = torch.stack([prepared[i].blob for i in group]).permute(0, 3, 1, 2).contiguous()  # (G, 3, h, w)
            with autocast:
                features = self.backbone(x)  # (G, C, h/16, w/16)
            clock.lap("backbone")
            scales = torch.tensor([prepared[i].scale for i in group], dtype=torch.float32)
            index = torch.tensor(group, device=dev)
            if given_boxes is None:
                with autocast:
                    prob, deltas = self.rpn(features)
                r, _, k, c = proposal_layer(prob.float(), deltas.float(), tuple(x.shape[2:]), scales, cfg.rpn,
                                            cfg.box_offset, nms)
                rois[index], ok[index], certified[index] = r, k, c
            else:
                for i in group:  # `_project_im_rois`: boxes times the scale (float64 in numpy), then the float32 blob
                    g = given_boxes[i].to(dev)
                    rois[i, :g.shape[0]] = (g.to(torch.float64) * prepared[i].scale).to(torch.float32)
                    ok[i, :g.shape[0]] = True
            clock.lap("rpn")
            by_image = roi_pool_batch(features.float(), rois[index], cfg.roi_head.pooled_size,
                                      cfg.roi_head.spatial_scale)  # (G, slots, C, P, P)
            for j, i in enumerate(group):
                pooled[i] = by_image[j]
            clock.lap("roi_pool")
        pool5, cls_prob, attr_prob = self._head(torch.cat(pooled), autocast)  # (n * slots, ...)
        clock.lap("head")
        clock.count("regions", n * slots)
        scale = torch.tensor([p.scale for p in prepared], dtype=torch.float32, device=dev)
        # `cls_boxes = rois[:, 1:5] / im_scales[0]`: float32 rois over the scale, in float32
        boxes = rois / scale[:, None, None]  # (n, slots, 4) original-image pixels
        pool5, cls_prob, attr_prob = (t.reshape(n, slots, -1) for t in (pool5, cls_prob, attr_prob))
        sizes = torch.tensor([[p.img_h, p.img_w] for p in prepared], dtype=torch.int64).to(dev)
        if given_boxes is None:
            sel = select_regions(boxes, cls_prob, attr_prob, ok, cfg.selection, cfg.box_offset)
            keep, count = sel.keep, sel.count
            obj_ids, obj_conf, attr_ids, attr_conf = sel.obj_ids, sel.obj_conf, sel.attr_ids, sel.attr_conf
            boxes = boxes.gather(1, keep[..., None].expand(-1, -1, 4))
            pool5 = pool5.gather(1, keep[..., None].expand(-1, -1, pool5.shape[2]))
        else:
            count = ok.sum(dim=1)
            obj_ids, obj_conf = labels(cls_prob)
            attr_ids, attr_conf = labels(attr_prob)
            boxes = torch.stack([torch.cat((g.to(dev, torch.float32), boxes.new_zeros((slots - g.shape[0], 4))))
                                 for g in given_boxes]) if n else boxes
        filled = torch.arange(boxes.shape[1], device=dev)[None, :] < count[:, None]  # (n, K)
        out = RegionBatch(count, sizes[:, 0], sizes[:, 1], torch.where(filled[..., None], boxes, 0.0),
                          torch.where(filled[..., None], pool5, 0.0), torch.where(filled, obj_ids, -1),
                          torch.where(filled, obj_conf, 0.0), torch.where(filled, attr_ids, -1),
                          torch.where(filled, attr_conf, 0.0), certified)
        clock.lap("select")
        return out

    def _head(self, pooled: Tensor, autocast) -> tuple[Tensor, Tensor, Tensor]:
        """The RoI head over (R, C, 14, 14) pooled regions, `region_batch` at a time."""
        outs = []
        for chunk in pooled.split(max(1, self.cfg.roi_head.region_batch)):
            with autocast:
                outs.append(self.head(chunk))
        if not outs:
            z = pooled.new_zeros
            return z((0, self.cfg.feature_dim)), z((0, self.cfg.num_classes + 1)), z((0, self.cfg.num_attributes + 1))
        return tuple(torch.cat(parts).float() for parts in zip(*outs, strict=True))  # type: ignore[return-value]

    def regions(self, images: Sequence[Tensor | PreparedImage], *, boxes_range: tuple[int, int] | None = None,
                given_boxes: Sequence[Tensor] | None = None, precision: str = "fp32", backbone_batch: int | None = None,
                stats: dict[str, float] | None = None) -> RegionBatch:
        """`detect`, the regions copied to the host once; the images it could not certify (rare) detected again
        with the sequential NMS, and their rows replaced (counted in stats as "recomputed")."""
        kw = dict(boxes_range=boxes_range, precision=precision, backbone_batch=backbone_batch, stats=stats)
        batch = self.detect(images, given_boxes=given_boxes, **kw)  # type: ignore[arg-type]
        clock = _StageClock(stats, self.device)
        host = batch.to_host()
        clock.lap("to_host")
        again = [i for i, c in enumerate(host.certified.tolist()) if not c]
        if not again:
            return host
        _StageClock(stats, self.device).count("recomputed", len(again))
        redo = self.detect([images[i] for i in again], given_boxes=None if given_boxes is None else
                           [given_boxes[i] for i in again], nms="sequential", **kw).to_host()  # type: ignore[arg-type]
        rows = torch.tensor(again)
        fields = []
        for old, new in zip(host, redo, strict=True):
            old = old.clone()
            old[rows] = new
            fields.append(old)
        return RegionBatch(*fields)

    def extract(self, images: Sequence[Tensor | PreparedImage], *, boxes_range: tuple[int, int] | None = None,
                given_boxes: Sequence[Tensor] | None = None, precision: str = "fp32", backbone_batch: int | None = None,
                stats: dict[str, float] | None = None) -> list[ImageRegions]:
        """`regions`, split per image (for tests and scripts; the extraction job takes the padded batch)."""
        return self.regions(images, boxes_range=boxes_range, given_boxes=given_boxes, precision=precision,
                            backbone_batch=backbone_batch, stats=stats).images()

    def fold_batch_norm(self) -> Detector:
        """Fold every frozen BatchNorm + Scale into the convolution before it, in place (`backbone.fold_batch_norm`)."""
        fold_batch_norm(self)
        return self


def _same_size(prepared: Sequence[PreparedImage], most: int) -> Iterator[list[int]]:
    """Indices of images with one input size, at most `most` at a time, in their first image's order."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, p in enumerate(prepared):
        groups.setdefault(tuple(p.blob.shape), []).append(i)
    for members in groups.values():
        for start in range(0, len(members), most):
            yield members[start:start + most]


@contextlib.contextmanager
def _precision(precision: str, device: torch.device):
    """TF32 on for "tf32" only, while the call runs (PyTorch's cuDNN default allows it: fp32 would not be fp32)."""
    if device.type != "cuda":
        yield
        return
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = precision == "tf32"
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


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
