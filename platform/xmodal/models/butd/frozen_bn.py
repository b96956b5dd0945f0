"""Caffe's frozen BatchNorm + Scale pair of the reference's ResNet-101, and its folding for inference.

Follows `BatchNormLayer::Forward_cpu` (`use_global_stats_` branch) in
`caffe/src/caffe/layers/batch_norm_layer.cpp`, `ScaleLayer::Forward_cpu` in `scale_layer.cpp` and
`BatchNormParameter` in `caffe/src/caffe/proto/caffe.proto` of peteanderson80/bottom-up-attention.
In `models/vg/ResNet-101/faster_rcnn_end2end_final/test.prototxt` each of the 104 BatchNorm layers
sets `use_global_stats: true` and no `eps`, so the proto default 1e-5 applies; each is followed by a
`Scale` layer with `bias_term: true`, and the convolutions before them have `bias_term: false`.

Caffe's BatchNorm keeps three blobs: a mean and a variance, both multiplied by a moving-average
factor, and that factor (one value). At test time it uses mean = blob0 * s and var = blob1 * s with
s = 0 if blob2 == 0 else 1 / blob2, then y = (x - mean) / sqrt(var + eps); Scale then gives
y * gamma + beta. All float32.
"""

from __future__ import annotations

import torch
from torch import Tensor

BN_EPS = 1e-5


def global_stats(mean_blob: Tensor, var_blob: Tensor, factor_blob: Tensor) -> tuple[Tensor, Tensor]:
    """(mean, var), both (C,) float32, from Caffe's three BatchNorm blobs (C,), (C,), (1,)."""
    factor = factor_blob.to(torch.float32).reshape(-1)[0]
    scale = torch.zeros_like(factor) if factor == 0 else 1 / factor  # float32, as Caffe's Dtype
    return mean_blob.to(torch.float32) * scale, var_blob.to(torch.float32) * scale


def caffe_batch_norm(
    x: Tensor, mean_blob: Tensor, var_blob: Tensor, factor_blob: Tensor, eps: float = BN_EPS
) -> Tensor:
    """Caffe's BatchNorm with `use_global_stats` on `x` (N, C, H, W) -> (N, C, H, W) float32."""
    mean, var = global_stats(mean_blob, var_blob, factor_blob)
    std = torch.sqrt(var + torch.tensor(eps, dtype=torch.float32))  # (C,)
    return (x.to(torch.float32) - mean[:, None, None]) / std[:, None, None]


def caffe_scale(x: Tensor, gamma: Tensor, beta: Tensor) -> Tensor:
    """Caffe's Scale with a bias term: x * gamma + beta per channel of `x` (N, C, H, W)."""
    return x * gamma.to(torch.float32)[:, None, None] + beta.to(torch.float32)[:, None, None]


def fold_batch_norm_scale(
    mean_blob: Tensor,
    var_blob: Tensor,
    factor_blob: Tensor,
    gamma: Tensor,
    beta: Tensor,
    eps: float = BN_EPS,
) -> tuple[Tensor, Tensor]:
    """BatchNorm then Scale as one per-channel affine map: (scale, shift), both (C,) float32.

    scale = gamma / sqrt(var + eps) and shift = beta - mean * scale, computed in float64 and
    rounded once. The folded map equals the pair up to float32 rounding, not bit for bit (the pair
    rounds after the subtraction, the division, the product and the sum).
    """
    mean, var = global_stats(mean_blob, var_blob, factor_blob)
    mean, var = mean.to(torch.float64), var.to(torch.float64)
    scale = gamma.to(torch.float64) / torch.sqrt(var + torch.tensor(eps, dtype=torch.float32).to(torch.float64))
    shift = beta.to(torch.float64) - mean * scale
    return scale.to(torch.float32), shift.to(torch.float32)


def fold_into_conv(weight: Tensor, bias: Tensor | None, scale: Tensor, shift: Tensor) -> tuple[Tensor, Tensor]:
    """A convolution (O, I, kh, kw) [+ bias (O,)] followed by a per-channel (scale, shift), as one convolution.

    weight' = weight * scale per output channel; bias' = bias * scale + shift (shift alone where the
    convolution has no bias, as the reference's do). Float64 inside, float32 out.
    """
    scale64 = scale.to(torch.float64)
    new_weight = weight.to(torch.float64) * scale64[:, None, None, None]  # (O, I, kh, kw)
    new_bias = shift.to(torch.float64) if bias is None else bias.to(torch.float64) * scale64 + shift.to(torch.float64)
    return new_weight.to(torch.float32), new_bias.to(torch.float32)
