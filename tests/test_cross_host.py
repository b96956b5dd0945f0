"""Pretraining runs across three rehearsal hosts (platform/xmodal_rehearsal/) that lose a network link or
their driver midway, and a run that cannot be placed on what is left.

    head     10.231.0.1  the Ray head (no CPUs: drivers only), the S3 server (moto), the jobs' drivers
    worker1  10.231.0.2  a Ray worker node, 2 CPUs
    worker2  10.231.0.3  a Ray worker node, 2 CPUs

One cluster for the module (the `cluster` fixture): each case costs its runs, not a new cluster, and
each lost host stays lost (a raylet started again on a host the GCS declared dead crashed at start-up),
so the cases run in the file's order: the cut link takes one of the two worker hosts, the strict
placement run gets the one left. The head's GCS runs with the
health-check settings the cluster configs give it (scripts/cluster/head_system_config.json, which
scripts/cluster/start_ray.sh passes as --system-config), read from that file. A monitor (a driver of
its own in `head`) prints every change of the live nodes and every Train worker that starts, with the
machine's monotonic clock, so the cases read when a node was declared dead and where the workers ran
without starting a Ray driver each time.

Once the nodes have joined, every host name resolves to 127.0.0.1 (the hosts file rewritten): gloo must
take its interface from the node IP (xmodal.runner.gloo), not from its host name, or the workers on the
two hosts each dial their own loopback.

Every job is `jobs/pretrain.py` (tiny preset, 50 steps, a checkpoint every 10) with 2 Train workers of
0.5 CPU placed SPREAD, checkpointing to `s3://` on the moto server and logging to an MLflow SQLite
file. The runs are reproducible (same seed, data, config and worker count), so one fault-free run of
the same job (`reference`) is what each faulty run must equal: its per-step losses and evaluations at
every step, and the weights of each checkpoint the faulty run resumed from (the same digest as the
fault-free run's at that step). Its steps after that checkpoint are a fault-free run from it.

One run takes two faults in turn, each once the run has written a checkpoint newer than the last
fault's (two job starts would cost a minute and a half each of the suite's two cores):
- A cut network link (the link to the bridge of a host running a Train worker taken down: its processes
  live on, unreachable): the GCS declares the host's node dead after its failed health checks, and Ray
  Train starts both workers again on the one worker host left (SPREAD is a soft placement; 2 x 0.5 CPUs,
  one CPU left for Ray Data's reads) from the newest checkpoint on S3. (A host that dies at once, its
  PID namespace gone as when a machine loses power, is the same path detected sooner, since its ports
  refuse connections: tests/extract/test_extract_cluster.py loses one that way.)
- The driver killed (SIGKILL): the cluster ends the job's actors; the same command run again resumes
  from the newest intact checkpoint on S3 into the same MLflow run, and finishes there.

And then:
- STRICT_SPREAD, which the one worker host left cannot hold: fails after its bounded tries (engine:
  controller_failure_limit) with Ray Train's error instead of retrying forever.

The faulty run prints its wall time, the steps trained twice, the metrics lost (none: asserted) and,
for each lost host, the time from the fault to the node declared dead.

What is shared between hosts: each host has its own /tmp, /run, /dev/shm and /root, so the store, the
MLflow database and the drivers' working folder live in a folder under /var/tmp, which the rehearsal
leaves as the machine's (every host sees the same files: a cut host could still reach the MLflow file,
which a real one could not reach over the network; its blocked workers log nothing new). Checkpoints
go over the network to S3.

Root only (network namespaces); skipped otherwise, with the reason.
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

import xmodal_rehearsal as rehearsal
from xmodal_rehearsal import Hosts
from xmodal_testing import (
    NODE_START_TRIES,
    PYTHON,
    REPO,
    HostLogs,
    NodeStart,
    child_of,
    kill_tree,
    start_nodes,
)

REASON = rehearsal.unavailable_reason()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(REASON is not None, reason=f"host rehearsal unavailable: {REASON}")]

PREFIX = "xmx"  # not the command line's (xm) nor test_rehearsal's (xmt)
BIN = Path(PYTHON).parent
RAY = str(BIN / "ray")
HEAD = "10.231.0.1"
WORKERS = {"worker1": "10.231.0.2", "worker2": "10.231.0.3"}
HOST_AT = {address: name for name, address in WORKERS.items()}
S3_PORT = 5000
ENDPOINT = f"http://{HEAD}:{S3_PORT}"
BUCKET = "xmodal"
STEPS = 50  # two faults in one run, each past a newer checkpoint than the last
EVAL_EVERY = 10
START_TIMEOUT_S = 10.0  # Ray Train's wait for a worker group's placement (default 60 s)
# The cluster configs' GCS health checks, from the file start_ray.sh passes to the head.
HEALTH = json.loads((REPO / "scripts" / "cluster" / "head_system_config.json").read_text())
COMPARED = ("train/loss", "train/loss/mlm", "eval/loss", "eval/match_acc", "eval/mlm_acc")
COMMON = ["--object-store-memory=100000000", "--disable-usage-stats"]

# A driver of its own in `head` for the whole module: the cluster's system config once, then, with the
# machine's monotonic clock (the same in every host), each change of the live nodes and each Train
# worker seen alive for the first time.
MONITOR = """
import json, time
import ray
from ray._private import state
ray.init(address="auto", log_to_driver=False)
print("config", json.dumps(state.state.get_system_config()), flush=True)
nodes, seen, next_actors = None, set(), 0.0
while True:
    alive = sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])
    now = time.monotonic()  # after the answer: a node's death is printed no earlier than it was known
    if alive != nodes:
        nodes = alive
        print(now, "nodes", " ".join(alive), flush=True)
    if now >= next_actors:
        next_actors = now + 1.0
        for a in sorted(state.actors(actor_state_name="ALIVE").values(), key=lambda a: a["StartTime"]):
            if a["ActorClassName"] == "RayTrainWorker" and a["ActorID"] not in seen:
                seen.add(a["ActorID"])
                print(now, "worker", a["Address"]["IPAddress"], flush=True)
    time.sleep(0.05)
"""


def s3():
    import boto3

    return boto3.client("s3", endpoint_url=ENDPOINT, region_name="us-east-1", aws_access_key_id="testing",
                        aws_secret_access_key="testing")


def wait_port(host: str, port: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection((host, port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def checkpoint_metas(client, run: str) -> dict[int, dict]:
    """The metas of the run's checkpoints on S3, by step."""
    out = client.list_objects_v2(Bucket=BUCKET, Prefix=f"runs/{run}/")
    keys = [o["Key"] for o in out.get("Contents", [])
            if o["Key"].endswith("/meta.json") and o["Key"].split("/")[2].startswith("checkpoint_")]
    metas = [json.loads(client.get_object(Bucket=BUCKET, Key=k)["Body"].read()) for k in keys]
    return {m["step"]: m for m in metas}


def printed_losses(log: str) -> dict[int, float]:
    """The console's progress lines: {step: train loss, 4 decimals}."""
    return {int(m.group(1)): float(m.group(2))
            for m in re.finditer(r"^\[xmodal\] step (\d+)/\d+ .* loss ([0-9.]+) ", log, re.MULTILINE)}


@dataclass
class Cluster:
    hosts: Hosts
    shared: Path
    env: dict[str, str]
    uri: str
    store: Path
    logs: HostLogs = field(init=False)
    lost: set[str] = field(default_factory=set)  # worker hosts cut off or killed

    def __post_init__(self) -> None:
        self.logs = HostLogs(self.shared)

    def tail(self, name: str, n: int = 4000) -> str:
        return self.logs.text(name)[-n:]

    def monitor(self, since: float) -> list[tuple[float, str, list[str]]]:
        """The monitor's lines since `since` (monotonic): (time, "nodes" or "worker", addresses)."""
        out = []
        for line in self.logs.text("monitor").splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[1] in ("nodes", "worker") and float(parts[0]) >= since:
                out.append((float(parts[0]), parts[1], parts[2:]))
        return out

    def alive(self) -> list[str]:
        nodes = [addresses for _, kind, addresses in self.monitor(0.0) if kind == "nodes"]
        return nodes[-1] if nodes else []

    def wait_nodes(self, expected: list[str], timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        while self.alive() != expected:
            assert time.monotonic() < deadline, (f"nodes {self.alive()}, expected {expected}:\n{self.tail('monitor')}\n"
                                                 + "\n".join(self.tail(w) for w in WORKERS))
            time.sleep(0.2)

    def worker_node(self, host: str, address: str, log: str) -> NodeStart:
        """`ray start --block` of a worker node in `host` (dies with its host), for `start_nodes`: a start
        that failed is torn down by its process tree and the host's own `ray stop` (the host's PID
        namespace: its Ray only), which also ends the daemons the host's PID 1 adopted."""
        def launch() -> subprocess.Popen:
            return self.hosts.popen(host, [RAY, "start", "--block", f"--address={HEAD}:6379",
                                           f"--node-ip-address={address}", "--num-cpus=2", *COMMON],
                                    env=self.env, **self.logs.open(log, "a"))

        def teardown(proc: subprocess.Popen) -> None:
            kill_tree(proc.pid)
            self.hosts.run(host, [RAY, "stop", "--force"], env=self.env, check=False, timeout=120)

        return NodeStart(f"the worker node in {host}", launch, self.shared / f"{log}.log", teardown)

    def job(self, name: str, *extra: str) -> list[str]:
        """The job's command line (the same for every case but its name and `extra`)."""
        return [PYTHON, str(REPO / "jobs" / "pretrain.py"), "--store", str(self.store),
                "--storage-path", f"s3://{BUCKET}/runs", "--run-name", name,
                "--set", "preset=tiny", "--set", "train.epochs=4", "--set", "train.batch_size=16",
                "--set", f"train.max_steps={STEPS}", "--set", f"train.eval_every={EVAL_EVERY}",
                "--set", "train.log_every=1", "--set", "train.keep_best=10", "--set", "data.eval_batches=2",
                "--set", "scale.num_workers=2", "--set", "scale.cpus_per_worker=0.5",
                "--set", "mlflow.system_metrics=false", "--set", f"mlflow.tracking_uri={self.uri}", *extra]

    def start(self, name: str, log: str, placement: str = "SPREAD", max_failures: int = 2) -> subprocess.Popen:
        """The job's driver, in `head`, attached to the cluster."""
        cmd = self.job(name, "--set", f"scale.placement_strategy={placement}", "--set", f"scale.max_failures={max_failures}")
        return self.hosts.popen("head", cmd, env={**self.env, "RAY_ADDRESS": f"{HEAD}:6379"}, cwd=str(self.shared),
                                **self.logs.open(log))

    def past_a_checkpoint(self, driver: subprocess.Popen, run: str, log: str, newer_than: int = 0) -> dict[int, dict]:
        """Waits until a checkpoint past step `newer_than` is on S3 and a progress line of the attempt running
        now at least 3 steps past it is shown (progress lines come every 5 steps of 50: e.g. 16 after the one at 10); returns the
        checkpoints on S3 then. The first such checkpoint sets the mark: the run does not wait for a
        newer one, which at this speed may come before the line (and the run end before the fault)."""
        client = s3()
        deadline = time.monotonic() + 240
        mark = None
        while True:
            assert driver.poll() is None, self.tail(log)
            assert time.monotonic() < deadline, f"no checkpoint past step {newer_than} on S3 after 240 s:\n" + self.tail(log)
            metas = checkpoint_metas(client, run)
            if mark is None and metas and max(metas) > newer_than:
                mark = max(metas)
            text = self.logs.text(log)  # the lines of the attempt running now: after the last resume, if any
            shown = printed_losses(text[max(text.rfind("[xmodal] resumed from checkpoint"), 0):])
            if mark is not None and shown and max(shown) >= mark + 3:
                return metas
            time.sleep(0.1)

    def finish(self, driver: subprocess.Popen, log: str, timeout: float = 300) -> str:
        try:
            rc = driver.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job did not end within {timeout} s:\n" + self.tail(log))
        out = self.logs.text(log)
        assert rc == 0, out[-6000:]
        return out

    def the_run(self, name: str):
        from xmodal import tracking

        exp = tracking.get_experiment_id(self.uri, "xmodal-pretrain")
        runs = tracking.search_runs(self.uri, [exp], f"tags.`{tracking.RUN_NAME_TAG}` = '{name}'")
        assert len(runs) == 1, runs
        return runs[0]


def start_head(hosts: Hosts, env: dict[str, str]) -> None:
    """The head's `ray start` in `head` (it returns once the head runs). A start that fails or times out
    (on a loaded machine, a node "timed out during startup", the GCS overloaded) is torn down with the
    host's own `ray stop --force` (its PID namespace: this host's Ray only) and tried again."""
    failed = []
    for attempt in range(1, NODE_START_TRIES + 1):
        try:
            out = hosts.run("head", [RAY, "start", "--head", f"--node-ip-address={HEAD}", "--port=6379",
                                     "--include-dashboard=false", "--num-cpus=0",
                                     f"--system-config={json.dumps(HEALTH)}", *COMMON],
                            env=env, timeout=120, check=False)
            if out.returncode == 0:
                return
            failed.append(f"exited {out.returncode}: {(out.stdout + out.stderr)[-3000:]}")
        except rehearsal.RehearsalError as e:  # still starting after the timeout
            failed.append(str(e)[-3000:])
        hosts.run("head", [RAY, "stop", "--force"], env=env, check=False, timeout=120)
        print(f"the Ray head's start {attempt} of {NODE_START_TRIES} failed: torn down")
    raise AssertionError(f"the Ray head did not start in {NODE_START_TRIES} tries; the last: {failed[-1]}")


@pytest.fixture(scope="module")
def cluster(mlflow_template, tiny_store, request) -> Iterator[Cluster]:
    pytest.importorskip("moto")
    rehearsal.teardown_leftovers(PREFIX)
    shared = Path(tempfile.mkdtemp(prefix="xmodal-xhost-", dir="/var/tmp"))
    os.chmod(shared, 0o755)
    db = shared / "mlflow.db"
    shutil.copyfile(mlflow_template, db)
    uri = f"sqlite:///{db}"
    # The session's tiny store, copied where every host sees it (each host has its own /tmp).
    store = Path(shutil.copytree(tiny_store, shared / "store"))
    env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO / "platform"), "RAY_DEDUP_LOGS": "0",
           "AWS_ENDPOINT_URL": ENDPOINT, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
           "OMP_NUM_THREADS": "1", "MLFLOW_TRACKING_URI": uri,
           # read by Ray Train's controller, which runs on the head (the driver's node)
           "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": str(START_TIMEOUT_S)}
    hosts = Hosts(1 + len(WORKERS), PREFIX)
    hosts_file = Path(f"/run/{PREFIX}-rehearsal/hosts")
    c = None
    failed_before = request.session.testsfailed
    began = time.monotonic()
    try:
        hosts.create()
        c = Cluster(hosts, shared, env, uri, store)
        hosts.popen("head", [str(BIN / "moto_server"), "-H", HEAD, "-p", str(S3_PORT)], env=env, **c.logs.open("s3"))
        start_head(hosts, env)
        start_nodes([c.worker_node(name, address, name) for name, address in WORKERS.items()])
        hosts.popen("head", [PYTHON, "-c", MONITOR], env=env, **c.logs.open("monitor"))
        wait_port(HEAD, S3_PORT, 30)
        s3().create_bucket(Bucket=BUCKET)
        c.wait_nodes([HEAD, *WORKERS.values()])
        # The GCS holds the cluster configs' health-check settings.
        config = json.loads(next(line for line in c.logs.text("monitor").splitlines() if line.startswith("config "))[7:])
        assert {k: config.get(k) for k in HEALTH} == HEALTH, config
        # From now on every host name resolves to 127.0.0.1 (as in many a machine's /etc/hosts; Ray's
        # nodes, which joined already, cannot start with that): gloo's own choice of
        # address would then be loopback, and the workers on two hosts would dial themselves.
        # xmodal.runner.gloo sets GLOO_SOCKET_IFNAME from the node IP instead. (The file is bind-mounted
        # into every host; rewritten in place, they all see it.)
        with open(hosts_file, "r+") as f:
            f.truncate(0)
            f.write("127.0.0.1\tlocalhost " + " ".join(hosts.names) + "\n")
        assert hosts.run("worker1", ["getent", "hosts", "worker1"]).stdout.split()[0] == "127.0.0.1"
        print(f"cluster up in {time.monotonic() - began:.1f} s")
        yield c
    finally:
        hosts.teardown()
        if c is not None:
            c.logs.close()
        if request.session.testsfailed == failed_before:
            shutil.rmtree(shared)
        else:
            print(f"the hosts' logs, store and MLflow database: {shared}")
    assert rehearsal.leftovers(PREFIX) == []  # every host process (Ray, moto, drivers) went with its host


@dataclass(frozen=True)
class Reference:
    histories: dict[str, dict[int, float]]  # COMPARED key -> {step: value}
    checkpoints: dict[int, dict]  # step -> meta


@pytest.fixture(scope="module")
def reference(cluster) -> Reference:
    """A fault-free run of the same job, which every faulty run must equal."""
    from xmodal import tracking

    c = cluster
    began = time.monotonic()
    c.finish(c.start("xhost-ref", "reference"), "reference")
    run = c.the_run("xhost-ref")
    assert run.status == "FINISHED"
    histories = {k: dict(tracking.metric_history(c.uri, run.run_id, k)) for k in COMPARED}
    assert sorted(histories["train/loss"]) == list(range(1, STEPS + 1))
    checkpoints = checkpoint_metas(s3(), "xhost-ref")
    assert sorted(checkpoints) == list(range(EVAL_EVERY, STEPS + 1, EVAL_EVERY)), sorted(checkpoints)
    print(f"reference: a fault-free run in {time.monotonic() - began:.1f} s")
    return Reference(histories, checkpoints)


@dataclass(frozen=True)
class Resumed:
    resumed_from: list[int]  # the step each restart resumed from, in order
    redone: list[int]  # steps trained before a fault and again after it (their loss logged once)


def check_resumed(c: Cluster, name: str, at_faults: list[dict[int, dict]], ref: Reference) -> Resumed:
    """The run finished once, each restart resumed from the newest checkpoint on S3 at its fault (or a
    newer one), every step and evaluation logged once with the fault-free run's values, from the same
    weights. `at_faults`: the checkpoints on S3 at each fault, in order."""
    from xmodal import tracking

    run = c.the_run(name)
    assert run.status == "FINISHED"
    resumed = sorted(tracking.metric_points(c.uri, run.run_id, "train/resumed_from_step"), key=lambda p: p.timestamp)
    assert len(resumed) == len(at_faults), resumed
    metas = checkpoint_metas(s3(), name)
    for point, at_fault in zip(resumed, at_faults, strict=True):
        assert point.value >= max(at_fault), (point.value, sorted(at_fault))
        # The checkpoint resumed from holds the fault-free run's state at that step: the same weights
        # (sha256 sealed in its meta) at the same place in the data.
        meta, same = metas[int(point.value)], ref.checkpoints[int(point.value)]
        assert meta["files"]["model.pt"] == same["files"]["model.pt"], (meta["files"], same["files"])
        assert (meta["epoch"], meta["pos"]) == (same["epoch"], same["pos"])
    points = tracking.metric_points(c.uri, run.run_id, "train/loss")
    steps = sorted(p.step for p in points)
    assert steps == list(range(1, STEPS + 1)), steps  # every step once: none lost, none twice
    assert all(math.isfinite(p.value) for p in points)
    # Every step's losses and every evaluation equal the fault-free run's: before the fault, and from
    # the checkpoint on (what the fault-free run did after that checkpoint).
    for key in COMPARED:
        logged = dict(tracking.metric_history(c.uri, run.run_id, key))
        assert logged.keys() == ref.histories[key].keys(), (key, sorted(logged), sorted(ref.histories[key]))
        worst = max(abs(logged[s] - ref.histories[key][s]) for s in logged)
        assert worst <= 1e-5, f"{key}: {name} differs from the fault-free run by {worst}"
    # Logged before a restart's mark but past its checkpoint: trained twice, logged by the attempt before.
    redone = sorted(p.step for point in resumed for p in points
                    if p.step > point.value and p.timestamp <= point.timestamp)
    return Resumed([int(p.value) for p in resumed], redone)


def spread(alive: list[str]) -> list[str]:
    """Where SPREAD places the job's 2 workers on the worker hosts `alive` (sorted addresses)."""
    return sorted(alive) if len(alive) >= 2 else alive * 2


def newest_used(c: Cluster, name: str, at_faults: list[dict[int, dict]]) -> int:
    """The newest checkpoint a fault so far saw on S3 or an attempt resumed from. The console lags the
    workers: a checkpoint can land between the progress line a fault waits for and the fault, and the
    attempt after it resumes from that one. The next fault waits for a newer checkpoint still, so that
    every attempt resumes from a step of its own (a second `train/resumed_from_step` at the same step
    would be the same MLflow point)."""
    resumed = [int(s) for s in re.findall(r"\[xmodal\] resumed from checkpoint at step (\d+)", c.logs.text(name))]
    return max([0, *resumed, *(max(a) for a in at_faults)])


def lose_hosts(c: Cluster, name: str, ref: Reference, faults: list[tuple[str, Callable[[str], None]]]) -> None:
    """Run the job; each time a checkpoint newer than the last fault's is on S3 and two progress lines
    after it are shown, apply the next fault of `faults` ((what, fault) pairs) to a worker host that
    runs one of its Train workers. Each host's node must be declared dead and the workers start again
    on the worker hosts left, as SPREAD as those allow. Then, once the run has written a newer
    checkpoint, its driver is killed (SIGKILL) and the same command run again, which must resume from
    the newest checkpoint on S3 into the same MLflow run. The run finishes equal to the fault-free one.
    (All faults in one run: each job start costs a minute and a half of the suite's two cores.)"""
    alive = [a for a in c.alive() if a != HEAD]
    assert len(alive) >= len(faults) + 1, f"{len(faults)} faults need {len(faults) + 1} worker hosts; alive: {alive}"
    began = time.monotonic()
    driver = c.start(name, name)
    at_faults: list[dict[int, dict]] = []
    since = began
    for what, fault in faults:
        at_faults.append(c.past_a_checkpoint(driver, name, name, newer_than=newest_used(c, name, at_faults)))
        on = sorted(nodes[0] for _, kind, nodes in c.monitor(since) if kind == "worker")
        assert len(on) == 2 and len(set(on)) == 2 and set(on) <= set(alive), (what, on, alive)  # SPREAD
        victim = HOST_AT[max(on)]
        faulted = time.monotonic()
        fault(victim)
        c.lost.add(victim)
        alive.remove(WORKERS[victim])
        deadline = faulted + 300
        while driver.poll() is None and c.logs.text(name).count("[xmodal] resumed from checkpoint") < len(at_faults):
            assert time.monotonic() < deadline, f"not resumed 300 s after {what}:\n" + c.tail(name)
            time.sleep(0.2)
        resumed_after = time.monotonic() - faulted
        declared = [t for t, kind, nodes in c.monitor(faulted) if kind == "nodes" and WORKERS[victim] not in nodes]
        assert declared, f"{victim} still alive after {what}:\n{c.tail('monitor')}"
        again = sorted(nodes[0] for _, kind, nodes in c.monitor(faulted) if kind == "worker")
        assert again == spread(alive), (what, on, again, alive)
        print(f"{what} ({victim}): declared dead {declared[0] - faulted:.1f} s after the fault, resumed "
              f"{resumed_after:.1f} s after it, on {again}")
        since = faulted
    at_faults.append(c.past_a_checkpoint(driver, name, name, newer_than=newest_used(c, name, at_faults)))
    killed = time.monotonic()
    os.kill(child_of(driver.pid), signal.SIGKILL)  # the driver itself (nsenter's child), at once
    driver.wait(timeout=60)
    out = c.finish(c.start(name, f"{name}-again"), f"{name}-again")
    wall = time.monotonic() - began
    assert f"[xmodal] resuming run '{name}'" in out, out[-4000:]
    result = check_resumed(c, name, at_faults, ref)
    starts = sorted(nodes[0] for _, kind, nodes in c.monitor(killed) if kind == "worker")
    assert starts == spread(alive), (starts, alive)
    print(f"then the driver killed: the rerun resumed from step {result.resumed_from[-1]} on {starts}")
    print(f"{name}: wall {wall:.1f} s in all; resumed from steps {result.resumed_from}; steps trained twice "
          f"{result.redone}; metrics lost: none")


def test_a_cut_link_then_a_killed_driver_and_the_run_finishes_on_the_host_left(cluster, reference):
    def cut(host: str) -> None:  # the machine's end of the host's link to the bridge: its processes live on
        subprocess.run(["ip", "link", "set", cluster.hosts.hosts[host].veth, "down"], check=True)

    lose_hosts(cluster, "xhost", reference, [("a cut link", cut)])


def test_strict_placement_on_the_host_left_fails_within_its_tries(cluster):
    from xmodal import tracking

    c = cluster
    for host in sorted(set(WORKERS) - c.lost)[1:]:  # run alone: one worker host must be left
        os.kill(c.hosts.hosts[host].holder, signal.SIGKILL)
        c.lost.add(host)
    c.wait_nodes([HEAD, *(a for h, a in WORKERS.items() if h not in c.lost)])
    # STRICT_SPREAD cannot place 2 workers on the one worker host left: each try to start the worker
    # group times out (RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S), and after scale.max_failures retries (none
    # here: each retry only waits out the same timeout again) the job fails with Ray Train's error, instead
    # of trying every minute without end (Ray's default, which a limit not passed on would leave).
    began = time.monotonic()
    strict = c.start("xhost-strict", "strict", placement="STRICT_SPREAD", max_failures=0)
    try:
        rc = strict.wait(timeout=240)
    except subprocess.TimeoutExpired:
        pytest.fail("the STRICT_SPREAD job did not end within 240 s:\n" + c.tail("strict"))
    said = c.logs.text("strict")
    assert rc != 0, said[-4000:]
    assert f"The worker group startup timed out after {START_TIMEOUT_S}" in said, said[-4000:]
    exp = tracking.get_experiment_id(c.uri, "xmodal-pretrain")
    (strict_run,) = tracking.search_runs(c.uri, [exp], f"tags.`{tracking.RUN_NAME_TAG}` = 'xhost-strict'")
    assert strict_run.status == "FAILED"
    print(f"strict placement: failed after its tries in {time.monotonic() - began:.1f} s")
