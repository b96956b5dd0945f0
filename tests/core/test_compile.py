"""Compile-clean objectives: the whole training forward of each job (the pretraining objective with
all five tasks, VQA and NLVR2 fine-tuning, the MulT training module) is one graph with no break, so
`torch.compile` (`train.compile`, `runtime.compile_module`) traces it whole and nothing in it waits
for the host. Checked with `torch._dynamo.explain` on the tiny presets (CPU; no code is generated),
in fp32 and with bf16 applied as training applies it (`runtime.apply_precision`: the autocast is
inside the traced forward)."""

from __future__ import annotations

import pytest
import torch

from xmodal_testing import tiny_worker

pytestmark = pytest.mark.usefixtures("one_thread")


def breaks(objective, batch, **kwargs) -> tuple[int, int, list[str]]:
    torch._dynamo.reset()
    ex = torch._dynamo.explain(objective)(batch, **kwargs)
    return ex.graph_count, ex.graph_break_count, [str(r.reason).splitlines()[0] for r in ex.break_reasons]


@pytest.mark.parametrize("job,overrides", [
    ("pretrain", []),
    ("pretrain", ["tasks.label_objects=all", "tasks.feat_loss=l2"]),
    ("mult", []),
    ("finetune", []),
    ("finetune", ["task=nlvr2"]),
    ("pretrain", ["train.precision=bf16"]),
    ("mult", ["train.precision=bf16"]),
], ids=["pretrain", "pretrain-all-objects", "mult", "vqa", "nlvr2", "pretrain-bf16", "mult-bf16"])
def test_the_training_forward_is_one_graph(job, overrides, stores):
    spec, cfg, w = tiny_worker(job, stores["nlvr2" if "task=nlvr2" in overrides else job], *overrides)
    if job == "pretrain":
        assert set(cfg.tasks.enabled()) == {"mlm", "obj_feat", "obj_label", "matching", "qa"}
    batch = next(iter(spec.train_batches(w, 0, 0)))
    w.model.train()
    graphs, n, reasons = breaks(w.model, batch, **spec.step_kwargs(cfg)(0))
    assert (graphs, n) == (1, 0), reasons
    graphs, n, reasons = breaks(w.model, batch, with_metrics=True)  # evaluation's forward too
    assert (graphs, n) == (1, 0), reasons
