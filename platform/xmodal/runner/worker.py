"""The worker side of every training job: what a job's worker hooks see (`Worker`), the worker built
from a job's spec (`make_worker`), and a run's worker (`run_worker`): start-up, resume point, seed,
objective, starting weights, restore, then `fit` with `RunHooks`, reporting to its session
(`xmodal.runner.session`): a Ray Train worker (`worker`) or the one worker of a sweep trial in the
trial's process. The driver's side is `xmodal.runner.engine`, which hands each worker its `RunPlan`
(`xmodal.runner.spec`).
"""

from __future__ import annotations

import functools
import tempfile
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from xmodal import tracking
from xmodal.base import console
from xmodal.core import checkpoint as ckpt
from xmodal.core.cost import CostMeter
from xmodal.core.loop import fit
from xmodal.core.runtime import prepare
from xmodal.runner import recovery, timeline
from xmodal.runner.hooks import RunHooks, ValidationSelection, say
from xmodal.runner.interrupt import StopWatch
from xmodal.runner.session import RayTrainSession
from xmodal.runner.spec import JobSpec, RunPlan, Worker

PLAN_KEY = "plan"  # train_loop_config's one key (Ray Train takes a dict): the RunPlan


def make_worker(spec: JobSpec, cfg, data, start: dict[str, Any], device: torch.device, total_steps: int,
                micro_batch: int, rank: int = 0, world: int = 1, ray_data: bool = False, fresh: bool = True,
                train_options: dict[str, Any] | None = None, builder: Any = None) -> Worker:
    """The seeded objective (identical initial weights on every worker) with its starting weights
    (fresh runs only), its training state (`train_options`: the job's DDP options), the model
    selection of a selecting job, and the batch builder the driver made (`PreparedJob.builder`)."""
    torch.manual_seed(cfg.train.seed)
    objective = spec.build_objective(cfg, data)
    if fresh:
        loaded = spec.load_start(objective, cfg, data, start)
        if loaded and rank == 0:
            say(f"[xmodal] {spec.name}: {loaded}")
    state = prepare(objective, device, cfg.train, cfg.optim, total_steps, **(train_options or {}))
    model = ckpt.unwrap(state.model)
    selection = (ValidationSelection(model, cfg.train.best_metric, cfg.train.best_mode)
                 if spec.selects_on_validation else None)
    return Worker(cfg, data, state, model, rank, world, device, micro_batch, ray_data, selection, builder)


def worker(spec: JobSpec, config: dict[str, RunPlan], stop_flag=None) -> None:
    """Every job's Ray Train worker. `config`: Ray Train's train_loop_config, holding the driver's
    `RunPlan` itself (`engine.trainer`). `stop_flag`: the driver's `interrupt.StopFlag` (Ctrl-C), None in
    sweep trials (Tune stops those)."""
    run_worker(spec, config[PLAN_KEY], RayTrainSession(), stop_flag=stop_flag)


def run_worker(spec: JobSpec, plan: RunPlan, session, data=None, stop_flag=None) -> None:
    """A run's worker, reporting to `session`. `data`: the opened data when the driver's process runs
    the worker too (a one-worker sweep trial, which reads its units straight from the files); a Ray
    Train worker opens `plan.data` and reads through Ray Data."""
    started = time.monotonic()  # the run's wall time (cost/wall_s) counts from here
    marks: dict[str, float] = {}  # rank 0 leaves them in the run's folder at the end (xmodal.runner.timeline)
    timeline.mark(marks, "worker_start")
    ray_data = data is None
    console.set_verbose(plan.verbose)
    console.quiet_worker()
    cfg = plan.config
    tracking.set_outage_wait(plan.tracking_uri, cfg.mlflow.outage_wait_s)  # this worker's waits on the store
    rank, world = session.rank, session.world
    found = recovery.resume_point(*session.folder(), loud=rank == 0)
    resume = found.checkpoint() if found is not None else None
    meta: dict[str, Any] = {}
    if resume is not None:
        with resume.as_directory() as d:
            meta = ckpt.read_meta(d)
    if meta.get("finished"):
        return  # a rerun of a finished run: nothing to do

    w = make_worker(spec, cfg, spec.open_data(plan.data) if ray_data else data, plan.start, session.device(),
                    plan.total_steps, plan.micro_batch, rank, world, ray_data=ray_data,
                    fresh=resume is None, train_options=plan.train_options, builder=plan.builder)
    if resume is not None:
        with resume.as_directory() as d:
            meta = ckpt.restore(d, w.state, verified=True)
            if w.selection is not None:
                w.selection.restore(d)

    def evaluate() -> dict[str, float]:
        metrics = spec.evaluate(w)
        if w.selection is not None:
            w.selection.consider(metrics)
        return metrics

    selecting = w.selection is not None
    cost = CostMeter(w.model, w.device, w.world,
                     cfg.scale.gpus_per_worker if w.device.type == "cuda" else cfg.scale.cpus_per_worker,
                     cfg.train.batch_size, wall_before_s=meta.get("wall_s", 0.0), started=started)
    hooks = RunHooks(plan, cfg.train, cfg.mlflow.system_metrics, w.rank, w.world, w.device, evaluate, meta,
                     on_checkpoint=w.selection.save if selecting else None,
                     on_end=functools.partial(selected_held_out, spec, w, plan) if selecting else None,
                     resumed_from=resume.path if resume is not None else None, cost=cost,
                     stop=StopWatch(stop_flag) if stop_flag is not None else None, marks=marks, session=session)
    step_kwargs = spec.step_kwargs(cfg)

    def batches(epoch: int, skip: int) -> Iterable[Any]:
        # the FLOPs of one training forward + backward, counted once on the first micro-batch
        for batch in cost.counting(spec.train_batches(w, epoch, skip), **step_kwargs(epoch)):
            timeline.mark(marks, "first_batch")
            yield batch

    timeline.mark(marks, "loop_start")
    try:
        fit(w.state, batches, hooks, epoch_steps=plan.epoch_steps, grad_accum=cfg.train.grad_accum,
            start=(meta.get("epoch", 0), meta.get("pos", 0)), step_kwargs=step_kwargs,
            seed=(cfg.train.seed, w.rank))
    finally:
        hooks.close()  # a trial process that Tune reuses keeps no logger thread of a trial it stopped


def selected_held_out(spec: JobSpec, w: Worker, plan: RunPlan | None, _state) -> dict[str, float]:
    """The held-out splits, once, with the model selected on validation; their files logged."""
    final = w.selection.load_selected()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) if w.rank == 0 else None
        final.update(spec.held_out(w, folder))
        if folder is not None and plan is not None and any(folder.iterdir()):
            tracking.log_artifacts(plan.tracking_uri, plan.run_id, tmp)
    return final
