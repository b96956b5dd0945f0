"""MulT's configuration (`MultConfig`): the Table 4 variant, the sizes, the dropouts, and the named
presets (the reference code's defaults, paper Table 5, the embedded default, unit tests). The model
itself: `xmodal.models.mult.model`. Imports the standard library and the bounds of the config fields
(annotated_types metadata, checked by the experiment config).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from xmodal.base.bounds import Dropout, PosInt

Variant = Literal[
    "full",  # MulT: six crossmodal transformers, three self-attention transformers
    "target_l",  # only [V,A -> L]  (Table 4 "only one target modality")
    "target_a",  # only [L,V -> A]
    "target_v",  # only [L,A -> V]
    "unimodal_l",  # one self-attention transformer over L only
    "unimodal_a",
    "unimodal_v",
    "early_fusion",  # one self-attention transformer over the time-concatenated L, A, V
    "late_fusion",  # three self-attention transformers; last elements concatenated
    "intermediate",  # full MulT, keys/values from the intermediate level (see `Mult`)
]
VARIANTS: tuple[str, ...] = Variant.__args__


@dataclass
class MultConfig:
    # Validated by the experiment config (pydantic reads this attribute; no import needed here).
    __pydantic_config__ = {"extra": "forbid"}

    variant: Variant = "full"
    l_dim: PosInt = 300  # GloVe
    a_dim: PosInt = 74  # COVAREP (5 in MOSI)
    v_dim: PosInt = 35  # Facet (20 in MOSI)
    dim: PosInt = 40  # d, the common dimension (paper Table 5: 40; reference: 30)
    layers: PosInt = 4  # D crossmodal layers (unimodal / fusion variants: depth of their transformers)
    # Depth of the self-attention transformers after the crossmodal ones; None = max(layers, 3) (reference).
    self_layers: PosInt | None = None
    num_heads: PosInt = 8
    l_kernel: PosInt = 1  # temporal convolution kernels (odd; Table 5 MOSEI: L 1 or 3, V 3, A 3)
    a_kernel: PosInt = 3
    v_kernel: PosInt = 3
    # Reference multiplies every transformer input by sqrt(width) before adding positions; the paper does not.
    embed_scale: bool = False
    # Reference: causal masks on (the paper does not mention masks). See `offset_causal_allowed`.
    causal: bool = True
    attn_dropout: Dropout = 0.1  # attention dropout of keys from L, and of the self-attention transformers
    attn_dropout_a: Dropout = 0.1  # ... of keys from A (reference: the SOURCE modality sets it)
    attn_dropout_v: Dropout = 0.1  # ... of keys from V
    relu_dropout: Dropout = 0.1
    res_dropout: Dropout = 0.1
    embed_dropout: Dropout = 0.3  # at the input of every transformer
    text_dropout: Dropout = 0.3  # on the raw text features (reference: the same knob as embed_dropout)
    out_dropout: Dropout = 0.1
    output_dim: PosInt = 1  # 1 = sentiment regression; 8 = IEMOCAP 4 emotions x 2 logits
    ffn_mult: PosInt = 4
    pad_head_dim_to: PosInt = 8  # 1 = no padding
    # Recompute the feed-forward activations in backward instead of storing them (same numbers):
    # about half the activation memory at MOSEI shapes for one more small FFN forward.
    recompute_ffn: bool = True

    def replace(self, **changes) -> MultConfig:
        return dataclasses.replace(self, **changes)

    @property
    def self_depth(self) -> int:
        return self.self_layers if self.self_layers is not None else max(self.layers, 3)

    def __post_init__(self) -> None:
        # Per-field bounds are `Annotated` metadata that the experiment config checks first; `validate`
        # adds the checks across fields (and repeats the bounds for configs built in code).
        self.validate()

    def validate(self) -> MultConfig:
        """Raise ValueError naming the field, the bad value and what is expected."""

        def bad(field: str, expected: str):
            raise ValueError(f"MultConfig.{field} = {getattr(self, field)!r}: expected {expected}")

        if self.variant not in VARIANTS:
            bad("variant", f"one of {list(VARIANTS)}")
        for f in ("l_dim", "a_dim", "v_dim", "layers", "num_heads", "output_dim", "ffn_mult", "pad_head_dim_to"):
            if not isinstance(getattr(self, f), int) or getattr(self, f) < 1:
                bad(f, "a positive integer")
        if self.self_layers is not None and self.self_layers < 1:
            bad("self_layers", "None or a positive integer")
        if self.dim < 4:
            bad("dim", "an integer >= 4 (sinusoidal positions need 2 frequencies)")
        if self.dim % self.num_heads:
            bad("dim", f"a multiple of num_heads = {self.num_heads}")
        for f in ("l_kernel", "a_kernel", "v_kernel"):
            k = getattr(self, f)
            if not isinstance(k, int) or k < 1 or k % 2 == 0:
                bad(f, "an odd positive integer (the convolution keeps the sequence length)")
        for f in ("attn_dropout", "attn_dropout_a", "attn_dropout_v", "relu_dropout", "res_dropout",
                  "embed_dropout", "text_dropout", "out_dropout"):
            if not 0.0 <= getattr(self, f) < 1.0:
                bad(f, "a probability in [0, 1)")
        return self


def _paper(**kw) -> MultConfig:
    # Table 5 "crossmodal attention block dropout" is read as the attention dropout of every modality;
    # "textual embedding dropout" is the reference's embed_dropout, which also drops the raw text.
    block, text = kw.pop("block"), kw.pop("text")
    return MultConfig(attn_dropout=block, attn_dropout_a=block, attn_dropout_v=block,
                      embed_dropout=text, text_dropout=text, **kw)


PRESETS: dict[str, MultConfig] = {
    # The reference code's defaults (main.py; docs/papers.md#mult-architecture), unaligned MOSEI inputs.
    "reference": MultConfig(
        dim=30, layers=5, num_heads=5, l_kernel=1, a_kernel=1, v_kernel=1, embed_scale=True, causal=True,
        attn_dropout=0.1, attn_dropout_a=0.0, attn_dropout_v=0.0, relu_dropout=0.1, res_dropout=0.1,
        embed_dropout=0.25, text_dropout=0.25, out_dropout=0.0,
    ),
    # Table 5.
    "paper_mosei": _paper(dim=40, layers=4, num_heads=8, l_kernel=1, v_kernel=3, a_kernel=3,
                          text=0.3, block=0.1, out_dropout=0.1),
    "paper_mosi": _paper(dim=40, layers=4, num_heads=10, l_kernel=1, v_kernel=3, a_kernel=3, a_dim=5, v_dim=20,
                         text=0.2, block=0.2, out_dropout=0.1),
    "paper_iemocap": _paper(dim=40, layers=4, num_heads=10, l_kernel=3, v_kernel=3, a_kernel=5, output_dim=8,
                            text=0.3, block=0.25, out_dropout=0.1),
    # The embedded default (`jobs/train_mult.py` with no arguments): a one-layer MulT at d = 32 that
    # learns the synthetic store in well under a minute of CPU (all crossmodal directions and
    # self-attention transformers of the paper, each one layer deep; no dropout, kernels 1).
    # Not a paper configuration: paper runs use `paper_*` or `reference`.
    "small": MultConfig(
        dim=32, layers=1, self_layers=1, num_heads=4, l_kernel=1, a_kernel=1, v_kernel=1,
        attn_dropout=0.0, attn_dropout_a=0.0, attn_dropout_v=0.0, relu_dropout=0.0,
        res_dropout=0.0, embed_dropout=0.0, text_dropout=0.0, out_dropout=0.0,
    ),
    # Unit tests: small inputs, no dropout.
    "tiny": MultConfig(
        l_dim=12, a_dim=6, v_dim=5, dim=16, layers=2, self_layers=1, num_heads=2, l_kernel=1, a_kernel=3,
        v_kernel=1, attn_dropout=0.0, attn_dropout_a=0.0, attn_dropout_v=0.0, relu_dropout=0.0,
        res_dropout=0.0, embed_dropout=0.0, text_dropout=0.0, out_dropout=0.0,
    ),
}


def preset(name: str) -> MultConfig:
    if name not in PRESETS:
        raise KeyError(f"unknown MulT preset {name!r}; valid presets: {sorted(PRESETS)}")
    return PRESETS[name]
