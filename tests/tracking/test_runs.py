"""xmodal.tracking.runs against a real MLflow SQLite store: a run's lifecycle (a restarted logger skips
the steps already logged), and what the MLflow UI reads (source tags, experiments, datasets, a run's
page)."""

from __future__ import annotations

import json
import subprocess

from xmodal import tracking
from xmodal.base.run_tags import RUN_NAME_TAG
from xmodal_testing import REPO


def test_run_lifecycle_and_resume_skips_logged_steps(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    uri = tracking.resolve_tracking_uri(None)
    assert uri == f"sqlite:///{tmp_path / 'mlflow.db'}"
    exp = tracking.ensure_experiment(uri, "e")
    assert tracking.ensure_experiment(uri, "e") == exp
    run_id = tracking.create_run(uri, exp, "r1", {f"p{i}": i for i in range(150)}, {"model": "lxmert"})
    found = tracking.find_run(uri, exp, "r1")
    assert isinstance(found, tracking.RunRecord) and found.run_id == run_id
    assert tracking.find_run(uri, exp, "other") is None
    assert (found.name, found.status, found.tags["model"]) == ("r1", "RUNNING", "lxmert")

    log = tracking.RunLogger(uri, run_id)
    for step in (1, 2, 3):
        log.log({"train/loss": 1.0 / step}, step)
    assert log.close() is None  # everything sent: no spool file
    # A restarted worker replays steps 2..4: only step 4 is new.
    log2 = tracking.RunLogger(uri, run_id)
    for step in (2, 3, 4):
        log2.log({"train/loss": 10.0 + step}, step)
    log2.close()
    assert log2.logged_steps == {"train/loss": 3}
    points = tracking.metric_points(uri, run_id, "train/loss")
    assert all(isinstance(p, tracking.MetricPoint) and p.timestamp > 0 for p in points)
    assert sorted((p.step, p.value) for p in points) == [(1, 1.0), (2, 0.5), (3, 1 / 3), (4, 14.0)]
    assert tracking.metric_history(uri, run_id, "train/loss") == [(1, 1.0), (2, 0.5), (3, 1 / 3), (4, 14.0)]

    run = tracking.get_run(uri, run_id)
    assert len(run.params) == 150 and run.params["p7"] == "7" and run.tags["model"] == "lxmert"
    assert run.tags[RUN_NAME_TAG] == "r1" and run.tags["model"] == "lxmert"
    assert (run.name, run.experiment_id, run.status, run.end_time) == ("r1", exp, "RUNNING", None)
    assert run.metrics == {"train/loss": 14.0} and run.parent_run_id is None
    tracking.set_terminated(uri, run_id)
    done = tracking.get_run(uri, run_id)
    assert done.status == "FINISHED" and done.end_time >= done.start_time > 0
    assert run.status == "RUNNING"  # a record is a snapshot


# ---------------------------------------------------------------- what the MLflow UI reads


def test_source_tags_name_the_entry_point_commit_and_command(monkeypatch):
    from xmodal.base import run_tags as T
    from xmodal.tracking.runs import _RAY_JOB_ENV

    monkeypatch.delenv(_RAY_JOB_ENV, raising=False)
    tags = tracking.source_tags([str(REPO / "jobs" / "pretrain.py"), "--set", "train.note=a b"])
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                           text=True).stdout.strip()
    assert tags == {T.SOURCE_NAME: "jobs/pretrain.py", T.SOURCE_TYPE: "LOCAL", T.GIT_COMMIT: head,
                    T.GIT_DIRTY: "true" if dirty else "false",
                    T.COMMAND: "jobs/pretrain.py --set 'train.note=a b'"}
    monkeypatch.setenv(_RAY_JOB_ENV, "{}")  # what `ray job submit` sets in the job's driver
    assert tracking.source_tags(["/elsewhere/run.py"])[T.SOURCE_TYPE] == "JOB"
    assert tracking.source_tags(["/elsewhere/run.py"])[T.SOURCE_NAME] == "/elsewhere/run.py"


def test_experiments_open_in_the_training_view_and_datasets_are_logged_once(tmp_path):
    from mlflow import MlflowClient

    from xmodal.base import run_tags as T

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    exp = tracking.ensure_experiment(uri, "new")
    assert client.get_experiment(exp).tags[T.EXPERIMENT_KIND] == "custom_model_development"
    # its description, by the job that created it (here pytest: the general one)
    assert client.get_experiment(exp).tags[T.NOTE] == "Model-training runs logged by xmodal (experiment 'new')."
    assert tracking.experiment_description("x", ["/repo/jobs/sweep.py", "space.yaml"]).startswith(
        "Ablation sweeps (jobs/sweep.py): one parent run per sweep")
    old = client.create_experiment("old")  # made before experiments were marked
    genai = client.create_experiment("genai", tags={T.EXPERIMENT_KIND: "genai_development", T.NOTE: "mine"})
    assert tracking.ensure_experiment(uri, "old", description="Pretraining runs.") == old
    assert client.get_experiment(old).tags[T.EXPERIMENT_KIND] == "custom_model_development"
    assert client.get_experiment(old).tags[T.NOTE] == "Pretraining runs."
    tracking.ensure_experiment(uri, "genai")
    assert client.get_experiment(genai).tags[T.EXPERIMENT_KIND] == "genai_development"  # a user's choice stays
    assert client.get_experiment(genai).tags[T.NOTE] == "mine"  # and so does a user's description

    run_id = tracking.create_run(uri, exp, "r", {}, {})
    # The end summary's address opens the run's page in the training view (MLflow 3.17's UI decides the
    # view by the address's query, defaulting to GenAI, whatever the experiment's kind tag).
    page = f"http://127.0.0.1:5000/#/experiments/{exp}/runs/{run_id}?workflowType=machine_learning"
    assert tracking.run_url(uri, run_id) == page
    assert tracking.ui_command(uri, run_id) == f"mlflow ui --backend-store-uri {uri}\n  then open   {page}"
    assert tracking.ui_command(uri) == f"mlflow ui --backend-store-uri {uri}"
    assert tracking.run_url("http://head:5000/", "abc", "7") == \
        "http://head:5000/#/experiments/7/runs/abc?workflowType=machine_learning"
    for _ in range(2):  # a resumed run logs its data again
        tracking.log_dataset(uri, run_id, "lxmert", str(tmp_path / "store"), "0123456789abcdef",
                             {"rows": {"train": 10}, "dims": {"feat_dim": 16}})
    tracking.log_dataset(uri, run_id, "remote", "s3://bucket/store", "fedcba9876543210", {"rows": {}})
    inputs = client.get_run(run_id).inputs.dataset_inputs
    assert sorted(d.dataset.name for d in inputs) == ["lxmert", "remote"]
    local = next(d.dataset for d in inputs if d.dataset.name == "lxmert")
    assert (local.digest, local.source_type, json.loads(local.source)) == (
        "0123456789abcdef", "local", {"uri": str(tmp_path / "store")})
    assert json.loads(local.profile) == {"rows": {"train": 10}, "dims": {"feat_dim": 16}}
    remote = next(d.dataset for d in inputs if d.dataset.name == "remote")
    assert (remote.source_type, json.loads(remote.source)) == ("s3", {"uri": "s3://bucket/store"})
