"""A report's rows and statistics: one row per configuration, mean ± std over seeds, the t interval,
the tests against the baseline with Holm's correction, the cost and the Pareto front."""

from __future__ import annotations

import json
import math

import pytest
from report_testing import costed_sweep, rows_of

from xmodal import tracking
from xmodal.base import run_tags as T
from xmodal.report import ReportError, make_report


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
    with pytest.raises(ReportError, match="--baseline model.depth=2: names 'model.depth', which is not an ablation "
                                          "parameter of these runs"):
        make_report(uri, parent_run_id=parent, out_dir=tmp_path / "c", log=False, baseline={"model.depth": 2})
    assert not (tmp_path / "c").exists()
    orphan = costed_sweep(uri, exp, "tf-gone", {1: [0.6, 0.62], 2: [0.7, 0.72]},
                          parent_params={"try_first": json.dumps([{"model.x_layers": 9}])})
    rep = make_report(uri, parent_run_id=orphan, out_dir=tmp_path / "d", log=False)
    assert not any(r.baseline or r.test for r in rep.table.rows)
    assert "No significance test: the baseline (model.x_layers=9) matches no row." in rep.markdown
