"""Parameter importance of a sweep (fANOVA, computed by the sweep driver, shown by the report) on made-up
trial runs in a real MLflow SQLite store: one parameter sets the score, the others do not."""

from __future__ import annotations

import csv
import json
import random
import textwrap

import pytest

from xmodal import tracking
from xmodal.base import run_tags as T
from xmodal.base.scores import selected_key
from xmodal.report import make_report
from xmodal.sweep.runner import log_importance
from xmodal.sweep.space import load_space

SPACE = """
job: mult
metric: valid/mae
mode: min
scheduler: {type: fifo}
parameters:
  model.layers: {type: int, low: 1, high: 8}
  optim.lr: {type: float, low: 1.0e-4, high: 1.0e-2, log: true}
  tasks.obj_feat: {type: choice, values: [true, false]}
  tasks.feat_loss: {type: choice, values: [l2, smooth_l1], when: {tasks.obj_feat: true}}
"""
KEYS = ["model.layers", "optim.lr", "tasks.obj_feat", "tasks.feat_loss"]


def made_up_sweep(uri: str, name: str, trials: int, seed: int = 0, experiment: str | None = None) -> str:
    """A parent and `trials` finished trials: valid/mae falls with model.layers (0.05 a layer, noise
    0.005); optim.lr, tasks.obj_feat and tasks.feat_loss are drawn at random and do nothing. Plus one
    trial stopped early with the best score of all, which must not count."""
    exp = tracking.ensure_experiment(uri, experiment or f"xmodal-sweep-{name}")
    parent = tracking.create_run(uri, exp, name, {}, {T.KIND: "sweep", T.SWEEP: name, T.METRIC: "valid/mae",
                                                      T.MODE: "min"})
    rng = random.Random(seed)
    for i in range(trials + 1):
        chosen = {"model.layers": rng.randint(1, 8), "optim.lr": 10 ** rng.uniform(-4, -2),
                  "tasks.obj_feat": rng.choice([True, False])}
        if chosen["tasks.obj_feat"]:
            chosen["tasks.feat_loss"] = rng.choice(["l2", "smooth_l1"])
        score = 1.0 - 0.05 * chosen["model.layers"] + rng.gauss(0, 0.005)
        stopped = i == trials
        tags = {T.KIND: "trial", T.SWEEP: name, T.TRIAL_ID: f"t{i}", T.ABLATION_KEYS: json.dumps(KEYS),
                T.METRIC: "valid/mae", T.SEED: "0", **{T.ABLATION + k: str(v) for k, v in chosen.items()},
                **({T.EARLY_STOPPED: "true"} if stopped else {})}
        run_id = tracking.create_run(uri, exp, f"t{i}", {}, tags, parent)
        tracking.log_metrics(uri, run_id, {"valid/mae": score - 0.5 * stopped,
                                           selected_key("valid/mae"): score - 0.5 * stopped}, step=1)
        tracking.set_terminated(uri, run_id, "KILLED" if stopped else "FINISHED")
    return parent


@pytest.fixture
def space(tmp_path):
    path = tmp_path / "space.yaml"
    path.write_text(textwrap.dedent(SPACE))
    return load_space(path)


def test_the_parameter_that_sets_the_score_ranks_first(tmp_path, monkeypatch, space):
    monkeypatch.chdir(tmp_path)  # MLflow's default artifact root
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    parent = made_up_sweep(uri, "imp", trials=16)
    info = log_importance(uri, space, parent)
    assert info["trials"] == 16 and info["method"] == "fanova"  # the stopped trial left out
    values = info["values"]
    assert set(values) == {"model.layers", "optim.lr", "tasks.obj_feat"}
    assert info["left_out"] == ["tasks.feat_loss"]  # it did not apply in every trial
    assert sum(values.values()) == pytest.approx(1.0)
    assert values["model.layers"] > 0.5 and all(values["model.layers"] > 2 * v for k, v in values.items()
                                                 if k != "model.layers"), values
    assert json.loads(tracking.get_run(uri, parent).tags[T.IMPORTANCE]) == info

    rep = make_report(uri, parent_run_id=parent, out_dir=tmp_path / "out")
    assert rep.table.importance[0]["values"] == values
    md = rep.markdown
    section = md.split("## Parameter importance", 1)[1]
    rows = [line.split(" | ")[0].lstrip("| ") for line in section.splitlines() if line.startswith("| ")]
    assert rows[:2] == ["parameter", "model.layers"] and set(rows[2:]) == {"optim.lr", "tasks.obj_feat"}
    assert "importance (sweep imp, 16 trials)" in section and "tasks.feat_loss" in section
    with open(tmp_path / "out" / "importance.csv") as f:
        shares = {r["parameter"]: float(r["importance"]) for r in csv.DictReader(f)}
    assert shares == pytest.approx(values)
    png = tmp_path / "out" / "parameter_importance.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "report/parameter_importance.png" in tracking.list_artifacts(uri, parent, "report")


def test_too_few_finished_trials_say_so(tmp_path, monkeypatch, space):
    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    parent = made_up_sweep(uri, "few", trials=2)
    info = log_importance(uri, space, parent)
    assert "values" not in info and info["why"] == "2 finished trial(s), fANOVA needs at least 3"
    md = make_report(uri, parent_run_id=parent, out_dir=tmp_path / "out", log=False).markdown
    assert "Sweep few: no parameter importance: 2 finished trial(s), fANOVA needs at least 3." in md
    assert not (tmp_path / "out" / "parameter_importance.png").exists()
