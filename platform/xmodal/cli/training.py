"""The training jobs' shared command line (`jobs/pretrain.py`, `jobs/finetune.py`, `jobs/train_mult.py`):
--config, --set and the flag shortcuts, run by the engine with the example pages at the end."""

from __future__ import annotations

import argparse
import json
import shlex

from xmodal.base.commands import add_verbose, setup_console, user_errors

# flag -> dotted config key: the options every training job takes (docs/configuration.md)
JOB_FLAGS: dict[str, tuple[str, str]] = {
    "store": ("data.store", "feature store: a directory or s3://... (default: the embedded synthetic store)"),
    "num_workers": ("scale.num_workers", "Ray Train workers"),
    "gpus_per_worker": ("scale.gpus_per_worker", "GPUs per worker (0 = CPU)"),
    "storage_path": ("scale.storage_path", "checkpoints: a local path, s3://... or a shared mount"),
    "experiment": ("mlflow.experiment", "MLflow experiment"),
    "run_name": ("mlflow.run_name", "MLflow and Ray Train run name; rerun with it to resume"),
    "register": ("mlflow.registered_model", "register the run's final model in the MLflow Model Registry under this name"),
    "seed": ("train.seed", "random seed"),
    "recipe": ("recipe", "train as a paper's reference code does (its values and their files: below)"),
}


# The flags whose value is text whatever it looks like (quoted into their --set override).
TEXT_FLAGS = ("store", "storage_path", "experiment", "run_name", "register", "init_run_id", "init_path")


def recipes_help(job: str) -> str:
    """`--help`'s list of the job's recipes, each value with the file it comes from."""
    from xmodal.config.recipes import describe

    return ("Recipes (--recipe NAME): the training of a paper's code; the model stays the preset's. A key set "
            "beside a recipe wins, and the run's banner and MLflow params say so.\n\n" + describe(job))


def shown(arg: str) -> str:
    """A command-line argument as the user would type it again (quoted where the shell needs it), on one line."""
    return shlex.quote(arg) if arg.isprintable() else repr(arg)


def end_of_run_pages(plan, folder, data) -> bool:
    """A training run's example pages, logged into it before it ends (`engine.AfterRun`):
    `examples.end_of_run_pages`, imported only when a run ends (it loads torch and Pillow)."""
    from xmodal.examples import end_of_run_pages as pages

    return pages(plan, folder, data)


def job_main(argv: list[str], *, job: str, doc: str | None,
             extra: dict[str, tuple[str, str, str]] | None = None) -> int:
    """The shared command line of the training jobs: --config, --set and the JOB_FLAGS shortcuts
    (plus `extra`: flag -> (dotted key, value template, help)), validated into the job's config
    class and run by the engine. Bad input is reported as one clear line and exit code 2."""
    from xmodal.config.experiment import check_each_key_once, load_config
    from xmodal.jobs.registry import job_spec
    from xmodal.runner.engine import run_job

    spec = job_spec(job)
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=recipes_help(job))
    p.add_argument("--config", help=f"YAML config file (top-level keys: {', '.join(spec.config_class.model_fields)})")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="dotted override")
    add_verbose(p)
    flags = {flag: (key, "{}", help_text) for flag, (key, help_text) in JOB_FLAGS.items()}
    flags.update(extra or {})
    for flag, (key, _, help_text) in flags.items():
        p.add_argument("--" + flag.replace("_", "-"), help=f"{help_text} (= --set {key}=...)")
    args = p.parse_args(argv)
    setup_console(args.verbose)
    # A flag's value is read as YAML like a --set value (--num-workers 2 is the integer 2), except a flag
    # of text (a name, a path, a run id), taken as written: --run-name 2024 is the name '2024'.
    given = [(f"--{flag.replace('_', '-')} {shown(value)}",
              f"{key}={json.dumps(value) if flag in TEXT_FLAGS else template.format(value)}")
             for flag, (key, template, _) in flags.items() if (value := getattr(args, flag)) is not None]
    given += [(f"--set {shown(item)}", item) for item in args.set]

    def go() -> None:
        # The flags and --set are one layer over --config (and a recipe): a key set twice in it is refused,
        # not left to the last one.
        check_each_key_once(given)
        cfg = load_config(spec.config_class, args.config, [item for _, item in given])
        run_job(spec, cfg, source=args.config or "defaults", after_run=end_of_run_pages)

    return user_errors(go)
