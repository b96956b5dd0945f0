"""Ablation reports: MLflow runs of sweeps -> a comparison table (Markdown + CSV) and plots (PNG).

    python jobs/report.py (--experiment NAME | --parent-run RUN_ID) [--out DIR] [--metric KEY]

One row per configuration (runs that differ only in their seed), its metrics as mean ± std, the sweep
metric's 95 % confidence interval, a t-test against the baseline row (Holm–Bonferroni over the rows),
the runs' cost beside the scores with the Pareto front, and each sweep's parameter importances (the
sweep driver's fANOVA, read from its parent run). Everything is read through `xmodal.tracking`.

The rooms, each importing only those above it in this list:

    collect.py  the trial and parent runs read from MLflow; a run's state and its value of a metric
    stats.py    the table: runs grouped into rows by configuration, mean ± std, intervals, tests, Pareto
    render.py   table.md, table.csv and importance.csv as text, in memory
    plots.py    the PNG plots
    build.py    `make_report`: collect, compute, render, write each file once, log the folder to the
                parent run(s); returns the `Report` (table, Markdown, folder, files)
"""

from xmodal.report.build import Report, make_report
from xmodal.report.collect import ReportError, TrialRun, collect_runs, parse_value
from xmodal.report.stats import Row, Table, Test, build_table

__all__ = ["Report", "ReportError", "Row", "Table", "Test", "TrialRun", "build_table", "collect_runs", "make_report",
           "parse_value"]
