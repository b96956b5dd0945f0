"""MulT's configuration (xmodal.models.mult.config): the presets are the reference's and the paper's, and a
bad field is named with its value and what it should be."""

from __future__ import annotations

import pytest

from xmodal.models.mult.config import PRESETS, MultConfig, preset
from xmodal.models.mult.model import Mult


def test_presets_and_config_errors():
    for name, cfg in PRESETS.items():
        cfg.validate()
        assert preset(name) is cfg
    ref = preset("reference")
    assert (ref.dim, ref.layers, ref.num_heads, ref.self_depth, ref.embed_scale, ref.causal) == (30, 5, 5, 5, True, True)
    assert (ref.attn_dropout, ref.attn_dropout_a, ref.attn_dropout_v, ref.embed_dropout) == (0.1, 0.0, 0.0, 0.25)
    assert preset("paper_iemocap").output_dim == 8
    assert (preset("paper_mosi").a_dim, preset("paper_mosi").v_dim) == (5, 20)
    with pytest.raises(KeyError, match="valid presets"):
        preset("nope")
    with pytest.raises(ValueError, match=r"MultConfig.a_kernel = 2: expected an odd"):
        Mult(MultConfig(a_kernel=2))
    with pytest.raises(ValueError, match=r"MultConfig.dim = 30: expected a multiple of num_heads = 8"):
        Mult(MultConfig(dim=30))
    with pytest.raises(ValueError, match=r"MultConfig.variant = 'both'"):
        Mult(MultConfig(variant="both"))
