"""`--to mult-reference`: MulT as the reference MULTModel's state dict, loaded strictly into a model
built from the written hyp_params.json (tests/mult_reference_layout.py), with equal outputs."""

from __future__ import annotations

import json

import pytest
import torch

from mult_reference_layout import MULTModel
from xmodal.base.errors import UserError
from xmodal.export import MULT_HYPERPARAMETERS_FILE, MULT_WEIGHTS_FILE, export
from xmodal.export.source import from_model
from xmodal.models.lxmert.model import LxmertForPretraining
from xmodal.models.lxmert.model import preset as lxmert_preset
from xmodal.models.mult.config import preset
from xmodal.models.mult.model import Mult

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

# The reference's d = 30 and kernel-1 projections; inputs not 30 wide; small lengths.
REF = preset("reference").replace(l_dim=12, a_dim=7, v_dim=5, layers=2, num_heads=5)
LENS = (6, 9, 4)  # T_l < T_a: lower-right causal offsets in both directions


def randomised(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.2)
    return model.eval()


def inputs(seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(3, t, d, generator=g) for t, d in zip(LENS, (REF.l_dim, REF.a_dim, REF.v_dim), strict=True)]


@pytest.mark.parametrize("variant, causal", [("full", True), ("full", False), ("target_a", True)])
def test_mult_loads_into_multmodel_built_from_the_written_hyperparameters(tmp_path, variant, causal):
    torch.manual_seed(0)
    src = randomised(Mult(REF.replace(variant=variant, causal=causal, output_dim=3)))
    result = export(from_model(src, "mult"), "mult-reference", tmp_path / "mult")
    assert {MULT_WEIGHTS_FILE, MULT_HYPERPARAMETERS_FILE} <= set(result.files)
    hyp = json.loads((tmp_path / "mult" / MULT_HYPERPARAMETERS_FILE).read_text())
    assert (hyp["lonly"], hyp["aonly"], hyp["vonly"]) == ((True,) * 3 if variant == "full" else (False, True, False))
    assert hyp["attn_mask"] is causal and hyp["output_dim"] == 3 and hyp["layers"] == 2
    ref = MULTModel(hyp).eval()
    ref.load_state_dict(torch.load(tmp_path / "mult" / MULT_WEIGHTS_FILE, weights_only=True), strict=True)
    x = inputs()
    with torch.no_grad():
        ours = src(*x)
        out, last_hs = ref(*x)
    torch.testing.assert_close(out, ours.output, atol=1e-5, rtol=1e-5)  # as tests/models/test_mult.py
    torch.testing.assert_close(last_hs, ours.hidden, atol=1e-5, rtol=1e-5)
    if variant != "full":
        assert any("zero weights" in n for n in result.notes)


@pytest.mark.parametrize("change, named", [
    ({"variant": "early_fusion"}, r"model.variant='early_fusion' \(the reference's MULTModel has full, target_l"),
    ({"dim": 32, "num_heads": 4}, r"model.dim=32 \(MULTModel fixes d_l = d_a = d_v = 30\)"),
    ({"a_kernel": 3}, r"model.a_kernel=3"),
    ({"embed_scale": False}, r"model.embed_scale=False"),
    ({"l_dim": 30}, r"model.l_dim=30 \(MULTModel skips proj_l"),
    ({"self_layers": 1}, r"model.self_layers=1 \(the reference's self-attention transformers are max\(layers, 3\)"),
])
def test_what_multmodel_cannot_hold_is_refused_and_nothing_is_written(tmp_path, change, named):
    with pytest.raises(UserError, match=rf"--to mult-reference cannot hold this mult model .*{named}"):
        export(from_model(Mult(REF.replace(**change)), "mult"), "mult-reference", tmp_path / "mult")
    assert list(tmp_path.iterdir()) == []


def test_an_lxmert_model_is_refused_for_mult_reference(tmp_path):
    with pytest.raises(UserError, match="--to mult-reference: .* is an LXMERT pretrain model; .*--to transformers"):
        export(from_model(LxmertForPretraining(lxmert_preset("tiny")), "pretrain"), "mult-reference", tmp_path / "m")
    assert list(tmp_path.iterdir()) == []
