"""What a run costs, measured on the worker: parameters, GFLOP per sample (counted), training
throughput, peak memory, wall time and device-hours. Imports only torch and the standard library.

Every job logs these as `cost/*` metrics (docs/sweeps.md, "Sweeps ... and reports"):

    cost/params            trainable and frozen parameters of the objective
    cost/gflop_per_sample  one training forward + backward of the first micro-batch, counted by
                           torch.utils.flop_counter.FlopCounterMode, divided by its samples
                           (the optimizer step is not counted)
    cost/samples_per_s     samples of the whole worker group per second of training steps (data
                           waits included; evaluation, checkpoints, logging and the first step excluded)
    cost/peak_mem_gib      rank 0: torch.cuda.max_memory_allocated on a GPU, else the worker
                           process's peak resident set size (the runtime and data buffers included)
    cost/wall_s            the worker group's wall time, from worker start to end, summed over the
                           attempts of a run that resumed from checkpoints (up to each one's last checkpoint)
    cost/device_hours      wall_s x workers x devices per worker / 3600: GPU-hours on GPUs, else
                           CPU-hours of the cores Ray reserved (scale.cpus_per_worker)
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

GIB = 2**30


def count_flops(model: nn.Module, batch: Any, **forward_kwargs) -> int:
    """FLOPs of one training forward + backward of `model` on `batch` (eager, the module's own
    precision); the gradients are dropped afterwards, so the next optimizer step is unaffected."""
    from torch.utils.flop_counter import FlopCounterMode

    was_training = model.training
    model.train()
    try:
        with FlopCounterMode(display=False) as counter:
            model(batch, **forward_kwargs)["loss"].backward()
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    return counter.get_total_flops()


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory so far: CUDA's max_memory_allocated on a GPU, else this process's peak RSS."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return rss * (1 if sys.platform == "darwin" else 1024) / GIB


class CostMeter:
    """The cost figures of one worker's attempt at a run (see the module's docstring)."""

    def __init__(self, model: nn.Module, device: torch.device, world: int, devices_per_worker: float,
                 batch_size: int, wall_before_s: float = 0.0, started: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.model, self.device, self.world = model, device, world
        self.devices_per_worker, self.batch_size = devices_per_worker, batch_size
        self.params = sum(p.numel() for p in model.parameters())
        self.gflop_per_sample: float | None = None
        self.count_s = 0.0  # what counting the FLOPs took
        self.clock = clock
        self.started = clock() if started is None else started
        self.wall_before_s = wall_before_s
        self.train_s, self.samples = 0.0, 0
        self._hooks_done: float | None = None  # when the hooks of the previous step returned

    def count(self, batch: Any, **forward_kwargs) -> None:
        """Count the FLOPs on one micro-batch (once: later calls do nothing)."""
        if self.gflop_per_sample is not None:
            return
        t0 = time.perf_counter()
        self.gflop_per_sample = count_flops(self.model, batch, **forward_kwargs) / max(len(batch), 1) / 1e9
        if self.device.type == "cuda":  # the count's activations are not training's
            torch.cuda.reset_peak_memory_stats(self.device)
        self.count_s = time.perf_counter() - t0

    def counting(self, batches: Iterable[Any], **forward_kwargs) -> Iterator[Any]:
        """`batches` unchanged, the FLOPs counted on the first one before it is handed on."""
        for batch in batches:
            self.count(batch, **forward_kwargs)
            yield batch

    def step_start(self) -> None:
        """Called when a step's hooks start: the time since the previous step's hooks returned was
        training (the first step of an attempt, with its start-up, is left out)."""
        if self._hooks_done is not None:
            self.train_s += self.clock() - self._hooks_done
            self.samples += self.batch_size

    def step_end(self) -> None:
        self._hooks_done = self.clock()

    def wall_s(self) -> float:
        return self.wall_before_s + self.clock() - self.started

    def metrics(self) -> dict[str, float]:
        wall = self.wall_s()
        out = {"cost/params": float(self.params), "cost/peak_mem_gib": peak_memory_gib(self.device),
               "cost/wall_s": wall, "cost/device_hours": wall * self.world * self.devices_per_worker / 3600}
        if self.gflop_per_sample is not None:
            out["cost/gflop_per_sample"] = self.gflop_per_sample
        if self.samples and self.train_s > 0:
            out["cost/samples_per_s"] = self.samples / self.train_s
        return out
