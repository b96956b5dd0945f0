"""Subcommand dispatch shared by the job scripts."""

from __future__ import annotations

import argparse
import importlib


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
    return importlib.import_module(table[args.command][0]).run(args)
