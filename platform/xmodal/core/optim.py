"""The optimizers and learning-rate schedules a run can train with (`optim.name`, `optim.schedule`,
`optim.decay_on`). Imports only torch.

- `adamw`: torch's AdamW (bias-corrected, decoupled decay); `adam`: torch's Adam (bias-corrected,
  decay as an L2 term in the gradient), the MulT reference's optimizer.
- `bertadam`: `BertAdam`, the LXMERT reference's optimizer (airsplay/lxmert `src/lxrt/optimization.py`)
  operation for operation: no bias correction, the decay added to the update, and its schedule inside
  the optimizer, evaluated at each parameter's own step count over `t_total`.
- Schedules of adam and adamw: `linear` (`step.linear_warmup_decay`), `constant` (the same warm-up,
  then the peak rate) and `plateau` (torch's ReduceLROnPlateau, which the runner steps once per epoch
  on a validation metric: `TrainState.plateau`). BertAdam's: `linear`, `constant`, `cosine` (the
  reference's `warmup_linear`, `warmup_constant`, `warmup_cosine`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch
from torch import nn


def warmup_linear(x: float, warmup: float) -> float:
    """The reference's `warmup_linear`: x / warmup up to the warm-up, then down to 0 at x = 1, and 0
    past it (x = step / t_total)."""
    if x < warmup:
        return x / warmup
    return max((x - 1.0) / (warmup - 1.0), 0)


def warmup_constant(x: float, warmup: float) -> float:
    """The reference's `warmup_constant`: x / warmup up to the warm-up, then 1 (past t_total too)."""
    if x < warmup:
        return x / warmup
    return 1.0


def warmup_cosine(x: float, warmup: float) -> float:
    """The reference's `warmup_cosine`: x / warmup up to the warm-up, then 0.5 (1 + cos(pi x)), which
    rises again past x = 1. (The reference passes the float x to `torch.cos`, which takes only tensors,
    so its own cosine schedule raises a TypeError at the first step past the warm-up; this is the
    formula it writes.)"""
    if x < warmup:
        return x / warmup
    return 0.5 * (1.0 + math.cos(math.pi * x))


BERT_SCHEDULES: dict[str, Callable[[float, float], float]] = {
    "linear": warmup_linear, "constant": warmup_constant, "cosine": warmup_cosine}


class BertAdam(torch.optim.Optimizer):
    """The LXMERT reference's BertAdam with its clipping left outside (as the reference leaves it: its
    tasks clip with `clip_grad_norm_` before the step). Per parameter, in the reference's order:
    m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2; u = m / (sqrt(v) + eps) [+ wd p];
    p -= lr * schedule(step / t_total, warmup) * u; step += 1. No bias correction; a parameter whose
    gradient is None is skipped (no decay, no step count), as in the reference."""

    def __init__(self, params: Iterable, lr: float, warmup: float, t_total: int, schedule: str = "linear",
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.01):
        if schedule not in BERT_SCHEDULES:
            raise ValueError(f"BertAdam schedule {schedule!r}; expected one of {sorted(BERT_SCHEDULES)}")
        if t_total < 1:
            raise ValueError(f"BertAdam t_total = {t_total}; expected at least 1 step")
        defaults = dict(lr=lr, schedule=schedule, warmup=warmup, t_total=t_total, b1=betas[0], b2=betas[1],
                        e=eps, weight_decay=weight_decay)
        super().__init__(params, defaults)

    def _scheduled(self, group: dict, step: int) -> float:
        return group["lr"] * BERT_SCHEDULES[group["schedule"]](step / group["t_total"], group["warmup"])

    def scheduled_lr(self) -> float:
        """The rate of the next step: the first parameter's that has a state (the rate at step 0 before
        any step). Every parameter that gets a gradient at every step shares it."""
        for group in self.param_groups:
            for p in group["params"]:
                if self.state[p]:
                    return self._scheduled(group, self.state[p]["step"])
        return self._scheduled(self.param_groups[0], 0)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                if grad.is_sparse:
                    raise RuntimeError("BertAdam does not support sparse gradients")
                state = self.state[p]
                if len(state) == 0:
                    state["step"] = 0
                    state["next_m"] = torch.zeros_like(p)
                    state["next_v"] = torch.zeros_like(p)
                next_m, next_v = state["next_m"], state["next_v"]
                beta1, beta2 = group["b1"], group["b2"]
                next_m.mul_(beta1).add_(grad, alpha=1 - beta1)
                next_v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                update = next_m / (next_v.sqrt() + group["e"])
                if group["weight_decay"] > 0.0:
                    update += group["weight_decay"] * p
                update_with_lr = self._scheduled(group, state["step"]) * update
                p.add_(-update_with_lr)
                state["step"] += 1
        return loss


def param_groups(model: nn.Module, weight_decay: float, decay_on: str) -> list[dict]:
    """The trainable parameters in decay groups: `all` decays every one (the LXMERT reference passes
    `model.parameters()` to BertAdam); `matrices` decays only those of two or more dimensions (no
    decay on biases and LayerNorm weights, the BERT convention)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if decay_on == "all":
        return [{"params": params, "weight_decay": weight_decay}]
    if decay_on != "matrices":
        raise ValueError(f"decay_on {decay_on!r}; expected 'all' or 'matrices'")
    return [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]


def build_optimizer(name: str, model: nn.Module, *, lr: float, weight_decay: float, betas: tuple[float, float],
                    eps: float, decay_on: str, warmup: float, total_steps: int, schedule: str
                    ) -> torch.optim.Optimizer:
    """`optim.name`'s optimizer over the model's trainable parameters (`warmup`, `total_steps` and
    `schedule` are read by BertAdam only: its schedule is inside it)."""
    groups = param_groups(model, weight_decay, decay_on)
    if name == "bertadam":
        return BertAdam(groups, lr=lr, warmup=warmup, t_total=total_steps, schedule=schedule, betas=betas, eps=eps)
    # Fused: one kernel per group instead of ~10 ops per parameter (torch >= 2.4 has it on CPU too; on
    # the 2-core CPU it saves ~1.5 ms of a 13 ms tiny-LXMERT step), and the for-loop Adam reads every
    # parameter's step count back to the host at every step.
    fused = next(model.parameters()).device.type in ("cuda", "cpu")
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused)
    if name == "adam":
        return torch.optim.Adam(groups, lr=lr, betas=betas, eps=eps, fused=fused)
    raise ValueError(f"optimizer {name!r}; expected 'adamw', 'adam' or 'bertadam'")


def warmup_constant_lambda(optimizer: torch.optim.Optimizer, total_steps: int, warmup_ratio: float):
    """adam / adamw `constant`: the warm-up of `step.linear_warmup_decay`, then the peak rate."""
    warmup = max(1, math.ceil(total_steps * warmup_ratio)) if warmup_ratio > 0 else 0
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: (step + 1) / warmup if step < warmup else 1.0)


def plateau(optimizer: torch.optim.Optimizer, *, mode: str, factor: float, patience: int, threshold: float):
    """torch's ReduceLROnPlateau with the MulT reference's other settings (relative threshold, no
    cooldown, no floor); the runner steps it once per epoch with the watched validation metric."""
    return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, mode=mode, factor=factor, patience=patience,
                                                      threshold=threshold)


def current_lr(optimizer: torch.optim.Optimizer, scheduler=None) -> float:
    """The rate the next step takes: a per-step schedule's, BertAdam's own, else the first group's
    (a constant rate, or one a plateau has set)."""
    if scheduler is not None:
        return scheduler.get_last_lr()[0]
    if isinstance(optimizer, BertAdam):
        return optimizer.scheduled_lr()
    return optimizer.param_groups[0]["lr"]
