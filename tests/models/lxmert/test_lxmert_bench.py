"""`jobs/benchmark.py lxmert`: the main path runs (tiny preset, a few steps) without Ray, MLflow or pyarrow,
its figures agree with each other and with the step times it recorded, and its console is quiet."""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[3]

# Runs the benchmark module in a fresh interpreter in which importing ray, mlflow or pyarrow fails.
SCRIPT = textwrap.dedent("""
    import argparse, sys

    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("ray", "mlflow", "pyarrow"):
                raise ImportError(f"{name} must not be imported by the LXMERT benchmark")

    sys.meta_path.insert(0, Block())
    from xmodal_bench import lxmert

    parser = argparse.ArgumentParser()
    lxmert.add_arguments(parser)
    sys.exit(lxmert.run(parser.parse_args(sys.argv[1:])))
""")


def test_benchmark_main_path_prints_figures_that_agree_with_its_step_times(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "platform")}
    # One thread: on a shared 2-core machine two OpenMP threads can stall each other for seconds.
    args = ["--preset", "tiny", "--batch", "4", "--steps", "4", "--rounds", "2", "--warmup", "1", "--device", "cpu",
            "--threads", "1", "--json", str(tmp_path / "r.json")]
    proc = subprocess.run([sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    # The memory figure comes from torch.profiler, whose C++ library logs `USDT:... profiler_start` to stderr.
    assert "USDT" not in out + proc.stderr and "profiler_st" not in out + proc.stderr, out + proc.stderr
    models = {m["name"]: m for m in json.loads((tmp_path / "r.json").read_text())["models"]}
    shown = {}
    for name in ("xmodal", "transformers"):
        row = re.search(rf"^{name}\s+[\d.]+M\s+([\d,.]+)\s+([\d.]+)\s+([\d.]+)-([\d.]+)\s+([\d.]+)\s", out, re.M)
        assert row, out
        sps, median, q1, q3, mean = (float(x.replace(",", "")) for x in row.groups())
        steps = models[name]["step_ms"]
        assert len(steps) == 4
        # Every figure of the row from the same recorded steps, equal within the printed rounding.
        assert median == pytest.approx(statistics.median(steps), abs=0.006)
        assert mean == pytest.approx(statistics.fmean(steps), abs=0.006)
        assert q1 <= median <= q3 and min(steps) - 0.006 <= q1 and q3 <= max(steps) + 0.006
        assert sps == pytest.approx(4 / (statistics.median(steps) / 1e3), abs=0.051)
        assert models[name]["samples_s_mean"] == pytest.approx(4 / (statistics.fmean(steps) / 1e3))
        shown[name] = sps
    ratio = re.search(r"^ratio xmodal/transformers: (\d+\.\d\d)x samples/s \((\d+\.\d\d)x by the mean step\)",
                      out, re.M)
    assert ratio, out
    # The ratio is that of the samples/s shown (each rounded to 0.1), and the mean steps' beside it.
    assert float(ratio.group(1)) == pytest.approx(shown["xmodal"] / shown["transformers"], rel=0.01, abs=0.006)
    means = {n: statistics.fmean(m["step_ms"]) for n, m in models.items()}
    assert float(ratio.group(2)) == pytest.approx(means["transformers"] / means["xmodal"], abs=0.006)


def test_help_shows_the_benchmarks_table_lines(capsys):
    """What `jobs/benchmark.py --help` and `jobs/benchmark.py lxmert --help` print (its `main`, in this
    process): the one-line help of every entry of xmodal_bench.BENCHMARKS (argparse wraps lines, so
    whitespace is normalised)."""
    from xmodal_bench import BENCHMARKS, main

    def help_text(*args: str) -> str:
        with pytest.raises(SystemExit) as done:
            main([*args, "--help"])
        said = capsys.readouterr()
        assert done.value.code == 0, said.out + said.err
        return " ".join(said.out.split())

    top = help_text()
    for name, (_, line) in BENCHMARKS.items():
        assert f"{name} {line}" in top, (name, top)
    assert BENCHMARKS["lxmert"][1] in help_text("lxmert")  # the subcommand's description
