"""Made-up sweeps for the report tests, logged directly through xmodal.tracking (no Ray, no
training), and the report's command line run as a user runs it."""

from __future__ import annotations

import csv
import json
import os
import subprocess

from xmodal import tracking
from xmodal.base import run_tags as T
from xmodal.base.scores import better, selected_key
from xmodal_testing import PYTHON, REPO

KEYS = ["model.x_layers", "tasks.obj_feat", "tasks.feat_loss", "train.seed"]


def sweep(uri: str, exp: str, name: str, metric: str = "eval/match_acc", mode: str = "max") -> str:
    return tracking.create_run(uri, exp, name, {"metric": metric},
                               {T.KIND: "sweep", T.SWEEP: name, T.METRIC: metric, T.MODE: mode})


def trial(uri: str, exp: str, parent: str, name: str, params: dict, history: list[float], status="FINISHED",
          extra_tags: dict | None = None) -> str:
    """A child run like a sweep trial's (selecting on eval/match_acc, mode max): ablation tags, per-report
    eval metrics with the selected score beside them as the worker logs it (the running best), a final
    status."""
    tags = {T.KIND: "trial", T.SWEEP: "s", T.TRIAL_ID: name, T.ABLATION_KEYS: json.dumps(KEYS),
            T.SEED: str(params.get("train.seed", 0)), **{T.ABLATION + k: str(v) for k, v in params.items()},
            T.METRIC: "eval/match_acc", **(extra_tags or {})}
    run_id = tracking.create_run(uri, exp, name, {}, tags, parent)
    best = None
    for i, v in enumerate(history):
        best = v if better(v, best, "max") else best
        tracking.log_metrics(uri, run_id, {"eval/match_acc": v, "eval/loss": 1 - v, "eval/loss/mlm": 2 - v,
                                           selected_key("eval/match_acc"): best}, step=10 * (i + 1))
    tracking.set_terminated(uri, run_id, status)
    return run_id


def costed_sweep(uri: str, exp: str, name: str, rows: dict[int, list[float]], parent_params: dict | None = None,
                 parent_tags: dict | None = None, seeds: dict[int, list[int]] | None = None) -> str:
    """A sweep over model.x_layers whose trials log one evaluation and the cost/* metrics of a job:
    x_layers n costs n GFLOP per sample, n M parameters and n/100 device-hours. The runs of a row have
    seeds 0, 1, ... unless `seeds` gives them."""
    parent = tracking.create_run(uri, exp, name, parent_params or {},
                                 {T.KIND: "sweep", T.SWEEP: name, T.METRIC: "eval/match_acc", T.MODE: "max",
                                  **(parent_tags or {})})
    for layers, values in rows.items():
        for seed, v in zip((seeds or {}).get(layers, range(len(values))), values, strict=True):
            run_id = trial(uri, exp, parent, f"x{layers}s{seed}",
                           {"model.x_layers": layers, "tasks.obj_feat": False, "train.seed": seed}, [v])
            tracking.log_metrics(uri, run_id, {
                "cost/params": layers * 1e6, "cost/gflop_per_sample": float(layers), "cost/samples_per_s": 1500.0,
                "cost/peak_mem_gib": 0.5, "cost/wall_s": 36.0 * layers, "cost/device_hours": layers / 100})
    return parent


def rows_of(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def report_cli(*args: str, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO / "platform")}  # this checkout's package from any cwd
    env.pop("MLFLOW_TRACKING_URI", None)
    return subprocess.run([PYTHON, str(REPO / "jobs" / "report.py"), *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env=env)


def one_error(out: subprocess.CompletedProcess) -> str:
    """The command failed as bad input: exit 2, one `error:` line on stderr, no traceback."""
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr and "error:" not in out.stdout, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    return lines[0]
