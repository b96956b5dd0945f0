"""The extraction tests call `jobs/extract.py`'s `main` in this process, and `main` sets up the console
for the rest of a real run's process (`xmodal.base.console.configure`): the package logger's handler, the
active console, the verbose flag. Each test, and each module fixture that runs `main` (`console_kept`),
gives the state back as it found it, so that the tests of other files on this worker see the console
they expect."""

from __future__ import annotations

import pytest

from xmodal_testing import console_kept


@pytest.fixture(scope="session")
def keep_console():
    """`console_kept`, for the module fixtures that run `main` (a test's own state is kept by the autouse
    fixture, which is set up after them)."""
    return console_kept
