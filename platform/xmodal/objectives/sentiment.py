"""MulT objectives and metrics: sentiment regression (CMU-MOSI / MOSEI) and IEMOCAP emotions.
Imports only torch and numpy.

Losses (reference code): L1 on the sentiment score; for IEMOCAP a cross-entropy over
2 logits for each of the 4 emotions (the model's 8 outputs read as 4 x 2).

Metrics are computed on FULL prediction arrays (numpy, after gathering from all
workers), exactly as docs/papers.md#mult-sentiment-metrics states them:

Sentiment, scores in [-3, 3]
  mae        mean |pred - true|
  corr       Pearson correlation (nan when either side is constant)
  acc7       accuracy of round(clip(x, -3, 3)) on both sides (7 classes)
  acc5       the same with clip to [-2, 2] (5 classes)
  acc2, f1   non-zero protocol (the paper's): samples with true != 0 only;
             pred > 0 vs true > 0; f1 is the support-weighted F1 (weights: see f1_protocol)
  acc2_has0, f1_has0
             has-zero protocol (MMSA's): all samples; pred >= 0 vs true >= 0
Rounding is numpy's (half to even), as the reference's `np.round`: 2.5 -> 2, -0.5 -> 0.

f1_protocol (`MultTrainConfig.f1_protocol`) says whose support weights the non-zero `f1`:
  "sklearn"    (default) the TRUE classes' support, sklearn's documented order
               f1_score(y_true, y_pred), as MMSA computes it;
  "reference"  the PREDICTED classes' support: the MulT reference's src/eval_metrics.py:
               eval_mosei_senti calls f1_score(preds > 0, truths > 0), arguments swapped. The F1
               numbers published from that code (MulT Tables 1-2) are this one.
Per-class F1 is symmetric in its two arguments, so only the weights differ. `f1_has0` (MMSA's
metric) and the IEMOCAP F1s (the reference's eval_iemocap calls f1_score(truth, preds)) use the
true support under both protocols.

IEMOCAP: per emotion (Neutral, Happy, Sad, Angry) binary accuracy and weighted F1 of the
argmax over its 2 logits: "<emotion>_acc", "<emotion>_f1", plus their means.
"""

from __future__ import annotations

import typing
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from xmodal.core.batches import MultBatch
from xmodal.models.mult.model import Mult
from xmodal.objectives import loss_precision

EMOTIONS: tuple[str, ...] = ("neutral", "happy", "sad", "angry")
Task = Literal["sentiment", "emotions"]
F1Protocol = Literal["sklearn", "reference"]
F1_PROTOCOLS: tuple[str, ...] = typing.get_args(F1Protocol)


# the store's task -> the metrics `compute_metrics` returns for it (config checks train.best_metric against them)
MULT_METRICS: dict[str, tuple[str, ...]] = {
    "sentiment": ("mae", "corr", "acc7", "acc5", "acc2", "f1", "acc2_has0", "f1_has0"),
    "emotions": tuple(f"{e}_{m}" for e in EMOTIONS for m in ("acc", "f1"))
    + ("mean_acc", "mean_f1"),
}


def mult_valid_metrics(*tasks: str) -> list[str]:
    """The `valid/*` metrics MulT logs on stores of these tasks."""
    return [f"valid/{m}" for t in tasks for m in MULT_METRICS[t]] + ["valid/loss"]


# -- metrics (numpy) ---------------------------------------------------------------------------


def weighted_f1(y_true: np.ndarray, y_pred: np.ndarray) -> float:
    """Support-weighted mean of the per-class F1 over the classes present in y_true or y_pred
    (sklearn's f1_score(y_true, y_pred, average="weighted"); 0.0 for empty input)."""
    y_true, y_pred = np.asarray(y_true).ravel(), np.asarray(y_pred).ravel()
    if y_true.shape != y_pred.shape:
        raise ValueError(f"weighted_f1: y_true has {y_true.size} entries, y_pred {y_pred.size}; expected equal")
    if y_true.size == 0:
        return 0.0
    total, score = 0, 0.0
    for c in np.union1d(y_true, y_pred):
        t, p = y_true == c, y_pred == c
        tp = np.count_nonzero(t & p)
        denom = np.count_nonzero(t) + np.count_nonzero(p)  # 2tp + fp + fn
        f1 = 2.0 * tp / denom if denom else 0.0
        support = np.count_nonzero(t)
        score += f1 * support
        total += support
    return float(score / total) if total else 0.0


def pearson(x: np.ndarray, y: np.ndarray) -> float:
    x, y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    xc, yc = x - x.mean(), y - y.mean()
    denom = np.sqrt((xc * xc).sum() * (yc * yc).sum())
    return float((xc * yc).sum() / denom) if denom > 0 else float("nan")


def _as_1d(name: str, a) -> np.ndarray:
    a = np.asarray(a, dtype=np.float64)
    if a.ndim > 1 and a.size != a.shape[0]:
        raise ValueError(f"sentiment_metrics: {name} has shape {a.shape}; expected one score per sample")
    return a.reshape(-1)


def sentiment_metrics(preds, truths, f1_protocol: F1Protocol = "sklearn") -> dict[str, float]:
    """MOSI / MOSEI metrics on full arrays of predicted and true scores (any shape with one value a sample);
    f1_protocol weights the non-zero `f1` by true ("sklearn") or predicted ("reference") support."""
    _check_protocol(f1_protocol)
    p, t = _as_1d("preds", preds), _as_1d("truths", truths)
    if p.shape != t.shape or p.size == 0:
        raise ValueError(f"sentiment_metrics: {p.size} predictions and {t.size} truths; expected the same, > 0")
    nz = t != 0
    # weighted_f1 weights by its first argument's support: the reference passes the predictions first.
    f1_by = (t[nz] > 0, p[nz] > 0) if f1_protocol == "sklearn" else (p[nz] > 0, t[nz] > 0)
    out = {
        "mae": float(np.mean(np.abs(p - t))),
        "corr": pearson(p, t),
        "acc7": float(np.mean(np.round(np.clip(p, -3, 3)) == np.round(np.clip(t, -3, 3)))),
        "acc5": float(np.mean(np.round(np.clip(p, -2, 2)) == np.round(np.clip(t, -2, 2)))),
        "acc2": float(np.mean((p[nz] > 0) == (t[nz] > 0))) if nz.any() else float("nan"),
        "f1": weighted_f1(*f1_by) if nz.any() else float("nan"),
        "acc2_has0": float(np.mean((p >= 0) == (t >= 0))),
        "f1_has0": weighted_f1(t >= 0, p >= 0),
    }
    return out


def emotion_metrics(logits, labels, emotions: tuple[str, ...] = EMOTIONS) -> dict[str, float]:
    """IEMOCAP: logits (N, E*2) or (N, E, 2); labels (N, E) class 0/1 per emotion (or one-hot (N, E, 2))."""
    n, e = np.shape(labels)[0], len(emotions)
    lg = np.asarray(logits, dtype=np.float64).reshape(n, e, 2)
    y = np.asarray(labels)
    if y.ndim == 3:  # the reference pickles' one-hot form
        y = y.argmax(-1)
    y = y.reshape(n, e)
    pred = lg.argmax(-1)  # (N, E)
    out: dict[str, float] = {}
    for i, name in enumerate(emotions):
        out[f"{name}_acc"] = float(np.mean(pred[:, i] == y[:, i]))
        out[f"{name}_f1"] = weighted_f1(y[:, i], pred[:, i])
    out["mean_acc"] = float(np.mean([out[f"{m}_acc"] for m in emotions]))
    out["mean_f1"] = float(np.mean([out[f"{m}_f1"] for m in emotions]))
    return out


def _check_protocol(f1_protocol: str) -> None:
    if f1_protocol not in F1_PROTOCOLS:
        raise ValueError(f"f1_protocol = {f1_protocol!r}; expected one of {', '.join(map(repr, F1_PROTOCOLS))}")


def compute_metrics(task: Task, outputs, labels, f1_protocol: F1Protocol = "sklearn") -> dict[str, float]:
    """The task's metrics from gathered model outputs (N, output_dim) and labels. f1_protocol changes
    only the sentiment `f1`: the reference weights the IEMOCAP F1s as sklearn does."""
    _check_protocol(f1_protocol)
    if task == "sentiment":
        return sentiment_metrics(outputs, labels, f1_protocol)
    if task == "emotions":
        return emotion_metrics(outputs, labels)
    raise ValueError(f"unknown task {task!r}; expected 'sentiment' or 'emotions'")


# -- objective (torch) -------------------------------------------------------------------------


class MultObjective(torch.nn.Module):
    """Model + loss as one module whose forward returns the loss dict (the train step's contract).

    task: "sentiment" (regression, output_dim 1, loss `regression_loss`) or "emotions"
    (IEMOCAP, output_dim 2 * len(EMOTIONS), cross-entropy per emotion, averaged).
    use_lengths: False treats every step as real (fixed-length inputs such as the
    reference pickles or the benchmark), which keeps the causal masks in their fused form.

    forward(batch, with_metrics=False) -> {"loss", "loss/<name>"} and, with metrics,
    "outputs" (B, output_dim) float32 and "labels" to gather for `compute_metrics`,
    plus summable "acc2/correct" & "acc2/count" (sentiment, non-zero protocol) or
    "acc/correct" & "acc/count" (emotions, over all emotion decisions).
    """

    def __init__(self, model: Mult, task: Task = "sentiment",
                 regression_loss: Literal["l1", "l2", "smooth_l1"] = "l1", use_lengths: bool = True):
        super().__init__()
        expected = 1 if task == "sentiment" else 2 * len(EMOTIONS)
        if task not in ("sentiment", "emotions"):
            raise ValueError(f"MultObjective task = {task!r}; expected 'sentiment' or 'emotions'")
        if model.config.output_dim != expected:
            raise ValueError(f"MultConfig.output_dim = {model.config.output_dim} for task {task!r}; expected {expected}")
        self.model = model
        self.task = task
        self.regression_loss = regression_loss
        self.use_lengths = use_lengths

    def forward(self, batch: MultBatch, with_metrics: bool = False) -> dict[str, Tensor]:
        lengths = batch.lengths() if self.use_lengths else None
        out = loss_precision(self.model(batch.text, batch.audio, batch.vision, lengths=lengths).output)  # (B, O)
        res: dict[str, Tensor] = {}
        if self.task == "sentiment":
            y = batch.labels.to(out.dtype).reshape(out.shape)
            name = self.regression_loss
            if name == "l1":
                loss = F.l1_loss(out, y)
            elif name == "l2":
                loss = F.mse_loss(out, y)
            else:
                loss = F.smooth_l1_loss(out, y)
            res[f"loss/{name}"] = loss
            if with_metrics:
                nz = y != 0
                res["acc2/correct"] = (((out > 0) == (y > 0)) & nz).sum()
                res["acc2/count"] = nz.sum()
        else:
            logits = out.view(-1, 2)  # (B * 4, 2)
            y = batch.labels.long().reshape(-1)  # (B * 4,)
            loss = F.cross_entropy(logits, y)
            res["loss/ce"] = loss
            if with_metrics:
                res["acc/correct"] = (logits.argmax(-1) == y).sum()
                res["acc/count"] = y.new_tensor(y.numel())
        res["loss"] = loss
        if with_metrics:
            res["outputs"] = out.detach()
            res["labels"] = batch.labels.detach()
        return res
