"""Whether a metric's score beats the best so far, for every place that selects by a metric and its
mode (the validation model selection, the best checkpoint, a sweep's best trial): one rule, so that
they cannot disagree about ties or NaN. Standard library only: every layer may import it."""

from __future__ import annotations

import math


def better(score: float, best: float | None, mode: str) -> bool:
    """Whether `score` beats `best` under `mode` ("max": higher is better, else lower).

    No best yet (None): any score, so the first evaluation is always a selection. NaN never beats a
    number, and a NaN best is beaten by any number: a run whose metric was NaN once (a diverged or
    empty evaluation) still selects its later scores. A tie is not better: the earlier one stays.
    """
    if best is None:
        return True
    if math.isnan(score):
        return False
    if math.isnan(best):
        return True
    return score > best if mode == "max" else score < best
