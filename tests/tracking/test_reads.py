"""xmodal.tracking.reads against a real MLflow SQLite store: runs come back as plain data, not MLflow
objects."""

from __future__ import annotations

import dataclasses

import pytest

from xmodal import tracking
from xmodal.base.run_tags import PARENT_TAG


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
