"""The pretrain-then-fine-tune chain (`PretrainFinetuneConfig`) as one job: what a sweep trial runs to
score a pretraining ablation by downstream accuracy, as the paper's Tables 3 to 5 do.

Both stages run through the engine: the pretraining stage is a run of its own (`<name>-pretrain`,
resumed or skipped when it already finished), then the fine-tuning stage (`<name>`) starts from that
run's final model. Both stages' configs are checked before the first starts. The trial's metric is
the fine-tuning stage's (e.g. valid/accuracy): its run is the one that reports to a sweep (`Trial`).
"""

from __future__ import annotations

import re

from xmodal.base import run_tags
from xmodal.config.experiment import ConfigError
from xmodal.config.paths import config_has
from xmodal.jobs.chain_config import PretrainFinetuneConfig
from xmodal.jobs.finetune_config import FinetuneInit
from xmodal.jobs.finetune_init import Init
from xmodal.jobs.finetune_job import FinetuneJob, started_from
from xmodal.jobs.pretrain_job import PretrainJob
from xmodal.models.lxmert.model import LxmertConfig
from xmodal.runner.hooks import say
from xmodal.runner.spec import CheckedRun, CheckedStages, RunResult, StagedJob, Trial


def stages(cfg: PretrainFinetuneConfig, name: str):
    """(pretraining config, fine-tuning config without its init) with the chain's mlflow and scale."""
    ml = cfg.mlflow

    def stage(sub, run_name: str, register: str | None):
        return sub.model_copy(update={"scale": cfg.scale, "mlflow": sub.mlflow.model_copy(update={
            "tracking_uri": ml.tracking_uri, "experiment": ml.experiment, "run_name": run_name,
            "system_metrics": ml.system_metrics, "registered_model": register})})

    # The chain's model is the fine-tuned one: only that stage registers (mlflow.registered_model).
    return stage(cfg.pretrain, f"{name}-pretrain", None), stage(cfg.finetune, name, ml.registered_model)


class ChainJob(StagedJob):
    name = "pretrain_finetune"
    config_class = PretrainFinetuneConfig
    run_name = "chain"

    def check_stages(self, cfg: PretrainFinetuneConfig, check) -> CheckedStages:
        """Both stages, once, before either starts: the fine-tuning stage as it will run, on the
        pretraining stage's architecture (its weights do not exist yet: `run_stages` resolves them)."""
        pre, fine = stages(cfg, cfg.mlflow.run_name)
        first = _stage_check(check, "pretrain", PretrainJob(), pre)
        fine = fine.model_copy(update={"init": FinetuneInit(source="scratch")})  # `started_from` sets it
        return CheckedStages(cfg, [first, _stage_check(check, "finetune", _OnArchitecture(first.prepared.cfg.model),
                                                       fine)])

    def run_stages(self, checked: CheckedStages, run, source: str, parent_run_id: str | None,
                   tags: dict[str, str] | None, trial: Trial | None) -> RunResult:
        cfg = checked.cfg
        name = cfg.mlflow.run_name
        pre, fine = stages(cfg, name)
        # The pretraining stage is a child of the same parent, but not a trial: reports count trials only.
        stage_tags = {run_tags.CHAIN_STAGE: "pretrain",
                      **{k: v for k, v in (tags or {}).items() if k != run_tags.KIND}}
        # A trial whose worker runs in its own process (`Trial.in_process`) holds the worker's resources:
        # its pretraining stage runs there too, reporting to no one (Tune ranks the fine-tuning stage).
        stage = Trial(report=_unreported, marks_end=True) if trial is not None and trial.in_process else None
        first = run(PretrainJob(), pre, source, parent_run_id, stage_tags, stage, checked=checked.stages[0])
        say(f"[xmodal] chain {name}: pretraining stage done (MLflow run {first.run_id}); fine-tuning from it")
        init = FinetuneInit(source="run", run_id=first.run_id, pretrain_experiment=cfg.mlflow.experiment,
                            answer_head_from_qa=cfg.finetune.init.answer_head_from_qa)
        fine = fine.model_copy(update={"init": init})
        fine_tags = {run_tags.CHAIN_STAGE: "finetune", run_tags.PRETRAIN_RUN_ID: first.run_id, **(tags or {})}
        return run(FinetuneJob(), fine, source, parent_run_id, fine_tags, trial,
                   checked=started_from(checked.stages[1], init))


def _stage_check(check, stage: str, spec, cfg) -> CheckedRun:
    """A stage's check, its errors naming the chain's keys: `examples.split: ...` of the fine-tuning stage
    is the chain's `finetune.examples.split`."""
    try:
        return check(spec, cfg)
    except ConfigError as e:
        text = str(e)
        key = re.match(r"[a-z_]\w*(?:\.\w+)*", text)  # a message that starts with a key names it
        if key and config_has(type(cfg), key.group(0)):
            raise ConfigError(f"{stage}.{text}") from None
        raise


class _OnArchitecture(FinetuneJob):
    """The fine-tuning stage as its check sees it before the pretraining stage has run: the weights
    are yet to come, their architecture is known (the pretraining stage's fitted model), so the set
    and the model are checked as the stage will run. `started_from` puts the weights in later."""

    def __init__(self, model: LxmertConfig):
        self.model = model

    def resolve_start(self, cfg, data, tracking_uri, download_dir) -> tuple[Init, LxmertConfig]:
        return Init("scratch"), self.model


def _unreported(_metrics: dict) -> None:
    """The pretraining stage's reports within a trial: Tune ranks the trial by its fine-tuning stage."""
