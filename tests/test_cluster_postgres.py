"""The cluster head's MLflow database: scripts/cluster/start_postgres.sh on this machine, in a stand-in
HOME whose node environment node_env.sh wrote, as the head's start command runs it.

Fast: the environment names the head's PostgreSQL (the URI with its driver and no password) unless
another backend is given, and bad data folders are refused, named, and left as they were. Slow: the
script initialises a data folder once, listens on 127.0.0.1 only and is idempotent; an `mlflow server`
on that database (reading the password as start_mlflow.sh does) restarted in the middle of a run loses
no metric and repeats none; and the runs are still there after PostgreSQL itself was stopped and
started again (what stop_cluster.sh and the next `ray up` do). Needs PostgreSQL's server programs
(scripts/setup.sh installs them as root); as root, also the system user postgres that the package makes.
"""

from __future__ import annotations

import glob
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from xmodal import tracking
from xmodal_testing import REPO, MlflowServer, free_port

SCRIPTS = REPO / "scripts" / "cluster"
ROOT = os.geteuid() == 0


def _no_postgres() -> str | None:
    """Why PostgreSQL cannot run here (None when it can)."""
    if not (glob.glob("/usr/lib/postgresql/*/bin/initdb") or shutil.which("initdb")):
        return ("PostgreSQL's server programs (initdb, pg_ctl) are not installed (scripts/setup.sh installs the "
                "package postgresql as root)")
    if ROOT and (shutil.which("runuser") is None or subprocess.run(["id", "postgres"], capture_output=True).returncode):
        return "as root, PostgreSQL runs as the user postgres (made by the package postgresql), which is missing"
    return None


NO_POSTGRES = _no_postgres()


def node(home: Path, *args: str) -> dict[str, str]:
    """node_env.sh in the stand-in HOME `home` (its ~/xmodal: this repository), `args` appended; returns
    the environment to run the node scripts in (they load ~/xmodal.env themselves)."""
    home.mkdir(parents=True, exist_ok=True)
    if not (home / "xmodal").exists():
        (home / "xmodal").symlink_to(REPO)
    env = {"HOME": str(home), "PATH": os.environ["PATH"]}
    out = subprocess.run(["bash", str(SCRIPTS / "node_env.sh"), "--storage-path=/shared/runs",
                          "--mlflow-artifacts=/shared/mlflow", "--head-ip=127.0.0.2", f"--venv={sys.prefix}", *args],
                         env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return env


def node_environment(env: dict[str, str]) -> dict[str, str]:
    out = subprocess.run(["bash", "-c", ". ~/xmodal.env && env -0"], env=env, capture_output=True, text=True,
                         check=True, timeout=60).stdout
    return dict(line.split("=", 1) for line in out.split("\0") if "=" in line)


def script(env: dict[str, str], name: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPTS / name), *args], env=env, capture_output=True, text=True,
                          timeout=timeout)


def stop_postgres(env: dict[str, str]) -> subprocess.CompletedProcess:
    """What stop_cluster.sh does for the database (the rest of it stops Ray)."""
    return subprocess.run(["bash", "-c", f". {SCRIPTS / 'lib.sh'} && xm_load_env && xm_stop_postgres"], env=env,
                          capture_output=True, text=True, timeout=120)


def accepts(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=2).close()
        return True
    except OSError:
        return False


@pytest.fixture
def data_parent(tmp_path_factory):
    """A folder for the data folder. As root the server runs as the user postgres, who must reach it:
    not under pytest's tmp_path (mode 700, root's), but a folder of its own under /var/tmp."""
    if not ROOT:
        yield tmp_path_factory.mktemp("pg")
        return
    parent = Path(tempfile.mkdtemp(prefix="xmodal-pg-", dir="/var/tmp"))
    parent.chmod(0o755)
    yield parent
    shutil.rmtree(parent, ignore_errors=True)


# ---------------------------------------------------------------- the environment and bad input


def test_node_environment_names_the_heads_postgres_unless_another_backend(tmp_path):
    env = node_environment(node(tmp_path / "a"))
    default = "/var/lib/xmodal/postgres" if ROOT else str(tmp_path / "a" / "mlflow" / "postgres")
    assert env["XMODAL_POSTGRES_DATA"] == default and env["XMODAL_POSTGRES_PORT"] == "5433"
    # The driver named (a plain postgresql:// makes SQLAlchemy 2 look for psycopg 3); no password on any node.
    assert env["XMODAL_MLFLOW_BACKEND"] == "postgresql+psycopg2://mlflow@127.0.0.1:5433/mlflow"
    env = node_environment(node(tmp_path / "b", f"--postgres-data={tmp_path}/pg", "--postgres-port=6543"))
    assert env["XMODAL_POSTGRES_DATA"] == f"{tmp_path}/pg"
    assert env["XMODAL_MLFLOW_BACKEND"] == "postgresql+psycopg2://mlflow@127.0.0.1:6543/mlflow"

    # Another database: nothing for start_postgres.sh (nor stop_cluster.sh) to run.
    sqlite = node(tmp_path / "c", f"--mlflow-backend=sqlite:///{tmp_path}/c/mlflow.db")
    assert node_environment(sqlite)["XMODAL_POSTGRES_DATA"] == ""
    out = script(sqlite, "start_postgres.sh")
    assert out.returncode == 0 and "nothing to start" in out.stdout, out.stdout + out.stderr
    assert stop_postgres(sqlite).returncode == 0
    assert not (tmp_path / "c" / "mlflow" / "postgres").exists()


@pytest.mark.parametrize("args, said", [
    (["--mlflow-backend=sqlite:////x/mlflow.db", "--postgres-data=/x/pg"], "give one of them"),
    (["--postgres-data=pg"], "--postgres-data=pg: expected an absolute path"),
])
def test_node_env_refuses_contradictory_or_relative_postgres_options(tmp_path, args, said):
    (tmp_path / "xmodal").symlink_to(REPO)
    out = subprocess.run(["bash", str(SCRIPTS / "node_env.sh"), "--storage-path=/s", "--mlflow-artifacts=/m", *args],
                         env={"HOME": str(tmp_path), "PATH": os.environ["PATH"]}, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and said in out.stderr, out.stderr
    assert not (tmp_path / "xmodal.env").exists()


@pytest.mark.skipif(NO_POSTGRES is not None, reason=str(NO_POSTGRES))
def test_start_postgres_refuses_a_data_folder_that_is_no_database(tmp_path, data_parent):
    data = data_parent / "pg"
    env = node(tmp_path / "home", f"--postgres-data={data}", f"--postgres-port={free_port()}")
    data.write_text("not a folder")
    out = script(env, "start_postgres.sh")
    assert out.returncode == 1 and f"XMODAL_POSTGRES_DATA={data} is not a folder" in out.stderr, out.stderr
    data.unlink()
    data.mkdir()
    (data / "notes.txt").write_text("mine")
    out = script(env, "start_postgres.sh")
    assert out.returncode == 1 and "holds files but no PostgreSQL database (no PG_VERSION)" in out.stderr, out.stderr
    assert [p.name for p in data.iterdir()] == ["notes.txt"] and not list(data_parent.glob(".pg.new"))
    (data / "PG_VERSION").write_text("99\n")  # made by a PostgreSQL this machine does not have
    out = script(env, "start_postgres.sh")
    assert out.returncode == 1 and "initialised by PostgreSQL 99, whose programs are not on" in out.stderr, out.stderr


# ---------------------------------------------------------------- the database, for real


@pytest.mark.slow
@pytest.mark.skipif(NO_POSTGRES is not None, reason=str(NO_POSTGRES))
def test_head_postgres_keeps_every_metric_through_a_server_restart_and_its_own(tmp_path_factory, data_parent):
    import psycopg2

    # Not tmp_path: a slow test's tmp_path starts with a copy of the SQLite template (conftest.py), made
    # for nothing here.
    tmp_path = tmp_path_factory.mktemp("head")
    data, port = data_parent / "pg", free_port()
    env = node(tmp_path / "home", f"--postgres-data={data}", f"--postgres-port={port}")
    pgpass = tmp_path / "home" / "mlflow" / "pgpass"
    server = None
    try:
        out = script(env, "start_postgres.sh")
        assert out.returncode == 0, out.stdout + out.stderr
        assert f"PostgreSQL on 127.0.0.1:{port}, data in {data}" in out.stdout
        assert (data / "PG_VERSION").exists() and data.stat().st_mode & 0o777 == 0o700
        assert pgpass.stat().st_mode & 0o777 == 0o600
        host, pport, db, user, password = pgpass.read_text().strip().split(":")
        assert (host, pport, db, user) == ("127.0.0.1", str(port), "mlflow", "mlflow") and len(password) == 48
        # The loopback address only (127.0.0.2 is loopback too, but not the address it listens on).
        assert accepts("127.0.0.1", port) and not accepts("127.0.0.2", port)
        postmaster = (data / "postmaster.pid").read_text().split()[0]
        # Rerun (every `ray up` does): the same server, nothing made again.
        out = script(env, "start_postgres.sh")
        assert out.returncode == 0, out.stdout + out.stderr
        assert (data / "postmaster.pid").read_text().split()[0] == postmaster

        # The server on that database, with the password from the file start_mlflow.sh points it to.
        backend = node_environment(env)["XMODAL_MLFLOW_BACKEND"]
        server = MlflowServer(tmp_path, backend=backend, env={"PGPASSFILE": str(pgpass),
                                                              "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"})
        server.start(timeout=300)
        exp = tracking.ensure_experiment(server.uri, "e")
        run_id = tracking.create_run(server.uri, exp, "r", {}, {})
        log = tracking.RunLogger(server.uri, run_id, spool=tmp_path / "spool.jsonl", outage_wait_s=120)
        for step in range(1, 6):
            log.log({"train/loss": 1.0 / step, "train/lr": 0.1}, step)
        assert log.flush()  # every value sent, none spooled
        server.stop()  # restarted in the middle of the run
        for step in range(6, 11):
            log.log({"train/loss": 1.0 / step, "train/lr": 0.1}, step)
        time.sleep(2)  # the logger is retrying meanwhile
        server.start(timeout=300)
        assert log.close() is None and not (tmp_path / "spool.jsonl").exists()

        def in_postgres() -> list[tuple[str, int]]:
            with psycopg2.connect(host="127.0.0.1", port=port, dbname="mlflow", user="mlflow",
                                  password=password) as conn, conn.cursor() as cur:
                cur.execute("SELECT key, step FROM metrics WHERE run_uuid = %s ORDER BY key, step", (run_id,))
                return cur.fetchall()

        every_step_once = [(k, s) for k in ("train/loss", "train/lr") for s in range(1, 11)]
        assert in_postgres() == every_step_once

        # PostgreSQL stopped (stop_cluster.sh) and started again (the next `ray up`): the run is there.
        # (tests/test_ray_up.py reads it through a server started again as well.)
        server.stop()
        assert stop_postgres(env).returncode == 0 and not accepts("127.0.0.1", port)
        assert (data / "PG_VERSION").exists()
        out = script(env, "start_postgres.sh")
        assert out.returncode == 0, out.stdout + out.stderr
        assert (data / "postmaster.pid").read_text().split()[0] != postmaster
        assert in_postgres() == every_step_once
    finally:
        if server is not None and server.proc is not None:
            server.stop()
        stop_postgres(env)
