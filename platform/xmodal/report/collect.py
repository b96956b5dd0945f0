"""A report's first room: the runs of one sweep, or of every sweep in an experiment, read from MLflow
(through `xmodal.tracking`) into plain data, and what their parent runs say about the sweep.

Trial runs are the children tagged `xmodal.kind = trial` (a pretrain-then-fine-tune chain logs its
pretraining stage under the same parent); those the driver closed as orphans are left out. A run's
state: finished, early-stopped (the scheduler stopped it), failed, running or killed.
The sweep metric's value of a run is its selected score, as the run logged it
(`scores.selected_key`: the best evaluation, the checkpoint the run keeps, the value the sweep ranked
it by and the parent's `best/<metric>` holds for the best trial), never recomputed here: a run
stopped early counts with its selected score at the step the sweep ranked it (tag
`xmodal.ranked_step`: its workers may have evaluated again before they stopped); a run that logged
none has none (n/a in the table). Any other metric's value: the selected model's (`best_<metric>`:
MulT, fine-tuning) where the job logs one, else the last evaluation.
The parents carry the sweep metric and mode, the baseline configuration (the space's `baseline:`,
else its first `try_first`) and the parameter importances the sweep driver computed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from xmodal import tracking
from xmodal.base import run_tags as T
from xmodal.base.errors import UserError
from xmodal.base.scores import SELECTED_PREFIX, selected_key


class ReportError(UserError):
    """Nothing to report, or a bad experiment / run id; the message says which."""


@dataclass
class TrialRun:
    run_id: str
    name: str
    parent_run_id: str | None
    params: dict[str, Any]  # ablation parameter -> value (absent: its condition did not hold)
    seed: str | None
    state: str  # finished | early-stopped | failed | running | killed
    metrics: dict[str, float]  # last value of each metric
    selects_on: str | None = None  # the sweep metric the run kept its checkpoints by (its tag)
    ranked_step: int | None = None  # stopped early: the step of the last report the sweep ranked it by
    ranked: float | None = None  # stopped early: its selected score at `ranked_step`

    def value(self, key: str) -> float | None:
        """For the metric the run selects on: its selected score as logged (`selected_key(key)`, the
        last value of a running best, or for a run stopped early its value at the last report the
        sweep ranked; None if it logged none, e.g. stopped before evaluating). For any other metric:
        the selected model's `best_<key>` where the job logs one, else the last value."""
        if key == self.selects_on and self.ranked_step is not None:
            return self.ranked
        if selected_key(key) in self.metrics:
            return self.metrics[selected_key(key)]
        if key == self.selects_on:
            return None
        if f"best_{key}" in self.metrics:
            return self.metrics[f"best_{key}"]
        return self.metrics.get(key)


def parse_value(text: str) -> Any:
    """Tag text back to a value: int, float, bool or the string."""
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return {"True": True, "False": False, "None": None}.get(text, text)


def fmt_param(v: Any) -> str:
    """A parameter's value as the table, the plots and the errors show it."""
    return f"{v:g}" if isinstance(v, float) else str(v)


def _state(run: tracking.RunRecord) -> str:
    tags, status = run.tags, run.status
    if tags.get(T.EARLY_STOPPED) == "true":
        return "early-stopped"
    return {"FINISHED": "finished", "FAILED": "failed", "RUNNING": "running", "SCHEDULED": "running"}.get(
        status, "killed")


def _trial(run: tracking.RunRecord) -> TrialRun:
    tags = run.tags
    keys = json.loads(tags.get(T.ABLATION_KEYS, "[]"))
    params = {k: parse_value(tags[T.ABLATION + k]) for k in keys if T.ABLATION + k in tags}
    step = tags.get(T.RANKED_STEP)
    return TrialRun(run_id=run.run_id, name=run.name, parent_run_id=run.parent_run_id, params=params,
                    seed=tags.get(T.SEED), state=_state(run), metrics=dict(run.metrics),
                    selects_on=tags.get(T.METRIC), ranked_step=int(step) if step is not None else None)


def _read_ranked(uri: str, t: TrialRun) -> None:
    """A run stopped early: its workers may have evaluated (and logged) once or twice more after the
    report the sweep ranked it by; its score is the selected score logged at that report's step."""
    if t.ranked_step is None or t.selects_on is None:
        return
    at = [v for s, v in tracking.metric_history(uri, t.run_id, selected_key(t.selects_on)) if s <= t.ranked_step]
    t.ranked = at[-1] if at else None


def collect_runs(uri: str, experiment: str | None = None,
                 parent_run_id: str | None = None) -> tuple[list[TrialRun], list[tracking.RunRecord]]:
    """(trial runs, parent runs) of one sweep or of every sweep in an experiment."""
    if (experiment is None) == (parent_run_id is None):
        raise ReportError("give exactly one of an experiment name or a parent run id")
    try:
        tracking.check_existing_store(uri)  # MLflow would create (or migrate) a database: a report only reads
    except UserError as e:
        raise ReportError(f"{e} (set --tracking-uri or $MLFLOW_TRACKING_URI)") from None
    if parent_run_id is not None:
        try:
            parent = tracking.get_run(uri, parent_run_id)
        except tracking.RunNotFound:
            raise ReportError(f"parent run {parent_run_id!r} not found in {uri}; expected the run id of a sweep's "
                              "parent run") from None
        if parent.parent_run_id is not None or parent.tags.get(T.KIND) == "trial":
            sweep_name = parent.tags.get(T.SWEEP)
            of = f"a trial of sweep {sweep_name!r}" if sweep_name else "a child run"
            up = parent.parent_run_id
            raise ReportError(f"--parent-run {parent_run_id!r} is {of}, not a sweep's parent run"
                              + (f"; its parent run is {up}: pass --parent-run {up}" if up else ""))
        # Children that are trials: a pretrain-then-fine-tune chain also logs its pretraining stage there.
        runs = [r for r in tracking.child_runs(uri, parent_run_id) if r.tags.get(T.KIND) == "trial"]
        if not runs and parent.tags.get(T.KIND) != "sweep":
            raise ReportError(f"--parent-run {parent_run_id!r} ({parent.name!r}) is not a sweep's parent run: it has "
                              f"no trial runs ({T.KIND} = {parent.tags.get(T.KIND)!r}, expected 'sweep')")
        parents = [parent]
    else:
        exp_id = tracking.get_experiment_id(uri, experiment)
        if exp_id is None:
            names = tracking.experiment_names(uri)
            raise ReportError(f"experiment {experiment!r} not found in {uri}; experiments: {', '.join(names)}")
        runs = tracking.search_runs(uri, [exp_id], f"tags.`{T.KIND}` = 'trial'")
        parents = tracking.search_runs(uri, [exp_id], f"tags.`{T.KIND}` = 'sweep'")
        if not runs and not parents:
            raise ReportError(f"experiment {experiment!r} in {uri} holds no sweep: no run is tagged {T.KIND} = "
                              "'sweep' or 'trial' (a report compares the trials of sweeps)")
    runs = [r for r in runs if r.tags.get(T.ORPHANED) != "true"]
    trials = [_trial(r) for r in runs]
    for t in trials:
        _read_ranked(uri, t)
    return trials, parents


def check_metric(metric: str, trials: list[TrialRun]) -> None:
    """A metric asked for by name must be one the runs logged: else every cell would be n/a."""
    logged = sorted({k.removeprefix("best_").removeprefix(SELECTED_PREFIX) for t in trials for k in t.metrics})
    if metric not in logged:
        shown = ", ".join(logged[:40]) + (f", ... ({len(logged)} in all)" if len(logged) > 40 else "")
        raise ReportError(f"--metric {metric!r}: no trial run logged it; the runs have: {shown or 'no metric'}")


def _parent_tag(parents: list[tracking.RunRecord], key: str) -> str | None:
    """The tag of the most recent parent run that has it."""
    for p in sorted(parents, key=lambda p: p.start_time or 0, reverse=True):
        if key in p.tags:
            return p.tags[key]
    return None


def sweep_metric(parents: list[tracking.RunRecord]) -> str | None:
    return _parent_tag(parents, T.METRIC)


def sweep_mode(parents: list[tracking.RunRecord]) -> str:
    return _parent_tag(parents, T.MODE) or "max"


def baseline_of(parents: list[tracking.RunRecord]) -> dict[str, Any] | None:
    """The parents' baseline configuration: the space's `baseline:` (a tag), else its first
    `try_first` configuration (a param of every sweep's parent run)."""
    tagged = _parent_tag(parents, T.BASELINE)
    if tagged:
        return json.loads(tagged)
    for p in sorted(parents, key=lambda p: p.start_time or 0, reverse=True):
        first = json.loads(p.params.get("try_first", "[]") or "[]")
        if first:
            return first[0]
    return None


def importance_of(parents: list[tracking.RunRecord]) -> list[dict[str, Any]]:
    """The parameter importances the sweep driver computed (fANOVA over its finished trials; the
    report itself imports no Optuna), one entry per parent run that has them, newest first."""
    found = []
    for p in sorted(parents, key=lambda p: p.start_time or 0, reverse=True):
        if T.IMPORTANCE in p.tags:
            found.append({"sweep": p.tags.get(T.SWEEP, p.name), **json.loads(p.tags[T.IMPORTANCE])})
    return found
