"""What every command line of the package shares: `--verbose`, the console's set-up, one `error:` line
for a user's error (`user_errors`), and subcommand dispatch."""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import threading
from collections.abc import Callable

from xmodal.base.errors import RunInterrupted, UserError


def add_verbose(p: argparse.ArgumentParser) -> None:
    p.add_argument("--verbose", action="store_true",
                   help="also show Ray's and MLflow's own output (Ray Data progress bars, report dumps, INFO lines)")


def setup_console(verbose: bool) -> None:
    """The package's logging and the console, once per command line (xmodal.base.console)."""
    from xmodal.base.console import configure

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
