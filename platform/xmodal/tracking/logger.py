"""The run logger: `RunLogger`, a training worker's metrics sent in order by a background thread that
waits an outage out and then writes to the spool file; and `Outbox`, the driver's last calls of a run,
retried until a shared deadline and then spooled."""

from __future__ import annotations

import shutil
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

from xmodal.tracking.connection import _client, _mlflow
from xmodal.tracking.retry import _first_line, _retried, _say
from xmodal.tracking.runs import (
    _METRICS_PER_BATCH,
    _drop_logged,
    _log_artifact,
    _set_tags,
    _set_terminated,
    log_metrics,
    set_tags,
)
from xmodal.tracking.spool import REPLAY_COMMAND, SPOOL_FILE, _append_spool, _unlogged_message


def _rejected(e: Exception) -> bool:
    """The server answered and refused the values (a bad key or value), as opposed to being away."""
    return getattr(e, "error_code", None) == "INVALID_PARAMETER_VALUE"


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

    BATCH = _METRICS_PER_BATCH  # MLflow's limit of metrics per log_batch

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
