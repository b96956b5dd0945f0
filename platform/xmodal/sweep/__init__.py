"""Ablation sweeps: search-space files -> Optuna (define-by-run) + Ray Tune (ASHA) -> one Ray Train run
per trial, logged to MLflow as children of one parent run per sweep.

    space.py   the space file's typed schema, loading, validation against the job's config (no Ray)
    plan.py    names, paths and every check, before Ray starts (no Ray)
    runner.py  Tune + Optuna: the Tuner, the trial function, the driver's MLflow callback
    (tag names: xmodal.base.run_tags, shared with xmodal.report)
"""

from __future__ import annotations

from typing import Any


def sweep(options) -> dict[str, Any]:
    """Plan (every check on the space and the config, before Ray starts), then run or resume the sweep."""
    from xmodal.sweep.plan import plan_sweep

    plan = plan_sweep(options)
    from xmodal.sweep.runner import run_sweep

    return run_sweep(plan)
