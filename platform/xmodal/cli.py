"""Subcommand dispatch shared by the job scripts."""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading
from collections.abc import Callable

from xmodal.errors import RunInterrupted, UserError


def add_verbose(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verbose", action="store_true",
                   help="also show Ray's and MLflow's own output (Ray Data progress bars, report dumps, INFO lines)")


def setup_console(verbose: bool) -> None:
    """The package's logging and the console, once per command line (xmodal.console)."""
    from xmodal.console import configure

    configure(verbose)


def user_errors(fn: Callable[[], int | None]) -> int:
    """Run a command: a `UserError` becomes one line `error: ...` on stderr and exit code 2, no
    traceback (tracebacks are for bugs); Ctrl-C or SIGTERM one line saying where the run stopped
    (`RunInterrupted`, xmodal.runner.interrupt) and exit code 130. Every command line of the package
    goes through here."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _interrupt)  # SIGTERM outside a run's training: as Ctrl-C
    try:
        return fn() or 0
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except RunInterrupted as e:
        print(e, file=sys.stderr)
        return 130
    except KeyboardInterrupt:
        print("[xmodal] interrupted", file=sys.stderr)
        return 130


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def dispatch(prog: str, doc: str | None, table: dict[str, tuple[str, str]], argv: list[str]) -> int:
    """Subcommands whose modules are imported only when chosen (a source's dependencies stay its own)."""
    parser = argparse.ArgumentParser(prog=prog, description=doc)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(table) + "}")
    chosen = argv[0] if argv and argv[0] in table else None
    for name, (module, help_text) in table.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            importlib.import_module(module).add_arguments(p)
    args = parser.parse_args(argv)
    module = importlib.import_module(table[args.command][0])
    return user_errors(lambda: module.run(args))  # bad input of a subcommand: one line, exit 2


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
}


def end_of_run_pages(plan, folder, data) -> bool:
    """A training run's example pages, logged into it before it ends (`engine.AfterRun`):
    `examples.end_of_run_pages`, imported only when a run ends (it loads torch and Pillow)."""
    from xmodal.examples import end_of_run_pages as pages

    return pages(plan, folder, data)


def job_main(argv: list[str], *, job: str, doc: str | None, sections: str,
             extra: dict[str, tuple[str, str, str]] | None = None) -> int:
    """The shared command line of the training jobs: --config, --set and the JOB_FLAGS shortcuts
    (plus `extra`: flag -> (dotted key, value template, help)), validated into the job's config
    class and run by the engine. Bad input is reported as one clear line and exit code 2."""
    from xmodal.config import load_config
    from xmodal.jobs.registry import job_spec
    from xmodal.runner.engine import run_job

    spec = job_spec(job)
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help=f"YAML config file (sections: {sections})")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="dotted override")
    add_verbose(p)
    flags = {flag: (key, "{}", help_text) for flag, (key, help_text) in JOB_FLAGS.items()}
    flags.update(extra or {})
    for flag, (key, _, help_text) in flags.items():
        p.add_argument("--" + flag.replace("_", "-"), help=f"{help_text} (= --set {key}=...)")
    args = p.parse_args(argv)
    setup_console(args.verbose)
    overrides = [f"{key}={template.format(getattr(args, flag))}" for flag, (key, template, _) in flags.items()
                 if getattr(args, flag) is not None]

    def go() -> None:
        cfg = load_config(spec.config_class, args.config, overrides + args.set)
        run_job(spec, cfg, source=args.config or "defaults", after_run=end_of_run_pages)

    return user_errors(go)
