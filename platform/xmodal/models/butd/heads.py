"""The RPN head and the RoI head of the prototxt (`models/vg/ResNet-101/faster_rcnn_end2end_final/test.prototxt`)."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from xmodal.models.butd.backbone import stage
from xmodal.models.butd.config import DetectorConfig


class RPN(nn.Module):
    """`rpn_conv/3x3` + ReLU, `rpn_cls_score` (2A: background logits of the A anchors, then foreground), `rpn_bbox_pred` (4A)."""

    def __init__(self, cfg: DetectorConfig):
        super().__init__()
        a = cfg.rpn.num_anchors
        self.conv = nn.Conv2d(cfg.backbone.stage_out(4), cfg.rpn.channels, 3, padding=1)
        self.objectness = nn.Conv2d(cfg.rpn.channels, 2 * a, 1)
        self.deltas = nn.Conv2d(cfg.rpn.channels, 4 * a, 1)

    def forward(self, features: Tensor) -> tuple[Tensor, Tensor]:
        """(B, C, H, W) -> rpn_cls_prob (B, 2A, H, W), rpn_bbox_pred (B, 4A, H, W)."""
        h = F.relu(self.conv(features))
        score = self.objectness(h)  # (B, 2A, H, W)
        n, two_a, height, width = score.shape
        # `rpn_cls_score_reshape` (B, 2, A*H, W), softmax over the 2, `rpn_cls_prob_reshape` back to (B, 2A, H, W)
        prob = torch.softmax(score.reshape(n, 2, two_a // 2 * height, width), dim=1).reshape(n, two_a, height, width)
        return prob, self.deltas(h)


class RoIHead(nn.Module):
    """res5 over pooled regions, the average pool, and the class, box and attribute heads."""

    def __init__(self, cfg: DetectorConfig):
        super().__init__()
        d, h = cfg.feature_dim, cfg.roi_head
        # `res5a` stride 1 (the reference's 14 x 14 regions stay 14 x 14), 3x3 convolutions dilation 2 pad 2
        self.res5 = stage(cfg.backbone, 5, h.res5_blocks, stride=1, dilation=2)
        self.cls_score = nn.Linear(d, h.num_classes + 1)
        self.bbox_pred = nn.Linear(d, 4 * (h.num_classes + 1))
        self.cls_embedding = nn.Embedding(h.num_classes + 1, h.class_embed)
        self.fc_attr = nn.Linear(d + h.class_embed, h.attr_hidden)
        self.attr_score = nn.Linear(h.attr_hidden, h.num_attributes + 1)

    def forward(self, pooled: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """(R, 1024, 14, 14) -> pool5 (R, 2048), cls_prob (R, 1601), attr_prob (R, 401), all float32."""
        pool5 = self.res5(pooled).mean(dim=(2, 3)).float()  # `pool5`: global AVE pooling; `pool5_flat`
        cls_score = self.cls_score(pool5)  # (R, 1601)
        # `predicted_cls`: Caffe's ArgMax over cls_score; on a tie it takes the HIGHER index (its
        # partial sort compares (value, index) pairs), where torch's argmax would take the lower one
        predicted = cls_score.shape[1] - 1 - cls_score.flip(1).argmax(dim=1)  # (R,)
        concat = torch.cat((pool5, self.cls_embedding(predicted)), dim=1)  # `concat_pool5`: pool5 then embedding
        attr_score = self.attr_score(F.relu(self.fc_attr(concat)))  # (R, 401)
        return pool5, torch.softmax(cls_score.float(), dim=1), torch.softmax(attr_score.float(), dim=1)
