"""LXMERT fine-tuning (`jobs/finetune.py --task vqa|gqa|nlvr2`): one job spec (`xmodal.runner.spec`).

Workers read only their own row groups of the image stores (`data.finetune.stream`: Ray Data tasks
on a Train worker, the files straight in-process; the same batches): each epoch the units holding
the train split's images are dealt out from (seed, epoch), every worker takes the same number of
steps; evaluation predicts every example of a split exactly once over the workers. They evaluate
the validation split every `eval_every` steps, keep the best model by `train.best_metric`, and at
the end evaluate every held-out split with that model and write the reference's prediction files
(VQA/GQA: JSON list of {question_id, answer}; NLVR2: CSV of identifier,True|False), logged as
artifacts under `predictions/`; then the validation split once per `robust.conditions`, the visual
inputs perturbed (`robust/<condition>/<metric>`, xmodal.core.robustness).

Where the weights come from (`init.source`): the newest finished pretraining run on the same image
store (`latest`, the default; scratch when there is none), an MLflow run id (`run`), a checkpoint
folder (`checkpoint`), a transformers LxmertForPreTraining directory (`transformers`), or a snapshot
file of the reference code (`reference`: its pretrained model_LXRT.pth or a fine-tuned BEST.pth). From a
pretrained model the architecture is the checkpoint's, and the answer head starts from the
pretraining QA head where the answer tables overlap (the reference's trick); from a fine-tuned
reference snapshot, the answer head is the snapshot's when its shapes match.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch

from xmodal.base import run_tags
from xmodal.config.experiment import ConfigError
from xmodal.core.loop import gather_rows
from xmodal.data.finetune.stream import split_layout
from xmodal.jobs.finetune_config import INIT_PATH_SOURCES, FinetuneConfig, FinetuneInit
from xmodal.jobs.finetune_init import Init, check_init_run, load_init, resolve_init, resolve_path_init
from xmodal.jobs.pretrain_job import store_sizes
from xmodal.models.lxmert.model import PRESETS as LXMERT_PRESETS
from xmodal.models.lxmert.model import LxmertConfig
from xmodal.objectives.finetune import finetune_metrics
from xmodal.runner.ray_cluster import init_download_dir
from xmodal.runner.spec import (
    CheckedRun,
    JobSpec,
    PrepareContext,
    PreparedJob,
    Worker,
    open_configured,
    with_data_sizes,
)

DEFAULT_SETS = {"vqa": "data/synthetic_vqa", "gqa": "data/synthetic_gqa", "nlvr2": "data/synthetic_nlvr2"}


class FinetuneJob(JobSpec):
    name = "finetune"
    config_class = FinetuneConfig
    run_name = "finetune-{cfg.task}"
    selects_on_validation = True

    # ------------------------------------------------ data
    def prepare(self, cfg: FinetuneConfig, inputs: PrepareContext) -> PreparedJob:
        """`init` checked first where it needs no data (the model section is not set beside
        pretrained weights, which fix the architecture; the folder, file or run named exists and
        holds what it should; no database is created), then the set opened or the embedded one
        built, the starting weights resolved and the model fitted to both."""
        i = cfg.init
        path_init = None
        if i.source in ("run", *INIT_PATH_SOURCES):
            _check_model_unset(cfg)
        if i.source == "run":
            check_init_run(inputs.tracking_uri, i.run_id, lxmert=True)
        elif i.source in INIT_PATH_SOURCES:
            path_init = resolve_path_init(i.source, i.path)  # a reference snapshot is read once
        data = self.open_set(cfg, inputs)
        init, pretrained = path_init or self.resolve_start(cfg, data, inputs.tracking_uri, inputs.download_dir)
        cfg = with_data_dims(cfg, data, pretrained)
        m, store = data.manifest, data.store.manifest
        dataset = {"name": f"{cfg.task} ({data.path.name})", "rows": dict(m.splits),
                   "dims": {"feat_dim": store.feat_dim, "num_objects": store.num_objects,
                            "vocab_size": store.vocab_size, "max_seq_len": m.max_seq_len,
                            "num_answers": m.num_answers}}
        tags = {run_tags.MODEL: "lxmert", run_tags.TASK: f"finetune-{cfg.task}", run_tags.STORE: str(data.store.path),
                run_tags.FINETUNE_SET: str(data.path), run_tags.INIT: init.source}
        if init.run_id:
            tags[run_tags.INIT_RUN_ID] = init.run_id
        return PreparedJob(cfg, data, str(data.path), train_examples=len(data.split("train")),
                        units=split_layout(data, "train").units, dataset=dataset, start=dataclasses.asdict(init),
                        tags=tags)

    def resolve_start(self, cfg: FinetuneConfig, data, tracking_uri: str, download_dir: Path
                      ) -> tuple[Init, LxmertConfig | None]:
        return resolve_init(cfg, str(data.store.path), tracking_uri, download_dir)

    def open_set(self, cfg: FinetuneConfig, inputs: PrepareContext):
        """The fine-tuning set: the configured one, or the embedded synthetic set of the task."""
        from xmodal.data.finetune.sets import open_finetune
        from xmodal.data.finetune.synthetic import ensure_synthetic_finetune
        from xmodal.data.lxmert.synthetic import ensure_synthetic_store
        from xmodal.jobs.pretrain_job import DEFAULT_STORE

        def embedded():
            images = ensure_synthetic_store(Path(DEFAULT_STORE).resolve(), cfg.data.synthetic)
            options = {} if cfg.task == "nlvr2" else {"questions_per_image": cfg.data.synthetic_questions_per_image}
            return ensure_synthetic_finetune(cfg.task, images.path, Path(DEFAULT_SETS[cfg.task]).resolve(), **options)

        data = open_configured(inputs, cfg.data.store, embedded, open_finetune,
                               f"python jobs/ingest.py {cfg.task}|synthetic-{cfg.task} {{path}} --store IMAGES")
        if data.task != cfg.task:
            raise ConfigError(f"data.store: {str(data.path)!r} is a {data.task} set, but task={cfg.task!r}")
        if "valid" not in data.splits:
            raise ConfigError(f"data.store: {data.path} has no valid split (model selection needs one); "
                              f"it has {', '.join(data.splits)}")
        shown = [s for s in data.splits if s != "train"]
        if cfg.examples.count and cfg.examples.split not in shown:
            raise ConfigError(f"examples.split: {cfg.examples.split!r} is not a split the run evaluates; expected one "
                              f"of {', '.join(shown)} (the splits of {data.path} but train)")
        return data

    def open_data(self, path: str):
        from xmodal.data.finetune.sets import open_finetune

        return open_finetune(path)

    # ------------------------------------------------ model
    def build_objective(self, cfg: FinetuneConfig, data):
        from xmodal.models.lxmert.finetune import LxmertForNlvr2, LxmertForQuestionAnswering
        from xmodal.models.lxmert.model import no_grad_row0
        from xmodal.objectives.finetune import FinetuneObjective

        if cfg.task == "nlvr2":
            model = LxmertForNlvr2(cfg.model, output=cfg.nlvr2_output)
        else:
            model = LxmertForQuestionAnswering(cfg.model, data.num_answers)
        if cfg.optim.embedding_row0 == "no_grad":
            no_grad_row0(model)
        return FinetuneObjective(model, cfg.task, qa_loss=cfg.qa_loss)

    # ------------------------------------------------ worker
    def load_start(self, objective, cfg: FinetuneConfig, data, start: dict[str, Any]) -> str:
        answers = list(data.answers.answers) if data.answers is not None else None
        return f"fine-tuning {cfg.task}: " + load_init(objective, Init(**start), answers,
                                                        cfg.init.answer_head_from_qa)

    def train_batches(self, w: Worker, epoch: int, skip: int) -> Iterable[Any]:
        """This worker's own units of the epoch, read by Ray Data tasks on a Train worker and straight
        from the files in-process: the same batches either way."""
        from xmodal.data.finetune.stream import iter_train_batches

        it = iter_train_batches(w.data, "train", w.micro_batch, seed=w.cfg.train.seed, epoch=epoch, rank=w.rank,
                                world=w.world, start_batch=skip, reader=reader(w), pin_memory=w.device.type == "cuda")
        return map(w.to_device, it)

    def evaluate(self, w: Worker) -> dict[str, float]:
        return split_metrics(w.cfg.task, w.data, "valid", predict_split(w, "valid"))

    def held_out(self, w: Worker, folder: Path | None) -> dict[str, float]:
        """Every held-out split with the selected model; the prediction files go to `predictions/`."""
        final: dict[str, float] = {}
        for split in (s for s in w.data.splits if s != "train"):
            p = predict_split(w, split)
            if split != "valid" and has_labels(w.data.split(split)):  # a test split may come unlabelled
                final.update(split_metrics(w.cfg.task, w.data, split, p))
            if folder is not None:
                write_predictions(w.cfg.task, w.data, split, p, folder / "predictions")
        if folder is not None:
            from xmodal.jobs.predictions import write_atomic

            selected = {"best": w.selection.score, **w.selection.valid, **final}
            write_atomic(folder / "predictions" / "selected.json", json.dumps(selected, indent=2))
        return {**final, **robust_metrics(w, "valid")}


def started_from(checked: CheckedRun, init: FinetuneInit) -> CheckedRun:
    """A fine-tuning run checked before its starting weights existed (the chain's stage, checked on the
    pretraining stage's architecture before that stage ran), now starting from them (`init`: a run):
    the run checked, its weights downloaded and read as `prepare` does, the architecture they fix
    checked to be the one the run was checked on; the rest of the check stands as it is."""
    plan, prepared = checked.plan, checked.prepared
    cfg = prepared.cfg.model_copy(update={"init": init})
    with init_download_dir(plan.storage, plan.run_name) as download:
        start, model = resolve_init(cfg, str(prepared.data.store.path), plan.tracking_uri, download)
        if model != cfg.model:
            raise ConfigError(f"init.run_id: the model of run {init.run_id!r} is not the architecture this run was "
                              f"checked on ({model} != {cfg.model})")
    tags = {**prepared.tags, run_tags.INIT: start.source}
    if start.run_id:
        tags[run_tags.INIT_RUN_ID] = start.run_id
    prepared = dataclasses.replace(prepared, cfg=cfg, start=dataclasses.asdict(start), tags=tags)
    plan = dataclasses.replace(plan, config=cfg, start=prepared.start)
    return dataclasses.replace(checked, plan=plan, prepared=prepared)


def reader(w: Worker):
    """How a worker reads its units (`stream.Reader`): Ray Data tasks on a Train worker, the files
    straight in-process; the same tables either way."""
    from xmodal.data.finetune.stream import local_reader, ray_reader

    return ray_reader() if w.ray_data else local_reader()


def _check_model_unset(cfg: FinetuneConfig) -> None:
    """Pretrained weights fix the architecture: a preset or model key set beside them would be ignored."""
    default = type(cfg).model_fields["preset"].default
    preset = LXMERT_PRESETS[cfg.preset]
    changed = [f"model.{f.name}" for f in dataclasses.fields(cfg.model)
               if getattr(cfg.model, f.name) != getattr(preset, f.name)]
    if cfg.preset != default or changed:
        key = "preset" if cfg.preset != default else changed[0]
        raise ConfigError(f"{key}: init.source={cfg.init.source} takes the architecture from its weights, so {key} "
                          "would be ignored; drop it, or fine-tune from scratch (--init scratch)")


def with_data_dims(cfg: FinetuneConfig, data, pretrained: LxmertConfig | None) -> FinetuneConfig:
    """The architecture (pretrained, else cfg.model) with the set's vocabulary, features and tokens."""
    store = data.store.manifest
    model = pretrained or cfg.model
    if pretrained is None:
        # the answers are the fine-tuning set's own (its answer head), not the image store's
        sizes = {k: v for k, v in store_sizes(store).items() if k != "num_qa_labels"}
        model = with_data_sizes(model, cfg.PRESETS[cfg.preset], sizes, f"the fine-tuning set {data.path}")
    problems = []
    if model.vocab_size < store.vocab_size:
        problems.append(f"vocab_size {model.vocab_size} < the store's {store.vocab_size}")
    if model.visual_feat_dim != store.feat_dim:
        problems.append(f"visual_feat_dim {model.visual_feat_dim} != the store's feat_dim {store.feat_dim}")
    if model.max_positions < data.manifest.max_seq_len:
        problems.append(f"max_positions {model.max_positions} < the set's max_seq_len {data.manifest.max_seq_len}")
    if problems:
        what = "the pretrained model" if pretrained is not None else "model"
        raise ConfigError(f"{what} does not fit the fine-tuning set {data.path}: " + "; ".join(problems))
    metrics = finetune_metrics(cfg.task)
    if cfg.train.best_metric not in metrics:
        raise ConfigError(f"train.best_metric: {cfg.train.best_metric!r} is not measured on {cfg.task}; "
                          f"valid: {', '.join(metrics)}")
    return cfg.model_copy(update={"model": model})


def robust_metrics(w: Worker, split: str) -> dict[str, float]:
    """`split` predicted under each of `robust.conditions` (`robust/<condition>/<metric>`): the
    validation split, the one every set has labelled (its clean figures are `best_valid/*`); the
    noise is scaled by each feature dimension's std over the split's images' real objects, streamed:
    float64 sums over each worker's blocks, added over the workers (`split_feature_std`)."""
    from xmodal.core.robustness import finetune_perturbation

    r = w.cfg.robust
    if not r.conditions:
        return {}
    std = split_feature_std(w, split) if "feat_noise" in r.conditions else None
    out: dict[str, float] = {}
    for condition in r.conditions:
        p = predict_split(w, split, finetune_perturbation(condition, r.noise_sigma, std, r.seed))
        metrics = split_metrics(w.cfg.task, w.data, split, p)
        out.update({f"robust/{condition}/{k.split('/', 1)[1]}": v for k, v in metrics.items()})
    return out


def split_feature_std(w: Worker, split: str) -> torch.Tensor:
    """`robustness.feature_std` over every image the split uses, each worker summing its own units
    (`stream.feature_sums`) and the sums added over the workers: memory of one block, not the split."""
    import numpy as np
    import torch.distributed as dist

    from xmodal.data.finetune.stream import feature_sums

    mine = feature_sums(w.data, split, rank=w.rank, world=w.world, reader=reader(w))
    parts = [mine]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
    n = sum(p[0] for p in parts)
    if n == 0:
        raise ValueError(f"split {split!r}: no real objects to measure the feature std on")
    mean = sum(p[1] for p in parts) / n
    var = sum(p[2] for p in parts) / n - mean * mean
    return torch.from_numpy(np.sqrt(np.maximum(var, 0.0))).float()


@torch.no_grad()
def predict_split(w: Worker, split: str, perturb: Callable[[Any], Any] | None = None) -> dict[str, Any]:
    """Every example of a split predicted exactly once across the workers (one forward per batch):
    row, prediction and score for all rows, plus the mean loss. Each worker reads only its own row
    groups of the image stores (`stream.iter_eval_batches`: a window of blocks in memory, not the
    split); the rows are gathered on every worker. `perturb`: applied to each batch on the device
    (robustness)."""
    from xmodal.data.finetune.stream import iter_eval_batches

    objective = w.model
    objective.eval()
    rows, preds, scores, loss_sum = [], [], [], 0.0
    for batch in iter_eval_batches(w.data, split, w.micro_batch, rank=w.rank, world=w.world, reader=reader(w)):
        batch = w.to_device(batch)
        if perturb is not None:
            batch = perturb(batch)
        out = objective(batch, with_predictions=True)
        pred = out["prediction"]
        rows.append(batch.index)
        preds.append(pred)
        if hasattr(batch, "targets"):  # VQA: the soft score of the answer; GQA: 1 for an exact match
            s = batch.targets.gather(1, pred[:, None])[:, 0].float()
            scores.append((s > 0).float() if objective.task == "gqa" else s)
        else:
            scores.append((pred == batch.labels).float())
        loss_sum += float(out["loss"]) * len(batch)

    def cat(xs: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(xs).cpu() if xs else torch.zeros(0)

    row, cols, sums = gather_rows(cat(rows), {"pred": cat(preds), "score": cat(scores)}, {"loss": loss_sum})
    return {"row": row.long(), "pred": cols["pred"].long(), "score": cols["score"],
            "loss": sums["loss"] / max(len(row), 1)}


def split_metrics(task: str, data, split: str, p: dict[str, Any]) -> dict[str, float]:
    from xmodal.objectives.finetune import nlvr2_consistency

    out = {"accuracy": float(p["score"].mean()) if len(p["score"]) else float("nan"), "loss": p["loss"]}
    if task == "nlvr2":
        ids = data.ids(split)
        out["consistency"] = nlvr2_consistency([ids[r] for r in p["row"].tolist()], (p["score"] > 0).tolist())
    return {f"{split}/{k}": v for k, v in out.items()}


def has_labels(sp) -> bool:
    """Whether a split carries answers (VQA/GQA) or labels (NLVR2: -1 = unknown) to score against."""
    if sp.labels is not None:
        return bool((sp.labels >= 0).any())
    return sp.ans_ids is not None and len(sp.ans_ids) > 0


def write_predictions(task: str, data, split: str, p: dict[str, Any], folder: Path) -> Path:
    from xmodal.jobs.predictions import write_gqa_predictions, write_nlvr2_predictions, write_vqa_predictions

    ids = data.ids(split)
    row_ids = [ids[r] for r in p["row"].tolist()]
    if task == "nlvr2":
        return write_nlvr2_predictions(folder / f"{split}_predict.csv", row_ids, p["pred"].tolist())
    answers = [data.answers.answer(a) for a in p["pred"].tolist()]
    write = write_vqa_predictions if task == "vqa" else write_gqa_predictions
    return write(folder / f"{split}_predict.json", row_ids, answers)


def finetune_in_process(cfg: FinetuneConfig, data, init: Init, pretrained: LxmertConfig | None = None
                        ) -> dict[str, float]:
    """The worker's fine-tuning in this process, on the CPU, without Ray (`inprocess.run_in_process`),
    from `init`: the validation metrics of the model the job selects (what it logs as best_valid/*).
    The learning tests run the embedded default through it."""
    from xmodal.runner.inprocess import run_in_process

    class Given(FinetuneJob):
        def resolve_start(self, cfg, data, uri, download_dir):
            return init, pretrained

    _, final = run_in_process(Given(), cfg, data)
    return {k.removeprefix("best_"): v for k, v in final.items() if k.startswith("best_valid/")}
