"""Ablation reports: MLflow runs of sweeps -> a comparison table (Markdown + CSV) and plots (PNG).

    python jobs/report.py (--experiment NAME | --parent-run RUN_ID) [--out DIR] [--metric KEY]

One row per configuration: runs whose ablation parameters are equal and that differ only in their
seed (`train.seed`, or separate sweeps of the same space with other seeds) are grouped, and their
metrics shown as mean ± std. Columns: the ablation parameters (a conditional parameter whose
condition did not hold shows as "-"), the number of runs, then the sweep metric, the other summary
metrics of its split (eval/* or valid/*) and test/* where the job logs them. The sweep metric's value
of a run is its selected score, as the run logged it (`scores.selected_key`: the best evaluation,
the checkpoint the run keeps, the value the sweep ranked it by and the parent's `best/<metric>`
holds for the best trial), never recomputed here: a run stopped early counts with its selected
score at the step the sweep ranked it (tag `xmodal.ranked_step`: its workers may have evaluated
again before they stopped); a run that logged none shows n/a. Other columns:
the selected model's value where the job logs one (`best_<metric>`: MulT, fine-tuning), else the
last evaluation. Statistics use the runs that trained to the end; a configuration whose runs
were all stopped early by the scheduler shows their values, marked †.
Each row's mean of the sweep metric has a 95 % Student t confidence interval (mean ± t(0.975, n-1)
s/√n over the same runs). Significance: each row's finished runs are compared with the baseline row's
on the sweep metric by a two-sided t-test: paired (scipy.stats.ttest_rel on the per-seed differences)
where the row and the baseline finished the same seeds, each once; else Welch's (unequal variances,
scipy.stats.ttest_ind). The p-values of the rows tested are Holm–Bonferroni adjusted, so that the
chance of marking any row significant when none differs is at most 0.05 over the whole table; a
row with adjusted p >= 0.05 is marked "n.s." ("n.s. after Holm" where its own p was below). The
baseline row is the space's `baseline:` configuration, else its first `try_first` one (a tag or
param of the parent run), else `--baseline`. Rows with fewer than two finished runs, or a baseline
with fewer, are not tested.
Parameter importance: the sweep driver (xmodal.sweep.runner, the one Optuna importer) computes
fANOVA importances over its finished trials and tags the parent run with them (T.IMPORTANCE, plain
JSON); the report shows each parent's as a table, importance.csv and parameter_importance.png.
Cost: every job logs `cost/*` (xmodal.core.cost); the table shows their means beside the scores,
and marks the rows on the Pareto front of score against GFLOP per sample.
Plots: the metric against each ablation parameter, the learning curves of the best configurations,
and the score against cost (GFLOP per sample, device-hours) with the Pareto front and the baseline.
Everything is read through `xmodal.tracking`; the files are also logged to the sweep's parent run
(artifact folder `report`, or `report_experiment` for an experiment report).
"""

from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xmodal import run_tags as T
from xmodal import tracking
from xmodal.errors import UserError
from xmodal.outputs import check_writable_dir
from xmodal.scores import SELECTED_PREFIX, selected_key

MISSING = "-"  # a conditional parameter that did not apply to a run
CURVES_TOP = 3  # configurations shown in the learning-curve plot
ALPHA = 0.05  # the family-wise error rate of the tests against the baseline (Holm–Bonferroni)
CONFIDENCE = 0.95  # the rows' confidence intervals of the mean (Student t)
PAIRED = "paired t"  # the tests against the baseline, as the table names them
WELCH = "Welch"
# cost/* metric -> (table header, factor applied to the mean and std shown)
COST_COLUMNS = {
    "cost/params": ("params (M)", 1e-6),
    "cost/gflop_per_sample": ("GFLOP/sample", 1.0),
    "cost/samples_per_s": ("samples/s", 1.0),
    "cost/peak_mem_gib": ("peak mem (GiB)", 1.0),
    "cost/wall_s": ("wall (s)", 1.0),
    "cost/device_hours": ("device-h", 1.0),
}
PARETO_COST = "cost/gflop_per_sample"  # the table's Pareto column: score against counted compute


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


@dataclass
class Test:
    """A row against the baseline row on the sweep metric: the difference of the means, the test
    (`PAIRED` or `WELCH`), its two-sided p and the p Holm–Bonferroni adjusts over every row tested
    against the same baseline (p None: not tested, `why` says why)."""

    delta: float
    p: float | None
    why: str = ""
    kind: str = ""
    p_holm: float | None = None

    @property
    def significant(self) -> bool | None:
        """After Holm's correction: the family of rows tested keeps its error rate at ALPHA."""
        return None if self.p_holm is None else self.p_holm < ALPHA

    @property
    def significant_alone(self) -> bool | None:
        return None if self.p is None else self.p < ALPHA


@dataclass
class Row:
    params: dict[str, Any]
    runs: list[TrialRun]
    stats: dict[str, tuple[float, float, int]] = field(default_factory=dict)  # metric -> (mean, std, n)
    ci: tuple[float, float] | None = None  # the sweep metric's mean: CONFIDENCE t interval (n >= 2)
    partial: bool = False  # statistics come from early-stopped runs only
    baseline: bool = False
    test: Test | None = None  # against the baseline row, on the sweep metric
    pareto: bool = False  # on the front of score against PARETO_COST

    def count(self, state: str) -> int:
        return sum(r.state == state for r in self.runs)


@dataclass
class Report:
    title: str
    metric: str
    mode: str
    keys: list[str]
    columns: list[str]
    rows: list[Row]
    skipped: dict[str, int]  # state -> runs left out of the table (failed, running, ...)
    parents: list[str]
    out_dir: str | None = None
    cost_columns: list[str] = field(default_factory=list)  # the cost/* metrics some run logged
    baseline: dict[str, Any] | None = None  # the baseline configuration asked for
    notes: list[str] = field(default_factory=list)  # e.g. why no row is the baseline
    # per sweep parent that logged them (T.IMPORTANCE), newest first: {"sweep", "trials", "values", ...}
    importance: list[dict[str, Any]] = field(default_factory=list)


def parse_value(text: str) -> Any:
    """Tag text back to a value: int, float, bool or the string."""
    for conv in (int, float):
        try:
            return conv(text)
        except ValueError:
            pass
    return {"True": True, "False": False, "None": None}.get(text, text)


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


def collect(uri: str, experiment: str | None = None,
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


def _default_columns(metric: str, trials: list[TrialRun]) -> list[str]:
    """The sweep metric, the other summary metrics of its split (e.g. eval/<name> or valid/<name>, not
    per-task losses), then the test metrics where the job logs them (MulT: of the selected model), then
    the sweep metric's name under each robustness condition (robust/<condition>/<name>)."""
    split = metric.split("/")[0] + "/" if "/" in metric else None
    keys = {k for t in trials for k in t.metrics if k.count("/") == 1 and k != metric
            and not k.startswith(SELECTED_PREFIX)}
    same = sorted(k for k in keys if split and k.startswith(split) and split != "test/")
    test = sorted(k for k in keys if k.startswith("test/"))
    name = metric.rsplit("/", 1)[-1]
    robust = sorted({k for t in trials for k in t.metrics if k.startswith("robust/") and k.count("/") == 2
                     and k.endswith(f"/{name}")})
    return [metric, *same, *test, *robust]


def _stats(values: list[float]) -> tuple[float, float, int]:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return (math.nan, math.nan, 0)
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else 0.0
    return (mean, std, len(vals))


def _parent_tag(parents: list[tracking.RunRecord], key: str) -> str | None:
    """The tag of the most recent parent run that has it."""
    for p in sorted(parents, key=lambda p: p.start_time or 0, reverse=True):
        if key in p.tags:
            return p.tags[key]
    return None


def _sweep_metric(parents: list[tracking.RunRecord]) -> str | None:
    return _parent_tag(parents, T.METRIC)


def _sweep_mode(parents: list[tracking.RunRecord]) -> str:
    return _parent_tag(parents, T.MODE) or "max"


def _baseline_of(parents: list[tracking.RunRecord]) -> dict[str, Any] | None:
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


def _importance_of(parents: list[tracking.RunRecord]) -> list[dict[str, Any]]:
    """The parameter importances the sweep driver computed (fANOVA over its finished trials; the
    report itself imports no Optuna), one entry per parent run that has them, newest first."""
    found = []
    for p in sorted(parents, key=lambda p: p.start_time or 0, reverse=True):
        if T.IMPORTANCE in p.tags:
            found.append({"sweep": p.tags.get(T.SWEEP, p.name), **json.loads(p.tags[T.IMPORTANCE])})
    return found


def _same(a: Any, b: Any) -> bool:
    """A value read back from a tag against one from JSON: 1 == 1.0, "True" is not 1."""
    if _numeric([a]) and _numeric([b]):
        return float(a) == float(b)
    return str(a) == str(b)


# Rows named in full in the error of a --baseline that names none (the rest are counted).
ROWS_LISTED = 20


def _baseline_row(rows: list[Row], keys: list[str], baseline: dict[str, Any], notes: list[str],
                  asked: bool = False) -> Row | None:
    """The one row of `baseline`'s configuration. When it has none: the sweep's own baseline gets a
    note in the report (no tests); a baseline `asked` for (--baseline) is a ReportError listing the
    rows, since a report without the tests asked for would look complete."""
    wanted = {k: v for k, v in baseline.items() if k not in T.REPLICATE_KEYS}
    described = ", ".join(f"{k}={_fmt_param(v)}" for k, v in wanted.items())
    unknown = [k for k in wanted if k not in keys]
    found = [] if unknown else [r for r in rows if all(_same(r.params[k], v) for k, v in wanted.items())]
    if len(found) == 1:
        return found[0]
    if unknown:
        why = (f"names {', '.join(unknown)}, which is not an ablation parameter of these runs "
               f"({', '.join(keys) or 'none'})")
    else:
        why = "matches no row" if not found else f"matches {len(found)} rows"
    if asked:
        listed = "; ".join(" ".join(f"{k}={_fmt_param(v)}" for k, v in r.params.items()) or "(no parameter)"
                           for r in (found or rows)[:ROWS_LISTED])
        more = f"; ... ({len(found or rows)} in all)" if len(found or rows) > ROWS_LISTED else ""
        which = "the rows it matches" if found else "the rows are"
        raise ReportError(f"--baseline {' '.join(f'{k}={_fmt_param(v)}' for k, v in wanted.items())}: {why}; "
                          f"expected the parameters of exactly one row ({which}: {listed}{more})")
    notes.append(f"No significance test: the baseline ({described}) {why}.")
    return None


def _finished_values(row: Row, metric: str) -> list[float]:
    vals = [r.value(metric) for r in row.runs if r.state == "finished"]
    return [v for v in vals if v is not None and math.isfinite(v)]


def welch_test(values: list[float], baseline: list[float]) -> float | None:
    """Two-sided p of Welch's t-test (unequal variances); None with fewer than two values a side."""
    if len(values) < 2 or len(baseline) < 2:
        return None
    m, b = _stats(values), _stats(baseline)
    if m[1] == 0 and b[1] == 0:  # no spread on either side: t is 0 or infinite
        return 1.0 if m[0] == b[0] else 0.0
    from scipy import stats

    return float(stats.ttest_ind(values, baseline, equal_var=False).pvalue)


def paired_test(values: list[float], baseline: list[float]) -> float | None:
    """Two-sided p of the paired t-test: the mean of the per-seed differences against 0, with n - 1
    degrees of freedom (`values[i]` and `baseline[i]` ran the same seed); None under two pairs."""
    if len(values) != len(baseline) or len(values) < 2:
        return None
    diffs = [v - b for v, b in zip(values, baseline, strict=True)]
    mean, std, _ = _stats(diffs)
    if std == 0:  # every seed moved by the same amount: t is 0 or infinite
        return 1.0 if mean == 0 else 0.0
    from scipy import stats

    return float(stats.ttest_rel(values, baseline).pvalue)


def holm(ps: list[float]) -> list[float]:
    """Holm–Bonferroni adjusted p-values, in the order given: the i-th smallest p times (m - i + 1),
    made non-decreasing in that order, at most 1. Rejecting where the adjusted p < α keeps the chance
    of any false rejection among the m at most α, whatever their dependence."""
    m = len(ps)
    adjusted = [1.0] * m
    running = 0.0
    for rank, i in enumerate(sorted(range(m), key=lambda i: ps[i])):
        running = max(running, min(1.0, (m - rank) * ps[i]))
        adjusted[i] = running
    return adjusted


def t_interval(values: list[float], confidence: float = CONFIDENCE) -> tuple[float, float] | None:
    """Student t confidence interval of the mean: mean ± t(1 - (1 - confidence) / 2, n - 1) · s / √n;
    None under two values."""
    mean, std, n = _stats(values)
    if n < 2:
        return None
    from scipy import stats

    half = float(stats.t.ppf(1 - (1 - confidence) / 2, n - 1)) * std / math.sqrt(n)
    return (mean - half, mean + half)


def _by_seed(row: Row, metric: str) -> dict[str, float] | None:
    """The finished runs' values by seed, where every run has a seed tag and no seed ran twice."""
    runs = [r for r in row.runs if r.state == "finished" and r.value(metric) is not None
            and math.isfinite(r.value(metric))]
    seeds = [r.seed for r in runs]
    if None in seeds or len(set(seeds)) != len(seeds):
        return None
    return {r.seed: r.value(metric) for r in runs}


def _test(row: Row, base: Row, metric: str) -> Test:
    """Paired over the seeds where the row and the baseline finished the same seeds (each once): the
    seed fixes initialisation and data order, so the per-seed difference removes that noise. Else
    Welch (no pairing to use; unequal variances)."""
    delta = row.stats[metric][0] - base.stats[metric][0]
    if row.partial:
        return Test(delta, None, "stopped early")
    a, b = _finished_values(row, metric), _finished_values(base, metric)
    if len(a) < 2 or len(b) < 2:
        return Test(delta, None, f"{len(a)} run" if len(a) < 2 else f"baseline {len(b)} run")
    mine, theirs = _by_seed(row, metric), _by_seed(base, metric)
    if mine is not None and theirs is not None and mine.keys() == theirs.keys():
        seeds = sorted(mine)
        return Test(delta, paired_test([mine[k] for k in seeds], [theirs[k] for k in seeds]), kind=PAIRED)
    return Test(delta, welch_test(a, b), kind=WELCH)


def pareto_front(points: list[tuple[float, float]], mode: str) -> list[bool]:
    """For (cost, score) points: True where no other point is at most as costly and at least as good,
    and strictly one of them (lower cost is better; the score by `mode`)."""
    sign = 1.0 if mode == "max" else -1.0
    front = []
    for i, (c, v) in enumerate(points):
        front.append(not any(c2 <= c and sign * v2 >= sign * v and (c2 < c or sign * v2 > sign * v)
                             for j, (c2, v2) in enumerate(points) if j != i))
    return front


def _costed(rows: list[Row], metric: str, cost: str) -> list[Row]:
    """Rows with a finite mean score and cost from finished runs (the Pareto front's candidates)."""
    return [r for r in rows if not r.partial and cost in r.stats and math.isfinite(r.stats[cost][0])
            and math.isfinite(r.stats[metric][0])]


def build_report(trials: list[TrialRun], parents: list[tracking.RunRecord], metric: str | None = None, mode: str | None = None,
                 columns: list[str] | None = None, title: str = "ablation",
                 baseline: dict[str, Any] | None = None) -> Report:
    """`baseline`: the configuration the rows are tested against (default: the parents')."""
    metric = metric or _sweep_metric(parents)
    mode = mode or _sweep_mode(parents)
    if metric is None:
        raise ReportError("no metric: the runs have no sweep parent with an xmodal.sweep.metric tag; pass --metric")
    table_states = ("finished", "early-stopped")
    skipped: dict[str, int] = {}
    for t in trials:
        if t.state not in table_states:
            skipped[t.state] = skipped.get(t.state, 0) + 1
    trials = [t for t in trials if t.state in table_states]
    if not trials:
        raise ReportError(f"no finished or early-stopped trial runs to report (left out: {skipped or 'none'})")
    keys: list[str] = []
    for t in trials:
        for k in list(t.params):
            if k not in keys and k not in T.REPLICATE_KEYS:
                keys.append(k)
    columns = columns or _default_columns(metric, trials)
    cost_columns = [c for c in COST_COLUMNS if any(c in t.metrics for t in trials)]

    groups: dict[str, Row] = {}
    for t in trials:
        params = {k: t.params.get(k, MISSING) for k in keys}
        groups.setdefault(json.dumps(params, sort_keys=True, default=str), Row(params, [])).runs.append(t)
    for row in groups.values():
        used = [r for r in row.runs if r.state == "finished"] or row.runs
        row.partial = all(r.state != "finished" for r in row.runs)
        row.stats = {c: _stats([r.value(c) for r in used]) for c in [*columns, *cost_columns]}
        scores = [r.value(metric) for r in used]
        row.ci = t_interval([v for v in scores if v is not None and math.isfinite(v)])
    sign = -1.0 if mode == "max" else 1.0

    def order(row: Row):
        mean = row.stats[metric][0]
        return (row.partial, math.isnan(mean), sign * mean if not math.isnan(mean) else 0.0)

    rows = sorted(groups.values(), key=order)
    rep = Report(title=title, metric=metric, mode=mode, keys=keys, columns=columns, rows=rows, skipped=skipped,
                 parents=[p.run_id for p in parents], cost_columns=cost_columns,
                 baseline=baseline if baseline is not None else _baseline_of(parents),
                 importance=_importance_of(parents))
    base = _baseline_row(rows, keys, rep.baseline, rep.notes, asked=baseline is not None) \
        if rep.baseline is not None else None
    if base is not None:
        base.baseline = True
        for row in rows:
            if row is not base:
                row.test = _test(row, base, metric)
        tested = [r.test for r in rows if r.test is not None and r.test.p is not None]
        for t, adjusted in zip(tested, holm([t.p for t in tested]), strict=True):
            t.p_holm = adjusted
    if PARETO_COST in cost_columns:
        candidates = _costed(rows, metric, PARETO_COST)
        points = [(r.stats[PARETO_COST][0], r.stats[metric][0]) for r in candidates]
        for row, on in zip(candidates, pareto_front(points, mode), strict=True):
            row.pareto = on
    return rep


# ---------------------------------------------------------------- files


def _fmt(x: float) -> str:
    if math.isnan(x):
        return "n/a"
    return f"{x:.4f}" if abs(x) < 1000 else f"{x:.4g}"


def _cell(stats: tuple[float, float, int]) -> str:
    mean, std, n = stats
    return _fmt(mean) if n <= 1 else f"{_fmt(mean)} ± {_fmt(std)}"


def _fmt_param(v: Any) -> str:
    return f"{v:g}" if isinstance(v, float) else str(v)


def _cost_cell(stats: tuple[float, float, int], factor: float) -> str:
    x = stats[0] * factor
    if math.isnan(x):
        return "n/a"
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.3g}"


def _p(p: float, name: str = "p") -> str:
    return f"{name}<0.001" if p < 0.001 else f"{name}={p:.2g}"


def _test_cell(row: Row) -> str:
    if row.baseline:
        return "baseline"
    t = row.test
    if t is None:
        return ""
    if t.p is None:
        return f"{t.delta:+.4f} (untested: {t.why})"
    verdict = "" if t.significant else ", n.s. after Holm" if t.significant_alone else ", n.s."
    return f"{t.delta:+.4f} ({t.kind}, {_p(t.p)}; {_p(t.p_holm, 'Holm p')}{verdict})"


def _ci_cell(row: Row) -> str:
    return "" if row.ci is None else f"[{_fmt(row.ci[0])}, {_fmt(row.ci[1])}]"


def _runs_cell(row: Row) -> str:
    stopped = row.count("early-stopped")
    return f"{len(row.runs)}" + (f" ({stopped} stopped early)" if stopped else "")


def _family(rep: Report) -> int:
    """The number of rows tested against the baseline: Holm's m."""
    return sum(r.test is not None and r.test.p is not None for r in rep.rows)


def _ci_header(rep: Report) -> str:
    return f"{CONFIDENCE:.0%} CI"


def _test_header(rep: Report) -> str:
    if not _family(rep):
        return f"vs baseline ({rep.metric}; none tested)"
    return f"vs baseline ({rep.metric}; Holm over {_family(rep)} rows, α={ALPHA:g})"


def _legend(rep: Report, tested: bool) -> list[str]:
    """One line per column, under the table."""
    lines = ["Columns:", ""]
    if rep.keys:
        lines.append(f"- {', '.join(rep.keys)}: the configuration (its ablation parameters).")
    lines += [
             "- runs: its runs (seeds); runs stopped early by the scheduler count in the statistics only where "
             "a configuration has no finished run.",
             f"- {rep.metric}: mean ± sample std over the finished runs of each run's selected score "
             f"(`{selected_key(rep.metric)}`: its best evaluation, the checkpoint it keeps, the value the sweep "
             "ranked it by).",
             f"- {_ci_header(rep)}: the {CONFIDENCE:.0%} confidence interval of that mean, Student t: mean ± "
             f"t({1 - (1 - CONFIDENCE) / 2:g}, n-1)·std/√n over the same runs (none for a single run)."]
    others = rep.columns[1:]
    if others:
        lines.append(f"- {', '.join(others)}: mean ± std of the selected model's value where the job logs it "
                     "(`best_<metric>`), else the last evaluation.")
    if tested and not _family(rep):
        lines.append("- vs baseline: the difference of the row's mean from the baseline row's; no row is tested: "
                     "a test needs two finished runs in the row and in the baseline.")
    elif tested:
        lines.append(f"- vs baseline: the difference of the row's mean from the baseline row's; the test on the "
                     f"finished runs' `{rep.metric}`: {PAIRED} (paired t-test on the per-seed differences) where "
                     f"the row and the baseline finished the same seeds, each once, else {WELCH} (Welch's t-test, "
                     f"unequal variances); its two-sided p; Holm p: adjusted by Holm–Bonferroni over the "
                     f"{_family(rep)} rows tested, so that the chance of calling any row different when none is "
                     f"stays at most α = {ALPHA:g}. n.s.: Holm p ≥ α (n.s. after Holm: p alone < α). Rows or a "
                     "baseline with fewer than two finished runs are not tested.")
    if rep.cost_columns:
        lines.append("- Cost (the mean over a row's runs; std in table.csv), logged by the job: parameters; GFLOP "
                     "per sample of one training forward + backward, counted (FlopCounterMode); training "
                     "samples/s; peak memory (GPU: max allocated; CPU: the worker's peak RSS); wall time; "
                     "device-hours = wall x workers x devices per worker (GPU-hours, or on CPU the CPU-hours "
                     "of the cores reserved).")
    if PARETO_COST in rep.cost_columns:
        lines.append(f"- Pareto ◆: on the Pareto front of `{rep.metric}` against GFLOP per sample (no other row "
                     "is as good for less compute).")
    return [*lines, ""]


def to_markdown(rep: Report) -> str:
    best = "highest" if rep.mode == "max" else "lowest"
    tested = any(r.baseline for r in rep.rows)
    caption = f"Sorted by `{rep.metric}` ({best} first); mean ± std over the runs of a configuration (seeds)"
    if tested and _family(rep):
        caption += (f"; rows are tested against the baseline with the family-wise error rate held at "
                    f"α = {ALPHA:g} over the {_family(rep)} rows tested (Holm–Bonferroni)")
    lines = [f"# {rep.title}", "", caption + ".", ""]
    pareto = PARETO_COST in rep.cost_columns
    head = [*rep.keys, "runs", rep.metric, _ci_header(rep), *rep.columns[1:]] \
        + ([_test_header(rep)] if tested else []) \
        + [COST_COLUMNS[c][0] for c in rep.cost_columns] + (["Pareto"] if pareto else [])
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rep.rows:
        mark = " †" if row.partial else ""
        scores = [_cell(row.stats[c]) + mark for c in rep.columns]
        cells = [_fmt_param(row.params[k]) for k in rep.keys] + [_runs_cell(row)] + \
            [scores[0], _ci_cell(row), *scores[1:]] + ([_test_cell(row)] if tested else []) + \
            [_cost_cell(row.stats[c], COST_COLUMNS[c][1]) for c in rep.cost_columns] + \
            (["◆" if row.pareto else ""] if pareto else [])
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines += _legend(rep, tested)
    notes = list(rep.notes)
    if any(r.partial for r in rep.rows):
        notes.append("† every run of this configuration was stopped early by the scheduler: its values at the stop.")
    if MISSING in {str(v) for r in rep.rows for v in r.params.values()}:
        notes.append(f"{MISSING}: the parameter did not apply (its `when:` condition was false).")
    if rep.skipped:
        notes.append("Left out: " + ", ".join(f"{n} {s}" for s, n in sorted(rep.skipped.items())) + " run(s).")
    lines += [x for note in notes for x in (note, "")]  # a paragraph each
    lines += _importance_markdown(rep)
    return "\n".join(lines).rstrip() + "\n"


def _importance_table(rep: Report) -> tuple[list[str], list[dict[str, Any]]]:
    """(parameters, the sweeps that have values): parameters by their importance in the newest sweep."""
    have = [i for i in rep.importance if i.get("values")]
    params: list[str] = []
    for i in have:
        params += [k for k in sorted(i["values"], key=lambda k: -i["values"][k]) if k not in params]
    return params, have


def _importance_markdown(rep: Report) -> list[str]:
    if not rep.importance:
        return []
    params, have = _importance_table(rep)
    lines = ["", "## Parameter importance", ""]
    for i in rep.importance:
        if not i.get("values"):
            lines += [f"Sweep {i['sweep']}: no parameter importance: {i.get('why', 'none computed')}.", ""]
    if have:
        lines += ["| parameter | " + " | ".join(f"importance (sweep {i['sweep']}, {i['trials']} trials)"
                                                 for i in have) + " |",
                  "|" + "---|" * (len(have) + 1)]
        for k in params:
            cells = [f"{i['values'][k]:.3f}" if k in i["values"] else "" for i in have]
            lines.append(f"| {k} | " + " | ".join(cells) + " |")
        scored = ", ".join(sorted({f"`{selected_key(i['metric'])}`" for i in have}))
        lines += ["", f"Importance: fANOVA (Optuna's FanovaImportanceEvaluator: a random forest fitted to the "
                      f"finished trials' {scored}, the variance each parameter explains on "
                      "its own across the space), as shares summing to 1 over the parameters shown; computed by "
                      "the sweep at its end. A guide to which parameters mattered in the trials run, not a test: "
                      "with few trials it is noisy."]
        for i in have:
            if i.get("left_out"):
                lines += ["", f"Sweep {i['sweep']}: left out (did not apply in every finished trial, or took "
                              f"one value in all): {', '.join(i['left_out'])}."]
    return lines


def write_importance_csv(rep: Report, path: Path) -> None:
    params, have = _importance_table(rep)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["sweep", "trials", "parameter", "importance"])
        for i in have:
            for k in params:
                if k in i["values"]:
                    w.writerow([i["sweep"], i["trials"], k, i["values"][k]])


def write_csv(rep: Report, path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        stats = [*rep.columns, *rep.cost_columns]
        w.writerow([*rep.keys, "runs", "finished", "early_stopped", "seeds",
                    *[f"{c} {s}" for c in stats for s in ("mean", "std", "n")],
                    f"{rep.metric} ci_low", f"{rep.metric} ci_high",
                    "baseline", "delta", "test", "p", "p_holm", "significant", "pareto"])
        for row in rep.rows:
            seeds = ";".join(sorted({r.seed for r in row.runs if r.seed is not None}))
            t = row.test if row.test is not None and row.test.p is not None else None
            w.writerow([row.params[k] for k in rep.keys]
                       + [len(row.runs), row.count("finished"), row.count("early-stopped"), seeds]
                       + [x for c in stats for x in row.stats[c]]
                       + (["", ""] if row.ci is None else list(row.ci))
                       + [row.baseline, "" if row.test is None else row.test.delta]
                       + (["", "", "", ""] if t is None else [t.kind, t.p, t.p_holm, t.significant])
                       + [row.pareto])


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")


def _numeric(values: list[Any]) -> bool:
    return all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)


def plot_metric_vs_params(rep: Report, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    runs = [(row, r) for row in rep.rows for r in row.runs]
    for key in rep.keys:
        pts = [(row.params[key], r, r.value(rep.metric)) for row, r in runs if row.params[key] != MISSING]
        pts = [(x, r, v) for x, r, v in pts if v is not None and math.isfinite(v)]
        if not pts:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        xs = [x for x, _, _ in pts]
        numeric = _numeric(xs)
        if numeric:
            pos = {x: x for x in xs}
            if min(xs) > 0 and max(xs) / min(xs) >= 100:
                ax.set_xscale("log")
        else:
            labels = list(dict.fromkeys(sorted(xs, key=str)))
            pos = {x: i for i, x in enumerate(labels)}
            ax.set_xticks(range(len(labels)), [_fmt_param(x) for x in labels], rotation=20, ha="right")
        for state, marker in (("finished", "o"), ("early-stopped", "x")):
            sel = [(pos[x], v) for x, r, v in pts if r.state == state]
            if sel:
                ax.scatter(*zip(*sel, strict=True), marker=marker, alpha=0.7, label=state)
        means = {}
        for x, r, v in pts:
            if r.state == "finished":
                means.setdefault(pos[x], []).append(v)
        if means:
            xs_m = sorted(means)
            stats = [_stats(means[x]) for x in xs_m]
            # a line only where the axis is ordered: categories get a bar per mean
            ax.errorbar(xs_m, [s[0] for s in stats], yerr=[s[1] for s in stats], color="black", capsize=3,
                        fmt="-" if numeric else "_", markersize=18, label="mean ± std (finished)")
        ax.set_xlabel(key)
        ax.set_ylabel(rep.metric)
        ax.set_title(f"{rep.metric} vs {key}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
        fig.tight_layout()
        path = out / f"{_slug(rep.metric)}_vs_{_slug(key)}.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        files.append(path)
    return files


def plot_learning_curves(rep: Report, uri: str, out: Path, top: int = CURVES_TOP) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    drawn = 0
    for i, row in enumerate(rep.rows[:top]):
        label = ", ".join(f"{k}={_fmt_param(v)}" for k, v in row.params.items()) or "base"
        for j, r in enumerate(row.runs):
            hist = tracking.metric_history(uri, r.run_id, rep.metric)
            if not hist:
                continue
            ax.plot([s for s, _ in hist], [v for _, v in hist], color=f"C{i}", marker=".",
                    linestyle="-" if r.state == "finished" else ":", label=label if j == 0 else None)
            drawn += 1
    if not drawn:
        plt.close(fig)
        return None
    ax.set_xlabel("step")
    ax.set_ylabel(rep.metric)
    ax.set_title(f"learning curves of the best {min(top, len(rep.rows))} configurations")
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    path = out / f"learning_curves_{_slug(rep.metric)}.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


COST_AXES = {  # the score-against-cost plot's panels: cost metric -> axis label (with units)
    "cost/gflop_per_sample": "GFLOP per sample (training forward + backward, counted)",
    "cost/device_hours": "device-hours (GPU-hours; on CPU, CPU-hours of the cores reserved)",
}


def _label(row: Row) -> str:
    """A row's parameters, short: the last part of each key, conditional ones that did not apply left out."""
    return ", ".join(f"{k.rsplit('.', 1)[-1]}={_fmt_param(v)}" for k, v in row.params.items() if v != MISSING) \
        or "base"


def plot_score_vs_cost(rep: Report, out: Path) -> Path | None:
    """The sweep metric (mean ± std over seeds) against each cost of COST_AXES, one panel each, the
    Pareto front drawn and labelled, the baseline starred. Rows with finished runs only."""
    panels = [c for c in COST_AXES if c in rep.cost_columns and _costed(rep.rows, rep.metric, c)]
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), sharey=True, squeeze=False)
    for ax, cost in zip(axes[0], panels, strict=True):
        rows = _costed(rep.rows, rep.metric, cost)
        xs = [r.stats[cost][0] for r in rows]
        ys = [r.stats[rep.metric][0] for r in rows]
        front = pareto_front(list(zip(xs, ys, strict=True)), rep.mode)
        kinds = [("configuration (mean ± std over seeds)", "C0", lambda r: not (r.test and r.test.significant is False)),
                 (f"not significantly different from the baseline (Holm p ≥ {ALPHA:g})", "0.6",
                  lambda r: r.test is not None and r.test.significant is False)]
        for label, color, which in kinds:
            sel = [(x, y, r.stats[rep.metric][1]) for r, x, y in zip(rows, xs, ys, strict=True) if which(r)]
            if sel:
                ax.errorbar([x for x, _, _ in sel], [y for _, y, _ in sel], yerr=[e for _, _, e in sel], fmt="o",
                            color=color, alpha=0.85, capsize=3, label=label)
        on = sorted((x, y) for x, y, f in zip(xs, ys, front, strict=True) if f)
        ax.plot([x for x, _ in on], [y for _, y in on], color="C3", drawstyle="steps-post", linewidth=1.5,
                marker="o", markerfacecolor="none", markersize=11, label="Pareto front")
        for r, x, y, f in zip(rows, xs, ys, front, strict=True):
            if f or r.baseline:
                ax.annotate(_label(r), (x, y), textcoords="offset points", xytext=(6, 6), fontsize=7)
            if r.baseline:
                ax.scatter([x], [y], marker="*", s=260, color="gold", edgecolors="black", zorder=5,
                           label="baseline")
        if min(xs) > 0 and max(xs) / min(xs) >= 10:
            ax.set_xscale("log")
        ax.margins(x=0.2, y=0.12)  # room for the labels
        ax.set_xlabel(COST_AXES[cost])
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small", loc="best")
    better = "higher" if rep.mode == "max" else "lower"
    axes[0][0].set_ylabel(f"{rep.metric} ({better} is better)")
    left_out = sum(r.partial for r in rep.rows)
    fig.suptitle(f"{rep.metric} against cost ({rep.title})"
                 + (f"; {left_out} configuration(s) stopped early left out" if left_out else ""))
    fig.tight_layout()
    path = out / f"{_slug(rep.metric)}_vs_cost.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_importance(rep: Report, out: Path) -> Path | None:
    """Horizontal bars: each parameter's fANOVA importance, one bar per sweep that has them."""
    params, have = _importance_table(rep)
    if not have:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 1.2 + 0.45 * len(params) * max(1, len(have) / 2)))
    height = 0.8 / len(have)
    for j, i in enumerate(have):
        ys = [n + (j - (len(have) - 1) / 2) * height for n in range(len(params))]
        bars = ax.barh(ys, [i["values"].get(k, 0.0) for k in params], height=height, color=f"C{j}",
                       label=f"sweep {i['sweep']} ({i['trials']} trials)")
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=2)
    ax.set_yticks(range(len(params)), params)
    ax.invert_yaxis()  # the most important on top
    scored = ", ".join(sorted({selected_key(i["metric"]) for i in have}))
    ax.set_xlabel(f"fANOVA importance for {scored} (share; sums to 1)")
    ax.set_xlim(0, 1.12)  # room for the labels
    ax.set_title(f"parameter importance ({rep.title})")
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize="small", loc="lower right")
    fig.tight_layout()
    path = out / "parameter_importance.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _check_metric(metric: str, trials: list[TrialRun]) -> None:
    """A metric asked for by name must be one the runs logged: else every cell would be n/a."""
    logged = sorted({k.removeprefix("best_").removeprefix(SELECTED_PREFIX) for t in trials for k in t.metrics})
    if metric not in logged:
        shown = ", ".join(logged[:40]) + (f", ... ({len(logged)} in all)" if len(logged) > 40 else "")
        raise ReportError(f"--metric {metric!r}: no trial run logged it; the runs have: {shown or 'no metric'}")



def make_report(uri: str, experiment: str | None = None, parent_run_id: str | None = None,
                out_dir: str | Path | None = None, metric: str | None = None, log: bool = True,
                baseline: dict[str, Any] | None = None) -> Report:
    """Write table.md, table.csv and the plots to `out_dir`; log them to the parent run(s).
    `baseline`: the configuration rows are tested against (default: the sweep's)."""
    uri = tracking.resolve_tracking_uri(uri)
    trials, parents = collect(uri, experiment, parent_run_id)
    if parent_run_id is not None:
        title = f"sweep {parents[0].tags.get(T.SWEEP, parents[0].name)}"
    else:
        title = f"experiment {experiment}"
    if metric is not None:
        _check_metric(metric, trials)
    metric = metric or _sweep_metric(parents)
    mode = _sweep_mode(parents)
    out = Path(out_dir or Path("reports") / _slug(title.split(" ", 1)[1])).resolve()
    check_writable_dir(out, "--out")  # before anything is written (jobs/report.py checked a given one already)
    rep = build_report(trials, parents, metric=metric, mode=mode, title=title, baseline=baseline)
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(to_markdown(rep))
    write_csv(rep, out / "table.csv")
    plot_metric_vs_params(rep, out)
    plot_learning_curves(rep, uri, out)
    plot_score_vs_cost(rep, out)
    if plot_importance(rep, out) is not None:
        write_importance_csv(rep, out / "importance.csv")
    if log:
        where = "report" if parent_run_id is not None else "report_experiment"
        used = {t.parent_run_id for row in rep.rows for t in row.runs}
        for pid in rep.parents:
            if pid in used:
                tracking.log_artifacts(uri, pid, out, where)
    rep.out_dir = str(out)
    return rep
