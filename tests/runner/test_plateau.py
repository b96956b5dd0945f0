"""The plateau schedule in a job's worker (in-process, as the learning tests run the jobs): it evaluates at
every epoch's end whatever `train.eval_every`, and the rate drops by the watched validation metric."""

from __future__ import annotations

import pytest

from xmodal.config.experiment import load_config
from xmodal.core.optim import current_lr
from xmodal.data.mult.synthetic import SyntheticMultOptions, build_synthetic_store
from xmodal.jobs.mult_config import MultTrainConfig
from xmodal.jobs.mult_job import MultJob
from xmodal.runner.inprocess import run_in_process
from xmodal.runner.spec import PrepareContext, epoch_plan, split_batch


def test_the_plateau_evaluates_each_epoch_end_and_drops_the_rate(tmp_path, one_thread):
    store = build_synthetic_store(tmp_path / "store", SyntheticMultOptions(num_samples=120))
    # eval_every far beyond the run: only the epochs' ends evaluate; no patience, and a better loss only
    # at half the best, so the second epoch's end drops the rate and the third's drops it again
    cfg = load_config(MultTrainConfig, overrides=[
        f"data.store={store.path}", "preset=tiny", "train.epochs=3", "train.batch_size=16", "train.eval_every=1000",
        "optim.schedule=plateau", "optim.lr=0.01", "optim.plateau.patience=0", "optim.plateau.threshold=0.5",
        "optim.plateau.factor=0.5", "robust.conditions=[]"])
    epochs = epoch_plan(MultJob().prepare(cfg, PrepareContext("", tmp_path, store)), split_batch(cfg), workers=1)
    history: list = []
    w, final = run_in_process(MultJob(), cfg, store, history)
    ends = [sum(epochs[:i + 1]) for i in range(len(epochs))]
    assert [step for step, _ in history] == ends
    assert current_lr(w.state.optimizer) == pytest.approx(0.01 * 0.5 ** 2)
    best = min(m["valid/mae"] for _, m in history)
    assert final["best_valid/mae"] == pytest.approx(best)  # the epochs' evaluations select the model too
