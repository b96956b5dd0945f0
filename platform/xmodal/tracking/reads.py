"""Reads, for resuming, reports and searches: runs come back as `RunRecord`s (plain data, read once),
metric values as `MetricPoint`s or (step, value) pairs, artifacts as paths; a run the store does not
hold is `RunNotFound`. Nothing here creates an experiment."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from xmodal.base.errors import UserError
from xmodal.base.run_tags import PARENT_TAG, RUN_NAME_TAG
from xmodal.tracking.connection import _client, run_url
from xmodal.tracking.retry import _waited


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
    lifecycle_stage: str = "active"  # "deleted": in MLflow's trash, which takes no more values

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
                     end_time=info.end_time, tags=tags, params=dict(data.params), metrics=dict(data.metrics),
                     lifecycle_stage=info.lifecycle_stage)


def find_run(uri: str, experiment_id: str, run_name: str) -> RunRecord | None:
    """The run created earlier under `run_name` (tagged), for resuming into the same run."""
    runs = _waited(uri, f"looking up run {run_name!r}", lambda: _client(uri).search_runs(
        [experiment_id], filter_string=f"tags.`{RUN_NAME_TAG}` = '{run_name}'",
        order_by=["attributes.start_time DESC"], max_results=1))
    return _record(runs[0]) if runs else None


def get_experiment_id(uri: str, name: str) -> str | None:
    """The id of an existing experiment, or None (reports must not create experiments)."""
    exp = _waited(uri, f"looking up experiment {name!r}", lambda: _client(uri).get_experiment_by_name(name),
                  first_contact=True)
    return exp.experiment_id if exp is not None else None


def experiment_names(uri: str) -> list[str]:
    """The names of the store's (active) experiments."""
    return [e.name for e in _waited(uri, "listing experiments", lambda: _client(uri).search_experiments(),
                                    first_contact=True)]


def get_run(uri: str, run_id: str) -> RunRecord:
    """The run with this id; `RunNotFound` (a LookupError) if the store has none."""
    from mlflow.exceptions import MlflowException

    try:
        return _record(_waited(uri, f"reading run {run_id}", lambda: _client(uri).get_run(run_id)))
    except MlflowException as e:
        if e.error_code != "RESOURCE_DOES_NOT_EXIST":  # e.g. a scheme MLflow has no store for: not a missing run
            raise UserError(f"tracking URI {uri!r}: {e.message.strip()}") from None
        raise RunNotFound(f"no MLflow run {run_id!r} in {uri}: {e.message}") from None


def search_runs(uri: str, experiment_ids: list[str], filter_string: str = "") -> list[RunRecord]:
    """Every matching run (all pages), oldest first."""
    runs: list[RunRecord] = []
    token = None
    while True:
        page = _waited(uri, "searching runs", lambda t=token: _client(uri).search_runs(
            experiment_ids, filter_string=filter_string, max_results=1000, order_by=["attributes.start_time ASC"],
            page_token=t))
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
    history = _waited(uri, f"reading {key} of run {run_id}", lambda: _client(uri).get_metric_history(run_id, key))
    return [MetricPoint(m.step, m.value, m.timestamp) for m in history]


def metric_history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    """(step, value) pairs of one metric, by step (the last value logged wins for a repeated step)."""
    by_step: dict[int, tuple[int, float]] = {}
    for m in metric_points(uri, run_id, key):
        if m.step not in by_step or m.timestamp >= by_step[m.step][0]:
            by_step[m.step] = (m.timestamp, m.value)
    return [(s, v) for s, (_, v) in sorted(by_step.items())]


def list_artifacts(uri: str, run_id: str, path: str | None = None) -> list[str]:
    """The paths (relative to the run's artifact root) of the files and folders directly under `path`."""
    return [a.path for a in _waited(uri, f"listing artifacts of run {run_id}",
                                    lambda: _client(uri).list_artifacts(run_id, path))]


def download_artifacts(uri: str, run_id: str, artifact_path: str, dst_dir: str | Path) -> Path:
    """Copy a run's artifact (file or folder) into `dst_dir`; returns the local path."""
    Path(dst_dir).mkdir(parents=True, exist_ok=True)
    return Path(_waited(uri, f"downloading {artifact_path} of run {run_id}",
                        lambda: _client(uri).download_artifacts(run_id, artifact_path, str(dst_dir))))


def artifact_url(uri: str, run_id: str, path: str) -> str:
    """The MLflow UI's own address of a run's artifact `path` (the run's Artifacts tab with the file shown):
    on the tracking server itself, or on `mlflow ui`'s default address for a local store, in the
    model-training view (the route takes the view's query after the path). A browser opens a page there
    in MLflow's artifact viewer (a server sends the artifact itself as a download, and the UI
    shows a `file://` link without its address)."""
    page, _, query = run_url(uri, run_id).partition("?")
    return f"{page}/artifacts/{path}" + (f"?{query}" if query else "")


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
