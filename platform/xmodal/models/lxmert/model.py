"""LXMERT (Tan & Bansal, 2019): encoders and pretraining heads. Imports only torch (and the config's
bounds, plain `Annotated` metadata that the experiment config checks).

Paper sections: §2 (model), §3.1 (pretraining tasks). Where the paper and the
reference code (airsplay/lxmert) differ, `LxmertConfig` has an option that
defaults to the paper.

Shapes: B batch, T words, N objects, D hidden, F visual feature dim.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xmodal.base.bounds import Dropout, NonNegInt, PosFloat, PosInt, SeqLen
from xmodal.models.attention import (
    MultiHeadAttention,
    PostLNAttention,
    PostLNFeedForward,
    padding_to_attn_mask,
)


@dataclass
class LxmertConfig:
    # Validated by the experiment config (pydantic reads this attribute; no import needed here).
    __pydantic_config__ = {"extra": "forbid"}

    vocab_size: PosInt = 30522
    hidden_size: PosInt = 768  # a multiple of num_heads
    num_heads: PosInt = 12
    ffn_size: PosInt = 3072
    # 0 layers is a valid ablation (e.g. no cross-modality layers).
    l_layers: NonNegInt = 9  # N_L language layers
    r_layers: NonNegInt = 5  # N_R object-relationship layers
    x_layers: NonNegInt = 5  # N_X cross-modality layers
    max_positions: SeqLen = 512  # room for [CLS], [SEP] and one word at least
    # The paper embeds word + position; the reference (BERT) also adds a token-type embedding.
    token_type_embedding: bool = False
    visual_feat_dim: PosInt = 2048
    visual_pos_dim: PosInt = 4
    dropout: Dropout = 0.1
    attention_dropout: Dropout = 0.1
    layer_norm_eps: PosFloat = 1e-12
    # The reference shares ONE cross-attention module between both directions.
    shared_cross_attention: bool = True
    # The reference passes [CLS] through a tanh pooler; off = the raw [CLS] state (paper §2.3).
    pooler: bool = True
    num_object_labels: PosInt = 1600
    num_attr_labels: PosInt = 400
    num_qa_labels: PosInt = 9500
    # Std of the N(0, std) initial weights (BERT and the paper: 0.02, transformers'
    # `initializer_range`). 0.02 is calibrated for width 768: a projection scales a unit-variance
    # input by about std * sqrt(hidden_size), 0.55 at 768 but 0.23 at 128, so a narrow model starts
    # with almost no signal through attention (see docs/learning.md, Objectives).
    initializer_range: PosFloat = 0.02

    def __post_init__(self) -> None:
        """Checks across fields (the experiment config reports them under the field's dotted key)."""
        if self.num_heads >= 1 and self.hidden_size % self.num_heads:
            raise ValueError(f"LxmertConfig.hidden_size = {self.hidden_size}: expected a multiple of "
                             f"num_heads = {self.num_heads}")

    def replace(self, **changes) -> LxmertConfig:
        return dataclasses.replace(self, **changes)


PRESETS: dict[str, LxmertConfig] = {
    "paper": LxmertConfig(token_type_embedding=True),
    # The embedded default: learns every task of the synthetic store in minutes on a 2-core CPU.
    # initializer_range 0.1 gives its 64-wide projections about the gain BERT's 0.02 gives at 768.
    "small": LxmertConfig(
        hidden_size=64, num_heads=4, ffn_size=256, l_layers=2, r_layers=1, x_layers=2,
        max_positions=64, dropout=0.0, attention_dropout=0.0, initializer_range=0.1,
    ),
    # Unit tests.
    "tiny": LxmertConfig(
        vocab_size=120, hidden_size=32, num_heads=4, ffn_size=64, l_layers=1, r_layers=1, x_layers=1,
        max_positions=32, visual_feat_dim=24, num_object_labels=12, num_attr_labels=6, num_qa_labels=10,
        dropout=0.0, attention_dropout=0.0,
    ),
}


def preset(name: str) -> LxmertConfig:
    if name not in PRESETS:
        raise KeyError(f"unknown LXMERT preset {name!r}; valid presets: {sorted(PRESETS)}")
    return PRESETS[name]


class LxmertOutput(NamedTuple):
    lang: Tensor  # (B, T, D)
    visn: Tensor  # (B, N, D)
    pooled: Tensor  # (B, D) cross-modality output


class WordEmbedding(nn.Module):
    """LayerNorm(WordEmbed(w) + IdxEmbed(i) [+ TypeEmbed(0)]) (paper §2.1). With `row0_grad` off
    (`no_grad_row0`), row 0 of the position and token-type embeddings gets no gradient from here, as
    the reference's nn.Embedding(..., padding_idx=0) lookups give it none (the same values: only the
    backward differs)."""

    def __init__(self, c: LxmertConfig):
        super().__init__()
        self.row0_grad = True
        self.word = nn.Embedding(c.vocab_size, c.hidden_size, padding_idx=0)
        self.position = nn.Embedding(c.max_positions, c.hidden_size)
        self.token_type = nn.Embedding(2, c.hidden_size) if c.token_type_embedding else None
        self.norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.dropout = nn.Dropout(c.dropout)

    def forward(self, input_ids: Tensor) -> Tensor:
        t = input_ids.shape[1]
        if self.row0_grad:
            positions = self.position.weight[:t]  # (T, D)
            type0 = self.token_type.weight[0] if self.token_type is not None else None
        else:  # the reference's lookups, whose padding_idx=0 passes row 0 no gradient (the others get theirs)
            positions = self.position(torch.arange(t, device=input_ids.device))
            zero = torch.zeros((), dtype=torch.long, device=input_ids.device)
            type0 = self.token_type(zero) if self.token_type is not None else None
        x = self.word(input_ids) + positions  # (B, T, D)
        if type0 is not None:
            x = x + type0
        return self.dropout(self.norm(x))


def no_grad_row0(model: nn.Module) -> nn.Module:
    """Every word embedding of `model` passes row 0 of its position and token-type tables no gradient, as
    the reference's nn.Embedding(..., padding_idx=0) lookups do (its word table's row 0, [PAD], gets none
    in either case). The weights are untouched; rows the batch does not use still get a (zero) gradient,
    so a decay that the optimizer applies to them applies as in the reference."""
    for m in model.modules():
        if isinstance(m, WordEmbedding):
            m.row0_grad = False
            m.position.padding_idx = 0
            if m.token_type is not None:
                m.token_type.padding_idx = 0
    return model


class ObjectEmbedding(nn.Module):
    """Eq. 1: v = (LayerNorm(W_f f + b_f) + LayerNorm(W_p p + b_p)) / 2."""

    def __init__(self, c: LxmertConfig):
        super().__init__()
        self.feat_fc = nn.Linear(c.visual_feat_dim, c.hidden_size)
        self.feat_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.box_fc = nn.Linear(c.visual_pos_dim, c.hidden_size)
        self.box_norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)
        self.dropout = nn.Dropout(c.dropout)

    def forward(self, feats: Tensor, boxes: Tensor) -> Tensor:
        f = self.feat_norm(self.feat_fc(feats))  # (B, N, D)
        p = self.box_norm(self.box_fc(boxes))  # (B, N, D)
        return self.dropout((f + p) / 2)


class SingleModalityLayer(nn.Module):
    """A language or object-relationship layer: self-attention then feed-forward (BERT layer)."""

    def __init__(self, c: LxmertConfig):
        super().__init__()
        self.attn = PostLNAttention(c.hidden_size, c.num_heads, c.dropout, c.attention_dropout, c.layer_norm_eps)
        self.ffn = PostLNFeedForward(c.hidden_size, c.ffn_size, c.dropout, c.layer_norm_eps)

    def forward(self, x: Tensor, mask: Tensor | None) -> Tensor:
        return self.ffn(self.attn(x, attn_mask=mask))


class CrossModalityLayer(nn.Module):
    """Paper §2.2: bi-directional cross-attention, then self-attention, then feed-forward."""

    def __init__(self, c: LxmertConfig):
        super().__init__()
        args = (c.hidden_size, c.num_heads, c.dropout, c.attention_dropout, c.layer_norm_eps)
        self.cross_l = PostLNAttention(*args)  # language queries vision
        self.cross_v = self.cross_l if c.shared_cross_attention else PostLNAttention(*args)
        self.self_l = PostLNAttention(*args)
        self.self_v = PostLNAttention(*args)
        self.ffn_l = PostLNFeedForward(c.hidden_size, c.ffn_size, c.dropout, c.layer_norm_eps)
        self.ffn_v = PostLNFeedForward(c.hidden_size, c.ffn_size, c.dropout, c.layer_norm_eps)

    def forward(self, lang: Tensor, visn: Tensor, lang_mask: Tensor | None, visn_mask: Tensor | None):
        # Both directions read the layer k-1 outputs.
        lang_x = self.cross_l(lang, visn, visn_mask)  # (B, T, D)
        visn_x = self.cross_v(visn, lang, lang_mask)  # (B, N, D)
        lang = self.ffn_l(self.self_l(lang_x, attn_mask=lang_mask))
        visn = self.ffn_v(self.self_v(visn_x, attn_mask=visn_mask))
        return lang, visn


class LxmertEncoder(nn.Module):
    def __init__(self, c: LxmertConfig):
        super().__init__()
        self.config = c
        self.word_embedding = WordEmbedding(c)
        self.object_embedding = ObjectEmbedding(c)
        self.lang_layers = nn.ModuleList(SingleModalityLayer(c) for _ in range(c.l_layers))
        self.visn_layers = nn.ModuleList(SingleModalityLayer(c) for _ in range(c.r_layers))
        self.x_layers = nn.ModuleList(CrossModalityLayer(c) for _ in range(c.x_layers))
        self.pooler = nn.Linear(c.hidden_size, c.hidden_size) if c.pooler else None

    def forward(
        self,
        input_ids: Tensor,  # (B, T) long
        attention_mask: Tensor | None,  # (B, T) bool, True = real token
        visual_feats: Tensor,  # (B, N, F)
        boxes: Tensor,  # (B, N, 4) in [0, 1]
        visual_mask: Tensor | None = None,  # (B, N) bool, True = real object
    ) -> LxmertOutput:
        lang_mask = padding_to_attn_mask(attention_mask)
        visn_mask = padding_to_attn_mask(visual_mask)
        lang = self.word_embedding(input_ids)
        visn = self.object_embedding(visual_feats.to(lang.dtype), boxes.to(lang.dtype))
        for layer in self.lang_layers:
            lang = layer(lang, lang_mask)
        for layer in self.visn_layers:
            visn = layer(visn, visn_mask)
        for layer in self.x_layers:
            lang, visn = layer(lang, visn, lang_mask, visn_mask)
        cls = lang[:, 0]  # (B, D)
        pooled = torch.tanh(self.pooler(cls)) if self.pooler is not None else cls
        return LxmertOutput(lang, visn, pooled)


def attention_probs(attn: MultiHeadAttention, x: Tensor, context: Tensor, attn_mask: Tensor | None) -> Tensor:
    """The (B, H, T, S) softmax weights of `attn`'s queries `x` over the keys of `context`: what its
    fused SDPA call computes inside and does not return (the same projections, scale and mask)."""
    d, h, dh = attn.dim, attn.num_heads, attn.head_dim
    w, b = attn.in_proj.weight, attn.in_proj.bias
    q = F.linear(x, w[:d], b[:d]).unflatten(-1, (h, dh)).transpose(1, 2)  # (B, H, T, dh)
    k = F.linear(context, w[d:2 * d], b[d:2 * d]).unflatten(-1, (h, dh)).transpose(1, 2)  # (B, H, S, dh)
    scores = (q @ k.transpose(-1, -2)).float() / math.sqrt(dh)  # (B, H, T, S)
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
            else scores + attn_mask.float()
    return scores.softmax(-1)


@contextlib.contextmanager
def recording_cross_attention(encoder: LxmertEncoder) -> Iterator[list[Tensor]]:
    """Within the block, every forward of `encoder` appends to the yielded list, per cross-modality layer
    in order, the language side's attention over the objects: (B, H, T, N) float32 weights of each word
    ([CLS] first) over the boxes, read from the layer's own inputs by a forward pre-hook (padded objects
    get 0). Outside it the encoder runs as before: no hook, no cost."""
    found: list[Tensor] = []

    def hook(layer: CrossModalityLayer, args: tuple) -> None:
        lang, visn, _, visn_mask = args
        with torch.no_grad():
            found.append(attention_probs(layer.cross_l.attn, lang, visn, visn_mask).detach())

    handles = [layer.register_forward_pre_hook(hook) for layer in encoder.x_layers]
    try:
        yield found
    finally:
        for handle in handles:
            handle.remove()


class HeadTransform(nn.Module):
    """dense -> GeLU -> LayerNorm, in front of the MLM and object heads (BERT)."""

    def __init__(self, c: LxmertConfig):
        super().__init__()
        self.dense = nn.Linear(c.hidden_size, c.hidden_size)
        self.norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(F.gelu(self.dense(x)))


class MaskedLMHead(nn.Module):
    """Decoder tied to the word embedding (paper §3.1.1)."""

    def __init__(self, c: LxmertConfig, word_embedding: nn.Embedding):
        super().__init__()
        self.transform = HeadTransform(c)
        self.decoder_weight = word_embedding.weight  # tied: the same Parameter
        self.bias = nn.Parameter(torch.zeros(c.vocab_size))

    def forward(self, h: Tensor) -> Tensor:  # (..., D) -> (..., V)
        return F.linear(self.transform(h), self.decoder_weight, self.bias)


class ObjectHeads(nn.Module):
    """Masked object prediction (§3.1.2): RoI-feature regression and detected-label classification."""

    def __init__(self, c: LxmertConfig):
        super().__init__()
        self.transform = HeadTransform(c)
        self.obj = nn.Linear(c.hidden_size, c.num_object_labels)
        self.attr = nn.Linear(c.hidden_size, c.num_attr_labels)
        self.feat = nn.Linear(c.hidden_size, c.visual_feat_dim)


class AnswerHead(nn.Module):
    """Image QA classifier over the answer table: Linear, GeLU, LayerNorm, Linear (reference)."""

    def __init__(self, c: LxmertConfig, num_answers: int):
        super().__init__()
        self.fc1 = nn.Linear(c.hidden_size, 2 * c.hidden_size)
        self.norm = nn.LayerNorm(2 * c.hidden_size, eps=c.layer_norm_eps)
        self.fc2 = nn.Linear(2 * c.hidden_size, num_answers)

    def forward(self, pooled: Tensor) -> Tensor:  # (B, D) -> (B, A)
        return self.fc2(self.norm(F.gelu(self.fc1(pooled))))


class LxmertForPretraining(nn.Module):
    """Encoder plus the heads of the five pretraining tasks.

    The heads are applied by `xmodal.objectives.pretraining` only where a loss
    needs them (the vocabulary projection only at masked words).
    """

    def __init__(self, config: LxmertConfig):
        super().__init__()
        self.config = config
        self.encoder = LxmertEncoder(config)
        self.mlm_head = MaskedLMHead(config, self.encoder.word_embedding.word)
        self.match_head = nn.Linear(config.hidden_size, 2)
        self.object_heads = ObjectHeads(config)
        self.qa_head = AnswerHead(config, config.num_qa_labels)
        self.apply(self._init_weights)

    def _init_weights(self, m: nn.Module) -> None:
        # BERT initialisation: N(0, initializer_range) weights, zero biases, unit LayerNorm.
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=self.config.initializer_range)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)
        elif isinstance(m, nn.LayerNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)

    def forward(self, input_ids, attention_mask, visual_feats, boxes, visual_mask=None) -> LxmertOutput:
        return self.encoder(input_ids, attention_mask, visual_feats, boxes, visual_mask)
