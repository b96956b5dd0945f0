"""A report's second room: the trial runs grouped into the table's rows, and the statistics of each.

One row per configuration: runs whose ablation parameters are equal and that differ only in their
seed (`train.seed`, or separate sweeps of the same space with other seeds) are grouped, and their
metrics summarised as mean ± std. Columns: the ablation parameters (a conditional parameter whose
condition did not hold is `MISSING`), the sweep metric, the other summary metrics of its split
(eval/* or valid/*), test/* where the job logs them and the sweep metric under each robustness
condition. Statistics use the runs that trained to the end; a configuration whose runs were all
stopped early by the scheduler has their values, marked partial.
Each row's mean of the sweep metric has a 95 % Student t confidence interval (mean ± t(0.975, n-1)
s/√n over the same runs). Significance: each row's finished runs are compared with the baseline row's
on the sweep metric by a two-sided t-test: paired (scipy.stats.ttest_rel on the per-seed differences)
where the row and the baseline finished the same seeds, each once; else Welch's (unequal variances,
scipy.stats.ttest_ind). The p-values of the rows tested are Holm–Bonferroni adjusted, so that the
chance of marking any row significant when none differs is at most 0.05 over the whole table. The
baseline row is the configuration asked for (`--baseline`), else the space's `baseline:`, else its
first `try_first` one (a tag or param of the parent run). Rows with fewer than two finished runs, or
a baseline with fewer, are not tested.
Cost: every job logs `cost/*` (xmodal.core.cost); a row has their means, and the rows on the Pareto
front of score against GFLOP per sample are marked.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from xmodal.base import run_tags as T
from xmodal.base.scores import SELECTED_PREFIX
from xmodal.report.collect import (
    ReportError,
    TrialRun,
    baseline_of,
    fmt_param,
    importance_of,
    sweep_metric,
    sweep_mode,
)

if TYPE_CHECKING:
    from xmodal.tracking import RunRecord

MISSING = "-"  # a conditional parameter that did not apply to a run
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
# Rows named in full in the error of a --baseline that names none (the rest are counted).
ROWS_LISTED = 20


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
class Table:
    """A report's content: its rows, best first, and what the files say about them."""

    title: str
    metric: str
    mode: str
    keys: list[str]
    columns: list[str]
    rows: list[Row]
    skipped: dict[str, int]  # state -> runs left out of the table (failed, running, ...)
    parents: list[str]
    cost_columns: list[str] = field(default_factory=list)  # the cost/* metrics some run logged
    baseline: dict[str, Any] | None = None  # the baseline configuration asked for
    notes: list[str] = field(default_factory=list)  # e.g. why no row is the baseline
    # per sweep parent that logged them (T.IMPORTANCE), newest first: {"sweep", "trials", "values", ...}
    importance: list[dict[str, Any]] = field(default_factory=list)


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


def mean_std(values: list[float | None]) -> tuple[float, float, int]:
    """(mean, sample std, n) of the finite values; (nan, nan, 0) where there is none."""
    vals = [v for v in values if v is not None and math.isfinite(v)]
    if not vals:
        return (math.nan, math.nan, 0)
    mean = sum(vals) / len(vals)
    std = math.sqrt(sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)) if len(vals) > 1 else 0.0
    return (mean, std, len(vals))


def numeric(values: list[Any]) -> bool:
    """Numbers, not booleans: values an axis can order."""
    return all(isinstance(v, int | float) and not isinstance(v, bool) for v in values)


def _same(a: Any, b: Any) -> bool:
    """A value read back from a tag against one from JSON: 1 == 1.0, "True" is not 1."""
    if numeric([a]) and numeric([b]):
        return float(a) == float(b)
    return str(a) == str(b)


def _baseline_row(rows: list[Row], keys: list[str], baseline: dict[str, Any], notes: list[str],
                  asked: bool = False) -> Row | None:
    """The one row of `baseline`'s configuration. When it has none: the sweep's own baseline gets a
    note in the report (no tests); a baseline `asked` for (--baseline) is a ReportError listing the
    rows, since a report without the tests asked for would look complete."""
    wanted = {k: v for k, v in baseline.items() if k not in T.REPLICATE_KEYS}
    described = ", ".join(f"{k}={fmt_param(v)}" for k, v in wanted.items())
    unknown = [k for k in wanted if k not in keys]
    found = [] if unknown else [r for r in rows if all(_same(r.params[k], v) for k, v in wanted.items())]
    if len(found) == 1:
        return found[0]
    if unknown:
        why = (f"names {', '.join(map(repr, unknown))}, which is not an ablation parameter of these runs "
               f"({', '.join(keys) or 'none'})")
    else:
        why = "matches no row" if not found else f"matches {len(found)} rows"
    if asked:
        listed = "; ".join(" ".join(f"{k}={fmt_param(v)}" for k, v in r.params.items()) or "(no parameter)"
                           for r in (found or rows)[:ROWS_LISTED])
        more = f"; ... ({len(found or rows)} in all)" if len(found or rows) > ROWS_LISTED else ""
        which = "the rows it matches" if found else "the rows are"
        raise ReportError(f"--baseline {' '.join(f'{k}={fmt_param(v)}' for k, v in wanted.items())}: {why}; "
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
    m, b = mean_std(values), mean_std(baseline)
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
    mean, std, _ = mean_std(diffs)
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
    mean, std, n = mean_std(values)
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


def costed(rows: list[Row], metric: str, cost: str) -> list[Row]:
    """Rows with a finite mean score and cost from finished runs (the Pareto front's candidates)."""
    return [r for r in rows if not r.partial and cost in r.stats and math.isfinite(r.stats[cost][0])
            and math.isfinite(r.stats[metric][0])]


def importance_table(table: Table) -> tuple[list[str], list[dict[str, Any]]]:
    """(parameters, the sweeps that have values): parameters by their importance in the newest sweep."""
    have = [i for i in table.importance if i.get("values")]
    params: list[str] = []
    for i in have:
        params += [k for k in sorted(i["values"], key=lambda k: -i["values"][k]) if k not in params]
    return params, have


def build_table(trials: list[TrialRun], parents: list[RunRecord], metric: str | None = None, mode: str | None = None,
                columns: list[str] | None = None, title: str = "ablation",
                baseline: dict[str, Any] | None = None) -> Table:
    """The rows of `trials` and their statistics. `baseline`: the configuration the rows are tested
    against (default: the parents')."""
    metric = metric or sweep_metric(parents)
    mode = mode or sweep_mode(parents)
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
        row.stats = {c: mean_std([r.value(c) for r in used]) for c in [*columns, *cost_columns]}
        scores = [r.value(metric) for r in used]
        row.ci = t_interval([v for v in scores if v is not None and math.isfinite(v)])
    sign = -1.0 if mode == "max" else 1.0

    def order(row: Row):
        mean = row.stats[metric][0]
        return (row.partial, math.isnan(mean), sign * mean if not math.isnan(mean) else 0.0)

    rows = sorted(groups.values(), key=order)
    table = Table(title=title, metric=metric, mode=mode, keys=keys, columns=columns, rows=rows, skipped=skipped,
                  parents=[p.run_id for p in parents], cost_columns=cost_columns,
                  baseline=baseline if baseline is not None else baseline_of(parents),
                  importance=importance_of(parents))
    base = _baseline_row(rows, keys, table.baseline, table.notes, asked=baseline is not None) \
        if table.baseline is not None else None
    if base is not None:
        base.baseline = True
        for row in rows:
            if row is not base:
                row.test = _test(row, base, metric)
        tested = [r.test for r in rows if r.test is not None and r.test.p is not None]
        for t, adjusted in zip(tested, holm([t.p for t in tested]), strict=True):
            t.p_holm = adjusted
    if PARETO_COST in cost_columns:
        candidates = costed(rows, metric, PARETO_COST)
        points = [(r.stats[PARETO_COST][0], r.stats[metric][0]) for r in candidates]
        for row, on in zip(candidates, pareto_front(points, mode), strict=True):
            row.pareto = on
    return table
