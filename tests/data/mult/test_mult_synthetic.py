"""Synthetic MulT data: its construction and the CLI. That it takes two modalities to learn it (the
job's default full MulT learns it, every unimodal variant stays at chance, and the unimodal
controls learn a label their stream carries alone) is tested in tests/jobs/test_mult_learning.py."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from xmodal.cli.ingest import main as ingest_main
from xmodal.data.mult.store import MODALITIES, MultStore, open_store
from xmodal.data.mult.synthetic import SyntheticMultOptions, ensure_synthetic_store, generate


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



def test_embedded_default_is_rebuilt_when_built_otherwise_and_a_named_store_is_not(tmp_path: Path, capsys):
    a, b = SyntheticMultOptions(num_samples=40, seed=1), SyntheticMultOptions(num_samples=40, seed=2)
    embedded = tmp_path / "synthetic_mult"
    first = ensure_synthetic_store(embedded, a)
    stamp = (embedded / "manifest.json").stat().st_mtime_ns
    assert ensure_synthetic_store(embedded, a).manifest == first.manifest  # same options: reused as is
    assert (embedded / "manifest.json").stat().st_mtime_ns == stamp and capsys.readouterr().out == ""
    rebuilt = ensure_synthetic_store(embedded, b)
    assert rebuilt.manifest.source["options"]["seed"] == 2
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and f"note: rebuilding {embedded}" in out and "seed: built with 1, asked for 2" in out
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]
    # A store the user named (built with options A) is opened as it is, whatever the job's options,
    # and the CLI does not replace it without --overwrite.
    named = tmp_path / "mine"
    assert ingest_main(["mult-synthetic", str(named), "--num-samples", "40", "--seed", "1"]) == 0
    manifest = (named / "manifest.json").read_text()
    assert open_store(named).manifest.source["options"]["seed"] == 1
    assert ingest_main(["mult-synthetic", str(named), "--num-samples", "40", "--seed", "2"]) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert (named / "manifest.json").read_text() == manifest
