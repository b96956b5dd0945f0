"""What a Train worker does besides the step: no host reads in the steady state. On a GPU every read
of a device tensor (`.item()`, `float()`, `.tolist()`, `bool()`) waits for the queue to drain; the
loop and its hooks read the losses once per log step. Counted here on the CPU, for a job of each kind,
over 20 steps of the job's own loop, hooks and objective."""

from __future__ import annotations

import collections
import functools
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from xmodal.config import FinetuneConfig, MultTrainConfig, PretrainConfig, load_config
from xmodal.train import engine
from xmodal.train.hooks import RunHooks
from xmodal.train.loop import fit

pytestmark = pytest.mark.usefixtures("one_thread")

READS = ("item", "__float__", "__int__", "__bool__", "__index__", "tolist")


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    from xmodal.data.finetune.synthetic import build_synthetic_vqa
    from xmodal.data.lxmert.synthetic import build_synthetic_store
    from xmodal.data.mult.synthetic import SyntheticMultOptions
    from xmodal.data.mult.synthetic import build_synthetic_store as build_mult
    from xmodal.data.options import SyntheticLxmertOptions

    root = tmp_path_factory.mktemp("stores")
    images = build_synthetic_store(root / "lxmert", SyntheticLxmertOptions(
        num_images=160, feat_dim=16, num_objects=8, num_object_labels=10, num_attr_labels=4, num_answers=20))
    return {"pretrain": images.path, "mult": build_mult(root / "mult", SyntheticMultOptions(num_samples=240)).path,
            "finetune": build_synthetic_vqa(images.path, root / "vqa", questions_per_image=2).path}


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
    from xmodal.train.specs import job_spec

    spec = job_spec(job)
    config = {"pretrain": PretrainConfig, "mult": MultTrainConfig, "finetune": FinetuneConfig}[job]
    cfg = load_config(config, overrides=["preset=tiny", "train.batch_size=16", "train.log_every=10",
                                         "train.eval_every=1000", f"data.store={stores[job]}"])
    data = spec.resolve_data(cfg)
    start, pretrained = spec.resolve_start(cfg, data, "", Path("."))
    cfg = spec.fit_to_data(cfg, data, pretrained)
    w = engine.make_worker(spec, cfg, data, start, torch.device("cpu"), 20, engine.split_batch(cfg))
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
