"""LXMERT pretraining on Ray Train: the driver (`run_pretraining`) and the per-worker function.

Driver: validate and resolve everything (store, dims, MLflow run, storage path)
before Ray starts; build a TorchTrainer; after `fit()` log the final model and
close the MLflow run. Workers: build the model, restore the latest checkpoint,
run `xmodal.train.loop.fit`, and report checkpoints + minival metrics.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from xmodal import tracking
from xmodal.config import ConfigError, PretrainConfig, flatten
from xmodal.models.lxmert import LxmertForPretraining
from xmodal.objectives.pretraining import PretrainingObjective
from xmodal.train import checkpoint as ckpt
from xmodal.train.cluster import connect, require_ray, storage_path
from xmodal.train.loop import Throughput, all_reduce_sums, evaluate_sums, fit, ratios
from xmodal.train.runtime import prepare
from xmodal.train.step import TrainState

DEFAULT_STORE = "data/synthetic_lxmert"


# ---------------------------------------------------------------- driver


@dataclass
class PretrainPlan:
    """Everything a worker needs, resolved on the driver (plain JSON-able data)."""

    config: dict[str, Any]
    store: str
    tracking_uri: str
    run_id: str
    run_name: str
    storage: str
    total_steps: int
    micro_batch: int
    fail_marker: str | None


def resolve_store(cfg: PretrainConfig):
    from xmodal.data.store import open_store
    from xmodal.data.synthetic import ensure_synthetic_store

    if cfg.data.store is None:
        return ensure_synthetic_store(Path(DEFAULT_STORE).resolve(), cfg.data.synthetic)
    path = Path(cfg.data.store).expanduser().resolve()
    if not path.exists():
        raise ConfigError(f"data.store: {str(path)!r} does not exist; build one with "
                          f"`python jobs/ingest.py lxmert|synthetic {path}` or leave data.store unset "
                          "for the embedded synthetic store")
    return open_store(path)


def with_store_dims(cfg: PretrainConfig, manifest) -> PretrainConfig:
    """The model's vocabulary, feature and label sizes come from the store."""
    dims = {
        "vocab_size": manifest.vocab_size,
        "visual_feat_dim": manifest.feat_dim,
        "num_object_labels": manifest.num_object_labels,
        "num_attr_labels": manifest.num_attr_labels,
        "num_qa_labels": manifest.num_answers,
    }
    if manifest.max_seq_len > cfg.model.max_positions:
        raise ConfigError(f"model.max_positions {cfg.model.max_positions} is shorter than the store's "
                          f"max_seq_len {manifest.max_seq_len}")
    return cfg.model_copy(update={"model": dataclasses.replace(cfg.model, **dims)})


def plan_steps(cfg: PretrainConfig, train_sentences: int) -> tuple[int, int]:
    """(micro-batch per worker, total optimizer steps)."""
    t, workers = cfg.train, cfg.scale.num_workers
    per_step = workers * t.grad_accum
    if t.batch_size % per_step:
        raise ConfigError(f"train.batch_size {t.batch_size} must be divisible by scale.num_workers x "
                          f"train.grad_accum = {per_step}")
    micro = t.batch_size // per_step
    steps_per_epoch = (train_sentences // workers // micro) // t.grad_accum
    if steps_per_epoch < 1:
        raise ConfigError(f"train.batch_size {t.batch_size} is larger than the store's "
                          f"{train_sentences} training sentences")
    total = steps_per_epoch * t.epochs
    return micro, min(total, t.max_steps) if t.max_steps else total


def prepare_run(cfg: PretrainConfig, source: str = "defaults", parent_run_id: str | None = None,
                extra_tags: dict[str, str] | None = None):
    """Resolve store, dims, steps, storage and the MLflow run (found by name to resume, else created).

    Everything that can fail on bad input fails here, before Ray starts. Returns (plan, store).
    """
    store = resolve_store(cfg)
    cfg = with_store_dims(cfg, store.manifest)
    micro, total_steps = plan_steps(cfg, store.manifest.sentences("train"))
    uri = tracking.resolve_tracking_uri(cfg.mlflow.tracking_uri)
    name = cfg.mlflow.run_name or f"pretrain-{cfg.preset}-{time.strftime('%Y%m%d-%H%M%S')}"
    cfg = cfg.model_copy(update={"mlflow": cfg.mlflow.model_copy(update={"run_name": name})})
    storage = storage_path(cfg.scale.storage_path)

    exp_id = tracking.ensure_experiment(uri, cfg.mlflow.experiment)
    existing = tracking.find_run(uri, exp_id, name)
    if existing is not None:
        run_id = existing.info.run_id
        tracking.mark_running(uri, run_id)
        print(f"[xmodal] resuming run {name!r} (MLflow run {run_id})")
    else:
        tags = {"model": "lxmert", "task": "pretrain", "preset": cfg.preset, "store": str(store.path),
                "git_commit": tracking.git_commit(), "config_source": source, **(extra_tags or {})}
        run_id = tracking.create_run(uri, exp_id, name, flatten(cfg), tags, parent_run_id)
    plan = PretrainPlan(
        config=cfg.model_dump(mode="json"), store=str(store.path), tracking_uri=uri, run_id=run_id,
        run_name=name, storage=storage, total_steps=total_steps, micro_batch=micro,
        fail_marker=(str(Path(storage) / name / ".fail_injected")
                     if cfg.train.fail_at_step is not None and "://" not in storage else None))
    return plan, store


def run_pretraining(cfg: PretrainConfig, source: str = "defaults") -> dict[str, Any]:
    """Run (or resume) one pretraining run; returns {"run_id", "tracking_uri", "checkpoint", "metrics"}."""
    plan, store = prepare_run(cfg, source)
    try:
        result = build_trainer(plan, store).fit()
        finish_run(plan, result.checkpoint)
    except BaseException:
        tracking.set_terminated(plan.tracking_uri, plan.run_id, "FAILED")
        raise
    print(f"[xmodal] finished MLflow run {plan.run_id} ({plan.run_name})")
    print(f"[xmodal] view it: {tracking.ui_command(plan.tracking_uri)}")
    return {"run_id": plan.run_id, "tracking_uri": plan.tracking_uri, "checkpoint": result.checkpoint,
            "metrics": result.metrics}


def build_trainer(plan: PretrainPlan, store, callbacks: list | None = None):
    """A TorchTrainer for the plan; sweeps pass Tune's report callback."""
    require_ray()
    import ray.data
    import ray.train
    from ray.train.torch import TorchTrainer

    from xmodal.data.pipeline import lxmert_dataset

    connect()
    # Per-operator progress bars from every split coordinator swamp the job's log; training prints its own.
    ray.data.DataContext.get_current().enable_progress_bars = False
    cfg = PretrainConfig.model_validate(plan.config)
    s = cfg.scale
    resources = {"CPU": s.cpus_per_worker, **s.resources_per_worker}
    if s.gpus_per_worker:
        resources["GPU"] = s.gpus_per_worker
    return TorchTrainer(
        pretrain_worker,
        train_loop_config=dataclasses.asdict(plan),
        scaling_config=ray.train.ScalingConfig(
            num_workers=s.num_workers, use_gpu=s.gpus_per_worker > 0, resources_per_worker=resources,
            placement_strategy=s.placement_strategy),
        run_config=ray.train.RunConfig(
            name=plan.run_name, storage_path=plan.storage, callbacks=callbacks,
            failure_config=ray.train.FailureConfig(max_failures=s.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(
                num_to_keep=cfg.train.keep_best, checkpoint_score_attribute=cfg.train.best_metric,
                checkpoint_score_order=cfg.train.best_mode)),
        # Minival is read by each worker straight from the store (see pretrain_worker.evaluate).
        datasets={"train": lxmert_dataset(store, "train", seed=cfg.train.seed)},
    )


def finish_run(plan: PretrainPlan, checkpoint) -> None:
    """Log the resolved config and the final model as artifacts, then mark the MLflow run finished."""
    uri, run_id = plan.tracking_uri, plan.run_id
    with tempfile.TemporaryDirectory() as tmp:
        cfg_file = Path(tmp) / "config.yaml"
        cfg_file.write_text(yaml.safe_dump(plan.config, sort_keys=False))
        tracking.log_artifact(uri, run_id, cfg_file)
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            for f in (ckpt.MODEL_FILE, ckpt.META_FILE):
                tracking.log_artifact(uri, run_id, Path(d) / f, "model")
    tracking.set_terminated(uri, run_id, "FINISHED")


# ---------------------------------------------------------------- worker


def pretrain_worker(plan_dict: dict[str, Any]) -> None:
    import ray.train
    import ray.train.torch

    from xmodal.data.loader import iter_local_batches
    from xmodal.data.masking import LxmertBatchBuilder
    from xmodal.data.pipeline import iter_lxmert_batches
    from xmodal.data.store import open_store

    plan = PretrainPlan(**plan_dict)
    cfg = PretrainConfig.model_validate(plan.config)
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    device = ray.train.torch.get_device()

    resume = ray.train.get_checkpoint()
    meta: dict[str, Any] = {}
    if resume is not None:
        with resume.as_directory() as d:
            meta = ckpt.read_meta(d)
        if meta.get("finished"):
            return  # a rerun of a finished run: nothing to do

    torch.manual_seed(cfg.train.seed)  # identical initial weights on every worker
    objective = PretrainingObjective(LxmertForPretraining(cfg.model), cfg.tasks)
    qa_scheduled = cfg.tasks.qa and cfg.schedule.qa_from_fraction > 0
    state = prepare(objective, device, cfg.train, cfg.optim, plan.total_steps,
                    find_unused_parameters=qa_scheduled)
    if resume is not None:
        with resume.as_directory() as d:
            meta = ckpt.restore(d, state)

    store = open_store(plan.store)
    builder = LxmertBatchBuilder.from_store(store, cfg.data.masking)
    train_shard = ray.train.get_dataset_shard("train")
    float_dtype = torch.float32  # features travel as float16; autocast handles bf16

    def to_device(batch):
        return batch.to(device, float_dtype, non_blocking=True)

    def data(epoch: int, skip: int):
        batches = iter_lxmert_batches(train_shard, builder, plan.micro_batch, epoch=epoch,
                                      seed=cfg.train.seed, rank=rank, start_batch=skip,
                                      pin_memory=device.type == "cuda")
        return map(to_device, batches)

    def evaluate() -> dict[str, float]:
        # A fixed minival (same masks every time), each worker reading disjoint row groups straight
        # from the store: a Ray Data execution per evaluation costs seconds of start-up.
        batches = iter_local_batches(store, "minival", builder, plan.micro_batch, epoch=0,
                                     seed=cfg.train.seed + 1, rank=rank, world_size=world, shuffle=False,
                                     drop_last=False)
        return ratios(evaluate_sums(state.model, batches, to_device, state.autocast_dtype,
                                    cfg.data.eval_batches))

    qa_from = int(cfg.schedule.qa_from_fraction * cfg.train.epochs)
    all_tasks = cfg.tasks.enabled()
    no_qa = tuple(t for t in all_tasks if t != "qa") or all_tasks

    def step_kwargs(epoch: int) -> dict[str, Any]:
        return {"active": all_tasks if epoch >= qa_from else no_qa}

    hooks = PretrainHooks(plan, cfg, rank, world, device, evaluate, meta)
    fit(state, data, hooks, epochs=cfg.train.epochs, total_steps=plan.total_steps,
        grad_accum=cfg.train.grad_accum, start=(meta.get("epoch", 0), meta.get("pos", 0)),
        step_kwargs=step_kwargs)


class PretrainHooks:
    """Logging, evaluation, checkpoints and the test-only fault switch, run on every worker
    (collectives need all of them); only rank 0 prints and writes to MLflow."""

    def __init__(self, plan: PretrainPlan, cfg: PretrainConfig, rank: int, world: int,
                 device: torch.device, evaluate, meta: dict[str, Any]):
        self.plan, self.cfg, self.rank, self.world, self.device = plan, cfg, rank, world, device
        self.evaluate = evaluate
        self.last_eval_step = meta.get("step", -1)
        self.best = meta.get("best")
        self.meter = Throughput(meta.get("step", 0), plan.total_steps)
        self.logger = (tracking.RunLogger(plan.tracking_uri, plan.run_id, cfg.mlflow.system_metrics)
                       if rank == 0 else None)
        self.window: dict[str, float] = {}
        self.window_steps = 0
        self.last_metrics: dict[str, float] = {}
        if self.logger is not None and "step" in meta:
            # Marks the restart in MLflow: training continued from this checkpointed step.
            self.logger.log({"train/resumed_from_step": meta["step"]}, meta["step"], force=True)
            say(f"[xmodal] resumed from checkpoint at step {meta['step']} (epoch {meta.get('epoch')})")

    def after_step(self, state: TrainState, epoch: int, pos: int, losses: dict[str, torch.Tensor]) -> None:
        t = self.cfg.train
        self.meter.add(t.batch_size)
        self._maybe_fail(state.step)
        for k, v in losses.items():
            self.window[k] = self.window.get(k, 0.0) + float(v)
        self.window_steps += 1
        if state.step % t.log_every == 0:
            sums = all_reduce_sums(self.window, self.device)
            n = self.window_steps * self.world
            metrics = {f"train/{k}": v / n for k, v in sums.items()}
            self.window, self.window_steps = {}, 0
            rate, eta = self.meter.read(state.step)
            metrics.update({"train/lr": state.scheduler.get_last_lr()[0], "train/samples_per_s": rate,
                            "train/epoch": epoch})
            if self.rank == 0:
                say(f"[xmodal] step {state.step}/{self.plan.total_steps} epoch {epoch} "
                      f"loss {metrics.get('train/loss', float('nan')):.4f} {rate:,.0f} samples/s "
                      f"ETA {_fmt_eta(eta)}")
                self.logger.log(metrics, state.step)
        if state.step % t.eval_every == 0:
            self._eval_and_checkpoint(state, epoch, pos, finished=False)

    def at_end(self, state: TrainState, epoch: int, pos: int) -> None:
        self._eval_and_checkpoint(state, epoch, pos, finished=True, rerun_eval=state.step != self.last_eval_step or not self.last_metrics)
        if self.logger is not None:
            self.logger.close()

    def _eval_and_checkpoint(self, state, epoch, pos, finished, rerun_eval=True) -> None:
        import ray.train

        metrics = self.evaluate() if rerun_eval else dict(self.last_metrics)
        self.last_eval_step, self.last_metrics = state.step, metrics
        score = metrics.get(self.cfg.train.best_metric)
        if score is not None and (self.best is None or (score > self.best) == (self.cfg.train.best_mode == "max")):
            self.best = score
        if self.rank == 0 and rerun_eval:
            shown = " ".join(f"{k.removeprefix('eval/')} {v:.4f}" for k, v in sorted(metrics.items()))
            say(f"[xmodal] eval @ step {state.step}: {shown}")
            self.logger.log(metrics, state.step)
        report = {**metrics, "step": state.step, "epoch": epoch}
        if self.rank == 0:
            with tempfile.TemporaryDirectory() as tmp:
                ckpt.save(tmp, state, {"epoch": epoch, "pos": pos, "finished": finished, "best": self.best,
                                       "run_id": self.plan.run_id, "config": self.plan.config})
                ray.train.report(report, checkpoint=ray.train.Checkpoint.from_directory(tmp))
        else:
            ray.train.report(report)

    def _maybe_fail(self, step: int) -> None:
        """Test-only: one worker exits once at `train.fail_at_step` to exercise FailureConfig."""
        marker = self.plan.fail_marker
        if self.cfg.train.fail_at_step != step or marker is None or self.rank != min(1, self.world - 1):
            return
        if Path(marker).exists():
            return
        Path(marker).parent.mkdir(parents=True, exist_ok=True)
        Path(marker).write_text(json.dumps({"step": step, "time": time.time()}))
        say(f"[xmodal] fault injection: worker {self.rank} exits at step {step}")
        os._exit(1)


def say(message: str) -> None:
    """Progress from a Train worker. Ray Train patches `print` into its logger and, when another
    library has wrapped sys.stdout (MLflow does), also tees it: lines came out twice."""
    print(message, file=sys.__stdout__, flush=True)


def _fmt_eta(seconds: float) -> str:
    if seconds == float("inf"):
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"
