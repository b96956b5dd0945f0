"""xmodal.tracking.logger against a real MLflow SQLite store and a real `mlflow server`: every step
logged once, and a server outage loses no metric (waited out, or spooled and replayed)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from xmodal import tracking
from xmodal.base.errors import UserError
from xmodal_testing import REPO


def sqlite_store(tmp_path, mlflow_template) -> str:
    """A new MLflow SQLite store: a copy of the session's migrated empty one (tests/conftest.py)."""
    shutil.copyfile(mlflow_template, tmp_path / "mlflow.db")
    return f"sqlite:///{tmp_path / 'mlflow.db'}"


def test_a_rerun_step_logs_the_metrics_its_first_try_did_not_send(tmp_path, mlflow_template):
    """A worker killed after sending step 8's loss but during step 8's evaluation: the run resumes
    from step 6 and redoes 7 and 8. Step 8's loss is in MLflow (skipped), its evaluation is not (sent):
    each metric is skipped up to its own last step, so the history has every step once and no gap."""
    uri = sqlite_store(tmp_path, mlflow_template)
    run_id = tracking.create_run(uri, tracking.ensure_experiment(uri, "e"), "r", {}, {})
    first = tracking.RunLogger(uri, run_id, spool=tmp_path / "spool.jsonl")
    for step in (2, 4, 6):
        first.log({"train/loss": 1.0 / step, "eval/loss": 2.0 / step}, step)
    first.log({"train/loss": 1.0 / 8}, 8)  # killed before eval/loss of step 8
    first.close()
    rerun = tracking.RunLogger(uri, run_id, spool=tmp_path / "spool.jsonl")
    rerun.log({"train/loss": 1.0 / 8, "eval/loss": 2.0 / 8}, 8)
    rerun.close()
    assert rerun.logged_steps == {"train/loss": 8, "eval/loss": 6}
    assert [p.step for p in tracking.metric_points(uri, run_id, "train/loss")] == [2, 4, 6, 8]
    assert [p.step for p in tracking.metric_points(uri, run_id, "eval/loss")] == [2, 4, 6, 8]


def test_logger_drops_only_values_the_server_rejects(tmp_path, capfd, mlflow_template):
    uri = sqlite_store(tmp_path, mlflow_template)
    run_id = tracking.create_run(uri, tracking.ensure_experiment(uri, "e"), "r", {}, {})
    log = tracking.RunLogger(uri, run_id, spool=tmp_path / "spool.jsonl", outage_wait_s=30)
    log.log({"train/loss": 1.0, "bad name!": 2.0}, 1)
    log.log({"train/loss": 0.5}, 2)
    t0 = time.monotonic()
    assert log.close() is None and time.monotonic() - t0 < 10  # not retried until the wait ran out
    assert tracking.metric_history(uri, run_id, "train/loss") == [(1, 1.0), (2, 0.5)]
    assert "[xmodal] MLflow rejected bad name!=2.0 at step 1, not logged" in capfd.readouterr().out


def loss_steps(uri: str, run_id: str) -> list[int]:
    return [p.step for p in sorted(tracking.metric_points(uri, run_id, "train/loss"), key=lambda p: p.timestamp)]


def test_logger_rides_out_a_server_outage(server, tmp_path):
    exp = tracking.ensure_experiment(server.uri, "e")
    run_id = tracking.create_run(server.uri, exp, "r", {}, {})
    # The default wait (300 s): `mlflow server` took over a minute to start again in one CI run on a
    # loaded 2-core machine, and a 60 s wait spooled the metrics instead (what the next test checks).
    log = tracking.RunLogger(server.uri, run_id, spool=tmp_path / "spool.jsonl", outage_wait_s=tracking.WAIT_S)
    for step in range(1, 6):
        log.log({"train/loss": 1.0 / step, "train/lr": 0.1}, step)
    assert log.flush()  # what a checkpoint waits for: sent, nothing spooled
    assert loss_steps(server.uri, run_id) == [1, 2, 3, 4, 5]
    server.stop()
    t0 = time.monotonic()
    for step in range(6, 11):
        log.log({"train/loss": 1.0 / step, "train/lr": 0.1}, step)
    assert time.monotonic() - t0 < 0.1  # queued, not sent: training does not wait for the server
    back = threading.Timer(3, server.start)  # back within the logger's wait
    back.start()
    assert log.flush()  # a checkpoint waits the outage out: everything sent, nothing spooled
    back.join()
    assert loss_steps(server.uri, run_id) == list(range(1, 11))  # every step once, in order
    assert log.close() is None and not (tmp_path / "spool.jsonl").exists()
    assert [s for s, _ in tracking.metric_history(server.uri, run_id, "train/lr")] == list(range(1, 11))


def test_a_checkpoint_during_a_long_outage_waits_until_its_metrics_are_spooled(server, tmp_path):
    """The flush before a checkpoint returns once every queued value is sent or in the spool file: after an
    outage longer than outage_wait_s the sender spools; later batches go to the file after one try, and
    once the server answers again they are sent."""
    exp = tracking.ensure_experiment(server.uri, "e")
    run_id = tracking.create_run(server.uri, exp, "long-outage", {}, {})
    spool = tmp_path / "spool.jsonl"
    log = tracking.RunLogger(server.uri, run_id, spool=spool, outage_wait_s=2)
    log.log({"train/loss": 1.0}, 1)
    assert log.flush()
    server.stop()
    try:
        for step in range(2, 5):
            log.log({"train/loss": 1.0 / step}, step)
        assert not log.flush()  # spooled, not lost: the checkpoint may be reported now
        assert [i[3] for r in tracking.read_spool(spool) for i in r["items"]] == [2, 3, 4]
        log.log({"train/loss": 0.2}, 5)
        assert not log.flush()  # the outage goes on: one try, then the file
        assert [i[3] for r in tracking.read_spool(spool) for i in r["items"]] == [2, 3, 4, 5]
    finally:
        server.start()
    log.log({"train/loss": 0.1}, 6)
    assert log.flush()  # the server answers again: sent
    assert log.close() == spool
    assert loss_steps(server.uri, run_id) == [1, 6]
    tracking.replay(spool)
    assert sorted(loss_steps(server.uri, run_id)) == [1, 2, 3, 4, 5, 6]


def test_server_that_never_returns_spools_and_replay_completes_the_run(server, tmp_path, capfd):
    exp = tracking.ensure_experiment(server.uri, "e")
    run_id = tracking.create_run(server.uri, exp, "r", {}, {})
    tracking.log_metrics(server.uri, run_id, {"train/loss": 1.0}, step=1)
    server.stop()
    # Started during the outage (a restarted worker): it must start, and still skip step 1 later.
    spool = tmp_path / "run" / tracking.SPOOL_FILE
    log = tracking.RunLogger(server.uri, run_id, spool=spool, outage_wait_s=1)
    for step in range(1, 8):
        log.log({"train/loss": 1.0 / step}, step)
    log.log({"final/acc": 0.5}, 7, force=True)
    t0 = time.monotonic()
    assert log.close() == spool
    assert time.monotonic() - t0 < 60  # bounded by the 1 s outage wait, not the default 300 s: a hang guard
    line = capfd.readouterr().out.strip()
    assert line == (f"[xmodal] MLflow at {server.uri} unreachable: 8 metric values not logged, saved to {spool}; "
                    f"replay them with python jobs/replay_tracking.py {spool}")

    # The driver's end of the run: given up on after its wait, kept with a copy of the file.
    art = tmp_path / "model.pt"
    art.write_text("weights")
    out = tracking.Outbox(server.uri, run_id, spool, wait_s=1)
    out.artifact(art, "model")
    out.terminated("FINISHED")
    art.unlink()  # the checkpoint folder is gone by the time of the replay
    out.report()
    assert capfd.readouterr().out.strip() == (
        f"[xmodal] MLflow at {server.uri} unreachable: 2 end-of-run records (artifact, terminated) not logged, "
        f"saved to {spool}; replay them with python jobs/replay_tracking.py {spool}")
    ops = [json.loads(x)["op"] for x in spool.read_text().splitlines()]
    assert ops == ["metrics", "artifact", "terminated"]

    with pytest.raises(UserError, match="unreachable"):
        tracking.replay(spool)
    server.start()
    summary = tracking.replay(spool)
    assert (summary.metrics_logged, summary.metrics_skipped, summary.artifacts, summary.terminated) == (7, 1, 1, 1)
    assert summary.path == spool.with_name(spool.name + ".replayed") and not spool.exists()
    assert loss_steps(server.uri, run_id) == list(range(1, 8))
    assert tracking.metric_history(server.uri, run_id, "final/acc") == [(7, 0.5)]
    run = tracking.get_run(server.uri, run_id)
    assert run.status == "FINISHED" and tracking.list_artifacts(server.uri, run_id, "model") == ["model/model.pt"]
    # Again, through the command line: the replayed file is refused (its terminated record would end the
    # run again); renamed back, it replays with nothing new.
    end_time = run.end_time
    out = subprocess.run([sys.executable, str(REPO / "jobs" / "replay_tracking.py"), str(summary.path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and f"{summary.path}: already replayed" in out.stderr, out.stderr
    assert tracking.get_run(server.uri, run_id).end_time == end_time and summary.path.exists()
    summary.path.rename(spool)
    out = subprocess.run([sys.executable, str(REPO / "jobs" / "replay_tracking.py"), str(spool)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "0 metric values logged, 8 already there" in out.stdout and f"file renamed to {summary.path}" in out.stdout
    assert loss_steps(server.uri, run_id) == list(range(1, 8))


CHECKPOINTING_WORKER = textwrap.dedent("""
    import sys
    from xmodal import tracking

    uri, run_id, spool, phase = sys.argv[1:5]
    log = tracking.RunLogger(uri, run_id, spool=spool, outage_wait_s=2)
    steps = range(1, 11) if phase == "first" else range(21, 31)
    for step in steps:
        log.log({"train/loss": 1.0 / step}, step)
    log.flush()  # what RunHooks does before it reports the checkpoint
    print("CHECKPOINT", steps[-1], flush=True)
    if phase == "first":
        sys.stdin.readline()  # the test stops the server meanwhile
        for step in range(11, 21):
            log.log({"train/loss": 1.0 / step}, step)
        log.flush()
        print("CHECKPOINT 20", flush=True)
        for step in range(21, 24):  # steps after the checkpoint: the worker dies before they are sent
            log.log({"train/loss": 1.0 / step}, step)
        sys.stdin.readline()  # killed here
    else:
        print("CLOSED", log.close(), flush=True)
""")


@pytest.mark.slow  # about 1 min: two fresh processes, a server restart
def test_a_worker_killed_after_a_checkpoint_during_an_outage_loses_no_step(server, tmp_path):
    """The server stops just before a checkpoint; the checkpoint is reported only once the metrics of its
    steps are spooled; the worker is killed (SIGKILL) after it. Resumed from that checkpoint with the server
    back, and the spool file replayed (jobs/replay_tracking.py): every step is in MLflow once. Drives
    RunLogger as RunHooks does (log, flush, report) in a real process: the engine cannot stop a server
    between two given steps."""
    exp = tracking.ensure_experiment(server.uri, "e")
    run_id = tracking.create_run(server.uri, exp, "killed", {}, {})
    spool = tmp_path / "run" / tracking.SPOOL_FILE
    env = {**os.environ, "PYTHONPATH": str(REPO / "platform")}
    args = [sys.executable, "-c", CHECKPOINTING_WORKER, server.uri, run_id, str(spool)]
    first = subprocess.Popen([*args, "first"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert first.stdout.readline().strip() == "CHECKPOINT 10"
        assert loss_steps(server.uri, run_id) == list(range(1, 11))
        server.stop()
        first.stdin.write("stopped\n")
        first.stdin.flush()
        assert first.stdout.readline().strip() == "CHECKPOINT 20"  # reported only after this:
        spooled = sorted(i[3] for r in tracking.read_spool(spool) for i in r["items"])
        assert set(range(11, 21)) <= set(spooled), spooled  # the checkpoint's steps are in the spool file
    finally:
        first.kill()  # SIGKILL: no close, no atexit
        first.wait()
        server.start()
    resumed = subprocess.run([*args, "resume"], capture_output=True, text=True, timeout=300, env=env)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"[xmodal] {spool} holds metric values an earlier attempt" in resumed.stdout  # said at the restart
    assert "CLOSED None" in resumed.stdout  # the resumed worker sent everything
    assert sorted(loss_steps(server.uri, run_id)) == [*range(1, 11), *range(21, 31)]
    replay = subprocess.run([sys.executable, str(REPO / "jobs" / "replay_tracking.py"), str(spool)],
                            capture_output=True, text=True, timeout=300, env=env)
    assert replay.returncode == 0, replay.stderr[-3000:]
    assert "10 metric values logged" in replay.stdout  # steps 11-20; 21-23, if spooled, are there already
    assert sorted(loss_steps(server.uri, run_id)) == list(range(1, 31))  # every step once
