"""Robustness at the final evaluation (`robust.*`): the jobs' own held-out evaluation on a worker in
this process, on the tiny stores (no Ray, no MLflow). That the metrics reach a real run is checked in
test_mult_job.py and test_finetune_job.py; that zeroing a modality the model needs costs it the
label, in test_mult_learning.py."""

from __future__ import annotations

import math

import pytest

from xmodal_testing import tiny_worker

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = [("mult", "mult", []), ("finetune", "finetune", ["init.source=scratch"]),
         ("finetune", "nlvr2", ["task=nlvr2", "init.source=scratch"])]


def clean_metrics(job, spec, w) -> dict[str, float]:
    """The clean figures the robust ones compare with: the test split (MulT), the validation split
    (fine-tuning), by metric name."""
    if job == "mult":
        from xmodal.jobs.mult_job import evaluate_split

        return {k.removeprefix("test/"): v for k, v in evaluate_split(w, "test").items()}
    return {k.removeprefix("valid/"): v for k, v in spec.evaluate(w).items()}


@pytest.mark.parametrize("job, store, overrides", CASES, ids=["mult", "vqa", "nlvr2"])
def test_the_final_evaluation_logs_every_condition_and_the_per_step_one_none(job, store, overrides, stores):
    spec, cfg, w = tiny_worker(job, stores[store], *overrides)
    final = spec.held_out(w, None)
    clean = clean_metrics(job, spec, w)
    want = {f"robust/{c}/{m}" for c in cfg.robust.conditions for m in clean}
    assert len(cfg.robust.conditions) == (6 if job == "mult" else 2)  # on by default
    assert want == {k for k in final if k.startswith("robust/")}
    assert all(math.isfinite(final[k]) for k in want if not k.endswith("/corr")), final
    assert not [k for k in spec.evaluate(w) if k.startswith("robust/")]  # per-step evaluation: no extra cost


@pytest.mark.parametrize("job, store, overrides", CASES, ids=["mult", "vqa", "nlvr2"])
def test_negligible_noise_scores_every_row_once_as_the_clean_evaluation(job, store, overrides, stores):
    """Noise at 1e-6 of the features' std: the same rows, the same figures as the clean evaluation."""
    noised = ["robust.conditions=[noise_audio]"] if job == "mult" else ["robust.conditions=[feat_noise]"]
    spec, cfg, w = tiny_worker(job, stores[store], *overrides, *noised, "robust.noise_sigma=1e-6")
    final = spec.held_out(w, None)
    condition = cfg.robust.conditions[0]
    for name, value in clean_metrics(job, spec, w).items():
        assert final[f"robust/{condition}/{name}"] == pytest.approx(value, rel=1e-4, abs=1e-4), name


def test_no_conditions_no_robust_metrics(stores):
    spec, cfg, w = tiny_worker("mult", stores["mult"], "robust.conditions=[]")
    final = spec.held_out(w, None)
    assert "test/mae" in final and not [k for k in final if k.startswith("robust/")]
