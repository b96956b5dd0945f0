"""The MulT reference code's MULTModel (yaohungt/Multimodal-Transformer: src/models.py,
modules/transformer.py, modules/multihead_attention.py, modules/position_embedding.py), re-written
for tests from its source with its module names and its computation, independently of the exporter
(`xmodal.models.mult.reference`), so that an exported state dict is checked by loading it strictly
into this model, built from the exported `hyp_params`, and comparing outputs.

What it keeps of the reference: d = 30 fixed; kernel-1 projections without bias, skipped for an input
already 30 wide; every TransformerEncoder scales its inputs by sqrt(width) and adds fairseq's
sinusoidal positions, numbered 1.. where the input's first feature is non-zero (0 elsewhere: a zero
row); pre-LayerNorm layers whose first LayerNorm normalises queries and keys/values alike; the
offset causal mask triu(-inf, 1 + |S - T|) when `attn_mask`; three self-attention transformers of
max(layers, 3) layers always built; the last time step of each; the residual output MLP.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn

D = 30


class SinusoidalPositionalEmbedding(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim
        self.register_buffer("_float_tensor", torch.zeros(1))

    def forward(self, first_feature):  # (B, T) -> (B, T, dim)
        b, t = first_feature.shape
        half = self.dim // 2
        freq = torch.exp(torch.arange(half, dtype=torch.float) * -(math.log(10000) / (half - 1)))
        table = torch.arange(t + 1, dtype=torch.float)[:, None] * freq[None, :]
        table = torch.cat([table.sin(), table.cos()], dim=1)
        if self.dim % 2:
            table = torch.cat([table, torch.zeros(t + 1, 1)], dim=1)
        table[0] = 0  # fairseq's padding row
        positions = torch.arange(1, t + 1).expand(b, t) * first_feature.ne(0)
        return table[positions]


class MultiheadAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.in_proj_weight = nn.Parameter(torch.empty(3 * dim, dim))
        self.in_proj_bias = nn.Parameter(torch.empty(3 * dim))
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, q, k, v, mask):  # (T, B, D), (S, B, D), (S, B, D)
        t, b, d = q.shape
        w, bias = self.in_proj_weight.chunk(3), self.in_proj_bias.chunk(3)
        hd = d // self.heads
        q = F.linear(q, w[0], bias[0]) * hd ** -0.5
        k, v = F.linear(k, w[1], bias[1]), F.linear(v, w[2], bias[2])
        q, k, v = (x.reshape(x.shape[0], b * self.heads, hd).transpose(0, 1) for x in (q, k, v))
        scores = q @ k.transpose(1, 2)  # (B H, T, S)
        if mask is not None:
            scores = scores + mask
        out = scores.softmax(-1) @ v  # (B H, T, hd)
        return self.out_proj(out.transpose(0, 1).reshape(t, b, d))


class TransformerEncoderLayer(nn.Module):
    def __init__(self, dim: int, heads: int, attn_mask: bool):
        super().__init__()
        self.self_attn = MultiheadAttention(dim, heads)
        self.fc1, self.fc2 = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)
        self.layer_norms = nn.ModuleList([nn.LayerNorm(dim), nn.LayerNorm(dim)])
        self.attn_mask = attn_mask

    def forward(self, x, kv=None):
        h = self.layer_norms[0](x)
        src = h if kv is None else self.layer_norms[0](kv)
        t, s = x.shape[0], src.shape[0]
        mask = torch.triu(torch.full((t, s), float("-inf")), 1 + abs(s - t)) if self.attn_mask else None
        x = x + self.self_attn(h, src, src, mask)
        return x + self.fc2(F.relu(self.fc1(self.layer_norms[1](x))))


class TransformerEncoder(nn.Module):
    def __init__(self, dim: int, heads: int, layers: int, attn_mask: bool):
        super().__init__()
        self.embed_scale = math.sqrt(dim)
        self.embed_positions = SinusoidalPositionalEmbedding(dim)
        self.layers = nn.ModuleList(TransformerEncoderLayer(dim, heads, attn_mask) for _ in range(layers))
        self.register_buffer("version", torch.tensor([2.0]))
        self.layer_norm = nn.LayerNorm(dim)

    def embed(self, x):  # (T, B, D)
        return self.embed_scale * x + self.embed_positions(x.transpose(0, 1)[:, :, 0]).transpose(0, 1)

    def forward(self, x, kv=None):
        h = self.embed(x)
        src = None if kv is None else self.embed(kv)
        for layer in self.layers:
            h = layer(h, src)
        return self.layer_norm(h)


class MULTModel(nn.Module):
    """Eval-mode MULTModel (dropout is the identity there) built from `hyp_params` (a dict)."""

    def __init__(self, hyp: dict):
        super().__init__()
        h = self.hyp = SimpleNamespace(**hyp)
        self.proj_l = nn.Conv1d(h.orig_d_l, D, kernel_size=1, padding=0, bias=False)
        self.proj_a = nn.Conv1d(h.orig_d_a, D, kernel_size=1, padding=0, bias=False)
        self.proj_v = nn.Conv1d(h.orig_d_v, D, kernel_size=1, padding=0, bias=False)
        self.targets = [m for m, on in (("l", h.lonly), ("a", h.aonly), ("v", h.vonly)) if on]
        sources = {"l": ("a", "v"), "a": ("l", "v"), "v": ("l", "a")}
        for t in self.targets:
            for s in sources[t]:
                setattr(self, f"trans_{t}_with_{s}", TransformerEncoder(D, h.num_heads, h.layers, h.attn_mask))
        for m in ("l", "a", "v"):
            setattr(self, f"trans_{m}_mem", TransformerEncoder(2 * D, h.num_heads, max(h.layers, 3), h.attn_mask))
        self.sources = sources
        combined = 2 * D if len(self.targets) == 1 else 6 * D
        self.proj1, self.proj2 = nn.Linear(combined, combined), nn.Linear(combined, combined)
        self.out_layer = nn.Linear(combined, h.output_dim)

    def forward(self, x_l, x_a, x_v):  # (B, T, F) each
        x = {}
        for m, inp, orig in (("l", x_l, self.hyp.orig_d_l), ("a", x_a, self.hyp.orig_d_a), ("v", x_v, self.hyp.orig_d_v)):
            y = inp.transpose(1, 2)
            y = y if orig == D else getattr(self, f"proj_{m}")(y)
            x[m] = y.permute(2, 0, 1)  # (T, B, D)
        last = []
        for t in self.targets:
            hs = torch.cat([getattr(self, f"trans_{t}_with_{s}")(x[t], x[s]) for s in self.sources[t]], dim=2)
            last.append(getattr(self, f"trans_{t}_mem")(hs)[-1])
        last_hs = torch.cat(last, dim=1)
        return self.out_layer(self.proj2(F.relu(self.proj1(last_hs))) + last_hs), last_hs
