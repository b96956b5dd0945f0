"""MulT metrics against values worked out by hand, and the objective's losses."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from xmodal.core.batches import MultBatch
from xmodal.models.mult.config import preset
from xmodal.models.mult.model import Mult
from xmodal.objectives.sentiment import (
    MULT_METRICS,
    MultObjective,
    compute_metrics,
    emotion_metrics,
    mult_valid_metrics,
    sentiment_metrics,
    weighted_f1,
)

# Ties at zero (truths 0 at 1 and 7, prediction 0.0 at 2), clipping beyond +-3 (3.7, -3.2),
# and numpy's half-to-even rounding (1.5 -> 2, -2.5 -> -2, 2.5 -> 2).
PREDS = np.array([2.6, -0.4, 0.0, 3.7, -3.2, 1.5, 0.3, 0.49])
TRUTHS = np.array([3.0, 0.0, -0.6, 2.5, -3.0, 2.0, -1.6, 0.0])


def test_sentiment_metrics_by_hand():
    m = sentiment_metrics(PREDS, TRUTHS)
    # |p - t| = .4 .4 .6 1.2 .2 .5 1.9 .49
    assert m["mae"] == pytest.approx(5.69 / 8)
    # round(clip(., -3, 3)): p 3 0 0 3 -3 2 0 0 ; t 3 0 -1 2 -3 2 -2 0  -> 5 of 8
    assert m["acc7"] == pytest.approx(5 / 8)
    # round(clip(., -2, 2)): p 2 0 0 2 -2 2 0 0 ; t 2 0 -1 2 -2 2 -2 0  -> 6 of 8
    assert m["acc5"] == pytest.approx(6 / 8)
    # non-zero truths (0, 2, 3, 4, 5, 6): pred>0 1 0 1 0 1 1 vs true>0 1 0 1 0 1 0
    assert m["acc2"] == pytest.approx(5 / 6)
    # class 1: tp 3 fp 1 fn 0 -> 6/7 ; class 0: tp 2 fp 0 fn 1 -> 4/5 ; supports 3 / 3
    assert m["f1"] == pytest.approx((3 * 6 / 7 + 3 * 4 / 5) / 6)
    # has-zero: pred>=0 1 0 1 1 0 1 1 1 vs true>=0 1 1 0 1 0 1 0 1
    assert m["acc2_has0"] == pytest.approx(5 / 8)
    # class 1: tp 4 fp 2 fn 1 -> 8/11, support 5 ; class 0: tp 1 fp 1 fn 2 -> 2/5, support 3
    assert m["f1_has0"] == pytest.approx((5 * 8 / 11 + 3 * 2 / 5) / 8)
    assert m["corr"] == pytest.approx(np.corrcoef(PREDS, TRUTHS)[0, 1])
    # Column vectors as the model emits them give the same numbers.
    assert sentiment_metrics(PREDS[:, None], TRUTHS[:, None, None]) == m


def test_sentiment_metrics_edge_cases():
    m = sentiment_metrics(np.zeros(4), np.array([1.0, -1.0, 2.0, 0.0]))
    assert np.isnan(m["corr"])  # a constant prediction has no correlation
    assert m["acc2"] == pytest.approx(1 / 3)  # 0 counts as negative under pred > 0: right on -1 only
    assert m["acc2_has0"] == pytest.approx(3 / 4)  # and as non-negative under pred >= 0: wrong on -1 only
    all_zero = sentiment_metrics(np.array([0.5, -0.5]), np.zeros(2))
    assert np.isnan(all_zero["acc2"]) and np.isnan(all_zero["f1"])
    with pytest.raises(ValueError, match="2 predictions and 3 truths"):
        sentiment_metrics(np.zeros(2), np.zeros(3))
    with pytest.raises(ValueError, match="one score per sample"):
        sentiment_metrics(np.zeros((2, 2)), np.zeros(4))


def test_weighted_f1_cases_and_sklearn():
    assert weighted_f1([1, 1, 1], [1, 1, 1]) == 1.0
    assert weighted_f1([1, 1, 1], [0, 0, 0]) == 0.0  # class 0 has no support, class 1 F1 = 0
    # true 0 0 1 1, pred 0 1 1 1: class 0 tp 1 fn 1 -> 2/3 ; class 1 tp 2 fp 1 -> 4/5
    assert weighted_f1([0, 0, 1, 1], [0, 1, 1, 1]) == pytest.approx((2 / 3 + 4 / 5) / 2)
    assert weighted_f1([], []) == 0.0
    sk = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(0)
    for classes in (2, 3, 5):
        t, p = rng.integers(0, classes, 200), rng.integers(0, classes, 200)
        assert weighted_f1(t, p) == pytest.approx(sk.f1_score(t, p, average="weighted"))
    b = rng.normal(size=300)
    c = b + rng.normal(size=300)
    m = sentiment_metrics(b, c)
    nz = c != 0
    assert m["f1"] == pytest.approx(sk.f1_score(c[nz] > 0, b[nz] > 0, average="weighted"))
    assert m["f1_has0"] == pytest.approx(sk.f1_score(c >= 0, b >= 0, average="weighted"))


# Unbalanced where the two F1 protocols differ. Non-zero truths (the sample with truth 0 is left out):
# true > 0   1 1 1 1 1 0
# pred > 0   1 1 1 0 0 0
# class 1: tp 3, 5 true, 3 predicted -> F1 6/8 ; class 0: tp 1, 1 true, 3 predicted -> F1 2/4
F1_PREDS = np.array([1.5, 0.2, 2.0, -0.3, -1.0, -2.0, 1.0])
F1_TRUTHS = np.array([2.0, 1.0, 0.5, 3.0, 1.2, -1.0, 0.0])


def test_f1_protocols_weight_by_true_or_predicted_support():
    sk = sentiment_metrics(F1_PREDS, F1_TRUTHS, "sklearn")
    ref = sentiment_metrics(F1_PREDS, F1_TRUTHS, "reference")
    assert sk["f1"] == pytest.approx((5 * 6 / 8 + 1 * 2 / 4) / 6)  # true supports 5 / 1: 17/24
    assert ref["f1"] == pytest.approx((3 * 6 / 8 + 3 * 2 / 4) / 6)  # predicted supports 3 / 3: 15/24
    # The default is sklearn's order, as before; only `f1` depends on the protocol.
    assert sentiment_metrics(F1_PREDS, F1_TRUTHS) == sk
    assert {k: v for k, v in ref.items() if k != "f1"} == {k: v for k, v in sk.items() if k != "f1"}
    assert compute_metrics("sentiment", F1_PREDS[:, None], F1_TRUTHS, "reference") == ref
    # The hand example above: true supports 3 / 3, predicted 4 / 2.
    assert sentiment_metrics(PREDS, TRUTHS, "reference")["f1"] == pytest.approx((4 * 6 / 7 + 2 * 4 / 5) / 6)
    with pytest.raises(ValueError, match="f1_protocol = 'macro'; expected one of 'sklearn', 'reference'"):
        sentiment_metrics(F1_PREDS, F1_TRUTHS, "macro")
    with pytest.raises(ValueError, match="f1_protocol = 'macro'"):
        compute_metrics("emotions", np.zeros((2, 8)), np.zeros((2, 4)), "macro")


def test_f1_protocols_against_sklearn():
    """"reference" is the MulT reference's call, f1_score(preds > 0, truths > 0); "sklearn" the documented order."""
    sk = pytest.importorskip("sklearn.metrics")
    rng = np.random.default_rng(1)
    t = rng.normal(0.8, 1.0, 400).round(1)  # unbalanced, with exact zeros to leave out
    p = t + rng.normal(0.0, 1.5, 400)
    nz = t != 0
    assert sentiment_metrics(p, t, "reference")["f1"] == pytest.approx(
        sk.f1_score(p[nz] > 0, t[nz] > 0, average="weighted"))
    assert sentiment_metrics(p, t, "sklearn")["f1"] == pytest.approx(
        sk.f1_score(t[nz] > 0, p[nz] > 0, average="weighted"))
    assert sentiment_metrics(p, t, "reference")["f1"] != pytest.approx(sentiment_metrics(p, t, "sklearn")["f1"])


def test_the_metric_table_names_what_compute_metrics_returns():
    assert tuple(compute_metrics("sentiment", PREDS[:, None], TRUTHS)) == MULT_METRICS["sentiment"]
    emotions = compute_metrics("emotions", np.zeros((2, 8)), np.zeros((2, 4), dtype=int))
    assert tuple(emotions) == MULT_METRICS["emotions"]
    assert mult_valid_metrics("sentiment")[-1] == "valid/loss" and "valid/mae" in mult_valid_metrics("sentiment")


def test_emotion_metrics_by_hand():
    labels = np.array([[0, 1, 0, 1], [1, 1, 0, 0], [0, 0, 1, 0], [0, 1, 1, 1]])
    pred = np.array([[0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 1, 0], [1, 1, 0, 1]])
    logits = np.stack([1 - pred, pred], -1) * 2.0 - 1.0  # (4, 4, 2): argmax = pred
    m = emotion_metrics(logits.reshape(4, 8), labels)
    # neutral: t 0 1 0 0, p 0 1 0 1 -> acc 3/4; class 0: tp 2 fn 1 -> 4/5 (sup 3); class 1: tp 1 fp 1 -> 2/3 (sup 1)
    assert m["neutral_acc"] == pytest.approx(3 / 4)
    assert m["neutral_f1"] == pytest.approx((3 * 4 / 5 + 1 * 2 / 3) / 4)
    assert m["sad_acc"] == pytest.approx(3 / 4)
    assert m["angry_acc"] == pytest.approx(3 / 4)
    assert m["happy_acc"] == pytest.approx(3 / 4)
    assert m["mean_acc"] == pytest.approx(3 / 4)
    # One-hot labels (the reference pickles' form) give the same.
    onehot = np.eye(2)[labels]
    assert emotion_metrics(logits, onehot) == m
    assert compute_metrics("emotions", logits.reshape(4, 8), labels) == m
    # The reference's eval_iemocap calls f1_score(truth, preds): both protocols are sklearn's order here.
    assert compute_metrics("emotions", logits.reshape(4, 8), labels, "reference") == m


def test_objective_losses():
    torch.manual_seed(0)
    batch = MultBatch.random(4, dims=(12, 6, 5), seq_lens=(6, 9, 7), variable_lengths=True).to(
        "cpu", float_dtype=torch.float32)
    model = Mult(preset("tiny"))
    obj = MultObjective(model)
    out = obj(batch, with_metrics=True)
    pred = model(batch.text, batch.audio, batch.vision, lengths=batch.lengths()).output
    torch.testing.assert_close(out["loss"], F.l1_loss(pred, batch.labels))
    assert out["loss/l1"] is out["loss"]
    assert out["outputs"].shape == (4, 1) and int(out["acc2/count"]) == 4
    assert batch.labels.dtype == torch.float32  # labels are not cast with the features
    assert batch.to("cpu", float_dtype=torch.bfloat16).labels.dtype == torch.float32

    emo = MultBatch.random(3, dims=(12, 6, 5), seq_lens=(6, 9, 7), num_emotions=4).to("cpu", torch.float32)
    model8 = Mult(preset("tiny").replace(output_dim=8))
    res = MultObjective(model8, task="emotions")(emo, with_metrics=True)
    logits = model8(emo.text, emo.audio, emo.vision, lengths=emo.lengths()).output
    torch.testing.assert_close(res["loss"], F.cross_entropy(logits.view(-1, 2), emo.labels.view(-1)))
    assert int(res["acc/count"]) == 12
    with pytest.raises(ValueError, match="output_dim = 1 for task 'emotions'; expected 8"):
        MultObjective(model, task="emotions")
