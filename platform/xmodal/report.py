"""Ablation reports: MLflow runs of sweeps -> a comparison table (Markdown + CSV) and plots (PNG).

    python jobs/report.py (--experiment NAME | --parent-run RUN_ID) [--out DIR] [--metric KEY]

One row per configuration: runs whose ablation parameters are equal and that differ only in their
seed (`train.seed`, or separate sweeps of the same space with other seeds) are grouped, and their
metrics shown as mean ± std. Columns: the ablation parameters (a conditional parameter whose
condition did not hold shows as "-"), the number of runs, then the sweep metric, the other summary
metrics of its split (eval/* or valid/*) and test/* where the job logs them. Values are those of
each run's validation-selected model: the sweep metric's best evaluation (the run keeps its best
checkpoint by it), and `best_<metric>` where the job logs the selected model's values (MulT), else
the last evaluation. Statistics use the runs that trained to the end; a configuration whose runs
were all stopped early by the scheduler shows their values, marked †.
Plots: the metric against each ablation parameter, and the learning curves of the best
configurations. Everything is read through `xmodal.tracking`; the files are also logged to the
sweep's parent run (artifact folder `report`, or `report_experiment` for an experiment report).
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

MISSING = "-"  # a conditional parameter that did not apply to a run
CURVES_TOP = 3  # configurations shown in the learning-curve plot


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
    selected: dict[str, float] = field(default_factory=dict)  # metric -> its best value over the run

    def value(self, key: str) -> float | None:
        """The value of the run's validation-selected model: the job's `best_<key>` where it logs one,
        else the best value over the run's evaluations (for the sweep metric, which is the metric the
        run keeps its best checkpoint by), else the last value."""
        if f"best_{key}" in self.metrics:
            return self.metrics[f"best_{key}"]
        return self.selected.get(key, self.metrics.get(key))


@dataclass
class Row:
    params: dict[str, Any]
    runs: list[TrialRun]
    stats: dict[str, tuple[float, float, int]] = field(default_factory=dict)  # metric -> (mean, std, n)
    partial: bool = False  # statistics come from early-stopped runs only

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
    return TrialRun(run_id=run.run_id, name=run.name, parent_run_id=run.parent_run_id, params=params,
                    seed=tags.get(T.SEED), state=_state(run), metrics=dict(run.metrics))


def collect(uri: str, experiment: str | None = None,
            parent_run_id: str | None = None) -> tuple[list[TrialRun], list[tracking.RunRecord]]:
    """(trial runs, parent runs) of one sweep or of every sweep in an experiment."""
    if (experiment is None) == (parent_run_id is None):
        raise ReportError("give exactly one of an experiment name or a parent run id")
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).exists():
        # MLflow would create an empty database: say where we looked instead
        raise ReportError(f"no MLflow database at {uri[len('sqlite:///'):]} (set --tracking-uri or "
                          "$MLFLOW_TRACKING_URI)")
    if parent_run_id is not None:
        try:
            parent = tracking.get_run(uri, parent_run_id)
        except tracking.RunNotFound as e:
            raise ReportError(f"parent run {parent_run_id!r} not found in {uri}: {e}") from None
        # Children that are trials: a pretrain-then-fine-tune chain also logs its pretraining stage there.
        runs = [r for r in tracking.child_runs(uri, parent_run_id) if r.tags.get(T.KIND) == "trial"]
        parents = [parent]
    else:
        exp_id = tracking.get_experiment_id(uri, experiment)
        if exp_id is None:
            names = tracking.experiment_names(uri)
            raise ReportError(f"experiment {experiment!r} not found in {uri}; experiments: {', '.join(names)}")
        runs = tracking.search_runs(uri, [exp_id], f"tags.`{T.KIND}` = 'trial'")
        parents = tracking.search_runs(uri, [exp_id], f"tags.`{T.KIND}` = 'sweep'")
    runs = [r for r in runs if r.tags.get(T.ORPHANED) != "true"]
    return [_trial(r) for r in runs], parents


def _default_columns(metric: str, trials: list[TrialRun]) -> list[str]:
    """The sweep metric, the other summary metrics of its split (e.g. eval/<name> or valid/<name>, not
    per-task losses), then the test metrics where the job logs them (MulT: of the selected model), then
    the sweep metric's name under each robustness condition (robust/<condition>/<name>)."""
    split = metric.split("/")[0] + "/" if "/" in metric else None
    keys = {k for t in trials for k in t.metrics if k.count("/") == 1 and k != metric}
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


def build_report(trials: list[TrialRun], parents: list[tracking.RunRecord], metric: str | None = None, mode: str | None = None,
                 columns: list[str] | None = None, title: str = "ablation") -> Report:
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

    groups: dict[str, Row] = {}
    for t in trials:
        params = {k: t.params.get(k, MISSING) for k in keys}
        groups.setdefault(json.dumps(params, sort_keys=True, default=str), Row(params, [])).runs.append(t)
    for row in groups.values():
        used = [r for r in row.runs if r.state == "finished"] or row.runs
        row.partial = all(r.state != "finished" for r in row.runs)
        row.stats = {c: _stats([r.value(c) for r in used]) for c in columns}
    sign = -1.0 if mode == "max" else 1.0

    def order(row: Row):
        mean = row.stats[metric][0]
        return (row.partial, math.isnan(mean), sign * mean if not math.isnan(mean) else 0.0)

    rows = sorted(groups.values(), key=order)
    return Report(title=title, metric=metric, mode=mode, keys=keys, columns=columns, rows=rows, skipped=skipped,
                  parents=[p.run_id for p in parents])


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


def _runs_cell(row: Row) -> str:
    stopped = row.count("early-stopped")
    return f"{len(row.runs)}" + (f" ({stopped} stopped early)" if stopped else "")


def to_markdown(rep: Report) -> str:
    best = "highest" if rep.mode == "max" else "lowest"
    lines = [f"# {rep.title}", "",
             f"Sorted by `{rep.metric}` ({best} first). Values: mean ± std over the runs of a configuration "
             f"(seeds). `{rep.metric}`: each run's best evaluation (the checkpoint it keeps, selected on "
             "validation); other columns: the selected model's values where the job logs them "
             "(`best_<metric>`), else the last evaluation.", ""]
    head = [*rep.keys, "runs", *rep.columns]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rep.rows:
        mark = " †" if row.partial else ""
        cells = [_fmt_param(row.params[k]) for k in rep.keys] + [_runs_cell(row)] + \
            [_cell(row.stats[c]) + mark for c in rep.columns]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    if any(r.partial for r in rep.rows):
        lines.append("† every run of this configuration was stopped early by the scheduler: its values at the stop.")
    if MISSING in {str(v) for r in rep.rows for v in r.params.values()}:
        lines.append(f"{MISSING}: the parameter did not apply (its `when:` condition was false).")
    if rep.skipped:
        lines.append("Left out: " + ", ".join(f"{n} {s}" for s, n in sorted(rep.skipped.items())) + " run(s).")
    return "\n".join(lines).rstrip() + "\n"


def write_csv(rep: Report, path: Path) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow([*rep.keys, "runs", "finished", "early_stopped", "seeds",
                    *[f"{c} {s}" for c in rep.columns for s in ("mean", "std", "n")]])
        for row in rep.rows:
            seeds = ";".join(sorted({r.seed for r in row.runs if r.seed is not None}))
            w.writerow([row.params[k] for k in rep.keys]
                       + [len(row.runs), row.count("finished"), row.count("early-stopped"), seeds]
                       + [x for c in rep.columns for x in row.stats[c]])


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


def make_report(uri: str, experiment: str | None = None, parent_run_id: str | None = None,
                out_dir: str | Path | None = None, metric: str | None = None, log: bool = True) -> Report:
    """Write table.md, table.csv and the plots to `out_dir`; log them to the parent run(s)."""
    uri = tracking.resolve_tracking_uri(uri)
    trials, parents = collect(uri, experiment, parent_run_id)
    if parent_run_id is not None:
        title = f"sweep {parents[0].tags.get(T.SWEEP, parents[0].name)}"
    else:
        title = f"experiment {experiment}"
    metric = metric or _sweep_metric(parents)
    mode = _sweep_mode(parents)
    for t in trials:
        hist = [v for _, v in tracking.metric_history(uri, t.run_id, metric)] if metric else []
        hist = [v for v in hist if math.isfinite(v)]
        if hist:
            t.selected[metric] = max(hist) if mode == "max" else min(hist)
    rep = build_report(trials, parents, metric=metric, mode=mode, title=title)
    out = Path(out_dir or Path("reports") / _slug(title.split(" ", 1)[1])).resolve()
    out.mkdir(parents=True, exist_ok=True)
    (out / "table.md").write_text(to_markdown(rep))
    write_csv(rep, out / "table.csv")
    plot_metric_vs_params(rep, out)
    plot_learning_curves(rep, uri, out)
    if log:
        where = "report" if parent_run_id is not None else "report_experiment"
        used = {t.parent_run_id for row in rep.rows for t in row.runs}
        for pid in rep.parents:
            if pid in used:
                tracking.log_artifacts(uri, pid, out, where)
    rep.out_dir = str(out)
    return rep
