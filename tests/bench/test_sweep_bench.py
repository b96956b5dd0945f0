"""`jobs/benchmark.py sweep`: a real sweep of tiny MulT trials, each trial's life set against its
training phase by phase, and the sweep's wall time broken down into parts. No figure is asserted (CI
machines differ): that the figures are there, add up, and land in the JSON and the table, and that
the console shows no internal event lines."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from xmodal_bench import sweep as bench_sweep
from xmodal_testing import ray_env

ROOT = Path(__file__).resolve().parents[2]


def bench(tmp_path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "jobs" / "benchmark.py"), "sweep", *args,
                           "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")],
                          capture_output=True, text=True, cwd=tmp_path, timeout=900,
                          env={**ray_env(**env), "PYTHONPATH": str(ROOT / "platform")})


@pytest.mark.slow
def test_one_trial_sweep_is_timed_phase_by_phase(tmp_path, ray_local):
    # attached to the shared test Ray, as a job to its cluster: no second local Ray on the machine
    run = bench(tmp_path, "--trials", "1", "--epochs", "1",
                RAY_ADDRESS=ray_local.get_runtime_context().gcs_address)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    console = run.stdout + run.stderr
    assert "[xmodal:event]" not in console and "USDT" not in console, console[-3000:]
    assert "trial " in run.stdout and "started" in run.stdout  # the sweep's own trial lines still show
    (js,) = (tmp_path / "out").glob("sweep-*.json")
    r = json.loads(js.read_text())["result"]
    (t,) = r["trials"]
    # The breakdown: consecutive parts in time order that add up to the wall time; the trial's part is its life.
    parts = r["breakdown"]
    assert [b["part"] for b in parts] == ["Ray start", "parent run", "Tune start", f"trial {t['trial']}", "sweep end",
                                          "Ray stop"]
    assert sum(b["s"] for b in parts) == pytest.approx(r["sweep_wall_s"])
    assert all(b["s"] >= 0 for b in parts) and parts[0]["from_s"] == 0
    assert all(b["from_s"] + b["s"] == pytest.approx(c["from_s"]) for b, c in zip(parts[:-1], parts[1:], strict=True))
    assert parts[3]["s"] == pytest.approx(t["life_s"], abs=0.01) and parts[3]["from_s"] == pytest.approx(t["start_s"])
    assert t["variant"] == "full" and t["training_s"] > 0
    assert all(t[p] is not None and t[p] >= 0 for p in bench_sweep.PHASES) and t["tune_s"] >= 0
    assert t["overhead_s"] == pytest.approx(t["life_s"] - t["training_s"])
    assert t["overhead_s"] == pytest.approx(sum(t[p] for p in bench_sweep.PHASES) + t["tune_s"])
    assert r["training_s_sum"] == t["training_s"] and r["sweep_wall_s"] >= t["life_s"]
    assert r["target_s"] == max(0.1 * t["training_s"], 5.0)
    assert r["target_met"] == (t["overhead_s"] <= r["target_s"])
    md = js.with_suffix(".md").read_text()
    assert md.startswith("# Sweep overhead: 1 MulT trials, 1 at a time, 1 epochs")
    assert "| trial | variant | start_s | life_s | training_s | overhead_s | prepare_s |" in md and "| full |" in md
    assert "| part | from s | s | % of wall | what |" in md and f"| total | | {r['sweep_wall_s']:.1f} | 100 % |" in md
    assert f"overhead per trial: mean {t['overhead_s']:.1f} s" in md and md in run.stdout  # the table, shown
    assert not (tmp_path / "work").exists()  # the MLflow file and storage were temporary, and the --work folder


def test_breakdown_parts_follow_the_trials_and_add_up_to_the_wall_time():
    # Two trials, one at a time, then two overlapping ones (--concurrent 2); times in s from 100.
    marks = {"begin": 100.0, "ray_up": 103.0, "parent_run": 104.0, "returned": 140.0, "end": 141.5}
    trials = [{"trial": "a", "start": 105.0, "end": 110.0}, {"trial": "b", "start": 112.0, "end": 120.0},
              {"trial": "c", "start": 121.0, "end": 130.0}, {"trial": "d", "start": 125.0, "end": 138.0}]
    parts = bench_sweep.breakdown(marks, trials)
    assert [(b["part"], b["s"]) for b in parts] == [
        ("Ray start", 3.0), ("parent run", 1.0), ("Tune start", 1.0), ("trial a", 5.0), ("between trials", 2.0),
        ("trial b", 8.0), ("between trials", 1.0), ("trial c", 4.0), ("trials c + d", 5.0), ("trial d", 8.0),
        ("sweep end", 2.0), ("Ray stop", 1.5)]
    assert sum(b["s"] for b in parts) == pytest.approx(marks["end"] - marks["begin"])
    assert [b["from_s"] for b in parts][:4] == [0.0, 3.0, 4.0, 5.0]


def test_more_trials_than_variants_is_refused_before_anything_runs(tmp_path, capsys):
    # jobs/benchmark.py's main in this process (the command's own process: the test above)
    from xmodal_bench import main

    code = main(["sweep", "--trials", "11", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")])
    said = capsys.readouterr()
    assert code == 2 and said.out == ""
    assert said.err.strip() == ("error: --trials 11: the space mult_ablation.yaml has 10 variants; "
                                "expected at most 10")
    assert not (tmp_path / "out").exists() and not (tmp_path / "work").exists()
