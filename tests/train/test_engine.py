"""The engine's driver-side pieces that need no Ray: the fault schedule (a testing aid)."""

from __future__ import annotations

import pytest

from xmodal.config import ConfigError, PretrainConfig, load_config
from xmodal.train.engine import fault_schedule


def train_of(*overrides: str):
    return load_config(PretrainConfig, overrides=list(overrides)).train


def test_listed_steps_fail_rank_1_or_the_only_worker():
    train = train_of("train.fail_at_step=[7,3]")
    assert fault_schedule(train, 2, 20, "/runs", "a") == [(3, 1), (7, 1)]
    assert fault_schedule(train, 1, 20, "/runs", "a") == [(3, 0), (7, 0)]
    assert fault_schedule(train_of("train.fail_at_step=5"), 4, 20, "/runs", "a") == [(5, 1)]
    assert fault_schedule(train_of(), 2, 20, "/runs", "a") == []


def test_random_faults_are_distinct_seeded_by_run_name_and_never_on_listed_steps():
    train = train_of("train.fail_at_step=3", "train.random_faults=4", "train.fault_seed=1")
    a = fault_schedule(train, 2, 10, "/runs", "trial-a")
    assert len(a) == 5 and len({s for s, _ in a}) == 5  # one fault per step
    assert all(1 <= s < 10 and r in (0, 1) for s, r in a)
    assert a == fault_schedule(train, 2, 10, "/runs", "trial-a")  # a rerun (resume) keeps its schedule
    others = {tuple(fault_schedule(train, 2, 10, "/runs", f"trial-{i}")) for i in range(8)}
    assert len(others) > 1  # trials of one sweep are hit at different steps
    every_step = fault_schedule(train_of("train.random_faults=9"), 1, 10, "/runs", "x")
    assert [s for s, _ in every_step] == list(range(1, 10))


def test_schedules_that_cannot_run_are_errors_naming_the_key():
    with pytest.raises(ConfigError, match=r"train.random_faults = 10: expected at most 9 .*10 steps"):
        fault_schedule(train_of("train.random_faults=10"), 1, 10, "/runs", "x")
    with pytest.raises(ConfigError, match=r"train.fail_at_step = \[12\]: expected steps below the run's 10 steps"):
        fault_schedule(train_of("train.fail_at_step=[2,12]"), 1, 10, "/runs", "x")
    with pytest.raises(ConfigError, match="local scale.storage_path.*'s3://bucket/runs'"):
        fault_schedule(train_of("train.fail_at_step=2"), 1, 10, "s3://bucket/runs", "x")
    with pytest.raises(ConfigError, match=r"train.fail_at_step.0 = 0: expected an integer >= 1"):
        train_of("train.fail_at_step=0")
