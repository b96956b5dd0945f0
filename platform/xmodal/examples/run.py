"""What every kind of example pages shares: the run (looked up once, `Resolved`), the errors, the fixed-seed
choice of examples, the check that a run's data is still the data it read, and `Shown`: one run's examples
as collected, whatever their kind.

Every bad input is an `ExamplesError` naming the option, the value and what was expected.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from xmodal import tracking
from xmodal.base import run_tags
from xmodal.base.errors import UserError

MAX_EXAMPLES = 1000  # the most examples one set of pages shows (the configs' `examples.count` bound too)


class ExamplesError(UserError):
    """Bad input to the example pages: the message names the option, the value and what was expected."""


@dataclass
class Resolved:
    """A finished run whose examples are shown, looked up once: its record, its kind (`kinds.KINDS`) and
    the option that named it (for the messages)."""

    uri: str
    run: tracking.RunRecord
    kind: str
    key: str  # "--run-id" or "--compare"

    @property
    def run_id(self) -> str:
        return self.run.run_id

    @property
    def name(self) -> str:
        return self.run.name or self.run.run_id


@dataclass
class Shown:
    """One run's examples as collected: `examples` of the kind's own type, `split_size` examples in the
    split they were chosen from, `notes` the pages should say (about the pictures)."""

    run_id: str
    run_name: str
    kind: str  # "finetune", "pretrain" or "mult"
    task: str  # vqa, gqa, nlvr2, pretrain, mult
    split: str
    data_path: str
    examples: list[Any]
    split_size: int
    notes: list[str] = field(default_factory=list)

    @property
    def right(self) -> int:
        return sum(bool(e.right) for e in self.examples)


def check_count(n: Any, key: str = "--examples") -> int:
    """A number of examples: an int (not a bool) from 1 to MAX_EXAMPLES."""
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_EXAMPLES:
        raise ExamplesError(f"{key} {n!r}: expected a whole number of examples from 1 to {MAX_EXAMPLES}")
    return n


def choose_rows(size: int, n: int) -> np.ndarray:
    """`n` rows of a split of `size`, in order, the same for every run of the same set: the first `n` of a
    fixed-seed permutation, so a larger count shows a smaller count's examples too (a run's 16 are among
    the 48 of `jobs/examples.py`, and MLflow's table joins them)."""
    return np.sort(np.random.default_rng(0).permutation(size)[:n]).astype(np.int64)


def rows_of(ids: list[str], wanted: list[str], where: str, key: str) -> np.ndarray:
    """The rows of `ids` (a split's example ids, in order) holding the examples `wanted`; a missing one is
    an error naming it."""
    at = {str(x): i for i, x in enumerate(ids)}
    for w in wanted:
        if w not in at:
            raise ExamplesError(f"{key}: {where} has no example {w!r}, which the first run shows; expected two runs "
                                "whose examples are the same (the same set and split)")
    return np.array([at[w] for w in wanted], np.int64)


def get_run(uri: str, run_id: str, key: str) -> tracking.RunRecord:
    local = uri[len("sqlite:///"):] if uri.startswith("sqlite:///") else None
    if local is not None and not Path(local).exists():  # a read must not create a database
        raise ExamplesError(f"{key}: no MLflow run {run_id!r}: there is no MLflow store at {local}")
    try:
        return tracking.get_run(uri, run_id)
    except tracking.RunNotFound:
        raise ExamplesError(f"{key}: no MLflow run {run_id!r} at {uri}") from None


def check_data_unchanged(run: tracking.RunRecord, path: str, key: str) -> None:
    """The data at `path` is the data the run read: its manifest's digest equals the one the run recorded
    (`run_tags.REPRO_DATA_MANIFEST`). Data ingested again since would give other examples than the run
    evaluated, with no error."""
    from xmodal.runner.run_record import manifest_digest

    recorded = run.tags.get(run_tags.REPRO_DATA_MANIFEST)
    found = manifest_digest(path)
    if recorded and recorded != "-" and found != recorded:
        raise ExamplesError(f"{key}: {path} is not the data run {run.run_id!r} read: its manifest's digest is "
                            f"{found}, the run recorded {recorded}; expected the data as it was (was it "
                            "ingested again since?)")


def open_recorded(r: Resolved, tag: str, what: str, opener):
    """The data the run recorded under `tag` (its path), checked unchanged and opened with `opener`."""
    path = r.run.tags.get(tag)
    if not path:
        raise ExamplesError(f"{r.key}: run {r.run_id!r} records no {what} (tag {tag!r})")
    check_data_unchanged(r.run, path, r.key)
    try:
        return opener(path)
    except UserError as e:
        raise ExamplesError(f"{r.key}: the {what} of run {r.run_id!r} cannot be opened: {e}") from None


def check_same_examples(a: Shown, b: Shown, key: str = "--compare") -> None:
    """Two runs' examples are the same examples: the same ids in the same order, and the same content
    (question, answers, pictures; a clip's label and steps: each kind's `identity`). The first that
    differs is named, with what differs."""
    for x, y in zip(a.examples, b.examples, strict=False):
        if x.id != y.id or x.identity() != y.identity():
            raise ExamplesError(
                f"{key}: example {x.id!r} of run {a.run_id!r} ({a.data_path}) differs from example {y.id!r} of run "
                f"{b.run_id!r} ({b.data_path}) ({differs(x.identity(), y.identity())}); expected two runs on the "
                "same examples (the same set and split)")
    if len(a.examples) != len(b.examples):
        raise ExamplesError(f"{key}: run {a.run_id!r} shows {len(a.examples)} examples, run {b.run_id!r} "
                            f"{len(b.examples)}; expected the same examples")


def differs(x: tuple, y: tuple) -> str:
    """What differs between two identities ((field, value) pairs): the first field that does."""
    for (name, p), (_, q) in zip(x, y, strict=False):
        if p != q:
            return f"{name} {p!r} against {q!r}"
    return "they have different fields"
