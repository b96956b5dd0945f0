"""xmodal.tracking.connection: the tracking URI, and where a SQLite experiment keeps its artifacts. (Not
test_store.py: tests/data/lxmert has one, and the test folders are no packages, so two test files may
not share a name.)"""

from __future__ import annotations

import pytest

from xmodal import tracking


def test_bad_tracking_uri_is_explained_naming_where_it_came_from(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(ValueError, match="mlflow.tracking_uri: 'mlflow.db' has no scheme; expected sqlite:///PATH "
                                         r"\(a database file: sqlite:///mlflow.db\)"):
        tracking.resolve_tracking_uri("mlflow.db")
    with pytest.raises(ValueError, match="--tracking-uri: 'sqlite://' is not a SQLite database file"):
        tracking.resolve_tracking_uri("sqlite://", "--tracking-uri")
    # an empty flag would fall back on another database than the one named; an empty config key is unset
    with pytest.raises(ValueError, match="--tracking-uri: '' is empty"):
        tracking.resolve_tracking_uri("", "--tracking-uri")
    assert tracking.resolve_tracking_uri("").endswith("/mlflow.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "runs.db")  # the environment's value is named as such
    with pytest.raises(ValueError, match="MLFLOW_TRACKING_URI: 'runs.db' has no scheme"):
        tracking.resolve_tracking_uri(None, "--tracking-uri")


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
