"""Every command that writes goes through the one output policy (xmodal.base.outputs; the stores' kind
checks in xmodal.data.atomic are built on it).

`COMMANDS` lists every command line of jobs/ and scripts/: each one that writes with the modules that
write its outputs, and a case where its output is a place the policy refuses (a folder holding the
user's files, an existing file, a URI where it writes locally, a place that cannot be written); each
command that writes nothing with why. The tests prove, for each writer, that:
- the command refuses the case with the policy's own message, exit 2, the user's folder unchanged
  (bad_input_harness: in this process, hashed before and after);
- every module that writes its outputs takes them from the policy (Output, Stage, Scratch, or the
  stores' StagedDir and check_target), so that the case is no accident of one path;
and that no command line of the repository is missing from the list.
"""

from __future__ import annotations

import ast
import json
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from bad_input_harness import Bad, run_bad

from xmodal.base.outputs import RECORD
from xmodal_testing import REPO

# What the policy says, whatever the command: the phrases of xmodal.base.outputs and xmodal.data.atomic.
NOT_WRITTEN_THERE = "did not write there"  # a folder holding files the command did not write
FILE_EXISTS = "already exists; choose a new file"
NOT_A_STORE = "is not a store"
POLICY_NAMES = {"Output", "Stage", "Scratch", "StagedDir", "check_target", "check_output_location",
                "check_writable_dir", "write_record",
                # the benchmarks' own helpers on the policy (xmodal_bench/__init__.py, itself listed below)
                "scratch", "write_results"}


@dataclass
class Command:
    script: str  # jobs/<name>.py, or scripts/<name>.py
    writes: str  # what it writes, and how the policy governs it
    case: Bad | None = None  # its output where the policy refuses it (None: it writes nothing)
    modules: list[str] = field(default_factory=list)  # the modules that write its outputs (under platform/)


LOCAL = {"RAY_ADDRESS": ""}  # a local Ray's checks (the case fails before Ray starts)
SPOOL = json.dumps({"op": "terminated", "uri": "sqlite:///mlflow.db", "run_id": "abc", "status": "FINISHED"}) + "\n"

COMMANDS = [
    Command("jobs/pretrain.py", "Ray's storage (--storage-path, checked as an output place before Ray starts); "
            "the embedded default store (data/atomic.StagedDir via data/manifest.ensure_derived)",
            Bad("pretrain-embedded-store-over-the-users-folder", [], ["data/synthetic_lxmert", NOT_A_STORE],
                files={"data/synthetic_lxmert/notes.txt": "mine"}, env=LOCAL),
            ["xmodal/runner/ray_cluster.py", "xmodal/data/atomic.py"]),
    Command("jobs/finetune.py", "as pretrain.py; the prediction files (jobs/predictions.py: Stage) and example pages "
            "(logged to MLflow from a scratch folder)",
            Bad("finetune-storage-under-a-file", ["--storage-path", "notes/runs"], ["'notes/runs'", "is a file"],
                files={"notes": "mine"}),
            ["xmodal/runner/ray_cluster.py", "xmodal/data/atomic.py", "xmodal/jobs/predictions.py"]),
    Command("jobs/train_mult.py", "as pretrain.py (its embedded default: data/synthetic_mult)",
            Bad("mult-embedded-store-over-the-users-folder", [], ["data/synthetic_mult", NOT_A_STORE],
                files={"data/synthetic_mult/clips.pkl": "mine"}, env=LOCAL),
            ["xmodal/runner/ray_cluster.py", "xmodal/data/atomic.py"]),
    Command("jobs/sweep.py", "Tune's storage (--storage-path, checked as an output place); the report folder in the "
            "sweep's own folder (report/build.py: Output)",
            Bad("sweep-storage-half-uri", ["space.yaml", "--storage-path", "s3:/bucket/sweeps"], ["slash missing"],
                files={"space.yaml": "job: pretrain\nmetric: eval/loss\nmode: min\nscheduler: {type: fifo}\n"
                                     "parameters:\n  optim.lr: {type: choice, values: [1e-3, 1e-2]}\n"}),
            ["xmodal/runner/ray_cluster.py", "xmodal/report/build.py"]),
    Command("jobs/ingest.py", "stores and sets (data/atomic.StagedDir: kind checks, staged, published with the "
            "output record)",
            Bad("ingest-over-a-store-holding-the-users-file", ["mult-synthetic", "st", "--overwrite"],
                ["not part of the store", "move it out first"],
                files={"st/manifest.json": json.dumps({"kind": "mult", "schema_version": 1}), "st/notes.txt": "mine",
                       f"st/{RECORD}": json.dumps({"command": "store mult", "files": ["manifest.json"]})}),
            ["xmodal/data/atomic.py", "xmodal/data/lxmert/store.py", "xmodal/data/finetune/sets.py"]),
    Command("jobs/export.py", "the export folder (export/__init__.py: Output, Stage)",
            Bad("export-into-the-users-folder", ["--to", "reference", "--checkpoint", "ck", "--out", "o"],
                ["--out", NOT_WRITTEN_THERE], files={"ck": None, "o/notes.txt": "mine"}),
            ["xmodal/export/__init__.py"]),
    Command("jobs/report.py", "the report folder (report/build.py: Output, Stage)",
            Bad("report-into-the-users-folder", ["--experiment", "x", "--out", "r"], ["--out", NOT_WRITTEN_THERE],
                files={"r/draft.md": "mine"}),
            ["xmodal/report/build.py"]),
    Command("jobs/benchmark.py", "result files (xmodal_bench.write_results and --json: Output, file=True), scratch "
            "folders (Scratch, removed however the command ends)",
            Bad("benchmark-json-over-the-users-file", ["lxmert", "--json", "r.json"], ["--json", FILE_EXISTS],
                files={"r.json": "mine"}),
            ["xmodal_bench/__init__.py", "xmodal_bench/lxmert.py", "xmodal_bench/data.py", "xmodal_bench/scale.py"]),
    Command("jobs/replay_tracking.py", "renames the spool FILE to FILE.replayed (an output file: never over one)",
            Bad("replay-over-an-earlier-replayed-file", ["s.jsonl"], ["s.jsonl.replayed", FILE_EXISTS],
                files={"s.jsonl": SPOOL, "s.jsonl.replayed": "the earlier replay"}),
            ["xmodal/tracking/spool.py"]),
    Command("scripts/learning_spread.py", "--out FILE (Output, file=True), written whole at the end",
            Bad("learning-spread-over-the-users-file", ["--seeds", "0", "--out", "spread.jsonl"],
                ["--out", FILE_EXISTS], files={"spread.jsonl": "mine"}),
            ["../scripts/learning_spread.py"]),
    Command("scripts/learning_recipes.py", "--out FILE (Output, file=True), written whole at the end",
            Bad("learning-recipes-over-the-users-file", ["mult", "--seeds", "0", "--out", "runs.jsonl"],
                ["--out", FILE_EXISTS], files={"runs.jsonl": "mine"}),
            ["../scripts/learning_recipes.py"]),
    Command("scripts/reference/recipes.py", "--out FILE (Output, file=True), written whole at the end",
            Bad("reference-recipes-over-the-users-file", ["--mult", "m", "--trainings", "mult", "--out", "r.json"],
                ["--out", FILE_EXISTS], files={"r.json": "mine", **{f"m/{f}": "" for f in (
                    "main.py", "src/train.py", "src/models.py", "modules/transformer.py")}}),
            ["../scripts/reference/recipes.py"]),
    Command("jobs/extract.py", "the feature store or TSV, and its work folder",
            Bad("extract-into-the-users-folder", [".", "out", "--random-weights", "--tiny", "--no-progress"],
                ["OUT", NOT_A_STORE], files={"a.jpg": "x", "out/notes.txt": "mine"}),
            ["xmodal/extract/plan.py", "xmodal/data/lxmert/feature_writer.py"]),
    Command("jobs/examples.py", "the pages folder",
            Bad("examples-into-the-users-folder", ["--run-id", "abc", "--out", "pages"], ["--out", NOT_WRITTEN_THERE],
                files={"pages/index.html": "mine"}),
            ["xmodal/examples/build.py"]),
    Command("scripts/reference/extractor.py", "photographs, weights files, per-image results, the comparison "
            "table (scripts/reference/common.py: output, Output and its stage)",
            Bad("reference-check-photos-into-the-users-folder", ["photos", "ph"], [NOT_WRITTEN_THERE],
                files={"ph/mine.jpg": "mine"}),
            ["../scripts/reference/common.py"]),
    Command("scripts/check_cluster.py", "nothing: it reads a cluster config and prints one line",
            modules=["../scripts/check_cluster.py", "xmodal/runner/cluster_check.py"]),
    Command("scripts/rehearsal_cluster.py", "nothing a user names: network namespaces and their state folder under "
            "/run (named by --prefix, made new, removed by `down`); standard library only by contract, so outside "
            "the package's policy"),
    Command("scripts/import_contracts.py", "nothing: an import-linter contract type, not a command"),
]
WRITERS = [c for c in COMMANDS if c.case is not None]


@pytest.mark.parametrize("command", [pytest.param(c, id=c.script) for c in WRITERS])
def test_each_writer_refuses_what_the_policy_refuses(command, tmp_path, monkeypatch, capsys):
    run_bad(command.script.removeprefix("jobs/"), command.case, tmp_path, monkeypatch, capsys)


def _as_empty_folders(case: Bad) -> Bad:
    """The case with the user's files in the output ("mine") made empty folders of the same names: a
    folder the command did not write is the user's as much as a file, an empty one included."""
    files = {name: None if body == "mine" and "/" in name else body for name, body in case.files.items()}
    return Bad(f"{case.id}-empty-folder", case.argv, case.said, files, case.env, case.setup, case.not_said)


FOLDER_WRITERS = [c for c in WRITERS if any(body == "mine" and "/" in name for name, body in c.case.files.items())]


@pytest.mark.parametrize("command", [pytest.param(c, id=c.script) for c in FOLDER_WRITERS])
def test_each_writer_refuses_a_folder_holding_the_users_empty_folder(command, tmp_path, monkeypatch, capsys):
    run_bad(command.script.removeprefix("jobs/"), _as_empty_folders(command.case), tmp_path, monkeypatch, capsys)


def _names_used(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    return ({a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
            | {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)})


@pytest.mark.parametrize("command", [pytest.param(c, id=c.script) for c in WRITERS])
def test_each_module_that_writes_takes_its_outputs_from_the_policy(command):
    for module in command.modules:
        path = (REPO / "platform" / module).resolve()
        assert POLICY_NAMES & _names_used(path), f"{module} writes {command.script}'s outputs without the policy"


WRITE_CALLS = {"write_text", "write_bytes", "mkdir", "rename", "replace", "rmtree", "unlink", "savefig", "makedirs"}


def test_the_commands_that_write_nothing_make_no_write_call():
    for c in (c for c in COMMANDS if c.case is None and c.modules):
        for module in c.modules:
            tree = ast.parse((REPO / "platform" / module).resolve().read_text())
            calls = {n.func.attr for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)}
            opened = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "open"
                      and any(isinstance(a, ast.Constant) and set(str(a.value)) & set("wax") for a in n.args[1:])]
            assert not (calls & WRITE_CALLS) and not opened, f"{module} ({c.script}) writes: {calls & WRITE_CALLS}"


def _command_lines() -> set[str]:
    """Every .py file of jobs/ and scripts/ at the top, and below them every one that runs as a script (its
    `if __name__ == "__main__":`)."""
    found = set()
    for d in ("jobs", "scripts"):
        for p in sorted((REPO / d).rglob("*.py")):
            if p.parent == REPO / d or 'if __name__ == "__main__":' in p.read_text():
                found.add(p.relative_to(REPO).as_posix())
    return found


def test_every_command_line_of_the_repository_is_listed():
    listed, found = {c.script for c in COMMANDS}, _command_lines()
    assert found == listed, f"unlisted: {sorted(found - listed)}; listed but gone: {sorted(listed - found)}"
