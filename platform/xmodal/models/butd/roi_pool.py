"""Caffe's ROIPooling (`caffe/src/caffe/layers/roi_pooling_layer.cpp` of peteanderson80/bottom-up-attention), on any device.

The reference's `roi_pool5` layer: 14 x 14 bins at spatial scale 1/16 of the res4b22 map
(`config.RoIHeadConfig`). Its arithmetic, which this module keeps:
- a RoI's corners are `round(x * spatial_scale)` in float32 (C's `round`: half away from zero);
- its size is max(end - start + 1, 1) cells, so an inverted RoI pools a single cell;
- bin (ph, pw) covers rows [floor(ph * bin_h), ceil((ph + 1) * bin_h)) shifted by the RoI's
  start and clipped to [0, H] (columns alike), with bin_h = roi_h / pooled_h in float32; bins may
  overlap by a row or column;
- a bin left empty by the clipping pools 0; any other bin pools its maximum (Caffe starts from
  -FLT_MAX, so a bin of -inf alone pools -FLT_MAX; Caffe's `>` skips NaN, `amax` here does not).

A bin's maximum over its [top, bottom) x [left, right) cells is the maximum of four blocks of
2^a x 2^b cells that cover it (a = floor(log2(rows)), b likewise; the blocks may overlap, which a
maximum does not mind). The blocks' maxima are a table over the map, one (H, W, C) slice per
(a, b), built once per image; each bin is then four row lookups. The table's depth comes from the
map's size alone (`levels`), never from the RoIs' values, so nothing is read back by the host.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

_FLT_MAX = 3.4028234663852886e38


def _c_round(x: Tensor) -> Tensor:
    """C's `round` of float32 values: half away from zero (exact in float64 for float32 inputs)."""
    x = x.to(torch.float64)
    return (torch.sign(x) * torch.floor(x.abs() + 0.5)).to(torch.int64)


def roi_bins(rois: Tensor, height: int, width: int, pooled: int, spatial_scale: float) -> tuple[Tensor, Tensor]:
    """Each RoI's bin edges on an (H, W) map: rows (R, pooled, 2) and columns (R, pooled, 2), [start, end).

    Edges are clipped to [0, H] and [0, W]; a bin is empty where end <= start.
    """
    dev = rois.device
    scaled = rois.to(torch.float32) * torch.tensor(spatial_scale, dtype=torch.float32, device=dev)  # (R, 4)
    corners = _c_round(scaled)  # (R, 4): start_w, start_h, end_w, end_h
    steps = torch.arange(pooled, dtype=torch.float32, device=dev)  # (P,)

    def edges(start: Tensor, end: Tensor, limit: int) -> Tensor:
        size = (end - start + 1).clamp(min=1).to(torch.float32)  # (R,)
        bin_size = size / torch.tensor(float(pooled), dtype=torch.float32, device=dev)  # (R,) float32
        lo = torch.floor(steps[None, :] * bin_size[:, None]).to(torch.int64)  # (R, P)
        hi = torch.ceil((steps[None, :] + 1) * bin_size[:, None]).to(torch.int64)
        return torch.stack((lo + start[:, None], hi + start[:, None]), dim=2).clamp(0, limit)  # (R, P, 2)

    return edges(corners[:, 1], corners[:, 3], height), edges(corners[:, 0], corners[:, 2], width)


def levels(side: int, pooled: int) -> int:
    """Table depth along a map side of `side` cells: enough for the longest bin of a RoI inside the image.

    A RoI inside the network's input spans at most side + 2 cells after rounding (the map is the
    input over 16, rounded up at each stride), so one of its bins spans at most
    ceil((side + 2) / pooled) + 1 cells (floor and ceil each add one), and never more than the side
    once clipped. The detector's RoIs are inside the input: the proposal layer clips them, and given
    boxes are checked against their image before they come here. 3 levels for the reference's maps.
    """
    return max(min(side, math.ceil((side + 2) / pooled) + 1), 1).bit_length()


def roi_pool(features: Tensor, rois: Tensor, pooled: int, spatial_scale: float) -> Tensor:
    """Max-pool `features` (C, H, W) of one image over `rois` (R, 4) in input pixels -> (R, C, pooled, pooled).

    The RoIs lie inside the network's input image (`levels`).
    """
    return roi_pool_batch(features[None], rois[None], pooled, spatial_scale)[0]


def roi_pool_batch(features: Tensor, rois: Tensor, pooled: int, spatial_scale: float) -> Tensor:
    """`roi_pool` of G images of one size at once: features (G, C, H, W), rois (G, R, 4) -> (G, R, C, P, P)."""
    g, channels, height, width = features.shape
    n_rois = rois.shape[1]
    rows, cols = roi_bins(rois.reshape(-1, 4), height, width, pooled, spatial_scale)  # (G*R, P, 2) each
    levels_h, levels_w = levels(height, pooled), levels(width, pooled)
    table = _block_maxima(features.permute(0, 2, 3, 1), levels_h, levels_w)  # (G, Lh, Lw, H, W, C)
    flat = table.reshape(-1, channels)  # (G * Lh * Lw * H * W, C)
    row_len = rows[..., 1] - rows[..., 0]  # (G*R, P)
    col_len = cols[..., 1] - cols[..., 0]

    def level(length: Tensor) -> Tensor:  # floor(log2(length)) for length >= 1, 0 for empty bins
        return torch.floor(torch.log2(length.clamp(min=1).double())).to(torch.int64)

    a = level(row_len)[:, :, None]  # (G*R, P, 1): bin row ph
    b = level(col_len)[:, None, :]  # (G*R, 1, P): bin column pw
    top, left = rows[..., 0][:, :, None], cols[..., 0][:, None, :]
    bottom = rows[..., 1][:, :, None] - (1 << a)  # the lower block's first row
    right = cols[..., 1][:, None, :] - (1 << b)
    image = torch.arange(g, device=features.device).repeat_interleave(n_rois)[:, None, None]  # (G*R, 1, 1)
    base = ((image * levels_h + a) * levels_w + b) * (height * width)  # (G*R, P, P)
    out = None
    for y, x in ((top, left), (top, right), (bottom, left), (bottom, right)):
        # an empty bin's edges may sit at -1 or on the far edge: clamped, looked up, then zeroed below
        index = (base + y.clamp(0, height - 1) * width + x.clamp(0, width - 1)).reshape(-1)  # (G*R*P*P,)
        got = flat.index_select(0, index)  # (G*R*P*P, C)
        out = got if out is None else torch.maximum(out, got)
    assert out is not None
    empty = ((row_len <= 0)[:, :, None] | (col_len <= 0)[:, None, :]).reshape(-1, 1)  # (G*R*P*P, 1)
    out = torch.where(empty, torch.zeros((), dtype=out.dtype, device=out.device), out.clamp(min=-_FLT_MAX))
    return out.reshape(g, n_rois, pooled, pooled, channels).permute(0, 1, 4, 2, 3)  # (G, R, C, P, P)


def _block_maxima(cells: Tensor, levels_h: int, levels_w: int) -> Tensor:
    """(G, H, W, C) -> (G, levels_h, levels_w, H, W, C): entry [g, a, b, y, x] the maximum over rows
    y..y+2^a-1 and columns x..x+2^b-1 where those lie inside the map (entries reaching past the edge are
    only partly covered and never looked up: a bin of 2^a rows starting at y ends inside the map)."""
    by_rows = [cells]
    for a in range(1, levels_h):
        prev, step = by_rows[-1], 1 << (a - 1)
        shifted = torch.cat((prev[:, step:], prev[:, -step:]), dim=1) if step < prev.shape[1] else prev
        by_rows.append(torch.maximum(prev, shifted))
    out = []
    for row_level in by_rows:
        by_cols = [row_level]
        for b in range(1, levels_w):
            prev, step = by_cols[-1], 1 << (b - 1)
            shifted = torch.cat((prev[:, :, step:], prev[:, :, -step:]), dim=2) if step < prev.shape[2] else prev
            by_cols.append(torch.maximum(prev, shifted))
        out.append(torch.stack(by_cols, dim=1))  # (G, Lw, H, W, C)
    return torch.stack(out, dim=1)  # (G, Lh, Lw, H, W, C)
