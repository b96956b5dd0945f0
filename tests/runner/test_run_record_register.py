"""`mlflow.registered_model` / `--register NAME` on a job: the run's logged model becomes a version of the
registered model, on a real MLflow SQLite store (the driver's end-of-run calls, without training)."""

from __future__ import annotations

import pytest
import torch

from xmodal import tracking
from xmodal.config.experiment import ConfigError, load_config
from xmodal.jobs.mult_config import MultTrainConfig


@pytest.fixture(scope="module")
def mult_store(tmp_path_factory):
    from xmodal.data.mult.synthetic import SyntheticMultOptions, build_synthetic_store

    return build_synthetic_store(tmp_path_factory.mktemp("mult") / "store", SyntheticMultOptions(num_samples=60))


def test_a_bad_model_name_is_a_config_error():
    with pytest.raises(ConfigError, match=r"mlflow.registered_model.*a/b"):
        load_config(MultTrainConfig, overrides=["mlflow.registered_model=a/b"])


def test_each_run_registers_a_new_version_of_its_logged_model(mult_store, tmp_path, monkeypatch):
    from xmodal.jobs.mult_job import MultJob
    from xmodal.runner import engine
    from xmodal.runner import run_record as record

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    versions = []
    for name in ("first", "second"):
        cfg = load_config(MultTrainConfig, overrides=[
            f"data.store={mult_store.path}", "preset=tiny", f"mlflow.tracking_uri={uri}", f"mlflow.run_name={name}",
            f"scale.storage_path={tmp_path / 'runs'}", "mlflow.registered_model=mult-job"])
        spec = MultJob()
        checked = engine.check(spec, cfg)
        plan = engine.open_run(spec, checked, "test")
        objective = spec.build_objective(checked.prepared.cfg, checked.prepared.data)
        folder = tmp_path / "ckpt" / name
        folder.mkdir(parents=True)
        torch.save(objective.state_dict(), folder / "model.pt")
        (folder / "meta.json").write_text('{"step": 3}')
        model_id = record.log_model(spec, plan, checked.prepared.data, folder)
        version = record.register(plan, model_id)
        assert version is not None and version.model_id == model_id == tracking.run_model_id(uri, plan.run_id)
        assert version.run_id == plan.run_id and version.aliases == ()
        versions.append(version.version)
    assert versions == [1, 2]
    assert tracking.get_model_version(uri, "mult-job", 2).run_id == plan.run_id
