"""The transformer stacks of MulT, as *streams* of a `StreamStack`: independent pre-LN transformer
encoders of equal width and depth whose weights are stacked on a stream axis, so that streams of equal
shapes run as one batched matmul per projection and one SDPA call (the layout and its reasons:
`xmodal.models.mult.model`). Imports only torch.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from xmodal.models.attention import offset_causal_allowed, padded_head_dim


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
