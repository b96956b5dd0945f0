"""MulT training on Ray Train. With no arguments: the embedded default (local Ray, synthetic
unaligned store built on first use, the reference code's model and optimiser, MLflow in ./mlflow.db).

    python jobs/train_mult.py [--config FILE.yaml] [--set key=value ...] [--store DIR] [--seeds 1111,1112,1113]
        [--num-workers N] [--gpus-per-worker G] [--storage-path PATH] [--experiment NAME] [--run-name NAME]

Model selection on the validation split; the test split is evaluated once, at the end, with the
selected model. With --seeds, one run per seed and each metric's mean and std on a parent run.
"""

import argparse
import sys

from xmodal.config import ConfigError, MultTrainConfig, load_config
from xmodal.train.mult import run_mult

# flag -> dotted config key
FLAGS = {
    "store": "data.store", "num_workers": "scale.num_workers", "gpus_per_worker": "scale.gpus_per_worker",
    "storage_path": "scale.storage_path", "experiment": "mlflow.experiment", "run_name": "mlflow.run_name",
    "seed": "train.seed",
}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML config file (sections: preset, model, regression_loss, data, optim, "
                                    "train, scale, mlflow, seeds)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="dotted override")
    p.add_argument("--seeds", help="comma-separated seeds, e.g. 1111,1112,1113")
    for flag in FLAGS:
        p.add_argument("--" + flag.replace("_", "-"))
    args = p.parse_args(argv)
    overrides = [f"{key}={getattr(args, flag)}" for flag, key in FLAGS.items() if getattr(args, flag)]
    if args.seeds:
        overrides.append(f"seeds=[{args.seeds}]")
    try:
        cfg = load_config(MultTrainConfig, args.config, overrides + args.set)
        run_mult(cfg, source=args.config or "defaults")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
