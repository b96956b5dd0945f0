"""Shared fixtures. One local Ray for the whole session (starting Ray costs seconds); one torch thread."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from runs_testing import mult_run, pretrain_run, vqa_run  # noqa: F401 - session fixtures: finished runs
from xmodal_testing import S3, console_kept, free_port, held, s3_environment

# Ray Train V2's controller polls its workers every 2 s by default: a run's end, and a worker's death,
# are seen only at the next poll. Every test Ray (the shared one, and those of jobs started as
# subprocesses, which inherit this environment) polls 10 times as often. A worker's `ray.train.report`
# also waits for that poll when the previous report is still queued (the queue holds one): with an
# evaluation every few steps, most of a tiny run's time was spent there.
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2")

# S3 for the tests is a moto server on 127.0.0.1 (the `s3` fixture starts it on first use) at a port
# chosen now: the AWS_* variables are set before any Ray starts, so the shared Ray's workers (and
# jobs run as subprocesses) read s3:// stores from it as a cluster's nodes read theirs, through the
# environment. Set, not defaulted: a test never reaches a real S3 of the user's.
S3_PORT = free_port()
os.environ.update(s3_environment(S3_PORT))


# `pytest -n 2` (pytest-xdist; `XMODAL_TEST_WORKERS=2 bash .ci/run`): each test file runs whole on one worker, so
# its module fixtures are built once, and the files of the rehearsal hosts share one worker (their
# hosts take the same bridge addresses, 10.231.0.0/24). Each worker has its own shared Ray, S3 server
# and temp folder. The heaviest files go first, so that none of them starts last: their wall times in
# one run of the whole suite, 2026-12-02, were 512 s (cross_host), 408 (pretrain) ... 29 (postgres).
# (xdist's own `--dist loadgroup` marks no longer group anything under pytest 9.2, which made node ids
# read-only, hence a scheduler of our own.)
HOST_FILES = ("test_cross_host.py", "test_rehearsal.py", "test_ray_up.py", "test_extract_cluster.py")
# Folders whose files share a session fixture that is costly to start (tests/tracking: one `mlflow
# server`): their files run on one worker, so it starts once.
GROUPED_FOLDERS = ("tracking",)
# Files that read the same finished runs (tests/runs_testing.py: session fixtures): one unit of work, so that
# each run is trained once.
RUN_READERS = ("examples/test_examples_run.py", "examples/test_examples_browser.py", "examples/test_mult_pages.py",
               "export/test_export_selected.py", "export/test_export_source.py")
HEAVIEST_FIRST = ("test_cross_host.py", "test_rehearsal.py", "jobs/test_pretrain_job.py", "test_cluster.py",
                  "jobs/test_learning.py", "sweep/test_sweep.py", "runner/test_interrupt.py", "tracking/test_logger.py",
                  "jobs/test_finetune_job.py", "jobs/test_mult_job.py", "extract/test_extract_job.py", "runner/test_outage.py",
                  "jobs/test_mult_learning.py", "export/test_export_selected.py", "bench/test_suite.py",
                  "report/test_build.py", "extract/test_extract_photographs.py", "test_tracking_load.py",
                  "jobs/test_pretrain_job_s3.py", "bench/test_scale.py", "bench/test_sweep_bench.py",
                  "export/test_export_source.py", "test_bad_configs.py", "data/finetune/test_finetune_stream.py",
                  "runner/test_local_ray.py", "report/test_collect.py", "report/test_stats.py",
                  "test_cluster_postgres.py", "tracking/test_retry.py")


def pytest_collection_modifyitems(config, items):
    if not hasattr(config, "workerinput"):  # an xdist worker's; a run of one process keeps the file order
        return
    tests = Path(__file__).parent
    rank = {name: i for i, name in enumerate(HEAVIEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.relative_to(tests).as_posix(), len(rank)))  # stable


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's: unknown to a run without it
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ByFile(LoadScopeScheduling):
        """A file's tests are one unit of work; the rehearsal-host files one unit together, and so are the
        files of each folder in GROUPED_FOLDERS, and the files in RUN_READERS."""

        def _split_scope(self, nodeid: str) -> str:
            file = Path(nodeid.split("::", 1)[0])
            if file.name in HOST_FILES:
                return "hosts"
            if any(file.as_posix().endswith(name) for name in RUN_READERS):
                return "run-readers"
            return file.parent.as_posix() if file.parent.name in GROUPED_FOLDERS else file.as_posix()

    return ByFile(config, log)


# The rehearsal-host files' prefixes (tests/test_rehearsal.py, test_cross_host.py, test_ray_up.py,
# extract/test_extract_cluster.py): every one takes the bridge addresses 10.231.0.0/24, so only one of them
# may have hosts up on the machine at a time.
HOST_PREFIXES = ("xmt", "xmx", "xmu", "xme")
# Longest a host file waits for another pytest run's (on this machine, or in a container on its network):
# the longest of them, test_cross_host.py, took 512 s.
HOSTS_LOCK_WAIT_S = 30 * 60


@pytest.fixture(scope="module", autouse=True)
def _rehearsal_hosts_alone(request):
    """A rehearsal-host file runs while it holds the machine's hosts lock, so that no other pytest run (a
    second checkout's, or a CI job beside this one on the same network) has its bridge on the same
    addresses. The lock's holder is the only test run with hosts up, so any host of a test prefix still
    there is a crashed run's and is removed first."""
    if request.path.name not in HOST_FILES:
        yield
        return
    import xmodal_rehearsal as rehearsal

    with held("xmodal-rehearsal-test-hosts", HOSTS_LOCK_WAIT_S):
        if rehearsal.unavailable_reason() is None:
            for prefix in HOST_PREFIXES:
                rehearsal.teardown_leftovers(prefix)
        yield


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread_under_xdist():
    """Torch on one thread in each xdist worker (`pytest -n 2`, as `.ci/run` runs): two workers on two
    cores, each with Ray's processes beside it, leave no core for a second thread, and OpenMP's threads
    then spin waiting for each other. Measured on the 2-core machine with both cores otherwise busy: 150
    steps of the embedded pretraining in-process took 25.5 s (17.8 CPU-s) on one thread and 156 s (137 CPU-s)
    on two. A test that needs another count sets it itself (`one_thread` marks the modules that did so
    before this); a run of one process keeps torch's default."""
    if os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") == "1":
        yield
        return
    import torch

    torch.set_num_threads(1)
    yield


@pytest.fixture(scope="session")
def ray_local():
    """A fresh local Ray cluster shared by the tests that need one.

    Four logical CPUs on a 2-core machine: Train workers take fractions and
    Ray Data's read tasks need CPUs of their own. No dashboard: no test asks
    this Ray's (the job-submission tests start a `RayHead` of their own), ASHA
    sweeps stop and free trials without it, and its processes took about 4 s
    of CPU a minute while idle, for the whole session, on each xdist worker.
    """
    ray = pytest.importorskip("ray")
    from xmodal.runner.ray_cluster import start_local

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    start_local(num_cpus=4, include_dashboard=False, log_to_driver=True, object_store_memory=1_000_000_000)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def s3():
    """The tests' S3 (`xmodal_testing.S3`): one moto server for the session, one bucket."""
    pytest.importorskip("moto")
    pytest.importorskip("boto3")
    server = S3(S3_PORT).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def mlflow_template(tmp_path_factory) -> Path:
    """An empty MLflow SQLite database, created (all schema migrations run) once per session."""
    from xmodal import tracking

    path = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    tracking.get_experiment_id(f"sqlite:///{path}", "Default")
    return path


@pytest.fixture(autouse=True)
def _migrated_mlflow_db(request):
    """A slow test's `tmp_path / "mlflow.db"` starts as a copy of `mlflow_template`: creating an MLflow
    SQLite database runs every schema migration, one commit each (about 5 s here, 1 s to open one).
    What the tests check is unchanged: it is the database MLflow itself would have created. (Fast
    tests, some of which check that nothing was written, get an empty tmp_path as before.)"""
    if request.node.get_closest_marker("slow") is None or "tmp_path" not in request.fixturenames:
        return
    shutil.copyfile(request.getfixturevalue("mlflow_template"), request.getfixturevalue("tmp_path") / "mlflow.db")


@pytest.fixture
def one_thread():
    """Torch on one thread for the test: tiny tensors are faster so, and far faster on a busy shared
    machine (no OpenMP spinning). Modules of tiny-model tests use it for every test with
    `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    import torch

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

@pytest.fixture(scope="module")
def tiny_store(tmp_path_factory):
    """A small synthetic LXMERT store (160 images, 16-dim features, 8 objects each)."""
    from xmodal.data.lxmert.synthetic import build_synthetic_store
    from xmodal.data.options import SyntheticLxmertOptions

    out = tmp_path_factory.mktemp("store") / "lxmert"
    build_synthetic_store(out, SyntheticLxmertOptions(num_images=160, feat_dim=16, num_objects=8,
                                                      num_object_labels=10, num_attr_labels=4, num_answers=20))
    return out


@pytest.fixture(scope="session")
def stores(tmp_path_factory):
    """A tiny LXMERT store, a MulT store, a VQA set on the LXMERT store's images and an NLVR2 set."""
    from xmodal.data.finetune.synthetic import build_synthetic_nlvr2, build_synthetic_vqa
    from xmodal.data.lxmert.synthetic import build_synthetic_store
    from xmodal.data.mult.synthetic import SyntheticMultOptions
    from xmodal.data.mult.synthetic import build_synthetic_store as build_mult
    from xmodal.data.options import SyntheticLxmertOptions

    root = tmp_path_factory.mktemp("stores")
    images = build_synthetic_store(root / "lxmert", SyntheticLxmertOptions(
        num_images=160, feat_dim=16, num_objects=8, num_object_labels=10, num_attr_labels=4, num_answers=20))
    spelled = build_synthetic_store(root / "lxmert-nlvr2", SyntheticLxmertOptions(
        num_images=160, num_objects=8, feat_dim=16, num_object_labels=40, num_attr_labels=8, num_answers=60,
        sentences_per_image=6, minival_fraction=0.25))  # a corpus whose vocabulary spells the NLVR2 statements
    return {"pretrain": images.path, "mult": build_mult(root / "mult", SyntheticMultOptions(num_samples=240)).path,
            "finetune": build_synthetic_vqa(images.path, root / "vqa", questions_per_image=2).path,
            "nlvr2": build_synthetic_nlvr2(spelled.path, root / "nlvr2").path}


@pytest.fixture(autouse=True)
def _console_as_found():
    """Every test gives the console's process-wide state back as it found it (`console_kept`)."""
    with console_kept():
        yield

