"""Typed batches: dataclasses of tensors that the train step takes as they are. Imports only torch."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from torch import Tensor


class TensorBatch:
    """Mixin for dataclasses whose fields are all tensors (dim 0 = batch)."""

    def to(self, device: torch.device | str, float_dtype: torch.dtype | None = None, non_blocking: bool = False):
        """Move every field to `device`; floating fields are cast to `float_dtype` when given
        (features travel as float16 and become float32 or bf16 on the device)."""
        out = {}
        for f in dataclasses.fields(self):
            t: Tensor = getattr(self, f.name)
            t = t.to(device, non_blocking=non_blocking)
            if float_dtype is not None and t.is_floating_point():
                t = t.to(float_dtype)
            out[f.name] = t
        return type(self)(**out)

    def pin_memory(self):
        return type(self)(**{f.name: getattr(self, f.name).pin_memory() for f in dataclasses.fields(self)})

    def __len__(self) -> int:
        return getattr(self, dataclasses.fields(self)[0].name).shape[0]


@dataclass
class LxmertBatch(TensorBatch):
    """One pretraining batch, built by `xmodal.data.lxmert.masking` (15 % / 80-10-10 rules already applied)."""

    input_ids: Tensor  # (B, T) long, masked words replaced
    attention_mask: Tensor  # (B, T) bool, True = real token
    mlm_labels: Tensor  # (B, T) long, original id at masked words, -100 elsewhere
    visual_feats: Tensor  # (B, N, F) after object masking (float16 from the store)
    boxes: Tensor  # (B, N, 4) normalised x1 y1 x2 y2
    visual_mask: Tensor  # (B, N) bool, True = real object
    obj_masked: Tensor  # (B, N) bool, objects chosen for masked object prediction
    feat_targets: Tensor  # (B, N, F) original features (regression targets)
    obj_labels: Tensor  # (B, N) long detector object class, -100 = none
    obj_conf: Tensor  # (B, N) float detector confidence
    attr_labels: Tensor  # (B, N) long detector attribute class, -100 = none
    attr_conf: Tensor  # (B, N) float
    is_matched: Tensor  # (B,) long, 1 = the sentence belongs to the image
    qa_labels: Tensor  # (B,) long answer index, -100 = not a question, unknown answer, or mismatched

    @classmethod
    def random(
        cls,
        batch_size: int,
        *,
        vocab_size: int,
        visual_feat_dim: int,
        num_object_labels: int,
        num_attr_labels: int,
        num_qa_labels: int,
        seq_len: int = 20,
        num_objects: int = 36,
        mask_prob: float = 0.15,
        generator: torch.Generator | None = None,
    ) -> LxmertBatch:
        """A batch of random inputs with the pretraining masks applied at their paper rates:
        for benchmarks and tests that need shapes, not meaning."""
        g = generator
        b, t, n = batch_size, seq_len, num_objects
        lengths = torch.randint(t // 2, t + 1, (b,), generator=g)
        attention_mask = torch.arange(t)[None, :] < lengths[:, None]
        input_ids = torch.randint(5, vocab_size, (b, t), generator=g) * attention_mask
        word_masked = (torch.rand(b, t, generator=g) < mask_prob) & attention_mask
        word_masked[:, 0] = False
        mlm_labels = torch.where(word_masked, input_ids, torch.full_like(input_ids, -100))
        feats = torch.randn(b, n, visual_feat_dim, generator=g).abs().half()
        obj_masked = torch.rand(b, n, generator=g) < mask_prob
        xy = torch.rand(b, n, 2, generator=g) * 0.5
        is_matched = (torch.rand(b, generator=g) < 0.5).long()
        is_question = torch.rand(b, generator=g) < 1 / 3
        qa = torch.randint(0, num_qa_labels, (b,), generator=g)
        return cls(
            input_ids=input_ids,
            attention_mask=attention_mask,
            mlm_labels=mlm_labels,
            visual_feats=feats.masked_fill(obj_masked[..., None], 0.0),
            boxes=torch.cat([xy, xy + 0.5 * torch.rand(b, n, 2, generator=g)], -1),
            visual_mask=torch.ones(b, n, dtype=torch.bool),
            obj_masked=obj_masked,
            feat_targets=feats,
            obj_labels=torch.randint(0, num_object_labels, (b, n), generator=g),
            obj_conf=torch.rand(b, n, generator=g),
            attr_labels=torch.randint(0, num_attr_labels, (b, n), generator=g),
            attr_conf=torch.rand(b, n, generator=g),
            is_matched=is_matched,
            qa_labels=torch.where(is_question & (is_matched == 1), qa, torch.full_like(qa, -100)),
        )


@dataclass
class MultBatch(TensorBatch):
    """One MulT batch: three unaligned sequences zero-padded at the END, their true lengths, labels.

    Built by `xmodal.data.mult.store` (numpy) or `xmodal.data.mult.pipeline` (Ray Data).
    `to(device, float_dtype)` casts only the three feature tensors: labels stay float32
    (a bf16 sentiment score would be off by up to 0.008).
    """

    text: Tensor  # (B, T_l, F_l) float16 from the store
    audio: Tensor  # (B, T_a, F_a)
    vision: Tensor  # (B, T_v, F_v)
    text_lengths: Tensor  # (B,) long, true lengths, each >= 1
    audio_lengths: Tensor  # (B,) long
    vision_lengths: Tensor  # (B,) long
    labels: Tensor  # (B, 1) float32 sentiment in [-3, 3], or (B, 4) long class per emotion (IEMOCAP)
    index: Tensor  # (B,) long row of the sample in its split (joins predictions with ids)

    FEATURES = ("text", "audio", "vision")

    def to(self, device: torch.device | str, float_dtype: torch.dtype | None = None, non_blocking: bool = False):
        out = {}
        for f in dataclasses.fields(self):
            t: Tensor = getattr(self, f.name).to(device, non_blocking=non_blocking)
            if float_dtype is not None and f.name in self.FEATURES:
                t = t.to(float_dtype)
            out[f.name] = t
        return type(self)(**out)

    def lengths(self) -> tuple[Tensor, Tensor, Tensor]:
        return self.text_lengths, self.audio_lengths, self.vision_lengths

    @classmethod
    def random(
        cls,
        batch_size: int,
        *,
        dims: tuple[int, int, int] = (300, 74, 35),
        seq_lens: tuple[int, int, int] = (50, 500, 500),
        variable_lengths: bool = False,
        num_emotions: int = 0,
        generator: torch.Generator | None = None,
    ) -> MultBatch:
        """Random inputs of the given shapes (default: unaligned MOSEI), for benchmarks and tests
        that need shapes, not meaning. `variable_lengths`: true lengths drawn in [T/2, T] and the
        padding zeroed; otherwise every step is real. `num_emotions` > 0: IEMOCAP-style labels."""
        g, b = generator, batch_size
        feats, lens = [], []
        for dim, t in zip(dims, seq_lens, strict=True):
            x = torch.randn(b, t, dim, generator=g)
            if variable_lengths:
                n = torch.randint(max(1, t // 2), t + 1, (b,), generator=g)
                x = x * (torch.arange(t)[None, :] < n[:, None])[..., None]
            else:
                n = torch.full((b,), t)
            feats.append(x.half())
            lens.append(n.long())
        if num_emotions:
            labels = torch.randint(0, 2, (b, num_emotions), generator=g)
        else:
            labels = (torch.rand(b, 1, generator=g) * 6 - 3).float()
        return cls(*feats, *lens, labels=labels, index=torch.arange(b))


@dataclass
class VqaBatch(TensorBatch):
    """One VQA- or GQA-style fine-tuning batch (built by `xmodal.data.finetune.sets`)."""

    input_ids: Tensor  # (B, T) long question tokens, [CLS] first, [SEP] last, [PAD] after
    attention_mask: Tensor  # (B, T) bool, True = real token
    visual_feats: Tensor  # (B, N, F) float16 from the store
    boxes: Tensor  # (B, N, 4) normalised x1 y1 x2 y2
    visual_mask: Tensor  # (B, N) bool, True = real object
    targets: Tensor  # (B, A) float32 soft score of every answer of the table (GQA: one-hot); all 0 = none known
    index: Tensor  # (B,) long row of the question in its split (joins predictions with question ids)

    def to(self, device: torch.device | str, float_dtype: torch.dtype | None = None, non_blocking: bool = False):
        out = super().to(device, None, non_blocking)
        if float_dtype is not None:  # features only: soft scores stay float32
            out.visual_feats = out.visual_feats.to(float_dtype)
            out.boxes = out.boxes.to(float_dtype)
        return out


@dataclass
class Nlvr2Batch(TensorBatch):
    """One NLVR2-style batch: a statement about a pair of images (Appendix B)."""

    input_ids: Tensor  # (B, T) long statement tokens
    attention_mask: Tensor  # (B, T) bool
    visual_feats: Tensor  # (B, 2, N, F) float16: img0, img1
    boxes: Tensor  # (B, 2, N, 4)
    visual_mask: Tensor  # (B, 2, N) bool
    labels: Tensor  # (B,) long, 1 = the statement is true of the pair
    index: Tensor  # (B,) long row of the example in its split (joins predictions with identifiers)
