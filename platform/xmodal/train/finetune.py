"""LXMERT fine-tuning on Ray Train (`jobs/finetune.py --task vqa|gqa|nlvr2`): driver and worker.

Same shape as the other jobs (`xmodal.train.job`): the driver resolves the fine-tuning set, the
weights to start from and the MLflow run before Ray starts; workers train with `fit`, evaluate the
validation split every `eval_every` steps, keep the best model by `train.best_metric`, and at the
end evaluate every held-out split with that model and write the reference's prediction files
(VQA/GQA: JSON list of {question_id, answer}; NLVR2: CSV of identifier,True|False), logged as
artifacts under `predictions/`.

Where the weights come from (`init.source`): the newest finished pretraining run on the same image
store (`latest`, the default; scratch when there is none), an MLflow run id (`run`), a checkpoint
folder (`checkpoint`), or a transformers LxmertForPreTraining directory (`transformers`). From a
pretrained model the architecture is the checkpoint's, and the answer head starts from the
pretraining QA head where the answer tables overlap (the reference's trick).

Fine-tuning sets are small: every worker reads its equal share of the examples straight from the
set and its image store (no Ray Data execution).
"""

from __future__ import annotations

import dataclasses
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from xmodal import tracking
from xmodal.config import ConfigError, FinetuneConfig, flatten
from xmodal.models.lxmert import LxmertConfig
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
    say,
    worker_start,
)
from xmodal.train.loop import NoHooks, autocast, fit
from xmodal.train.runtime import prepare

DEFAULT_SETS = {"vqa": "data/synthetic_vqa", "gqa": "data/synthetic_gqa", "nlvr2": "data/synthetic_nlvr2"}


# ---------------------------------------------------------------- driver


def resolve_data(cfg: FinetuneConfig):
    """The fine-tuning set: the configured one, or the embedded synthetic set of the task."""
    from xmodal.data.finetune.sets import open_finetune
    from xmodal.data.finetune.synthetic import ensure_synthetic_finetune
    from xmodal.data.lxmert.synthetic import ensure_synthetic_store
    from xmodal.train.pretrain import DEFAULT_STORE

    if cfg.data.store is None:
        images = ensure_synthetic_store(Path(DEFAULT_STORE).resolve(), cfg.data.synthetic)
        options = {} if cfg.task == "nlvr2" else {"questions_per_image": cfg.data.synthetic_questions_per_image}
        return ensure_synthetic_finetune(cfg.task, images.path, Path(DEFAULT_SETS[cfg.task]).resolve(), **options)
    path = Path(cfg.data.store).expanduser().resolve()
    if not path.exists():
        raise ConfigError(f"data.store: {str(path)!r} does not exist; build a fine-tuning set with `python "
                          f"jobs/ingest.py {cfg.task}|synthetic-{cfg.task} {path} --store IMAGES` or leave "
                          "data.store unset for the embedded synthetic set")
    data = open_finetune(path)
    if data.task != cfg.task:
        raise ConfigError(f"data.store: {str(path)!r} is a {data.task} set, but task={cfg.task!r}")
    return data


@dataclasses.dataclass
class Init:
    """The resolved `init`: what the workers load (plain JSON-able data in the run plan)."""

    source: str  # scratch | run | checkpoint | transformers
    path: str | None = None  # local folder with model.pt (+ meta.json), or the transformers directory
    run_id: str | None = None
    pretrain_answers: list[str] | None = None  # the pretraining QA table, when its store is known


def _checkpoint_files(path: Path) -> Path:
    """A folder holding model.pt and meta.json (given the folder or its model.pt)."""
    folder = path.parent if path.is_file() else path
    missing = [f for f in (ckpt.MODEL_FILE, ckpt.META_FILE) if not (folder / f).is_file()]
    if missing:
        raise ConfigError(f"init.path: {str(path)!r} is not a checkpoint: {', '.join(missing)} missing (expected "
                          "a checkpoint folder of a pretraining run, or the `model` artifact folder of its MLflow run)")
    return folder


def _pretrain_answers(store_path: str | None) -> list[str] | None:
    from xmodal.data.lxmert.store import open_store

    try:
        return list(open_store(store_path).answers().answers) if store_path else None
    except (OSError, ValueError):
        return None  # the pretraining store is not readable here: the answer head starts fresh


def resolve_init(cfg: FinetuneConfig, image_store: str, uri: str, download_dir: Path) -> tuple[Init, LxmertConfig | None]:
    """Where the weights come from, and the architecture they fix (None = from scratch: cfg.model)."""
    i = cfg.init
    source, run_id = i.source, i.run_id
    if source == "latest":
        run = tracking.latest_finished_run(uri, i.pretrain_experiment, {"task": "pretrain", "store": image_store})
        if run is None:
            say(f"[xmodal] no finished pretraining run on {image_store} in experiment {i.pretrain_experiment!r}: "
                "fine-tuning from scratch")
            return Init("scratch"), None
        source, run_id = "run", run.info.run_id
        say(f"[xmodal] fine-tuning from the latest pretraining run {run.data.tags.get('mlflow.runName')} ({run_id})")
    if source == "scratch":
        return Init("scratch"), None
    if source == "transformers":
        from xmodal.models.lxmert_hf import config_from_hf_dir

        path = Path(i.path).expanduser().resolve()
        try:
            return Init("transformers", path=str(path)), config_from_hf_dir(path)
        except (FileNotFoundError, KeyError, ValueError) as e:
            raise ConfigError(f"init.path: {e}") from None
    if source == "run":
        try:
            tracking.get_run(uri, run_id)
        except Exception as e:  # MLflow raises its own exception types for an unknown id
            raise ConfigError(f"init.run_id: no MLflow run {run_id!r} at {uri} ({type(e).__name__})") from None
        try:
            folder = tracking.download_artifacts(uri, run_id, "model", download_dir / run_id)
        except Exception as e:
            raise ConfigError(f"init.run_id: run {run_id!r} has no `model` artifact (did it finish?): {e}") from None
    else:
        folder = Path(i.path).expanduser().resolve()
        if not folder.exists():
            raise ConfigError(f"init.path: {str(folder)!r} does not exist")
    folder = _checkpoint_files(folder)
    meta = ckpt.read_meta(folder)
    model = meta.get("config", {}).get("model")
    if not model:
        raise ConfigError(f"init: {folder / ckpt.META_FILE} holds no model config (not an xmodal checkpoint?)")
    return (Init("run" if source == "run" else "checkpoint", path=str(folder), run_id=run_id,
                 pretrain_answers=_pretrain_answers(meta.get("store"))), LxmertConfig(**model))


def with_data_dims(cfg: FinetuneConfig, data, pretrained: LxmertConfig | None) -> FinetuneConfig:
    """The architecture (pretrained, else cfg.model) with the set's vocabulary, features and tokens."""
    store = data.store.manifest
    model = pretrained or cfg.model
    if pretrained is None:
        model = dataclasses.replace(model, vocab_size=store.vocab_size, visual_feat_dim=store.feat_dim,
                                    num_object_labels=store.num_object_labels, num_attr_labels=store.num_attr_labels)
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
    return cfg.model_copy(update={"model": model})


def prepare_run(cfg: FinetuneConfig, source: str = "defaults", parent_run_id: str | None = None,
                extra_tags: dict[str, str] | None = None):
    """Everything that can fail on bad input fails here, before Ray starts. Returns (plan, data)."""
    data = resolve_data(cfg)
    uri = tracking.resolve_tracking_uri(cfg.mlflow.tracking_uri)
    name = cfg.mlflow.run_name or f"finetune-{cfg.task}-{time.strftime('%Y%m%d-%H%M%S')}"
    storage = storage_path(cfg.scale.storage_path)
    init, pretrained = resolve_init(cfg, str(data.store.path), uri, Path(storage) / name / "init")
    cfg = with_data_dims(cfg, data, pretrained)
    micro, total = plan_steps(cfg, data)
    if "valid" not in data.splits:
        raise ConfigError(f"data.store: {data.path} has no valid split (model selection needs one); "
                          f"it has {', '.join(data.splits)}")
    cfg = cfg.model_copy(update={"mlflow": cfg.mlflow.model_copy(update={"run_name": name})})
    tags = {"model": "lxmert", "task": f"finetune-{cfg.task}", "store": str(data.store.path),
            "finetune_set": str(data.path), "init": init.source, "config_source": source, **(extra_tags or {})}
    if init.run_id:
        tags["init_run_id"] = init.run_id
    params = {**flatten(cfg), "init.resolved": init.source}
    run_id = open_run(uri, cfg.mlflow.experiment, name, params, tags, parent_run_id)
    plan = RunPlan(config={**cfg.model_dump(mode="json"), "_init": dataclasses.asdict(init)},
                   store=str(data.path), tracking_uri=uri, run_id=run_id, run_name=name, storage=storage,
                   total_steps=total, micro_batch=micro,
                   fail_marker=fail_marker(storage, name) if cfg.train.fail_at_step is not None else None)
    return plan, data


def build_trainer(plan: RunPlan, data, callbacks: list | None = None):
    connect()
    cfg = _config(plan)
    return make_trainer(finetune_worker, plan, cfg.scale, cfg.train, {}, callbacks)


def run_finetune(cfg: FinetuneConfig, source: str = "defaults", parent_run_id: str | None = None) -> dict[str, Any]:
    """Run (or resume) one fine-tuning run; returns {"run_id", "tracking_uri", "checkpoint", "metrics"}."""
    return run_job(prepare_run, build_trainer, cfg, source, parent_run_id)


def _config(plan: RunPlan) -> FinetuneConfig:
    return FinetuneConfig.model_validate({k: v for k, v in plan.config.items() if k != "_init"})


# ---------------------------------------------------------------- worker


def build_objective(cfg: FinetuneConfig, num_answers: int):
    from xmodal.models.lxmert_finetune import LxmertForNlvr2, LxmertForQuestionAnswering
    from xmodal.objectives.finetune import FinetuneObjective

    if cfg.task == "nlvr2":
        model = LxmertForNlvr2(cfg.model, output=cfg.nlvr2_output)
    else:
        model = LxmertForQuestionAnswering(cfg.model, num_answers)
    return FinetuneObjective(model, cfg.task, qa_loss=cfg.qa_loss)


def load_init(objective, init: Init, answers: list[str] | None, answer_head_from_qa: bool) -> str:
    """Load the starting weights into the objective's model; returns a line saying what was loaded."""
    from xmodal.models.lxmert_init import (
        encoder_state_from_hf_dir,
        init_answer_head_from_qa,
        load_pretrained_encoder,
    )

    if init.source == "scratch":
        return "from scratch"
    if init.source == "transformers":
        _, state = encoder_state_from_hf_dir(init.path)
        pretrain_answers = None  # transformers' checkpoints carry no answer table
    else:
        state = torch.load(Path(init.path) / ckpt.MODEL_FILE, map_location="cpu", weights_only=True)
        pretrain_answers = init.pretrain_answers
    model = objective.model
    load_pretrained_encoder(model, state)
    line = f"encoder from {init.source} {init.run_id or init.path}"
    if answer_head_from_qa and answers is not None and pretrain_answers is not None and hasattr(model, "answer_head"):
        n = init_answer_head_from_qa(model, state, pretrain_answers, answers)
        line += f"; answer head: {n} of {len(answers)} answers from the pretraining QA head"
    return line


@torch.no_grad()
def predict_split(objective, data, split: str, batch_size: int, rank: int, world: int, device,
                  autocast_dtype) -> dict[str, Any]:
    """Every example of a split, predicted once across the workers: (row, prediction, score) for all rows,
    plus the mean loss. Each worker takes a strided share; the parts are gathered on every worker."""
    from xmodal.data.finetune.sets import iter_finetune_batches

    objective.eval()
    rows, preds, scores, loss_sum = [], [], [], 0.0
    for i, batch in enumerate(iter_finetune_batches(data, split, batch_size, seed=0, epoch=0, shuffle=False,
                                                    drop_last=False)):
        if i % world != rank:
            continue
        batch = batch.to(device, torch.float32)
        with autocast(device, autocast_dtype):
            out = objective(batch)
            pred = objective.predict(batch)
        rows.append(batch.index.cpu())
        preds.append(pred.cpu())
        if hasattr(batch, "targets"):  # VQA: the soft score of the answer; GQA: 1 for an exact match
            s = batch.targets.gather(1, pred[:, None])[:, 0].float()
            scores.append((s > 0).float().cpu() if objective.task == "gqa" else s.cpu())
        else:
            scores.append((pred == batch.labels).float().cpu())
        loss_sum += float(out["loss"]) * len(batch)
    mine = [torch.cat(x) if x else torch.zeros(0) for x in (rows, preds, scores)] + [loss_sum]
    parts = [mine]
    if dist.is_available() and dist.is_initialized() and world > 1:
        parts = [None] * world
        dist.all_gather_object(parts, mine)
    row, pred, score = (torch.cat([p[i] for p in parts]) for i in range(3))
    order = torch.argsort(row)
    return {"row": row[order].long(), "pred": pred[order].long(), "score": score[order],
            "loss": sum(p[3] for p in parts) / max(len(row), 1)}


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
    from xmodal.train.predictions import write_gqa_predictions, write_nlvr2_predictions, write_vqa_predictions

    ids = data.ids(split)
    row_ids = [ids[r] for r in p["row"].tolist()]
    if task == "nlvr2":
        return write_nlvr2_predictions(folder / f"{split}_predict.csv", row_ids, p["pred"].tolist())
    answers = [data.answers.answer(a) for a in p["pred"].tolist()]
    write = write_vqa_predictions if task == "vqa" else write_gqa_predictions
    return write(folder / f"{split}_predict.json", row_ids, answers)


def plan_steps(cfg: FinetuneConfig, data) -> tuple[int, int]:
    """(micro-batch per worker, total optimizer steps); errors name the key."""
    t, workers = cfg.train, cfg.scale.num_workers
    if t.batch_size % (workers * t.grad_accum):
        raise ConfigError(f"train.batch_size {t.batch_size} must be divisible by scale.num_workers x "
                          f"train.grad_accum = {workers * t.grad_accum}")
    micro = t.batch_size // (workers * t.grad_accum)
    steps_per_epoch = data.num_batches("train", micro, workers) // t.grad_accum
    if steps_per_epoch < 1:
        raise ConfigError(f"train.batch_size {t.batch_size} is larger than the {len(data.split('train'))} "
                          "training examples")
    total = steps_per_epoch * t.epochs
    return micro, min(total, t.max_steps) if t.max_steps else total


def finetune_in_process(cfg: FinetuneConfig, data, init: Init, pretrained: LxmertConfig | None = None
                        ) -> dict[str, float]:
    """The worker's fine-tuning in this process, on the CPU, without Ray: the same initial weights,
    starting point, batches, steps and loop (`fit`); returns the final model's validation metrics.
    The learning tests run the embedded default through it."""
    from xmodal.data.finetune.sets import iter_finetune_batches

    cfg = with_data_dims(cfg, data, pretrained)
    micro, total = plan_steps(cfg, data)
    torch.manual_seed(cfg.train.seed)
    objective = build_objective(cfg, data.num_answers)
    answers = list(data.answers.answers) if data.answers is not None else None
    load_init(objective, init, answers, cfg.init.answer_head_from_qa)
    cpu = torch.device("cpu")
    state = prepare(objective, cpu, cfg.train, cfg.optim, total)

    def batches(epoch: int, skip: int):
        it = iter_finetune_batches(data, "train", micro, seed=cfg.train.seed, epoch=epoch, start_batch=skip)
        return (b.to(cpu, torch.float32) for b in it)

    fit(state, batches, NoHooks(), epochs=cfg.train.epochs, total_steps=total, grad_accum=cfg.train.grad_accum)
    return split_metrics(cfg.task, data, "valid", predict_split(objective, data, "valid", micro, 0, 1, cpu, None))


def finetune_worker(plan_dict: dict[str, Any]) -> None:
    from xmodal.data.finetune.sets import iter_finetune_batches, open_finetune

    plan = RunPlan(**plan_dict)
    cfg = _config(plan)
    init = Init(**plan.config["_init"])
    data = open_finetune(plan.store)
    answers = list(data.answers.answers) if data.answers is not None else None

    start = worker_start()
    rank, world, device, resume, meta = start.rank, start.world, start.device, start.resume, start.meta
    if meta.get("finished"):
        return

    torch.manual_seed(cfg.train.seed)  # identical initial weights on every worker
    objective = build_objective(cfg, data.num_answers)
    if resume is None:
        loaded = load_init(objective, init, answers, cfg.init.answer_head_from_qa)
        if rank == 0:
            say(f"[xmodal] fine-tuning {cfg.task}: {loaded}")
    state = prepare(objective, device, cfg.train, cfg.optim, plan.total_steps)
    plain = ckpt.unwrap(state.model)
    selection = ValidationSelection(plain, cfg.train.best_metric, cfg.train.best_mode)
    if resume is not None:
        with resume.as_directory() as d:
            meta = ckpt.restore(d, state)
            selection.restore(d)

    def batches(epoch: int, skip: int):
        it = iter_finetune_batches(data, "train", plan.micro_batch, seed=cfg.train.seed, epoch=epoch, rank=rank,
                                   world_size=world, start_batch=skip)
        return (b.to(device, torch.float32, non_blocking=True) for b in it)

    def evaluate() -> dict[str, float]:
        p = predict_split(plain, data, "valid", plan.micro_batch, rank, world, device, state.autocast_dtype)
        metrics = split_metrics(cfg.task, data, "valid", p)
        selection.consider(metrics)
        return metrics

    def final_with_selected(_state) -> dict[str, float]:
        """Every held-out split, once, with the model selected on validation; prediction files logged."""
        final = selection.load_selected()
        with tempfile.TemporaryDirectory() as tmp:
            for split in (s for s in data.splits if s != "train"):
                p = predict_split(plain, data, split, plan.micro_batch, rank, world, device, state.autocast_dtype)
                if split != "valid" and has_labels(data.split(split)):  # a test split may come unlabelled
                    final.update(split_metrics(cfg.task, data, split, p))
                if rank == 0:
                    write_predictions(cfg.task, data, split, p, Path(tmp))
            if rank == 0:
                (Path(tmp) / "selected.json").write_text(json.dumps({"best": selection.score, **final}, indent=2))
                tracking.log_artifacts(plan.tracking_uri, plan.run_id, tmp, "predictions")
        return final

    hooks = RunHooks(plan, cfg.train, cfg.mlflow.system_metrics, rank, world, device, evaluate, meta,
                     on_checkpoint=selection.save, on_end=final_with_selected)
    fit(state, batches, hooks, epochs=cfg.train.epochs, total_steps=plan.total_steps,
        grad_accum=cfg.train.grad_accum, start=(meta.get("epoch", 0), meta.get("pos", 0)))
