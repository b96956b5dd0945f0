"""LXMERT model: size, shapes, weight sharing, masking (no transformers needed)."""

from __future__ import annotations

import pytest
import torch

from xmodal.models.lxmert.model import LxmertForPretraining, preset
from xmodal_testing import all_logits


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() counts a tied weight once


def test_paper_preset_has_about_228m_parameters():
    # ~228 M for the full pretraining model (transformers' LxmertForPreTraining; docs/papers.md#lxmert-architecture).
    with torch.device("meta"):  # no 0.9 GB allocation, no init cost
        model = LxmertForPretraining(preset("paper"))
    assert abs(n_params(model) - 228e6) / 228e6 < 0.01, n_params(model)


def test_unknown_preset_names_the_valid_ones():
    with pytest.raises(KeyError, match="paper"):
        preset("huge")


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return LxmertForPretraining(preset("tiny")).eval()


def inputs(c, b=3, t=12, n=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    am = torch.arange(t)[None, :] < torch.tensor([t, 5, 9])[:b, None]  # (B, T)
    ids = torch.randint(1, c.vocab_size, (b, t), generator=g) * am
    feats = torch.randn(b, n, c.visual_feat_dim, generator=g)
    boxes = torch.rand(b, n, 4, generator=g)
    vm = torch.ones(b, n, dtype=torch.bool)
    vm[1, 4:] = False
    return ids, am, feats, boxes, vm


def test_output_and_head_shapes(tiny):
    c = tiny.config
    with torch.no_grad():
        out = tiny(*inputs(c))
        logits = all_logits(tiny, out)
    d = c.hidden_size
    assert out.lang.shape == (3, 12, d) and out.visn.shape == (3, 7, d) and out.pooled.shape == (3, d)
    assert logits["mlm"].shape == (3, 12, c.vocab_size)
    assert logits["match"].shape == (3, 2)
    assert logits["obj"].shape == (3, 7, c.num_object_labels)
    assert logits["attr"].shape == (3, 7, c.num_attr_labels)
    assert logits["feat"].shape == (3, 7, c.visual_feat_dim)
    assert logits["qa"].shape == (3, c.num_qa_labels)


def test_decoder_tied_and_cross_attention_shared(tiny):
    assert tiny.mlm_head.decoder_weight is tiny.encoder.word_embedding.word.weight
    for layer in tiny.encoder.x_layers:
        assert layer.cross_v is layer.cross_l
    unshared = LxmertForPretraining(preset("tiny").replace(shared_cross_attention=False))
    assert unshared.encoder.x_layers[0].cross_v is not unshared.encoder.x_layers[0].cross_l
    extra = sum(p.numel() for p in unshared.encoder.x_layers[0].cross_v.parameters())
    assert n_params(unshared) == n_params(tiny) + extra


def test_padding_is_ignored(tiny):
    c = tiny.config
    ids, am, feats, boxes, vm = inputs(c)
    ids2, feats2, boxes2 = ids.clone(), feats.clone(), boxes.clone()
    ids2[~am] = 3
    feats2[~vm] = 5.0
    boxes2[~vm] = 0.9
    with torch.no_grad():
        a, b = tiny(ids, am, feats, boxes, vm), tiny(ids2, am, feats2, boxes2, vm)
    torch.testing.assert_close(a.lang[am], b.lang[am])
    torch.testing.assert_close(a.visn[vm], b.visn[vm])
    torch.testing.assert_close(a.pooled, b.pooled)
    # ...while a real token does matter.
    ids2[0, 1] = (ids[0, 1] + 1) % c.vocab_size
    with torch.no_grad():
        assert not torch.allclose(tiny(ids2, am, feats, boxes, vm).pooled[0], a.pooled[0])


def test_pooler_and_token_type_options():
    c = preset("tiny")
    no_pool = LxmertForPretraining(c.replace(pooler=False)).eval()
    ids, am, feats, boxes, vm = inputs(c)
    with torch.no_grad():
        out = no_pool(ids, am, feats, boxes, vm)
    torch.testing.assert_close(out.pooled, out.lang[:, 0])  # the raw [CLS] state (paper §2.3)
    with_type = LxmertForPretraining(c.replace(token_type_embedding=True))
    assert with_type.encoder.word_embedding.token_type.weight.shape == (2, c.hidden_size)
    assert n_params(with_type) == n_params(LxmertForPretraining(c)) + 2 * c.hidden_size


def test_row0_no_grad_as_the_reference_padding_idx(tiny):
    """`no_grad_row0`: the same forward, and the position and token-type tables' row 0 get a zero gradient
    (the reference's nn.Embedding(padding_idx=0)); every other row gets its own, the unused ones zero."""
    import copy

    from xmodal.models.lxmert.model import no_grad_row0

    c = preset("tiny").replace(token_type_embedding=True)
    torch.manual_seed(0)
    default = LxmertForPretraining(c)
    reference = no_grad_row0(copy.deepcopy(default))
    ids, am, feats, boxes, vm = inputs(c)
    grads = []
    for model in (default, reference):
        out = model.encoder(ids, am, feats, boxes, vm)
        (out.lang.square().sum() + out.pooled.sum()).backward()
        emb = model.encoder.word_embedding
        grads.append((out.lang.detach(), emb.position.weight.grad, emb.token_type.weight.grad))
    (lang_a, pos_a, type_a), (lang_b, pos_b, type_b) = grads
    torch.testing.assert_close(lang_a, lang_b, rtol=0, atol=1e-6)
    assert pos_a[0].abs().sum() > 0 and type_a[0].abs().sum() > 0  # trained by default
    assert pos_b[0].abs().sum() == 0 and type_b[0].abs().sum() == 0  # not under the reference's padding_idx
    torch.testing.assert_close(pos_b[1:], pos_a[1:], rtol=1e-5, atol=1e-6)
    assert type_b.shape == type_a.shape and type_b[1].abs().sum() == 0  # a zero gradient, not None: decay applies
