"""MulT training on Ray Train (`jobs/train_mult.py`): driver, per-worker function, multi-seed runs.

Same shape as the pretraining job (and the same `xmodal.train.job` machinery): the driver resolves
store, dims, steps and the MLflow run before Ray starts; workers train with `fit`, evaluate on the
validation split every `eval_every` steps, keep the best model by `train.best_metric`, and at the
end evaluate the TEST split once, with that selected model. The sweep layer calls prepare_run /
build_trainer / finish_run.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from xmodal import tracking
from xmodal.config import ConfigError, MultTrainConfig, flatten
from xmodal.models.mult import Mult
from xmodal.objectives.sentiment import MultObjective, compute_metrics
from xmodal.train import checkpoint as ckpt
from xmodal.train.cluster import connect, storage_path
from xmodal.train.job import (
    RunHooks,
    RunPlan,
    ValidationSelection,
    fail_marker,
    finish_run,  # noqa: F401  (the sweep runner calls <job>.finish_run)
    make_trainer,
    open_run,
    run_job,
    worker_start,
)
from xmodal.train.loop import autocast, fit
from xmodal.train.runtime import prepare

DEFAULT_STORE = "data/synthetic_mult"
SENTIMENT_METRICS = ("mae", "corr", "acc7", "acc5", "acc2", "f1", "acc2_has0", "f1_has0")
EMOTION_METRICS = tuple(f"{e}_{m}" for e in ("neutral", "happy", "sad", "angry") for m in ("acc", "f1")) + (
    "mean_acc", "mean_f1")


def resolve_store(cfg: MultTrainConfig):
    from xmodal.data.mult.store import open_store
    from xmodal.data.mult.synthetic import build_synthetic_store

    if cfg.data.store is None:
        # The embedded store is derived data: rebuilt when it was built with other options (e.g. by an
        # older default or `--set data.synthetic.*`), so a run always trains on the options it logs.
        path = Path(DEFAULT_STORE).resolve()
        if (path / "manifest.json").exists():
            store = open_store(path)
            wanted = json.loads(json.dumps(dataclasses.asdict(cfg.data.synthetic)))  # tuples as in the manifest
            if store.manifest.source.get("options") in (None, wanted):
                return store
            print(f"[xmodal] note: rebuilding {path}, built with other synthetic options")
            return build_synthetic_store(path, cfg.data.synthetic, overwrite=True)
        return build_synthetic_store(path, cfg.data.synthetic)
    path = Path(cfg.data.store).expanduser().resolve()
    if not path.exists():
        raise ConfigError(f"data.store: {str(path)!r} does not exist; build one with `python jobs/ingest.py "
                          f"mult|mult-synthetic {path}` or leave data.store unset for the embedded synthetic store")
    return open_store(path)


def with_store_dims(cfg: MultTrainConfig, store) -> MultTrainConfig:
    dims = store.dims
    out = 1 if store.task == "sentiment" else 8
    model = dataclasses.replace(cfg.model, l_dim=dims["text"], a_dim=dims["audio"], v_dim=dims["vision"],
                                output_dim=out).validate()
    valid = [f"valid/{m}" for m in (SENTIMENT_METRICS if store.task == "sentiment" else EMOTION_METRICS)]
    if cfg.train.best_metric not in valid + ["valid/loss"]:
        raise ConfigError(f"train.best_metric: {cfg.train.best_metric!r} is not measured on a {store.task} store; "
                          f"valid: {', '.join(valid + ['valid/loss'])}")
    return cfg.model_copy(update={"model": model})


def prepare_run(cfg: MultTrainConfig, source: str = "defaults", parent_run_id: str | None = None,
                extra_tags: dict[str, str] | None = None):
    """Everything that can fail on bad input fails here, before Ray starts. Returns (plan, store)."""
    store = resolve_store(cfg)
    cfg = with_store_dims(cfg, store)
    t = cfg.train
    micro, total = schedule(cfg, store.manifest.rows["train"])
    uri = tracking.resolve_tracking_uri(cfg.mlflow.tracking_uri)
    name = cfg.mlflow.run_name or f"mult-{cfg.model.variant}-{time.strftime('%Y%m%d-%H%M%S')}"
    cfg = cfg.model_copy(update={"mlflow": cfg.mlflow.model_copy(update={"run_name": name})})
    storage = storage_path(cfg.scale.storage_path)
    tags = {"model": "mult", "variant": cfg.model.variant, "task": store.task, "preset": cfg.preset,
            "store": str(store.path), "dataset": store.manifest.dataset, "config_source": source,
            **(extra_tags or {})}
    run_id = open_run(uri, cfg.mlflow.experiment, name, flatten(cfg), tags, parent_run_id)
    plan = RunPlan(config=cfg.model_dump(mode="json"), store=str(store.path), tracking_uri=uri, run_id=run_id,
                   run_name=name, storage=storage, total_steps=total, micro_batch=micro,
                   fail_marker=fail_marker(storage, name) if t.fail_at_step is not None else None)
    return plan, store


def schedule(cfg: MultTrainConfig, train_rows: int) -> tuple[int, int]:
    """(micro-batch per worker, total optimizer steps) of a run over `train_rows` training clips."""
    t, workers = cfg.train, cfg.scale.num_workers
    if t.batch_size % (workers * t.grad_accum):
        raise ConfigError(f"train.batch_size {t.batch_size} must be divisible by scale.num_workers x "
                          f"train.grad_accum = {workers * t.grad_accum}")
    micro = t.batch_size // (workers * t.grad_accum)
    steps_per_epoch = train_rows // workers // micro // t.grad_accum
    if steps_per_epoch < 1:
        raise ConfigError(f"train.batch_size {t.batch_size} is larger than the {train_rows} training clips")
    total = steps_per_epoch * t.epochs
    return micro, (min(total, t.max_steps) if t.max_steps else total)


def build_state(cfg: MultTrainConfig, task: str, device: torch.device, total_steps: int):
    """The seeded model, objective, optimizer (Adam, as the reference) and schedule of a worker."""
    torch.manual_seed(cfg.train.seed)
    objective = MultObjective(Mult(cfg.model), task, cfg.regression_loss)
    return prepare(objective, device, cfg.train, cfg.optim, total_steps, optimizer="adam")


def build_trainer(plan: RunPlan, store, callbacks: list | None = None):
    connect()
    from xmodal.data.mult.pipeline import mult_dataset

    cfg = MultTrainConfig.model_validate(plan.config)
    # Validation and test are read by each worker straight from the store (small; see evaluate).
    return make_trainer(mult_worker, plan, cfg.scale, cfg.train,
                        {"train": mult_dataset(store, "train", seed=cfg.train.seed)}, callbacks)


def run_mult(cfg: MultTrainConfig, source: str = "defaults") -> dict[str, Any]:
    """One run, or one per seed in `cfg.seeds` under a parent run with mean and std of every metric."""
    if not cfg.seeds:
        return _run_one(cfg, source)
    uri = tracking.resolve_tracking_uri(cfg.mlflow.tracking_uri)
    base = cfg.mlflow.run_name or f"mult-{cfg.model.variant}-{time.strftime('%Y%m%d-%H%M%S')}"
    parent = open_run(uri, cfg.mlflow.experiment, base, flatten(cfg),
                      {"model": "mult", "variant": cfg.model.variant, "seeds": ",".join(map(str, cfg.seeds))})
    finals = []
    for seed in cfg.seeds:
        one = cfg.model_copy(update={
            "seeds": None, "train": cfg.train.model_copy(update={"seed": seed}),
            "mlflow": cfg.mlflow.model_copy(update={"run_name": f"{base}-seed{seed}"})})
        res = _run_one(one, source, parent_run_id=parent)
        finals.append(tracking.client(uri).get_run(res["run_id"]).data.metrics)
    summary = seed_summary(finals)
    run_logger = tracking.RunLogger(uri, parent)
    run_logger.log(summary, step=0, force=True)
    tracking.set_terminated(uri, parent)
    shown = {k.removesuffix("_mean"): (v, summary[k.removesuffix("_mean") + "_std"])
             for k, v in summary.items() if k.endswith("_mean") and k.startswith("test/")}
    print("[xmodal] over seeds " + ", ".join(map(str, cfg.seeds)) + ": " +
          "  ".join(f"{k} {m:.4f} ± {s:.4f}" for k, (m, s) in sorted(shown.items())))
    return {"run_id": parent, "tracking_uri": uri, "summary": summary}


def seed_summary(finals: list[dict[str, float]]) -> dict[str, float]:
    """{metric_mean, metric_std} over seeds for the test and best-validation metrics every run has."""
    keys = set.intersection(*(set(m) for m in finals)) if finals else set()
    out: dict[str, float] = {}
    for k in sorted(k for k in keys if k.startswith(("test/", "best_valid/"))):
        vals = [m[k] for m in finals]
        out[f"{k}_mean"] = statistics.fmean(vals)
        out[f"{k}_std"] = statistics.stdev(vals) if len(vals) > 1 else 0.0
    return out


def _run_one(cfg: MultTrainConfig, source: str, parent_run_id: str | None = None) -> dict[str, Any]:
    return run_job(prepare_run, build_trainer, cfg, source, parent_run_id)


# ---------------------------------------------------------------- worker


@torch.no_grad()
def evaluate_outputs(objective: MultObjective, batches, device, autocast_dtype, prefix: str) -> dict[str, float]:
    """Metrics on the whole split: every worker's outputs are gathered, then docs/papers.md#metrics computed."""
    objective.eval()
    outs, labels, index, loss_sum = [], [], [], 0.0
    for batch in batches:
        batch = batch.to(device, torch.float32)
        with autocast(device, autocast_dtype):
            res = objective(batch, with_metrics=True)
        outs.append(res["outputs"].cpu())
        labels.append(res["labels"].cpu())
        index.append(batch.index.cpu())
        loss_sum += float(res["loss"]) * len(batch)
    mine = (torch.cat(outs) if outs else None, torch.cat(labels) if labels else None,
            torch.cat(index) if index else None, loss_sum)
    parts = [mine]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
    parts = [p for p in parts if p[0] is not None]
    if not parts:
        raise RuntimeError(f"evaluation on {prefix!r} saw no samples on any worker")
    out, lab, idx = (torch.cat([p[i] for p in parts]) for i in range(3))
    order = torch.argsort(idx)  # the same order whatever the number of workers
    metrics = compute_metrics(objective.task, out[order].numpy(), lab[order].numpy())
    metrics["loss"] = sum(p[3] for p in parts) / len(idx)
    return {f"{prefix}/{k}": float(v) for k, v in metrics.items()}


def mult_worker(plan_dict: dict[str, Any]) -> None:
    import ray.train

    from xmodal.data.mult.pipeline import iter_mult_batches
    from xmodal.data.mult.store import open_store

    plan = RunPlan(**plan_dict)
    cfg = MultTrainConfig.model_validate(plan.config)
    store = open_store(plan.store)

    start = worker_start()
    rank, world, device, resume, meta = start.rank, start.world, start.device, start.resume, start.meta
    if meta.get("finished"):
        return

    state = build_state(cfg, store.task, device, plan.total_steps)
    plain = ckpt.unwrap(state.model)
    selection = ValidationSelection(plain, cfg.train.best_metric, cfg.train.best_mode)
    if resume is not None:
        with resume.as_directory() as d:
            meta = ckpt.restore(d, state)
            selection.restore(d)

    train_shard = ray.train.get_dataset_shard("train")

    def data(epoch: int, skip: int):
        batches = iter_mult_batches(train_shard, store.dims, plan.micro_batch, epoch=epoch, seed=cfg.train.seed,
                                    rank=rank, pin_memory=device.type == "cuda")
        return (b.to(device, torch.float32, non_blocking=True) for b in itertools.islice(batches, skip, None))

    def split_batches(split: str):
        return store.split(split).batches(plan.micro_batch, rank=rank, world_size=world, even_shards=False)

    def evaluate() -> dict[str, float]:
        metrics = evaluate_outputs(plain, split_batches("valid"), device, state.autocast_dtype, "valid")
        selection.consider(metrics)
        return metrics

    def test_selected(_state) -> dict[str, float]:
        """The test split, evaluated once, with the model selected on validation."""
        final = selection.load_selected()
        final.update(evaluate_outputs(plain, split_batches("test"), device, state.autocast_dtype, "test"))
        return final

    hooks = RunHooks(plan, cfg.train, cfg.mlflow.system_metrics, rank, world, device, evaluate, meta,
                     on_checkpoint=selection.save, on_end=test_selected)
    fit(state, data, hooks, epochs=cfg.train.epochs, total_steps=plan.total_steps,
        grad_accum=cfg.train.grad_accum, start=(meta.get("epoch", 0), meta.get("pos", 0)))
