"""The reference's operations written as plainly as the reference writes them: oracles for the tests.

Loops over boxes and bins in Python with numpy's float32 scalars, following
peteanderson80/bottom-up-attention line by line: `lib/nms/cpu_nms.pyx` (`cpu_nms`),
`caffe/src/caffe/layers/roi_pooling_layer.cpp` (`ROIPoolingLayer::Forward_cpu`),
`batch_norm_layer.cpp` / `scale_layer.cpp` (BatchNorm with global stats, then Scale). Slow on purpose:
the product's batched, device-side versions are checked against these on many cases.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor


def cpu_nms(dets: np.ndarray, thresh: float) -> list[int]:
    """`cpu_nms(dets, thresh)`: dets (N, 5) float32 (x1, y1, x2, y2, score) -> kept indices, best first."""
    x1, y1, x2, y2, scores = (dets[:, i] for i in range(5))
    areas = (x2 - x1 + np.float32(1)) * (y2 - y1 + np.float32(1))
    order = scores.argsort(kind="stable")[::-1]  # the reference's argsort()[::-1], stable: ties later-first
    suppressed = np.zeros(len(dets), dtype=bool)
    keep = []
    for _i in range(len(dets)):
        i = order[_i]
        if suppressed[i]:
            continue
        keep.append(int(i))
        ix1, iy1, ix2, iy2, iarea = x1[i], y1[i], x2[i], y2[i], areas[i]
        for _j in range(_i + 1, len(dets)):
            j = order[_j]
            if suppressed[j]:
                continue
            w = max(np.float32(0.0), min(ix2, x2[j]) - max(ix1, x1[j]) + np.float32(1))
            h = max(np.float32(0.0), min(iy2, y2[j]) - max(iy1, y1[j]) + np.float32(1))
            inter = np.float32(w * h)
            ovr = np.float32(inter / (iarea + areas[j] - inter))
            if float(ovr) >= thresh:
                suppressed[j] = True
    return keep


def nms(boxes: Tensor, scores: Tensor, thresh: float, max_keep: int | None = None) -> list[int]:
    keep = cpu_nms(np.concatenate([boxes.numpy(), scores.numpy()[:, None]], axis=1).astype(np.float32), thresh)
    return keep if max_keep is None else keep[:max_keep]


def roi_pool(features: Tensor, rois: Tensor, pooled: int, spatial_scale: float) -> Tensor:
    """`ROIPoolingLayer::Forward_cpu` of one image: features (C, H, W), rois (R, 4) -> (R, C, pooled, pooled)."""
    f = features.numpy()
    channels, height, width = f.shape
    out = np.zeros((rois.shape[0], channels, pooled, pooled), dtype=np.float32)
    scale = np.float32(spatial_scale)
    for r, roi in enumerate(rois.numpy().astype(np.float32)):
        start_w, start_h, end_w, end_h = (int(math.copysign(math.floor(abs(float(v * scale)) + 0.5), float(v * scale)))
                                          for v in roi)
        roi_h, roi_w = max(end_h - start_h + 1, 1), max(end_w - start_w + 1, 1)
        bin_h, bin_w = np.float32(roi_h) / np.float32(pooled), np.float32(roi_w) / np.float32(pooled)
        for ph in range(pooled):
            hstart = min(max(int(math.floor(np.float32(ph) * bin_h)) + start_h, 0), height)
            hend = min(max(int(math.ceil(np.float32(ph + 1) * bin_h)) + start_h, 0), height)
            for pw in range(pooled):
                wstart = min(max(int(math.floor(np.float32(pw) * bin_w)) + start_w, 0), width)
                wend = min(max(int(math.ceil(np.float32(pw + 1) * bin_w)) + start_w, 0), width)
                if hend <= hstart or wend <= wstart:
                    continue  # an empty bin pools 0
                out[r, :, ph, pw] = np.maximum(f[:, hstart:hend, wstart:wend].max(axis=(1, 2)), -np.finfo(np.float32).max)
    return torch.from_numpy(out)


def global_stats(mean_blob: Tensor, var_blob: Tensor, factor_blob: Tensor) -> tuple[Tensor, Tensor]:
    """(mean, var) float32 from Caffe's three BatchNorm blobs: blobs times 1 / factor (0 where factor is 0)."""
    factor = factor_blob.to(torch.float32).reshape(-1)[0]
    scale = torch.zeros_like(factor) if factor == 0 else 1 / factor
    return mean_blob.to(torch.float32) * scale, var_blob.to(torch.float32) * scale


def caffe_batch_norm(x: Tensor, mean_blob: Tensor, var_blob: Tensor, factor_blob: Tensor, eps: float = 1e-5) -> Tensor:
    mean, var = global_stats(mean_blob, var_blob, factor_blob)
    std = torch.sqrt(var + torch.tensor(eps, dtype=torch.float32))
    return (x.to(torch.float32) - mean[:, None, None]) / std[:, None, None]


def caffe_scale(x: Tensor, gamma: Tensor, beta: Tensor) -> Tensor:
    return x * gamma.to(torch.float32)[:, None, None] + beta.to(torch.float32)[:, None, None]
