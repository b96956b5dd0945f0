"""Fault injection, a testing aid: the schedule the driver draws and the firing on the workers.

`train.fail_at_step` and `train.random_faults` (with `train.fault_seed`) make workers exit at
chosen steps, to test what a run survives. The driver draws the (step, rank) pairs once
(`fault_schedule`, in `RunPlan.faults`) and checks them against the run's steps before Ray starts;
each worker's `RunHooks` asks its `Injector` at every step. Each fault fires once: it leaves a marker
in the run's `.faults` folder, because a resumed run replays the steps since its checkpoint.
"""

from __future__ import annotations

import json
import os
import random
import time
from pathlib import Path

from xmodal.base.console import say
from xmodal.config.experiment import ConfigError


def check_fault_storage(train, storage: str) -> None:
    """Faults need a local storage path: each leaves a marker there so that it fires once."""
    if (train.fail_at_step or train.random_faults) and "://" in storage:
        raise ConfigError(f"train.fail_at_step / train.random_faults need a local scale.storage_path (each fault "
                          f"leaves a marker there so that it fires once); got {storage!r}")


def fault_schedule(train, workers: int, total_steps: int, storage: str, run_name: str) -> list[tuple[int, int]]:
    """The testing aid's (step, rank) pairs: each listed step on rank 1 (rank 0 with one worker), and
    `train.random_faults` more distinct steps and ranks drawn from `train.fault_seed` and the run name
    (trials of one sweep get different schedules, a rerun of a run the same one)."""
    listed = sorted(set(train.fail_at_step or []))
    if not listed and not train.random_faults:
        return []
    check_fault_storage(train, storage)
    late = [s for s in listed if s >= total_steps]
    if late:
        raise ConfigError(f"train.fail_at_step = {late}: expected steps below the run's {total_steps} steps")
    free = [s for s in range(1, total_steps) if s not in listed]
    if train.random_faults > len(free):
        raise ConfigError(f"train.random_faults = {train.random_faults}: expected at most {len(free)} (the run has "
                          f"{total_steps} steps, {len(listed)} of them in train.fail_at_step)")
    rng = random.Random(f"{train.fault_seed}:{run_name}")
    drawn = sorted(rng.sample(free, train.random_faults))
    return sorted([(s, min(1, workers - 1)) for s in listed]
                  + [(s, rng.randrange(workers)) for s in drawn])


class Injector:
    """One worker's share of the schedule: `faults` the plan's (step, rank) pairs, `fault_dir` where
    each fired fault leaves its marker; `settle_s` how long a worker waits before it exits, so that its
    last checkpoint is registered (`xmodal.runner.session`: a session's `fault_settle_s`)."""

    def __init__(self, faults, fault_dir: str | None, rank: int, settle_s: float = 0.0):
        self.faults = {tuple(f) for f in faults}
        self.fault_dir, self.rank, self.settle_s = fault_dir, rank, settle_s

    def at_step(self, step: int) -> None:
        """At a scheduled (step, rank) this worker exits, once (a marker file records it: a resumed run
        replays the steps since its checkpoint)."""
        if (step, self.rank) not in self.faults:
            return
        marker = Path(self.fault_dir) / f"step{step}-rank{self.rank}"
        if marker.exists():
            return
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(json.dumps({"step": step, "rank": self.rank, "time": time.time()}))
        say(f"[xmodal] fault injection: worker {self.rank} exits at step {step}")
        time.sleep(self.settle_s)
        os._exit(1)
