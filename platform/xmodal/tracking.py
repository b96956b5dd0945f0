"""MLflow: where runs are logged, run naming and lookup, parent/child runs, artifacts.

The only module that talks to MLflow, and the only one that sees MLflow's objects: runs come back as
`RunRecord`s, metric values as `MetricPoint`s or (step, value) pairs, artifacts as paths. The driver
creates the experiment and the run; rank 0 of the training workers logs into that run by id.

Under load: a process's first contact with a SQLite database is serialised across processes by a file
lock (`sqlite_lock_path`; MLflow creates and migrates the schema without one), and every call waits out a busy
database or an unreachable server through one retry policy (`_retried`), bounded in time.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xmodal import run_tags as T
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


def check_existing_store(uri: str) -> None:
    """Raise UserError unless `uri` names a tracking store that already exists: an MLflow SQLite database
    (a file with MLflow's tables), a file store folder, or a server that answers. Readers (reports,
    replay) call this first: opening a missing or foreign database through MLflow would create or
    migrate one."""
    if uri.startswith("sqlite:///"):
        path = Path(uri[len("sqlite:///"):])
        if not path.exists():
            raise UserError(f"no MLflow database at {path}; expected an existing one")
        if not path.is_file():
            raise UserError(f"{path}: is a directory; expected an MLflow SQLite database file")
        with open(path, "rb") as f:
            head = f.read(16)
        if head != b"SQLite format 3\x00":
            what = "an empty file" if not head else "not an SQLite database"
            raise UserError(f"{path}: {what}; expected an MLflow SQLite database")
        import sqlite3

        try:
            with sqlite3.connect(f"file:{path}?mode=ro", uri=True) as db:
                tables = {r[0] for r in db.execute("select name from sqlite_master where type = 'table'")}
        except sqlite3.Error as e:
            raise UserError(f"{path}: cannot be read as SQLite ({e}); expected an MLflow database") from None
        if not {"experiments", "runs"} <= tables:
            raise UserError(f"{path}: an SQLite database without MLflow's tables (experiments, runs); "
                            "expected an MLflow tracking database")
    elif uri.startswith("file:"):
        path = Path(uri[len("file://"):] if uri.startswith("file://") else uri[len("file:"):])
        if not path.is_dir():
            raise UserError(f"no MLflow file store at {path}; expected an existing folder")
    elif "://" not in uri:
        raise UserError(f"tracking URI {uri!r}: expected sqlite:///PATH, http(s)://HOST:PORT or another MLflow URI")
    elif not reachable(uri):
        raise UserError(f"MLflow at {uri} is unreachable; expected a running tracking server")


# Where `mlflow ui` serves by default.
UI_ADDRESS = "http://127.0.0.1:5000"
# The query that opens MLflow 3's model-training view. Its UI (3.17) takes the GenAI / model-training
# choice from the page's `workflowType` query, else from a per-browser setting that defaults to GenAI;
# the experiment's `mlflow.experimentKind` tag does not decide it there. Without the query a run's
# page sits under "Evaluation runs" of the GenAI view.
TRAINING_VIEW_QUERY = "?workflowType=machine_learning"


def run_url(uri: str, run_id: str, experiment_id: str | None = None) -> str:
    """The address of a run's page in the MLflow UI, in the model-training view: on `mlflow ui`'s default
    address for a SQLite or file store, else on the tracking server itself. The experiment id is read
    from the run when not given (a few seconds at most: a store that does not answer gets MLflow's
    run-only address, which opens the same page without the training view's query)."""
    base = uri.rstrip("/") if uri.startswith(("http://", "https://")) else UI_ADDRESS
    if experiment_id is None:
        try:
            experiment_id = _waited(uri, f"reading run {run_id}",
                                    lambda: _client(uri).get_run(run_id).info.experiment_id, wait_s=5)
        except Exception:  # the address is a convenience: the run id is printed beside it
            return f"{base}/#/runs/{run_id}"
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}{TRAINING_VIEW_QUERY}"


def ui_command(uri: str, run_id: str | None = None) -> str:
    """How to see the store in the MLflow UI: `mlflow ui` for a SQLite file, the server's address
    otherwise. With `run_id`, the run's page too (`run_url`), on a second line indented as the rows of
    the run's end summary (`console.end_summary`)."""
    if uri.startswith("sqlite:"):
        command = f"mlflow ui --backend-store-uri {uri}"
        return command if run_id is None else f"{command}\n  then open   {run_url(uri, run_id)}"
    page = run_url(uri, run_id) if run_id is not None else f"{uri.rstrip('/')}/#/experiments{TRAINING_VIEW_QUERY}"
    return f"open {page} in a browser (MLflow server){_through_tunnel(uri, page)}"


def _through_tunnel(uri: str, page: str) -> str:
    """On a cluster's node (node_env.sh's XMODAL_HEAD_IP), a server at the head's private address opens
    from the cluster's network only; from a user's computer, through the SSH tunnel docs/cluster.md
    opens (`ray attach CONFIG -p PORT`): that page's address there, on a second line, else nothing."""
    parts = urllib.parse.urlsplit(uri)
    if not os.environ.get("XMODAL_HEAD_IP") or parts.hostname != os.environ["XMODAL_HEAD_IP"] or parts.port is None:
        return ""
    local = page.replace(f"{parts.scheme}://{parts.netloc}", f"http://127.0.0.1:{parts.port}", 1)
    return f"\n  or open    {local} through the SSH tunnel (`ray attach CLUSTER.yaml -p {parts.port}`)"


def _client(uri: str):
    """MLflow's client, for this module's functions only: other modules call those, so that mlflow is
    imported here and nowhere else (the import contract in pyproject.toml). Building one opens the
    store (for SQLite: creates or migrates the schema), so callers build it inside the retry policy.
    One client per URI and process, built once (a sweep trial makes dozens of calls; a new client per
    call measured 0.6 ms each here, MLflow 3 caching the store itself). The client holds no connection
    of its own (MLflow caches the SQLite store and the HTTP session per process either way), so threads
    share it; a forked child builds its own."""
    key = (uri, os.getpid())
    client = _clients.get(key)
    if client is None:
        if uri.startswith("sqlite:///") and uri not in _opened:
            client = _first_contact(uri)
        else:
            client = _mlflow().tracking.MlflowClient(tracking_uri=uri)
        _clients[key] = client
    return client


_clients: dict[tuple[str, int], Any] = {}


# The SQLite URIs whose store this process has opened: MLflow keeps it (schema checked) for the process.
_opened: set[str] = set()
_opening = threading.Lock()


def sqlite_lock_path(uri: str) -> Path:
    """The file lock that serialises first contacts with a SQLite database: one per database file (a
    digest of its real path) in this machine's temporary folder, not beside the database, so that its
    folder gains no file (a job that stops at a check leaves the working directory as it was)."""
    db = os.path.realpath(uri[len("sqlite:///"):].split("?", 1)[0])
    return LOCK_DIR / f"sqlite-{hashlib.sha256(db.encode()).hexdigest()[:16]}.lock"


LOCK_DIR = Path(tempfile.gettempdir()) / "xmodal-locks"


def _first_contact(uri: str):
    """The client of a SQLite store this process has not opened yet, built under an exclusive `flock`
    on its lock file (`sqlite_lock_path`): MLflow creates a new database's tables and runs its migrations with no lock of its
    own, and processes doing so at once break each other ("duplicate column name", "table
    _alembic_tmp_... already exists"), sometimes leaving the file unusable. One attempt under the lock;
    a failure (the database locked by someone else) releases it and goes back to the caller's retry
    policy. Later clients of the process reuse MLflow's cached store and need no lock."""
    with _opening:  # threads of one process (a worker's sender and its main thread) take turns too
        if uri in _opened:
            return _mlflow().tracking.MlflowClient(tracking_uri=uri)
        lock = sqlite_lock_path(uri)
        try:
            if not LOCK_DIR.is_dir():
                LOCK_DIR.mkdir(exist_ok=True)
                LOCK_DIR.chmod(0o1777)  # like /tmp: every user's jobs lock here
            fd = os.open(lock, os.O_RDWR | os.O_CREAT, 0o666)
        except OSError:  # no lock to be had (another user's file, a read-only folder): open without one
            fd = None
        try:
            if fd is not None:
                fcntl.flock(fd, fcntl.LOCK_EX)  # held for one store opening: seconds at most
            client = _mlflow().tracking.MlflowClient(tracking_uri=uri)
        finally:
            if fd is not None:
                os.close(fd)  # releases the lock
        _opened.add(uri)
        return client


def artifact_location(uri: str, name: str) -> str | None:
    """Where a new experiment of a SQLite database keeps its artifacts: `mlruns/` beside the database
    file, one folder per experiment name, whatever the job's working directory (MLflow's own default
    is `./mlruns` of the process that creates the experiment, so a job started elsewhere scattered
    them). None (the server's or MLflow's default) for every other tracking URI."""
    if not uri.startswith("sqlite:///"):
        return None
    db = Path(os.path.realpath(uri[len("sqlite:///"):].split("?", 1)[0]))
    slug = re.sub(r"[^A-Za-z0-9._-]+", "_", name).strip("._") or "experiment"
    return (db.parent / "mlruns" / f"{slug}-{hashlib.sha256(name.encode()).hexdigest()[:8]}").as_uri()


# What an experiment holds, by the entry point that creates it (its description in the MLflow UI).
_DESCRIPTIONS = {
    "pretrain.py": "LXMERT pretraining runs (jobs/pretrain.py): one run per job, with its config, dataset, "
                   "metrics beside their chance levels, checkpoints and final model.",
    "finetune.py": "LXMERT fine-tuning runs (jobs/finetune.py) on VQA, GQA or NLVR2: one run per job, with its "
                   "config, dataset, metrics, prediction files and the model selected on validation.",
    "train_mult.py": "MulT training runs (jobs/train_mult.py): one run per job (a multi-seed job: a parent run "
                     "with one child per seed), with its config, dataset, metrics and the model selected on "
                     "validation.",
    "sweep.py": "Ablation sweeps (jobs/sweep.py): one parent run per sweep, holding its search space, best trial "
                "and report (jobs/report.py); one child run per trial.",
    "benchmark.py": "Throwaway runs of the tracking benchmark (jobs/benchmark.py tracking).",
}


def experiment_description(name: str, argv: list[str] | None = None) -> str:
    """The description (Markdown) of an experiment xmodal creates: what its runs are, by the job that
    creates it (`sys.argv[0]`), else a general one."""
    args = sys.argv if argv is None else argv
    entry = Path(args[0]).name if args else ""
    return _DESCRIPTIONS.get(entry, f"Model-training runs logged by xmodal (experiment {name!r}).")


def ensure_experiment(uri: str, name: str, description: str | None = None) -> str:
    """The experiment's id (created if new), marked as a model-training experiment unless it is
    marked otherwise (`mlflow.experimentKind`), and described (`mlflow.note.content`: `description`,
    default `experiment_description`) unless it has a description. MLflow's UI shows the description on
    the experiment's page; the kind is what MLflow records for the training view (its 3.17 UI opens that
    view from the address's query instead: `run_url`)."""
    text = description or experiment_description(name)

    def ensure() -> str:
        c = _client(uri)
        exp = c.get_experiment_by_name(name)
        if exp is None:
            try:
                return c.create_experiment(name, artifact_location=artifact_location(uri, name),
                                           tags={T.EXPERIMENT_KIND: T.TRAINING_EXPERIMENT, T.NOTE: text})
            except Exception:  # created concurrently by another driver
                exp = c.get_experiment_by_name(name)
                if exp is None:
                    raise
        if T.EXPERIMENT_KIND not in exp.tags:  # made before the kind was set, or by MLflow itself
            c.set_experiment_tag(exp.experiment_id, T.EXPERIMENT_KIND, T.TRAINING_EXPERIMENT)
        if not exp.tags.get(T.NOTE):  # made before experiments were described; a user's text stays
            c.set_experiment_tag(exp.experiment_id, T.NOTE, text)
        return exp.experiment_id

    return _waited(uri, f"opening experiment {name!r}", ensure, first_contact=True)


def find_run(uri: str, experiment_id: str, run_name: str) -> RunRecord | None:
    """The run created earlier under `run_name` (tagged), for resuming into the same run."""
    runs = _waited(uri, f"looking up run {run_name!r}", lambda: _client(uri).search_runs(
        [experiment_id], filter_string=f"tags.`{RUN_NAME_TAG}` = '{run_name}'",
        order_by=["attributes.start_time DESC"], max_results=1))
    return _record(runs[0]) if runs else None


def create_run(uri: str, experiment_id: str, run_name: str, params: dict[str, Any], tags: dict[str, str],
               parent_run_id: str | None = None) -> str:
    """A new RUNNING run with params and tags logged in batches (MLflow caps a batch at 100 params).
    Each call is retried on its own: the run is created once, and a params batch sent again after a
    lost reply is accepted (the same values)."""
    all_tags = {RUN_NAME_TAG: run_name, **tags}
    if parent_run_id:
        all_tags[PARENT_TAG] = parent_run_id
    run_id = _waited(uri, f"creating run {run_name!r}", lambda: _client(uri).create_run(
        experiment_id, run_name=run_name, tags=all_tags).info.run_id)
    log_params(uri, run_id, params)
    return run_id


def _git(*args: str) -> str | None:
    """A git command's output in this package's checkout, None outside one (an installed package)."""
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_commit(short: bool = False) -> str:
    """The checkout's commit (`short`: abbreviated, as the benchmarks record it), "unknown" outside git."""
    return _git("rev-parse", *(("--short",) if short else ()), "HEAD") or "unknown"


def git_dirty() -> bool | None:
    """Whether tracked files differ from the commit (untracked files, e.g. mlflow.db, do not count)."""
    out = _git("status", "--porcelain", "--untracked-files=no")
    return None if out is None else bool(out)


# Set by `ray job submit` in the job's driver (ray._private.runtime_env.constants).
_RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"


def source_tags(argv: list[str] | None = None) -> dict[str, str]:
    """MLflow's source tags, which its UI shows as the run's Source: the entry point (relative to the
    checkout when inside it), JOB under `ray job submit` else LOCAL, the git commit and whether the
    checkout was dirty; and the whole command line (`xmodal.command`)."""
    argv = list(sys.argv if argv is None else argv)
    entry = argv[0] if argv else "unknown"
    root = _git("rev-parse", "--show-toplevel")
    if root and entry:
        try:
            entry = Path(entry).resolve().relative_to(root).as_posix()
        except ValueError:
            pass
    tags = {T.SOURCE_NAME: entry, T.SOURCE_TYPE: "JOB" if _RAY_JOB_ENV in os.environ else "LOCAL",
            T.COMMAND: shlex.join([entry, *argv[1:]])[:5000]}
    commit, dirty = git_commit(), git_dirty()
    if commit != "unknown":
        tags[T.GIT_COMMIT] = commit
    if dirty is not None:
        tags[T.GIT_DIRTY] = str(dirty).lower()
    return tags


def log_dataset(uri: str, run_id: str, name: str, path: str, digest: str, profile: dict[str, Any],
                context: str = "train") -> None:
    """The run's data as an MLflow dataset input (the UI's Dataset column and panel): its name, where
    it is, its fingerprint as the digest, and `profile` (rows, dims, ...) as the dataset's profile.
    Logging the same dataset again (a resumed run) adds nothing."""
    import warnings

    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    if "://" in path:
        from mlflow.data.dataset_source_registry import resolve_dataset_source

        with warnings.catch_warnings():  # "can be interpreted in multiple ways": the first is right
            warnings.simplefilter("ignore")
            source = resolve_dataset_source(path)
    else:
        from mlflow.data.sources import LocalArtifactDatasetSource

        source = LocalArtifactDatasetSource(str(Path(path).resolve()))

    class StoreDataset(MetaDataset):
        @property
        def profile(self) -> dict[str, Any]:
            return profile

        def to_dict(self) -> dict[str, str]:
            return {**super().to_dict(), "profile": json.dumps(profile)}

    entity = StoreDataset(source, name=name, digest=digest)._to_mlflow_entity()
    inputs = [DatasetInput(entity, [InputTag(MLFLOW_DATASET_CONTEXT, context)])]
    _waited(uri, f"logging dataset {name!r}", lambda: _client(uri).log_inputs(run_id, inputs))


# What a logged model's environment lists: the versions it was trained with, named rather than
# inferred (MLflow's inference runs a subprocess that imports the model: seconds per run).
MODEL_REQUIREMENTS = ("torch", "numpy", "pyyaml", "pydantic")


# The name of a run's MLflow model: not "model", the run's artifact folder of checkpoint files (MLflow 3
# merges a logged model into the run's artifact paths of its name, and then looks the model up through
# the process's global tracking URI, not the client's).
LOGGED_MODEL = "final_model"


def log_pytorch_model(uri: str, run_id: str, model, name: str = LOGGED_MODEL, config: dict[str, Any] | None = None,
                      metadata: dict[str, Any] | None = None, step: int = 0) -> str:
    """`model` (an nn.Module) as the run's MLflow model (`mlflow.pytorch` flavor, pickled by reference
    to its classes: loading needs the package importable), with `config` as `config.yaml` beside it
    and as the model's params; returns the model id. Load it with
    `mlflow.pytorch.load_model("runs:/<run_id>/final_model")` or `("models:/<model id>")`."""
    import importlib.metadata
    import warnings

    import yaml
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus
    from mlflow.models import Model

    mlflow = _mlflow()
    doing = f"logging model {name!r}"

    def call(method: str, *args, **kwargs):  # each MLflow call retried on its own (none is repeated)
        return _waited(uri, doing, lambda: getattr(_client(uri), method)(*args, **kwargs))

    run = call("get_run", run_id)
    params = {k: str(v)[:6000] for k, v in _flat(config or {}).items()}
    # The run's source tags on the model too: the UI's model list shows them as "Logged from".
    tags = {k: v for k, v in run.data.tags.items() if k.startswith(T.SOURCE)}
    tags[T.MODEL_CLASS] = f"{type(model).__module__}.{type(model).__qualname__}"
    logged = call("create_logged_model", run.info.experiment_id, name=name, source_run_id=run_id, params=params or None,
                                   tags=tags)
    requirements = []
    for package in MODEL_REQUIREMENTS:
        try:
            requirements.append(f"{package}=={importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    with tempfile.TemporaryDirectory() as tmp:
        extra = []
        if config is not None:
            (Path(tmp) / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
            extra.append(str(Path(tmp) / "config.yaml"))
        local = Path(tmp) / "model"
        info = Model(artifact_path=logged.artifact_location, model_uuid=logged.model_id, run_id=run_id,
                     model_id=logged.model_id, metadata=metadata)
        # The pickle format's own caution (a warning and a log line on every save), said once in the
        # docs instead.
        pytorch_log = logging.getLogger("mlflow.pytorch")
        level = pytorch_log.level
        pytorch_log.setLevel(logging.ERROR)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mlflow.pytorch.save_model(model, str(local), mlflow_model=info, pip_requirements=requirements,
                                          serialization_format="pickle", extra_files=extra or None)
        finally:
            pytorch_log.setLevel(level)
        call("log_model_artifacts", logged.model_id, str(local))
    call("log_outputs", run_id, [LoggedModelOutput(logged.model_id, step=step)])
    call("finalize_logged_model", logged.model_id, LoggedModelStatus.READY)
    return logged.model_id


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


SPOOL_FILE = "mlflow_unlogged.jsonl"
REPLAY_COMMAND = "python jobs/replay_tracking.py"
_SPOOL_OPS = {"metrics": ("items",), "artifact": ("path",), "tags": ("tags",), "terminated": ("status",)}


def spool_path(storage: str, run_name: str) -> Path:
    """Where a run writes what it could not log: `<storage>/<run_name>/mlflow_unlogged.jsonl` when the
    checkpoint storage is local, else this machine's temp folder (remote storage is not a file)."""
    root = Path(storage) if "://" not in storage else Path(tempfile.gettempdir()) / "xmodal-runs"
    return root / run_name / SPOOL_FILE


def _probe(uri: str, timeout_s: float = 5.0) -> OSError | ValueError | None:
    """None if an http(s) tracking server answers at all (any HTTP status counts), else the error."""
    try:
        urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s).close()
        return None
    except urllib.error.HTTPError:
        return None
    except (OSError, ValueError) as e:
        return e


def reachable(uri: str, timeout_s: float = 5.0) -> bool:
    """Whether an http(s) tracking server answers at all (any HTTP status counts). MLflow's own
    client retries a refused connection for minutes (MLFLOW_HTTP_REQUEST_MAX_RETRIES, exponential
    backoff): asking first keeps a sender out of that loop while the server is down, without
    changing MLflow's settings for the rest of the process. Other URIs (files, SQLite) count as up."""
    if not uri.startswith(("http://", "https://")):
        return True
    if _probe(uri, timeout_s) is not None:
        return False
    _reached.add(uri)
    return True


# The http(s) servers that answered this process once: a refused connection to one of them is an outage
# to wait out, never a wrong URI (`_waited`'s fast failure).
_reached: set[str] = set()


def _refused(e: BaseException | None) -> bool:
    """Whether a probe's error says that nothing listens at the address (or the host name is unknown)."""
    reason = getattr(e, "reason", e)
    return isinstance(reason, ConnectionRefusedError) or (
        isinstance(reason, socket.gaierror) and reason.errno == socket.EAI_NONAME)


def check_server(uri: str, doing: str) -> None:
    """A UserError at once when `uri` is an http(s) server this process never reached and nothing listens
    there (connection refused, unknown host): a wrong port or host, or a server never started, which
    waiting would not mend. A server that answered once and went away is waited for (`_waited`)."""
    if not uri.startswith(("http://", "https://")) or uri in _reached:
        return
    e = _probe(uri)
    if e is None:
        _reached.add(uri)
    elif _refused(e):
        raise UserError(f"MLflow at {uri} ({doing}): nothing listens there ({_first_line(e)}); expected a running "
                        "tracking server: start it (mlflow server --host HOST --port PORT) or fix "
                        "mlflow.tracking_uri (or $MLFLOW_TRACKING_URI)")


# MLflow's answers about the request itself (a bad value, an unknown run, a name taken, no permission):
# asking again cannot change them, so they are raised at once rather than retried.
_PERMANENT_CODES = frozenset({"INVALID_PARAMETER_VALUE", "RESOURCE_DOES_NOT_EXIST", "RESOURCE_ALREADY_EXISTS",
                              "INVALID_STATE", "BAD_REQUEST", "PERMISSION_DENIED", "UNAUTHENTICATED",
                              "ENDPOINT_NOT_FOUND", "FEATURE_DISABLED", "NOT_FOUND"})
# SQLite's errors that no wait mends (everything else from SQLite, "database is locked" first, is retried).
_PERMANENT_SQLITE = ("file is not a database", "database disk image is malformed", "unable to open database file",
                     "out-of-date database schema")


def _permanent(e: Exception) -> bool:
    """Whether `e` says the call itself is wrong (raised) rather than the store busy or away (retried)."""
    if getattr(e, "error_code", None) in _PERMANENT_CODES:
        return True
    text = str(e)
    return any(m in text for m in _PERMANENT_SQLITE)


def _retried(uri: str, what: Callable[[], Any], pause: Callable[[float], bool]) -> tuple[bool, Any]:
    """The one retry policy of every MLflow call: `what()` once the server at `uri` answers
    (`reachable`). While it does not, or `what()` raises because the store is busy or away (a SQLite
    database locked by another process, a server down), `pause(seconds)` is called with the backoff (1,
    2, 4, 8, 10, 10, ... s): it waits, that long or less, and says whether to try again. An error that
    no wait mends (`_permanent`) is raised at once. The callers differ only in how they wait and when
    they give up (`RunLogger`: until abandoned; `Outbox`: a deadline shared by a run's last calls;
    `_waited`, every other call: a bounded wait, then a UserError); their fallbacks are their own.
    Returns (True, what's result), or (False, the last error, None if the server never answered) once
    `pause` gave up."""
    attempt = 0
    last: Exception | None = None
    while True:
        try:
            if reachable(uri):
                return True, what()
        except Exception as e:
            if _permanent(e):
                raise
            last = e
        if not pause(min(10.0, float(2 ** attempt))):
            return False, last
        attempt += 1


# How long a call waits for a busy SQLite database or an unreachable server before it fails, where the
# run's `mlflow.outage_wait_s` was not given for the URI (`set_outage_wait`): that setting's default.
WAIT_S = 300.0
# The `mlflow.outage_wait_s` of each URI, set by the process that runs with that config (the driver in
# `engine.check`, each Train worker): every wait of this process on that store then lasts that long.
_outage_wait: dict[str, float] = {}
# A wait is said (once per process and store) when it lasts longer than this: short lock waits are
# ordinary when many trials share one SQLite file.
_SAY_AFTER_S = 3.0
_said_waiting: set[str] = set()


def set_outage_wait(uri: str, seconds: float) -> None:
    """Every later call of this process to `uri` waits up to `seconds` (the run's `mlflow.outage_wait_s`)
    for a busy database or an unreachable server before it fails; the last setting for a URI wins."""
    _outage_wait[uri] = float(seconds)


def outage_wait(uri: str) -> float:
    """How long this process's calls to `uri` wait for it (`set_outage_wait`, else `WAIT_S`)."""
    return _outage_wait.get(uri, WAIT_S)


def _waited(uri: str, doing: str, what: Callable[[], Any], wait_s: float | None = None,
            first_contact: bool = False) -> Any:
    """`what()` (which builds its client with `_client`) through `_retried`, retried for up to `wait_s`
    (default `outage_wait(uri)`) from the call; then a UserError naming the store, what was being done,
    the last error, the setting and what to do. `first_contact`: a call that names no run or experiment
    (the first a job makes): a server never reached that refuses the connection fails at once
    (`check_server`)."""
    if first_contact:
        check_server(uri, doing)
    wait = outage_wait(uri) if wait_s is None else wait_s
    start = time.monotonic()

    def pause(seconds: float) -> bool:
        waited = time.monotonic() - start
        if waited >= wait:
            return False
        if waited + seconds > _SAY_AFTER_S and uri not in _said_waiting:
            _said_waiting.add(uri)
            _say(f"[xmodal] MLflow at {uri} is busy or unreachable ({doing}): retrying for up to {wait:g} s "
                 "(mlflow.outage_wait_s)")
        time.sleep(min(seconds, wait - waited))
        return True

    done, out = _retried(uri, what, pause)
    if done:
        return out
    error = _first_line(out) if out is not None else "no answer"
    if uri.startswith("sqlite:///"):
        todo = ("another process holds the database locked (an `mlflow ui`, a sweep's trials, another job, a "
                "backup): let it finish or stop it, then rerun")
    else:
        todo = "start the tracking server (or fix mlflow.tracking_uri), then rerun"
    raise UserError(f"MLflow at {uri}: {doing} failed for {wait:g} s, the wait mlflow.outage_wait_s allows "
                    f"({error}); {todo}")


def _append_spool(path: Path, records: list[dict[str, Any]]) -> None:
    """One JSON object per line, each line written by one append and synced: a crash mid-write leaves
    the earlier lines whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        for rec in records:
            os.write(fd, (json.dumps(rec) + "\n").encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def _unlogged_message(uri: str, what: str, path: Path, why: str | None = None) -> str:
    if why is None:  # a SQLite file is always there: what kept the values out is another process's lock
        why = "busy (locked by another process)" if uri.startswith("sqlite:") else "unreachable"
    return (f"[xmodal] MLflow at {uri} {why}: {what} not logged, saved to {path}; "
            f"replay them with {REPLAY_COMMAND} {path}")


def _first_line(e: Exception) -> str:
    """An error as one short line: MLflow's messages can carry a whole SQL statement."""
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:300]


def _say(message: str) -> None:
    """A worker's line reaches the driver through its stdout; a driver's goes through its console."""
    from xmodal.console import say

    say(message)


def _rejected(e: Exception) -> bool:
    """The server answered and refused the values (a bad key or value), as opposed to being away."""
    return getattr(e, "error_code", None) == "INVALID_PARAMETER_VALUE"


def _drop_logged(client, run_id: str, items: list) -> list:
    """`items` (mlflow Metric) less those whose (key, step) the run's history already holds: a retry or a
    replay after a partial success adds no duplicate."""
    seen = {k: {m.step for m in client.get_metric_history(run_id, k)} for k in {m.key for m in items}}
    return [m for m in items if m.step not in seen[m.key]]


class RunLogger:
    """Logs metrics into an existing run from a training worker (rank 0), in the background.

    `log` only queues (it never blocks or raises); a daemon thread sends the queue in order with
    `log_batch`. While the tracking server is unreachable (or its SQLite file locked) the thread keeps
    the batch and retries it (backoff 1 s growing to 10 s) for up to `outage_wait_s`; an outage longer
    than that sends each later batch to the spool file after one try, until a try succeeds again.
    Training goes on meanwhile and nothing is lost or reordered; `flush` (before every checkpoint) waits
    until everything queued so far is sent or spooled, and `close` spools what is left after its wait.
    The spool file is replayed into MLflow later with jobs/replay_tracking.py.

    After a restart, each metric's steps at or below its own last step already in MLflow (read by the
    thread, so that a worker restarted during an outage starts) are skipped, so a run's metric history
    has neither duplicates nor a restart nor a gap: a worker killed between sending a step's loss and
    its evaluation leaves that evaluation to the rerun of the step.
    """

    BATCH = 500  # MLflow's limit of metrics per log_batch

    def __init__(self, uri: str, run_id: str, system_metrics: bool = False,
                 spool: str | Path | None = None, outage_wait_s: float = 300.0):
        self.uri = uri
        self.run_id = run_id
        self.spool = Path(spool) if spool is not None else Path.cwd() / SPOOL_FILE
        self.outage_wait_s = outage_wait_s
        self.logged_steps: dict[str, int] | None = None  # each metric's last step in MLflow, once read
        self._queue: deque[tuple[str, float, int, int, bool]] = deque()  # key, value, ms, step, force
        self._inflight: list = []  # the batch being sent (mlflow Metric)
        self._inflight_n = 0  # the queued values it was taken from (those skipped as logged included)
        # Counted in queue order: values queued, and values settled (sent, skipped or spooled).
        self._queued = self._settled = 0
        self.spooled = 0  # values this logger wrote to the spool file
        self.batch_s: list[float] = []  # how long each batch took to send (the tracking benchmark's figure)
        self._outage_since: float | None = None  # when the failures of the current outage began
        self._given_up = False  # the current outage outlasted outage_wait_s: one try per batch
        self._cond = threading.Condition()
        self._closing = False
        self._abandoned = False
        self._error: Exception | None = None  # what stopped the thread, if anything did
        if self.spool.is_file():  # a worker restarted after an outage: say so before the run ends
            _say(f"[xmodal] {self.spool} holds metric values an earlier attempt of this run could not log to "
                 f"MLflow at {uri}; replay them with {REPLAY_COMMAND} {self.spool}")
        self._thread = threading.Thread(target=self._run, name="xmodal-mlflow-logger", daemon=True)
        self._thread.start()
        self._system = None
        if system_metrics:
            self._start_system_metrics()

    def _start_system_metrics(self) -> None:
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
        except ImportError:
            return
        try:
            # The run's own store: the default URI is a new mlflow.db in the worker's Ray session folder.
            self._system = SystemMetricsMonitor(self.run_id, resume_logging=True, tracking_uri=self.uri)
            self._system.start()
        except Exception as e:  # psutil missing or no permission: training goes on without them
            _say(f"[xmodal] system metrics unavailable: {e}")
            self._system = None

    def log(self, metrics: dict[str, float], step: int, force: bool = False) -> None:
        """Queue one step's metrics (sent in the background)."""
        ts = int(time.time() * 1000)
        with self._cond:
            if self._closing:
                return
            self._queue.extend((k, float(v), ts, step, force) for k, v in metrics.items())
            self._queued += len(metrics)
            self._cond.notify()

    def set_tag(self, key: str, value: str) -> None:
        set_tags(self.uri, self.run_id, {key: value})

    @property
    def client(self):
        return _client(self.uri)

    # ------------------------------------------------ the sending thread

    def _retrying(self, what) -> tuple[bool, Any]:
        """`what()` through the retry policy, for as long as the current outage may last
        (`outage_wait_s` from its first failure; one try once it has lasted longer) and the logger is
        not abandoned. Returns (whether it succeeded, its result)."""

        def pause(seconds: float) -> bool:  # woken early when `close` abandons the logger
            with self._cond:
                now = time.monotonic()
                if self._outage_since is None:
                    self._outage_since = now
                left = self.outage_wait_s - (now - self._outage_since)
                if self._given_up or left <= 0:
                    self._given_up = True
                    return False
                self._cond.wait_for(lambda: self._abandoned, timeout=min(seconds, left))
                return not self._abandoned

        if self._abandoned:
            return False, None
        done, out = _retried(self.uri, what, pause)
        if done:
            with self._cond:
                self._outage_since, self._given_up = None, False
        return done, out

    def _run(self) -> None:
        """The thread: never ends silently. An error no retry mends (`_permanent`: the run deleted, say)
        stops the sending; `flush` and `close` then write everything unsent to the spool file, and
        `close` says why."""
        try:
            self._sending()
        except Exception as e:
            with self._cond:
                self._error = e
        finally:
            with self._cond:
                self._cond.notify_all()

    def _sending(self) -> None:
        mlflow = _mlflow()
        client = None

        def connect():
            # The client too is made inside the retry: opening the store is the call most likely to meet
            # a locked database (a new worker's first contact) or an unreachable server.
            c = _client(self.uri)
            keys = c.get_run(self.run_id).data.metrics
            return c, {k: max((m.step for m in c.get_metric_history(self.run_id, k)), default=-1) for k in keys}

        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closing or self._abandoned)
                if self._abandoned or not self._queue:
                    return
            if client is None:
                done, out = self._retrying(connect)
                if not done:
                    # The history is unknown: everything queued is spooled (replay skips what the run has).
                    with self._cond:
                        if self._abandoned:
                            return
                        self._spool_left()
                        self._cond.notify_all()
                    continue
                client, self.logged_steps = out
            with self._cond:
                if self._abandoned:
                    return
                batch, taken = [], 0
                while self._queue and len(batch) < self.BATCH:
                    k, v, ts, step, force = self._queue.popleft()
                    taken += 1
                    if force or step > self.logged_steps.get(k, -1):
                        batch.append(mlflow.entities.Metric(k, v, ts, step))
                self._inflight, self._inflight_n = batch, taken
            t0 = time.perf_counter()
            sent = not batch or self._send(client, batch)
            if batch and sent:
                self.batch_s.append(time.perf_counter() - t0)
            with self._cond:
                if self._abandoned:  # `close` spooled the batch
                    return
                if not sent:
                    self._write_spool([[m.key, m.value, m.timestamp, m.step] for m in batch])
                self._inflight, self._inflight_n = [], 0
                self._settled += taken
                self._cond.notify_all()

    def _send(self, client, batch: list) -> bool:
        failed = False

        def send() -> bool:
            nonlocal failed
            try:
                # After a failure the batch may have reached the server all the same (a lost reply).
                todo = _drop_logged(client, self.run_id, batch) if failed else batch
                try:
                    if todo:
                        client.log_batch(self.run_id, metrics=todo)
                except Exception as e:
                    if not _rejected(e):
                        raise
                    # The server rejects some values themselves: a retry cannot help, and it would hold
                    # up every later metric. The others go one by one; the bad ones are said and dropped.
                    for m in todo:
                        try:
                            client.log_batch(self.run_id, metrics=[m])
                        except Exception as e1:
                            if not _rejected(e1):
                                raise
                            _say(f"[xmodal] MLflow rejected {m.key}={m.value} at step {m.step}, not logged: {e1}")
                return True
            except Exception:
                failed = True
                raise

        return self._retrying(send)[0]

    def _write_spool(self, items: list[list]) -> None:
        """Append metric items to the spool file (under the lock: one writer at a time, in order)."""
        if items:
            _append_spool(self.spool, [{"op": "metrics", "uri": self.uri, "run_id": self.run_id,
                                        "items": items[i:i + 1000]} for i in range(0, len(items), 1000)])
            self.spooled += len(items)

    def _spool_left(self) -> None:
        """The batch in flight and everything queued, to the spool file, settled (under the lock)."""
        items = [[m.key, m.value, m.timestamp, m.step] for m in self._inflight]
        logged = self.logged_steps
        items += [[k, v, ts, step] for k, v, ts, step, force in self._queue
                  if force or logged is None or step > logged.get(k, -1)]
        self._settled += self._inflight_n + len(self._queue)
        self._inflight, self._inflight_n = [], 0
        self._queue.clear()
        self._write_spool(items)

    def flush(self) -> bool:
        """Wait until every value queued so far is sent to MLflow or written to the spool file, however
        long that takes: called before a checkpoint is reported, so that a worker killed after it loses
        no metric of the steps that checkpoint holds. The wait is bounded by the retry policy: an
        outage longer than `outage_wait_s` (from its first failure) spools (plus, when the server went
        away during a request, MLflow's own retries of that request). Returns whether nothing queued
        since the previous flush went to the spool file."""
        with self._cond:
            target, spooled = self._queued, self.spooled
            self._cond.wait_for(lambda: self._settled >= target or self._abandoned or not self._thread.is_alive())
            if self._settled < target and not self._abandoned:  # the thread was stopped by an error
                self._spool_left()
            return self.spooled == spooled

    # ------------------------------------------------ the end

    def close(self, timeout_s: float | None = None) -> Path | None:
        """Wait up to `timeout_s` (default `outage_wait_s`) for the queue to be sent; what is left goes
        to the spool file. One line says how many values this logger spooled over the run, if any.
        Returns the spool file if written."""
        if self._system is not None:
            self._system.finish()
            self._system = None
        wait = self.outage_wait_s if timeout_s is None else timeout_s
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(wait)
        # Whatever the thread left, whether it is still retrying (abandoned now) or was stopped by an
        # error, goes to the spool file; a thread that ended normally left nothing.
        with self._cond:
            self._abandoned = True
            self._cond.notify_all()
            self._spool_left()
        if not self.spooled:
            return None
        why = None if self._error is None else f"failed ({_first_line(self._error)})"
        _say(_unlogged_message(self.uri, f"{self.spooled} metric values", self.spool, why))
        return self.spool


class Outbox:
    """The driver's last calls of a run (artifacts, final status) through a tracking server that may be
    down: each is retried until a deadline shared by all (`wait_s` from the first failure); once it has
    passed, that call and every later one is appended to the spool file instead, in order. Files are
    copied next to the spool file (`mlflow_unlogged/`): checkpoints and temp folders may go away."""

    def __init__(self, uri: str, run_id: str, spool: str | Path, wait_s: float):
        self.uri, self.run_id, self.spool, self.wait_s = uri, run_id, Path(spool), wait_s
        self.deadline: float | None = None
        self.spooled: list[str] = []

    def _call(self, what, record) -> None:
        """`what()`, retried until the deadline; else `record()` (a spool record) is appended."""

        def pause(seconds: float) -> bool:  # the deadline starts at the first failure of any call
            now = time.monotonic()
            self.deadline = self.deadline if self.deadline is not None else now + self.wait_s
            if now >= self.deadline:
                return False
            time.sleep(min(seconds, self.deadline - now))
            return True

        # Once one call was given up on, the later ones follow it into the spool file (order).
        if not self.spooled and _retried(self.uri, what, pause)[0]:
            return
        rec = record()
        _append_spool(self.spool, [{"op": rec["op"], "uri": self.uri, "run_id": self.run_id, **rec}])
        self.spooled.append(rec["op"])

    def artifact(self, local_path: str | Path, artifact_path: str | None = None) -> None:
        def record() -> dict[str, Any]:  # a copy, made only when the call is given up on
            keep = self.spool.parent / "mlflow_unlogged" / (artifact_path or "") / Path(local_path).name
            keep.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(local_path, keep)
            return {"op": "artifact", "path": str(keep), "artifact_path": artifact_path}

        self._call(lambda: _log_artifact(self.uri, self.run_id, local_path, artifact_path), record)

    def tags(self, tags: dict[str, str]) -> None:
        self._call(lambda: _set_tags(self.uri, self.run_id, tags), lambda: {"op": "tags", "tags": dict(tags)})

    def metrics(self, metrics: dict[str, float], step: int = 0) -> None:
        ts = int(time.time() * 1000)
        self._call(lambda: log_metrics(self.uri, self.run_id, metrics, step),
                   lambda: {"op": "metrics", "items": [[k, float(v), ts, step] for k, v in metrics.items()]})

    def terminated(self, status: str) -> None:
        self._call(lambda: _set_terminated(self.uri, self.run_id, status),
                   lambda: {"op": "terminated", "status": status})

    def report(self) -> None:
        """One line if anything went to the spool file."""
        if self.spooled:
            what = f"{len(self.spooled)} end-of-run records ({', '.join(dict.fromkeys(self.spooled))})"
            _say(_unlogged_message(self.uri, what, self.spool))


@dataclass(frozen=True)
class ReplaySummary:
    """What `replay` did: metric values logged and skipped (already in the run), artifacts, statuses."""

    path: Path  # the file as renamed after the replay
    runs: tuple[str, ...]
    metrics_logged: int
    metrics_skipped: int
    artifacts: int
    terminated: int


def read_spool(path: str | Path) -> list[dict[str, Any]]:
    """Every record of a spool file, all checked first; a UserError names the file, the line and what
    was expected."""
    p = Path(path)
    if p.is_dir():
        raise UserError(f"{p}: is a directory; expected the {SPOOL_FILE} file in it or another spool file")
    if not p.is_file():
        raise UserError(f"{p}: no such file; expected a {SPOOL_FILE} written by a run that could not reach its "
                        "tracking server")
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start}); expected a {SPOOL_FILE} (one JSON "
                        "object a line)") from None
    records = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{p}, line {n}"
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{where}: not valid JSON ({e.msg}); expected one JSON object per line") from None
        if not isinstance(rec, dict) or rec.get("op") not in _SPOOL_OPS:
            op = rec.get("op") if isinstance(rec, dict) else rec
            raise UserError(f"{where}: unknown op {op!r}; expected an object with op one of "
                            f"{', '.join(_SPOOL_OPS)}")
        for key in ("uri", "run_id", *_SPOOL_OPS[rec["op"]]):
            if not rec.get(key):
                raise UserError(f"{where}: op {rec['op']!r} without {key!r}")
            if key != "items" and not isinstance(rec[key], str):
                raise UserError(f"{where}: {key!r} is {rec[key]!r}; expected a string")
        if rec["op"] == "artifact" and not isinstance(rec.get("artifact_path"), str | None):
            raise UserError(f"{where}: 'artifact_path' is {rec['artifact_path']!r}; expected a string or null")
        if rec["op"] == "metrics":
            if not isinstance(rec["items"], list):
                raise UserError(f"{where}: 'items' is {rec['items']!r:.60}; expected a list of "
                                "[key, value, timestamp_ms, step]")
            for item in rec["items"]:
                if not (isinstance(item, list) and len(item) == 4 and isinstance(item[0], str)
                        and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in item[1:])):
                    raise UserError(f"{where}: metric item {item!r}; expected [key, value, timestamp_ms, step]")
        elif rec["op"] == "artifact" and not Path(rec["path"]).is_file():
            raise UserError(f"{where}: artifact file {rec['path']!r} does not exist")
        elif rec["op"] == "tags" and not (isinstance(rec["tags"], dict)
                                          and all(isinstance(v, str) for v in rec["tags"].values())):
            raise UserError(f"{where}: tags {rec['tags']!r}; expected an object of string values")
        elif rec["op"] == "terminated" and rec["status"] not in ("FINISHED", "FAILED", "KILLED"):
            raise UserError(f"{where}: status {rec['status']!r}; expected FINISHED, FAILED or KILLED")
        records.append(rec)
    if not records:
        raise UserError(f"{p}: holds no record; expected a {SPOOL_FILE} written by a run that could not reach its "
                        "tracking server (one JSON object a line)")
    return records


def replay(path: str | Path, tracking_uri: str | None = None) -> ReplaySummary:
    """Send a spool file's records to MLflow in order (into `tracking_uri` if given, else the URI each
    record names), then rename the file to `*.replayed`. Idempotent: a metric value whose (key, step)
    the run already has is skipped, so replaying twice adds no duplicate."""
    p = Path(path)
    records = read_spool(p)  # the whole file checked before anything is sent
    uri_of = {r["uri"]: resolve_tracking_uri(tracking_uri) if tracking_uri else r["uri"] for r in records}
    for uri in dict.fromkeys(uri_of.values()):
        if uri.startswith(("http://", "https://")) and not reachable(uri):
            raise UserError(f"{p}: MLflow at {uri} is unreachable; start it (or pass --tracking-uri) and replay again")
        try:
            check_existing_store(uri)  # replay logs into the run's store; it never creates one
        except UserError as e:
            raise UserError(f"{p}: cannot replay into {uri}: {e} (replay never creates a tracking store: pass the "
                            "one that holds the run with --tracking-uri)") from None
    # Every run checked before the first record is sent: MLflow refuses values for a run that is not
    # there or is deleted, and a replay that stopped at the second run would leave the first one's
    # records logged and the file half-replayed.
    runs = list(dict.fromkeys((uri_of[r["uri"]], r["run_id"]) for r in records))
    line_of = {}
    for n, rec in enumerate(records, 1):
        line_of.setdefault((uri_of[rec["uri"]], rec["run_id"]), n)
    others = f" ({len(runs)} runs in the file)" if len(runs) > 1 else ""
    for uri, run_id in runs:
        where = f"{p}: record {line_of[uri, run_id]}{others}: run {run_id!r}"
        try:
            found = get_run(uri, run_id)
        except RunNotFound:
            raise UserError(f"{where} is not in {uri}; nothing was replayed; pass the tracking store that holds it "
                            "with --tracking-uri") from None
        if found.lifecycle_stage != "active":
            raise UserError(f"{where} is deleted in {uri}, so MLflow takes no values for it; nothing was replayed; "
                            f"restore it (mlflow runs restore --run-id {run_id}, with MLFLOW_TRACKING_URI={uri}) and "
                            "replay again") from None
    mlflow = _mlflow()
    from mlflow.exceptions import MlflowException

    logged = skipped = artifacts = terminated = 0
    for n, rec in enumerate(records, 1):
        uri, run_id = uri_of[rec["uri"]], rec["run_id"]
        try:
            if rec["op"] == "metrics":
                unique = {(k, int(step)): mlflow.entities.Metric(k, float(v), int(ts), int(step))
                          for k, v, ts, step in reversed(rec["items"])}  # a repeated (key, step): the first wins
                items = sorted(unique.values(), key=lambda m: (m.step, m.timestamp))
                todo = _waited(uri, f"reading the metrics of run {run_id}",
                               lambda u=uri, r=run_id, i=items: _drop_logged(_client(u), r, i))
                for i in range(0, len(todo), RunLogger.BATCH):
                    _log_batch_once(uri, run_id, todo[i:i + RunLogger.BATCH], f"replaying metrics into run {run_id}")
                logged, skipped = logged + len(todo), skipped + len(rec["items"]) - len(todo)
            elif rec["op"] == "artifact":
                log_artifact(uri, run_id, rec["path"], rec.get("artifact_path"))
                artifacts += 1
            elif rec["op"] == "tags":
                set_tags(uri, run_id, rec["tags"])
            else:
                set_terminated(uri, run_id, rec["status"])
                terminated += 1
        except MlflowException as e:  # refused after the checks above (the run deleted meanwhile, say)
            raise UserError(f"{p}: record {n} of {len(records)} ({rec['op']}, run {run_id!r}) refused by MLflow at "
                            f"{uri} ({_first_line(e)}); the records before it were sent and the file is kept: "
                            "replaying it again skips the metric values the runs already hold") from None
    done = p if p.name.endswith(".replayed") else p.rename(p.with_name(p.name + ".replayed"))
    return ReplaySummary(done, tuple(r for _, r in runs), logged, skipped, artifacts, terminated)


# The calls below, as `Outbox` makes them: one attempt each, inside its own retry (`_retried`).


def _log_artifact(uri: str, run_id: str, local_path: str | Path, artifact_path: str | None = None) -> None:
    _client(uri).log_artifact(run_id, str(local_path), artifact_path)


def _set_terminated(uri: str, run_id: str, status: str) -> None:
    _client(uri).set_terminated(run_id, status=status)


def _set_tags(uri: str, run_id: str, tags: dict[str, str]) -> None:
    c = _client(uri)
    for k, v in tags.items():  # setting a tag again to the same value is harmless: retried whole
        c.set_tag(run_id, k, str(v))


def log_artifacts(uri: str, run_id: str, local_dir: str | Path, artifact_path: str | None = None) -> None:
    _waited(uri, f"logging artifacts from {local_dir}",
            lambda: _client(uri).log_artifacts(run_id, str(local_dir), artifact_path))


def log_artifact(uri: str, run_id: str, local_path: str | Path, artifact_path: str | None = None) -> None:
    _waited(uri, f"logging artifact {local_path}", lambda: _log_artifact(uri, run_id, local_path, artifact_path))


def set_terminated(uri: str, run_id: str, status: str = "FINISHED") -> None:
    _waited(uri, f"marking run {run_id} {status}", lambda: _set_terminated(uri, run_id, status))


def set_tags(uri: str, run_id: str, tags: dict[str, str]) -> None:
    _waited(uri, f"setting tags of run {run_id}", lambda: _set_tags(uri, run_id, tags))


def mark_running(uri: str, run_id: str) -> None:
    """Re-open a run that a dead driver left FAILED/KILLED, when it is resumed."""
    _waited(uri, f"resuming run {run_id}", lambda: _client(uri).update_run(run_id, status="RUNNING"))


# ---------------------------------------------------------------- sweeps and reports (xmodal.sweep, xmodal.report)


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


def log_metrics(uri: str, run_id: str, metrics: dict[str, float], step: int = 0) -> None:
    """Metrics of an existing run at one step. A batch retried after a failure first drops what its
    lost reply may have logged all the same, so no value appears twice."""
    mlflow = _mlflow()
    ts = int(time.time() * 1000)
    items = [mlflow.entities.Metric(k, float(v), ts, step) for k, v in metrics.items()]
    for i in range(0, len(items), RunLogger.BATCH):
        _log_batch_once(uri, run_id, items[i:i + RunLogger.BATCH], f"logging metrics of run {run_id}")


def _log_batch_once(uri: str, run_id: str, batch: list, doing: str) -> None:
    """`batch` (mlflow Metric) logged through `_waited`, each value once however many tries it took."""
    tried = False

    def send() -> None:
        nonlocal tried
        c = _client(uri)
        todo = _drop_logged(c, run_id, batch) if tried else batch
        tried = True
        if todo:
            c.log_batch(run_id, metrics=todo)

    _waited(uri, doing, send)


def log_params(uri: str, run_id: str, params: dict[str, Any]) -> None:
    """Params of an existing run (logging one again with the same value is allowed; another value is not)."""
    mlflow = _mlflow()
    items = [mlflow.entities.Param(k, str(v)[:6000]) for k, v in params.items()]
    for i in range(0, len(items), 100):
        _waited(uri, f"logging params of run {run_id}",
                lambda batch=items[i:i + 100]: _client(uri).log_batch(run_id, params=batch))


def download_artifacts(uri: str, run_id: str, artifact_path: str, dst_dir: str | Path) -> Path:
    """Copy a run's artifact (file or folder) into `dst_dir`; returns the local path."""
    Path(dst_dir).mkdir(parents=True, exist_ok=True)
    return Path(_waited(uri, f"downloading {artifact_path} of run {run_id}",
                        lambda: _client(uri).download_artifacts(run_id, artifact_path, str(dst_dir))))


@dataclass(frozen=True)
class LoggedModel:
    """A logged model read back (`load_logged_model`): the module, the config logged beside it, and
    the run that logged it."""

    module: Any  # the nn.Module, unpickled
    config: dict[str, Any] | None  # extra_files/config.yaml
    run_id: str | None
    path: Path  # the downloaded model folder


def load_logged_model(uri: str, model_uri: str, dst_dir: str | Path) -> LoggedModel:
    """Read only: a model `log_pytorch_model` logged (`models:/<model id>` or `runs:/<run id>/<name>`,
    e.g. `runs:/<run id>/final_model`), found in the store at `uri`, downloaded from its artifact
    location into `dst_dir` and unpickled by `mlflow.pytorch` (the pickle refers to xmodal's classes:
    only load models of your own runs). An unknown URI or a folder that is no pytorch model is a
    UserError naming it. (MLflow's own `runs:/` resolution looks the model up through the process's
    global tracking URI, so the lookup is made here, in this store.)"""
    import yaml

    mlflow = _mlflow()

    def find():
        client = _client(uri)
        if model_uri.startswith("models:/"):
            wanted = f"model_id = '{model_uri[len('models:/'):].strip('/')}'"
        elif model_uri.startswith("runs:/") and model_uri[len("runs:/"):].count("/") == 1:
            run_id, name = model_uri[len("runs:/"):].split("/")
            wanted = f"name = '{name}' AND source_run_id = '{run_id}'"
        else:
            return None
        experiments = [e.experiment_id for e in client.search_experiments()]
        found = client.search_logged_models(experiments, filter_string=wanted) if experiments else []
        return max(found, key=lambda m: m.creation_timestamp) if found else None

    if not model_uri.startswith(("models:/", "runs:/")):
        raise UserError(f"logged model {model_uri!r}: expected models:/<model id> or runs:/<run id>/final_model")
    try:
        logged = _waited(uri, f"looking up model {model_uri}", find)
    except UserError:
        raise
    except Exception as e:  # a permanent MLflow error: a malformed id in the search filter
        raise UserError(f"logged model {model_uri!r}: cannot be looked up at {uri} ({_first_line(e)})") from None
    if logged is None:
        raise UserError(f"logged model {model_uri!r}: no such model at {uri}; expected models:/<model id> or "
                        "runs:/<run id>/final_model of a finished xmodal run")
    Path(dst_dir).mkdir(parents=True, exist_ok=True)
    try:
        local = Path(mlflow.artifacts.download_artifacts(artifact_uri=logged.artifact_location, dst_path=str(dst_dir)))
        from mlflow.models import Model

        Model.load(str(local))
        module = mlflow.pytorch.load_model(str(local), map_location="cpu")
    except Exception as e:  # the artifacts gone, a missing MLmodel, another flavour
        raise UserError(f"logged model {model_uri!r} at {uri}: cannot be read from {logged.artifact_location} "
                        f"({_first_line(e)}); expected a model of an xmodal run") from None
    found = sorted(local.rglob("config.yaml"))
    config = yaml.safe_load(found[0].read_text()) if found else None
    return LoggedModel(module, config, logged.source_run_id, local)


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


# ---------------------------------------------------------------- the Model Registry


@dataclass(frozen=True)
class ModelVersion:
    """One version of a registered model, as plain data."""

    name: str
    version: int
    model_id: str | None  # the logged model it registers
    run_id: str | None
    aliases: tuple[str, ...]
    tags: dict[str, str] = field(default_factory=dict, hash=False)


def run_model_id(uri: str, run_id: str, name: str = LOGGED_MODEL) -> str | None:
    """The id of the logged model `name` the run logged (its latest, by step), None if it logged none."""
    def find() -> str | None:
        client = _client(uri)
        run = client.get_run(run_id)
        outputs = sorted(run.outputs.model_outputs if run.outputs else [], key=lambda o: o.step)
        for out in reversed(outputs):
            if client.get_logged_model(out.model_id).name == name:
                return out.model_id
        return None

    return _waited(uri, f"finding the logged model of run {run_id}", find)


def register_model(uri: str, name: str, model_id: str, run_id: str, alias: str | None = None,
                   tags: dict[str, str] | None = None) -> ModelVersion:
    """Register the logged model `model_id` (of run `run_id`) as a new version of the registered model
    `name`, created if new, with `tags` on the version and `alias` (e.g. "best") pointed at it: then
    `mlflow.pytorch.load_model(f"models:/{name}@{alias}")` loads it. Each MLflow call is retried on its
    own, as in `log_pytorch_model`."""
    from mlflow.exceptions import MlflowException

    doing = f"registering model {name!r}"

    def call(method: str, *args, **kwargs):
        return _waited(uri, doing, lambda: getattr(_client(uri), method)(*args, **kwargs))

    try:
        call("create_registered_model", name)
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise UserError(f"MLflow at {uri}: {doing}: {_first_line(e)}") from None
    version = call("create_model_version", name, source=f"models:/{model_id}", run_id=run_id, tags=tags or None,
                   model_id=model_id)
    if alias:
        call("set_registered_model_alias", name, alias, version.version)
    return get_model_version(uri, name, alias) if alias else get_model_version(uri, name, int(version.version))


def get_model_version(uri: str, name: str, version_or_alias: int | str) -> ModelVersion:
    """A registered model's version by number, or by alias (a string)."""
    def get():
        client = _client(uri)
        if isinstance(version_or_alias, str):
            return client.get_model_version_by_alias(name, version_or_alias)
        return client.get_model_version(name, str(version_or_alias))

    v = _waited(uri, f"reading model {name!r} version {version_or_alias!r}", get)
    # A SQLite store leaves the version's model_id empty; its source names the logged model.
    model_id = getattr(v, "model_id", None) or (v.source[len("models:/"):] if v.source.startswith("models:/") else None)
    return ModelVersion(name=v.name, version=int(v.version), model_id=model_id, run_id=v.run_id,
                        aliases=tuple(v.aliases or ()), tags=dict(v.tags or {}))
