"""A pretraining run across three rehearsal hosts (xmodal/rehearsal.py) that loses one of them midway.

    head     10.231.0.1  the Ray head (no CPUs: drivers only), the S3 server (moto), the job's driver
    worker1  10.231.0.2  a Ray worker node, 2 CPUs
    worker2  10.231.0.3  a Ray worker node, 2 CPUs

Once the nodes have joined, every host name resolves to 127.0.0.1 (the hosts file rewritten): gloo must
take its interface from the node IP (xmodal.train.gloo), not from its host name, or the workers on the
two hosts each dial their own loopback.

The job (`jobs/pretrain.py`, tiny preset) runs 2 Train workers of 0.5 CPU each, placed SPREAD (one per
worker host), checkpoints to `s3://` on the moto server, logs to an MLflow SQLite file. Once two steps
after a checkpoint have been shown, every process of worker2 is killed (its host's PID namespace dies: raylet, Train
worker, Ray Data tasks at once, as when a machine loses power). Ray Train sees the worker group fail,
and, SPREAD being a soft placement, starts both workers again on worker1 (2 x 0.5 CPUs, one CPU left for
Ray Data's read tasks) from the newest checkpoint on S3. The run finishes there, every step logged
once, the steps trained twice with the same losses. Then a STRICT_SPREAD run, which one worker host
cannot hold, fails after its bounded tries (engine: controller_failure_limit) instead of retrying forever.

What is shared between hosts: each host has its own /tmp, /run, /dev/shm and /root, so the store, the
MLflow database and the driver's working folder live in a folder under /var/tmp, which the rehearsal
leaves as the machine's (every host sees the same files). Checkpoints go over the network to S3.

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
from pathlib import Path

import pytest

from xmodal import rehearsal
from xmodal.rehearsal import Hosts
from xmodal_testing import PYTHON, REPO

REASON = rehearsal.unavailable_reason()
PREFIX = "xmx"  # not the command line's (xm) nor test_rehearsal's (xmt)
BIN = Path(PYTHON).parent
RAY = str(BIN / "ray")
HEAD, WORKER1, WORKER2 = "10.231.0.1", "10.231.0.2", "10.231.0.3"
S3_PORT = 5000
ENDPOINT = f"http://{HEAD}:{S3_PORT}"
BUCKET = "xmodal"
RUN = "xhost"
STEPS = 40
EVAL_EVERY = 10
# The GCS notices a dead node after about period x threshold (3 s) instead of the defaults' 30 s or more.
START_TIMEOUT_S = 10.0  # Ray Train's wait for a worker group's placement (default 60 s)
HEALTH = {"health_check_initial_delay_ms": 1000, "health_check_period_ms": 1000,
          "health_check_timeout_ms": 1000, "health_check_failure_threshold": 3}

WAIT_FOR_NODES = """
import sys, time
import ray
ray.init(address="auto", log_to_driver=False)
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    alive = sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])
    if len(alive) == 3:
        break
    time.sleep(0.2)
print(" ".join(alive))
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


def checkpoint_steps_on_s3(client) -> list[int]:
    """The steps of the run's checkpoints on S3 (their meta files)."""
    out = client.list_objects_v2(Bucket=BUCKET, Prefix=f"runs/{RUN}/")
    metas = [o["Key"] for o in out.get("Contents", [])
             if o["Key"].endswith("/meta.json") and o["Key"].split("/")[2].startswith("checkpoint_")]
    return sorted(json.loads(client.get_object(Bucket=BUCKET, Key=k)["Body"].read())["step"] for k in metas)


def printed_losses(log: str) -> dict[int, float]:
    """The console's progress lines: {step: train loss, 4 decimals}."""
    return {int(m.group(1)): float(m.group(2))
            for m in re.finditer(r"^\[xmodal\] step (\d+)/\d+ .* loss ([0-9.]+) ", log, re.MULTILINE)}


TRAIN_WORKERS = """
import json
import ray
from ray._private import state
ray.init(address="auto", log_to_driver=False)
actors = [a for a in state.actors().values() if a["ActorClassName"] == "RayTrainWorker"]
print(json.dumps(sorted((a["StartTime"], a["Address"]["IPAddress"]) for a in actors)))
"""


@pytest.mark.slow
@pytest.mark.skipif(REASON is not None, reason=f"host rehearsal unavailable: {REASON}")
def test_a_run_loses_a_worker_host_and_finishes_on_the_other(mlflow_template):
    pytest.importorskip("moto")
    from xmodal import tracking

    rehearsal.teardown_leftovers(PREFIX)
    shared = Path(tempfile.mkdtemp(prefix="xmodal-xhost-", dir="/var/tmp"))
    os.chmod(shared, 0o755)
    db = shared / "mlflow.db"
    shutil.copyfile(mlflow_template, db)
    uri = f"sqlite:///{db}"
    store = shared / "store"
    subprocess.run([PYTHON, str(REPO / "jobs" / "ingest.py"), "synthetic", str(store), "--num-images", "160",
                    "--feat-dim", "16", "--num-objects", "8", "--num-object-labels", "10", "--num-attr-labels", "4",
                    "--num-answers", "20"], check=True, cwd=REPO, capture_output=True)
    env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO / "platform"), "RAY_DEDUP_LOGS": "0",
           "AWS_ENDPOINT_URL": ENDPOINT, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
           "OMP_NUM_THREADS": "1", "MLFLOW_TRACKING_URI": uri,
           # read by Ray Train's controller, which runs on the head (the driver's node)
           "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S": str(START_TIMEOUT_S)}
    common = ["--object-store-memory=100000000", "--disable-usage-stats"]
    hosts = Hosts(3, PREFIX)
    logs = {}
    times = {}
    passed = False

    def log(name: str):
        logs[name] = open(shared / f"{name}.log", "w")  # noqa: SIM115 - closed in finally
        return {"stdout": logs[name], "stderr": subprocess.STDOUT}

    def tail(name: str, n: int = 4000) -> str:
        return (shared / f"{name}.log").read_text()[-n:]

    began = time.monotonic()
    try:
        hosts.create()
        hosts.popen("head", [str(BIN / "moto_server"), "-H", HEAD, "-p", str(S3_PORT)], env=env, **log("s3"))
        hosts.run("head", [RAY, "start", "--head", f"--node-ip-address={HEAD}", "--port=6379",
                           "--include-dashboard=false", "--num-cpus=0", f"--system-config={json.dumps(HEALTH)}",
                           *common], env=env, timeout=120)
        for host, address in (("worker1", WORKER1), ("worker2", WORKER2)):
            hosts.popen(host, [RAY, "start", "--block", f"--address={HEAD}:6379", f"--node-ip-address={address}",
                               "--num-cpus=2", *common], env=env, **log(host))
        wait_port(HEAD, S3_PORT, 30)
        s3().create_bucket(Bucket=BUCKET)
        nodes = hosts.run("head", [PYTHON, "-c", WAIT_FOR_NODES], env=env, timeout=90).stdout.split()
        assert nodes == [HEAD, WORKER1, WORKER2], f"{nodes}\n{tail('worker1')}\n{tail('worker2')}"
        # From now on every host name resolves to 127.0.0.1 (as in many a machine's /etc/hosts; Ray's
        # nodes, which joined already, cannot start with that): gloo's own choice of
        # address would then be loopback, and the workers on two hosts would dial themselves.
        # xmodal.train.gloo sets GLOO_SOCKET_IFNAME from the node IP instead. (The file is bind-mounted
        # into every host; rewritten in place, they all see it.)
        hosts_file = Path(f"/run/{PREFIX}-rehearsal/hosts")
        with open(hosts_file, "r+") as f:
            f.truncate(0)
            f.write("127.0.0.1\tlocalhost " + " ".join(hosts.names) + "\n")
        assert hosts.run("worker1", ["getent", "hosts", "worker1"]).stdout.split()[0] == "127.0.0.1"
        times["cluster up"] = time.monotonic() - began

        def job(name: str, *extra: str) -> list[str]:
            return [PYTHON, str(REPO / "jobs" / "pretrain.py"), "--store", str(store),
                    "--storage-path", f"s3://{BUCKET}/runs", "--run-name", name,
                    "--set", "preset=tiny", "--set", "train.epochs=4", "--set", "train.batch_size=16",
                    "--set", f"train.max_steps={STEPS}", "--set", f"train.eval_every={EVAL_EVERY}",
                    "--set", "train.log_every=1", "--set", "train.keep_best=10", "--set", "data.eval_batches=2",
                    "--set", "scale.num_workers=2", "--set", "scale.cpus_per_worker=0.5",
                    "--set", "mlflow.system_metrics=false", "--set", f"mlflow.tracking_uri={uri}", *extra]

        cmd = job(RUN, "--set", "scale.placement_strategy=SPREAD", "--set", "scale.max_failures=2")
        job_began = time.monotonic()
        driver = hosts.popen("head", cmd, env={**env, "RAY_ADDRESS": f"{HEAD}:6379"}, cwd=str(shared),
                             **log("driver"))
        client = s3()
        deadline = time.monotonic() + 240
        while True:  # until two progress lines (every 4 steps) after the newest checkpoint on S3 are shown
            assert driver.poll() is None, tail("driver")
            assert time.monotonic() < deadline, "no checkpoint on S3 after 240 s:\n" + tail("driver")
            on_s3 = checkpoint_steps_on_s3(client)
            shown = printed_losses((shared / "driver.log").read_text())
            if on_s3 and shown and max(shown) >= on_s3[-1] + 7:  # e.g. 13 and 17 after the checkpoint at 10
                break
            time.sleep(0.1)
        times["job to first checkpoint"] = time.monotonic() - job_began
        # worker2 loses power: its host's PID 1 dies, and every process in it with it.
        os.kill(hosts.hosts["worker2"].holder, signal.SIGKILL)
        killed_at = time.monotonic()
        while driver.poll() is None and "[xmodal] resumed from checkpoint" not in (shared / "driver.log").read_text():
            assert time.monotonic() < killed_at + 300, "not resumed 300 s after losing worker2:\n" + tail("driver")
            time.sleep(0.2)
        times["loss to resumed"] = time.monotonic() - killed_at
        try:
            rc = driver.wait(timeout=300)
        except subprocess.TimeoutExpired:
            pytest.fail("the job did not end within 300 s of losing worker2:\n" + tail("driver"))
        times["resumed to the job's end"] = time.monotonic() - killed_at - times["loss to resumed"]
        out = (shared / "driver.log").read_text()
        assert rc == 0, out[-6000:]

        exp = tracking.get_experiment_id(uri, "xmodal-pretrain")
        runs = tracking.search_runs(uri, [exp], f"tags.`{tracking.RUN_NAME_TAG}` = '{RUN}'")
        assert len(runs) == 1, runs
        run = runs[0]
        assert run.status == "FINISHED"
        resumed = tracking.metric_points(uri, run.run_id, "train/resumed_from_step")
        assert len(resumed) == 1, resumed
        resumed_from = int(resumed[0].value)
        assert resumed_from >= on_s3[-1], (resumed_from, on_s3)  # the newest checkpoint on S3 at the loss
        history = tracking.metric_history(uri, run.run_id, "train/loss")
        steps = [s for s, _ in history]
        assert sorted(steps) == list(range(1, STEPS + 1)), steps  # every step once, none lost, none twice
        assert all(math.isfinite(v) for _, v in history)
        # The steps trained twice (after the checkpoint, before the loss: shown by the first attempt,
        # on two hosts) have the same loss in the resumed attempt (both workers on worker1): the
        # resumed run continues the uninterrupted one exactly, to the console's 4 decimals.
        again = {s: v for s, v in shown.items() if s > resumed_from}
        assert len(again) >= 2, (shown, resumed_from)
        logged = dict(history)
        assert {s: round(logged[s], 4) for s in again} == pytest.approx(again, abs=1.5e-4), (again, logged)
        # Where the Train workers ran: one per worker host, then both on worker1.
        placed = json.loads(hosts.run("head", [PYTHON, "-c", TRAIN_WORKERS], env=env, timeout=60).stdout
                            .strip().splitlines()[-1])
        ips = [ip for _, ip in placed]
        assert sorted(ips[:2]) == [WORKER1, WORKER2] and ips[2:] == [WORKER1, WORKER1], placed

        # STRICT_SPREAD cannot place 2 workers on the one worker host left: each try to start the worker
        # group times out (RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S), and after scale.max_failures retries
        # the job fails with Ray Train's error, instead of trying every minute without end (Ray's default).
        strict_began = time.monotonic()
        strict = hosts.run("head", job("xhost-strict", "--set", "scale.placement_strategy=STRICT_SPREAD",
                                       "--set", "scale.max_failures=1"),
                           env={**env, "RAY_ADDRESS": f"{HEAD}:6379"}, cwd=str(shared), check=False, timeout=240)
        times["strict placement's error"] = time.monotonic() - strict_began
        said = strict.stdout + strict.stderr
        assert strict.returncode != 0, said[-4000:]
        assert f"The worker group startup timed out after {START_TIMEOUT_S}" in said, said[-4000:]
        (strict_run,) = tracking.search_runs(uri, [exp], f"tags.`{tracking.RUN_NAME_TAG}` = 'xhost-strict'")
        assert strict_run.status == "FAILED"
        print("phases: " + ", ".join(f"{k} {v:.1f} s" for k, v in times.items())
              + f"; resumed from step {resumed_from}; steps {sorted(again)} trained twice, the same losses")
        passed = True
    finally:
        hosts.teardown()
        for f in logs.values():
            f.close()
        if passed:
            shutil.rmtree(shared)
        else:
            print(f"the hosts' logs, store and MLflow database: {shared}")
    assert rehearsal.leftovers(PREFIX) == []  # every host process (Ray, moto, the driver) went with its host
