"""The reference's input arithmetic: the scale, the resized size and the pixel means.

Follows `_get_image_blob` in `lib/fast_rcnn/test.py` and `PIXEL_MEANS`, `TEST.SCALES` (600,) and
`TEST.MAX_SIZE` (1000) in `lib/fast_rcnn/config.py` of peteanderson80/bottom-up-attention. The
reference reads images with `cv2.imread` (BGR, uint8, (H, W, 3)), subtracts the means in float,
then `cv2.resize(..., fx=scale, fy=scale, interpolation=cv2.INTER_LINEAR)`. Only the arithmetic is
here; the bilinear resize itself is still to come.
"""

from __future__ import annotations

import torch
from torch import Tensor

PIXEL_MEANS_BGR = (102.9801, 115.9465, 122.7717)
TEST_SCALE = 600
TEST_MAX_SIZE = 1000


def resize_scale(height: int, width: int, target: int = TEST_SCALE, max_size: int = TEST_MAX_SIZE) -> float:
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


def target_size(height: int, width: int) -> tuple[float, tuple[int, int]]:
    """The reference's test-time scale and the (height, width) the network sees for an image of that size."""
    scale = resize_scale(height, width)
    return scale, resized_size(height, width, scale)


def subtract_means(image_bgr: Tensor) -> Tensor:
    """(H, W, 3) BGR pixels minus PIXEL_MEANS_BGR -> (H, W, 3) float32.

    The reference does `im.astype(np.float32) -= cfg.PIXEL_MEANS`, a float64 array: numpy subtracts
    in float64 and rounds once to float32, which is what this does (subtracting float32 means in
    float32 would round twice and can differ in the last bit).
    """
    means = torch.tensor(PIXEL_MEANS_BGR, dtype=torch.float64)
    return (image_bgr.to(torch.float32).to(torch.float64) - means).to(torch.float32)
