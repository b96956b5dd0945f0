"""Where a run's time goes (`xmodal.runner.timeline`): marks -> `time/*` phases, the worker's marks
through a file on storage, a sweep trial's overhead and the sweep's summary of it."""

from __future__ import annotations

import json

import pyarrow.fs
import pytest

from xmodal.runner import timeline

MARKS = {"run_start": 100.0, "fit_call": 101.0, "worker_start": 117.0, "loop_start": 120.0, "first_batch": 124.0,
         "fit_end": 154.0, "fit_return": 156.0, "finished": 157.5}


def test_phases_are_the_gaps_between_marks_and_the_overhead_is_all_but_training():
    p = timeline.phases(MARKS)
    assert p == {"time/prepare_s": 1.0, "time/train_start_s": 16.0, "time/worker_setup_s": 3.0,
                 "time/data_start_s": 4.0, "time/training_s": 30.0, "time/train_end_s": 2.0,
                 "time/finish_s": 1.5, "time/overhead_s": 27.5, "time/overhead_ratio": 27.5 / 30.0}


def test_phases_of_a_run_without_the_workers_marks_leave_out_what_they_span():
    driver = {k: v for k, v in MARKS.items() if k not in timeline.WORKER_MARKS}
    assert timeline.phases(driver) == {"time/prepare_s": 1.0, "time/finish_s": 1.5}


def test_a_mark_is_taken_once_and_an_unknown_one_names_the_valid_ones():
    marks: dict[str, float] = {}
    timeline.mark(marks, "first_batch")
    first = marks["first_batch"]
    timeline.mark(marks, "first_batch")
    assert marks == {"first_batch": first}
    with pytest.raises(KeyError, match="unknown timeline mark 'first_step'; valid: run_start, fit_call"):
        timeline.mark(marks, "first_step")


def test_the_workers_marks_round_trip_through_the_run_folder(tmp_path):
    fs = pyarrow.fs.LocalFileSystem()
    assert timeline.read_worker_marks(fs, str(tmp_path)) == {}  # none written: no figures, no error
    timeline.write_worker_marks(fs, str(tmp_path), MARKS)
    worker = {k: MARKS[k] for k in timeline.WORKER_MARKS}
    assert json.loads((tmp_path / timeline.FILE).read_text()) == worker
    assert timeline.read_worker_marks(fs, str(tmp_path)) == worker
    (tmp_path / timeline.FILE).write_text("{not json")
    assert timeline.read_worker_marks(fs, str(tmp_path)) == {}


def test_marks_an_earlier_run_left_are_not_this_fits():
    worker = {k: MARKS[k] for k in timeline.WORKER_MARKS}
    assert timeline.within(worker, 101.0, 156.0) == worker
    assert timeline.within(worker, 200.0, 260.0) == {}  # a rerun of a finished run: the old file


def test_a_trials_overhead_is_its_life_minus_its_training():
    assert timeline.trial_overhead(40.0, {"time/training_s": 30.0}) == {
        timeline.TRIAL_LIFE: 40.0, timeline.TRIAL_OVERHEAD: 10.0, "sweep/trial_overhead_ratio": 10.0 / 30.0}
    assert timeline.trial_overhead(40.0, {"cost/wall_s": 35.0}) == {}  # stopped early: no training time


def test_the_sweep_summary_averages_the_timed_trials_and_says_where_the_time_went():
    a = {**timeline.phases(MARKS), **timeline.trial_overhead(60.0, {"time/training_s": 30.0})}
    b = {"time/training_s": 10.0, "time/overhead_s": 5.0, "time/train_start_s": 4.0,
         **timeline.trial_overhead(20.0, {"time/training_s": 10.0})}
    s = timeline.sweep_summary([a, b, {"cost/wall_s": 3.0}])  # the third was stopped early
    assert s["sweep/timed_trials"] == 2
    assert s["sweep/trial_life_s_mean"] == 40.0 and s["sweep/training_s_mean"] == 20.0
    assert s["sweep/trial_overhead_s_mean"] == 20.0 and s["sweep/trial_overhead_ratio"] == 1.0
    assert s["sweep/train_start_s_mean"] == 10.0 and s["sweep/prepare_s_mean"] == 1.0
    assert s["sweep/tune_s_mean"] == pytest.approx(((30.0 - 27.5) + (10.0 - 5.0)) / 2)
    line = timeline.summary_line(s)
    assert line.startswith("trials took 40.0 s each on average, 20.0 s of it training: 20.0 s outside training "
                           "(100 % of training); ")
    assert "train start 10.0 s" in line and "tune 3.8 s" in line
    assert timeline.sweep_summary([{"cost/wall_s": 3.0}]) == {}
