"""Which searched parameters mattered: fANOVA importances of a sweep's parameters for its trials'
score (Optuna's evaluator on a study rebuilt from the finished trials), logged on the parent run as a
tag that the report reads without importing Optuna.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

import optuna

from xmodal import tracking
from xmodal.base import run_tags as T
from xmodal.sweep.space import DefineByRun, SearchSpace

log = logging.getLogger(__name__)

IMPORTANCE_MIN_TRIALS = 3  # fANOVA's forest on fewer finished trials says nothing


def param_importance(space: SearchSpace, points: list[tuple[dict[str, Any], float]]) -> dict[str, Any]:
    """fANOVA importances of the space's parameters for the trials' score, from (searched values,
    score) of the finished trials: Optuna's FanovaImportanceEvaluator (seeded by the space's seed)
    on a study rebuilt from those points with the space's own distributions (its define-by-run
    function run on a FixedTrial). Plain data, for the parent's T.IMPORTANCE tag (the report reads
    it there and imports no Optuna). Parameters that did not apply in every finished trial, or took
    one value in all, are left out; `why` says why there are no values."""
    info: dict[str, Any] = {"method": "fanova", "metric": space.metric, "trials": len(points)}
    if len(points) < IMPORTANCE_MIN_TRIALS:
        return {**info, "why": f"{len(points)} finished trial(s), fANOVA needs at least {IMPORTANCE_MIN_TRIALS}"}
    define = DefineByRun(space.parameters)
    trials = []
    for chosen, score in points:
        fixed = optuna.trial.FixedTrial({k: v for k, v in chosen.items() if k in space.parameters})
        define(fixed)
        trials.append(optuna.trial.create_trial(params=fixed.params, distributions=fixed.distributions,
                                                value=score))
    seen = list(dict.fromkeys(k for t in trials for k in t.params))
    varied = [k for k in seen if all(k in t.params for t in trials) and len({repr(t.params[k]) for t in trials}) > 1]
    info["left_out"] = [k for k in seen if k not in varied]
    if not varied:
        return {**info, "why": "no parameter that applied in every finished trial took two values"}
    verbosity = optuna.logging.get_verbosity()
    optuna.logging.set_verbosity(optuna.logging.WARNING)  # no "new study created" line on the sweep's console
    try:
        study = optuna.create_study(direction="maximize" if space.mode == "max" else "minimize")
        study.add_trials(trials)
        values = optuna.importance.get_param_importances(
            study, evaluator=optuna.importance.FanovaImportanceEvaluator(seed=space.seed), params=varied)
    except RuntimeError as e:  # Optuna's fANOVA: "zero total variance" when every trial scored the same
        return {**info, "why": f"fANOVA failed: {e}"}
    finally:
        optuna.logging.set_verbosity(verbosity)
    return {**info, "values": {k: float(v) for k, v in values.items()}}


def log_importance(uri: str, space: SearchSpace, parent_run_id: str) -> dict[str, Any]:
    """The parameter importances over the trials that trained to their end, as the report counts
    them (MLflow state FINISHED, not stopped early) and scored as Tune ranked them (their selected
    score), on the parent run as the T.IMPORTANCE tag; returned too."""
    from xmodal.report import collect_runs

    trials, _ = collect_runs(uri, parent_run_id=parent_run_id)
    points = []
    for t in trials:
        score = t.value(space.metric)
        if t.state == "finished" and score is not None and math.isfinite(score):
            points.append((t.params, score))
    try:
        info = param_importance(space, points)
    except ValueError as e:  # a logged value outside its distribution (a space edited since): not the sweep's end
        log.warning(f"parameter importance not computed: {e}")
        info = {"method": "fanova", "metric": space.metric, "trials": len(points), "why": f"failed: {e}"}
    tracking.set_tags(uri, parent_run_id, {T.IMPORTANCE: json.dumps(info)})
    return info
