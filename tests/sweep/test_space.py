"""Search-space files: schema, validation against the job's config, define-by-run, planning. No Ray."""

from __future__ import annotations

import subprocess
import textwrap
from pathlib import Path

import pytest

import xmodal.config.experiment
from xmodal.jobs.chain_config import PretrainFinetuneConfig
from xmodal.jobs.mult_config import MultTrainConfig
from xmodal.jobs.pretrain_config import PretrainConfig
from xmodal.sweep.plan import SweepOptions, plan_sweep
from xmodal.sweep.space import (
    DefineByRun,
    SpaceError,
    load_space,
    validate_config,
    validate_space,
    with_assignments,
)
from xmodal_testing import PYTHON, REPO, ray_env

SPACES = REPO / "search_spaces"

GOOD = """
job: pretrain
metric: eval/loss/mlm
mode: min
num_samples: 4
scheduler: {type: asha, max_t: 4, grace_period: 1, reduction_factor: 2}
parameters:
  optim.lr: {type: choice, values: [1e-2, 1e-9]}
  tasks.obj_feat: {type: choice, values: [true, false]}
  tasks.feat_loss: {type: choice, values: [l2, smooth_l1], when: {tasks.obj_feat: true}}
  model.x_layers: {type: int, low: 1, high: 3}
try_first:
  - {optim.lr: 1e-2, tasks.obj_feat: true, tasks.feat_loss: smooth_l1}
  - {optim.lr: 1e-9}
"""


def write(tmp_path: Path, text: str, name: str = "space.yaml") -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return p


def plan(tmp_path: Path, text: str, **kw):
    return plan_sweep(SweepOptions(space=str(write(tmp_path, text)), storage_path=str(tmp_path / "runs"), **kw))


def replace(text: str, old: str, new: str) -> str:
    assert old in text, old
    return text.replace(old, new)


# ---------------------------------------------------------------- shipped spaces


@pytest.mark.parametrize("name, job", [("lxmert_layers", "pretrain"), ("lxmert_tasks", "pretrain_finetune")])
def test_shipped_lxmert_spaces_validate_against_their_job_config(name, job, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    p = plan_sweep(SweepOptions(space=str(SPACES / f"{name}.yaml")))
    assert p.space.job == job and p.name.startswith(f"{name}-")
    assert p.experiment == f"xmodal-sweep-{name}"
    assert p.tracking_uri == f"sqlite:///{tmp_path / 'mlflow.db'}"
    assert p.base["scale"]["storage_path"] == str(tmp_path / "runs" / "sweeps" / p.name / "train")
    assert not (tmp_path / "mlflow.db").exists()  # planning writes nothing


def test_task_subsets_keep_mlm_and_matching_on_and_are_scored_downstream():
    space = load_space(SPACES / "lxmert_tasks.yaml")
    options = space.parameters["pretrain_tasks"].options
    assert set(options) == {"all", "no_vision", "feat_only", "label_only", "no_qa"}
    assert all(o["pretrain.tasks.matching"] and o["pretrain.tasks.mlm"] for o in options.values())
    assert space.metric == "valid/accuracy"  # the fine-tuning stage's metric, as the paper's tables
    raw = with_assignments({}, space.assignments({"pretrain_tasks": "no_vision"}))
    cfg = PretrainFinetuneConfig.model_validate(raw)
    assert cfg.pretrain.tasks.enabled() == ("mlm", "matching", "qa")


def test_mult_space_validates_against_the_mult_job_config(tmp_path):
    path = SPACES / "mult_ablation.yaml"
    plan = plan_sweep(SweepOptions(space=str(path), storage_path=str(tmp_path)))
    # Every variant gets the job's default budget, the one tests/jobs/test_mult_learning.py measures:
    # validated as a trial validates it (a partial train section keeps the job's batch size).
    cfg = validate_config(MultTrainConfig, plan.base, "trial")
    default = xmodal.config.experiment.load_config(MultTrainConfig)
    assert (cfg.train, cfg.optim, cfg.preset, cfg.model, cfg.data) == (
        default.train, default.optim, default.preset, default.model, default.data)


@pytest.mark.parametrize("path", sorted(SPACES.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_space_plans(path, tmp_path, monkeypatch):
    """Each file in search_spaces/ validates against its job's config (every choice, both ends of every
    range, the try_first rows), as `jobs/sweep.py` checks it before Tune starts."""
    monkeypatch.chdir(tmp_path)
    p = plan_sweep(SweepOptions(space=str(path)))
    assert p.experiment == f"xmodal-sweep-{path.stem}"
    assert not (tmp_path / "mlflow.db").exists()


def test_mult_depth_space_runs_every_crossmodal_depth_at_each_width_once(tmp_path):
    plan = plan_sweep(SweepOptions(space=str(SPACES / "mult_depth.yaml"), storage_path=str(tmp_path)))
    space = plan.space
    depth = space.parameters["model.layers"]
    assert (depth.low, depth.high, space.metric, space.scheduler.type) == (1, 8, "valid/mae", "fifo")
    rows = {(r["model.layers"], r["width"]) for r in space.try_first}
    widths = space.parameters["width"].options
    assert rows == {(d, w) for d in range(1, 9) for w in widths} and space.num_samples == len(space.try_first)
    for w, keys in widths.items():
        cfg = validate_config(MultTrainConfig,
                              with_assignments(plan.base, space.assignments({"model.layers": 8, "width": w})), w)
        # Only the crossmodal depth and the width vary: the self-attention transformers keep the preset's depth.
        assert (cfg.model.layers, cfg.model.dim, cfg.model.num_heads) == (8, keys["model.dim"], keys["model.num_heads"])
        assert cfg.model.self_depth == 1 and cfg.preset == "small"


# ---------------------------------------------------------------- bad files: clear errors before anything runs


@pytest.mark.parametrize("old, new, expected", [
    # the space file's own schema
    ("num_samples: 4", "num_sample: 4", ["num_sample: unknown key", "num_samples"]),
    ("{type: int, low: 1, high: 3}", "{type: int, lo: 1, high: 3}",
     ["parameters.model.x_layers.lo: unknown key", "low", "parameters.model.x_layers.low: required"]),
    ("{type: int, low: 1, high: 3}", "{type: integer, low: 1, high: 3}",
     ["parameters.model.x_layers", "must be one of int, float, choice", "'integer'"]),
    ("{type: int, low: 1, high: 3}", "{type: int, low: 3, high: 2}",
     ["parameters.model.x_layers: low (3) must be below high (2)"]),
    ("optim.lr: {type: choice, values: [1e-2, 1e-9]}", "optim.lr: {type: float, low: 0, high: 0.1, log: true}",
     ["parameters.optim.lr: log: true needs low > 0"]),
    ("mode: min", "mode: minimum", ["mode", "'max' or 'min'", "'minimum'"]),
    ("type: asha, max_t: 4, grace_period: 1", "type: asha, max_t: 4, grace_period: 4",
     ["grace_period (4) must be below max_t (4)"]),
    ("job: pretrain", "job: pretrian", ["job", "'pretrain'", "'mult'", "'pretrian'"]),
    # conditions
    ("when: {tasks.obj_feat: true}", "when: {tasks.obj_featt: true}",
     ["parameters.tasks.feat_loss.when: 'tasks.obj_featt' is not a parameter of this space",
      "parameters: optim.lr, tasks.obj_feat, tasks.feat_loss, model.x_layers"]),
    ("when: {tasks.obj_feat: true}", "when: {tasks.obj_feat: maybe}", ["tasks.obj_feat='maybe' can never happen",
                                                                        "one of True, False"]),
    ("when: {tasks.obj_feat: true}", "when: {model.x_layers: 2}", ["'model.x_layers' must be declared before"]),
    # try_first
    ("- {optim.lr: 1e-9}", "- {optim.lr: 1e-3}", ["try_first[1]: optim.lr=0.001 is outside the space",
                                                  "one of 0.01, 1e-09"]),
    ("- {optim.lr: 1e-9}", "- {optim.lr: 1e-9, tasks.obj_feat: false, tasks.feat_loss: l2}",
     ["try_first[1]: tasks.feat_loss is given but its condition does not hold"]),
    ("- {optim.lr: 1e-9}", "- {optimm.lr: 1e-9}", ["try_first[1]: 'optimm.lr' is not a parameter"]),
    # the report's baseline: one whole configuration of the space, run first unless try_first lists it
    ("  - {optim.lr: 1e-9}\n", "  - {optim.lr: 1e-9}\nbaseline: {optim.lr: 1e-3}\n",
     ["baseline: optim.lr=0.001 is outside the space", "one of 0.01, 1e-09"]),
    ("  - {optim.lr: 1e-9}\n", "  - {optim.lr: 1e-9}\nbaseline: {optim.lr: 1e-2}\n",
     ["baseline: gives no value for tasks.obj_feat, model.x_layers; expected a value for every parameter"]),
    # (num_samples changed in place: a key given twice is an error of its own)
    (GOOD[GOOD.index("num_samples: 4"):], GOOD[GOOD.index("num_samples: 4"):].replace("num_samples: 4", "num_samples: 2")
     + "baseline: {optim.lr: 1e-9, tasks.obj_feat: false, model.x_layers: 1}\n",
     ["try_first and the baseline: 3 configurations but num_samples is 2"]),
    # keys the sweep owns
    ("  model.x_layers:", "  mlflow.experiment: {type: choice, values: [a, b]}\n  model.x_layers:",
     ["'mlflow.experiment' cannot be searched"]),
])
def test_bad_space_structure(tmp_path, old, new, expected):
    with pytest.raises(SpaceError) as e:
        plan(tmp_path, replace(GOOD, old, new))
    msg = str(e.value)
    assert "space.yaml" in msg
    for piece in expected:
        assert piece in msg, f"{piece!r} not in:\n{msg}"


@pytest.mark.parametrize("old, new, expected", [
    # an unknown config key: the config's error lists the valid keys of that section
    ("model.x_layers: {type: int", "model.x_layer: {type: int",
     ["parameters: 'model.x_layer' is not a key of the pretrain config", "x_layers"]),
    ("model.x_layers: {type: int", "modle.x_layers: {type: int", ["'modle' is not a section", "model, tasks"]),
    # a choice value the config rejects, with the config's allowed values and the space's
    ("values: [l2, smooth_l1]", "values: [smooth_l1, l3]",
     ["parameter 'tasks.feat_loss' = 'l3' is rejected by the pretrain config", "tasks.feat_loss",
      "'l2' or 'smooth_l1'", "the space allows one of 'smooth_l1', 'l3'"]),
    # ends of a range
    ("{type: int, low: 1, high: 3}", "{type: int, low: 1, high: 30}", []),
    ("optim.lr: {type: choice, values: [1e-2, 1e-9]}", "optim.lr: {type: float, low: -1.0, high: 0.1}",
     ["parameter 'optim.lr' = -1.0", "optim.lr", "optim.lr = -1.0: expected a number > 0"]),
    # the metric must be measured with the tasks every trial trains
    ("metric: eval/loss/mlm", "metric: eval/bleu", ["train.best_metric", "'eval/bleu' is not measured",
                                                    "eval/match_acc"]),
    ("  model.x_layers: {type: int, low: 1, high: 3}", "  tasks.mlm: {type: choice, values: [true, false]}",
     ["parameter 'tasks.mlm' = False", "'eval/loss/mlm' is not measured"]),
])
def test_values_the_config_rejects(tmp_path, old, new, expected):
    text = replace(GOOD, old, new)
    if not expected:
        plan(tmp_path, text)  # a large int range is fine: layers have no upper bound in the config
        return
    with pytest.raises(SpaceError) as e:
        plan(tmp_path, text)
    msg = str(e.value)
    assert "space.yaml" in msg
    for piece in expected:
        assert piece in msg, f"{piece!r} not in:\n{msg}"


def test_a_named_option_that_switches_every_task_off(tmp_path):
    text = """
    job: pretrain
    metric: eval/loss
    mode: min
    scheduler: {type: fifo}
    parameters:
      subset:
        type: choice
        options:
          vision: {tasks.mlm: false, tasks.matching: false, tasks.qa: false, tasks.obj_label: false}
          none: {tasks.mlm: false, tasks.matching: false, tasks.qa: false, tasks.obj_label: false, tasks.obj_feat: false}
    """
    with pytest.raises(SpaceError) as e:
        plan(tmp_path, text)
    assert "parameter 'subset' = 'none'" in str(e.value)
    assert "every pretraining task is switched off" in str(e.value)


def test_a_bad_combination_is_found_when_the_space_is_small(tmp_path):
    text = """
    job: pretrain
    metric: eval/loss
    mode: min
    scheduler: {type: fifo}
    base: {config: {tasks: {obj_feat: false, obj_label: false, qa: false}}}
    parameters:
      tasks.mlm: {type: choice, values: [true, false]}
      tasks.matching: {type: choice, values: [true, false]}
    """
    with pytest.raises(SpaceError) as e:
        plan(tmp_path, text)
    assert "the combination tasks.mlm=False, tasks.matching=False" in str(e.value)
    assert "every pretraining task is switched off" in str(e.value)


def test_bad_base_config_and_overrides(tmp_path):
    with pytest.raises(SpaceError, match=r"base config.*\n  train.epoch: unknown key"):
        plan(tmp_path, GOOD + "base: {config: {train: {epoch: 3}}}\n")
    with pytest.raises(SpaceError, match="base.file: config file .*missing.yaml' does not exist"):
        plan(tmp_path, GOOD + "base: {file: missing.yaml}\n")
    with pytest.raises(SpaceError, match="train.epochs = 'many': expected an integer >= 1, got text"):
        plan(tmp_path, GOOD, sets=["train.epochs=many"])


def test_file_level_errors(tmp_path):
    with pytest.raises(SpaceError, match="search space '.*nope.yaml' does not exist"):
        load_space(tmp_path / "nope.yaml")
    with pytest.raises(SpaceError, match="bad.yaml: not valid YAML"):
        load_space(write(tmp_path, "parameters: [1, 2\n", "bad.yaml"))
    with pytest.raises(SpaceError, match="list.yaml: expected a mapping"):
        load_space(write(tmp_path, "- 1\n", "list.yaml"))
    with pytest.raises(SpaceError, match="parameters: required"):
        load_space(write(tmp_path, "job: pretrain\nmetric: eval/loss\nmode: min\nscheduler: {type: fifo}\n", "e.yaml"))
    with pytest.raises(SpaceError, match=r"scheduler: required \(\{type: asha, max_t: REPORTS"):
        load_space(write(tmp_path, replace(GOOD, "scheduler: {type: asha, max_t: 4, grace_period: 1, "
                                                 "reduction_factor: 2}", ""), "s.yaml"))
    with pytest.raises(SpaceError, match="parameters.model.x_layers: needs a `type`: one of int, float, choice"):
        load_space(write(tmp_path, replace(GOOD, "{type: int, low: 1, high: 3}", "{low: 1, high: 3}"), "t.yaml"))
    with pytest.raises(SpaceError, match="base.configs: unknown key; valid keys here: file, config, set"):
        load_space(write(tmp_path, GOOD + "base: {configs: {}}\n", "b.yaml"))


def test_the_command_line_reports_a_bad_space_before_ray_starts(tmp_path):
    bad = write(tmp_path, replace(GOOD, "values: [l2, smooth_l1]", "values: [smooth_l1, l3]"))
    out = subprocess.run([PYTHON, str(REPO / "jobs" / "sweep.py"), str(bad)], cwd=tmp_path, env=ray_env(),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out.stdout + out.stderr
    assert "error: invalid search space" in out.stderr and "'l3'" in out.stderr
    assert "Started a local Ray instance" not in out.stdout + out.stderr
    assert not (tmp_path / "mlflow.db").exists() and not (tmp_path / "runs").exists()


# ---------------------------------------------------------------- values, planning, define-by-run


def test_yaml_exponents_are_numbers_and_base_layers(tmp_path):
    base = write(tmp_path, "train: {epochs: 3, batch_size: 8}\noptim: {lr: 1e-3}\n", "base.yaml")
    p = plan(tmp_path, GOOD + f"base:\n  file: {base.name}\n  config: {{train: {{epochs: 2}}}}\n"
                              "  set: [train.max_steps=5]\n", sets=["train.max_steps=7"])
    assert p.space.parameters["optim.lr"].values == [0.01, 1e-9]
    assert p.base["train"]["epochs"] == 2 and p.base["train"]["batch_size"] == 8
    assert p.base["train"]["max_steps"] == 7  # --set comes last
    assert p.base["optim"]["lr"] == 1e-3
    # the sweep owns these keys: trials keep their best checkpoints by the sweep's metric
    assert p.base["train"]["best_metric"] == "eval/loss/mlm" and p.base["train"]["best_mode"] == "min"
    assert p.base["train"]["seed"] == 0 and p.base["mlflow"]["experiment"] == "xmodal-sweep-space"


def test_gpus_per_trial_are_split_over_the_workers(tmp_path):
    p = plan(tmp_path, GOOD + "base: {config: {scale: {num_workers: 2}}}\n", gpus_per_trial=0.5)
    assert p.base["scale"]["gpus_per_worker"] == 0.25


def test_names_and_resume(tmp_path):
    p = plan(tmp_path, GOOD)
    assert p.name.startswith("space-") and p.root == str(tmp_path / "runs")
    with pytest.raises(SpaceError, match="--resume: no sweep of 'space' under"):
        plan(tmp_path, GOOD, resume=True)
    done = tmp_path / "runs" / "space-20250101-000000"
    done.mkdir(parents=True)
    (done / "tuner.pkl").write_bytes(b"")
    assert plan(tmp_path, GOOD, resume=True).name == "space-20250101-000000"
    assert plan(tmp_path, GOOD, resume=True, name="space-20250101-000000").name == "space-20250101-000000"
    with pytest.raises(SpaceError, match="already exists .*pass --resume to continue it"):
        plan(tmp_path, GOOD, name="space-20250101-000000")


class FakeTrial:
    """Stands in for optuna.Trial: records what was suggested."""

    def __init__(self, picks):
        self.picks, self.asked = picks, []

    def suggest_categorical(self, name, choices):
        self.asked.append(name)
        return self.picks.get(name, choices[0])

    def suggest_int(self, name, low, high, step=1, log=False):
        self.asked.append(name)
        return low

    def suggest_float(self, name, low, high, step=None, log=False):
        self.asked.append(name)
        return low


def test_define_by_run_asks_conditional_parameters_only_when_their_condition_holds(tmp_path):
    space = load_space(write(tmp_path, GOOD))
    fn = DefineByRun(space.parameters)
    on, off = FakeTrial({"tasks.obj_feat": True}), FakeTrial({"tasks.obj_feat": False})
    fn(on), fn(off)
    assert on.asked == ["optim.lr", "tasks.obj_feat", "tasks.feat_loss", "model.x_layers"]
    assert off.asked == ["optim.lr", "tasks.obj_feat", "model.x_layers"]


def test_define_by_run_with_optuna_tpe_and_enqueued_points(tmp_path):
    import pickle

    import optuna

    space = load_space(write(tmp_path, GOOD))
    fn = pickle.loads(pickle.dumps(DefineByRun(space.parameters)))  # Tune saves the searcher with pickle
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(sampler=optuna.samplers.TPESampler(seed=0), direction="minimize")
    for point in space.try_first:
        study.enqueue_trial(point)
    seen = []
    for _ in range(12):
        trial = study.ask()
        fn(trial)
        seen.append(dict(trial.params))
        study.tell(trial, 1.0)
    assert seen[0] == {"optim.lr": 0.01, "tasks.obj_feat": True, "tasks.feat_loss": "smooth_l1",
                       "model.x_layers": seen[0]["model.x_layers"]}
    assert seen[1]["optim.lr"] == 1e-9
    for params in seen:
        assert ("tasks.feat_loss" in params) == params["tasks.obj_feat"]
        assert 1 <= params["model.x_layers"] <= 3
    assert {p["tasks.obj_feat"] for p in seen} == {True, False}


def test_every_probe_value_builds_a_valid_config(tmp_path, monkeypatch):
    import xmodal.sweep.space as space_module

    tried: list[dict] = []
    real = space_module.validate_config

    def spy(config_cls, raw, source):
        tried.append(raw)
        return real(config_cls, raw, source)

    monkeypatch.setattr(space_module, "validate_config", spy)
    space = load_space(write(tmp_path, GOOD))
    cfg = validate_space(space, PretrainConfig, {"train": {"best_metric": "eval/loss/mlm"}}, "x")
    # The base config comes back validated, with no parameter applied: the job's defaults elsewhere.
    assert cfg.train.best_metric == "eval/loss/mlm"
    assert (cfg.optim.lr, cfg.model.x_layers, cfg.tasks.feat_loss) == (2e-3, 2, "l2")
    # Every choice and both ends of the int range were built into a config, each conditional value
    # together with the condition it needs.
    seen = {(k, repr(v)) for raw in tried for k, v in
            [("optim.lr", raw.get("optim", {}).get("lr")), ("tasks.obj_feat", raw.get("tasks", {}).get("obj_feat")),
             ("model.x_layers", raw.get("model", {}).get("x_layers"))]}
    for key, value in [("optim.lr", 1e-2), ("optim.lr", 1e-9), ("tasks.obj_feat", True), ("tasks.obj_feat", False),
                       ("model.x_layers", 1), ("model.x_layers", 3)]:
        assert (key, repr(value)) in seen, (key, value)
    for loss in ("l2", "smooth_l1"):
        assert any(raw.get("tasks", {}) == {"obj_feat": True, "feat_loss": loss} for raw in tried), loss


def test_the_baseline_is_run_first_and_defaults_to_the_first_try_first(tmp_path):
    base = {"optim.lr": 1e-9, "tasks.obj_feat": False, "model.x_layers": 2}
    with_base = load_space(write(tmp_path, GOOD + "baseline: {optim.lr: 1e-9, tasks.obj_feat: false, "
                                               "model.x_layers: 2}\n"))
    assert with_base.baseline_point() == base
    assert with_base.first_points() == [base, *with_base.try_first]
    listed = load_space(write(tmp_path, replace(GOOD, "- {optim.lr: 1e-9}", "- {optim.lr: 1e-9, tasks.obj_feat: "
                                                "false, model.x_layers: 2}") + f"baseline: {base}\n", "b.yaml"))
    assert listed.first_points() == listed.try_first  # already listed: not run twice
    plain = load_space(write(tmp_path, GOOD, "c.yaml"))
    assert plain.baseline_point() == plain.try_first[0]
