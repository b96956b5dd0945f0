"""MulT, the Multimodal Transformer (Tsai et al., 2019), and its Table 4 ablations. Imports only torch;
its configuration is `xmodal.models.mult.config`, its batched transformer stacks `xmodal.models.mult.streams`.

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
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xmodal.models.attention import (
    additive_mask,
    key_padding_allowed,
    offset_causal_allowed,
    offset_causal_mask,
)
from xmodal.models.mult.streams import StreamStack

MODALITIES: tuple[str, ...] = ("l", "a", "v")  # language, audio, vision (input order: text, audio, vision)
MODALITY_NAMES = {"l": "text", "a": "audio", "v": "vision"}

# Crossmodal directions (source, target), ordered so that directions with equal shapes are adjacent
# at the usual shapes (aligned: all; unaligned T_a == T_v: [A,V -> L], [L -> A,V], [V -> A, A -> V]).
DIRECTIONS: tuple[tuple[str, str], ...] = (("a", "l"), ("v", "l"), ("l", "a"), ("l", "v"), ("v", "a"), ("a", "v"))
# Per target, its two crossmodal outputs in the order they are concatenated (reference order).
TARGET_SOURCES = {"l": ("a", "v"), "a": ("l", "v"), "v": ("l", "a")}

if TYPE_CHECKING:
    from xmodal.models.mult.config import MultConfig

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
