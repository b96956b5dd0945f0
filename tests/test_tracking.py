"""tracking.py against a real MLflow SQLite store: runs come back as plain data, not MLflow objects."""

import dataclasses

import pytest

from xmodal import tracking
from xmodal.run_tags import PARENT_TAG, RUN_NAME_TAG


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
    # A restarted worker replays steps 2..4: only step 4 is new.
    log2 = tracking.RunLogger(uri, run_id)
    for step in (2, 3, 4):
        log2.log({"train/loss": 10.0 + step}, step)
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
