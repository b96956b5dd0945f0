"""The session of a one-worker sweep trial run in its own process (`xmodal.runner.session.TrialSession`):
checkpoint folders copied to the run's folder on real (local) storage, Ray Train's retention rule (the
`keep` best by score, and the latest), the registry a restarted attempt reads back, and every report
passed on (to Tune in a sweep; to a list here)."""

from __future__ import annotations

import logging
import threading

import pytest

from xmodal.runner import recovery
from xmodal.runner.session import TrialSession


def folder_with(tmp_path, name: str, text: str):
    d = tmp_path / "work" / name
    d.mkdir(parents=True)
    (d / "model.pt").write_text(text)
    return d


def report_checkpoints(session: TrialSession, tmp_path, scores: list[float | None], first_step: int = 1) -> None:
    for i, score in enumerate(scores):
        step = first_step + i
        metrics = {"step": step, **({"valid/mae": score} if score is not None else {})}
        name = f"{recovery.PREFIX}{step:04d}"
        session.report(metrics, checkpoint=str(folder_with(tmp_path, name, f"weights of step {step}")), name=name)


def on_storage(storage, run: str) -> list[str]:
    return sorted(p.name for p in (storage / run).glob(f"{recovery.PREFIX}*"))


@pytest.mark.parametrize("mode, scores, kept", [
    # keep=2, min: after step 3 (4) the worst, step 1 (5), goes; after step 4 (1), step 3 (4) goes;
    # step 5 (6) is the worst but the latest: kept beside the two best
    ("min", [5.0, 3.0, 4.0, 1.0, 6.0], [2, 4, 5]),
    # max: step 4 (1) stays while it is the latest, and goes with step 3 once step 5 (6) is among the best
    ("max", [5.0, 3.0, 4.0, 1.0, 6.0], [1, 5]),
    ("min", [2.0, None, 1.0], [1, 3]),  # a checkpoint without a score ranks last
])
def test_the_best_checkpoints_by_score_and_the_latest_stay(tmp_path, mode, scores, kept):
    storage, reports = tmp_path / "storage", []
    s = TrialSession(str(storage), "run", reports.append, keep=2, metric="valid/mae", mode=mode)
    report_checkpoints(s, tmp_path, scores)
    assert on_storage(storage, "run") == [f"{recovery.PREFIX}{k:04d}" for k in kept]
    assert [r["step"] for r in reports] == list(range(1, len(scores) + 1))  # every report passed on
    latest = storage / "run" / f"{recovery.PREFIX}{len(scores):04d}"
    assert (latest / "model.pt").read_text() == f"weights of step {len(scores)}"  # copied whole
    assert s.checkpoint().path == str(latest) and s.metrics == reports[-1]


def test_a_restarted_attempt_keeps_applying_the_rule_to_the_earlier_attempts_checkpoints(tmp_path):
    storage = tmp_path / "storage"
    first = TrialSession(str(storage), "run", lambda m: None, keep=2, metric="valid/mae", mode="min")
    report_checkpoints(first, tmp_path, [3.0, 2.0])
    # the worker died; Tune starts the trial again, whose session reads what the first one kept
    again = TrialSession(str(storage), "run", lambda m: None, keep=2, metric="valid/mae", mode="min")
    assert again.checkpoint() is None  # nothing reported by this attempt yet
    report_checkpoints(again, tmp_path / "again", [1.0], first_step=3)
    assert on_storage(storage, "run") == [f"{recovery.PREFIX}0002", f"{recovery.PREFIX}0003"]


def test_a_report_without_a_checkpoint_writes_nothing(tmp_path):
    reports = []
    s = TrialSession(str(tmp_path / "storage"), "run", reports.append, keep=1, metric="valid/mae", mode="min")
    assert s.report({"step": 1, "final": 1}) is None
    assert reports == [{"step": 1, "final": 1}] and not (tmp_path / "storage" / "run").exists()
    assert s.fault_settle_s() == 0.0 and s.rank == 0 and s.world == 1 and s.device().type == "cpu"


def test_a_trial_tune_ends_at_a_report_leaves_no_logger_thread_and_loses_no_metric(tmp_path, stores, monkeypatch):
    """Tune ends a stopped trial's thread with SystemExit inside its report (and reuses the process for
    the next trial): the worker's MLflow logger is closed on the way out, with every metric up to that
    report in MLflow. A real MulT worker in this process, a real SQLite MLflow file, real checkpoints."""
    from xmodal import tracking
    from xmodal.base import console
    from xmodal.config.experiment import load_config
    from xmodal.jobs.mult_config import MultTrainConfig
    from xmodal.jobs.registry import job_spec
    from xmodal.runner import engine
    from xmodal.runner.worker import run_worker

    # what the worker sets for its process (a trial's, here pytest's): put back after the test
    monkeypatch.setattr(console, "_on_worker", False)
    for name in (console.VERBOSE_ENV, "MLFLOW_LOGGING_LEVEL", "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR",
                 "RAY_AIR_NEW_OUTPUT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(logging.getLogger(), "level", logging.getLogger().level)

    spec = job_spec("mult")
    cfg = load_config(MultTrainConfig, overrides=[
        "preset=tiny", "train.batch_size=16", f"data.store={stores['mult']}", "train.max_steps=12",
        "train.eval_every=4", "train.log_every=2", "mlflow.system_metrics=false", "mlflow.run_name=stopped",
        f"mlflow.tracking_uri=sqlite:///{tmp_path / 'mlflow.db'}", f"scale.storage_path={tmp_path / 'runs'}"])
    checked = engine.check(spec, cfg)
    plan = engine.open_run(spec, checked, "test")
    reports = []

    def tune_report(metrics):  # the scheduler stopped the trial on its second result
        reports.append(metrics)
        if len(reports) == 2:
            raise SystemExit(0)

    session = TrialSession(plan.storage, plan.run_name, tune_report, keep=1, metric="valid/mae", mode="min")
    with pytest.raises(SystemExit):
        run_worker(spec, plan, session, data=checked.prepared.data)
    assert [r["step"] for r in reports] == [4, 8]
    assert not [t for t in threading.enumerate() if t.name == "xmodal-mlflow-logger" and t.is_alive()]
    assert [p.step for p in tracking.metric_points(plan.tracking_uri, plan.run_id, "valid/mae")] == [4, 8]
    assert [p.step for p in tracking.metric_points(plan.tracking_uri, plan.run_id, "train/loss")] == [2, 4, 6, 8]
