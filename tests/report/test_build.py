"""A report built from the command line (jobs/report.py): the table printed, the files written, and
bad requests as one line that write nothing. The command runs as a process of its own once (its real
path); the other requests run its `main` in this process (each process spent seconds importing MLflow,
pandas and matplotlib), from the same working directory and environment."""

from __future__ import annotations

import importlib.util
import subprocess

import pytest
from report_testing import costed_sweep, one_error

from xmodal import tracking
from xmodal_testing import PYTHON, REPO


@pytest.fixture
def report(capsys, monkeypatch):
    """`report(*args, cwd=...)`: jobs/report.py's `main` in this process, run as `report_cli` runs the command
    (in `cwd`, without MLFLOW_TRACKING_URI); its exit code and output, as a finished process's."""
    spec = importlib.util.spec_from_file_location("report_cli_main", REPO / "jobs" / "report.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)

    def run(*args: str, cwd) -> subprocess.CompletedProcess:
        capsys.readouterr()
        with monkeypatch.context() as m:
            m.chdir(cwd)
            try:
                code = module.main(list(args))
            except SystemExit as e:  # argparse's own errors
                code = e.code
        said = capsys.readouterr()
        return subprocess.CompletedProcess(args, code, said.out, said.err)

    return run


def test_the_command_line(store, tmp_path, report):
    uri, _, parent = store
    out = subprocess.run([PYTHON, str(REPO / "jobs" / "report.py"), "--parent-run", parent, "--tracking-uri", uri,
                          "--out", str(tmp_path / "cli")], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "| 2 | True | smooth_l1 |" in out.stdout and (tmp_path / "cli" / "table.csv").exists()
    given = report("--parent-run", parent, "--tracking-uri", uri, "--out", str(tmp_path / "b"), "--no-log",
                   "--baseline", "model.x_layers=1", "tasks.obj_feat=False", cwd=tmp_path)
    assert given.returncode == 0, given.stderr
    # two seeds: the 95 % t interval is mean ± 12.706 · std / √2
    assert "| 1 | False | - | 2 | 0.7000 ± 0.1414 | [-0.5706, 1.9706] | 0.3000 ± 0.1414 | baseline |" in given.stdout
    # a bad request's exit code 2 and one line: test_bad_report_requests_... below (in this process), and the
    # command's own process: tests/test_bad_configs.py (report-* cases)


def test_bad_report_requests_are_one_line_and_write_nothing(store, tmp_path, report):
    """A metric no run logged (it used to write a table of n/a cells), --out naming a file, a trial's
    id given as --parent-run, an unknown run or experiment: one line each, and no report folder, no
    artifact and no new database."""
    uri, _, parent = store
    trial_id = next(r.run_id for r in tracking.child_runs(uri, parent) if r.name == "a0")
    artifacts = tracking.list_artifacts(uri, parent)
    line = one_error(report("--parent-run", parent, "--tracking-uri", uri, "--metric", "eval/bleu",
                                  "--out", str(tmp_path / "r"), cwd=tmp_path))
    assert "--metric 'eval/bleu'" in line and "eval/match_acc" in line and "eval/loss" in line
    (tmp_path / "taken").write_text("mine")
    line = one_error(report("--parent-run", parent, "--tracking-uri", uri, "--out", str(tmp_path / "taken"),
                                  cwd=tmp_path))
    assert "--out" in line and "taken" in line and "is a file" in line
    assert (tmp_path / "taken").read_text() == "mine"
    line = one_error(report("--parent-run", trial_id, "--tracking-uri", uri, cwd=tmp_path))
    assert f"--parent-run '{trial_id}' is a trial of sweep 's'" in line and f"--parent-run {parent}" in line
    line = one_error(report("--parent-run", "deadbeef", "--tracking-uri", uri, cwd=tmp_path))
    assert "'deadbeef' not found" in line
    line = one_error(report("--experiment", "nope", "--tracking-uri", uri, cwd=tmp_path))
    assert "experiment 'nope' not found" in line and "xmodal-sweep-demo" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]
    assert tracking.list_artifacts(uri, parent) == artifacts


def test_an_unwritable_out_or_a_baseline_naming_no_row_fails_before_anything_is_written(store, tmp_path, report):
    """--out where nothing can be written (checked before MLflow is opened), and --baseline naming no
    row (it used to write the report without its tests and exit 0): one line each, naming the rows."""
    uri, exp, _ = store
    parent = costed_sweep(uri, tracking.ensure_experiment(uri, "xmodal-sweep-cli-baseline"), "cb",
                          {1: [0.6, 0.62], 2: [0.7, 0.72]})
    artifacts = tracking.list_artifacts(uri, parent)
    line = one_error(report("--parent-run", parent, "--tracking-uri", uri, "--out", "/proc/xmodal-report",
                                  cwd=tmp_path))
    assert "--out: '/proc/xmodal-report' cannot be written" in line
    line = one_error(report("--parent-run", parent, "--tracking-uri", uri, "--baseline", "model.x_layers=3",
                                  cwd=tmp_path))
    assert line == ("error: --baseline model.x_layers=3: matches no row; expected the parameters of exactly one row "
                    "(the rows are: model.x_layers=2 tasks.obj_feat=False; model.x_layers=1 tasks.obj_feat=False)")
    assert list(tmp_path.iterdir()) == [] and tracking.list_artifacts(uri, parent) == artifacts
