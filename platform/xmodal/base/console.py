"""What a job prints: the package's logging, the switches that quiet Ray's and MLflow's chatter, and the
driver's view of a run (start banner, one progress bar, an evaluation table per evaluation, end summary).

Train workers print lines to their stdout, which Ray forwards to the driver: messages (`say`) and, from
rank 0, events (`emit`: progress, evaluations) as one JSON line each. The driver's console
(`Console.ray_lines`, put into Ray's log stream by `xmodal.runner.ray_cluster.attach_ray`) takes those
lines out of it: messages are logged without Ray's `(pid=...)` prefix, events move the progress bar and
print the tables. On a terminal the bar is a live tqdm bar; when stdout is not
a terminal (a log file, `ray job submit`) it becomes a plain line at the first log step and then every
tenth of the run. `--verbose`
brings Ray's own output back (progress bars, report dumps, INFO lines).

Standard library only at import (tqdm is imported when a bar is drawn): every layer may use it.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

log = logging.getLogger("xmodal")

PREFIX = "[xmodal] "
EVENT = "[xmodal:event] "
VERBOSE_ENV = "XMODAL_VERBOSE"  # set by the command line: trial processes and local workers inherit it
# Ray lines that say nothing a user can act on, dropped on the driver (with the traceback that follows
# them) unless --verbose. Ray Train's internal PreemptionWatcher actor logs the first from C++ (no Python
# logger to quiet) on every run; on a loaded machine Ray Train's internal placement-group cleaner (it
# frees a dead controller's resources) times out talking to the GCS or to the controller and both log
# a 20 to 30 line traceback, while the run goes on unharmed; and so does the controller's resource
# request to Ray's autoscaling coordinator when the coordinator answers past Ray's 5 s wait (a local
# Ray has no autoscaler to tell; a cluster's gets the request again within 20 s).
RAY_NOISE = ("has constructor arguments in the object store and max_restarts > 0", "PlacementGroupCleaner",
             "Failed to send resource request for", "Failed to cancel resource request for")
RAY_QUIET_ACTORS = ("PlacementGroupCleaner",)  # every line of these actors
_TRACEBACK_LINE = re.compile(r"^(\s|Traceback \(most recent call last\)|[\w.]+(Error|Exception)\b)")
SETTLE_S = 15.0  # how long the driver waits for a run's last evaluation lines after Ray Train returns
REPORT_BOOKKEEPING = {"step", "epoch", "final"}  # keys of a final report that are not metrics
END_ONLY = ("test/", "best_valid/", "robust/", "cost/")  # a final report's held-out results, not the evaluation
PLAIN_EVERY = 0.1  # without a terminal: a progress line every tenth of the run's steps...
PLAIN_EVERY_S = 300.0  # ...or every 5 minutes, whichever comes first


_on_worker = False  # set by `quiet_worker`: `say` then writes to the stdout that Ray forwards


def verbose() -> bool:
    return os.environ.get(VERBOSE_ENV, "") not in ("", "0")


def set_verbose(on: bool) -> None:
    os.environ[VERBOSE_ENV] = "1" if on else "0"


# ---------------------------------------------------------------- logging


class _Formatter(logging.Formatter):
    """`[xmodal] message`; warnings say so; continuation lines of a record are kept as they are."""

    def format(self, record: logging.LogRecord) -> str:
        text = record.getMessage()
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        if record.levelno >= logging.WARNING:
            text = f"{record.levelname.lower()}: {text}"
        return PREFIX + text


class _ConsoleHandler(logging.Handler):
    """Writes through the console, so that a log line never lands in the middle of the progress bar."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            CONSOLE.write(self.format(record))
        except Exception:  # a closed stream must not take the job down
            self.handleError(record)


def configure(verbose_output: bool = False) -> None:
    """Once, in the command line: the package's log lines on stdout, Ray's and MLflow's quiet (unless
    `verbose_output`), and this process's console active (banner, bar, tables, summary)."""
    set_verbose(verbose_output)
    if not any(isinstance(h, _ConsoleHandler) for h in log.handlers):
        handler = _ConsoleHandler()
        handler.setFormatter(_Formatter())
        log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    CONSOLE.active = True
    quiet_libraries()


def quiet_libraries() -> None:
    """Python loggers of Ray and MLflow whose INFO lines (and one warning) fill a job's log."""
    if verbose():
        return
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")  # read when mlflow configures its loggers
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # tqdm bars per download
    for name in ("mlflow", "alembic"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # Tune's default output prints its experiment box, results folder and TensorBoard hint whatever
    # `verbose` says; its classic reporter keeps quiet at verbose=0 (the sweep's own lines say it all).
    os.environ.setdefault("RAY_AIR_NEW_OUTPUT", "0")
    logging.getLogger("ray.tune.tune").setLevel(logging.WARNING)  # "Wrote the latest version of all result files"
    # "Started a local Ray instance. View the dashboard at ..." (and "Connecting to existing Ray
    # cluster"): the job's own lines say what runs where; its warnings still come through.
    logging.getLogger("ray._private.worker").setLevel(logging.WARNING)
    # "Token authentication is enabled for this Ray cluster" on every start: not something to act on.
    logging.getLogger("ray._private.authentication.authentication_token_setup").setLevel(logging.ERROR)
    # A sweep stopped with Ctrl-C: Tune's own lines name its Python API (`Tuner.restore(...)`) and the
    # trials that never started; the sweep's line says how to continue it (`--resume --name`).
    for name in ("ray.tune.tune", "ray.tune.analysis.experiment_analysis"):
        target = logging.getLogger(name)
        if not any(isinstance(f, _DropTuneInterruptNotes) for f in target.filters):
            target.addFilter(_DropTuneInterruptNotes())


def quiet_worker() -> None:
    """In a Train worker: Ray Train's per-report INFO lines (`Reporting training result N:
    TrainingReport(...)`, logged on a logger named after its file) go through the root logger. Every
    worker calls it first, which is also how `say` knows it runs on one."""
    global _on_worker
    _on_worker = True
    if verbose():
        return
    logging.getLogger().setLevel(logging.WARNING)
    quiet_libraries()


def quiet_ray_data(ray_data_logger: logging.Logger) -> None:
    """Ray Data's console lines (per-execution start, plan, finish, "progress bars disabled") above
    INFO only; its log files in the Ray session keep everything. Called where Ray Data is imported."""
    if verbose():
        return
    for handler in ray_data_logger.handlers:
        if handler.get_name() == "console":
            handler.setLevel(logging.WARNING)
            if not any(isinstance(f, _DropProgressNotice) for f in handler.filters):
                handler.addFilter(_DropProgressNotice())


class _DropTuneInterruptNotes(logging.Filter):
    NOTES = ("Experiment has been interrupted", "Trials did not complete", "Failed to fetch metrics")

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(self.NOTES)


class _DropProgressNotice(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Progress bars disabled")


class DriverNoise:
    """Ray's C++ core worker in the driver logs its errors straight to file descriptor 2, past any
    Python logger: Ray Data's actor pools log RAY_NOISE's first line for every actor they start (they
    pass their context as object refs and keep actor restarts on). While this is entered (unless
    --verbose), descriptor 2 is a pipe whose reader drops RAY_NOISE lines and copies every other line
    to the real stderr as it comes; leaving it drains the pipe and puts the real stderr back. Enter it
    after Ray has started: processes started meanwhile would inherit the pipe."""

    DRAIN_S = 5.0

    def __init__(self) -> None:
        self.real: int | None = None
        self.thread: threading.Thread | None = None

    def __enter__(self) -> DriverNoise:
        if verbose():
            return self
        sys.stderr.flush()
        read, write = os.pipe()
        self.real = os.dup(2)
        os.dup2(write, 2)
        os.close(write)
        self.thread = threading.Thread(target=self._pump, args=(read, self.real), name="xmodal-stderr",
                                       daemon=True)
        self.thread.start()
        return self

    @staticmethod
    def _pump(read: int, real: int) -> None:
        """Copy `read` to `real` as it comes, less the lines that hold RAY_NOISE. A line is judged when
        whole if it may be a Ray log line (it starts with "["); any other piece (a progress bar's
        carriage-return updates) is copied at once."""
        held = b""
        try:
            while chunk := os.read(read, 1 << 16):
                parts = chunk.split(b"\n")
                pieces = [x + b"\n" for x in parts[:-1]] + ([parts[-1]] if parts[-1] else [])
                out = []
                for piece in pieces:
                    line, held = held + piece, b""
                    whole = line.endswith(b"\n")
                    at = min((i for i in (line.find(n.encode()) for n in RAY_NOISE) if i >= 0), default=-1)
                    if at >= 0:  # dropped once whole, from its "[" on (a bar's update before it is kept)
                        if whole:
                            out.append(line[:max(0, line.rfind(b"[", 0, at))])
                        else:
                            held = line
                    elif whole or not line.lstrip(b"\r").startswith(b"["):
                        out.append(line)
                    else:
                        held = line
                if out:
                    os.write(real, b"".join(out))
            if held and not any(n.encode() in held for n in RAY_NOISE):
                os.write(real, held)
        finally:
            os.close(read)

    def __exit__(self, *exc: object) -> None:
        if self.real is None:
            return
        sys.stderr.flush()
        os.dup2(self.real, 2)  # the pipe's last writer closed: the reader sees its end
        if self.thread is not None:
            self.thread.join(self.DRAIN_S)
        if self.thread is None or not self.thread.is_alive():  # else a process holds the pipe: the reader
            os.close(self.real)                                  # keeps its copy of the real stderr
        self.real = self.thread = None


def progress_bar(total: int, desc: str, unit: str, enabled: bool):
    """A tqdm bar for a job that runs in the driver (ingest, extraction): `total` units, bytes shown
    scaled; a disabled one (`enabled` False, e.g. --no-progress) draws nothing but takes the calls."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", dynamic_ncols=True,
                disable=not enabled, smoothing=0.1)


# ---------------------------------------------------------------- worker side


def say(message: str, *, err: bool = False) -> None:
    """The one way a line for the user leaves the package; only the command-line edge (`xmodal.cli`)
    prints itself. The text is shown as given. In a process whose console is active (a job's driver)
    it goes through the console, so that it never lands in the middle of the progress bar: a line that
    starts with `PREFIX` is logged (the log handler puts the prefix back), any other written as is.
    On a Train worker (after `quiet_worker`) it goes to the process's own stdout, which Ray forwards
    to the driver: Ray Train patches `print` into its logger and, when another library has wrapped
    sys.stdout (MLflow does), also tees it. Anywhere else (benchmarks, ingest, library use) it goes to
    sys.stdout. `err`: a failure's line, on stderr wherever it is said."""
    if err:
        print(message, file=sys.stderr, flush=True)
    elif CONSOLE.active:
        if message.startswith(PREFIX):
            log.info(message.removeprefix(PREFIX))
        else:
            CONSOLE.write(message)
    else:
        print(message, file=sys.__stdout__ if _on_worker else sys.stdout, flush=True)


def emit(kind: str, **data: Any) -> None:
    """An event for the driver's console (rank 0): one JSON line on stdout."""
    if CONSOLE.active:
        CONSOLE.event({"kind": kind, **data})
    else:
        print(EVENT + json.dumps({"kind": kind, **data}), file=sys.__stdout__, flush=True)


# ---------------------------------------------------------------- driver side


def fmt_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _short(key: str) -> str:
    return key.split("/", 1)[1] if key.startswith(("eval/", "valid/")) else key


def _is_loss(key: str) -> bool:
    name = _short(key)
    return name == "loss" or name.startswith("loss/")


def _lower_is_better(key: str) -> bool:
    name = _short(key).rsplit("/", 1)[-1]
    return name.startswith("loss") or name.endswith(("mse", "mae", "error"))


def _ordered(metrics: Iterable[str], order: list[str]) -> list[str]:
    keys = list(metrics)
    rank = {k: i for i, k in enumerate(order)}
    return sorted(keys, key=lambda k: (rank.get(k, len(rank)), k))


def eval_table(step: int, total: int | None, metrics: dict[str, float], baselines: dict[str, list],
               order: list[str] | None = None, width: int = 100) -> str:
    """One evaluation as a few lines: a column per metric (the job's order, the total loss last), its
    value, and the chance level or prior under it where the job knows one. Per-task losses are left
    to MLflow. Wide tables wrap."""
    keys = [k for k in _ordered(metrics, order or []) if not _is_loss(k)]
    keys += [k for k in metrics if _short(k) == "loss"]
    title = f"{PREFIX}eval @ step {step}" + (f"/{total}" if total else "")
    if not keys:
        return title + ": (no metrics)"
    cols = [(_short(k), f"{metrics[k]:.4f}", f"{baselines[k][0]:.4f}" if k in baselines else "-") for k in keys]
    label = max(len(title), len("  chance/prior"))
    lines: list[str] = []
    chunk: list[tuple[str, str, str]] = []
    used = label
    for col in [*cols, None]:
        w = max(len(col[0]), len(col[1])) + 2 if col else 0
        if col is None or (chunk and used + w > width):
            head = title if not lines else ""
            lines.append(f"{head:<{label}}" + "".join(f"{c[0]:>{max(len(c[0]), len(c[1])) + 2}}" for c in chunk))
            lines.append(f"{'  value':<{label}}" + "".join(f"{c[1]:>{max(len(c[0]), len(c[1])) + 2}}"
                                                         for c in chunk))
            if baselines:
                lines.append(f"{'  chance/prior':<{label}}" + "".join(
                    f"{c[2]:>{max(len(c[0]), len(c[1])) + 2}}" for c in chunk))
            chunk, used = [], label
        if col is not None:
            chunk.append(col)
            used += w
    return "\n".join(lines)


def summary_table(final: dict[str, Any], history: dict[str, list[tuple[int, float]]],
                  baselines: dict[str, list], order: list[str] | None = None) -> list[str]:
    """The end summary's metric rows: final value, best value over the evaluations (and its step),
    the chance level or prior (what it is). Counters and per-task losses are left out."""
    keys = [k for k in final if "/" in k and isinstance(final[k], (int, float)) and not isinstance(final[k], bool)
            and not _short(k).startswith("loss/") and not k.startswith(("train/", "system/"))]
    robust = [k for k in keys if k.startswith("robust/")]
    keys = _ordered([k for k in keys if k not in robust], order or [])
    keys = [k for k in keys if not _is_loss(k)] + [k for k in keys if _is_loss(k)]
    if not keys:
        return []
    width = max(len(k) for k in keys)
    rows = [f"  {'metric':<{width}}     final   best (step)       chance/prior"]
    for k in keys:
        seen = history.get(k, [])
        if seen:
            pick = min if _lower_is_better(k) else max
            b_step, b_val = pick(seen, key=lambda sv: sv[1])
            best = f"{b_val:8.4f} ({b_step})"
        else:
            best = f"{'-':>8}"
        base = f"{baselines[k][0]:.4f} ({baselines[k][1]})" if k in baselines else "-"
        rows.append(f"  {k:<{width}}  {final[k]:8.4f}   {best:<16}  {base}")
    return rows + _robust_rows(final, robust)


def _robust_rows(final: dict[str, Any], keys: list[str]) -> list[str]:
    """One line per robustness condition (`robust/<condition>/<metric>`), its metrics but the loss."""
    by_condition: dict[str, list[str]] = {}
    for k in sorted(keys):
        condition, name = k.rsplit("/", 1)
        if name != "loss":
            by_condition.setdefault(condition, []).append(f"{name} {final[k]:.4f}")
    width = max((len(c) for c in by_condition), default=0)
    return [f"  {c:<{width}}  " + "  ".join(parts) for c, parts in by_condition.items()]


def banner(*, job: str, run_name: str, data: str, train_examples: int, preset: str | None, parameters: int,
           steps: int, epochs: int, batch_size: int, workers: int, gpus_per_worker: float, tracking_uri: str,
           experiment: str, run_id: str, storage: str, recipe: list[str] | None = None) -> str:
    """What a run is about to do, shown before Ray Train starts (`storage`: the storage path, of which
    the run's folder is `run_name`; `recipe`: the lines of its recipe, `config.recipes.banner_lines`)."""
    devices = f"{gpus_per_worker:g} GPU each" if gpus_per_worker else "CPU"
    model = (f"preset {preset}, " if preset else "") + f"{parameters / 1e6:.2f} M parameters"
    lines = [
        f"{PREFIX}{job} run {run_name}",
        f"  data      {data} ({_size(data)}, {train_examples:,} training examples)",
        f"  model     {model}",
        f"  training  {steps:,} steps ({epochs} epoch{'s' if epochs != 1 else ''}, batch "
        f"{batch_size}) on {workers} worker{'s' if workers != 1 else ''}, {devices}",
        *(f"  {'recipe' if i == 0 else '':<9} {line}" for i, line in enumerate(recipe or [])),
        f"  MLflow    {tracking_uri} (experiment {experiment!r}, run {run_id})",
        f"  storage   {storage}/{run_name}",
    ]
    return "\n".join(lines)


def _size(path: str) -> str:
    """A local folder's size on disk ("?" for remote or unreadable stores)."""
    try:
        n = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())
    except OSError:
        return "?"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return "?"


def end_summary(*, run_name: str, wall_s: float, metrics: dict[str, Any], history: dict[str, list[tuple[int, float]]],
                baselines: dict[str, list], order: list[str], checkpoint: str | None, run_id: str, view: str) -> str:
    """Best and final metrics, the final checkpoint's path, the wall time and where the run is in
    MLflow (`view`: the command that shows it)."""
    step = metrics.get("step")
    lines = [f"{PREFIX}finished run {run_name} in {fmt_duration(wall_s)}"
             + (f" ({step} steps)" if step is not None else "")]
    lines += summary_table(metrics, history, baselines, order)
    if checkpoint is not None:
        lines.append(f"  checkpoint  {checkpoint}")
    lines.append(f"  MLflow run  {run_id}")
    lines.append(f"  view it     {view}")
    return "\n".join(lines)


class Console:
    """The driver's view of a run. Inactive (every call a no-op) in processes whose command line did
    not `configure` it: library use, tests, sweep trials."""

    def __init__(self) -> None:
        self.active = False
        self.lock = threading.RLock()
        self.arrived = threading.Condition(self.lock)  # an evaluation was shown
        self.bar = None
        self.sweep = False  # a sweep's driver: trial lines only, no bar or tables
        self._muted: set[Any] = set()  # pids whose noise's traceback is being dropped
        self._reset()

    def _reset(self) -> None:
        self.total = 0
        self.baselines: dict[str, list] = {}
        self.order: list[str] = []
        self.history: dict[str, list[tuple[int, float]]] = {}
        self.started = time.monotonic()
        self.last_plain = (0, 0.0)  # (step, time) of the last plain progress line
        self.run_open = False
        self.last_eval_step: int | None = None

    # ------------------------------------------------ output
    def write(self, text: str) -> None:
        with self.lock:
            if self.bar is not None:
                self.bar.clear()
            print(text, file=sys.stdout, flush=True)
            if self.bar is not None:
                self.bar.refresh()

    def show(self, text: str) -> None:
        """A block of the console (banner, table, summary): shown only where the console is active."""
        if self.active:
            self.write(text)

    # ------------------------------------------------ a run
    def begin(self, total_steps: int, baselines: dict[str, list], order: list[str]) -> None:
        if not self.active or self.sweep:
            return
        with self.lock:
            self._close_bar()
            self._reset()
            self.total, self.baselines, self.order, self.run_open = total_steps, baselines, order, True
            self.last_plain = (0, time.monotonic())

    def end(self) -> float:
        """Close the bar; returns the run's wall time in seconds. Events after this are dropped."""
        with self.lock:
            self._close_bar()
            self.run_open = False
            return time.monotonic() - self.started

    def _close_bar(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def event(self, e: dict[str, Any]) -> None:
        with self.lock:
            if not self.run_open:
                return
            if e.get("kind") == "progress":
                self._progress(e)
            elif e.get("kind") == "eval":
                metrics = e.get("metrics", {})
                for k, v in metrics.items():
                    self.history.setdefault(k, []).append((int(e["step"]), float(v)))
                self.write(eval_table(int(e["step"]), self.total, metrics, self.baselines, self.order))
                self.last_eval_step = int(e["step"])
                self.arrived.notify_all()

    def settle(self, step: int, final: dict[str, Any], timeout_s: float = SETTLE_S) -> None:
        """Before the run is closed: make sure its evaluation at `step` (the last) was shown. Ray forwards
        worker lines asynchronously, so the last ones can arrive after `fit()` returned; wait for them
        (bounded), and if they do not come, show the table from the run's final report instead."""
        if not self.active or self.sweep:
            return
        deadline = time.monotonic() + timeout_s
        with self.lock:
            if not self.run_open:
                return
            while self.last_eval_step != step and time.monotonic() < deadline:
                self.arrived.wait(deadline - time.monotonic())
            if self.last_eval_step == step:
                return
            known = set(self.history)  # the metrics of the run's earlier evaluations
            metrics = {k: float(v) for k, v in final.items() if isinstance(v, (int, float)) and (
                k in known if known else k not in REPORT_BOOKKEEPING and not k.startswith(END_ONLY))}
            for k, v in metrics.items():
                self.history.setdefault(k, []).append((step, v))
            self.last_eval_step = step
            self.write(eval_table(step, self.total, metrics, self.baselines, self.order))

    def _progress(self, e: dict[str, Any]) -> None:
        step, loss, rate = int(e["step"]), float(e.get("loss", float("nan"))), float(e.get("rate", 0.0))
        stats = f"loss {loss:.4f}  {rate:,.0f} samples/s"
        if sys.stdout.isatty():
            if self.bar is None:
                from tqdm import tqdm

                self.bar = tqdm(total=self.total, initial=step, file=sys.stdout, dynamic_ncols=True,
                                unit="step", bar_format="{percentage:3.0f}%|{bar}| {n}/{total} "
                                                        "[{elapsed}<{remaining}] {postfix}")
            self.bar.set_postfix_str(f"epoch {e.get('epoch', 0)}  {stats}", refresh=False)
            self.bar.update(step - self.bar.n)
            return
        last_step, last_t = self.last_plain
        now = time.monotonic()
        due = step - last_step >= max(1, int(self.total * PLAIN_EVERY)) or now - last_t >= PLAIN_EVERY_S
        if due or step >= self.total or last_step == 0:  # the first says that training has started
            self.last_plain = (step, now)
            self.write(f"{PREFIX}step {step}/{self.total} epoch {e.get('epoch', 0)}  {stats}  "
                       f"ETA {fmt_duration(float(e.get('eta', float('inf'))))}")

    # ------------------------------------------------ Ray's log stream
    def ray_lines(self, data: dict[str, Any], forward: Callable[[dict[str, Any]], None]) -> None:
        """A batch of worker lines from Ray: events and messages taken out, noise dropped, the rest
        printed by Ray (with the bar cleared around them)."""
        if not verbose() and data.get("actor_name") in RAY_QUIET_ACTORS:
            return
        keep = []
        for line in data.get("lines", []):
            if line.startswith(EVENT):
                try:
                    self.event(json.loads(line[len(EVENT):]))
                except (ValueError, KeyError, TypeError):
                    keep.append(line)
            elif line.startswith(PREFIX):
                log.info(line[len(PREFIX):])
            elif verbose() or not self._noise(data.get("pid"), line):
                keep.append(line)
        if keep:
            with self.lock:
                if self.bar is not None:
                    self.bar.clear()
                forward({**data, "lines": keep})
                if self.bar is not None:
                    self.bar.refresh()

    def _noise(self, pid: Any, line: str) -> bool:
        if any(n in line for n in RAY_NOISE):
            self._muted.add(pid)
            return True
        if pid in self._muted:
            if _TRACEBACK_LINE.match(line):
                return True
            self._muted.discard(pid)
        return False


CONSOLE = Console()
