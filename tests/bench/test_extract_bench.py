"""`jobs/benchmark.py extract` on the tiny detector: every row and field is there and positive, every
line printed says the weights are random, the JSON and Markdown land in --out, bad flags are one
`error:` line. Speed is not asserted: machines differ."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
STAGES = {"prepare", "backbone", "rpn", "roi_pool", "head", "select", "to_host"}


def bench(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "jobs" / "benchmark.py"), "extract", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT / "platform"), **env})


def test_tiny_extraction_benchmark_writes_every_row(tmp_path, ray_local):
    # the smallest run that writes every row: what is tested is the rows and fields, not the speed. Its job
    # row attaches to the shared test Ray (RAY_ADDRESS, as on a cluster) rather than start a Ray of its own.
    run = bench("--config", "tiny", "--images", "2", "--batch", "2", "--size", "48x64", "--input-size", "48:64",
                "--job-images", "2", "--out", str(tmp_path), RAY_ADDRESS=ray_local.get_runtime_context().gcs_address)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    printed = [line for line in run.stdout.splitlines() if line.strip() and not line.startswith(("|", "Stage", "wrote"))]
    # every line of its own says RANDOM weights (the table's header line too)
    assert printed and all("random weights" in line.lower() for line in printed
                           if not line.startswith(("Decode", "Target", "driver per image", "The job over", "One write task"))), printed
    (js,) = tmp_path.glob("extract-*.json")
    res = json.loads(js.read_text())
    assert res["meta"]["weights"] == "random" and res["meta"]["config"] == "tiny"
    rows = res["detector"]
    assert [(r["regions"], r["precision"]) for r in rows] == [
        ("batched", "fp32"), ("batched", "bf16"), ("per image", "fp32"), ("per image", "bf16")]
    for r in rows:
        # 36 where the network proposes as many; on a 48 x 64 input the tiny net's proposal layer keeps fewer
        assert r["images"] == 2 and 0 < r["boxes_per_image"] <= 36 and r["boxes_per_image"] == rows[0]["boxes_per_image"]
        assert set(r["stage_s_per_image"]) == STAGES
        for key in ("images_s", "s_per_image", "peak_gib", "tflops", "of_matmul", "host_ms_per_image", "kernels_per_image",
                    "op_us"):
            assert math.isfinite(r[key]) and r[key] > 0, (key, r)
        # The FLOP rate: the counted work per image (the same in every row) over this row's time, against
        # the matmul rate of the row's precision measured in the same run.
        assert r["flops_per_image"] == rows[0]["flops_per_image"] > 0
        assert math.isclose(r["tflops"], r["flops_per_image"] * r["images_s"] / 1e12)
        assert math.isclose(r["of_matmul"], r["tflops"] / res["matmul_tflops"][r["precision"]])
    assert res["decode"]["images_s_per_core"] > 0
    # bf16 against fp32: a real difference (bf16 ran) and a small one (0.4 % on this net; bf16 keeps 8 bits)
    (b,) = res["precision"]
    assert b["precision"] == "bf16" and 0 < b["features_rel_l2"] < 0.03, b
    assert all(0 <= b[k] <= 1 for k in ("boxes_kept", "obj_ids_same", "attr_ids_same")), b
    assert js.with_suffix(".md").read_text().startswith("Feature extraction [random weights]")
    # the job's own path: what its driver cost, measured by itself, on a line of its own; the write tasks
    job, write = res["job"], res["write"]
    assert job["images"] == 2 and job["shards"] >= 1 and write["images"] == 256
    for row, key in [*((job, k) for k in ("images_s", "driver_cpu_ms_per_image", "driver_bytes_per_image",
                                          "driver_cpu_per_s")), *((write, k) for k in ("mb_s", "images_s", "shard_mib"))]:
        assert math.isfinite(row[key]) and row[key] > 0, (key, row)
    assert job["driver_bytes_per_image"] < 1024  # names and ids, no features
    line = (f"driver per image: {job['driver_cpu_ms_per_image']:.3f} ms CPU, {job['driver_bytes_per_image']:.0f} bytes "
            "received")
    assert line in run.stdout.splitlines(), run.stdout[-3000:]


@pytest.mark.parametrize(("args", "message"), [
    (("--config", "huge"), "--config 'huge': unknown; expected one of reference, tiny"),
    (("--size", "48by64"), "--size '48by64': expected HEIGHTxWIDTH"),
    (("--images", "0"), "--images 0: expected a number >= 1"),
    (("--input-size", "600x1000"), "--input-size '600x1000': expected SHORT:MAX"),
])
def test_bad_flags_are_one_error_line(args, message, capsys):
    """In this process: the command's own path is the test above's; a bad flag is refused before any work."""
    from xmodal_bench import main

    assert main(["extract", *args]) == 2
    err = capsys.readouterr().err
    assert err.strip().startswith(f"error: {message}") and len(err.strip().splitlines()) == 1, err
