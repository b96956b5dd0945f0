"""LXMERT fine-tuning losses, metrics and prediction files against hand-computed values (tiny preset)."""

from __future__ import annotations

import csv
import json
import math

import numpy as np
import pytest
import torch

from xmodal.core.batches import Nlvr2Batch, VqaBatch
from xmodal.jobs.predictions import write_gqa_predictions, write_nlvr2_predictions, write_vqa_predictions
from xmodal.models.lxmert.finetune import LxmertForNlvr2, LxmertForQuestionAnswering
from xmodal.models.lxmert.model import preset
from xmodal.objectives.finetune import (
    FinetuneObjective,
    nlvr2_consistency,
    nlvr2_statement,
    predicted_soft_scores,
)

CFG = preset("tiny")
T, N = 8, 4


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def vqa_batch(targets, seed=0) -> VqaBatch:
    g = torch.Generator().manual_seed(seed)
    b = targets.shape[0]
    return VqaBatch(
        input_ids=torch.randint(5, CFG.vocab_size, (b, T), generator=g),
        attention_mask=torch.ones(b, T, dtype=torch.bool),
        visual_feats=torch.randn(b, N, CFG.visual_feat_dim, generator=g),
        boxes=torch.rand(b, N, 4, generator=g),
        visual_mask=torch.ones(b, N, dtype=torch.bool),
        targets=torch.as_tensor(targets, dtype=torch.float32),
        index=torch.arange(b),
    )


def nlvr2_batch(labels, seed=0) -> Nlvr2Batch:
    g = torch.Generator().manual_seed(seed)
    b = len(labels)
    return Nlvr2Batch(
        input_ids=torch.randint(5, CFG.vocab_size, (b, T), generator=g),
        attention_mask=torch.ones(b, T, dtype=torch.bool),
        visual_feats=torch.randn(b, 2, N, CFG.visual_feat_dim, generator=g),
        boxes=torch.rand(b, 2, N, 4, generator=g),
        visual_mask=torch.ones(b, 2, N, dtype=torch.bool),
        labels=torch.as_tensor(labels, dtype=torch.long),
        index=torch.arange(b),
    )


class FixedQA(LxmertForQuestionAnswering):
    """Returns given logits: the loss and metric arithmetic checked by hand."""

    def __init__(self, logits):
        super().__init__(CFG, len(logits[0]))
        self.fixed = torch.tensor(logits)

    def forward(self, *args):
        return self.fixed


class FixedNlvr2(LxmertForNlvr2):
    def __init__(self, logits):
        super().__init__(CFG, "softmax" if len(logits[0]) == 2 else "sigmoid")
        self.fixed = torch.tensor(logits)

    def forward(self, *args):
        return self.fixed


def bce(x: float, y: float) -> float:
    return -(y * math.log(1 / (1 + math.exp(-x))) + (1 - y) * math.log(1 - 1 / (1 + math.exp(-x))))


def ce(row: list[float], k: int) -> float:
    return -(row[k] - math.log(sum(math.exp(v) for v in row)))


# Row 0 predicts answer 1 (score 0.6); row 1 ties answers 0 and 1 and takes the first (0.3);
# row 2 predicts answer 3 and has no known answer (0).
LOGITS = [[0.1, 2.0, 0.5, 0.5], [3.0, 3.0, 0.0, 0.0], [-1.0, -2.0, -3.0, 5.0]]
SOFT = [[0.0, 0.6, 1.0, 0.0], [0.3, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]


# -- pure metrics ------------------------------------------------------------------------------


def test_soft_scores_of_the_predicted_answers_with_ties():
    assert predicted_soft_scores(torch.tensor(LOGITS), torch.tensor(SOFT)).tolist() == pytest.approx([0.6, 0.3, 0.0])
    with pytest.raises(ValueError, match="expected both"):
        predicted_soft_scores(torch.zeros(2, 4), torch.zeros(2, 3))


def test_nlvr2_statement_blanks_the_pair_id_as_the_official_evaluator():
    assert nlvr2_statement("dev-850-2-0") == "dev-850--0"
    with pytest.raises(ValueError, match="split-set_id-pair_id-sentence_id"):
        nlvr2_statement("dev-850-2")


def test_nlvr2_consistency_over_grouped_statements():
    ids = ["dev-1-0-0", "dev-1-1-0", "dev-1-2-0",  # statement dev-1--0: three image pairs, all right
           "dev-1-0-1", "dev-1-3-1",  # statement dev-1--1: one wrong pair
           "dev-2-0-0"]  # statement dev-2--0: one pair, right
    correct = [True, True, True, True, False, True]
    assert nlvr2_consistency(ids, correct) == pytest.approx(2 / 3)
    # Same image pair, different sentences: two statements.
    assert nlvr2_consistency(["dev-850-0-0", "dev-850-0-1"], [True, False]) == 0.5
    assert math.isnan(nlvr2_consistency([], []))
    with pytest.raises(ValueError, match="2 identifiers and 1"):
        nlvr2_consistency(["dev-1-0-0", "dev-1-1-0"], [True])


# -- objective: hand-computed losses and metrics ------------------------------------------------


@pytest.mark.parametrize("scale", [True, False])
def test_vqa_bce_loss_and_soft_score(scale):
    obj = FinetuneObjective(FixedQA(LOGITS), "vqa", scale_by_answers=scale)
    out = obj(vqa_batch(torch.tensor(SOFT)), with_metrics=True)
    total = sum(bce(x, y) for row, trow in zip(LOGITS, SOFT, strict=True) for x, y in zip(row, trow, strict=True))
    expected = total / 3 if scale else total / 12  # reference: mean over B*A entries times A
    assert float(out["loss"]) == pytest.approx(expected, rel=1e-5)
    assert float(out["loss/vqa"]) == float(out["loss"])
    assert float(out["vqa_score/correct"]) == pytest.approx(0.9)
    assert int(out["vqa_score/count"]) == 3
    assert all(v.dim() == 0 for v in out.values())  # the evaluation loop sums float(v)
    assert obj.predict(vqa_batch(torch.tensor(SOFT))).tolist() == [1, 0, 3]


def test_gqa_exact_match_accuracy_and_ce_option():
    onehot = [[0.0, 1.0, 0.0, 0.0], [0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]]
    out = FinetuneObjective(FixedQA(LOGITS), "gqa")(vqa_batch(torch.tensor(onehot)), with_metrics=True)
    assert int(out["accuracy/correct"]) == 1 and int(out["accuracy/count"]) == 3
    assert set(out) == {"loss", "loss/gqa", "accuracy/correct", "accuracy/count"}
    # Cross-entropy on the best answer; the row without a known answer is left out.
    out = FinetuneObjective(FixedQA(LOGITS), "gqa", qa_loss="ce")(vqa_batch(torch.tensor(onehot)))
    assert float(out["loss"]) == pytest.approx((ce(LOGITS[0], 1) + ce(LOGITS[1], 1)) / 2 * 4, rel=1e-5)


def test_nlvr2_cross_entropy_and_accuracy():
    logits = [[0.2, 1.0], [2.0, -1.0], [0.5, 0.5]]  # predictions 1, 0, 0 (tie -> first = False)
    labels = [1, 1, 0]
    obj = FinetuneObjective(FixedNlvr2(logits), "nlvr2")
    out = obj(nlvr2_batch(labels), with_metrics=True)
    assert float(out["loss/nlvr2"]) == pytest.approx(sum(ce(r, y) for r, y in zip(logits, labels, strict=True)) / 3,
                                                     rel=1e-5)
    assert int(out["accuracy/correct"]) == 2 and int(out["accuracy/count"]) == 3
    assert obj.predict(nlvr2_batch(labels)).tolist() == [1, 0, 0]


def test_nlvr2_sigmoid_head_uses_binary_cross_entropy():
    logits = [[0.7], [-0.3], [0.0]]  # predictions 1, 0, 0
    labels = [1, 1, 0]
    obj = FinetuneObjective(FixedNlvr2(logits), "nlvr2")
    out = obj(nlvr2_batch(labels), with_metrics=True)
    assert float(out["loss"]) == pytest.approx(sum(bce(r[0], y) for r, y in zip(logits, labels, strict=True)) / 3,
                                               rel=1e-5)
    assert int(out["accuracy/correct"]) == 2
    assert obj.predict(nlvr2_batch(labels)).tolist() == [1, 0, 0]


def test_objective_refuses_wrong_model_or_task():
    with pytest.raises(TypeError, match="needs a LxmertForNlvr2"):
        FinetuneObjective(LxmertForQuestionAnswering(CFG, 3), "nlvr2")
    with pytest.raises(ValueError, match="fine-tuning task 'snli'"):
        FinetuneObjective(LxmertForQuestionAnswering(CFG, 3), "snli")


# -- objective: real tiny models ---------------------------------------------------------------


@pytest.mark.parametrize("task", ["vqa", "nlvr2"])
def test_every_parameter_gets_a_gradient_and_a_tiny_set_is_learnt(task):
    torch.manual_seed(0)
    if task == "vqa":
        targets = torch.zeros(4, 6)
        targets[torch.arange(4), torch.tensor([0, 2, 5, 2])] = 1.0
        targets[0, 3] = 0.3
        batch = vqa_batch(targets)
        model = LxmertForQuestionAnswering(CFG, 6)
    else:
        batch = nlvr2_batch([1, 0, 0, 1])
        model = LxmertForNlvr2(CFG)
    obj = FinetuneObjective(model, task)
    obj(batch)["loss"].backward()
    no_grad = [n for n, p in obj.named_parameters() if p.grad is None or not p.grad.any()]
    frozen = [n for n, p in obj.named_parameters() if not p.requires_grad]
    # Only the last cross layer's vision side is unused (pooled output = language [CLS]); it is frozen.
    assert no_grad == frozen and frozen
    assert all(n.startswith(("model.encoder.x_layers.0.self_v.", "model.encoder.x_layers.0.ffn_v.")) for n in frozen)
    opt = torch.optim.Adam(obj.parameters(), lr=3e-3)
    for _ in range(40):
        opt.zero_grad()
        obj(batch)["loss"].backward()
        opt.step()
    obj.eval()
    metric = "vqa_score" if task == "vqa" else "accuracy"
    out = obj(batch, with_metrics=True)
    assert float(out[f"{metric}/correct"]) == pytest.approx(4.0)


# -- prediction files --------------------------------------------------------------------------


def test_vqa_and_gqa_prediction_files(tmp_path):
    p = write_vqa_predictions(tmp_path / "out" / "vqa.json", [262148000, np.int64(7)], ["yes", "2"])
    assert json.loads(p.read_text()) == [{"answer": "yes", "question_id": 262148000},
                                         {"answer": "2", "question_id": 7}]
    p = write_gqa_predictions(tmp_path / "gqa.json", ["201307251", 5], ["no", "left"])
    assert json.loads(p.read_text()) == [{"prediction": "no", "questionId": "201307251"},
                                         {"prediction": "left", "questionId": "5"}]
    with pytest.raises(ValueError, match="2 question ids and 1 predictions"):
        write_vqa_predictions(tmp_path / "bad.json", [1, 2], ["yes"])
    assert sorted(f.name for f in tmp_path.iterdir()) == ["gqa.json", "out"]  # no temporary files left


def test_nlvr2_prediction_csv_writes_true_false(tmp_path):
    p = write_nlvr2_predictions(tmp_path / "nlvr2.csv", ["dev-850-0-0", "dev-850-1-0", "dev-3-0-1"],
                                [1, torch.tensor(0), np.bool_(True)])
    assert p.read_text() == "dev-850-0-0,True\ndev-850-1-0,False\ndev-3-0-1,True\n"
    assert list(csv.reader(p.open())) == [["dev-850-0-0", "True"], ["dev-850-1-0", "False"], ["dev-3-0-1", "True"]]
    with pytest.raises(ValueError, match="expected 0/1"):
        write_nlvr2_predictions(tmp_path / "bad.csv", ["dev-1-0-0"], [2])
    with pytest.raises(ValueError, match="expected 0/1"):
        write_nlvr2_predictions(tmp_path / "bad.csv", ["dev-1-0-0"], [0.5])
    p.write_text("old")
    write_nlvr2_predictions(p, ["dev-1-0-0"], [False])  # replaces the whole file
    assert p.read_text() == "dev-1-0-0,False\n"
    assert sorted(f.name for f in tmp_path.iterdir()) == ["nlvr2.csv"]
