"""`jobs/benchmark.py lxmert`: the main path runs (tiny preset, 2 steps) without Ray, MLflow or pyarrow."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]

# Runs the benchmark module in a fresh interpreter in which importing ray, mlflow or pyarrow fails.
SCRIPT = textwrap.dedent("""
    import argparse, sys

    class Block:
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("ray", "mlflow", "pyarrow"):
                raise ImportError(f"{name} must not be imported by the LXMERT benchmark")

    sys.meta_path.insert(0, Block())
    from xmodal.bench import lxmert

    parser = argparse.ArgumentParser()
    lxmert.add_arguments(parser)
    sys.exit(lxmert.run(parser.parse_args(sys.argv[1:])))
""")


def test_benchmark_main_path_prints_both_rows_and_the_ratio():
    env = {**os.environ, "PYTHONPATH": str(ROOT / "platform")}
    # One thread: on a shared 2-core machine two OpenMP threads can stall each other for seconds.
    args = ["--preset", "tiny", "--batch", "4", "--steps", "2", "--warmup", "1", "--device", "cpu", "--threads", "1"]
    proc = subprocess.run([sys.executable, "-c", SCRIPT, *args], capture_output=True, text=True, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert re.search(r"^xmodal\s+[\d.]+M\s+[\d,.]+\s", out, re.M), out
    assert re.search(r"^transformers\s+[\d.]+M\s+[\d,.]+\s", out, re.M), out
    assert re.search(r"^ratio xmodal/transformers: \d+\.\d\dx samples/s", out, re.M), out


def test_help_shows_the_benchmarks_table_lines():
    """What `jobs/benchmark.py --help` and `jobs/benchmark.py lxmert --help` print: the one-line help of
    every entry of xmodal.bench.BENCHMARKS (argparse wraps lines, so whitespace is normalised)."""
    from xmodal.bench import BENCHMARKS

    env = {**os.environ, "PYTHONPATH": str(ROOT / "platform")}

    def help_text(*args: str) -> str:
        proc = subprocess.run([sys.executable, str(ROOT / "jobs" / "benchmark.py"), *args, "--help"],
                              capture_output=True, text=True, env=env, timeout=120)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return " ".join(proc.stdout.split())

    top = help_text()
    for name, (_, line) in BENCHMARKS.items():
        assert f"{name} {line}" in top, (name, top)
    assert BENCHMARKS["lxmert"][1] in help_text("lxmert")  # the subcommand's description
