"""The train step every task uses (LXMERT pretraining, fine-tuning, MulT). Imports only torch.

The training loop, `jobs/benchmark.py` and the tests call `train_step`; it is
the only place that does forward, backward and the optimizer step.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn


@dataclass
class TrainState:
    # The objective module (possibly DDP-wrapped or compiled, its precision applied by
    # `runtime.apply_precision`); forward(batch) -> {"loss", ...}.
    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: Any | None = None  # stepped after every optimizer step
    grad_clip: float = 0.0
    step: int = 0
    # A ReduceLROnPlateau (`optim.schedule=plateau`): not stepped here, but once per epoch by the runner,
    # with the validation metric it watches (runner/hooks.py: `epoch_ended`).
    plateau: Any | None = None


def linear_warmup_decay(optimizer: torch.optim.Optimizer, total_steps: int, warmup_ratio: float):
    """Linear warm-up to the peak lr, then linear decay to 0 (BERT / reference schedule)."""
    warmup = max(1, math.ceil(total_steps * warmup_ratio)) if warmup_ratio > 0 else 0

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def adamw(model: nn.Module, lr: float, weight_decay: float, betas=(0.9, 0.999), eps: float = 1e-6,
          fused: bool | None = None) -> torch.optim.AdamW:
    """AdamW without weight decay on biases and LayerNorm weights (BERT convention)."""
    from xmodal.core.optim import param_groups

    if fused is None:
        fused = next(model.parameters()).device.type in ("cuda", "cpu")
    return torch.optim.AdamW(param_groups(model, weight_decay, "matrices"), lr=lr, betas=betas, eps=eps, fused=fused)


def train_step(state: TrainState, micro_batches: Sequence[Any], **forward_kwargs) -> dict[str, Tensor]:
    """Forward, loss, backward over the micro-batches (gradient accumulation), clip, optimizer step.

    Returns the detached mean of each loss entry (tensors: no host sync here).
    """
    model = state.model
    model.train()
    n = len(micro_batches)
    sums: dict[str, Tensor] = {}
    for i, batch in enumerate(micro_batches):
        # Under DDP only the last micro-batch all-reduces the gradients.
        sync = contextlib.nullcontext() if i == n - 1 or not hasattr(model, "no_sync") else model.no_sync()
        with sync:
            out = model(batch, **forward_kwargs)  # precision: the module's own (runtime.apply_precision)
            loss = out["loss"] / n
            loss.backward()
        for k, v in out.items():
            if k == "loss" or k.startswith("loss/"):  # float32 at least (a float64 run keeps its own)
                sums[k] = sums.get(k, 0) + (v.detach() if v.dtype == torch.float64 else v.detach().float()) / n
    if state.grad_clip > 0:
        sums["grad_norm"] = torch.nn.utils.clip_grad_norm_(model.parameters(), state.grad_clip).detach()
    state.optimizer.step()
    if state.scheduler is not None:
        state.scheduler.step()
    state.optimizer.zero_grad(set_to_none=True)
    state.step += 1
    return sums
