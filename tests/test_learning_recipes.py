"""scripts/learning_recipes.py without its long runs: its input checks (one `error:` line, exit 2, nothing
written) and the scale rehearsal's store it trains on with `--store scale` (built by the rehearsal's own
writer and the ingest, its inputs removed)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from xmodal_testing import REPO

SCRIPT = REPO / "scripts" / "learning_recipes.py"
_spec = importlib.util.spec_from_file_location("learning_recipes", SCRIPT)
learning_recipes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(learning_recipes)


@pytest.mark.parametrize(("args", "named"), [
    (["mult", "--store", "scale"], ["--store scale", "pretraining store", "got mult"]),
    (["pretrain", "--store", "scale", "--scale-images", "50"], ["--scale-images 50", "at least 100"]),
    (["pretrain", "--seeds", "0,x"], ["--seeds '0,x'", "whole numbers"]),
])
def test_bad_input_is_one_error_and_nothing_written(tmp_path, args, named):
    r = subprocess.run([sys.executable, str(SCRIPT), *args, "--out", "runs.jsonl"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and all(n in lines[0] for n in named), r.stderr
    assert list(tmp_path.iterdir()) == []


def test_scale_store_is_the_rehearsals_inputs_ingested(tmp_path):
    store = learning_recipes.scale_store(tmp_path / "scale", 120)
    m = store.manifest
    assert m.images("train") + m.images("minival") == 120 and m.images("minival") > 0
    assert m.sentences("train") == 5 * m.images("train")  # the rehearsal writes 5 sentences an image
    assert (m.num_objects, m.feat_dim) == (learning_recipes.SCALE_BOXES, learning_recipes.SCALE_FEATURES)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["scale"]  # the TSV, JSON and vocab removed
