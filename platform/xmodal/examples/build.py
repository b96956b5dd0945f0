"""The example pages of a run, built whole: collected (collect.py), drawn (draw.py), written as HTML
(pages.py) into a hidden folder beside the output and renamed into place, so a failure leaves nothing.

Two doors: `make_examples` (jobs/examples.py: a finished run, optionally against a second one, into a
folder) and `log_run_examples` (the end of a fine-tuning run, `runner/engine.py: finish_run`: its
final model on its own data, logged into the run under `examples/` with a table and a tag).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from xmodal import tracking
from xmodal.base import run_tags
from xmodal.base.errors import UserError
from xmodal.examples.collect import (
    PRETRAIN_SPLIT,
    ExamplesError,
    RunExamples,
    check_count,
    check_split,
    choose_rows,
    collect,
    evaluate,
    evaluate_pretrain,
    get_run,
    run_task,
)
from xmodal.examples.draw import picture_png
from xmodal.examples.pages import Drawn, Side, example_page, index_page, page_name, page_order, picture_name
from xmodal.examples.stats import compare

ARTIFACT_DIR = "examples"  # the pages' folder among a run's artifacts
TABLE_FILE = "examples/examples_table.json"  # the run's table of the examples (`mlflow.log_table`)
EXAMPLES_TAG = run_tags.EXAMPLES  # the run's tag: the index page's artifact path


@dataclass
class Built:
    out: Path
    a: RunExamples
    b: RunExamples | None
    pages: int
    pictures: int
    mult: list | None = None  # a MulT run's clips (`examples.mult.MultExample`)


def write_pages(a: RunExamples, b: RunExamples | None, folder: Path) -> tuple[int, int]:
    """The index, one page per example and the pictures (PNG, once per image) into `folder` (which
    exists). With `b`: the same examples of a second run, disagreements first. Returns (pages, pictures)."""
    order = page_order(a, b)
    a.examples = [a.examples[i] for i in order]
    if b is not None:
        b.examples = [b.examples[i] for i in order]
    cmp = compare(a.examples, b.examples) if b is not None else None
    (folder / "img").mkdir(parents=True, exist_ok=True)
    drawn: dict[str, Drawn] = {}
    for e in a.examples:
        for pic in e.pictures:
            if pic.img_id not in drawn:
                path = folder / picture_name(pic.img_id)
                (w, h), uri = picture_png(pic, path)
                drawn[pic.img_id] = Drawn(w, h, uri)
    notes = list(dict.fromkeys(a.notes + (b.notes if b is not None else [])))
    n = len(a.examples)
    for i in range(n):
        sides = [Side("A", a, a.examples[i])] + ([Side("B", b, b.examples[i])] if b is not None else [])
        (folder / page_name(i)).write_text(example_page(i, n, sides, drawn, notes), encoding="utf-8")
    (folder / "index.html").write_text(index_page(a, b, cmp, notes, drawn), encoding="utf-8")
    return n + 1, len(drawn)


def check_out(out: str | Path) -> Path:
    from xmodal.base.outputs import check_writable_dir

    p = check_writable_dir(out, "--out")
    if p.is_dir() and any(p.iterdir()):
        raise ExamplesError(f"--out {out}: already exists and is not empty; expected a new or empty folder")
    return p


def publish(tmp: Path, out: Path) -> None:
    """The finished folder `tmp` renamed to `out` (an empty `out` is replaced)."""
    if out.is_dir():
        out.rmdir()
    out.parent.mkdir(parents=True, exist_ok=True)
    os.rename(tmp, out)


def make_examples(uri: str, run_id: str, split: str | None = None, n: int = 48, compare_run: str | None = None,
                  out: str | Path | None = None) -> Built:
    """Pages of `n` examples of `split` of a finished fine-tuning run (and of `compare_run` on the same
    examples) into `out` (default examples/<run name>[-vs-<other>]). Every check comes before anything
    is written."""
    check_count(n)
    target = check_out(out) if out is not None else None
    a_run = get_run(uri, run_id, "--run-id")
    task = run_task(a_run, "--run-id")
    split = split or {"pretrain": PRETRAIN_SPLIT, "mult": "test"}.get(task, "valid")
    if task == "mult":
        if compare_run is not None:
            raise ExamplesError(f"--compare: run {run_id!r} is a MulT run; two runs side by side are for "
                                "fine-tuning runs")
        return _mult_examples(uri, a_run, split, n, target)
    if compare_run is not None:
        b_run = get_run(uri, compare_run, "--compare")
        other = run_task(b_run, "--compare")
        if other != task:
            raise ExamplesError(f"--compare: run {compare_run!r} is a {other} run and run {run_id!r} a {task} run; "
                                "expected two runs of one task")
    if target is None:
        name = a_run.name or run_id
        if compare_run is not None:
            name += f"-vs-{b_run.name or compare_run}"
        target = check_out(Path("examples") / name)
    with tempfile.TemporaryDirectory(prefix="xmodal-examples-") as scratch:
        a, data = collect(uri, run_id, split, n, Path(scratch) / "a", "--run-id")
        b = None
        if compare_run is not None:
            rows = np.array([e.row for e in a.examples], np.int64)
            b, data_b = collect(uri, compare_run, split, n, Path(scratch) / "b", "--compare", rows=rows)
            if [e.id for e in b.examples] != [e.id for e in a.examples]:
                raise ExamplesError(f"--compare: run {compare_run!r} read {data_b.path}, run {run_id!r} read "
                                    f"{data.path}: their {split} examples differ; expected runs on the same set")
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
        try:
            pages, pictures = write_pages(a, b, tmp)
            publish(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return Built(target, a, b, pages, pictures)


def _mult_examples(uri: str, run, split: str, n: int, target: Path | None) -> Built:
    """A MulT run's pages: its clips of `split` (one it evaluated: valid or test)."""
    from xmodal.data.mult.store import open_store
    from xmodal.examples.mult import collect_mult, write_mult_pages
    from xmodal.export.source import from_run

    try:
        store = open_store(run.tags.get(run_tags.STORE, ""))
    except UserError as e:
        raise ExamplesError(f"--run-id: the store of run {run.run_id!r} cannot be opened: {e}") from None
    evaluated = [s for s in store.splits if s != "train"]
    if split not in evaluated:
        raise ExamplesError(f"--split {split}: run {run.run_id!r} did not evaluate it; it evaluated "
                            f"{', '.join(evaluated)}")
    target = target or check_out(Path("examples") / (run.name or run.run_id))
    with tempfile.TemporaryDirectory(prefix="xmodal-examples-") as scratch:
        source = from_run(uri, run.run_id, Path(scratch))
        examples, size = collect_mult(source.model, store, split, n)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        pages = write_mult_pages(run.name, run.run_id, split, size, examples, tmp)
        publish(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    a = RunExamples(run.run_id, run.name, "mult", split, str(store.path), [], size)
    return Built(target, a, None, pages, 0, mult=examples)


def table_of(a: RunExamples) -> dict[str, list]:
    """The run's examples as table columns (one row per example) for `mlflow.log_table`."""
    return {
        "example_id": [e.id for e in a.examples],
        "question": [e.text for e in a.examples],
        "answers": [", ".join(f"{g} ({s:.2f})" for g, s in e.gold) for e in a.examples],
        "prediction": [e.pred for e in a.examples],
        "right": [bool(e.right) for e in a.examples],
        "page": [f"{ARTIFACT_DIR}/{page_name(i)}" for i in range(len(a.examples))],
        "image_path": [f"{ARTIFACT_DIR}/{picture_name(e.pictures[0].img_id)}" for e in a.examples],
    }


def log_pages(uri: str, run_id: str, folder: Path, a: RunExamples) -> str | None:
    """The pages into the run's artifacts (`examples/`), the table, and a tag and a line of the run's
    description linking to the index. Returns the index's address where a browser can open it."""
    tracking.log_artifacts(uri, run_id, folder, ARTIFACT_DIR)
    tracking.log_table(uri, run_id, table_of(a), TABLE_FILE)
    index = f"{ARTIFACT_DIR}/index.html"
    url = tracking.artifact_url(uri, run_id, index)
    note = tracking.get_run(uri, run_id).tags.get(run_tags.NOTE, "")
    right = sum(e.right for e in a.examples)
    where = f"[{index}]({url})" if url and url.startswith("file:") else \
        f"{index} under the run's [Artifacts]({url})" if url else f"{index} among the run's artifacts"
    line = (f"Example pages: {where} ({len(a.examples)} {a.split} examples, {right} right; pictures, answers and "
            "cross-attention)")
    tags = {EXAMPLES_TAG: index}
    if index not in note:
        tags[run_tags.NOTE] = f"{note}\n\n{line}".strip()
    tracking.set_tags(uri, run_id, tags)
    return url


def log_run_examples(uri: str, run_id: str, run_name: str, cfg, data, checkpoint_dir: Path) -> str | None:
    """The end of a run: `cfg.examples.count` examples with the run's final model (the selected weights of
    its final checkpoint folder) on its own data, logged into the run: a fine-tuning run's examples of
    `cfg.examples.split`, a pretraining run's QA questions of its store's minival split. Nothing when the
    count is 0. Where the time went is logged too (`time/examples/{model,predict,pages,log}_s`). Returns
    the index's address."""
    from xmodal.export.source import from_checkpoint

    conf = cfg.examples
    if conf.count == 0:
        return None
    spent: dict[str, float] = {}
    t = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal t
        now = time.perf_counter()
        spent[f"time/examples/{name}_s"] = now - t
        t = now

    source = from_checkpoint(checkpoint_dir, key="the run's final checkpoint", run_id=run_id)
    lap("model")
    notes: list[str] = []
    if source.kind == "pretrain":
        examples, size = evaluate_pretrain(source.model, data, PRETRAIN_SPLIT, conf.count, notes)
        a = RunExamples(run_id, run_name, "pretrain", PRETRAIN_SPLIT, str(data.path), examples, size, notes)
    else:
        check_split(data, conf.split, run_id)
        size = len(data.split(conf.split))
        examples = evaluate(source.model, data, conf.split, choose_rows(size, conf.count), notes)
        a = RunExamples(run_id, run_name, data.task, conf.split, str(data.path), examples, size, notes)
    lap("predict")
    with tempfile.TemporaryDirectory(prefix="xmodal-examples-") as tmp:
        write_pages(a, None, Path(tmp))
        lap("pages")
        url = log_pages(uri, run_id, Path(tmp), a)
        lap("log")
    tracking.log_metrics(uri, run_id, spent)
    return url
