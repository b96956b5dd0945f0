"""What a sweep trial costs beyond its training: N tiny MulT trials of the shipped ablation space
(search_spaces/mult_ablation.yaml, its first N variants) on the embedded default (local Ray, the
synthetic MulT store), with a throwaway MLflow file and storage. Prints, per trial and on average,
its life as Tune's driver saw it, its training (`time/training_s`) and where the rest went (the
`time/*` phases of xmodal.train.timeline, Tune's share), the sweep's wall time against the trials'
summed training, and whether the overhead is within its target: at most 10 % of the training or
5 s a trial, whichever is larger (docs/architecture.md, "Sweeps").
"""

from __future__ import annotations

import argparse
import shutil
import time
from pathlib import Path
from typing import Any

import yaml

from xmodal.console import say
from xmodal.train import timeline

SPACE = Path(__file__).resolve().parents[3] / "search_spaces" / "mult_ablation.yaml"
TARGET_RATIO, TARGET_S = 0.10, 5.0  # a trial's life outside training: at most the larger of the two
PHASES = ("prepare_s", "train_start_s", "worker_setup_s", "data_start_s", "train_end_s", "finish_s")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trials", type=int, default=4, help="trials, each a MulT variant (default 4, at most 10)")
    p.add_argument("--concurrent", type=int, default=1, help="trials at a time (default 1)")
    p.add_argument("--epochs", type=int, default=3, help="epochs per trial (the space's own: 12; default 3)")
    p.add_argument("--out", default="bench-results", help="folder for sweep-<timestamp>.json and .md")
    p.add_argument("--work", default=None, help="where the throwaway MLflow file and storage go "
                                                 "(default: the temp folder)")


def space_file(work: Path, trials: int, concurrent: int, epochs: int) -> Path:
    space = yaml.safe_load(SPACE.read_text())
    space.update(num_samples=trials, max_concurrent=concurrent, try_first=space["try_first"][:trials])
    space["parameters"]["model.variant"]["values"] = space["parameters"]["model.variant"]["values"][:trials]
    space["base"]["config"]["train"]["epochs"] = epochs
    space["base"]["config"]["mlflow"] = {"tracking_uri": f"sqlite:///{work / 'mlflow.db'}"}
    path = work / "bench_sweep.yaml"
    path.write_text(yaml.safe_dump(space, sort_keys=False))
    return path


def per_trial(runs) -> list[dict[str, Any]]:
    """The finished trials' figures, from their child runs' metrics."""
    out = []
    for r in sorted(runs, key=lambda r: r.name):
        m = r.metrics
        if timeline.TRIAL_LIFE not in m:
            continue
        row = {"trial": r.name.rsplit("-", 1)[-1], "variant": r.params.get("model.variant", "?"),
               "life_s": m[timeline.TRIAL_LIFE], "training_s": m["time/training_s"],
               "overhead_s": m[timeline.TRIAL_OVERHEAD], "tune_s": timeline.tune_s(m)}
        row.update({p: m.get(f"time/{p}") for p in PHASES})
        out.append(row)
    return out


def markdown(res: dict[str, Any]) -> str:
    m, r = res["meta"], res["result"]
    cols = ["trial", "variant", "life_s", "training_s", "overhead_s", *PHASES, "tune_s"]
    lines = [f"# Sweep overhead: {m['trials']} MulT trials, {m['concurrent']} at a time, {m['epochs']} epochs",
             "", f"{m['machine']}; {m['date']}; commit {m['git_commit']}; `{m['command']}`", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for t in r["trials"]:
        lines.append("| " + " | ".join(f"{t[c]:.1f}" if isinstance(t[c], float) else str(t[c]) for c in cols) + " |")
    lines += ["", f"- sweep wall time {r['sweep_wall_s']:.1f} s against {r['training_s_sum']:.1f} s of summed "
              f"training (ratio {r['wall_over_training']:.2f}; with {m['concurrent']} at a time the ideal is "
              f"{1 / m['concurrent']:.2f})",
              f"- overhead per trial: mean {r['overhead_s_mean']:.1f} s, {100 * r['overhead_ratio']:.0f} % of the "
              f"training; target at most max({100 * TARGET_RATIO:.0f} % of training, {TARGET_S:.0f} s) = "
              f"{r['target_s']:.1f} s: {'met' if r['target_met'] else 'NOT met'}"]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from xmodal import tracking
    from xmodal.bench import at_least, begin, write_results
    from xmodal.errors import UserError
    from xmodal.sweep.plan import SweepOptions
    from xmodal.sweep.runner import run_sweep

    at_least(args, 1, "trials", "concurrent", "epochs")
    variants = len(yaml.safe_load(SPACE.read_text())["parameters"]["model.variant"]["values"])
    if args.trials > variants:
        raise UserError(f"--trials {args.trials}: the space {SPACE.name} has {variants} variants; expected at most "
                        f"{variants}")
    work, stamp, meta = begin(args, "sweep", trials=args.trials, concurrent=args.concurrent, epochs=args.epochs)
    res: dict[str, Any] = {"meta": meta}
    say(f"benchmark sweep on {meta['machine']}: {args.trials} MulT trials, {args.concurrent} at a time; "
        f"work in {work}")
    t0 = time.perf_counter()
    try:
        space = space_file(work, args.trials, args.concurrent, args.epochs)
        started = time.perf_counter()
        out = run_sweep(SweepOptions(space=str(space), storage_path=str(work / "runs"), report=False))
        wall = time.perf_counter() - started
        trials = per_trial(tracking.child_runs(out["tracking_uri"], out["parent_run_id"]))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not trials:
        raise RuntimeError("no trial finished with its timeline: nothing to report (see the sweep's output)")
    s = out["overhead"]  # the sweep's own summary, as on its parent run (timeline.sweep_summary)
    training = sum(t["training_s"] for t in trials)
    target = max(TARGET_RATIO * s["sweep/training_s_mean"], TARGET_S)
    res["result"] = {"trials": trials, "sweep_wall_s": wall, "training_s_sum": training,
                     "wall_over_training": wall / training, "overhead_s_mean": s["sweep/trial_overhead_s_mean"],
                     "overhead_ratio": s["sweep/trial_overhead_ratio"], "target_s": target,
                     "target_met": s["sweep/trial_overhead_s_mean"] <= target,
                     **{k.removeprefix("sweep/"): v for k, v in s.items() if k.endswith("_s_mean")}}
    res["meta"]["wall_s"] = time.perf_counter() - t0
    write_results(args.out, "sweep-" + stamp, res, markdown(res))
    return 0
