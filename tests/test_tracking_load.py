"""tracking.py under load, on real SQLite files through real MLflow: many processes starting at once
on a database that does not exist yet, and a database held locked by another process for longer than
SQLite's busy timeout. Nothing may be lost, and the output says what happened in at most one line."""

from __future__ import annotations

import multiprocessing
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from xmodal import tracking

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


def test_a_sender_stopped_by_an_error_no_retry_mends_spools_everything_and_says_why(tmp_path, capfd):
    """A run id the store does not know (deleted, or another store's): the sender stops at once rather
    than retrying for ever or dying silently, and `close` keeps every value in the spool file."""
    uri = f"sqlite:///{tmp_path / 'other.db'}"
    tracking.ensure_experiment(uri, "e")
    spool = tmp_path / "spool.jsonl"
    log = tracking.RunLogger(uri, "0" * 32, spool=spool, outage_wait_s=30)
    for step in range(1, 4):
        log.log({"train/loss": 1.0 / step}, step)
    t0 = time.monotonic()
    assert log.close() == spool and time.monotonic() - t0 < 10
    assert len(tracking.read_spool(spool)[0]["items"]) == 3
    line = capfd.readouterr().out.strip()
    assert line.startswith(f"[xmodal] MLflow at {uri} failed (") and "3 metric values not logged" in line, line
