"""Snapshots of the reference code (airsplay/lxmert) loaded through `lxmert_init` (CPU, tiny sizes).

The snapshots are written in the reference's own layout by tests/lxmert_reference_layout.py, named
from the reference's source independently of the adapter's mapping; literal names are spot-checked here.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lxmert_reference_layout import randomised, reference_pretraining, reference_task
from xmodal.jobs.finetune_init import Init, load_init
from xmodal.models.lxmert.finetune import LxmertForNlvr2, LxmertForQuestionAnswering
from xmodal.models.lxmert.init import PretrainedWeightsError, reference_weights
from xmodal.models.lxmert.model import LxmertConfig, LxmertForPretraining

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# What the reference builds, at test size: bert-base's 64-wide heads, token types, one shared
# cross-attention, pooler, LayerNorm eps 1e-12, dropout 0.1, init std 0.02 (all that the shapes
# cannot tell, so the inferred config must equal this one field for field).
REF = LxmertConfig(vocab_size=120, hidden_size=128, num_heads=2, ffn_size=96, l_layers=2, r_layers=1, x_layers=2,
                   max_positions=32, token_type_embedding=True, visual_feat_dim=24, num_object_labels=12,
                   num_attr_labels=6, num_qa_labels=10)
B, T, N = 3, 9, 5

# Names as the reference saves them, copied from its source (LXRTPretraining under DataParallel).
LITERAL_PRETRAINED_KEYS = [
    "module.bert.embeddings.word_embeddings.weight",
    "module.bert.embeddings.token_type_embeddings.weight",
    "module.bert.embeddings.LayerNorm.bias",
    "module.bert.encoder.visn_fc.visn_fc.weight",
    "module.bert.encoder.visn_fc.box_layer_norm.bias",
    "module.bert.encoder.layer.1.attention.self.value.weight",
    "module.bert.encoder.layer.0.attention.output.LayerNorm.weight",
    "module.bert.encoder.layer.0.intermediate.dense.bias",
    "module.bert.encoder.r_layers.0.output.dense.weight",
    "module.bert.encoder.x_layers.1.visual_attention.att.key.bias",
    "module.bert.encoder.x_layers.0.visual_attention.output.dense.weight",
    "module.bert.encoder.x_layers.0.lang_self_att.self.query.weight",
    "module.bert.encoder.x_layers.1.visn_self_att.output.LayerNorm.bias",
    "module.bert.encoder.x_layers.0.lang_inter.dense.weight",
    "module.bert.encoder.x_layers.0.visn_output.LayerNorm.weight",
    "module.bert.pooler.dense.bias",
    "module.cls.predictions.transform.dense.weight",
    "module.cls.predictions.transform.LayerNorm.bias",
    "module.cls.predictions.decoder.weight",
    "module.cls.predictions.bias",
    "module.cls.seq_relationship.weight",
    "module.obj_predict_head.transform.LayerNorm.weight",
    "module.obj_predict_head.decoder_dict.obj.weight",
    "module.obj_predict_head.decoder_dict.attr.bias",
    "module.obj_predict_head.decoder_dict.feat.weight",
    "module.answer_head.logit_fc.0.weight",
    "module.answer_head.logit_fc.2.bias",
    "module.answer_head.logit_fc.3.weight",
]


def inputs(pair=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    am = torch.arange(T)[None, :] < torch.randint(3, T + 1, (B,), generator=g)[:, None]
    ids = torch.randint(5, REF.vocab_size, (B, T), generator=g) * am
    lead = (B, 2) if pair else (B,)
    feats = torch.randn(*lead, N, REF.visual_feat_dim, generator=g)
    xy = torch.rand(*lead, N, 2, generator=g) * 0.5
    boxes = torch.cat([xy, xy + 0.5 * torch.rand(*lead, N, 2, generator=g)], -1)
    return ids, am, feats, boxes, torch.ones(*lead, N, dtype=torch.bool)


def test_the_layout_has_the_reference_names():
    sd = reference_pretraining(LxmertForPretraining(REF))
    assert [k for k in LITERAL_PRETRAINED_KEYS if k not in sd] == []
    # 5 embedding, 8 visual-feature, 16 per BertLayer, 42 per LXRTXLayer, 2 pooler; heads: 8 cls, 10 obj, 6 answer
    assert len(sd) == 5 + 8 + 16 * (REF.l_layers + REF.r_layers) + 42 * REF.x_layers + 2 + 8 + 10 + 6


def test_transformers_kept_the_reference_names():
    """The adapter maps `bert.` to the transformers names: the two layouts differ only there."""
    transformers = pytest.importorskip("transformers")
    from xmodal.models.lxmert.hf import config_to_hf

    hf = transformers.LxmertForPreTraining(config_to_hf(REF))
    hf_keys = {k.replace("lxmert.", "bert.", 1) for k in hf.state_dict() if not k.endswith("position_ids")}
    assert hf_keys == {k.removeprefix("module.") for k in reference_pretraining(LxmertForPretraining(REF))}


# -- loading ----------------------------------------------------------------------------------


# The reference's torch (1.0, 2019) wrote the legacy format; torch >= 1.6 writes a zip.
@pytest.mark.parametrize("zip_format", [False, True])
def test_pretrained_snapshot_loads_every_weight_and_fixes_the_architecture(tmp_path, zip_format):
    src = randomised(LxmertForPretraining(REF))
    torch.save(reference_pretraining(src), tmp_path / "model_LXRT.pth", _use_new_zipfile_serialization=zip_format)
    w = reference_weights(tmp_path / "model_LXRT.pth")
    assert w.config == REF and w.head is None
    model = LxmertForPretraining(w.config)
    model.load_state_dict(w.state, strict=True)  # every entry of our pretraining model, the heads too
    want = src.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())

    # The job's path: the encoder into a fine-tuning model, outputs exactly the source's.
    qa = LxmertForQuestionAnswering(w.config, 4).eval()
    line = load_init(SimpleNamespace(model=qa), Init("reference", path=str(tmp_path / "model_LXRT.pth")), None, True)
    assert line == f"encoder from reference {tmp_path / 'model_LXRT.pth'}"
    with torch.no_grad():
        for got, exp in zip(qa.encoder(*inputs()), src.encoder(*inputs()), strict=True):
            assert torch.equal(got, exp)


@pytest.mark.parametrize("multi_gpu", [False, True])
def test_finetuned_vqa_snapshot_loads_the_answer_head_when_it_fits(tmp_path, multi_gpu):
    src = randomised(LxmertForQuestionAnswering(REF, 5))
    sd = reference_task(src, multi_gpu)
    assert {"lxrt_encoder.model.bert.pooler.dense.weight", "logit_fc.0.weight", "logit_fc.2.bias",
            "logit_fc.3.weight"} <= {k.replace("model.module.", "model.") for k in sd}
    torch.save(sd, tmp_path / "BEST.pth")
    w = reference_weights(tmp_path / "BEST.pth")
    assert w.head == "answer_head" and w.config.hidden_size == REF.hidden_size
    init = Init("reference", path=str(tmp_path / "BEST.pth"))

    model = LxmertForQuestionAnswering(w.config, 5).eval()
    assert load_init(SimpleNamespace(model=model), init, None, True).endswith("answer_head from the snapshot")
    with torch.no_grad():
        assert torch.equal(model(*inputs()), src(*inputs()))

    other = LxmertForQuestionAnswering(w.config, 7).eval()  # another answer table: the encoder only
    before = {k: v.clone() for k, v in other.answer_head.state_dict().items()}
    assert "does not fit this model's head" in load_init(SimpleNamespace(model=other), init, None, True)
    assert all(torch.equal(v, before[k]) for k, v in other.answer_head.state_dict().items())
    assert torch.equal(other.encoder.pooler.weight, src.encoder.pooler.weight)


def test_finetuned_nlvr2_snapshot_loads_the_pair_classifier(tmp_path):
    src = randomised(LxmertForNlvr2(REF, output="softmax"))  # the reference's 2-way softmax
    torch.save(reference_task(src, multi_gpu=True), tmp_path / "BEST.pth")
    init = Init("reference", path=str(tmp_path / "BEST.pth"))
    model = LxmertForNlvr2(REF, output="softmax").eval()
    assert load_init(SimpleNamespace(model=model), init, None, True).endswith("classifier from the snapshot")
    with torch.no_grad():
        assert torch.equal(model(*inputs(pair=True)), src(*inputs(pair=True)))
    # The paper's sigmoid head has one output: it cannot take the 2-way classifier; a QA model has no classifier.
    assert "does not fit" in load_init(SimpleNamespace(model=LxmertForNlvr2(REF)), init, None, True)
    assert "does not fit" in load_init(SimpleNamespace(model=LxmertForQuestionAnswering(REF, 2)), init, None, True)


# -- errors -----------------------------------------------------------------------------------


def test_foreign_missing_and_unexpected_keys_name_the_file_and_the_keys(tmp_path):
    src = LxmertForPretraining(REF)
    ours = tmp_path / "ours.pth"
    torch.save(src.state_dict(), ours)
    with pytest.raises(PretrainedWeightsError, match=rf"{ours}: not a reference LXMERT snapshot .*"
                                                     r"encoder\.word_embedding\.word\.weight.*--init checkpoint"):
        reference_weights(ours)

    sd = reference_pretraining(src)
    del sd["module.bert.encoder.layer.1.output.dense.bias"], sd["module.answer_head.logit_fc.3.bias"]
    sd["module.bert.encoder.layer.0.adapter.weight"] = torch.zeros(2)
    sd["module.vqa_head.weight"] = torch.zeros(2)
    bad = tmp_path / "model_LXRT.pth"
    torch.save(sd, bad)
    with pytest.raises(PretrainedWeightsError) as err:
        reference_weights(bad)
    msg = str(err.value)
    assert msg.startswith(f"{bad}: ")
    assert ("2 missing from the checkpoint: bert.encoder.layer.1.output.dense.bias, answer_head.logit_fc.3.bias"
            in msg)
    assert "2 unexpected in the checkpoint: bert.encoder.layer.0.adapter.weight, vqa_head.weight" in msg

    task = reference_task(LxmertForQuestionAnswering(REF, 3))
    del task["lxrt_encoder.model.bert.pooler.dense.weight"]
    torch.save(task, tmp_path / "BEST.pth")
    with pytest.raises(PretrainedWeightsError, match=r"1 missing from the checkpoint: "
                                                     r"lxrt_encoder\.model\.bert\.pooler\.dense\.weight"):
        reference_weights(tmp_path / "BEST.pth")

    torch.save(reference_pretraining(LxmertForPretraining(REF.replace(hidden_size=96))), tmp_path / "narrow.pth")
    with pytest.raises(PretrainedWeightsError, match="narrow.pth: hidden size 96 is not a multiple of 64"):
        reference_weights(tmp_path / "narrow.pth")


def test_a_file_that_is_not_a_state_dict_is_refused(tmp_path):
    (tmp_path / "notes.pth").write_text("not a checkpoint\n")
    with pytest.raises(PretrainedWeightsError, match=rf"{tmp_path / 'notes.pth'}: not a torch state dict file"):
        reference_weights(tmp_path / "notes.pth")
    torch.save([torch.zeros(1)], tmp_path / "list.pth")
    with pytest.raises(PretrainedWeightsError, match="list.pth: holds a list; expected a state dict"):
        reference_weights(tmp_path / "list.pth")
    torch.save({"optimizer": {"lr": 1}}, tmp_path / "dict.pth")  # weights_only allows plain containers
    with pytest.raises(PretrainedWeightsError, match="dict.pth: holds a mapping that is not name -> tensor"):
        reference_weights(tmp_path / "dict.pth")


class _RunsCode:
    """A pickle that would run a command when loaded without weights_only."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        import os

        return os.system, (f"touch {self.marker}",)


def test_a_malicious_file_is_refused_with_torchs_reason_on_one_line(tmp_path):
    marker = tmp_path / "ran"
    torch.save({"encoder.x": _RunsCode(marker), **{f"pad{i}": "x" * 50 for i in range(8)}}, tmp_path / "evil.pth")
    with pytest.raises(PretrainedWeightsError) as e:
        reference_weights(tmp_path / "evil.pth")
    msg = str(e.value)
    assert "\n" not in msg and "evil.pth: not a torch state dict file (UnpicklingError" in msg, msg
    assert "GLOBAL posix.system" in msg, msg  # the blocked global: the reason, kept whole
    assert "weights_only" not in msg, msg  # never the advice to load it with code running
    assert msg.endswith("expected a file written by torch.save(model.state_dict())"), msg
    assert not marker.exists()
