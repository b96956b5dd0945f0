"""`python jobs/ingest.py SOURCE ...` as a user runs it: bad input of every source is one line
`error: ...` on stderr naming the file or flag, exit code 2, no traceback. The subprocesses start
together (each imports torch or pyarrow: a few seconds apiece on a busy machine)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from xmodal.data.lxmert.synthetic import build_synthetic_store
from xmodal.data.options import SyntheticLxmertOptions
from xmodal_testing import PYTHON, REPO

TINY = SyntheticLxmertOptions(num_images=20, num_objects=4, feat_dim=8, num_object_labels=10, num_attr_labels=4,
                              num_answers=20, sentences_per_image=2, images_per_shard=16)


def _start(argv: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO / "platform")}
    return subprocess.Popen([PYTHON, str(REPO / "jobs" / "ingest.py"), *argv], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def test_every_source_reports_bad_input_as_one_error_line(tmp_path: Path):
    lxmert = build_synthetic_store(tmp_path / "lxmert", TINY)
    manifest = (lxmert.path / "manifest.json").read_text()
    not_a_store = tmp_path / "notes"
    not_a_store.mkdir()
    (not_a_store / "notes.txt").write_text("keep me")
    pickle = tmp_path / "clips.pkl"
    pickle.write_bytes(b"\x80\x02}q\x00.")  # an empty dict: never read, the target is refused first
    missing = tmp_path / "missing.tsv"
    out = str(tmp_path / "out")
    # source -> (arguments, what stderr must name)
    cases = {
        "lxmert": (["lxmert", out, "--tsv", str(missing), "--json", str(missing), "--no-progress"],
                   [str(missing), "does not exist"]),
        "features": (["features", str(lxmert.path), "--tsv", str(missing), "--overwrite", "--no-progress"],
                     [str(lxmert.path), "LXMERT feature store", "feature-only image store", "refusing"]),
        "synthetic": (["synthetic", out, "--num-images", "1", "--no-progress"], ["num_images=1"]),
        # the reported bug: --overwrite of a MulT ingest replaced an LXMERT store
        "mult": (["mult", str(lxmert.path), "--pickle", str(pickle), "--format", "mmsa", "--overwrite"],
                 [str(lxmert.path), "LXMERT feature store", "MulT store", "refusing"]),
        "mult-synthetic": (["mult-synthetic", out, "--num-samples", "5"], ["num_samples = 5"]),
        "vqa": (["vqa", out, "--store", str(not_a_store), "--train", str(missing)],
                [str(not_a_store), "expected an LXMERT feature store"]),
        "gqa": (["gqa", out, "--store", str(lxmert.path)], ["--train, --valid, --test"]),
        "nlvr2": (["nlvr2", out, "--store", str(lxmert.path), "--train", str(missing), "--answers", str(missing)],
                  ["--answers"]),
        "synthetic-vqa": (["synthetic-vqa", str(lxmert.path), "--store", str(lxmert.path)],
                          [str(lxmert.path), "inside the feature store"]),
        "synthetic-gqa": (["synthetic-gqa", out, "--store", str(lxmert.path), "--pairs-per-statement", "2"],
                          ["--pairs-per-statement"]),
        "synthetic-nlvr2": (["synthetic-nlvr2", out, "--store", str(tmp_path / "nowhere")],
                            [str(tmp_path / "nowhere"), "does not exist"]),
    }
    running = {source: _start(argv) for source, (argv, _) in cases.items()}
    for source, proc in running.items():
        stdout, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 2, (source, proc.returncode, stdout, stderr)
        assert "Traceback" not in stderr + stdout, (source, stderr)
        lines = stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: "), (source, stderr)
        for part in cases[source][1]:
            assert part in lines[0], (source, part, lines[0])
    # Nothing was written or replaced.
    assert (lxmert.path / "manifest.json").read_text() == manifest
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clips.pkl", "lxmert", "notes"]
    assert json.loads(manifest)["kind"] == "lxmert"
