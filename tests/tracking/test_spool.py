"""xmodal.tracking.spool: replay checks the whole file, its store and its runs before it sends
anything, and says what is wrong."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from xmodal import tracking
from xmodal.base.errors import UserError
from xmodal_testing import REPO


@pytest.mark.parametrize("content, message", [
    (None, "no such file"),
    ('{"op": "metrics", "uri": "sqlite:///x.db", "run_id": "r", "items": [["a", 1, 2, 3]]}\n{"op": "metr',
     "line 2: not valid JSON"),
    ('{"op": "rename", "uri": "sqlite:///x.db", "run_id": "r"}', "line 1: unknown op 'rename'; expected"),
    ('{"op": "metrics", "uri": "sqlite:///x.db", "run_id": "r", "items": [["a", "one", 2, 3]]}',
     r"line 1: metric item 0 \['a', 'one', 2, 3\]: value 'one'; expected a number"),
    ('{"op": "metrics", "uri": "sqlite:///x.db", "run_id": "r", "items": [["a", 1, 2]]}',
     r"line 1: metric item 0 \['a', 1, 2\]; expected \[key, value, timestamp_ms, step\]"),
    ('{"op": "artifact", "uri": "sqlite:///x.db", "run_id": "r", "path": "/nonexistent/model.pt"}',
     "line 1: artifact file '/nonexistent/model.pt' does not exist"),
    ('{"op": "terminated", "uri": "sqlite:///x.db", "run_id": "r"}', "line 1: op 'terminated' without 'status'"),
    ("", "holds no record"),
    ('{"op": "metrics", "uri": "sqlite:///x.db", "run_id": "r", "items": 5}', "line 1: 'items' is 5; expected a list"),
    ('{"op": "terminated", "uri": "sqlite:///x.db", "run_id": 7, "status": "FINISHED"}',
     "line 1: 'run_id' is 7; expected a non-empty string"),
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


GOOD = {"uri": "sqlite:///x.db", "run_id": "r"}
INT64 = "expected a whole number from -9223372036854775808 to 9223372036854775807 (MLflow stores a 64-bit integer)"
LONG = "x" * 9000


def _metric(*item) -> dict:
    return {"op": "metrics", **GOOD, "items": [["ok", 1.0, 1, 1], list(item)]}


@pytest.mark.parametrize("record, message", [
    # a step or timestamp MLflow cannot store: it used to be retried for 300 s as a locked database
    (_metric("a", 1.0, 1, 2 ** 70), f"metric item 1 ['a', 1.0, 1, {2 ** 70}]: step {2 ** 70}; {INT64}"),
    (_metric("a", 1.0, 1, 2 ** 63), f"step {2 ** 63}; {INT64}"),
    # a fractional step used to be truncated, exit 0
    (_metric("a", 1.0, 1, 1.7), f"metric item 1 ['a', 1.0, 1, 1.7]: step 1.7; {INT64}"),
    (_metric("a", 1.0, 1, 2.0), f"step 2.0; {INT64}"),
    (_metric("a", 1.0, 1, True), f"step True; {INT64}"),
    (_metric("a", 1.0, 1.5, 1), "timestamp_ms 1.5; expected a whole number of milliseconds from 0 to"),
    (_metric("a", 1.0, -1, 1), "timestamp_ms -1; expected a whole number of milliseconds"),
    (_metric("a", 1.0, 2 ** 64, 1), f"timestamp_ms {2 ** 64}; expected"),
    (_metric("a", True, 1, 1), "value True; expected a number"),
    (_metric("a", 10 ** 400, 1, 1), re.compile(r"value 1000000\d+\.\.\. \(401 characters\); expected a number")),
    (_metric("../a", 1.0, 1, 1), "key '../a'; expected a normalized relative path"),
    (_metric("a@1", 1.0, 1, 1), "key 'a@1'; expected letters, digits and _ - . : / or spaces only"),
    (_metric("", 1.0, 1, 1), "key ''; expected a non-empty string"),
    ({"op": "metrics", **GOOD, "items": "ab"}, "'items' is 'ab'; expected a list of"),
    # MLflow's "Invalid artifact path" (INTERNAL_ERROR) was retried for 300 s as an outage
    ({"op": "artifact", **GOOD, "path": __file__, "artifact_path": "../../evil"},
     "'artifact_path' is '../../evil'; expected null or a folder inside the run's artifacts"),
    ({"op": "artifact", **GOOD, "path": __file__, "artifact_path": "/etc"}, "'artifact_path' is '/etc'; expected"),
    ({"op": "artifact", **GOOD, "path": __file__, "artifact_path": "a/../b"}, "'artifact_path' is 'a/../b'"),
    ({"op": "artifact", **GOOD, "path": __file__, "artifact_path": "a//b"}, "'artifact_path' is 'a//b'"),
    ({"op": "artifact", **GOOD, "path": __file__, "artifact_path": 3}, "'artifact_path' is 3; expected null"),
    ({"op": "tags", **GOOD, "tags": ["a"]}, "'tags' is ['a']; expected an object of tag names to string values"),
    ({"op": "tags", **GOOD, "tags": {"a": 1}}, "tag 'a' is 1; expected a string"),
    ({"op": "tags", **GOOD, "tags": {"a/": "v"}}, "tag key 'a/'; expected a normalized relative path"),
    ({"op": "tags", **GOOD, "tags": {"k" * 251: "v"}}, "expected at most 250 characters (MLflow's limit), not 251"),
    ({"op": "terminated", **GOOD, "status": "DONE"}, "status 'DONE'; expected FINISHED, FAILED or KILLED"),
    ({"op": "terminated", **GOOD, "status": ""}, "'status' is ''; expected a non-empty string"),
    ({"op": "terminated", "uri": "", "run_id": "r", "status": "FINISHED"}, "'uri' is ''; expected a non-empty string"),
    # long values are cut short in the error line
    ({"op": "tags", **GOOD, "tags": {"a": [LONG]}},
     re.compile(r"tag 'a' is \['x+\.\.\. \(9004 characters\); expected a string")),
    ({"op": "terminated", **GOOD, "status": LONG},
     re.compile(r"status 'x+\.\.\. \(9002 characters\); expected FINISHED")),
    ({"op": LONG, **GOOD}, re.compile(r"unknown op 'x+\.\.\. \(9002 characters\); expected")),
])
def test_a_value_mlflow_would_refuse_is_named_before_anything_is_sent(tmp_path, record, message):
    """Each key of each op is checked as MLflow would take it, on line 2 here: after a good line 1, which
    is not sent (the error names the file, the line, the key and the value, cut short when long)."""
    f = tmp_path / "spool.jsonl"
    f.write_text(json.dumps(_metric("ok", 1.0, 1, 1)) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(UserError) as e:
        tracking.replay(f)
    assert (message.search(str(e.value)) if isinstance(message, re.Pattern) else message in str(e.value)), str(e.value)
    assert str(e.value).startswith(f"{f}, line 2: ")
    assert len(str(e.value)) < 400 and "\n" not in str(e.value)
    assert f.exists() and not (tmp_path / "x.db").exists()


def test_every_op_the_logger_writes_is_read_back(tmp_path):
    """Every record shape of tracking/logger.py (the run logger's metrics; the outbox's artifact, tags,
    metrics, terminated), with the values a run writes (NaN from a diverged loss, a null artifact folder,
    an empty tag value), passes read_spool as written."""
    art = tmp_path / "model.pt"
    art.write_text("weights")
    records = [{"op": "metrics", **GOOD, "items": [["train/loss", float("nan"), 1733580000000, 1],
                                                   ["train/loss", float("inf"), 1733580000001, 2],
                                                   ["time/end_of_run_s", 12.5, 1733580000002, 0]]},
               {"op": "artifact", **GOOD, "path": str(art), "artifact_path": "model"},
               {"op": "artifact", **GOOD, "path": str(art), "artifact_path": None},
               {"op": "tags", **GOOD, "tags": {"xmodal.stopped_at_step": "7", "note": "", "long": LONG}},
               {"op": "metrics", **GOOD, "items": []},
               *({"op": "terminated", **GOOD, "status": s} for s in ("FINISHED", "FAILED", "KILLED"))]
    f = tmp_path / "spool.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in records))
    back = tracking.read_spool(f)
    assert [r["op"] for r in back] == [r["op"] for r in records]
    assert back[3]["tags"] == records[3]["tags"]


def test_an_empty_argument_or_a_replayed_file_is_refused_and_says_so(tmp_path):
    """An empty argument used to be read as the current folder (".: is a directory"); a file already
    replayed was replayed again and the line said "file renamed to" its own name."""
    out = _replay_cli("", cwd=tmp_path)
    assert out.returncode == 2 and out.stderr.strip() == (
        "error: the spool file argument is empty (''); expected the path of a mlflow_unlogged.jsonl"), out.stderr
    done = tmp_path / "s.jsonl.replayed"
    done.write_text(json.dumps({"op": "terminated", **GOOD, "status": "FINISHED"}) + "\n")
    out = _replay_cli(str(done), cwd=tmp_path)
    assert out.returncode == 2 and out.stdout == "" and len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert out.stderr.startswith(f"error: {done}: already replayed (an earlier replay renamed it so); nothing was "
                                 "sent; expected a spool file not yet replayed")
    assert done.exists() and not (tmp_path / "x.db").exists()


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
    # an empty --tracking-uri is refused: taken for none, the records would go to the stores they name
    with pytest.raises(UserError, match="--tracking-uri: '' is empty"):
        tracking.replay(f, "")
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


def test_a_spool_the_logger_wrote_with_every_op_replays_and_its_tags_land(server, tmp_path):
    """The run's own outage path: the run logger's metrics and the outbox's four ops (artifact, tags,
    metrics, terminated), written by tracking/logger.py while the server is down, pass read_spool and
    replay through the command line, and the tags land in the run (every tags record used to be refused:
    "'tags' is {...}; expected a string", so such a file could never be replayed)."""
    exp = tracking.ensure_experiment(server.uri, "e")
    run_id = tracking.create_run(server.uri, exp, "every-op", {}, {})
    spool = tmp_path / "run" / tracking.SPOOL_FILE
    art = tmp_path / "model.pt"
    art.write_text("weights")
    server.stop()
    try:
        log = tracking.RunLogger(server.uri, run_id, spool=spool, outage_wait_s=1)
        log.log({"train/loss": 0.5}, 1)
        assert log.close() == spool
        out = tracking.Outbox(server.uri, run_id, spool, wait_s=1)
        out.artifact(art, "model")
        out.tags({"xmodal.stopped_at_step": "1", "audit.t": "v"})
        out.metrics({"time/end_of_run_s": 2.5}, 1)
        out.terminated("KILLED")
    finally:
        server.start()
    assert [r["op"] for r in tracking.read_spool(spool)] == ["metrics", "artifact", "tags", "metrics", "terminated"]
    done = _replay_cli(str(spool), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().splitlines()[-1] == (  # after MLflow's own "View run" lines
        f"[xmodal] replayed into run(s) {run_id}: 2 metric values logged, 0 already there, 1 artifacts, "
        f"1 tag record(s), 1 status(es); file renamed to {spool}.replayed")
    run = tracking.get_run(server.uri, run_id)
    assert (run.tags["audit.t"], run.tags["xmodal.stopped_at_step"], run.status) == ("v", "1", "KILLED")
    assert run.metrics == {"train/loss": 0.5, "time/end_of_run_s": 2.5}
    assert tracking.list_artifacts(server.uri, run_id, "model") == ["model/model.pt"]


def test_a_bad_value_fails_at_once_through_the_command_line_and_sends_nothing(tmp_path, mlflow_template):
    """A real SQLite run, a good line 1 and a bad line 2: one error line naming the line, the key and the
    value, at once (a step past 64 bits and an artifact folder outside the run used to be retried for
    300 s, then blamed on a lock), and line 1 is not sent."""
    import shutil

    shutil.copyfile(mlflow_template, tmp_path / "mlflow.db")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id = tracking.create_run(uri, tracking.ensure_experiment(uri, "e"), "r", {}, {})
    (tmp_path / "a.txt").write_text("a")
    good = {"op": "metrics", "uri": uri, "run_id": run_id, "items": [["loss", 0.5, 1, 1]]}
    for bad, said in (({"op": "metrics", "items": [["audit/big", 1.0, 1, 2 ** 70]]}, f"step {2 ** 70}; expected"),
                      ({"op": "metrics", "items": [["audit/fs", 1.0, 1, 1.7]]}, "step 1.7; expected a whole number"),
                      ({"op": "artifact", "path": str(tmp_path / "a.txt"), "artifact_path": "../../evil"},
                       "'artifact_path' is '../../evil'; expected null or a folder inside the run's artifacts")):
        f = tmp_path / "s.jsonl"
        f.write_text(json.dumps(good) + "\n" + json.dumps({"uri": uri, "run_id": run_id, **bad}) + "\n")
        out = _replay_cli(str(f), cwd=tmp_path)
        lines = out.stderr.strip().splitlines()
        assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith(f"error: {f}, line 2: "), out.stderr
        assert said in lines[0] and "busy" not in out.stdout + out.stderr, out.stderr
        assert f.exists() and not list(tmp_path.glob("*.replayed"))
    assert tracking.metric_points(uri, run_id, "loss") == [] and tracking.list_artifacts(uri, run_id) == []
