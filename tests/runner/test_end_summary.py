"""The end-of-run summary a job prints."""

from __future__ import annotations

from xmodal import tracking
from xmodal.base.console import end_summary


def test_summary_puts_each_metric_beside_its_best_and_its_baseline():
    metrics = {"eval/match_acc": 0.8512, "eval/qa_acc": 0.49, "eval/feat_mse": 1.1, "eval/loss": 7.0,
               "eval/loss/mlm": 1.5, "step": 2696, "epoch": 8, "final": 1}
    history = {"eval/match_acc": [(500, 0.7), (2696, 0.8512)], "eval/feat_mse": [(500, 1.0), (2696, 1.1)],
               "eval/loss": [(500, 8.0), (2696, 7.0)]}
    text = end_summary(run_name="pretrain-small-1", wall_s=189.0, metrics=metrics, history=history,
                       baselines={"eval/match_acc": [0.5, "chance"], "eval/qa_acc": [0.363, "text-only prior"]},
                       order=["eval/qa_acc", "eval/match_acc"], checkpoint=None, run_id="abc123",
                       view=tracking.ui_command("sqlite:////tmp/x/mlflow.db"))
    lines = text.splitlines()
    assert lines[0] == "[xmodal] finished run pretrain-small-1 in 3:09 (2696 steps)"
    row = {line.split()[0]: line.split()[1:] for line in lines[2:]}
    # the job's order, other metrics by name, the total loss last; per-task losses and counters left out
    assert list(row)[:4] == ["eval/qa_acc", "eval/match_acc", "eval/feat_mse", "eval/loss"]
    assert row["eval/match_acc"] == ["0.8512", "0.8512", "(2696)", "0.5000", "(chance)"]
    assert row["eval/qa_acc"] == ["0.4900", "-", "0.3630", "(text-only", "prior)"]  # never seen evaluated
    assert row["eval/feat_mse"] == ["1.1000", "1.0000", "(500)", "-"]  # lower is better
    assert row["eval/loss"] == ["7.0000", "7.0000", "(2696)", "-"]
    assert row["MLflow"] == ["run", "abc123"]
    assert row["view"] == ["it", "mlflow", "ui", "--backend-store-uri", "sqlite:////tmp/x/mlflow.db"]
