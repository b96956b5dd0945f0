"""The training jobs a sweep can run, looked up by the name a space file gives (`job:`).

Every job module offers `prepare_run(cfg, source, parent_run_id, extra_tags) -> (plan, store)`,
`build_trainer(plan, store, callbacks) -> TorchTrainer` and `finish_run(plan, checkpoint)`; its
config class lives in `xmodal.config`. Imported lazily: a job that has not landed yet is a clear
error naming it, not an ImportError at startup. The training jobs never import the sweep layer.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType

from xmodal.sweep.space import SpaceError


@dataclass(frozen=True)
class Job:
    name: str
    module: str  # prepare_run / build_trainer / finish_run (and resolve_store when it has a data store)
    config_class: str  # in xmodal.config


JOBS: dict[str, Job] = {
    "pretrain": Job("pretrain", "xmodal.train.pretrain", "PretrainConfig"),
    "mult": Job("mult", "xmodal.train.mult", "MultTrainConfig"),
    "pretrain_finetune": Job("pretrain_finetune", "xmodal.train.pretrain_finetune", "PretrainFinetuneConfig"),
}


def get_job(name: str) -> Job:
    if name not in JOBS:
        raise SpaceError(f"job {name!r} is unknown; valid jobs: {', '.join(JOBS)}")
    return JOBS[name]


def config_class(name: str) -> type:
    job = get_job(name)
    import xmodal.config

    cls = getattr(xmodal.config, job.config_class, None)
    if cls is None:
        raise SpaceError(f"job {name!r} is not available in this version: xmodal.config has no "
                         f"{job.config_class}")
    return cls


def job_module(name: str) -> ModuleType:
    job = get_job(name)
    try:
        module = importlib.import_module(job.module)
    except ModuleNotFoundError as e:
        if e.name and job.module.startswith(e.name):
            raise SpaceError(f"job {name!r} is not available in this version: no module {job.module}") from None
        raise
    missing = [f for f in ("prepare_run", "build_trainer", "finish_run") if not hasattr(module, f)]
    if missing:
        raise SpaceError(f"job {name!r}: {job.module} lacks {', '.join(missing)}")
    return module


def check_with_store(name: str, module: ModuleType, cfg, store) -> None:
    """The job's own config-vs-store check, `with_store_dims(cfg, store)` (model dims, metric names the
    store's task measures; raises ConfigError), called once in the driver so that a bad metric fails
    before any trial starts. Jobs without a data store have none."""
    check = getattr(module, "with_store_dims", None)
    if check is not None:
        check(cfg, store)
