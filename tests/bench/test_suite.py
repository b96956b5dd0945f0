"""`jobs/benchmark.py suite --device cpu --quick`: the one command a GPU run uses, run end to end on
the CPU (tiny presets, compiled rows through dynamo's eager backend) in a fresh interpreter where Ray, MLflow and
Optuna cannot be imported (the device machines have none). Checks the JSON has every field, each
figure is finite and positive where it must be, a row's step figures come from its recorded steps,
the Markdown table is written beside it, and the console holds no profiler log lines. Speed is not
asserted: CI machines differ."""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = textwrap.dedent("""
    import sys

    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("ray", "mlflow", "optuna"):
                raise ImportError(f"{name} must not be imported by the benchmark suite")

    sys.meta_path.insert(0, Block())
    from xmodal_bench import main

    sys.exit(main(sys.argv[1:]))
""")
ROW_FIELDS = {"section", "impl", "mode", "preset", "batch", "precision", "params", "samples_s", "samples_s_mean", "ms_step",
              "peak_gib", "gflop_per_sample", "mfu", "compile_s", "graph_breaks", "final_loss", "step_ms"}


@pytest.mark.slow
def test_quick_cpu_suite_writes_every_field(tmp_path):
    # --quick's smallest run: one timed step a contender, no warm-up steps (the fields, not the figures)
    out = subprocess.run([sys.executable, "-c", SCRIPT, "suite", "--device", "cpu", "--quick", "--steps", "1",
                          "--warmup", "0", "--out", str(tmp_path)],
                         capture_output=True, text=True, cwd=ROOT, timeout=600,
                         env={**os.environ, "PYTHONPATH": str(ROOT / "platform")})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    assert "USDT" not in out.stdout + out.stderr, out.stderr[-3000:]  # torch.profiler's C++ log lines
    (js,) = tmp_path.glob("*.json")
    assert js.with_suffix(".md").read_text().startswith("Benchmark suite,")
    res = json.loads(js.read_text())
    meta = res["meta"]
    assert meta["device"] == "cpu" and meta["quick"] is True and meta["compile_backend"] == "eager"
    for key in ("date", "device_name", "torch", "transformers", "settings", "targets", "section_seconds", "wall_s"):
        assert meta[key], key

    # Every implementation in both modes, with its figures.
    want = {"lxmert": {("xmodal", m) for m in ("eager", "compiled")} | {("transformers", m) for m in ("eager", "compiled")},
            "mult": {("xmodal", m) for m in ("eager", "compiled")} | {("plain", m) for m in ("eager", "compiled")},
            "ddp": {("xmodal", "eager"), ("xmodal+ddp", "eager")}}
    for section, pairs in want.items():
        rows = res[section]
        assert {(r["impl"], r["mode"]) for r in rows} == pairs, section
        for r in rows:
            assert set(r) == ROW_FIELDS, (section, set(r) ^ ROW_FIELDS)
            assert r["samples_s"] > 0 and r["samples_s_mean"] > 0 and r["ms_step"] > 0 and r["params"] > 0 and math.isfinite(r["final_loss"])
            assert r["mfu"] is None  # no MFU without an accelerator peak
            assert r["peak_gib"] is None or r["peak_gib"] > 0
            if section != "ddp":
                assert r["gflop_per_sample"] > 0 and r["graph_breaks"] >= 0
            assert (r["compile_s"] is not None) == (r["mode"] == "compiled")
            # CPU: ms/step and both samples/s from the same recorded steps
            assert len(r["step_ms"]) == meta["settings"]["steps"]
            assert r["ms_step"] == pytest.approx(statistics.median(r["step_ms"]))
            assert r["samples_s"] == pytest.approx(r["batch"] / (r["ms_step"] / 1e3))
            assert r["samples_s_mean"] == pytest.approx(r["batch"] / (statistics.fmean(r["step_ms"]) / 1e3))
        assert rows[0]["peak_gib"] > 0, section  # --quick: the memory figure of each section's first row only
    ours = [r for r in res["lxmert"] + res["mult"] if r["impl"] == "xmodal"]
    assert all(r["graph_breaks"] == 0 for r in ours)  # our objectives compile whole

    assert [d["sentences_per_image"] for d in res["data"]] == [5, 50]
    assert all(d["samples_s"] > 0 and d["target"] == 5000 for d in res["data"])
    assert [(e["config"], e["regions"], e["precision"]) for e in res["extract"]] == [
        ("tiny", regions, p) for regions in ("batched", "per image") for p in ("fp32", "bf16")]
    assert all(e["images_s"] > 0 and e["boxes_per_image"] == 36 and e["target"] == 100 for e in res["extract"])

    ratios = res["ratios"]
    assert set(ratios) == {"lxmert_eager_vs_transformers_eager", "lxmert_compiled_vs_transformers_compiled",
                           "lxmert_compiled_vs_transformers_best", "mult_b4_eager_vs_plain_eager",
                           "mult_b4_compiled_vs_plain_compiled", "ddp_step_time_over_bare"}
    assert all(math.isfinite(v) and v > 0 for v in ratios.values()), ratios
