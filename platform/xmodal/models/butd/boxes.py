"""Box arithmetic and greedy NMS, the reference's way, batched over images and on any device.

Boxes are (x1, y1, x2, y2) with inclusive corners: with the reference's `offset` of 1, a box's width
is x2 - x1 + 1 (`lib/fast_rcnn/bbox_transform.py`, `lib/nms/cpu_nms.pyx` of
peteanderson80/bottom-up-attention); detectron2's ports use 0. Every function takes boxes
(..., N, 4) with any leading batch axes, float32 as the reference's blobs, and keeps the reference's
order of operations so that float32 rounding is the same.

Two NMS, both on the tensors' device with no read back to the host, both the reference's greedy
result: `greedy_nms` takes a fixed number of sequential steps (`max_keep`), each keeping every
image's next surviving box; `window_nms` solves the same greedy rule as fixed points over windows of
boxes in a fixed number of matrix steps, and says per image whether the answer is certified (every
window at its fixed point), so that a caller re-runs only the rare image it could not certify through
`greedy_nms`.
"""

from __future__ import annotations

import torch
from torch import Tensor


def descending_order(scores: Tensor) -> Tensor:
    """Indices sorting `scores` (..., N) from highest to lowest along the last axis, as `argsort()[::-1]`.

    The reference reverses numpy's ascending argsort, so among equal scores the LATER index comes
    first. That is exact where numpy's argsort is stable, which its default quicksort is for the
    small arrays it insertion-sorts (16 elements or fewer); for larger arrays numpy leaves the order
    of ties unspecified, and this keeps the same later-index-first rule so that it is at least
    deterministic, on every device (docs/extract.md, "Ties").
    """
    return torch.argsort(scores, dim=-1, stable=True).flip(-1)


def sizes(boxes: Tensor, offset: float = 1.0) -> tuple[Tensor, Tensor]:
    """Widths and heights (..., N) of (..., N, 4) boxes: x2 - x1 + offset."""
    return boxes[..., 2] - boxes[..., 0] + offset, boxes[..., 3] - boxes[..., 1] + offset


def areas(boxes: Tensor, offset: float = 1.0) -> Tensor:
    """(..., N) areas: (x2 - x1 + offset) * (y2 - y1 + offset)."""
    w, h = sizes(boxes, offset)
    return w * h


def decode(boxes: Tensor, deltas: Tensor, offset: float = 1.0) -> Tensor:
    """`bbox_transform_inv`: apply (dx, dy, dw, dh) `deltas` (..., N, 4) to `boxes` -> (..., N, 4), the deltas' dtype.

    ctr = x1 + 0.5 w; the predicted box is ctr' -+ 0.5 w' with NO "- offset" on the far corner, so
    zero deltas move x2 and y2 one pixel out (box (0, 0, 15, 15) comes back as (0, 0, 16, 16)):
    the reference's arithmetic, which the proposals depend on. dw and dh are not clamped before exp
    (Detectron's later log(1000 / 16) clamp is not in the reference). exp is rounded once from float64.
    """
    boxes = boxes.to(deltas.dtype)
    widths, heights = sizes(boxes, offset)
    ctr_x = boxes[..., 0] + 0.5 * widths
    ctr_y = boxes[..., 1] + 0.5 * heights
    dx, dy, dw, dh = deltas.unbind(dim=-1)
    pred_ctr_x = dx * widths + ctr_x
    pred_ctr_y = dy * heights + ctr_y
    # exp correctly rounded to the deltas' dtype (computed in float64): libm's expf, which the reference's
    # numpy called for float32 arrays (numpy <= 1.16; later numpy's AVX2 / AVX-512 exp and torch's
    # differ from it in the last bit of 40 % and 1 % of values, and such a bit moves a proposal's corner)
    pred_w = torch.exp(dw.to(torch.float64)).to(dw.dtype) * widths
    pred_h = torch.exp(dh.to(torch.float64)).to(dh.dtype) * heights
    return torch.stack((pred_ctr_x - 0.5 * pred_w, pred_ctr_y - 0.5 * pred_h,
                        pred_ctr_x + 0.5 * pred_w, pred_ctr_y + 0.5 * pred_h), dim=-1)


def clip(boxes: Tensor, height: float | Tensor, width: float | Tensor, offset: float = 1.0) -> Tensor:
    """Clip (..., N, 4) boxes to [0, width - offset] x [0, height - offset] (`clip_boxes`: min, then max)."""
    x = boxes[..., 0::2].clamp(max=width - offset).clamp(min=0)
    y = boxes[..., 1::2].clamp(max=height - offset).clamp(min=0)
    return torch.stack((x[..., 0], y[..., 0], x[..., 1], y[..., 1]), dim=-1)


def big_enough(boxes: Tensor, min_size: Tensor, offset: float = 1.0) -> Tensor:
    """`_filter_boxes` as a mask (..., N): both sides >= min_size (float32, one value per image (...,) or scalar)."""
    w, h = sizes(boxes, offset)
    m = min_size[..., None] if min_size.dim() else min_size
    return (w >= m) & (h >= m)


def iou_with(box: Tensor, boxes: Tensor, box_area: Tensor, boxes_area: Tensor, offset: float = 1.0) -> Tensor:
    """IoU of one box per row (..., 1, 4) with (..., N, 4) boxes -> (..., N), in `cpu_nms`'s operation order.

    w = max(0, min(x2) - max(x1) + offset), likewise h; inter = w * h; inter / (area + areas - inter).
    """
    w = (torch.minimum(box[..., 2], boxes[..., 2]) - torch.maximum(box[..., 0], boxes[..., 0]) + offset).clamp(min=0.0)
    h = (torch.minimum(box[..., 3], boxes[..., 3]) - torch.maximum(box[..., 1], boxes[..., 1]) + offset).clamp(min=0.0)
    inter = w * h
    return inter / (box_area + boxes_area - inter)


def pairwise_iou(boxes: Tensor, offset: float = 1.0) -> Tensor:
    """(..., N, N) IoU of (..., N, 4) boxes; row i equals what `cpu_nms` computes for box i."""
    a = areas(boxes, offset)
    return iou_with(boxes[..., :, None, :], boxes[..., None, :, :], a[..., :, None], a[..., None, :], offset)


def suppresses(overlap: Tensor, threshold: float) -> Tensor:
    """`cpu_nms` suppresses when its float32 IoU is >= a float64 threshold: compared in float64, an IoU
    of exactly 0.7 (float32 0.69999999) survives 0.7 while one of exactly 0.3 is suppressed by 0.3."""
    return overlap.double() >= threshold


def greedy_nms(boxes: Tensor, valid: Tensor, threshold: float, max_keep: int, offset: float = 1.0
               ) -> tuple[Tensor, Tensor]:
    """Greedy NMS as `cpu_nms` over boxes already in visiting order: (B, N, 4), valid (B, N).

    Box j is kept when no kept box before it overlaps it at IoU >= threshold; invalid boxes are
    neither kept nor suppress. Returns the first `max_keep` kept positions of each image (B, max_keep)
    and which of those slots hold a box (B, max_keep): an image with fewer survivors has its tail
    slots empty (their positions are 0).

    Step t picks each image's first box neither kept nor suppressed (`argmax` of the mask: the first
    maximum, on every device), keeps it, and suppresses what it overlaps. `max_keep` steps whatever
    the data: no host read decides when to stop.
    """
    b, n = valid.shape
    if n == 0 or max_keep <= 0:
        return (torch.zeros((b, max(max_keep, 0)), dtype=torch.long, device=boxes.device),
                torch.zeros((b, max(max_keep, 0)), dtype=torch.bool, device=boxes.device))
    box_areas = areas(boxes, offset)  # (B, N)
    done = ~valid  # (B, N): kept, suppressed, or never a candidate
    keep = torch.zeros((b, max_keep), dtype=torch.long, device=boxes.device)
    ok = torch.zeros((b, max_keep), dtype=torch.bool, device=boxes.device)
    rows = torch.arange(b, device=boxes.device)
    for t in range(max_keep):
        open_ = ~done
        i = open_.to(torch.uint8).argmax(dim=1)  # (B,) the first open box (0 when none is)
        found = open_[rows, i]  # (B,)
        keep[:, t] = i
        ok[:, t] = found
        chosen = boxes[rows, i][:, None, :]  # (B, 1, 4)
        hit = suppresses(iou_with(chosen, boxes, box_areas[rows, i][:, None], box_areas, offset), threshold)
        done |= hit & found[:, None]
        done[rows, i] = True
    return keep, ok


def window_nms(boxes: Tensor, valid: Tensor, threshold: float, max_keep: int, offset: float = 1.0, *,
               window: int = 1500, iterations: int = 48) -> tuple[Tensor, Tensor, Tensor]:
    """`greedy_nms`'s result by fixed points: (keep (B, max_keep), ok (B, max_keep), certified (B,)).

    Greedy NMS keeps box j exactly when no kept box before it overlaps it: keep = valid & ~(keep @ S)
    with S[i, j] = (i < j and IoU >= threshold). That equation has one solution (box by box in order,
    each is decided by the ones before it), the greedy one. The boxes are taken `window` at a time, in
    order: a window's boxes overlapped by a kept box of an earlier window are out (one batched product
    per earlier window), and the rest solve the equation inside the window by iterating it from "keep
    everything", typically within 5 to 30 steps (measured on RPN-like score maps); each step is one
    batched matrix product of 0/1 values (exact in float32). An image is certified when every window's
    answer satisfies its equation after `iterations` steps; the shapes, and so the work, are the same
    whatever the data. An image that is not certified has a wrong answer here: re-run it through
    `greedy_nms`.
    """
    b, n = valid.shape
    kept = torch.zeros((b, n), dtype=torch.bool, device=boxes.device)
    certified = torch.ones(b, dtype=torch.bool, device=boxes.device)
    starts = range(0, n, window)
    for start in starts:
        stop = min(n, start + window)
        cur = boxes[:, start:stop]
        v = valid[:, start:stop]
        for earlier in range(0, start, window):  # suppressed by a kept box of an earlier window
            prev = boxes[:, earlier:earlier + window]
            hit = suppresses(iou_with(prev[:, :, None, :], cur[:, None, :, :], areas(prev, offset)[:, :, None],
                                      areas(cur, offset)[:, None, :], offset), threshold)  # (B, W', W)
            v = v & ~(torch.bmm(kept[:, None, earlier:earlier + window].to(torch.float32), hit.to(torch.float32))[:, 0] > 0)
        idx = torch.arange(stop - start, device=boxes.device)
        s = (suppresses(pairwise_iou(cur, offset), threshold) & (idx[:, None] < idx[None, :]) & v[:, :, None])
        s = s.to(torch.float32)
        keep = v
        for _ in range(iterations):
            keep = v & ~(torch.bmm(keep.to(torch.float32)[:, None, :], s)[:, 0] > 0)
        certified &= (keep == (v & ~(torch.bmm(keep.to(torch.float32)[:, None, :], s)[:, 0] > 0))).all(dim=1)
        kept[:, start:stop] = keep
    count = kept.sum(dim=1)
    idx = torch.arange(n, device=boxes.device)
    first = torch.argsort(torch.where(kept, idx, n + idx), dim=1, stable=True)[:, :max_keep]  # kept, in order
    if first.shape[1] < max_keep:
        first = torch.cat((first, first.new_zeros((b, max_keep - first.shape[1]))), dim=1)
    ok = torch.arange(max_keep, device=boxes.device)[None, :] < count[:, None]
    return torch.where(ok, first, 0), ok, certified
