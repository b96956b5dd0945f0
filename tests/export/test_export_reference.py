"""`--to reference`: the reference code's snapshot layout (checked against the layout written from its
source, tests/lxmert_reference_layout.py), read back through our own `--init reference` path."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from lxmert_reference_layout import reference_pretraining, reference_task
from xmodal.base.errors import UserError
from xmodal.export import export
from xmodal.export.source import from_model
from xmodal.jobs.finetune_init import load_init, resolve_path_init
from xmodal.models.lxmert.finetune import LxmertForNlvr2, LxmertForQuestionAnswering
from xmodal.models.lxmert.init import reference_weights
from xmodal.models.lxmert.model import LxmertConfig, LxmertForPretraining
from xmodal.models.mult.config import preset as mult_preset
from xmodal.models.mult.model import Mult

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# 64-wide heads as the reference's; no token-type embedding (the paper, exported as a zero table);
# dropout and init other than bert-base's, which a snapshot cannot carry.
OURS = LxmertConfig(vocab_size=90, hidden_size=128, num_heads=2, ffn_size=96, l_layers=2, r_layers=1, x_layers=1,
                    max_positions=24, visual_feat_dim=20, num_object_labels=9, num_attr_labels=5, num_qa_labels=7,
                    dropout=0.0, attention_dropout=0.0, initializer_range=0.05)
B, T, N = 3, 9, 5


def randomised(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return model.eval()


def inputs(pair=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    am = torch.arange(T)[None, :] < torch.tensor([T, 5, 3])[:, None]
    ids = torch.randint(5, OURS.vocab_size, (B, T), generator=g) * am
    lead = (B, 2) if pair else (B,)
    feats = torch.randn(*lead, N, OURS.visual_feat_dim, generator=g)
    xy = torch.rand(*lead, N, 2, generator=g) * 0.5
    boxes = torch.cat([xy, xy + 0.5 * torch.rand(*lead, N, 2, generator=g)], -1)
    return ids, am, feats, boxes, torch.ones(*lead, N, dtype=torch.bool)


def same_layout(written: dict, expected: dict) -> None:
    assert written.keys() == expected.keys()
    assert all(torch.equal(written[k], expected[k]) for k in expected)


def test_pretraining_model_is_model_lxrt_and_reads_back_through_init_reference(tmp_path):
    src = randomised(LxmertForPretraining(OURS))
    result = export(from_model(src, "pretrain"), "reference", tmp_path / "snap")
    path = tmp_path / "snap" / "model_LXRT.pth"
    assert "model_LXRT.pth" in result.files and any("dropout 0.1" in n for n in result.notes)
    written = torch.load(path, weights_only=True)
    # The layout of LXRTPretraining.state_dict(), with a zero token-type table where ours has none.
    with_types = randomised(LxmertForPretraining(OURS.replace(token_type_embedding=True)))
    with_types.load_state_dict({**src.state_dict(), "encoder.word_embedding.token_type.weight":
                                torch.zeros(2, OURS.hidden_size)})
    same_layout(written, reference_pretraining(with_types, prefix=""))

    # What --init reference reads: every weight, the architecture from the shapes.
    init, config = resolve_path_init("reference", str(path))
    assert config == OURS.replace(token_type_embedding=True, dropout=0.1, attention_dropout=0.1,
                                  initializer_range=0.02)
    back = LxmertForPretraining(config).eval()
    back.load_state_dict(reference_weights(path).state, strict=True)
    with torch.no_grad():
        a, b = src(*inputs()), back(*inputs())
        for got, want in zip(b, a, strict=True):
            torch.testing.assert_close(got, want, atol=1e-6, rtol=0)
        torch.testing.assert_close(back.qa_head(b.pooled), src.qa_head(a.pooled), atol=1e-6, rtol=0)
    # and the fine-tuning job's loader puts the encoder into a fine-tuning model
    qa = LxmertForQuestionAnswering(config, 4).eval()
    assert load_init(SimpleNamespace(model=qa), init, None, True) == f"encoder from reference {path}"
    with torch.no_grad():
        torch.testing.assert_close(qa.encoder(*inputs()).pooled, a.pooled, atol=1e-6, rtol=0)


def test_vqa_model_is_a_task_snapshot_whose_head_init_reference_loads(tmp_path):
    src = randomised(LxmertForQuestionAnswering(OURS.replace(token_type_embedding=True), 6))
    export(from_model(src, "vqa"), "reference", tmp_path / "snap")
    path = tmp_path / "snap" / "BEST.pth"
    same_layout(torch.load(path, weights_only=True), reference_task(src))
    init, config = resolve_path_init("reference", str(path))
    model = LxmertForQuestionAnswering(config, 6).eval()
    assert load_init(SimpleNamespace(model=model), init, None, True).endswith("answer_head from the snapshot")
    with torch.no_grad():
        assert torch.equal(model(*inputs()), src(*inputs()))


def test_nlvr2_softmax_is_a_task_snapshot_and_sigmoid_is_refused(tmp_path):
    src = randomised(LxmertForNlvr2(OURS.replace(token_type_embedding=True), output="softmax"))
    export(from_model(src, "nlvr2"), "reference", tmp_path / "snap")
    path = tmp_path / "snap" / "BEST.pth"
    same_layout(torch.load(path, weights_only=True), reference_task(src))
    w = reference_weights(path)
    assert w.head == "classifier"
    with pytest.raises(UserError, match="--to reference cannot hold this nlvr2 model .*nlvr2_output='sigmoid'"):
        export(from_model(LxmertForNlvr2(OURS, output="sigmoid"), "nlvr2"), "reference", tmp_path / "sig")
    assert not (tmp_path / "sig").exists() and [p.name for p in tmp_path.iterdir()] == ["snap"]


@pytest.mark.parametrize("change, named", [
    ({"num_heads": 4}, r"model.num_heads=4 at hidden_size=128 \(the reference's heads are 64 wide"),
    ({"pooler": False}, r"model.pooler=False \(the reference needs True\)"),
])
def test_what_the_reference_cannot_hold_is_refused(tmp_path, change, named):
    with pytest.raises(UserError, match=rf"--to reference cannot hold this pretrain model .*{named}"):
        export(from_model(LxmertForPretraining(OURS.replace(**change)), "pretrain"), "reference", tmp_path / "snap")
    assert list(tmp_path.iterdir()) == []


def test_a_mult_model_is_refused_for_the_lxmert_reference(tmp_path):
    with pytest.raises(UserError, match="--to reference: .* is a MulT model; .*--to mult-reference"):
        export(from_model(Mult(mult_preset("tiny")), "mult"), "reference", tmp_path / "snap")
    assert list(tmp_path.iterdir()) == []
