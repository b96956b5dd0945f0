"""The cost figures every job logs (xmodal.core.cost), computed in this process: no Ray, no MLflow."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from xmodal.core.cost import CostMeter, count_flops, peak_memory_gib
from xmodal_testing import tiny_worker


class LinearObjective(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 4)

    def forward(self, batch):
        return {"loss": self.lin(batch).sum()}


def test_flops_are_counted_on_forward_and_backward_and_the_gradients_dropped():
    model = LinearObjective()
    meter = CostMeter(model, torch.device("cpu"), world=1, devices_per_worker=1, batch_size=5)
    batches = list(meter.counting([torch.ones(5, 8), torch.ones(3, 8)]))
    assert len(batches) == 2  # handed on unchanged
    # forward 2*5*8*4 (the matmul), backward 2*5*8*4 for the weight's gradient (the input needs none)
    assert count_flops(model, torch.ones(5, 8)) == 640
    assert meter.gflop_per_sample == pytest.approx(640 / 5 / 1e9)  # counted once, on the first batch
    assert all(p.grad is None for p in model.parameters())
    assert meter.params == 8 * 4 + 4


def test_throughput_wall_time_and_device_hours_from_the_clock():
    now = [100.0]
    meter = CostMeter(LinearObjective(), torch.device("cpu"), world=2, devices_per_worker=0.5, batch_size=16,
                      wall_before_s=30.0, started=90.0, clock=lambda: now[0])
    for step_s, hooks_s in [(5.0, 1.0), (2.0, 10.0), (2.0, 0.0), (2.0, 0.0)]:
        now[0] += step_s
        meter.step_start()
        now[0] += hooks_s  # logging, evaluation, checkpoints: not training
        meter.step_end()
    m = meter.metrics()
    # the first step (start-up) is left out: 3 steps of 16 samples in 6 s of steps
    assert m["cost/samples_per_s"] == pytest.approx(48 / 6)
    assert m["cost/wall_s"] == pytest.approx(30 + (now[0] - 90))  # carried over from the checkpoint
    assert m["cost/device_hours"] == pytest.approx(m["cost/wall_s"] * 2 * 0.5 / 3600)
    assert "cost/gflop_per_sample" not in m  # nothing counted yet
    assert 0.01 < m["cost/peak_mem_gib"] == pytest.approx(peak_memory_gib(torch.device("cpu")), rel=0.1)


@pytest.mark.parametrize("job", ["pretrain", "mult", "finetune"])
def test_counting_a_tiny_job_leaves_its_training_alone(job, stores):
    spec, cfg, w = tiny_worker(job, stores[job])
    batch = next(iter(spec.train_batches(w, 0, 0)))
    kwargs = spec.step_kwargs(cfg)(0)
    before = {k: v.clone() for k, v in w.model.state_dict().items()}
    meter = CostMeter(w.model, w.device, 1, 1, cfg.train.batch_size)
    meter.count(batch, **kwargs)
    first = meter.gflop_per_sample
    assert first > 0 and count_flops(w.model, batch, **kwargs) / len(batch) / 1e9 == pytest.approx(first)
    assert all(p.grad is None for p in w.model.parameters())
    assert all(torch.equal(before[k], v) for k, v in w.model.state_dict().items())
