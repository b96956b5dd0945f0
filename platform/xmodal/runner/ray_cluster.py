"""Connecting to Ray, routing the workers' lines to the console, and choosing where runs are stored.
Imported only by drivers."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from xmodal.base.console import CONSOLE, PREFIX, say
from xmodal.base.errors import UserError
from xmodal.base.outputs import check_output_location


def require_ray():
    try:
        import ray
        import ray.train  # noqa: F401
    except ImportError as e:
        raise ImportError("this job needs Ray: pip install 'ray[default,train,tune,data]'") from e
    return ray


# How long the driver's checks wait for the cluster named by RAY_ADDRESS: ray.init itself retries an
# address that does not answer for minutes before it gives up.
PROBE_TIMEOUT_S = 5.0
PROBE_WINDOW_S = 3.0  # a refused connection is tried again for this long (a head still starting)


def cluster_address() -> tuple[str, str, int] | None:
    """(the RAY_ADDRESS text, host, port) of the cluster this job joins, or None where Ray finds or starts
    its own (unset, `auto`, `local`). Raises UserError for an address without a port."""
    text = os.environ.get("RAY_ADDRESS", "").strip()
    if text in ("", "auto", "local"):
        return None
    rest = re.sub(r"^(ray|https?)://", "", text).split("/", 1)[0]
    m = re.match(r"^\[?([^\[\]]+?)\]?:(\d+)$", rest)
    if m is None or not 0 < int(m.group(2)) < 65536:
        raise UserError(f"RAY_ADDRESS = {text!r}: expected HOST:PORT (the head's address, port 6379 by default), "
                        "ray://HOST:PORT, auto or local")
    return text, m.group(1), int(m.group(2))


def check_cluster_address() -> None:
    """The cluster named by RAY_ADDRESS answers: a TCP connection to its host and port within a few
    seconds, else one UserError naming the address (instead of minutes of retries in ray.init)."""
    found = cluster_address()
    if found is None:
        return
    text, host, port = found
    deadline = time.monotonic() + PROBE_WINDOW_S
    while True:
        try:
            with socket.create_connection((host, port), timeout=PROBE_TIMEOUT_S):
                return
        except ConnectionRefusedError as e:
            if time.monotonic() >= deadline:
                why = str(e.strerror or e)
                break
            time.sleep(0.5)
        except OSError as e:  # a timeout, an unknown host, an unreachable network
            why = str(getattr(e, "strerror", None) or e or type(e).__name__)
            break
    raise UserError(f"RAY_ADDRESS = {text!r}: no Ray cluster answers at {host}:{port} ({why}); check it with "
                    f"`ray status --address {host}:{port}`, or unset RAY_ADDRESS to start a local Ray")


LOCAL_MIN_CPUS = 4  # logical CPUs a local Ray gets at least (`connect`)


def check_local_resources(scale) -> None:
    """With no cluster named (RAY_ADDRESS unset or `local`: a local Ray on this machine), the workers'
    CPUs, GPUs and custom resources exist here: Ray Train would wait for them without end."""
    if os.environ.get("RAY_ADDRESS", "").strip() not in ("", "local"):
        return
    ray = sys.modules.get("ray")
    if ray is not None and getattr(ray, "is_initialized", lambda: False)():
        return  # a Ray this process started already (tests, notebooks): its resources are its own
    n = scale.num_workers
    cpus = max(os.cpu_count() or 1, LOCAL_MIN_CPUS)
    if n * scale.cpus_per_worker > cpus:
        raise UserError(f"scale.cpus_per_worker = {scale.cpus_per_worker} x scale.num_workers = {n}: a local Ray "
                        f"has {cpus} logical CPUs; expected at most that (or set RAY_ADDRESS to a cluster)")
    if scale.gpus_per_worker:
        import torch

        gpus = torch.cuda.device_count()
        if n * scale.gpus_per_worker > gpus:
            raise UserError(f"scale.gpus_per_worker = {scale.gpus_per_worker} x scale.num_workers = {n}: this machine "
                            f"has {gpus} GPU{'s' if gpus != 1 else ''} for a local Ray; expected at most that (0 = CPU), "
                            "or set RAY_ADDRESS to a cluster")
    if scale.resources_per_worker:
        raise UserError(f"scale.resources_per_worker = {scale.resources_per_worker}: a local Ray has no custom "
                        "resources; set RAY_ADDRESS to a cluster whose nodes declare them, or leave it empty")


def check_cluster(scale) -> None:
    """What the driver's checks know of the cluster before Ray starts: the one RAY_ADDRESS names answers,
    or a local Ray has what the workers ask for."""
    check_cluster_address()
    check_local_resources(scale)


# Ray Train V2's controller polls its workers every 2 s by default, so it sees a run's end (and a dead
# worker) up to 2 s late, and its teardown waits on further polls: measured on a 2-core machine, a
# one-worker sweep trial's end took 5.6 s at 2 s and 1.2 s at 0.5 s (bench-results/20261203-sweep-overhead.md).
# A local Ray's processes inherit it from the driver; a cluster's from scripts/cluster/node_env.sh.
TRAIN_POLL_ENV, TRAIN_POLL_S = "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5"


def connect(min_logical_cpus: int = LOCAL_MIN_CPUS) -> None:
    """Attach to the cluster a job runs in (`ray job submit` sets RAY_ADDRESS), else start a local Ray.

    A local Ray gets at least `min_logical_cpus` logical CPUs: Train workers take
    fractions, and Ray Data's read tasks need CPUs of their own or `fit()` hangs.
    """
    ray = require_ray()
    if not ray.is_initialized():
        check_cluster_address()
        if os.environ.get("RAY_ADDRESS"):
            try:
                ray.init(log_to_driver=True)
            except ConnectionError as e:  # something answered the probe, but no Ray cluster
                address = os.environ["RAY_ADDRESS"]
                raise UserError(f"RAY_ADDRESS = {address!r}: could not join a Ray cluster there ({' '.join(str(e).split())}); "
                                f"check it with `ray status --address {address}`") from None
        else:
            os.environ.setdefault(TRAIN_POLL_ENV, TRAIN_POLL_S)
            start_local(num_cpus=max(os.cpu_count() or 1, min_logical_cpus), log_to_driver=True)
    attach_ray()  # the workers' lines through the console (xmodal.base.console), where a command line set it up


class _RayLines:
    def __init__(self, forward: Callable[[dict[str, Any]], None]):
        self.forward = forward

    def __call__(self, data: dict[str, Any]) -> None:
        CONSOLE.ray_lines(data, self.forward)


def attach_ray() -> bool:
    """Route the worker lines Ray forwards to this driver through the console (`Console.ray_lines`,
    after `ray.init`). Uses Ray's log dispatcher (a private API, checked against Ray 2.60); without it,
    the lines come out as Ray prints them. Returns whether the console is attached."""
    if not CONSOLE.active:
        return False
    try:
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:
        return False
    with dispatcher._lock:
        for i, (name, handler) in enumerate(dispatcher.handlers):
            if isinstance(handler, _RayLines):
                return True
            if name == "ray_print_logs":
                dispatcher.handlers[i] = (name, _RayLines(handler))
                return True
    return False


# Ray Train's preemption watcher (an actor of every run, polling the cluster's drain state every 5 s)
# has nothing to watch on a local Ray: no node of one machine is reclaimed by a cloud. Off there, it
# is one process start less per run (a few CPU-seconds on a 2-core machine); clusters keep it.
PREEMPTION_WATCHER_ENV = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"

# Ray's log monitor (it forwards the workers' lines to the driver) looks for new log files with a glob
# of the session's log folder on every pass, ten times a second, until the folder holds 1,000 files;
# past that, every 0.5 s. The folder gains two files per Ray worker process, so a local Ray that runs
# many Train runs (a sweep, a test session) spends more on it with every run: measured with 800 files,
# 4.2 CPU-seconds in 30 s, against 1.7 with the 0.5 s pace from the first file. New workers' lines
# still come through, up to 0.5 s later.
LOG_MONITOR_ENV = "RAY_LOG_MONITOR_MANY_FILES_THRESHOLD"


def start_local(**init_kwargs) -> None:
    """`ray.init(address="local", **init_kwargs)`, with the processes of that Ray knowing its address.

    Ray Train's `PlacementGroupCleaner` (an actor of every Train run) asks "is my controller alive?"
    of the cluster it finds the way Ray's command line does: RAY_ADDRESS, else the address the last
    `ray start` on this machine wrote to /tmp/ray/ray_current_cluster. A local Ray started by
    `ray.init` writes none there, so its cleaner asked another cluster: a stale file (a `ray start`
    long gone) cost every run's end 12 s waiting on a dead address (measured: 13.6 s against 1.4 s);
    another live Ray on the machine answered "no such actor", and the cleaner gave up before the run
    began ("Failed to register placement group with cleaner" on the console), or, registered, removed
    the placement group of a live run. So the GCS gets a free port chosen here, and RAY_ADDRESS names
    it in the environment the local Ray's processes inherit; this process's own environment is
    restored after (a job started from here must not join this Ray by accident).

    The local Ray's processes (GCS, raylet, log monitor, dashboard and agents, autoscaler monitor) share
    the driver's process group, so a SIGTERM to the group (`kill -TERM -<pgid>`, a batch system's stop)
    reached them too and killed some (measured: the log monitor, the dashboard and its agent at once,
    the GCS at times, and then the driver died a minute later: "Failed to connect to GCS within 60
    seconds"; under load the autoscaler monitor, and the job failed instead of stopping at a
    checkpoint). Ray blocks SIGINT in the processes it starts; SIGTERM is blocked here the same way
    while they start (a blocked-signal mask is inherited across fork and exec, by the raylet's workers
    too), so the driver alone acts on it. They still end with the driver: Ray ties them to it (PR_SET_PDEATHSIG,
    SIGKILL), and `ray.shutdown()` ends them. Its processes also get Ray Train's preemption watcher
    off (`PREEMPTION_WATCHER_ENV`) and the log monitor's slower pace (`LOG_MONITOR_ENV`).

    A start that fails (on a loaded machine the node can miss Ray's start-up deadlines: "The current
    node timed out during startup", "Failed to start GCS") is tried once more, after the processes the
    failed try left are ended; a second failure is one `LocalRayStartError` saying what to do."""
    ray = require_ray()
    for attempt in range(1, LOCAL_START_TRIES + 1):
        before = _child_pids()
        try:
            _start_local_once(ray, init_kwargs)
            return
        except (TypeError, ValueError):  # options Ray refuses: the same on every try
            raise
        except Exception as e:
            ray.shutdown()  # whatever state the failed ray.init kept in this process
            _end_new_children(before)
            reason = _first_sentence(e)
            if attempt == LOCAL_START_TRIES:
                logs = Path(os.environ.get("RAY_TMPDIR") or tempfile.gettempdir()) / "ray" / "session_latest" / "logs"
                raise LocalRayStartError(
                    f"the local Ray did not start, in {LOCAL_START_TRIES} tries ({reason}): the machine may be too "
                    "loaded to start it within Ray's deadlines; run the job again when it is less busy, or start "
                    "Ray yourself (`ray start --head`) and run the job with RAY_ADDRESS=auto (Ray's logs: "
                    f"{logs})") from None
            say(f"{PREFIX}the local Ray did not start ({reason}); trying once more")
            time.sleep(LOCAL_RETRY_PAUSE_S)


LOCAL_START_TRIES = 2  # tries of a local Ray's start (`start_local`)
LOCAL_RETRY_PAUSE_S = 2.0  # between them: a loaded machine's moment to settle


class LocalRayStartError(UserError):
    """A local Ray failed to start on every try (`start_local`)."""


def _start_local_once(ray, init_kwargs: dict) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    pinned = {"RAY_GCS_SERVER_PORT": str(port), "RAY_ADDRESS": f"127.0.0.1:{port}"}
    for key, value in ((PREEMPTION_WATCHER_ENV, "0"), (LOG_MONITOR_ENV, "0")):
        if key not in os.environ:  # the user's choice stands
            pinned[key] = value
    saved = {k: os.environ.get(k) for k in pinned}
    os.environ.update(pinned)
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        ray.init(address="local", **init_kwargs)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # a SIGTERM that came meanwhile is delivered now
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _child_pids() -> set[int]:
    import psutil  # a dependency of Ray's

    return {c.pid for c in psutil.Process().children(recursive=True)}


def _end_new_children(before: set[int], wait_s: float = 5.0) -> None:
    """End the processes a failed ray.init started (they are this process's children since `before`):
    a half-started node (its GCS, a raylet) would hold the machine while the next try starts another.
    SIGKILL: they were started with SIGTERM blocked (`start_local`), and hold nothing to save."""
    import psutil

    new = [c for c in psutil.Process().children(recursive=True) if c.pid not in before]
    for c in new:
        try:
            c.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(new, timeout=wait_s)


def _first_sentence(e: BaseException) -> str:
    """Ray's reason in a few words: the first sentence of the error (its message may go on with a
    traceback's text), else the exception's name."""
    text = " ".join(str(e).split())
    return re.split(r"(?<=\.)\s", text, maxsplit=1)[0][:200] if text else type(e).__name__


@contextlib.contextmanager
def removed_on_failure(path: Path):
    """On an exception in the block, remove `path` if it did not exist on entry, and the parents made
    for it that are empty again (a download that failed, or whose check did, leaves nothing). A parent
    that holds anything else stays: another job starting at the same time may have written there."""
    path = Path(path)
    missing = [p for p in [path, *path.parents] if not p.exists()]  # deepest first
    try:
        yield path
    except BaseException:
        if missing and missing[0] == path:
            shutil.rmtree(path, ignore_errors=True)
        for parent in missing[1:]:
            try:
                parent.rmdir()
            except OSError:  # not empty, or already gone
                break
        raise


@contextlib.contextmanager
def init_download_dir(storage: str, run_name: str) -> Iterator[Path]:
    """Where the driver downloads fine-tuning's `--init run` weights: the run's folder
    `<storage>/<run>/init` when the storage is a local (on a cluster, shared) folder, removed with the
    folders made for it when a check fails; a scratch folder, removed after the checks, when the storage
    is a URI (`s3://...`), which names no local folder (it would have become one named `s3:`). Workers
    that do not see the driver's copy fetch the weights themselves (`finetune.run_weights_here`)."""
    if "://" not in storage:
        with removed_on_failure(Path(storage) / run_name / "init") as folder:
            yield folder
        return
    with tempfile.TemporaryDirectory(prefix="xmodal-init-") as scratch:
        yield Path(scratch)


def storage_path(configured: str | None) -> str:
    """Config > $XMODAL_STORAGE_PATH (set by the cluster) > ./runs, checked before any work (a local
    folder that can be made and written, or a well-formed URI). Local paths become absolute
    because workers do not share the driver's working directory."""
    env = os.environ.get("XMODAL_STORAGE_PATH")
    path = configured or env or "runs"
    option = ("scale.storage_path" if configured else "XMODAL_STORAGE_PATH (scale.storage_path unset)" if env
              else "scale.storage_path (unset: ./runs)")
    check_output_location(path, option)
    if "://" in path:
        return path
    return str(Path(path).expanduser().resolve())
