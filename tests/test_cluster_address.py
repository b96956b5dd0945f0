"""RAY_ADDRESS checked in the driver: an address that does not answer is one error within seconds, not
minutes of retries in ray.init. Real sockets, no Ray."""

from __future__ import annotations

import socket
import time

import pytest

from xmodal.errors import UserError
from xmodal.train.cluster import check_cluster_address, cluster_address


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
    assert time.monotonic() - started < 15
    msg = str(e.value)
    assert "\n" not in msg and f"127.0.0.1:{port}" in msg and f"ray status --address 127.0.0.1:{port}" in msg, msg


def test_unset_auto_and_local_are_not_probed(monkeypatch):
    for value in ("auto", "local"):
        monkeypatch.setenv("RAY_ADDRESS", value)
        check_cluster_address()
    monkeypatch.delenv("RAY_ADDRESS")
    check_cluster_address()
