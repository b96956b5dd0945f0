"""The one retry policy of every MLflow call (`_retried`), bounded in time: a busy SQLite database or an
unreachable server is waited out for up to the URI's `mlflow.outage_wait_s` (`set_outage_wait`, default
`WAIT_S`); an error no wait mends is raised at once (`_permanent`), and so is a refused connection to a
server this process never reached (`check_server`). `_waited` is how every call but the run logger's and
the outbox's uses it: a bounded wait, then a UserError that says what to do."""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

from xmodal.base.errors import UserError


def _first_line(e: Exception) -> str:
    """An error as one short line: MLflow's messages can carry a whole SQL statement."""
    text = str(e).strip()
    return (text.splitlines()[0] if text else type(e).__name__)[:300]


def _say(message: str) -> None:
    """A worker's line reaches the driver through its stdout; a driver's goes through its console."""
    from xmodal.base.console import say

    say(message)


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
# "int too large" is the value itself (a step or timestamp past 64 bits): sqlite3 says it before the
# database is touched, so a lock or an outage never reads so.
_PERMANENT_SQLITE = ("file is not a database", "database disk image is malformed", "unable to open database file",
                     "out-of-date database schema", "Python int too large to convert to SQLite INTEGER")
# MLflow's own check of an artifact folder, made in this process before any upload (its artifact
# repositories' verify_artifact_path), under the code INTERNAL_ERROR, which an outage uses too: so the
# message, which nothing else writes, not the code.
_PERMANENT_MESSAGES = ("Invalid artifact path: ",)


def _permanent(e: Exception) -> bool:
    """Whether `e` says the call itself is wrong (raised) rather than the store busy or away (retried)."""
    if getattr(e, "error_code", None) in _PERMANENT_CODES:
        return True
    text = str(e)
    return any(m in text for m in _PERMANENT_SQLITE) or text.startswith(_PERMANENT_MESSAGES)


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
