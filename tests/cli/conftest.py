"""The bad-input tests call each command's `main` in this process, and `main` sets up what a real run's
process keeps (the console: `xmodal.base.console.configure`; the SIGTERM handler: `user_errors`). Each
test gets that state back as it found it, so that the tests of other files on this worker see what they
expect."""

from __future__ import annotations

import os
import signal

import pytest

from xmodal.base import console


@pytest.fixture(autouse=True)
def _process_as_found():
    handlers, level, propagate = list(console.log.handlers), console.log.level, console.log.propagate
    active, verbose = console.CONSOLE.active, os.environ.get(console.VERBOSE_ENV)
    term = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, term)
    console.log.handlers[:] = handlers
    console.log.setLevel(level)
    console.log.propagate = propagate
    console.CONSOLE.active = active
    if verbose is None:
        os.environ.pop(console.VERBOSE_ENV, None)
    else:
        os.environ[console.VERBOSE_ENV] = verbose
