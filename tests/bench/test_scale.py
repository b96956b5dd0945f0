"""`jobs/benchmark.py scale --quick`: reference-format inputs written, ingested through the real
ingest functions, the stores measured (size, open, pipeline, one worker's epoch) and the inputs
deleted. Checks every field of the JSON is there and positive, the worker's RSS ratio across the two
store sizes is finite, the extrapolation is filled in, the Markdown is written and --work, made for the
run, is gone again. Speed is not asserted: CI machines differ."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
POSITIVE = ("items", "ingest_s", "ingest_cpu_s", "processes", "ingest_peak_rss_bytes", "items_per_s_per_process",
            "items_per_cpu_s", "pipeline_best_samples_s",
            "store_bytes", "open_s", "open_peak_bytes", "pipeline_samples_s",
            "worker_peak_rss_bytes", "worker_rss_before_bytes", "worker_steps", "worker_s", "worker_samples")
LXMERT_ONLY = ("tsv_bytes", "json_bytes", "sentences", "sentence_part_s", "sentence_part_cpu_s", "per_image_s",
               "per_image_cpu_s", "per_sentence_s", "per_sentence_cpu_s",
               "store_bytes_per_image", "train_images", "train_sentences")


@pytest.mark.slow
def test_quick_scale_rehearsal_writes_every_field(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    # The smallest sizes it takes (20 and 200 images, 10x apart as --quick's 100 and 1,000): every field is
    # written and the store still grows tenfold while the worker's resident set does not.
    run = subprocess.run([sys.executable, str(ROOT / "jobs" / "benchmark.py"), "scale", "--quick", "--images", "20,200",
                          "--out", str(out), "--work", str(work)], capture_output=True, text=True, cwd=ROOT, timeout=300,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "platform")})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (js,) = out.glob("scale-*.json")
    md = js.with_suffix(".md").read_text()
    assert md.startswith("Scale rehearsal,") and "QUICK" in md and "ratio large/small" in md
    res = json.loads(js.read_text())
    assert res["meta"]["quick"] is True and res["meta"]["images"] == [20, 200]

    rows = res["rows"]
    assert [(r["kind"], r["items"]) for r in rows] == [("lxmert", 20), ("lxmert", 200), ("mult", 60)]
    for r in rows:
        for key in POSITIVE + (LXMERT_ONLY if r["kind"] == "lxmert" else ("pickle_bytes",)):
            assert isinstance(r[key], (int, float)) and math.isfinite(r[key]) and r[key] > 0, (r["kind"], key, r[key])
        assert r["processes"] == 1
    # One epoch: every train sentence of the store once, in whole batches.
    for r in rows[:2]:
        assert r["worker_samples"] == r["train_sentences"] // r["batch"] * r["batch"] > 0
        assert r["images_stored"] == r["items"] and r["sentences"] == 5 * r["items"]
    assert rows[1]["store_bytes"] > 5 * rows[0]["store_bytes"]  # the store grows with the images ...

    growth = res["growth"]
    ratio = growth["worker_rss_ratio"]
    assert math.isfinite(ratio) and 0.5 < ratio < 1.5  # ... the worker's resident set does not
    assert set(growth["figures"]) >= {"worker peak RSS GiB", "store GiB", "ingest images/s per process"}

    x = res["extrapolation"]
    assert x["from_images"] == 200 and len(x["rows"]) == 4 and x["mult"]["clips"] == 60
    paper = x["rows"][0]
    assert paper["images"] == 180_000 and paper["sentences"] == 9_180_000
    for key in ("ingest_hours_1proc", "ingest_hours_1core_cpu", "store_bytes", "ingest_peak_rss_bytes", "worker_peak_rss_bytes"):
        assert paper[key] > 0, key
    assert paper["processes_for_1h"] >= 1
    assert not work.exists()  # inputs and stores deleted, with the --work folder made for them
