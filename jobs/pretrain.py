"""LXMERT pretraining on Ray Train. With no arguments: the embedded default (local Ray, synthetic
store built on first use, `small` preset, MLflow in ./mlflow.db).

    python jobs/pretrain.py [--config FILE.yaml] [--set key=value ...] [--store DIR] [--num-workers N]
        [--gpus-per-worker G] [--storage-path PATH] [--experiment NAME] [--run-name NAME] [--seed S]

Rerun with the same --run-name to resume a run whose driver died.
"""

import sys

from xmodal.cli import job_main
from xmodal.config import PretrainConfig
from xmodal.train.pretrain import run_pretraining


def main(argv: list[str]) -> int:
    return job_main(argv, doc=__doc__, config_class=PretrainConfig, run=run_pretraining,
                    sections="preset, model, tasks, schedule, data, optim, train, scale, mlflow")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
