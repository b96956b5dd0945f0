"""Typed experiment configs: YAML files plus dotted `--set key=value` overrides.

Every section forbids unknown keys and every field has its bounds (here, or as `Annotated` metadata
in the model and data dataclasses, see xmodal.bounds), every float is finite, and an option the user
gave that the config does not read is an error (`USES`), so a bad value fails here, before Ray or
MLflow start. Errors name the file, the dotted key, the bad value and what was expected, one line
each. Model sections start from a named preset and take overrides on top.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from xmodal.bounds import Dropout, NonNegInt, PosInt, Seed, describe_bounds
from xmodal.config_paths import (
    config_values,
    deep_merge,
    dotted_keys,
    field_names,
    keys_beside,
    set_dotted,
    type_at,
)
from xmodal.data.options import MaskingOptions, SyntheticLxmertOptions, SyntheticMultOptions
from xmodal.errors import UserError
from xmodal.models.lxmert import PRESETS as LXMERT_PRESETS
from xmodal.models.lxmert import LxmertConfig
from xmodal.models.mult import PRESETS as MULT_PRESETS
from xmodal.models.mult import MultConfig
from xmodal.objectives.finetune import finetune_metrics
from xmodal.objectives.pretraining import PretrainTasks, pretraining_eval_metrics
from xmodal.objectives.sentiment import MULT_METRICS, F1Protocol, mult_valid_metrics
from xmodal.robustness import FINETUNE_CONDITIONS, MULT_CONDITIONS, FinetuneCondition, MultCondition

# A registered model's name: MLflow forbids "/" and ":", and "@" would cut `models:/NAME@alias`.
MODEL_NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"


class ConfigError(UserError):
    """A bad config file, key or value; the message says which and what was expected."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class OptimConfig(Section):
    lr: float = Field(1e-4, gt=0)  # the paper; the embedded default raises it (PretrainConfig.optim)
    weight_decay: float = Field(0.01, ge=0)
    betas: tuple[Dropout, Dropout] = (0.9, 0.999)  # each in [0, 1)
    eps: float = Field(1e-6, gt=0)
    warmup_ratio: float = Field(0.05, ge=0, lt=1)
    grad_clip: float = Field(1.0, ge=0)  # 0 = off


class TrainConfig(Section):
    epochs: int = Field(20, ge=1)
    batch_size: int = Field(256, ge=1)  # global samples per optimizer step
    grad_accum: int = Field(1, ge=1)
    max_steps: PosInt | None = None  # stop early (smoke runs)
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # auto = bf16 on GPU, fp32 on CPU
    compile: bool = False
    eval_every: int = Field(500, ge=1)  # steps; every evaluation also checkpoints
    keep_best: int = Field(2, ge=1)
    best_metric: str = Field("eval/match_acc", min_length=1)
    best_mode: Literal["max", "min"] = "max"
    log_every: int = Field(20, ge=1)
    seed: Seed = 0
    # A testing aid (docs/reliability.md, "Fault injection"): a Train worker exits once at each of these
    # steps (one step or a list), and at `random_faults` more steps drawn from `fault_seed` and the run name.
    fail_at_step: list[PosInt] | None = None
    random_faults: int = Field(0, ge=0)
    fault_seed: Seed = 0

    @field_validator("fail_at_step", mode="before")
    @classmethod
    def _one_or_more(cls, v: Any) -> Any:
        return [v] if isinstance(v, int) and not isinstance(v, bool) else v


class ScaleConfig(Section):
    num_workers: int = Field(1, ge=1)
    gpus_per_worker: float = Field(0, ge=0)
    # Leave CPUs for Ray Data's read tasks: workers holding every CPU starve the pipeline.
    cpus_per_worker: float = Field(0.5, gt=0)
    max_failures: int = Field(2, ge=0)
    storage_path: str | None = Field(None, min_length=1)  # default: ./runs (env XMODAL_STORAGE_PATH on a cluster)
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "SPREAD"
    # Extra custom resources per worker.
    resources_per_worker: dict[Annotated[str, Field(min_length=1)], Annotated[float, Field(ge=0)]] = \
        Field(default_factory=dict)


# What xmodal.tracking.resolve_tracking_uri takes: a URI with a scheme, never a bare path.
TRACKING_URI_HELP = ("sqlite:///PATH (a SQLite file, e.g. sqlite:///mlflow.db), http(s)://HOST:PORT (a tracking "
                     "server), file:///DIR (a folder) or another MLflow store URI (postgresql://..., databricks://PROFILE)")


class MlflowConfig(Section):
    tracking_uri: str | None = None  # default: sqlite:///mlflow.db (env MLFLOW_TRACKING_URI wins)
    experiment: str = Field("xmodal-pretrain", min_length=1)
    # Also the Ray Train run name: rerun with the same name to resume.
    run_name: str | None = Field(None, min_length=1)
    system_metrics: bool = True
    # How long any wait of the run (driver and workers) for a busy or unreachable tracking store lasts
    # (seconds): then the metrics sender and the run's end write what they could not log to
    # <scale.storage_path>/<run name>/mlflow_unlogged.jsonl (replayed with jobs/replay_tracking.py) and
    # other calls fail. Training waits only at a checkpoint, for its steps' metrics to be sent or spooled.
    outage_wait_s: float = Field(300.0, ge=0, le=3600)
    # Register the run's final model (its MLflow logged model) in the Model Registry under this name, a
    # new version per run: `models:/NAME/<version>`. A sweep registers only its best trial's
    # (`jobs/sweep.py --register NAME`, alias `best`).
    registered_model: str | None = Field(None, pattern=MODEL_NAME_RE)

    @field_validator("run_name")
    @classmethod
    def _folder_name(cls, name: str | None) -> str | None:
        # The run name is also its folder under scale.storage_path (checkpoints, fault markers).
        if name is not None and (any(c in name for c in "/\\") or name in (".", "..")):
            raise ValueError(f"got {name!r}; expected a name without / or \\ (it names the run's folder under "
                             "scale.storage_path)")
        return name

    @field_validator("tracking_uri")
    @classmethod
    def _uri(cls, uri: str | None) -> str | None:
        if uri is None:
            return uri
        scheme = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*):", uri)
        if scheme is None or (len(scheme.group(1)) == 1 and uri[2:3] in ("\\", "/")):  # C:\... is a path
            raise ValueError(f"not a URI; use {TRACKING_URI_HELP}")
        if scheme.group(1) == "sqlite" and not uri.startswith("sqlite:///"):
            raise ValueError("a SQLite URI is sqlite:///RELATIVE/PATH or sqlite:////ABSOLUTE/PATH")
        if scheme.group(1) in ("http", "https") and not re.match(r"^https?://[^/\s]+", uri):
            raise ValueError("expected http(s)://HOST[:PORT]")
        return uri


class TaskSchedule(Section):
    # The paper adds QA only in the last 10 of 20 epochs (0.5); the embedded default trains it from
    # the first step (PretrainConfig.schedule).
    qa_from_fraction: float = Field(0.5, ge=0, lt=1)


def _store_field() -> Any:
    # None = the embedded synthetic store; a path is checked when the job opens it.
    return Field(None, min_length=1)


def embedded_lxmert_store() -> SyntheticLxmertOptions:
    """The embedded default's synthetic corpus: 6,000 images of 1-3 named object groups and nothing
    else (no background boxes), 32 named classes, 8 colours, 64-dim features, 4 sentences each, a
    quarter of them questions, every caption naming all of its image's groups (docs/learning.md,
    "What the embedded default learns", says why)."""
    return SyntheticLxmertOptions(
        num_images=6000, num_objects=8, feat_dim=64, num_object_labels=40, num_attr_labels=8, num_answers=60,
        sentences_per_image=4, max_seq_len=16, question_fraction=0.25, background_objects=False,
        captions_name_all_groups=True)


class LxmertDataConfig(Section):
    store: str | None = _store_field()  # None = the embedded synthetic store, built on first use
    synthetic: SyntheticLxmertOptions = Field(default_factory=embedded_lxmert_store)
    masking: MaskingOptions = Field(default_factory=MaskingOptions)
    eval_batches: PosInt | None = None  # cap on minival batches per evaluation
    # Units (row groups) whose images are mixed into each block, the pool of matching negatives
    # (xmodal.data.lxmert.loader.DEFAULT_MIX_UNITS); 0 = consecutive units, unmixed.
    mix_units: NonNegInt = 16


def _job_defaults(cls: type[BaseModel], data: Any) -> Any:
    """A partial config keeps this job's defaults for the keys it does not set: `load_config` fills its
    raw dict with them before the --set overrides (so `train.epochs.x=1` finds a value, not a section),
    and every job's validation does (a sweep's base config, `model_validate` of a YAML mapping): without
    this, a pretraining `{"train": {"max_steps": 1200}}` would fall back to TrainConfig's generic batch
    size 256. The model section is overrides on top of its preset instead (`_resolve_preset`)."""
    if not isinstance(data, dict):
        return data
    # model_construct: the defaults without this validation again (it would recurse)
    return deep_merge(cls.model_construct().model_dump(mode="python", exclude={"model", "preset"}), data)


def _resolve_preset(data: Any, presets: dict[str, Any], default: str) -> Any:
    """`preset: NAME` plus `model: {overrides}` -> a full model dict (overrides on top of the preset)."""
    if not isinstance(data, dict):
        return data
    name = data.get("preset", default)
    if name not in presets:
        return data  # the Literal check on `preset` reports it
    overrides = data.get("model") or {}
    if isinstance(overrides, dict) and not dataclasses.is_dataclass(overrides):
        data = {**data, "model": {**dataclasses.asdict(presets[name]), **overrides}}
    return data


class _Job(Section):
    """A job's whole config: a partial one keeps the job's defaults (`_job_defaults`); with `PRESETS`,
    its `model` section is overrides on top of the preset its `preset` names."""

    PRESETS: ClassVar[dict[str, Any] | None] = None

    @model_validator(mode="before")
    @classmethod
    def _defaults_and_preset(cls, data: Any) -> Any:
        data = _job_defaults(cls, data)
        if cls.PRESETS is None:
            return data
        return _resolve_preset(data, cls.PRESETS, cls.model_fields["preset"].default)

    @model_validator(mode="after")
    def _finite(self) -> _Job:
        # pydantic's floats take inf and nan ('inf' and 'nan' as text too), and inf passes a lower bound
        # (`optim.lr=inf`): no option of ours means anything at either.
        for loc, value in config_values(self):
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{'.'.join(map(str, loc))} = {value}: expected {finite_bounds(type(self), loc)}")
        return self


def finite_bounds(model: type, loc: tuple) -> str:
    """'a finite number > 0', ...: what the float field at `loc` allows."""
    return describe_bounds(type_at(model, loc)[1], "a finite number") or "a finite number"


class PretrainConfig(_Job):
    """LXMERT pretraining: `jobs/pretrain.py`."""

    PRESETS = LXMERT_PRESETS
    preset: Literal["small", "paper", "tiny"] = "small"
    model: LxmertConfig = Field(default_factory=lambda: LXMERT_PRESETS["small"])
    tasks: PretrainTasks = Field(default_factory=PretrainTasks)
    # The embedded default trains QA from the first step; paper runs set schedule.qa_from_fraction=0.5.
    schedule: TaskSchedule = Field(default_factory=lambda: TaskSchedule(qa_from_fraction=0.0))
    data: LxmertDataConfig = Field(default_factory=LxmertDataConfig)
    # The small preset on the embedded store learns fastest at 2e-3; paper runs use 1e-4.
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=2e-3))
    # The embedded default: about 3 minutes on a 2-core CPU. Paper runs set epochs=20, batch_size=256.
    train: TrainConfig = Field(default_factory=lambda: TrainConfig(epochs=8, batch_size=64, eval_every=500))
    scale: ScaleConfig = Field(default_factory=ScaleConfig)
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig)

    @model_validator(mode="after")
    def _check(self) -> PretrainConfig:
        _check_batch(self.train, self.scale)
        seq, positions = self.data.masking.max_seq_len, self.model.max_positions
        if seq is not None and seq > positions:
            raise ValueError(f"data.masking.max_seq_len = {seq}: expected at most model.max_positions = {positions}")
        if self.data.store is None:  # the embedded store's sentences are tokenised to data.synthetic.max_seq_len
            stored = self.data.synthetic.max_seq_len
            if seq is not None and seq < stored:
                raise ValueError(f"data.masking.max_seq_len = {seq}: expected at least the store's sentence length, "
                                 f"data.synthetic.max_seq_len = {stored} (or leave it unset)")
            if stored > positions:
                raise ValueError(f"data.synthetic.max_seq_len = {stored}: expected at most model.max_positions = "
                                 f"{positions}")
        if not self.tasks.enabled():
            raise ValueError("tasks: every pretraining task is switched off; enable at least one of "
                             "mlm, obj_feat, obj_label, matching, qa")
        valid = pretraining_eval_metrics(self.tasks)
        if self.train.best_metric not in valid:
            raise ValueError(f"train.best_metric: {self.train.best_metric!r} is not measured with these tasks; "
                             f"valid: {', '.join(valid)}")
        return self


def _check_batch(train: TrainConfig, scale: ScaleConfig) -> None:
    """The global batch splits evenly into workers x accumulation steps (the jobs' micro-batches)."""
    per_step = scale.num_workers * train.grad_accum
    if train.batch_size % per_step:
        raise ValueError(f"train.batch_size = {train.batch_size}: expected a multiple of scale.num_workers x "
                         f"train.grad_accum = {scale.num_workers} x {train.grad_accum} = {per_step}")


class _Robust(Section):
    @field_validator("conditions", check_fields=False)
    @classmethod
    def _distinct(cls, conditions: list[str]) -> list[str]:
        if len(set(conditions)) < len(conditions):
            raise ValueError(f"expected each condition once, got {conditions}")
        return conditions


class MultRobustConfig(_Robust):
    """Robustness, evaluated once at the end on the test split with the selected model (never at the
    per-step evaluations): each condition logged as `robust/<condition>/<metric>`. [] = off."""

    # zero_<m>: modality m missing (features zeroed); noise_<m>: Gaussian noise on m (xmodal.robustness).
    conditions: list[MultCondition] = Field(default_factory=lambda: list(MULT_CONDITIONS))
    # Noise std as a multiple of each feature dimension's std over the evaluated split's real steps.
    noise_sigma: float = Field(0.5, gt=0, le=10)
    seed: Seed = 0  # with the condition and each example's row: the noise drawn


class FinetuneRobustConfig(_Robust):
    """Robustness, evaluated once at the end on the validation split with the selected model (never
    at the per-step evaluations): each condition logged as `robust/<condition>/<metric>`. [] = off."""

    # feat_noise: Gaussian noise on the visual features; shuffle_boxes: boxes permuted across each
    # image's objects, features kept (xmodal.robustness).
    conditions: list[FinetuneCondition] = Field(default_factory=lambda: list(FINETUNE_CONDITIONS))
    # Noise std as a multiple of each feature dimension's std over the split's images' real objects.
    noise_sigma: float = Field(0.5, gt=0, le=10)
    seed: Seed = 0  # with the condition and each example's row: the noise and permutations drawn


class MultDataConfig(Section):
    store: str | None = _store_field()  # None = the embedded synthetic store, built on first use
    synthetic: SyntheticMultOptions = Field(default_factory=SyntheticMultOptions)


class MultTrainConfig(_Job):
    """MulT training: `jobs/train_mult.py`. Defaults (the embedded default): the `small` preset with
    the reference code's optimiser (Adam, clip 0.8, L1) at lr 3e-3 on the embedded synthetic store,
    792 steps (12 epochs of 66), about 20 s of training on a 2-core CPU. Paper / reference runs set
    `preset=reference` (or `paper_mosei`, ...) and `optim.lr=1e-3` (the reference's rate)."""

    PRESETS = MULT_PRESETS
    preset: Literal["small", "reference", "paper_mosei", "paper_mosi", "paper_iemocap", "tiny"] = "small"
    model: MultConfig = Field(default_factory=lambda: MULT_PRESETS["small"])
    regression_loss: Literal["l1", "l2", "smooth_l1"] = "l1"
    # Metrics: whose support weights the sentiment F1 (`f1`, non-zero protocol). "sklearn": the true
    # classes' (sklearn's documented order, MMSA); "reference": the predicted classes', as the MulT
    # reference's src/eval_metrics.py computes it and its published F1s are. IEMOCAP F1s are the same
    # under both. Logged as the run tag `f1_protocol`.
    f1_protocol: F1Protocol = "sklearn"
    robust: MultRobustConfig = Field(default_factory=MultRobustConfig)
    data: MultDataConfig = Field(default_factory=MultDataConfig)
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(
        lr=3e-3, weight_decay=0.0, eps=1e-8, warmup_ratio=0.0, grad_clip=0.8))
    train: TrainConfig = Field(default_factory=lambda: TrainConfig(
        epochs=12, batch_size=24, eval_every=50, log_every=10, best_metric="valid/mae", best_mode="min"))
    scale: ScaleConfig = Field(default_factory=ScaleConfig)
    mlflow: MlflowConfig = Field(default_factory=lambda: MlflowConfig(experiment="xmodal-mult"))
    # One training per seed; the parent MLflow run gets each metric's mean and std.
    seeds: list[Seed] | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _check(self) -> MultTrainConfig:
        # (MultConfig checks itself: bounds as field metadata, the rest in its __post_init__.)
        _check_batch(self.train, self.scale)
        if self.seeds is not None and len(set(self.seeds)) < len(self.seeds):
            raise ValueError(f"seeds = {self.seeds}: expected distinct seeds")
        if self.seeds is not None and self.train.seed != type(self).model_fields["train"].default_factory().seed:
            raise ValueError(f"train.seed = {self.train.seed}: not used with seeds = {self.seeds} (each run takes its "
                             "seed from seeds); drop one of them")
        # The embedded store is a sentiment set; a named store's task is checked again once it is opened.
        tasks = ["sentiment"] if self.data.store is None else list(MULT_METRICS)
        valid = mult_valid_metrics(*tasks)
        if self.train.best_metric not in valid:
            what = "on the embedded (sentiment) store" if self.data.store is None else "on a sentiment or emotions store"
            raise ValueError(f"train.best_metric: {self.train.best_metric!r} is not measured {what}; "
                             f"valid: {', '.join(valid)}")
        return self


class FinetuneInit(Section):
    """Where the encoder's weights come from (`jobs/finetune.py --init ...`)."""

    # latest: the newest FINISHED pretraining run on the same image store, else scratch (with a note);
    # run: an MLflow run id (its logged model); checkpoint: a checkpoint folder or its model.pt;
    # transformers: a transformers LxmertForPreTraining directory (config.json + weights), via the adapter;
    # reference: a snapshot file of the reference code (airsplay/lxmert): its pretrained model_LXRT.pth or a
    # fine-tuned BEST.pth (the answer head too, when its shapes match), via the same adapter.
    source: Literal["latest", "scratch", "run", "checkpoint", "transformers", "reference"] = "latest"
    run_id: str | None = Field(None, min_length=1)
    path: str | None = Field(None, min_length=1)
    pretrain_experiment: str = Field("xmodal-pretrain", min_length=1)  # where `latest` and `run` look
    # The reference's trick: the answer head starts from the pretraining QA head where answers overlap.
    answer_head_from_qa: bool = True

    @model_validator(mode="after")
    def _check(self) -> FinetuneInit:
        # Messages start with the field's name; the loader puts the section's dotted path in front.
        if self.source == "run" and not self.run_id:
            raise ValueError("run_id: required with source=run: the MLflow run id of a pretraining run "
                             "(jobs/finetune.py --init-run-id ID)")
        if self.source in INIT_PATH_SOURCES and not self.path:
            what = "FILE" if self.source == "reference" else "DIR"
            raise ValueError(f"path: required with source={self.source} (jobs/finetune.py --init-path {what})")
        # An option the chosen source does not read is a mistake, never ignored: `--init-run-id ID`
        # alone would otherwise fine-tune from `latest` and drop the id.
        if self.run_id is not None and self.source != "run":
            raise ValueError(f"run_id = {self.run_id!r}: only read with source=run, but source={self.source!r}; "
                             "add --init run (init.source=run) or drop --init-run-id (init.run_id)")
        if self.path is not None and self.source not in INIT_PATH_SOURCES:
            raise ValueError(f"path = {self.path!r}: only read with source=checkpoint, transformers or reference, but "
                             f"source={self.source!r}; choose one with --init (init.source) or drop --init-path "
                             "(init.path)")
        default = type(self).model_fields["pretrain_experiment"].default
        if self.pretrain_experiment != default and self.source not in ("latest", "run"):
            raise ValueError(f"pretrain_experiment = {self.pretrain_experiment!r}: only read with source=latest or "
                             f"run, but source={self.source!r}")
        return self


INIT_PATH_SOURCES = ("checkpoint", "transformers", "reference")  # the init sources that read init.path


class FinetuneDataConfig(Section):
    # A fine-tuning set (`python jobs/ingest.py vqa|gqa|nlvr2|synthetic-vqa|synthetic-nlvr2 DIR`), which
    # names its image store. None = the embedded synthetic set of the task, built on first use from the
    # embedded synthetic image store (the pretraining job's).
    store: str | None = _store_field()
    synthetic: SyntheticLxmertOptions = Field(default_factory=embedded_lxmert_store)
    # Questions per image of the embedded synthetic VQA/GQA set: one (5,400 training questions), a
    # labelled set much smaller than the pretraining corpus, as real fine-tuning sets are.
    synthetic_questions_per_image: int = Field(1, ge=1)
    eval_batches: PosInt | None = None  # cap on validation batches per evaluation


class FinetuneConfig(_Job):
    """LXMERT fine-tuning: `jobs/finetune.py --task vqa|gqa|nlvr2`. The model section applies to a
    from-scratch run; initialised from pretrained weights, the architecture is the checkpoint's."""

    task: Literal["vqa", "gqa", "nlvr2"] = "vqa"
    PRESETS = LXMERT_PRESETS
    preset: Literal["small", "paper", "tiny"] = "small"
    model: LxmertConfig = Field(default_factory=lambda: LXMERT_PRESETS["small"])
    init: FinetuneInit = Field(default_factory=FinetuneInit)
    # Paper (Appendix B): one sigmoid logit with binary cross-entropy; reference: 2-way softmax.
    nlvr2_output: Literal["sigmoid", "softmax"] = "sigmoid"
    # Reference: BCE on the soft scores (VQA; its GQA default too); "ce": cross-entropy on the top answer.
    qa_loss: Literal["bce", "ce"] = "bce"
    robust: FinetuneRobustConfig = Field(default_factory=FinetuneRobustConfig)
    data: FinetuneDataConfig = Field(default_factory=FinetuneDataConfig)
    # Paper: lr 1e-5 or 5e-5, batch 32, 4 epochs. The embedded default: the paper's 5e-5, one epoch of
    # the synthetic set's 5,400 questions (168 steps).
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(lr=5e-5, warmup_ratio=0.1))
    train: TrainConfig = Field(default_factory=lambda: TrainConfig(
        epochs=1, batch_size=32, eval_every=50, log_every=10, best_metric="valid/accuracy"))
    scale: ScaleConfig = Field(default_factory=ScaleConfig)
    mlflow: MlflowConfig = Field(default_factory=lambda: MlflowConfig(experiment="xmodal-finetune"))

    @model_validator(mode="after")
    def _check(self) -> FinetuneConfig:
        _check_batch(self.train, self.scale)
        valid = finetune_metrics(self.task)
        if self.train.best_metric not in valid:
            raise ValueError(f"train.best_metric: {self.train.best_metric!r} is not measured on {self.task}; "
                             f"valid: {', '.join(valid)}")
        return self


class PretrainFinetuneConfig(_Job):
    """A pretrain-then-fine-tune chain: one sweep trial, scored by downstream accuracy (paper Tables 3-5).

    The fine-tuning stage always starts from the pretraining stage's final model (its `init` is
    replaced). `mlflow` and `scale` apply to both stages: one experiment, runs `<run_name>-pretrain`
    and `<run_name>`, one storage path."""

    pretrain: PretrainConfig = Field(default_factory=PretrainConfig)
    finetune: FinetuneConfig = Field(default_factory=FinetuneConfig)
    mlflow: MlflowConfig = Field(default_factory=lambda: MlflowConfig(experiment="xmodal-chain"))
    scale: ScaleConfig = Field(default_factory=ScaleConfig)

    @model_validator(mode="after")
    def _check(self) -> PretrainFinetuneConfig:
        for stage in ("pretrain", "finetune"):  # this `scale` replaces the stages' own
            try:
                _check_batch(getattr(self, stage).train, self.scale)
            except ValueError as e:
                raise ValueError(f"{stage}.{e}") from None
        # What the chain replaces in its stages is an error when set, never ignored.
        for stage, cls in (("pretrain", PretrainConfig), ("finetune", FinetuneConfig)):
            for section in ("scale", "mlflow"):
                given, default = getattr(getattr(self, stage), section), cls.model_fields[section].default_factory()
                changed = [k for k in type(given).model_fields if getattr(given, k) != getattr(default, k)]
                if changed:
                    raise ValueError(f"{stage}.{section}.{changed[0]}: the chain's own `{section}` section applies to "
                                     f"both stages; set {section}.{changed[0]} instead")
        init, default_init = self.finetune.init, FinetuneInit()
        changed = [k for k in FinetuneInit.model_fields if k != "answer_head_from_qa"
                   and getattr(init, k) != getattr(default_init, k)]
        if changed:
            raise ValueError(f"finetune.init.{changed[0]}: the chain fine-tunes from its own pretraining stage; "
                             "only finetune.init.answer_head_from_qa applies")
        fine = self.finetune
        preset_default = FinetuneConfig.model_fields["preset"].default
        changed = [f"model.{f.name}" for f in dataclasses.fields(fine.model)
                   if getattr(fine.model, f.name) != getattr(LXMERT_PRESETS[fine.preset], f.name)]
        if fine.preset != preset_default or changed:
            key = "preset" if fine.preset != preset_default else changed[0]
            raise ValueError(f"finetune.{key}: the fine-tuning stage takes the pretraining stage's architecture; "
                             f"set pretrain.{key} instead")
        return self


# ---------------------------------------------------------------- options that nothing uses


@dataclass(frozen=True)
class Use:
    """An option (a field, or a whole section: every key under it) that the job reads only when `when`
    holds on its config: given otherwise, it would change nothing, so it is an error naming `what`
    reads it and the setting (`now`) that leaves it unread."""

    key: str  # dotted, from the job's config
    when: Callable[[Any], bool]
    what: str  # "by ...", "to ...": what reads it
    now: Callable[[Any], str]  # the setting that leaves it unread
    hint: str = "drop it"


def _has_noise(conditions: Iterable[str]) -> bool:
    return any(c.startswith("noise_") for c in conditions)


_EMBEDDED = Use("data.synthetic", lambda c: c.data.store is None, "to build the embedded synthetic store "
                "(data.store unset)", lambda c: f"data.store={c.data.store!r} is read instead")
_FAULT_SEED = Use("train.fault_seed", lambda c: c.train.random_faults > 0, "to draw train.random_faults's steps",
                  lambda c: "train.random_faults=0")
_CROSS = Use("model.shared_cross_attention", lambda c: c.model.x_layers > 0, "by the cross-modality layers "
             "(model.x_layers > 0)", lambda c: "model.x_layers=0")
_SCRATCH = "to build the model from scratch (init.source=scratch, or latest when no pretraining run is found)"
_PRETRAINED_HEAD = ("latest", "run", "checkpoint")  # the init sources whose weights carry a QA head and its answers

# Job config class -> its options read only under a condition. `unused_options` walks a config with it
# (into the chain's stages too); only the keys a user gave count, so a default never trips it.
USES: dict[type, tuple[Use, ...]] = {
    PretrainConfig: (
        Use("tasks.feat_loss", lambda c: c.tasks.obj_feat, "by the feature-regression task (tasks.obj_feat=true)",
            lambda c: "tasks.obj_feat=false"),
        Use("tasks.label_objects", lambda c: c.tasks.obj_label, "by the object-label task (tasks.obj_label=true)",
            lambda c: "tasks.obj_label=false"),
        Use("tasks.label_confidence_weighted", lambda c: c.tasks.obj_label,
            "by the object-label task (tasks.obj_label=true)", lambda c: "tasks.obj_label=false"),
        Use("tasks.visual_loss_scale", lambda c: c.tasks.obj_feat or c.tasks.obj_label,
            "by the visual tasks (tasks.obj_feat or tasks.obj_label)", lambda c: "both are off"),
        Use("schedule.qa_from_fraction", lambda c: c.tasks.qa, "by the QA task (tasks.qa=true)",
            lambda c: "tasks.qa=false"),
        Use("data.masking.qa_target", lambda c: c.tasks.qa, "by the QA task (tasks.qa=true)",
            lambda c: "tasks.qa=false"),
        _EMBEDDED, _CROSS, _FAULT_SEED),
    FinetuneConfig: (
        Use("nlvr2_output", lambda c: c.task == "nlvr2", "by the NLVR2 classifier (task=nlvr2)",
            lambda c: f"task={c.task!r}"),
        Use("qa_loss", lambda c: c.task != "nlvr2", "by the VQA and GQA answer loss (task=vqa or gqa)",
            lambda c: f"task={c.task!r}"),
        Use("init.answer_head_from_qa", lambda c: c.task != "nlvr2" and c.init.source in _PRETRAINED_HEAD,
            "when a VQA or GQA answer head starts from pretrained weights with a QA head (task=vqa or gqa, "
            "init.source=latest, run or checkpoint)", lambda c: f"task={c.task!r}, init.source={c.init.source!r}"),
        Use("robust.noise_sigma", lambda c: "feat_noise" in c.robust.conditions,
            "by the feat_noise condition (in robust.conditions)",
            lambda c: f"robust.conditions={list(c.robust.conditions)}"),
        Use("robust.seed", lambda c: bool(c.robust.conditions), "by the robustness conditions (robust.conditions)",
            lambda c: "robust.conditions=[]"),
        _EMBEDDED,
        Use("data.synthetic_questions_per_image", lambda c: c.data.store is None and c.task != "nlvr2",
            "to build the embedded VQA or GQA set (data.store unset, task=vqa or gqa)",
            lambda c: f"data.store={c.data.store!r}" if c.data.store is not None else "task='nlvr2'"),
        Use("preset", lambda c: c.init.source in ("scratch", "latest"), _SCRATCH,
            lambda c: f"init.source={c.init.source} takes the architecture from its weights",
            "drop it, or fine-tune from scratch (--init scratch)"),
        Use("model", lambda c: c.init.source in ("scratch", "latest"), _SCRATCH,
            lambda c: f"init.source={c.init.source} takes the architecture from its weights",
            "drop it, or fine-tune from scratch (--init scratch)"),
        _CROSS, _FAULT_SEED),
    MultTrainConfig: (
        Use("robust.noise_sigma", lambda c: _has_noise(c.robust.conditions),
            "by the noise_* conditions (in robust.conditions)",
            lambda c: f"robust.conditions={list(c.robust.conditions)}"),
        Use("robust.seed", lambda c: _has_noise(c.robust.conditions), "by the noise_* conditions "
            "(in robust.conditions; zero_* draws nothing)", lambda c: f"robust.conditions={list(c.robust.conditions)}"),
        _EMBEDDED, _FAULT_SEED),
}


def unused_options(cfg: BaseModel, given: Iterable[str], prefix: str = "") -> list[str]:
    """One line per option in `given` (dotted keys a user set) that `cfg`, a job's validated config, does
    not read (`USES`); the stages of a chain are walked under their own prefix."""
    keys = sorted(set(given))
    stage = f" (in {prefix.rstrip('.')})" if prefix else ""  # what/now name keys within the stage
    out = []
    for use in USES.get(type(cfg), ()):
        if use.when(cfg):
            continue
        full = prefix + use.key
        for key in (k for k in keys if k == full or k.startswith(full + ".")):
            shown = short_repr(_value_at(cfg, key[len(prefix):]))
            out.append(f"{key}{f' = {shown}' if shown else ''}: only used {use.what}, but {use.now(cfg)}{stage}; "
                       f"{use.hint}")
    for name in type(cfg).model_fields:
        sub = getattr(cfg, name)
        if isinstance(sub, _Job):
            out += unused_options(sub, keys, f"{prefix}{name}.")
    return out


def _value_at(cfg: Any, key: str) -> Any:
    node = cfg
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else getattr(node, part, None)
    return node


def check_used(cfg: BaseModel, given: dict | Iterable[str], source: str) -> None:
    """Raise ConfigError listing every option a user gave (`given`: their raw config, or its dotted keys)
    that this config does not read."""
    problems = unused_options(cfg, dotted_keys(given) if isinstance(given, dict) else given)
    if problems:
        raise ConfigError(f"invalid config ({source}):\n" + "\n".join(f"  {x}" for x in problems))


# ---------------------------------------------------------------- loading and overrides


def format_validation_error(err: ValidationError, model: type, source: str) -> str:
    """One line per problem: the dotted key, the bad value and what is allowed (no pydantic noise,
    no dumps of whole sections)."""
    lines: list[str] = []
    for e in err.errors():
        line = error_line(e, model)
        if line not in lines:
            lines.append(line)
    return f"invalid config ({source}):\n" + "\n".join(f"  {x}" for x in lines)


_BOUND_ERRORS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")
# A check's message that starts with a field name ("hidden_size = 130: ...", "MultConfig.dim = 31: ...",
# "run_id: required ...", a dotted key within the section: "optim.lr = inf: ...") is reported under that
# field's dotted key.
_FIELD_MESSAGE = re.compile(r"^(?:[A-Z]\w*\.)?([a-z_][\w.]*)(?= = |: )")


def error_line(e: dict, model: type) -> str:
    """One pydantic error as `key = value: expected ...` (or `key: ...`)."""
    loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and p.startswith("function-")))
    key = ".".join(str(p) for p in loc)
    got = short_repr(e.get("input"))
    kind = e["type"]
    if kind in ("extra_forbidden", "unexpected_keyword_argument"):
        return f"{key}: unknown key; valid keys here: {', '.join(keys_beside(model, loc))}"
    if kind == "missing":
        return f"{key}: required"
    if kind in ("value_error", "assertion_error"):
        msg = str(e["msg"]).removeprefix("Value error, ").removeprefix("Assertion failed, ")
        m = _FIELD_MESSAGE.match(msg)
        if loc and m and m.group(1).split(".")[0] in field_names(type_at(model, loc)[0]):
            return f"{key}.{m.group(1)}{msg[m.end():]}"
        return f"{key}: {msg}" if loc else msg  # a check across sections names its keys itself
    msg = str(e["msg"]).removeprefix("Input should be ")
    if kind in _BOUND_ERRORS:
        typ, meta = type_at(model, loc)
        what = "an integer" if typ is int else "a finite number" if _non_finite(e.get("input")) else "a number"
        msg = describe_bounds(meta, what) or msg
    elif kind == "string_too_short":
        msg = "a non-empty string"
    elif kind == "too_short":
        n = (e.get("ctx") or {}).get("min_length", 1)
        msg = f"at least {n} item{'s' if n != 1 else ''}"
    where = key or "<top level>"
    return f"{where} = {got}: expected {msg}" if got is not None else f"{where}: expected {msg}"


def _non_finite(value: Any) -> bool:
    """Whether a value given for a float field is inf or nan (pydantic reads 'inf' and 'nan' as such)."""
    try:
        return not isinstance(value, bool) and not math.isfinite(float(value))
    except (TypeError, ValueError, OverflowError):
        return False


def short_repr(value: Any, limit: int = 60) -> str | None:
    """repr of a value, or None for a long one (a whole section is not worth printing)."""
    text = repr(value)
    return text if len(text) <= limit else None


def parse_override(item: str) -> tuple[list[str], Any]:
    key, _, raw = item.partition("=")
    if "=" not in item or not all(part.strip() for part in key.split(".")):
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE with a dotted key, e.g. train.epochs=3")
    try:
        value = load_yaml(raw) if raw != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {item!r}: the value is not valid YAML: {yaml_problem(e)}") from None
    return key.strip().split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    for item in overrides:
        path, value = parse_override(item)
        data = set_dotted(data, ".".join(path), value, "--set ", ConfigError)
    return data


def read_user_file(p: Path, what: str = "config file", prefix: str = "", error: type[ConfigError] | None = None
                   ) -> str:
    """The text of a file the user names: a missing path, a folder, an unreadable or non-UTF-8 file are
    errors naming it."""
    error = error or ConfigError
    if p.is_dir():
        raise error(f"{prefix}{what} {str(p)!r} is a directory; expected a YAML file")
    if not p.is_file():
        raise error(f"{prefix}{what} {str(p)!r} does not exist")
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise error(f"{prefix}{p}: not UTF-8 text (byte {e.start}); expected a YAML file") from None
    except OSError as e:
        raise error(f"{prefix}{p}: cannot be read: {e.strerror or e}") from None


def read_yaml(path: str | Path) -> dict:
    p = Path(path)
    text = read_user_file(p)
    try:
        data = load_yaml(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {yaml_problem(e)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a mapping of config sections at the top level, got {type(data).__name__}")
    return data


class StrictLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a key given twice in one mapping is an error: PyYAML keeps the
    last one silently, so a config with `train:` twice ran with only the second section. Every YAML a
    user writes (config files, --set values, search spaces and their base files) is read with it.
    Keys brought in by a `<<` merge may be overridden, as YAML intends."""

    def construct_mapping(self, node: yaml.Node, deep: bool = False) -> dict:
        if isinstance(node, yaml.MappingNode):
            first: dict[Any, yaml.Mark] = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    seen = first.setdefault(key, key_node.start_mark)
                except TypeError:
                    continue  # an unhashable key: the base constructor reports it
                if seen is not key_node.start_mark:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r} (first given at line {seen.line + 1}, column "
                                    f"{seen.column + 1}); give each key once", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str, loader: type[StrictLoader] = StrictLoader) -> Any:
    """YAML a user wrote -> Python data; duplicate keys are errors (`StrictLoader`)."""
    return yaml.load(text, Loader=loader)  # noqa: S506 - a SafeLoader subclass


def yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML error on one line: what and where (PyYAML's own text spans several lines)."""
    mark = getattr(e, "problem_mark", None)
    what = " ".join(str(getattr(e, "problem", None) or e).split())
    return f"{what} (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else what


def load_config(model: type[Section], path: str | Path | None = None, overrides: list[str] | None = None,
                base: dict | None = None) -> Any:
    """YAML file (optional) + dotted overrides -> a validated config of type `model`.

    Files and overrides are merged into the config's own defaults, so `--set train.epochs=2`
    keeps the job's other `train` defaults. The model section is the exception: it is
    overrides on top of the chosen preset. An option given (in `base`, the file or an override)
    that the resulting config does not read is an error (`check_used`).
    """
    data = _job_defaults(model, base or {})
    given = base or {}  # what the user wrote, without the defaults: the options they set
    source = "defaults"
    if path is not None:
        raw = read_yaml(path)
        data, given = deep_merge(data, raw), deep_merge(given, raw)
        source = str(path)
    if overrides:
        data = apply_overrides(data, overrides)
        given = apply_overrides(given, overrides)
        source += " + --set " + " ".join(overrides)
    try:
        cfg = model.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, model, source)) from None
    check_used(cfg, given, source)
    return cfg


def flatten(cfg: BaseModel | dict, prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}, for MLflow params."""
    data = cfg.model_dump(mode="json") if isinstance(cfg, BaseModel) else cfg
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out
