"""Fixtures shared by the tests of xmodal.tracking."""

from __future__ import annotations

import pytest

from xmodal_testing import MlflowServer


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """One server for these files (starting one costs seconds; tests/conftest.py runs the folder's files
    on one worker); each test leaves it running."""
    s = MlflowServer(tmp_path_factory.mktemp("mlflow-server")).start()
    yield s
    s.stop()
