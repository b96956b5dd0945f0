"""A job's worker in this process, without Ray or MLflow (tests, learning measurements): the same
objective, batches, steps, `fit` loop, evaluation cadence and model selection as a Train worker."""

from __future__ import annotations

import functools
import tempfile
from pathlib import Path

import torch

from xmodal.core.loop import NoHooks, fit
from xmodal.runner.spec import JobSpec, PrepareContext, Worker, epoch_plan, split_batch
from xmodal.runner.worker import make_worker, selected_held_out


class LocalSelection(NoHooks):
    """In-process hooks of a selecting job: validation every `train.eval_every` steps and at the
    end, each result offered to the model selection (RunHooks' cadence, without Ray or MLflow)."""

    def __init__(self, spec: JobSpec, w: Worker):
        self.spec, self.w, self.last = spec, w, None

    def after_step(self, state, epoch, pos, losses) -> None:
        if state.step % self.w.cfg.train.eval_every == 0:
            self.w.selection.consider(self.spec.evaluate(self.w))
            self.last = state.step

    def at_end(self, state, epoch, pos) -> None:
        if self.last != state.step:
            self.w.selection.consider(self.spec.evaluate(self.w))


def run_in_process(spec: JobSpec, cfg, data=None) -> tuple[Worker, dict[str, float]]:
    """A job's worker in this process, on the CPU, without Ray or MLflow: the same initial weights,
    starting point, batches, steps, loop (`fit`), evaluation cadence and model selection. The train
    split is read straight from the files (the units and batches a single Ray worker reads). Returns
    (worker, final metrics): the held-out metrics of the selected model for selecting jobs, else one
    evaluation at the end."""
    prepared = spec.prepare(cfg, PrepareContext("", Path(tempfile.mkdtemp()), data))
    cfg = prepared.cfg
    micro = split_batch(cfg)
    epochs = epoch_plan(prepared, micro, workers=1)
    w = make_worker(spec, cfg, prepared.data, prepared.start, torch.device("cpu"), sum(epochs), micro,
                    train_options=prepared.train_options, builder=prepared.builder)
    hooks = LocalSelection(spec, w) if w.selection is not None else NoHooks()
    fit(w.state, functools.partial(spec.train_batches, w), hooks, epoch_steps=epochs,
        grad_accum=cfg.train.grad_accum, step_kwargs=spec.step_kwargs(cfg), seed=(cfg.train.seed, 0))
    if w.selection is None:
        return w, spec.evaluate(w)
    return w, selected_held_out(spec, w, None, w.state)
