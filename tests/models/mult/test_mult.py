"""MulT: every variant, equivalence with a plain per-direction implementation, padding invariance,
causal-mask semantics, and the memory / speed levers leaving the numbers unchanged."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from xmodal.models.attention import (
    additive_mask,
    offset_causal_allowed,
    offset_causal_mask,
)
from xmodal.models.mult.config import VARIANTS, preset
from xmodal.models.mult.model import Mult
from xmodal_bench.mult import PlainMult, reference_future_mask

DIMS = (12, 6, 5)  # tiny preset's l, a, v feature dims


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def _inputs(b: int, lens: tuple[int, int, int], seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(b, t, d, generator=g) for t, d in zip(lens, DIMS, strict=True)]


def _perturb(model: torch.nn.Module, scale: float = 0.2, seed: int = 1) -> None:
    """Move LayerNorm / bias parameters off their 1 / 0 init so that every parameter matters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("padded", [False, True])
def test_every_variant_forward_backward(variant, padded):
    out_dim = 8 if variant == "full" else 1
    m = Mult(preset("tiny").replace(variant=variant, output_dim=out_dim))
    x = _inputs(3, (7, 11, 5))
    lengths = (torch.tensor([7, 3, 1]), torch.tensor([11, 4, 9]), torch.tensor([5, 1, 2])) if padded else None
    out = m(*x, lengths=lengths)
    assert out.output.shape == (3, out_dim)
    assert out.hidden.shape == (3, m.combined_dim)
    expected = {"full": 96, "intermediate": 96, "early_fusion": 16, "late_fusion": 48}.get(
        variant, 32 if variant.startswith("target_") else 16)
    assert m.combined_dim == expected
    out.output.square().sum().backward()
    missing = [n for n, p in m.named_parameters() if p.grad is None or not torch.isfinite(p.grad).all()]
    assert not missing, f"{variant}: no / bad gradient for {missing}"


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("lens", [(7, 11, 5), (4, 9, 9), (6, 6, 6), (9, 3, 5)])
def test_batched_directions_equal_plain_per_direction_model(causal, lens):
    """The grouped / folded / head-padded implementation computes what one plain module per
    direction computes (nn.MultiheadAttention, the reference's float causal mask).
    (9, 3, 5) has S < T with and without a mask; (7, 11, 5) has S > T (lower-right) and
    a bool mask for [V -> L] (5 < 7 < 2 * 5 - 1)."""
    torch.manual_seed(0)
    c = preset("tiny").replace(causal=causal, l_kernel=3, a_kernel=1, v_kernel=5, layers=2, self_layers=2)
    m = Mult(c).eval()
    _perturb(m)
    plain = PlainMult(c).load_from(m).eval()
    x = _inputs(3, lens)
    with torch.no_grad():
        torch.testing.assert_close(m(*x).output, plain(*x), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("causal", [True, False])
def test_padding_invariance(variant, causal):
    """A sample padded at the end inside a batch gives the output it gives alone, unpadded."""
    torch.manual_seed(0)
    m = Mult(preset("tiny").replace(variant=variant, causal=causal, a_kernel=3, v_kernel=3)).eval()
    _perturb(m)
    true = [(5, 9, 4), (2, 12, 1), (7, 3, 6)]
    t_max = [max(s[i] for s in true) + 2 for i in range(3)]
    singles = [_inputs(1, s, seed=i) for i, s in enumerate(true)]
    batch = []
    for mod in range(3):
        rows = [F.pad(x[mod], (0, 0, 0, t_max[mod] - x[mod].shape[1])) for x in singles]
        batch.append(torch.cat(rows))
    # Garbage in the padding must not matter either (the model zeroes it).
    for mod in range(3):
        for i, s in enumerate(true):
            batch[mod][i, s[mod]:] = 7.0
    lengths = tuple(torch.tensor([s[i] for s in true]) for i in range(3))
    with torch.no_grad():
        together = m(*batch, lengths=lengths).output
        alone = torch.cat([m(*x).output for x in singles])
        alone_len = torch.cat([m(*x, lengths=tuple(torch.tensor([t]) for t in s)).output
                               for x, s in zip(singles, true, strict=True)])
    torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(alone_len, alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("t,s", [(3, 3), (3, 5), (5, 3), (7, 3), (4, 7), (1, 6), (6, 1)])
def test_offset_causal_mask_is_the_reference_mask(t, s):
    ref = reference_future_mask(t, s) == 0  # True = attend
    assert torch.equal(offset_causal_allowed(t, s), ref)
    if s >= t:  # lower-right aligned: the last query sees every key
        assert ref[-1].all()
        assert torch.equal(ref, torch.ones(t, s, dtype=torch.bool).tril(s - t))
    # Every fused form used without lengths attends exactly like the bool mask.
    q, k, v = torch.randn(2, 2, t, 8), torch.randn(2, 2, s, 8), torch.randn(2, 2, s, 8)
    mask, is_causal = offset_causal_mask(t, s)
    fused = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)
    plain = F.scaled_dot_product_attention(q, k, v, attn_mask=additive_mask(ref, q.dtype))
    torch.testing.assert_close(fused, plain)


def test_offset_causal_mask_with_lengths_is_per_sample():
    t, s = 6, 9
    q_len, k_len = torch.tensor([6, 2, 4]), torch.tensor([9, 7, 3])
    got = offset_causal_allowed(t, s, q_lengths=q_len, k_lengths=k_len)[:, 0]  # (N, t, s)
    for n in range(3):
        tq, sk = int(q_len[n]), int(k_len[n])
        assert torch.equal(got[n, :tq, :sk], offset_causal_allowed(tq, sk))
        assert not got[n, :, sk:].any()  # padded keys never attended
        assert got[n, :, 0].all()  # no empty row, padded query rows included


def test_causal_crossmodal_outputs_ignore_keys_outside_the_window():
    """[A -> L] with T_l = 4, T_a = 10: text position i may read audio steps j <= i + 6 only."""
    torch.manual_seed(0)
    m = Mult(preset("tiny").replace(causal=True, layers=2)).eval()
    x = _inputs(2, (4, 10, 4))
    with torch.no_grad():
        emb = {k: m.embed[k](v, None) for k, v in zip("lav", x, strict=True)}
        base = m._crossmodal(emb, None)[("a", "l")]
        emb["a"] = emb["a"].clone()
        emb["a"][:, 8] += 3.0 * torch.randn(emb["a"].shape[-1])  # visible from text positions i >= 2 only
        moved = m._crossmodal(emb, None)[("a", "l")]
    torch.testing.assert_close(moved[:, :2], base[:, :2])
    assert (moved[:, 2:] - base[:, 2:]).abs().amax() > 1e-3


def test_intermediate_equals_full_with_one_layer():
    """With D = 1 both read the low-level sources, so the variants coincide."""
    torch.manual_seed(0)
    full = Mult(preset("tiny").replace(layers=1)).eval()
    inter = Mult(preset("tiny").replace(layers=1, variant="intermediate")).eval()
    inter.load_state_dict(full.state_dict())
    x = _inputs(2, (5, 8, 6))
    with torch.no_grad():
        torch.testing.assert_close(inter(*x).output, full(*x).output)
    deep = Mult(preset("tiny").replace(layers=2)).eval()
    deep_inter = Mult(preset("tiny").replace(layers=2, variant="intermediate")).eval()
    deep_inter.load_state_dict(deep.state_dict())
    with torch.no_grad():
        assert not torch.allclose(deep_inter(*x).output, deep(*x).output)


def test_head_padding_and_ffn_recompute_change_nothing():
    torch.manual_seed(0)
    base_cfg = preset("tiny").replace(dim=18, num_heads=3, relu_dropout=0.2, res_dropout=0.1, attn_dropout=0.1,
                                      embed_dropout=0.1, text_dropout=0.1)
    ref = Mult(base_cfg.replace(pad_head_dim_to=1, recompute_ffn=False))
    fast = Mult(base_cfg.replace(pad_head_dim_to=8, recompute_ffn=True))
    fast.load_state_dict(ref.state_dict())
    assert fast.crossmodal.padded_head_dim == 8 and ref.crossmodal.padded_head_dim == 6
    x = _inputs(3, (6, 9, 7))
    grads = []
    for m in (ref, fast):
        torch.manual_seed(123)  # same dropout masks
        m(*x).output.sum().backward()
        grads.append({n: p.grad for n, p in m.named_parameters()})
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-4, atol=1e-5, msg=n)


@pytest.mark.parametrize("compute_dtype", [torch.bfloat16, None], ids=["declared", "bare-autocast"])
def test_bf16_autocast_runs(compute_dtype):
    """bf16 as training runs it (the compute dtype declared: weights and masks cast once per forward),
    and under a bare autocast (matmuls cast per use): the same result up to bf16 rounding."""
    m = Mult(preset("tiny"))
    x = [t.half() for t in _inputs(2, (5, 8, 6))]  # features travel as float16
    lengths = (torch.tensor([5, 2]), torch.tensor([8, 3]), torch.tensor([6, 6]))
    with torch.no_grad():
        ref = m(*x, lengths=lengths).output
    m.compute_dtype = compute_dtype
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = m(*x, lengths=lengths).output
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    torch.testing.assert_close(out.float(), ref, atol=0.05, rtol=0.05)


@pytest.mark.parametrize("given", ["q", "k", "both"])
def test_offset_causal_mask_with_lengths_is_on_the_lengths_device(given):
    # The meta device stands in for a GPU: a mask built on the CPU default would not meet its lengths.
    lengths = torch.tensor([5, 3], device="meta")
    kwargs = {"q": {"q_lengths": lengths}, "k": {"k_lengths": lengths},
              "both": {"q_lengths": lengths, "k_lengths": lengths}}[given]
    mask = offset_causal_allowed(6, 9, **kwargs)
    assert mask.device.type == "meta" and mask.shape == (2, 1, 6, 9)
