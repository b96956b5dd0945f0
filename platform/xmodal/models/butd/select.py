"""Which proposals become an image's regions, and their object and attribute labels, over a batch.

Follows `get_detections_from_im` in airsplay/lxmert's `data/mscoco_imgfeat/extract_coco_image.py`
(MIN_BOXES = MAX_BOXES = 36) and in peteanderson80/bottom-up-attention's `tools/generate_tsv.py`
(MIN_BOXES 10, MAX_BOXES 100; the same selection without the labels), with `config.SelectionConfig`'s
values. The NMS is `cpu_nms` (`lib/nms/cpu_nms.pyx`).

The regions are the proposals themselves (the box regression output is not used). The caller
passes them in ORIGINAL-image pixels, i.e. the proposal layer's rois divided by the input scale, as
the reference does: the "+1" areas make the NMS depend on the pixel scale.

Every image of the batch has N proposal slots of which the first few hold proposals (`ok`): empty
slots score -1 in every class, so each class visits them last and they suppress nothing the
reference would see; nothing is read back by the host.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from xmodal.models.butd.boxes import descending_order, pairwise_iou, suppresses
from xmodal.models.butd.config import SelectionConfig


class Selection(NamedTuple):
    """The regions chosen among each image's proposals, in the order the reference writes them."""

    keep: Tensor  # (B, K) indices into the proposal slots; K = max_boxes
    count: Tensor  # (B,) how many of the K slots hold a region
    obj_ids: Tensor  # (B, K) int64, 0-based over classes 1..C (class index - 1)
    obj_conf: Tensor  # (B, K)
    attr_ids: Tensor  # (B, K) int64, 0-based over attributes 1..M (attribute index - 1)
    attr_conf: Tensor  # (B, K)


def max_class_confidence(boxes: Tensor, cls_prob: Tensor, ok: Tensor, nms_thresh: float, offset: float = 1.0) -> Tensor:
    """Each proposal's highest class probability among the classes whose NMS keeps it -> (B, N); -1 in empty slots.

    boxes: (B, N, 4) float32, original-image pixels; cls_prob: (B, N, C + 1), column 0 the background;
    ok: (B, N). For every class 1..C the reference runs `cpu_nms` over all the image's boxes scored by
    that class's column; a box's max_conf starts at 0 and takes the class's score wherever the box is
    kept, so a box suppressed in every class stays at 0.

    All classes of all images run together: the boxes are the same for every class, so the overlap
    test is one (N, N) matrix per image, and the greedy pass walks position p of every class's score
    order at once, on suppression masks packed 64 boxes to a word.
    """
    b, n = ok.shape
    if n == 0:
        return torch.zeros((b, 0), dtype=torch.float32, device=boxes.device)
    scores = torch.where(ok[..., None], cls_prob[..., 1:].to(torch.float32), -1.0).transpose(1, 2)  # (B, C, N)
    classes = scores.shape[1]
    overlaps = _pack_bits(suppresses(pairwise_iou(boxes.to(torch.float32), offset), nms_thresh))  # (B, N, words)
    words = overlaps.shape[2]
    order = descending_order(scores).reshape(b * classes, n)  # (B*C, N)
    # per visiting step p, each class's box as: its row of overlaps, its word and bit in the masks
    image = torch.arange(b, device=boxes.device).repeat_interleave(classes)[:, None]  # (B*C, 1)
    rows = (image * n + order).T.contiguous()  # (N, B*C): step-major, so each step reads one row
    word = (order // 64).T.contiguous()
    bit = (order % 64).T.contiguous()
    flat = overlaps.reshape(b * n, words)
    suppressed = torch.zeros((b * classes, words), dtype=torch.int64, device=boxes.device)
    alive_at = torch.empty((n, b * classes), dtype=torch.int64, device=boxes.device)
    for p in range(n):
        w = suppressed.gather(1, word[p][:, None])[:, 0]  # (B*C,) the word holding this step's box
        alive = ((w >> bit[p]) & 1) ^ 1  # 1 where no kept box of this class suppressed it
        alive_at[p] = alive
        # boxes already visited get marked too; harmless, as each box is visited once per class
        suppressed |= flat.index_select(0, rows[p]) & -alive[:, None]
    kept = torch.zeros((b * classes, n), dtype=torch.bool, device=boxes.device)
    kept.scatter_(1, order, alive_at.T.bool())
    kept = kept.reshape(b, classes, n)
    best = torch.where(kept, scores, torch.zeros((), dtype=scores.dtype, device=scores.device)).amax(dim=1)
    return torch.where(ok, best.clamp(min=0), -1.0)  # (B, N)


def _pack_bits(mask: Tensor) -> Tensor:
    """(..., R, N) bool -> (..., R, ceil(N / 64)) int64, bit j % 64 of word j // 64 set where mask[..., j].

    The per-class greedy pass then touches ceil(N / 64) words per step instead of N bools (5 words
    for 300 proposals): the sums add distinct powers of two, so they are bitwise ORs.
    """
    n = mask.shape[-1]
    words = -(-n // 64)
    padded = torch.zeros((*mask.shape[:-1], words * 64), dtype=torch.int64, device=mask.device)
    padded[..., :n] = mask.to(torch.int64)
    bits = torch.arange(64, dtype=torch.int64, device=mask.device)
    return (padded.reshape(*mask.shape[:-1], words, 64) << bits).sum(dim=-1)


def choose_boxes(max_conf: Tensor, ok: Tensor, cfg: SelectionConfig) -> tuple[Tensor, Tensor]:
    """The indices the reference keeps, in its order -> (B, max_boxes) and the count of each image's (B,).

    The boxes with max_conf >= conf_thresh (compared in float64, as the reference's float64 max_conf
    against 0.2), in index order, when there are min_boxes to max_boxes of them; otherwise the first
    min_boxes (too few; fewer where the image has fewer proposals) or max_boxes (too many) of
    `descending_order(max_conf)`, which fills up with boxes under the threshold, best first. So 36
    passing boxes stay in proposal order while 35 or 37 come out by confidence, as in the reference.
    """
    b, n = ok.shape
    idx = torch.arange(n, device=ok.device)
    passing = ok & (max_conf.double() >= cfg.conf_thresh)  # (B, N)
    count = passing.sum(dim=1)
    by_conf = descending_order(max_conf)  # empty slots (-1) last
    by_index = torch.argsort(torch.where(passing, idx, n + idx), dim=1, stable=True)  # the passing ones first
    too_few, too_many = count < cfg.min_boxes, count > cfg.max_boxes
    order = torch.where((too_few | too_many)[:, None], by_conf, by_index)  # (B, N)
    if n < cfg.max_boxes:
        order = torch.cat((order, order.new_zeros((b, cfg.max_boxes - n))), dim=1)
    chosen = torch.where(too_few, torch.clamp(ok.sum(dim=1), max=cfg.min_boxes),
                         torch.where(too_many, torch.full_like(count, cfg.max_boxes), count))
    return order[:, :cfg.max_boxes], chosen


def labels(prob: Tensor) -> tuple[Tensor, Tensor]:
    """argmax and max over columns 1.. of a (..., 1 + M) probability matrix (column 0 is background or no attribute).

    Ids are 0-based over those columns (the reference's `argmax(prob[:, 1:])`); ties go to the
    first, as numpy's argmax and torch's.
    """
    conf, ids = prob[..., 1:].max(dim=-1)
    return ids, conf


def select_regions(boxes: Tensor, cls_prob: Tensor, attr_prob: Tensor, ok: Tensor, cfg: SelectionConfig,
                   offset: float = 1.0) -> Selection:
    """The reference's regions of each image from its proposal slots: boxes (B, N, 4), cls_prob (B, N, C + 1),
    attr_prob (B, N, M + 1), ok (B, N)."""
    b, n = ok.shape
    if n == 0:  # no proposal slot at all: every image gets no region
        z = torch.zeros((b, cfg.max_boxes), dtype=torch.long, device=ok.device)
        return Selection(z, z[:, 0], z, z.float(), z, z.float())
    keep, count = choose_boxes(max_class_confidence(boxes, cls_prob, ok, cfg.nms_thresh, offset), ok, cfg)
    obj_ids, obj_conf = labels(_take(cls_prob, keep))
    attr_ids, attr_conf = labels(_take(attr_prob, keep))
    return Selection(keep, count, obj_ids, obj_conf, attr_ids, attr_conf)


def _take(t: Tensor, index: Tensor) -> Tensor:
    """Rows `index` (B, K) of t (B, N, D) -> (B, K, D)."""
    return t.gather(1, index[..., None].expand(-1, -1, t.shape[-1]))
