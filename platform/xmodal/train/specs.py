"""Job name -> job spec: the one table the command lines and the sweep look jobs up in."""

from __future__ import annotations

from xmodal.config import ConfigError
from xmodal.train.chain import ChainJob
from xmodal.train.finetune import FinetuneJob
from xmodal.train.job import JobSpec
from xmodal.train.mult import MultJob
from xmodal.train.pretrain import PretrainJob

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
