"""The pretraining job end to end: real Ray, real MLflow (SQLite), real Parquet stores."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from xmodal import tracking
from xmodal.config.experiment import ConfigError, load_config
from xmodal.jobs.pretrain_config import PretrainConfig
from xmodal.runner import engine
from xmodal_testing import PYTHON, REPO, RayHead, ray_env, wait_job

PRETRAIN = str(REPO / "jobs" / "pretrain.py")
TASK_METRICS = ["train/loss/mlm", "train/loss/obj_feat", "train/loss/obj_label", "train/loss/matching",
                "eval/mlm_acc", "eval/obj_acc", "eval/attr_acc", "eval/feat_mse", "eval/match_acc", "eval/qa_acc"]


@pytest.fixture(scope="module")
def tiny_store(tmp_path_factory):
    """A small synthetic store built through the real ingest CLI: 48 images, 6 steps an epoch on two workers
    at batch 16 (13 on one), so that the runs below cross an epoch's end within a dozen steps."""
    out = tmp_path_factory.mktemp("store") / "lxmert"
    subprocess.run([PYTHON, str(REPO / "jobs" / "ingest.py"), "synthetic", str(out), "--num-images", "48",
                    "--feat-dim", "16", "--num-objects", "8", "--num-object-labels", "10",
                    "--num-attr-labels", "4", "--num-answers", "20"], check=True, cwd=REPO)
    return out


def the_run(tmp: Path, name: str, experiment: str = "xmodal-pretrain"):
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    exp_id = tracking.get_experiment_id(uri, experiment)
    runs = tracking.search_runs(uri, [exp_id], f"tags.`{tracking.RUN_NAME_TAG}` = '{name}'")
    assert len(runs) == 1, f"expected one MLflow run named {name}, found {len(runs)}"
    return uri, runs[0]


def steps_of(uri: str, run_id: str, key: str) -> list[int]:
    return sorted(m.step for m in tracking.metric_points(uri, run_id, key))


# ---------------------------------------------------------------- bad input, before Ray starts


def test_a_model_size_the_store_fixes_is_refused_when_set_otherwise(tiny_store, tmp_path):
    """The store gives the model's vocabulary, feature and label sizes: one set to another value was
    replaced silently; its own value (a run's logged config on its store) passes."""
    from xmodal.data.lxmert.store import open_store
    from xmodal.jobs.pretrain_job import PretrainJob
    from xmodal.runner.spec import PrepareContext

    answers = open_store(tiny_store).manifest.num_answers
    base = [f"data.store={tiny_store}", f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}"]
    for key, given, message in [
        ("visual_feat_dim", 7, "has features 16 wide; drop the key (or set it to 16)"),
        ("num_qa_labels", answers + 1, f"has {answers} answers; drop the key (or set it to {answers})"),
    ]:
        with pytest.raises(ConfigError) as e:
            engine.check(PretrainJob(), load_config(PretrainConfig, overrides=[*base, f"model.{key}={given}"]))
        assert str(e.value).startswith(f"model.{key}: {given} set, but the model's {key} comes from the data, and "
                                       f"the store {tiny_store} ")
        assert message in str(e.value)
    assert not (tmp_path / "mlflow.db").exists()
    same = load_config(PretrainConfig, overrides=[*base, "model.visual_feat_dim=16", f"model.num_qa_labels={answers}"])
    assert PretrainJob().prepare(same, PrepareContext("", tmp_path)).cfg.model.visual_feat_dim == 16


@pytest.mark.parametrize("args, message", [
    (["--set", "train.epoch=3"], "train.epoch: unknown key"),
    (["--set", "train.epochs=three"], "train.epochs"),
    (["--store", "/nonexistent/store"], "data.store: '/nonexistent/store' does not exist"),
])
def test_bad_config_fails_before_ray_starts(tmp_path, args, message):
    out = subprocess.run([PYTHON, PRETRAIN, *args], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                         env=ray_env())
    assert out.returncode == 2, out.stdout + out.stderr
    assert message in out.stderr
    assert "Started a local Ray instance" not in out.stdout + out.stderr
    assert not (tmp_path / "mlflow.db").exists()


def test_batch_size_must_split_over_workers(tiny_store):
    with pytest.raises(ConfigError, match="train.batch_size = 10: expected a multiple of scale.num_workers"):
        load_config(PretrainConfig, overrides=[f"data.store={tiny_store}", "train.batch_size=10",
                                               "scale.num_workers=4"])


# ---------------------------------------------------------------- through `ray job submit`


# The submitted run: two workers, two epochs of 6 steps, an evaluation and checkpoint every 4 steps, a
# log step every step. (A worker's fault and exact resume: tests/jobs/test_finetune_job.py, test_cross_host.py.)
SUBMITTED_CASE = ["preset=tiny", "train.epochs=2", "train.batch_size=16", "train.eval_every=4", "train.log_every=1",
              "scale.num_workers=2", "scale.max_failures=2", "data.eval_batches=2", "mlflow.system_metrics=false"]


@pytest.fixture(scope="module")
def submitted(tmp_path_factory, tiny_store):
    """(folder, job logs, job status) of the run named "clean", submitted through `ray job submit` to a
    Ray head of its own."""
    tmp = tmp_path_factory.mktemp("submitted")
    head = RayHead(tmp)
    try:
        sets = [a for s in SUBMITTED_CASE for a in ("--set", s)]
        job = head.submit([PYTHON, PRETRAIN, "--store", str(tiny_store), "--storage-path", str(tmp / "runs"),
                           "--run-name", "clean", *sets, "--set", f"mlflow.tracking_uri=sqlite:///{tmp / 'mlflow.db'}"])
        status = wait_job(head.client(), job, timeout=400)
        logs = head.client().get_job_logs(job)
    finally:
        head.stop()
    return tmp, logs, status


@pytest.mark.slow
def test_job_submit_logs_a_finished_run(submitted, tiny_store, monkeypatch):
    tmp_path, logs, status = submitted
    assert status == "SUCCEEDED", logs[-4000:]
    assert "mlflow ui --backend-store-uri" in logs and "samples/s" in logs and "ETA" in logs
    uri, run = the_run(tmp_path, "clean")
    assert run.status == "FINISHED"
    assert run.params["model.hidden_size"] == "32" and run.params["scale.num_workers"] == "2"
    assert run.tags["model"] == "lxmert" and run.tags["git_commit"]
    for key in TASK_METRICS + ["train/lr", "train/samples_per_s"]:
        assert key in run.metrics, key
    artifacts = set(tracking.list_artifacts(uri, run.run_id))
    assert "config.yaml" in artifacts and "model" in artifacts
    model_files = set(tracking.list_artifacts(uri, run.run_id, "model"))
    assert "model/model.pt" in model_files
    # What the MLflow UI's run page reads: source, dataset input, logged model (loads with its weights).
    import mlflow
    import torch

    from xmodal.base import run_tags as T

    assert (run.tags[T.SOURCE_NAME], run.tags[T.SOURCE_TYPE]) == ("jobs/pretrain.py", "JOB")
    assert run.tags[T.GIT_COMMIT] == run.tags["git_commit"] and "--run-name clean" in run.tags[T.COMMAND]
    client = mlflow.MlflowClient(uri)
    full = client.get_run(run.run_id)
    (ds,) = full.inputs.dataset_inputs
    assert ds.dataset.name == tiny_store.name and ds.dataset.digest == run.tags["xmodal.repro.data_manifest_sha256"]
    assert json.loads(ds.dataset.profile)["dims"]["feat_dim"] == 16
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # what resolves runs:/ (no global setting left behind)
    model = mlflow.pytorch.load_model(f"runs:/{run.run_id}/final_model")
    final = torch.load(tracking.download_artifacts(uri, run.run_id, "model/model.pt", tmp_path / "dl"),
                       weights_only=True)
    assert type(model).__name__ == "LxmertForPretraining"
    assert all(torch.equal(v, final[f"model.{k}"]) for k, v in model.state_dict().items())
    assert client.get_experiment(full.info.experiment_id).tags[T.EXPERIMENT_KIND] == T.TRAINING_EXPERIMENT


# ---------------------------------------------------------------- faults


def final_metrics(out: str) -> dict[str, str]:
    """The end summary's final value of each metric (xmodal.base.console.summary_table)."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("[xmodal] finished run "))
    rows = [line.split() for line in lines[start + 2:]]
    return {r[0]: r[1] for r in rows if "/" in r[0]}


def short_args(tmp: Path, store: Path, storage: Path, name: str, steps: int) -> list[str]:
    """One worker, `steps` steps, a checkpoint every 4 (all kept), no retries."""
    return ["--store", str(store), "--storage-path", str(storage), "--run-name", name,
            "--set", "preset=tiny", "--set", "train.epochs=1", "--set", "train.batch_size=16",
            "--set", f"train.max_steps={steps}", "--set", "train.eval_every=4", "--set", "train.log_every=2",
            "--set", "train.keep_best=10", "--set", "data.eval_batches=2", "--set", "scale.max_failures=0",
            "--set", "mlflow.system_metrics=false", "--set", f"mlflow.tracking_uri=sqlite:///{tmp / 'mlflow.db'}"]


def checkpoint_bytes(store: Path) -> int:
    """About what one checkpoint of the tiny model takes: weights and AdamW's two moments."""
    from xmodal.jobs.pretrain_job import PretrainJob

    cfg = load_config(PretrainConfig, overrides=[f"data.store={store}", "preset=tiny"])
    checked = engine.check(PretrainJob(), cfg)
    n = sum(p.numel() * p.element_size() for p in PretrainJob().build_objective(checked.prepared.cfg, checked.prepared.data)
            .parameters())
    return 3 * n


@pytest.mark.slow
def test_storage_faults_full_storage_then_a_corrupt_checkpoint(tmp_path, tiny_store, ray_local):
    """1. The storage has room for one checkpoint (step 4), not two: writing the step-8 one fails (in the
    worker, or in Ray Train's controller while the worker's copy fills the disk). The job stops with one
    error line naming the storage (exit 2); once the storage has room again, the
    rerun resumes from the step-4 checkpoint and finishes.
    2. That finished run's final checkpoint (step 10) is then truncated; the next rerun says so, resumes
    from the step-8 one, trains steps 9-10 again and ends with the same weights and evaluation.
    The jobs attach to the shared test Ray (RAY_ADDRESS), as a submitted job attaches to its cluster."""
    import os

    import torch

    from xmodal.core import checkpoint as ckpt

    if os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs (the full storage) needs root")
    storage = tmp_path / "storage"
    storage.mkdir()
    size_k = checkpoint_bytes(tiny_store) * 3 // 2 // 1024  # one checkpoint fits, two do not
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_k}k", "tmpfs", str(storage)],
                             capture_output=True, text=True)
    if mounted.returncode != 0:
        pytest.skip(f"mounting a tmpfs is not permitted here: {mounted.stderr.strip()}")
    env = ray_env(RAY_ADDRESS=ray_local.get_runtime_context().gcs_address)
    try:
        cmd = [PYTHON, PRETRAIN, *short_args(tmp_path, tiny_store, storage, "full", steps=10)]
        first = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
        assert first.returncode == 2, first.stdout[-3000:] + first.stderr[-3000:]
        errors = [line for line in first.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1, first.stderr[-3000:]
        # The worker's write of the step-8 checkpoint fails, or, while that copy fills the disk, Ray Train's
        # controller rewriting its list of checkpoints does (recovery.controller_write_advice): one line either way.
        assert errors[0].startswith((f"error: writing a checkpoint of run full under {storage}/full failed at step 8: ",
                                     f"error: writing Ray Train's list of the checkpoints of run full under {storage}/full "
                                     "failed: ")), errors[0]
        assert "No space left on device" in errors[0]
        assert f"the previous checkpoint (step 4, {storage}/full/checkpoint_" in errors[0]
        assert errors[0].endswith("rerun with mlflow.run_name=full to resume")
        # Ray's own processes log the worker's failure; the driver itself prints no traceback.
        assert not [line for line in first.stderr.splitlines() if line.startswith("Traceback")]
        uri, run = the_run(tmp_path, "full")
        assert run.status == "FAILED"

        subprocess.run(["mount", "-o", "remount,size=16m", str(storage)], check=True)  # storage back
        second = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
        assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
        assert "resumed from checkpoint at step 4" in second.stdout
        uri, run = the_run(tmp_path, "full")
        assert run.status == "FINISHED"
        assert [m.value for m in tracking.metric_points(uri, run.run_id, "train/resumed_from_step")] == [4]
        assert steps_of(uri, run.run_id, "train/loss") == [2, 4, 6, 8, 10]

        folders = sorted(f for f in (storage / "full").glob("checkpoint_*") if f.is_dir())
        assert [ckpt.read_meta(f)["step"] for f in folders] == [4, 8, 10]
        final = torch.load(folders[-1] / ckpt.MODEL_FILE, weights_only=True)
        model = folders[-1] / ckpt.MODEL_FILE
        size = model.stat().st_size
        model.write_bytes(model.read_bytes()[:1000])  # truncated
        third = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=400)
        assert third.returncode == 0, third.stdout[-3000:] + third.stderr[-3000:]
        assert (f"[xmodal] checkpoint {folders[-1]} is corrupt (model.pt has 1000 bytes, expected {size} "
                "(truncated or overwritten)); skipped") in third.stdout
        assert f"resuming from {folders[1]} (step 8), the newest intact checkpoint" in third.stdout
        assert "resumed from checkpoint at step 8" in third.stdout
        finals = [final_metrics(out.stdout) for out in (second, third)]
        assert finals[0] and finals[0] == finals[1]  # the same final evaluation (4 decimals)
        newest = max(f for f in (storage / "full").glob("checkpoint_*") if f.is_dir())
        assert ckpt.verify(newest) is None and ckpt.read_meta(newest)["finished"]
        again = torch.load(newest / ckpt.MODEL_FILE, weights_only=True)
        worst = max(float((again[k] - final[k]).abs().max()) for k in final)
        assert worst <= 1e-5, f"the retrained steps end with other weights (max difference {worst})"
        uri, run = the_run(tmp_path, "full")
        assert run.status == "FINISHED"
        assert [m.value for m in tracking.metric_points(uri, run.run_id, "train/resumed_from_step")] == [4, 8]
    finally:
        subprocess.run(["umount", "-l", str(storage)], check=False)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v"]))
