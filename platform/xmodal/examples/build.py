"""The example pages of a run, built whole: the run resolved once (kinds.resolve), its kind's data opened and
checked, its examples collected with its model and rendered (kinds.KINDS), and the pages written.

Two doors:
- `make_examples` (jobs/examples.py): a finished run, optionally against a second one on the same examples,
  into a folder under the output policy (`base.outputs.Output`: new, empty, or this command's own earlier
  output; `--overwrite` writes beside other files and removes none; staged and published whole). Two runs'
  comparison is also logged into the second run (B): `examples/vs-<A>/index.html` and its counts, and a line
  of B's description linking it; the same command again replaces both.
- `log_run_examples` (the end of a training run, `runner/engine.py: finish_run`, through
  `end_of_run_pages`): its final model on its own data, logged into the run under `examples/` with MLflow's
  table of the examples (pictures as an image column), a tag, a summary the end-of-run lines print, and a
  line of the run's description linking the MLflow UI's address of the index.
"""

from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from xmodal import tracking
from xmodal.base import run_tags
from xmodal.base.outputs import Output
from xmodal.examples.kinds import KINDS, Kind, kind_of_task, resolve, run_task
from xmodal.examples.run import ExamplesError, Resolved, Shown, check_count, check_same_examples
from xmodal.examples.stats import Comparison, compare
from xmodal.examples.viewer import Rendered, slug

COMMAND = "jobs/examples.py"  # the name in the output folder's record
ARTIFACT_DIR = "examples"  # the pages' folder among a run's artifacts
INDEX = f"{ARTIFACT_DIR}/index.html"
TABLE_FILE = f"{ARTIFACT_DIR}/examples_table.json"  # the run's table of the examples (`mlflow.log_table`)
EXAMPLES_TAG = run_tags.EXAMPLES  # the run's tag: the index page's artifact path


@dataclass
class Built:
    out: Path
    a: Shown
    b: Shown | None
    line: str  # what the console says of the pages
    comparison: Comparison | None = None
    logged: str | None = None  # the address in the MLflow UI of what was logged: the comparison (in run B), or --log's


def write_rendered(rendered: Rendered, folder: Path) -> None:
    """The index and the files beside it into `folder` (which exists)."""
    (folder / "index.html").write_text(rendered.index, encoding="utf-8")
    for rel, data in rendered.files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)


def collect_run(kind: Kind, r: Resolved, data, split: str, n: int, scratch: Path,
                ids: list[str] | None = None) -> Shown:
    """The run's examples of `split` with its model (the weights it selected on validation, its `model`
    artifact): `n` of them, or those with `ids` (a second run's, on the first's examples)."""
    from xmodal.export.source import from_run

    source = from_run(r.uri, r.run_id, scratch / r.run_id)
    kind.check(r, data, split, source.config)  # what only the run's config says (a pretraining run's tasks)
    notes: list[str] = list(source.notes)
    examples, size = kind.collect(source.model, data, split, n, notes, ids=ids, config=source.config)
    return Shown(r.run_id, r.name, r.kind, run_task(r.run), split, str(data.path), examples, size, notes)


def opened(r: Resolved, split: str):
    """The kind's data of the run, opened and checked for `split` (before any model is read)."""
    kind = KINDS[r.kind]
    data = kind.open(r)
    kind.check(r, data, split)
    return data


def check_loggable(a: Resolved, compare_run: str | None) -> None:
    """`--log`: the pages go into a run that has none (MLflow keeps a run's artifacts: what is there would
    stay beside them), and alone (a comparison goes into the second run anyway)."""
    if compare_run is not None:
        raise ExamplesError("--log: with --compare the comparison is logged into the second run; expected one of "
                            "--log or --compare")
    if a.run.tags.get(EXAMPLES_TAG):
        raise ExamplesError(f"--log: run {a.run_id!r} already has example pages ({a.run.tags[EXAMPLES_TAG]}), which "
                            "MLflow would keep beside new ones; expected a run without them (write these with --out)")


def make_examples(uri: str, run_id: str, split: str | None = None, n: int = 48, compare_run: str | None = None,
                  out: str | Path | None = None, overwrite: bool = False, log: bool = False) -> Built:
    """Pages of `n` examples of `split` of a finished run (and of `compare_run` on the same examples) into
    `out` (default examples/<run name>[-vs-<other>]); with `log`, into the run too (as its end logs them:
    a MulT run's, or a run's that logged none). Every check comes before anything is written."""
    check_count(n)
    target = Output(out, "--out", COMMAND, overwrite=overwrite) if out is not None else None
    a = resolve(uri, run_id, "--run-id")
    if log:
        check_loggable(a, compare_run)
    b = resolve(uri, compare_run, "--compare") if compare_run is not None else None
    if b is not None and (b.kind, run_task(b.run)) != (a.kind, run_task(a.run)):
        raise ExamplesError(f"--compare: run {b.run_id!r} is a {run_task(b.run)} run and run {a.run_id!r} a "
                            f"{run_task(a.run)} run; expected two runs of one task")
    kind = KINDS[a.kind]
    split = split or kind.default_split
    data_a = opened(a, split)
    data_b = opened(b, split) if b is not None else None
    if target is None:
        name = a.name + (f"-vs-{b.name}" if b is not None else "")
        target = Output(Path("examples") / name, "--out", COMMAND, overwrite=overwrite)
    with tempfile.TemporaryDirectory(prefix="xmodal-examples-") as scratch:
        shown_a = collect_run(kind, a, data_a, split, n, Path(scratch))
        shown_b = None
        if b is not None:
            shown_b = collect_run(kind, b, data_b, split, n, Path(scratch), ids=[e.id for e in shown_a.examples])
            check_same_examples(shown_a, shown_b)
    rendered = kind.render(shown_a, shown_b)
    with target.stage() as stage:
        write_rendered(rendered, stage.tmp)
        folder = stage.publish()
    built = Built(folder, shown_a, shown_b, rendered.line)
    if log:
        with tempfile.TemporaryDirectory(prefix="xmodal-examples-") as tmp:
            write_rendered(rendered, Path(tmp))
            built.logged = log_pages(uri, a.run_id, Path(tmp), shown_a, rendered)
    if shown_b is not None:
        built.comparison = compare(shown_a.examples, shown_b.examples)
        built.logged = log_comparison(uri, shown_a, shown_b, built.comparison, rendered)
    return built


def comparison_dir(a: Shown) -> str:
    """Where run B's artifacts hold its comparison with run A."""
    return f"{ARTIFACT_DIR}/vs-{slug(a.run_name, 40)}-{a.run_id[:8]}"


def log_comparison(uri: str, a: Shown, b: Shown, c: Comparison, rendered: Rendered) -> str:
    """The comparison page (the index alone: it holds its pictures) and its counts into run B, and a line of
    B's description linking it (replacing the line an earlier comparison with A left). Returns its address
    in the MLflow UI."""
    where = comparison_dir(a)
    counts = {"a_run_id": a.run_id, "b_run_id": b.run_id, "split": a.split, "examples": c.total,
              "a_right": a.right, "b_right": b.right, "both_right": c.both_right, "only_a": c.only_a,
              "only_b": c.only_b, "both_wrong": c.both_wrong, "mcnemar_p": c.p_value, "test": c.test}
    with tempfile.TemporaryDirectory(prefix="xmodal-compare-") as tmp:
        (Path(tmp) / "index.html").write_text(rendered.index, encoding="utf-8")
        (Path(tmp) / "comparison.json").write_text(json.dumps(counts, indent=1) + "\n")
        tracking.log_artifacts(uri, b.run_id, tmp, where)
    url = tracking.artifact_url(uri, b.run_id, f"{where}/index.html")
    line = (f"Compared with run {a.run_name} ({a.run_id}) on {c.total} {a.split} examples: [{where}/index.html]({url}); "
            f"this run {b.right} right, {a.run_name} {a.right}; only this run right {c.only_b}, only {a.run_name} "
            f"{c.only_a}; McNemar's p = {c.p_value:.4g}")
    set_note_line(uri, b.run_id, f"[{where}/index.html]", line)
    return url


def set_note_line(uri: str, run_id: str, marker: str, line: str, tags: dict[str, str] | None = None) -> None:
    """The run's description with `line` in place of the line holding `marker` (or added), and `tags`."""
    note = tracking.get_run(uri, run_id).tags.get(run_tags.NOTE, "")
    paragraphs = [p for p in note.split("\n\n") if p.strip() and marker not in p]
    tracking.set_tags(uri, run_id, {**(tags or {}), run_tags.NOTE: "\n\n".join(paragraphs + [line])})


def log_pages(uri: str, run_id: str, folder: Path, shown: Shown, rendered: Rendered) -> str:
    """The pages into the run's artifacts (`examples/`), MLflow's table of them (once: a table logged again
    would be appended to), the tags and a line of the run's description linking the index in the MLflow
    UI. Returns that address."""
    tracking.log_artifacts(uri, run_id, folder, ARTIFACT_DIR)
    if rendered.table is not None and TABLE_FILE not in tracking.list_artifacts(uri, run_id, ARTIFACT_DIR):
        tracking.log_table(uri, run_id, rendered.table, TABLE_FILE)
    url = tracking.artifact_url(uri, run_id, INDEX)
    said = (f"{len(shown.examples)} {shown.split} clips, {shown.right} with the sign right" if shown.kind == "mult" else
            f"{len(shown.examples)} {shown.split} examples, {shown.right} right")
    line = f"Example pages: [{INDEX}]({url}) ({said}; pictures, answers and attention; filters and sorting)"
    set_note_line(uri, run_id, f"[{INDEX}]", line, {EXAMPLES_TAG: INDEX, run_tags.EXAMPLES_SUMMARY: said})
    return url


def log_run_examples(uri: str, run_id: str, run_name: str, cfg, data, checkpoint_dir: Path) -> str | None:
    """The end of a run: `cfg.examples.count` examples with the run's final model (the selected weights of
    its final checkpoint folder) on its own data, logged into the run: a fine-tuning run's examples of
    `cfg.examples.split`, a pretraining run's QA questions of its store's minival split. Nothing when the
    count is 0. Where the time went is logged too (`time/examples/{model,predict,pages,log}_s`). Returns
    the index's address in the MLflow UI."""
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
    kind_name = kind_of_task(source.kind)
    if kind_name is None:
        raise ExamplesError(f"run {run_id!r}: a {source.kind} model has no example pages")
    kind = KINDS[kind_name]
    split = getattr(conf, "split", kind.default_split)
    notes: list[str] = []
    examples, size = kind.collect(source.model, data, split, conf.count, notes, config=source.config)
    shown = Shown(run_id, run_name, kind_name, source.kind, split, str(data.path), examples, size, notes)
    lap("predict")
    rendered = kind.render(shown)
    with tempfile.TemporaryDirectory(prefix="xmodal-examples-") as tmp:
        write_rendered(rendered, Path(tmp))
        lap("pages")
        url = log_pages(uri, run_id, Path(tmp), shown, rendered)
        lap("log")
    tracking.log_metrics(uri, run_id, spent)
    return url


def end_of_run_pages(plan, folder: Path, data) -> bool:
    """A training run's example pages, logged into it before it ends (`engine.AfterRun`): fine-tuning
    runs, pretraining runs with the QA task and MulT runs (on sentiment stores: `mult_job.prepare`), whose
    `examples.count` is above 0; a job's command line
    (`cli.job_main`) and a sweep's trials (`sweep.runner.run_trial`) alike. Returns whether it made them."""
    cfg = plan.config
    if getattr(getattr(cfg, "examples", None), "count", 0) == 0:
        return False
    if hasattr(cfg, "tasks") and not cfg.tasks.qa:
        return False
    log_run_examples(plan.tracking_uri, plan.run_id, plan.run_name, cfg, data, folder)
    return True
