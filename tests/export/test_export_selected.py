"""Runs that select their model on validation (fine-tuning, MulT), exported from their MLflow run: the
export computes the selected model, not the last weights. Real tiny runs through the engine (the session's,
tests/runs_testing.py: the shared local Ray; the VQA run's MLflow a real `mlflow server`, MulT's SQLite);
each selects on its worst validation loss (best_mode=max), so that the selected weights are an early
evaluation's and differ from the last."""

from __future__ import annotations

import json

import pytest
import torch

from mult_reference_layout import MULTModel
from xmodal.core import checkpoint as ckpt
from xmodal.export import MULT_HYPERPARAMETERS_FILE, MULT_WEIGHTS_FILE, PROVENANCE_FILE, run_export
from xmodal.export.source import bare_model, job_config
from xmodal.runner.hooks import ValidationSelection

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

def selected_and_last(result):
    """The run's selected and last models, read from its final checkpoint on storage (not through the
    MLflow artifact the export reads)."""
    with result.checkpoint.as_directory() as d:
        raw = ckpt.read_meta(d)["config"]
        kind, cfg, _ = job_config(raw, "the run's checkpoint")
        best = torch.load(f"{d}/{ValidationSelection.BEST_FILE}", map_location="cpu", weights_only=True)["weights"]
        last = torch.load(f"{d}/{ckpt.MODEL_FILE}", map_location="cpu", weights_only=True)
    return bare_model(kind, cfg, best, "best"), bare_model(kind, cfg, last, "last")


def provenance(folder):
    return json.loads((folder / PROVENANCE_FILE).read_text())


def test_a_vqa_run_exports_its_selected_model(tmp_path, vqa_run, capsys):
    transformers = pytest.importorskip("transformers")
    uri, result = vqa_run.uri, vqa_run.result
    selected, last = selected_and_last(result)

    capsys.readouterr()
    run_export("transformers", str(tmp_path / "by-run"), run_id=result.run_id, tracking_uri=uri)
    assert f"(weights selected on valid/loss) to {tmp_path / 'by-run'}" in capsys.readouterr().out
    run_export("transformers", str(tmp_path / "by-model"), logged_model=f"runs:/{result.run_id}/final_model",
               tracking_uri=uri)
    for folder in ("by-run", "by-model"):
        said = provenance(tmp_path / folder)
        assert (said["weights"], said["selected_on"], said["run_id"]) == ("selected", "valid/loss", result.run_id)

    g = torch.Generator().manual_seed(0)
    c = selected.config
    ids = torch.randint(5, c.vocab_size, (4, 7), generator=g)
    feats, boxes = torch.randn(4, 8, c.visual_feat_dim, generator=g), torch.rand(4, 8, 4, generator=g)
    with torch.no_grad():
        want, old = selected(ids, None, feats, boxes), last(ids, None, feats, boxes)
        assert (want - old).abs().max() > 1e-3  # the selection is not the last weights
        for folder in ("by-run", "by-model"):
            hf = transformers.LxmertForQuestionAnswering.from_pretrained(tmp_path / folder).eval()
            got = hf(input_ids=ids, visual_feats=feats, visual_pos=boxes).question_answering_score
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_a_mult_run_exports_its_selected_model(tmp_path, mult_run):
    uri, result = mult_run.uri, mult_run.result  # in MULTModel's layout: the reference preset
    selected, last = selected_and_last(result)

    out = run_export("mult-reference", str(tmp_path / "by-run"), run_id=result.run_id, tracking_uri=uri).out
    said = provenance(out)
    assert (said["weights"], said["selected_on"]) == ("selected", "valid/loss")
    ref = MULTModel(json.loads((out / MULT_HYPERPARAMETERS_FILE).read_text())).eval()
    ref.load_state_dict(torch.load(out / MULT_WEIGHTS_FILE, weights_only=True), strict=True)
    g = torch.Generator().manual_seed(1)
    c = selected.config
    x = [torch.randn(3, t, d, generator=g) for t, d in zip((6, 9, 4), (c.l_dim, c.a_dim, c.v_dim), strict=True)]
    with torch.no_grad():
        want, old = selected(*x).output, last(*x).output
        assert (want - old).abs().max() > 1e-3  # the selection is not the last weights
        torch.testing.assert_close(ref(*x)[0], want, atol=1e-5, rtol=1e-5)
