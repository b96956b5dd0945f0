"""The bottom-up-attention detector: Faster R-CNN, ResNet-101 C4, Visual Genome (Anderson et al., CVPR 2018).

The network of peteanderson80/bottom-up-attention's
`models/vg/ResNet-101/faster_rcnn_end2end_final/test.prototxt`, run as its `lib/fast_rcnn/test.py`
(`im_detect`) and LXMERT's `data/mscoco_imgfeat/extract_coco_image.py` (airsplay/lxmert) run it,
in pure torch on one device. `Detector.detect` calls its stages in order, each a module built from its
node of the config tree (`config.DetectorConfig`) that owns its post-processing:

    preprocess  (H, W, 3) uint8 BGR -> minus the means -> bilinear resize   image.py (or OpenCV at decode)
    backbone    conv1 .. res4b22, stride 16, 1024 channels                   backbone.py
    rpn         the RPN head, then the proposal layer (anchors, decode,      proposals.py: RPN
                clip, min size, NMS), 300 proposals an image
    head        ROIPool 14 x 14 at 1/16, res5, pool5 (2048), the class and   roi_heads.py: RoIHeads
                attribute heads, then the selection: 36 (or 10-100) regions  (roi_pool.py, select.py)
                in original-image pixels

`Detector.detect_given_boxes` skips the proposals: the RoI heads take the given boxes, with no
selection. Images of one input size go through the backbone and the proposal layer together, the RoI
heads take the regions of the whole batch at once, and nothing is copied to the host until
`RegionBatch.to_host`, one copy of the final regions (`Detector.regions`). On a CPU the same code is the
exact path. How a call runs (precision, backbone batch, NMS mode, stage timings) is one
`config.DetectOptions`; what the stages hand each other is in `structures.py`.

Parameter names (the canonical layout that `weights.py` maps the public files onto) are the module
paths: `backbone.stem.{conv,bn}`, `backbone.res{2,3,4}.{i}.{conv1,bn1,conv2,bn2,conv3,bn3}`
(+ `shortcut`, `shortcut_bn` in block 0), `rpn.{conv,objectness,deltas}`, `head.res5.{i}...`,
`head.{cls_score,bbox_pred,cls_embedding,fc_attr,attr_score}`. `rpn.objectness` keeps Caffe's 24
channels: background logits of anchors 0..11, then their foreground logits.

Precision (`config.PRECISIONS`, `DetectOptions.precision`): "fp32" is the exact mode (TF32 off for
convolutions and matmuls while it runs); "tf32" lets convolutions and matmuls use TF32 on GPUs that
have it; "bf16" runs the backbone, the RPN head and the RoI heads' layers under bfloat16 autocast. Box
arithmetic, NMS and the selection are float32 in every mode. Imports only torch and the standard library.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor, nn

from xmodal.models.butd.backbone import Backbone, fold_batch_norm
from xmodal.models.butd.config import DetectOptions, DetectorConfig
from xmodal.models.butd.image import PreparedImage, check_image, prepare_image
from xmodal.models.butd.proposals import RPN
from xmodal.models.butd.roi_heads import RoIHeads
from xmodal.models.butd.structures import ImageBatch, ImageRegions, Pass, RegionBatch, StageClock


class Detector(nn.Module):
    """The whole detector (module docstring)."""

    def __init__(self, cfg: DetectorConfig | None = None):
        super().__init__()
        self.cfg = cfg or DetectorConfig()
        self.backbone = Backbone(self.cfg.backbone)
        self.rpn = RPN(self.cfg)  # the proposal generator
        self.head = RoIHeads(self.cfg)

    @property
    def device(self) -> torch.device:
        return self.rpn.conv.weight.device

    @torch.no_grad()
    def detect(self, images: Sequence[Tensor | PreparedImage], options: DetectOptions = DetectOptions()) -> RegionBatch:
        """Regions of each image, as `get_detections_from_im` writes them, on the model's device.

        images: (H, W, 3) uint8 BGR tensors (as `cv2.imread` gives) or `PreparedImage`s (blobs made at decode).
        An image whose proposal NMS the window could not certify (`boxes.window_nms`; rare) has
        `certified` False and other regions than the reference's: `regions` detects it again sequentially.
        """
        with self._pass(options) as run:
            batch = self.preprocess(images, run)
            features = self.features(batch, run)
            proposals = self.rpn(batch, features, run)
            return self.head(batch, features, proposals, run)

    @torch.no_grad()
    def detect_given_boxes(self, images: Sequence[Tensor | PreparedImage], given_boxes: Sequence[Tensor],
                           options: DetectOptions = DetectOptions()) -> RegionBatch:
        """The features of given boxes, per image (K, 4) in original-image pixels (the reference's
        `im_detect(net, im, boxes)`: rois = boxes * scale), in their order and with no selection; their
        labels are still the heads' argmax. No proposals: every image is certified."""
        if len(given_boxes) != len(images):
            raise ValueError(f"given_boxes has {len(given_boxes)} entries for {len(images)} images")
        with self._pass(options) as run:
            batch = self.preprocess(images, run)
            features = self.features(batch, run)
            return self.head.forward_with_given_boxes(batch, features, given_boxes, run)

    def regions(self, images: Sequence[Tensor | PreparedImage], options: DetectOptions = DetectOptions(),
                given_boxes: Sequence[Tensor] | None = None) -> RegionBatch:
        """`detect` (`detect_given_boxes` when boxes are given), the regions copied to the host once; the
        images it could not certify (rare) detected again with the sequential NMS, and their rows replaced
        (counted in stats as "recomputed")."""
        found = self.detect(images, options) if given_boxes is None else \
            self.detect_given_boxes(images, given_boxes, options)
        clock = StageClock(options.stats, self.device)
        host = found.to_host()
        clock.lap("to_host")
        again = [i for i, c in enumerate(host.certified.tolist()) if not c]  # none with given boxes
        if not again:
            return host
        clock.count("recomputed", len(again))
        redo = self.detect([images[i] for i in again], dataclasses.replace(options, nms="sequential"))
        return host.with_rows(again, redo.to_host())

    def extract(self, images: Sequence[Tensor | PreparedImage], options: DetectOptions = DetectOptions(),
                given_boxes: Sequence[Tensor] | None = None) -> list[ImageRegions]:
        """`regions`, split per image (for tests and scripts; the extraction job takes the padded batch)."""
        return self.regions(images, options, given_boxes).images()

    def prepare(self, image: Tensor | PreparedImage) -> PreparedImage:
        """An image on the model's device: a blob made at decode (OpenCV) is moved there; a uint8 image is
        prepared there by `image.prepare_image` (the generic resize)."""
        if isinstance(image, PreparedImage):
            return image._replace(blob=image.blob.to(self.device, non_blocking=True))
        check_image(image)
        return prepare_image(image.to(self.device, non_blocking=True), self.cfg.input)

    def preprocess(self, images: Sequence[Tensor | PreparedImage], run: Pass) -> ImageBatch:
        """The images prepared on the device, grouped by input size for the backbone."""
        prepared = [self.prepare(im) for im in images]
        run.clock.lap("prepare")
        most = run.options.backbone_batch or (len(images) if self.device.type == "cuda" else 1)
        return ImageBatch.grouped(prepared, max(1, most))

    def features(self, batch: ImageBatch, run: Pass) -> list[Tensor]:
        """The backbone's feature map of each group of `batch`: (G, C, h/16, w/16)."""
        out = []
        for group in batch.groups:
            with run.autocast():
                out.append(self.backbone(batch.blobs(group)))
            run.clock.lap("backbone")
        return out

    def fold_batch_norm(self) -> Detector:
        """Fold every frozen BatchNorm + Scale into the convolution before it, in place (`backbone.fold_batch_norm`)."""
        fold_batch_norm(self)
        return self

    @contextlib.contextmanager
    def _pass(self, options: DetectOptions) -> Iterator[Pass]:
        """One call: TF32 on for "tf32" only while it runs (PyTorch's cuDNN default allows it: fp32 would not
        be fp32), and its stage clock."""
        dev = self.device
        if dev.type != "cuda":
            yield Pass(options, dev, StageClock(options.stats, dev))
            return
        saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = options.precision == "tf32"
        try:
            yield Pass(options, dev, StageClock(options.stats, dev))
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


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
