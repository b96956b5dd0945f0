"""The cross-attention the example pages draw (`recording_cross_attention`): the probabilities the
model's own attention used, read by a hook only inside the block."""

from __future__ import annotations

import pytest
import torch

from xmodal.models.lxmert.model import PRESETS, LxmertEncoder, recording_cross_attention

pytestmark = pytest.mark.usefixtures("one_thread")


def inputs(c, b=3, t=7, n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, c.vocab_size, (b, t), generator=g)
    mask = torch.ones(b, t, dtype=torch.bool)
    mask[1, 5:] = False
    feats, boxes = torch.randn(b, n, c.visual_feat_dim, generator=g), torch.rand(b, n, 4, generator=g)
    vmask = torch.ones(b, n, dtype=torch.bool)
    vmask[0, 4:] = False  # image 0 has 4 real boxes
    return ids, mask, feats, boxes, vmask


def test_the_recorded_weights_are_those_the_attention_applied():
    """Multiplied by the values and projected, the recorded weights give the attention module's own
    output (its fused SDPA call) for every layer."""
    c = PRESETS["tiny"].replace(x_layers=2)
    torch.manual_seed(0)
    enc = LxmertEncoder(c).eval()
    calls = []
    hooks = [layer.cross_l.attn.register_forward_hook(lambda m, a, out: calls.append((a, out)))
             for layer in enc.x_layers]
    with torch.no_grad(), recording_cross_attention(enc) as found:
        enc(*inputs(c))
    for h in hooks:
        h.remove()
    # cross_l serves both directions (shared): each layer's language-side call has the 7 words as queries
    language = [call for call in calls if call[0][0].shape[1] == 7]
    assert len(found) == len(language) == c.x_layers
    for layer, probs, ((_, context, _), out) in zip(enc.x_layers, found, language, strict=True):
        attn = layer.cross_l.attn
        v = torch.nn.functional.linear(context, attn.in_proj.weight[2 * attn.dim:], attn.in_proj.bias[2 * attn.dim:])
        v = v.unflatten(-1, (attn.num_heads, attn.head_dim)).transpose(1, 2)  # (B, H, N, dh)
        mixed = (probs @ v).transpose(1, 2).flatten(-2)  # (B, T, D)
        torch.testing.assert_close(attn.out_proj(mixed), out, atol=1e-5, rtol=1e-4)
        assert probs.shape == (3, c.num_heads, 7, 6)
        torch.testing.assert_close(probs.sum(-1), torch.ones(3, c.num_heads, 7))
        assert (probs[0, :, :, 4:] == 0).all()  # padded boxes get nothing


def test_known_weights_give_known_attention():
    """With the query projection zeroed, every word attends uniformly over the real boxes."""
    c = PRESETS["tiny"]
    torch.manual_seed(0)
    enc = LxmertEncoder(c).eval()
    attn = enc.x_layers[0].cross_l.attn
    with torch.no_grad():
        attn.in_proj.weight[: attn.dim].zero_()
        attn.in_proj.bias[: attn.dim].zero_()
        with recording_cross_attention(enc) as found:
            enc(*inputs(c))
    probs = found[0]
    torch.testing.assert_close(probs[0, :, :, :4], torch.full((c.num_heads, 7, 4), 0.25))
    torch.testing.assert_close(probs[1:], torch.full((2, c.num_heads, 7, 6), 1 / 6))


def test_outside_the_block_nothing_is_recorded():
    c = PRESETS["tiny"]
    enc = LxmertEncoder(c).eval()
    with torch.no_grad():
        with recording_cross_attention(enc) as found:
            enc(*inputs(c))
        enc(*inputs(c))
    assert len(found) == c.x_layers
    assert all(not layer._forward_pre_hooks for layer in enc.x_layers)
