"""The RPN's test-time proposal layer, over a batch of images of one input size, on any device.

Follows peteanderson80/bottom-up-attention's `lib/rpn/proposal_layer.py` (`ProposalLayer.forward`,
`_filter_boxes`) with the box arithmetic of `boxes` (`bbox_transform_inv`, `clip_boxes`, `cpu_nms`:
the NMS that runs, because `experiments/cfgs/faster_rcnn_end2end_resnet.yml` sets
`USE_GPU_NMS: False`). Arithmetic is float32, as in the reference's blobs.

The reference drops boxes, sorts what is left and cuts; here every image keeps its full set of
anchors with a mask, so that a batch keeps one shape and nothing is read back by the host: a box too
small scores -1 (below every probability) and sorts after the rest in the same relative order, so
the first `pre_nms_top_n` survivors are the reference's, in its order.
"""

from __future__ import annotations

import torch
from torch import Tensor

from xmodal.models.butd.anchors import generate_anchors, shifted_anchors
from xmodal.models.butd.boxes import big_enough, clip, decode, descending_order, greedy_nms, window_nms
from xmodal.models.butd.config import RPNConfig


def proposal_layer(rpn_cls_prob: Tensor, rpn_bbox_pred: Tensor, im_size: tuple[int, int], scales: Tensor,
                   cfg: RPNConfig, offset: float = 1.0, nms: str = "window") -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Proposals of B images of one input size -> rois (B, R, 4), scores (B, R), ok (B, R), certified (B,);
    R = post_nms_top_n.

    rpn_cls_prob: (B, 2A, H, W), the softmax blob `rpn_cls_prob_reshape`: the first A channels are
      background, the last A the object probabilities used here.
    rpn_bbox_pred: (B, 4A, H, W), channel 4a + c the delta c of anchor a.
    im_size: (height, width) of the resized input, the same for the batch.
    scales: (B,) float32, each image's input scale (the reference's `im_info[2]`, a float32 blob, so
      the minimum size is min_size * scale in float32).

    Steps, in the reference's order: decode every shifted anchor, clip to the image, drop boxes with
    a side < min_size * scale, sort by score (`descending_order`), keep pre_nms_top_n, NMS at
    nms_thresh, keep post_nms_top_n. The rois are in input pixels; an image with fewer survivors
    has its tail slots empty (ok False, rois 0).

    nms: "window" (`boxes.window_nms`: a few batched matrix steps; an image it cannot certify has
    certified False and must be re-run with "sequential") or "sequential" (`boxes.greedy_nms`:
    post_nms_top_n steps, always certified).
    """
    b, two_a, height, width = rpn_cls_prob.shape
    a = two_a // 2
    device = rpn_cls_prob.device
    cell = generate_anchors(cfg.feat_stride, cfg.anchor_ratios, cfg.anchor_scales)  # (A, 4) float64
    anchors = shifted_anchors(height, width, cfg.feat_stride, cell).to(device)  # (H*W*A, 4)
    # (B, 4A, H, W) -> (B, H, W, 4A) -> (B, H*W*A, 4): rows in (h, w, a) order, matching the anchors
    deltas = rpn_bbox_pred.permute(0, 2, 3, 1).reshape(b, -1, 4)
    scores = rpn_cls_prob[:, a:].permute(0, 2, 3, 1).reshape(b, -1)  # (B, H*W*A)

    props = clip(decode(anchors, deltas, offset), float(im_size[0]), float(im_size[1]), offset)  # (B, N, 4)
    min_size = scales.to(device=device, dtype=torch.float32) * cfg.min_size  # (B,) float32
    ok = big_enough(props, min_size, offset)  # (B, N)
    order = descending_order(torch.where(ok, scores, torch.full_like(scores, -1.0)))
    if cfg.pre_nms_top_n > 0:
        order = order[:, :cfg.pre_nms_top_n]
    props, scores, ok = props.gather(1, order[..., None].expand(-1, -1, 4)), scores.gather(1, order), ok.gather(1, order)
    # `cpu_nms` sorts what it is given once more by numpy's argsort, which moves only equal scores, in an
    # order no fixed rule reproduces (docs/extract.md, "Ties"): NMS visits the candidates in this order.

    if nms == "window":
        keep, kept, certified = window_nms(props, ok, cfg.nms_thresh, cfg.post_nms_top_n, offset,
                                           window=cfg.nms_window, iterations=cfg.nms_iterations)  # (B, R)
    elif nms == "sequential":
        keep, kept = greedy_nms(props, ok, cfg.nms_thresh, cfg.post_nms_top_n, offset)
        certified = torch.ones(b, dtype=torch.bool, device=device)
    else:
        raise ValueError(f"nms {nms!r}: expected window or sequential")
    rois = torch.where(kept[..., None], props.gather(1, keep[..., None].expand(-1, -1, 4)), 0.0)
    return rois, torch.where(kept, scores.gather(1, keep), 0.0), kept, certified
