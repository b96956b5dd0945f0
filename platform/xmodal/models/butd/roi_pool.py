"""Caffe's ROIPooling layer as the reference's RoI head uses it: 14 x 14 bins at 1/16.

Follows `ROIPoolingLayer::Forward_cpu` in `caffe/src/caffe/layers/roi_pooling_layer.cpp` and the
`ROIPoolForward` kernel in `roi_pooling_layer.cu` (the same arithmetic) of
peteanderson80/bottom-up-attention's Caffe; the parameters are the `roi_pool5` layer's
`roi_pooling_param` in `models/vg/ResNet-101/faster_rcnn_end2end_final/test.prototxt`
(`pooled_w: 14`, `pooled_h: 14`, `spatial_scale: 0.0625`), pooling `res4b22`.

For each RoI (x1, y1, x2, y2) in input-image pixels:
- its corners on the feature map are C's `round(coordinate * spatial_scale)` (the product in
  float32, rounded half AWAY from zero: 0.5 -> 1, -0.5 -> -1, not numpy's half to even);
- its size is max(end - start + 1, 1), so a zero-size or inverted RoI pools a single cell;
- bin (ph, pw) covers rows [floor(ph * bin_h), ceil((ph + 1) * bin_h)) shifted by the RoI's
  start and clipped to [0, H] (columns alike), with bin_h = roi_h / pooled_h in float32; bins may
  overlap by a row or column;
- a bin left empty by the clipping pools 0; any other bin pools its maximum (Caffe starts from
  -FLT_MAX, so a bin of -inf alone pools -FLT_MAX; Caffe's `>` skips NaN, `amax` here does not).
"""

from __future__ import annotations

import torch
from torch import Tensor

POOLED_SIZE = 14
SPATIAL_SCALE = 0.0625
_FLT_MAX = 3.4028234663852886e38


def _c_round(x: Tensor) -> Tensor:
    """C's `round` of float32 values: half away from zero (exact in float64 for float32 inputs)."""
    x = x.to(torch.float64)
    return (torch.sign(x) * torch.floor(x.abs() + 0.5)).to(torch.int64)


def roi_bins(rois: Tensor, height: int, width: int, pooled: int, spatial_scale: float) -> tuple[Tensor, Tensor]:
    """Each RoI's bin edges on an (H, W) map: rows (R, pooled, 2) and columns (R, pooled, 2), [start, end).

    Edges are clipped to [0, H] and [0, W]; a bin is empty where end <= start.
    """
    scaled = rois.to(torch.float32) * torch.tensor(spatial_scale, dtype=torch.float32)  # (R, 4), float32 product
    corners = _c_round(scaled)  # (R, 4): start_w, start_h, end_w, end_h
    steps = torch.arange(pooled, dtype=torch.float32)  # (P,)

    def edges(start: Tensor, end: Tensor, limit: int) -> Tensor:
        size = (end - start + 1).clamp(min=1).to(torch.float32)  # (R,)
        bin_size = size / torch.tensor(float(pooled), dtype=torch.float32)  # (R,) float32
        lo = torch.floor(steps[None, :] * bin_size[:, None]).to(torch.int64)  # (R, P)
        hi = torch.ceil((steps[None, :] + 1) * bin_size[:, None]).to(torch.int64)
        return torch.stack((lo + start[:, None], hi + start[:, None]), dim=2).clamp(0, limit)  # (R, P, 2)

    rows = edges(corners[:, 1], corners[:, 3], height)
    cols = edges(corners[:, 0], corners[:, 2], width)
    return rows, cols


def roi_pool(
    features: Tensor, rois: Tensor, pooled: int = POOLED_SIZE, spatial_scale: float = SPATIAL_SCALE
) -> Tensor:
    """Max-pool `features` (C, H, W) of one image over `rois` (R, 4) -> (R, C, pooled, pooled).

    `rois` are (x1, y1, x2, y2) in the network input's pixels (Caffe's `rois` blob without its
    batch-index column: the reference runs one image at a time). Per RoI and row of bins: the maximum
    over the bin rows' cells across the RoI's columns, then over each bin's columns, on a
    channel-last copy so that every slice is contiguous.
    """
    channels, height, width = features.shape
    rows, cols = roi_bins(rois, height, width, pooled, spatial_scale)
    by_cell = features.permute(1, 2, 0).contiguous()  # (H, W, C): a bin's cells are contiguous rows of C
    out = features.new_zeros((rois.shape[0], pooled, pooled, channels))  # (R, P, P, C)
    for r, (row_edges, col_edges) in enumerate(zip(rows.tolist(), cols.tolist(), strict=True)):
        full_cols = [(pw, start, end) for pw, (start, end) in enumerate(col_edges) if end > start]
        if not full_cols:
            continue
        left, right = min(c[1] for c in full_cols), max(c[2] for c in full_cols)
        for ph, (top, bottom) in enumerate(row_edges):
            if bottom <= top:
                continue  # empty row of bins: stays 0
            row_max = by_cell[top:bottom, left:right].amax(dim=0)  # (right - left, C)
            for pw, start, end in full_cols:
                out[r, ph, pw] = row_max[start - left : end - left].amax(dim=0)
    return out.permute(0, 3, 1, 2).clamp(min=-_FLT_MAX)  # (R, C, P, P)


def roi_pool_fast(
    features: Tensor, rois: Tensor, pooled: int = POOLED_SIZE, spatial_scale: float = SPATIAL_SCALE
) -> Tensor:
    """`roi_pool` without a Python loop over RoIs or bins: the same bins and the same values.

    A bin's maximum over its [top, bottom) x [left, right) cells is the maximum of four blocks of
    2^a x 2^b cells that cover it (a = floor(log2(rows)), b likewise; the blocks may overlap, which
    a maximum does not mind). The blocks' maxima are a sparse table over the map, one (H, W, C)
    slice per (a, b), built once per image; then each bin is four row lookups. Maxima are exact, so
    this equals `roi_pool` value for value (tests/models/butd/test_roi_pool.py), on any device.
    """
    channels, height, width = features.shape
    rows, cols = roi_bins(rois.cpu(), height, width, pooled, spatial_scale)  # (R, P, 2) each
    rows, cols = rows.to(features.device), cols.to(features.device)
    n_rois = rois.shape[0]
    row_len = rows[..., 1] - rows[..., 0]  # (R, P)
    col_len = cols[..., 1] - cols[..., 0]
    levels_h = max(int(row_len.max().item()) if n_rois else 1, 1).bit_length()  # a in [0, levels_h)
    levels_w = max(int(col_len.max().item()) if n_rois else 1, 1).bit_length()
    table = _block_maxima(features.permute(1, 2, 0), levels_h, levels_w)  # (Lh, Lw, H, W, C)
    flat = table.reshape(-1, channels)  # (Lh * Lw * H * W, C)

    def level(length: Tensor) -> Tensor:  # floor(log2(length)) for length >= 1, 0 for empty bins
        return torch.floor(torch.log2(length.clamp(min=1).double())).to(torch.int64)

    a = level(row_len)[:, :, None]  # (R, P, 1): bin row ph
    b = level(col_len)[:, None, :]  # (R, 1, P): bin column pw
    top, left = rows[..., 0][:, :, None], cols[..., 0][:, None, :]
    bottom = rows[..., 1][:, :, None] - (1 << a)  # the lower block's first row
    right = cols[..., 1][:, None, :] - (1 << b)
    base = (a * levels_w + b) * (height * width)  # (R, P, P)
    out = None
    for y, x in ((top, left), (top, right), (bottom, left), (bottom, right)):
        # an empty bin's edges may sit at -1 or on the far edge: clamped, looked up, then zeroed below
        index = (base + y.clamp(0, height - 1) * width + x.clamp(0, width - 1)).reshape(-1)  # (R * P * P,)
        got = flat.index_select(0, index)  # (R * P * P, C)
        out = got if out is None else torch.maximum(out, got)
    assert out is not None
    empty = ((row_len <= 0)[:, :, None] | (col_len <= 0)[:, None, :]).reshape(-1, 1)  # (R * P * P, 1)
    out = torch.where(empty, torch.zeros((), dtype=out.dtype, device=out.device), out.clamp(min=-_FLT_MAX))
    return out.reshape(n_rois, pooled, pooled, channels).permute(0, 3, 1, 2)  # (R, C, P, P)


def _block_maxima(cells: Tensor, levels_h: int, levels_w: int) -> Tensor:
    """(H, W, C) -> (levels_h, levels_w, H, W, C): entry [a, b, y, x] the maximum over rows y..y+2^a-1
    and columns x..x+2^b-1 where those lie inside the map (entries reaching past the edge are only
    partly covered and never looked up: a bin of 2^a rows starting at y ends inside the map)."""
    by_rows = [cells]
    for a in range(1, levels_h):
        prev, step = by_rows[-1], 1 << (a - 1)
        shifted = torch.cat((prev[step:], prev[-step:]), dim=0) if step < prev.shape[0] else prev
        by_rows.append(torch.maximum(prev, shifted))
    out = []
    for row_level in by_rows:
        by_cols = [row_level]
        for b in range(1, levels_w):
            prev, step = by_cols[-1], 1 << (b - 1)
            shifted = torch.cat((prev[:, step:], prev[:, -step:]), dim=1) if step < prev.shape[1] else prev
            by_cols.append(torch.maximum(prev, shifted))
        out.append(torch.stack(by_cols))
    return torch.stack(out)
