"""MulT training (`jobs/train_mult.py`): one job spec (`xmodal.runner.spec`).

Workers read their own row groups of the train split through Ray Data (the same every run:
reproducible, exact resume), evaluate on the validation split every `eval_every` steps, keep the
best model by `train.best_metric`, and at the end evaluate the TEST split once, with that selected
model, and then once per `robust.conditions` with the inputs perturbed (`robust/<condition>/<metric>`,
xmodal.core.robustness). Optimiser: `optim.name` (Adam by default, as the reference code). With `seeds`, the engine runs
one run per seed under a parent run with every metric's mean and std.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from xmodal.base import run_tags
from xmodal.config.experiment import ConfigError
from xmodal.core.batches import MultBatch
from xmodal.core.loop import gather_rows
from xmodal.data.units import epoch_units, read_unit
from xmodal.jobs.mult_config import DEFAULT_PAGES, MultTrainConfig
from xmodal.models.mult.model import Mult
from xmodal.objectives.sentiment import MULT_METRICS, MultObjective, compute_metrics, mult_valid_metrics
from xmodal.runner.spec import JobSpec, PrepareContext, PreparedJob, Worker, open_configured, with_data_sizes

DEFAULT_STORE = "data/synthetic_mult"
SENTIMENT_METRICS = MULT_METRICS["sentiment"]
EMOTION_METRICS = MULT_METRICS["emotions"]


class MultJob(JobSpec):
    name = "mult"
    config_class = MultTrainConfig
    run_name = "mult-{cfg.model.variant}"
    selects_on_validation = True

    # ------------------------------------------------ data
    def prepare(self, cfg: MultTrainConfig, inputs: PrepareContext) -> PreparedJob:
        from xmodal.data.mult.store import open_store
        from xmodal.data.mult.synthetic import ensure_synthetic_store

        store = open_configured(
            inputs, cfg.data.store, lambda: ensure_synthetic_store(Path(DEFAULT_STORE).resolve(), cfg.data.synthetic),
            open_store, "python jobs/ingest.py mult|mult-synthetic {path}")
        cfg = with_store_dims(cfg, store)
        m = store.manifest
        dataset = {"name": f"{m.dataset} ({store.path.name})", "rows": dict(m.rows),
                   "dims": {**m.dims, **{f"max_len_{k}": v for k, v in m.max_len.items()}}}
        # The F1 protocol beside the metrics, to compare with published tables (docs/papers.md).
        tags = {run_tags.MODEL: "mult", run_tags.VARIANT: cfg.model.variant, run_tags.TASK: store.task,
                run_tags.PRESET: cfg.preset, run_tags.DATASET: m.dataset, run_tags.F1_PROTOCOL: cfg.f1_protocol}
        return PreparedJob(cfg, store, str(store.path), train_examples=m.rows["train"], units=store.units("train"),
                        dataset=dataset, tags=tags)

    def open_data(self, path: str):
        from xmodal.data.mult.store import open_store

        return open_store(path)

    # ------------------------------------------------ model
    def build_objective(self, cfg: MultTrainConfig, store) -> MultObjective:
        return MultObjective(Mult(cfg.model), store.task, cfg.regression_loss)

    # ------------------------------------------------ worker
    def train_batches(self, w: Worker, epoch: int, skip: int) -> Iterable[Any]:
        """This worker's units of the epoch, through Ray Data on a Train worker or straight from the
        files in-process: the same batches either way."""
        seed = w.cfg.train.seed
        if w.ray_data:
            from xmodal.data.mult.pipeline import iter_rank_batches

            batches = iter_rank_batches(w.data, "train", w.micro_batch, seed=seed, epoch=epoch, rank=w.rank,
                                        world=w.world, start_batch=skip, pin_memory=w.device.type == "cuda")
            return map(w.to_device, batches)
        from xmodal.data.mult.pipeline import batches_from_tables

        units = epoch_units(w.data.units("train"), seed=seed, epoch=epoch, rank=w.rank, world=w.world)
        batches = batches_from_tables((read_unit(u) for u in units), w.data.dims, w.micro_batch, seed=seed,
                                      epoch=epoch, rank=w.rank)
        return map(w.to_device, itertools.islice(batches, skip, None))

    def evaluate(self, w: Worker) -> dict[str, float]:
        return evaluate_split(w, "valid")

    def held_out(self, w: Worker, folder: Path | None) -> dict[str, float]:
        """The test split, evaluated once, with the model selected on validation; then under each
        robustness condition."""
        loaded = w.data.split("test")
        return {**evaluate_split(w, "test", loaded=loaded), **robust_metrics(w, "test", loaded)}


def with_store_dims(cfg: MultTrainConfig, store) -> MultTrainConfig:
    dims = store.dims
    sizes = {"l_dim": (dims["text"], "text features {} wide"), "a_dim": (dims["audio"], "audio features {} wide"),
             "v_dim": (dims["vision"], "vision features {} wide"),
             "output_dim": (1 if store.task == "sentiment" else 8,
                            f"the task {store.task!r}, {{}} output{'' if store.task == 'sentiment' else 's'}")}
    model = with_data_sizes(cfg.model, cfg.PRESETS[cfg.preset], sizes, f"the store {store.path}").validate()
    valid = mult_valid_metrics(store.task)
    if cfg.optim.schedule == "plateau" and not store.manifest.rows.get("valid"):
        raise ConfigError(f"optim.schedule: the plateau watches {cfg.optim.plateau.metric} at every epoch's end, but "
                          f"the store {store.path} has no valid split (it has {', '.join(store.manifest.rows)})")
    if cfg.optim.schedule == "plateau" and cfg.optim.plateau.metric not in valid:
        raise ConfigError(f"optim.plateau.metric: {cfg.optim.plateau.metric!r} is not measured on a {store.task} "
                          f"store; valid: {', '.join(valid)}")
    if cfg.train.best_metric not in valid:
        raise ConfigError(f"train.best_metric: {cfg.train.best_metric!r} is not measured on a {store.task} store; "
                          f"valid: {', '.join(valid)}")
    count = cfg.examples.count
    if count and store.task != "sentiment":
        raise ConfigError(f"examples.count: {count} example pages asked, but MulT's pages show sentiment clips and "
                          f"the store {store.path} holds the task {store.task!r}; leave examples.count unset (none are made "
                          "there) or set it to 0")
    if count is None:
        count = DEFAULT_PAGES if store.task == "sentiment" else 0
    return cfg.model_copy(update={"model": model, "examples": cfg.examples.model_copy(update={"count": count})})


def robust_metrics(w: Worker, split: str, loaded=None) -> dict[str, float]:
    """`split` evaluated under each of `robust.conditions` (`robust/<condition>/<metric>`); the noise
    is scaled by each modality's per-dimension std over the split's real steps."""
    from xmodal.core.robustness import feature_std, mult_perturbation

    r = w.cfg.robust
    loaded = loaded if loaded is not None else w.data.split(split)
    noised = {c.split("_", 1)[1] for c in r.conditions if c.startswith("noise_")}
    stds = {m: feature_std(loaded.values[m]) for m in sorted(noised)}
    out: dict[str, float] = {}
    for condition in r.conditions:
        perturb = mult_perturbation(condition, r.noise_sigma, stds, r.seed)
        metrics = evaluate_split(w, split, perturb, loaded)
        out.update({f"robust/{condition}/{k.split('/', 1)[1]}": v for k, v in metrics.items()})
    return out


@torch.no_grad()
def evaluate_split(w: Worker, split: str, perturb: Callable[[MultBatch], MultBatch] | None = None,
                   loaded=None) -> dict[str, float]:
    """Metrics on a whole split (docs/papers.md#metrics): every worker's outputs are gathered in
    row order, then the metrics computed on all of them, F1 by the config's `f1_protocol`.
    `perturb`: applied to each batch on the device (robustness); `loaded`: the split, when read already."""
    objective = w.model
    objective.eval()
    outs, labels, index, loss_sum = [], [], [], 0.0
    loaded = loaded if loaded is not None else w.data.split(split)
    for batch in loaded.batches(w.micro_batch, rank=w.rank, world=w.world, even_shards=False):
        batch = w.to_device(batch)
        if perturb is not None:
            batch = perturb(batch)
        res = objective(batch, with_metrics=True)
        outs.append(res["outputs"].float())
        labels.append(res["labels"])
        index.append(batch.index)
        loss_sum += float(res["loss"]) * len(batch)

    def cat(xs: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(xs).cpu() if xs else torch.zeros(0)

    idx, cols, sums = gather_rows(cat(index), {"out": cat(outs), "lab": cat(labels)}, {"loss": loss_sum})
    if len(idx) == 0:
        raise RuntimeError(f"evaluation on {split!r} saw no samples on any worker")
    metrics = compute_metrics(objective.task, cols["out"].numpy(), cols["lab"].numpy(), w.cfg.f1_protocol)
    metrics["loss"] = sums["loss"] / len(idx)
    return {f"{split}/{k}": float(v) for k, v in metrics.items()}
