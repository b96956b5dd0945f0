"""`jobs/ingest.py`: one subcommand per source. Each module exposes `add_arguments(parser)` and `run(args) -> int`."""

from __future__ import annotations

from xmodal.cli import dispatch

# source name -> (module that ingests it, one-line help)
SOURCES: dict[str, tuple[str, str]] = {
    "lxmert": ("xmodal.data.lxmert.ingest", "reference feature TSV + pretraining JSON -> LXMERT store"),
    "synthetic": ("xmodal.data.lxmert.synthetic", "learnable synthetic LXMERT corpus -> LXMERT store"),
    "mult": ("xmodal.data.mult.ingest", "reference / MMSA sentiment pickles -> MulT store"),
    "mult-synthetic": ("xmodal.data.mult.synthetic", "learnable synthetic unaligned streams -> MulT store"),
    "vqa": ("xmodal.data.finetune.ingest", "reference VQA fine-tuning JSON -> fine-tuning set over an LXMERT store"),
    "gqa": ("xmodal.data.finetune.ingest", "reference GQA fine-tuning JSON -> fine-tuning set over an LXMERT store"),
    "nlvr2": ("xmodal.data.finetune.ingest", "reference NLVR2 JSON -> fine-tuning set over an LXMERT store"),
    "synthetic-vqa": ("xmodal.data.finetune.synthetic", "learnable synthetic VQA over a synthetic LXMERT store"),
    "synthetic-gqa": ("xmodal.data.finetune.synthetic", "learnable synthetic GQA over a synthetic LXMERT store"),
    "synthetic-nlvr2": ("xmodal.data.finetune.synthetic", "learnable synthetic NLVR2 over a synthetic LXMERT store"),
}


def main(argv: list[str]) -> int:
    return dispatch("ingest.py", __doc__, SOURCES, argv)
