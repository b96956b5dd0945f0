"""The extraction tests call `jobs/extract.py`'s `main` in this process, and `main` sets up the console
for the rest of a real run's process (`xmodal.base.console.configure`): the package logger's handler, the
active console, the verbose flag. Each test, and each module fixture that runs `main` (`console_kept`),
gives the state back as it found it, so that the tests of other files on this worker see the console
they expect."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from xmodal.base import console


@contextmanager
def console_kept() -> Iterator[None]:
    handlers, level, propagate = list(console.log.handlers), console.log.level, console.log.propagate
    active, verbose = console.CONSOLE.active, os.environ.get(console.VERBOSE_ENV)
    try:
        yield
    finally:
        console.log.handlers[:] = handlers
        console.log.setLevel(level)
        console.log.propagate = propagate
        console.CONSOLE.active = active
        if verbose is None:
            os.environ.pop(console.VERBOSE_ENV, None)
        else:
            os.environ[console.VERBOSE_ENV] = verbose


@pytest.fixture(autouse=True)
def _console_as_found():
    with console_kept():
        yield


@pytest.fixture(scope="session")
def keep_console():
    """`console_kept`, for the module fixtures that run `main` (a test's own state is kept by the autouse
    fixture, which is set up after them)."""
    return console_kept
