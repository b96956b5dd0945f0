"""The reference's input scale and resized size, worked out by hand, and its mean subtraction."""

from __future__ import annotations

import struct

import pytest
import torch

from xmodal.models.butd.image import PIXEL_MEANS_BGR, resize_scale, resized_size, subtract_means, target_size


@pytest.mark.parametrize(
    ("height", "width", "scale", "size"),
    [
        (480, 640, 1.25, (600, 800)),  # landscape: 600 / 480; 640 x 1.25 = 800
        (640, 480, 1.25, (800, 600)),  # portrait
        (600, 600, 1.0, (600, 600)),
        (333, 500, 600 / 333, (600, 901)),  # 500 x 1.8018 = 900.9 -> 901
        (100, 1000, 1.0, (100, 1000)),  # 6 x 1000 > 1000: 1000 / 1000
        (1000, 100, 1.0, (1000, 100)),
        (50, 3000, 1000 / 3000, (17, 1000)),  # 12 x 3000 > 1000: 50 / 3 = 16.67 -> 17
        (3000, 50, 1000 / 3000, (1000, 17)),
        (400, 667, 1.5, (600, 1000)),  # 667 x 1.5 = 1000.5, half to even 1000: not > 1000, keeps 1.5
        (400, 669, 1000 / 669, (598, 1000)),  # 1003.5 -> 1004 > 1000; 400 x 1000 / 669 = 597.9 -> 598
    ],
)
def test_target_size(height, width, scale, size):
    assert target_size(height, width) == (scale, size)


def test_resized_size_rounds_half_to_even_as_cvround():
    # scale 1.5: 663 -> 994.5 -> 994 (half-up would give 995); 665 -> 997.5 -> 998; 401 -> 601.5 -> 602
    assert resized_size(401, 663, 1.5) == (602, 994)
    assert resized_size(400, 665, 1.5) == (600, 998)
    assert resize_scale(400, 663) == 1.5


def _f32(x: float) -> float:
    return struct.unpack("f", struct.pack("f", x))[0]


def test_means_are_subtracted_in_float64_then_rounded_once():
    assert PIXEL_MEANS_BGR == (102.9801, 115.9465, 122.7717)
    pixels = torch.arange(256, dtype=torch.uint8)[:, None, None].expand(256, 1, 3)  # (H, W, 3) BGR
    got = subtract_means(pixels)
    assert got.dtype == torch.float32 and got.shape == (256, 1, 3)
    expected = [[[_f32(v - m) for m in PIXEL_MEANS_BGR]] for v in range(256)]
    assert got.tolist() == expected
