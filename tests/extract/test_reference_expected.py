"""The extraction's regions of scikit-learn's two sample photographs against the reference's own, stored
(tests/extract/data/reference_sklearn_tiny.md says how it was made): one image at a time and both in one
batch, through the job's decode task and detector actor. A change to the input path (decode, colour
order, resize, scale) or to any discrete step that moves a box fails here."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from scripts.reference import common, extractor  # noqa: E402
from xmodal.core.checkpoint import sha256_of  # noqa: E402

EXPECTED = Path(__file__).parent / "data" / "reference_sklearn_tiny.npz"
WEIGHTS_SHA256 = "463b69064f11341e2af2b2e9ca3788eba18c07f7905e42ef5ce7a47337d07505"


@pytest.mark.slow
def test_the_reference_regions_of_scikit_learns_photographs(tmp_path, capsys):
    sklearn = pytest.importorskip("sklearn")
    images = tmp_path / "images"
    images.mkdir()
    for name in ("china.jpg", "flower.jpg"):
        shutil.copyfile(Path(sklearn.__file__).parent / "datasets" / "images" / name, images / name)
    weights = tmp_path / "w.pkl"
    extractor.write_weights(weights, extractor.TINY, 0, 1.0, 0.0)
    assert sha256_of(weights) == WEIGHTS_SHA256, "the random weights are not those the expected output was made with"
    for batch in ("1", "2"):
        out = tmp_path / f"ours_{batch}"
        argv = ["ours", "--weights", str(weights), str(images), "--out", str(out), "--batch-size", batch, "--threads", "2"]
        assert common.command(extractor.main, argv) == 0
        capsys.readouterr()
        assert common.command(extractor.main, ["compare", str(EXPECTED), str(out)]) == 0
        rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        assert [(r["image"], r["verdict"], r["identical"], r["obj_agree"]) for r in rows[:-1]] == [
            ("china", "identical", 36, 36), ("flower", "identical", 36, 36)], rows
        assert all(r["max_feature_diff"] < 1e-4 for r in rows[:-1])
