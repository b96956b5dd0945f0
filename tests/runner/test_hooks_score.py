"""The run's selected score (`xmodal.base.scores.selected_key`): every report a worker's hooks make to Ray
Train carries the best `train.best_metric` so far, the score of the checkpoint the run keeps. Run in
Ray Train's local mode (no workers: the training function runs in this process, and the trainer's
result holds the function's last report)."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest

from xmodal.base.scores import selected_key
from xmodal.config.experiment import TrainConfig
from xmodal.runner.hooks import RunHooks

KEY = selected_key("eval/acc")


def last_report(evaluations: list[float], mode: str, end: str) -> dict:
    """The last report of a run on a non-zero rank (no MLflow, no checkpoint files) whose evaluations
    at steps 2, 4, ... score `evaluations`, then ends by `end`: "final" (the end of training, with an
    `on_end` like a selecting job's), "stop" (stopped at the step after the last evaluation) or
    "eval" (the last evaluation's report)."""
    import torch
    from ray.train import ScalingConfig
    from ray.train.torch import TorchTrainer

    def train_fn():
        plan = SimpleNamespace(total_steps=100, faults=[], fault_dir=None, run_id="-", tracking_uri="-")
        scores = iter(evaluations)
        hooks = RunHooks(plan, TrainConfig(best_metric="eval/acc", best_mode=mode), False, rank=1, world=2,
                         device=torch.device("cpu"), evaluate=lambda: {"eval/acc": next(scores), "eval/loss": 1.0},
                         meta={}, on_end=lambda _state: {"test/acc": 0.25})
        state = SimpleNamespace(step=0)
        for _ in evaluations:
            state.step += 2
            hooks._eval_and_checkpoint(state, 0, state.step, finished=False)
        if end == "final":
            hooks.at_end(state, 0, state.step)
        elif end == "stop":
            state.step += 1
            hooks._stop_here(state, 0, state.step)

    return TorchTrainer(train_fn, scaling_config=ScalingConfig(num_workers=0)).fit().metrics


@pytest.mark.parametrize("evaluations, mode, selected", [
    ([0.5], "max", 0.5),
    ([0.5, 0.8, 0.6], "max", 0.8),  # the kept checkpoint's score, not the last evaluation's
    ([0.5, 0.8, 0.6], "min", 0.5),
    ([float("nan"), 0.3], "max", 0.3),  # a NaN evaluation is beaten by any number (scores.better)
])
def test_every_report_carries_the_best_evaluation_so_far(evaluations, mode, selected):
    report = last_report(evaluations, mode, "eval")
    assert report[KEY] == selected and report["eval/acc"] == evaluations[-1]
    final = last_report(evaluations, mode, "final")
    assert final[KEY] == selected and final["final"] == 1 and final["test/acc"] == 0.25


def test_a_stopped_run_keeps_its_selected_score():
    """The stop report has no evaluation: its own metric is the worst finite value (Ray Train ranks that
    checkpoint last), the run's selected score is unchanged; before any evaluation it is the worst too."""
    stopped = last_report([0.5, 0.8, 0.6], "max", "stop")
    assert stopped["stopped"] == 1 and stopped["step"] == 7
    assert stopped["eval/acc"] == -sys.float_info.max and stopped[KEY] == 0.8
    early = last_report([], "min", "stop")
    assert early["eval/acc"] == sys.float_info.max and early[KEY] == sys.float_info.max
