"""LXMERT pretraining on Ray Train: the driver (`run_pretraining`) and the per-worker function.

Driver: validate and resolve everything (store, dims, MLflow run, storage path)
before Ray starts; build a TorchTrainer; after `fit()` log the final model and
close the MLflow run. Workers: build the model, restore the latest checkpoint,
run `xmodal.train.loop.fit`; `xmodal.train.job.RunHooks` logs, evaluates on
minival and reports checkpoints. The sweep layer calls prepare_run /
build_trainer / finish_run.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from xmodal import tracking
from xmodal.config import ConfigError, PretrainConfig, flatten, pretraining_eval_metrics
from xmodal.data.lxmert.priors import PRIOR_NAMES, pretraining_priors
from xmodal.models.lxmert import LxmertForPretraining
from xmodal.objectives.pretraining import PretrainingObjective
from xmodal.train import checkpoint as ckpt
from xmodal.train.cluster import connect, storage_path
from xmodal.train.job import (
    RunHooks,
    RunPlan,
    fail_marker,
    finish_run,  # noqa: F401  (the sweep runner calls <job>.finish_run)
    make_trainer,
    open_run,
    run_job,
    worker_start,
)
from xmodal.train.loop import NoHooks, evaluate_sums, fit, ratios
from xmodal.train.runtime import prepare

DEFAULT_STORE = "data/synthetic_lxmert"


# ---------------------------------------------------------------- driver


def resolve_store(cfg: PretrainConfig):
    from xmodal.data.lxmert.store import open_store
    from xmodal.data.lxmert.synthetic import ensure_synthetic_store

    if cfg.data.store is None:
        return ensure_synthetic_store(Path(DEFAULT_STORE).resolve(), cfg.data.synthetic)
    path = Path(cfg.data.store).expanduser().resolve()
    if not path.exists():
        raise ConfigError(f"data.store: {str(path)!r} does not exist; build one with "
                          f"`python jobs/ingest.py lxmert|synthetic {path}` or leave data.store unset "
                          "for the embedded synthetic store")
    return open_store(path)


def with_store_dims(cfg: PretrainConfig, store) -> PretrainConfig:
    """The model's vocabulary, feature and label sizes come from the store."""
    manifest = store.manifest
    dims = {
        "vocab_size": manifest.vocab_size,
        "visual_feat_dim": manifest.feat_dim,
        "num_object_labels": manifest.num_object_labels,
        "num_attr_labels": manifest.num_attr_labels,
        "num_qa_labels": manifest.num_answers,
    }
    seq_len = max(manifest.max_seq_len, cfg.data.masking.max_seq_len or 0)
    if seq_len > cfg.model.max_positions:
        raise ConfigError(f"model.max_positions {cfg.model.max_positions} is shorter than the samples' "
                          f"{seq_len} tokens (the store's max_seq_len {manifest.max_seq_len}, "
                          f"data.masking.max_seq_len {cfg.data.masking.max_seq_len})")
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
    cfg = with_store_dims(cfg, store)
    micro, total_steps = plan_steps(cfg, store.manifest.sentences("train"))
    uri = tracking.resolve_tracking_uri(cfg.mlflow.tracking_uri)
    name = cfg.mlflow.run_name or f"pretrain-{cfg.preset}-{time.strftime('%Y%m%d-%H%M%S')}"
    cfg = cfg.model_copy(update={"mlflow": cfg.mlflow.model_copy(update={"run_name": name})})
    storage = storage_path(cfg.scale.storage_path)

    tags = {"model": "lxmert", "task": "pretrain", "preset": cfg.preset, "store": str(store.path),
            "config_source": source, **(extra_tags or {})}
    run_id = open_run(uri, cfg.mlflow.experiment, name, flatten(cfg), tags, parent_run_id)
    baselines = task_baselines(cfg, store)
    tracking.log_metrics(uri, run_id, {f"baseline/{k.removeprefix('eval/')}": v for k, v in baselines.items()})
    plan = RunPlan(
        config=cfg.model_dump(mode="json"), store=str(store.path), tracking_uri=uri, run_id=run_id,
        run_name=name, storage=storage, total_steps=total_steps, micro_batch=micro,
        fail_marker=fail_marker(storage, name) if cfg.train.fail_at_step is not None else None,
        baselines={k: [v, PRIOR_NAMES[k]] for k, v in baselines.items()})
    return plan, store


def task_baselines(cfg: PretrainConfig, store) -> dict[str, float]:
    """The chance level or image-blind prior of each minival metric these tasks report."""
    measured = set(pretraining_eval_metrics(cfg.tasks))
    priors = pretraining_priors(store, cfg.data.masking.mismatch_prob)
    return {k: v for k, v in priors.items() if k in measured and v == v}  # v == v: drop NaN


def run_pretraining(cfg: PretrainConfig, source: str = "defaults") -> dict[str, Any]:
    """Run (or resume) one pretraining run; returns {"run_id", "tracking_uri", "checkpoint", "metrics"}."""
    return run_job(prepare_run, build_trainer, cfg, source)


def build_trainer(plan: RunPlan, store, callbacks: list | None = None):
    """A TorchTrainer for the plan; sweeps pass Tune's report callback."""
    connect()
    from xmodal.data.lxmert.pipeline import lxmert_dataset

    cfg = PretrainConfig.model_validate(plan.config)
    # Minival is read by each worker straight from the store (see pretrain_worker.evaluate).
    datasets = {"train": lxmert_dataset(store, "train", seed=cfg.train.seed)}
    return make_trainer(pretrain_worker, plan, cfg.scale, cfg.train, datasets, callbacks)


# ---------------------------------------------------------------- worker


def pretrain_worker(plan_dict: dict[str, Any]) -> None:
    import ray.train

    from xmodal.data.lxmert.masking import LxmertBatchBuilder
    from xmodal.data.lxmert.pipeline import iter_lxmert_batches
    from xmodal.data.lxmert.store import open_store

    plan = RunPlan(**plan_dict)
    cfg = PretrainConfig.model_validate(plan.config)

    start = worker_start()
    rank, world, device, resume, meta = start.rank, start.world, start.device, start.resume, start.meta
    if meta.get("finished"):
        return  # a rerun of a finished run: nothing to do

    objective = build_objective(cfg)
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
        return minival_metrics(state, cfg, store, builder, plan.micro_batch, to_device, rank, world)

    hooks = RunHooks(plan, cfg.train, cfg.mlflow.system_metrics, rank, world, device, evaluate, meta)
    fit(state, data, hooks, epochs=cfg.train.epochs, total_steps=plan.total_steps,
        grad_accum=cfg.train.grad_accum, start=(meta.get("epoch", 0), meta.get("pos", 0)),
        step_kwargs=task_schedule(cfg))


# ---------------------------------------------------------------- shared by the worker and in-process runs


def build_objective(cfg: PretrainConfig) -> PretrainingObjective:
    torch.manual_seed(cfg.train.seed)  # identical initial weights on every worker
    return PretrainingObjective(LxmertForPretraining(cfg.model), cfg.tasks)


def task_schedule(cfg: PretrainConfig) -> Callable[[int], dict[str, Any]]:
    """epoch -> train_step's keyword arguments: QA joins after `schedule.qa_from_fraction` of the epochs."""
    qa_from = int(cfg.schedule.qa_from_fraction * cfg.train.epochs)
    all_tasks = cfg.tasks.enabled()
    no_qa = tuple(t for t in all_tasks if t != "qa") or all_tasks

    def step_kwargs(epoch: int) -> dict[str, Any]:
        return {"active": all_tasks if epoch >= qa_from else no_qa}

    return step_kwargs


def minival_metrics(state, cfg: PretrainConfig, store, builder, batch_size: int, to_device,
                    rank: int = 0, world: int = 1) -> dict[str, float]:
    """A fixed minival (same masks every time), each worker reading disjoint row groups straight from
    the store: a Ray Data execution per evaluation costs seconds of start-up."""
    from xmodal.data.lxmert.loader import iter_local_batches

    batches = iter_local_batches(store, "minival", builder, batch_size, epoch=0, seed=cfg.train.seed + 1,
                                 rank=rank, world_size=world, shuffle=False, drop_last=False)
    return ratios(evaluate_sums(state.model, batches, to_device, state.autocast_dtype, cfg.data.eval_batches))


def pretrain_in_process(cfg: PretrainConfig, store) -> tuple[PretrainingObjective, dict[str, float]]:
    """The worker's pretraining in this process, on the CPU, without Ray: the same initial weights,
    batch builder, task schedule, steps, loop (`fit`) and minival evaluation. Only the reader differs:
    the train split comes from the Ray-free `iter_local_batches` instead of Ray Data's streaming
    split. The learning tests run the embedded default through it. Returns (objective, minival metrics)."""
    from xmodal.data.lxmert.loader import iter_local_batches
    from xmodal.data.lxmert.masking import LxmertBatchBuilder

    cfg = with_store_dims(cfg, store)
    micro, total = plan_steps(cfg, store.manifest.sentences("train"))
    builder = LxmertBatchBuilder.from_store(store, cfg.data.masking)
    objective = build_objective(cfg)
    cpu = torch.device("cpu")
    state = prepare(objective, cpu, cfg.train, cfg.optim, total)

    def to_cpu(batch):
        return batch.to(cpu, torch.float32)

    def data(epoch: int, skip: int):
        return map(to_cpu, iter_local_batches(store, "train", builder, micro, epoch=epoch, seed=cfg.train.seed,
                                              start_batch=skip))

    fit(state, data, NoHooks(), epochs=cfg.train.epochs, total_steps=total, grad_accum=cfg.train.grad_accum,
        step_kwargs=task_schedule(cfg))
    return objective, minival_metrics(state, cfg, store, builder, micro, to_cpu)
