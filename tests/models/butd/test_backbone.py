"""Caffe's frozen BatchNorm + Scale and their folding, on hand-computed numbers and against the reference's order.

The variance blobs are chosen so that var + eps is a perfect square: blob1 / blob2 = v - 1e-5.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from reference_ops import caffe_batch_norm, caffe_scale, global_stats

from xmodal.models.butd.backbone import FrozenBatchNorm, fold_batch_norm, fold_into_conv
from xmodal.models.butd.config import BackboneConfig


def t(values):
    return torch.tensor(values, dtype=torch.float32)


# two channels, moving-average factor 2:
# channel 0: mean 2 / 2 = 1, var 7.99998 / 2 = 3.99999, + 1e-5 = 4 -> std 2; gamma 3, beta 0.5
# channel 1: mean -1 / 2 = -0.5, var 0.49998 / 2 = 0.24999, + 1e-5 = 0.25 -> std 0.5; gamma -0.5, beta 1
MEAN, VAR, FACTOR = t([2.0, -1.0]), t([7.99998, 0.49998]), t([2.0])
GAMMA, BETA = t([3.0, -0.5]), t([0.5, 1.0])


def close(got, want):
    return torch.allclose(got, t(want), rtol=1e-5, atol=1e-5)


def frozen() -> FrozenBatchNorm:
    bn = FrozenBatchNorm(2)
    mean, var = global_stats(MEAN, VAR, FACTOR)
    bn.running_mean.copy_(mean), bn.running_var.copy_(var), bn.weight.copy_(GAMMA), bn.bias.copy_(BETA)
    return bn


def test_eps_is_caffes_proto_default():
    assert BackboneConfig().bn_eps == 1e-5 and FrozenBatchNorm(1).eps == 1e-5


def test_zero_factor_zeroes_the_stats_as_caffe_does():
    # blob2 == 0 -> scale factor 0: mean 0, var 0, y = x / sqrt(1e-5) = x x 316.227766...
    mean, var = global_stats(t([5.0]), t([9.0]), t([0.0]))
    assert mean.tolist() == [0.0] and var.tolist() == [0.0]
    y = caffe_batch_norm(t([[[[0.01, -2.0]]]]), t([5.0]), t([9.0]), t([0.0]))
    assert close(y, [[[[3.1622777, -632.45553]]]])
    bn = FrozenBatchNorm(1)
    bn.running_var.zero_()
    assert close(bn(t([[[[0.01, -2.0]]]])), [[[[0.01 / math.sqrt(1e-5), -2.0 / math.sqrt(1e-5)]]]])


def test_frozen_batch_norm_is_batch_norm_then_scale_in_caffes_order():
    x = t([[[[-1.0, 3.0]], [[1.5, -0.5]]]])  # (1, 2, 1, 2)
    # channel 0: (-1 - 1) / 2 = -1, (3 - 1) / 2 = 1; x 3 + 0.5 -> -2.5, 3.5
    # channel 1: (1.5 + 0.5) / 0.5 = 4, (-0.5 + 0.5) / 0.5 = 0; x -0.5 + 1 -> -1, 1
    assert close(frozen()(x), [[[[-2.5, 3.5]], [[-1.0, 1.0]]]])
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 2, 5, 4, generator=g)
    expected = caffe_scale(caffe_batch_norm(x, MEAN, VAR, FACTOR), GAMMA, BETA)
    assert torch.equal(frozen()(x), expected)  # the same operations in the same order, bit for bit


def test_folded_conv_equals_conv_batch_norm_scale():
    # input (1, 1, 1, 2) = [1, 2]; a 1 x 2 convolution without bias, two output channels:
    # w0 = [1, -1] -> -1; w1 = [0.5, 0.5] -> 1.5
    # BN + Scale: channel 0: (-1 - 1) / 2 x 3 + 0.5 = -2.5; channel 1: (1.5 + 0.5) / 0.5 x -0.5 + 1 = -1
    # folded: scale = gamma / std = 1.5, -1; shift = beta - mean x scale = -1, 0.5
    x = t([[[[1.0, 2.0]]]])
    weight = t([[[[1.0, -1.0]]], [[[0.5, 0.5]]]])  # (2, 1, 1, 2)
    pair = torch.nn.Module()
    pair.conv = torch.nn.Conv2d(1, 2, (1, 2), bias=False)
    pair.bn = frozen()
    with torch.no_grad():
        pair.conv.weight.copy_(weight)
    assert close(pair.bn(pair.conv(x)), [[[[-2.5]], [[-1.0]]]])
    fold_batch_norm(pair)
    assert isinstance(pair.bn, torch.nn.Identity)
    assert close(pair.conv.weight, [[[[1.5, -1.5]]], [[[-0.5, -0.5]]]]) and close(pair.conv.bias, [-1.0, 0.5])
    assert close(pair.conv(x), [[[[-2.5]], [[-1.0]]]])


def test_folding_keeps_an_existing_conv_bias():
    # bias [2, -4]: bias x scale + shift = 2 x 1.5 - 1 = 2, -4 x -1 + 0.5 = 4.5
    weight = t([[[[1.0]]], [[[1.0]]]])
    _, new_bias = fold_into_conv(weight, t([2.0, -4.0]), t([1.5, -1.0]), t([-1.0, 0.5]))
    assert new_bias.tolist() == [2.0, 4.5]
    assert F.conv2d(t([[[[1.0]]]]), *fold_into_conv(weight, None, t([1.5, -1.0]), t([-1.0, 0.5]))).flatten().tolist() == [0.5, -0.5]
