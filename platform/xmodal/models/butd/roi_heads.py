"""The RoI heads: ROI pooling, res5, the class, box and attribute heads, and the selection of the regions.

The prototxt's (`models/vg/ResNet-101/faster_rcnn_end2end_final/test.prototxt`) `roi_pool5` (`roi_pool`),
`res5a` .. `res5c`, `pool5`, `cls_score`, `bbox_pred`, `cls_embedding`, `fc_attr`, `attr_score`, then
`get_detections_from_im` (airsplay/lxmert's `extract_coco_image.py`): which proposals become an image's
regions (`select`). `RoIHeads.forward` takes the proposal layer's proposals; `forward_with_given_boxes`
takes boxes that came with the images (the reference's `im_detect(net, im, boxes)`), with no selection.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from xmodal.models.butd.backbone import stage
from xmodal.models.butd.config import DetectorConfig
from xmodal.models.butd.roi_pool import roi_pool_batch
from xmodal.models.butd.select import labels, select_regions
from xmodal.models.butd.structures import ImageBatch, Pass, Proposals, RegionBatch


class RoIHeads(nn.Module):
    """ROI pooling, res5 over the pooled regions, the average pool, the heads, and the selection."""

    def __init__(self, cfg: DetectorConfig):
        super().__init__()
        self.cfg = cfg
        d, h = cfg.feature_dim, cfg.roi_head
        # `res5a` stride 1 (the reference's 14 x 14 regions stay 14 x 14), 3x3 convolutions dilation 2 pad 2
        self.res5 = stage(cfg.backbone, 5, h.res5_blocks, stride=1, dilation=2)
        self.cls_score = nn.Linear(d, h.num_classes + 1)
        self.bbox_pred = nn.Linear(d, 4 * (h.num_classes + 1))
        self.cls_embedding = nn.Embedding(h.num_classes + 1, h.class_embed)
        self.fc_attr = nn.Linear(d + h.class_embed, h.attr_hidden)
        self.attr_score = nn.Linear(h.attr_hidden, h.num_attributes + 1)

    def forward(self, batch: ImageBatch, features: list[Tensor], proposals: Proposals, run: Pass) -> RegionBatch:
        """The regions the reference keeps among each image's proposals (36, or the config's range)."""
        boxes, pool5, cls_prob, attr_prob = self._score(batch, features, proposals.rois, run)
        sel = select_regions(boxes, cls_prob, attr_prob, proposals.ok, self.cfg.selection, self.cfg.box_offset)
        out = RegionBatch.padded(batch, sel.count, _take(boxes, sel.keep), _take(pool5, sel.keep),
                                 (sel.obj_ids, sel.obj_conf, sel.attr_ids, sel.attr_conf), proposals.certified)
        run.clock.lap("select")
        return out

    def forward_with_given_boxes(self, batch: ImageBatch, features: list[Tensor], boxes: Sequence[Tensor],
                                 run: Pass) -> RegionBatch:
        """The features of given boxes (per image (K, 4) in original-image pixels), in their order, with no
        selection; their labels are still the heads' argmax. K slots per image, K the most boxes an image has."""
        dev = run.device
        n, slots = len(batch.images), max([g.shape[0] for g in boxes], default=0)
        rois = torch.zeros((n, slots, 4), dtype=torch.float32, device=dev)  # input pixels
        count = torch.tensor([g.shape[0] for g in boxes], dtype=torch.int64).to(dev)
        for i, g in enumerate(boxes):  # `_project_im_rois`: boxes times the scale (float64 in numpy), then the float32 blob
            rois[i, :g.shape[0]] = (g.to(dev).to(torch.float64) * batch.images[i].scale).to(torch.float32)
        _, pool5, cls_prob, attr_prob = self._score(batch, features, rois, run)
        given = torch.stack([torch.cat((g.to(dev, torch.float32), rois.new_zeros((slots - g.shape[0], 4))))
                             for g in boxes]) if n else rois
        out = RegionBatch.padded(batch, count, given, pool5, (*labels(cls_prob), *labels(attr_prob)),
                                 torch.ones(n, dtype=torch.bool, device=dev))
        run.clock.lap("select")
        return out

    def predict(self, pooled: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """res5 and the heads: (R, 1024, 14, 14) -> pool5 (R, 2048), cls_prob (R, 1601), attr_prob (R, 401), all float32."""
        pool5 = self.res5(pooled).mean(dim=(2, 3)).float()  # `pool5`: global AVE pooling; `pool5_flat`
        cls_score = self.cls_score(pool5)  # (R, 1601)
        # `predicted_cls`: Caffe's ArgMax over cls_score; on a tie it takes the HIGHER index (its
        # partial sort compares (value, index) pairs), where torch's argmax would take the lower one
        predicted = cls_score.shape[1] - 1 - cls_score.flip(1).argmax(dim=1)  # (R,)
        concat = torch.cat((pool5, self.cls_embedding(predicted)), dim=1)  # `concat_pool5`: pool5 then embedding
        attr_score = self.attr_score(F.relu(self.fc_attr(concat)))  # (R, 401)
        return pool5, torch.softmax(cls_score.float(), dim=1), torch.softmax(attr_score.float(), dim=1)

    def _score(self, batch: ImageBatch, features: list[Tensor], rois: Tensor,
               run: Pass) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Every slot of `rois` (B, S, 4), input pixels, pooled from its image's features and through res5 and
        the heads -> boxes (B, S, 4) in original-image pixels, pool5 (B, S, D), cls_prob, attr_prob (B, S, .)."""
        n, slots = rois.shape[:2]
        pooled = [torch.empty(0)] * n
        for group, f in zip(batch.groups, features, strict=True):
            by_image = roi_pool_batch(f.float(), rois[torch.tensor(group, device=run.device)],
                                      self.cfg.roi_head.pooled_size, self.cfg.roi_head.spatial_scale)  # (G, S, C, P, P)
            for j, i in enumerate(group):
                pooled[i] = by_image[j]
        run.clock.lap("roi_pool")
        pool5, cls_prob, attr_prob = self._predict_in_chunks(torch.cat(pooled), run)  # (n * slots, ...)
        run.clock.lap("head")
        run.clock.count("regions", n * slots)
        # `cls_boxes = rois[:, 1:5] / im_scales[0]`: float32 rois over the scale, in float32
        boxes = rois / batch.scales().to(run.device)[:, None, None]
        return (boxes, *(t.reshape(n, slots, t.shape[1]) for t in (pool5, cls_prob, attr_prob)))  # type: ignore[return-value]

    def _predict_in_chunks(self, pooled: Tensor, run: Pass) -> tuple[Tensor, Tensor, Tensor]:
        """`predict` over (R, C, 14, 14) pooled regions, `region_batch` at a time."""
        outs = []
        for chunk in pooled.split(max(1, self.cfg.roi_head.region_batch)):
            with run.autocast():
                outs.append(self.predict(chunk))
        if not outs:
            z = pooled.new_zeros
            return z((0, self.cfg.feature_dim)), z((0, self.cfg.num_classes + 1)), z((0, self.cfg.num_attributes + 1))
        return tuple(torch.cat(parts).float() for parts in zip(*outs, strict=True))  # type: ignore[return-value]


def _take(t: Tensor, keep: Tensor) -> Tensor:
    """Rows `keep` (B, K) of t (B, N, D) -> (B, K, D)."""
    return t.gather(1, keep[..., None].expand(-1, -1, t.shape[2]))
