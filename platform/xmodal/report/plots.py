"""A report's plots (PNG, matplotlib's Agg backend, imported when a plot is drawn): the sweep metric
against each ablation parameter, the learning curves of the best configurations (read from MLflow),
the score against cost (GFLOP per sample, device-hours) with the Pareto front and the baseline, and
the parameters' fANOVA importances.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

from xmodal import tracking
from xmodal.base.scores import selected_key
from xmodal.report.collect import fmt_param
from xmodal.report.stats import (
    ALPHA,
    MISSING,
    Row,
    Table,
    costed,
    importance_table,
    mean_std,
    numeric,
    pareto_front,
)

CURVES_TOP = 3  # configurations shown in the learning-curve plot


def slug(text: str) -> str:
    """`text` as part of a file name: runs of other characters become one `_`."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_")


def plot_metric_vs_params(table: Table, out: Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    runs = [(row, r) for row in table.rows for r in row.runs]
    for key in table.keys:
        pts = [(row.params[key], r, r.value(table.metric)) for row, r in runs if row.params[key] != MISSING]
        pts = [(x, r, v) for x, r, v in pts if v is not None and math.isfinite(v)]
        if not pts:
            continue
        fig, ax = plt.subplots(figsize=(6, 4))
        xs = [x for x, _, _ in pts]
        ordered = numeric(xs)
        if ordered:
            pos = {x: x for x in xs}
            if min(xs) > 0 and max(xs) / min(xs) >= 100:
                ax.set_xscale("log")
        else:
            labels = list(dict.fromkeys(sorted(xs, key=str)))
            pos = {x: i for i, x in enumerate(labels)}
            ax.set_xticks(range(len(labels)), [fmt_param(x) for x in labels], rotation=20, ha="right")
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
            stats = [mean_std(means[x]) for x in xs_m]
            # a line only where the axis is ordered: categories get a bar per mean
            ax.errorbar(xs_m, [s[0] for s in stats], yerr=[s[1] for s in stats], color="black", capsize=3,
                        fmt="-" if ordered else "_", markersize=18, label="mean ± std (finished)")
        files.append(_save(fig, ax, key, table.metric, f"{table.metric} vs {key}",
                           out / f"{slug(table.metric)}_vs_{slug(key)}.png"))
    return files


def plot_learning_curves(table: Table, uri: str, out: Path, top: int = CURVES_TOP) -> Path | None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    drawn = 0
    for i, row in enumerate(table.rows[:top]):
        label = ", ".join(f"{k}={fmt_param(v)}" for k, v in row.params.items()) or "base"
        for j, r in enumerate(row.runs):
            hist = tracking.metric_history(uri, r.run_id, table.metric)
            if not hist:
                continue
            ax.plot([s for s, _ in hist], [v for _, v in hist], color=f"C{i}", marker=".",
                    linestyle="-" if r.state == "finished" else ":", label=label if j == 0 else None)
            drawn += 1
    if not drawn:
        plt.close(fig)
        return None
    return _save(fig, ax, "step", table.metric,
                 f"learning curves of the best {min(top, len(table.rows))} configurations",
                 out / f"learning_curves_{slug(table.metric)}.png")


def _save(fig, ax, xlabel: str, ylabel: str, title: str, path: Path) -> Path:
    """A plot's axes labelled, gridded and with its legend, written to `path` (100 dpi) and closed."""
    import matplotlib.pyplot as plt

    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


COST_AXES = {  # the score-against-cost plot's panels: cost metric -> axis label (with units)
    "cost/gflop_per_sample": "GFLOP per sample (training forward + backward, counted)",
    "cost/device_hours": "device-hours (GPU-hours; on CPU, CPU-hours of the cores reserved)",
}


def _label(row: Row) -> str:
    """A row's parameters, short: the last part of each key, conditional ones that did not apply left out."""
    return ", ".join(f"{k.rsplit('.', 1)[-1]}={fmt_param(v)}" for k, v in row.params.items() if v != MISSING) \
        or "base"


def plot_score_vs_cost(table: Table, out: Path) -> Path | None:
    """The sweep metric (mean ± std over seeds) against each cost of COST_AXES, one panel each, the
    Pareto front drawn and labelled, the baseline starred. Rows with finished runs only."""
    panels = [c for c in COST_AXES if c in table.cost_columns and costed(table.rows, table.metric, c)]
    if not panels:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(panels), figsize=(6.5 * len(panels), 4.8), sharey=True, squeeze=False)
    for ax, cost in zip(axes[0], panels, strict=True):
        rows = costed(table.rows, table.metric, cost)
        xs = [r.stats[cost][0] for r in rows]
        ys = [r.stats[table.metric][0] for r in rows]
        front = pareto_front(list(zip(xs, ys, strict=True)), table.mode)
        kinds = [("configuration (mean ± std over seeds)", "C0", lambda r: not (r.test and r.test.significant is False)),
                 (f"not significantly different from the baseline (Holm p ≥ {ALPHA:g})", "0.6",
                  lambda r: r.test is not None and r.test.significant is False)]
        for label, color, which in kinds:
            sel = [(x, y, r.stats[table.metric][1]) for r, x, y in zip(rows, xs, ys, strict=True) if which(r)]
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
    better = "higher" if table.mode == "max" else "lower"
    axes[0][0].set_ylabel(f"{table.metric} ({better} is better)")
    left_out = sum(r.partial for r in table.rows)
    fig.suptitle(f"{table.metric} against cost ({table.title})"
                 + (f"; {left_out} configuration(s) stopped early left out" if left_out else ""))
    fig.tight_layout()
    path = out / f"{slug(table.metric)}_vs_cost.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_importance(table: Table, out: Path) -> Path | None:
    """Horizontal bars: each parameter's fANOVA importance, one bar per sweep that has them."""
    params, have = importance_table(table)
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
    ax.set_title(f"parameter importance ({table.title})")
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize="small", loc="lower right")
    fig.tight_layout()
    path = out / "parameter_importance.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
