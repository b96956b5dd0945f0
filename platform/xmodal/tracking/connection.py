"""The tracking store: its URI (`resolve_tracking_uri`), the check that it exists before it is read
(`check_existing_store`), where a SQLite experiment keeps its artifacts, MLflow's client (`_client`, one
per URI and process) and a SQLite database's first contact, serialised across processes by a file lock
(`sqlite_lock_path`; MLflow creates and migrates the schema without one); and where the MLflow UI shows
a run (`run_url`, `ui_command`)."""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import tempfile
import threading
import urllib.parse
from pathlib import Path
from typing import Any

from xmodal.base.errors import UserError
from xmodal.base.run_tags import EXAMPLES, EXAMPLES_SUMMARY
from xmodal.tracking.retry import _waited, reachable


def _mlflow():
    try:
        import mlflow
    except ImportError as e:  # pragma: no cover - mlflow is a runtime dependency
        raise ImportError("xmodal.tracking needs mlflow: pip install 'mlflow>=3'") from e
    return mlflow


def resolve_tracking_uri(uri: str | None, option: str = "mlflow.tracking_uri") -> str:
    """Explicit config > $MLFLOW_TRACKING_URI > ./mlflow.db. Relative SQLite paths become absolute,
    because Train workers run in a Ray session folder, not the job's working directory. `option`: how
    the explicit value was given (the config key, or a command's `--tracking-uri`), which errors name.
    An empty flag is an error: taken for none, it would fall back on another database than the one named."""
    if option.startswith("--") and uri is not None and not uri.strip():
        raise UserError(f"{option}: {uri!r} is empty; expected an MLflow URI such as sqlite:///PATH or "
                        "http(s)://HOST:PORT (or leave the option out: $MLFLOW_TRACKING_URI, else ./mlflow.db)")
    named = option if uri else "MLFLOW_TRACKING_URI" if os.environ.get("MLFLOW_TRACKING_URI") else option
    uri = uri or os.environ.get("MLFLOW_TRACKING_URI") or "sqlite:///mlflow.db"
    if uri.startswith("sqlite:///") and not uri.startswith("sqlite:////"):
        uri = "sqlite:///" + str(Path(uri[len("sqlite:///"):]).resolve())
    elif "://" not in uri:
        raise UserError(f"{named}: {uri!r} has no scheme; expected sqlite:///PATH (a database file: sqlite:///{uri}), "
                        "http(s)://HOST:PORT or another MLflow URI scheme")
    elif uri.startswith("sqlite:") and not uri.startswith("sqlite:///"):  # `sqlite://`: a database in memory
        raise UserError(f"{named}: {uri!r} is not a SQLite database file; expected sqlite:///RELATIVE/PATH or "
                        "sqlite:////ABSOLUTE/PATH")
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


def _client(uri: str):
    """MLflow's client, for the functions of xmodal.tracking only: other modules call those, so that
    mlflow is imported in this package and nowhere else (the import contract in pyproject.toml). Building
    one opens the store (for SQLite: creates or migrates the schema), so callers build it inside the retry
    policy.
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
        run = _run_or_none(uri, run_id)
        if run is None:  # the address is a convenience: the run id is printed beside it
            return f"{base}/#/runs/{run_id}"
        experiment_id = run.info.experiment_id
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}{TRAINING_VIEW_QUERY}"


def _run_or_none(uri: str, run_id: str):
    """MLflow's run, waited for a few seconds at most; None when the store does not answer."""
    try:
        return _waited(uri, f"reading run {run_id}", lambda: _client(uri).get_run(run_id), wait_s=5)
    except Exception:
        return None


def ui_command(uri: str, run_id: str | None = None) -> str:
    """How to see the store in the MLflow UI: `mlflow ui` for a SQLite file, the server's address
    otherwise. With `run_id`, the run's page too (`run_url`), on a second line indented as the rows of
    the run's end summary (`console.end_summary`), and, where the run has example pages
    (`run_tags.EXAMPLES`), a line saying what they show and the UI's address of their index."""
    if run_id is None:
        if uri.startswith("sqlite:"):
            return f"mlflow ui --backend-store-uri {uri}"
        page = f"{uri.rstrip('/')}/#/experiments{TRAINING_VIEW_QUERY}"
        return f"open {page} in a browser (MLflow server){_through_tunnel(uri, page)}"
    run = _run_or_none(uri, run_id)
    page = run_url(uri, run_id, run.info.experiment_id if run is not None else None)
    if uri.startswith("sqlite:"):
        text = f"mlflow ui --backend-store-uri {uri}\n  then open   {page}"
    else:
        text = f"open {page} in a browser (MLflow server){_through_tunnel(uri, page)}"
    tags = run.data.tags if run is not None else {}
    if tags.get(EXAMPLES) and tags.get(EXAMPLES_SUMMARY):
        at, _, query = page.partition("?")
        text += f"\n  pages       {tags[EXAMPLES_SUMMARY]}: {at}/artifacts/{tags[EXAMPLES]}{'?' + query if query else ''}"
    return text


def _through_tunnel(uri: str, page: str) -> str:
    """On a cluster's node (node_env.sh's XMODAL_HEAD_IP), a server at the head's private address opens
    from the cluster's network only; from a user's computer, through the SSH tunnel docs/cluster.md
    opens (`ray attach CONFIG -p PORT`): that page's address there, on a second line, else nothing."""
    parts = urllib.parse.urlsplit(uri)
    if not os.environ.get("XMODAL_HEAD_IP") or parts.hostname != os.environ["XMODAL_HEAD_IP"] or parts.port is None:
        return ""
    local = page.replace(f"{parts.scheme}://{parts.netloc}", f"http://127.0.0.1:{parts.port}", 1)
    return f"\n  or open    {local} through the SSH tunnel (`ray attach CLUSTER.yaml -p {parts.port}`)"
