"""The end-of-run summary a job prints."""

from __future__ import annotations

from xmodal.train.hooks import summary_table


def test_summary_puts_each_metric_beside_its_baseline():
    metrics = {"eval/match_acc": 0.8512, "eval/qa_acc": 0.49, "eval/feat_mse": 1.1, "eval/loss": 7.0,
               "eval/loss/mlm": 1.5, "step": 2696, "epoch": 8, "final": 1}
    text = summary_table(metrics, {"eval/match_acc": [0.5, "chance"], "eval/qa_acc": [0.363, "text-only prior"]})
    lines = text.splitlines()
    assert lines[0] == "[xmodal] final evaluation (step 2696):"
    row = {line.split()[0]: line for line in lines[2:]}
    assert set(row) == {"eval/match_acc", "eval/qa_acc", "eval/feat_mse"}  # losses and counters left out
    assert row["eval/match_acc"].split()[1:] == ["0.851", "0.500", "(chance)"]
    assert row["eval/qa_acc"].split()[1:] == ["0.490", "0.363", "(text-only", "prior)"]
    assert row["eval/feat_mse"].split()[1:] == ["1.100", "-"]
