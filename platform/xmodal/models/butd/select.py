"""Which proposals become an image's regions, and their object and attribute labels.

Follows `get_detections_from_im` in airsplay/lxmert's `data/mscoco_imgfeat/extract_coco_image.py`
(MIN_BOXES = MAX_BOXES = 36) and in peteanderson80/bottom-up-attention's `tools/generate_tsv.py`
(MIN_BOXES 10, MAX_BOXES 100; the same selection without the labels). The NMS is `cpu_nms`
(`lib/nms/cpu_nms.pyx`) at `TEST.NMS` 0.3 of `lib/fast_rcnn/config.py`.

The regions are the proposals themselves (the box regression output is not used). The caller
passes them in ORIGINAL-image pixels, i.e. the proposal layer's rois divided by the input scale, as
the reference does: the "+1" areas make the NMS depend on the pixel scale.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from xmodal.models.butd.proposals import descending_order, pairwise_iou

CLASS_NMS_THRESH = 0.3
CONF_THRESH = 0.2
OBJ36 = (36, 36)  # LXMERT's (min_boxes, max_boxes)
BOTTOM_UP_DEFAULT = (10, 100)  # tools/generate_tsv.py's


class Regions(NamedTuple):
    keep: Tensor  # (K,) indices into the proposals, in the order the reference writes them
    objects_id: Tensor  # (K,) int64, 0-based over classes 1..1600 (class index - 1)
    objects_conf: Tensor  # (K,)
    attrs_id: Tensor  # (K,) int64, 0-based over attributes 1..400 (attribute index - 1)
    attrs_conf: Tensor  # (K,)


def max_class_confidence(boxes: Tensor, cls_prob: Tensor, nms_thresh: float = CLASS_NMS_THRESH) -> Tensor:
    """Each proposal's highest class probability among the classes whose NMS keeps it -> (N,).

    boxes: (N, 4) float32, original-image pixels; cls_prob: (N, C + 1), column 0 the background.
    For every class 1..C the reference runs `cpu_nms` over all N boxes scored by that class's
    column; a box's max_conf starts at 0 and takes the class's score wherever the box is kept, so a
    box suppressed in every class stays at 0.

    All classes run together: the boxes are the same for every class, so the overlap test
    (IoU >= threshold, float32 IoU against a float64 threshold as in `cpu_nms`) is one (N, N)
    matrix, and the greedy pass walks position p of every class's score order at once, on
    suppression masks packed 64 boxes to a word.
    """
    n = boxes.shape[0]
    scores = cls_prob[:, 1:].to(torch.float32).T  # (C, N)
    if n == 0:
        return torch.zeros(0, dtype=torch.float32)
    overlaps = _pack_bits(pairwise_iou(boxes.to(torch.float32)).double() >= nms_thresh)  # (N, words)
    order = descending_order(scores)  # (C, N)
    classes = torch.arange(scores.shape[0])
    suppressed = torch.zeros((scores.shape[0], overlaps.shape[1]), dtype=torch.int64)  # (C, words)
    kept = torch.zeros(scores.shape, dtype=torch.bool)  # (C, N)
    for p in range(n):
        box = order[:, p]  # (C,) the box each class visits now
        word = suppressed.gather(1, (box // 64)[:, None])[:, 0]  # (C,)
        alive = ((word >> (box % 64)) & 1) == 0  # (C,)
        kept[classes, box] = alive
        # boxes already visited get marked too; harmless, as each box is visited once per class
        suppressed |= overlaps.index_select(0, box) & -alive.to(torch.int64)[:, None]
    return torch.where(kept, scores, torch.zeros((), dtype=scores.dtype)).amax(dim=0).clamp(min=0)  # (N,)


def _pack_bits(mask: Tensor) -> Tensor:
    """(R, N) bool -> (R, ceil(N / 64)) int64, bit j % 64 of word j // 64 set where mask[:, j].

    The per-class greedy pass then touches C x ceil(N / 64) words per step instead of C x N bools
    (5 words for 300 proposals): the sums add distinct powers of two, so they are bitwise ORs.
    """
    rows, n = mask.shape
    words = -(-n // 64)
    padded = torch.zeros((rows, words * 64), dtype=torch.int64)
    padded[:, :n] = mask.to(torch.int64)
    return (padded.reshape(rows, words, 64) << torch.arange(64, dtype=torch.int64)).sum(dim=2)


def choose_boxes(max_conf: Tensor, min_boxes: int, max_boxes: int, conf_thresh: float = CONF_THRESH) -> Tensor:
    """The indices the reference keeps, in its order -> (K,).

    The boxes with max_conf >= conf_thresh (compared in float64, as the reference's float64
    max_conf against 0.2), in index order, when there are min_boxes to max_boxes of them;
    otherwise the first min_boxes (too few) or max_boxes (too many) of `descending_order(max_conf)`,
    which fills up with boxes under the threshold, best first. So 36 passing boxes stay in proposal
    order while 35 or 37 come out by confidence, as in the reference.
    """
    passing = torch.nonzero(max_conf.double() >= conf_thresh).flatten()
    if passing.numel() < min_boxes:
        return descending_order(max_conf)[:min_boxes]
    if passing.numel() > max_boxes:
        return descending_order(max_conf)[:max_boxes]
    return passing


def labels(prob: Tensor) -> tuple[Tensor, Tensor]:
    """argmax and max over columns 1.. of a (K, 1 + M) probability matrix (column 0 is background or no attribute).

    Ids are 0-based over those columns (the reference's `argmax(prob[:, 1:])`); ties go to the
    first, as numpy's argmax and torch's.
    """
    conf, ids = prob[:, 1:].max(dim=1)
    return ids, conf


def select_regions(
    boxes: Tensor,
    cls_prob: Tensor,
    attr_prob: Tensor,
    boxes_range: tuple[int, int] = OBJ36,
    *,
    conf_thresh: float = CONF_THRESH,
    nms_thresh: float = CLASS_NMS_THRESH,
) -> Regions:
    """The reference's regions of one image from its proposals (N, 4), cls_prob (N, 1601) and attr_prob (N, 401).

    boxes_range is (min_boxes, max_boxes): OBJ36 for LXMERT's features, BOTTOM_UP_DEFAULT for
    the bottom-up-attention default.
    """
    keep = choose_boxes(max_class_confidence(boxes, cls_prob, nms_thresh), *boxes_range, conf_thresh=conf_thresh)
    objects_id, objects_conf = labels(cls_prob[keep])
    attrs_id, attrs_conf = labels(attr_prob[keep])
    return Regions(keep, objects_id, objects_conf, attrs_id, attrs_conf)
