"""Ctrl-C as a safe way to stop a run: SIGINT or SIGTERM to the driver (or its process group).

The first signal asks the workers to stop at the next logging step (every `train.log_every` steps):
the flag rides on that step's all-reduce, so every worker stops at the same step, and the losses
logged by the resumed run are those of an uninterrupted one. Rank 0 writes and registers a checkpoint there
(unless that step's evaluation just wrote one), the metrics logged so far are flushed, and the
workers return. The driver then marks the MLflow run KILLED and the job exits 130. A second signal
stops at once: the driver leaves, Ray ends the workers, and the newest intact checkpoint on storage
(`xmodal.train.recovery`) is where a rerun resumes.

Ray Train's own SIGINT handler (it aborts the run without a checkpoint) is registered only when
`fit()` runs in the main thread: the driver runs `fit()` in a thread of its own and keeps the main
thread, where Python delivers signals, for `GracefulStop`.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

from xmodal.console import say

SIGNALS = (signal.SIGINT, signal.SIGTERM)
POLL_S = 0.1  # how often a worker asks the driver's flag


class StopFlag:
    """The Ray actor the driver sets and the workers read (one per run, owned by the driver)."""

    def __init__(self):
        self.requested = False

    def request(self) -> None:
        self.requested = True

    def get(self) -> bool:
        return self.requested


class GracefulStop:
    """The driver's signal handling around `fit()`: the first SIGINT/SIGTERM sets the run's `StopFlag`,
    the second raises KeyboardInterrupt in the main thread (stop at once).

    The handlers only note the signal; the main thread acts on it between two short waits (`run`).
    Acting in the handler itself (a remote call to the flag, a console line) let a second signal that
    came during the first one's remote call raise KeyboardInterrupt inside Ray's client code."""

    WAIT_S = 0.05  # how soon the main thread acts on a signal

    def __init__(self):
        import ray

        self.flag = ray.remote(num_cpus=0)(StopFlag).remote()
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
        import ray

        ray.kill(self.flag)

    def _handle(self, signum, frame) -> None:
        self._noted.append(signum)

    def _act(self) -> None:
        while self._noted:
            signum = self._noted.pop(0)
            if self.requested:
                raise KeyboardInterrupt
            self.requested = True
            self.flag.request.remote()
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
        import ray

        while not self.event.is_set():
            try:
                if ray.get(self.flag.get.remote(), timeout=30):
                    self.event.set()
                    return
            except ray.exceptions.GetTimeoutError:
                continue
            except ray.exceptions.RayError:  # the driver is gone (stopped at once): Ray ends this worker
                return
            time.sleep(POLL_S)

    def __call__(self) -> bool:
        return self.event.is_set()
