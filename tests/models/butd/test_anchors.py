"""The reference's anchors, against the table in the reference's own source."""

from __future__ import annotations

import torch

from xmodal.models.butd.anchors import generate_anchors, shifted_anchors

# The docstring of lib/rpn/generate_anchors.py (peteanderson80/bottom-up-attention) prints the nine
# anchors of scales (8, 16, 32) as Shaoqing Ren's MATLAB code gives them, 1-based:
MATLAB_ANCHORS = [
    [-83, -39, 100, 56], [-175, -87, 192, 104], [-359, -183, 376, 200],
    [-55, -55, 72, 72], [-119, -119, 136, 136], [-247, -247, 264, 264],
    [-35, -79, 52, 96], [-79, -167, 96, 184], [-167, -343, 184, 360],
]

# Scale 4 by hand, on the reference's rule: base box (0, 0, 15, 15), centre 7.5, area 256.
# ratio 0.5: w = round(sqrt(512)) = 23, h = round(11.5) = 12 -> x4: 92 x 48 -> 7.5 -+ 45.5, 7.5 -+ 23.5
# ratio 1:   16 x 16 -> x4: 64 x 64 -> 7.5 -+ 31.5
# ratio 2:   w = round(sqrt(128)) = 11, h = 22 -> x4: 44 x 88 -> 7.5 -+ 21.5, 7.5 -+ 43.5
SCALE_4 = [[-38, -16, 53, 31], [-24, -24, 39, 39], [-14, -36, 29, 51]]


def test_the_nine_anchors_are_the_matlab_table_made_0_based():
    got = generate_anchors(scales=(8, 16, 32))
    expected = torch.tensor(MATLAB_ANCHORS, dtype=torch.float64) - 1
    assert torch.equal(got, expected)


def test_the_twelve_anchors_of_the_vg_model_are_ratio_major():
    got = generate_anchors()  # scales (4, 8, 16, 32), the test.prototxt's
    assert got.shape == (12, 4)
    for r in range(3):
        expected = [SCALE_4[r]] + [[v - 1 for v in row] for row in MATLAB_ANCHORS[3 * r : 3 * r + 3]]
        assert got[4 * r : 4 * r + 4].tolist() == expected
    centres = (got[:, :2] + got[:, 2:]) / 2
    assert torch.equal(centres, torch.full((12, 2), 7.5, dtype=torch.float64))


def test_shifted_anchors_are_positions_major_then_anchors():
    cell = generate_anchors()
    got = shifted_anchors(2, 3)  # H = 2, W = 3
    assert got.shape == (2 * 3 * 12, 4)
    for y in range(2):
        for x in range(3):
            k = y * 3 + x  # row-major over the map, as the proposal layer's (h, w, a) order
            shift = torch.tensor([16 * x, 16 * y, 16 * x, 16 * y], dtype=torch.float64)
            assert torch.equal(got[12 * k : 12 * k + 12], cell + shift)
    assert got[12 * 4 + 5].tolist() == [-56 + 16, -56 + 16, 71 + 16, 71 + 16]  # (y 1, x 1), anchor 5
