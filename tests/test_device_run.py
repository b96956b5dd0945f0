"""scripts/device_run.sh called wrongly: one `error:` line saying what it expects, exit 2, nothing run."""

from __future__ import annotations

import subprocess

import pytest

from xmodal_testing import REPO

SCRIPT = REPO / "scripts" / "device_run.sh"


@pytest.mark.parametrize("args, named", [
    ([], "expected fetch or run SECTIONS OUT, got ''"),
    (["bogus"], "got 'bogus'"),
    (["run"], "device_run.sh run: expected SECTIONS OUT, two non-empty arguments (e.g. run mult,extract bench-out), "
              "got 0"),
    (["run", "mult"], "got 1: mult"),
    (["run", "", "out"], "got 2:  out"),
])
def test_wrong_arguments_one_error_line(args, named, tmp_path):
    r = subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert r.returncode == 2, r.stderr
    assert r.stdout == "" and r.stderr.startswith("error: ") and r.stderr.count("\n") == 1, r.stderr
    assert named in r.stderr, r.stderr
    assert not (REPO / "out").exists() and list(tmp_path.iterdir()) == []
