"""The shared loop, step and checkpoints, with the tiny LXMERT on random batches (no Ray)."""

import dataclasses

import pytest
import torch

from xmodal.config.experiment import OptimConfig, TrainConfig
from xmodal.core import checkpoint as ckpt
from xmodal.core.batches import LxmertBatch
from xmodal.core.loop import evaluate_sums, fit, ratios
from xmodal.core.runtime import prepare
from xmodal.core.step import linear_warmup_decay
from xmodal.models.lxmert.model import LxmertForPretraining, preset
from xmodal.objectives.pretraining import PretrainingObjective, PretrainTasks

C = preset("tiny")


def batches(n, seed=0, size=8):
    g = torch.Generator().manual_seed(seed)
    return [LxmertBatch.random(size, vocab_size=C.vocab_size, visual_feat_dim=C.visual_feat_dim,
                               num_object_labels=C.num_object_labels, num_attr_labels=C.num_attr_labels,
                               num_qa_labels=C.num_qa_labels, num_objects=6, seq_len=10, generator=g)
            .to("cpu", torch.float32) for _ in range(n)]


def make_state(total_steps=20, seed=0, config=C):
    torch.manual_seed(seed)
    obj = PretrainingObjective(LxmertForPretraining(config), PretrainTasks())
    return prepare(obj, torch.device("cpu"), TrainConfig(), OptimConfig(lr=1e-3), total_steps)


class Recorder:
    def __init__(self):
        self.steps, self.positions, self.ended = [], [], None

    def after_step(self, state, epoch, pos, losses):
        self.steps.append((epoch, state.step, float(losses["loss"])))
        self.positions.append(pos)

    def at_end(self, state, epoch, pos):
        self.ended = (epoch, state.step)


def test_fit_runs_epochs_with_accumulation_and_drops_partial_groups():
    data = batches(5)
    state, rec = make_state(), Recorder()
    fit(state, lambda epoch, skip: data[skip:], rec, epoch_steps=[2, 2], grad_accum=2)
    # 5 micro-batches per epoch with accumulation 2: two steps per epoch, the 5th micro-batch unused.
    assert [s for _, s, _ in rec.steps] == [1, 2, 3, 4]
    assert [e for e, _, _ in rec.steps] == [0, 0, 1, 1]
    assert rec.ended == (2, 4)


def test_fit_takes_the_planned_steps_and_resumes_from_a_position():
    data = batches(6)
    state, rec = make_state(), Recorder()
    fit(state, lambda epoch, skip: data[skip:], rec, epoch_steps=[6, 6, 4], start=(1, 4))
    # Resumed in epoch 1 after 4 steps: 2 steps left there, then 6 in epoch 2 until step 8.
    assert [(e, s) for e, s, _ in rec.steps][:3] == [(1, 1), (1, 2), (2, 3)]
    assert rec.ended == (3, 6)


def test_a_worker_short_of_its_planned_batches_stops_the_run():
    data = batches(3)
    with pytest.raises(RuntimeError, match="epoch 1: this worker's train batches ran out after 3 of the 4 steps"):
        fit(make_state(), lambda epoch, skip: data[skip:], Recorder(), epoch_steps=[3, 4])


def test_checkpoint_round_trip_restores_training_exactly(tmp_path):
    data = batches(4, seed=1)
    a = make_state()
    fit(a, lambda e, s: data[s:2], Recorder(), epoch_steps=[2])
    ckpt.save(tmp_path / "c", a, {"epoch": 0, "pos": 2})
    b = make_state(seed=123)  # different init: everything must come from the checkpoint
    meta = ckpt.restore(tmp_path / "c", b)
    assert meta["pos"] == 2 and b.step == 2
    assert b.scheduler.get_last_lr() == a.scheduler.get_last_lr()
    ra, rb = Recorder(), Recorder()
    fit(a, lambda e, s: data[2:], ra, epoch_steps=[2])
    fit(b, lambda e, s: data[2:], rb, epoch_steps=[2])
    assert [x[2] for x in ra.steps] == [x[2] for x in rb.steps]


def test_each_worker_draws_its_own_dropout_and_a_resumed_run_draws_the_same(tmp_path):
    data = batches(4, seed=2)
    dropping = dataclasses.replace(C, dropout=0.1, attention_dropout=0.1)

    def run(rank, state=None, skip=0):
        state, rec = state or make_state(config=dropping), Recorder()  # the same weights on every worker
        fit(state, lambda e, s: data[skip:][s:], rec, epoch_steps=[4 - skip], seed=(0, rank))
        return [x[2] for x in rec.steps]

    whole = run(0)
    assert whole[0] != run(1)[0]  # the same weights and batch, other dropout masks
    head = make_state(config=dropping)
    fit(head, lambda e, s: data[:2], Recorder(), epoch_steps=[2], seed=(0, 0))
    ckpt.save(tmp_path / "c", head, {"epoch": 0, "pos": 2})
    resumed = make_state(seed=7, config=dropping)
    ckpt.restore(tmp_path / "c", resumed)
    torch.manual_seed(12345)  # any generator state: the step's seed decides its masks
    assert run(0, resumed, skip=2) == whole[2:]


def test_evaluate_reports_task_metrics():
    state = make_state()
    sums = evaluate_sums(state.model, batches(2), lambda b: b)
    m = ratios(sums)
    for key in ("eval/loss", "eval/mlm_acc", "eval/obj_acc", "eval/attr_acc", "eval/match_acc", "eval/feat_mse"):
        assert key in m
    assert 0.0 <= m["eval/match_acc"] <= 1.0
    assert sums["samples"] == 16


def test_warmup_then_linear_decay():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    sched = linear_warmup_decay(opt, total_steps=10, warmup_ratio=0.2)
    lrs = []
    for _ in range(10):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs[:3] == [0.5, 1.0, 1.0] and lrs[-1] == 0.125 and all(a >= b for a, b in zip(lrs[1:], lrs[2:], strict=False))


def test_prepare_reads_plain_settings_objects():
    """runtime.prepare does not need xmodal.config.experiment: any object with the attributes it reads will do."""
    from types import SimpleNamespace

    train = SimpleNamespace(compile=False, precision="auto")
    optim = SimpleNamespace(name="adam", schedule="linear", decay_on="all", lr=0.5, weight_decay=0.0,
                            betas=(0.9, 0.99), eps=1e-8, warmup_ratio=0.0, grad_clip=2.0, plateau=None)
    state = prepare(torch.nn.Linear(3, 1), torch.device("cpu"), train, optim, total_steps=4)
    assert isinstance(state.optimizer, torch.optim.Adam) and state.optimizer.param_groups[0]["betas"] == (0.9, 0.99)
    assert state.grad_clip == 2.0
    assert not hasattr(state.model, "_xmodal_autocast")  # "auto" on a CPU is fp32: no autocast
