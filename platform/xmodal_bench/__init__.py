"""Benchmarks behind `jobs/benchmark.py`. Each module exposes `add_arguments(parser)` and `run(args) -> int`.

A module per benchmark, named after what it measures: `lxmert` and `mult` time the train step of that
model (the same benchmark for two models); `data`, `tracking` and `sweep` measure the part of `xmodal`
of that name; `scale` the stores and workers at two sizes; `extract` the feature extractor; `suite` runs them all for a device run.

Bad input of any benchmark (a preset, a --set, a number, an output path) is a `UserError`: one line
`error: ...` on stderr and exit code 2 (`xmodal.base.commands.user_errors`), raised before anything is measured
or written. The helpers below are the checks every benchmark shares.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from xmodal.base.commands import dispatch
from xmodal.base.console import say
from xmodal.base.errors import UserError
from xmodal.base.outputs import Output, Scratch, check_writable_dir

USAGE = ("Benchmarks: each measures one part of xmodal against its reference or peer on this machine and "
         "prints its figures and ratios (docs/performance.md). `python jobs/benchmark.py NAME --help` for one.")

# name -> (module implementing it, one-line help); imported only when chosen, so `lxmert` needs no
# pyarrow and `data` no transformers.
BENCHMARKS: dict[str, tuple[str, str]] = {
    "lxmert": ("xmodal_bench.lxmert", "LXMERT train step: ours vs transformers' LxmertForPreTraining"),
    "data": ("xmodal_bench.data", "LXMERT input pipeline: ready batches/s vs the reference loader's work"),
    "mult": ("xmodal_bench.mult", "MulT train step at unaligned MOSEI shapes"),
    "suite": ("xmodal_bench.suite", "everything a device run must show, in one run: JSON + Markdown table"),
    "scale": ("xmodal_bench.scale", "ingest, store, pipeline and worker RSS at two store sizes: JSON + Markdown"),
    "tracking": ("xmodal_bench.tracking", "MLflow under N writers (sqlite, server, postgres): points present, "
                 "p50/p99 per call"),
    "sweep": ("xmodal_bench.sweep", "N tiny MulT sweep trials: each trial's life against its training, per phase"),
    "examples": ("xmodal_bench.examples", "a fine-tuning run's example pages against the run's own evaluation time"),
    "extract": ("xmodal_bench.extract", "region-feature extraction: images/s per detector worker and per decode core, "
                "regions batched vs per image, fp32 vs bf16"),
}


def at_least(args: argparse.Namespace, minimum: float, *names: str) -> None:
    """Each flag in `names` (attribute names) that is set must be >= minimum (every item of a list flag)."""
    for name in names:
        value = getattr(args, name)
        for v in value if isinstance(value, list) else [value]:
            if v is not None and not v >= minimum:  # `not >=`: NaN fails too
                raise UserError(f"--{name.replace('_', '-')} {v}: expected a number >= {minimum:g}")


def folder_arg(flag: str, path: str | None) -> None:
    """A folder the benchmark writes its results into (checked before anything is measured): local, and
    writable (new, or an existing folder, never a file nor under one). What it holds stays: each result
    is a new file there (`write_results`)."""
    if path is None:
        return
    if "://" in path:
        raise UserError(f"{flag}: {path!r} is a URI; benchmarks write their results to a local folder")
    check_writable_dir(path, flag)


# The scratch folders of this command (`begin`), removed when it ends, however it ends (`main`).
_SCRATCH: list[Scratch] = []


def scratch(under: str | None, flag: str, name: str, keep: bool = False) -> Path:
    """A new scratch folder under `under` (the benchmark's --work, else the temporary folder), removed
    with the folders made for it when the command ends, failed or not (unless `keep`)."""
    s = Scratch(under, flag, f"xmodal-bench-{name}-", keep=keep)
    _SCRATCH.append(s)
    return s.path


def begin(args: argparse.Namespace, name: str, **meta: Any) -> tuple[Path, str, dict[str, Any]]:
    """What the benchmarks with `--out` and `--work` share before measuring: both flags checked, a
    fresh work folder (`scratch`: under --work, else the temp folder; removed when the command ends), the
    results' timestamp for file names, and their `meta` (date, machine, Python, commit, command, `meta`)."""
    import datetime as dt
    import os
    import platform
    import sys

    from xmodal.tracking import git_commit

    folder_arg("--out", args.out)
    work = scratch(args.work, "--work", name)
    now = dt.datetime.now(dt.timezone.utc)
    return work, now.strftime("%Y%m%dT%H%M%SZ"), {
        "date": now.strftime("%Y-%m-%d %H:%M UTC"), "python": platform.python_version(),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "git_commit": git_commit(short=True), **meta,
        "command": f"python jobs/benchmark.py {name} " + " ".join(sys.argv[2:])}


def preset_arg(flag: str, name: str | None, presets: dict) -> None:
    if name is not None and name not in presets:
        raise UserError(f"{flag} {name!r}: unknown preset; expected one of {', '.join(sorted(presets))}")


def cuda_arg(device: str | None) -> None:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda, but torch.cuda.is_available() is False; pass --device cpu")


def write_results(out: str, name: str, res: dict, text: str) -> None:
    """A benchmark's results as `out/name.json` and its Markdown table `text` as `out/name.md`, each a new
    file (xmodal.base.outputs: staged, published whole, never over an existing file; the folder's other
    files stay), then the table and where both went on the console."""
    stem = Path(out) / name
    files = {stem.with_suffix(".json"): json.dumps(res, indent=1, default=str), stem.with_suffix(".md"): text + "\n"}
    outputs = [Output(path, "--out", "benchmark", file=True, overwrite=None) for path in files]
    stages = []
    try:
        for output, body in zip(outputs, files.values(), strict=True):
            stages.append(output.stage())
            stages[-1].tmp.write_text(body)
        for stage in stages:
            stage.publish()
    finally:
        for stage in stages:
            if not stage.published:
                stage.discard()
    say("")
    say(text)
    say(f"wrote {stem}.json and {stem}.md ({res['meta']['wall_s']:.0f} s)")


def main(argv: list[str]) -> int:
    try:
        return dispatch("benchmark.py", USAGE, BENCHMARKS, argv)
    finally:
        while _SCRATCH:
            _SCRATCH.pop().remove()
