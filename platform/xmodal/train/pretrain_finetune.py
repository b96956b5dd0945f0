"""A pretrain-then-fine-tune chain as one job (`PretrainFinetuneConfig`): what a sweep trial runs to
score a pretraining ablation by downstream accuracy, as the paper's Tables 3 to 5 do.

It offers the job interface the sweep runner calls (prepare_run / build_trainer / finish_run). Its
`prepare_run` runs the whole pretraining stage (a Ray Train run of its own, logged as the MLflow run
`<name>-pretrain`, resumed or skipped if already finished), then prepares the fine-tuning stage from
that run's final model; the trainer the runner fits, and reports to Tune from, is the fine-tuning
one, so the trial's metric is the downstream one (e.g. valid/accuracy).
"""

from __future__ import annotations

import time
from typing import Any

from xmodal import tracking
from xmodal.config import FinetuneInit, PretrainFinetuneConfig
from xmodal.train import finetune, pretrain
from xmodal.train.finetune import build_trainer, finish_run  # noqa: F401  (the job interface)
from xmodal.train.job import run_job, say

STAGE_TAG = "xmodal.chain_stage"


def stages(cfg: PretrainFinetuneConfig, name: str):
    """(pretraining config, fine-tuning config without its init) with the chain's mlflow and scale."""
    ml = cfg.mlflow
    pre = cfg.pretrain.model_copy(update={
        "scale": cfg.scale,
        "mlflow": cfg.pretrain.mlflow.model_copy(update={
            "tracking_uri": ml.tracking_uri, "experiment": ml.experiment, "run_name": f"{name}-pretrain",
            "system_metrics": ml.system_metrics})})
    fine = cfg.finetune.model_copy(update={
        "scale": cfg.scale,
        "mlflow": cfg.finetune.mlflow.model_copy(update={
            "tracking_uri": ml.tracking_uri, "experiment": ml.experiment, "run_name": name,
            "system_metrics": ml.system_metrics})})
    return pre, fine


def prepare_run(cfg: PretrainFinetuneConfig, source: str = "defaults", parent_run_id: str | None = None,
                extra_tags: dict[str, str] | None = None):
    """Pretrain (to the end), then prepare fine-tuning from that run. Returns the fine-tuning (plan, data)."""
    name = cfg.mlflow.run_name or f"chain-{time.strftime('%Y%m%d-%H%M%S')}"
    pre, fine = stages(cfg, name)
    # The pretraining stage is a child of the same parent, but not a trial: reports count trials only.
    stage_tags = {STAGE_TAG: "pretrain", **{k: v for k, v in (extra_tags or {}).items() if k != "xmodal.kind"}}
    plan, store = pretrain.prepare_run(pre, source, parent_run_id, stage_tags)
    try:  # a stage that had finished (rerun trial) returns at once: its last checkpoint says so
        result = pretrain.build_trainer(plan, store).fit()
        pretrain.finish_run(plan, result.checkpoint)
    except BaseException:
        tracking.set_terminated(plan.tracking_uri, plan.run_id, "FAILED")
        raise
    say(f"[xmodal] chain {name}: pretraining stage done (MLflow run {plan.run_id}); fine-tuning from it")
    fine = fine.model_copy(update={"init": FinetuneInit(
        source="run", run_id=plan.run_id, pretrain_experiment=cfg.mlflow.experiment,
        answer_head_from_qa=cfg.finetune.init.answer_head_from_qa)})
    tags = {STAGE_TAG: "finetune", "pretrain_run_id": plan.run_id, **(extra_tags or {})}
    return finetune.prepare_run(fine, source, parent_run_id, tags)


def run_chain(cfg: PretrainFinetuneConfig, source: str = "defaults") -> dict[str, Any]:
    return run_job(prepare_run, build_trainer, cfg, source)
