"""The input stage: the reference's scale, resized size and pixel means, and OpenCV's bilinear resize in torch.

Follows `_get_image_blob` in `lib/fast_rcnn/test.py` of peteanderson80/bottom-up-attention with
`config.InputConfig`'s values (TEST.SCALES (600,), TEST.MAX_SIZE 1000, PIXEL_MEANS). The reference
reads images with `cv2.imread` (BGR, uint8, (H, W, 3)), subtracts the means in float, then
`cv2.resize(im, None, None, fx=scale, fy=scale, interpolation=cv2.INTER_LINEAR)`.

Two ways to the same blob (`InputConfig.resize`): "opencv" calls `cv2.resize` where the image is
decoded (the extraction's decode tasks; this module never imports OpenCV), "generic" is
`resize_linear` here, on the detector's device: OpenCV's generic float32 path, equal bit for bit to
an OpenCV whose IPP is off (`tests/models/butd/test_image.py`); pip's opencv-python calls IPP's resize,
whose values differ from the generic path by up to about 0.01 on most pixels.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from xmodal.models.butd.config import InputConfig

_INPUT = InputConfig()


class PreparedImage(NamedTuple):
    """An image as the network sees it (`_get_image_blob`'s blob), and the size it came from."""

    blob: Tensor  # (h, w, 3) float32: BGR minus the means, resized (OpenCV's layout; the detector permutes it)
    scale: float  # the input scale (`im_scales[0]`)
    img_h: int  # the original size
    img_w: int


def resize_scale(height: int, width: int, target: int = _INPUT.scale, max_size: int = _INPUT.max_size) -> float:
    """target / short side, unless that makes round(scale * long side) exceed max_size: then max_size / long side.

    Python's `round` is half to even, as the reference's `np.round`: a long side that would come
    to exactly 1000.5 rounds to 1000 and keeps the 600 scale.
    """
    short, long = min(height, width), max(height, width)
    scale = float(target) / float(short)
    if round(scale * long) > max_size:
        scale = float(max_size) / float(long)
    return scale


def resized_size(height: int, width: int, scale: float) -> tuple[int, int]:
    """(height, width) of `cv2.resize(im, None, fx=scale, fy=scale)`.

    OpenCV's `resize` computes the destination size as `saturate_cast<int>(side * scale)` in
    double, and `saturate_cast<int>(double)` is `cvRound`, which rounds half to even (SSE2's
    `cvtsd2si`, or `lrint`, under the default rounding mode). Python's `round` does the same.
    """
    return round(height * scale), round(width * scale)


def target_size(height: int, width: int, cfg: InputConfig = _INPUT) -> tuple[float, tuple[int, int]]:
    """The input scale and the (height, width) the network sees for an image of that size."""
    scale = resize_scale(height, width, cfg.scale, cfg.max_size)
    return scale, resized_size(height, width, scale)


def subtract_means(image_bgr: Tensor, means: tuple[float, float, float] = _INPUT.pixel_means) -> Tensor:
    """(H, W, 3) BGR pixels minus the means -> (H, W, 3) float32.

    The reference does `im.astype(np.float32) -= cfg.PIXEL_MEANS`, a float64 array: numpy subtracts
    in float64 and rounds once to float32, which is what this does (subtracting float32 means in
    float32 would round twice and can differ in the last bit).
    """
    m = torch.tensor(means, dtype=torch.float64, device=image_bgr.device)
    if image_bgr.dtype not in (torch.uint8, torch.float32):  # uint8 and float32 widen to float64 exactly
        image_bgr = image_bgr.to(torch.float32)
    return (image_bgr.to(torch.float64) - m).to(torch.float32)


def check_image(image_bgr: Tensor) -> None:
    if image_bgr.dim() != 3 or image_bgr.shape[2] != 3 or min(image_bgr.shape[:2]) < 1:
        raise ValueError(f"expected an (H, W, 3) BGR image, got shape {tuple(image_bgr.shape)}")


def prepare_image(image_bgr: Tensor, cfg: InputConfig = _INPUT) -> PreparedImage:
    """(H, W, 3) uint8 BGR, as `cv2.imread` returns it, on any device -> the blob, by `resize_linear` there."""
    check_image(image_bgr)
    height, width = int(image_bgr.shape[0]), int(image_bgr.shape[1])
    scale, _ = target_size(height, width, cfg)
    return PreparedImage(resize_linear(subtract_means(image_bgr, cfg.pixel_means), scale), scale, height, width)


def _linear_taps(src_size: int, dst_size: int, scale: float, clamp_weight: bool) -> tuple[Tensor, Tensor, Tensor]:
    """OpenCV's source index pairs (D,), (D,) and float32 weight fraction (D,) along one axis.

    The position is `(float)((d + 0.5) * (1 / scale) - 0.5)`: double arithmetic rounded once to
    float32, then `cvFloor` and the float32 fraction. Horizontally (`clamp_weight`) a position
    left of pixel 0 or at or past the last pixel takes that pixel with weight 1; vertically OpenCV
    only clips the two row indices and keeps the fraction, so such rows blend a row with itself.
    """
    inv = 1.0 / scale  # OpenCV's scale_x = 1. / inv_scale_x, inv_scale_x being the fx it was given
    pos = ((torch.arange(dst_size, dtype=torch.float64) + 0.5) * inv - 0.5).to(torch.float32)  # (D,)
    index = torch.floor(pos)
    frac = pos - index  # float32
    index = index.to(torch.int64)
    if clamp_weight:
        low, high = index < 0, index >= src_size - 1
        frac = torch.where(low | high, torch.zeros_like(frac), frac)
        index = torch.where(low, torch.zeros_like(index), index)
        index = torch.where(high, torch.full_like(index, src_size - 1), index)
    return index.clamp(0, src_size - 1), (index + 1).clamp(0, src_size - 1), frac


def resize_linear(image: Tensor, scale: float) -> Tensor:
    """`cv2.resize(image, None, None, fx=scale, fy=scale, interpolation=cv2.INTER_LINEAR)` on float32.

    `image` (H, W) or (H, W, C) -> (round(H * scale), round(W * scale)[, C]) float32, the size from
    `resized_size`. This follows `cv::resize` and its generic path (`resizeGeneric_`,
    `HResizeLinear`, `VResizeLinear`) in OpenCV's `modules/imgproc/src/resize.cpp`:
    - with no `dsize` given, OpenCV keeps `inv_scale_x = fx` (it recomputes the ratio as
      dsize / ssize only when a `dsize` is passed), so the source step is `1 / scale` in double,
      not W / round(W * scale). Seen in several copies of `resize.cpp` (2.4 to 4.x) and consistent
      with the reference's call, which passes `None` for the size; checked against OpenCV 5.1
      (`tests/models/butd/test_image.py`: equal up to float32 rounding);
    - columns first: `S[x0] * (1 - fx) + S[x0 + 1] * fx` in float32, then rows:
      `R[y0] * (1 - fy) + R[y1] * fy` in float32, each product and the sum rounded separately
      (OpenCV's SIMD code might fuse a multiply-add: not checked);
    - not reproduced: the exact-half scale (1 / scale == 2), which OpenCV sends to its INTER_AREA
      fast path (a 2 x 2 mean with its own rounding and partial edge blocks), and builds whose
      IPP or OpenCL resize takes over; the values here are then the same bilinear weights, not
      necessarily the same last bits.
    """
    height, width = image.shape[0], image.shape[1]
    out_h, out_w = resized_size(height, width, scale)
    if out_h <= 0 or out_w <= 0 or not math.isfinite(scale):
        raise ValueError(f"scale {scale} gives an empty image from {height} x {width}")
    image = image.to(torch.float32)
    channels = image.shape[2] if image.dim() == 3 else 1
    dev = image.device
    x0, x1, fx = (t.to(dev) for t in _linear_taps(width, out_w, scale, clamp_weight=True))  # (W',)
    y0, y1, fy = (t.to(dev) for t in _linear_taps(height, out_h, scale, clamp_weight=False))  # (H',)
    # Pixels as rows of W * C values, so both passes are plain gathers and multiplies over contiguous
    # memory; in place where possible: fresh multi-megabyte buffers cost more in page faults than
    # the arithmetic (about 4x faster on a CPU core than indexing (H, W, C) directly). Same values.
    flat = image.reshape(height, width * channels)  # (H, W*C)
    lanes = torch.arange(channels, device=dev)
    ax1 = fx.repeat_interleave(channels)  # (W'*C,)
    ax0 = 1.0 - ax1  # float32, as OpenCV's 1.f - fx
    rows = flat.index_select(1, (x0[:, None] * channels + lanes).reshape(-1)).mul_(ax0)
    rows.add_(flat.index_select(1, (x1[:, None] * channels + lanes).reshape(-1)).mul_(ax1))  # (H, W'*C)
    by1 = fy[:, None]  # (H', 1)
    by0 = 1.0 - by1
    out = rows.index_select(0, y0).mul_(by0)
    out.add_(rows.index_select(0, y1).mul_(by1))  # (H', W'*C)
    return out.reshape(out_h, out_w, *image.shape[2:])  # (H', W'[, C])
