"""The pretrain-then-fine-tune chain's config (`chain_job.ChainJob`): both stages' configs, one
`mlflow` and one `scale` section for both."""

from __future__ import annotations

import dataclasses

from pydantic import Field, model_validator

from xmodal.config.experiment import JobConfig, MlflowConfig, ScaleConfig, check_batch
from xmodal.jobs.finetune_config import FinetuneConfig, FinetuneInit
from xmodal.jobs.pretrain_config import PretrainConfig
from xmodal.models.lxmert.model import PRESETS as LXMERT_PRESETS


class PretrainFinetuneConfig(JobConfig):
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
                check_batch(getattr(self, stage).train, self.scale)
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
