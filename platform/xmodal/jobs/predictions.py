"""Prediction files in the shapes the benchmarks' evaluation servers take (as the reference
airsplay/lxmert writes them). Standard library only; every file is written through the output policy
(`xmodal.base.outputs`: staged beside its place and published whole), so a reader never sees half a file.

- VQA: a JSON list of {"answer": str, "question_id": int} (reference `VQAEvaluator.dump_result`;
  the VQA server wants integer ids, so pass them as ints).
- GQA: a JSON list of {"prediction": str, "questionId": str} (reference `GQAEvaluator.dump_result`;
  the GQA server wants string ids).
- NLVR2: CSV lines "identifier,True" / "identifier,False", no header (reference
  `NLVR2Evaluator.dump_result`; the official evaluator compares them case-insensitively with the
  JSON's "True"/"False" labels).
"""

from __future__ import annotations

import json
import operator
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from xmodal.base.outputs import Output


def write_atomic(path: str | os.PathLike, text: str) -> Path:
    """Write `text` as the file `path` (replacing the run's earlier one): staged beside it, synced, published
    whole."""
    with Output(path, "predictions file", "finetune", file=True, overwrite=True).stage() as stage:
        with open(stage.tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        return stage.publish()


def _same_length(what: str, a: Sequence[Any], b: Sequence[Any]) -> None:
    if len(a) != len(b):
        raise ValueError(f"{len(a)} {what} and {len(b)} predictions; expected one prediction each")


def _plain_id(q: Any) -> int | str:
    """numpy / torch integers -> int (JSON-serialisable); strings stay strings."""
    if isinstance(q, str):
        return q
    try:
        return operator.index(q)
    except TypeError:
        raise TypeError(f"question id {q!r} is neither an integer nor a string") from None


def write_vqa_predictions(path: str | os.PathLike, question_ids: Sequence[Any], answers: Sequence[str]) -> Path:
    """VQA submission: [{"answer": ..., "question_id": ...}, ...] (ids written as given)."""
    _same_length("question ids", question_ids, answers)
    rows = [{"question_id": _plain_id(q), "answer": str(a)} for q, a in zip(question_ids, answers, strict=True)]
    return write_atomic(path, json.dumps(rows, indent=4, sort_keys=True))


def write_gqa_predictions(path: str | os.PathLike, question_ids: Sequence[Any], answers: Sequence[str]) -> Path:
    """GQA submission: [{"prediction": ..., "questionId": "<id as a string>"}, ...]."""
    _same_length("question ids", question_ids, answers)
    rows = [{"questionId": str(_plain_id(q)), "prediction": str(a)}
            for q, a in zip(question_ids, answers, strict=True)]
    return write_atomic(path, json.dumps(rows, indent=4, sort_keys=True))


def write_nlvr2_predictions(path: str | os.PathLike, identifiers: Sequence[str], predictions: Sequence[Any]) -> Path:
    """NLVR2 submission: "identifier,True|False" lines; a prediction is anything equal to 1/0 or True/False."""
    _same_length("identifiers", identifiers, predictions)
    lines = []
    for ident, p in zip(identifiers, predictions, strict=True):
        # Equality, not isinstance: numpy / torch scalars and bools count as well.
        if bool(p == 1):
            v = True
        elif bool(p == 0):
            v = False
        else:
            raise ValueError(f"NLVR2 prediction {p!r} for {ident}: expected 0/1 or False/True")
        if "," in ident or "\n" in ident:
            raise ValueError(f"NLVR2 identifier {ident!r} contains a comma or newline")
        lines.append(f"{ident},{v}\n")
    return write_atomic(path, "".join(lines))
