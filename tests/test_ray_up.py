"""`ray up` of cluster.onprem.yaml on three rehearsal hosts (platform/xmodal_rehearsal/) with SSH servers, a
pretraining job and a sweep on the cluster it starts, its teardown, and the runs kept after it.

    head     10.231.0.1  `ray up` logs in here: the Ray head (no CPUs), PostgreSQL, the MLflow server, job drivers
    worker1  10.231.0.2  a worker machine: the head's autoscaler logs in, syncs, sets up, starts Ray
    worker2  10.231.0.3  likewise

The config is cluster.onprem.yaml with what a user edits filled in: head_ip and worker_ips, the SSH
login (root, with the rehearsal's key), and the locations: folders under /var/tmp, which every host
sees as the machine's (the shared filesystem), and no stores to copy. Besides: --venv, because the
hosts reach no network and setup cannot install anything (this test's environment, which every host
sees, stands in for a prepared machine's), the head's PostgreSQL data folder in the shared folder
(--postgres-data; root's default, /var/lib/xmodal/postgres, would outlive the test), the token's
source (a token made here, not this machine's ~/.ray/auth_token) and a cluster name of its own. Every
command is the file's own.

`ray up` runs on this machine, as from a laptop (it reaches the head over the bridge), with the
launcher's local state (its state file and config cache) in a folder of its own (TMPDIR); its SSH
control sockets are in /tmp/ray_ssh_*/ under a hash of the cluster name, removed at the end. Then, as
a user would, through `ray exec` on the head: the nodes, `ray job submit` of a tiny pretraining job
with one Train worker per worker host, where its workers ran; the MLflow run, read from this machine
at the head's MLflow server, and in the head's PostgreSQL (read there with psql). A sweep of two
one-worker trials, each asking for most of a worker machine's memory, runs one trial per worker host.
Then the documented teardown (stop_cluster.sh, then `ray down`) and no Ray, MLflow or PostgreSQL
process is left on any host. The database outlives it: the head's start commands for PostgreSQL and
MLflow, run again over SSH (a second `ray up` would cost minutes more), serve the runs and their
artifacts as before; stop_cluster.sh stops them again. Traffic goes to loopback and 10.231.0.0/24 only.

Slow: on a 2-core machine, 12 minutes while other test suites ran alongside (load 12 to 29: `ray up`
277 s, the workers 8 s more, the job 102 s, the sweep 236 s, the teardown 52 s, the head's services
again and their stop 33 s); before the sweep and the database checks it took 6.5 minutes under
lighter load (`ray up` 140 s, the job 150 s, the teardown 70 s). On an idle machine, with the trials'
workers in the trials' own processes: 5.6 minutes (`ray up` 96 s, the workers 15 s more, the job 88 s,
the sweep 47 s, the teardown 50 s, the services again 35 s). Root only, with sshd (openssh-server), rsync, PostgreSQL and
network namespaces; skipped otherwise, with the reason.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from getpass import getuser
from pathlib import Path

import pytest
import yaml

import xmodal_rehearsal as rehearsal
from xmodal_rehearsal import Hosts
from xmodal_testing import PYTHON, REPO

REASON = rehearsal.unavailable_reason(sshd=True)
if REASON is None and shutil.which("rsync") is None:
    REASON = "the cluster launcher syncs files with rsync, which is not installed (scripts/setup.sh installs it as root)"
PSQL = next(iter(sorted(glob.glob("/usr/lib/postgresql/*/bin/psql"), reverse=True)), shutil.which("psql"))
if REASON is None and (PSQL is None or not any(map(shutil.which, ["initdb", *glob.glob("/usr/lib/postgresql/*/bin/initdb")]))):
    REASON = ("the head's MLflow database is PostgreSQL, which is not installed (scripts/setup.sh installs the "
              "package postgresql as root)")
PREFIX = "xmu"  # not the command line's (xm) nor another test's (xmt, xmx)
ONPREM_YAML = REPO / "cluster.onprem.yaml"
RAY = str(Path(PYTHON).parent / "ray")
VENV = Path(sys.prefix)  # the environment every host's nodes run in (node_env.sh --venv)
HEAD, WORKER1, WORKER2 = "10.231.0.1", "10.231.0.2", "10.231.0.3"
STEPS = 10
PG_PORT = 5433  # node_env.sh's default
# Ray's processes (raylet, gcs_server, ray::IDLE, python .../site-packages/ray/..., python -m ray.util...,
# ray_client_server) and MLflow's server with its gunicorn. Not the launcher's SSH connections (their
# control sockets are /tmp/ray_ssh_*), and not zombies (state Z), which hold nothing.
RAY_OR_MLFLOW = re.compile(r"\bray\b|raylet|gcs_server|ray_client_server|mlflow|gunicorn|postgres")

NODES = """
import json, sys, time
import ray
ray.init(address="auto", log_to_driver=False)
want, deadline = int(sys.argv[1]), time.monotonic() + float(sys.argv[2])
while True:
    alive = sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])
    if len(alive) >= want or time.monotonic() > deadline:
        break
    time.sleep(1)
print("NODES " + json.dumps(alive))
# The memory Ray gives each worker machine (all of them see this machine's): a trial that asks for most
# of it has a machine to itself.
print("MEMORY " + json.dumps(min(n["Resources"].get("memory", 0) for n in ray.nodes()
                                 if n["Alive"] and n["Resources"].get("CPU"))))
"""

# Where each job's Train workers ran: {job id: [machine address, ...]}.
TRAIN_WORKERS = """
import json
import ray
from ray._private import state
ray.init(address="auto", log_to_driver=False)
jobs = {}
for a in state.actors().values():
    # Ray Train's workers, and Tune's trial actors (a one-worker trial's worker runs in its trial)
    if a["ActorClassName"] in ("RayTrainWorker", "ImplicitFunc"):
        jobs.setdefault(a["JobID"], []).append(a["Address"]["IPAddress"])
print("WORKERS " + json.dumps({job: sorted(ips) for job, ips in jobs.items()}))
"""

# Two trials of one worker each (run in the trials' own processes); every trial asks (with --set) for most
# of a worker machine's memory, so that the two run at once on the two machines.
SWEEP_SPACE = """\
job: pretrain
base:
  config:
    preset: tiny
    data: {store: ~/stores/synthetic_lxmert, eval_batches: 2}
    train: {epochs: 1, batch_size: 16, max_steps: 4, eval_every: 2, log_every: 2}
    scale: {num_workers: 1}
    mlflow: {system_metrics: false}
metric: eval/loss/mlm
mode: min
num_samples: 2
max_concurrent: 2
seed: 0
scheduler: {type: fifo}
parameters:
  optim.lr: {type: choice, values: [1.0e-2, 1.0e-3]}
try_first:
  - {optim.lr: 1.0e-2}
  - {optim.lr: 1.0e-3}
"""


def with_args(command: str, values: dict[str, str]) -> str:
    """`bash ~/xmodal/scripts/...sh --name=value ...` with these options' values replaced or added (the
    script's path left unquoted, for the remote shell to expand ~)."""
    program, script, *args = shlex.split(command)
    kept = [a for a in args if a.split("=", 1)[0] not in values]
    return " ".join([program, script, *map(shlex.quote, kept + [f"{k}={v}" for k, v in values.items()])])


def rehearsal_config(shared: Path, token: Path, key: Path, name: str) -> dict:
    cfg = yaml.safe_load(ONPREM_YAML.read_text())
    cfg["cluster_name"] = name
    cfg["provider"].update(head_ip=HEAD, worker_ips=[WORKER1, WORKER2])
    cfg["auth"] = {"ssh_user": "root", "ssh_private_key": str(key)}
    cfg["file_mounts"] = {"~/xmodal": str(REPO), "~/.ray/auth_token": str(token)}
    (i,) = [i for i, c in enumerate(cfg["setup_commands"]) if "node_env.sh" in c]
    cfg["setup_commands"][i] = with_args(cfg["setup_commands"][i], {
        "--storage-path": str(shared / "runs"), "--mlflow-artifacts": str(shared / "mlflow"), "--stores": "",
        "--postgres-data": str(shared / "postgres"), "--venv": str(VENV)})
    return cfg


def text(out: str | bytes | None) -> str:
    """A command's output as plain text: the launcher runs remote commands on a terminal (ssh -tt), so
    Ray's messages may come colored."""
    out = out.decode(errors="replace") if isinstance(out, bytes) else out or ""
    return re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", out)


def keep_logs(hosts: Hosts, into: Path) -> None:
    """Each host's Ray logs (the head's autoscaler: monitor.*) and MLflow log, copied into the shared
    folder before the hosts go."""
    for name in hosts.names:
        folder = into / "logs" / name
        try:
            hosts.run(name, ["sh", "-c", f"mkdir -p {folder} && cp -rL /tmp/ray/session_latest/logs {folder}/ray; "
                                         f"cp /root/mlflow/server.log {folder}/ 2>/dev/null; true"], timeout=60)
        except rehearsal.RehearsalError as e:  # a host already gone: its logs with it
            print(f"no logs from {name}: {e}")
    for log in Path(f"/run/{PREFIX}-rehearsal").glob("*.log"):
        shutil.copy(log, into / "logs")


def cfg_head_services(config: Path) -> list[str]:
    """The head's start commands other than Ray's: its PostgreSQL, then its MLflow server."""
    commands = [c for c in yaml.safe_load(config.read_text())["head_start_ray_commands"] if "start_ray.sh" not in c]
    assert [c.split("/")[-1] for c in commands] == ["start_postgres.sh", "start_mlflow.sh"], commands
    return commands


def ray_processes(hosts: Hosts, name: str) -> list[str]:
    ps = hosts.run(name, ["ps", "-eo", "pid=,stat=,comm=,args="]).stdout.splitlines()
    return [line for line in ps
            if RAY_OR_MLFLOW.search(line) and line.split()[1][0] != "Z" and line.split()[2] not in ("ssh", "sshd")]


@pytest.mark.slow
@pytest.mark.launcher  # not in .ci/run (CI time): `.venv/bin/python -m pytest -m launcher` as root
@pytest.mark.skipif(REASON is not None, reason=f"ray up rehearsal unavailable: {REASON}")
def test_ray_up_runs_a_job_on_every_worker_and_ray_down_leaves_nothing():
    from xmodal import tracking

    rehearsal.teardown_leftovers(PREFIX)
    shared = Path(tempfile.mkdtemp(prefix="xmodal-rayup-", dir="/var/tmp"))
    os.chmod(shared, 0o755)
    launcher_tmp = shared / "launcher"  # the launcher's state file and config cache, on this machine
    launcher_tmp.mkdir()
    token = shared / "auth_token"
    token.write_text(secrets.token_hex(32))
    token.chmod(0o600)
    name = f"xmodal-rayup-{secrets.token_hex(3)}"
    control = Path("/tmp") / f"ray_ssh_{hashlib.sha256(getuser().encode()).hexdigest()[:10]}" / \
        hashlib.sha256(name.encode()).hexdigest()[:10]
    config = shared / "cluster.yaml"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "MLFLOW_", "XMODAL_"))}
    env.update(RAY_UP_enable_autoscaler_v2="0", TMPDIR=str(launcher_tmp), RAY_USAGE_STATS_ENABLED="0",
               PATH=f"{VENV / 'bin'}:{env['PATH']}")
    hosts = Hosts(3, PREFIX, sshd=True)
    times: dict[str, float] = {}
    passed = False

    def launcher(*argv: str, timeout: float, what: str) -> str:
        began = time.monotonic()
        try:
            out = subprocess.run([RAY, *argv], cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as e:
            said = text(e.stdout) + text(e.stderr)
            with open(shared / "launcher.log", "a") as log:
                log.write(f"$ ray {' '.join(argv)}\n{said}\n(still running after {timeout:.0f} s)\n")
            pytest.fail(f"`ray {' '.join(argv)}` still running after {timeout:.0f} s:\n{said[-8000:]}")
        times[what] = times.get(what, 0.0) + time.monotonic() - began
        said = text(out.stdout) + text(out.stderr)
        with open(shared / "launcher.log", "a") as log:
            log.write(f"$ ray {' '.join(argv)}\n{said}\n")
        assert out.returncode == 0, f"`ray {' '.join(argv)}` exited {out.returncode}:\n{said[-8000:]}"
        return said

    def on_head(command: str, *, timeout: float, what: str) -> str:
        return launcher("exec", str(config), command, timeout=timeout, what=what)

    began = time.monotonic()
    try:
        hosts.create()
        times["hosts with sshd"] = time.monotonic() - began
        config.write_text(yaml.safe_dump(rehearsal_config(shared, token, hosts.ssh_key, name), sort_keys=False))
        (shared / "nodes.py").write_text(NODES)
        (shared / "train_workers.py").write_text(TRAIN_WORKERS)

        launcher("up", "-y", "--no-config-cache", str(config), timeout=600, what="ray up")
        said = on_head(f"python {shared}/nodes.py 3 300", timeout=400, what="workers joined")
        (nodes,) = re.findall(r"^NODES (.*)$", said, re.MULTILINE)
        assert json.loads(nodes) == [HEAD, WORKER1, WORKER2], said[-4000:]
        (memory,) = re.findall(r"^MEMORY (.*)$", said, re.MULTILINE)
        times["cluster up"] = time.monotonic() - began

        job = ("cd ~/xmodal && ray job submit --address=http://127.0.0.1:8265 --working-dir . -- "
               "python jobs/pretrain.py --store '~/stores/synthetic_lxmert' --run-name rayup --num-workers 2 "
               "--set scale.placement_strategy=STRICT_SPREAD --set preset=tiny --set train.batch_size=16 "
               f"--set train.max_steps={STEPS} --set train.eval_every=5 --set train.log_every=5 "
               "--set data.eval_batches=2 --set mlflow.system_metrics=false")
        said = on_head(job, timeout=600, what="job")
        assert re.search(r"Job 'raysubmit_\w+' succeeded", said), said[-8000:]
        said = on_head(f"python {shared}/train_workers.py", timeout=120, what="job")
        (workers,) = re.findall(r"^WORKERS (.*)$", said, re.MULTILINE)
        ((pretrain_job, ips),) = json.loads(workers).items()
        assert ips == [WORKER1, WORKER2], said[-4000:]  # one Train worker per worker host
        # Checkpoints in the shared folder the nodes' environment names; the run in the head's MLflow.
        assert list((shared / "runs" / "rayup").glob("checkpoint_*"))
        uri = f"http://{HEAD}:5000"
        exp = tracking.get_experiment_id(uri, "xmodal-pretrain")
        (run,) = tracking.search_runs(uri, [exp], f"tags.`{tracking.RUN_NAME_TAG}` = 'rayup'")
        assert run.status == "FINISHED"
        assert "train/loss" in run.metrics and "eval/loss/mlm" in run.metrics, run.metrics
        assert "model/model.pt" in tracking.list_artifacts(uri, run.run_id, "model")
        # ... and the server keeps it in the head's PostgreSQL, in the data folder node_env.sh named (read
        # there as the database's superuser), not in a SQLite file.
        def in_postgres(sql: str) -> list[str]:
            out = hosts.run("head", ["runuser", "-u", "postgres", "--", PSQL, "-h", str(shared / "postgres"),
                                     "-p", str(PG_PORT), "-d", "mlflow", "-Atc", sql], cwd="/", timeout=60)
            return out.stdout.split()

        assert in_postgres(f"SELECT status FROM runs WHERE run_uuid = '{run.run_id}'") == ["FINISHED"]
        assert not [f for f in hosts.run("head", ["ls", "/root/mlflow"]).stdout.split() if f.endswith(".db")]

        # A sweep of two one-worker trials, one on each worker machine.
        (shared / "sweep.yaml").write_text(SWEEP_SPACE)
        said = on_head(f"cd ~/xmodal && ray job submit --address=http://127.0.0.1:8265 --working-dir . -- "
                       f"python jobs/sweep.py {shared}/sweep.yaml --name rayup-sweep --no-report "
                       f"--set scale.resources_per_worker.memory={int(0.6 * float(memory))}",
                       timeout=600, what="sweep")
        assert re.search(r"Job 'raysubmit_\w+' succeeded", said), said[-8000:]
        said = on_head(f"python {shared}/train_workers.py", timeout=120, what="sweep")
        (workers,) = re.findall(r"^WORKERS (.*)$", said, re.MULTILINE)
        ((_, trials),) = [(j, ips) for j, ips in json.loads(workers).items() if j != pretrain_job]
        assert trials == [WORKER1, WORKER2], said[-4000:]  # one trial (of one worker) per worker host
        sweep_exp = tracking.get_experiment_id(uri, "xmodal-sweep-sweep")
        parent = tracking.find_run(uri, sweep_exp, "rayup-sweep")
        children = tracking.child_runs(uri, parent.run_id)
        assert parent.status == "FINISHED" and sorted(c.status for c in children) == ["FINISHED"] * 2

        def nothing_left() -> None:
            # `ray stop` waits for what it signalled; a worker process of a raylet may take a moment more.
            down = time.monotonic()
            while True:
                left = {host: ray_processes(hosts, host) for host in hosts.names}
                if not any(left.values()) or time.monotonic() > down + 30:
                    break
                time.sleep(1)
            assert left == {host: [] for host in hosts.names}, left
            times["last process gone after ray down"] = time.monotonic() - down

        # The teardown docs/cluster.md gives: Ray off on the head, then on every worker (and the head's
        # MLflow server and PostgreSQL); then `ray down`.
        said = on_head("bash ~/xmodal/scripts/cluster/stop_cluster.sh", timeout=300, what="teardown")
        assert f"{WORKER1}: no Ray process left" in said and f"{WORKER2}: no Ray process left" in said, said[-4000:]
        launcher("down", "-y", str(config), timeout=300, what="teardown")
        nothing_left()
        # The database outlives the cluster: the head's start commands for PostgreSQL and MLflow (the
        # config's own, run over SSH as the launcher would; a second `ray up` costs minutes more) find
        # the runs and their artifacts where they were.
        again = time.monotonic()

        def over_ssh(command: str) -> str:
            out = subprocess.run([*hosts.ssh_argv("head"), command], capture_output=True, text=True, timeout=400)
            assert out.returncode == 0, f"{command}: {out.stdout}{out.stderr}"
            return out.stdout

        for command in cfg_head_services(config):
            over_ssh(command)
        assert tracking.get_run(uri, run.run_id).metrics == run.metrics
        assert "model/model.pt" in tracking.list_artifacts(uri, run.run_id, "model")
        assert len(tracking.child_runs(uri, parent.run_id)) == 2
        over_ssh("bash ~/xmodal/scripts/cluster/stop_cluster.sh")
        nothing_left()
        times["services again"] = time.monotonic() - again
        times["all"] = time.monotonic() - began
        print("phases: " + ", ".join(f"{k} {v:.1f} s" for k, v in times.items()))
        passed = True
    finally:
        if not passed and hosts.hosts:
            keep_logs(hosts, shared)
        hosts.teardown()
        # The launcher's SSH connections ended with the hosts; their control sockets stay behind.
        shutil.rmtree(control, ignore_errors=True)
        if control.parent.exists() and not any(control.parent.iterdir()):
            control.parent.rmdir()
        if passed:
            shutil.rmtree(shared)
        else:
            print(f"the launcher's log, the config, the hosts' logs and the shared folder: {shared}")
    assert rehearsal.leftovers(PREFIX) == []
