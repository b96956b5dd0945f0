"""The one place where a model is put on its device, given its precision, compiled, wrapped for
data parallelism, and given its optimizer and schedule (core/optim.py). Imports only torch.

`prepare` reads a few attributes of the job's `train` and `optim` settings; any object with them
will do (the jobs pass their pydantic `TrainConfig` / `OptimConfig`, which this module does not
import: the protocols below name what is read).
"""

from __future__ import annotations

import types
from typing import Protocol

import torch
import torch.distributed as dist
from torch import nn

from xmodal.core.optim import build_optimizer, plateau, warmup_constant_lambda
from xmodal.core.step import TrainState, linear_warmup_decay


def resolve_precision(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype of a `train.precision` setting: 'auto' = bf16 on CUDA, fp32 (None) elsewhere."""
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return None


def _autocast_forward(self: nn.Module, *args, **kwargs):
    device_type, dtype = self._xmodal_autocast
    with torch.autocast(device_type=device_type, dtype=dtype):
        return type(self).forward(self, *args, **kwargs)


def apply_precision(module: nn.Module, dtype: torch.dtype | None) -> nn.Module:
    """The one place where mixed precision is applied: from now on `module`'s forward runs under
    autocast(dtype) on the device its parameters are on, whoever calls it (the train step,
    evaluation, prediction, the benchmarks), and every submodule with a `compute_dtype` attribute
    (MulT, which casts its folded weights once per forward) is told the dtype. None = fp32:
    nothing changes. Call it after the module is on its device and before compile and DDP.

    The forward is replaced on the instance by a bound method (so the state dict is unchanged and a
    deep copy keeps its own), which dynamo traces as one graph with the autocast inside.
    """
    if dtype is None:
        return module
    if hasattr(module, "_xmodal_autocast"):
        raise RuntimeError(f"apply_precision: {type(module).__name__} already has its precision "
                           f"({module._xmodal_autocast[1]})")
    device_type = next(module.parameters()).device.type
    for m in module.modules():
        if hasattr(m, "compute_dtype"):
            m.compute_dtype = dtype
    module._xmodal_autocast = (device_type, dtype)
    module.forward = types.MethodType(_autocast_forward, module)
    return module


def compile_module(module: nn.Module, mode: str | None = None, backend: str = "inductor") -> nn.Module:
    """The compiled model that training runs when `train.compile` is set; the benchmarks compile
    through it too (`mode`: torch.compile's, for the LXMERT benchmark's --compile-mode; `backend`:
    "aot_eager" captures the same graphs without generating code, for the suite's --quick run)."""
    # Static shapes: train batches have one shape (fixed micro-batch, padded sequences), and dynamo
    # fails to trace MulT's checkpointed FFN (recompute_ffn) under dynamic=True.
    return torch.compile(module, dynamic=False, mode=mode, backend=backend)


class TrainSettings(Protocol):
    """What `prepare` reads of the job's train settings (`xmodal.config.experiment.TrainConfig` has it)."""

    @property
    def compile(self) -> bool: ...

    @property
    def precision(self) -> str: ...  # "auto" | "fp32" | "bf16" (resolve_precision)


class PlateauSettings(Protocol):
    """What `prepare` reads of `optim.plateau` (`xmodal.config.experiment.PlateauConfig` has it)."""

    @property
    def mode(self) -> str: ...

    @property
    def factor(self) -> float: ...

    @property
    def patience(self) -> int: ...

    @property
    def threshold(self) -> float: ...


class OptimSettings(Protocol):
    """What `prepare` reads of the job's optimizer settings (`xmodal.config.experiment.OptimConfig` has it)."""

    @property
    def name(self) -> str: ...  # "adamw" | "adam" | "bertadam" (core/optim.py)

    @property
    def schedule(self) -> str: ...  # "linear" | "constant" | "cosine" | "plateau"

    @property
    def decay_on(self) -> str: ...  # "all" | "matrices"

    @property
    def lr(self) -> float: ...

    @property
    def weight_decay(self) -> float: ...

    @property
    def betas(self) -> tuple[float, float]: ...

    @property
    def eps(self) -> float: ...

    @property
    def warmup_ratio(self) -> float: ...

    @property
    def grad_clip(self) -> float: ...  # 0 = off

    @property
    def plateau(self) -> PlateauSettings: ...


def schedules(opt: torch.optim.Optimizer, optim: OptimSettings, total_steps: int):
    """(per-step scheduler, plateau) of `optim.schedule`: BertAdam's schedule is inside it (neither)."""
    if optim.name == "bertadam":
        return None, None
    if optim.schedule == "plateau":
        p = optim.plateau
        return None, plateau(opt, mode=p.mode, factor=p.factor, patience=p.patience, threshold=p.threshold)
    if optim.schedule == "constant":
        return warmup_constant_lambda(opt, total_steps, optim.warmup_ratio), None
    if optim.schedule == "linear":
        return linear_warmup_decay(opt, total_steps, optim.warmup_ratio), None
    raise ValueError(f"schedule {optim.schedule!r} for {optim.name}; expected linear, constant or plateau")


def prepare(objective: nn.Module, device: torch.device, train: TrainSettings, optim: OptimSettings,
            total_steps: int, find_unused_parameters: bool = False) -> TrainState:
    objective = apply_precision(objective.to(device), resolve_precision(train.precision, device))
    # The optimizer holds the plain module's parameters; DDP and compile wrap the same tensors.
    opt = build_optimizer(optim.name, objective, lr=optim.lr, weight_decay=optim.weight_decay, betas=optim.betas,
                          eps=optim.eps, decay_on=optim.decay_on, warmup=optim.warmup_ratio,
                          total_steps=total_steps, schedule=optim.schedule)
    scheduler, on_plateau = schedules(opt, optim, total_steps)
    model: nn.Module = objective
    if train.compile:
        model = compile_module(model)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        model = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None,
            find_unused_parameters=find_unused_parameters)
    return TrainState(model=model, optimizer=opt, scheduler=scheduler, grad_clip=optim.grad_clip, plateau=on_plateau)
