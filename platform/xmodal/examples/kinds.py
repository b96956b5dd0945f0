"""The kinds of example pages, one entry each, the way `jobs/registry.py: JOBS` maps jobs: a kind opens the
data its run read, checks the split (and that the run trained what its pages would show), collects the
examples with the run's model and renders the pages.

    KINDS["finetune"]  fine-tuning runs (VQA, GQA, NLVR2)           examples/finetune.py, pages examples/qa.py
    KINDS["pretrain"]  pretraining runs: their QA head on minival   examples/pretrain.py, pages examples/qa.py
    KINDS["mult"]      MulT runs on sentiment stores                examples/mult.py

A kind is what `kind_of` says of a run, from its task (tags) or its checkpoint: the one place the task is
dispatched on.
"""

from __future__ import annotations

from typing import Any, Protocol

from xmodal import tracking
from xmodal.base import run_tags
from xmodal.examples.finetune import TASKS, FinetuneKind
from xmodal.examples.mult import MultKind
from xmodal.examples.pretrain import PretrainKind
from xmodal.examples.run import ExamplesError, Resolved, get_run
from xmodal.examples.viewer import Rendered


class Kind(Protocol):
    name: str
    what: str  # "a fine-tuning run", for messages
    default_split: str

    def open(self, r: Resolved) -> Any: ...

    def check(self, r: Resolved, data: Any, split: str, config: dict | None = None) -> None: ...

    def collect(self, model, data, split: str, n: int, notes: list[str], ids: list[str] | None = None,
                config: dict | None = None) -> tuple[list[Any], int]: ...

    def render(self, a, b=None) -> Rendered: ...


KINDS: dict[str, Kind] = {"finetune": FinetuneKind(), "pretrain": PretrainKind(), "mult": MultKind()}

# a task (a run's `task` tag without its `finetune-` prefix, or a checkpoint's kind) -> its kind
BY_TASK = {**{t: "finetune" for t in TASKS}, "pretrain": "pretrain", "mult": "mult"}


def kind_of_task(task: str) -> str | None:
    """The kind of a task name (`vqa`, `pretrain`, `mult`, ...; `export.source`'s kinds), None if none."""
    return BY_TASK.get(task)


def run_task(run: tracking.RunRecord) -> str:
    """A run's task by its tags: the fine-tuning task (`finetune-<task>`), `pretrain`, `mult` (its model
    tag: a MulT run's task tag is its store's task), else the tag as it is."""
    if run.tags.get(run_tags.MODEL) == "mult":
        return "mult"
    task = run.tags.get(run_tags.TASK, "")
    return task[len("finetune-"):] if task.startswith("finetune-") else task


def resolve(uri: str, run_id: str, key: str) -> Resolved:
    """The run, looked up once, and its kind; a run whose examples have no pages is an error saying what
    it is."""
    run = get_run(uri, run_id, key)
    task = run_task(run)
    kind = kind_of_task(task)
    if kind is None:
        what = f"a {run.tags.get(run_tags.TASK)!r} run" if run.tags.get(run_tags.TASK) else "a run without a task tag"
        raise ExamplesError(f"{key}: run {run_id!r} is {what}; expected "
                            f"{', '.join(k.what for k in KINDS.values())} "
                            f"(task tags {', '.join('finetune-' + t for t in TASKS)}, pretrain; model tag mult)")
    return Resolved(uri, run, kind, key)
