"""Every job's training step (forward, loss, backward, optimizer step: `step.train_step`) with the model
and the batch on PyTorch's `meta` device: a tensor that a forward or a loss creates on the CPU by default
(`torch.arange(n)`, `torch.zeros(...)` without `device=`) then fails to meet the meta tensors, as it
would fail on a GPU. The CPU-only suite's stand-in for a CUDA run of each job's step."""

from __future__ import annotations

import pytest
import torch

from xmodal.core.step import TrainState, adamw, train_step
from xmodal_testing import tiny_worker

pytestmark = pytest.mark.usefixtures("one_thread")

META = torch.device("meta")


@pytest.mark.parametrize("job,overrides", [
    ("pretrain", []),
    ("pretrain", ["tasks.label_objects=all", "tasks.feat_loss=l2"]),
    ("finetune", []),
    ("finetune", ["task=nlvr2"]),
    ("mult", []),
], ids=["pretrain", "pretrain-all-objects", "vqa", "nlvr2", "mult"])
def test_the_training_step_runs_on_the_meta_device(job, overrides, stores):
    spec, cfg, w = tiny_worker(job, stores["nlvr2" if "task=nlvr2" in overrides else job], *overrides)
    if job == "pretrain":
        assert set(cfg.tasks.enabled()) == {"mlm", "obj_feat", "obj_label", "matching", "qa"}
    batch = next(iter(spec.train_batches(w, 0, 0)))
    model = w.model.to(META)
    assert {p.device.type for p in model.parameters()} == {"meta"}
    meta_batch = batch.to(META)
    state = TrainState(model, adamw(model, lr=1e-4, weight_decay=0.01, fused=False), grad_clip=1.0)
    losses = train_step(state, [meta_batch], **spec.step_kwargs(cfg)(0))
    assert "loss" in losses and {v.device.type for v in losses.values()} == {"meta"}, losses
    trained = [p for p in model.parameters() if p.requires_grad]
    assert trained and all(p.device.type == "meta" for p in trained)
    # the same step on the CPU batch fails: the check is live (a CPU tensor does not meet a meta one)
    with pytest.raises((RuntimeError, NotImplementedError)):
        train_step(state, [batch], **spec.step_kwargs(cfg)(0))
