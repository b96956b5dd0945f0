"""MulT's stacked transformer streams (xmodal.models.mult.streams): the LayerNorm affines folded into the
projections give the plain pre-LN layer's numbers, and streams run together as one group give what each
gives alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from xmodal.models.mult.streams import StreamStack

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _stack(pad_head_dim_to: int = 1) -> StreamStack:
    torch.manual_seed(0)
    stack = StreamStack(("a", "b", "c"), 2, 8, 2, ffn_mult=2, attn_dropout=(0.0, 0.0, 0.0), relu_dropout=0.0,
                        res_dropout=0.0, pad_head_dim_to=pad_head_dim_to)
    with torch.no_grad():  # LayerNorm affines away from (1, 0), so that folding them is tested
        for p in (stack.ln1_weight, stack.ln1_bias, stack.ln2_weight, stack.ln2_bias):
            p.add_(0.3 * torch.randn_like(p))
    return stack.eval()


def _plain_layer(stack: StreamStack, i: int, j: int, x: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
    """Layer i of stream j written out as the reference's pre-LN layer, from the stack's own parameters."""
    st = stack.stream_state(j, i)
    d, h = stack.dim, stack.num_heads
    ln = lambda t, n: F.layer_norm(t, (d,), st[f"{n}.weight"], st[f"{n}.bias"])  # noqa: E731
    w_q, w_k, w_v = st["attn.in_proj_weight"].chunk(3)
    b_q, b_k, b_v = st["attn.in_proj_bias"].chunk(3)
    q, k, v = F.linear(ln(x, "ln1"), w_q, b_q), F.linear(ln(kv, "ln1"), w_k, b_k), F.linear(ln(kv, "ln1"), w_v, b_v)
    heads = lambda t: t.view(t.shape[0], t.shape[1], h, d // h).transpose(1, 2)  # noqa: E731
    o = F.scaled_dot_product_attention(heads(q), heads(k), heads(v)).transpose(1, 2).reshape(x.shape)
    x = x + F.linear(o, st["attn.out_proj.weight"], st["attn.out_proj.bias"])
    f = F.linear(F.relu(F.linear(ln(x, "ln2"), st["fc1.weight"], st["fc1.bias"])), st["fc2.weight"], st["fc2.bias"])
    return x + f


@pytest.mark.parametrize("pad_head_dim_to", [1, 8])
def test_a_crossmodal_layer_is_the_plain_pre_ln_layer_and_groups_change_nothing(pad_head_dim_to):
    stack = _stack(pad_head_dim_to)
    g = torch.Generator().manual_seed(1)
    x, kv = torch.randn(3, 2, 5, 8, generator=g), torch.randn(3, 2, 7, 8, generator=g)  # (G, B, T, D), (G, B, S, D)
    kv_hat = F.layer_norm(kv, (8,))  # the source normalised once; the layer's affine is folded into K/V
    with torch.no_grad():
        together = stack.layer(stack.weights(0, 3), 1, x, kv_hat, None, False, 0.0)
        alone = torch.cat([stack.layer(stack.weights(j, j + 1), 1, x[j:j + 1], kv_hat[j:j + 1], None, False, 0.0)
                           for j in range(3)])
        plain = torch.stack([_plain_layer(stack, 1, j, x[j], kv[j]) for j in range(3)])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(together, plain, rtol=1e-4, atol=1e-4)


def test_a_width_the_heads_do_not_divide_is_refused():
    with pytest.raises(ValueError, match="hidden size 10 is not divisible by num_heads 4"):
        StreamStack(("a",), 1, 10, 4, ffn_mult=2, attn_dropout=(0.0,), relu_dropout=0.0, res_dropout=0.0,
                    pad_head_dim_to=1)
