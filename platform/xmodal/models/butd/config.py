"""The detector's configuration: one tree, a node per stage, the reference's values as its defaults.

    DetectorConfig
      input      InputConfig      the test scale, the size cap, the pixel means, how the image is resized
      backbone   BackboneConfig   conv1 .. res4: blocks and widths, BatchNorm's eps
      rpn        RPNConfig        anchors, the proposal layer's top-n, NMS and minimum size
      roi_head   RoIHeadConfig    ROI pooling, res5, the class, box and attribute heads
      selection  SelectionConfig  which proposals become regions: the per-class NMS, the threshold, 36 or 10-100
      box_offset                  the "+1" of every box width, area and IoU (1 in the reference, 0 in detectron2's ports)

Every default is the value of peteanderson80/bottom-up-attention's files that LXMERT's features came
from: `lib/fast_rcnn/config.py` (TEST.SCALES (600,), TEST.MAX_SIZE 1000, PIXEL_MEANS, TEST.RPN_*,
TEST.NMS), `models/vg/ResNet-101/faster_rcnn_end2end_final/test.prototxt` (the network, the proposal
layer's `param_str`, ROIPooling 14 x 14 at 0.0625), `lib/rpn/generate_anchors.py` (ratios) and
`get_detections_from_im` in airsplay/lxmert's `extract_coco_image.py` (CONF_THRESH 0.2, 36 boxes).
A convention is changed where it lives: `cfg.replace_in("rpn", post_nms_top_n=100)`. `DetectOptions`
says how one call runs (precision, backbone batch, NMS mode, stage timings), never which regions.

Imports only the standard library.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal

PIXEL_MEANS_BGR = (102.9801, 115.9465, 122.7717)
PRECISIONS = ("fp32", "tf32", "bf16")  # `DetectOptions.precision`: fp32 exact (TF32 off), tf32, bf16 autocast
NMS_MODES = ("window", "sequential")  # `DetectOptions.nms`: how the proposal NMS is computed (`proposals.proposal_layer`)
OBJ36 = (36, 36)  # LXMERT's (min_boxes, max_boxes)
BOTTOM_UP_DEFAULT = (10, 100)  # the reference's tools/generate_tsv.py


@dataclass(frozen=True)
class InputConfig:
    """`_get_image_blob` of `lib/fast_rcnn/test.py`: BGR minus the means, then a bilinear resize.

    resize: "opencv" takes `cv2.resize` itself, called where the image is decoded (bit-equal to the
      OpenCV installed there, as running the reference's code in that environment is); "generic"
      is `image.resize_linear`, OpenCV's generic float path in torch, run on the detector's device
      (bit-equal to OpenCV built without IPP; pip's opencv-python builds call IPP, which differs by
      up to about 0.01 on most pixels: docs/extract.md, "The input").
    """

    scale: int = 600  # TEST.SCALES[0]: the short side
    max_size: int = 1000  # TEST.MAX_SIZE: the long side's cap
    pixel_means: tuple[float, float, float] = PIXEL_MEANS_BGR
    resize: Literal["opencv", "generic"] = "opencv"


@dataclass(frozen=True)
class BackboneConfig:
    """ResNet-101 C4 up to res4b22 with Caffe's frozen BatchNorm + Scale."""

    blocks: tuple[int, int, int] = (3, 4, 23)  # res2, res3, res4 bottlenecks
    stem_width: int = 64  # conv1's channels
    width: int = 64  # res2's 1x1/3x3 width; doubles per stage; a stage's output is 4x its width
    bn_eps: float = 1e-5  # BatchNormParameter's default: the prototxt sets none

    def stage_out(self, stage: int) -> int:
        """Output channels of res{stage} (2..5): 256, 512, 1024, 2048 in the reference."""
        return 4 * self.width * 2 ** (stage - 2)


@dataclass(frozen=True)
class RPNConfig:
    """The RPN head and the test-time proposal layer (`lib/rpn/proposal_layer.py`)."""

    channels: int = 512  # rpn_conv/3x3
    anchor_scales: tuple[float, ...] = (4, 8, 16, 32)  # the proposal layer's param_str
    anchor_ratios: tuple[float, ...] = (0.5, 1.0, 2.0)  # generate_anchors' default
    feat_stride: int = 16
    pre_nms_top_n: int = 6000  # TEST.RPN_PRE_NMS_TOP_N
    post_nms_top_n: int = 300  # TEST.RPN_POST_NMS_TOP_N
    nms_thresh: float = 0.7  # TEST.RPN_NMS_THRESH: suppress at IoU >= this
    min_size: float = 16  # TEST.RPN_MIN_SIZE, in original-image pixels (times the scale)
    # How the NMS is computed, not what it computes (`boxes.window_nms`): nms_window candidates at a
    # time, nms_iterations fixed-point steps each; an image it cannot certify is re-run sequentially
    nms_window: int = 1500
    nms_iterations: int = 48

    @property
    def num_anchors(self) -> int:
        return len(self.anchor_ratios) * len(self.anchor_scales)


@dataclass(frozen=True)
class RoIHeadConfig:
    """`roi_pool5` (ROIPooling), res5 and the class, box and attribute heads of the prototxt."""

    pooled_size: int = 14
    spatial_scale: float = 0.0625  # 1 / feat_stride
    res5_blocks: int = 3
    num_classes: int = 1600  # objects, plus the background at index 0
    num_attributes: int = 400  # attributes, plus "no attribute" at index 0
    class_embed: int = 256  # cls_embedding's width
    attr_hidden: int = 512  # fc_attr's width
    region_batch: int = 1200  # regions per res5 call (memory, not arithmetic)


@dataclass(frozen=True)
class SelectionConfig:
    """`get_detections_from_im`: per-class NMS, the confidence threshold, the number of boxes."""

    nms_thresh: float = 0.3  # TEST.NMS
    conf_thresh: float = 0.2  # CONF_THRESH
    min_boxes: int = OBJ36[0]
    max_boxes: int = OBJ36[1]


@dataclass(frozen=True)
class DetectorConfig:
    """The whole detector (module docstring); the defaults are the reference's ResNet-101 on Visual Genome."""

    input: InputConfig = field(default_factory=InputConfig)
    backbone: BackboneConfig = field(default_factory=BackboneConfig)
    rpn: RPNConfig = field(default_factory=RPNConfig)
    roi_head: RoIHeadConfig = field(default_factory=RoIHeadConfig)
    selection: SelectionConfig = field(default_factory=SelectionConfig)
    box_offset: float = 1.0  # the reference's "+1": a box's width is x2 - x1 + 1

    @classmethod
    def tiny(cls) -> DetectorConfig:
        """A very small network with the reference's structure and label spaces, for tests and CPU benchmarks."""
        return cls(backbone=BackboneConfig(blocks=(1, 1, 1), stem_width=8, width=8),
                   rpn=RPNConfig(channels=16), roi_head=RoIHeadConfig(res5_blocks=1, class_embed=8, attr_hidden=16))

    def replace(self, **changes: object) -> DetectorConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def replace_in(self, stage: str, **changes: object) -> DetectorConfig:
        """This config with fields of one stage changed: `cfg.replace_in("selection", min_boxes=10, max_boxes=100)`."""
        stages = ("input", "backbone", "rpn", "roi_head", "selection")
        if stage not in stages:
            raise KeyError(f"stage {stage!r}: expected one of {', '.join(stages)}")
        return dataclasses.replace(self, **{stage: dataclasses.replace(getattr(self, stage), **changes)})

    def with_boxes(self, boxes_range: tuple[int, int]) -> DetectorConfig:
        """This config selecting between boxes_range[0] and boxes_range[1] regions per image."""
        return self.replace_in("selection", min_boxes=boxes_range[0], max_boxes=boxes_range[1])

    @property
    def feature_dim(self) -> int:
        """Width of a region's feature (`pool5_flat`): 2048 in the reference."""
        return self.backbone.stage_out(5)

    @property
    def num_classes(self) -> int:
        return self.roi_head.num_classes

    @property
    def num_attributes(self) -> int:
        return self.roi_head.num_attributes


@dataclass(frozen=True)
class DetectOptions:
    """How one `Detector.detect` call runs; what it computes is the config's (the boxes' range included:
    `DetectorConfig.with_boxes`).

    precision: one of PRECISIONS. "fp32" is the exact mode (TF32 off for convolutions and matmuls while
      the call runs); "tf32" lets them use TF32 on GPUs that have it; "bf16" runs the backbone, the RPN
      head and the RoI heads' layers under bfloat16 autocast. Box arithmetic, NMS and the selection are
      float32 in every mode.
    backbone_batch: at most this many images of one input size per backbone call; None: all of them on a
      GPU and one on a CPU (where batching the backbone gains nothing, 0.88x measured, and oneDNN's kernel
      for one image differs in the last bits from its kernel for several at small widths: one image at a
      time keeps a CPU run's features independent of its batches).
    nms: the proposal layer's NMS, one of NMS_MODES (`proposals.proposal_layer`).
    stats: if given, seconds per stage are added to it (the device synchronised at each stage's end,
      which costs time of its own): prepare, backbone, rpn, roi_pool, head, select (and to_host,
      recomputed from `Detector.regions`); and "regions", the number of region slots the RoI heads ran over.
    """

    precision: str = "fp32"
    backbone_batch: int | None = None
    nms: str = "window"
    stats: dict[str, float] | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision {self.precision!r}: expected one of {', '.join(PRECISIONS)}")
        if self.nms not in NMS_MODES:
            raise ValueError(f"nms {self.nms!r}: expected one of {', '.join(NMS_MODES)}")
        if self.backbone_batch is not None and self.backbone_batch < 1:
            raise ValueError(f"backbone_batch {self.backbone_batch}: expected None or at least 1")
