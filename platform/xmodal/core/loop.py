"""One training loop for every task. Imports only torch.

`fit` drives `train_step` over epochs; everything task- or platform-specific
(logging, evaluation, checkpoints, fault injection) happens in `hooks`.
Works in one process or under torch.distributed (DDP): every worker takes the steps the driver
planned for each epoch (its smallest share), so workers never have to agree, batch by batch, on who
still has one: the steady state has no host sync (losses stay on the device until a log step).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from xmodal.core.checkpoint import unwrap
from xmodal.core.step import TrainState, train_step


class Hooks(Protocol):
    # True: stop the run after this step (a requested stop, already checkpointed); `at_end` is not called
    def after_step(self, state: TrainState, epoch: int, pos: int, losses: dict[str, torch.Tensor]) -> bool | None: ...
    def at_end(self, state: TrainState, epoch: int, pos: int) -> None: ...


class NoHooks:
    """Hooks of an in-process run (tests, benchmarks): no logging, evaluation or checkpoints."""

    def after_step(self, state: TrainState, epoch: int, pos: int, losses: dict[str, torch.Tensor]) -> None:
        pass

    def at_end(self, state: TrainState, epoch: int, pos: int) -> None:
        pass


def fit(
    state: TrainState,
    data: Callable[[int, int], Iterable[Any]],  # (epoch, micro-batches to skip) -> micro-batches
    hooks: Hooks,
    *,
    epoch_steps: Sequence[int],  # optimizer steps of each epoch, the same on every worker
    grad_accum: int = 1,
    start: tuple[int, int] = (0, 0),  # (epoch, optimizer steps already done in it), from a checkpoint
    step_kwargs: Callable[[int], dict[str, Any]] = lambda epoch: {},
    seed: tuple[int, int] | None = None,  # (run seed, rank): each step's dropout masks
) -> None:
    epoch, pos = start
    while epoch < len(epoch_steps):
        micro = iter(data(epoch, pos * grad_accum)) if pos < epoch_steps[epoch] else iter(())
        while pos < epoch_steps[epoch]:
            group = list(itertools.islice(micro, grad_accum))
            if len(group) < grad_accum:
                # The driver counted every worker's share (job.epoch_plan): a worker short of
                # batches would leave the others waiting in a collective, so it stops the run.
                raise RuntimeError(f"epoch {epoch}: this worker's train batches ran out after {pos} of the "
                                   f"{epoch_steps[epoch]} steps planned for the epoch")
            if seed is not None:
                torch.manual_seed(step_seed(*seed, state.step))
            losses = train_step(state, group, **step_kwargs(epoch))
            pos += 1
            if hooks.after_step(state, epoch, pos, losses):
                return
        epoch, pos = epoch + 1, 0
    hooks.at_end(state, epoch, pos)


def ends_epoch(epoch_steps: Sequence[int], epoch: int, pos: int) -> bool:
    """Whether the step that left the loop at (epoch, pos) was the epoch's last."""
    return epoch < len(epoch_steps) and pos == epoch_steps[epoch]


def epoch_ended(state: TrainState, metrics: dict[str, float], metric: str) -> None:
    """The plateau schedule's step, once per epoch, with the validation `metric` of the epoch's end
    (the MulT reference's `scheduler.step(val_loss)`); nothing without one."""
    if state.plateau is None:
        return
    if metric not in metrics:
        raise RuntimeError(f"the plateau schedule watches {metric!r}, which the evaluation did not report "
                           f"(it reported {', '.join(sorted(metrics))})")
    state.plateau.step(metrics[metric])


def step_seed(seed: int, rank: int, step: int) -> int:
    """The torch seed of one optimizer step on one worker: every worker draws its own dropout masks
    (the same initial weights come from the run seed alone), and a resumed run draws the masks the
    uninterrupted one drew, whatever generator state the checkpoint holds."""
    return (seed * 1_000_003 + rank * 7_919 + step) % (2**63 - 1)


def device_of(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def all_reduce_sums(sums: dict[str, torch.Tensor | float], device: torch.device) -> dict[str, float]:
    """Sum a dict of scalars (floats or 0-d tensors, left on their device) over all workers (keys must
    match on every worker); one host read in all."""
    keys = sorted(sums)
    if not keys:
        return {}
    vec = torch.stack([torch.as_tensor(sums[k], device=device).to(torch.float64) for k in keys])
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(vec)
    return dict(zip(keys, vec.tolist(), strict=True))


@torch.no_grad()
def evaluate_sums(model: torch.nn.Module, batches: Iterable[Any], to_device: Callable[[Any], Any],
                  max_batches: int | None = None,
                  **forward_kwargs) -> dict[str, float]:
    """Run the objective with metrics over this worker's `batches`; return sums reduced over workers.

    Metric entries come as "<name>/correct" and "<name>/count"; losses are weighted by batch size.
    Workers may hold different numbers of batches: the plain module runs (no DDP collectives in the
    forward), and the only collective is the final all-reduce.
    """
    module = unwrap(model)
    device = device_of(module)
    module.eval()
    sums: dict[str, float] = {}
    n = 0
    for batch in itertools.islice(batches, max_batches):
        batch = to_device(batch)
        out = module(batch, with_metrics=True, **forward_kwargs)
        size = len(batch)
        for k, v in out.items():
            weight = size if (k == "loss" or k.startswith("loss/")) else 1
            sums[k] = sums.get(k, 0.0) + float(v) * weight
        n += size
    sums["samples"] = float(n)
    keys = sorted(sums)
    # Every worker must all-reduce the same keys: a worker without batches contributes zeros.
    gathered = [None] * (dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1)
    if len(gathered) > 1:
        dist.all_gather_object(gathered, keys)
        keys = sorted(set().union(*gathered))
    total = all_reduce_sums({k: sums.get(k, 0.0) for k in keys}, device)
    if total["samples"] == 0:
        raise RuntimeError("evaluation saw no samples: the evaluation split yields no batch on any worker")
    return total


def ratios(sums: dict[str, float], prefix: str = "eval/") -> dict[str, float]:
    """{"x/correct", "x/count", "loss/y", "samples"} sums -> {"eval/x": correct/count, "eval/loss/y": mean}."""
    out: dict[str, float] = {}
    n = max(sums.get("samples", 0.0), 1.0)
    for k, v in sums.items():
        if k.endswith("/correct"):
            name = k[: -len("/correct")]
            out[prefix + name] = v / max(sums.get(name + "/count", 0.0), 1.0)
        elif k == "loss" or k.startswith("loss/"):
            out[prefix + k] = v / n
    return out


class Throughput:
    """Samples/s over the last logging window and an ETA from the steps left."""

    def __init__(self, start_step: int, total_steps: int):
        self.total = total_steps
        self.t0, self.s0, self.samples = None, start_step, 0

    def add(self, samples: int) -> None:
        if self.t0 is None:  # the clock starts at the first step, not during pipeline warm-up
            self.t0, self.s0 = time.perf_counter(), self.s0 + 1
            return
        self.samples += samples

    def read(self, step: int) -> tuple[float, float]:
        now = time.perf_counter()
        dt = max(now - (self.t0 or now), 1e-9)
        rate, steps_per_s = self.samples / dt, (step - self.s0) / dt
        eta = (self.total - step) / steps_per_s if steps_per_s > 0 else float("inf")
        self.t0, self.s0, self.samples = now, step, 0
        return rate, eta


def gather_rows(index: torch.Tensor, columns: dict[str, torch.Tensor], sums: dict[str, float]
                ) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, float]]:
    """Every worker's evaluated rows, gathered on every worker and put in the order of `index` (the
    same whatever the number of workers): (index, columns, sums added over workers). Tensors on CPU."""
    mine = (index.cpu(), {k: v.cpu() for k, v in columns.items()}, dict(sums))
    parts = [mine]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        parts = [None] * dist.get_world_size()
        dist.all_gather_object(parts, mine)
    idx = torch.cat([p[0] for p in parts])
    order = torch.argsort(idx)
    cols = {k: torch.cat([p[1][k] for p in parts])[order] for k in columns}
    total = {k: sum(p[2].get(k, 0.0) for p in parts) for k in sums}
    return idx[order], cols, total
