"""The pretraining job's config (`jobs/pretrain.py`, `pretrain_job.PretrainJob`): the shared sections
of `xmodal.config.experiment` plus the tasks, their schedule and the LXMERT store."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from xmodal.base.bounds import NonNegInt, PosInt
from xmodal.config.experiment import (
    CROSS_USE,
    SHARED_USES,
    JobConfig,
    MlflowConfig,
    OptimConfig,
    PlateauConfig,
    ScaleConfig,
    Section,
    TrainConfig,
    Use,
    check_batch,
    check_plateau,
    store_field,
)
from xmodal.config.recipes import recipes_for
from xmodal.data.options import MaskingOptions, SyntheticLxmertOptions
from xmodal.models.lxmert.model import PRESETS as LXMERT_PRESETS
from xmodal.models.lxmert.model import LxmertConfig
from xmodal.objectives.pretraining import PretrainTasks, pretraining_eval_metrics


class LxmertOptimConfig(OptimConfig):
    """The optimizer section of the LXMERT jobs: the shared one, and what their embeddings' row 0 does."""

    # train: row 0 of the position and token-type embeddings (the [CLS] position; token type 0, every token
    # of a single-sentence task) trains like any row. no_grad: as the reference's nn.Embedding(...,
    # padding_idx=0), the lookups pass row 0 no gradient (weight decay still moves it, as under BertAdam).
    # The word embedding's row 0 is [PAD], which gets no lookup gradient either way.
    embedding_row0: Literal["train", "no_grad"] = "train"


class PretrainExamplesConfig(Section):
    """Example pages of the QA head logged into the run at its end (`examples/index.html`,
    docs/tracking.md): `count` questions of the store's minival split with the run's final model, each
    with its picture, boxes, answers and cross-attention. 0 = off."""

    count: int = Field(16, ge=0, le=1000)


class TaskSchedule(Section):
    # The paper adds QA only in the last 10 of 20 epochs (0.5); the embedded default trains it from
    # the first step (PretrainConfig.schedule).
    qa_from_fraction: float = Field(0.5, ge=0, lt=1)


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
    store: str | None = store_field()  # None = the embedded synthetic store, built on first use
    synthetic: SyntheticLxmertOptions = Field(default_factory=embedded_lxmert_store)
    masking: MaskingOptions = Field(default_factory=MaskingOptions)
    eval_batches: PosInt | None = None  # cap on minival batches per evaluation
    # Units (row groups) whose images are mixed into each block, the pool of matching negatives
    # (xmodal.data.lxmert.loader.DEFAULT_MIX_UNITS); 0 = consecutive units, unmixed.
    mix_units: NonNegInt = 16



class PretrainConfig(JobConfig):
    """LXMERT pretraining: `jobs/pretrain.py`."""

    PRESETS = LXMERT_PRESETS
    RECIPES = recipes_for("pretrain")
    recipe: str | None = None  # config/recipes.py: lxmert-pretrain, lxmert-pretrain-paper
    preset: Literal["small", "paper", "tiny"] = "small"
    model: LxmertConfig = Field(default_factory=lambda: LXMERT_PRESETS["small"])
    tasks: PretrainTasks = Field(default_factory=PretrainTasks)
    # The embedded default trains QA from the first step; paper runs set schedule.qa_from_fraction=0.5.
    schedule: TaskSchedule = Field(default_factory=lambda: TaskSchedule(qa_from_fraction=0.0))
    data: LxmertDataConfig = Field(default_factory=LxmertDataConfig)
    examples: PretrainExamplesConfig = Field(default_factory=PretrainExamplesConfig)
    # The small preset on the embedded store learns fastest at 2e-3; paper runs use 1e-4.
    optim: LxmertOptimConfig = Field(default_factory=lambda: LxmertOptimConfig(
        lr=2e-3, plateau=PlateauConfig(metric="eval/loss")))
    # The embedded default: about 3 minutes on a 2-core CPU. Paper runs set epochs=20, batch_size=256.
    train: TrainConfig = Field(default_factory=lambda: TrainConfig(epochs=8, batch_size=64, eval_every=500))
    scale: ScaleConfig = Field(default_factory=ScaleConfig)
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig)

    # Options read only under a condition (`config.unused_options`): given otherwise, an error.
    USES: ClassVar[tuple[Use, ...]] = (
        Use("examples.count", lambda c: c.tasks.qa, "by the QA head's example pages (tasks.qa=true)",
            lambda c: "tasks.qa=false"),
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
        Use("tasks.feat_loss_mean", lambda c: c.tasks.obj_feat, "by the feature-regression task "
            "(tasks.obj_feat=true)", lambda c: "tasks.obj_feat=false"),
        CROSS_USE, *SHARED_USES,
    )

    @model_validator(mode="after")
    def _check(self) -> PretrainConfig:
        check_batch(self.train, self.scale)
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
        check_plateau(self.optim, valid, "on minival with these tasks")
        if self.optim.schedule == "plateau" and self.data.store is None and self.data.synthetic.minival_fraction == 0:
            raise ValueError("optim.schedule = 'plateau': it watches optim.plateau.metric on minival at every epoch's "
                             "end, but data.synthetic.minival_fraction = 0 builds no minival")
        return self
