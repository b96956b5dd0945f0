"""ResNet-101 C4 with Caffe's frozen BatchNorm: the backbone (conv1 .. res4b22) and the blocks res5 reuses.

The network of `models/vg/ResNet-101/faster_rcnn_end2end_final/test.prototxt` (peteanderson80/
bottom-up-attention). Each of its 104 BatchNorm layers sets `use_global_stats: true` and no `eps`
(the proto default 1e-5, `BackboneConfig.bn_eps`) and is followed by a `Scale` layer with a bias;
the convolutions before them have no bias. `FrozenBatchNorm` is that pair as buffers, in Caffe's
order of operations (`BatchNormLayer::Forward_cpu`, `ScaleLayer::Forward_cpu`); `fold_batch_norm`
folds it into the convolution before it (faster; equal up to float32 rounding, not bit for bit).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from xmodal.models.butd.config import BackboneConfig


class FrozenBatchNorm(nn.Module):
    """Caffe's BatchNorm (global stats) + Scale as buffers: ((x - mean) / sqrt(var + eps)) * weight + bias.

    mean and var are the BatchNorm blobs already divided by their moving-average factor.
    """

    def __init__(self, channels: int, eps: float = BackboneConfig.bn_eps):
        super().__init__()
        self.eps = eps
        for name, value in (("weight", 1.0), ("bias", 0.0), ("running_mean", 0.0), ("running_var", 1.0)):
            self.register_buffer(name, torch.full((channels,), value))

    def forward(self, x: Tensor) -> Tensor:  # (N, C, H, W)
        std = torch.sqrt(self.running_var + self.eps)[:, None, None]
        return (x - self.running_mean[:, None, None]) / std * self.weight[:, None, None] + self.bias[:, None, None]


class Bottleneck(nn.Module):
    """A Caffe ResNet bottleneck: 1x1 (the stage's stride) -> 3x3 (dilation) -> 1x1, + shortcut, ReLU.

    The stride sits in the first 1x1 convolution and the shortcut (`res3a_branch2a`, `res3a_branch1`
    stride 2), not in the 3x3 as in torchvision's ResNet.
    """

    def __init__(self, c_in: int, width: int, c_out: int, stride: int, dilation: int, shortcut: bool, eps: float):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, width, 1, stride=stride, bias=False)
        self.bn1 = FrozenBatchNorm(width, eps)
        self.conv2 = nn.Conv2d(width, width, 3, padding=dilation, dilation=dilation, bias=False)
        self.bn2 = FrozenBatchNorm(width, eps)
        self.conv3 = nn.Conv2d(width, c_out, 1, bias=False)
        self.bn3 = FrozenBatchNorm(c_out, eps)
        self.shortcut = nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False) if shortcut else None
        self.shortcut_bn = FrozenBatchNorm(c_out, eps) if shortcut else None

    def forward(self, x: Tensor) -> Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        y = F.relu(self.bn2(self.conv2(y)))
        y = self.bn3(self.conv3(y))
        skip = x if self.shortcut is None else self.shortcut_bn(self.shortcut(x))  # type: ignore[misc]
        return F.relu(y + skip)  # the Eltwise sum, then ReLU


def stage(cfg: BackboneConfig, index: int, blocks: int, stride: int, dilation: int = 1) -> nn.Sequential:
    """res{index} (2..5): `blocks` bottlenecks, the first with the stride and the projection shortcut."""
    c_in = cfg.stem_width if index == 2 else cfg.stage_out(index - 1)
    width, c_out = cfg.width * 2 ** (index - 2), cfg.stage_out(index)
    return nn.Sequential(*(Bottleneck(c_in if i == 0 else c_out, width, c_out, stride if i == 0 else 1, dilation,
                                      shortcut=i == 0, eps=cfg.bn_eps) for i in range(blocks)))


class Stem(nn.Module):
    """conv1 7x7 stride 2 pad 3, BatchNorm + Scale, ReLU, pool1 3x3 stride 2 pad 0 with Caffe's ceil rounding."""

    def __init__(self, width: int, eps: float):
        super().__init__()
        self.conv = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn = FrozenBatchNorm(width, eps)

    def forward(self, x: Tensor) -> Tensor:  # (N, 3, H, W) -> (N, C, ceil((H' - 3) / 2) + 1, ...)
        return F.max_pool2d(F.relu(self.bn(self.conv(x))), 3, stride=2, padding=0, ceil_mode=True)


class Backbone(nn.Module):
    """conv1 .. res4b22: (N, 3, H, W) -> (N, 1024, ~H/16, ~W/16)."""

    def __init__(self, cfg: BackboneConfig):
        super().__init__()
        self.stem = Stem(cfg.stem_width, cfg.bn_eps)
        self.res2 = stage(cfg, 2, cfg.blocks[0], stride=1)
        self.res3 = stage(cfg, 3, cfg.blocks[1], stride=2)
        self.res4 = stage(cfg, 4, cfg.blocks[2], stride=2)

    def forward(self, x: Tensor) -> Tensor:
        return self.res4(self.res3(self.res2(self.stem(x))))


def fold_into_conv(weight: Tensor, bias: Tensor | None, scale: Tensor, shift: Tensor) -> tuple[Tensor, Tensor]:
    """A convolution (O, I, kh, kw) [+ bias (O,)] followed by a per-channel (scale, shift), as one convolution.

    weight' = weight * scale per output channel; bias' = bias * scale + shift (shift alone where the
    convolution has no bias, as the reference's do). Float64 inside, float32 out.
    """
    scale64 = scale.to(torch.float64)
    new_weight = weight.to(torch.float64) * scale64[:, None, None, None]  # (O, I, kh, kw)
    new_bias = shift.to(torch.float64) if bias is None else bias.to(torch.float64) * scale64 + shift.to(torch.float64)
    return new_weight.to(torch.float32), new_bias.to(torch.float32)


@torch.no_grad()
def fold_batch_norm(model: nn.Module) -> nn.Module:
    """Fold every frozen BatchNorm + Scale of `model` into the convolution before it, in place.

    scale = gamma / sqrt(var + eps) and shift = beta - mean * scale in float64, rounded once; equal
    to the unfolded network up to float32 rounding (the pair rounds after each of its operations).
    """
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            bn = getattr(module, _bn_name(name), None)
            if isinstance(child, nn.Conv2d) and isinstance(bn, FrozenBatchNorm):
                scale64 = bn.weight.double() / torch.sqrt(bn.running_var.double() + bn.eps)
                scale, shift = scale64.float(), (bn.bias.double() - bn.running_mean.double() * scale64).float()
                weight, bias = fold_into_conv(child.weight, child.bias, scale, shift)
                conv = nn.Conv2d(child.in_channels, child.out_channels, child.kernel_size, child.stride,
                                 child.padding, child.dilation, bias=True).to(child.weight.device)
                conv.weight.copy_(weight)
                conv.bias.copy_(bias)  # type: ignore[union-attr]
                setattr(module, name, conv)
                setattr(module, _bn_name(name), nn.Identity())
    return model


def _bn_name(conv_name: str) -> str:
    """The BatchNorm that follows a convolution: conv -> bn, conv1 -> bn1, shortcut -> shortcut_bn."""
    return {"conv": "bn", "shortcut": "shortcut_bn"}.get(conv_name, conv_name.replace("conv", "bn"))
