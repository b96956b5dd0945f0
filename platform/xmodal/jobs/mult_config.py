"""The MulT job's config (`jobs/train_mult.py`, `mult_job.MultJob`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from xmodal.base.bounds import Seed
from xmodal.config.experiment import (
    SHARED_USES,
    JobConfig,
    MlflowConfig,
    OptimConfig,
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
from xmodal.core.robustness import MULT_CONDITIONS, MultCondition
from xmodal.data.options import SyntheticMultOptions
from xmodal.models.mult.config import PRESETS as MULT_PRESETS
from xmodal.models.mult.config import MultConfig
from xmodal.objectives.sentiment import MULT_METRICS, F1Protocol, mult_valid_metrics


class MultRobustConfig(RobustSection):
    """Robustness, evaluated once at the end on the test split with the selected model (never at the
    per-step evaluations): each condition logged as `robust/<condition>/<metric>`. [] = off."""

    # zero_<m>: modality m missing (features zeroed); noise_<m>: Gaussian noise on m (xmodal.core.robustness).
    conditions: list[MultCondition] = Field(default_factory=lambda: list(MULT_CONDITIONS))
    # Noise std as a multiple of each feature dimension's std over the evaluated split's real steps.
    noise_sigma: float = Field(0.5, gt=0, le=10)
    seed: Seed = 0  # with the condition and each example's row: the noise drawn


def _has_noise(conditions: Iterable[str]) -> bool:
    return any(c.startswith("noise_") for c in conditions)


DEFAULT_PAGES = 16  # examples.count unset, on a sentiment store


class MultExamplesConfig(Section):
    """Example pages logged into the run at its end (`examples/index.html`, docs/tracking.md): `count`
    clips of `split` with the run's final model, each with its prediction, label and crossmodal attention
    over time. 0 = off. The pages show sentiment clips: unset, `count` is 16 on a sentiment store and
    none on an emotions store (IEMOCAP), where a count above 0 is refused (`mult_job.with_store_dims`)."""

    count: int | None = Field(None, ge=0, le=1000)  # None: DEFAULT_PAGES on a sentiment store, else 0
    split: Literal["valid", "test"] = "test"


class MultDataConfig(Section):
    store: str | None = store_field()  # None = the embedded synthetic store, built on first use
    synthetic: SyntheticMultOptions = Field(default_factory=SyntheticMultOptions)


class MultTrainConfig(JobConfig):
    """MulT training: `jobs/train_mult.py`. Defaults (the embedded default): the `small` preset with
    the reference code's optimiser (Adam, clip 0.8, L1) at lr 3e-3 on the embedded synthetic store,
    792 steps (12 epochs of 66), about 20 s of training on a 2-core CPU. Paper / reference runs set
    `preset=reference` (or `paper_mosei`, ...) and `optim.lr=1e-3` (the reference's rate)."""

    PRESETS = MULT_PRESETS
    RECIPES = recipes_for("mult")
    # config/recipes.py: mult-reference, mult-mosei-paper, mult-mosi-paper, mult-iemocap-paper
    recipe: str | None = None
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
    examples: MultExamplesConfig = Field(default_factory=MultExamplesConfig)
    optim: OptimConfig = Field(default_factory=lambda: OptimConfig(
        name="adam", lr=3e-3, weight_decay=0.0, eps=1e-8, warmup_ratio=0.0, grad_clip=0.8))
    train: TrainConfig = Field(default_factory=lambda: TrainConfig(
        epochs=12, batch_size=24, eval_every=50, log_every=10, best_metric="valid/mae", best_mode="min"))
    scale: ScaleConfig = Field(default_factory=ScaleConfig)
    mlflow: MlflowConfig = Field(default_factory=lambda: MlflowConfig(experiment="xmodal-mult"))
    # One training per seed; the parent MLflow run gets each metric's mean and std.
    seeds: list[Seed] | None = Field(None, min_length=1)

    # Options read only under a condition (`config.unused_options`): given otherwise, an error.
    USES: ClassVar[tuple[Use, ...]] = (
        Use("examples.split", lambda c: c.examples.count != 0, "by the example pages (examples.count > 0)",
            lambda c: "examples.count=0"),
        Use("robust.noise_sigma", lambda c: _has_noise(c.robust.conditions),
            "by the noise_* conditions (in robust.conditions)",
            lambda c: f"robust.conditions={list(c.robust.conditions)}"),
        Use("robust.seed", lambda c: _has_noise(c.robust.conditions), "by the noise_* conditions "
            "(in robust.conditions; zero_* draws nothing)", lambda c: f"robust.conditions={list(c.robust.conditions)}"),
        *SHARED_USES,
    )

    @model_validator(mode="after")
    def _check(self) -> MultTrainConfig:
        # (MultConfig checks itself: bounds as field metadata, the rest in its __post_init__.)
        check_batch(self.train, self.scale)
        if self.seeds is not None and len(set(self.seeds)) < len(self.seeds):
            raise ValueError(f"seeds = {self.seeds}: expected distinct seeds")
        if self.seeds is not None and self.train.seed != type(self).model_fields["train"].default_factory().seed:
            raise ValueError(f"train.seed = {self.train.seed}: not used with seeds = {self.seeds} (each run takes its "
                             "seed from seeds); drop one of them")
        # The embedded store is a sentiment set; a named store's task is checked again once it is opened.
        tasks = ["sentiment"] if self.data.store is None else list(MULT_METRICS)
        valid = mult_valid_metrics(*tasks)
        what = "on the embedded (sentiment) store" if self.data.store is None else "on a sentiment or emotions store"
        if self.train.best_metric not in valid:
            raise ValueError(f"train.best_metric: {self.train.best_metric!r} is not measured {what}; "
                             f"valid: {', '.join(valid)}")
        check_plateau(self.optim, valid, what)
        return self
