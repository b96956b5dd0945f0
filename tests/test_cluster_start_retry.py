"""The cluster tests' node starts (xmodal_testing.start_nodes): a node whose start fails or times out is
torn down and started again, the others are kept. Real processes standing in for `ray start --block`,
which print what it prints: a start that passes says NODE_STARTED and stays; one that fails prints Ray's
time-out and exits, as a node did on a loaded 2-core machine (tests/test_cross_host.py, the GCS
overloaded)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from xmodal_testing import NODE_STARTED, NodeStart, start_nodes

# argv: a counter file, how many starts fail first, and how: "exit" (Ray's time-out, then exit 1) or
# "hang" (nothing said, never exits).
FAKE_NODE = f"""
import sys, time
from pathlib import Path
counter, failing, how = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
n = int(counter.read_text()) + 1 if counter.exists() else 1
counter.write_text(str(n))
print(f"start {{n}}", flush=True)
if n <= failing:
    if how == "exit":
        print("Exception: The current node timed out during startup. This could happen because some of the "
              "raylet failed to startup or the GCS has become overloaded.", flush=True)
        sys.exit(1)
    time.sleep(600)
print({NODE_STARTED!r}, flush=True)
time.sleep(600)
"""


def fake(tmp_path: Path, name: str, failing: int, how: str = "exit", torn: list | None = None) -> NodeStart:
    log = tmp_path / f"{name}.log"

    def launch() -> subprocess.Popen:
        with open(log, "a") as out:
            return subprocess.Popen([sys.executable, "-c", FAKE_NODE, str(tmp_path / f"{name}.count"), str(failing),
                                     how], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def teardown(proc: subprocess.Popen) -> None:
        torn.append((name, proc.pid))
        proc.kill()
        proc.wait()

    return NodeStart(name, launch, log, teardown if torn is not None else None)


def gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_a_node_that_timed_out_is_torn_down_and_started_again_and_the_others_kept(tmp_path, capsys):
    torn: list = []
    nodes = [fake(tmp_path, "steady", 0, torn=torn), fake(tmp_path, "flaky", 2, torn=torn)]
    procs = start_nodes(nodes, timeout=60)
    try:
        assert [p.poll() for p in procs] == [None, None]
        # The steady node started once; the flaky one three times, its two failed starts torn down.
        assert (tmp_path / "steady.count").read_text() == "1" and (tmp_path / "flaky.count").read_text() == "3"
        assert [name for name, _ in torn] == ["flaky", "flaky"]
        assert all(gone(pid) for _, pid in torn)
        log = (tmp_path / "flaky.log").read_text()
        assert log.count("timed out during startup") == 2 and log.endswith(f"start 3\n{NODE_STARTED}\n"), log
        said = capsys.readouterr().out
        assert "node start 1 of 3 failed for flaky (exited 1): torn down, starting again" in said, said
    finally:
        for p in procs:
            p.kill()
            p.wait()


def test_a_start_that_hangs_is_killed_at_the_timeout_and_a_node_that_never_starts_fails_the_fixture(tmp_path):
    began = time.monotonic()
    (proc,) = start_nodes([fake(tmp_path, "slow", 1, how="hang")], timeout=2)
    try:
        assert proc.poll() is None and (tmp_path / "slow.count").read_text() == "2"
        assert time.monotonic() - began < 60  # two tries of 2 s, not a hang: a guard far above them
    finally:
        proc.kill()
        proc.wait()
    # Three failed starts: one error with each reason and the last one's output; the steady node that
    # did start is not left running.
    torn: list = []
    with pytest.raises(RuntimeError) as e:
        start_nodes([fake(tmp_path, "dead", 5, torn=torn), fake(tmp_path, "fine", 0)], timeout=30, tries=3)
    msg = str(e.value)
    assert msg.startswith("dead: 3 starts failed (exited 1; exited 1; exited 1); the last: dead, start 3: exited 1:")
    assert "start 3\nException: The current node timed out during startup" in msg
    assert len(torn) == 3 and all(gone(pid) for _, pid in torn)
    fine = [p for p in psutil.process_iter(["cmdline"]) if str(tmp_path / "fine.count") in (p.info["cmdline"] or [])]
    assert all(p.status() == psutil.STATUS_ZOMBIE for p in fine), fine
