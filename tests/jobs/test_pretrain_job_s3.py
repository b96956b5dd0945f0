"""A pretraining run on a store on S3 (a moto server, `s3` in tests/conftest.py), read where it is by
the Train worker's Ray Data tasks: the run logs what the same run on the local copy logs."""

from __future__ import annotations

import hashlib
import uuid

import pytest

from xmodal import tracking
from xmodal.base import run_tags
from xmodal.config.experiment import ConfigError, load_config
from xmodal.jobs.pretrain_config import PretrainConfig
from xmodal.runner import engine
from xmodal_testing import S3_BUCKET


def config(tmp_path, store: str, name: str) -> PretrainConfig:
    return load_config(PretrainConfig, overrides=[
        f"data.store={store}", f"scale.storage_path={tmp_path / 'runs'}", f"mlflow.run_name={name}",
        f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}", "preset=tiny", "train.epochs=1",
        "train.max_steps=4", "train.batch_size=16", "train.eval_every=4", "train.log_every=1",
        "scale.num_workers=1", "data.eval_batches=1", "mlflow.system_metrics=false"])


@pytest.mark.slow
def test_a_run_on_an_s3_store_learns_what_the_local_copy_teaches(tmp_path, stores, s3, ray_local):
    """One Train worker whose Ray Data tasks read the train split from S3 (and its evaluation the
    minival split): its final evaluation is that of the same run in-process on the local copy (the
    same units, batches and steps, `inprocess.run_in_process`)."""
    from xmodal.jobs.pretrain_job import PretrainJob, pretrain_in_process

    local = stores["pretrain"]
    uri = s3.upload(local, f"runs-{uuid.uuid4().hex[:8]}/lxmert")
    result = engine.run(PretrainJob(), config(tmp_path, uri, "on-s3"))
    db = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run = tracking.get_run(db, result.run_id)
    assert run.status == "FINISHED"
    assert run.tags[run_tags.STORE] == uri  # the URI itself, not a local path made of it
    digest = hashlib.sha256((local / "manifest.json").read_bytes()).hexdigest()[:16]
    assert run.tags[run_tags.REPRO_DATA_MANIFEST] == digest
    assert [s for s, _ in tracking.metric_history(db, run.run_id, "train/loss")] == [1, 2, 3, 4]
    _, expected = pretrain_in_process(config(tmp_path, str(local), "in-process"), None)
    for key in ("eval/loss", "eval/mlm_acc", "eval/match_acc"):
        (step, got), = [p for p in tracking.metric_history(db, run.run_id, key) if p[0] == 4]
        assert got == pytest.approx(expected[key], abs=1e-5), key


def test_a_missing_s3_store_is_a_config_error_before_ray(tmp_path, s3):
    from xmodal.jobs.pretrain_job import PretrainJob
    from xmodal.runner import engine

    missing = f"s3://{S3_BUCKET}/nothing-{uuid.uuid4().hex[:8]}/lxmert"
    with pytest.raises(ConfigError, match=f"data.store: '{missing}' does not exist; build it with `python "
                                          f"jobs/ingest.py lxmert\\|synthetic lxmert` and upload it to {missing}"):
        engine.check(PretrainJob(), config(tmp_path, missing, "missing"))
    assert not (tmp_path / "mlflow.db").exists()
