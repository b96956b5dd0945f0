"""A job's worker in this process, without Ray Train: without Ray or MLflow (`run_in_process`: tests,
learning measurements), or as a one-worker sweep trial (`in_trial_process`): the same objective, batches,
steps, `fit` loop, evaluation cadence and model selection as a Train worker."""

from __future__ import annotations

import functools
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from xmodal.core.loop import NoHooks, ends_epoch, epoch_ended, fit
from xmodal.runner import recovery
from xmodal.runner.spec import JobSpec, PrepareContext, RunPlan, Trial, Worker, epoch_plan, split_batch
from xmodal.runner.worker import make_worker, selected_held_out


class LocalHooks(NoHooks):
    """In-process hooks: RunHooks' evaluation cadence without Ray or MLflow. A selecting job validates
    every `train.eval_every` steps and at the end, each result offered to the model selection; under the
    plateau schedule every job also evaluates at each epoch's end and steps the plateau with it. With a
    `history` list, every job evaluates at that cadence and each (step, metrics) is appended to it."""

    def __init__(self, spec: JobSpec, w: Worker, epoch_steps: list[int], history: list | None = None):
        self.spec, self.w, self.epoch_steps, self.history, self.last = spec, w, epoch_steps, history, None

    def after_step(self, state, epoch, pos, losses) -> None:
        epoch_end = state.plateau is not None and ends_epoch(self.epoch_steps, epoch, pos)
        cadence = (self.w.selection is not None or self.history is not None) and state.step % self.w.cfg.train.eval_every == 0
        if epoch_end or cadence:
            metrics = self.spec.evaluate(self.w)
            if epoch_end:
                epoch_ended(state, metrics, self.w.cfg.optim.plateau.metric)
            self._offer(state.step, metrics)

    def _offer(self, step: int, metrics: dict[str, float]) -> None:
        if self.w.selection is not None:
            self.w.selection.consider(metrics)
        if self.history is not None:
            self.history.append((step, metrics))
        self.last = step

    def at_end(self, state, epoch, pos) -> None:
        if (self.w.selection is not None or self.history is not None) and self.last != state.step:
            self._offer(state.step, self.spec.evaluate(self.w))


def run_in_process(spec: JobSpec, cfg, data=None, history: list | None = None) -> tuple[Worker, dict[str, float]]:
    """A job's worker in this process, on the CPU, without Ray or MLflow: the same initial weights,
    starting point, batches, steps, loop (`fit`), evaluation cadence and model selection. The train
    split is read straight from the files (the units and batches a single Ray worker reads). Returns
    (worker, final metrics): the held-out metrics of the selected model for selecting jobs, else one
    evaluation at the end. `history`: a list that gets every evaluation's (step, metrics) (`LocalHooks`)."""
    with tempfile.TemporaryDirectory(prefix="xmodal-in-process-") as downloads:  # starting weights, if fetched
        prepared = spec.prepare(cfg, PrepareContext("", Path(downloads), data))
        cfg = prepared.cfg
        micro = split_batch(cfg)
        epochs = epoch_plan(prepared, micro, workers=1)
        w = make_worker(spec, cfg, prepared.data, prepared.start, torch.device("cpu"), sum(epochs), micro,
                        train_options=prepared.train_options, builder=prepared.builder)
    hooks = LocalHooks(spec, w, epochs, history)
    fit(w.state, functools.partial(spec.train_batches, w), hooks, epoch_steps=epochs,
        grad_accum=cfg.train.grad_accum, step_kwargs=spec.step_kwargs(cfg), seed=(cfg.train.seed, 0))
    if w.selection is None:
        return w, history[-1][1] if history else spec.evaluate(w)
    return w, selected_held_out(spec, w, None, w.state)


@dataclass
class InProcessResult:
    """What `fit()` of a Ray Train run returns, for a run whose worker ran in this process."""

    metrics: dict[str, Any]  # the last report's
    checkpoint: Any  # the last checkpoint (ray.train.Checkpoint), None when there is none


def in_trial_process(spec: JobSpec, plan: RunPlan, data, trial: Trial) -> InProcessResult:
    """A one-worker sweep trial's worker in the trial's own process, without Ray Train: the same
    worker, hooks, checkpoints on storage and resume point, its reports to Tune (`trial.report`), its
    units read straight from the files (`data`, opened by `check`). What a Ray Train run adds for one
    worker (controller, placement group, worker actor, Ray Data) costs a tiny trial more than its
    training (docs/performance.md, "Sweep overhead"). A worker's failure is the trial's: Tune retries it."""
    from xmodal.runner.session import TrialSession
    from xmodal.runner.worker import run_worker

    cfg = plan.config
    session = TrialSession(plan.storage, plan.run_name, trial.report, cfg.train.keep_best, cfg.train.best_metric,
                           cfg.train.best_mode, cfg.scale.gpus_per_worker)
    run_worker(spec, plan, session, data=data)
    checkpoint = session.checkpoint()
    if checkpoint is None:  # a rerun of a finished run trains nothing: its last checkpoint on storage
        found = recovery.resume_point(*session.folder(), loud=False)
        checkpoint = found.checkpoint() if found is not None else None
    return InProcessResult(session.metrics, checkpoint)
