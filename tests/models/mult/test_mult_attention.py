"""MulT's crossmodal attention as the example pages draw it (`recording_crossmodal_attention`): the
weights of each direction and layer equal those of the plain reference architecture's
nn.MultiheadAttention (one module per direction, the reference's float causal mask)."""

from __future__ import annotations

import pytest
import torch

from xmodal.models.mult.config import preset
from xmodal.models.mult.model import Mult, recording_crossmodal_attention
from xmodal_bench.mult import PlainMult

pytestmark = pytest.mark.usefixtures("one_thread")

DIMS = (12, 6, 5)  # the tiny preset's l, a, v feature dims


def inputs(b, lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, t, d, generator=g) for t, d in zip(lens, DIMS, strict=True)]


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("lens", [(7, 11, 5), (9, 3, 5)])
def test_recorded_weights_equal_the_plain_models(causal, lens):
    torch.manual_seed(0)
    c = preset("tiny").replace(causal=causal, layers=2)
    m = Mult(c).eval()
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn(p.shape) * 0.2)
    plain = PlainMult(c).load_from(m).eval()
    seen: dict[tuple[str, int], torch.Tensor] = {}
    for name, enc in plain.cross.items():
        for i, layer in enumerate(enc.layers):
            original = layer.attn.forward

            def weighed(q, k, v, *a, _orig=original, _key=(name, i), **kw):
                kw.update(need_weights=True, average_attn_weights=False)
                out, w = _orig(q, k, v, *a, **kw)
                seen[_key] = w
                return out, w

            layer.attn.forward = weighed
    x = inputs(3, lens)
    with torch.no_grad():
        with recording_crossmodal_attention(m) as found:
            m(*x)
        plain(*x)
    assert set(found) == {(i, d) for i in range(2) for d in m.directions}
    for (i, (s, t)), w in found.items():
        assert w.shape == (3, c.num_heads, lens["lav".index(t)], lens["lav".index(s)])
        torch.testing.assert_close(w, seen[(f"{s}{t}", i)], atol=1e-5, rtol=1e-4)
    m(*x)
    assert m.crossmodal.record is None  # outside the block nothing is kept


def test_padded_keys_get_nothing():
    """With lengths, a clip's padded source steps get no weight; with the query projection zeroed, each
    step attends uniformly over the real steps it may see."""
    c = preset("tiny").replace(causal=False, layers=1)
    m = Mult(c).eval()
    with torch.no_grad():
        m.crossmodal.in_proj_weight[:, :, : c.dim].zero_()
        m.crossmodal.in_proj_bias[:, :, : c.dim].zero_()
    lengths = (torch.tensor([7, 3]), torch.tensor([11, 4]), torch.tensor([5, 2]))
    with torch.no_grad(), recording_crossmodal_attention(m) as found:
        m(*inputs(2, (7, 11, 5)), lengths=lengths)
    w = found[(0, ("a", "l"))]  # text attending to audio: (B, H, T_l, S_a)
    torch.testing.assert_close(w[1, :, :3, :4], torch.full((c.num_heads, 3, 4), 0.25))
    assert (w[1, :, :, 4:] == 0).all()
    torch.testing.assert_close(w[0], torch.full((c.num_heads, 7, 11), 1 / 11))
