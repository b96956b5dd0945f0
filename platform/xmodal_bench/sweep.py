"""What a sweep trial costs beyond its training: N tiny MulT trials of the shipped ablation space
(search_spaces/mult_ablation.yaml, its first N variants) on the embedded default (local Ray, the
synthetic MulT store), with a throwaway MLflow file and storage. Prints, per trial and on average,
its life as Tune's driver saw it, its training (`time/training_s`) and where the rest went (the
`time/*` phases of xmodal.runner.timeline, Tune's share), the sweep's wall time against the trials'
summed training, and whether the overhead is within its target: at most 10 % of the training or
5 s a trial, whichever is larger (bench-results/20261203-sweep-overhead.md).

The sweep's wall time is broken down too, in time order, into parts that add up to it: Ray's start,
the sweep's start (its MLflow parent run made, by the run's start time; then Tune's start: Tuner and
search set-up, up to the first trial's start), each trial
(its life, start to end, as Tune's driver saw it), the gaps between trials, the sweep's end (after
the last trial, until `run_sweep` returns) and Ray's stop. A trial's end is when the driver logged its
life on the child run (`sweep/trial_life_s`, whose timestamp MLflow keeps); its start is that end
minus its life. Overlapping trials (`--concurrent` above 1) share a part.

The console is a sweep job's: the trials' internal event lines stay off it (`--verbose` shows Ray's
own output).
"""

from __future__ import annotations

import argparse
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from xmodal.base.console import say
from xmodal.runner import timeline

SPACE = Path(__file__).resolve().parents[2] / "search_spaces" / "mult_ablation.yaml"
TARGET_RATIO, TARGET_S = 0.10, 5.0  # a trial's life outside training: at most the larger of the two
PHASES = ("prepare_s", "train_start_s", "worker_setup_s", "data_start_s", "train_end_s", "finish_s")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from xmodal.base.commands import add_verbose

    p.add_argument("--trials", type=int, default=4, help="trials, each a MulT variant (default 4, at most 10)")
    p.add_argument("--concurrent", type=int, default=1, help="trials at a time (default 1)")
    p.add_argument("--epochs", type=int, default=3, help="epochs per trial (the space's own: 12; default 3)")
    p.add_argument("--out", default="bench-results", help="folder for sweep-<timestamp>.json and .md")
    p.add_argument("--work", default=None, help="where the throwaway MLflow file and storage go "
                                                 "(default: the temp folder)")
    add_verbose(p)


def space_file(work: Path, trials: int, concurrent: int, epochs: int) -> Path:
    space = yaml.safe_load(SPACE.read_text())
    space.update(num_samples=trials, max_concurrent=concurrent, try_first=space["try_first"][:trials])
    space["parameters"]["model.variant"]["values"] = space["parameters"]["model.variant"]["values"][:trials]
    space["base"]["config"]["train"]["epochs"] = epochs
    space["base"]["config"]["mlflow"] = {"tracking_uri": f"sqlite:///{work / 'mlflow.db'}"}
    path = work / "bench_sweep.yaml"
    path.write_text(yaml.safe_dump(space, sort_keys=False))
    return path


def per_trial(runs, ended_at: Callable[[str], float]) -> list[dict[str, Any]]:
    """The finished trials' figures, from their child runs' metrics; `ended_at(run_id)`: the wall-clock
    time (s since the epoch) the driver logged the trial's life, i.e. the trial's end."""
    out = []
    for r in runs:
        m = r.metrics
        if timeline.TRIAL_LIFE not in m:
            continue
        end = ended_at(r.run_id)
        row = {"trial": r.name.rsplit("-", 1)[-1], "variant": r.params.get("model.variant", "?"),
               "start": end - m[timeline.TRIAL_LIFE], "end": end,
               "life_s": m[timeline.TRIAL_LIFE], "training_s": m["time/training_s"],
               "overhead_s": m[timeline.TRIAL_OVERHEAD], "tune_s": timeline.tune_s(m)}
        row.update({p: m.get(f"time/{p}") for p in PHASES})
        out.append(row)
    return sorted(out, key=lambda t: t["start"])


def breakdown(marks: dict[str, float], trials: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The sweep's wall time, `marks["begin"]` to `marks["end"]`, in consecutive parts (time order) that
    add up to it: Ray's start, the sweep's start, the trials and the gaps between them, the sweep's end
    and Ray's stop. `marks`: begin, ray_up (Ray started), parent_run (the parent run's start time),
    returned (`run_sweep` returned), end (Ray stopped). Each trial's start and end, and the parent run's,
    are clamped into the sweep's, so that the parts never overlap."""
    lo, hi = marks["ray_up"], marks["returned"]
    spans = [(t["trial"], min(max(t["start"], lo), hi), min(max(t["end"], lo), hi)) for t in trials]
    first = min((a for _, a, _ in spans), default=hi)
    last = max((b for _, _, b in spans), default=first)
    parent = min(max(marks["parent_run"], lo), first)
    cuts = sorted({first, last, *(a for _, a, _ in spans), *(b for _, _, b in spans)})
    parts = [("Ray start", marks["begin"], lo, "a local Ray started (or the cluster joined)"),
             ("parent run", lo, parent, "the sweep planned, its MLflow parent run made"),
             ("Tune start", parent, first, "Tuner and search set-up, the first trial's process and start")]
    for a, b in zip(cuts[:-1], cuts[1:], strict=True):
        running = [name for name, s, e in spans if s <= a and e >= b]
        if not running:
            part = ("between trials", "Tune: the ended trial's bookkeeping, the next one's start")
        elif len(running) == 1:
            part = (f"trial {running[0]}", "its life, start to end (its row above)")
        else:
            part = ("trials " + " + ".join(running), "trials running together")
        if parts[-1][0] == part[0] and parts[-1][2] == a:  # one part, cut where another trial began or ended
            parts[-1] = (part[0], parts[-1][1], b, part[1])
        else:
            parts.append((part[0], a, b, part[1]))
    parts += [("sweep end", last, hi, "after the last trial: Tune's end, the summary, the parent run closed"),
              ("Ray stop", hi, marks["end"], "ray.shutdown()")]
    return [{"part": name, "from_s": a - marks["begin"], "s": b - a, "what": what} for name, a, b, what in parts]


def markdown(res: dict[str, Any]) -> str:
    m, r = res["meta"], res["result"]
    cols = ["trial", "variant", "start_s", "life_s", "training_s", "overhead_s", *PHASES, "tune_s"]
    lines = [f"# Sweep overhead: {m['trials']} MulT trials, {m['concurrent']} at a time, {m['epochs']} epochs",
             "", f"{m['machine']}; {m['date']}; commit {m['git_commit']}; `{m['command']}`", "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for t in r["trials"]:
        lines.append("| " + " | ".join(f"{t[c]:.1f}" if isinstance(t[c], float) else str(t[c]) for c in cols) + " |")
    wall = r["sweep_wall_s"]
    lines += ["", "Where the sweep's wall time went, in time order:", "",
              "| part | from s | s | % of wall | what |", "|---|---:|---:|---:|---|"]
    lines += [f"| {b['part']} | {b['from_s']:.1f} | {b['s']:.1f} | {100 * b['s'] / wall:.0f} % | {b['what']} |"
              for b in r["breakdown"]]
    lines += [f"| total | | {sum(b['s'] for b in r['breakdown']):.1f} | 100 % | the sweep's wall time |"]
    lines += ["", f"- sweep wall time {r['sweep_wall_s']:.1f} s against {r['training_s_sum']:.1f} s of summed "
              f"training (ratio {r['wall_over_training']:.2f}; with {m['concurrent']} at a time the ideal is "
              f"{1 / m['concurrent']:.2f})",
              f"- overhead per trial: mean {r['overhead_s_mean']:.1f} s, {100 * r['overhead_ratio']:.0f} % of the "
              f"training; target at most max({100 * TARGET_RATIO:.0f} % of training, {TARGET_S:.0f} s) = "
              f"{r['target_s']:.1f} s: {'met' if r['target_met'] else 'NOT met'}"]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from xmodal import tracking
    from xmodal.base.commands import setup_console
    from xmodal.base.errors import UserError
    from xmodal.runner.ray_cluster import connect, require_ray
    from xmodal.sweep.plan import SweepOptions
    from xmodal.sweep.runner import run_sweep
    from xmodal_bench import at_least, begin, write_results

    at_least(args, 1, "trials", "concurrent", "epochs")
    variants = len(yaml.safe_load(SPACE.read_text())["parameters"]["model.variant"]["values"])
    if args.trials > variants:
        raise UserError(f"--trials {args.trials}: the space {SPACE.name} has {variants} variants; expected at most "
                        f"{variants}")
    work, stamp, meta = begin(args, "sweep", trials=args.trials, concurrent=args.concurrent, epochs=args.epochs)
    # A sweep job's console: the trials' event lines (progress, evaluations) are taken out of Ray's log
    # stream (xmodal.base.console) instead of printed as JSON, and Ray's and MLflow's chatter is quiet.
    setup_console(args.verbose)
    res: dict[str, Any] = {"meta": meta}
    say(f"benchmark sweep on {meta['machine']}: {args.trials} MulT trials, {args.concurrent} at a time; "
        f"work in {work}")
    t0 = time.perf_counter()
    try:
        space = space_file(work, args.trials, args.concurrent, args.epochs)
        # Wall-clock marks (time.time), comparable with the trials' ends that MLflow timestamps.
        marks = {"begin": time.time()}
        connect()  # what run_sweep would do first; here, so that Ray's start is a part of its own
        marks["ray_up"] = time.time()
        out = run_sweep(SweepOptions(space=str(space), storage_path=str(work / "runs"), report=False))
        marks["returned"] = time.time()
        require_ray().shutdown()
        marks["end"] = time.time()
        uri = out["tracking_uri"]
        parent_start = tracking.get_run(uri, out["parent_run_id"]).start_time
        marks["parent_run"] = marks["ray_up"] if parent_start is None else parent_start / 1e3

        def ended_at(run_id: str) -> float:
            return tracking.metric_points(uri, run_id, timeline.TRIAL_LIFE)[-1].timestamp / 1e3

        trials = per_trial(tracking.child_runs(uri, out["parent_run_id"]), ended_at)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not trials:
        raise RuntimeError("no trial finished with its timeline: nothing to report (see the sweep's output)")
    s = out["overhead"]  # the sweep's own summary, as on its parent run (timeline.sweep_summary)
    training = sum(t["training_s"] for t in trials)
    wall = marks["end"] - marks["begin"]
    parts = breakdown(marks, trials)
    for t in trials:  # seconds from the sweep's begin, as the breakdown counts them
        t["start_s"], t["end_s"] = t.pop("start") - marks["begin"], t.pop("end") - marks["begin"]
    target = max(TARGET_RATIO * s["sweep/training_s_mean"], TARGET_S)
    res["result"] = {"trials": trials, "sweep_wall_s": wall, "breakdown": parts, "training_s_sum": training,
                     "wall_over_training": wall / training, "overhead_s_mean": s["sweep/trial_overhead_s_mean"],
                     "overhead_ratio": s["sweep/trial_overhead_ratio"], "target_s": target,
                     "target_met": s["sweep/trial_overhead_s_mean"] <= target,
                     **{k.removeprefix("sweep/"): v for k, v in s.items() if k.endswith("_s_mean")}}
    res["meta"]["wall_s"] = time.perf_counter() - t0
    write_results(args.out, "sweep-" + stamp, res, markdown(res))
    return 0
