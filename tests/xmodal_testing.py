"""Shared test helpers: processes, Ray heads owned by a test, job waiting; LXMERT head outputs.

A plain module (not conftest.py): tests/data has a conftest of its own, so `from conftest import`
would find whichever conftest was imported first.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
RAY = str(Path(sys.executable).parent / "ray")
MLFLOW = str(Path(sys.executable).parent / "mlflow")


def all_logits(model, out) -> dict:
    """Every pretraining head of `model` (an `LxmertForPretraining`) at every position of its output
    `out`, for parity checks; the objective applies each head only where a loss needs it."""
    hv = model.object_heads.transform(out.visn)  # (B, N, D)
    return {
        "mlm": model.mlm_head(out.lang),  # (B, T, V)
        "match": model.match_head(out.pooled),  # (B, 2)
        "obj": model.object_heads.obj(hv),  # (B, N, 1600)
        "attr": model.object_heads.attr(hv),  # (B, N, 400)
        "feat": model.object_heads.feat(hv),  # (B, N, F)
        "qa": model.qa_head(out.pooled),  # (B, A)
    }


def spy_checks_and_prepares(mp, *specs: type) -> dict[str, list[str]]:
    """The run name of each call of `engine.check` and of the specs' `prepare` in this process, in the
    order made: each call recorded, then made as it is (`mp`: a pytest MonkeyPatch that undoes it)."""
    from xmodal.runner import engine

    calls: dict[str, list[str]] = {"check": [], "prepare": []}
    check = engine.check

    def counted_check(spec, cfg):
        calls["check"].append(cfg.mlflow.run_name)
        return check(spec, cfg)

    mp.setattr(engine, "check", counted_check)
    for spec in specs:
        def counted_prepare(self, cfg, inputs, _prepare=spec.prepare):
            calls["prepare"].append(cfg.mlflow.run_name)
            return _prepare(self, cfg, inputs)

        mp.setattr(spec, "prepare", counted_prepare)
    return calls


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def held(name: str, timeout: float, poll: float = 1.0) -> Iterator[None]:
    """Hold a lock named `name` for the network namespace (an abstract Unix socket: one bind per network
    namespace succeeds, and the kernel frees it when its process dies, so a crashed holder leaves no stale
    lock). Waits up to `timeout` s for whoever holds it, then fails naming it."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    deadline = time.monotonic() + timeout
    try:
        while True:
            try:
                sock.bind("\0" + name)
                break
            except OSError as e:
                if e.errno != errno.EADDRINUSE:  # anything but "held" is not worth waiting out
                    raise
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the lock {name!r} (an abstract Unix socket: `ss -xlp | grep {name}` "
                                       f"shows its process) was still held after {timeout:.0f} s") from None
                time.sleep(poll)
        yield
    finally:
        sock.close()


def kill_tree(pid: int, grace: float = 5.0) -> None:
    """SIGTERM a process and all its descendants, then SIGKILL what is left.

    By pid, not `ray stop` (which stops every Ray node on the machine, including
    the shared test cluster); some Ray agents ignore SIGTERM.
    """
    import psutil

    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    procs = [root, *root.children(recursive=True)]
    for p in procs:
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=grace)


# What `ray start` prints once its node has registered with the GCS (with --block, before it blocks).

class HostLogs:
    """The log files of the processes a test starts in its rehearsal hosts, one `NAME.log` each in one
    folder: `open` gives Popen's output arguments (a name opened again is closed first), `text` reads one
    back, `close` at teardown."""

    def __init__(self, folder: Path):
        self.folder = folder
        self.files: dict = {}

    def open(self, name: str, mode: str = "w") -> dict:
        if name in self.files:
            self.files[name].close()
        self.files[name] = open(self.folder / f"{name}.log", mode)  # noqa: SIM115 - closed by close()
        return {"stdout": self.files[name], "stderr": subprocess.STDOUT}

    def text(self, name: str) -> str:
        return (self.folder / f"{name}.log").read_text()

    def close(self) -> None:
        for f in self.files.values():
            f.close()


def child_of(pid: int) -> int:
    """The one child of `pid` (the program an `nsenter --pid` runs: nsenter forks it)."""
    deadline = time.monotonic() + 30
    while True:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        if children:
            return int(children[0])
        assert time.monotonic() < deadline, f"process {pid} started no child"
        time.sleep(0.05)

NODE_STARTED = "Ray runtime started."
NODE_START_TRIES = 3


@dataclass
class NodeStart:
    """One Ray node to start: `start()` launches its `ray start --block` (its output appended to `log`);
    `teardown(proc)` removes a failed attempt (default: the process tree)."""

    what: str
    start: Callable[[], subprocess.Popen]
    log: Path
    teardown: Callable[[subprocess.Popen], None] | None = None


def start_nodes(nodes: list[NodeStart], timeout: float = 120, tries: int = NODE_START_TRIES) -> list[subprocess.Popen]:
    """Start the nodes at once and wait until each says it started; one that fails or times out is torn
    down and started again, up to `tries` starts in all. On a loaded machine a node's start can time
    out ("The current node timed out during startup ... the GCS has become overloaded") where the same
    start a moment later passes. Returns the nodes' processes, in order; raises after the last try,
    with each failed start's reason and the last one's output."""
    procs: dict[int, subprocess.Popen] = {}
    failures: dict[int, list[str]] = {i: [] for i in range(len(nodes))}
    pending = list(range(len(nodes)))
    last = ""
    for attempt in range(1, tries + 1):
        started = {}
        for i in pending:
            offset = nodes[i].log.stat().st_size if nodes[i].log.exists() else 0
            started[i] = (nodes[i].start(), offset)
        deadline = time.monotonic() + timeout
        waiting = dict(started)
        while waiting:
            for i, (proc, offset) in list(waiting.items()):
                with open(nodes[i].log, "rb") as f:
                    f.seek(offset)
                    said = f.read().decode(errors="replace")
                if NODE_STARTED in said:
                    procs[i] = proc
                elif proc.poll() is not None or time.monotonic() > deadline:
                    why = f"exited {proc.returncode}" if proc.poll() is not None else f"not started after {timeout:.0f} s"
                    failures[i].append(why)
                    last = f"{nodes[i].what}, start {attempt}: {why}:\n{said[-3000:]}"
                    (nodes[i].teardown or (lambda p: kill_tree(p.pid)))(proc)
                else:
                    continue
                del waiting[i]
            time.sleep(0.1)
        pending = [i for i in pending if i not in procs]
        if not pending:
            return [procs[i] for i in range(len(nodes))]
        if attempt < tries:
            print(f"node start {attempt} of {tries} failed for " + ", ".join(
                f"{nodes[i].what} ({failures[i][-1]})" for i in pending) + ": torn down, starting again")
    for proc in procs.values():  # nothing half-started is left to the caller
        kill_tree(proc.pid)
    raise RuntimeError(f"{', '.join(nodes[i].what for i in pending)}: {tries} starts failed "
                       f"({'; '.join(w for i in pending for w in failures[i])}); the last: {last}")


def ray_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",)}
    env.update({"RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1", **extra})
    return env


class RayHead:
    """A `ray start --head --block` node owned by the test (stopped by pid)."""

    def __init__(self, tmp: Path, num_cpus: int = 4, resources: str | None = None):
        self.port, self.dash_port = free_port(), free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.dashboard = f"http://127.0.0.1:{self.dash_port}"
        import secrets

        # Token authentication, as on a real cluster: every process that talks to the cluster carries it.
        self.token = secrets.token_hex(32)
        self.env = ray_env(RAY_AUTH_TOKEN=self.token)
        self.nodes: list[subprocess.Popen] = []
        cmd = [RAY, "start", "--head", "--block", f"--port={self.port}", f"--dashboard-port={self.dash_port}",
               "--dashboard-host=127.0.0.1", f"--num-cpus={num_cpus}", "--disable-usage-stats",
               "--object-store-memory=500000000", "--memory=4000000000",
               f"--ray-client-server-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
               f"--metrics-export-port={free_port()}", f"--runtime-env-agent-port={free_port()}"]
        if resources:
            cmd.append(f"--resources={resources}")
        self._start(cmd, tmp / "head.log", "the Ray head")
        self.wait_ready()

    def _start(self, cmd: list[str], log: Path, what: str) -> None:
        """Starts the node and returns once it has joined; a start that fails or times out is torn down
        and tried again (`start_nodes`)."""
        def launch() -> subprocess.Popen:
            with open(log, "a") as out:  # each try's output after the last's
                # RAY_ADDRESS for the node's processes: Ray Train's placement-group cleaner finds "its" cluster
                # by it, else by the file the last `ray start` wrote (xmodal.runner.ray_cluster.start_local).
                return subprocess.Popen(cmd, env={**self.env, "RAY_ADDRESS": self.address}, stdout=out,
                                        stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)

        self.nodes += start_nodes([NodeStart(what, launch, log)])

    def add_worker_node(self, tmp: Path, num_cpus: int, resources: str | None = None,
                        temp_dir: str | None = None) -> None:
        """`temp_dir` (short: socket paths live under it) gives the node a session folder of its own. Nodes
        sharing one re-extract each other's runtime_env packages in place, deleting a running job's
        working directory (`ray job submit --working-dir`)."""
        cmd = [RAY, "start", "--block", f"--address={self.address}", f"--num-cpus={num_cpus}",
               "--object-store-memory=500000000", "--memory=4000000000", "--disable-usage-stats",
               f"--dashboard-agent-listen-port={free_port()}", f"--metrics-export-port={free_port()}",
               f"--runtime-env-agent-port={free_port()}"]
        if resources:
            cmd.append(f"--resources={resources}")
        if temp_dir:
            cmd.append(f"--temp-dir={temp_dir}")
        self._start(cmd, tmp / f"node{len(self.nodes)}.log", f"Ray worker node {len(self.nodes)}")

    def client(self):
        from ray.job_submission import JobSubmissionClient

        return JobSubmissionClient(self.dashboard, headers={"Authorization": f"Bearer {self.token}"})

    def submit(self, entrypoint: list[str], cwd: Path = REPO) -> str:
        """`ray job submit --no-wait` through the real CLI; returns the job id."""
        out = subprocess.run([RAY, "job", "submit", f"--address={self.dashboard}", "--no-wait", "--", *entrypoint],
                             env=self.env, cwd=cwd, capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        for word in (out.stdout + out.stderr).split():
            if word.strip("'\"").startswith("raysubmit_"):
                return word.strip("'\".")
        raise AssertionError(f"no job id in: {out.stdout}{out.stderr}")

    def wait_ready(self, timeout: float = 120) -> None:
        deadline = time.time() + timeout
        while True:
            try:
                self.client().list_jobs()
                return
            except Exception:
                if time.time() > deadline:
                    raise
                time.sleep(2)

    def stop(self) -> None:
        for p in reversed(self.nodes):
            kill_tree(p.pid)
        # `ray start --head` wrote this node's address to /tmp/ray/ray_current_cluster, which a killed
        # node leaves behind: Ray's command line (and anything else that looks there) would then wait
        # on a dead address.
        from ray._common.utils import get_ray_address_file

        written = Path(get_ray_address_file(None))
        if written.exists() and written.read_text().strip().endswith(f":{self.port}"):
            written.unlink(missing_ok=True)


def wait_job(client, job_id: str, timeout: float) -> str:
    from ray.job_submission import JobStatus

    deadline = time.time() + timeout
    while time.time() < deadline:
        status = client.get_job_status(job_id)
        if status in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
            return status
        time.sleep(2)
    raise TimeoutError(f"job {job_id} still {client.get_job_status(job_id)} after {timeout} s:\n"
                       f"{client.get_job_logs(job_id)[-5000:]}")


def tiny_worker(job: str, store: Path, *overrides: str):
    """(spec, config, worker) of `job` on the tiny preset, 16 samples a step, on the CPU."""
    import torch

    from xmodal.config.experiment import load_config
    from xmodal.jobs.finetune_config import FinetuneConfig
    from xmodal.jobs.mult_config import MultTrainConfig
    from xmodal.jobs.pretrain_config import PretrainConfig
    from xmodal.jobs.registry import job_spec
    from xmodal.runner.spec import PrepareContext, split_batch
    from xmodal.runner.worker import make_worker

    spec = job_spec(job)
    config = {"pretrain": PretrainConfig, "mult": MultTrainConfig, "finetune": FinetuneConfig}[job]
    cfg = load_config(config, overrides=["preset=tiny", "train.batch_size=16", f"data.store={store}", *overrides])
    prepared = spec.prepare(cfg, PrepareContext("", Path(".")))
    cfg = prepared.cfg
    return spec, cfg, make_worker(spec, cfg, prepared.data, prepared.start, torch.device("cpu"), 20, split_batch(cfg),
                                  train_options=prepared.train_options, builder=prepared.builder)


class MlflowServer:
    """A real `mlflow server` on a local port (SQLite backend unless `backend` names another database,
    artifacts served), stopped and started again by the test on the same port and database. `env`: added
    to the server's environment."""

    def __init__(self, tmp: Path, port: int | None = None, backend: str | None = None,
                 env: dict[str, str] | None = None):
        self.tmp, self.port = tmp, port or free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.backend = backend or f"sqlite:///{self.tmp / 'server.db'}"
        # Without MLflow's job runner, as scripts/cluster/start_mlflow.sh runs the head's server: its eight
        # processes (a runner, seven huey consumers) took ~15 CPU-seconds a start, for jobs xmodal never runs.
        self.env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", **(env or {})}
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120) -> MlflowServer:
        db = self.tmp / "server.db"
        if self.backend.startswith("sqlite:") and not db.exists():
            from xmodal import tracking

            tracking.ensure_experiment(f"sqlite:///{db}", "e")  # the tables, made faster in-process
        log = open(self.tmp / "mlflow-server.log", "a")  # noqa: SIM115 - kept open for the server's lifetime
        self.proc = subprocess.Popen(
            [MLFLOW, "server", "--backend-store-uri", self.backend,
             "--artifacts-destination", str(self.tmp / "server-artifacts"), "--host", "127.0.0.1",
             "--port", str(self.port), "--workers", "1"],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=self.tmp, env=self.env)
        deadline = time.time() + timeout
        while True:
            try:
                urllib.request.urlopen(f"{self.uri}/health", timeout=2).close()
                return self
            except OSError:
                assert self.proc.poll() is None, (self.tmp / "mlflow-server.log").read_text()[-3000:]
                if time.time() >= deadline:  # not left running: the failed fixture never stops it
                    kill_tree(self.proc.pid)
                    self.proc = None
                    raise AssertionError(f"mlflow server not ready after {timeout} s") from None
                time.sleep(0.5)

    def stop(self) -> None:
        if self.proc is not None:
            kill_tree(self.proc.pid)
            self.proc = None
        from xmodal import tracking

        assert not tracking.reachable(self.uri)


# ---------------------------------------------------------------- S3: a moto server

S3_BUCKET = "xmodal-test"


def s3_environment(port: int) -> dict[str, str]:
    """The AWS_* variables that point pyarrow, boto3 and Ray's workers at the moto server on `port`
    (scripts/cluster/node_env.sh writes the same variables for a cluster's real endpoint)."""
    return {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true"}


class S3:
    """A moto S3 server on 127.0.0.1 with one bucket (`S3_BUCKET`), reached through the AWS_*
    variables of this process (`s3_environment`)."""

    def __init__(self, port: int):
        self.port = port
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 30.0) -> S3:
        self.proc = subprocess.Popen([str(Path(PYTHON).parent / "moto_server"), "-H", "127.0.0.1", "-p",
                                      str(self.port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + timeout
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"moto_server did not start on port {self.port}") from None
                time.sleep(0.1)
        self.client().create_bucket(Bucket=S3_BUCKET)
        return self

    def stop(self) -> None:
        if self.proc is not None:
            kill_tree(self.proc.pid)
            self.proc = None

    def client(self):
        import boto3

        return boto3.client("s3", endpoint_url=f"http://127.0.0.1:{self.port}")

    def upload(self, folder: Path, prefix: str) -> str:
        """Every file under `folder` to `s3://S3_BUCKET/prefix/...`; returns that URI."""
        client = self.client()
        for f in sorted(p for p in Path(folder).rglob("*") if p.is_file()):
            client.upload_file(str(f), S3_BUCKET, f"{prefix}/{f.relative_to(folder).as_posix()}")
        return f"s3://{S3_BUCKET}/{prefix}"

    def put(self, key: str, body: bytes) -> None:
        self.client().put_object(Bucket=S3_BUCKET, Key=key, Body=body)

    def get(self, key: str) -> bytes:
        return self.client().get_object(Bucket=S3_BUCKET, Key=key)["Body"].read()

    def delete(self, key: str) -> None:
        self.client().delete_object(Bucket=S3_BUCKET, Key=key)


@contextmanager
def console_kept() -> Iterator[None]:
    """The console's process-wide state (the package logger's handler, level and propagation, the active
    console, the worker flag, the verbose flag) given back as found: a test that runs a command's `main`
    in this process sets it up for a whole run's process, and the tests after it on this worker would
    see it."""
    from xmodal.base import console

    handlers, level, propagate = list(console.log.handlers), console.log.level, console.log.propagate
    active, on_worker, verbose = console.CONSOLE.active, console._on_worker, os.environ.get(console.VERBOSE_ENV)
    try:
        yield
    finally:
        console.log.handlers[:] = handlers
        console.log.setLevel(level)
        console.log.propagate = propagate
        console.CONSOLE.active, console._on_worker = active, on_worker
        if verbose is None:
            os.environ.pop(console.VERBOSE_ENV, None)
        else:
            os.environ[console.VERBOSE_ENV] = verbose

