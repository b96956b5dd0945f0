"""`jobs/ingest.py`: one subcommand per source. Each module exposes `add_arguments(parser)` and `run(args) -> int`."""

from __future__ import annotations

from xmodal.cli import dispatch

# source name -> (module that ingests it, one-line help)
SOURCES: dict[str, tuple[str, str]] = {
    "lxmert": ("xmodal.data.lxmert_ingest", "reference feature TSV + pretraining JSON -> LXMERT store"),
    "synthetic": ("xmodal.data.synthetic", "learnable synthetic LXMERT corpus -> LXMERT store"),
    "mult": ("xmodal.data.mult_ingest", "reference / MMSA sentiment pickles -> MulT store"),
    "mult-synthetic": ("xmodal.data.mult_synthetic", "learnable synthetic unaligned streams -> MulT store"),
}


def main(argv: list[str]) -> int:
    return dispatch("ingest.py", __doc__, SOURCES, argv)
