"""Attention blocks shared by LXMERT and MulT.

Imports only torch. Every attention in the project goes through
`torch.nn.functional.scaled_dot_product_attention` so that the fused kernels
(flash / memory-efficient on GPU, the flash CPU kernel on CPU) apply.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils._python_dispatch import _get_current_dispatch_mode  # private, stable since torch 2.0


def padding_to_attn_mask(key_valid: Tensor | None) -> Tensor | None:
    """(B, S) bool, True = a real key  ->  (B, 1, 1, S) bool mask for SDPA (True = attend)."""
    if key_valid is None:
        return None
    return key_valid[:, None, None, :]


class MultiHeadAttention(nn.Module):
    """Multi-head attention for self- (context=None) and cross-attention.

    One (3D, D) input projection holds W_q, W_k, W_v: self-attention projects
    with one matmul; cross-attention uses the first third on the queries and the
    last two thirds on the context (views, no copy).

    `pad_head_dim_to`: when the head dimension is not a multiple of it, q/k/v are
    zero-padded per head and SDPA is given the true `scale`, so the fused
    kernels (which need head_dim % 8 == 0) apply. Zero padding leaves q.k and
    the first head_dim output columns unchanged.
    """

    def __init__(self, dim: int, num_heads: int, dropout: float = 0.0, pad_head_dim_to: int = 1):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"hidden size {dim} is not divisible by num_heads {num_heads}")
        self.dim = dim
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.dropout = dropout
        self.padded_head_dim = math.ceil(self.head_dim / pad_head_dim_to) * pad_head_dim_to
        self.in_proj = nn.Linear(dim, 3 * dim)
        self.out_proj = nn.Linear(dim, dim)

    def _heads(self, x: Tensor) -> Tensor:
        b, t, _ = x.shape
        x = x.view(b, t, self.num_heads, self.head_dim).transpose(1, 2)  # (B, H, T, d_h)
        if self.padded_head_dim != self.head_dim:
            x = F.pad(x, (0, self.padded_head_dim - self.head_dim))
        return x

    def forward(
        self,
        x: Tensor,  # (B, T, D) queries
        context: Tensor | None = None,  # (B, S, D) keys/values; None = self-attention
        attn_mask: Tensor | None = None,  # bool (True = attend) or additive float, broadcast to (B, H, T, S)
        is_causal: bool = False,
    ) -> Tensor:
        if context is None:
            q, k, v = self.in_proj(x).chunk(3, dim=-1)
        else:
            w, b = self.in_proj.weight, self.in_proj.bias
            q = F.linear(x, w[: self.dim], b[: self.dim])
            k, v = F.linear(context, w[self.dim :], b[self.dim :]).chunk(2, dim=-1)
        q, k, v = self._heads(q), self._heads(k), self._heads(v)
        out = F.scaled_dot_product_attention(
            q,
            k,
            v,
            attn_mask=attn_mask,
            dropout_p=self.dropout if self.training else 0.0,
            is_causal=is_causal,
            scale=1.0 / math.sqrt(self.head_dim),
        )  # (B, H, T, d_pad)
        if self.padded_head_dim != self.head_dim:
            out = out[..., : self.head_dim]
        b, _, t, _ = out.shape
        out = out.transpose(1, 2).reshape(b, t, self.dim)  # (B, T, D)
        return self.out_proj(out)


class PostLNAttention(nn.Module):
    """BERT-style attention sub-layer: LayerNorm(x + Dropout(MHA(x, context)))."""

    def __init__(self, dim: int, num_heads: int, dropout: float, attention_dropout: float, eps: float):
        super().__init__()
        self.attn = MultiHeadAttention(dim, num_heads, attention_dropout)
        self.dropout = nn.Dropout(dropout)
        self.norm = nn.LayerNorm(dim, eps=eps)

    def forward(self, x: Tensor, context: Tensor | None = None, attn_mask: Tensor | None = None) -> Tensor:
        return self.norm(x + self.dropout(self.attn(x, context, attn_mask)))


class PostLNFeedForward(nn.Module):
    """BERT-style feed-forward sub-layer: LayerNorm(x + Dropout(W_2 GeLU(W_1 x)))."""

    def __init__(self, dim: int, ffn_dim: int, dropout: float, eps: float):
        super().__init__()
        self.fc1 = nn.Linear(dim, ffn_dim)
        self.fc2 = nn.Linear(ffn_dim, dim)
        self.dropout = nn.Dropout(dropout)
        self.norm = nn.LayerNorm(dim, eps=eps)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(x + self.dropout(self.fc2(F.gelu(self.fc1(x)))))


# ---------------------------------------------------------------------------
# Helpers for models that call SDPA on their own head-split tensors (MulT runs
# several directions as one batched call, so it cannot hold one
# MultiHeadAttention per direction). Same conventions as above: bool masks are
# True = attend; a zero-padded head dimension needs the true `scale`.
# ---------------------------------------------------------------------------


def padded_head_dim(head_dim: int, multiple: int) -> int:
    """The head dimension rounded up to `multiple` (fused SDPA kernels need head_dim % 8 == 0)."""
    return math.ceil(head_dim / multiple) * multiple


def offset_causal_allowed(
    t: int,
    s: int,
    *,
    q_lengths: Tensor | None = None,  # (N,) true query lengths (end padding); None = all t
    k_lengths: Tensor | None = None,  # (N,) true key lengths; None = all s
    device: torch.device | str | None = None,
) -> Tensor:
    """Bool (t, s) or (N, 1, t, s) mask, True = attend: query i sees key j iff j <= i + |S - T|.

    This is the causal mask of the MulT reference (`triu(-inf, 1 + |S - T|)`).
    For S >= T it is the lower-right causal mask (the last query sees every
    key); for S < T the window keeps its top-left anchor and is widened by
    T - S, so no query row is ever empty. With lengths, S and T are each
    sample's true lengths and keys at j >= S_n are masked too; padded query
    rows always see key 0, so SDPA never meets an all-masked row.
    """
    ref = q_lengths if q_lengths is not None else k_lengths
    if device is None and ref is not None:  # the lengths' device (a GPU's), not the CPU default
        device = ref.device
    i = torch.arange(t, device=device)
    j = torch.arange(s, device=device)
    if ref is None:
        return j[None, :] <= i[:, None] + abs(s - t)
    n = ref.shape[0]
    ql = q_lengths if q_lengths is not None else torch.full((n,), t, device=ref.device, dtype=ref.dtype)
    kl = k_lengths if k_lengths is not None else torch.full((n,), s, device=ref.device, dtype=ref.dtype)
    offset = (kl - ql).abs()  # (N,)
    allowed = j[None, None, :] <= i[None, :, None] + offset[:, None, None]  # (N, t, s)
    allowed = allowed & (j[None, None, :] < kl[:, None, None])
    return allowed[:, None]  # (N, 1, t, s)


def key_padding_allowed(k_lengths: Tensor, s: int) -> Tensor:
    """(N,) true key lengths -> (N, 1, 1, s) bool, True = a real key."""
    return (torch.arange(s, device=k_lengths.device)[None, :] < k_lengths[:, None])[:, None, None, :]


def offset_causal_mask(t: int, s: int, device: torch.device | str | None = None) -> tuple[object | None, bool]:
    """(attn_mask, is_causal) for SDPA implementing `offset_causal_allowed(t, s)` without lengths,
    in the form that keeps the fused kernels usable:

    - S == T: `is_causal=True` (flash / memory-efficient kernels);
    - S > T: `causal_lower_right(T, S)` (a CausalBias: flash / memory-efficient kernels
      with their native lower-right alignment; a materialised bool mask under
      torch.compile, which does not trace CausalBias, and under a dispatch mode such as
      FlopCounterMode, in which the CausalBias subclass cannot be created);
    - S < T and T >= 2S - 1: no mask at all (every key is visible to every query);
    - otherwise a bool (t, s) mask.
    """
    if s == t:
        return None, True
    if s > t:
        if torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None:
            return offset_causal_allowed(t, s, device=device), False
        from torch.nn.attention.bias import causal_lower_right

        return causal_lower_right(t, s), False
    if t >= 2 * s - 1:
        return None, False
    return offset_causal_allowed(t, s, device=device), False


def additive_mask(allowed: Tensor, dtype: torch.dtype) -> Tensor:
    """Bool mask (True = attend) -> additive float mask of `dtype` (0 / -inf).

    Built once and reused by every layer (SDPA would convert a bool mask on each
    call). The last dimension is allocated to a multiple of 16 and sliced back,
    so the memory-efficient CUDA kernel takes it without padding it per call.
    """
    s = allowed.shape[-1]
    s16 = math.ceil(s / 16) * 16
    out = torch.full((*allowed.shape[:-1], s16), float("-inf"), dtype=dtype, device=allowed.device)
    out = out[..., :s]
    out.masked_fill_(allowed, 0.0)
    return out
