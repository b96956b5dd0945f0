"""Parity with transformers' LxmertForPreTraining and the checkpoint adapter (fp32, CPU)."""

from __future__ import annotations

import json

import pytest
import torch

from xmodal.models.lxmert.hf import (
    HF_DEFAULTS,
    config_from_hf,
    config_to_hf,
    from_pretrained_dir,
    load_hf_state_dict,
)
from xmodal.models.lxmert.model import LxmertForPretraining, preset
from xmodal_testing import all_logits

transformers = pytest.importorskip("transformers")

B, T, N = 2, 20, 36
TOL = 1e-4


def small_hf_config(**overrides):
    kw = dict(
        vocab_size=99, hidden_size=32, num_attention_heads=4, intermediate_size=48, l_layers=2, r_layers=2,
        x_layers=2, max_position_embeddings=40, visual_feat_dim=24, num_object_labels=11, num_attr_labels=7,
        num_qa_labels=9, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
    )
    return transformers.LxmertConfig(**{**kw, **overrides})


def random_hf_model(hf_config, seed=0):
    """HF model with EVERY parameter random (HF initialises biases to 0 and LayerNorms to 1,
    which would hide a bias or LayerNorm mapped to the wrong place)."""
    torch.manual_seed(seed)
    hf = transformers.LxmertForPreTraining(hf_config).eval()
    with torch.no_grad():
        for p in hf.parameters():  # tied decoder = word embedding: one Parameter, drawn once
            p.normal_(0.0, 0.1).add_(0.05)
    return hf


def parity_inputs(vocab_size, feat_dim, seed=1):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([T, 11])  # sentence 2 is padded
    attention_mask = torch.arange(T)[None, :] < lengths[:, None]  # (B, T)
    input_ids = torch.randint(1, vocab_size, (B, T), generator=g) * attention_mask
    feats = torch.randn(B, N, feat_dim, generator=g)
    xy = torch.rand(B, N, 2, generator=g) * 0.5
    boxes = torch.cat([xy, xy + 0.5 * torch.rand(B, N, 2, generator=g)], -1)
    visual_mask = torch.ones(B, N, dtype=torch.bool)
    visual_mask[1, 30:] = False  # image 2 has 30 objects
    return input_ids, attention_mask, feats, boxes, visual_mask


def converted(hf):
    ours = LxmertForPretraining(config_from_hf(hf.config)).eval()
    return load_hf_state_dict(ours, hf.state_dict())


@pytest.fixture(scope="module")
def hf_and_ours():
    hf = random_hf_model(small_hf_config())
    return hf, converted(hf)


def test_outputs_and_every_head_match_transformers(hf_and_ours):
    hf, ours = hf_and_ours
    ids, am, feats, boxes, vm = parity_inputs(hf.config.vocab_size, hf.config.visual_feat_dim)
    with torch.no_grad():
        # HF turns the 0/1 masks into additive finfo.min biases; we pass booleans to SDPA.
        h = hf.lxmert(input_ids=ids, visual_feats=feats, visual_pos=boxes, attention_mask=am.long(),
                      visual_attention_mask=vm.long(), return_dict=True)
        full = hf(input_ids=ids, visual_feats=feats, visual_pos=boxes, attention_mask=am.long(),
                  visual_attention_mask=vm.long(), return_dict=True)
        hf_visual = hf.obj_predict_head(h.vision_output)
        out = ours(ids, am, feats, boxes, vm)
        logits = all_logits(ours, out)

    lang_valid, visn_valid = am[..., None], vm[..., None]
    checks = {
        "lang": (out.lang, h.language_output, lang_valid),
        "visn": (out.visn, h.vision_output, visn_valid),
        "pooled": (out.pooled, h.pooled_output, None),
        "mlm": (logits["mlm"], full.prediction_logits, lang_valid),
        "match": (logits["match"], full.cross_relationship_score, None),
        "qa": (logits["qa"], full.question_answering_score, None),
        "obj": (logits["obj"], hf_visual["obj"], visn_valid),
        "attr": (logits["attr"], hf_visual["attr"], visn_valid),
        "feat": (logits["feat"], hf_visual["feat"], visn_valid),
    }
    for name, (mine, theirs, valid) in checks.items():
        assert mine.shape == theirs.shape, name
        if valid is not None:  # compare at real tokens / objects only
            mine, theirs = mine.masked_fill(~valid, 0), theirs.masked_fill(~valid, 0)
        err = (mine - theirs).abs().max().item()
        assert err < TOL, f"{name}: max abs diff {err:.2e}"


def test_padding_changes_nothing_at_valid_positions(hf_and_ours):
    """Both models ignore padded keys: different ids/features at padding leave valid outputs equal."""
    _, ours = hf_and_ours
    ids, am, feats, boxes, vm = parity_inputs(ours.config.vocab_size, ours.config.visual_feat_dim)
    ids2, feats2 = ids.clone(), feats.clone()
    ids2[~am] = 7
    feats2[~vm] = 3.0
    with torch.no_grad():
        a, b = ours(ids, am, feats, boxes, vm), ours(ids2, am, feats2, boxes, vm)
    torch.testing.assert_close(a.lang[am], b.lang[am], atol=1e-6, rtol=0)
    torch.testing.assert_close(a.visn[vm], b.visn[vm], atol=1e-6, rtol=0)
    torch.testing.assert_close(a.pooled, b.pooled, atol=1e-6, rtol=0)


def test_config_mapping_both_ways():
    hf_config = small_hf_config()
    ours = config_from_hf(hf_config)
    assert (ours.hidden_size, ours.num_heads, ours.ffn_size) == (32, 4, 48)
    assert (ours.l_layers, ours.r_layers, ours.x_layers, ours.max_positions) == (2, 2, 2, 40)
    assert (ours.num_object_labels, ours.num_attr_labels, ours.num_qa_labels) == (11, 7, 9)
    assert ours.token_type_embedding and ours.shared_cross_attention and ours.pooler
    assert ours.layer_norm_eps == 1e-12
    # Round trip, and the dict form (config.json) gives the same config.
    assert config_from_hf(config_to_hf(ours)) == ours
    assert config_from_hf(hf_config.to_dict()) == ours
    # HF defaults are the paper: our paper preset is HF's default config.
    assert config_from_hf(transformers.LxmertConfig()) == preset("paper")
    assert config_from_hf({}) == preset("paper")
    back = config_to_hf(preset("paper"))
    default = transformers.LxmertConfig()
    for key in HF_DEFAULTS:
        assert getattr(back, key) == getattr(default, key), key


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="hidden_act"):
        config_from_hf({"hidden_act": "relu"})
    with pytest.raises(ValueError, match="model_type"):
        config_from_hf({"model_type": "bert"})
    with pytest.raises(ValueError, match="token_type_embedding"):
        config_to_hf(preset("tiny"))  # the tiny preset has no token-type embedding


def test_strict_loading_reports_missing_unexpected_and_shape(hf_and_ours):
    hf, _ = hf_and_ours
    sd = hf.state_dict()
    model = LxmertForPretraining(config_from_hf(hf.config))

    missing = {k: v for k, v in sd.items() if not k.startswith("answer_head.")}
    with pytest.raises(KeyError, match=r"qa_head\.fc1\.weight.*answer_head\.logit_fc\.0\.weight"):
        load_hf_state_dict(model, missing)

    extra = {**sd, "lxmert.encoder.layer.7.output.dense.weight": torch.zeros(1)}
    with pytest.raises(KeyError, match=r"lxmert\.encoder\.layer\.7\.output\.dense\.weight"):
        load_hf_state_dict(model, extra)

    # A 3-layer checkpoint into a 2-layer model: the third layer's keys are unexpected.
    bigger = transformers.LxmertForPreTraining(small_hf_config(l_layers=3)).state_dict()
    with pytest.raises(KeyError, match=r"layer\.2\."):
        load_hf_state_dict(model, bigger)

    wrong = LxmertForPretraining(config_from_hf(hf.config).replace(num_qa_labels=5))
    with pytest.raises(ValueError, match=r"qa_head\.fc2\.weight.*\(9, 64\).*\(5, 64\)"):
        load_hf_state_dict(wrong, sd)

    untied = dict(sd)
    untied["cls.predictions.decoder.weight"] = sd["cls.predictions.decoder.weight"] + 1
    with pytest.raises(ValueError, match="tied"):
        load_hf_state_dict(model, untied)


def test_from_pretrained_dir_reads_safetensors_and_bin(tmp_path, hf_and_ours):
    hf, ours = hf_and_ours
    hf.save_pretrained(tmp_path / "st")  # config.json (diff to defaults only) + model.safetensors
    assert (tmp_path / "st" / "model.safetensors").is_file()

    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text(json.dumps(hf.config.to_dict()))
    torch.save(hf.state_dict(), tmp_path / "bin" / "pytorch_model.bin")

    ids, am, feats, boxes, vm = parity_inputs(hf.config.vocab_size, hf.config.visual_feat_dim)
    with torch.no_grad():
        want = all_logits(ours, ours(ids, am, feats, boxes, vm))
        for sub in ("st", "bin"):
            loaded = from_pretrained_dir(tmp_path / sub)
            assert loaded.config == ours.config
            got = all_logits(loaded, loaded(ids, am, feats, boxes, vm))
            for k in want:
                torch.testing.assert_close(got[k], want[k], atol=0, rtol=0)

    with pytest.raises(FileNotFoundError, match="config.json"):
        from_pretrained_dir(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        from_pretrained_dir(tmp_path / "empty")


def test_to_hf_state_dict_inverts_the_mapping_exactly(hf_and_ours):
    """ours -> transformers' names -> ours is the identity, and gives transformers' own state dict back."""
    from xmodal.models.lxmert.hf import convert_hf_state_dict, to_hf_state_dict

    hf, ours = hf_and_ours
    theirs = to_hf_state_dict(ours.config, ours.state_dict())
    want = hf.state_dict()
    assert theirs.keys() == want.keys()
    assert all(torch.equal(theirs[k], want[k]) for k in want)
    back = convert_hf_state_dict(ours.config, theirs)
    assert all(torch.equal(back[k], v) for k, v in ours.state_dict().items()) and back.keys() == ours.state_dict().keys()

    with pytest.raises(KeyError, match=r"no place in transformers' pretraining model: extra\.weight"):
        to_hf_state_dict(ours.config, {**ours.state_dict(), "extra.weight": torch.zeros(1)})
    split = dict(ours.state_dict())
    split["encoder.x_layers.0.cross_v.attn.out_proj.weight"] = split["encoder.x_layers.0.cross_v.attn.out_proj.weight"] + 1
    with pytest.raises(ValueError, match="visual_attention.output.dense.weight gets two different values"):
        to_hf_state_dict(ours.config, split)
