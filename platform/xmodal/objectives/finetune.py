"""LXMERT fine-tuning losses and metrics: VQA, GQA, NLVR2 (paper §4, Appendix B). Imports only torch.

Losses (reference code, airsplay/lxmert `tasks/*.py`):
  vqa, gqa  binary cross-entropy with logits on the soft answer scores (GQA: one-hot), averaged
            over all B x A entries and multiplied by A (= summed over answers, averaged over
            questions); `scale_by_answers=False` keeps the plain mean. The paper names no
            scaling. `qa_loss="ce"` is the reference's GQA `--mce_loss`: cross-entropy on the
            best-scored answer (rows without a known answer are left out here; the reference
            would train them towards answer 0), multiplied by A as well when scaling.
  nlvr2     2-way cross-entropy (reference), or the paper's sigmoid + binary cross-entropy when
            the model has one output (`LxmertForNlvr2(output="sigmoid")`).

Metrics, as summable "<name>/correct" and "<name>/count" (reduced across workers, then divided):
  vqa_score  soft score of the predicted answer (reference `VQAEvaluator`: label[answer])
  accuracy   GQA: the predicted answer is the right one (its target > 0); NLVR2: label match
Predictions take the first of tied maxima (torch's argmax, as the reference's `logit.max(1)`).

NLVR2 consistency (`nlvr2_consistency`) follows the official evaluator (lil-lab/nlvr
`nlvr2/eval/metrics.py`): identifiers are "split-set_id-pair_id-sentence_id" and a statement is
the identifier with the pair_id (third part) blanked.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xmodal.core.batches import Nlvr2Batch, VqaBatch
from xmodal.models.lxmert.finetune import LxmertForNlvr2, LxmertForQuestionAnswering
from xmodal.models.lxmert.model import LxmertEncoder
from xmodal.objectives import loss_precision

Task = Literal["vqa", "gqa", "nlvr2"]
TASKS: tuple[str, ...] = ("vqa", "gqa", "nlvr2")
METRIC: dict[str, str] = {"vqa": "vqa_score", "gqa": "accuracy", "nlvr2": "accuracy"}


def finetune_metrics(task: str) -> list[str]:
    """The validation metrics a fine-tuning task logs (VQA accuracy is the soft score of the answer)."""
    return ["valid/accuracy", "valid/loss"] + (["valid/consistency"] if task == "nlvr2" else [])


# -- metrics (pure) ----------------------------------------------------------------------------


def predicted_soft_scores(logits: Tensor, targets: Tensor) -> Tensor:
    """(B, A) logits and (B, A) soft scores -> (B,) the score of each row's predicted answer."""
    logits, targets = torch.as_tensor(logits), torch.as_tensor(targets)
    if logits.shape != targets.shape or logits.dim() != 2:
        raise ValueError(f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)}; expected both (B, A)")
    pred = logits.argmax(-1)  # (B,) first maximum on ties
    return targets.gather(1, pred[:, None]).squeeze(1).float()


def nlvr2_statement(identifier: str) -> str:
    """"dev-850-2-0" -> "dev-850--0": the statement key of the official NLVR2 evaluator."""
    parts = identifier.split("-")
    if len(parts) != 4:
        raise ValueError(f"NLVR2 identifier {identifier!r}: expected 'split-set_id-pair_id-sentence_id'")
    parts[2] = ""
    return "-".join(parts)


def nlvr2_consistency(identifiers: Sequence[str], correct: Sequence[bool]) -> float:
    """Share of statements for which every image pair is predicted right (nan when empty)."""
    if len(identifiers) != len(correct):
        raise ValueError(f"{len(identifiers)} identifiers and {len(correct)} correctness flags; expected equal")
    consistent: dict[str, bool] = {}
    for ident, ok in zip(identifiers, correct, strict=True):
        key = nlvr2_statement(ident)
        consistent[key] = consistent.get(key, True) and bool(ok)
    return sum(consistent.values()) / len(consistent) if consistent else math.nan


# -- objective (torch) -------------------------------------------------------------------------


def unused_vision_modules(encoder: LxmertEncoder) -> list[nn.Module]:
    """The vision-side sub-layers of the last cross-modality layer.

    Fine-tuning heads read only the pooled [CLS] (language side), so these never reach the
    loss (in pretraining the object heads read them). Frozen, they get no gradient that DDP
    would wait for, and no optimizer state. With a shared cross-attention, `cross_v` is
    `cross_l`, which the language side uses.
    """
    if len(encoder.x_layers) == 0:
        return []
    last = encoder.x_layers[-1]
    modules: list[nn.Module] = [last.self_v, last.ffn_v]
    if last.cross_v is not last.cross_l:
        modules.append(last.cross_v)
    return modules


class FinetuneObjective(nn.Module):
    """Model + loss as one module whose forward returns the loss dict (the train step's contract).

    The last cross-modality layer's vision-side sub-layers are frozen (`unused_vision_modules`).

    forward(batch, with_metrics=False, with_predictions=False) -> {"loss", "loss/<task>"} and, with
    metrics, "<metric>/correct" and "<metric>/count" (metric name in `METRIC`); with predictions,
    "prediction": the predicted label per row (as `predict`), from the same forward pass.
    `predict(batch)` gives the predicted label per row: the answer index (VQA, GQA) or 1 = true (NLVR2).
    """

    def __init__(self, model: LxmertForQuestionAnswering | LxmertForNlvr2, task: Task,
                 qa_loss: Literal["bce", "ce"] = "bce", scale_by_answers: bool = True):
        super().__init__()
        if task not in TASKS:
            raise ValueError(f"fine-tuning task {task!r}; expected one of {TASKS}")
        expected = LxmertForNlvr2 if task == "nlvr2" else LxmertForQuestionAnswering
        if not isinstance(model, expected):
            raise TypeError(f"task {task!r} needs a {expected.__name__}; got {type(model).__name__}")
        if qa_loss not in ("bce", "ce"):
            raise ValueError(f"qa_loss {qa_loss!r}; expected 'bce' (reference default) or 'ce'")
        self.model = model
        self.task = task
        self.qa_loss = qa_loss
        self.scale_by_answers = scale_by_answers
        for module in unused_vision_modules(model.encoder):
            module.requires_grad_(False)

    def logits(self, batch: VqaBatch | Nlvr2Batch) -> Tensor:
        """(B, A) answer logits, or NLVR2 (B, 2) / (B, 1)."""
        return self.model(batch.input_ids, batch.attention_mask, batch.visual_feats, batch.boxes,
                          batch.visual_mask)

    def _nlvr2_pred(self, logits: Tensor) -> Tensor:
        if logits.shape[-1] == 1:  # sigmoid head: true when p > 0.5
            return (logits[:, 0] > 0).long()
        return logits.argmax(-1)

    def forward(self, batch: VqaBatch | Nlvr2Batch, with_metrics: bool = False,
                with_predictions: bool = False) -> dict[str, Tensor]:
        logits = loss_precision(self.logits(batch))  # losses in fp32 under autocast
        res: dict[str, Tensor] = {}
        if self.task == "nlvr2":
            labels = batch.labels
            if logits.shape[-1] == 1:
                loss = F.binary_cross_entropy_with_logits(logits[:, 0], labels.to(logits.dtype))
            else:
                loss = F.cross_entropy(logits, labels)
            if with_metrics:
                res["accuracy/correct"] = (self._nlvr2_pred(logits.detach()) == labels).sum()
                res["accuracy/count"] = labels.new_tensor(labels.numel())
        else:
            targets = loss_precision(batch.targets)  # (B, A)
            num_answers = logits.shape[-1]
            if self.qa_loss == "bce":
                loss = F.binary_cross_entropy_with_logits(logits, targets)
            else:
                known = (targets.amax(-1) > 0).float()  # (B,); masked, not indexed: no data-dependent shape
                ce = F.cross_entropy(logits, targets.argmax(-1), reduction="none")  # (B,)
                loss = (ce * known).sum() / known.sum().clamp(min=1.0)
            if self.scale_by_answers:
                loss = loss * num_answers
            if with_metrics:
                scores = predicted_soft_scores(logits.detach(), targets)  # (B,)
                name = METRIC[self.task]
                res[f"{name}/correct"] = scores.sum() if self.task == "vqa" else (scores > 0).sum()
                res[f"{name}/count"] = batch.index.new_tensor(scores.numel())
        if with_predictions:
            res["prediction"] = self._predictions(logits.detach())
        res[f"loss/{self.task}"] = loss
        res["loss"] = loss
        return res

    def _predictions(self, logits: Tensor) -> Tensor:
        return self._nlvr2_pred(logits) if self.task == "nlvr2" else logits.argmax(-1)

    @torch.no_grad()
    def predict(self, batch: VqaBatch | Nlvr2Batch) -> Tensor:
        """(B,) long: the predicted answer index (VQA, GQA) or NLVR2 label (1 = true)."""
        return self._predictions(self.logits(batch).float())
