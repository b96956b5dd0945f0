"""The fine-tuning job's config (`jobs/finetune.py`, `finetune_job.FinetuneJob`): the task, where the
starting weights come from (`init`), the set and the robustness conditions."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from xmodal.base.bounds import PosInt, Seed
from xmodal.config.experiment import (
    CROSS_USE,
    SHARED_USES,
    JobConfig,
    MlflowConfig,
    RobustSection,
    ScaleConfig,
    Section,
    TrainConfig,
    Use,
    check_batch,
    check_plateau,
    store_field,
)
from xmodal.config.recipes import recipes_for
from xmodal.core.robustness import FINETUNE_CONDITIONS, FinetuneCondition
from xmodal.data.options import SyntheticLxmertOptions
from xmodal.jobs.pretrain_config import LxmertOptimConfig, embedded_lxmert_store
from xmodal.models.lxmert.model import PRESETS as LXMERT_PRESETS
from xmodal.models.lxmert.model import LxmertConfig
from xmodal.objectives.finetune import finetune_metrics


class FinetuneRobustConfig(RobustSection):
    """Robustness, evaluated once at the end on the validation split with the selected model (never
    at the per-step evaluations): each condition logged as `robust/<condition>/<metric>`. [] = off."""

    # feat_noise: Gaussian noise on the visual features; shuffle_boxes: boxes permuted across each
    # image's objects, features kept (xmodal.core.robustness).
    conditions: list[FinetuneCondition] = Field(default_factory=lambda: list(FINETUNE_CONDITIONS))
    # Noise std as a multiple of each feature dimension's std over the split's images' real objects.
    noise_sigma: float = Field(0.5, gt=0, le=10)
    seed: Seed = 0  # with the condition and each example's row: the noise and permutations drawn


_SCRATCH = "to build the model from scratch (init.source=scratch, or latest when no pretraining run is found)"
_PRETRAINED_HEAD = ("latest", "run", "checkpoint")  # the init sources whose weights carry a QA head and its answers


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
    store: str | None = store_field()
    synthetic: SyntheticLxmertOptions = Field(default_factory=embedded_lxmert_store)
    # Questions per image of the embedded synthetic VQA/GQA set: one (5,400 training questions), a
    # labelled set much smaller than the pretraining corpus, as real fine-tuning sets are.
    synthetic_questions_per_image: int = Field(1, ge=1)
    eval_batches: PosInt | None = None  # cap on validation batches per evaluation


class FinetuneExamplesConfig(Section):
    """Example pages logged into the run at its end (`examples/index.html`, docs/tracking.md): `count`
    examples of `split` with the run's final model, each with its picture, boxes, answers and
    cross-attention. 0 = off."""

    count: int = Field(16, ge=0, le=1000)
    split: str = Field("valid", min_length=1)  # a split the run evaluates: any of its set's but train

    @field_validator("split")
    @classmethod
    def _evaluated(cls, split: str) -> str:
        # known without the set (which may be the embedded one, not built yet): train is never evaluated
        if split == "train":
            raise ValueError("'train' is not a split the run evaluates; expected one of its set's others (e.g. valid)")
        return split


class FinetuneConfig(JobConfig):
    """LXMERT fine-tuning: `jobs/finetune.py --task vqa|gqa|nlvr2`. The model section applies to a
    from-scratch run; initialised from pretrained weights, the architecture is the checkpoint's."""

    task: Literal["vqa", "gqa", "nlvr2"] = "vqa"
    RECIPES = recipes_for("finetune")
    recipe: str | None = None  # config/recipes.py: lxmert-vqa, lxmert-gqa, lxmert-nlvr2, lxmert-nlvr2-paper
    PRESETS = LXMERT_PRESETS
    preset: Literal["small", "paper", "tiny"] = "small"
    model: LxmertConfig = Field(default_factory=lambda: LXMERT_PRESETS["small"])
    init: FinetuneInit = Field(default_factory=FinetuneInit)
    # Paper (Appendix B): one sigmoid logit with binary cross-entropy; reference: 2-way softmax.
    nlvr2_output: Literal["sigmoid", "softmax"] = "sigmoid"
    # Reference: BCE on the soft scores (VQA; its GQA default too); "ce": cross-entropy on the top answer.
    qa_loss: Literal["bce", "ce"] = "bce"
    robust: FinetuneRobustConfig = Field(default_factory=FinetuneRobustConfig)
    examples: FinetuneExamplesConfig = Field(default_factory=FinetuneExamplesConfig)
    data: FinetuneDataConfig = Field(default_factory=FinetuneDataConfig)
    # Paper: lr 1e-5 or 5e-5, batch 32, 4 epochs. The embedded default: the paper's 5e-5, one epoch of
    # the synthetic set's 5,400 questions (168 steps).
    optim: LxmertOptimConfig = Field(default_factory=lambda: LxmertOptimConfig(lr=5e-5, warmup_ratio=0.1))
    train: TrainConfig = Field(default_factory=lambda: TrainConfig(
        epochs=1, batch_size=32, eval_every=50, log_every=10, best_metric="valid/accuracy"))
    scale: ScaleConfig = Field(default_factory=ScaleConfig)
    mlflow: MlflowConfig = Field(default_factory=lambda: MlflowConfig(experiment="xmodal-finetune"))

    # Options read only under a condition (`config.unused_options`): given otherwise, an error.
    USES: ClassVar[tuple[Use, ...]] = (
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
        Use("examples.split", lambda c: c.examples.count > 0, "by the example pages (examples.count > 0)",
            lambda c: "examples.count=0"),
        Use("data.synthetic_questions_per_image", lambda c: c.data.store is None and c.task != "nlvr2",
            "to build the embedded VQA or GQA set (data.store unset, task=vqa or gqa)",
            lambda c: f"data.store={c.data.store!r}" if c.data.store is not None else "task='nlvr2'"),
        Use("preset", lambda c: c.init.source in ("scratch", "latest"), _SCRATCH,
            lambda c: f"init.source={c.init.source} takes the architecture from its weights",
            "drop it, or fine-tune from scratch (--init scratch)"),
        Use("model", lambda c: c.init.source in ("scratch", "latest"), _SCRATCH,
            lambda c: f"init.source={c.init.source} takes the architecture from its weights",
            "drop it, or fine-tune from scratch (--init scratch)"),
        CROSS_USE, *SHARED_USES,
    )

    @model_validator(mode="after")
    def _check(self) -> FinetuneConfig:
        check_batch(self.train, self.scale)
        valid = finetune_metrics(self.task)
        if self.train.best_metric not in valid:
            raise ValueError(f"train.best_metric: {self.train.best_metric!r} is not measured on {self.task}; "
                             f"valid: {', '.join(valid)}")
        check_plateau(self.optim, valid, f"on {self.task}")
        return self
