"""MulT, the Multimodal Transformer (Tsai et al., 2019), and its Table 4 ablations. Imports only torch
(and annotated_types: the config's bounds, checked by the experiment config).

Paper sections: §3.1 crossmodal attention, §3.2 architecture (temporal
convolution, positional embedding, crossmodal transformers, self-attention
transformers and prediction), §4.3 / Table 4 ablations, Table 5 hyper-parameters.
Reference code: yaohungt/Multimodal-Transformer (read, not copied).

Shapes: B batch, T_l / T_a / T_v sequence lengths, F_m input feature dims,
D the common dimension d, G directions (streams) computed together, H heads,
P the padded head dimension.

How the work is laid out (the maths is the paper's; the grouping is for speed):

- Every transformer stack is a *stream* of a `StreamStack`, whose weights are
  stacked on a stream axis (layer, stream, ...). Consecutive streams with equal
  (query length, key length, attention dropout) form a *group* that runs as ONE
  batched matmul per projection and ONE SDPA call (groups merged into the batch
  axis). At unaligned MOSEI shapes the six directions form three groups:
  [A->L, V->L] (50 x 500), [L->A, L->V] (500 x 50), [V->A, A->V] (500 x 500),
  and the three self-attention transformers two: [L] and [A, V].
- Keys/values of the crossmodal layers come from the LOW-LEVEL source (§3.1):
  the source is layer-normalised once, and each layer's LayerNorm affine is
  folded into its key/value projection (W diag(gamma), W beta + b), so no
  per-layer LayerNorm of the source is computed or stored.
- The head dimension (6 at d = 30 with 5 heads) is zero-padded to a multiple
  of `pad_head_dim_to` by padding the projection WEIGHTS, so q/k/v come out of
  the matmul already padded and SDPA gets the true scale: the fused kernels
  apply and no activation is copied to pad it.
- The causal mask is the reference's offset mask (query i sees key j iff
  j <= i + |S - T|; lower-right for S >= T), passed as `is_causal` or a
  `causal_lower_right` bias when there is no padding (fused kernels), or as a
  per-sample additive mask built once per forward from the true lengths.
- Only the LAST element of each self-attention transformer is used (§3.2), so
  its last layer runs the query and the feed-forward on that element only.

Differences from the reference code (each noted where it happens):
- the kernels of the temporal convolutions keep the length ("same" padding,
  odd kernels); the reference pads 0 and only ever uses kernel 1;
- positions count 1, 2, ... from the first real step of each sequence; the
  reference numbers steps of its front-padded window and gives position 0 to
  steps whose first projected feature is 0, so its positions depend on padding;
- one embedding dropout mask per modality, shared by the directions that read
  it; the reference draws one per transformer and a separate one for keys and values;
- sequences carry true lengths: padded keys are masked and the last REAL
  element is read; the reference attends to its zero padding.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from xmodal.base.bounds import Dropout, PosInt
from xmodal.models.attention import (
    additive_mask,
    key_padding_allowed,
    offset_causal_allowed,
    offset_causal_mask,
    padded_head_dim,
)

MODALITIES: tuple[str, ...] = ("l", "a", "v")  # language, audio, vision (input order: text, audio, vision)
MODALITY_NAMES = {"l": "text", "a": "audio", "v": "vision"}

# Crossmodal directions (source, target), ordered so that directions with equal shapes are adjacent
# at the usual shapes (aligned: all; unaligned T_a == T_v: [A,V -> L], [L -> A,V], [V -> A, A -> V]).
DIRECTIONS: tuple[tuple[str, str], ...] = (("a", "l"), ("v", "l"), ("l", "a"), ("l", "v"), ("v", "a"), ("a", "v"))
# Per target, its two crossmodal outputs in the order they are concatenated (reference order).
TARGET_SOURCES = {"l": ("a", "v"), "a": ("l", "v"), "v": ("l", "a")}

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


class MultOutput(NamedTuple):
    output: Tensor  # (B, output_dim) sentiment score, or IEMOCAP logits (B, 8) = (B, 4 emotions x 2)
    hidden: Tensor  # (B, combined) concatenated last elements (6d for the full model)


def sinusoidal_positions(length: int, dim: int, device: torch.device | str | None = None) -> Tensor:
    """(length, dim) fixed positional embeddings of positions 1..length (paper §3.2, Appendix A).

    Layout of the reference (tensor2tensor / fairseq): sines of all
    frequencies, then cosines, frequencies 10000^(-k / (dim/2 - 1)); a zero
    column when dim is odd. Position 0 is fairseq's padding slot, so real
    steps start at 1.
    """
    half = dim // 2
    freq = torch.exp(torch.arange(half, device=device, dtype=torch.float32) * -(math.log(10000.0) / (half - 1)))
    angle = torch.arange(1, length + 1, device=device, dtype=torch.float32)[:, None] * freq[None, :]
    pe = torch.cat([angle.sin(), angle.cos()], dim=1)  # (T, 2 * half)
    if dim % 2:
        pe = F.pad(pe, (0, 1))
    return pe


def _valid(lengths: Tensor | None, t: int) -> Tensor | None:
    """(B,) lengths -> (B, T) bool, True = a real step."""
    if lengths is None:
        return None
    return torch.arange(t, device=lengths.device)[None, :] < lengths[:, None]


def _group_runs(keys: list[tuple]) -> list[tuple[int, int]]:
    """Maximal runs of consecutive equal keys, as (start, end) index pairs."""
    runs: list[tuple[int, int]] = []
    start = 0
    for i in range(1, len(keys) + 1):
        if i == len(keys) or keys[i] != keys[start]:
            runs.append((start, i))
            start = i
    return runs


def _as_sdpa_mask(mask, dtype: torch.dtype):
    """A bool mask becomes an additive one once per forward (SDPA would convert it in every layer)."""
    if isinstance(mask, Tensor) and mask.dtype == torch.bool:
        return additive_mask(mask, dtype)
    return mask


def _stack(xs: list[Tensor]) -> Tensor:
    """Stack on a new leading axis; the same tensor repeated is expanded, not copied."""
    if all(x is xs[0] for x in xs):
        return xs[0].unsqueeze(0).expand(len(xs), *xs[0].shape)
    return torch.stack(xs)


class TemporalEmbedding(nn.Module):
    """Paper §3.2: Conv1D(kernel k_m) to d, then (optionally sqrt(d) x) + positions, then embedding dropout."""

    def __init__(self, in_dim: int, dim: int, kernel: int, input_dropout: float, embed_dropout: float,
                 scale: bool):
        super().__init__()
        # No bias, as the reference: a zero step stays zero before positions are added.
        self.conv = nn.Conv1d(in_dim, dim, kernel, padding=kernel // 2, bias=False)
        self.input_dropout = input_dropout
        self.embed_dropout = embed_dropout
        self.scale = math.sqrt(dim) if scale else 1.0

    def forward(self, x: Tensor, lengths: Tensor | None, compute_dtype: torch.dtype | None = None) -> Tensor:
        b, t, _ = x.shape  # (B, T, F)
        valid = _valid(lengths, t)
        if valid is not None:
            # Padding must be exact zeros: a kernel > 1 reads it as the convolution's own zero padding.
            x = x * valid[..., None].to(x.dtype)
        w = self.conv.weight  # (D, F, k)
        x = x.to(compute_dtype or w.dtype)  # features travel as float16
        x = F.dropout(x, self.input_dropout, self.training)
        if w.shape[-1] == 1:
            h = F.linear(x, w[:, :, 0])  # (B, T, D): a 1x1 convolution without the transposes
        else:
            h = self.conv(x.transpose(1, 2)).transpose(1, 2)  # (B, T, D)
        h = self.scale * h + sinusoidal_positions(t, h.shape[-1], h.device).to(h.dtype)
        return F.dropout(h, self.embed_dropout, self.training)


class StreamWeights(NamedTuple):
    """The weights of streams [s, e): per-layer tuples (index = layer), LayerNorm affines folded in,
    heads padded, already in the autocast dtype.

    G streams, P padded head dim, E = H * P, F ffn width.
    """

    qkv_w: tuple[Tensor, ...]  # (G, 3E, D) per layer, LN1 folded in; rows q | k | v, each head padded to P
    qkv_b: tuple[Tensor, ...]  # (G, 3E)
    q_w: tuple[Tensor, ...]  # (G, E, D) the q rows of qkv_w (crossmodal layers and last-element queries)
    q_b: tuple[Tensor, ...]  # (G, E)
    kv_w: tuple[Tensor, ...]  # (G, 2E, D) the k | v rows
    kv_b: tuple[Tensor, ...]  # (G, 2E)
    out_w: tuple[Tensor, ...]  # (G, D, E) zero columns at the padded head slots
    out_b: tuple[Tensor, ...]  # (G, D)
    fc1_w: tuple[Tensor, ...]  # (G, F, D) LN2 folded in
    fc1_b: tuple[Tensor, ...]  # (G, F)
    fc2_w: tuple[Tensor, ...]  # (G, D, F)
    fc2_b: tuple[Tensor, ...]  # (G, D)
    final_w: Tensor  # (G, D)
    final_b: Tensor  # (G, D)


class StreamStack(nn.Module):
    """`len(streams)` independent pre-LN transformer encoders of equal width and depth (paper Eq. 4 /
    the reference TransformerEncoder: LN -> attention -> dropout -> +residual; LN -> ReLU FFN -> dropout
    -> +residual; a final LayerNorm), with their weights stacked on a stream axis so that streams of
    equal shapes run as one batched matmul and one SDPA call.

    A crossmodal layer normalises its queries and its keys/values with the SAME LayerNorm (reference).
    Parameters follow the nn.Linear / nn.MultiheadAttention layouts per (layer, stream), so one stream
    can be copied to or from a plain module (`stream_state`).
    """

    def __init__(self, streams: tuple[str, ...], depth: int, dim: int, num_heads: int, *, ffn_mult: int,
                 attn_dropout: tuple[float, ...], relu_dropout: float, res_dropout: float, pad_head_dim_to: int,
                 recompute_ffn: bool = False):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"hidden size {dim} is not divisible by num_heads {num_heads}")
        n, f = len(streams), ffn_mult * dim
        self.streams = streams
        self.depth, self.dim, self.num_heads, self.ffn_dim = depth, dim, num_heads, f
        self.head_dim = dim // num_heads
        self.padded_head_dim = padded_head_dim(self.head_dim, pad_head_dim_to)
        self.attn_dropout = attn_dropout
        self.relu_dropout, self.res_dropout = relu_dropout, res_dropout
        self.recompute_ffn = recompute_ffn
        # Set by `recording_crossmodal_attention` only: each crossmodal layer call appends its attention
        # weights here, and `Mult._crossmodal` files them by direction into `recorded`.
        self.record: list[Tensor] | None = None
        self.recorded: dict[tuple[int, tuple[str, str]], Tensor] = {}
        p = nn.Parameter
        self.ln1_weight, self.ln1_bias = p(torch.ones(depth, n, dim)), p(torch.zeros(depth, n, dim))
        self.in_proj_weight, self.in_proj_bias = p(torch.empty(depth, n, 3 * dim, dim)), p(torch.zeros(depth, n, 3 * dim))
        self.out_proj_weight, self.out_proj_bias = p(torch.empty(depth, n, dim, dim)), p(torch.zeros(depth, n, dim))
        self.ln2_weight, self.ln2_bias = p(torch.ones(depth, n, dim)), p(torch.zeros(depth, n, dim))
        self.fc1_weight, self.fc1_bias = p(torch.empty(depth, n, f, dim)), p(torch.zeros(depth, n, f))
        self.fc2_weight, self.fc2_bias = p(torch.empty(depth, n, dim, f)), p(torch.zeros(depth, n, dim))
        self.final_weight, self.final_bias = p(torch.ones(n, dim)), p(torch.zeros(n, dim))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self):
        # Reference (fairseq): Xavier-uniform per matrix, zero biases, LayerNorm 1 / 0.
        for w in (self.in_proj_weight, self.out_proj_weight, self.fc1_weight, self.fc2_weight):
            for m in w.view(-1, *w.shape[-2:]):
                nn.init.xavier_uniform_(m)

    def stream_state(self, stream: int, layer: int) -> dict[str, Tensor]:
        """Views of one (layer, stream)'s parameters under plain-module names."""
        i, j = layer, stream
        return {
            "ln1.weight": self.ln1_weight[i, j], "ln1.bias": self.ln1_bias[i, j],
            "attn.in_proj_weight": self.in_proj_weight[i, j], "attn.in_proj_bias": self.in_proj_bias[i, j],
            "attn.out_proj.weight": self.out_proj_weight[i, j], "attn.out_proj.bias": self.out_proj_bias[i, j],
            "ln2.weight": self.ln2_weight[i, j], "ln2.bias": self.ln2_bias[i, j],
            "fc1.weight": self.fc1_weight[i, j], "fc1.bias": self.fc1_bias[i, j],
            "fc2.weight": self.fc2_weight[i, j], "fc2.bias": self.fc2_bias[i, j],
        }

    def _pad_heads(self, w: Tensor, dim: int) -> Tensor:
        """Zero-pad each head's slice of `w` along `dim` (a multiple of D laid out as (k, H, head_dim))."""
        h, d, p = self.num_heads, self.head_dim, self.padded_head_dim
        if p == d:
            return w
        dim = dim % w.ndim
        shape = w.shape
        w = w.reshape(*shape[:dim], shape[dim] // (h * d), h, d, *shape[dim + 1:])
        pad = [0, 0] * (w.ndim - dim - 3) + [0, p - d]
        w = F.pad(w, pad)
        return w.reshape(*shape[:dim], -1, *shape[dim + 1:])

    def weights(self, s: int, e: int, dtype: torch.dtype | None = None) -> StreamWeights:
        """Fold the LayerNorm affines into the following projections for streams [s, e), all layers:
        LN(x) W^T + b = x_hat (W diag(gamma))^T + (W beta + b), with x_hat the plain normalisation."""
        sl = slice(s, e)
        w_in = self.in_proj_weight[:, sl]  # (L, G, 3D, D)
        qkv_w = w_in * self.ln1_weight[:, sl, None, :]
        qkv_b = self.in_proj_bias[:, sl] + (w_in @ self.ln1_bias[:, sl, :, None])[..., 0]
        w1 = self.fc1_weight[:, sl]  # (L, G, F, D)
        fc1_w = w1 * self.ln2_weight[:, sl, None, :]
        fc1_b = self.fc1_bias[:, sl] + (w1 @ self.ln2_bias[:, sl, :, None])[..., 0]
        qkv_w, qkv_b = self._pad_heads(qkv_w, -2), self._pad_heads(qkv_b, -1)
        # Cast once per forward to the compute dtype, not once per layer and use (autocast would
        # re-cast these non-leaf tensors at every use).
        dtype = dtype or qkv_w.dtype
        qkv_w, qkv_b = qkv_w.to(dtype), qkv_b.to(dtype)
        e = self.num_heads * self.padded_head_dim
        q_w, kv_w = qkv_w.split([e, 2 * e], dim=2)
        q_b, kv_b = qkv_b.split([e, 2 * e], dim=2)
        rest = (self._pad_heads(self.out_proj_weight[:, sl], -1), self.out_proj_bias[:, sl],
                fc1_w, fc1_b, self.fc2_weight[:, sl], self.fc2_bias[:, sl])
        rest = tuple(t.to(dtype) for t in rest)
        # unbind: the backward is one stack per weight instead of zeros + copy per layer.
        return StreamWeights(*(t.unbind(0) for t in (qkv_w, qkv_b, q_w, q_b, kv_w, kv_b, *rest)),
                             final_w=self.final_weight[sl], final_b=self.final_bias[sl])

    def layer(self, w: StreamWeights, i: int, x: Tensor, kv_hat: Tensor | None, attn_mask, is_causal: bool,
              attn_dropout: float, query: Tensor | None = None) -> Tensor:
        """Layer `i` of a group of G streams (weights `w` from `weights(s, e)`).

        x: (G, B, T, D) residual stream. kv_hat: (G, B, S, D) NORMALISED key/value source
        (crossmodal), or None for self-attention over x. query: (G, B, T', D), a subset of
        x's positions to compute instead of all of them (their keys still come from x).
        attn_mask: None, a CausalBias or an additive float mask. Returns the new residual
        stream at the query positions.
        """
        lw = (w.qkv_w[i], w.qkv_b[i], w.q_w[i], w.q_b[i], w.kv_w[i], w.kv_b[i],
              w.out_w[i], w.out_b[i], w.fc1_w[i], w.fc1_b[i], w.fc2_w[i], w.fc2_b[i])
        return self._layer_impl(lw, x, kv_hat, attn_mask, is_causal, attn_dropout, query)

    def _layer_impl(self, lw: tuple[Tensor, ...], x: Tensor, kv_hat: Tensor | None, attn_mask, is_causal: bool,
                    attn_dropout: float, query: Tensor | None) -> Tensor:
        qkv_w, qkv_b, q_w, q_b, kv_w, kv_b, out_w, out_b, fc1_w, fc1_b, fc2_w, fc2_b = lw  # (G, 3E, D), ...
        h, p = self.num_heads, self.padded_head_dim
        e = h * p
        g, b, t, d = x.shape
        training = self.training
        x_hat = F.layer_norm(x, (d,))  # (G, B, T, D), affine folded into the projections
        if kv_hat is None and query is None:
            # Self-attention: q, k, v from one matmul.
            qkv = torch.baddbmm(qkv_b[:, None], x_hat.reshape(g, b * t, d), qkv_w.transpose(1, 2))  # (G, BT, 3E)
            q, k, v = qkv.view(g * b, t, 3, h, p).unbind(2)  # (GB, T, H, P) each
            tq = t
        else:
            src = x_hat if kv_hat is None else kv_hat  # (G, B, S, D)
            if query is not None:
                x = query
                x_hat = F.layer_norm(query, (d,))
            tq, s = x.shape[2], src.shape[2]
            q = torch.baddbmm(q_b[:, None], x_hat.reshape(g, b * tq, d), q_w.transpose(1, 2))
            q = q.view(g * b, tq, h, p)  # (GB, T, H, P)
            kv = torch.baddbmm(kv_b[:, None], src.reshape(g, b * s, d), kv_w.transpose(1, 2))
            k, v = kv.view(g * b, s, 2, h, p).unbind(2)  # (GB, S, H, P) each
        if self.record is not None and kv_hat is not None:
            self.record.append(self._probs(q, k, attn_mask, is_causal).view(g, b, h, tq, -1))
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=attn_mask, is_causal=is_causal,
            dropout_p=attn_dropout if training else 0.0,
            scale=1.0 / math.sqrt(self.head_dim),  # the true head dim, not the padded one
        )  # (GB, H, T, P)
        o = o.transpose(1, 2).reshape(g, b * tq, e)  # (G, BT, E)
        o = torch.baddbmm(out_b[:, None], o, out_w.transpose(1, 2)).view(g, b, tq, d)
        x = x + F.dropout(o, self.res_dropout, training)
        if self.recompute_ffn and training and torch.is_grad_enabled():
            # The FFN's 4D-wide activations (ReLU output, dropout mask and output) would be most of the
            # stored activations; recomputing them costs one small FFN forward.
            f = checkpoint(self._ffn, x, fc1_w, fc1_b, fc2_w, fc2_b, use_reentrant=False)
        else:
            f = self._ffn(x, fc1_w, fc1_b, fc2_w, fc2_b)
        return x + F.dropout(f, self.res_dropout, training)

    @torch.no_grad()
    def _probs(self, q: Tensor, k: Tensor, attn_mask, is_causal: bool) -> Tensor:
        """The (GB, H, T, S) softmax weights the SDPA call below computes and does not return: the same
        scores (the true head dim's scale; zero-padded head dims add nothing) and mask."""
        scores = (q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2)).float() / math.sqrt(self.head_dim)
        t, s = scores.shape[-2:]
        if is_causal:
            attn_mask = torch.ones(t, s, dtype=torch.bool, device=scores.device).tril()
        elif type(attn_mask).__name__ == "CausalBias":  # `offset_causal_mask`'s lower-right causal bias
            attn_mask = offset_causal_allowed(t, s, device=scores.device)
        if attn_mask is not None:
            scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool \
                else scores + attn_mask.float()
        return scores.softmax(-1)

    def _ffn(self, x: Tensor, fc1_w: Tensor, fc1_b: Tensor, fc2_w: Tensor, fc2_b: Tensor) -> Tensor:
        g, b, t, d = x.shape
        f = F.layer_norm(x, (d,))
        f = torch.baddbmm(fc1_b[:, None], f.reshape(g, b * t, d), fc1_w.transpose(1, 2))  # (G, BT, F)
        f = F.dropout(F.relu(f), self.relu_dropout, self.training)
        return torch.baddbmm(fc2_b[:, None], f, fc2_w.transpose(1, 2)).view(g, b, t, d)

    @staticmethod
    def final_norm(w: StreamWeights, x: Tensor) -> Tensor:
        """The stack's closing LayerNorm, per stream: (G, B, T, D) -> (G, B, T, D)."""
        return torch.addcmul(w.final_b[:, None, None], F.layer_norm(x, (x.shape[-1],)), w.final_w[:, None, None])


class Mult(nn.Module):
    """MulT (paper §3) and the Table 4 ablations, chosen by `MultConfig.variant`.

    forward(text (B, T_l, F_l), audio (B, T_a, F_a), vision (B, T_v, F_v),
            lengths=(text_len, audio_len, vision_len) | None) -> MultOutput.

    Sequences are zero-padded at the END; `lengths` (B,) long, each >= 1, are
    their true lengths. `lengths=None` means every step is real (fixed-shape
    inputs as in the reference pickles): then no padding mask is built and
    the causal masks take their fused-kernel forms.

    "intermediate" (Table 4, "adapting from intermediate-level features"):
    layer 1 of [beta -> alpha] reads the low-level beta as in MulT; layer k > 1
    reads the output of layer k-1 of the REVERSE direction [alpha -> beta],
    i.e. beta's sequence already adapted to alpha. So each modality pair forms a
    bi-directional co-attention stack (as in an NMT encoder-decoder without
    self-attention, §3.1); the three pairs stay independent until fusion.
    """

    def __init__(self, config: MultConfig):
        super().__init__()
        c = self.config = config.validate()
        # The dtype matmuls run in under autocast (bf16 training), set by the training layer
        # (`train.runtime.apply_precision`) with the autocast it enters; None = the inputs' dtype.
        # Known up front, the folded weights and additive masks are cast once per forward.
        self.compute_dtype: torch.dtype | None = None
        attn_p = {"l": c.attn_dropout, "a": c.attn_dropout_a, "v": c.attn_dropout_v}
        stack = dict(ffn_mult=c.ffn_mult, relu_dropout=c.relu_dropout, res_dropout=c.res_dropout,
                     pad_head_dim_to=c.pad_head_dim_to, recompute_ffn=c.recompute_ffn)
        v = c.variant
        if v in ("full", "intermediate"):
            targets = MODALITIES
        elif v.startswith("target_"):
            targets = (v[-1],)
        else:
            targets = ()
        self.directions = tuple(d for d in DIRECTIONS if d[1] in targets)
        self.targets = targets
        if v.startswith("unimodal_"):
            self.inputs = (v[-1],)
        elif targets == MODALITIES or v in ("early_fusion", "late_fusion"):
            self.inputs = MODALITIES
        else:
            self.inputs = (targets[0], *TARGET_SOURCES[targets[0]])
        dims = {"l": c.l_dim, "a": c.a_dim, "v": c.v_dim}
        kernels = {"l": c.l_kernel, "a": c.a_kernel, "v": c.v_kernel}
        self.embed = nn.ModuleDict({
            m: TemporalEmbedding(dims[m], c.dim, kernels[m], c.text_dropout if m == "l" else 0.0,
                                 c.embed_dropout, c.embed_scale)
            for m in self.inputs
        })
        if self.directions:
            # The SOURCE modality sets the attention dropout of a crossmodal transformer (reference).
            self.crossmodal = StreamStack(
                tuple(f"{s}->{t}" for s, t in self.directions), c.layers, c.dim, c.num_heads,
                attn_dropout=tuple(attn_p[s] for s, _ in self.directions), **stack)
            self.fusion = StreamStack(targets, c.self_depth, 2 * c.dim, c.num_heads,
                                      attn_dropout=(c.attn_dropout,) * len(targets), **stack)
            combined = 2 * c.dim * len(targets)
        elif v == "early_fusion":
            self.fusion = StreamStack(("lav",), c.layers, c.dim, c.num_heads, attn_dropout=(c.attn_dropout,), **stack)
            combined = c.dim
        else:  # unimodal / late fusion: one transformer per input modality
            self.fusion = StreamStack(self.inputs, c.layers, c.dim, c.num_heads,
                                      attn_dropout=tuple(attn_p[m] for m in self.inputs), **stack)
            combined = c.dim * len(self.inputs)
        self.combined_dim = combined
        # Prediction: residual MLP on the concatenated last elements, then a linear layer (reference).
        self.proj1 = nn.Linear(combined, combined)
        self.proj2 = nn.Linear(combined, combined)
        self.out_layer = nn.Linear(combined, c.output_dim)

    # -- pieces ---------------------------------------------------------------------------------

    def _fusion_input(self, h: Tensor) -> Tensor:
        """Input embedding of a self-attention transformer over width-W features (reference:
        sqrt(W) scale if enabled, positions, embedding dropout)."""
        t, w = h.shape[1], h.shape[2]
        if self.config.embed_scale:
            h = math.sqrt(w) * h
        h = h + sinusoidal_positions(t, w, h.device).to(h.dtype)
        return F.dropout(h, self.config.embed_dropout, self.training)

    def _crossmodal(self, emb: dict[str, Tensor], lens: dict[str, Tensor] | None) -> dict[tuple[str, str], Tensor]:
        """The crossmodal transformers [beta -> alpha] (paper Eq. 4), grouped by shape.
        Returns {(source, target): (B, T_target, D)} after each stack's final LayerNorm."""
        c, stack, dirs = self.config, self.crossmodal, self.directions
        d = c.dim
        length = {m: x.shape[1] for m, x in emb.items()}
        groups = _group_runs([(length[t], length[s], stack.attn_dropout[i]) for i, (s, t) in enumerate(dirs)])
        # Each source normalised once; every layer's LN affine is folded into its K/V projection.
        dtype = self.compute_dtype or next(iter(emb.values())).dtype
        normed = {m: F.layer_norm(emb[m], (d,)).to(dtype) for m in {s for s, _ in dirs}}  # (B, S, D), cast once
        weights, states, kv_low, masks = [], [], [], []
        for s, e in groups:
            weights.append(stack.weights(s, e, self.compute_dtype))
            states.append(_stack([emb[t] for _, t in dirs[s:e]]))  # (G, B, T, D)
            kv_low.append(_stack([normed[src] for src, _ in dirs[s:e]]))  # (G, B, S, D), in the compute dtype
            mask, is_causal = self._cross_mask(dirs[s:e], length, lens)
            masks.append((_as_sdpa_mask(mask, dtype), is_causal))
        intermediate = c.variant == "intermediate"
        index = {dr: i for i, dr in enumerate(dirs)}
        for layer in range(stack.depth):
            if intermediate and layer > 0:
                per_dir = [x for st in states for x in st.unbind(0)]  # (B, T, D) per direction
                kvs = [F.layer_norm(_stack([per_dir[index[(t, src)]] for src, t in dirs[s:e]]), (d,)).to(dtype)
                       for s, e in groups]
            else:
                kvs = kv_low
            states = [
                stack.layer(weights[gi], layer, states[gi], kvs[gi], *masks[gi], stack.attn_dropout[s])
                for gi, (s, e) in enumerate(groups)
            ]
            if stack.record is not None:  # one entry per group, in order: (G, B, H, T, S)
                found, stack.record = stack.record, []
                for (s, e), probs in zip(groups, found, strict=True):
                    for dr, p in zip(dirs[s:e], probs.unbind(0), strict=True):
                        stack.recorded[(layer, dr)] = p
        out: dict[tuple[str, str], Tensor] = {}
        for gi, (s, e) in enumerate(groups):
            for dr, x in zip(dirs[s:e], StreamStack.final_norm(weights[gi], states[gi]).unbind(0), strict=True):
                out[dr] = x
        return out

    def _cross_mask(self, dirs, length: dict[str, int], lens: dict[str, Tensor] | None):
        """(attn_mask, is_causal) for a group of directions with equal (T, S)."""
        src, tgt = dirs[0]
        t, s = length[tgt], length[src]
        if lens is None:
            if not self.config.causal:
                return None, False
            return offset_causal_mask(t, s, self.proj1.weight.device)
        k_len = torch.cat([lens[sr] for sr, _ in dirs])  # (G*B,) in the (G, B) -> GB order
        if not self.config.causal:
            return key_padding_allowed(k_len, s), False
        q_len = torch.cat([lens[tg] for _, tg in dirs])
        return offset_causal_allowed(t, s, q_lengths=q_len, k_lengths=k_len), False

    def _self_attention(self, inputs: list[Tensor], valid: list[Tensor | None], last: list[Tensor | None],
                        interior_padding: bool = False) -> Tensor:
        """Run the fusion stack's streams over `inputs` ((B, T, W) each, already embedded) and
        return the final-normalised LAST real element of each: (B, W * n_streams).

        valid: (B, T) bool per stream or None (all real); last: (B,) index of the last real
        step or None (T - 1). Causal masks: with end padding a causal query never reaches a padded
        key, so `is_causal` alone is exact; with interior padding (early fusion) the padding is
        masked explicitly.
        """
        stack, causal = self.fusion, self.config.causal
        groups = _group_runs([(x.shape[1], stack.attn_dropout[i]) for i, x in enumerate(inputs)])
        outs = []
        for s, e in groups:
            w = stack.weights(s, e, self.compute_dtype)
            x = _stack(inputs[s:e])  # (G, B, T, W)
            g, b, t, _ = x.shape
            key_valid = None if valid[s] is None else torch.cat(valid[s:e])[:, None, None, :]  # (GB, 1, 1, T)
            if causal and key_valid is not None and interior_padding:
                mask, is_causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril() & key_valid, False
            elif causal:
                mask, is_causal = None, True
            else:
                mask, is_causal = key_valid, False
            dtype = self.compute_dtype or x.dtype
            mask, key_valid = _as_sdpa_mask(mask, dtype), _as_sdpa_mask(key_valid, dtype)
            p = stack.attn_dropout[s]
            for layer in range(stack.depth - 1):
                x = stack.layer(w, layer, x, None, mask, is_causal, p)
            # Last layer: only the last element is used (§3.2), so only it is queried. It sees every
            # real key under either mask, hence only the key padding remains.
            if last[s] is None:
                q = x[:, :, -1:]  # (G, B, 1, W)
            else:
                idx = torch.stack(last[s:e])  # (G, B)
                q = torch.gather(x, 2, idx[:, :, None, None].expand(g, b, 1, x.shape[-1]))  # (G, B, 1, W)
            x = stack.layer(w, stack.depth - 1, x, None, key_valid, False, p, query=q)
            x = StreamStack.final_norm(w, x)[:, :, 0]  # (G, B, W)
            outs.extend(x.unbind(0))
        return torch.cat(outs, dim=-1)

    # -- forward --------------------------------------------------------------------------------

    def forward(self, text: Tensor, audio: Tensor, vision: Tensor,
                lengths: tuple[Tensor, Tensor, Tensor] | None = None) -> MultOutput:
        raw = {"l": text, "a": audio, "v": vision}
        lens = None if lengths is None else dict(zip(MODALITIES, lengths, strict=True))
        emb = {m: self.embed[m](raw[m], None if lens is None else lens[m], self.compute_dtype)
               for m in self.inputs}  # (B, T_m, D)
        v = self.config.variant

        def last_index(m: str, offset: int = 0) -> Tensor | None:
            return None if lens is None else lens[m] - 1 + offset

        if self.directions:
            cross = self._crossmodal(emb, lens)
            inputs = [self._fusion_input(torch.cat([cross[(s, t)] for s in TARGET_SOURCES[t]], dim=-1))
                      for t in self.targets]  # (B, T_t, 2D) each
            valid = [None if lens is None else _valid(lens[t], emb[t].shape[1]) for t in self.targets]
            hidden = self._self_attention(inputs, valid, [last_index(t) for t in self.targets])
        elif v == "early_fusion":
            x = torch.cat([emb[m] for m in MODALITIES], dim=1)  # (B, T_l + T_a + T_v, D)
            valid = None if lens is None else torch.cat([_valid(lens[m], emb[m].shape[1]) for m in MODALITIES], 1)
            before_v = emb["l"].shape[1] + emb["a"].shape[1]
            hidden = self._self_attention([x], [valid], [last_index("v", before_v)], interior_padding=True)
        else:
            valid = [None if lens is None else _valid(lens[m], emb[m].shape[1]) for m in self.inputs]
            hidden = self._self_attention([emb[m] for m in self.inputs], valid,
                                          [last_index(m) for m in self.inputs])
        # hidden: (B, combined). Residual block, then the output layer (reference).
        h = self.proj2(F.dropout(F.relu(self.proj1(hidden)), self.config.out_dropout, self.training)) + hidden
        return MultOutput(self.out_layer(h), hidden)


@contextlib.contextmanager
def recording_crossmodal_attention(model: Mult) -> Iterator[dict[tuple[int, tuple[str, str]], Tensor]]:
    """Within the block, each forward of `model` fills the yielded dict with every crossmodal layer's
    attention: (layer, (source, target)) -> (B, H, T_target, S_source) float32 weights of each target step
    over the source steps (padded keys get 0), computed from the layer's own q and k and mask. Outside
    it nothing is recorded."""
    stack = getattr(model, "crossmodal", None)
    if stack is None:
        raise ValueError(f"MulT variant {model.config.variant!r} has no crossmodal attention to record")
    stack.record, stack.recorded = [], {}
    try:
        yield stack.recorded
    finally:
        stack.record = None
