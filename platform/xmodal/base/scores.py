"""A run's score, in one place: whether a metric's value beats the best so far (`better`, for every
place that selects by a metric and its mode: the validation model selection, the best checkpoint, a
sweep's best trial), so that they cannot disagree about ties or NaN; and the key of the metric that
holds the score of the model a run keeps (`selected_key`), the one value a sweep ranks its trials by,
its parent run summarises and its report shows. Standard library only: every layer may import it."""

from __future__ import annotations

import math

SELECTED_PREFIX = "selected/"


def selected_key(metric: str) -> str:
    """The metric holding a run's selected score on `metric` (its `train.best_metric`), e.g.
    `selected/valid/accuracy`: the best value of `metric` over the run's evaluations so far under
    `scores.better`, that is the score of the checkpoint (and, for jobs that select on validation,
    the model) the run keeps. The worker logs it to MLflow at each evaluation and puts it in every
    report to Ray Train; Tune ranks trials by it, and a sweep's parent run and report read it."""
    return SELECTED_PREFIX + metric


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
