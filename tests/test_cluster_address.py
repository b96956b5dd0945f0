"""RAY_ADDRESS checked in the driver: an address that does not answer is one error within seconds, not
minutes of retries in ray.init. Real sockets, no Ray."""

from __future__ import annotations

import socket
import time

import pytest

from xmodal.base.errors import UserError
from xmodal.runner.ray_cluster import check_cluster_address, cluster_address


@pytest.mark.parametrize("value, expected", [
    ("", None), ("auto", None), ("local", None),
    ("10.0.0.5:6379", ("10.0.0.5:6379", "10.0.0.5", 6379)),
    ("ray://head:10001", ("ray://head:10001", "head", 10001)),
    ("http://127.0.0.1:8265", ("http://127.0.0.1:8265", "127.0.0.1", 8265)),
    ("[::1]:6379", ("[::1]:6379", "::1", 6379)),
])
def test_the_addresses_ray_takes(monkeypatch, value, expected):
    monkeypatch.setenv("RAY_ADDRESS", value)
    assert cluster_address() == expected


@pytest.mark.parametrize("value", ["10.0.0.5", "head:port", "head:0", "ray://head"])
def test_an_address_without_a_port_is_named(monkeypatch, value):
    monkeypatch.setenv("RAY_ADDRESS", value)
    with pytest.raises(UserError, match=rf"RAY_ADDRESS = {value!r}: expected HOST:PORT"):
        cluster_address()


def test_a_listening_address_passes_and_a_closed_port_is_one_error_within_seconds(monkeypatch):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
        check_cluster_address()
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")  # closed now: nothing listens
    started = time.monotonic()
    with pytest.raises(UserError) as e:
        check_cluster_address()
    assert time.monotonic() - started < 45  # at once, not after Ray's own minute of retries: a hang guard
    msg = str(e.value)
    assert "\n" not in msg and f"127.0.0.1:{port}" in msg and f"ray status --address 127.0.0.1:{port}" in msg, msg


def test_unset_auto_and_local_are_not_probed(monkeypatch):
    for value in ("auto", "local"):
        monkeypatch.setenv("RAY_ADDRESS", value)
        check_cluster_address()
    monkeypatch.delenv("RAY_ADDRESS")
    check_cluster_address()


@pytest.mark.parametrize("args, named", [
    (["--gpus-per-worker", "1"], ["scale.gpus_per_worker = 1.0", "GPU", "RAY_ADDRESS"]),
    (["--num-workers", "16"], ["scale.cpus_per_worker = 0.5 x scale.num_workers = 16", "logical CPUs"]),
    (["--set", "scale.resources_per_worker={accel: 1}"], ["scale.resources_per_worker", "custom resources"]),
])
def test_a_local_ray_without_what_the_workers_ask_for_is_one_error_before_anything_starts(tmp_path, args, named):
    """Without RAY_ADDRESS the job would start a local Ray and wait for the resources without end."""
    import os
    import subprocess

    from xmodal_testing import PYTHON, REPO

    try:
        import torch

        if torch.cuda.device_count() >= 1 and "--gpus-per-worker" in args:
            pytest.skip("this machine has a GPU")
    except ImportError:
        pass
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI", "PYTHONPATH")}
    env.update({"PYTHONPATH": str(REPO / "platform"), "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"})
    proc = subprocess.run([PYTHON, str(REPO / "jobs" / "pretrain.py"), *args], cwd=tmp_path, env=env, text=True,
                          capture_output=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    for piece in named:
        assert piece in proc.stderr, proc.stderr
    assert "Started a local Ray instance" not in proc.stdout + proc.stderr
    assert list(tmp_path.iterdir()) == []  # nothing built: no data/, mlflow.db or runs/
