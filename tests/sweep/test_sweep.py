"""Real sweeps on tiny configs: Ray Tune + Optuna + ASHA, Ray Train trials, MLflow parent/child runs,
reports, and one sweep's driver killed midway, stopped with Ctrl-C and resumed. Each trial runs its one
worker in the trial's own process (a Tune actor reused by the next trial); the sweeps are small: 4
trials (3 for the faults and stops), two at a time, a few steps each (one of 400 cheap steps, to be
training when the Ctrl-C lands)."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import textwrap
import time
from pathlib import Path

import pytest

from xmodal import tracking
from xmodal.base import run_tags as T
from xmodal.base.scores import better, selected_key
from xmodal.runner import timeline
from xmodal_testing import PYTHON, REPO, RayHead, kill_tree

SWEEP = str(REPO / "jobs" / "sweep.py")


def space_file(tmp: Path, store: Path, body: str, train: str) -> Path:
    """A space on the tiny preset, 16 sentences a step; `train` sets steps and evaluations (= reports).
    No example pages (`examples.count: 0`): the chain trial's test has them."""
    head = f"""
    job: pretrain
    base:
      config:
        preset: tiny
        data: {{store: {store}, eval_batches: 2}}
        train: {{epochs: 2, batch_size: 16, log_every: 2, {train}}}
        examples: {{count: 0}}
        mlflow: {{system_metrics: false, tracking_uri: "sqlite:///{tmp / 'mlflow.db'}"}}
    max_concurrent: 2
    seed: 0
    """
    p = tmp / "space.yaml"
    p.write_text(textwrap.dedent(head) + textwrap.dedent(body))
    return p


def children(uri: str, parent: str) -> list:
    return [r for r in tracking.child_runs(uri, parent) if r.tags.get(T.ORPHANED) != "true"]


# ---------------------------------------------------------------- one sweep: children, conditions, ASHA, report


ASHA_SPACE = """
metric: eval/loss/mlm
mode: min
num_samples: 4
# 6 steps, a report every 2 plus the final one: 4 reports. Rungs at 1 and 2 reports.
scheduler: {type: asha, max_t: 4, grace_period: 1, reduction_factor: 2}
parameters:
  optim.lr: {type: choice, values: [1e-2, 1e-9]}      # 1e-9 learns nothing: ASHA must stop it
  tasks.obj_feat: {type: choice, values: [true, false]}
  tasks.feat_loss: {type: choice, values: [l2, smooth_l1], when: {tasks.obj_feat: true}}
try_first:                                            # the good ones first, so that the rungs are set
  - {optim.lr: 1e-2, tasks.obj_feat: true, tasks.feat_loss: smooth_l1}
  - {optim.lr: 1e-2, tasks.obj_feat: false}
  - {optim.lr: 1e-9}
  - {optim.lr: 1e-9}
"""


@pytest.mark.slow
def test_sweep_children_conditions_early_stopping_and_report(tmp_path, tiny_store, ray_local, monkeypatch):
    from xmodal.sweep.plan import SweepOptions
    from xmodal.sweep.runner import run_sweep

    monkeypatch.chdir(tmp_path)  # MLflow's default artifact root is ./mlruns
    monkeypatch.setenv("TUNE_GLOBAL_CHECKPOINT_S", "2")  # what run_sweep sets, undone after the test
    space = space_file(tmp_path, tiny_store, ASHA_SPACE, "max_steps: 6, eval_every: 2")
    result = run_sweep(SweepOptions(space=str(space), storage_path=str(tmp_path / "runs")))
    uri, parent_id = result["tracking_uri"], result["parent_run_id"]
    assert result["errors"] == 0 and result["trials"] == 4 and result["unfinished"] == 0

    parent = tracking.get_run(uri, parent_id)
    assert parent.status == "FINISHED" and parent.tags[T.KIND] == "sweep"
    assert parent.params["num_samples"] == "4" and parent.params["scheduler.max_t"] == "4"
    assert parent.tags[T.BEST + "optim.lr"] == "0.01"
    assert parent.metrics["best/eval/loss/mlm"] == result["best"]["eval/loss/mlm"]
    assert {"space/space.yaml", "space/sweep.yaml"} <= set(tracking.list_artifacts(uri, parent_id, "space"))
    # the report's baseline: the first try_first configuration; the best trial's cost beside its score
    assert json.loads(parent.tags[T.BASELINE]) == {"optim.lr": 0.01, "tasks.obj_feat": True,
                                                   "tasks.feat_loss": "smooth_l1"}
    assert parent.metrics["best/cost/gflop_per_sample"] > 0 and parent.metrics["best/cost/wall_s"] > 0
    assert "| optim.lr | tasks.obj_feat | tasks.feat_loss | runs | eval/loss/mlm |" in \
        parent.tags["mlflow.note.content"]  # the run page shows the table

    runs = children(uri, parent_id)
    assert len(runs) == 4 and len({r.tags[T.TRIAL_ID] for r in runs}) == 4
    stopped = []
    for r in runs:
        tags, params = r.tags, r.params
        assert tags[T.KIND] == "trial" and tags[T.PARENT_TAG] == parent_id
        # searched values: in the run's params (the resolved config) and its ablation tags
        assert params["optim.lr"] == tags[T.ABLATION + "optim.lr"]
        assert params["tasks.obj_feat"] == tags[T.ABLATION + "tasks.obj_feat"]
        # the conditional parameter exists exactly where its condition holds
        has_cond = T.ABLATION + "tasks.feat_loss" in tags
        assert has_cond == (tags[T.ABLATION + "tasks.obj_feat"] == "True"), tags
        if has_cond:
            assert params["tasks.feat_loss"] == tags[T.ABLATION + "tasks.feat_loss"]
        assert params["train.best_metric"] == "eval/loss/mlm" and params["preset"] == "tiny"
        # one param per searched parameter in every trial, for MLflow's comparison of runs
        assert all(params[f"ablation.{k}"] == tags.get(T.ABLATION + k, "-")
                   for k in ("optim.lr", "tasks.obj_feat", "tasks.feat_loss"))
        # cost, logged at each evaluation: trials stopped early have it too
        assert r.metrics["cost/gflop_per_sample"] > 0 and r.metrics["cost/device_hours"] > 0
        if tags.get(T.EARLY_STOPPED) == "true":
            stopped.append(r)
            assert r.status == "KILLED" and int(tags[T.STOPPED_AT]) < 4
        else:
            assert r.status == "FINISHED" and tags[T.EARLY_STOPPED] == "false"
            steps = [s for s, _ in tracking.metric_history(uri, r.run_id, "eval/loss/mlm")]
            assert steps == [2, 4, 6]
            arts = set(tracking.list_artifacts(uri, r.run_id))
            assert {"config.yaml", "model"} <= arts
            assert "examples" not in arts and T.EXAMPLES not in tags  # examples.count: 0 in the base
            # where the trial's time went: its phases (xmodal.runner.timeline) and Tune's share add up
            # to its life as the driver saw it; everything but training is overhead
            m = r.metrics
            phases = [m[f"time/{p}"] for p in timeline.PHASES]
            assert all(v >= 0 for v in phases) and m["time/training_s"] > 0, m
            assert m[timeline.TRIAL_OVERHEAD] == pytest.approx(m[timeline.TRIAL_LIFE] - m["time/training_s"])
            assert sum(phases) == pytest.approx(m["time/overhead_s"] + m["time/training_s"])
            assert m["time/overhead_s"] <= m[timeline.TRIAL_OVERHEAD] < m[timeline.TRIAL_LIFE]
    # Every 1e-9 trial starts after a good one has set the first rung, and is worse: stopped there.
    # (ASHA may also stop the second good trial when it reaches a rung behind an equally good one.)
    assert stopped and all(r in stopped for r in runs if r.params["optim.lr"] == "1e-09")
    assert any(r.status == "FINISHED" and r.params["optim.lr"] == "0.01" for r in runs)

    # One score per trial: the value Tune ranked it by (its last result's selected score, from Tune's
    # saved state) is what its run logged at that step, what the report's table shows and, for the
    # best trial, the parent's best/<metric>. The worker logs it at each evaluation: the running best
    # (mode min). A stopped trial's workers may evaluate once more before they stop: its run is
    # tagged with the step Tune ranked.
    from ray.tune import ExperimentAnalysis

    score = selected_key("eval/loss/mlm")
    last = {t.trial_id: t.last_result for t in ExperimentAnalysis(result["path"]).trials}
    ranked = {trial: res[score] for trial, res in last.items()}
    assert ranked.keys() == {r.tags[T.TRIAL_ID] for r in runs}
    for r in runs:
        evals = tracking.metric_history(uri, r.run_id, "eval/loss/mlm")
        kept = tracking.metric_history(uri, r.run_id, score)
        assert kept == [(s, min(v for _, v in evals[:i + 1])) for i, (s, _) in enumerate(evals)], r.name
        step = last[r.tags[T.TRIAL_ID]]["step"]
        assert dict(kept)[step] == ranked[r.tags[T.TRIAL_ID]], r.name
        if r.tags.get(T.EARLY_STOPPED) == "true":
            assert r.tags[T.RANKED_STEP] == str(step)
        else:
            assert r.metrics[score] == ranked[r.tags[T.TRIAL_ID]] and step == 6, r.name
    # the parent's overhead per trial: the mean over the finished trials of what each logged
    timed = [r.metrics for r in runs if r.status == "FINISHED"]
    assert parent.metrics["sweep/timed_trials"] == len(timed)
    assert parent.metrics["sweep/trial_overhead_s_mean"] == pytest.approx(
        sum(m[timeline.TRIAL_OVERHEAD] for m in timed) / len(timed))
    assert parent.metrics["sweep/trial_overhead_ratio"] == pytest.approx(
        sum(m[timeline.TRIAL_OVERHEAD] for m in timed) / sum(m["time/training_s"] for m in timed))
    best_trial = parent.tags[T.BEST + "trial_id"]
    assert not any(better(v, ranked[best_trial], "min") for v in ranked.values())
    assert parent.metrics["best/eval/loss/mlm"] == ranked[best_trial]

    # the report written at the end: one row per configuration, its cell the mean of those scores
    out = Path(result["report"])
    with open(out / "table.csv") as f:
        rows = list(csv.DictReader(f))
    configs: dict[tuple, list] = {}
    for r in runs:
        key = tuple(r.tags.get(T.ABLATION + k, "-") for k in ("optim.lr", "tasks.obj_feat", "tasks.feat_loss"))
        configs.setdefault(key, []).append(r)
    assert len(rows) == len(configs)
    for row in rows:
        group = configs[(row["optim.lr"], row["tasks.obj_feat"], row["tasks.feat_loss"])]
        used = [r for r in group if r.status == "FINISHED"] or group
        scores = [ranked[r.tags[T.TRIAL_ID]] for r in used]
        if len(scores) == 1:
            assert float(row["eval/loss/mlm mean"]) == scores[0]
        else:
            assert float(row["eval/loss/mlm mean"]) == pytest.approx(sum(scores) / len(scores), rel=1e-12)
        assert int(row["runs"]) == len(group)
    assert rows[0]["optim.lr"] == "0.01" and rows[0]["finished"] == "1"  # sorted best first
    assert [(r["optim.lr"], r["tasks.feat_loss"]) for r in rows if r["baseline"] == "True"] == [("0.01", "smooth_l1")]
    assert all(float(r["cost/gflop_per_sample mean"]) > 0 for r in rows)
    # parameter importance over the finished trials (none under 3: the tag says why)
    importance = json.loads(parent.tags[T.IMPORTANCE])
    finished = sum(r.status == "FINISHED" for r in runs)
    assert importance["trials"] == finished and ("values" in importance) == (finished >= 3), importance
    # metric vs each of the 3 parameters, learning curves, score against cost (and importance with values)
    assert len(list(out.glob("*.png"))) == 5 + ("values" in importance)
    logged = set(tracking.list_artifacts(uri, parent_id, "report"))
    assert {"report/table.md", "report/eval_loss_mlm_vs_cost.png"} <= logged


# ---------------------------------------------------------------- chaos: worker faults, a killed driver, Ctrl-C


# One sweep's lifetime serves the worker faults, the killed driver and the Ctrl-C (each driver start and
# each trial start costs seconds of the suite's two cores; the properties do not depend on there being
# two sweeps). A trial of 4 steps finishes first: the driver is killed then, while the trial of 8 steps
# trains (its Train run resumes from a checkpoint). The resumed driver gets the Ctrl-C while the long
# trial trains: 400 steps, a checkpoint every 40, so that it is still training, with a checkpoint written,
# when the signal lands (350 steps left: a margin on a fast machine); the short ones evaluate every 2 steps.
CHAOS_SPACE = """
metric: eval/loss/mlm
mode: min
num_samples: 3
trial_retries: 2
scheduler: {type: fifo}
parameters:
  length:
    type: choice
    options:
      short: {train.max_steps: 4}
      mid: {train.max_steps: 8}
      long: {train.max_steps: 400, train.eval_every: 40}
  optim.lr: {type: float, low: 1e-3, high: 1e-2, log: true}
try_first:
  - {length: short, optim.lr: 0.005}   # finishes first: the driver is killed then
  - {length: mid, optim.lr: 0.002}     # running at the kill: its Train run resumes from a checkpoint
  - {length: long, optim.lr: 0.008}    # training at the Ctrl-C, in the resumed driver
"""
# In each trial a worker exits once, at a step drawn per trial. A Train run does not retry
# (scale.max_failures=0): the fault fails the Train run and Tune starts the trial again, which resumes
# from its checkpoint. (Restarts within a Train run are checked by the exact-resume tests of each job.)
FAULTS = ["train.random_faults=1", "train.fault_seed=7", "scale.max_failures=0"]
EXPERIMENT = "xmodal-sweep-space"
STOPPED_LINE = ("continue it with the same command and --resume --name chaos "
                "(finished trials are kept, the others resume from their checkpoints)")


def kill_session(sid: int) -> None:
    """SIGKILL whatever a killed driver left behind: it ran in a session of its own, so everything it
    started has its pid as session id (by pid, never `ray stop`: other Rays live on)."""
    import psutil

    for p in psutil.process_iter():
        try:
            if p.pid != os.getpid() and os.getsid(p.pid) == sid:
                p.send_signal(signal.SIGKILL)
        except (psutil.Error, ProcessLookupError, PermissionError):
            pass


def start_driver(tmp: Path, space: Path, env: dict[str, str], log: str, *extra: str) -> subprocess.Popen:
    """`jobs/sweep.py` as its own process, attached to the test's Ray head the way a job attaches to its
    cluster (RAY_ADDRESS): killing the driver ends its trials and Train runs, not the cluster."""
    sets = [a for f in FAULTS for a in ("--set", f)]
    return subprocess.Popen([PYTHON, SWEEP, str(space), "--name", "chaos", "--storage-path", str(tmp / "runs"),
                             *sets, *extra], cwd=tmp, env=env, start_new_session=True,
                            stdout=open(tmp / log, "w"), stderr=subprocess.STDOUT)


def trial_runs(tmp: Path, log: str) -> list | None:
    """The trials' MLflow runs, or None before the driver has made its database (two processes creating
    a new SQLite database at once fail; the driver prints this line after its parent run exists)."""
    if "[xmodal] sweep 'chaos'" not in (tmp / log).read_text():
        return None
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    return tracking.search_runs(uri, [tracking.get_experiment_id(uri, EXPERIMENT)], f"tags.`{T.KIND}` = 'trial'")


@pytest.mark.slow
def test_chaos_sweep_survives_worker_faults_a_killed_driver_and_ctrl_c(tmp_path, tiny_store, ray_local):
    """3 trials, a worker fault in each at a step drawn per trial (each ends its Train run, and Tune
    retries the trial); the sweep's driver killed (SIGKILL) once a trial has finished and resumed; the
    resumed driver stopped with Ctrl-C (SIGINT to its process group) while the long trial trains: exit
    130 and one line saying how to continue, the parent and the running trials KILLED, each trial
    tagged with the step it resumes from; `--resume` again finishes the sweep. Trials finished before
    either stop are kept (not run again), the stopped ones resume from the steps their tags named, each
    child run's history has every step exactly once, and the report equals a fault-free sweep's.
    On a Ray head of its own: in the shared test Ray, placement groups left by the in-process sweeps
    of earlier tests held enough CPUs that resumed trials' Ray Data reads never got one (a hang). The
    fault-free sweep runs in this process, on the shared test Ray."""
    space = space_file(tmp_path, tiny_store, CHAOS_SPACE, "eval_every: 2")
    space.write_text(space.read_text().replace("epochs: 2,", "epochs: 10,"))  # 450 steps: room for 400
    head = RayHead(tmp_path)
    try:
        env = {**head.env, "RAY_ADDRESS": head.address}
        kept = _kill_once_a_trial_finished(tmp_path, space, env, head)
        stopped, kept_too, ended = _ctrl_c_once_the_long_trial_trains(tmp_path, space, env)
        third = start_driver(tmp_path, space, env, "third.log", "--resume")
        try:
            third.wait(timeout=600)
        finally:
            kill_tree(third.pid, grace=3)
            kill_session(third.pid)
    finally:
        head.stop()
    log = "".join((tmp_path / f"{n}.log").read_text() for n in ("first", "second", "third"))
    assert third.returncode == 0, log[-4000:]
    assert log.count("continuing sweep 'chaos'") == 2, log[-4000:]
    assert "finished: no " not in log  # a resumed trial's line still shows its score
    runs, injected = _check_every_step_once(tmp_path, {**kept, **kept_too}, stopped, ended)
    _compare_with_a_fault_free_sweep(tmp_path, space, runs, injected)


def _kill_once_a_trial_finished(tmp_path: Path, space: Path, env: dict[str, str], head: RayHead) -> dict[str, float]:
    """The first driver, killed (SIGKILL, then what it left) once a trial has finished; returns the
    finished trials' runs and end times."""
    first = start_driver(tmp_path, space, env, "first.log")
    finished: dict[str, float] = {}
    try:
        deadline = time.time() + 300
        while time.time() < deadline and first.poll() is None:
            time.sleep(2)
            runs = trial_runs(tmp_path, "first.log")
            finished = {r.run_id: r.end_time for r in runs or [] if r.status == "FINISHED"}
            if finished:
                break
        assert first.poll() is None, (tmp_path / "first.log").read_text()[-3000:]
        assert finished, "no trial finished in time:\n" + (tmp_path / "first.log").read_text()[-3000:]
        os.kill(first.pid, signal.SIGKILL)  # the driver alone, at once: no handler runs, no state is saved
        first.wait(timeout=60)
    finally:
        kill_tree(first.pid, grace=3)
        kill_session(first.pid)
    said = (tmp_path / "first.log").read_text()
    assert first.returncode == -signal.SIGKILL and "Stop signal received" not in said, said[-3000:]
    _trials_ended(head)
    return finished


def _trials_ended(head: RayHead, timeout: float = 60) -> None:
    """Wait until Ray has ended the killed driver's trial processes (Tune's trial actors, `ray::ImplicitFunc`),
    as it does once the driver's job is dead: until then a trial's worker may still write to its run folder,
    which the next driver's trial resumes."""
    import psutil

    deadline = time.time() + timeout
    while True:
        alive = []
        for node in head.nodes:
            try:
                alive += [p.pid for p in psutil.Process(node.pid).children(recursive=True)
                          if "ImplicitFunc" in " ".join(p.cmdline())]
            except psutil.Error:
                pass
        if not alive:
            return
        assert time.time() < deadline, f"the killed driver's trial processes {alive} still run after {timeout} s"
        time.sleep(0.5)


def _ctrl_c_once_the_long_trial_trains(tmp_path: Path, space: Path, env: dict[str, str]):
    """The driver resumed, then Ctrl-C once the long trial trains in it past a checkpoint. Returns the
    KILLED trials' runs -> the step each is tagged to resume from, the trials finished by then, and the
    time the stopped driver exited."""
    second = start_driver(tmp_path, space, env, "second.log", "--resume")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    started_ms = time.time() * 1000
    try:
        deadline = time.time() + 300
        while time.time() < deadline and second.poll() is None:
            time.sleep(1)
            runs = trial_runs(tmp_path, "second.log") or []
            training = [r for r in runs if r.status == "RUNNING" and r.tags.get(T.ABLATION + "length") == "long"
                        and any(p.step >= 50 and p.timestamp >= started_ms
                                for p in tracking.metric_points(uri, r.run_id, "train/loss"))]
            if training:
                break
        said = (tmp_path / "second.log").read_text()
        assert second.poll() is None and training, said[-3000:]
        finished = {r.run_id: r.end_time for r in runs if r.status == "FINISHED"}
        os.killpg(second.pid, signal.SIGINT)
        second.wait(timeout=120)
        ended = time.time()
    finally:
        kill_tree(second.pid, grace=3)
        kill_session(second.pid)
    log = (tmp_path / "second.log").read_text()
    assert second.returncode == 130, log[-3000:]
    lines = [line for line in log.splitlines() if line.startswith("[xmodal] sweep 'chaos' stopped with ")]
    assert len(lines) == 1 and lines[0].endswith(STOPPED_LINE), log[-3000:]
    # the driver's own output after the Ctrl-C has no traceback (Ray's processes may log theirs under
    # load, prefixed; a worker fault's before it is not the Ctrl-C's)
    after = log[len(said):]
    assert not [line for line in after.splitlines() if line.startswith("Traceback")], after[-3000:]
    assert "Tuner.restore" not in log  # Tune's own advice names its Python API, not the command
    parent = tracking.find_run(uri, tracking.get_experiment_id(uri, EXPERIMENT), "chaos")
    assert parent.status == "KILLED"
    runs = children(uri, parent.run_id)
    stopped = {r.run_id: int(r.tags[T.STOPPED_AT_STEP]) for r in runs if r.status == "KILLED"}
    # the long trial stopped midway, at a checkpoint it had written (another may train out before the
    # signal lands: then it has nothing left to resume)
    assert any(0 < stopped.get(r.run_id, 0) < int(r.params["train.max_steps"]) for r in runs), stopped
    assert not [r for r in runs if r.status == "RUNNING"]
    return stopped, finished, ended


def _check_every_step_once(tmp_path: Path, kept: dict[str, float], stopped: dict[str, int], ended: float):
    """Every trial finished once; those finished before a stop were not run again; each stopped at a
    checkpoint resumed from the step its tag named; every step logged once. Returns the runs and the
    faults' markers."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    parent = tracking.find_run(uri, tracking.get_experiment_id(uri, EXPERIMENT), "chaos")
    assert parent.status == "FINISHED"
    runs = children(uri, parent.run_id)
    assert len(runs) == 3 and len({r.name for r in runs}) == 3, [r.name for r in runs]
    assert all(r.status == "FINISHED" for r in runs), [(r.name, r.status) for r in runs]
    for run_id, end in kept.items():  # finished before the kill or the Ctrl-C: not run again
        assert tracking.get_run(uri, run_id).end_time == end
    injected = sorted((tmp_path / "runs" / "chaos" / "train").glob("*/.faults/step*"))
    assert len(injected) == 3, injected  # once each (a marker per fault)
    for r in runs:
        total, every = int(r.params["train.max_steps"]), int(r.params["train.eval_every"])
        for key, each in (("train/loss", 2), ("eval/loss/mlm", every)):
            steps = [p.step for p in tracking.metric_points(uri, r.run_id, key)]
            assert steps == list(range(each, total + 1, each)), (r.name, key, steps)  # each step once
        if 0 < stopped.get(r.run_id, 0) < total:  # the first resume after the Ctrl-C: from the step its tag named
            resumed = sorted(tracking.metric_points(uri, r.run_id, "train/resumed_from_step"), key=lambda p: p.timestamp)
            # after the stopped driver had exited: until then Tune may still restart a trial that failed
            # (its retry resumes from the checkpoint before the one the tag names, and writes that one)
            after = [p.value for p in resumed if p.timestamp > ended * 1000]
            assert after[:1] == [stopped[r.run_id]], (r.name, after, stopped[r.run_id])
    return runs, injected


def _compare_with_a_fault_free_sweep(tmp_path: Path, space: Path, runs: list, injected: list[Path]) -> None:
    """The same space swept without faults or stops (in this process, on the shared test Ray): the same
    report, and each trial step by step equal to its fault-free twin."""
    from xmodal.sweep.plan import SweepOptions
    from xmodal.sweep.runner import run_sweep

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    clean = run_sweep(SweepOptions(space=str(space), name="clean", storage_path=str(tmp_path / "runs")))
    assert clean["errors"] == 0 and clean["unfinished"] == 0
    chaos_rows = _table(tmp_path / "runs" / "chaos" / "report" / "table.csv")
    clean_rows = _table(Path(clean["report"]) / "table.csv")
    assert chaos_rows.keys() == clean_rows.keys() and len(chaos_rows) == 3
    for params, row in clean_rows.items():
        for col, value in row.items():
            want = value if isinstance(value, str) else pytest.approx(value, abs=1e-5)
            assert chaos_rows[params][col] == want, (params, col)

    # Step by step, each faulty trial against the fault-free trial with the same values.
    clean_runs = {(r.tags[T.ABLATION + "length"], r.params["optim.lr"]): r for r in children(uri, clean["parent_run_id"])}
    worst, lost = 0.0, 0
    for r in runs:
        twin = clean_runs[(r.tags[T.ABLATION + "length"], r.params["optim.lr"])]
        for key in ("train/loss", "eval/loss/mlm", "eval/match_acc"):
            mine, theirs = (dict(tracking.metric_history(uri, x.run_id, key)) for x in (r, twin))
            assert mine.keys() == theirs.keys(), (r.name, key)
            worst = max(worst, *(abs(mine[s] - theirs[s]) for s in theirs))
        lost += _steps_trained_twice(uri, r, injected)
    assert worst <= 1e-5, f"a faulty trial differs from its fault-free twin by {worst}"
    print(f"[chaos] {len(injected)} worker faults, 1 driver kill and 1 Ctrl-C, all survived: 3 of 3 trials "
          f"finished, 0 metric values lost, {lost} steps trained twice, largest difference from the "
          f"fault-free sweep {worst:.2e}")


def _steps_trained_twice(uri: str, r, injected: list[Path]) -> int:
    """A fault's step (its marker holds it) back to the checkpoint the run resumed from (0 when none had
    been written yet); a driver's stop: the last step logged before it back to the checkpoint."""
    marks = sorted((json.loads(f.read_text()) for f in injected if f.parent.parent.name == r.name),
                   key=lambda m: m["time"])
    backs = sorted(tracking.metric_points(uri, r.run_id, "train/resumed_from_step"), key=lambda p: p.timestamp)
    logged = tracking.metric_points(uri, r.run_id, "train/loss")
    lost = 0
    for m in marks:
        after = [b for b in backs if b.timestamp > m["time"] * 1000]
        lost += m["step"] - (int(after[0].value) if after else 0)
        if after:
            backs.remove(after[0])
    for back in backs:  # restarts without a worker fault: the driver was killed or stopped
        lost += max(p.step for p in logged if p.timestamp < back.timestamp) - int(back.value)
    return lost


def _table(path: Path) -> dict[tuple, dict[str, float | str]]:
    """The report's table.csv: (parameter values) -> its columns, numbers as floats. The measured cost
    columns (samples/s, wall time, ...) are left out: they differ from run to run by nature."""
    with open(path) as f:
        rows = list(csv.DictReader(f))
    out = {}
    for row in rows:
        key = (row["length"], row["optim.lr"])
        out[key] = {k: _number_or_text(v) for k, v in row.items()
                    if k not in ("length", "optim.lr", "seeds") and not k.startswith("cost/") and v}
    return out


def _number_or_text(v: str) -> float | str:
    try:
        return float(v)
    except ValueError:
        return v


# ---------------------------------------------------------------- a chain trial, in its own process


@pytest.mark.slow
def test_a_chain_trial_runs_both_stages_in_its_process(tmp_path, tiny_store, ray_local, monkeypatch):
    """A pretrain-then-fine-tune trial of one worker: both stages run in the trial's process (their
    run folders hold the trial session's checkpoint list, not Ray Train's run state), the pretraining
    stage is a finished child run beside the trial's, and the trial is scored by its fine-tuning stage."""
    from xmodal.data.finetune.synthetic import build_synthetic_vqa
    from xmodal.runner.session import TrialSession
    from xmodal.sweep.plan import SweepOptions
    from xmodal.sweep.runner import run_sweep

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TUNE_GLOBAL_CHECKPOINT_S", "2")
    vqa = build_synthetic_vqa(tiny_store, tmp_path / "vqa", questions_per_image=1).path
    stage = "batch_size: 16, eval_every: 4, log_every: 2"
    space = tmp_path / "chain.yaml"
    space.write_text(textwrap.dedent(f"""
        job: pretrain_finetune
        base:
          config:
            pretrain: {{preset: tiny, data: {{store: {tiny_store}, eval_batches: 2}}, train: {{max_steps: 4, {stage}}},
                        examples: {{count: 2}}}}
            finetune: {{data: {{store: {vqa}}}, train: {{max_steps: 4, {stage}}}, examples: {{count: 3}}}}
            mlflow: {{system_metrics: false, tracking_uri: "sqlite:///{tmp_path / 'mlflow.db'}"}}
        metric: valid/accuracy
        mode: max
        num_samples: 1
        scheduler: {{type: fifo}}
        parameters:
          pretrain.optim.lr: {{type: choice, values: [0.001]}}
        """))
    result = run_sweep(SweepOptions(space=str(space), name="chain", storage_path=str(tmp_path / "runs"),
                                    report=False))
    assert result["errors"] == 0 and result["unfinished"] == 0 and result["best"] is not None
    uri = result["tracking_uri"]
    runs = {r.name: r for r in tracking.child_runs(uri, result["parent_run_id"])}
    trial = next(r for r in runs.values() if r.tags.get(T.KIND) == "trial")
    pre = runs[f"{trial.name}-pretrain"]
    assert (pre.status, trial.status) == ("FINISHED", "FINISHED")
    assert result["best"]["valid/accuracy"] == trial.metrics[selected_key("valid/accuracy")]
    for run in (pre, trial):
        folder = tmp_path / "runs" / "chain" / "train" / run.name
        assert (folder / TrialSession.REGISTRY).is_file(), sorted(p.name for p in folder.iterdir())
        assert not (folder / "checkpoint_manager_snapshot.json").exists()  # no Ray Train run state
        assert run.metrics["time/training_s"] > 0
    # a trial's runs have their example pages, as a run from the command line has: each stage at its
    # own examples.count (the QA head's questions of the pretraining stage, the fine-tuning stage's valid)
    for run, count in ((pre, 2), (trial, 3)):
        assert run.tags[T.EXAMPLES] == "examples/index.html", run.name
        assert {n.split("/")[-1] for n in tracking.list_artifacts(uri, run.run_id, "examples")} >= {"index.html",
                                                                                                 "pictures"}, run.name
        assert len(tracking.list_artifacts(uri, run.run_id, "examples/pictures")) == count, run.name  # one an example
        assert f"{count} {'minival' if run is pre else 'valid'} examples" in run.tags[T.NOTE]
        assert run.metrics["time/end_of_run_s"] > 0
