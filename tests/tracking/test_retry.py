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
