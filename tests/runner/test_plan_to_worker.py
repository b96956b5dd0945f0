"""The plan crosses to the Ray Train workers as itself (`engine.trainer`): each worker of a real Train
run on the shared local Ray receives a `RunPlan` equal to the driver's, its config the typed object
the driver checked, its batch builder the one the driver's `prepare` made."""

from __future__ import annotations

import dataclasses
import pickle

import numpy as np
import pytest

from xmodal.config.experiment import load_config
from xmodal.jobs.pretrain_config import PretrainConfig
from xmodal.runner import engine
from xmodal.runner.spec import RunPlan

pytestmark = pytest.mark.slow


def builder_state(builder) -> dict:
    """A batch builder's settings (its arrays as lists; its buffer pool, scratch space, left out)."""
    return {k: v.tolist() if isinstance(v, np.ndarray) else v for k, v in vars(builder).items() if k != "_buffers"}


def test_each_worker_receives_the_drivers_run_plan(tmp_path, tiny_store, ray_local):
    from xmodal.data.lxmert.masking import LxmertBatchBuilder
    from xmodal.jobs.pretrain_job import PretrainJob
    from xmodal.runner.worker import PLAN_KEY

    cfg = load_config(PretrainConfig, overrides=[
        f"data.store={tiny_store}", f"scale.storage_path={tmp_path / 'runs'}", "mlflow.run_name=plan",
        f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}", "preset=tiny", "train.batch_size=16",
        "train.max_steps=2", "scale.num_workers=2", "scale.max_failures=0"])
    plan = dataclasses.replace(engine.check(PretrainJob(), cfg).plan, run_id="0" * 32)
    received = tmp_path / "received"
    received.mkdir()

    def keep_plan(config):  # in place of the job's worker: what train_loop_config brought this worker
        import ray.train

        got = config[PLAN_KEY]
        rank = ray.train.get_context().get_world_rank()
        (received / f"rank{rank}.pkl").write_bytes(pickle.dumps((type(got), got)))

    trainer = engine.trainer(PretrainJob(), plan)
    trainer.train_loop_per_worker = keep_plan
    trainer.fit()

    files = sorted(received.iterdir())
    assert [f.name for f in files] == ["rank0.pkl", "rank1.pkl"]
    for f in files:
        kind, got = pickle.loads(f.read_bytes())
        assert kind is RunPlan and type(got.config) is PretrainConfig
        assert got.config == plan.config and got.config.model == plan.config.model  # the fitted model sizes
        assert dataclasses.replace(got, builder=None) == dataclasses.replace(plan, builder=None)
        assert type(got.builder) is LxmertBatchBuilder and builder_state(got.builder) == builder_state(plan.builder)
