"""MulT training on Ray Train. With no arguments: the embedded default (local Ray, synthetic
unaligned store built on first use, the `small` preset with the reference code's optimiser at lr 3e-3,
792 steps, MLflow in ./mlflow.db); `--set preset=reference --set optim.lr=1e-3` for the reference model.

    python jobs/train_mult.py [--config FILE.yaml] [--set key=value ...] [--store DIR] [--seeds 1111,1112,1113]
        [--num-workers N] [--gpus-per-worker G] [--storage-path PATH] [--experiment NAME] [--run-name NAME]

Model selection on the validation split; the test split is evaluated once, at the end, with the
selected model. With --seeds, one run per seed and each metric's mean and std on a parent run.
"""

import sys

from xmodal.cli.training import job_main


def main(argv: list[str]) -> int:
    return job_main(argv, job="mult", doc=__doc__,
                    extra={"seeds": ("seeds", "[{}]", "comma-separated seeds, e.g. 1111,1112,1113")})


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
