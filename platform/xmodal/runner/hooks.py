"""What runs on every Train worker besides the loop: logging, evaluation, checkpoints, model
selection on a validation split and fault injection (a testing aid, `xmodal.runner.faults`). Rank 0
shows progress and evaluations through the driver's console (`xmodal.base.console.emit`).

The run's score is decided here and nowhere else: the best `train.best_metric` over its evaluations
(`scores.better`), the score of the checkpoint it keeps. It is logged to MLflow and sent with every
report (to Ray Train, or to Tune from a sweep trial's in-process worker: `xmodal.runner.session`) under
`scores.selected_key(train.best_metric)`; a sweep reads only that."""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from xmodal import tracking
from xmodal.base.console import emit, say
from xmodal.base.scores import better, selected_key
from xmodal.config.experiment import TrainConfig
from xmodal.core import checkpoint as ckpt
from xmodal.core.cost import CostMeter
from xmodal.core.loop import Throughput, all_reduce_sums, ends_epoch, epoch_ended
from xmodal.core.optim import current_lr
from xmodal.core.step import TrainState
from xmodal.runner import timeline
from xmodal.runner.faults import Injector
from xmodal.runner.session import RayTrainSession


class ValidationSelection:
    """Model selection on a validation split (MulT, fine-tuning): every worker keeps the best weights
    by `metric`; they travel in each checkpoint (`BEST_FILE`), so a resumed run keeps its selection,
    and the held-out splits are evaluated once with them at the end."""

    BEST_FILE = "best_model.pt"

    def __init__(self, model: torch.nn.Module, metric: str, mode: str):
        self.model, self.metric, self.mode = model, metric, mode
        self.score: float | None = None
        self.valid: dict[str, float] = {}
        self.weights: dict[str, torch.Tensor] | None = None

    def consider(self, metrics: dict[str, float]) -> None:
        score = metrics[self.metric]
        if better(score, self.score, self.mode):
            self.score, self.valid = score, dict(metrics)
            self.weights = {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def save(self, _state: TrainState, folder: Path, _is_new_best: bool) -> None:
        """A RunHooks `on_checkpoint`."""
        if self.weights is not None:
            torch.save({"weights": self.weights, "score": self.score, "valid": self.valid}, folder / self.BEST_FILE)

    def restore(self, folder: str | Path) -> None:
        f = Path(folder) / self.BEST_FILE
        if f.exists():
            blob = torch.load(f, map_location="cpu", weights_only=True)
            self.weights, self.score, self.valid = blob["weights"], blob["score"], blob["valid"]

    def load_selected(self) -> dict[str, float]:
        """Put the selected weights into the model; returns their validation metrics as best_<metric>."""
        if self.weights is None:
            raise RuntimeError("no model was selected: the validation split was never evaluated")
        self.model.load_state_dict(self.weights)
        return {f"best_{k}": v for k, v in self.valid.items()}


STOP_KEY = "_stop_requested"  # the all-reduced stop flag's entry among the logged loss sums


class RunHooks:
    """Logging, evaluation, checkpoints and fault injection (a testing aid), run on every worker
    (collectives need all of them); only rank 0 prints and writes to MLflow."""

    def __init__(self, plan, train: TrainConfig, system_metrics: bool, rank: int, world: int,
                 device: torch.device, evaluate: Callable[[], dict[str, float]], meta: dict[str, Any],
                 on_checkpoint: Callable[[TrainState, Path, bool], None] | None = None,
                 on_end: Callable[[TrainState], dict[str, float]] | None = None,
                 resumed_from: str | None = None, cost: CostMeter | None = None,
                 stop: Callable[[], bool] | None = None, marks: dict[str, float] | None = None,
                 session=None):
        """`on_checkpoint(state, folder, is_new_best)` adds files to a checkpoint (rank 0);
        `on_end(state)` runs on every worker after the final checkpoint (e.g. the test split on
        the selected model) and its metrics are logged and reported; `resumed_from` is the path of
        the checkpoint restored (the one a failed checkpoint write leaves as the last); `cost` times
        the steps, and rank 0 logs its `cost/*` metrics at every evaluation (early-stopped sweep
        trials have them too) and carries its wall time in each checkpoint; `stop()` is True once the
        driver asked the run to stop (Ctrl-C, `xmodal.runner.interrupt`); `marks`: the worker's
        timeline marks (`xmodal.runner.timeline`), which rank 0 writes into the run's folder at `fit_end`;
        `session`: where reports go (`xmodal.runner.session`; Ray Train's unless given)."""
        self.session = session if session is not None else RayTrainSession()
        self.cost, self.stop = cost, stop
        self.marks = marks if marks is not None else {}
        self.plan, self.train, self.rank, self.world, self.device = plan, train, rank, world, device
        self.last_checkpoint: tuple[int, str] | None = (
            (meta["step"], resumed_from) if resumed_from is not None and "step" in meta else None)
        self.on_checkpoint, self.on_end = on_checkpoint, on_end
        self.evaluate = evaluate
        self.faults = Injector(plan.faults, plan.fault_dir, rank, self.session.fault_settle_s())
        self.last_eval_step = meta.get("step", -1)
        self.checkpointed_step = meta.get("step", -1)  # the same on every rank (each evaluation checkpoints)
        self.best = meta.get("best")  # the selected score so far (a resumed run keeps its selection)
        self.selected_key = selected_key(train.best_metric)
        self.meter = Throughput(meta.get("step", 0), plan.total_steps)
        self.logger = (tracking.RunLogger(plan.tracking_uri, plan.run_id, system_metrics,
                                          spool=tracking.spool_path(plan.storage, plan.run_name),
                                          outage_wait_s=plan.config.mlflow.outage_wait_s)
                       if rank == 0 else None)
        self.closed = False
        self.window: dict[str, torch.Tensor] = {}  # loss sums since the last log step
        self.window_steps = 0
        self.last_metrics: dict[str, float] = {}
        if self.logger is not None and "step" in meta:
            # Marks the restart in MLflow: training continued from this checkpointed step.
            self.logger.log({"train/resumed_from_step": meta["step"]}, meta["step"], force=True)
            say(f"[xmodal] resumed from checkpoint at step {meta['step']} (epoch {meta.get('epoch')})")

    def after_step(self, state: TrainState, epoch: int, pos: int, losses: dict[str, torch.Tensor]) -> bool:
        """Returns True when the run stops here (the driver asked it to; the checkpoint is written)."""
        if self.cost is not None:
            self.cost.step_start()
        t = self.train
        self.meter.add(t.batch_size)
        self.faults.at_step(state.step)
        for k, v in losses.items():  # summed on the device: read once per log step, not every step
            self.window[k] = self.window.get(k, 0) + v
        self.window_steps += 1
        stopping = False
        if state.step % t.log_every == 0:
            # A requested stop happens at a log step: every worker learns of it here (the flag rides on
            # the all-reduce they all make), and a resumed run logs the same losses as an uninterrupted one (no half-logged window).
            window = dict(self.window)
            if self.stop is not None:
                window[STOP_KEY] = float(self.stop())
            sums = all_reduce_sums(window, self.device)
            stopping = sums.pop(STOP_KEY, 0.0) > 0
            n = self.window_steps * self.world
            metrics = {f"train/{k}": v / n for k, v in sums.items()}
            self.window, self.window_steps = {}, 0
            rate, eta = self.meter.read(state.step)
            metrics.update({"train/lr": current_lr(state.optimizer, state.scheduler), "train/samples_per_s": rate,
                            "train/epoch": epoch})
            if self.rank == 0:
                emit("progress", step=state.step, epoch=epoch, loss=metrics.get("train/loss", float("nan")),
                     rate=rate, eta=eta)
                self.logger.log(metrics, state.step)
        # The plateau schedule needs the validation metric at every epoch's end, whatever train.eval_every.
        epoch_end = state.plateau is not None and ends_epoch(self.plan.epoch_steps, epoch, pos)
        if state.step % t.eval_every == 0 or epoch_end:
            self._eval_and_checkpoint(state, epoch, pos, finished=False, epoch_end=epoch_end)
        if stopping:
            self._stop_here(state, epoch, pos)
        if self.cost is not None:
            self.cost.step_end()
        return stopping

    def selected(self) -> dict[str, float]:
        """The selected score as a metric: {selected_key: the best evaluation so far}; empty before the
        first evaluation."""
        return {} if self.best is None else {self.selected_key: self.best}

    def _worst(self) -> float:
        return -sys.float_info.max if self.train.best_mode == "max" else sys.float_info.max

    def _stop_here(self, state: TrainState, epoch: int, pos: int) -> None:
        """The driver asked the run to stop: a checkpoint of this step (unless its evaluation just
        wrote one) registered with Ray Train, and every metric logged so far sent to MLflow. No
        evaluation: this checkpoint's own `best_metric` is the worst finite value, so Ray Train ranks
        it below every evaluated checkpoint (NaN would not survive Ray Train's JSON snapshot, and a
        missing score is logged as an error). The run's selected score stays what its evaluations
        made it; before the first one it is the worst finite value too (Tune needs a number)."""
        if self.checkpointed_step != state.step:
            report = {self.train.best_metric: self._worst(), self.selected_key: self._worst(), **self.selected(),
                      "step": state.step, "epoch": epoch, "stopped": 1}
            if self.rank == 0:
                self.logger.flush()
                self._report_checkpoint(state, epoch, pos, False, False, report)
            else:
                self.session.report(report)
            self.checkpointed_step = state.step
        if self.logger is not None:
            self.logger.log({"train/stopped_at_step": state.step}, state.step, force=True)
        self.close()

    def at_end(self, state: TrainState, epoch: int, pos: int) -> None:
        rerun = state.step != self.last_eval_step or not self.last_metrics
        self._eval_and_checkpoint(state, epoch, pos, finished=True, rerun_eval=rerun)
        if self.on_end is not None:
            final = self.on_end(state)
            self._timeline()
            if self.rank == 0:  # shown by the driver's end summary
                self.logger.log(final, state.step, force=True)
            self.session.report({**self.last_metrics, **final, **self.selected(), "step": state.step,
                                 "epoch": epoch, "final": 1})
        self.close()

    def close(self) -> None:
        """Send (or spool) what is queued and end the logger's thread, once: at the run's end, at a stop,
        and after a run that ended otherwise (an error; Tune ending a trial's thread at a report)."""
        if self.logger is not None and not self.closed:
            self.closed = True
            self.logger.close()

    def _eval_and_checkpoint(self, state, epoch, pos, finished, rerun_eval=True, epoch_end=False) -> None:
        metrics = self.evaluate() if rerun_eval else dict(self.last_metrics)
        if epoch_end:  # before the checkpoint, which then holds the plateau's new state
            epoch_ended(state, metrics, self.plan.config.optim.plateau.metric)
        self.last_eval_step, self.last_metrics, self.checkpointed_step = state.step, metrics, state.step
        score = metrics.get(self.train.best_metric)
        new_best = score is not None and better(score, self.best, self.train.best_mode)
        if new_best:
            self.best = score
        if self.rank == 0 and rerun_eval:
            emit("eval", step=state.step, epoch=epoch, metrics=metrics)
            self.logger.log({**metrics, **self.selected()}, state.step)
        if self.rank == 0 and self.cost is not None:
            self.logger.log(self.cost.metrics(), state.step, force=finished)
        if self.rank == 0:
            # Every metric of the checkpoint's steps is in MLflow or the spool file before the checkpoint
            # is reported: a worker killed after it loses none (however long the server is away, up to
            # mlflow.outage_wait_s per outage: the sender then spools).
            self.logger.flush()
        report = {**metrics, **self.selected(), "step": state.step, "epoch": epoch}
        if finished and self.on_end is None:
            report["final"] = 1  # the run's last report (with on_end, that report comes after)
            self._timeline()
        if self.rank == 0:
            self._report_checkpoint(state, epoch, pos, finished, new_best, report)
        else:
            self.session.report(report)

    def _timeline(self) -> None:
        """The training is over (the last report follows): rank 0 leaves its marks for the driver."""
        timeline.mark(self.marks, "fit_end")
        if self.rank == 0:
            try:
                timeline.write_worker_marks(*self.session.folder(), self.marks)
            except OSError as e:  # figures only: a storage that refuses them costs the run nothing
                say(f"[xmodal] the run's timeline was not written ({e}); its time/* metrics are left out")

    def _report_checkpoint(self, state, epoch, pos, finished, new_best, report) -> None:
        """Rank 0: write the checkpoint folder, seal it (checksums) and hand it to the session (Ray Train),
        which copies it to the run's storage. A storage failure becomes one CheckpointWriteError."""
        name = self.session.checkpoint_name()  # Ray's own naming, known here to clean up
        where, copying = tempfile.gettempdir(), False  # until the folder is complete, the local disk's
        try:
            with tempfile.TemporaryDirectory() as tmp:
                where = tmp
                ckpt.save(tmp, state, {"epoch": epoch, "pos": pos, "finished": finished, "best": self.best,
                                       "run_id": self.plan.run_id, "config": self.plan.config.model_dump(mode="json"),
                                       "store": self.plan.data,
                                       "wall_s": self.cost.wall_s() if self.cost is not None else 0.0})
                if self.on_checkpoint is not None:
                    self.on_checkpoint(state, Path(tmp), new_best)
                ckpt.seal(tmp)
                where, copying = f"{self.plan.storage.rstrip('/')}/{self.plan.run_name}", True
                registered = self.session.report(report, checkpoint=tmp, name=name)
        except Exception as e:
            if not ckpt.is_storage_failure(e):
                raise
            if copying:
                # The partial copy is no checkpoint (never registered, fails verify); on a full disk it
                # also holds the space Ray Train's controller needs for its run state: remove it.
                try:
                    fs, folder = self.session.folder()
                    fs.delete_dir(f"{folder}/{name}")
                except Exception:  # read-only or gone: nothing was written, or nothing can be removed
                    pass
            raise ckpt.CheckpointWriteError(self.plan.run_name, where, state.step, " ".join(str(e).split()),
                                            self.last_checkpoint) from e
        self.last_checkpoint = (state.step, registered)
