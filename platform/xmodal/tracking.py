"""MLflow: where runs are logged, run naming and lookup, parent/child runs, artifacts.

The only module that talks to MLflow, and the only one that sees MLflow's objects: runs come back as
`RunRecord`s, metric values as `MetricPoint`s or (step, value) pairs, artifacts as paths. The driver
creates the database, the experiment and the run (several processes creating a new SQLite database
at once fail); rank 0 of the training workers logs into that run by id.
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xmodal.errors import UserError
from xmodal.run_tags import PARENT_TAG, RUN_NAME_TAG

__all__ = ["PARENT_TAG", "RUN_NAME_TAG", "MetricPoint", "RunNotFound", "RunRecord"]  # and the functions below


class RunNotFound(LookupError):
    """No run with this id in the tracking store."""


@dataclass(frozen=True)
class RunRecord:
    """One MLflow run as plain data, read once (a later change to the run is not seen)."""

    run_id: str
    name: str  # the run name (MLflow's, else the xmodal.run_name tag)
    experiment_id: str
    status: str  # RUNNING | SCHEDULED | FINISHED | FAILED | KILLED
    start_time: int | None  # ms since the epoch
    end_time: int | None  # ms since the epoch; None while running
    tags: dict[str, str] = field(default_factory=dict, hash=False)
    params: dict[str, str] = field(default_factory=dict, hash=False)
    metrics: dict[str, float] = field(default_factory=dict, hash=False)  # the last value of each metric

    @property
    def parent_run_id(self) -> str | None:
        return self.tags.get(PARENT_TAG)



@dataclass(frozen=True)
class MetricPoint:
    """One logged value of a metric."""

    step: int
    value: float
    timestamp: int  # ms since the epoch


def _record(run) -> RunRecord:
    info, data = run.info, run.data
    tags = dict(data.tags)
    return RunRecord(run_id=info.run_id, name=info.run_name or tags.get(RUN_NAME_TAG, ""),
                     experiment_id=info.experiment_id, status=info.status, start_time=info.start_time,
                     end_time=info.end_time, tags=tags, params=dict(data.params), metrics=dict(data.metrics))


def _mlflow():
    try:
        import mlflow
    except ImportError as e:  # pragma: no cover - mlflow is a runtime dependency
        raise ImportError("xmodal.tracking needs mlflow: pip install 'mlflow>=3'") from e
    return mlflow


def resolve_tracking_uri(uri: str | None) -> str:
    """Explicit config > $MLFLOW_TRACKING_URI > ./mlflow.db. Relative SQLite paths become absolute,
    because Train workers run in a Ray session folder, not the job's working directory."""
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db"
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        uri = "sqlite:///" + str(Path(uri[len("sqlite:///"):]).resolve())
    elif "://" not in uri:
        raise UserError(f"mlflow.tracking_uri {uri!r}: expected sqlite:///PATH, http(s)://HOST:PORT or another "
                         "MLflow URI scheme")
    return uri


def ui_command(uri: str) -> str:
    if uri.startswith("sqlite:"):
        return f"mlflow ui --backend-store-uri {uri}"
    return f"open {uri} in a browser (MLflow server)"


def _client(uri: str):
    """MLflow's client. Internal: other modules use the functions of this module. (train/mult.py still
    calls it until the job-layer rewrite; then it becomes `_client`.)"""
    return _mlflow().tracking.MlflowClient(tracking_uri=uri)


def ensure_experiment(uri: str, name: str) -> str:
    c = _client(uri)
    exp = c.get_experiment_by_name(name)
    if exp is not None:
        return exp.experiment_id
    try:
        return c.create_experiment(name)
    except Exception:  # created concurrently by another driver
        exp = c.get_experiment_by_name(name)
        if exp is None:
            raise
        return exp.experiment_id


def find_run(uri: str, experiment_id: str, run_name: str) -> RunRecord | None:
    """The run created earlier under `run_name` (tagged), for resuming into the same run."""
    runs = _client(uri).search_runs(
        [experiment_id], filter_string=f"tags.`{RUN_NAME_TAG}` = '{run_name}'",
        order_by=["attributes.start_time DESC"], max_results=1)
    return _record(runs[0]) if runs else None


def create_run(uri: str, experiment_id: str, run_name: str, params: dict[str, Any], tags: dict[str, str],
               parent_run_id: str | None = None) -> str:
    """A new RUNNING run with params and tags logged in batches (MLflow caps a batch at 100 params)."""
    mlflow = _mlflow()
    c = _client(uri)
    all_tags = {RUN_NAME_TAG: run_name, **tags}
    if parent_run_id:
        all_tags[PARENT_TAG] = parent_run_id
    run = c.create_run(experiment_id, run_name=run_name, tags=all_tags)
    items = [mlflow.entities.Param(k, str(v)[:6000]) for k, v in params.items()]
    for i in range(0, len(items), 100):
        c.log_batch(run.info.run_id, params=items[i:i + 100])
    return run.info.run_id


def git_commit() -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
        return out.stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


class RunLogger:
    """Logs metrics into an existing run from a training worker (rank 0).

    After a restart, steps at or below the last step already in MLflow are
    skipped, so a run's metric history has neither duplicates nor a restart.
    """

    def __init__(self, uri: str, run_id: str, system_metrics: bool = False, watch_key: str = "train/loss"):
        self.uri = uri
        self.run_id = run_id
        self.client = _client(uri)
        history = self.client.get_metric_history(run_id, watch_key)
        self.logged_up_to = max((m.step for m in history), default=-1)
        self._system = None
        if system_metrics:
            self._start_system_metrics()

    def _start_system_metrics(self) -> None:
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
        except ImportError:
            return
        try:
            self._system = SystemMetricsMonitor(self.run_id, resume_logging=True)
            self._system.start()
        except Exception as e:  # psutil missing or no permission: training goes on without them
            print(f"[xmodal] system metrics unavailable: {e}")
            self._system = None

    def log(self, metrics: dict[str, float], step: int, force: bool = False) -> None:
        if step <= self.logged_up_to and not force:
            return
        mlflow = _mlflow()
        ts = int(time.time() * 1000)
        items = [mlflow.entities.Metric(k, float(v), ts, step) for k, v in metrics.items()]
        for i in range(0, len(items), 500):
            self.client.log_batch(self.run_id, metrics=items[i:i + 500])

    def set_tag(self, key: str, value: str) -> None:
        self.client.set_tag(self.run_id, key, value)

    def close(self) -> None:
        if self._system is not None:
            self._system.finish()
            self._system = None


def log_artifacts(uri: str, run_id: str, local_dir: str | Path, artifact_path: str | None = None) -> None:
    _client(uri).log_artifacts(run_id, str(local_dir), artifact_path)


def log_artifact(uri: str, run_id: str, local_path: str | Path, artifact_path: str | None = None) -> None:
    _client(uri).log_artifact(run_id, str(local_path), artifact_path)


def set_terminated(uri: str, run_id: str, status: str = "FINISHED") -> None:
    _client(uri).set_terminated(run_id, status=status)


def set_tags(uri: str, run_id: str, tags: dict[str, str]) -> None:
    c = _client(uri)
    for k, v in tags.items():
        c.set_tag(run_id, k, str(v))


def mark_running(uri: str, run_id: str) -> None:
    """Re-open a run that a dead driver left FAILED/KILLED, when it is resumed."""
    _client(uri).update_run(run_id, status="RUNNING")


# ---------------------------------------------------------------- sweeps and reports (xmodal.sweep, xmodal.report)


def get_experiment_id(uri: str, name: str) -> str | None:
    """The id of an existing experiment, or None (reports must not create experiments)."""
    exp = _client(uri).get_experiment_by_name(name)
    return exp.experiment_id if exp is not None else None


def experiment_names(uri: str) -> list[str]:
    """The names of the store's (active) experiments."""
    return [e.name for e in _client(uri).search_experiments()]


def get_run(uri: str, run_id: str) -> RunRecord:
    """The run with this id; `RunNotFound` (a LookupError) if the store has none."""
    from mlflow.exceptions import MlflowException

    try:
        return _record(_client(uri).get_run(run_id))
    except MlflowException as e:
        raise RunNotFound(f"no MLflow run {run_id!r} in {uri}: {e.message}") from None


def search_runs(uri: str, experiment_ids: list[str], filter_string: str = "") -> list[RunRecord]:
    """Every matching run (all pages), oldest first."""
    c = _client(uri)
    runs: list[RunRecord] = []
    token = None
    while True:
        page = c.search_runs(experiment_ids, filter_string=filter_string, max_results=1000,
                             order_by=["attributes.start_time ASC"], page_token=token)
        runs.extend(_record(r) for r in page)
        token = page.token
        if not token:
            return runs


def child_runs(uri: str, parent_run_id: str) -> list[RunRecord]:
    """The runs tagged as children of `parent_run_id`, oldest first."""
    parent = get_run(uri, parent_run_id)
    return search_runs(uri, [parent.experiment_id], f"tags.`{PARENT_TAG}` = '{parent_run_id}'")


def metric_points(uri: str, run_id: str, key: str) -> list[MetricPoint]:
    """Every value logged for one metric, as MLflow stores them (a repeated step appears twice)."""
    return [MetricPoint(m.step, m.value, m.timestamp) for m in _client(uri).get_metric_history(run_id, key)]


def metric_history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    """(step, value) pairs of one metric, by step (the last value logged wins for a repeated step)."""
    by_step: dict[int, tuple[int, float]] = {}
    for m in metric_points(uri, run_id, key):
        if m.step not in by_step or m.timestamp >= by_step[m.step][0]:
            by_step[m.step] = (m.timestamp, m.value)
    return [(s, v) for s, (_, v) in sorted(by_step.items())]


def list_artifacts(uri: str, run_id: str, path: str | None = None) -> list[str]:
    """The paths (relative to the run's artifact root) of the files and folders directly under `path`."""
    return [a.path for a in _client(uri).list_artifacts(run_id, path)]


def log_metrics(uri: str, run_id: str, metrics: dict[str, float], step: int = 0) -> None:
    mlflow = _mlflow()
    ts = int(time.time() * 1000)
    items = [mlflow.entities.Metric(k, float(v), ts, step) for k, v in metrics.items()]
    for i in range(0, len(items), 500):
        _client(uri).log_batch(run_id, metrics=items[i:i + 500])


def download_artifacts(uri: str, run_id: str, artifact_path: str, dst_dir: str | Path) -> Path:
    """Copy a run's artifact (file or folder) into `dst_dir`; returns the local path."""
    Path(dst_dir).mkdir(parents=True, exist_ok=True)
    return Path(_client(uri).download_artifacts(run_id, artifact_path, str(dst_dir)))


def latest_finished_run(uri: str, experiment: str, tags: dict[str, str]) -> RunRecord | None:
    """The most recently started FINISHED run of `experiment` with these tag values, or None. Reads
    only: a SQLite database that does not exist yet is not created (it holds no runs)."""
    if uri.startswith("sqlite:///") and not Path(uri[len("sqlite:///"):]).exists():
        return None
    exp_id = get_experiment_id(uri, experiment)
    if exp_id is None:
        return None
    where = " and ".join(["attributes.status = 'FINISHED'"] + [f"tags.`{k}` = '{v}'" for k, v in tags.items()])
    runs = search_runs(uri, [exp_id], where)
    return runs[-1] if runs else None
