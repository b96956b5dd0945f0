"""Where a job's worker reports to, and where its run's folder is: the one thing that differs between a
worker run by Ray Train and the one worker of a sweep trial run in the trial's own process.

    RayTrainSession  every command-line run, and sweep trials of several workers: `ray.train.report`,
                     Ray Train's storage context and device, its checkpoint registry (`CheckpointConfig`)
    TrialSession     a one-worker sweep trial, in its Tune trial process (no Ray Train controller,
                     worker actor or placement group: `docs/performance.md`, "Sweep overhead"): each
                     checkpoint folder copied to the run's folder on storage, the best `keep` of them
                     kept (Ray Train's rule: the `keep` best by score, and the latest), every report
                     passed to Tune

Either way a run resumes from what is on storage (`xmodal.runner.recovery`), not from a registry.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from xmodal.runner import recovery
from xmodal.runner.recovery import PREFIX


def ray_train_poll_s() -> float:
    """How often Ray Train V2's controller polls its workers (its own setting, read where it reads it)."""
    return float(os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "2.0"))


class RayTrainSession:
    """A Ray Train worker's: its rank, device and storage are Ray Train's; reports go to its controller."""

    @property
    def rank(self) -> int:
        import ray.train

        return ray.train.get_context().get_world_rank()

    @property
    def world(self) -> int:
        import ray.train

        return ray.train.get_context().get_world_size()

    @staticmethod
    def device() -> torch.device:
        import ray.train.torch

        return ray.train.torch.get_device()

    @staticmethod
    def folder() -> tuple[Any, str]:
        """(pyarrow file system, path) of the run's folder on storage."""
        import ray.train

        storage = ray.train.get_context().get_storage()
        return storage.storage_filesystem, storage.experiment_fs_path

    @staticmethod
    def checkpoint_name() -> str:
        import ray.train

        return ray.train.get_context().get_storage().make_default_checkpoint_dir_name()

    @staticmethod
    def report(metrics: dict[str, Any], checkpoint: str | None = None, name: str | None = None) -> str | None:
        """Report `metrics`, with the checkpoint folder `checkpoint` (rank 0) copied to storage as `name`;
        returns the checkpoint's path on storage."""
        import ray.train

        if checkpoint is None:
            ray.train.report(metrics)
            return None
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(checkpoint), checkpoint_dir_name=name)
        return ray.train.get_checkpoint().path

    @staticmethod
    def fault_settle_s() -> float:
        """Ray Train collects reports when it polls the workers: a worker that dies sooner after a
        checkpoint loses it, and the run resumes from the one before. An injected fault waits out two polls."""
        return 2 * ray_train_poll_s() + 1


@dataclass
class Kept:
    name: str  # the checkpoint's folder in the run's folder
    score: float | None  # its `train.best_metric`


class TrialSession:
    """The one worker of a sweep trial, in the trial's process. `report(metrics)` is Tune's; `keep`,
    `metric`, `mode`: which checkpoints stay (`train.keep_best`, `train.best_metric`, `train.best_mode`);
    `gpus`: the worker's (`scale.gpus_per_worker`), which Tune gave the trial."""

    REGISTRY = "checkpoints.json"  # the checkpoints this session kept, with their scores (read back on resume)
    rank, world = 0, 1

    def __init__(self, storage: str, run_name: str, report: Callable[[dict[str, Any]], None], keep: int,
                 metric: str, mode: str, gpus: float = 0.0):
        self.fs, self.path = recovery.run_folder(storage, run_name)
        self.tune_report, self.keep, self.metric, self.mode, self.gpus = report, keep, metric, mode, gpus
        self.kept: list[Kept] = self._read_registry()
        self.metrics: dict[str, Any] = {}  # the last report's
        self.latest: str | None = None  # the last checkpoint's path on storage

    def device(self) -> torch.device:
        return torch.device("cuda", 0) if self.gpus > 0 else torch.device("cpu")  # Ray set CUDA_VISIBLE_DEVICES

    def folder(self) -> tuple[Any, str]:
        return self.fs, self.path

    @staticmethod
    def checkpoint_name() -> str:
        return f"{PREFIX}{datetime.datetime.now():%Y-%m-%d_%H-%M-%S.%f}"  # Ray Train's form

    def report(self, metrics: dict[str, Any], checkpoint: str | None = None, name: str | None = None) -> str | None:
        """The checkpoint folder (if any) copied to the run's folder and retention applied, then the
        metrics to Tune (which may stop the trial there)."""
        import pyarrow.fs

        path = None
        if checkpoint is not None:
            path = f"{self.path}/{name}"
            self.fs.create_dir(path)
            pyarrow.fs.copy_files(checkpoint, path, source_filesystem=pyarrow.fs.LocalFileSystem(),
                                  destination_filesystem=self.fs)
            score = metrics.get(self.metric)
            self.kept.append(Kept(name, float(score) if score is not None else None))
            self.latest = path
            self._retain()
        self.metrics = dict(metrics)
        self.tune_report(metrics)
        return path

    @staticmethod
    def fault_settle_s() -> float:
        return 0.0  # reports are synchronous here: a checkpoint reported is on storage

    def checkpoint(self):
        """The last checkpoint, as Ray Train's result would hold it (None before the first)."""
        from ray.train import Checkpoint

        return Checkpoint(path=self.latest, filesystem=self.fs) if self.latest is not None else None

    def _retain(self) -> None:
        """Ray Train's rule: the `keep` best by score stay, and the latest; the others are deleted."""
        best = sorted(self.kept, key=_rank_key(self.mode))[: self.keep]
        for k in [k for k in self.kept[:-1] if k not in best]:
            self.fs.delete_dir(f"{self.path}/{k.name}")
            self.kept.remove(k)
        with self.fs.open_output_stream(f"{self.path}/{self.REGISTRY}") as f:
            f.write(json.dumps([vars(k) for k in self.kept]).encode())

    def _read_registry(self) -> list[Kept]:
        """The checkpoints a previous attempt kept that are still there (a fault mid-copy leaves a
        partial folder: not listed, never deleted here, skipped by the resume's verification)."""
        try:
            with self.fs.open_input_stream(f"{self.path}/{self.REGISTRY}") as f:
                return [Kept(**k) for k in json.loads(f.read())]
        except (OSError, ValueError, TypeError):  # none yet, or unreadable: nothing to go on
            return []


def _rank_key(mode: str) -> Callable[[Kept], tuple]:
    """Best first; a checkpoint without a score last."""
    def key(k: Kept) -> tuple:
        if k.score is None or k.score != k.score:
            return (1, 0.0)
        return (0, -k.score if mode == "max" else k.score)
    return key

