"""LXMERT pretraining on Ray Train. With no arguments: the embedded default (local Ray, synthetic
store built on first use, `small` preset, MLflow in ./mlflow.db).

    python jobs/pretrain.py [--config FILE.yaml] [--set key=value ...] [--store DIR] [--num-workers N]
        [--gpus-per-worker G] [--storage-path PATH] [--experiment NAME] [--run-name NAME] [--seed S] [--verbose]

Rerun with the same --run-name to resume a run whose driver died.
"""

import sys

from xmodal.cli.training import job_main


def main(argv: list[str]) -> int:
    return job_main(argv, job="pretrain", doc=__doc__)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
