"""Shared fixtures. One local Ray for the whole session (starting Ray costs seconds); one torch thread."""

from __future__ import annotations

import os

import pytest

# Ray Train V2's controller polls its workers every 2 s by default: a run's end, and a worker's death,
# are seen only at the next poll. Every test Ray (the shared one, and those of jobs started as
# subprocesses, which inherit this environment) polls 4 times as often: tens of seconds less per suite.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")


@pytest.fixture(scope="session")
def ray_local():
    """A fresh local Ray cluster shared by the tests that need one.

    Four logical CPUs on a 2-core machine: Train workers take fractions and
    Ray Data's read tasks need CPUs of their own. The dashboard stays on
    (Tune with ASHA needs it to free stopped trials' resources).
    """
    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    ray.init(address="local", num_cpus=4, include_dashboard=True, log_to_driver=True,
             object_store_memory=1_000_000_000)
    yield ray
    ray.shutdown()


@pytest.fixture
def one_thread():
    """Torch on one thread for the test: tiny tensors are faster so, and far faster on a busy shared
    machine (no OpenMP spinning). Modules of tiny-model tests use it for every test with
    `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
