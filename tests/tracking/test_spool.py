"""xmodal.tracking.spool: replay checks the whole file, its store and its runs before it sends
anything, and says what is wrong."""

from __future__ import annotations

import json
import os
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
