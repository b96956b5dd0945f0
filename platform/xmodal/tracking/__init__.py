"""MLflow: where runs are logged, run naming and lookup, parent/child runs, artifacts.

The only package that talks to MLflow, and the only one that sees MLflow's objects: runs come back as
`RunRecord`s, metric values as `MetricPoint`s or (step, value) pairs, artifacts as paths. The driver
creates the experiment and the run; rank 0 of the training workers logs into that run by id.

Under load: a process's first contact with a SQLite database is serialised across processes by a file
lock (`sqlite_lock_path`; MLflow creates and migrates the schema without one), and every call waits out a busy
database or an unreachable server through one retry policy (`retry._retried`), bounded in time.

    retry.py          the retry policy: how long a call waits for a busy or unreachable store, and what it says then
    connection.py     the tracking URI and the store checks, MLflow's client, SQLite first-contact locks, UI addresses
    runs.py           experiments; runs created and tagged (source, git); params, metrics, artifacts, tags, status
    reads.py          runs, metrics and artifacts read back as plain data, for resuming, reports and searches
    logged_models.py  logged models (a run's model, logged and loaded back) and the Model Registry
    spool.py          the spool file of what a run could not log, and its replay
    logger.py         RunLogger (a worker's metrics, in the background) and Outbox (the driver's last calls)

Each module imports only those above it in this list. Callers use the package (`from xmodal import
tracking`, `tracking.create_run(...)`): it re-exports every public name of the modules.
"""

from __future__ import annotations

from xmodal.base.run_tags import PARENT_TAG, RUN_NAME_TAG
from xmodal.tracking.connection import (
    LOCK_DIR,
    TRAINING_VIEW_QUERY,
    UI_ADDRESS,
    artifact_location,
    check_existing_store,
    resolve_tracking_uri,
    run_url,
    sqlite_lock_path,
    ui_command,
)
from xmodal.tracking.logged_models import (
    LOGGED_MODEL,
    MODEL_REQUIREMENTS,
    LoggedModel,
    ModelVersion,
    get_model_version,
    load_logged_model,
    log_pytorch_model,
    register_model,
    run_model_id,
)
from xmodal.tracking.logger import Outbox, RunLogger
from xmodal.tracking.reads import (
    MetricPoint,
    RunNotFound,
    RunRecord,
    artifact_url,
    child_runs,
    download_artifacts,
    experiment_names,
    find_run,
    get_experiment_id,
    get_run,
    latest_finished_run,
    list_artifacts,
    metric_history,
    metric_points,
    search_runs,
)
from xmodal.tracking.retry import WAIT_S, check_server, outage_wait, reachable, set_outage_wait
from xmodal.tracking.runs import (
    create_run,
    ensure_experiment,
    experiment_description,
    git_commit,
    git_dirty,
    log_artifact,
    log_artifacts,
    log_dataset,
    log_metrics,
    log_params,
    log_table,
    mark_running,
    set_tags,
    set_terminated,
    source_tags,
)
from xmodal.tracking.spool import REPLAY_COMMAND, SPOOL_FILE, ReplaySummary, read_spool, replay, spool_path

__all__ = [
    "LOCK_DIR", "LOGGED_MODEL", "MODEL_REQUIREMENTS", "PARENT_TAG", "REPLAY_COMMAND", "RUN_NAME_TAG", "SPOOL_FILE",
    "TRAINING_VIEW_QUERY", "UI_ADDRESS", "WAIT_S",
    "LoggedModel", "MetricPoint", "ModelVersion", "Outbox", "ReplaySummary", "RunLogger", "RunNotFound", "RunRecord",
    "artifact_location", "artifact_url", "check_existing_store", "check_server", "child_runs", "create_run", "download_artifacts",
    "ensure_experiment", "experiment_description", "experiment_names", "find_run", "get_experiment_id",
    "get_model_version", "get_run", "git_commit", "git_dirty", "latest_finished_run", "list_artifacts",
    "load_logged_model", "log_artifact", "log_artifacts", "log_dataset", "log_metrics", "log_params",
    "log_pytorch_model", "log_table", "mark_running", "metric_history", "metric_points", "outage_wait", "reachable", "read_spool",
    "register_model", "replay", "resolve_tracking_uri", "run_model_id", "run_url", "search_runs", "set_outage_wait",
    "set_tags", "set_terminated", "source_tags", "spool_path", "sqlite_lock_path", "ui_command",
]
