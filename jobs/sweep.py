"""Ablation sweep: Ray Tune + Optuna over a search-space file; one MLflow parent run, one child per trial.

    python jobs/sweep.py SPACE.yaml [--set key=value ...] [--resume] [--name NAME] [--max-concurrent N]
        [--gpus-per-trial F] [--num-samples N] [--storage-path PATH] [--no-report] [--verbose]

--set overrides the trials' base config (dotted keys, as in jobs/pretrain.py). With a shipped space
and no other arguments it runs on the embedded default (local Ray, synthetic store, ./mlflow.db).
--resume continues the latest sweep of this space (or --name NAME) after its driver died: finished
trials are kept, unfinished ones continue from their checkpoints.
"""

import argparse
import sys

from xmodal.base.commands import add_verbose, setup_console, user_errors
from xmodal.sweep import sweep
from xmodal.sweep.plan import SweepOptions


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("space", help="search-space YAML, e.g. search_spaces/lxmert_layers.yaml")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="dotted override of the trials' base config")
    p.add_argument("--resume", action="store_true", help="continue the latest sweep of this space (or --name)")
    p.add_argument("--name", help="sweep name (Tune experiment and MLflow parent run); default SPACE-TIMESTAMP")
    p.add_argument("--max-concurrent", type=int, help="trials running at once")
    p.add_argument("--gpus-per-trial", type=float, help="GPUs per trial, fractions allowed (split over workers)")
    p.add_argument("--num-samples", type=int, help="number of trials")
    p.add_argument("--storage-path", help="where Tune and the trials' Train runs store state (default ./runs/sweeps)")
    p.add_argument("--no-report", action="store_true", help="skip the report at the end")
    p.add_argument("--register", metavar="NAME",
                   help="register the best trial's model in the MLflow Model Registry as NAME, alias `best`")
    add_verbose(p)
    args = p.parse_args(argv)
    setup_console(args.verbose)
    opts = SweepOptions(space=args.space, sets=args.set, resume=args.resume, name=args.name,
                        num_samples=args.num_samples, max_concurrent=args.max_concurrent,
                        gpus_per_trial=args.gpus_per_trial, storage_path=args.storage_path,
                        report=not args.no_report, register=args.register)

    def go() -> int:
        result = sweep(opts)
        ok = result["best"] is not None and not result["errors"] and not result["unfinished"] \
            and (opts.register is None or result.get("registered") is not None)
        return 0 if ok else 1

    return user_errors(go)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
