"""A report built: the runs collected, the rows' statistics, the files written to a folder and logged
to the sweep's parent run(s) (artifact folder `report`, or `report_experiment` for an experiment
report).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from xmodal import run_tags as T
from xmodal import tracking
from xmodal.outputs import check_writable_dir
from xmodal.report.collect import check_metric, collect_runs, sweep_metric, sweep_mode
from xmodal.report.plots import (
    plot_importance,
    plot_learning_curves,
    plot_metric_vs_params,
    plot_score_vs_cost,
    slug,
)
from xmodal.report.render import to_markdown, write_csv, write_importance_csv
from xmodal.report.stats import Report, build_report


def make_report(uri: str, experiment: str | None = None, parent_run_id: str | None = None,
                out_dir: str | Path | None = None, metric: str | None = None, log: bool = True,
                baseline: dict[str, Any] | None = None) -> Report:
    """Write table.md, table.csv and the plots to `out_dir`; log them to the parent run(s).
    `baseline`: the configuration rows are tested against (default: the sweep's)."""
    uri = tracking.resolve_tracking_uri(uri)
    trials, parents = collect_runs(uri, experiment, parent_run_id)
    if parent_run_id is not None:
        title = f"sweep {parents[0].tags.get(T.SWEEP, parents[0].name)}"
    else:
        title = f"experiment {experiment}"
    if metric is not None:
        check_metric(metric, trials)
    metric = metric or sweep_metric(parents)
    mode = sweep_mode(parents)
    out = Path(out_dir or Path("reports") / slug(title.split(" ", 1)[1])).resolve()
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
