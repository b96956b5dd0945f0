"""Ablation reports from MLflow runs made directly through xmodal.tracking (no Ray, no training)."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess

import pytest

from xmodal import run_tags as T
from xmodal import tracking
from xmodal.report import ReportError, make_report
from xmodal.scores import better, selected_key
from xmodal_testing import PYTHON, REPO

KEYS = ["model.x_layers", "tasks.obj_feat", "tasks.feat_loss", "train.seed"]


def sweep(uri: str, exp: str, name: str, metric: str = "eval/match_acc", mode: str = "max") -> str:
    return tracking.create_run(uri, exp, name, {"metric": metric},
                               {T.KIND: "sweep", T.SWEEP: name, T.METRIC: metric, T.MODE: mode})


def trial(uri: str, exp: str, parent: str, name: str, params: dict, history: list[float], status="FINISHED",
          extra_tags: dict | None = None) -> str:
    """A child run like a sweep trial's (selecting on eval/match_acc, mode max): ablation tags, per-report
    eval metrics with the selected score beside them as the worker logs it (the running best), a final
    status."""
    tags = {T.KIND: "trial", T.SWEEP: "s", T.TRIAL_ID: name, T.ABLATION_KEYS: json.dumps(KEYS),
            T.SEED: str(params.get("train.seed", 0)), **{T.ABLATION + k: str(v) for k, v in params.items()},
            T.METRIC: "eval/match_acc", **(extra_tags or {})}
    run_id = tracking.create_run(uri, exp, name, {}, tags, parent)
    best = None
    for i, v in enumerate(history):
        best = v if better(v, best, "max") else best
        tracking.log_metrics(uri, run_id, {"eval/match_acc": v, "eval/loss": 1 - v, "eval/loss/mlm": 2 - v,
                                           selected_key("eval/match_acc"): best}, step=10 * (i + 1))
    tracking.set_terminated(uri, run_id, status)
    return run_id


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """One database for the module (creating an MLflow database costs seconds). Artifacts go under the
    working directory (MLflow's default artifact root), so work in the temporary folder."""
    tmp = tmp_path_factory.mktemp("mlflow")
    mp = pytest.MonkeyPatch()
    mp.chdir(tmp)
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    exp = tracking.ensure_experiment(uri, "xmodal-sweep-demo")
    parent = sweep(uri, exp, "demo-1")
    # configuration A (x_layers 1, no obj_feat): two seeds
    trial(uri, exp, parent, "a0", {"model.x_layers": 1, "tasks.obj_feat": False, "train.seed": 0}, [0.5, 0.6])
    trial(uri, exp, parent, "a1", {"model.x_layers": 1, "tasks.obj_feat": False, "train.seed": 1}, [0.5, 0.8])
    # configuration B (x_layers 2, obj_feat with smooth_l1): one finished, one stopped early
    trial(uri, exp, parent, "b0", {"model.x_layers": 2, "tasks.obj_feat": True, "tasks.feat_loss": "smooth_l1",
                                   "train.seed": 0}, [0.6, 0.9])
    trial(uri, exp, parent, "b1", {"model.x_layers": 2, "tasks.obj_feat": True, "tasks.feat_loss": "smooth_l1",
                                   "train.seed": 1}, [0.1], "KILLED", {T.EARLY_STOPPED: "true"})
    # configuration C: stopped early only
    trial(uri, exp, parent, "c0", {"model.x_layers": 3, "tasks.obj_feat": True, "tasks.feat_loss": "l2",
                                   "train.seed": 0}, [0.2], "KILLED", {T.EARLY_STOPPED: "true"})
    # configuration D: its best evaluation came first (the run keeps that checkpoint: selected on validation)
    trial(uri, exp, parent, "d0", {"model.x_layers": 4, "tasks.obj_feat": False, "train.seed": 0}, [0.95, 0.4])
    # left out: a failed trial and an orphan the driver closed
    trial(uri, exp, parent, "f0", {"model.x_layers": 3, "tasks.obj_feat": False, "train.seed": 0}, [0.3], "FAILED")
    trial(uri, exp, parent, "o0", {"model.x_layers": 1, "tasks.obj_feat": False, "train.seed": 0}, [0.99],
          "KILLED", {T.ORPHANED: "true"})
    yield uri, exp, parent
    mp.undo()


def rows_of(path):
    with open(path) as f:
        return list(csv.DictReader(f))


def test_one_row_per_configuration_with_mean_and_std_over_seeds(store, tmp_path):
    uri, _, parent = store
    rep = make_report(uri, parent_run_id=parent, out_dir=tmp_path / "out")
    assert rep.table.metric == "eval/match_acc" and rep.table.keys == ["model.x_layers", "tasks.obj_feat", "tasks.feat_loss"]
    assert rep.table.skipped == {"failed": 1}
    rows = rows_of(tmp_path / "out" / "table.csv")
    assert [(r["model.x_layers"], r["tasks.obj_feat"], r["tasks.feat_loss"]) for r in rows] == [
        ("4", "False", "-"), ("2", "True", "smooth_l1"), ("1", "False", "-"), ("3", "True", "l2")]
    d, b, a, c = rows  # best first; all-stopped last
    assert float(d["eval/match_acc mean"]) == pytest.approx(0.95)  # its best evaluation, not its last
    assert float(d["eval/loss mean"]) == pytest.approx(0.6)  # other columns: the last evaluation
    assert (b["runs"], b["finished"], b["early_stopped"], b["seeds"]) == ("2", "1", "1", "0;1")
    assert float(b["eval/match_acc mean"]) == pytest.approx(0.9) and b["eval/match_acc n"] == "1"
    assert float(a["eval/match_acc mean"]) == pytest.approx(0.7)
    assert float(a["eval/match_acc std"]) == pytest.approx(math.sqrt(0.02))  # sample std of 0.6, 0.8
    assert float(a["eval/loss mean"]) == pytest.approx(0.3)
    assert float(c["eval/match_acc mean"]) == pytest.approx(0.2)
    assert "eval/loss/mlm mean" not in b  # per-task losses are not summary columns

    md = rep.markdown  # what the command line prints and the sweep puts on its parent run: table.md's text
    assert (tmp_path / "out" / "table.md").read_text() == md
    assert "| model.x_layers | tasks.obj_feat | tasks.feat_loss | runs | eval/match_acc | 95% CI | eval/loss |" in md
    assert "| 1 | False | - | 2 | 0.7000 ± 0.1414 |" in md
    assert "| 2 | True | smooth_l1 | 2 (1 stopped early) | 0.9000 |" in md
    assert "0.2000 †" in md and "Left out: 1 failed run(s)." in md


def test_plots_exist_and_are_logged_to_the_parent(store, tmp_path):
    uri, _, parent = store
    rep = make_report(uri, parent_run_id=parent, out_dir=tmp_path / "out")
    pngs = sorted(p.name for p in (tmp_path / "out").glob("*.png"))
    assert "| 4 | False | - | 1 | 0.9500 |" in rep.markdown
    assert rep.out_dir == (tmp_path / "out").resolve() and rep.files[:2] == (rep.out_dir / "table.md",
                                                                              rep.out_dir / "table.csv")
    assert sorted(p.name for p in rep.files[2:]) == pngs and all(p.parent == rep.out_dir for p in rep.files)
    assert pngs == ["eval_match_acc_vs_model.x_layers.png", "eval_match_acc_vs_tasks.feat_loss.png",
                    "eval_match_acc_vs_tasks.obj_feat.png", "learning_curves_eval_match_acc.png"]
    for p in pngs:
        assert (tmp_path / "out" / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    logged = set(tracking.list_artifacts(uri, parent, "report"))
    assert {"report/table.md", "report/table.csv", "report/learning_curves_eval_match_acc.png"} <= logged


def test_an_experiment_report_groups_runs_of_several_sweeps(store, tmp_path):
    uri, exp, _ = store
    other = sweep(uri, exp, "demo-2")
    trial(uri, exp, other, "a2", {"model.x_layers": 1, "tasks.obj_feat": False, "train.seed": 2}, [0.7])
    rep = make_report(uri, experiment="xmodal-sweep-demo", out_dir=tmp_path / "exp")
    a = next(r for r in rep.table.rows if r.params["model.x_layers"] == 1)
    assert len(a.runs) == 3 and a.stats["eval/match_acc"][0] == pytest.approx(0.7)
    assert a.stats["eval/match_acc"][2] == 3
    assert tracking.list_artifacts(uri, other, "report_experiment")


def test_metric_override_and_errors(store, tmp_path):
    uri, _, parent = store
    rep = make_report(uri, parent_run_id=parent, out_dir=tmp_path / "o", metric="eval/loss", log=False)
    assert rep.table.columns[0] == "eval/loss"
    with pytest.raises(ReportError, match="experiment 'nope' not found.*xmodal-sweep-demo"):
        make_report(uri, experiment="nope", out_dir=tmp_path / "x")
    with pytest.raises(ReportError, match="parent run 'deadbeef' not found"):
        make_report(uri, parent_run_id="deadbeef", out_dir=tmp_path / "x")
    with pytest.raises(ReportError, match="no MLflow database"):
        make_report(f"sqlite:///{tmp_path / 'missing.db'}", experiment="x", out_dir=tmp_path / "x")


def test_the_command_line(store, tmp_path):
    uri, _, parent = store
    out = subprocess.run([PYTHON, str(REPO / "jobs" / "report.py"), "--parent-run", parent, "--tracking-uri", uri,
                          "--out", str(tmp_path / "cli")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "| 2 | True | smooth_l1 |" in out.stdout and (tmp_path / "cli" / "table.csv").exists()
    given = subprocess.run([PYTHON, str(REPO / "jobs" / "report.py"), "--parent-run", parent, "--tracking-uri", uri,
                            "--out", str(tmp_path / "b"), "--no-log", "--baseline", "model.x_layers=1",
                            "tasks.obj_feat=False"], capture_output=True, text=True, timeout=120)
    assert given.returncode == 0, given.stderr
    # two seeds: the 95 % t interval is mean ± 12.706 · std / √2
    assert "| 1 | False | - | 2 | 0.7000 ± 0.1414 | [-0.5706, 1.9706] | 0.3000 ± 0.1414 | baseline |" in given.stdout
    bad = subprocess.run([PYTHON, str(REPO / "jobs" / "report.py"), "--experiment", "nope", "--tracking-uri", uri],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "experiment 'nope' not found" in bad.stderr


def test_a_job_that_logs_its_selected_model_and_test_metrics(tmp_path, monkeypatch):
    """MulT logs valid/* at every evaluation and, at the end, best_valid/* (the validation-selected
    model) and test/* (that model on the test split, once): the table shows those."""
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'm.db'}"
    exp = tracking.ensure_experiment(uri, "xmodal-sweep-mult")
    parent = sweep(uri, exp, "mult-1", metric="valid/mae", mode="min")
    for name, variant, seed, hist, best, test in [("f0", "full", 0, [0.9, 0.7, 0.8], 0.7, 0.72),
                                                  ("f1", "full", 1, [0.8, 0.6, 0.65], 0.6, 0.66),
                                                  ("e0", "early_fusion", 0, [0.9, 0.85], 0.85, 0.88)]:
        tags = {T.KIND: "trial", T.ABLATION_KEYS: json.dumps(["model.variant"]), T.SEED: str(seed),
                T.ABLATION + "model.variant": variant, T.METRIC: "valid/mae"}
        run_id = tracking.create_run(uri, exp, name, {}, tags, parent)
        for i, v in enumerate(hist):
            tracking.log_metrics(uri, run_id, {"valid/mae": v, "valid/corr": 1 - v,
                                               selected_key("valid/mae"): min(hist[:i + 1])}, step=i + 1)
        tracking.log_metrics(uri, run_id, {"best_valid/mae": best, "best_valid/corr": 1 - best, "test/mae": test},
                             step=len(hist))
        tracking.set_terminated(uri, run_id)
    rep = make_report(uri, parent_run_id=parent, out_dir=tmp_path / "o")
    assert rep.table.columns == ["valid/mae", "valid/corr", "test/mae"]  # no selected/* column
    full, early = rep.table.rows
    assert full.params == {"model.variant": "full"} and len(full.runs) == 2
    assert full.stats["valid/mae"][0] == pytest.approx(0.65) and full.stats["test/mae"][0] == pytest.approx(0.69)
    assert full.stats["valid/corr"][0] == pytest.approx(0.35)  # the selected model's, not the last
    assert early.stats["valid/mae"][0] == pytest.approx(0.85)


def costed_sweep(uri: str, exp: str, name: str, rows: dict[int, list[float]], parent_params: dict | None = None,
                 parent_tags: dict | None = None, seeds: dict[int, list[int]] | None = None) -> str:
    """A sweep over model.x_layers whose trials log one evaluation and the cost/* metrics of a job:
    x_layers n costs n GFLOP per sample, n M parameters and n/100 device-hours. The runs of a row have
    seeds 0, 1, ... unless `seeds` gives them."""
    parent = tracking.create_run(uri, exp, name, parent_params or {},
                                 {T.KIND: "sweep", T.SWEEP: name, T.METRIC: "eval/match_acc", T.MODE: "max",
                                  **(parent_tags or {})})
    for layers, values in rows.items():
        for seed, v in zip((seeds or {}).get(layers, range(len(values))), values, strict=True):
            run_id = trial(uri, exp, parent, f"x{layers}s{seed}",
                           {"model.x_layers": layers, "tasks.obj_feat": False, "train.seed": seed}, [v])
            tracking.log_metrics(uri, run_id, {
                "cost/params": layers * 1e6, "cost/gflop_per_sample": float(layers), "cost/samples_per_s": 1500.0,
                "cost/peak_mem_gib": 0.5, "cost/wall_s": 36.0 * layers, "cost/device_hours": layers / 100})
    return parent


# baseline x_layers=1; 2 is better (Welch p = 0.0036); 3 is no different (p = 0.578); 4 ran once. Every row
# ran other seeds (no pairing): Welch's t-test, Holm over the 2 rows tested.
KNOWN = {1: [0.60, 0.62, 0.64], 2: [0.70, 0.72, 0.74], 3: [0.59, 0.65, 0.67], 4: [0.9]}
KNOWN_SEEDS = {1: [0, 1, 2], 2: [3, 4, 5], 3: [6, 7, 8], 4: [9]}
BASELINE = {"model.x_layers": 1, "tasks.obj_feat": False}


def test_rows_are_tested_against_the_baseline_and_cost_is_beside_the_score(store, tmp_path):
    uri, _, _ = store
    exp = tracking.ensure_experiment(uri, "xmodal-sweep-known")
    parent = costed_sweep(uri, exp, "known", KNOWN, parent_tags={T.BASELINE: json.dumps(BASELINE)},
                          seeds=KNOWN_SEEDS)
    rep = make_report(uri, parent_run_id=parent, out_dir=tmp_path / "out")
    by_layers = {r.params["model.x_layers"]: r for r in rep.table.rows}
    assert by_layers[1].baseline and by_layers[1].test is None
    better, same, once = by_layers[2].test, by_layers[3].test, by_layers[4].test
    assert better.delta == pytest.approx(0.10) and better.p == pytest.approx(0.0036022, rel=1e-4)
    assert better.kind == "Welch" and better.p_holm == pytest.approx(2 * 0.0036022, rel=1e-4)  # the smaller of 2
    assert better.significant
    assert same.delta == pytest.approx(0.0166667, rel=1e-4) and same.p == pytest.approx(0.578028, rel=1e-4)
    assert same.p_holm == pytest.approx(0.578028, rel=1e-4)  # the larger p of 2 counts once
    assert same.significant is False
    assert once.p is None and once.why == "1 run"
    # Pareto front of score against GFLOP/sample: 3 layers cost more than 2 and score lower
    assert {k: r.pareto for k, r in by_layers.items()} == {1: True, 2: True, 3: False, 4: True}

    md = rep.markdown
    assert ("| model.x_layers | tasks.obj_feat | runs | eval/match_acc | 95% CI | eval/loss "
            "| vs baseline (eval/match_acc; Holm over 2 rows, α=0.05) "
            "| params (M) | GFLOP/sample | samples/s | peak mem (GiB) | wall (s) | device-h | Pareto |") in md
    # 95 % t interval of 3 runs: mean ± t(0.975, 2) · std / √3, t(0.975, 2) = 4.3027 (any t table)
    assert "| 2 | False | 3 | 0.7200 ± 0.0200 | [0.6703, 0.7697] | 0.2800 ± 0.0200 | +0.1000 (Welch, p=0.0036; " \
           "Holm p=0.0072) | 2 | 2 | 1,500 | 0.5 | 72 | 0.02 | ◆ |" in md
    assert "| 3 | False | 3 | 0.6367 ± 0.0416 | [0.5332, 0.7401] | 0.3633 ± 0.0416 | +0.0167 (Welch, p=0.58; " \
           "Holm p=0.58, n.s.) | 3 | 3 |" in md
    assert "| 1 | False | 3 | 0.6200 ± 0.0200 | [0.5703, 0.6697] | 0.3800 ± 0.0200 | baseline | 1 | 1 |" in md
    assert "| 4 | False | 1 | 0.9000 |  | 0.1000 | +0.2800 (untested: 1 run) |" in md
    assert "family-wise error rate held at α = 0.05 over the 2 rows tested (Holm–Bonferroni)" in md
    assert "else Welch (Welch's t-test, unequal variances)" in md
    rows = {r["model.x_layers"]: r for r in rows_of(tmp_path / "out" / "table.csv")}
    assert float(rows["2"]["p"]) == pytest.approx(0.0036022, rel=1e-4) and rows["3"]["significant"] == "False"
    assert float(rows["2"]["p_holm"]) == pytest.approx(0.0072044, rel=1e-4) and rows["2"]["test"] == "Welch"
    assert float(rows["1"]["eval/match_acc ci_low"]) == pytest.approx(0.62 - 4.302653 * 0.02 / math.sqrt(3))
    assert float(rows["3"]["cost/gflop_per_sample mean"]) == 3.0 and rows["3"]["cost/device_hours n"] == "3"
    assert rows["1"]["baseline"] == "True" and rows["4"]["p"] == "" and rows["4"]["eval/match_acc ci_low"] == ""

    png = tmp_path / "out" / "eval_match_acc_vs_cost.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "report/eval_match_acc_vs_cost.png" in tracking.list_artifacts(uri, parent, "report")


# Four seeds a row. Rows 2-4 ran the baseline's seeds: paired t-tests on the per-seed differences.
# Row 3 is better by 0.01-0.04 on every seed: paired p = 0.0305 (t = 3.873, 3 df), significant alone; over
# the seeds' spread Welch would see nothing (p = 0.31). Row 5 ran seeds 0-2 only: Welch (p = 0.000115).
# Holm over the 4 rows tested: p sorted 0.000097 (x4), 0.000115 (x3), 0.0305 (x2 = 0.061), 0.824 (x1):
# row 3 is not significant after the correction.
PAIRED_ROWS = {1: [0.60, 0.64, 0.62, 0.66], 2: [0.70, 0.745, 0.71, 0.765], 3: [0.62, 0.67, 0.63, 0.70],
               4: [0.59, 0.66, 0.60, 0.68], 5: [0.80, 0.82, 0.84]}


def test_paired_where_the_seeds_match_and_holm_over_the_rows_tested(store, tmp_path):
    uri, _, _ = store
    exp = tracking.ensure_experiment(uri, "xmodal-sweep-paired")
    parent = costed_sweep(uri, exp, "paired", PAIRED_ROWS, parent_tags={T.BASELINE: json.dumps(BASELINE)})
    rep = make_report(uri, parent_run_id=parent, out_dir=tmp_path / "out", log=False)
    tests = {r.params["model.x_layers"]: r.test for r in rep.table.rows if not r.baseline}
    assert {k: t.kind for k, t in tests.items()} == {2: "paired t", 3: "paired t", 4: "paired t", 5: "Welch"}
    expected = {2: 9.7025276e-05, 3: 0.0304663, 4: 0.8240010, 5: 0.00011509}  # scipy ttest_rel / ttest_ind
    holm = {2: 4 * expected[2], 3: 2 * expected[3], 4: expected[4], 5: 4 * expected[2]}  # 3 x p5 < 4 x p2
    for k, t in tests.items():
        assert t.p == pytest.approx(expected[k], rel=1e-4) and t.p_holm == pytest.approx(holm[k], rel=1e-4), k
    assert tests[3].significant_alone and tests[3].significant is False
    assert tests[2].significant and tests[5].significant and tests[4].significant is False
    md = rep.markdown
    assert "| +0.0250 (paired t, p=0.03; Holm p=0.061, n.s. after Holm) |" in md
    assert "| +0.1900 (Welch, p<0.001; Holm p<0.001) |" in md
    assert "| +0.0025 (paired t, p=0.82; Holm p=0.82, n.s.) |" in md
    assert "vs baseline (eval/match_acc; Holm over 4 rows, α=0.05)" in md
    # the columns explained under the table, one line each
    legend = md.split("Columns:", 1)[1]
    for column in ("- model.x_layers, tasks.obj_feat:", "- runs:", "- eval/match_acc:", "- 95% CI:", "- eval/loss:",
                   "- vs baseline:", "- Cost", "- Pareto"):
        assert f"\n{column}" in legend, column
    # a duplicated seed breaks the pairing: Welch
    exp = tracking.ensure_experiment(uri, "xmodal-sweep-twice")
    parent = costed_sweep(uri, exp, "twice", {1: [0.6, 0.64], 2: [0.7, 0.72]}, seeds={1: [0, 1], 2: [0, 0]},
                          parent_tags={T.BASELINE: json.dumps(BASELINE)})
    rep = make_report(uri, parent_run_id=parent, out_dir=tmp_path / "twice", log=False)
    assert [r.test.kind for r in rep.table.rows if r.test] == ["Welch"]


def test_the_baseline_defaults_to_the_first_try_first_configuration_or_is_given(store, tmp_path):
    uri, _, _ = store
    exp = tracking.ensure_experiment(uri, "xmodal-sweep-tryfirst")
    first = [{"model.x_layers": 2, "tasks.obj_feat": False}, BASELINE]
    parent = costed_sweep(uri, exp, "tf", {1: [0.6, 0.62], 2: [0.7, 0.72]},
                          parent_params={"try_first": json.dumps(first)})
    rep = make_report(uri, parent_run_id=parent, out_dir=tmp_path / "a", log=False)
    assert [r.params["model.x_layers"] for r in rep.table.rows if r.baseline] == [2]
    rep = make_report(uri, parent_run_id=parent, out_dir=tmp_path / "b", log=False,
                      baseline={"model.x_layers": 1})
    assert [r.params["model.x_layers"] for r in rep.table.rows if r.baseline] == [1]
    # A baseline asked for that names no row is an error listing the rows (a report without the tests
    # asked for would look complete); the sweep's own baseline naming none is a note in the report.
    with pytest.raises(ReportError, match=r"--baseline model.x_layers=7: matches no row; expected the parameters of "
                                          r"exactly one row \(the rows are: model.x_layers=2 tasks.obj_feat=False; "
                                          r"model.x_layers=1 tasks.obj_feat=False\)"):
        make_report(uri, parent_run_id=parent, out_dir=tmp_path / "c", log=False, baseline={"model.x_layers": 7})
    with pytest.raises(ReportError, match="--baseline model.depth=2: names model.depth, which is not an ablation "
                                          "parameter of these runs"):
        make_report(uri, parent_run_id=parent, out_dir=tmp_path / "c", log=False, baseline={"model.depth": 2})
    assert not (tmp_path / "c").exists()
    orphan = costed_sweep(uri, exp, "tf-gone", {1: [0.6, 0.62], 2: [0.7, 0.72]},
                          parent_params={"try_first": json.dumps([{"model.x_layers": 9}])})
    rep = make_report(uri, parent_run_id=orphan, out_dir=tmp_path / "d", log=False)
    assert not any(r.baseline or r.test for r in rep.table.rows)
    assert "No significance test: the baseline (model.x_layers=9) matches no row." in rep.markdown


def _report_cli(*args: str, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO / "platform")}  # this checkout's package from any cwd
    env.pop("MLFLOW_TRACKING_URI", None)
    return subprocess.run([PYTHON, str(REPO / "jobs" / "report.py"), *args], capture_output=True, text=True,
                          timeout=120, cwd=cwd, env=env)


def _one_error(out: subprocess.CompletedProcess) -> str:
    """The command failed as bad input: exit 2, one `error:` line on stderr, no traceback."""
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert "Traceback" not in out.stderr and "error:" not in out.stdout, out.stderr
    lines = [line for line in out.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), out.stderr
    return lines[0]


def test_bad_report_requests_are_one_line_and_write_nothing(store, tmp_path):
    """A metric no run logged (it used to write a table of n/a cells), --out naming a file, a trial's
    id given as --parent-run, an unknown run or experiment: one line each, and no report folder, no
    artifact and no new database."""
    uri, _, parent = store
    trial_id = next(r.run_id for r in tracking.child_runs(uri, parent) if r.name == "a0")
    artifacts = tracking.list_artifacts(uri, parent)
    line = _one_error(_report_cli("--parent-run", parent, "--tracking-uri", uri, "--metric", "eval/bleu",
                                  "--out", str(tmp_path / "r"), cwd=tmp_path))
    assert "--metric 'eval/bleu'" in line and "eval/match_acc" in line and "eval/loss" in line
    (tmp_path / "taken").write_text("mine")
    line = _one_error(_report_cli("--parent-run", parent, "--tracking-uri", uri, "--out", str(tmp_path / "taken"),
                                  cwd=tmp_path))
    assert "--out" in line and "taken" in line and "is a file" in line
    assert (tmp_path / "taken").read_text() == "mine"
    line = _one_error(_report_cli("--parent-run", trial_id, "--tracking-uri", uri, cwd=tmp_path))
    assert f"--parent-run '{trial_id}' is a trial of sweep 's'" in line and f"--parent-run {parent}" in line
    line = _one_error(_report_cli("--parent-run", "deadbeef", "--tracking-uri", uri, cwd=tmp_path))
    assert "'deadbeef' not found" in line
    line = _one_error(_report_cli("--experiment", "nope", "--tracking-uri", uri, cwd=tmp_path))
    assert "experiment 'nope' not found" in line and "xmodal-sweep-demo" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]
    assert tracking.list_artifacts(uri, parent) == artifacts


def test_an_unwritable_out_or_a_baseline_naming_no_row_fails_before_anything_is_written(store, tmp_path):
    """--out where nothing can be written (checked before MLflow is opened), and --baseline naming no
    row (it used to write the report without its tests and exit 0): one line each, naming the rows."""
    uri, exp, _ = store
    parent = costed_sweep(uri, tracking.ensure_experiment(uri, "xmodal-sweep-cli-baseline"), "cb",
                          {1: [0.6, 0.62], 2: [0.7, 0.72]})
    artifacts = tracking.list_artifacts(uri, parent)
    line = _one_error(_report_cli("--parent-run", parent, "--tracking-uri", uri, "--out", "/proc/xmodal-report",
                                  cwd=tmp_path))
    assert "--out: '/proc/xmodal-report' cannot be written" in line
    line = _one_error(_report_cli("--parent-run", parent, "--tracking-uri", uri, "--baseline", "model.x_layers=3",
                                  cwd=tmp_path))
    assert line == ("error: --baseline model.x_layers=3: matches no row; expected the parameters of exactly one row "
                    "(the rows are: model.x_layers=2 tasks.obj_feat=False; model.x_layers=1 tasks.obj_feat=False)")
    assert list(tmp_path.iterdir()) == [] and tracking.list_artifacts(uri, parent) == artifacts


def test_a_report_never_creates_or_migrates_a_database(tmp_path):
    """Missing, empty, a directory, or an SQLite file that is not MLflow's: one line, and the file is
    left as it was (MLflow would have created or migrated it)."""
    import sqlite3

    with sqlite3.connect(tmp_path / "other.db") as db:
        db.execute("create table notes (text)")
    (tmp_path / "empty.db").write_text("")
    (tmp_path / "folder.db").mkdir()
    for name, expected in (("missing.db", "no MLflow database at"), ("empty.db", "an empty file"),
                           ("folder.db", "is a directory"), ("other.db", "without MLflow's tables")):
        line = _one_error(_report_cli("--experiment", "x", "--tracking-uri", f"sqlite:///{tmp_path / name}",
                                      cwd=tmp_path))
        assert name in line and expected in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.db", "folder.db", "other.db"]
    assert (tmp_path / "empty.db").read_bytes() == b""
    with sqlite3.connect(tmp_path / "other.db") as db:
        assert [r[0] for r in db.execute("select name from sqlite_master")] == ["notes"]


def test_the_score_column_is_the_selected_score_each_run_logged(tmp_path, monkeypatch):
    """The sweep metric's cell is the run's logged selected score, never recomputed from its history
    (here the two differ on purpose); a run that selects on the metric but logged no selected score
    (stopped before its first evaluation) shows n/a rather than another value."""
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 's.db'}"
    exp = tracking.ensure_experiment(uri, "xmodal-sweep-selected")
    parent = sweep(uri, exp, "sel-1")
    logged = trial(uri, exp, parent, "a", {"model.x_layers": 1}, [])
    for step, (acc, kept) in enumerate([(0.5, 0.5), (0.9, 0.7)], 1):
        tracking.log_metrics(uri, logged, {"eval/match_acc": acc, selected_key("eval/match_acc"): kept}, step=step)
    unscored = trial(uri, exp, parent, "b", {"model.x_layers": 2}, [])
    tracking.log_metrics(uri, unscored, {"eval/loss": 0.4}, step=1)
    rep = make_report(uri, parent_run_id=parent, out_dir=tmp_path / "o", log=False)
    by_layers = {r.params["model.x_layers"]: r for r in rep.table.rows}
    assert by_layers[1].stats["eval/match_acc"] == (0.7, 0.0, 1)
    assert by_layers[2].stats["eval/match_acc"][2] == 0
    assert "| 2 | 1 | n/a |  | 0.4000 |" in rep.markdown


def test_a_run_stopped_early_scores_what_the_sweep_ranked(tmp_path, monkeypatch):
    """Its workers evaluated once more after the report the scheduler stopped it on (step 20): the
    cell is the selected score at that step, the one the sweep ranked, not the later one."""
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'r.db'}"
    exp = tracking.ensure_experiment(uri, "xmodal-sweep-ranked")
    parent = sweep(uri, exp, "ranked-1")
    trial(uri, exp, parent, "s0", {"model.x_layers": 1}, [0.5, 0.7, 0.8], "KILLED",
          {T.EARLY_STOPPED: "true", T.RANKED_STEP: "20"})
    trial(uri, exp, parent, "f0", {"model.x_layers": 2}, [0.6, 0.65, 0.7])
    rep = make_report(uri, parent_run_id=parent, out_dir=tmp_path / "o", log=False)
    by_layers = {r.params["model.x_layers"]: r for r in rep.table.rows}
    assert by_layers[1].partial and by_layers[1].stats["eval/match_acc"] == (0.7, 0.0, 1)
    assert by_layers[2].stats["eval/match_acc"] == (0.7, 0.0, 1)
