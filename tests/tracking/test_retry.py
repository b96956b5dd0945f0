"""xmodal.tracking.retry against a real `mlflow server`: a server that went away is waited for, up to
mlflow.outage_wait_s; one never reached that refuses the connection fails at once."""

from __future__ import annotations

import time

import pytest

from xmodal import tracking
from xmodal.base.errors import UserError
from xmodal_testing import free_port


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


def test_a_value_mlflow_cannot_take_fails_at_once_and_an_outage_is_still_waited_for(tmp_path, mlflow_template):
    """A step past 64 bits (SQLite: "Python int too large") and an artifact folder outside the run
    (MLflow's "Invalid artifact path", code INTERNAL_ERROR) are the request's fault: raised at once, not
    waited on for mlflow.outage_wait_s and then blamed on a lock. A locked database and a server away
    (the same code INTERNAL_ERROR) are still waited for."""
    import shutil

    from mlflow.exceptions import MlflowException

    from xmodal.tracking.retry import _permanent

    shutil.copyfile(mlflow_template, tmp_path / "mlflow.db")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id = tracking.create_run(uri, tracking.ensure_experiment(uri, "e"), "r", {}, {})
    (tmp_path / "a.txt").write_text("a")
    tracking.set_outage_wait(uri, 60)
    try:
        t0 = time.monotonic()
        with pytest.raises(MlflowException, match="Python int too large to convert to SQLite INTEGER"):
            tracking.log_metrics(uri, run_id, {"a": 1.0}, step=2 ** 70)
        with pytest.raises(MlflowException, match="Invalid artifact path: '../../evil'"):
            tracking.log_artifact(uri, run_id, tmp_path / "a.txt", "../../evil")
        assert time.monotonic() - t0 < 30
    finally:
        tracking.set_outage_wait(uri, tracking.WAIT_S)
    # what a lock and a server away raise, word for word (a real lock costs SQLite's 20 s busy timeout)
    for away in (MlflowException("(sqlite3.OperationalError) database is locked\n[SQL: SELECT runs.run_uuid]"),
                 MlflowException("API request to http://127.0.0.1:5000/api/2.0/mlflow/runs/log-batch failed with "
                                 "exception HTTPConnectionPool(host='127.0.0.1', port=5000): Max retries exceeded"),
                 ConnectionRefusedError(111, "Connection refused")):
        assert not _permanent(away), away
