"""A cluster of extractors on four rehearsal hosts (platform/xmodal_rehearsal/), its store on S3: the write
tasks on the worker hosts write the shards there, the driver only commits; an extraction whose driver is
interrupted (Ctrl-C) and resumed by the same command, which loses a worker host mid-run.

    head     10.231.0.1    the Ray head (no CPUs: the driver only); the job's driver runs here
    worker1  10.231.0.2    a Ray worker node: 2 CPUs and 1 GPU (logical: torch sees none, the detector
    worker2  10.231.0.3      runs on the CPU); the job runs one detector actor per GPU (--gpus-per-actor 1),
    worker3  10.231.0.4      so one actor per worker host, its decode and write tasks beside it
    (machine) 10.231.0.254 the S3 server (moto) on the bridge address: the images and the stores

The job is `jobs/extract.py s3://.../photos s3://.../STORE --random-weights --tiny --boxes-from BOXES
--input-size 96:160` (the tiny detector, random weights of a fixed seed, the features of 1 to 4 given
boxes an image at a small input) over `N_IMAGES` small JPEGs of varied content, in shards of `SHARD`
images. Each store must equal, row for row and bit for bit, what the detector gives on the same images
in this process with no cluster and no fault (`reference`), every image once, and hold no shard its
manifest does not name; the driver's host holds no shard. The cases:
- a local OUT that the worker hosts do not share (the head's own /tmp): refused before any work by the
  probe tasks, naming a worker host; nothing is left;
- with every host up, the driver gets SIGINT (Ctrl-C) once `INTERRUPT_AFTER` images are on S3: it
  exits 130 saying how many images are kept there, and nothing is published (no manifest); the same
  command again verifies the shards on S3 and extracts the rest, and in that run a worker host dies
  (its PID 1 killed: every process in it at once, as when a machine loses power) once `KILL_AFTER`
  images are on S3; the run goes on with the two hosts left, finishes on its own and publishes.
Ray's task events show each worker host's one actor did a share of the batches of the interrupted run,
and each did a share of the rerun's, the lost host's before it died (the fault landed mid-run). The two
faults share one rerun: a run of its own for each would cost a cluster job's start and its images again,
and prove nothing more.

Why given boxes at a small input: with proposals, even the tiny detector costs about 0.8 s of one core
per image here, at any input size (its RoI head runs res5 over 300 regions an image, and the per-class
selection walks 1,600 classes). With a few given boxes at 96 x 128 an image costs about 8 ms, and what
the rehearsal is for (listing, decoding and writing on S3, placing the actors, batching, Ctrl-C and a
lost host) is the same path; the proposal path's equality with the detector in-process is tested in
tests/extract/test_extract_job.py. The hosts share the machine's two cores, so no speed-up is expected
or measured. Each phase prints its wall time.

Root only (network namespaces); skipped otherwise, with the reason.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import xmodal_rehearsal as rehearsal
from xmodal_rehearsal import BRIDGE_ADDRESS, Hosts
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

cv2 = pytest.importorskip("cv2")

from test_extract_job import sigint_as_in_a_terminal  # noqa: E402

REASON = rehearsal.unavailable_reason()
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread"),
              pytest.mark.skipif(REASON is not None, reason=f"host rehearsal unavailable: {REASON}")]

PREFIX = "xme"  # not the command line's (xm) nor the other host files' (xmt, xmx, xmu)
BIN = Path(PYTHON).parent
RAY = str(BIN / "ray")
HEAD = "10.231.0.1"
WORKERS = {"worker1": "10.231.0.2", "worker2": "10.231.0.3", "worker3": "10.231.0.4"}
VICTIM = "worker3"
BUCKET = "xmodal"
PHOTOS = f"s3://{BUCKET}/photos"
# Enough batches that each of the three actors has done several before each fault (an actor that starts
# late on a loaded host misses the first few: 8 batches before the interrupt were too few for one of them),
# and that each fault lands mid-run; a batch costs the tiny net a few ms, its tasks' scheduling more.
N_IMAGES = 384
BATCH = 8
SHARD = 16  # images a shard (default 256): shards come often enough to time the faults by
INTERRUPT_AFTER = 128  # images on S3 when the driver gets SIGINT: 16 batches of the first run
KILL_AFTER = 288  # images on S3 (the kept ones included) when the worker host dies in the rerun: it started
#                   with ~130-180 kept, so its actors have done ~14 batches of it and ~12 are left
INPUT_SIZE = (96, 160)
MAX_GIVEN = 4  # given boxes an image: 1 to 4
HEALTH = json.loads((REPO / "scripts" / "cluster" / "head_system_config.json").read_text())
COMMON = ["--object-store-memory=100000000", "--disable-usage-stats"]
DETECTOR_TASK = "(DetectorActor)).submit"  # the name of Ray Data's batch tasks on the detector actors ends so

# Run in `head`: for each job, per node address (dead nodes included), the finished tasks (batches) on a
# detector actor, those of them that were a retry (attempt > 0), and the detector actors that ran them,
# from the task events the GCS keeps (no dashboard needed). argv[1]: a part of the tasks' name.
TASKS = """
import collections, json, sys
import ray
from ray._private import state
from ray.core.generated import common_pb2
ray.init(address="auto", log_to_driver=False)
ip = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes()}
finished = common_pb2.TaskStatus.Value("FINISHED")
info, node, done = {}, {}, set()
for e in state.state._get_all_task_events():
    key = (e.task_id, e.attempt_number)
    if e.task_info.name:
        info[key] = (e.job_id.hex(), e.task_info.name, e.task_info.actor_id.hex())
    if e.state_updates.node_id:
        node[key] = e.state_updates.node_id.hex()
    if finished in e.state_updates.state_ts_ns:
        done.add(key)
out = {"batches": {}, "retried": {}, "actors": {}}
for k in sorted(done):
    if k in info and sys.argv[1] in info[k][1]:
        job, where = info[k][0], ip.get(node.get(k), node.get(k))
        for what, add in (("batches", 1), ("retried", int(k[1] > 0))):
            per = out[what].setdefault(job, {})
            per[where] = per.get(where, 0) + add
        out["actors"].setdefault(job, {}).setdefault(where, set()).add(info[k][2])
out["actors"] = {j: {n: len(a) for n, a in per.items()} for j, per in out["actors"].items()}
print(json.dumps(out))
"""


def images(folder: Path, n: int, seed: int = 0) -> list[Path]:
    """`n` 64 x 48 JPEGs of varied content: a random background colour, gradient and noise, a few
    filled rectangles and circles, a line of text."""
    folder.mkdir(parents=True)
    rng = np.random.default_rng(seed)
    out = []
    yy, xx = np.mgrid[0:48, 0:64]
    for i in range(n):
        base = rng.integers(0, 256, 3)
        ramp = (xx * rng.uniform(-2, 2) + yy * rng.uniform(-2, 2))[..., None]
        im = np.clip(base + ramp + rng.normal(0, rng.uniform(2, 30), (48, 64, 3)), 0, 255).astype(np.uint8)
        for _ in range(rng.integers(1, 5)):
            colour = tuple(int(c) for c in rng.integers(0, 256, 3))
            x, y = int(rng.integers(0, 56)), int(rng.integers(0, 40))
            if rng.random() < 0.5:
                cv2.rectangle(im, (x, y), (x + int(rng.integers(4, 30)), y + int(rng.integers(4, 24))), colour, -1)
            else:
                cv2.circle(im, (x, y), int(rng.integers(3, 16)), colour, -1)
        cv2.putText(im, str(i), (2, 44), cv2.FONT_HERSHEY_SIMPLEX, 0.4, (255, 255, 255), 1)
        p = folder / f"img_{i:05d}.jpg"
        cv2.imwrite(str(p), im, [cv2.IMWRITE_JPEG_QUALITY, int(rng.integers(60, 96))])
        out.append(p)
    return out


def bridge_port() -> int:
    """A free port on the bridge address (chosen once the bridge is up: a leftover server of a killed run
    may still hold an earlier one)."""
    with socket.socket() as s:
        s.bind((BRIDGE_ADDRESS, 0))
        return s.getsockname()[1]


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


@dataclass
class Cluster:
    hosts: Hosts
    shared: Path
    env: dict[str, str]
    images: list[Path]
    boxes: Path  # the --boxes-from file
    s3: Any = None  # a boto3 client of the rehearsal's S3
    logs: HostLogs = field(init=False)

    def __post_init__(self) -> None:
        self.logs = HostLogs(self.shared)

    def worker_node(self, host: str, address: str) -> NodeStart:
        """`ray start --block` of a worker node in `host`; a failed start is torn down by its process tree
        and the host's own `ray stop` (its PID namespace: the host's Ray only)."""
        def launch() -> subprocess.Popen:
            return self.hosts.popen(host, [RAY, "start", "--block", f"--address={HEAD}:6379",
                                           f"--node-ip-address={address}", "--num-cpus=2", "--num-gpus=1",
                                           *COMMON], env=self.env, **self.logs.open(host, "a"))

        def teardown(proc: subprocess.Popen) -> None:
            kill_tree(proc.pid)
            self.hosts.run(host, [RAY, "stop", "--force"], env=self.env, check=False, timeout=120)

        return NodeStart(f"the worker node in {host}", launch, self.shared / f"{host}.log", teardown)

    def start(self, out: str, log: str) -> subprocess.Popen:
        """The extraction's driver, in `head`, attached to the cluster: the same command but for OUT."""
        cmd = [PYTHON, str(REPO / "jobs" / "extract.py"), PHOTOS, out, "--random-weights", "--tiny",
               "--no-progress", "--batch-size", str(BATCH), "--images-per-shard", str(SHARD), "--gpus-per-actor", "1",
               "--boxes-from", str(self.boxes), "--input-size", ":".join(map(str, INPUT_SIZE))]
        return self.hosts.popen("head", cmd, env={**self.env, "RAY_ADDRESS": f"{HEAD}:6379"}, cwd=str(self.shared),
                                preexec_fn=sigint_as_in_a_terminal, **self.logs.open(log))

    def keys(self, store: str) -> list[str]:
        """The objects under a store's prefix (S3 folder markers left out), relative to it."""
        prefix = store.removeprefix(f"s3://{BUCKET}/") + "/"
        pages = self.s3.get_paginator("list_objects_v2").paginate(Bucket=BUCKET, Prefix=prefix)
        return sorted(o["Key"][len(prefix):] for page in pages for o in page.get("Contents", [])
                      if not o["Key"].endswith("/"))

    def written(self, store: str) -> int:
        """Images on S3 in the store's shards (all of `SHARD` images but a run's last few)."""
        return SHARD * sum(k.startswith("images/part-") for k in self.keys(store))

    def located(self, store: str) -> str:
        """The store's URI as this process reads it: the rehearsal's S3 endpoint in its query."""
        return f"{store}?endpoint_override={self.env['AWS_ENDPOINT_URL'].removeprefix('http://')}&scheme=http"

    def tasks(self) -> dict[str, dict[str, dict[str, int]]]:
        """`TASKS`' answer: {"batches" | "retried" | "actors": {job id: {node address: count}}}."""
        out = self.hosts.run("head", [PYTHON, "-c", TASKS, DETECTOR_TASK], env=self.env, timeout=120).stdout
        return json.loads(out.strip().splitlines()[-1])

    def wait_written(self, driver: subprocess.Popen, store: str, log: str, at_least: int, timeout: float = 600) -> int:
        deadline = time.monotonic() + timeout
        while (n := self.written(store)) < at_least:
            assert driver.poll() is None, f"the driver ended ({driver.returncode}) with {n} images written:\n" \
                                          + self.logs.text(log)[-5000:]
            assert time.monotonic() < deadline, f"{n} images written after {timeout} s:\n" + self.logs.text(log)[-5000:]
            time.sleep(0.2)
        return n

    def finish(self, driver: subprocess.Popen, log: str, timeout: float = 600) -> str:
        try:
            rc = driver.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the job did not end within {timeout} s:\n" + self.logs.text(log)[-5000:])
        said = self.logs.text(log)
        assert rc == 0, said[-5000:]
        assert "Traceback" not in said, said[-5000:]
        return said


def given_boxes(file: Path, photos: list[Path], seed: int = 0) -> Path:
    """`--boxes-from FILE`: 1 to `MAX_GIVEN` boxes inside each 64 x 48 image, in its pixels."""
    rng = np.random.default_rng(seed)
    boxes = {}
    for p in photos:
        x1, y1 = rng.uniform(0, 40, (2, rng.integers(1, MAX_GIVEN + 1))) * [[1], [0.7]]
        w, h = rng.uniform(4, 24, (2, x1.size))
        boxes[p.stem] = np.stack([x1, y1, np.minimum(x1 + w, 63), np.minimum(y1 + h, 47)], 1).round(1).tolist()
    file.write_text(json.dumps(boxes))
    return file


def start_head(hosts: Hosts, env: dict[str, str]) -> None:
    """The head's `ray start` in `head` (returns once the head runs), with the cluster configs' GCS health
    checks; a failed or timed-out start is torn down with the host's own `ray stop` and tried again."""
    failed = []
    for _ in range(NODE_START_TRIES):
        try:
            out = hosts.run("head", [RAY, "start", "--head", f"--node-ip-address={HEAD}", "--port=6379",
                                     "--include-dashboard=false", "--num-cpus=0",
                                     f"--system-config={json.dumps(HEALTH)}", *COMMON],
                            env=env, timeout=120, check=False)
            if out.returncode == 0:
                return
            failed.append(f"exited {out.returncode}: {(out.stdout + out.stderr)[-3000:]}")
        except rehearsal.RehearsalError as e:
            failed.append(str(e)[-3000:])
        hosts.run("head", [RAY, "stop", "--force"], env=env, check=False, timeout=120)
    raise AssertionError(f"the Ray head did not start in {NODE_START_TRIES} tries; the last: {failed[-1]}")


@pytest.fixture(scope="module")
def cluster(request) -> Iterator[Cluster]:
    pytest.importorskip("moto")
    rehearsal.teardown_leftovers(PREFIX)
    shared = Path(tempfile.mkdtemp(prefix="xmodal-xextract-", dir="/var/tmp"))
    os.chmod(shared, 0o755)
    env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32), "RAY_USAGE_STATS_ENABLED": "0",
           "PYTHONUNBUFFERED": "1", "PYTHONPATH": str(REPO / "platform"), "RAY_DEDUP_LOGS": "0",
           "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
           "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true", "OMP_NUM_THREADS": "1"}
    hosts = Hosts(1 + len(WORKERS), PREFIX)
    moto = None
    c = None
    failed_before = request.session.testsfailed
    began = time.monotonic()
    try:
        hosts.create()
        photos = images(shared / "photos", N_IMAGES)
        c = Cluster(hosts, shared, env, photos, given_boxes(shared / "boxes.json", photos))
        # On the machine's bridge address: every host reaches it over the bridge, the test directly.
        port = bridge_port()
        env["AWS_ENDPOINT_URL"] = f"http://{BRIDGE_ADDRESS}:{port}"
        moto = subprocess.Popen([str(BIN / "moto_server"), "-H", BRIDGE_ADDRESS, "-p", str(port)],
                                start_new_session=True, **c.logs.open("s3"))
        start_head(hosts, env)
        start_nodes([c.worker_node(name, address) for name, address in WORKERS.items()])
        wait_port(BRIDGE_ADDRESS, port, 30)
        import boto3

        client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                              aws_access_key_id="testing", aws_secret_access_key="testing")
        client.create_bucket(Bucket=BUCKET)
        for p in c.images:
            client.upload_file(str(p), BUCKET, f"photos/{p.name}")
        c.s3 = client
        print(f"cluster up and {N_IMAGES} images on S3 in {time.monotonic() - began:.1f} s")
        yield c
    finally:
        hosts.teardown()
        if moto is not None:
            kill_tree(moto.pid)
        if c is not None:
            c.logs.close()
        if request.session.testsfailed == failed_before:
            shutil.rmtree(shared)
        else:
            print(f"the hosts' logs, images and store: {shared}")
    assert rehearsal.leftovers(PREFIX) == []  # every host process (Ray, the drivers) went with its host


def table_rows(t) -> list[dict]:
    """The rows of a store table, each a dict of numpy values."""
    import pyarrow as pa

    cols = {c: (t.column(c).combine_chunks().to_numpy_ndarray()
                if isinstance(t.column(c).type, pa.FixedShapeTensorType) else t.column(c).to_numpy(zero_copy_only=False))
            for c in t.column_names}
    return [{c: v[i] for c, v in cols.items()} for i in range(t.num_rows)]


@pytest.fixture(scope="module")
def reference(cluster) -> dict[str, dict]:
    """Every image's row as the detector gives it in this process, with no cluster and no fault: the same
    seed's random detector, each image as cv2.imread reads it and the reference's OpenCV code prepares it,
    batches of `BATCH` as the actors take them, packed as the write tasks pack them."""
    import torch

    from xmodal.extract.pipeline import prepare_blob
    from xmodal.extract.write import store_table
    from xmodal.models.butd.detector import DetectorConfig, random_detector
    from xmodal.models.butd.image import PreparedImage

    began = time.monotonic()
    cfg = DetectorConfig.tiny().replace_in("input", scale=INPUT_SIZE[0], max_size=INPUT_SIZE[1])
    det = random_detector(cfg, seed=0).eval()
    given = json.loads(cluster.boxes.read_text())
    k = max(len(b) for b in given.values())  # the store's slots: the most boxes an image was given
    rows = {}
    for start in range(0, N_IMAGES, BATCH):
        part = cluster.images[start:start + BATCH]
        with torch.inference_mode():
            decoded = [cv2.imread(str(p), cv2.IMREAD_COLOR) for p in part]
            found = det.extract([PreparedImage(torch.from_numpy(b), s, *im.shape[:2])
                                 for im, (b, s) in ((im, prepare_blob(im, det.cfg.input)) for im in decoded)],
                                given_boxes=[torch.tensor(given[p.stem], dtype=torch.float32) for p in part])
        for p, reg in zip(part, found, strict=True):
            m = int(reg.boxes.shape[0])
            padded = {"img_id": np.array([p.stem], dtype=object), "img_h": np.array([reg.img_h]),
                      "img_w": np.array([reg.img_w]), "num_boxes": np.array([m]),
                      "source": np.array([f"{PHOTOS}/{p.name}"], dtype=object)}  # an S3 image's source: its URI
            for name, value, fill in (("features", reg.features, 0.0), ("boxes", reg.boxes, 0.0),
                                      ("obj_ids", reg.obj_ids, -1), ("obj_conf", reg.obj_conf, 0.0),
                                      ("attr_ids", reg.attr_ids, -1), ("attr_conf", reg.attr_conf, 0.0)):
                v = value.float().numpy() if value.is_floating_point() else value.numpy()
                full = np.full((1, k, *v.shape[1:]), fill, v.dtype)
                full[0, :m] = v
                padded[name] = full
            (rows[p.stem],) = table_rows(store_table(padded))
    print(f"the reference rows of {N_IMAGES} images in this process in {time.monotonic() - began:.1f} s")
    return rows


def check_store(c: Cluster, store: str, reference: dict[str, dict]) -> None:
    """Every image once, each row bit for bit the reference's; no shard the manifest does not name; nothing
    of it on the driver's host."""
    from xmodal.data.lxmert.features import open_features

    opened = open_features(c.located(store))
    ids = []
    for f in opened.image_files():
        for row in table_rows(opened.read_table(f)):
            img_id = str(row["img_id"])
            ids.append(img_id)
            expected = reference[img_id]
            assert row.keys() == expected.keys()
            for col, value in expected.items():
                assert np.array_equal(row[col], value), (img_id, col)
    assert sorted(ids) == sorted(p.stem for p in c.images), (len(ids), len(set(ids)))  # each once
    assert c.keys(store) == sorted(["manifest.json", *opened.image_files()])  # no stray shard, no record
    # (the repository, which every host sees at its own path, is left out: a clone under /tmp holds
    # pyarrow's own test files in its .venv)
    held = c.hosts.run("head", ["find", "/tmp", str(c.shared), "-path", str(REPO), "-prune", "-o", "-name",
                                "*.parquet", "-print"], env=c.env).stdout.split()
    assert held == [], held


def test_a_local_out_the_workers_do_not_share_is_refused_naming_a_host(cluster):
    """The head's /tmp is its own: the write tasks on the worker hosts could not write there. The probe
    tasks find it before any work, naming a host; nothing is left on the head."""
    c = cluster
    driver = c.start("/tmp/xme-local/store", "local")
    rc = driver.wait(timeout=300)
    said = c.logs.text("local")
    errors = [line for line in said.splitlines() if line.startswith("error: ")]
    assert rc == 2 and len(errors) == 1, said[-5000:]
    assert "error: OUT /tmp/xme-local/store: the worker host 10.231.0." in errors[0], errors
    assert "does not see the file the driver wrote at /tmp/xme-local/.store.extract/writing.json" in errors[0], errors
    assert "extracting" not in said and "Traceback" not in said, said[-5000:]
    assert c.hosts.run("head", ["test", "-e", "/tmp/xme-local"], env=c.env, check=False).returncode == 1


def test_ctrl_c_then_a_host_lost_in_the_rerun_every_image_once_each_host_a_share(cluster, reference):
    """With every host up: the job interrupted (SIGINT to its driver, as Ctrl-C) once `INTERRUPT_AFTER`
    images are on S3; then the same command again, which verifies them, loses a worker host once
    `KILL_AFTER` images are on S3 and finishes on its own with the hosts left: its store equal, row for
    row, to the fault-free reference."""
    c = cluster
    store = f"s3://{BUCKET}/store"
    began = time.monotonic()
    driver = c.start(store, "interrupted")
    at_sigint = c.wait_written(driver, store, "interrupted", INTERRUPT_AFTER)
    interrupted = time.monotonic()
    os.kill(child_of(driver.pid), signal.SIGINT)  # the driver itself, as Ctrl-C in its terminal
    rc = driver.wait(timeout=180)
    said = c.logs.text("interrupted")
    assert rc == 130, said[-5000:]
    assert f"extracting {N_IMAGES} images with {len(WORKERS)} detector actor(s)" in said, said[-5000:]
    stopped = [line for line in said.splitlines() if "stopped extracting:" in line]
    assert len(stopped) == 1 and f"kept in {store}" in stopped[0] and "rerun the same command" in stopped[0], said
    assert "Traceback" not in said, said[-5000:]
    told = int(stopped[0].split("stopped extracting: ")[1].split()[0])
    assert "manifest.json" not in c.keys(store)  # nothing published
    (first,) = c.tasks()["batches"]  # the one job that ran detector batches (a refused OUT's ran none)

    rerun = time.monotonic()
    driver = c.start(store, "resumed")
    at_kill = c.wait_written(driver, store, "resumed", KILL_AFTER)
    killed = time.monotonic()
    os.kill(c.hosts.hosts[VICTIM].holder, signal.SIGKILL)  # the host's PID 1: every process in it dies
    said = c.finish(driver, "resumed")
    finished = time.monotonic()
    kept = int(said.split(f"resuming {store}: ")[1].split()[0])
    assert told <= kept < at_kill and kept >= at_sigint - SHARD, (told, kept, at_sigint, at_kill)
    assert f"extracting {N_IMAGES - kept} images with {len(WORKERS)} detector actor(s)" in said, said[-5000:]
    assert f"extracted {N_IMAGES - kept} images" in said, said[-5000:]
    assert f"skipped {kept} already done; rejected 0" in said, said[-5000:]
    check_store(c, store, reference)
    tasks = c.tasks()
    (second,) = set(tasks["batches"]) - {first}
    for job in (first, second):  # each worker host's actor did batches; the lost host's before it died
        assert set(tasks["batches"][job]) == set(WORKERS.values()), (job, tasks)
    assert set(tasks["actors"][first].values()) == {1}, tasks  # one actor per worker host
    print(f"interrupted at {at_sigint} images on S3 ({interrupted - began:.1f} s in), {told} told kept, {kept} "
          f"verified by the rerun; host {VICTIM} killed at {at_kill} images on S3 ({killed - rerun:.1f} s into the "
          f"rerun), which finished {finished - killed:.1f} s later. Per host: batches finished {tasks['batches']}, "
          f"of them retries {tasks['retried']}, by detector actors {tasks['actors']}")
