"""The extraction tests call `jobs/extract.py`'s `main` in this process, and `main` sets up the console
for the rest of a real run's process (`xmodal.base.console.configure`): the package logger's handler, the
active console, the verbose flag. Each test gets the state back as it found it, so that the tests of
other files on this worker see the console they expect."""

from __future__ import annotations

import os

import pytest

from xmodal.base import console


@pytest.fixture(autouse=True)
def _console_as_found():
    handlers, level, propagate = list(console.log.handlers), console.log.level, console.log.propagate
    active, verbose = console.CONSOLE.active, os.environ.get(console.VERBOSE_ENV)
    yield
    console.log.handlers[:] = handlers
    console.log.setLevel(level)
    console.log.propagate = propagate
    console.CONSOLE.active = active
    if verbose is None:
        os.environ.pop(console.VERBOSE_ENV, None)
    else:
        os.environ[console.VERBOSE_ENV] = verbose
