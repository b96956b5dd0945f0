"""Fixtures for the data tests: reference-format inputs (see refdata.py) and a small synthetic store
built once per session (it takes well under a second)."""

from __future__ import annotations

from pathlib import Path

import pytest
from refdata import SMALL, RefCorpus, write_reference

from xmodal.data.lxmert.synthetic import build_synthetic_store


@pytest.fixture
def reference(tmp_path: Path) -> RefCorpus:
    return write_reference(tmp_path / "ref")


@pytest.fixture(scope="session")
def small_store(tmp_path_factory: pytest.TempPathFactory):
    """A small synthetic store shared by the read-only tests."""
    return build_synthetic_store(tmp_path_factory.mktemp("stores") / "small", SMALL)
