"""A pretraining run across three rehearsal hosts (xmodal/rehearsal.py) that loses one of them midway.

    head     10.231.0.1  the Ray head (no CPUs: drivers only), the S3 server (moto), the job's driver
    worker1  10.231.0.2  a Ray worker node, 2 CPUs
    worker2  10.231.0.3  a Ray worker node, 2 CPUs

The job (`jobs/pretrain.py`, tiny preset) runs 2 Train workers of 0.5 CPU each, placed SPREAD (one per
worker host), checkpoints to `s3://` on the moto server, logs to an MLflow SQLite file. After its first
checkpoint is on S3, every process of worker2 is killed (its host's PID namespace dies: raylet, Train
worker, Ray Data tasks at once, as when a machine loses power). Ray Train sees the worker group fail,
and, SPREAD being a soft placement, starts both workers again on worker1 (2 x 0.5 CPUs, one CPU left for
Ray Data's read tasks) from the newest checkpoint on S3. The run finishes there.

What is shared between hosts: each host has its own /tmp, /run, /dev/shm and /root, so the store, the
MLflow database and the driver's working folder live in a folder under /var/tmp, which the rehearsal
leaves as the machine's (every host sees the same files). Checkpoints go over the network to S3.

Root only (network namespaces); skipped otherwise, with the reason.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import textwrap
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


def checkpoints_on_s3(client) -> list[str]:
    """The run's checkpoint folders on S3 with their meta file written."""
    out = client.list_objects_v2(Bucket=BUCKET, Prefix=f"runs/{RUN}/")
    return sorted({o["Key"].split("/")[2] for o in out.get("Contents", [])
                   if o["Key"].endswith("/meta.json") and o["Key"].split("/")[2].startswith("checkpoint_")})


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
           "OMP_NUM_THREADS": "1", "MLFLOW_TRACKING_URI": uri}
    common = ["--object-store-memory=100000000", "--disable-usage-stats"]
    hosts = Hosts(3, PREFIX)
    logs = {}
    times = {}

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
        times["cluster up"] = time.monotonic() - began

        cmd = [PYTHON, str(REPO / "jobs" / "pretrain.py"), "--store", str(store),
               "--storage-path", f"s3://{BUCKET}/runs", "--run-name", RUN,
               "--set", "preset=tiny", "--set", "train.epochs=4", "--set", "train.batch_size=16",
               "--set", f"train.max_steps={STEPS}", "--set", f"train.eval_every={EVAL_EVERY}",
               "--set", "train.log_every=1", "--set", "train.keep_best=10", "--set", "data.eval_batches=2",
               "--set", "scale.num_workers=2", "--set", "scale.placement_strategy=SPREAD",
               "--set", "scale.cpus_per_worker=0.5", "--set", "scale.max_failures=2",
               "--set", "mlflow.system_metrics=false", "--set", f"mlflow.tracking_uri={uri}"]
        job_began = time.monotonic()
        driver = hosts.popen("head", cmd, env={**env, "RAY_ADDRESS": f"{HEAD}:6379"}, cwd=str(shared),
                             **log("driver"))
        client = s3()
        deadline = time.monotonic() + 240
        while not checkpoints_on_s3(client):
            assert driver.poll() is None, tail("driver")
            assert time.monotonic() < deadline, "no checkpoint on S3 after 240 s:\n" + tail("driver")
            time.sleep(0.2)
        times["job to first checkpoint"] = time.monotonic() - job_began
        before = checkpoints_on_s3(client)
        # worker2 loses power: its host's PID 1 dies, and every process in it with it.
        os.kill(hosts.hosts["worker2"].holder, signal.SIGKILL)
        killed_at = time.monotonic()
        try:
            rc = driver.wait(timeout=300)
        except subprocess.TimeoutExpired:
            pytest.fail("the job did not end within 300 s of losing worker2:\n" + tail("driver"))
        times["after the loss to the job's end"] = time.monotonic() - killed_at
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
        assert resumed_from >= EVAL_EVERY and resumed_from % EVAL_EVERY == 0, (resumed_from, before)
        history = tracking.metric_history(uri, run.run_id, "train/loss")
        steps = [s for s, _ in history]
        assert sorted(steps) == list(range(1, STEPS + 1)), steps  # every step once, none lost, none twice
        assert all(math.isfinite(v) for _, v in history)
        print("phases: " + ", ".join(f"{k} {v:.1f} s" for k, v in times.items())
              + f"; resumed from step {resumed_from}")
    finally:
        hosts.teardown()
        for f in logs.values():
            f.close()
        print(f"logs in {shared}")
