"""Where a run's wall time goes: marks taken along the way (wall-clock `time.time()`, so the marks of
the driver and of the rank-0 worker compare on one machine; across hosts, up to their clock skew),
turned into the `time/*` metrics every run logs at its end. Standard library only (the file system
passed in is pyarrow's).

    run_start    the driver's `engine.run` begins (a sweep trial: in its Tune trial process)
    fit_call     the MLflow run is open, Ray Train's `fit()` is called (or the trial's in-process worker)
    worker_start the rank-0 Train worker's function begins (the attempt that finished)
    loop_start   its data, model, optimizer and MLflow logger are ready: the loop starts
    first_batch  the loop's first micro-batch arrived
    fit_end      the last step, the final evaluation and the held-out splits are done (the last report)
    fit_return   `fit()` returned in the driver
    finished     the run's artifacts and MLflow model are logged

    time/prepare_s       run_start -> fit_call      checks, data opened, MLflow run created, Ray connected
    time/train_start_s   fit_call -> worker_start   Ray Train: controller, placement, worker processes
                                                    (and any failed attempt before the last one);
                                                    about 0 for a sweep trial's in-process worker
    time/worker_setup_s  worker_start -> loop_start resume point, data, model build, logger
    time/data_start_s    loop_start -> first_batch  the train split's first batch
    time/training_s      first_batch -> fit_end     the steps, evaluations and checkpoints
    time/train_end_s     fit_end -> fit_return      the worker group's teardown
    time/finish_s        fit_return -> finished     artifacts, the MLflow model
    time/overhead_s      everything but training_s
    time/overhead_ratio  overhead_s / training_s
"""

from __future__ import annotations

import json
import time

FILE = "timeline.json"  # the rank-0 worker's marks, in the run's folder on storage (beside its checkpoints)
MARKS = ("run_start", "fit_call", "worker_start", "loop_start", "first_batch", "fit_end", "fit_return",
         "finished")
PHASES = {"prepare_s": ("run_start", "fit_call"), "train_start_s": ("fit_call", "worker_start"),
          "worker_setup_s": ("worker_start", "loop_start"), "data_start_s": ("loop_start", "first_batch"),
          "training_s": ("first_batch", "fit_end"), "train_end_s": ("fit_end", "fit_return"),
          "finish_s": ("fit_return", "finished")}
WORKER_MARKS = ("worker_start", "loop_start", "first_batch", "fit_end")


def mark(marks: dict[str, float], name: str) -> None:
    """Record `name` now, once: a later call keeps the first time (e.g. the first batch)."""
    if name not in MARKS:
        raise KeyError(f"unknown timeline mark {name!r}; valid: {', '.join(MARKS)}")
    marks.setdefault(name, time.time())


def write_worker_marks(fs, folder: str, marks: dict[str, float]) -> None:
    """The worker's marks into the run's folder (`fs`: a pyarrow file system): Ray Train's result
    holds the metrics of the last checkpoint only, not of the reports after it."""
    with fs.open_output_stream(f"{folder}/{FILE}") as f:
        f.write(json.dumps({k: v for k, v in marks.items() if k in WORKER_MARKS}).encode())


def read_worker_marks(fs, folder: str) -> dict[str, float]:
    """The marks `write_worker_marks` left, or {} when there are none (figures only: never an error)."""
    try:
        with fs.open_input_stream(f"{folder}/{FILE}") as f:
            got = json.loads(f.read())
    except Exception:  # absent (the worker died first), unreadable or not JSON: no figures
        return {}
    return {k: float(v) for k, v in got.items() if k in WORKER_MARKS} if isinstance(got, dict) else {}


def within(worker: dict[str, float], fit_call: float, fit_return: float) -> dict[str, float]:
    """The worker's marks if they lie within this `fit()`; {} for a file an earlier run left (a rerun
    of a finished run trains nothing and writes none)."""
    return worker if worker and all(fit_call <= t <= fit_return for t in worker.values()) else {}


def phases(marks: dict[str, float]) -> dict[str, float]:
    """The `time/*` metrics of the phases whose two marks are known; with the run's first and last
    mark and its training, the overhead (everything else) and its ratio to training."""
    out = {f"time/{name}": marks[b] - marks[a] for name, (a, b) in PHASES.items() if a in marks and b in marks}
    if "run_start" in marks and "finished" in marks and "time/training_s" in out:
        training = out["time/training_s"]
        out["time/overhead_s"] = marks["finished"] - marks["run_start"] - training
        if training > 0:
            out["time/overhead_ratio"] = out["time/overhead_s"] / training
    return out


TRIAL_LIFE = "sweep/trial_life_s"  # a sweep trial's life as Tune's driver saw it, start to end
TRIAL_OVERHEAD = "sweep/trial_overhead_s"  # of it, the time outside time/training_s


def trial_overhead(life_s: float, run_metrics: dict[str, float]) -> dict[str, float]:
    """A finished sweep trial's life and overhead (life minus its run's training), for its child run;
    empty when the run logged no training time (stopped early, failed, or its end was spooled)."""
    training = run_metrics.get("time/training_s")
    if training is None:
        return {}
    out = {TRIAL_LIFE: life_s, TRIAL_OVERHEAD: life_s - training}
    if training > 0:
        out["sweep/trial_overhead_ratio"] = (life_s - training) / training
    return out


def sweep_summary(runs: list[dict[str, float]]) -> dict[str, float]:
    """Over the finished trials' run metrics (those with a trial life): the mean life, training and
    overhead per trial, the overhead as a share of training (summed over trials), and the mean of each
    phase of the runs' timelines. Empty when no trial has its figures."""
    done = [m for m in runs if TRIAL_LIFE in m and "time/training_s" in m]
    if not done:
        return {}
    n = len(done)
    training = sum(m["time/training_s"] for m in done)
    overhead = sum(m[TRIAL_OVERHEAD] for m in done)
    out = {"sweep/timed_trials": float(n), "sweep/trial_life_s_mean": sum(m[TRIAL_LIFE] for m in done) / n,
           "sweep/training_s_mean": training / n, "sweep/trial_overhead_s_mean": overhead / n}
    if training > 0:
        out["sweep/trial_overhead_ratio"] = overhead / training
    for phase in PHASES:
        values = [m[f"time/{phase}"] for m in done if f"time/{phase}" in m]
        if values and phase != "training_s":
            out[f"sweep/{phase}_mean"] = sum(values) / len(values)
    known = [tune_s(m) for m in done if tune_s(m) is not None]
    if known:
        out["sweep/tune_s_mean"] = sum(known) / len(known)
    return out


def tune_s(run_metrics: dict[str, float]) -> float | None:
    """Tune's own share of a trial's overhead: its trial process starting before the run and ending
    after it (the trial's overhead minus its run's)."""
    if TRIAL_OVERHEAD not in run_metrics or "time/overhead_s" not in run_metrics:
        return None
    return run_metrics[TRIAL_OVERHEAD] - run_metrics["time/overhead_s"]


def summary_line(s: dict[str, float]) -> str:
    """One line for the sweep's output: the overhead per trial and where it went."""
    parts = [(k.removeprefix("sweep/").removesuffix("_s_mean").replace("_", " "), v) for k, v in s.items()
             if k.endswith("_s_mean") and k not in ("sweep/trial_life_s_mean", "sweep/training_s_mean",
                                                    "sweep/trial_overhead_s_mean")]
    ratio = s.get("sweep/trial_overhead_ratio")
    share = f" ({100 * ratio:.0f} % of training)" if ratio is not None else ""
    return (f"trials took {s['sweep/trial_life_s_mean']:.1f} s each on average, {s['sweep/training_s_mean']:.1f} s "
            f"of it training: {s['sweep/trial_overhead_s_mean']:.1f} s outside training{share}; "
            + ", ".join(f"{name} {v:.1f} s" for name, v in parts))
