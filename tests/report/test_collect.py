"""The runs a report reads from MLflow: one sweep's or an experiment's, each run's score as it logged it,
and the requests that name no sweep (one line each, nothing created)."""

from __future__ import annotations

import json

import pytest
from report_testing import one_error, report_cli, sweep, trial

from xmodal import tracking
from xmodal.base import run_tags as T
from xmodal.base.scores import selected_key
from xmodal.report import ReportError, make_report


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
    rep = make_report(uri, parent_run_id=parent, out_dir=tmp_path / "o", metric="eval/loss", log=False, mode="min")
    assert rep.table.columns[0] == "eval/loss" and rep.table.mode == "min"
    assert "(lowest first)" in rep.markdown
    with pytest.raises(ReportError, match="its own metric 'eval/match_acc'; expected --mode max or --mode min"):
        make_report(uri, parent_run_id=parent, out_dir=tmp_path / "o2", metric="eval/loss", log=False)
    with pytest.raises(ReportError, match="experiment 'nope' not found.*xmodal-sweep-demo"):
        make_report(uri, experiment="nope", out_dir=tmp_path / "x")
    with pytest.raises(ReportError, match="parent run 'deadbeef' not found"):
        make_report(uri, parent_run_id="deadbeef", out_dir=tmp_path / "x")
    with pytest.raises(ReportError, match="no MLflow database"):
        make_report(f"sqlite:///{tmp_path / 'missing.db'}", experiment="x", out_dir=tmp_path / "x")


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
        line = one_error(report_cli("--experiment", "x", "--tracking-uri", f"sqlite:///{tmp_path / name}",
                                      cwd=tmp_path))
        assert name in line and expected in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty.db", "folder.db", "other.db"]
    assert (tmp_path / "empty.db").read_bytes() == b""
    with sqlite3.connect(tmp_path / "other.db") as db:
        assert [r[0] for r in db.execute("select name from sqlite_master")] == ["notes"]
