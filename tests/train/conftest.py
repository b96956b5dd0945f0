"""Tiny stores of each kind (`xmodal_testing.tiny_worker` runs a job's worker on them)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def stores(tmp_path_factory):
    """A tiny LXMERT store, a MulT store, a VQA set on the LXMERT store's images and an NLVR2 set."""
    from xmodal.data.finetune.synthetic import build_synthetic_nlvr2, build_synthetic_vqa
    from xmodal.data.lxmert.synthetic import build_synthetic_store
    from xmodal.data.mult.synthetic import SyntheticMultOptions
    from xmodal.data.mult.synthetic import build_synthetic_store as build_mult
    from xmodal.data.options import SyntheticLxmertOptions

    root = tmp_path_factory.mktemp("stores")
    images = build_synthetic_store(root / "lxmert", SyntheticLxmertOptions(
        num_images=160, feat_dim=16, num_objects=8, num_object_labels=10, num_attr_labels=4, num_answers=20))
    spelled = build_synthetic_store(root / "lxmert-nlvr2", SyntheticLxmertOptions(
        num_images=160, num_objects=8, feat_dim=16, num_object_labels=40, num_attr_labels=8, num_answers=60,
        sentences_per_image=6, minival_fraction=0.25))  # a corpus whose vocabulary spells the NLVR2 statements
    return {"pretrain": images.path, "mult": build_mult(root / "mult", SyntheticMultOptions(num_samples=240)).path,
            "finetune": build_synthetic_vqa(images.path, root / "vqa", questions_per_image=2).path,
            "nlvr2": build_synthetic_nlvr2(spelled.path, root / "nlvr2").path}
