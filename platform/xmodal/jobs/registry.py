"""Job name -> job spec: the one table the command lines and the sweep look jobs up in."""

from __future__ import annotations

from xmodal.config.experiment import ConfigError
from xmodal.jobs.chain_job import ChainJob
from xmodal.jobs.finetune_job import FinetuneJob
from xmodal.jobs.mult_job import MultJob
from xmodal.jobs.pretrain_job import PretrainJob
from xmodal.runner.spec import JobSpec

JOBS: dict[str, type[JobSpec]] = {
    "pretrain": PretrainJob,
    "finetune": FinetuneJob,
    "mult": MultJob,
    "pretrain_finetune": ChainJob,
}


def job_spec(name: str) -> JobSpec:
    if name not in JOBS:
        raise ConfigError(f"job {name!r} is unknown; valid jobs: {', '.join(JOBS)}")
    return JOBS[name]()
