"""`xmodal.base.scores.better`: the one rule for "this score beats the best so far"."""

from __future__ import annotations

import math

import pytest

from xmodal.base.scores import better

NAN = math.nan


@pytest.mark.parametrize("score, best, mode, expected", [
    (0.5, 0.4, "max", True), (0.4, 0.5, "max", False),
    (0.4, 0.5, "min", True), (0.5, 0.4, "min", False),
    (0.5, 0.5, "max", False), (0.5, 0.5, "min", False),  # a tie keeps the earlier one, in both modes
    (-1e9, None, "max", True), (1e9, None, "min", True),  # no best yet: any score
    (NAN, None, "max", True),  # the first evaluation is always a selection
    (NAN, 0.5, "max", False), (NAN, 0.5, "min", False),  # NaN never beats a number
    (0.5, NAN, "max", True), (0.5, NAN, "min", True),  # any number beats a NaN best
    (NAN, NAN, "min", False),
    (3, 2, "max", True),  # ints (Tune results) as well as floats
])
def test_better(score, best, mode, expected):
    assert better(score, best, mode) is expected
