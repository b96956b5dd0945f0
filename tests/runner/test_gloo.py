"""GLOO_SOCKET_IFNAME chosen on each Train worker from the node IP (xmodal.runner.gloo), and what the
engine's TorchTrainer is built with. No Ray cluster needed."""

from __future__ import annotations

import pytest

pytest.importorskip("ray.train")

from xmodal.config.experiment import load_config  # noqa: E402
from xmodal.jobs.pretrain_config import PretrainConfig
from xmodal.jobs.pretrain_job import PretrainJob  # noqa: E402
from xmodal.runner import gloo  # noqa: E402
from xmodal.runner.engine import trainer  # noqa: E402
from xmodal.runner.spec import RunPlan  # noqa: E402


def test_the_interface_holding_an_address_is_found():
    import psutil

    name = gloo.interface_of("127.0.0.1")
    assert name is not None and any(a.address == "127.0.0.1" for a in psutil.net_if_addrs()[name])
    assert gloo.interface_of("198.51.100.1") is None  # TEST-NET-2: no interface here holds it


def test_the_node_ip_chooses_gloo_interface_unless_one_is_set(monkeypatch):
    monkeypatch.delenv(gloo.GLOO_IFNAME, raising=False)
    assert gloo.choose_interface("198.51.100.1") is None  # not found: gloo's own choice, nothing set
    assert gloo.GLOO_IFNAME not in __import__("os").environ
    loopback = gloo.interface_of("127.0.0.1")
    assert gloo.choose_interface("127.0.0.1") == loopback
    assert __import__("os").environ[gloo.GLOO_IFNAME] == loopback
    monkeypatch.setenv(gloo.GLOO_IFNAME, "eth7")  # the operator's choice wins
    assert gloo.choose_interface("127.0.0.1") == "eth7"


def test_the_trainer_sets_gloo_interface_and_bounds_failed_starts(tmp_path):
    cfg = load_config(PretrainConfig, overrides=["preset=tiny", "scale.max_failures=3",
                                                 "scale.placement_strategy=SPREAD"])
    plan = RunPlan(job="pretrain", config=cfg, data=str(tmp_path), start={},
                   train_options={}, tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", run_name="r",
                   storage=str(tmp_path / "runs"), total_steps=1, micro_batch=1, epoch_steps=[1], faults=[],
                   fault_dir=None)
    t = trainer(PretrainJob(), plan)
    assert isinstance(t.backend_config, gloo.NodeInterfaceTorchConfig)
    assert t.backend_config.backend_cls.on_start is gloo._Backend.on_start
    failure = t.run_config.failure_config
    assert (failure.max_failures, failure.controller_failure_limit) == (3, 3)
    assert t.scaling_config.placement_strategy == "SPREAD"
