"""A local Ray (`xmodal.runner.ray_cluster.start_local`) whose processes find their own cluster, not the one the
last `ray start` on the machine wrote down: Ray Train's placement-group cleaner asks that cluster whether
the run's controller is alive (a stale address cost each run's end 12 s; another live Ray says "dead")."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from xmodal_testing import PYTHON, REPO, free_port, ray_env

pytestmark = pytest.mark.slow

# One local Ray serves both checks below (a start costs a Python with Ray and a cluster's processes): what
# its processes resolve and see in their environment, then a group SIGTERM while it runs.
SCRIPT = """
import json, os, signal, sys, time, ray
from xmodal.runner.ray_cluster import start_local

start_local(num_cpus=1, include_dashboard=False, log_to_driver=False)
noted = []
signal.signal(signal.SIGTERM, lambda s, f: noted.append(s))


@ray.remote(num_cpus=0)
def seen():
    from ray._private.services import canonicalize_bootstrap_address_or_die

    return (os.environ.get("RAY_ADDRESS"), canonicalize_bootstrap_address_or_die(None),
            os.environ.get("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"))


@ray.remote(num_cpus=0)
class Echo:
    def pid(self):
        return os.getpid()


import psutil

session = ray._private.worker._global_node.get_session_dir_path()
(monitor,) = [p for p in psutil.process_iter(["cmdline"])
              if "log_monitor.py" in " ".join(p.info["cmdline"] or []) and session in " ".join(p.info["cmdline"])]
first = Echo.remote()
ray.get(first.pid.remote())
print(json.dumps({"own": ray.get_runtime_context().gcs_address, "seen": ray.get(seen.remote()),
                  "driver": os.environ.get("RAY_ADDRESS"),
                  "driver_watcher": os.environ.get("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"),
                  "log_monitor": monitor.environ().get("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD"),
                  "driver_log_monitor": os.environ.get("RAY_LOG_MONITOR_MANY_FILES_THRESHOLD")}), flush=True)
sys.stdin.readline()  # the test has signalled the process group
time.sleep(5)  # a Ray process the signal killed has gone by now
print(json.dumps({"noted": noted, "pids": ray.get([first.pid.remote(), Echo.remote().pid.remote()], timeout=60)}),
      flush=True)
sys.stdin.readline()  # the test has looked at the Ray processes
ray.shutdown()
"""


def port(address: str) -> int:
    return int(address.rsplit(":", 1)[1])


def _json_line(proc: subprocess.Popen, failed: str = "the driver failed") -> str:
    """The script's next JSON line, past the lines the package says (on a loaded machine, a local Ray's
    start that is tried once more)."""
    while (line := proc.stdout.readline()) and not line.startswith("{"):
        pass
    assert line, f"{failed}: {proc.stderr.read()[-3000:]}"
    return line


def _in(pid: str, text: str) -> bool:
    """Whether a process's command line names `text` (a Ray process of this test's temp folder)."""
    try:
        return text in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return False


def test_a_local_rays_processes_resolve_their_own_cluster_and_a_group_sigterm_reaches_the_driver_alone():
    """1. Over a stale `ray start`'s address file, the local Ray's processes resolve their own cluster,
    with the preemption watcher off and the log monitor's slower pace; the driver's environment is as
    it was. 2. A group SIGTERM (what a batch system or `kill -TERM -<pgid>` sends a job started by hand)
    is the driver's to act on (xmodal.runner.interrupt): every process of its local Ray lives on.
    3. Nothing of the local Ray outlives its driver's ray.shutdown()."""
    # A Ray temp folder of the test's own (short: Ray's socket paths live under it), with the file a
    # `ray start` long gone left behind.
    tmp = Path(tempfile.mkdtemp(prefix="rx", dir="/tmp"))
    (tmp / "ray").mkdir()
    stale = free_port()
    (tmp / "ray" / "ray_current_cluster").write_text(f"127.0.0.1:{stale}")
    proc = subprocess.Popen([PYTHON, "-c", SCRIPT], env=ray_env(RAY_TMPDIR=str(tmp), PYTHONPATH=str(REPO / "platform")),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp,
                            start_new_session=True)
    try:
        seen = json.loads(_json_line(proc))
        env_address, resolved, watcher = seen["seen"]
        assert port(resolved) == port(seen["own"]) != stale, seen  # what the cleaner's state query connects to
        assert env_address and port(env_address) == port(seen["own"]), seen
        assert watcher == "0", seen  # Ray Train's preemption watcher off in the local Ray's processes
        assert seen["log_monitor"] == "0", seen  # Ray's log monitor looks for new files at its slower pace
        assert seen["driver"] is None and seen["driver_watcher"] is None  # the driver's environment is as it was
        assert seen["driver_log_monitor"] is None, seen

        ray_processes = {p: _name(p) for p in os.listdir("/proc") if p.isdigit() and _in(p, str(tmp))}
        assert len(ray_processes) >= 4, ray_processes  # GCS, raylet, monitors, agents
        os.killpg(proc.pid, signal.SIGTERM)
        proc.stdin.write("\n")
        proc.stdin.flush()
        seen = json.loads(_json_line(proc, "the driver failed after the group SIGTERM"))
        assert seen["noted"] == [signal.SIGTERM]
        assert seen["pids"][0] != seen["pids"][1]  # the old actor answers, and a new one starts
        gone = sorted(name for p, name in ray_processes.items() if _state(p) in ("gone", "Z"))
        assert not gone, f"the group SIGTERM ended Ray processes: {gone}"
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(timeout=120) == 0, proc.stderr.read()[-3000:]
        deadline = time.time() + 30
        while (left := [p for p in os.listdir("/proc") if p.isdigit() and _in(p, str(tmp))]) and time.time() < deadline:
            time.sleep(0.5)
        assert not left, "the local Ray outlived its driver's ray.shutdown()"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        shutil.rmtree(tmp, ignore_errors=True)


def _name(pid: str) -> str:
    """A process's program and first argument, e.g. `python .../log_monitor.py` or `.../raylet`."""
    try:
        return " ".join(Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")[:2])[-80:]
    except OSError:
        return "?"


def _state(pid: str) -> str:
    """A process's state letter (Z: exited, its parent has not reaped it yet), or "gone"."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_a_local_ray_that_does_not_start_is_tried_once_more_then_one_error_and_the_run_failed(tmp_path):
    """A local Ray whose GCS does not start (on a loaded machine: Ray's start-up deadlines missed; here,
    every time: the GCS's RocksDB folders are files, so it exits at once, and Ray's deadlines are 0 so
    that each try fails fast) is started once more, then the job ends with one `error:` line saying what
    to do, exit 2, no traceback, nothing of either try left running, and its MLflow run FAILED (not
    RUNNING for ever). Zero deadlines alone do not fail a start: a fast machine's GCS is up at Ray's one look."""
    from xmodal import tracking
    from xmodal.data.lxmert.synthetic import build_synthetic_store
    from xmodal.data.options import SyntheticLxmertOptions

    store = build_synthetic_store(tmp_path / "store", SyntheticLxmertOptions(
        num_images=32, feat_dim=16, num_objects=8, num_object_labels=10, num_attr_labels=4, num_answers=20)).path
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    ray_tmp = Path(tempfile.mkdtemp(prefix="rx", dir="/tmp"))  # short: Ray's socket paths live under it
    try:
        gcs_store = ray_tmp / "gcs"
        gcs_store.mkdir()
        for name in ("tables", "kv"):  # where the GCS's RocksDB opens its databases: a file, not a folder
            (gcs_store / name).write_text("")
        env = ray_env(RAY_TMPDIR=str(ray_tmp), PYTHONPATH=str(REPO / "platform"),
                      RAY_gcs_storage="rocksdb", RAY_gcs_storage_path=str(gcs_store),
                      RAY_py_gcs_connect_timeout_s="0", RAY_gcs_server_port_wait_time_s="0")
        out = subprocess.run([PYTHON, str(REPO / "jobs" / "pretrain.py"), "--store", str(store), "--run-name", "nostart",
                              "--experiment", "nostart", "--storage-path", str(tmp_path / "runs"),
                              "--set", "preset=tiny", "--set", f"mlflow.tracking_uri={uri}",
                              "--set", "mlflow.system_metrics=false"],
                             env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
        shown = f"--- rc {out.returncode}\n--- stdout\n{out.stdout[-3000:]}\n--- stderr\n{out.stderr[-3000:]}"
        assert out.returncode == 2, shown
        assert "Traceback" not in out.stdout + out.stderr, shown
        (line,) = [x for x in out.stderr.splitlines() if x.startswith("error:")]
        assert line.startswith("error: the local Ray did not start, in 2 tries (Failed to start GCS.)"), shown
        assert "ray start --head" in line and "RAY_ADDRESS=auto" in line, line
        assert (out.stdout + out.stderr).count("trying once more") == 1, shown
        assert len(list((ray_tmp / "ray").glob("session_2*"))) == 2  # two starts, each its own Ray session
        run = tracking.find_run(uri, tracking.get_experiment_id(uri, "nostart"), "nostart")
        assert run is not None and run.status == "FAILED", run
        assert not [p for p in os.listdir("/proc") if p.isdigit() and _in(p, str(ray_tmp))], "a Ray process outlived it"
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
