"""The optimizers and schedules (`core/optim.py`) against the formulas written out here.

BertAdam is the LXMERT reference's (airsplay/lxmert `src/lxrt/optimization.py`); the expected values
below follow its text step by step, in plain Python floats, element by element."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from xmodal.core import checkpoint as ckpt
from xmodal.core.loop import epoch_ended
from xmodal.core.optim import (
    BertAdam,
    current_lr,
    param_groups,
    warmup_constant,
    warmup_cosine,
    warmup_linear,
)
from xmodal.core.runtime import prepare
from xmodal.core.step import TrainState


def test_the_warmup_schedules_are_the_reference_formulas_past_t_total_too():
    w = 0.1
    for x in (0.0, 0.05, 0.1, 0.3, 0.99, 1.0, 1.2, 2.5):
        up = x / w
        assert warmup_linear(x, w) == (up if x < w else max((x - 1.0) / (w - 1.0), 0))
        assert warmup_constant(x, w) == (up if x < w else 1.0)
        assert warmup_cosine(x, w) == pytest.approx(up if x < w else 0.5 * (1.0 + math.cos(math.pi * x)), abs=1e-15)
    # past t_total: linear stays at 0, constant at 1, cosine climbs back up (it is periodic)
    assert warmup_linear(1.5, w) == 0 and warmup_constant(1.5, w) == 1.0 and warmup_cosine(2.0, w) == pytest.approx(1.0)
    # no warm-up: the decay from the first step
    assert warmup_linear(0.25, 0.0) == 0.75


def _bertadam_by_hand(p0: list[float], grads: list[list[float]], lr: float, warmup: float, t_total: int, wd: float,
                      schedule, b1=0.9, b2=0.999, e=1e-6) -> list[list[float]]:
    """The reference's step, element by element: m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g g;
    u = m / (sqrt(v) + e) + wd p; p = p - lr * schedule(step / t_total, warmup) * u; step += 1."""
    p, m, v, out = list(p0), [0.0] * len(p0), [0.0] * len(p0), []
    for step, g in enumerate(grads):
        lr_t = lr * schedule(step / t_total, warmup)
        for i, gi in enumerate(g):
            m[i] = b1 * m[i] + (1 - b1) * gi
            v[i] = b2 * v[i] + (1 - b2) * gi * gi
            u = m[i] / (math.sqrt(v[i]) + e) + wd * p[i]
            p[i] = p[i] - lr_t * u
        out.append(list(p))
    return out


@pytest.mark.parametrize("schedule", ["linear", "constant", "cosine"])
def test_bertadam_is_the_reference_update_without_bias_correction(schedule):
    fn = {"linear": warmup_linear, "constant": warmup_constant, "cosine": warmup_cosine}[schedule]
    p0 = [0.5, -1.25, 2.0]
    grads = [[0.1 * (k + 1), -0.3, 0.02 * k - 0.05] for k in range(12)]
    t_total = 8  # 12 steps: 4 past t_total
    expected = _bertadam_by_hand(p0, grads, lr=0.1, warmup=0.25, t_total=t_total, wd=0.01, schedule=fn)
    w = torch.nn.Parameter(torch.tensor(p0, dtype=torch.float64))
    opt = BertAdam([w], lr=0.1, warmup=0.25, t_total=t_total, schedule=schedule, weight_decay=0.01)
    for g, want in zip(grads, expected, strict=True):
        w.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
        assert w.detach().tolist() == pytest.approx(want, rel=1e-13, abs=1e-15)
    assert opt.state[w]["step"] == 12
    if schedule == "linear":  # past t_total the rate is 0: only the moments move
        assert opt.scheduled_lr() == 0.0


def test_bertadam_skips_a_parameter_without_gradient_and_keeps_its_own_step_count():
    a, b = (torch.nn.Parameter(torch.ones(2, dtype=torch.float64)) for _ in range(2))
    opt = BertAdam([a, b], lr=1.0, warmup=0.0, t_total=4, schedule="constant", weight_decay=0.5)
    a.grad = torch.ones(2, dtype=torch.float64)
    opt.step()
    assert b.tolist() == [1.0, 1.0] and not opt.state[b]  # no gradient: no decay, no state (as the reference)
    assert opt.state[a]["step"] == 1
    # the first step: m = 0.1, v = 0.001, u = 0.1 / (sqrt(0.001) + 1e-6) + 0.5 * 1; lr 1 (constant, no warm-up)
    u = 0.1 / (math.sqrt(0.001) + 1e-6) + 0.5
    assert a.tolist() == pytest.approx([1 - u, 1 - u], rel=1e-14)


def test_decay_groups():
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.LayerNorm(2))
    everything = param_groups(model, 0.01, "all")
    assert len(everything) == 1 and everything[0]["weight_decay"] == 0.01 and len(everything[0]["params"]) == 4
    decay, rest = param_groups(model, 0.01, "matrices")
    assert [p.ndim for p in decay["params"]] == [2] and decay["weight_decay"] == 0.01
    assert [p.ndim for p in rest["params"]] == [1, 1, 1] and rest["weight_decay"] == 0.0


def _optim(**kw):
    base = dict(name="adamw", schedule="linear", decay_on="matrices", lr=0.1, weight_decay=0.0, betas=(0.9, 0.999),
                eps=1e-8, warmup_ratio=0.0, grad_clip=0.0,
                plateau=SimpleNamespace(mode="min", factor=0.5, patience=1, threshold=1e-4))
    return SimpleNamespace(**{**base, **kw})


TRAIN = SimpleNamespace(compile=False, precision="fp32")


def test_prepare_builds_what_the_settings_name():
    def state(**kw):
        return prepare(torch.nn.Linear(2, 1), torch.device("cpu"), TRAIN, _optim(**kw), total_steps=10)

    s = state(name="bertadam", warmup_ratio=0.1, decay_on="all")
    assert isinstance(s.optimizer, BertAdam) and s.scheduler is None and s.plateau is None
    assert s.optimizer.param_groups[0]["t_total"] == 10 and current_lr(s.optimizer, s.scheduler) == 0.0
    s = state(name="adam", schedule="plateau")
    assert isinstance(s.optimizer, torch.optim.Adam) and s.scheduler is None
    assert isinstance(s.plateau, torch.optim.lr_scheduler.ReduceLROnPlateau) and current_lr(s.optimizer) == 0.1
    s = state(schedule="constant", warmup_ratio=0.2)  # 2 warm-up steps: 1/2, then the peak for good
    rates = []
    for _ in range(5):
        rates.append(current_lr(s.optimizer, s.scheduler))
        s.optimizer.step()
        s.scheduler.step()
    assert rates == pytest.approx([0.05, 0.1, 0.1, 0.1, 0.1])


def test_the_plateau_drops_once_per_epoch_by_the_watched_metric_and_resumes_from_a_checkpoint(tmp_path):
    """patience 1, factor 0.5: an epoch without a better loss is allowed, the second drops the rate."""
    def fresh() -> TrainState:
        return prepare(torch.nn.Linear(2, 1), torch.device("cpu"), TRAIN, _optim(name="adam", schedule="plateau"), 10)

    state = fresh()
    rates = []
    for loss in (1.0, 0.8, 0.9, 0.85, 0.7, 0.75, 0.8):
        epoch_ended(state, {"valid/loss": loss}, "valid/loss")
        rates.append(current_lr(state.optimizer))
    assert rates == [0.1, 0.1, 0.1, 0.05, 0.05, 0.05, 0.025]
    with pytest.raises(RuntimeError, match="watches 'valid/mae'"):
        epoch_ended(state, {"valid/loss": 1.0}, "valid/mae")

    # killed after the first drop (epochs 1-4), resumed from the checkpoint: the same history after it
    first = fresh()
    for loss in (1.0, 0.8, 0.9, 0.85):
        epoch_ended(first, {"valid/loss": loss}, "valid/loss")
    ckpt.save(tmp_path, first, {})
    resumed = fresh()
    ckpt.restore(tmp_path, resumed)
    assert current_lr(resumed.optimizer) == 0.05
    after = []
    for loss in (0.7, 0.75, 0.8):
        epoch_ended(resumed, {"valid/loss": loss}, "valid/loss")
        after.append(current_lr(resumed.optimizer))
    assert after == rates[4:]
