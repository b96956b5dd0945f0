"""The LXMERT pretraining job (`jobs/pretrain.py`): one job spec (`xmodal.runner.spec`).

Data: an LXMERT store (or the embedded synthetic one, built on first use); the model's vocabulary,
feature and label sizes come from its manifest. Workers read their own row groups of the train split
through Ray Data (the same every run: reproducible, exact resume) and evaluate on a fixed minival
read straight from the store; the five pretraining tasks
are switchable (`tasks.*`), QA can join after a fraction of the epochs (`schedule.qa_from_fraction`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from xmodal.base import run_tags
from xmodal.config.experiment import ConfigError
from xmodal.core.loop import evaluate_sums, ratios
from xmodal.jobs.pretrain_config import PretrainConfig
from xmodal.models.lxmert.model import LxmertForPretraining, no_grad_row0
from xmodal.objectives.pretraining import PretrainingObjective, pretraining_eval_metrics
from xmodal.runner.spec import JobSpec, PrepareContext, PreparedJob, Worker, open_configured, with_data_sizes

DEFAULT_STORE = "data/synthetic_lxmert"


class PretrainJob(JobSpec):
    name = "pretrain"
    config_class = PretrainConfig
    run_name = "pretrain-{cfg.preset}"

    # ------------------------------------------------ data
    def prepare(self, cfg: PretrainConfig, inputs: PrepareContext) -> PreparedJob:
        from xmodal.data.lxmert.store import open_store
        from xmodal.data.lxmert.synthetic import ensure_synthetic_store

        store = open_configured(
            inputs, cfg.data.store, lambda: ensure_synthetic_store(Path(DEFAULT_STORE).resolve(), cfg.data.synthetic),
            open_store, "python jobs/ingest.py lxmert|synthetic {path}")
        cfg = with_store_dims(cfg, store)
        if cfg.optim.schedule == "plateau" and not store.manifest.sentences("minival"):
            raise ConfigError(f"optim.schedule: the plateau watches {cfg.optim.plateau.metric} on minival at every "
                              f"epoch's end, but the store {store.path} has no minival sentences")
        builder = batch_builder(cfg, store)  # checks the masking options against the store's vocabulary
        return PreparedJob(
            cfg, store, str(store.path), train_examples=store.manifest.sentences("train"), units=store.units("train"),
            dataset=dataset_record(store), tags={run_tags.MODEL: "lxmert", run_tags.PRESET: cfg.preset},
            baselines=baselines(cfg, store), metric_order=pretraining_eval_metrics(cfg.tasks),
            # QA joining later leaves its head unused for a while: DDP must not wait for its gradients.
            train_options={"find_unused_parameters": cfg.tasks.qa and cfg.schedule.qa_from_fraction > 0},
            builder=builder)

    def open_data(self, path: str):
        from xmodal.data.lxmert.store import open_store

        return open_store(path)

    # ------------------------------------------------ model
    def build_objective(self, cfg: PretrainConfig, store) -> PretrainingObjective:
        model = LxmertForPretraining(cfg.model)
        if cfg.optim.embedding_row0 == "no_grad":
            no_grad_row0(model)
        return PretrainingObjective(model, cfg.tasks)

    def step_kwargs(self, cfg: PretrainConfig) -> Callable[[int], dict[str, Any]]:
        return task_schedule(cfg)

    # ------------------------------------------------ worker
    def train_batches(self, w: Worker, epoch: int, skip: int) -> Iterable[Any]:
        """This worker's units of the epoch, through Ray Data on a Train worker or straight from the
        files in-process: the same batches either way."""
        args = dict(seed=w.cfg.train.seed, epoch=epoch, rank=w.rank, start_batch=skip, mix_units=w.cfg.data.mix_units)
        if w.ray_data:
            from xmodal.data.lxmert.pipeline import iter_rank_batches

            batches = iter_rank_batches(w.data, "train", w.builder, w.micro_batch, world=w.world,
                                        pin_memory=w.device.type == "cuda", **args)
        else:
            from xmodal.data.lxmert.loader import iter_local_batches

            batches = iter_local_batches(w.data, "train", w.builder, w.micro_batch, world=w.world,
                                         **args)
        return map(w.to_device, batches)

    def evaluate(self, w: Worker) -> dict[str, float]:
        """A fixed minival (same masks every time), each worker reading disjoint row groups straight
        from the store: a Ray Data execution per evaluation costs seconds of start-up."""
        from xmodal.data.lxmert.loader import iter_local_batches

        batches = iter_local_batches(w.data, "minival", w.builder, w.micro_batch, epoch=0,
                                     seed=w.cfg.train.seed + 1, rank=w.rank, world=w.world, shuffle=False,
                                     drop_last=False, mix_units=w.cfg.data.mix_units)
        return ratios(evaluate_sums(w.model, batches, w.to_device, w.cfg.data.eval_batches))


def baselines(cfg: PretrainConfig, store) -> dict[str, list]:
    """The chance level or image-blind prior of each minival metric these tasks report."""
    from xmodal.data.lxmert.priors import PRIOR_NAMES, pretraining_priors

    measured = set(pretraining_eval_metrics(cfg.tasks))
    priors = pretraining_priors(store, cfg.data.masking.mismatch_prob)
    return {k: [v, PRIOR_NAMES[k]] for k, v in priors.items() if k in measured and v == v}  # v == v: no NaN


def dataset_record(store) -> dict[str, Any]:
    m = store.manifest
    rows = {f"{split}_{what}": n for split in m.shards
            for what, n in (("images", m.images(split)), ("sentences", m.sentences(split)))}
    dims = {"feat_dim": m.feat_dim, "num_objects": m.num_objects, "vocab_size": m.vocab_size,
            "max_seq_len": m.max_seq_len, "num_object_labels": m.num_object_labels,
            "num_attr_labels": m.num_attr_labels, "num_answers": m.num_answers}
    return {"name": store.path.name, "rows": rows, "dims": dims}


def batch_builder(cfg: PretrainConfig, store):
    from xmodal.data.lxmert.masking import LxmertBatchBuilder

    return LxmertBatchBuilder.from_store(store, cfg.data.masking)


def store_sizes(manifest) -> dict[str, tuple[int, str]]:
    """The `LxmertConfig` sizes an LXMERT store fixes, each with how to say it (`spec.with_data_sizes`)."""
    return {
        "vocab_size": (manifest.vocab_size, "a vocabulary of {} tokens"),
        "visual_feat_dim": (manifest.feat_dim, "features {} wide"),
        "num_object_labels": (manifest.num_object_labels, "{} object labels"),
        "num_attr_labels": (manifest.num_attr_labels, "{} attribute labels"),
        "num_qa_labels": (manifest.num_answers, "{} answers"),
    }


def with_store_dims(cfg: PretrainConfig, store) -> PretrainConfig:
    """The model's vocabulary, feature and label sizes come from the store."""
    manifest = store.manifest
    seq_len = max(manifest.max_seq_len, cfg.data.masking.max_seq_len or 0)
    if seq_len > cfg.model.max_positions:
        raise ConfigError(f"model.max_positions {cfg.model.max_positions} is shorter than the samples' "
                          f"{seq_len} tokens (the store's max_seq_len {manifest.max_seq_len}, "
                          f"data.masking.max_seq_len {cfg.data.masking.max_seq_len})")
    model = with_data_sizes(cfg.model, cfg.PRESETS[cfg.preset], store_sizes(manifest), f"the store {store.path}")
    return cfg.model_copy(update={"model": model})


def task_schedule(cfg: PretrainConfig) -> Callable[[int], dict[str, Any]]:
    """epoch -> train_step's keyword arguments: QA joins after `schedule.qa_from_fraction` of the epochs."""
    qa_from = int(cfg.schedule.qa_from_fraction * cfg.train.epochs)
    all_tasks = cfg.tasks.enabled()
    no_qa = tuple(t for t in all_tasks if t != "qa") or all_tasks

    def step_kwargs(epoch: int) -> dict[str, Any]:
        return {"active": all_tasks if epoch >= qa_from else no_qa}

    return step_kwargs


def pretrain_in_process(cfg: PretrainConfig, store) -> tuple[torch.nn.Module, dict[str, float]]:
    """The worker's pretraining in this process, on the CPU, without Ray (`inprocess.run_in_process`).
    The learning tests run the embedded default through it. Returns (objective, minival metrics)."""
    from xmodal.runner.inprocess import run_in_process

    w, metrics = run_in_process(PretrainJob(), cfg, store)
    return w.model, metrics
