"""The spool file: what a run could not log to MLflow (metric values, its last calls), one JSON object a
line (`SPOOL_FILE`, where: `spool_path`), and its replay (`replay`, jobs/replay_tracking.py): the whole
file and every run it names checked before the first record is sent, each value the run already holds
skipped."""

from __future__ import annotations

import json
import os
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
_SPOOL_OPS = {"metrics": ("items",), "artifact": ("path",), "tags": ("tags",), "terminated": ("status",)}


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
    # the file's new name is an output: never over another (an earlier replay's file, kept)
    done = None if p.name.endswith(".replayed") else Output(p.with_name(p.name + ".replayed"), "FILE", "replay",
                                                              file=True, overwrite=None)
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
                for i in range(0, len(todo), _METRICS_PER_BATCH):
                    _log_batch_once(uri, run_id, todo[i:i + _METRICS_PER_BATCH], f"replaying metrics into run {run_id}")
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
    if done is not None:
        done.check()
        os.rename(p, done.path)
    return ReplaySummary(done.path if done is not None else p, tuple(r for _, r in runs), logged, skipped, artifacts,
                         terminated)
