"""Benchmarks behind `jobs/benchmark.py`. Each module exposes `add_arguments(parser)` and `run(args) -> int`."""

from __future__ import annotations

import argparse
import importlib

# name -> module implementing it (imported only when chosen, so `lxmert` needs no pyarrow, `data` no transformers)
BENCHMARKS: dict[str, str] = {
    "lxmert": "xmodal.bench.lxmert",
    "data": "xmodal.bench.data",
    "mult": "xmodal.bench.mult",
}


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="benchmark.py", description=__doc__)
    sub = parser.add_subparsers(dest="benchmark", required=True, metavar="{" + ",".join(BENCHMARKS) + "}")
    for name, module in BENCHMARKS.items():
        mod = importlib.import_module(module)
        mod.add_arguments(sub.add_parser(name, help=(mod.__doc__ or "").strip().splitlines()[0]))
    args = parser.parse_args(argv)
    return importlib.import_module(BENCHMARKS[args.benchmark]).run(args)
