"""`jobs/benchmark.py tracking`: writers in their own processes log through RunLogger into one store and
every point they sent is read back once. Speed is not asserted: CI machines differ. (The `server` and
`postgres` backends start servers: run by hand, figures in docs/performance.md.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_two_writers_on_sqlite_every_point_present(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    # Its smallest run: two writers (processes) of a few points, two flushes each: what is checked (every
    # point sent is read back once, every call counted) does not depend on how many points there are.
    run = subprocess.run([sys.executable, str(ROOT / "jobs" / "benchmark.py"), "tracking", "--writers", "2",
                          "--backend", "sqlite", "--steps", "20", "--metrics", "2", "--flush-every", "10",
                          "--out", str(out), "--work", str(work)],
                         capture_output=True, text=True, cwd=tmp_path, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "platform")})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (js,) = out.glob("tracking-*.json")
    res = json.loads(js.read_text())
    r = res["result"]
    assert (r["writers"], r["steps"], r["metrics"], r["flush_every"]) == (2, 20, 2, 10)
    assert r["points_sent"] == 2 * 20 * 2
    assert r["points_present"] == r["points_distinct"] == r["points_sent"]  # every point, once
    assert r["points_spooled"] == 0 and r["errors"] == []
    assert r["calls"]["flush"]["n"] == 2 * 2 and r["calls"]["create"]["n"] == 2
    assert r["calls"]["batch"]["n"] >= 2 * 2  # each flush sent at least one batch
    assert all(c["p50_ms"] > 0 and c["p99_ms"] >= c["p50_ms"] for c in r["calls"].values())
    md = js.with_suffix(".md").read_text()
    assert md.startswith("# Tracking under 2 writers (sqlite)") and "| RunLogger.flush | 4 |" in md
    assert "Points sent 80, present 80" in run.stdout
    assert not work.exists()  # the store was temporary, and so was the --work folder made for it


def test_postgres_backend_without_psycopg2_names_the_package(tmp_path):
    """Where psycopg2 is missing the backend stops before starting anything, naming the package; where it
    is installed, the same run is the benchmark (not run here: it starts PostgreSQL and a server)."""
    code = ("import sys; sys.modules['psycopg2'] = None\n"  # an import that fails, as where it is not installed
            "from xmodal_bench import main\n"
            f"sys.exit(main(['tracking', '--backend', 'postgres', '--writers', '1', '--out', {str(tmp_path / 'out')!r},"
            f" '--work', {str(tmp_path / 'work')!r}]))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=tmp_path,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "platform")})
    assert run.returncode == 2, run.stdout[-2000:] + run.stderr[-2000:]
    assert "--backend postgres needs the psycopg2 package (pip install psycopg2-binary)" in run.stderr
    assert not (tmp_path / "out").exists()
    assert not (tmp_path / "work").exists()  # made for the benchmark, removed with its scratch


def test_an_unwritable_out_fails_before_anything_is_measured(tmp_path):
    """The results are written last: --out is checked first, so a bad one costs no benchmark run."""
    run = subprocess.run([sys.executable, str(ROOT / "jobs" / "benchmark.py"), "tracking", "--writers", "1",
                          "--out", "/proc/xmodal-bench", "--work", str(tmp_path / "work")],
                         capture_output=True, text=True, cwd=tmp_path, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "platform")})
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr[-2000:]
    (line,) = run.stderr.strip().splitlines()
    assert line.startswith("error: --out: '/proc/xmodal-bench' cannot be written: '/proc' refuses new files")
    assert "benchmark tracking" not in run.stdout and not (tmp_path / "work").exists()
