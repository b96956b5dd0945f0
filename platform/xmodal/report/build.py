"""A report built: the runs collected, the rows' statistics, the text rendered in memory, every file
written once into a stage of the output folder and published whole (xmodal.base.outputs: a new or empty
folder, or this command's own earlier report, which is replaced; with `overwrite` a folder holding other
files, which stay), then its files logged to the sweep's parent run(s) (artifact folder `report`, or
`report_experiment` for an experiment report). `make_report` returns all of it as a `Report`: its
callers print the Markdown or put it on the parent run without reading a file back.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xmodal import tracking
from xmodal.base import run_tags as T
from xmodal.base.outputs import Output
from xmodal.report.collect import ReportError, check_metric, collect_runs, sweep_metric, sweep_mode
from xmodal.report.plots import (
    plot_importance,
    plot_learning_curves,
    plot_metric_vs_params,
    plot_score_vs_cost,
    slug,
)
from xmodal.report.render import importance_csv, to_csv, to_markdown
from xmodal.report.stats import Table, build_table


@dataclass(frozen=True)
class Report:
    """A report as built and written."""

    table: Table  # the rows, best first, and their statistics
    markdown: str  # table.md's text: what the command line prints and the sweep puts on its parent run
    out_dir: Path
    files: tuple[Path, ...]  # every file written to out_dir, table.md first (all of them are logged)


def report_output(out_dir: str | Path, overwrite: bool = False) -> Output:
    """Where a report goes, under the output policy (checked before anything is read or written)."""
    return Output(out_dir, "--out", "report", overwrite=overwrite)


MODES = {"max": "higher", "min": "lower"}  # a metric's mode -> which of its values is better


def _direction(metric: str | None, mode: str | None, swept: str | None, swept_mode: str) -> str:
    """Which way the report's metric is better. The sweep's mode belongs to the sweep's metric: applied
    to another (a loss's `min` to an accuracy) it would sort and pick the Pareto front backwards."""
    if mode is not None and mode not in MODES:
        raise ReportError(f"--mode {mode!r}: expected one of {', '.join(MODES)}")
    if metric is not None and metric != swept and mode is None:
        raise ReportError(f"--metric {metric!r}: the sweep's mode ({swept_mode}) is for its own metric "
                          f"{swept!r}; expected --mode max or --mode min (is higher or lower {metric} better?)")
    if mode is not None and (metric is None or metric == swept) and mode != swept_mode:
        raise ReportError(f"--mode {mode}: the sweep's metric {swept!r} is better {MODES[swept_mode]} (mode "
                          f"{swept_mode}); expected --mode only with a --metric other than the sweep's")
    return mode or swept_mode


def make_report(uri: str, experiment: str | None = None, parent_run_id: str | None = None,
                out_dir: str | Path | Output | None = None, metric: str | None = None, log: bool = True,
                baseline: dict[str, Any] | None = None, overwrite: bool = False, mode: str | None = None) -> Report:
    """Write table.md, table.csv, importance.csv (where a sweep has importances) and the plots to
    `out_dir` (default reports/NAME); log them to the parent run(s) unless not `log`. `baseline`: the
    configuration rows are tested against (default: the sweep's). `mode` (max or min): which way
    `metric` is better; required for a metric other than the sweep's, whose mode is the sweep's."""
    uri = tracking.resolve_tracking_uri(uri)
    trials, parents = collect_runs(uri, experiment, parent_run_id)
    if parent_run_id is not None:
        title = f"sweep {parents[0].tags.get(T.SWEEP, parents[0].name)}"
    else:
        title = f"experiment {experiment}"
    if metric is not None:
        check_metric(metric, trials)
    mode = _direction(metric, mode, sweep_metric(parents), sweep_mode(parents))
    metric = metric or sweep_metric(parents)
    output = out_dir if isinstance(out_dir, Output) else report_output(
        out_dir or Path("reports") / slug(title.split(" ", 1)[1]), overwrite)  # before anything is written
    table = build_table(trials, parents, metric=metric, mode=mode, title=title, baseline=baseline)
    markdown = to_markdown(table)
    texts = {"table.md": markdown, "table.csv": to_csv(table), "importance.csv": importance_csv(table)}
    with output.stage() as stage:
        written = []
        for name, text in texts.items():
            if text is not None:
                # newline="": the CSV writer ends its lines with \r\n itself
                (stage.tmp / name).write_text(text, newline="")
                written.append(stage.tmp / name)
        written += plot_metric_vs_params(table, stage.tmp)
        written += [p for p in (plot_learning_curves(table, uri, stage.tmp), plot_score_vs_cost(table, stage.tmp),
                                plot_importance(table, stage.tmp)) if p is not None]
        out = stage.publish()
    files = tuple(out / p.name for p in written)
    if log:
        where = "report" if parent_run_id is not None else "report_experiment"
        used = {t.parent_run_id for row in table.rows for t in row.runs}
        for pid in table.parents:
            if pid in used:
                for f in files:  # the report's own files: not what else the folder holds
                    tracking.log_artifact(uri, pid, f, where)
    return Report(table=table, markdown=markdown, out_dir=out, files=files)
