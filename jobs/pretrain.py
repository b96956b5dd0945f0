"""LXMERT pretraining on Ray Train. With no arguments: the embedded default (local Ray, synthetic
store built on first use, `small` preset, MLflow in ./mlflow.db).

    python jobs/pretrain.py [--config FILE.yaml] [--set key=value ...] [--store DIR] [--num-workers N]
        [--gpus-per-worker G] [--storage-path PATH] [--experiment NAME] [--run-name NAME] [--seed S]

Rerun with the same --run-name to resume a run whose driver died.
"""

import argparse
import sys

from xmodal.config import ConfigError, PretrainConfig, load_config
from xmodal.train.pretrain import run_pretraining

# flag -> dotted config key
FLAGS = {
    "store": "data.store", "num_workers": "scale.num_workers", "gpus_per_worker": "scale.gpus_per_worker",
    "storage_path": "scale.storage_path", "experiment": "mlflow.experiment", "run_name": "mlflow.run_name",
    "seed": "train.seed",
}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="YAML config file (sections: preset, model, tasks, schedule, data, "
                                    "optim, train, scale, mlflow)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="dotted override")
    for flag in FLAGS:
        p.add_argument("--" + flag.replace("_", "-"))
    args = p.parse_args(argv)
    overrides = [f"{key}={getattr(args, flag)}" for flag, key in FLAGS.items() if getattr(args, flag)]
    try:
        cfg = load_config(PretrainConfig, args.config, overrides + args.set)
        run_pretraining(cfg, source=args.config or "defaults")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
