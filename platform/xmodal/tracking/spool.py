"""The spool file: what a run could not log to MLflow (metric values, its last calls), one JSON object a
line (`SPOOL_FILE`, where: `spool_path`), and its replay (`replay`, jobs/replay_tracking.py): the whole
file and every run it names checked before the first record is sent, each value the run already holds
skipped."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from xmodal.base.errors import UserError
from xmodal.base.outputs import Output
from xmodal.tracking.connection import _client, _mlflow, check_existing_store, resolve_tracking_uri
from xmodal.tracking.reads import RunNotFound, get_run
from xmodal.tracking.retry import _first_line, _waited, reachable
from xmodal.tracking.runs import (
    _METRICS_PER_BATCH,
    _drop_logged,
    _log_batch_once,
    log_artifact,
    set_tags,
    set_terminated,
)

SPOOL_FILE = "mlflow_unlogged.jsonl"
REPLAY_COMMAND = "python jobs/replay_tracking.py"
# Each op's keys besides `op`, `uri` and `run_id`, as tracking/logger.py writes them (RunLogger: metrics;
# Outbox: all four); read_spool checks each against what MLflow accepts.
_SPOOL_OPS = {"metrics": ("items",), "artifact": ("path",), "tags": ("tags",), "terminated": ("status",)}
_STATUSES = ("FINISHED", "FAILED", "KILLED")
# MLflow stores steps and timestamps as 64-bit integers: a larger one fails in the database (SQLite: "Python
# int too large", which looks like any other database error) and a fractional one is truncated silently.
_INT64 = (-2 ** 63, 2 ** 63 - 1)
_KEY_MAX = 250  # MLflow's longest metric or tag key (MAX_ENTITY_KEY_LENGTH), refused beyond it, not cut
_METRIC_ITEM = "[key, value, timestamp_ms, step]"


def spool_path(storage: str, run_name: str) -> Path:
    """Where a run writes what it could not log: `<storage>/<run_name>/mlflow_unlogged.jsonl` when the
    checkpoint storage is local, else this machine's temp folder (remote storage is not a file)."""
    root = Path(storage) if "://" not in storage else Path(tempfile.gettempdir()) / "xmodal-runs"
    return root / run_name / SPOOL_FILE


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


@dataclass(frozen=True)
class ReplaySummary:
    """What `replay` did: metric values logged and skipped (already in the run), artifacts, statuses, tag
    records."""

    path: Path  # the file as renamed after the replay
    runs: tuple[str, ...]
    metrics_logged: int
    metrics_skipped: int
    artifacts: int
    terminated: int
    tags: int


def _shown(value: Any, limit: int = 80) -> str:
    """A value as an error line shows it: its repr, cut short when long (a 9000-character tag value
    would bury what the line says)."""
    text = repr(value)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _int64(x: Any) -> bool:
    """A JSON integer MLflow can store: not a float (a fractional step would be truncated), not a bool."""
    return isinstance(x, int) and not isinstance(x, bool) and _INT64[0] <= x <= _INT64[1]


def _key_problem(key: Any) -> str | None:
    """Why MLflow would refuse `key` as a metric or tag key, or None. MLflow's own rules: it refuses such
    a key only when the record is sent, after the records before it were."""
    from mlflow.utils.validation import path_not_unique, validate_param_and_metric_name

    if not isinstance(key, str) or not key:
        return "expected a non-empty string"
    if len(key) > _KEY_MAX:
        return f"expected at most {_KEY_MAX} characters (MLflow's limit), not {len(key)}"
    if not validate_param_and_metric_name(key):
        return "expected letters, digits and _ - . : / or spaces only (MLflow's rule for keys)"
    if path_not_unique(key):
        return "expected a normalized relative path: no '.' or '..' part, no '//', no leading or trailing '/'"
    return None


def _check_metric_item(where: str, n: int, item: Any) -> None:
    at = f"{where}: metric item {n} {_shown(item)}"
    if not (isinstance(item, list) and len(item) == 4):
        raise UserError(f"{at}; expected {_METRIC_ITEM}")
    key, value, timestamp, step = item
    if (problem := _key_problem(key)) is not None:
        raise UserError(f"{at}: key {_shown(key)}; {problem}")
    # JSON's NaN and Infinity are numbers too: a diverged loss is logged as such
    if not (isinstance(value, float) or isinstance(value, int) and not isinstance(value, bool)
            and abs(value) <= sys.float_info.max):
        raise UserError(f"{at}: value {_shown(value)}; expected a number (MLflow stores a 64-bit float)")
    if not (_int64(timestamp) and timestamp >= 0):
        raise UserError(f"{at}: timestamp_ms {_shown(timestamp)}; expected a whole number of milliseconds from 0 "
                        f"to {_INT64[1]} (MLflow stores a 64-bit integer)")
    if not _int64(step):
        raise UserError(f"{at}: step {_shown(step)}; expected a whole number from {_INT64[0]} to {_INT64[1]} "
                        "(MLflow stores a 64-bit integer)")


def _check_artifact(where: str, rec: dict[str, Any]) -> None:
    from mlflow.utils.validation import path_not_unique

    if not Path(rec["path"]).is_file():
        raise UserError(f"{where}: artifact file {_shown(rec['path'])} does not exist")
    folder = rec.get("artifact_path")
    # MLflow refuses a folder that would resolve elsewhere (its "Invalid artifact path"); empty or null
    # is the run's artifact root
    if not (folder is None or isinstance(folder, str) and not (folder and path_not_unique(folder))):
        raise UserError(f"{where}: 'artifact_path' is {_shown(folder)}; expected null or a folder inside the run's "
                        "artifacts: a normalized relative path, no '.' or '..' part, no '//', no leading or "
                        "trailing '/'")


def _check_tags(where: str, tags: Any) -> None:
    if not isinstance(tags, dict):
        raise UserError(f"{where}: 'tags' is {_shown(tags)}; expected an object of tag names to string values")
    for key, value in tags.items():
        if (problem := _key_problem(key)) is not None:
            raise UserError(f"{where}: tag key {_shown(key)}; {problem}")
        if not isinstance(value, str):  # an over-long value is cut by MLflow, as when the run set it
            raise UserError(f"{where}: tag {_shown(key)} is {_shown(value)}; expected a string")


def _check_record(where: str, rec: Any) -> None:
    """One record, as `replay` sends it: a UserError names the line, the key, the value and what was
    expected."""
    if not isinstance(rec, dict) or rec.get("op") not in _SPOOL_OPS:
        op = rec.get("op") if isinstance(rec, dict) else rec
        raise UserError(f"{where}: unknown op {_shown(op)}; expected an object with op one of {', '.join(_SPOOL_OPS)}")
    op = rec["op"]
    for key in ("uri", "run_id", *_SPOOL_OPS[op]):
        if rec.get(key) is None:
            raise UserError(f"{where}: op {op!r} without {key!r}")
        if key not in ("items", "tags") and not (isinstance(rec[key], str) and rec[key]):
            raise UserError(f"{where}: {key!r} is {_shown(rec[key])}; expected a non-empty string")
    if op == "metrics":
        if not isinstance(rec["items"], list):
            raise UserError(f"{where}: 'items' is {_shown(rec['items'])}; expected a list of {_METRIC_ITEM}")
        for n, item in enumerate(rec["items"]):
            _check_metric_item(where, n, item)
    elif op == "artifact":
        _check_artifact(where, rec)
    elif op == "tags":
        _check_tags(where, rec["tags"])
    elif rec["status"] not in _STATUSES:
        raise UserError(f"{where}: status {_shown(rec['status'])}; expected {', '.join(_STATUSES[:-1])} or "
                        f"{_STATUSES[-1]}")


def read_spool(path: str | Path) -> list[dict[str, Any]]:
    """Every record of a spool file, all checked first (`_check_record`); a UserError names the file,
    the line and what was expected."""
    if not str(path).strip():  # Path("") is ".", the current folder: say what was given
        raise UserError(f"the spool file argument is empty ({_shown(str(path))}); expected the path of a {SPOOL_FILE}")
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
        except (ValueError, RecursionError) as e:  # also an integer of over 4300 digits, or nesting too deep
            why = e.msg if isinstance(e, json.JSONDecodeError) else _first_line(e)
            raise UserError(f"{where}: not valid JSON ({why}); expected one JSON object per line") from None
        _check_record(where, rec)
        records.append(rec)
    if not records:
        raise UserError(f"{p}: holds no record; expected a {SPOOL_FILE} written by a run that could not reach its "
                        "tracking server (one JSON object a line)")
    return records


def replay(path: str | Path, tracking_uri: str | None = None) -> ReplaySummary:
    """Send a spool file's records to MLflow in order (into `tracking_uri` if given, else the URI each
    record names), then rename the file to `*.replayed`. A file stopped halfway (MLflow refused a record)
    keeps its name: replaying it again skips each metric value whose (key, step) the run already has. A
    `*.replayed` file is refused: its terminated record would end the run again (a new end time, or a
    resumed run marked FAILED), and there is no new name to give it."""
    p = Path(path)
    if p.name.endswith(".replayed"):
        raise UserError(f"{p}: already replayed (an earlier replay renamed it so); nothing was sent; expected a "
                        "spool file not yet replayed (to send these records again, rename it without "
                        "'.replayed' and replay that)")
    records = read_spool(path)  # the whole file checked before anything is sent
    # the file's new name is an output: never over another (an earlier replay's file, kept)
    done = Output(p.with_name(p.name + ".replayed"), "FILE", "replay", file=True, overwrite=None)
    uri_of = {r["uri"]: resolve_tracking_uri(tracking_uri, "--tracking-uri") if tracking_uri is not None
              else r["uri"] for r in records}
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

    logged = skipped = artifacts = terminated = tags = 0
    for n, rec in enumerate(records, 1):
        uri, run_id = uri_of[rec["uri"]], rec["run_id"]
        try:
            if rec["op"] == "metrics":
                unique = {(k, int(step)): mlflow.entities.Metric(k, float(v), int(ts), int(step))
                          for k, v, ts, step in reversed(rec["items"])}  # a repeated (key, step): the first wins
                items = sorted(unique.values(), key=lambda m: (m.step, m.timestamp))
                todo = _waited(uri, f"reading the metrics of run {run_id}",
                               lambda u=uri, r=run_id, i=items: _drop_logged(_client(u), r, i))
                for i in range(0, len(todo), _METRICS_PER_BATCH):
                    _log_batch_once(uri, run_id, todo[i:i + _METRICS_PER_BATCH], f"replaying metrics into run {run_id}")
                logged, skipped = logged + len(todo), skipped + len(rec["items"]) - len(todo)
            elif rec["op"] == "artifact":
                log_artifact(uri, run_id, rec["path"], rec.get("artifact_path"))
                artifacts += 1
            elif rec["op"] == "tags":
                set_tags(uri, run_id, rec["tags"])
                tags += 1
            else:
                set_terminated(uri, run_id, rec["status"])
                terminated += 1
        except MlflowException as e:  # refused after the checks above (the run deleted meanwhile, say)
            raise UserError(f"{p}: record {n} of {len(records)} ({rec['op']}, run {run_id!r}) refused by MLflow at "
                            f"{uri} ({_first_line(e)}); the records before it were sent and the file is kept: "
                            "replaying it again skips the metric values the runs already hold") from None
    done.check()
    os.rename(p, done.path)
    return ReplaySummary(done.path, tuple(r for _, r in runs), logged, skipped, artifacts, terminated, tags)
