"""MLflow under many writers: what a sweep's or a cluster's rank-0 workers do to one tracking store.

    python jobs/benchmark.py tracking [--writers 8] [--backend sqlite|server|postgres] [--out bench-results]

N processes start together; each creates a run (`tracking.create_run`) and logs `--steps` steps of
`--metrics` metrics through `tracking.RunLogger`, flushing every `--flush-every` steps as a checkpoint
does. Then the parent reads every run back and counts the points present. Backends: `sqlite`, one
SQLite file; `server`, an `mlflow server` subprocess on a SQLite file; `postgres`, an `mlflow server`
on a throwaway PostgreSQL (initdb and pg_ctl into a temporary folder, stopped and removed after;
needs psycopg2, e.g. `pip install psycopg2-binary`). Prints points sent and present, p50/p99 of each
kind of call (create_run, log, the sender's log_batch, flush) and the errors (a writer that failed, a
value spooled); writes `<out>/tracking-<UTC timestamp>.json` and `.md`.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import pwd
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from xmodal import tracking
from xmodal.base.console import say
from xmodal.base.errors import UserError
from xmodal.base.outputs import check_writable_dir

BACKENDS = ("sqlite", "server", "postgres")
EXPERIMENT = "xmodal-bench-tracking"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--writers", type=int, default=8, help="processes, each with its own run (default 8)")
    p.add_argument("--backend", choices=BACKENDS, default="sqlite",
                   help="sqlite: one file; server: mlflow server on a SQLite file; postgres: mlflow server on "
                        "a throwaway PostgreSQL (default sqlite)")
    p.add_argument("--steps", type=int, default=200, help="steps per writer (default 200)")
    p.add_argument("--metrics", type=int, default=8, help="metrics per step (default 8)")
    p.add_argument("--flush-every", type=int, default=50, help="a flush (as before a checkpoint) every N steps")
    p.add_argument("--server-workers", type=int, default=2, help="the mlflow server's --workers (default 2)")
    p.add_argument("--out", default="bench-results", help="folder for tracking-<timestamp>.json and .md")
    p.add_argument("--work", default=None, help="where the temporary store goes (default: the temp folder)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_up(uri: str, proc: subprocess.Popen, log: Path, what: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            urllib.request.urlopen(uri + "/health", timeout=2).close()
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                why = "it exited" if proc.poll() is not None else f"no answer after {timeout_s:.0f} s"
                raise UserError(f"{what} did not start ({why}); its log {log}:\n{tail}") from None
            time.sleep(0.5)


@contextlib.contextmanager
def _mlflow_server(store_uri: str, work: Path, workers: int) -> Iterator[str]:
    """`mlflow server` on `store_uri` at a free local port, stopped (its process group) on exit."""
    port = _free_port()
    log = work / "mlflow-server.log"
    mlflow = Path(sys.executable).parent / "mlflow"
    with open(log, "a") as out:
        proc = subprocess.Popen([str(mlflow), "server", "--backend-store-uri", store_uri, "--artifacts-destination",
                                 str(work / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
                                 "--workers", str(workers)],
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True, cwd=work,
                                # as scripts/cluster/start_mlflow.sh runs it: without MLflow's job runner
                                env={**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
    uri = f"http://127.0.0.1:{port}"
    try:
        _wait_up(uri, proc, log, f"mlflow server on {store_uri}")
        yield uri
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, 15)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, 9)
            proc.wait()


def _pg_binary(name: str) -> str:
    found = shutil.which(name) or next((str(p) for p in sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"))),
                                       None)
    if found is None:
        raise UserError(f"--backend postgres: {name} not found on PATH or under /usr/lib/postgresql; expected a "
                        "PostgreSQL server installation (initdb, pg_ctl)")
    return found


@contextlib.contextmanager
def _postgres(work: Path) -> Iterator[str]:
    """A throwaway PostgreSQL cluster in a temporary folder (trust authentication, local port); yields
    its SQLAlchemy URI; stopped and removed on exit. PostgreSQL refuses to run as root: as root, its
    programs run as the `postgres` user."""
    try:
        import psycopg2  # noqa: F401 - MLflow's server needs it for postgresql:// stores
    except ImportError:
        raise UserError("--backend postgres needs the psycopg2 package (pip install psycopg2-binary) in this "
                        "environment: MLflow's server talks to PostgreSQL through it") from None
    initdb, pg_ctl = _pg_binary("initdb"), _pg_binary("pg_ctl")
    as_user: list[str] = []
    folder = Path(tempfile.mkdtemp(prefix="xmodal-pg-", dir=work))
    if os.geteuid() == 0:
        try:
            user = pwd.getpwnam("postgres")
        except KeyError:
            raise UserError("--backend postgres as root: PostgreSQL refuses to run as root and there is no "
                            "'postgres' user to run it as; run the benchmark as another user") from None
        as_user = ["runuser", "-u", "postgres", "--"]
        os.chmod(work, 0o755)
        os.chown(folder, user.pw_uid, user.pw_gid)
    data, port = folder / "data", _free_port()
    run = lambda *cmd: subprocess.run([*as_user, *cmd], capture_output=True, text=True, timeout=300)  # noqa: E731
    out = run(initdb, "-D", str(data), "-U", "xmodal", "-A", "trust", "-E", "UTF8")
    if out.returncode != 0:
        raise UserError(f"--backend postgres: initdb failed: {(out.stderr or out.stdout).strip()[-1000:]}")
    out = run(pg_ctl, "-D", str(data), "-l", str(folder / "postgres.log"), "-w", "-t", "120",
              "-o", f"-h 127.0.0.1 -p {port} -k {folder}", "start")
    try:
        if out.returncode != 0:
            log = folder / "postgres.log"
            raise UserError(f"--backend postgres: pg_ctl start failed: {(out.stderr or out.stdout).strip()[-500:]}; "
                            f"{log.read_text(errors='replace')[-1000:] if log.exists() else ''}")
        # The driver named: SQLAlchemy's default for postgresql:// may be psycopg 3, not installed here.
        yield f"postgresql+psycopg2://xmodal@127.0.0.1:{port}/postgres"
    finally:
        run(pg_ctl, "-D", str(data), "-m", "fast", "-w", "stop")


@contextlib.contextmanager
def backend(kind: str, work: Path, server_workers: int) -> Iterator[str]:
    """The tracking URI the writers log to, for as long as the block runs."""
    if kind == "sqlite":
        yield f"sqlite:///{work / 'bench.db'}"
    elif kind == "server":
        with _mlflow_server(f"sqlite:///{work / 'server.db'}", work, server_workers) as uri:
            yield uri
    else:
        with _postgres(work) as store, _mlflow_server(store, work, server_workers) as uri:
            yield uri


def _writer(uri: str, experiment_id: str, index: int, steps: int, metrics: int, flush_every: int, spool: str,
            barrier) -> dict[str, Any]:
    """One writer: a run, then `steps` steps of `metrics` values through a RunLogger; its timings."""
    try:
        barrier.wait(timeout=600)  # every writer's first call at the same moment
        t0 = time.perf_counter()
        run_id = tracking.create_run(uri, experiment_id, f"writer{index}", {"writer": index}, {})
        create_s = time.perf_counter() - t0
        log = tracking.RunLogger(uri, run_id, spool=spool, outage_wait_s=tracking.WAIT_S)
        log_s, flush_s = [], []
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            log.log({f"bench/m{k}": (index + 1) * step + k for k in range(metrics)}, step)
            log_s.append(time.perf_counter() - t0)
            if step % flush_every == 0:
                t0 = time.perf_counter()
                log.flush()
                flush_s.append(time.perf_counter() - t0)
        log.close()
        return {"run_id": run_id, "create_s": [create_s], "log_s": log_s, "batch_s": log.batch_s,
                "flush_s": flush_s, "spooled": log.spooled, "error": None}
    except Exception as e:  # counted with the others: how many writers fail is a figure
        return {"run_id": None, "create_s": [], "log_s": [], "batch_s": [], "flush_s": [], "spooled": 0,
                "error": f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]}


def _percentiles(values: list[float]) -> dict[str, float | None]:
    if not values:
        return {"n": 0, "p50_ms": None, "p99_ms": None}
    q = statistics.quantiles(values, n=100, method="inclusive") if len(values) > 1 else [values[0]] * 99
    return {"n": len(values), "p50_ms": statistics.median(values) * 1e3, "p99_ms": q[98] * 1e3}


def measure(uri: str, writers: int, steps: int, metrics: int, flush_every: int, work: Path) -> dict[str, Any]:
    """The writers, forked from a server process that has imported MLflow (16 imports on a small machine
    take minutes); none has opened the store before the barrier. Then every run read back."""
    experiment_id = tracking.ensure_experiment(uri, EXPERIMENT)
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["xmodal.tracking", "mlflow", "mlflow.store.tracking.sqlalchemy_store"])
    t0 = time.perf_counter()
    with ctx.Manager() as manager, ctx.Pool(writers) as pool:
        barrier = manager.Barrier(writers)
        pending = [pool.apply_async(_writer, (uri, experiment_id, i, steps, metrics, flush_every,
                                              str(work / f"spool{i}.jsonl"), barrier)) for i in range(writers)]
        results = [p.get(timeout=3600) for p in pending]
    wall_s = time.perf_counter() - t0
    present = distinct = 0
    for r in results:
        if r["run_id"] is None:
            continue
        for k in range(metrics):
            points = tracking.metric_points(uri, r["run_id"], f"bench/m{k}")
            present += len(points)
            distinct += len({p.step for p in points})
    calls = {name: _percentiles([x for r in results for x in r[f"{name}_s"]])
             for name in ("create", "log", "batch", "flush")}
    return {"writers": writers, "steps": steps, "metrics": metrics, "flush_every": flush_every,
            "points_sent": writers * steps * metrics, "points_present": present, "points_distinct": distinct,
            "points_spooled": sum(r["spooled"] for r in results), "wall_s": wall_s,
            "points_per_s": present / wall_s if wall_s > 0 else None, "calls": calls,
            "errors": [r["error"] for r in results if r["error"]]}


def markdown(res: dict[str, Any]) -> str:
    m, r = res["meta"], res["result"]
    ms = lambda v: "-" if v is None else f"{v:.3f}" if v < 1 else f"{v:.1f}"  # noqa: E731
    lines = [f"# Tracking under {r['writers']} writers ({m['backend']})", "",
             f"{m['date']}, {m['machine']}, commit {m['git_commit']}; {r['steps']} steps x {r['metrics']} metrics per "
             f"writer, a flush every {r['flush_every']} steps.", "",
             f"Points sent {r['points_sent']:,}, present {r['points_present']:,} ({r['points_distinct']:,} distinct), "
             f"spooled {r['points_spooled']:,}; {len(r['errors'])} writer errors; {r['wall_s']:.1f} s "
             f"({r['points_per_s'] or 0:,.0f} points/s).", "",
             "| call | n | p50 ms | p99 ms |", "|---|---:|---:|---:|"]
    names = {"create": "create_run", "log": "RunLogger.log (queue)", "batch": "log_batch (sender)",
             "flush": "RunLogger.flush"}
    for key, name in names.items():
        c = r["calls"][key]
        lines.append(f"| {name} | {c['n']} | {ms(c['p50_ms'])} | {ms(c['p99_ms'])} |")
    lines += [f"- error: {e}" for e in r["errors"]]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from xmodal_bench import at_least, begin, write_results

    at_least(args, 1, "writers", "steps", "metrics", "flush_every", "server_workers")
    check_writable_dir(args.out, "--out")  # the results are written last: a bad --out would waste the run
    if args.work:
        check_writable_dir(args.work, "--work")
    work, stamp, meta = begin(args, "tracking", backend=args.backend)
    res: dict[str, Any] = {"meta": meta}
    say(f"benchmark tracking on {meta['machine']}: {args.writers} writers, {args.backend}; work in {work}")
    t0 = time.perf_counter()
    try:
        with backend(args.backend, work, args.server_workers) as uri:
            res["result"] = measure(uri, args.writers, args.steps, args.metrics, args.flush_every, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    res["meta"]["wall_s"] = time.perf_counter() - t0
    write_results(args.out, "tracking-" + stamp, res, markdown(res))
    r = res["result"]
    return 0 if r["points_distinct"] == r["points_sent"] and not r["errors"] else 1
