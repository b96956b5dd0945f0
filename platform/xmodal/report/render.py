"""A report's text, rendered from its table in memory (the build writes each file once, and its callers
print or tag the Markdown without reading it back): table.md (the table, a line per column under it,
the notes, the parameter importances), table.csv (every statistic, the std and n too) and
importance.csv.

The table shows each row's sweep metric as mean ± std with its confidence interval, the other columns
as mean ± std, the test against the baseline (a row with adjusted p >= 0.05 is marked "n.s.", "n.s.
after Holm" where its own p was below), the cost means and the Pareto mark; a row whose runs were all
stopped early is marked †.
"""

from __future__ import annotations

import csv
import io
import math

from xmodal.base.scores import selected_key
from xmodal.report.collect import fmt_param
from xmodal.report.stats import (
    ALPHA,
    CONFIDENCE,
    COST_COLUMNS,
    MISSING,
    PAIRED,
    PARETO_COST,
    WELCH,
    Row,
    Table,
    importance_table,
)


def _fmt(x: float) -> str:
    if math.isnan(x):
        return "n/a"
    return f"{x:.4f}" if abs(x) < 1000 else f"{x:.4g}"


def _cell(stats: tuple[float, float, int]) -> str:
    mean, std, n = stats
    return _fmt(mean) if n <= 1 else f"{_fmt(mean)} ± {_fmt(std)}"


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


def _family(table: Table) -> int:
    """The number of rows tested against the baseline: Holm's m."""
    return sum(r.test is not None and r.test.p is not None for r in table.rows)


def _ci_header(table: Table) -> str:
    return f"{CONFIDENCE:.0%} CI"


def _test_header(table: Table) -> str:
    if not _family(table):
        return f"vs baseline ({table.metric}; none tested)"
    return f"vs baseline ({table.metric}; Holm over {_family(table)} rows, α={ALPHA:g})"


def _legend(table: Table, tested: bool) -> list[str]:
    """One line per column, under the table."""
    lines = ["Columns:", ""]
    if table.keys:
        lines.append(f"- {', '.join(table.keys)}: the configuration (its ablation parameters).")
    lines += [
             "- runs: its runs (seeds); runs stopped early by the scheduler count in the statistics only where "
             "a configuration has no finished run.",
             f"- {table.metric}: mean ± sample std over the finished runs of each run's selected score "
             f"(`{selected_key(table.metric)}`: its best evaluation, the checkpoint it keeps, the value the sweep "
             "ranked it by).",
             f"- {_ci_header(table)}: the {CONFIDENCE:.0%} confidence interval of that mean, Student t: mean ± "
             f"t({1 - (1 - CONFIDENCE) / 2:g}, n-1)·std/√n over the same runs (none for a single run)."]
    others = table.columns[1:]
    if others:
        lines.append(f"- {', '.join(others)}: mean ± std of the selected model's value where the job logs it "
                     "(`best_<metric>`), else the last evaluation.")
    if tested and not _family(table):
        lines.append("- vs baseline: the difference of the row's mean from the baseline row's; no row is tested: "
                     "a test needs two finished runs in the row and in the baseline.")
    elif tested:
        lines.append(f"- vs baseline: the difference of the row's mean from the baseline row's; the test on the "
                     f"finished runs' `{table.metric}`: {PAIRED} (paired t-test on the per-seed differences) where "
                     f"the row and the baseline finished the same seeds, each once, else {WELCH} (Welch's t-test, "
                     f"unequal variances); its two-sided p; Holm p: adjusted by Holm–Bonferroni over the "
                     f"{_family(table)} rows tested, so that the chance of calling any row different when none is "
                     f"stays at most α = {ALPHA:g}. n.s.: Holm p ≥ α (n.s. after Holm: p alone < α). Rows or a "
                     "baseline with fewer than two finished runs are not tested.")
    if table.cost_columns:
        lines.append("- Cost (the mean over a row's runs; std in table.csv), logged by the job: parameters; GFLOP "
                     "per sample of one training forward + backward, counted (FlopCounterMode); training "
                     "samples/s; peak memory (GPU: max allocated; CPU: the worker's peak RSS); wall time; "
                     "device-hours = wall x workers x devices per worker (GPU-hours, or on CPU the CPU-hours "
                     "of the cores reserved).")
    if PARETO_COST in table.cost_columns:
        lines.append(f"- Pareto ◆: on the Pareto front of `{table.metric}` against GFLOP per sample (no other row "
                     "is as good for less compute).")
    return [*lines, ""]


def to_markdown(table: Table) -> str:
    """table.md's text: the title, the table, a line per column, the notes, the parameter importances."""
    best = "highest" if table.mode == "max" else "lowest"
    tested = any(r.baseline for r in table.rows)
    caption = f"Sorted by `{table.metric}` ({best} first); mean ± std over the runs of a configuration (seeds)"
    if tested and _family(table):
        caption += (f"; rows are tested against the baseline with the family-wise error rate held at "
                    f"α = {ALPHA:g} over the {_family(table)} rows tested (Holm–Bonferroni)")
    lines = [f"# {table.title}", "", caption + ".", ""]
    pareto = PARETO_COST in table.cost_columns
    head = [*table.keys, "runs", table.metric, _ci_header(table), *table.columns[1:]] \
        + ([_test_header(table)] if tested else []) \
        + [COST_COLUMNS[c][0] for c in table.cost_columns] + (["Pareto"] if pareto else [])
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in table.rows:
        mark = " †" if row.partial else ""
        scores = [_cell(row.stats[c]) + mark for c in table.columns]
        cells = [fmt_param(row.params[k]) for k in table.keys] + [_runs_cell(row)] + \
            [scores[0], _ci_cell(row), *scores[1:]] + ([_test_cell(row)] if tested else []) + \
            [_cost_cell(row.stats[c], COST_COLUMNS[c][1]) for c in table.cost_columns] + \
            (["◆" if row.pareto else ""] if pareto else [])
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines += _legend(table, tested)
    notes = list(table.notes)
    if any(r.partial for r in table.rows):
        notes.append("† every run of this configuration was stopped early by the scheduler: its values at the stop.")
    if MISSING in {str(v) for r in table.rows for v in r.params.values()}:
        notes.append(f"{MISSING}: the parameter did not apply (its `when:` condition was false).")
    if table.skipped:
        notes.append("Left out: " + ", ".join(f"{n} {s}" for s, n in sorted(table.skipped.items())) + " run(s).")
    lines += [x for note in notes for x in (note, "")]  # a paragraph each
    lines += _importance_markdown(table)
    return "\n".join(lines).rstrip() + "\n"


def _importance_markdown(table: Table) -> list[str]:
    if not table.importance:
        return []
    params, have = importance_table(table)
    lines = ["", "## Parameter importance", ""]
    for i in table.importance:
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


def importance_csv(table: Table) -> str | None:
    """importance.csv's text: a line per sweep and parameter; None where no sweep has importances."""
    params, have = importance_table(table)
    if not have:
        return None
    f = io.StringIO()
    w = csv.writer(f)
    w.writerow(["sweep", "trials", "parameter", "importance"])
    for i in have:
        for k in params:
            if k in i["values"]:
                w.writerow([i["sweep"], i["trials"], k, i["values"][k]])
    return f.getvalue()


def to_csv(table: Table) -> str:
    """table.csv's text: a line per row, every statistic (mean, std and n of each column), the test."""
    f = io.StringIO()
    w = csv.writer(f)
    stats = [*table.columns, *table.cost_columns]
    w.writerow([*table.keys, "runs", "finished", "early_stopped", "seeds",
                *[f"{c} {s}" for c in stats for s in ("mean", "std", "n")],
                f"{table.metric} ci_low", f"{table.metric} ci_high",
                "baseline", "delta", "test", "p", "p_holm", "significant", "pareto"])
    for row in table.rows:
        seeds = ";".join(sorted({r.seed for r in row.runs if r.seed is not None}))
        t = row.test if row.test is not None and row.test.p is not None else None
        w.writerow([row.params[k] for k in table.keys]
                   + [len(row.runs), row.count("finished"), row.count("early-stopped"), seeds]
                   + [x for c in stats for x in row.stats[c]]
                   + (["", ""] if row.ci is None else list(row.ci))
                   + [row.baseline, "" if row.test is None else row.test.delta]
                   + (["", "", "", ""] if t is None else [t.kind, t.p, t.p_holm, t.significant])
                   + [row.pareto])
    return f.getvalue()
