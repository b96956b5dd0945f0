"""Ctrl-C and SIGTERM during a job (xmodal.train.interrupt): a real `jobs/pretrain.py` in a process
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

from xmodal import run_tags as T
from xmodal import tracking
from xmodal.config import PretrainConfig, load_config
from xmodal.train import checkpoint as ckpt
from xmodal.train import recovery
from xmodal_testing import PYTHON, REPO, kill_tree, ray_env

PRETRAIN = str(REPO / "jobs" / "pretrain.py")
# 5 epochs of 45 steps, cut at 200: an evaluation (and checkpoint) every 20 steps, a log step every 5.
SETTINGS = ["preset=tiny", "train.epochs=5", "train.batch_size=16", "train.max_steps=200", "train.eval_every=20",
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
                log: str) -> subprocess.CompletedProcess:
    """The job until its first evaluation has been shown and its checkpoint is on storage (written once
    the evaluation's metrics are in MLflow: seconds on a loaded machine), then `signals` to its process
    group (a terminal's Ctrl-C reaches every process of the foreground group), 0.05 s apart."""
    out = open(tmp / log, "w")  # noqa: SIM115 - the job's output, read back below
    proc = subprocess.Popen([PYTHON, PRETRAIN, *job_args(tmp, store, name)], cwd=tmp, env=env,
                            start_new_session=True, stdout=out, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.time() + 300
        def ready() -> bool:
            return ("[xmodal] eval @ step 20/" in (tmp / log).read_text()
                    and recovery.newest_intact(*recovery.run_folder(str(tmp / "runs"), name))[0] is not None)

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


def rerun(tmp: Path, store: Path, name: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([PYTHON, PRETRAIN, *job_args(tmp, store, name)], cwd=tmp, env=env, capture_output=True,
                          text=True, timeout=500)


def assert_same_history(uri: str, resumed: tracking.RunRecord, clean: tracking.RunRecord) -> None:
    for key in COMPARED:
        mine, theirs = (dict(tracking.metric_history(uri, r.run_id, key)) for r in (resumed, clean))
        assert mine.keys() == theirs.keys(), (key, sorted(set(mine) ^ set(theirs)))
        worst = max(abs(mine[s] - theirs[s]) for s in theirs)
        assert worst <= 1e-5, f"{key}: the resumed run differs from the uninterrupted one by {worst}"


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory, stores, ray_local):
    """The uninterrupted run every interrupted one is compared with (in-process, on the shared Ray)."""
    from xmodal.train.pretrain import PretrainJob

    tmp = tmp_path_factory.mktemp("interrupt")
    cfg = load_config(PretrainConfig, overrides=[
        f"data.store={stores['pretrain']}", f"scale.storage_path={tmp / 'runs'}", "mlflow.run_name=clean",
        f"mlflow.tracking_uri=sqlite:///{tmp / 'mlflow.db'}", *SETTINGS])
    PretrainJob().run(cfg)
    return tmp, f"sqlite:///{tmp / 'mlflow.db'}"


@pytest.mark.slow
def test_ctrl_c_stops_at_a_step_with_a_checkpoint_and_the_rerun_continues_exactly(clean_run, stores, ray_local):
    tmp, uri = clean_run
    env = ray_env(RAY_ADDRESS=ray_local.get_runtime_context().gcs_address)
    first = interrupted(tmp, stores["pretrain"], "ctrlc", env, [signal.SIGINT], "ctrlc.log")
    assert first.returncode == 130, first.stdout[-3000:]
    assert "[xmodal] SIGINT: stopping at the next logged step with a checkpoint (Ctrl-C again to stop at once)" \
        in first.stdout
    stopped = re.findall(r"^\[xmodal\] stopped at step (\d+); rerun the same command to resume from step (\d+)$",
                         first.stdout, re.M)
    assert len(stopped) == 1 and stopped[0][0] == stopped[0][1], first.stdout[-3000:]
    step = int(stopped[0][0])
    assert 20 < step < 200 and step % 5 == 0  # after the first evaluation, at a log step
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

    second = rerun(tmp, stores["pretrain"], "ctrlc", env)
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert f"[xmodal] resuming run 'ctrlc' (MLflow run {run.run_id}): from step {step}, " in second.stdout
    assert f"[xmodal] resumed from checkpoint at step {step} " in second.stdout
    run = the_run(uri, "ctrlc")
    assert run.status == "FINISHED"
    assert [p.value for p in tracking.metric_points(uri, run.run_id, "train/resumed_from_step")] == [step]
    assert_same_history(uri, run, the_run(uri, "clean"))


@pytest.mark.slow
def test_a_second_signal_stops_at_once_and_the_rerun_resumes_from_the_newest_intact_checkpoint(
        clean_run, stores, ray_local):
    """SIGTERM, then Ctrl-C 0.05 s later, to a job that started its own local Ray (the Quickstart's way):
    the job leaves at once, the rerun resumes from the newest checkpoint on storage, whatever Ray
    Train had registered, and ends as the uninterrupted run ends."""
    tmp, uri = clean_run
    first = interrupted(tmp, stores["pretrain"], "twice", ray_env(), [signal.SIGTERM, signal.SIGINT], "twice.log")
    assert first.returncode == 130, first.stdout[-3000:]
    assert "[xmodal] SIGTERM: stopping at the next logged step" in first.stdout
    stopped = re.findall(r"^\[xmodal\] stopped at once; rerun the same command to resume from step (\d+)$",
                         first.stdout, re.M)
    assert len(stopped) == 1, first.stdout[-3000:]
    step = int(stopped[0])
    assert step >= 20
    run = the_run(uri, "twice")
    assert run.status == "KILLED" and run.tags[T.STOPPED_AT_STEP] == str(step)
    found, _ = recovery.newest_intact(*recovery.run_folder(str(tmp / "runs"), "twice"))
    assert found is not None and found.step == step

    second = rerun(tmp, stores["pretrain"], "twice", ray_env(RAY_ADDRESS=ray_local.get_runtime_context().gcs_address))
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert f"(MLflow run {run.run_id}): from step {step}, " in second.stdout
    assert f"[xmodal] resumed from checkpoint at step {step} " in second.stdout
    run = the_run(uri, "twice")
    assert run.status == "FINISHED"
    assert_same_history(uri, run, the_run(uri, "clean"))


@pytest.mark.slow
def test_two_signals_at_once_set_the_flag_then_stop_at_once(ray_local):
    """SIGTERM and SIGINT delivered together (as on a loaded machine, where the first handler had not run
    before the second came): the main thread acts on them in order between its waits, never inside the
    first one's remote call. The flag is set, the second raises KeyboardInterrupt, `fit` still runs."""
    import threading

    from xmodal.train.interrupt import GracefulStop

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
                seen.update(flag=ray_local.get(stop.flag.get.remote()), requested=stop.requested,
                            fit_running=not release.is_set())
    finally:
        release.set()
    assert seen == {"flag": True, "requested": True, "fit_running": True}
    for s in (signal.SIGINT, signal.SIGTERM):  # the previous handlers are back
        assert getattr(signal.getsignal(s), "__self__", None) is not stop
