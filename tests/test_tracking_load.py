"""xmodal.tracking under load, on real SQLite files through real MLflow: many processes starting at once
on a database that does not exist yet, and a database held locked by another process for longer than
SQLite's busy timeout. Nothing may be lost, and the output says what happened in at most one line."""

from __future__ import annotations

import multiprocessing
import os
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from xmodal import tracking
from xmodal_testing import REPO

STEPS = 20
KEYS = ("train/loss", "train/lr")


def _one_job(uri: str, index: int, barrier, spool_dir: str) -> tuple[str, str | None]:
    """What one training job does on first contact with the store: the driver's experiment and run,
    then rank 0's logger. Returns (run id, spool file or None)."""
    barrier.wait(timeout=120)  # every process starts its first MLflow call at the same moment
    exp = tracking.ensure_experiment(uri, "load")
    run_id = tracking.create_run(uri, exp, f"job{index}", {"index": index}, {"xmodal.kind": "load"})
    log = tracking.RunLogger(uri, run_id, spool=Path(spool_dir) / f"spool{index}.jsonl", outage_wait_s=120)
    for step in range(1, STEPS + 1):
        log.log({k: step / (1 + index) for k in KEYS}, step)
    spooled = log.close()
    return run_id, str(spooled) if spooled else None


def _run_at_once(uri: str, spool_dir: Path, n: int) -> list:
    """`_one_job` in `n` processes released together. Forked from a server that has imported MLflow
    (not spawned: 16 imports of MLflow on a shared 2-core machine take minutes); none has opened the
    database before the barrier, so each makes its own first contact."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["xmodal.tracking", "mlflow", "mlflow.store.tracking.sqlalchemy_store"])
    barrier = ctx.Manager().Barrier(n)
    with ctx.Pool(n) as pool:
        pending = [pool.apply_async(_one_job, (uri, i, barrier, str(spool_dir))) for i in range(n)]
        results = []
        for p in pending:
            try:
                results.append(p.get(timeout=600))
            except Exception as e:  # reported with the others: how many failed is the measurement
                results.append(e)
    return results


@pytest.mark.slow
def test_sixteen_processes_start_at_once_on_a_new_sqlite_file(tmp_path):
    db = tmp_path / "fresh.db"  # not mlflow.db: slow tests get a migrated copy under that name
    uri = f"sqlite:///{db}"
    t0 = time.monotonic()
    results = _run_at_once(uri, tmp_path, 16)
    failed = [r for r in results if isinstance(r, Exception)]
    assert not failed, f"{len(failed)} of 16 failed in {time.monotonic() - t0:.0f} s: {failed[:3]}"
    assert all(spooled is None for _, spooled in results)  # everything reached MLflow

    # The file is a working MLflow database, read by MLflow's own client in a fresh process.
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(f"""
        import mlflow
        c = mlflow.MlflowClient({uri!r})
        exp = c.get_experiment_by_name("load")
        runs = c.search_runs([exp.experiment_id], max_results=100)
        print(len(runs))
        """)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0 and out.stdout.split()[-1] == "16", out.stderr[-3000:]

    for run_id, _ in results:
        for key in KEYS:
            steps = [p.step for p in tracking.metric_points(uri, run_id, key)]
            assert sorted(steps) == list(range(1, STEPS + 1)), (run_id, key, steps)  # every point once


# ---------------------------------------------------------------- a database held locked


def _hold_exclusive(db: Path, seconds: float, held: threading.Event) -> None:
    """Another process's long write: an exclusive transaction that nobody else can read or write past."""
    con = sqlite3.connect(db, timeout=60, isolation_level=None, check_same_thread=False)
    con.execute("BEGIN EXCLUSIVE")
    held.set()
    time.sleep(seconds)
    con.execute("ROLLBACK")
    con.close()


LOCKED_JOB = textwrap.dedent("""
    import sys, time
    from xmodal import tracking

    uri, run_id, spool, close_first = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "close-first"
    # The store is opened for the first time in this process while the database is locked: rank 0's
    # logger starts, and the driver creates its next run meanwhile.
    log = tracking.RunLogger(uri, run_id, spool=spool, outage_wait_s=1 if close_first else 120)
    for step in range(1, 101):
        log.log({"train/loss": 1.0 / step}, step)
    spooled = log.close() if close_first else None
    t0 = time.monotonic()
    new_run = tracking.create_run(uri, tracking.ensure_experiment(uri, "e"), "next", {}, {})
    waited = time.monotonic() - t0
    spooled = spooled if close_first else log.close()
    print("RESULT", new_run, spooled, f"{waited:.1f}", file=sys.stderr)
""")


def _locked_job(tmp_path: Path, mode: str, hold_s: float = 12.0) -> tuple[str, str, list[str], str]:
    """LOCKED_JOB in a fresh process while another holds the database exclusively for `hold_s` (more
    than the 5 s an opening store waits for SQLite). Returns (uri, the run logged into, our output
    lines, the job's RESULT line)."""
    db = tmp_path / "locked.db"
    uri = f"sqlite:///{db}"
    run_id = tracking.create_run(uri, tracking.ensure_experiment(uri, "e"), "r", {}, {})
    held = threading.Event()
    holder = threading.Thread(target=_hold_exclusive, args=(db, hold_s, held))
    holder.start()
    assert held.wait(30)
    try:
        out = subprocess.run([sys.executable, "-c", LOCKED_JOB, uri, run_id, str(tmp_path / "spool.jsonl"), mode],
                             capture_output=True, text=True, timeout=300, cwd=tmp_path,
                             env={**os.environ, "PYTHONPATH": str(REPO / "platform")})
    finally:
        holder.join()
    assert out.returncode == 0, out.stderr[-3000:]
    ours = [line for line in (out.stdout + out.stderr).splitlines() if line.startswith("[xmodal]")]
    result = next(line for line in out.stderr.splitlines() if line.startswith("RESULT"))
    return uri, run_id, ours, result


@pytest.mark.slow  # about 20 s: a 12 s lock and a fresh process
def test_a_locked_database_at_start_delays_the_run_and_loses_nothing(tmp_path):
    uri, run_id, ours, result = _locked_job(tmp_path, "wait")
    _, new_run, spooled, waited = result.split()
    assert spooled == "None" and not (tmp_path / "spool.jsonl").exists()
    assert [p.step for p in tracking.metric_points(uri, run_id, "train/loss")] == list(range(1, 101))
    assert tracking.get_run(uri, new_run).name == "next"  # the driver waited the lock out
    assert len(ours) <= 1, ours  # at most: "busy or unreachable ..., retrying for up to 300 s"
    assert all("busy or unreachable" in line for line in ours), ours


@pytest.mark.slow  # about 20 s: a 12 s lock and a fresh process
def test_a_run_that_ends_while_the_database_is_locked_spools_and_replays(tmp_path):
    uri, run_id, ours, result = _locked_job(tmp_path, "close-first")
    spool = tmp_path / "spool.jsonl"
    _, new_run, spooled, _ = result.split()
    assert tracking.get_run(uri, new_run).name == "next"
    sent = [p.step for p in tracking.metric_points(uri, run_id, "train/loss")]
    if spooled == "None":  # the lock was gone before the logger's wait ran out: all sent
        assert sent == list(range(1, 101)) and not spool.exists()
        return
    # The driver's next run may wait the rest of the lock out, said in one line (whether it does depends on
    # when the lock ends); the values not logged are said once.
    waits = [line for line in ours if "is busy or unreachable (opening experiment 'e')" in line]
    assert len(waits) <= 1, ours
    assert [line for line in ours if line not in waits] == [
        f"[xmodal] MLflow at {uri} busy (locked by another process): 100 metric values not logged, saved to {spool}; "
        f"replay them with python jobs/replay_tracking.py {spool}"]
    summary = tracking.replay(spool)
    assert summary.metrics_logged + summary.metrics_skipped == 100
    assert sorted(p.step for p in tracking.metric_points(uri, run_id, "train/loss")) == list(range(1, 101))


def test_a_sender_stopped_by_an_error_no_retry_mends_spools_everything_and_says_why(tmp_path, capfd):
    """A run id the store does not know (deleted, or another store's): the sender stops at once rather
    than retrying for ever or dying silently, and `close` keeps every value in the spool file."""
    uri = f"sqlite:///{tmp_path / 'other.db'}"
    tracking.ensure_experiment(uri, "e")
    spool = tmp_path / "spool.jsonl"
    log = tracking.RunLogger(uri, "0" * 32, spool=spool, outage_wait_s=300)
    for step in range(1, 4):
        log.log({"train/loss": 1.0 / step}, step)
    t0 = time.monotonic()
    assert log.close() == spool and time.monotonic() - t0 < 150  # not the 300 s an outage may take: a hang guard
    assert len(tracking.read_spool(spool)[0]["items"]) == 3
    line = capfd.readouterr().out.strip()
    assert line.startswith(f"[xmodal] MLflow at {uri} failed (") and "3 metric values not logged" in line, line
