"""Ctrl-C and SIGTERM during a job (xmodal.runner.interrupt): a real `jobs/pretrain.py` in a process
group of its own, the signal sent to the whole group as a terminal sends it, real MLflow (SQLite),
real checkpoints; the rerun resumes and ends where an uninterrupted run ends, step by step."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest

from xmodal import tracking
from xmodal.base import run_tags as T
from xmodal.config.experiment import load_config
from xmodal.core import checkpoint as ckpt
from xmodal.jobs.pretrain_config import PretrainConfig
from xmodal.runner import engine, recovery
from xmodal_testing import PYTHON, REPO, kill_tree, ray_env

PRETRAIN = str(REPO / "jobs" / "pretrain.py")
# 5 epochs of 45 steps, cut at 120: an evaluation (and checkpoint) every 20 steps, a log step every 5.
SETTINGS = ["preset=tiny", "train.epochs=5", "train.batch_size=16", "train.max_steps=120", "train.eval_every=20",
            "train.log_every=5", "train.keep_best=2", "data.eval_batches=2", "mlflow.system_metrics=false"]
COMPARED = ("train/loss", "train/loss/mlm", "eval/loss", "eval/mlm_acc", "eval/match_acc")


def job_args(tmp: Path, store: Path, name: str) -> list[str]:
    sets = [a for s in SETTINGS for a in ("--set", s)]
    return ["--store", str(store), "--storage-path", str(tmp / "runs"), "--run-name", name, *sets,
            "--set", f"mlflow.tracking_uri=sqlite:///{tmp / 'mlflow.db'}"]


def the_run(uri: str, name: str) -> tracking.RunRecord:
    run = tracking.find_run(uri, tracking.get_experiment_id(uri, "xmodal-pretrain"), name)
    assert run is not None, name
    return run


def interrupted(tmp: Path, store: Path, name: str, env: dict[str, str], signals: list[signal.Signals],
                log: str, after_step: int = 0) -> subprocess.CompletedProcess:
    """The job until it has shown an evaluation past `after_step` and that evaluation's checkpoint is on
    storage (written once the evaluation's metrics are in MLflow: seconds on a loaded machine), then
    `signals` to its process group (a terminal's Ctrl-C reaches every process of the foreground group),
    0.05 s apart."""
    out = open(tmp / log, "w")  # noqa: SIM115 - the job's output, read back below
    proc = subprocess.Popen([PYTHON, PRETRAIN, *job_args(tmp, store, name)], cwd=tmp, env=env,
                            start_new_session=True, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 300
        def ready() -> bool:
            found = recovery.newest_intact(*recovery.run_folder(str(tmp / "runs"), name))[0]
            return (found is not None and found.step > after_step
                    and f"[xmodal] eval @ step {found.step}/" in (tmp / log).read_text())

        while not ready() and proc.poll() is None:
            assert time.time() < deadline, (tmp / log).read_text()[-3000:]
            time.sleep(0.05)
        assert proc.poll() is None, (tmp / log).read_text()[-3000:]
        for s in signals:
            os.killpg(proc.pid, s)
            time.sleep(0.05)
        proc.wait(timeout=300)
    finally:
        kill_tree(proc.pid, grace=3)
    return subprocess.CompletedProcess(proc.args, proc.returncode, (tmp / log).read_text(), "")


def rerun(tmp: Path, store: Path, name: str, env: dict[str, str], log: str) -> subprocess.CompletedProcess:
    """The same command again, to its end; its output (stdout and stderr) in the file `log`."""
    with open(tmp / log, "w") as out:
        done = subprocess.run([PYTHON, PRETRAIN, *job_args(tmp, store, name)], cwd=tmp, env=env, stdout=out,
                              stderr=subprocess.STDOUT, text=True, timeout=500)
    return subprocess.CompletedProcess(done.args, done.returncode, (tmp / log).read_text(), "")


# What may come out of a job besides the package's own lines: Ray saying which Ray the job started or
# joined (a job attached to a cluster through RAY_ADDRESS, as a submitted job is, gets the last three).
FOREIGN_LINES_ALLOWED = ("Started a local Ray instance", "set in the environment variable RAY_ADDRESS",
                         "Connecting to existing Ray cluster at address", "Connected to Ray cluster.")
RAY_OUTPUT = ("TrainingReport(", "Checkpoint successfully created", "Dataset dataset_", "Running Dataset",
              "Progress bars disabled", "Creating initial MLflow database tables", "PreemptionWatcher",
              "Token authentication is enabled", "Requesting resources")


def check_console(log: str, name: str) -> None:
    """The console's promise on a job's log (stdout and stderr in a file): at most 60 lines, none of
    them Ray's or MLflow's chatter, and the banner, evaluation tables and end summary there."""
    lines = log.splitlines()
    assert len(lines) <= 60, f"{len(lines)} lines:\n{log}"
    for noise in RAY_OUTPUT:
        assert noise not in log, f"{noise!r} in:\n{log}"
    assert "\r" not in log  # no bar redrawn into a file
    foreign = [line for line in lines if not line.startswith(("[xmodal]", "  "))
               and not any(a in line for a in FOREIGN_LINES_ALLOWED)]
    assert not foreign, "\n".join(foreign)
    assert f"[xmodal] pretrain run {name}" in lines
    assert any(line.startswith("[xmodal] eval @ step ") for line in lines)
    assert any(line.startswith("  chance/prior") for line in lines)
    assert any(line.startswith(f"[xmodal] finished run {name} in ") for line in lines)
    assert any(line.startswith("  view it     mlflow ui --backend-store-uri sqlite:///") for line in lines)



def assert_same_history(uri: str, resumed: tracking.RunRecord, clean: tracking.RunRecord) -> None:
    for key in COMPARED:
        mine, theirs = (dict(tracking.metric_history(uri, r.run_id, key)) for r in (resumed, clean))
        assert mine.keys() == theirs.keys(), (key, sorted(set(mine) ^ set(theirs)))
        worst = max(abs(mine[s] - theirs[s]) for s in theirs)
        assert worst <= 1e-5, f"{key}: the resumed run differs from the uninterrupted one by {worst}"


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory, stores, ray_local):
    """The uninterrupted run every interrupted one is compared with (in-process, on the shared Ray)."""
    from xmodal.jobs.pretrain_job import PretrainJob

    tmp = tmp_path_factory.mktemp("interrupt")
    cfg = load_config(PretrainConfig, overrides=[
        f"data.store={stores['pretrain']}", f"scale.storage_path={tmp / 'runs'}", "mlflow.run_name=clean",
        f"mlflow.tracking_uri=sqlite:///{tmp / 'mlflow.db'}", *SETTINGS])
    engine.run(PretrainJob(), cfg)
    return tmp, f"sqlite:///{tmp / 'mlflow.db'}"


@pytest.mark.slow
def test_ctrl_c_then_a_second_signal_and_each_rerun_continues_exactly(clean_run, stores, ray_local):
    """One run stopped twice, as a user stops and reruns a job, each rerun the same command:
    1. Ctrl-C (SIGINT to the job's process group) to the job on a local Ray of its own (the Quickstart's
       way): it stops at the next logged step with a checkpoint that Ray Train registered.
    2. The rerun resumes from that step; SIGTERM, then Ctrl-C 0.05 s later, once it has written a newer
       checkpoint: it leaves at once, its own local Ray too, and says where a rerun resumes from.
    3. The next rerun (attached to the shared test Ray, as a submitted job attaches to its cluster)
       resumes from the newest intact checkpoint on storage, whatever Ray Train had registered, and
       ends as the uninterrupted run ends, step by step. Ray Train's own list of the checkpoints is
       emptied before it, as a stop landing while Ray Train writes it leaves it: the rerun moves it
       aside and says so. Its output is also the console's test.
    (One run for both signals: each job start costs a minute and a half of the suite's two cores.)"""
    tmp, uri = clean_run
    store = stores["pretrain"]
    first = interrupted(tmp, store, "ctrlc", ray_env(), [signal.SIGINT], "ctrlc.log")
    assert first.returncode == 130, first.stdout[-3000:]
    assert "[xmodal] SIGINT: stopping at the next logged step with a checkpoint (Ctrl-C again to stop at once)" \
        in first.stdout
    stopped = re.findall(r"^\[xmodal\] stopped at step (\d+); rerun the same command to resume from step (\d+)$",
                         first.stdout, re.M)
    assert len(stopped) == 1 and stopped[0][0] == stopped[0][1], first.stdout[-3000:]
    step = int(stopped[0][0])
    assert 20 < step < 120 and step % 5 == 0  # after the first evaluation, at a log step
    assert "Traceback" not in first.stdout and "Gracefully aborting" not in first.stdout

    run = the_run(uri, "ctrlc")
    assert run.status == "KILLED" and run.tags[T.STOPPED_AT_STEP] == str(step)
    assert [p.value for p in tracking.metric_points(uri, run.run_id, "train/stopped_at_step")] == [step]
    assert max(p.step for p in tracking.metric_points(uri, run.run_id, "train/loss")) == step  # flushed
    found, skipped = recovery.newest_intact(*recovery.run_folder(str(tmp / "runs"), "ctrlc"))
    assert found is not None and found.step == step and not skipped
    assert not ckpt.read_meta(found.path)["finished"]
    # Ray Train registered it: it is the latest checkpoint in Ray's own snapshot too
    snapshot = (tmp / "runs" / "ctrlc" / "checkpoint_manager_snapshot.json").read_text()
    assert Path(found.path).name in snapshot

    second = interrupted(tmp, store, "ctrlc", ray_env(), [signal.SIGTERM, signal.SIGINT], "twice.log",
                         after_step=step)
    assert second.returncode == 130, second.stdout[-3000:]
    assert f"[xmodal] resuming run 'ctrlc' (MLflow run {run.run_id}): from step {step}, " in second.stdout
    assert f"[xmodal] resumed from checkpoint at step {step} " in second.stdout
    assert "[xmodal] SIGTERM: stopping at the next logged step" in second.stdout
    stopped = re.findall(r"^\[xmodal\] stopped at once; rerun the same command to resume from step (\d+)$",
                         second.stdout, re.M)
    assert len(stopped) == 1, second.stdout[-3000:]
    newer = int(stopped[0])
    assert newer > step
    run = the_run(uri, "ctrlc")
    assert run.status == "KILLED" and run.tags[T.STOPPED_AT_STEP] == str(newer)
    found, _ = recovery.newest_intact(*recovery.run_folder(str(tmp / "runs"), "ctrlc"))
    assert found is not None and found.step == newer

    ray_list = tmp / "runs" / "ctrlc" / recovery.RAY_LIST
    ray_list.write_text("")
    third = rerun(tmp, store, "ctrlc", ray_env(RAY_ADDRESS=ray_local.get_runtime_context().gcs_address), "last.log")
    assert third.returncode == 0, third.stdout[-3000:]
    assert (f"[xmodal] Ray Train's list of this run's checkpoints {ray_list} is empty (a stop landed while Ray "
            f"Train wrote it); moved aside to {recovery.RAY_LIST}.unreadable") in third.stdout, third.stdout[-3000:]
    assert (tmp / "runs" / "ctrlc" / f"{recovery.RAY_LIST}.unreadable").read_text() == ""
    assert f"(MLflow run {run.run_id}): from step {newer}, " in third.stdout
    assert f"[xmodal] resumed from checkpoint at step {newer} " in third.stdout
    check_console(third.stdout, "ctrlc")
    run = the_run(uri, "ctrlc")
    assert run.status == "FINISHED"
    assert [p.value for p in tracking.metric_points(uri, run.run_id, "train/resumed_from_step")] == [step, newer]
    assert_same_history(uri, run, the_run(uri, "clean"))


@pytest.mark.slow
def test_two_signals_at_once_set_the_flag_then_stop_at_once(ray_local):
    """SIGTERM and SIGINT delivered together (as on a loaded machine, where the first handler had not run
    before the second came): the main thread acts on them in order between its waits, never inside the
    first one's remote call. The flag is set, the second raises KeyboardInterrupt, `fit` still runs."""
    import threading

    from xmodal.runner.interrupt import GracefulStop

    release, seen = threading.Event(), {}

    def fit() -> None:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        release.wait(60)

    try:
        with pytest.raises(KeyboardInterrupt), GracefulStop() as stop:
            try:
                stop.run(fit)
            finally:
                seen.update(flag=stop.flag.get(), requested=stop.requested,
                            fit_running=not release.is_set())
    finally:
        release.set()
    assert seen == {"flag": True, "requested": True, "fit_running": True}
    assert not stop.flag.get()  # its key left the cluster's store with the run
    for s in (signal.SIGINT, signal.SIGTERM):  # the previous handlers are back
        assert getattr(signal.getsignal(s), "__self__", None) is not stop
