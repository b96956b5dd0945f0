"""tracking.py against a real MLflow SQLite store and a real `mlflow server`: runs come back as plain
data, not MLflow objects; a server outage loses no metric."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from xmodal import tracking
from xmodal.errors import UserError
from xmodal.run_tags import PARENT_TAG, RUN_NAME_TAG
from xmodal_testing import REPO, MlflowServer, free_port


def test_run_lifecycle_and_resume_skips_logged_steps(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    uri = tracking.resolve_tracking_uri(None)
    assert uri == f"sqlite:///{tmp_path / 'mlflow.db'}"
    exp = tracking.ensure_experiment(uri, "e")
    assert tracking.ensure_experiment(uri, "e") == exp
    run_id = tracking.create_run(uri, exp, "r1", {f"p{i}": i for i in range(150)}, {"model": "lxmert"})
    found = tracking.find_run(uri, exp, "r1")
    assert isinstance(found, tracking.RunRecord) and found.run_id == run_id
    assert tracking.find_run(uri, exp, "other") is None
    assert (found.name, found.status, found.tags["model"]) == ("r1", "RUNNING", "lxmert")

    log = tracking.RunLogger(uri, run_id)
    for step in (1, 2, 3):
        log.log({"train/loss": 1.0 / step}, step)
    assert log.close() is None  # everything sent: no spool file
    # A restarted worker replays steps 2..4: only step 4 is new.
    log2 = tracking.RunLogger(uri, run_id)
    for step in (2, 3, 4):
        log2.log({"train/loss": 10.0 + step}, step)
    log2.close()
    assert log2.logged_steps == {"train/loss": 3}
    points = tracking.metric_points(uri, run_id, "train/loss")
    assert all(isinstance(p, tracking.MetricPoint) and p.timestamp > 0 for p in points)
    assert sorted((p.step, p.value) for p in points) == [(1, 1.0), (2, 0.5), (3, 1 / 3), (4, 14.0)]
    assert tracking.metric_history(uri, run_id, "train/loss") == [(1, 1.0), (2, 0.5), (3, 1 / 3), (4, 14.0)]

    run = tracking.get_run(uri, run_id)
    assert len(run.params) == 150 and run.params["p7"] == "7" and run.tags["model"] == "lxmert"
    assert run.tags[RUN_NAME_TAG] == "r1" and run.tags["model"] == "lxmert"
    assert (run.name, run.experiment_id, run.status, run.end_time) == ("r1", exp, "RUNNING", None)
    assert run.metrics == {"train/loss": 14.0} and run.parent_run_id is None
    tracking.set_terminated(uri, run_id)
    done = tracking.get_run(uri, run_id)
    assert done.status == "FINISHED" and done.end_time >= done.start_time > 0
    assert run.status == "RUNNING"  # a record is a snapshot


def test_a_rerun_step_logs_the_metrics_its_first_try_did_not_send(tmp_path):
    """A worker killed after sending step 8's loss but during step 8's evaluation: the run resumes
    from step 6 and redoes 7 and 8. Step 8's loss is in MLflow (skipped), its evaluation is not (sent):
    each metric is skipped up to its own last step, so the history has every step once and no gap."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
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


def test_records_are_plain_frozen_data(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    exp = tracking.ensure_experiment(uri, "e")
    parent = tracking.create_run(uri, exp, "p", {}, {"xmodal.kind": "sweep"})
    kids = [tracking.create_run(uri, exp, f"c{i}", {"i": i}, {}, parent_run_id=parent) for i in range(2)]
    tracking.log_metrics(uri, kids[0], {"eval/acc": 0.5}, step=3)
    tracking.set_terminated(uri, kids[0])

    children = tracking.child_runs(uri, parent)
    assert sorted(c.run_id for c in children) == sorted(kids) and {c.name for c in children} == {"c0", "c1"}
    assert all(c.parent_run_id == parent and c.tags[PARENT_TAG] == parent for c in children)
    assert children[0].metrics == {"eval/acc": 0.5} and children[1].metrics == {}
    # Every field is a str / int / None or a dict of them: nothing of MLflow's leaks out.
    for rec in [*children, tracking.get_run(uri, parent)]:
        for f in dataclasses.fields(rec):
            v = getattr(rec, f.name)
            assert type(v) in (str, int, type(None), dict), (f.name, type(v))
            if isinstance(v, dict):
                assert all(type(k) is str and type(x) in (str, float) for k, x in v.items()), f.name
        with pytest.raises(dataclasses.FrozenInstanceError):
            rec.status = "KILLED"

    everything = tracking.search_runs(uri, [exp])
    assert everything[0].run_id == parent and sorted(r.run_id for r in everything[1:]) == sorted(kids)
    assert [r.run_id for r in tracking.search_runs(uri, [exp], "attributes.status = 'FINISHED'")] == [kids[0]]
    latest = tracking.latest_finished_run(uri, "e", {})
    assert latest is not None and latest.run_id == kids[0]
    assert tracking.latest_finished_run(uri, "missing", {}) is None
    assert tracking.get_experiment_id(uri, "e") == exp and tracking.get_experiment_id(uri, "missing") is None
    assert "e" in tracking.experiment_names(uri)


def test_unknown_run_and_artifacts(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # artifacts go under the working directory
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    exp = tracking.ensure_experiment(uri, "e")
    run_id = tracking.create_run(uri, exp, "r", {}, {})
    with pytest.raises(tracking.RunNotFound, match="deadbeef"):
        tracking.get_run(uri, "deadbeef")
    assert issubclass(tracking.RunNotFound, LookupError)

    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "a.txt").write_text("a")
    tracking.log_artifacts(uri, run_id, tmp_path / "out", "folder")
    assert tracking.list_artifacts(uri, run_id) == ["folder"]
    assert tracking.list_artifacts(uri, run_id, "folder") == ["folder/a.txt"]
    got = tracking.download_artifacts(uri, run_id, "folder/a.txt", tmp_path / "dl")
    assert got.read_text() == "a"


def test_bad_tracking_uri_is_explained():
    with pytest.raises(ValueError, match="mlflow.tracking_uri 'mlflow.db'"):
        tracking.resolve_tracking_uri("mlflow.db")


def test_logger_drops_only_values_the_server_rejects(tmp_path, capfd):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id = tracking.create_run(uri, tracking.ensure_experiment(uri, "e"), "r", {}, {})
    log = tracking.RunLogger(uri, run_id, spool=tmp_path / "spool.jsonl", outage_wait_s=30)
    log.log({"train/loss": 1.0, "bad name!": 2.0}, 1)
    log.log({"train/loss": 0.5}, 2)
    t0 = time.monotonic()
    assert log.close() is None and time.monotonic() - t0 < 10  # not retried until the wait ran out
    assert tracking.metric_history(uri, run_id, "train/loss") == [(1, 1.0), (2, 0.5)]
    assert "[xmodal] MLflow rejected bad name!=2.0 at step 1, not logged" in capfd.readouterr().out


# ---------------------------------------------------------------- a tracking server that goes away


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server for the module (starting one costs seconds); each test leaves it running."""
    s = MlflowServer(tmp_path_factory.mktemp("mlflow-server")).start()
    yield s
    s.stop()


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


def test_outage_wait_bounds_every_wait_and_names_the_setting(server, tmp_path):
    """A server that answered once and went away is waited for, up to the URI's mlflow.outage_wait_s
    (not the 300 s default), then a UserError names the URI, the call and the setting."""
    exp = tracking.ensure_experiment(server.uri, "e")
    tracking.set_outage_wait(server.uri, 2)
    server.stop()
    try:
        t0 = time.monotonic()
        with pytest.raises(UserError) as e:
            tracking.create_run(server.uri, exp, "r2", {}, {})
        waited = time.monotonic() - t0
        # waited out (not refused at once: this process reached it), and far less than the default
        assert 1.5 < waited < tracking.WAIT_S / 10, waited
        assert str(e.value).startswith(f"MLflow at {server.uri}: creating run 'r2' failed for 2 s, the wait "
                                       "mlflow.outage_wait_s allows")
        with pytest.raises(UserError, match="opening experiment 'e' failed for 2 s"):
            tracking.ensure_experiment(server.uri, "e")  # a first-contact call too: the server was reached
    finally:
        tracking.set_outage_wait(server.uri, tracking.WAIT_S)
        server.start()


def test_a_server_never_reached_that_refuses_fails_at_once(tmp_path):
    """Nothing listens at the URI (a wrong port, a server never started): the first call fails at once,
    naming the URI, instead of waiting for mlflow.outage_wait_s."""
    uri = f"http://127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    with pytest.raises(UserError) as e:
        tracking.ensure_experiment(uri, "e")
    assert time.monotonic() - t0 < tracking.WAIT_S / 10
    assert str(e.value).startswith(f"MLflow at {uri} (opening experiment 'e'): nothing listens there (")
    assert "mlflow.tracking_uri" in str(e.value)


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
    assert time.monotonic() - t0 < 5
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
    # Again, through the command line: nothing new.
    out = subprocess.run([sys.executable, str(REPO / "jobs" / "replay_tracking.py"), str(summary.path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "0 metric values logged, 8 already there" in out.stdout
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


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    ('{"op": "metrics", "uri": "sqlite:///x.db", "run_id": "r", "items": [["a", 1, 2, 3]]}\n{"op": "metr',
     "line 2: not valid JSON"),
    ('{"op": "rename", "uri": "sqlite:///x.db", "run_id": "r"}', "line 1: unknown op 'rename'; expected"),
    ('{"op": "metrics", "uri": "sqlite:///x.db", "run_id": "r", "items": [["a", "one", 2, 3]]}',
     r"line 1: metric item \['a', 'one', 2, 3\]; expected \[key, value, timestamp_ms, step\]"),
    ('{"op": "artifact", "uri": "sqlite:///x.db", "run_id": "r", "path": "/nonexistent/model.pt"}',
     "line 1: artifact file '/nonexistent/model.pt' does not exist"),
    ('{"op": "terminated", "uri": "sqlite:///x.db", "run_id": "r"}', "line 1: op 'terminated' without 'status'"),
    ("", "holds no record"),
    ('{"op": "metrics", "uri": "sqlite:///x.db", "run_id": "r", "items": 5}', "line 1: 'items' is 5; expected a list"),
    ('{"op": "terminated", "uri": "sqlite:///x.db", "run_id": 7, "status": "FINISHED"}',
     "line 1: 'run_id' is 7; expected a string"),
    # the record's database does not exist: replay never creates one
    ('{"op": "terminated", "uri": "sqlite:///x.db", "run_id": "r", "status": "FINISHED"}',
     "cannot replay into sqlite:///x.db: no MLflow database at x.db"),
])
def test_bad_spool_file_is_rejected_before_anything_is_sent(tmp_path, content, message):
    f = tmp_path / "spool.jsonl"
    if content is not None:
        f.write_text(content)
    with pytest.raises(UserError, match=message) as e:
        tracking.replay(f)
    assert str(f) in str(e.value)
    assert not (tmp_path / "x.db").exists()  # nothing written to MLflow
    if content is not None:
        assert f.exists()


def test_replay_into_a_file_that_is_not_an_mlflow_database_leaves_it_alone(tmp_path):
    """A record (or --tracking-uri) naming an empty file, a folder or a foreign SQLite file: one error
    naming it, and the file is not turned into an MLflow database."""
    import sqlite3

    with sqlite3.connect(tmp_path / "other.db") as db:
        db.execute("create table notes (text)")
    (tmp_path / "empty.db").write_bytes(b"")
    (tmp_path / "folder.db").mkdir()
    (tmp_path / "binary.jsonl").write_bytes(b"\x80\x04\x95 not text")
    with pytest.raises(UserError, match="binary.jsonl: not UTF-8 text"):
        tracking.replay(tmp_path / "binary.jsonl")
    f = tmp_path / "spool.jsonl"
    for name, message in (("empty.db", "an empty file"), ("folder.db", "is a directory"),
                          ("other.db", "an SQLite database without MLflow's tables")):
        uri = f"sqlite:///{tmp_path / name}"
        f.write_text(json.dumps({"op": "terminated", "uri": uri, "run_id": "r", "status": "FINISHED"}) + "\n")
        with pytest.raises(UserError, match=f"{name}: {message}"):
            tracking.replay(f)
        with pytest.raises(UserError, match=f"{name}: {message}"):
            tracking.replay(f, uri)
    assert (tmp_path / "empty.db").read_bytes() == b"" and f.exists()
    with sqlite3.connect(tmp_path / "other.db") as db:
        assert [r[0] for r in db.execute("select name from sqlite_master")] == ["notes"]


def _replay_cli(*args: str, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO / "platform")}
    env.pop("MLFLOW_TRACKING_URI", None)
    return subprocess.run([sys.executable, str(REPO / "jobs" / "replay_tracking.py"), *args], capture_output=True,
                          text=True, timeout=120, cwd=cwd, env=env)


def test_a_spool_naming_a_deleted_or_foreign_run_replays_nothing_and_says_which(tmp_path):
    """Every run of the file is checked before the first record is sent: a deleted run (MLflow refuses
    its values) or one the store does not hold is one error naming it, and the runs before it in the
    file get nothing (they used to be logged before the replay failed on the next run, half-done)."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    exp = tracking.ensure_experiment(uri, "e")
    alive, deleted = (tracking.create_run(uri, exp, name, {}, {}) for name in ("alive", "deleted"))
    MlflowClient(uri).delete_run(deleted)
    other = f"sqlite:///{tmp_path / 'other.db'}"
    foreign = tracking.create_run(other, tracking.ensure_experiment(other, "e"), "elsewhere", {}, {})

    def spool(name: str, *run_ids: str):
        f = tmp_path / name
        f.write_text("".join(json.dumps(rec) + "\n" for r in run_ids for rec in (
            {"op": "metrics", "uri": uri, "run_id": r, "items": [["loss", 0.5, 1, 1], ["loss", 0.4, 2, 2]]},
            {"op": "terminated", "uri": uri, "run_id": r, "status": "FINISHED"})))
        return f

    out = _replay_cli(str(spool("one.jsonl", deleted)), cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    assert f"run '{deleted}' is deleted in {uri}" in lines[0] and "nothing was replayed" in lines[0]
    assert f"mlflow runs restore --run-id {deleted}" in lines[0]

    for f, bad, said in ((spool("two.jsonl", alive, deleted), deleted, "is deleted in"),
                         (spool("three.jsonl", alive, foreign), foreign, f"is not in {uri}")):
        with pytest.raises(UserError) as e:
            tracking.replay(f)
        assert f"record 3 (2 runs in the file): run '{bad}' {said}" in str(e.value)
        assert "nothing was replayed" in str(e.value) and f.exists()
        assert tracking.metric_points(uri, alive, "loss") == []  # the first run's records were not sent
        assert tracking.get_run(uri, alive).status == "RUNNING"
    assert not list(tmp_path.glob("*.replayed"))
    assert tracking.metric_points(other, foreign, "loss") == []


# ---------------------------------------------------------------- what the MLflow UI reads


def test_source_tags_name_the_entry_point_commit_and_command(monkeypatch):
    from xmodal import run_tags as T
    from xmodal.tracking.runs import _RAY_JOB_ENV

    monkeypatch.delenv(_RAY_JOB_ENV, raising=False)
    tags = tracking.source_tags([str(REPO / "jobs" / "pretrain.py"), "--set", "train.note=a b"])
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True).stdout.strip()
    assert tags == {T.SOURCE_NAME: "jobs/pretrain.py", T.SOURCE_TYPE: "LOCAL", T.GIT_COMMIT: head,
                    T.GIT_DIRTY: "true" if dirty else "false",
                    T.COMMAND: "jobs/pretrain.py --set 'train.note=a b'"}
    monkeypatch.setenv(_RAY_JOB_ENV, "{}")  # what `ray job submit` sets in the job's driver
    assert tracking.source_tags(["/elsewhere/run.py"])[T.SOURCE_TYPE] == "JOB"
    assert tracking.source_tags(["/elsewhere/run.py"])[T.SOURCE_NAME] == "/elsewhere/run.py"


def test_experiments_open_in_the_training_view_and_datasets_are_logged_once(tmp_path):
    from mlflow import MlflowClient

    from xmodal import run_tags as T

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = tracking.ensure_experiment(uri, "new")
    assert client.get_experiment(exp).tags[T.EXPERIMENT_KIND] == "custom_model_development"
    # its description, by the job that created it (here pytest: the general one)
    assert client.get_experiment(exp).tags[T.NOTE] == "Model-training runs logged by xmodal (experiment 'new')."
    assert tracking.experiment_description("x", ["/repo/jobs/sweep.py", "space.yaml"]).startswith(
        "Ablation sweeps (jobs/sweep.py): one parent run per sweep")
    old = client.create_experiment("old")  # made before experiments were marked
    genai = client.create_experiment("genai", tags={T.EXPERIMENT_KIND: "genai_development", T.NOTE: "mine"})
    assert tracking.ensure_experiment(uri, "old", description="Pretraining runs.") == old
    assert client.get_experiment(old).tags[T.EXPERIMENT_KIND] == "custom_model_development"
    assert client.get_experiment(old).tags[T.NOTE] == "Pretraining runs."
    tracking.ensure_experiment(uri, "genai")
    assert client.get_experiment(genai).tags[T.EXPERIMENT_KIND] == "genai_development"  # a user's choice stays
    assert client.get_experiment(genai).tags[T.NOTE] == "mine"  # and so does a user's description

    run_id = tracking.create_run(uri, exp, "r", {}, {})
    # The end summary's address opens the run's page in the training view (MLflow 3.17's UI decides the
    # view by the address's query, defaulting to GenAI, whatever the experiment's kind tag).
    page = f"http://127.0.0.1:5000/#/experiments/{exp}/runs/{run_id}?workflowType=machine_learning"
    assert tracking.run_url(uri, run_id) == page
    assert tracking.ui_command(uri, run_id) == f"mlflow ui --backend-store-uri {uri}\n  then open   {page}"
    assert tracking.ui_command(uri) == f"mlflow ui --backend-store-uri {uri}"
    assert tracking.run_url("http://head:5000/", "abc", "7") == \
        "http://head:5000/#/experiments/7/runs/abc?workflowType=machine_learning"
    for _ in range(2):  # a resumed run logs its data again
        tracking.log_dataset(uri, run_id, "lxmert", str(tmp_path / "store"), "0123456789abcdef",
                             {"rows": {"train": 10}, "dims": {"feat_dim": 16}})
    tracking.log_dataset(uri, run_id, "remote", "s3://bucket/store", "fedcba9876543210", {"rows": {}})
    inputs = client.get_run(run_id).inputs.dataset_inputs
    assert sorted(d.dataset.name for d in inputs) == ["lxmert", "remote"]
    local = next(d.dataset for d in inputs if d.dataset.name == "lxmert")
    assert (local.digest, local.source_type, json.loads(local.source)) == (
        "0123456789abcdef", "local", {"uri": str(tmp_path / "store")})
    assert json.loads(local.profile) == {"rows": {"train": 10}, "dims": {"feat_dim": 16}}
    remote = next(d.dataset for d in inputs if d.dataset.name == "remote")
    assert (remote.source_type, json.loads(remote.source)) == ("s3", {"uri": "s3://bucket/store"})


def test_a_sqlite_experiment_keeps_its_artifacts_beside_the_database(tmp_path, monkeypatch):
    """Not in ./mlruns of whatever folder the job was started from (MLflow's default)."""
    from mlflow import MlflowClient

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    db = tmp_path / "tracking" / "mlflow.db"
    db.parent.mkdir()
    uri = f"sqlite:///{db}"
    exp = tracking.ensure_experiment(uri, "layers / ablation")
    run_id = tracking.create_run(uri, exp, "r", {}, {})
    note = tmp_path / "note.txt"
    note.write_text("hello")
    tracking.log_artifact(uri, run_id, note)
    location = MlflowClient(uri).get_experiment(exp).artifact_location
    assert location.startswith((db.parent / "mlruns").as_uri() + "/layers_ablation-"), location
    assert [p.name for p in (db.parent / "mlruns").rglob("note.txt")] == ["note.txt"]
    assert list(elsewhere.iterdir()) == []
    assert tracking.artifact_location("http://127.0.0.1:5000", "x") is None
