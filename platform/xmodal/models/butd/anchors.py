"""The RPN's anchors, as the reference builds them.

Follows `lib/rpn/generate_anchors.py` (`generate_anchors`, `_ratio_enum`, `_scale_enum`,
`_whctrs`, `_mkanchors`) and the shift enumeration of `ProposalLayer.forward` in
`lib/rpn/proposal_layer.py`, both in peteanderson80/bottom-up-attention; the scales, ratios and
stride are `config.RPNConfig`'s.

Boxes are (x1, y1, x2, y2) in pixels with inclusive corners: a box's width is x2 - x1 + 1 (the
"+1" of the reference's anchor code, which builds the anchors whatever the boxes' convention later).
"""

from __future__ import annotations

import torch
from torch import Tensor

from xmodal.models.butd.config import RPNConfig

_RPN = RPNConfig()


def _mkanchors(ws: Tensor, hs: Tensor, x_ctr: float, y_ctr: float) -> Tensor:
    """Boxes of widths `ws` and heights `hs` (both (M,)) around one centre -> (M, 4)."""
    return torch.stack(
        (x_ctr - 0.5 * (ws - 1), y_ctr - 0.5 * (hs - 1), x_ctr + 0.5 * (ws - 1), y_ctr + 0.5 * (hs - 1)), dim=1
    )


def _whctrs(anchor: Tensor) -> tuple[float, float, float, float]:
    """Width, height and centre of one (4,) box; the centre is x1 + (w - 1) / 2 under "+1" widths."""
    w = float(anchor[2] - anchor[0] + 1)
    h = float(anchor[3] - anchor[1] + 1)
    return w, h, float(anchor[0]) + 0.5 * (w - 1), float(anchor[1]) + 0.5 * (h - 1)


def generate_anchors(
    base_size: int = _RPN.feat_stride, ratios: tuple[float, ...] = _RPN.anchor_ratios,
    scales: tuple[float, ...] = _RPN.anchor_scales,
) -> Tensor:
    """The reference's cell anchors, (len(ratios) * len(scales), 4) float64, ratio-major.

    For each ratio r the base box (0, 0, base_size - 1, base_size - 1) of area s = base_size ** 2 gets
    the width round(sqrt(s / r)) and then the height round(width * r), both rounded before the
    scales multiply them (so the aspect ratios are only approximately r); each is centred on the
    base box's centre ((base_size - 1) / 2 = 7.5). Rounding is half to even, as numpy's `np.round`.
    float64 because the reference computes them in numpy's default float64.
    """
    base = torch.tensor([0.0, 0.0, base_size - 1.0, base_size - 1.0], dtype=torch.float64)
    w, h, x_ctr, y_ctr = _whctrs(base)
    ratio_t = torch.tensor(ratios, dtype=torch.float64)
    ws = torch.round(torch.sqrt(w * h / ratio_t))  # (R,)
    hs = torch.round(ws * ratio_t)  # (R,)
    ratio_anchors = _mkanchors(ws, hs, x_ctr, y_ctr)  # (R, 4)
    scale_t = torch.tensor(scales, dtype=torch.float64)
    rows = []
    for anchor in ratio_anchors:
        aw, ah, ax, ay = _whctrs(anchor)
        rows.append(_mkanchors(aw * scale_t, ah * scale_t, ax, ay))  # (S, 4)
    return torch.cat(rows)  # (R * S, 4)


def shifted_anchors(height: int, width: int, stride: int = _RPN.feat_stride, anchors: Tensor | None = None) -> Tensor:
    """All anchors of a (height, width) feature map, (height * width * A, 4), in the proposal layer's order.

    Rows are ordered (y, x, a) from slowest to fastest: positions major (row-major over the map),
    the A cell anchors fastest. The proposal layer reshapes its (B, 4A, H, W) deltas and (B, A, H, W)
    scores to that same (h, w, a) order, so row k of this tensor pairs with row k of theirs.
    """
    cell = generate_anchors() if anchors is None else anchors  # (A, 4)
    ys = torch.arange(height, dtype=cell.dtype) * stride  # (H,)
    xs = torch.arange(width, dtype=cell.dtype) * stride  # (W,)
    shift_y, shift_x = torch.meshgrid(ys, xs, indexing="ij")  # (H, W) each
    shifts = torch.stack((shift_x, shift_y, shift_x, shift_y), dim=-1).reshape(-1, 1, 4)  # (K, 1, 4)
    return (shifts + cell[None]).reshape(-1, 4)  # (K * A, 4)
