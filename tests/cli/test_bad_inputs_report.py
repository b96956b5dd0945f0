"""Bad input to jobs/report.py: the sweep or experiment, the metric and baseline, the database, and the
output folder (which must be new, empty or an earlier report's); each refused with one `error:` line,
nothing written, the user's files and database untouched (bad_input_harness)."""

from __future__ import annotations

import json
import shutil

import pytest
from bad_input_harness import GIVEN, Bad, run_bad

from xmodal import tracking
from xmodal.base import run_tags as T

DB = {"mlflow.db": GIVEN}
PARENT = "0" * 32  # replaced by the sweep's parent run id (the database's)
EXP = ["--experiment", "xmodal-sweep-demo"]


@pytest.fixture(scope="module")
def database(tmp_path_factory, mlflow_template) -> tuple[bytes, str]:
    """A database holding one sweep of two trials (its bytes, and the parent run's id)."""
    tmp = tmp_path_factory.mktemp("report-db")
    shutil.copyfile(mlflow_template, tmp / "mlflow.db")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    exp = tracking.ensure_experiment(uri, "xmodal-sweep-demo")
    parent = tracking.create_run(uri, exp, "demo", {}, {T.KIND: "sweep", T.SWEEP: "demo", T.METRIC: "eval/acc",
                                                        T.MODE: "max"})
    for name, layers in (("a", 1), ("b", 2)):
        run = tracking.create_run(uri, exp, name, {}, {T.KIND: "trial", T.SWEEP: "demo", T.TRIAL_ID: name,
                                                       T.ABLATION_KEYS: json.dumps(["model.x_layers"]),
                                                       T.ABLATION + "model.x_layers": str(layers)}, parent)
        tracking.log_metrics(uri, run, {"eval/acc": 0.5, "selected/eval/acc": 0.5, "eval/loss": 0.7}, step=1)
        tracking.set_terminated(uri, run, "FINISHED")
    tracking.set_terminated(uri, parent, "FINISHED")
    return (tmp / "mlflow.db").read_bytes(), parent


REPORT = [
    Bad("no-sweep-named", [], ["one of the arguments --experiment --parent-run is required"]),
    Bad("both-named", [*EXP, "--parent-run", "abc"], ["not allowed with"]),
    Bad("baseline-without-value", [*EXP, "--baseline", "model.x_layers"], ["--baseline 'model.x_layers'",
                                                                           "KEY=VALUE"]),
    Bad("out-holds-the-users-file", [*EXP, "--out", "r"],
        ["--out", "already holds 'draft.md', which report did not write there", "--overwrite"],
        files={"r/draft.md": "my notes"}),
    Bad("out-is-a-uri", [*EXP, "--out", "s3://bucket/reports"], ["--out", "is a URI", "local folder"]),
    Bad("out-half-uri", [*EXP, "--out", "s3:/bucket/reports"], ["--out", "slash missing"]),
    Bad("out-empty", [*EXP, "--out", ""], ["--out ''", "a non-empty value"]),
    Bad("out-is-the-database-folder", [*EXP, "--out", "."], ["--out", "already holds 'mlflow.db'"], files=DB),
    Bad("unknown-experiment", ["--experiment", "nope"], ["'nope'"], files=DB),
    Bad("unknown-parent-run", ["--parent-run", "f" * 32], ["f" * 32], files=DB),
    Bad("parent-run-is-a-trial-name", ["--parent-run", "a"], ["'a'"], files=DB),
    Bad("metric-never-logged", [*EXP, "--metric", "eval/bleu"], ["eval/bleu"], files=DB),
    # the sweep's mode (max) is its eval/acc's: a loss sorted by it would put the worst row first
    Bad("other-metric-without-mode", [*EXP, "--metric", "eval/loss"],
        ["--metric 'eval/loss'", "expected --mode max or --mode min"], files=DB),
    Bad("mode-against-the-sweeps-metric", [*EXP, "--mode", "min"], ["--mode min", "mode max"], files=DB),
    Bad("baseline-unknown-key", [*EXP, "--baseline", "model.depth=2"], ["model.depth"], files=DB),
    Bad("baseline-value-no-row-has", [*EXP, "--baseline", "model.x_layers=7"], ["model.x_layers", "7"], files=DB),
    Bad("default-out-holds-the-users-file", ["--parent-run", PARENT],
        ["--out", "already holds 'mine.txt', which report did not write there"],
        files={**DB, "reports/demo/mine.txt": "mine"}),
    Bad("experiment-empty", ["--experiment", ""], ["--experiment ''", "a non-empty value"], files=DB),
    Bad("metric-empty", [*EXP, "--metric", ""], ["--metric ''", "a non-empty value"], files=DB),
    Bad("tracking-uri-sqlite-without-path", [*EXP, "--tracking-uri", "sqlite://"],
        ["'sqlite://'", "sqlite:///RELATIVE/PATH"]),
    Bad("tracking-uri-missing-file-store", [*EXP, "--tracking-uri", "file:///nonexistent/mlruns"],
        ["/nonexistent/mlruns"]),
    Bad("database-is-truncated", [*EXP], ["mlflow.db"], files={"mlflow.db": b"SQLite format 3\x00" + b"\x00" * 40}),
    Bad("baseline-key-twice", [*EXP, "--baseline", "model.x_layers=1", "model.x_layers=2"],
        ["--baseline: 'model.x_layers' is given twice"], files=DB),
    Bad("out-a-file", [*EXP, "--out", "table.md"], ["--out", "'table.md'", "is a file"], files={"table.md": "x"}),
]


@pytest.mark.parametrize("case", REPORT, ids=[c.id for c in REPORT])
def test_report(case, tmp_path, monkeypatch, capsys, database):
    db, parent = database
    case = Bad(case.id, [parent if a == PARENT else a for a in case.argv], case.said, case.files)
    run_bad("report.py", case, tmp_path, monkeypatch, capsys, given=db)


def test_the_table_holds_twenty_cases_or_more():
    assert len(REPORT) >= 20 and len({c.id for c in REPORT}) == len(REPORT)
