"""`--to transformers`: the directory loads into transformers' own classes with no missing or
unexpected key and computes our outputs (fp32, eval, atol 1e-5); what transformers cannot express is
refused with nothing left behind."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from xmodal.base.errors import UserError
from xmodal.export import PROVENANCE_FILE, export
from xmodal.export.source import from_model
from xmodal.models.lxmert.finetune import LxmertForNlvr2, LxmertForQuestionAnswering
from xmodal.models.lxmert.model import LxmertForPretraining, preset
from xmodal.models.mult.config import preset as mult_preset
from xmodal.models.mult.model import Mult
from xmodal_testing import all_logits

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

B, T, N = 3, 11, 8
ATOL = 1e-5
# The tiny preset has no token-type embedding (the paper): exported as a zero table.
TINY = preset("tiny")


def randomised(model, seed=0):
    """Every parameter random: BERT's init (zero biases, unit LayerNorms) would hide a misplaced one."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1 + 0.02)
    return model.eval()


def inputs(config, pair=False, seed=1):
    g = torch.Generator().manual_seed(seed)
    am = torch.arange(T)[None, :] < torch.tensor([T, 6, 3])[:, None]  # (B, T): padded sentences
    ids = torch.randint(5, config.vocab_size, (B, T), generator=g) * am
    lead = (B, 2) if pair else (B,)
    feats = torch.randn(*lead, N, config.visual_feat_dim, generator=g)
    xy = torch.rand(*lead, N, 2, generator=g) * 0.5
    boxes = torch.cat([xy, xy + 0.5 * torch.rand(*lead, N, 2, generator=g)], -1)
    vm = torch.ones(*lead, N, dtype=torch.bool)
    vm[..., 0, 6:] = False  # the first image has 6 objects
    return ids, am, feats, boxes, vm


def close(mine, theirs, valid=None, name=""):
    assert mine.shape == theirs.shape, name
    if valid is not None:  # real tokens / objects only: padding positions are anyone's
        mine, theirs = mine.masked_fill(~valid, 0), theirs.masked_fill(~valid, 0)
    err = (mine - theirs).abs().max().item()
    assert err <= ATOL, f"{name}: max abs diff {err:.2e}"


def loaded(cls, folder):
    model, info = cls.from_pretrained(folder, output_loading_info=True)
    assert {k: v for k, v in info.items() if v} == {}, info  # no missing, unexpected or mismatched key
    return model.eval()


def test_pretraining_model_loads_into_lxmert_for_pretraining_with_equal_outputs(tmp_path):
    src = randomised(LxmertForPretraining(TINY))
    result = export(from_model(src, "pretrain"), "transformers", tmp_path / "hf")
    assert {"config.json", "model.safetensors", PROVENANCE_FILE} <= set(result.files)
    assert any("zero table" in n for n in result.notes)
    hf = loaded(transformers.LxmertForPreTraining, tmp_path / "hf")
    assert torch.equal(hf.lxmert.embeddings.token_type_embeddings.weight, torch.zeros(2, TINY.hidden_size))

    ids, am, feats, boxes, vm = inputs(TINY)
    with torch.no_grad():
        theirs = hf(input_ids=ids, visual_feats=feats, visual_pos=boxes, attention_mask=am.long(),
                    visual_attention_mask=vm.long(), return_dict=True)
        h = hf.lxmert(input_ids=ids, visual_feats=feats, visual_pos=boxes, attention_mask=am.long(),
                      visual_attention_mask=vm.long(), return_dict=True)
        visual = hf.obj_predict_head(h.vision_output)
        out = src(ids, am, feats, boxes, vm)
        mine = all_logits(src, out)
    lang, visn = am[..., None], vm[..., None]
    close(out.pooled, h.pooled_output, name="pooled")
    close(mine["mlm"], theirs.prediction_logits, lang, "mlm")
    close(mine["match"], theirs.cross_relationship_score, name="match")
    close(mine["qa"], theirs.question_answering_score, name="qa")
    for k in ("obj", "attr", "feat"):
        close(mine[k], visual[k], visn, k)
    provenance = json.loads((tmp_path / "hf" / PROVENANCE_FILE).read_text())
    assert provenance["target"] == "transformers" and provenance["kind"] == "pretrain"
    assert list(tmp_path.iterdir()) == [tmp_path / "hf"]  # no temporary folder left beside it


@pytest.mark.parametrize("kind", ["vqa", "gqa"])
def test_qa_model_loads_into_lxmert_for_question_answering(tmp_path, kind):
    src = randomised(LxmertForQuestionAnswering(TINY.replace(token_type_embedding=True), num_answers=7))
    export(from_model(src, kind), "transformers", tmp_path / "qa")
    hf = loaded(transformers.LxmertForQuestionAnswering, tmp_path / "qa")
    assert hf.config.num_qa_labels == 7
    ids, am, feats, boxes, vm = inputs(TINY)
    with torch.no_grad():
        theirs = hf(input_ids=ids, visual_feats=feats, visual_pos=boxes, attention_mask=am.long(),
                    visual_attention_mask=vm.long(), return_dict=True).question_answering_score
        close(src(ids, am, feats, boxes, vm), theirs, name="answer scores")


def test_nlvr2_model_is_the_encoder_plus_its_classifier_file(tmp_path):
    from safetensors.torch import load_file

    src = randomised(LxmertForNlvr2(TINY, output="sigmoid"))
    result = export(from_model(src, "nlvr2"), "transformers", tmp_path / "nlvr2")
    assert "nlvr2_classifier.safetensors" in result.files
    assert any("no NLVR2 model" in n for n in result.notes)
    encoder = loaded(transformers.LxmertModel, tmp_path / "nlvr2")
    head = load_file(str(tmp_path / "nlvr2" / "nlvr2_classifier.safetensors"))
    eps = encoder.config.to_dict().get("layer_norm_eps", 1e-12)

    ids, am, feats, boxes, vm = inputs(TINY, pair=True)
    with torch.no_grad():
        pooled = encoder(input_ids=ids.repeat_interleave(2, 0), visual_feats=feats.flatten(0, 1),
                         visual_pos=boxes.flatten(0, 1), attention_mask=am.repeat_interleave(2, 0).long(),
                         visual_attention_mask=vm.flatten(0, 1).long()).pooled_output.reshape(B, -1)
        z = torch.nn.functional.gelu(pooled @ head["fc1.weight"].T + head["fc1.bias"])
        z = torch.nn.functional.layer_norm(z, z.shape[-1:], head["norm.weight"], head["norm.bias"], eps)
        close(src(ids, am, feats, boxes, vm), z @ head["fc2.weight"].T + head["fc2.bias"], name="nlvr2 logits")


def test_the_vocabulary_becomes_a_tokenizer_that_encodes_as_ours(tmp_path):
    from xmodal.data.tokenizer import WordPieceTokenizer

    sentences = ["A red cube left of two small spheres.", "Is the dog on the grass?", "zebra unknownword ##x"]
    ours = WordPieceTokenizer.train(sentences * 20, max_seq_len=16, vocab_size=60)
    ours.save(tmp_path)
    src = randomised(LxmertForPretraining(TINY.replace(vocab_size=ours.vocab_size)))
    result = export(from_model(src, "pretrain", vocab=tmp_path / "vocab.txt"), "transformers", tmp_path / "hf")
    assert {"vocab.txt", "tokenizer.json", "tokenizer_config.json"} <= set(result.files)
    tok = transformers.AutoTokenizer.from_pretrained(tmp_path / "hf")
    want, _ = ours.encode(sentences)
    for sentence, row in zip(sentences, want, strict=True):
        got = tok(sentence, padding="max_length", truncation=True, max_length=16)["input_ids"]
        assert got == row.tolist(), sentence


@pytest.mark.parametrize("change, named", [
    ({"pooler": False}, "model.pooler=False"),
    ({"shared_cross_attention": False}, "model.shared_cross_attention=False"),
    ({"layer_norm_eps": 1e-5}, "model.layer_norm_eps=1e-05"),
])
def test_what_transformers_cannot_express_is_refused_and_nothing_is_written(tmp_path, change, named):
    src = LxmertForPretraining(TINY.replace(**change))
    with pytest.raises(UserError, match=rf"--to transformers cannot hold this pretrain model .*{named}"):
        export(from_model(src, "pretrain"), "transformers", tmp_path / "hf")
    assert list(tmp_path.iterdir()) == []


def test_a_mult_model_is_refused_for_transformers(tmp_path):
    with pytest.raises(UserError, match="--to transformers: .* is a MulT model; .*--to mult-reference"):
        export(from_model(Mult(mult_preset("tiny")), "mult"), "transformers", tmp_path / "hf")
    assert list(tmp_path.iterdir()) == []


def test_an_existing_output_is_kept_and_overwrite_writes_beside_it(tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "mine.txt").write_text("keep me")
    src = from_model(randomised(LxmertForPretraining(TINY)), "pretrain")
    with pytest.raises(UserError, match="--out: .* already holds 'mine.txt', which export did not write there; "
                                        ".*--overwrite"):
        export(src, "transformers", out)
    assert [p.name for p in out.iterdir()] == ["mine.txt"] and len(list(tmp_path.iterdir())) == 1
    with pytest.raises(UserError, match="--to 'onnx': expected one of transformers, reference, mult-reference"):
        export(src, "onnx", tmp_path / "other")
    (tmp_path / "file").write_text("")
    with pytest.raises(UserError, match="--out: .*/file' is a file; expected a folder"):
        export(src, "transformers", tmp_path / "file")
    (tmp_path / "file").unlink()
    export(src, "transformers", out, overwrite=True)
    assert (out / "mine.txt").read_text() == "keep me" and (out / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]  # nothing left beside it
    export(src, "transformers", tmp_path / "missing" / "hf")  # the folders above it are made
    assert (tmp_path / "missing" / "hf" / "model.safetensors").is_file()


def test_an_empty_folder_of_the_users_is_refused_and_with_overwrite_kept(tmp_path):
    (tmp_path / "out3" / "keepme" / "deeper").mkdir(parents=True)
    src = from_model(LxmertForPretraining(TINY), "pretrain")
    with pytest.raises(UserError, match="--out: .* already holds 'keepme/deeper/', which export did not write there; "
                                        "choose a new or empty folder or pass --overwrite"):
        export(src, "transformers", tmp_path / "out3")
    for _ in range(2):  # and again over its own export beside the user's folder
        export(src, "transformers", tmp_path / "out3", overwrite=True)
        assert (tmp_path / "out3" / "keepme" / "deeper").is_dir() and (tmp_path / "out3" / "model.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["out3"]


def test_a_linked_out_is_written_at_the_folder_it_points_to_and_stays_a_link(tmp_path):
    src = from_model(LxmertForPretraining(TINY), "pretrain")
    export(src, "transformers", tmp_path / "ex1")
    first = (tmp_path / "ex1" / "model.safetensors").read_bytes()
    (tmp_path / "linkex").symlink_to("ex1")
    result = export(from_model(randomised(LxmertForPretraining(TINY)), "pretrain"), "transformers", tmp_path / "linkex")
    assert result.out == tmp_path / "ex1" and (tmp_path / "linkex").is_symlink()
    assert (tmp_path / "ex1" / "model.safetensors").read_bytes() != first  # the new export, at the link's folder
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ex1", "linkex"]  # nothing left beside them


def test_an_out_with_dot_dot_is_the_folder_it_names(tmp_path):
    (tmp_path / "e4" / "sub").mkdir(parents=True)
    src = from_model(LxmertForPretraining(TINY), "pretrain")
    with pytest.raises(UserError, match=r"--out: '.*/e4/sub/\.\.' \(that is '.*/e4'\) already holds 'sub/'"):
        export(src, "transformers", f"{tmp_path}/e4/sub/..")  # refused before anything is written
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e4"] and list((tmp_path / "e4").iterdir()) == [
        tmp_path / "e4" / "sub"]
    export(src, "transformers", f"{tmp_path}/e4/sub/..", overwrite=True)
    assert (tmp_path / "e4" / "model.safetensors").is_file() and list((tmp_path / "e4" / "sub").iterdir()) == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["e4"]


def test_without_transformers_installed_the_target_is_refused(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)  # what `import transformers` meets when it is absent
    with pytest.raises(UserError, match="--to transformers needs the transformers package"):
        export(from_model(LxmertForPretraining(TINY), "pretrain"), "transformers", tmp_path / "hf")
    assert list(tmp_path.iterdir()) == []
