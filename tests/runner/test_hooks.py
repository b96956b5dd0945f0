"""What a Train worker does besides the step: no host reads in the steady state. On a GPU every read
of a device tensor (`.item()`, `float()`, `.tolist()`, `bool()`) waits for the queue to drain; the
loop and its hooks read the losses once per log step. Counted here on the CPU, for a job of each kind,
over 20 steps of the job's own loop, hooks and objective."""

from __future__ import annotations

import collections
import functools
from types import SimpleNamespace

import pytest
import torch

from xmodal.core.loop import fit
from xmodal.runner.hooks import RunHooks
from xmodal_testing import tiny_worker

pytestmark = pytest.mark.usefixtures("one_thread")

READS = ("item", "__float__", "__int__", "__bool__", "__index__", "tolist")


class Counter:
    """Counts the host reads of tensors while active (Tensor methods patched, then restored)."""

    def __init__(self):
        self.calls: collections.Counter[str] = collections.Counter()

    def __enter__(self):
        self.saved = {name: getattr(torch.Tensor, name) for name in READS}
        for name, method in self.saved.items():
            setattr(torch.Tensor, name, self._counting(name, method))
        return self

    def _counting(self, name, method):
        @functools.wraps(method)
        def counted(tensor, *args, **kwargs):
            self.calls[name] += 1
            return method(tensor, *args, **kwargs)
        return counted

    def __exit__(self, *exc):
        for name, method in self.saved.items():
            setattr(torch.Tensor, name, method)


class LogPoints(RunHooks):
    """RunHooks on a rank that does not write to MLflow (no logger), recording host reads per step."""

    def __init__(self, counter: Counter, train, total: int):
        plan = SimpleNamespace(total_steps=total, faults=[], fault_dir=None, run_id="-", tracking_uri="-")
        super().__init__(plan, train, False, rank=1, world=2, device=torch.device("cpu"),
                         evaluate=dict, meta={})
        self.counter, self.reads, self.seen = counter, [], 0

    def after_step(self, state, epoch, pos, losses) -> None:
        """Reads since the previous step ended: this step's forward, backward, optimizer and hooks."""
        super().after_step(state, epoch, pos, losses)
        total = sum(self.counter.calls.values())
        self.reads.append(total - self.seen)
        self.seen = total

    def at_end(self, state, epoch, pos) -> None:
        pass  # the end evaluates and checkpoints through Ray Train: not the steady state


@pytest.mark.parametrize("job", ["pretrain", "mult", "finetune"])
def test_the_steady_state_reads_the_device_once_per_log_step(job, stores):
    spec, cfg, w = tiny_worker(job, stores[job], "train.log_every=10", "train.eval_every=1000")
    every = (b for epoch in range(8) for b in spec.train_batches(w, epoch, 0))  # small stores: several epochs
    batches = list(zip(range(20), every, strict=False))
    assert len(batches) == 20
    with Counter() as counter:
        hooks = LogPoints(counter, cfg.train, 20)
        fit(w.state, lambda epoch, skip: (b for _, b in batches[skip:]), hooks, epoch_steps=[20],
            step_kwargs=spec.step_kwargs(cfg))
    between = [n for step, n in enumerate(hooks.reads, 1) if step % 10]
    at_logs = [n for step, n in enumerate(hooks.reads, 1) if step % 10 == 0]
    assert between == [0] * 18, f"host reads between log steps: {hooks.reads} ({dict(counter.calls)})"
    assert at_logs == [1, 1], f"one read of all the losses per log step: {hooks.reads} ({dict(counter.calls)})"
