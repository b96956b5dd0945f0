"""The engine's driver-side pieces that need no Ray: the fault schedule (a testing aid) and what a run
records in MLflow (source, data, final model)."""

from __future__ import annotations

import json
import os
import subprocess
import textwrap

import pytest
import torch

from xmodal.config.experiment import ConfigError, load_config
from xmodal.jobs.pretrain_config import PretrainConfig
from xmodal.runner.faults import fault_schedule
from xmodal_testing import PYTHON, REPO


def train_of(*overrides: str):
    return load_config(PretrainConfig, overrides=list(overrides)).train


def test_listed_steps_fail_rank_1_or_the_only_worker():
    train = train_of("train.fail_at_step=[7,3]")
    assert fault_schedule(train, 2, 20, "/runs", "a") == [(3, 1), (7, 1)]
    assert fault_schedule(train, 1, 20, "/runs", "a") == [(3, 0), (7, 0)]
    assert fault_schedule(train_of("train.fail_at_step=5"), 4, 20, "/runs", "a") == [(5, 1)]
    assert fault_schedule(train_of(), 2, 20, "/runs", "a") == []


def test_random_faults_are_distinct_seeded_by_run_name_and_never_on_listed_steps():
    train = train_of("train.fail_at_step=3", "train.random_faults=4", "train.fault_seed=1")
    a = fault_schedule(train, 2, 10, "/runs", "trial-a")
    assert len(a) == 5 and len({s for s, _ in a}) == 5  # one fault per step
    assert all(1 <= s < 10 and r in (0, 1) for s, r in a)
    assert a == fault_schedule(train, 2, 10, "/runs", "trial-a")  # a rerun (resume) keeps its schedule
    others = {tuple(fault_schedule(train, 2, 10, "/runs", f"trial-{i}")) for i in range(8)}
    assert len(others) > 1  # trials of one sweep are hit at different steps
    every_step = fault_schedule(train_of("train.random_faults=9"), 1, 10, "/runs", "x")
    assert [s for s, _ in every_step] == list(range(1, 10))


def test_schedules_that_cannot_run_are_errors_naming_the_key():
    with pytest.raises(ConfigError, match=r"train.random_faults = 10: expected at most 9 .*10 steps"):
        fault_schedule(train_of("train.random_faults=10"), 1, 10, "/runs", "x")
    with pytest.raises(ConfigError, match=r"train.fail_at_step = \[12\]: expected steps below the run's 10 steps"):
        fault_schedule(train_of("train.fail_at_step=[2,12]"), 1, 10, "/runs", "x")
    with pytest.raises(ConfigError, match="local scale.storage_path.*'s3://bucket/runs'"):
        fault_schedule(train_of("train.fail_at_step=2"), 1, 10, "s3://bucket/runs", "x")
    with pytest.raises(ConfigError, match=r"train.fail_at_step.0 = 0: expected an integer >= 1"):
        train_of("train.fail_at_step=0")


# ---------------------------------------------------------------- what a run records in MLflow


def example_inputs(job: str, cfg) -> tuple:
    """A small batch of each job's bare model's inputs (seeded)."""
    g = torch.Generator().manual_seed(0)
    if job == "mult":
        m = cfg.model
        return tuple(torch.randn(3, 5, d, generator=g) for d in (m.l_dim, m.a_dim, m.v_dim))
    m = cfg.model
    ids = torch.randint(1, m.vocab_size, (3, 6), generator=g)
    return (ids, torch.ones(3, 6, dtype=torch.bool), torch.randn(3, 4, m.visual_feat_dim, generator=g),
            torch.rand(3, 4, 4, generator=g))


def first_tensor(out) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else next(x for x in out if isinstance(x, torch.Tensor))


def test_each_job_records_source_data_and_a_model_that_loads_in_a_fresh_process(stores, tmp_path):
    """Every job's run, as its driver opens and finishes it (without training): MLflow's source tags,
    the store as a dataset input, the final checkpoint as an `mlflow.pytorch` model of the bare model
    class (the weights selected on validation for a selecting job) with the config beside it, loaded
    with mlflow.pytorch.load_model in a process that has only the package on its path."""
    from mlflow import MlflowClient

    from xmodal import tracking
    from xmodal.base import run_tags as T
    from xmodal.jobs.finetune_config import FinetuneConfig
    from xmodal.jobs.finetune_job import FinetuneJob
    from xmodal.jobs.mult_config import MultTrainConfig
    from xmodal.jobs.mult_job import MultJob
    from xmodal.jobs.pretrain_job import PretrainJob
    from xmodal.runner import engine
    from xmodal.runner import run_record as record
    from xmodal.runner.hooks import ValidationSelection

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    jobs = {"pretrain": (PretrainJob(), PretrainConfig, []), "mult": (MultJob(), MultTrainConfig, []),
            "finetune": (FinetuneJob(), FinetuneConfig, ["init.source=scratch"])}
    client = MlflowClient(uri)
    expected, runs = {}, {}
    for job, (spec, config_class, extra) in jobs.items():
        cfg = load_config(config_class, overrides=[
            f"data.store={stores[job]}", "preset=tiny", f"mlflow.tracking_uri={uri}", f"mlflow.run_name={job}",
            f"scale.storage_path={tmp_path / 'runs'}", *extra])
        checked = engine.check(spec, cfg)
        plan = engine.open_run(spec, checked, "test")
        torch.manual_seed(1)
        objective = spec.build_objective(checked.prepared.cfg, checked.prepared.data)
        folder = tmp_path / "ckpt" / job
        folder.mkdir(parents=True)
        torch.save(objective.state_dict(), folder / "model.pt")
        (folder / "meta.json").write_text(json.dumps({"step": 7}))
        if spec.selects_on_validation:  # the selected weights differ from the last ones
            selected = {k: v + 0.01 if v.is_floating_point() else v for k, v in objective.state_dict().items()}
            torch.save({"weights": selected, "score": 0.5, "valid": {}}, folder / ValidationSelection.BEST_FILE)
            objective.load_state_dict(selected)
        model = record.exported_model(objective).eval()
        inputs = example_inputs(job, checked.prepared.cfg)
        with torch.no_grad():
            expected[job] = first_tensor(model(*inputs))
        torch.save(inputs, tmp_path / f"{job}_inputs.pt")
        model_id = record.log_model(spec, plan, checked.prepared.data, folder)
        assert model_id is not None
        runs[job] = (plan.run_id, type(model).__name__, model_id)
        # The run's checkpoint folder `model` stays apart from its MLflow model (another name).
        tracking.log_artifact(uri, plan.run_id, folder / "model.pt", "model")
        assert tracking.list_artifacts(uri, plan.run_id, "model") == ["model/model.pt"]

        run = client.get_run(plan.run_id)
        assert run.data.tags[T.SOURCE_NAME] == tracking.source_tags()[T.SOURCE_NAME]
        assert run.data.tags[T.SOURCE_TYPE] == "LOCAL"
        assert run.data.tags[T.GIT_COMMIT] == tracking.git_commit() and run.data.tags[T.GIT_DIRTY] in ("true", "false")
        assert run.data.tags[T.COMMAND].startswith(run.data.tags[T.SOURCE_NAME])
        (ds,) = run.inputs.dataset_inputs
        assert ds.dataset.digest == run.data.tags["xmodal.repro.data_manifest_sha256"] != "-"
        assert json.loads(ds.dataset.source)["uri"] == checked.plan.data
        assert [(t.key, t.value) for t in ds.tags] == [("mlflow.data.context", "train")]
        profile = json.loads(ds.dataset.profile)
        assert profile["job"] == job and profile["fingerprint"] == ds.dataset.digest
        assert profile["rows"] and all(n > 0 for n in profile["dims"].values())
        assert [o.model_id for o in run.outputs.model_outputs] == [model_id]
        logged = client.get_logged_model(model_id)
        assert logged.source_run_id == plan.run_id and str(logged.status) in ("READY", "LoggedModelStatus.READY")
        assert logged.params["train.seed"] == str(checked.prepared.cfg.train.seed)
        assert logged.tags[T.SOURCE_NAME] == run.data.tags[T.SOURCE_NAME]  # the model list's "Logged from"
        files = {f.path for f in client.list_logged_model_artifacts(model_id)}
        assert {"MLmodel", "extra_files"} <= files, files
        exp = client.get_experiment(run.info.experiment_id)
        assert exp.tags[T.EXPERIMENT_KIND] == T.TRAINING_EXPERIMENT

    assert runs["pretrain"][1] == "LxmertForPretraining" and runs["mult"][1] == "Mult"
    assert runs["finetune"][1] == "LxmertForQuestionAnswering"
    load = textwrap.dedent(f"""
        import sys, mlflow, mlflow.pytorch, torch
        mlflow.set_tracking_uri({uri!r})
        for job, run_id, name in {[(j, r, n) for j, (r, n, _) in runs.items()]!r}:
            model = mlflow.pytorch.load_model(f"runs:/{{run_id}}/final_model")
            assert type(model).__name__ == name and "xmodal" in type(model).__module__, type(model)
            assert not model.training
            config = mlflow.artifacts.download_artifacts(f"runs:/{{run_id}}/final_model/extra_files/config.yaml")
            assert "train:" in open(config).read()
            with torch.no_grad():
                out = model(*torch.load({str(tmp_path)!r} + f"/{{job}}_inputs.pt"))
            out = out if isinstance(out, torch.Tensor) else next(x for x in out if isinstance(x, torch.Tensor))
            torch.save(out, {str(tmp_path)!r} + f"/{{job}}_out.pt")
    """)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MLFLOW_TRACKING_URI")}
    env["PYTHONPATH"] = str(REPO / "platform")
    done = subprocess.run([PYTHON, "-c", load], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for job, want in expected.items():
        torch.testing.assert_close(torch.load(tmp_path / f"{job}_out.pt"), want)
