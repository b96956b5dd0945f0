"""Precision is applied in one place (`runtime.apply_precision`): every caller of the objective's
forward (train step, evaluation, prediction, benchmark) runs under its autocast, and nothing else
enters one."""

from __future__ import annotations

import copy

import pytest
import torch

from xmodal.core.batches import MultBatch
from xmodal.core.runtime import apply_precision, resolve_precision
from xmodal.core.step import TrainState, train_step
from xmodal.models.mult.config import preset
from xmodal.models.mult.model import Mult
from xmodal.objectives.sentiment import MultObjective


def _objective() -> MultObjective:
    torch.manual_seed(0)
    return MultObjective(Mult(preset("tiny")), use_lengths=False)


def _batch() -> MultBatch:
    return MultBatch.random(4, generator=torch.Generator().manual_seed(1), dims=(12, 6, 5), seq_lens=(6, 9, 7))


def test_resolve_precision():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_precision("auto", cpu) is None and resolve_precision("fp32", cuda) is None
    assert resolve_precision("auto", cuda) is torch.bfloat16 and resolve_precision("bf16", cpu) is torch.bfloat16


def test_every_caller_of_forward_runs_in_the_applied_precision():
    objective = _objective()
    keys = list(objective.state_dict())
    apply_precision(objective, torch.bfloat16)
    assert objective.model.compute_dtype is torch.bfloat16  # MulT is told, and casts its weights once
    assert list(objective.state_dict()) == keys  # checkpoints keep their names
    seen = []
    objective.model.out_layer.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    b = _batch()
    with torch.no_grad():
        objective(b, with_metrics=True)  # what evaluation calls
    state = TrainState(model=objective, optimizer=torch.optim.Adam(objective.parameters()))
    losses = train_step(state, [b])  # no autocast in the step itself
    assert seen == [torch.bfloat16, torch.bfloat16] and torch.isfinite(losses["loss"])
    assert all(p.dtype == torch.float32 for p in objective.parameters())  # master weights stay fp32
    assert not torch.is_autocast_enabled("cpu")  # left on exit


def test_a_copy_keeps_its_own_precision_and_fp32_changes_nothing():
    objective = apply_precision(_objective(), torch.bfloat16)
    twin = copy.deepcopy(objective)
    with torch.no_grad():
        twin.model.out_layer.weight.add_(1.0)  # the copy's forward must use the copy's weights
        a, b = objective(_batch())["loss"], twin(_batch())["loss"]
    assert a != b
    plain = _objective()
    assert apply_precision(plain, None) is plain and plain.model.compute_dtype is None
    assert "forward" not in vars(plain)
    with pytest.raises(RuntimeError, match=r"MultObjective already has its precision \(torch.bfloat16\)"):
        apply_precision(objective, torch.bfloat16)
