"""Ctrl-C as a safe way to stop a run: SIGINT or SIGTERM to the driver (or its process group).

The first signal asks the workers to stop at the next logging step (every `train.log_every` steps):
the flag rides on that step's all-reduce, so every worker stops at the same step, and the losses
logged by the resumed run are those of an uninterrupted one. Rank 0 writes and registers a checkpoint there
(unless that step's evaluation just wrote one), the metrics logged so far are flushed, and the
workers return. The driver then marks the MLflow run KILLED and the job exits 130. A second signal
stops at once: the driver leaves, Ray ends the workers, and the newest intact checkpoint on storage
(`xmodal.runner.recovery`) is where a rerun resumes.

Ray Train's own SIGINT handler (it aborts the run without a checkpoint) is registered only when
`fit()` runs in the main thread: the driver runs `fit()` in a thread of its own and keeps the main
thread, where Python delivers signals, for `GracefulStop`.
"""

from __future__ import annotations

import signal
import threading
import time
import uuid
from typing import Any

from xmodal.base.console import say

SIGNALS = (signal.SIGINT, signal.SIGTERM)
POLL_S = 0.1  # how often a worker asks the driver's flag


class StopFlag:
    """The run's stop request: a key in the Ray cluster's own key-value store (the GCS), set by the
    driver and read by the workers. Picklable (it is only the key), so it travels to the workers with
    their train function. A key, not an actor: an actor is one more Ray worker process per run (about
    3 CPU-seconds on a 2-core machine, to answer a poll). `ray.experimental.internal_kv` is a private
    API (checked against Ray 2.60; `tests/runner/test_interrupt.py` runs it on a real Ray)."""

    NAMESPACE = "xmodal-stop"

    def __init__(self):
        self.key = f"run-{uuid.uuid4().hex}"

    def request(self) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_put(self.key, b"1", namespace=self.NAMESPACE)

    def get(self) -> bool:
        from ray.experimental import internal_kv

        return internal_kv._internal_kv_exists(self.key, namespace=self.NAMESPACE)

    def clear(self) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_del(self.key, namespace=self.NAMESPACE)


class GracefulStop:
    """The driver's signal handling around `fit()`: the first SIGINT/SIGTERM sets the run's `StopFlag`,
    the second raises KeyboardInterrupt in the main thread (stop at once).

    The handlers only note the signal; the main thread acts on it between two short waits (`run`).
    Acting in the handler itself (a call to the flag's store, a console line) let a second signal that
    came during the first one's remote call raise KeyboardInterrupt inside Ray's client code."""

    WAIT_S = 0.05  # how soon the main thread acts on a signal

    def __init__(self):
        self.flag = StopFlag()
        self.requested = False
        self._noted: list[int] = []
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> GracefulStop:
        for s in SIGNALS:
            self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        try:
            self.flag.clear()
        except Exception:  # noqa: BLE001 - the cluster is gone (stopped at once): so is its store
            pass

    def _handle(self, signum, frame) -> None:
        self._noted.append(signum)

    def _act(self) -> None:
        while self._noted:
            signum = self._noted.pop(0)
            if self.requested:
                raise KeyboardInterrupt
            self.requested = True
            self.flag.request()
            say(f"[xmodal] {signal.Signals(signum).name}: stopping at the next logged step with a checkpoint "
                "(Ctrl-C again to stop at once)")

    def run(self, fn):
        """`fn()` in a thread of its own (so that Ray Train registers no SIGINT handler); the main thread
        waits, acting on signals. Returns what `fn` returned or raises what it raised."""
        out: dict[str, Any] = {}

        def target() -> None:
            try:
                out["value"] = fn()
            except BaseException as e:  # handed to the main thread
                out["error"] = e

        thread = threading.Thread(target=target, name="xmodal-fit", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(self.WAIT_S)
            self._act()
        self._act()  # a second signal as `fn` returned still stops at once
        if "error" in out:
            raise out["error"]
        return out["value"]


class StopWatch:
    """A worker's view of the driver's `StopFlag`: a thread asks it every POLL_S seconds, so that the
    training loop only reads a local event (no remote call on the step's path)."""

    def __init__(self, flag):
        self.flag, self.event = flag, threading.Event()
        self.thread = threading.Thread(target=self._poll, name="xmodal-stop-watch", daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        while not self.event.is_set():
            try:
                if self.flag.get():
                    self.event.set()
                    return
            except Exception:  # noqa: BLE001 - the GCS unreachable for a moment: ask again; if the driver
                pass           # is gone (stopped at once), Ray ends this worker
            time.sleep(POLL_S)

    def __call__(self) -> bool:
        return self.event.is_set()
