"""LXMERT fine-tuning models and their initialisation from pretraining (tiny preset, CPU)."""

from __future__ import annotations

import pytest
import torch

from xmodal.data.answers import AnswerTable
from xmodal.models.lxmert.finetune import LxmertForNlvr2, LxmertForQuestionAnswering
from xmodal.models.lxmert.init import (
    PretrainedWeightsError,
    encoder_state_from_hf_dir,
    init_answer_head_from_qa,
    load_pretrained_encoder,
    strip_wrappers,
)
from xmodal.models.lxmert.model import LxmertForPretraining, preset
from xmodal.objectives.pretraining import PretrainingObjective, PretrainTasks

CFG = preset("tiny")
B, T, N = 3, 9, 5


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def inputs(b=B, pair=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, T + 1, (b,), generator=g)
    am = torch.arange(T)[None, :] < lengths[:, None]  # (B, T)
    ids = torch.randint(5, CFG.vocab_size, (b, T), generator=g) * am
    lead = (b, 2) if pair else (b,)
    feats = torch.randn(*lead, N, CFG.visual_feat_dim, generator=g)
    xy = torch.rand(*lead, N, 2, generator=g) * 0.5
    boxes = torch.cat([xy, xy + 0.5 * torch.rand(*lead, N, 2, generator=g)], -1)
    vm = torch.ones(*lead, N, dtype=torch.bool)
    vm[..., -1, -2:] = False  # the last example (and its second image) has fewer objects
    return ids, am, feats, boxes, vm


def pretrained(seed=1, **changes) -> LxmertForPretraining:
    torch.manual_seed(seed)
    return LxmertForPretraining(CFG.replace(**changes)).eval()


# -- models ------------------------------------------------------------------------------------


def test_qa_logits_shape_and_bert_init():
    torch.manual_seed(0)
    model = LxmertForQuestionAnswering(CFG, num_answers=7).eval()
    assert model(*inputs()).shape == (B, 7)
    head = model.answer_head
    assert torch.equal(head.fc2.bias, torch.zeros(7)) and torch.equal(head.norm.weight, torch.ones(2 * CFG.hidden_size))
    assert abs(float(head.fc1.weight.detach().std()) - 0.02) < 0.003
    # Same state-dict names as the pretraining encoder.
    assert set(model.encoder.state_dict()) == {k[len("encoder."):] for k in pretrained().state_dict()
                                               if k.startswith("encoder.")}


def test_nlvr2_one_encoder_call_equals_two_separate_encodings():
    torch.manual_seed(0)
    model = LxmertForNlvr2(CFG, output="softmax").eval()
    ids, am, feats, boxes, vm = inputs(pair=True)
    with torch.no_grad():
        logits = model(ids, am, feats, boxes, vm)  # (B, 2)
        x0 = model.encoder(ids, am, feats[:, 0], boxes[:, 0], vm[:, 0]).pooled  # (B, D)
        x1 = model.encoder(ids, am, feats[:, 1], boxes[:, 1], vm[:, 1]).pooled
        expected = model.classifier(torch.cat([x0, x1], -1))  # [x0; x1], Appendix B
        swapped = model.classifier(torch.cat([x1, x0], -1))
    assert logits.shape == (B, 2)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    assert not torch.allclose(logits, swapped, atol=1e-4)
    c = model.classifier
    assert c.fc1.weight.shape == (2 * CFG.hidden_size, 2 * CFG.hidden_size) and c.fc2.weight.shape[0] == 2
    assert torch.equal(c.fc1.bias, torch.zeros(2 * CFG.hidden_size))


def test_nlvr2_sigmoid_head_has_one_output_and_bad_pairs_are_refused():
    model = LxmertForNlvr2(CFG, output="sigmoid").eval()
    ids, am, feats, boxes, vm = inputs(pair=True)
    assert model(ids, am, feats, boxes, vm).shape == (B, 1)
    with pytest.raises(ValueError, match=r"expected \(B, 2, N, F\)"):
        model(ids, am, torch.cat([feats, feats[:, :1]], 1), torch.cat([boxes, boxes[:, :1]], 1), None)
    with pytest.raises(ValueError, match="'softmax' .* 'sigmoid'"):
        LxmertForNlvr2(CFG, output="tanh")


# -- loading the pretrained encoder ------------------------------------------------------------


def _wrapped(sd, prefix):
    return {prefix + k: v for k, v in sd.items()}


@pytest.mark.parametrize("form", ["model", "objective", "ddp_compiled_objective"])
def test_pretrained_encoder_reproduces_the_pretraining_outputs_exactly(form):
    src = pretrained()
    if form == "model":
        sd = src.state_dict()
    elif form == "objective":  # the pretraining job's model.pt: the objective's state dict
        sd = PretrainingObjective(src, PretrainTasks()).state_dict()
    else:
        sd = _wrapped(PretrainingObjective(src, PretrainTasks()).state_dict(), "module._orig_mod.")
    torch.manual_seed(5)
    for model in (LxmertForQuestionAnswering(CFG, 4).eval(), LxmertForNlvr2(CFG).eval()):
        assert load_pretrained_encoder(model, sd) is model
        ids, am, feats, boxes, vm = inputs()
        with torch.no_grad():
            want = src(ids, am, feats, boxes, vm)
            got = model.encoder(ids, am, feats, boxes, vm)
        for a, b in zip(got, want, strict=True):
            assert torch.equal(a, b)


def test_mismatched_shapes_name_the_key_and_both_shapes():
    sd = pretrained(hidden_size=48, ffn_size=96).state_dict()
    model = LxmertForQuestionAnswering(CFG, 4)
    with pytest.raises(PretrainedWeightsError) as err:
        load_pretrained_encoder(model, sd)
    msg = str(err.value)
    assert "encoder.word_embedding.word.weight: checkpoint (120, 48), model (120, 32)" in msg
    assert "74 shape mismatches" in msg and "(62 more)" in msg  # long lists are cut


def test_missing_and_unexpected_keys_are_listed():
    model = LxmertForQuestionAnswering(CFG, 4)
    with pytest.raises(PretrainedWeightsError, match=r"2 missing .*encoder\.pooler\.weight, encoder\.pooler\.bias"):
        load_pretrained_encoder(model, pretrained(pooler=False).state_dict())
    with pytest.raises(PretrainedWeightsError, match=r"1 unexpected .*encoder\.word_embedding\.token_type\.weight"):
        load_pretrained_encoder(model, pretrained(token_type_embedding=True).state_dict())
    hf_like = {"lxmert.encoder.layer.0.attention.self.query.weight": torch.zeros(1)}
    with pytest.raises(PretrainedWeightsError, match="encoder_state_from_hf_dir"):
        load_pretrained_encoder(model, hf_like)


def test_strip_wrappers_keeps_names_and_refuses_collisions():
    assert list(strip_wrappers({"module._orig_mod.model.encoder.x": 1, "qa_head.fc1.weight": 2})) == [
        "encoder.x", "qa_head.fc1.weight"]
    with pytest.raises(PretrainedWeightsError, match="two entries"):
        strip_wrappers({"module.encoder.x": 1, "encoder.x": 2})


# -- answer head from the pretraining QA head --------------------------------------------------

PRE = ["yes", "no", "2", "red", "gray"]  # the pretraining table (stored normalised)
FT = ["no", "blue", "two", "Grey", "yes"]  # fine-tuning table: "two" -> "2", "Grey" -> "gray"
COPIED = {0: 1, 2: 2, 3: 4, 4: 0}  # fine-tune row <- pretraining row


def rows(pre: list[str], ft: list[str]) -> list[int | None]:
    """What the fine-tuning job passes: each fine-tuning answer's pretraining row, matched by the data
    layer's answer normalisation (the model layer takes plain rows)."""
    table = AnswerTable(pre)
    return [table.index(a) for a in ft]


def _pretrain_with_random_head():
    src = pretrained(num_qa_labels=len(PRE))
    with torch.no_grad():
        for p in src.qa_head.parameters():  # BERT init would hide biases/LayerNorm put in the wrong place
            p.normal_(0.0, 0.5)
    return src


@pytest.mark.parametrize("zero_unmatched", [True, False])
def test_answer_head_copies_exactly_the_shared_rows(zero_unmatched):
    src = _pretrain_with_random_head()
    torch.manual_seed(3)
    model = LxmertForQuestionAnswering(CFG, len(FT))
    before = {k: v.clone() for k, v in model.answer_head.state_dict().items()}
    sd = PretrainingObjective(src, PretrainTasks()).state_dict()
    assert rows(PRE, FT) == [1, None, 2, 4, 0]
    assert init_answer_head_from_qa(model, sd, rows(PRE, FT), num_pretrain_answers=len(PRE),
                                    zero_unmatched=zero_unmatched) == len(COPIED)
    head, pre = model.answer_head, src.qa_head
    for name in ("fc1", "norm"):
        for p in ("weight", "bias"):
            assert torch.equal(getattr(getattr(head, name), p), getattr(getattr(pre, name), p))
    for i, j in COPIED.items():
        assert torch.equal(head.fc2.weight[i], pre.fc2.weight[j]) and torch.equal(head.fc2.bias[i], pre.fc2.bias[j])
    if zero_unmatched:  # the reference zeroes the rows of answers pretraining never saw
        assert not head.fc2.weight[1].any() and float(head.fc2.bias[1].detach()) == 0.0
    else:
        assert torch.equal(head.fc2.weight[1], before["fc2.weight"][1])


def test_answer_head_errors():
    src = _pretrain_with_random_head()
    sd = src.state_dict()
    with pytest.raises(PretrainedWeightsError, match="has 5 rows but the pretraining answer table has 4"):
        init_answer_head_from_qa(LxmertForQuestionAnswering(CFG, len(FT)), sd, rows(PRE[:4], FT),
                                 num_pretrain_answers=4)
    with pytest.raises(PretrainedWeightsError, match="5 answers but the model's answer head has 6"):
        init_answer_head_from_qa(LxmertForQuestionAnswering(CFG, 6), sd, rows(PRE, FT))
    with pytest.raises(PretrainedWeightsError, match=r"outside the pretraining head's 5 rows: 1 -> 5"):
        init_answer_head_from_qa(LxmertForQuestionAnswering(CFG, len(FT)), sd, [0, 5, None, None, None])
    with pytest.raises(TypeError, match="map answer strings to rows first"):
        init_answer_head_from_qa(LxmertForQuestionAnswering(CFG, len(FT)), sd, FT)
    wide = pretrained(hidden_size=48, ffn_size=96, num_qa_labels=len(PRE)).state_dict()
    with pytest.raises(PretrainedWeightsError, match=r"qa_head\.fc1\.weight: checkpoint \(96, 48\), model \(64, 32\)"):
        init_answer_head_from_qa(LxmertForQuestionAnswering(CFG, len(FT)), wide, rows(PRE, FT))


# -- transformers checkpoint -------------------------------------------------------------------


def test_encoder_state_from_hf_dir_matches_transformers_pooled_output(tmp_path):
    transformers = pytest.importorskip("transformers")
    hf_cfg = transformers.LxmertConfig(
        vocab_size=99, hidden_size=32, num_attention_heads=4, intermediate_size=48, l_layers=1, r_layers=1,
        x_layers=1, max_position_embeddings=40, visual_feat_dim=CFG.visual_feat_dim, num_object_labels=11,
        num_attr_labels=7, num_qa_labels=len(PRE), hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    hf = transformers.LxmertForPreTraining(hf_cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0.0, 0.1)
    hf.save_pretrained(tmp_path)
    config, sd = encoder_state_from_hf_dir(tmp_path)
    assert (config.hidden_size, config.vocab_size, config.token_type_embedding) == (32, 99, True)
    model = LxmertForQuestionAnswering(config, len(FT)).eval()
    load_pretrained_encoder(model, sd)
    assert init_answer_head_from_qa(model, sd, rows(PRE, FT)) == len(COPIED)
    ids, am, feats, boxes, vm = inputs()
    ids = ids.clamp(max=98) * am
    with torch.no_grad():
        want = hf.lxmert(input_ids=ids, visual_feats=feats, visual_pos=boxes, attention_mask=am.long(),
                         visual_attention_mask=vm.long()).pooled_output
        got = model.encoder(ids, am, feats, boxes, vm).pooled
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(model.answer_head.fc2.weight[0], hf.answer_head.logit_fc[3].weight[1])
