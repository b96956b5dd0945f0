"""Export sources: checkpoint folders in core/checkpoint.py's format (the weights a run selected), the
command line, an MLflow run's final checkpoint and its logged model from a real pretraining run, and
bad sources refused before anything is written."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch

from xmodal.base.errors import UserError
from xmodal.config.experiment import load_config
from xmodal.core import checkpoint as ckpt
from xmodal.core.step import TrainState
from xmodal.export import MULT_HYPERPARAMETERS_FILE, PROVENANCE_FILE, run_export
from xmodal.export.source import from_checkpoint
from xmodal.jobs.finetune_config import FinetuneConfig
from xmodal.jobs.mult_config import MultTrainConfig
from xmodal.jobs.pretrain_config import PretrainConfig
from xmodal.models.lxmert.finetune import LxmertForQuestionAnswering
from xmodal.models.lxmert.model import LxmertForPretraining
from xmodal.models.mult.model import Mult
from xmodal.objectives.finetune import FinetuneObjective
from xmodal.objectives.pretraining import PretrainingObjective
from xmodal.objectives.sentiment import MultObjective
from xmodal.runner.hooks import ValidationSelection
from xmodal_testing import PYTHON, REPO

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py
EXPORT = str(REPO / "jobs" / "export.py")
# The command line runs outside the checkout (cwd: the test's folder), so this checkout's package first.
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "platform"), os.environ.get("PYTHONPATH", "")])}


def write_checkpoint(folder, cfg, objective, store=None, best=None):
    """A checkpoint folder as a run's rank 0 writes it (hooks: save, the job's best_model.pt, seal)."""
    state = TrainState(objective, torch.optim.SGD(objective.parameters(), lr=0.1), step=12)
    ckpt.save(folder, state, {"epoch": 1, "pos": 0, "finished": True, "best": None, "run_id": "0123abcd",
                              "config": cfg.model_dump(mode="json"), "store": str(store) if store else None})
    if best is not None:
        torch.save({"weights": best, "score": 0.5, "valid": {}}, folder / ValidationSelection.BEST_FILE)
    ckpt.seal(folder)
    return folder


def vocabulary(folder, size):
    folder.mkdir()
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(size - 5)]
    (folder / "vocab.txt").write_text("\n".join(tokens) + "\n")
    return folder


def test_command_line_exports_a_pretraining_checkpoint_with_its_stores_tokenizer(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = load_config(PretrainConfig, overrides=["preset=tiny"])
    objective = PretrainingObjective(LxmertForPretraining(cfg.model), cfg.tasks)
    store = vocabulary(tmp_path / "store", cfg.model.vocab_size)
    folder = write_checkpoint(tmp_path / "checkpoint_000001", cfg, objective, store)
    out = subprocess.run([PYTHON, EXPORT, "--checkpoint", str(folder), "--to", "transformers", "--out",
                          str(tmp_path / "hf")], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=ENV)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"[xmodal] exported the pretrain model of checkpoint {folder} (last weights) to "
                               f"{tmp_path / 'hf'}: LxmertForPreTraining")
    assert all(line.startswith("[xmodal]") for line in lines) and "zero table" in out.stdout
    assert out.stderr == ""  # nothing of transformers' own (its progress bars) on the console
    assert not (tmp_path / "mlflow.db").exists()  # a checkpoint source opens no tracking store
    hf = transformers.LxmertForPreTraining.from_pretrained(tmp_path / "hf").eval()
    assert torch.equal(hf.lxmert.embeddings.word_embeddings.weight, objective.model.encoder.word_embedding.word.weight)
    assert transformers.AutoTokenizer.from_pretrained(tmp_path / "hf").convert_tokens_to_ids("w3") == 8
    meta = json.loads((tmp_path / "hf" / PROVENANCE_FILE).read_text())
    assert meta["run_id"] == "0123abcd" and meta["weights"] == "last"

    first = sorted(p.name for p in (tmp_path / "hf").iterdir())
    again = subprocess.run([PYTHON, EXPORT, "--checkpoint", str(folder), "--to", "transformers", "--out",
                            str(tmp_path / "hf")], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=ENV)
    # the same command's own earlier export is replaced whole (a user's file there is refused:
    # test_export_transformers.py)
    assert again.returncode == 0, again.stderr
    assert sorted(p.name for p in (tmp_path / "hf").iterdir()) == first and ".xmodal-output.json" in first
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint_000001", "hf", "store"]


def test_a_finetuning_checkpoint_exports_the_weights_selected_on_validation(tmp_path):
    cfg = load_config(FinetuneConfig, overrides=["preset=tiny", "init.source=scratch", "task=gqa"])
    objective = FinetuneObjective(LxmertForQuestionAnswering(cfg.model, 5), "gqa")
    torch.manual_seed(3)
    selected = FinetuneObjective(LxmertForQuestionAnswering(cfg.model, 5), "gqa").state_dict()
    # a fine-tuning set names the LXMERT store whose tokenizer made its input_ids
    lxmert = vocabulary(tmp_path / "lxmert", cfg.model.vocab_size)
    (tmp_path / "set").mkdir()
    (tmp_path / "set" / "manifest.json").write_text(json.dumps({"task": "gqa", "store": str(lxmert)}))
    folder = write_checkpoint(tmp_path / "ckpt", cfg, objective, tmp_path / "set", best=selected)
    source = from_checkpoint(folder)
    assert (source.kind, source.weights, source.vocab) == ("gqa", "selected", lxmert / "vocab.txt")
    got = source.model.state_dict()
    assert all(torch.equal(got[k], selected["model." + k]) for k in got)
    assert not torch.equal(got["answer_head.fc2.weight"], objective.model.answer_head.fc2.weight)


def _selecting_checkpoint(tmp_path):
    """A MulT checkpoint whose selected weights differ from its last ones."""
    cfg = load_config(MultTrainConfig, overrides=["preset=reference", "model.l_dim=12", "model.a_dim=7",
                                                  "model.v_dim=5", "model.layers=1"])
    objective = MultObjective(Mult(cfg.model), "sentiment", "l1")
    torch.manual_seed(3)
    selected = MultObjective(Mult(cfg.model), "sentiment", "l1").state_dict()
    return write_checkpoint(tmp_path / "ckpt", cfg, objective, best=selected)


@pytest.mark.parametrize("name", [ckpt.MODEL_FILE, ValidationSelection.BEST_FILE])
def test_a_weight_file_that_no_longer_matches_its_recorded_sha256_is_refused(tmp_path, name):
    folder = _selecting_checkpoint(tmp_path)
    blob = bytearray((folder / name).read_bytes())
    blob[-100] ^= 0xFF  # one byte inside the stored tensors: same size, another sha256
    (folder / name).write_bytes(bytes(blob))
    with pytest.raises(UserError, match=rf"--checkpoint: {name} in {folder} does not match the sha256 meta.json "
                                        "records .* refusing to export it"):
        run_export("mult-reference", str(tmp_path / "out"), checkpoint=str(folder))
    (folder / name).write_bytes(bytes(blob[:-10]))
    with pytest.raises(UserError, match=rf"{name} in {folder} has \d+ bytes, but meta.json records \d+: truncated"):
        run_export("mult-reference", str(tmp_path / "out"), checkpoint=str(folder))
    assert not (tmp_path / "out").exists()


def test_a_selecting_checkpoint_without_its_selected_weights_is_refused_not_exported_as_last(tmp_path):
    folder = _selecting_checkpoint(tmp_path)
    (folder / ValidationSelection.BEST_FILE).unlink()  # meta.json still records it
    with pytest.raises(UserError, match=r"--checkpoint: .*ckpt lacks best_model.pt, the weights its run selected on "
                                        r"validation, which meta.json records: .*--logged-model runs:/0123abcd/"):
        run_export("mult-reference", str(tmp_path / "out"), checkpoint=str(folder))
    # A run's `model` artifact of a selecting job (a finished run) must hold them, recorded or not.
    meta = json.loads((folder / "meta.json").read_text())
    del meta["files"]
    (folder / "meta.json").write_text(json.dumps(meta))
    with pytest.raises(UserError, match=r"--run-id: run feed's `model` artifact holds no best_model.pt, the weights "
                                        r"the run selected on validation \(valid/mae\).*--logged-model "
                                        r"runs:/feed/final_model"):
        from_checkpoint(folder, key="--run-id", run_id="feed")
    # A checkpoint written before the run's first validation: its last weights, said so.
    result = run_export("mult-reference", str(tmp_path / "out"), checkpoint=str(folder))
    provenance = json.loads((result.out / PROVENANCE_FILE).read_text())
    assert provenance["weights"] == "last" and provenance["selected_on"] is None
    assert any("no weights selected on validation" in n for n in provenance["notes"])


def test_the_export_names_the_selected_weights_and_their_metric(tmp_path, capsys):
    folder = _selecting_checkpoint(tmp_path)
    result = run_export("mult-reference", str(tmp_path / "out"), checkpoint=str(folder))
    assert f"(weights selected on valid/mae) to {result.out}" in capsys.readouterr().out
    provenance = json.loads((result.out / PROVENANCE_FILE).read_text())
    assert (provenance["weights"], provenance["selected_on"]) == ("selected", "valid/mae")


def test_an_out_that_cannot_be_written_is_one_error_naming_it(tmp_path):
    folder = _selecting_checkpoint(tmp_path)
    (tmp_path / "file").write_text("x")
    for out, message in ((tmp_path / "file" / "out", r"--out: '.*/file/out' cannot be made: '.*/file' is a file"),
                         (tmp_path / "file", r"--out: '.*/file' is a file; expected a folder"),
                         ("/proc/xmodal-export", r"--out: '/proc/xmodal-export' cannot be written: '/proc' refuses"),
                         ("s3://bucket/export", r"--out: 's3://bucket/export' is a URI; export writes a local folder only")):
        with pytest.raises(UserError, match=message):
            run_export("mult-reference", str(out), checkpoint=str(folder))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt", "file"]


def test_a_mult_checkpoint_exports_to_the_mult_reference(tmp_path):
    cfg = load_config(MultTrainConfig, overrides=["preset=reference", "model.l_dim=12", "model.a_dim=7",
                                                  "model.v_dim=5", "model.layers=1"])
    objective = MultObjective(Mult(cfg.model), "sentiment", "l1")
    folder = write_checkpoint(tmp_path / "ckpt", cfg, objective)
    result = run_export("mult-reference", str(tmp_path / "out"), checkpoint=str(folder))
    hyp = json.loads((result.out / MULT_HYPERPARAMETERS_FILE).read_text())
    assert hyp["orig_d_l"] == 12 and hyp["layers"] == 1 and hyp["embed_dropout"] == cfg.model.embed_dropout


def test_bad_sources_are_refused_and_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = str(tmp_path / "out")
    with pytest.raises(UserError, match=r"--checkpoint: '.*/nowhere' does not exist"):
        run_export("transformers", out, checkpoint=str(tmp_path / "nowhere"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match=r"--checkpoint: .* is not a checkpoint: model.pt, meta.json missing"):
        run_export("transformers", out, checkpoint=str(tmp_path / "empty"))
    cfg = load_config(PretrainConfig, overrides=["preset=tiny"])
    folder = write_checkpoint(tmp_path / "foreign", cfg, PretrainingObjective(LxmertForPretraining(cfg.model),
                                                                              cfg.tasks))
    meta = json.loads((folder / "meta.json").read_text())
    (folder / "meta.json").write_text(json.dumps({**meta, "config": {"model": {"hidden": 3}}}))
    with pytest.raises(UserError, match=r"--checkpoint: .*meta.json: its config is no pretraining, fine-tuning or MulT"):
        run_export("transformers", out, checkpoint=str(folder))
    with pytest.raises(UserError, match=r"no MLflow database at .*mlflow.db; expected an existing one"):
        run_export("transformers", out, run_id="0123456789abcdef")  # the default ./mlflow.db: absent, not created
    with pytest.raises(UserError, match="name one source: --run-id ID, --checkpoint DIR or --logged-model URI"):
        run_export("transformers", out)
    with pytest.raises(UserError, match="--to 'onnx': expected one of"):
        run_export("onnx", out, checkpoint=str(folder))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "foreign"]


def test_logged_model_uris_that_name_nothing_are_refused(tmp_path):
    from xmodal import tracking

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracking.ensure_experiment(uri, "xmodal-pretrain")
    for model_uri, message in (("models:/m-0123", r"'models:/m-0123': no such model at sqlite:///"),
                               ("runs:/0123/final_model", r"'runs:/0123/final_model': no such model"),
                               ("models:/m-a'b", r"cannot be looked up at sqlite:///.*Invalid filter string"),
                               ("file:///tmp/model", r"expected models:/MODEL_ID or runs:/RUN_ID/final_model")):
        with pytest.raises(UserError, match=message):
            run_export("transformers", str(tmp_path / "out"), logged_model=model_uri, tracking_uri=uri)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mlflow.db"]


@pytest.mark.slow
def test_a_real_pretraining_runs_checkpoint_and_logged_model_export_to_transformers(tmp_path, pretrain_run):
    """A tiny pretraining run through the engine (the session's, tests/runs_testing.py: Ray Train, MLflow in
    SQLite), exported from its MLflow run and from its logged model: both load into LxmertForPreTraining and
    compute the run's model."""
    transformers = pytest.importorskip("transformers")
    from xmodal import tracking

    uri, result = pretrain_run.uri, pretrain_run.result
    with result.checkpoint.as_directory() as d:
        trained = from_checkpoint(d).model  # the run's final weights, as our model

    by_run = run_export("transformers", str(tmp_path / "by-run"), run_id=result.run_id, tracking_uri=uri)
    logged = run_export("transformers", str(tmp_path / "by-model"), logged_model=f"runs:/{result.run_id}/final_model",
                        tracking_uri=uri)
    assert {"tokenizer.json", "vocab.txt"} <= set(by_run.files) & set(logged.files)  # the store's vocabulary
    assert json.loads((tmp_path / "by-run" / PROVENANCE_FILE).read_text())["run_id"] == result.run_id
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, trained.config.vocab_size, (2, 7), generator=g)
    feats, boxes = torch.randn(2, 8, 16, generator=g), torch.rand(2, 8, 4, generator=g)
    with torch.no_grad():
        ours = trained.mlm_head(trained(ids, None, feats, boxes).lang)
        for folder in ("by-run", "by-model"):
            hf = transformers.LxmertForPreTraining.from_pretrained(tmp_path / folder).eval()
            theirs = hf(input_ids=ids, visual_feats=feats, visual_pos=boxes).prediction_logits
            torch.testing.assert_close(theirs, ours, atol=1e-5, rtol=0)
    with pytest.raises(UserError, match=r"--run-id: no MLflow run 'feedface' at sqlite:///"):
        run_export("transformers", str(tmp_path / "nope"), run_id="feedface", tracking_uri=uri)
    with pytest.raises(UserError, match=r"logged model 'models:/m-nothere': no such model at sqlite:///"):
        run_export("transformers", str(tmp_path / "nope"), logged_model="models:/m-nothere", tracking_uri=uri)
    assert not (tmp_path / "nope").exists()
    assert tracking.get_run(uri, result.run_id).status == "FINISHED"
