"""tracking.py against a real MLflow SQLite store."""

from xmodal import tracking


def test_run_lifecycle_and_resume_skips_logged_steps(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    uri = tracking.resolve_tracking_uri(None)
    assert uri == f"sqlite:///{tmp_path / 'mlflow.db'}"
    exp = tracking.ensure_experiment(uri, "e")
    assert tracking.ensure_experiment(uri, "e") == exp
    run_id = tracking.create_run(uri, exp, "r1", {f"p{i}": i for i in range(150)}, {"model": "lxmert"})
    assert tracking.find_run(uri, exp, "r1").info.run_id == run_id
    assert tracking.find_run(uri, exp, "other") is None

    log = tracking.RunLogger(uri, run_id)
    for step in (1, 2, 3):
        log.log({"train/loss": 1.0 / step}, step)
    # A restarted worker replays steps 2..4: only step 4 is new.
    log2 = tracking.RunLogger(uri, run_id)
    for step in (2, 3, 4):
        log2.log({"train/loss": 10.0 + step}, step)
    hist = tracking.client(uri).get_metric_history(run_id, "train/loss")
    assert sorted((m.step, m.value) for m in hist) == [(1, 1.0), (2, 0.5), (3, 1 / 3), (4, 14.0)]

    run = tracking.client(uri).get_run(run_id)
    assert len(run.data.params) == 150 and run.data.tags["model"] == "lxmert"
    tracking.set_terminated(uri, run_id)
    assert tracking.client(uri).get_run(run_id).info.status == "FINISHED"


def test_bad_tracking_uri_is_explained():
    import pytest

    with pytest.raises(ValueError, match="mlflow.tracking_uri 'mlflow.db'"):
        tracking.resolve_tracking_uri("mlflow.db")
