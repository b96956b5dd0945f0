"""The browser the example pages are looked at in: the system's Chromium (scripts/setup.sh installs it with
apt; Playwright's own download is not used: it is unreachable in CI), driven by Playwright."""

from __future__ import annotations

import os
import shutil

import pytest


def chromium() -> str | None:
    return os.environ.get("XMODAL_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api")
    binary = chromium()
    if binary is None:
        pytest.skip("no chromium on PATH (scripts/setup.sh installs it with apt)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=binary, args=["--no-sandbox", "--disable-gpu"])
        yield b
        b.close()
