"""Benchmarks behind `jobs/benchmark.py`. Each module exposes `add_arguments(parser)` and `run(args) -> int`."""

from __future__ import annotations

from xmodal.cli import dispatch

# name -> (module implementing it, one-line help); imported only when chosen, so `lxmert` needs no
# pyarrow and `data` no transformers.
BENCHMARKS: dict[str, tuple[str, str]] = {
    "lxmert": ("xmodal.bench.lxmert", "LXMERT train step: ours vs transformers' LxmertForPreTraining"),
    "data": ("xmodal.bench.data", "LXMERT input pipeline: ready batches/s vs the reference loader's work"),
    "mult": ("xmodal.bench.mult", "MulT train step at unaligned MOSEI shapes"),
    "suite": ("xmodal.bench.suite", "everything a device run must show, in one run: JSON + Markdown table"),
    "scale": ("xmodal.bench.scale", "ingest, store, pipeline and worker RSS at two store sizes: JSON + Markdown"),
}


def main(argv: list[str]) -> int:
    return dispatch("benchmark.py", __doc__, BENCHMARKS, argv)
