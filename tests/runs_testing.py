"""Finished tiny runs that several test files read (example pages, exports): each is trained once per test
session (pytest-xdist worker; tests/conftest.py runs the files that read them on one worker), through
the engine on the shared local Ray. What the readers check does not depend on the run being theirs
alone: each writes only its own artifacts or pages beside the ones it checks."""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest

from xmodal.config.experiment import load_config
from xmodal.runner import engine
from xmodal.runner.spec import RunResult
from xmodal_testing import MlflowServer

# Selection on the worst validation loss (best_mode=max) with an evaluation every 4 steps: the weights a run
# selects are an early evaluation's and differ from its last, so an export of the selected model is told
# apart from one of the last weights.
SELECT_WORST = ["train.best_metric=valid/loss", "train.best_mode=max", "train.eval_every=4", "train.log_every=4",
                "train.batch_size=16", "mlflow.system_metrics=false"]


@dataclass
class Run:
    tmp: Path  # the run's own folder (its store, MLflow database, storage)
    uri: str
    run_id: str
    result: RunResult
    data: object = None  # the fine-tuning set (build_synthetic_vqa's), where the run made one


def _sqlite(tmp: Path, mlflow_template: Path) -> str:
    shutil.copyfile(mlflow_template, tmp / "mlflow.db")  # migrated once per session (tests/conftest.py)
    return f"sqlite:///{tmp / 'mlflow.db'}"


@pytest.fixture(scope="session")
def vqa_run(tmp_path_factory, ray_local, mlflow_template):
    """A VQA fine-tuning run logged to a real `mlflow server` (SQLite behind it, artifacts served, as the
    MLflow UI reads them): 2 epochs of 64 images, selecting on its worst validation loss, its example
    pages (6) logged at its end as the job logs them."""
    from xmodal.cli.training import end_of_run_pages
    from xmodal.data.finetune.synthetic import build_synthetic_vqa
    from xmodal.data.lxmert.synthetic import build_synthetic_store
    from xmodal.data.options import SyntheticLxmertOptions
    from xmodal.jobs.finetune_config import FinetuneConfig
    from xmodal.jobs.finetune_job import FinetuneJob

    tmp = tmp_path_factory.mktemp("vqa-run")
    shutil.copyfile(mlflow_template, tmp / "server.db")
    server = MlflowServer(tmp).start()
    try:
        images = build_synthetic_store(tmp / "images", SyntheticLxmertOptions(
            num_images=64, num_objects=8, feat_dim=16, num_object_labels=10, num_attr_labels=4, num_answers=20))
        vqa = build_synthetic_vqa(images.path, tmp / "vqa", questions_per_image=2)
        result = engine.run(FinetuneJob(), load_config(FinetuneConfig, overrides=[
            f"data.store={vqa.path}", "init.source=scratch", "preset=tiny", f"mlflow.tracking_uri={server.uri}",
            f"scale.storage_path={tmp / 'runs'}", "mlflow.run_name=vqa", "train.epochs=2", *SELECT_WORST,
            "examples.count=6"]), after_run=end_of_run_pages)
        yield Run(tmp, server.uri, result.run_id, result, vqa)
    finally:
        server.stop()


@pytest.fixture(scope="session")
def mult_run(tmp_path_factory, ray_local, stores, mlflow_template):
    """A MulT run in MULTModel's layout (the reference preset: d = 30, kernel 1; one crossmodal layer to stay
    small), MLflow in SQLite: 2 epochs of the 240-clip store, selecting on its worst validation loss."""
    from xmodal.jobs.mult_config import MultTrainConfig
    from xmodal.jobs.mult_job import MultJob

    tmp = tmp_path_factory.mktemp("mult-run")
    uri = _sqlite(tmp, mlflow_template)
    result = engine.run(MultJob(), load_config(MultTrainConfig, overrides=[
        f"data.store={stores['mult']}", "preset=reference", "model.layers=1", f"mlflow.tracking_uri={uri}",
        f"scale.storage_path={tmp / 'runs'}", "mlflow.run_name=mult", "train.epochs=2", *SELECT_WORST]))
    return Run(tmp, uri, result.run_id, result)


@pytest.fixture(scope="session")
def pretrain_run(tmp_path_factory, ray_local, stores, mlflow_template):
    """A pretraining run (tiny preset, all five tasks, 4 steps, one evaluation), MLflow in SQLite, its QA
    head's example pages (5) logged at its end as the job logs them."""
    from xmodal.cli.training import end_of_run_pages
    from xmodal.jobs.pretrain_config import PretrainConfig
    from xmodal.jobs.pretrain_job import PretrainJob

    tmp = tmp_path_factory.mktemp("pretrain-run")
    uri = _sqlite(tmp, mlflow_template)
    result = engine.run(PretrainJob(), load_config(PretrainConfig, overrides=[
        f"data.store={stores['pretrain']}", "preset=tiny", "train.epochs=1", "train.max_steps=4",
        "train.batch_size=16", "train.eval_every=4", "train.log_every=2", "data.eval_batches=1",
        f"scale.storage_path={tmp / 'runs'}", f"mlflow.tracking_uri={uri}", "mlflow.run_name=to-export",
        "mlflow.system_metrics=false", "examples.count=5"]), after_run=end_of_run_pages)
    return Run(tmp, uri, result.run_id, result)
