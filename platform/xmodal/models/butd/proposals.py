"""The RPN's proposal layer for one image, and the NMS it and the region selection use.

Follows peteanderson80/bottom-up-attention:
- `lib/rpn/proposal_layer.py` (`ProposalLayer.forward`, `_filter_boxes`),
- `lib/fast_rcnn/bbox_transform.py` (`bbox_transform_inv`, `clip_boxes`),
- `lib/nms/cpu_nms.pyx` (`cpu_nms`): the NMS that runs, because the configuration the extraction
  loads, `experiments/cfgs/faster_rcnn_end2end_resnet.yml`, sets `USE_GPU_NMS: False`, and
  `lib/fast_rcnn/nms_wrapper.py` then dispatches to `cpu_nms`;
- the test-time defaults of `lib/fast_rcnn/config.py` (`TEST.RPN_PRE_NMS_TOP_N` 6000,
  `TEST.RPN_POST_NMS_TOP_N` 300, `TEST.RPN_NMS_THRESH` 0.7, `TEST.RPN_MIN_SIZE` 16).

Boxes are (x1, y1, x2, y2) with inclusive corners: width x2 - x1 + 1, area (w + 1)(h + 1) in
x2 - x1 terms. Arithmetic is float32, as in the reference (its blobs and `cpu_nms`'s typed
variables are float32).
"""

from __future__ import annotations

import torch
from torch import Tensor

from xmodal.models.butd.anchors import ANCHOR_SCALES, FEAT_STRIDE, generate_anchors, shifted_anchors

PRE_NMS_TOP_N = 6000
POST_NMS_TOP_N = 300
RPN_NMS_THRESH = 0.7
RPN_MIN_SIZE = 16


def descending_order(scores: Tensor) -> Tensor:
    """Indices sorting `scores` (..., N) from highest to lowest along the last axis, as `argsort()[::-1]`.

    The reference reverses numpy's ascending argsort, so among equal scores the LATER index comes
    first. That is exact where numpy's argsort is stable, which its default quicksort is for the
    small arrays it insertion-sorts (16 elements or fewer); for larger arrays numpy leaves the order
    of ties unspecified, and this keeps the same later-index-first rule so it is at least
    deterministic.
    """
    return torch.argsort(scores, dim=-1, stable=True).flip(-1)


def bbox_transform_inv(boxes: Tensor, deltas: Tensor) -> Tensor:
    """Apply (dx, dy, dw, dh) `deltas` (N, 4) to `boxes` (N, 4) -> (N, 4), in the deltas' dtype.

    w = x2 - x1 + 1 and ctr = x1 + 0.5 w; the predicted box is ctr' -+ 0.5 w' with NO "- 1" on the
    far corner, so zero deltas move x2 and y2 one pixel out (box (0, 0, 15, 15) comes back as
    (0, 0, 16, 16)); that is the reference's arithmetic and the proposals depend on it. dw and dh
    are not clamped before exp (Detectron's later log(1000 / 16) clamp is not in the reference).
    """
    boxes = boxes.to(deltas.dtype)
    widths = boxes[:, 2] - boxes[:, 0] + 1.0  # (N,)
    heights = boxes[:, 3] - boxes[:, 1] + 1.0
    ctr_x = boxes[:, 0] + 0.5 * widths
    ctr_y = boxes[:, 1] + 0.5 * heights
    dx, dy, dw, dh = deltas.unbind(dim=1)
    pred_ctr_x = dx * widths + ctr_x
    pred_ctr_y = dy * heights + ctr_y
    pred_w = torch.exp(dw) * widths
    pred_h = torch.exp(dh) * heights
    return torch.stack(
        (pred_ctr_x - 0.5 * pred_w, pred_ctr_y - 0.5 * pred_h, pred_ctr_x + 0.5 * pred_w, pred_ctr_y + 0.5 * pred_h),
        dim=1,
    )


def clip_boxes(boxes: Tensor, height: float, width: float) -> Tensor:
    """Clip (N, 4) boxes to [0, width - 1] x [0, height - 1] (the last pixel is inclusive)."""
    x = boxes[:, 0::2].clamp(max=width - 1).clamp(min=0)  # min then max, the reference's order
    y = boxes[:, 1::2].clamp(max=height - 1).clamp(min=0)
    return torch.stack((x[:, 0], y[:, 0], x[:, 1], y[:, 1]), dim=1)


def filter_small_boxes(boxes: Tensor, min_size: float | Tensor) -> Tensor:
    """Indices (ascending) of the (N, 4) boxes whose "+1" width and height are both >= min_size."""
    ws = boxes[:, 2] - boxes[:, 0] + 1
    hs = boxes[:, 3] - boxes[:, 1] + 1
    return torch.nonzero((ws >= min_size) & (hs >= min_size)).flatten()


def _overlaps(box: Tensor, boxes: Tensor, box_area: Tensor, areas: Tensor) -> Tensor:
    """IoU of one (4,) box with (M, 4) boxes, "+1" sizes, in `cpu_nms`'s operation order -> (M,)."""
    w = (torch.minimum(box[2], boxes[:, 2]) - torch.maximum(box[0], boxes[:, 0]) + 1).clamp(min=0.0)
    h = (torch.minimum(box[3], boxes[:, 3]) - torch.maximum(box[1], boxes[:, 1]) + 1).clamp(min=0.0)
    inter = w * h
    return inter / (box_area + areas - inter)


def _suppresses(overlap: Tensor, threshold: float) -> Tensor:
    # `cpu_nms` suppresses when its float32 IoU is >= a float64 threshold: compared in float64, an
    # IoU of exactly 0.7 (float32 0.69999999) survives 0.7 while one of exactly 0.3 is suppressed by 0.3.
    return overlap.double() >= threshold


def box_areas(boxes: Tensor) -> Tensor:
    """"+1" areas of (N, 4) boxes -> (N,)."""
    return (boxes[:, 2] - boxes[:, 0] + 1) * (boxes[:, 3] - boxes[:, 1] + 1)


def pairwise_iou(boxes: Tensor) -> Tensor:
    """(N, N) IoU of (N, 4) boxes with "+1" sizes; each row equals what `cpu_nms` computes for that box."""
    areas = box_areas(boxes)
    w = (torch.minimum(boxes[:, None, 2], boxes[None, :, 2]) - torch.maximum(boxes[:, None, 0], boxes[None, :, 0]) + 1)
    h = (torch.minimum(boxes[:, None, 3], boxes[None, :, 3]) - torch.maximum(boxes[:, None, 1], boxes[None, :, 1]) + 1)
    inter = w.clamp(min=0.0) * h.clamp(min=0.0)
    return inter / (areas[:, None] + areas[None, :] - inter)


def nms(boxes: Tensor, scores: Tensor, threshold: float, max_keep: int | None = None) -> Tensor:
    """Greedy NMS as the reference's `cpu_nms`: indices into `boxes` (N, 4) of the kept boxes, best first.

    Boxes are visited by `descending_order(scores)`; a visited box that is not suppressed is kept
    and suppresses every box whose "+1" IoU with it is >= threshold. `max_keep` stops after that
    many kept boxes, which gives the first `max_keep` of the full result (the proposal layer keeps
    only its first 300). One row of overlaps per kept box, so memory stays O(N).
    """
    if boxes.shape[0] == 0:
        return torch.zeros(0, dtype=torch.long)
    order = descending_order(scores)  # (N,)
    ordered = boxes[order]  # (N, 4)
    areas = box_areas(ordered)  # (N,)
    n = ordered.shape[0]
    suppressed = torch.zeros(n, dtype=torch.bool)
    keep = []
    i = 0
    while i < n and (max_keep is None or len(keep) < max_keep):
        keep.append(i)
        rest = slice(i + 1, n)
        suppressed[rest] |= _suppresses(_overlaps(ordered[i], ordered[rest], areas[i], areas[rest]), threshold)
        alive = torch.nonzero(~suppressed[rest])
        if alive.numel() == 0:
            break
        i = i + 1 + int(alive[0])
    return order[torch.tensor(keep, dtype=torch.long)]


def proposal_layer(
    rpn_cls_prob: Tensor,
    rpn_bbox_pred: Tensor,
    im_info: tuple[float, float, float],
    *,
    feat_stride: int = FEAT_STRIDE,
    anchor_scales: tuple[float, ...] = ANCHOR_SCALES,
    pre_nms_top_n: int = PRE_NMS_TOP_N,
    post_nms_top_n: int = POST_NMS_TOP_N,
    nms_thresh: float = RPN_NMS_THRESH,
    min_size: float = RPN_MIN_SIZE,
) -> tuple[Tensor, Tensor]:
    """The test-time proposal layer on one image -> (rois (R, 4), scores (R,)), R <= post_nms_top_n.

    rpn_cls_prob: (2A, H, W), the softmax blob `rpn_cls_prob_reshape` without its batch axis: the
      first A channels are background, the last A the object probabilities used here.
    rpn_bbox_pred: (4A, H, W), channel 4a + c the delta c of anchor a.
    im_info: (height, width, scale) of the resized input image; the reference stores it as float32,
      so the scale is rounded to float32 before it scales min_size.

    Steps, in the reference's order: decode every shifted anchor, clip to the image, drop boxes
    with a "+1" side < min_size * scale, sort by score (`descending_order`), keep pre_nms_top_n,
    NMS at nms_thresh, keep post_nms_top_n. The rois are in resized-image pixels.
    """
    a = rpn_cls_prob.shape[0] // 2
    height, width = rpn_cls_prob.shape[-2:]
    info = torch.tensor(im_info, dtype=torch.float32)  # (3,)
    anchors = shifted_anchors(height, width, feat_stride, generate_anchors(scales=anchor_scales))  # (H*W*A, 4)
    # (4A, H, W) -> (H, W, 4A) -> (H*W*A, 4): rows in (h, w, a) order, matching the anchors
    deltas = rpn_bbox_pred.permute(1, 2, 0).reshape(-1, 4)
    scores = rpn_cls_prob[a:].permute(1, 2, 0).reshape(-1)  # (H*W*A,)

    proposals = clip_boxes(bbox_transform_inv(anchors, deltas), info[0], info[1])
    keep = filter_small_boxes(proposals, min_size * info[2])
    proposals, scores = proposals[keep], scores[keep]

    order = descending_order(scores)
    if pre_nms_top_n > 0:
        order = order[:pre_nms_top_n]
    proposals, scores = proposals[order], scores[order]

    keep = nms(proposals, scores, nms_thresh, max_keep=post_nms_top_n if post_nms_top_n > 0 else None)
    return proposals[keep], scores[keep]
