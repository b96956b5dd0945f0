"""Fixtures shared by the tests of xmodal.tracking."""

from __future__ import annotations

import pytest

from xmodal_testing import MlflowServer


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server per test file that uses it (starting one costs seconds); each test leaves it running."""
    s = MlflowServer(tmp_path_factory.mktemp("mlflow-server")).start()
    yield s
    s.stop()
