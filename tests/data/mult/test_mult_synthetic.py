"""Synthetic MulT data: its construction and the CLI. That it takes two modalities to learn it (the
job's default full MulT learns it, every unimodal variant stays at chance, and the unimodal
controls learn a label their stream carries alone) is tested in tests/train/test_mult_learning.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from xmodal.data.mult.store import MODALITIES, MultStore
from xmodal.data.mult.synthetic import SyntheticMultOptions, generate
from xmodal.ingest_cli import main as ingest_main


def test_streams_are_unaligned_and_only_the_combination_predicts():
    sp = generate(SyntheticMultOptions(num_samples=2000, seed=3))
    assert {k: len(v) for k, v in sp.items()} == {"train": 1600, "valid": 200, "test": 200}
    tr = sp["train"]
    lens = {m: tr.lengths[m] for m in MODALITIES}
    assert (lens["audio"] > 2 * lens["text"]).mean() > 0.9 and (lens["vision"] > lens["text"]).mean() > 0.9
    assert len(np.unique(lens["audio"] - 3 * lens["text"])) > 3  # no fixed ratio: not aligned
    y = tr.labels
    assert set(np.unique(np.abs(y))) == {1.0, 2.0, 3.0}
    # Any single stream is (nearly) uncorrelated with the label's sign.
    audio_energy = np.array([np.abs(tr.batch([i]).audio[0].numpy().astype(np.float32)).max()
                             for i in range(len(tr))])
    assert abs(np.corrcoef(audio_energy, y)[0, 1]) < 0.1
    again = generate(SyntheticMultOptions(num_samples=2000, seed=3))["valid"]
    np.testing.assert_array_equal(again.values["text"], sp["valid"].values["text"])  # deterministic


def test_cli_builds_a_store(tmp_path: Path, capsys):
    out = tmp_path / "syn"
    assert ingest_main(["mult-synthetic", str(out), "--num-samples", "50", "--seed", "1"]) == 0
    store = MultStore.open(out)
    assert store.manifest.dataset == "synthetic" and store.manifest.rows == {"train": 40, "valid": 5, "test": 5}
    assert store.manifest.source["options"]["seed"] == 1
    assert ingest_main(["mult-synthetic", str(out), "--num-samples", "5"]) == 2
    assert "num_samples = 5: expected >= 10" in capsys.readouterr().err

