"""Benchmarks behind `jobs/benchmark.py`. Each module exposes `add_arguments(parser)` and `run(args) -> int`.

Bad input of any benchmark (a preset, a --set, a number, an output path) is a `UserError`: one line
`error: ...` on stderr and exit code 2 (`xmodal.cli.user_errors`), raised before anything is measured
or written. The helpers below are the checks every benchmark shares.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from xmodal.cli import dispatch
from xmodal.errors import UserError

# name -> (module implementing it, one-line help); imported only when chosen, so `lxmert` needs no
# pyarrow and `data` no transformers.
BENCHMARKS: dict[str, tuple[str, str]] = {
    "lxmert": ("xmodal.bench.lxmert", "LXMERT train step: ours vs transformers' LxmertForPreTraining"),
    "data": ("xmodal.bench.data", "LXMERT input pipeline: ready batches/s vs the reference loader's work"),
    "mult": ("xmodal.bench.mult", "MulT train step at unaligned MOSEI shapes"),
    "suite": ("xmodal.bench.suite", "everything a device run must show, in one run: JSON + Markdown table"),
    "scale": ("xmodal.bench.scale", "ingest, store, pipeline and worker RSS at two store sizes: JSON + Markdown"),
}


def at_least(args: argparse.Namespace, minimum: float, *names: str) -> None:
    """Each flag in `names` (attribute names) that is set must be >= minimum (every item of a list flag)."""
    for name in names:
        value = getattr(args, name)
        for v in value if isinstance(value, list) else [value]:
            if v is not None and not v >= minimum:  # `not >=`: NaN fails too
                raise UserError(f"--{name.replace('_', '-')} {v}: expected a number >= {minimum:g}")


def folder_arg(flag: str, path: str | None) -> None:
    """An output or work folder: new or an existing folder, never a file (nor under one)."""
    if path is None:
        return
    p = Path(path).expanduser().resolve()
    for q in (p, *p.parents):
        if q.exists():
            if not q.is_dir():
                raise UserError(f"{flag} {path}: {q} is a file; expected a folder")
            return


def preset_arg(flag: str, name: str | None, presets: dict) -> None:
    if name is not None and name not in presets:
        raise UserError(f"{flag} {name!r}: unknown preset; expected one of {', '.join(sorted(presets))}")


def cuda_arg(device: str | None) -> None:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda, but torch.cuda.is_available() is False; pass --device cpu")


def main(argv: list[str]) -> int:
    return dispatch("benchmark.py", __doc__.split("\n\n")[0], BENCHMARKS, argv)
