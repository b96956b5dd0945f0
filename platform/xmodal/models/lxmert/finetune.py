"""LXMERT fine-tuning models (paper §4, Appendix B). Imports only torch.

- `LxmertForQuestionAnswering`: encoder + answer classifier over the task's answer table
  (VQA: 3,129 answers, GQA: 1,842). The classifier is the pretraining QA head's shape
  (`AnswerHead`: Linear(D, 2D), GeLU, LayerNorm, Linear(2D, A)), as in the reference, so it can
  start from the pretrained QA head (`xmodal.models.lxmert.init.init_answer_head_from_qa`).
- `LxmertForNlvr2`: encoder + the Appendix B classifier on [LXMERT(img0, s); LXMERT(img1, s)].

The encoder attribute is `encoder`, so the encoder's state-dict keys (`encoder.*`) are the same
as in `LxmertForPretraining` and a pretraining checkpoint loads by name.

Shapes: B batch, T words, N objects, D hidden, F visual feature dim, A answers.
"""

from __future__ import annotations

from typing import Literal

import torch.nn.functional as F
from torch import Tensor, nn

from xmodal.models.lxmert.model import AnswerHead, LxmertConfig, LxmertEncoder, LxmertForPretraining

Nlvr2Output = Literal["softmax", "sigmoid"]


class LxmertForQuestionAnswering(nn.Module):
    """VQA / GQA: logits over the answer table from the pooled cross-modality output."""

    # The same BERT initialisation as pretraining (N(0, 0.02), zero biases, unit LayerNorm).
    _init_weights = LxmertForPretraining._init_weights

    def __init__(self, config: LxmertConfig, num_answers: int):
        super().__init__()
        if num_answers < 1:
            raise ValueError(f"num_answers = {num_answers}; expected the size of the answer table (>= 1)")
        self.config = config
        self.num_answers = num_answers
        self.encoder = LxmertEncoder(config)
        self.answer_head = AnswerHead(config, num_answers)
        self.apply(self._init_weights)

    def forward(
        self,
        input_ids: Tensor,  # (B, T) long
        attention_mask: Tensor | None,  # (B, T) bool, True = real token
        visual_feats: Tensor,  # (B, N, F)
        boxes: Tensor,  # (B, N, 4)
        visual_mask: Tensor | None = None,  # (B, N) bool, True = real object
    ) -> Tensor:
        pooled = self.encoder(input_ids, attention_mask, visual_feats, boxes, visual_mask).pooled  # (B, D)
        return self.answer_head(pooled)  # (B, A)


class PairClassifier(nn.Module):
    """Appendix B: z0 = W0 [x0; x1] + b0, z1 = LayerNorm(GeLU(z0)), logits = W1 z1 + b1.

    `output="softmax"`: two logits for a 2-way cross-entropy, as the reference code
    (`nlvr2_model.py`: Linear(2D, 2D), GeLU, LayerNorm, Linear(2D, 2)).
    `output="sigmoid"`: one logit for the paper's sigmoid + binary cross-entropy. The two are
    the same family of functions (softmax over [a, b] = sigmoid(b - a)); only the
    parametrisation and thus the initial scale differ.
    """

    def __init__(self, c: LxmertConfig, output: Nlvr2Output = "sigmoid"):
        super().__init__()
        if output not in ("softmax", "sigmoid"):
            raise ValueError(f"NLVR2 output = {output!r}; expected 'softmax' (reference) or 'sigmoid' (paper)")
        d2 = 2 * c.hidden_size
        self.fc1 = nn.Linear(d2, d2)
        self.norm = nn.LayerNorm(d2, eps=c.layer_norm_eps)
        self.fc2 = nn.Linear(d2, 2 if output == "softmax" else 1)

    def forward(self, pair: Tensor) -> Tensor:  # (B, 2D) -> (B, 2) or (B, 1)
        return self.fc2(self.norm(F.gelu(self.fc1(pair))))


class LxmertForNlvr2(nn.Module):
    """NLVR2 (Appendix B): one statement, two images; classifier on the two cross-modality outputs.

    Both (img0, s) and (img1, s) go through ONE encoder call: the pair is stacked along the
    batch dimension as [ex0-img0, ex0-img1, ex1-img0, ...] with the statement repeated, so
    the pooled outputs reshape to (B, 2D) = [x0; x1] per example (the reference's layout).
    """

    _init_weights = LxmertForPretraining._init_weights

    def __init__(self, config: LxmertConfig, output: Nlvr2Output = "sigmoid"):
        super().__init__()
        self.config = config
        self.output = output
        self.encoder = LxmertEncoder(config)
        self.classifier = PairClassifier(config, output)
        self.apply(self._init_weights)

    def forward(
        self,
        input_ids: Tensor,  # (B, T) long statement
        attention_mask: Tensor | None,  # (B, T) bool
        visual_feats: Tensor,  # (B, 2, N, F) img0, img1
        boxes: Tensor,  # (B, 2, N, 4)
        visual_mask: Tensor | None = None,  # (B, 2, N) bool
    ) -> Tensor:
        b, pair = visual_feats.shape[:2]
        if pair != 2:
            raise ValueError(f"NLVR2 visual_feats has shape {tuple(visual_feats.shape)}; expected (B, 2, N, F)")
        ids = input_ids.repeat_interleave(2, dim=0)  # (2B, T): each statement twice, next to its images
        am = attention_mask.repeat_interleave(2, dim=0) if attention_mask is not None else None
        feats = visual_feats.flatten(0, 1)  # (2B, N, F)
        bx = boxes.flatten(0, 1)  # (2B, N, 4)
        vm = visual_mask.flatten(0, 1) if visual_mask is not None else None  # (2B, N)
        pooled = self.encoder(ids, am, feats, bx, vm).pooled  # (2B, D)
        return self.classifier(pooled.reshape(b, -1))  # (B, 2D) -> (B, 2) or (B, 1)
