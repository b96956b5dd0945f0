"""LXMERT's five pretraining tasks (paper §3.1) as separately switchable losses. Imports only torch
(and annotated_types: the config's bounds, checked by the experiment config).

Tasks (names used everywhere: config, logs, MLflow):
  mlm        masked cross-modality language modelling
  obj_feat   RoI-feature regression on masked objects
  obj_label  detected-label classification (objects + attributes)
  matching   cross-modality matching
  qa         image question answering (matched pairs only)

Heads are applied only where a loss needs them: the vocabulary projection at
masked words, the feature regressor at masked objects, the label classifiers at
the objects the label loss covers.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from xmodal.base.bounds import PosFloat
from xmodal.core.batches import LxmertBatch
from xmodal.models.lxmert.model import LxmertForPretraining
from xmodal.objectives import loss_precision

TASKS: tuple[str, ...] = ("mlm", "obj_feat", "obj_label", "matching", "qa")
IGNORE = -100


@dataclass
class PretrainTasks:
    __pydantic_config__ = {"extra": "forbid"}

    mlm: bool = True
    obj_feat: bool = True
    obj_label: bool = True
    matching: bool = True
    qa: bool = True
    # Paper: L2; reference: SmoothL1 averaged over the feature dims.
    feat_loss: Literal["l2", "smooth_l1"] = "l2"
    # The masked objects' feature losses divided by the number of masked objects ("masked") or of all
    # real objects ("all": the reference's `(loss * feat_mask).mean()`, which its 1 / 0.15 scales back).
    feat_loss_mean: Literal["masked", "all"] = "masked"
    # Paper: masked objects; reference: all objects, weighted by detector confidence.
    label_objects: Literal["masked", "all"] = "masked"
    label_confidence_weighted: bool = False
    # Reference multiplies the visual losses by 1 / 0.15; the paper sums with equal weights.
    visual_loss_scale: PosFloat = 1.0

    def enabled(self) -> tuple[str, ...]:
        return tuple(t for t in TASKS if getattr(self, t))

    @classmethod
    def reference(cls) -> PretrainTasks:
        return cls(feat_loss="smooth_l1", feat_loss_mean="all", label_objects="all", label_confidence_weighted=True,
                   visual_loss_scale=1 / 0.15)

    def replace(self, **changes) -> PretrainTasks:
        return dataclasses.replace(self, **changes)


# task -> the minival metrics `PretrainingObjective` reports for it (config checks train.best_metric against them)
PRETRAIN_TASK_METRICS: dict[str, tuple[str, ...]] = {
    "mlm": ("mlm_acc",),
    "obj_feat": ("feat_mse",),
    "obj_label": ("obj_acc", "attr_acc"),
    "matching": ("match_acc",),
    "qa": ("qa_acc",),
}


def pretraining_eval_metrics(tasks: PretrainTasks) -> list[str]:
    """The `eval/*` metrics a pretraining run logs with these tasks on."""
    names = ["eval/loss"]
    for t in tasks.enabled():
        names += [f"eval/loss/{t}"] + [f"eval/{m}" for m in PRETRAIN_TASK_METRICS[t]]
    return names


def _masked_mean(x: Tensor, keep: Tensor, weight: Tensor | None = None) -> Tensor:
    """Mean of `x` over the kept entries (0, with a graph, when none is kept). Static shapes: every
    entry is computed and the unkept ones are zeroed, so a compiled graph never breaks on a boolean
    selection (`nonzero`) and nothing waits for the host."""
    kept = keep.to(x.dtype)
    scale = kept if weight is None else kept * weight.to(x.dtype)
    return (x * scale).sum() / kept.sum().clamp(min=1)


def _hits(logits: Tensor, target: Tensor, keep: Tensor) -> Tensor:
    return ((logits.argmax(-1) == target) & keep).sum()


def pretraining_losses(
    model: LxmertForPretraining,
    batch: LxmertBatch,
    tasks: PretrainTasks,
    active: tuple[str, ...] | None = None,
    with_metrics: bool = False,
) -> dict[str, Tensor]:
    """Forward pass and the enabled tasks' losses.

    `active` narrows the enabled tasks for this step (the paper's schedule adds
    QA only in the last half). Returns {"loss": sum, "loss/<task>": ...} and,
    with `with_metrics`, "<metric>/correct" and "<metric>/count" sums that can be
    reduced across workers before dividing. Each loss is a mean over the positions its task
    selects (masked words, masked or labelled objects, matched pairs), computed with static shapes.
    """
    run = tuple(t for t in tasks.enabled() if active is None or t in active)
    out = model(batch.input_ids, batch.attention_mask, batch.visual_feats, batch.boxes, batch.visual_mask)
    res: dict[str, Tensor] = {}

    if "mlm" in run:
        sel = batch.mlm_labels != IGNORE  # (B, T)
        logits = loss_precision(model.mlm_head(out.lang))  # (B, T, V): every word, the loss keeps the masked ones
        target = batch.mlm_labels.clamp(min=0)
        ce = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none").view_as(sel)
        res["loss/mlm"] = _masked_mean(ce, sel)
        if with_metrics:
            res["mlm_acc/correct"] = _hits(logits, target, sel)
            res["mlm_acc/count"] = sel.sum()

    if "obj_feat" in run or "obj_label" in run:
        _object_losses(model, out.visn, batch, tasks, run, with_metrics, res)

    if "matching" in run:
        logits = loss_precision(model.match_head(out.pooled))  # (B, 2)
        res["loss/matching"] = F.cross_entropy(logits, batch.is_matched)
        if with_metrics:
            res["match_acc/correct"] = (logits.argmax(-1) == batch.is_matched).sum()
            res["match_acc/count"] = batch.is_matched.new_tensor(batch.is_matched.numel())

    if "qa" in run:
        # Only matched pairs carry a QA target (paper §3.1.3).
        sel = (batch.qa_labels != IGNORE) & (batch.is_matched == 1)  # (B,)
        logits = loss_precision(model.qa_head(out.pooled))  # (B, A)
        target = batch.qa_labels.clamp(min=0)
        res["loss/qa"] = _masked_mean(F.cross_entropy(logits, target, reduction="none"), sel)
        if with_metrics:
            res["qa_acc/correct"] = _hits(logits, target, sel)
            res["qa_acc/count"] = sel.sum()

    res["loss"] = sum(res[f"loss/{t}"] for t in run)
    return res


def _object_losses(model: LxmertForPretraining, visn: Tensor, batch: LxmertBatch, tasks: PretrainTasks,
                   run: tuple[str, ...], with_metrics: bool, res: dict[str, Tensor]) -> None:
    """The object tasks' losses (feature regression, detector labels) and metrics, added to `res`:
    both read the same transformed object states."""
    masked = batch.obj_masked & batch.visual_mask  # (B, N)
    need = masked if tasks.label_objects == "masked" or "obj_label" not in run else batch.visual_mask
    h = model.object_heads.transform(visn)  # (B, N, D); the losses keep `need`

    if "obj_feat" in run:
        pred = loss_precision(model.object_heads.feat(h))  # (B, N, F)
        target = batch.feat_targets.to(pred.dtype)
        if tasks.feat_loss == "l2":
            per_obj = F.mse_loss(pred, target, reduction="none").mean(-1)
        else:
            per_obj = F.smooth_l1_loss(pred, target, reduction="none").mean(-1)
        if tasks.feat_loss_mean == "masked":
            feat = _masked_mean(per_obj, masked)
        else:
            feat = (per_obj * masked.to(per_obj.dtype)).sum() / batch.visual_mask.sum().clamp(min=1)
        res["loss/obj_feat"] = tasks.visual_loss_scale * feat
        if with_metrics:
            mse = F.mse_loss(pred, target, reduction="none").mean(-1)
            res["feat_mse/correct"] = (mse * masked).sum().detach()
            res["feat_mse/count"] = masked.sum()

    if "obj_label" in run:
        total = h.new_zeros((), dtype=torch.float32)
        for name, head, labels, conf in (
            ("obj", model.object_heads.obj, batch.obj_labels, batch.obj_conf),
            ("attr", model.object_heads.attr, batch.attr_labels, batch.attr_conf),
        ):
            keep = need & (labels != IGNORE)  # (B, N)
            logits = loss_precision(head(h))  # (B, N, L)
            target = labels.clamp(min=0)
            ce = F.cross_entropy(logits.flatten(0, 1), target.flatten(), reduction="none").view_as(keep)
            weight = conf if tasks.label_confidence_weighted else None
            total = total + _masked_mean(ce, keep, weight)
            if with_metrics:
                res[f"{name}_acc/correct"] = _hits(logits, target, keep)
                res[f"{name}_acc/count"] = keep.sum()
        res["loss/obj_label"] = tasks.visual_loss_scale * total


class PretrainingObjective(torch.nn.Module):
    """Model + task config as one module whose forward returns the loss dict.

    The training layer wraps this (DDP, compile), so every head runs inside the
    wrapped forward. Heads of disabled tasks are frozen: they never receive a
    gradient, and DDP does not wait for one.
    """

    def __init__(self, model: LxmertForPretraining, tasks: PretrainTasks):
        super().__init__()
        self.model = model
        self.tasks = tasks
        for task, head in (("matching", model.match_head), ("qa", model.qa_head)):
            head.requires_grad_(getattr(tasks, task))
        heads = model.object_heads
        heads.feat.requires_grad_(tasks.obj_feat)
        heads.obj.requires_grad_(tasks.obj_label)
        heads.attr.requires_grad_(tasks.obj_label)
        heads.transform.requires_grad_(tasks.obj_feat or tasks.obj_label)
        if not tasks.mlm:
            model.mlm_head.transform.requires_grad_(False)
            model.mlm_head.bias.requires_grad_(False)

    def forward(self, batch: LxmertBatch, active: tuple[str, ...] | None = None,
                with_metrics: bool = False) -> dict[str, Tensor]:
        return pretraining_losses(self.model, batch, self.tasks, active, with_metrics)
