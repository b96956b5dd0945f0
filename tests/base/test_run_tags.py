"""`xmodal.base.run_tags` owns every MLflow tag name: no "xmodal." tag name is spelled anywhere else in
platform/, and no two of its constants name the same tag."""

from __future__ import annotations

import ast
from pathlib import Path

from xmodal.base import run_tags
from xmodal_testing import REPO

PLATFORM = REPO / "platform"
RUN_TAGS = PLATFORM / "xmodal" / "base" / "run_tags.py"

# Strings starting with "xmodal." that are not tag names, each with the reason it may stay where it is.
NOT_TAGS = {
    "xmodal.data.mult.synthetic": "a MulT store manifest's `generator` (the module that wrote it)",
    "xmodal.shard": "a feature shard's Parquet footer key (data/lxmert/feature_writer.py: META)",
    "xmodal.tracking": "a module the tracking benchmark's writer processes import in advance",
    "xmodal.tracking needs mlflow: pip install 'mlflow>=3'": "an error message naming the module",
}


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring constants (prose, not names)."""
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                found.add(id(first.value))
    return found


def xmodal_strings(root: Path, base: Path = REPO) -> list[tuple[str, int, str]]:
    """(file relative to `base`, line, string) of every string constant, f-string parts included,
    that starts with "xmodal.", outside run_tags.py and docstrings; in file and line order."""
    out = []
    for path in sorted(root.rglob("*.py")):
        if path == RUN_TAGS:
            continue
        tree = ast.parse(path.read_text(), filename=str(path))
        skip = _docstrings(tree)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("xmodal.")
                    and id(node) not in skip):
                out.append((path.relative_to(base).as_posix(), node.lineno, node.value))
    return sorted(out)


def test_no_xmodal_tag_name_is_written_outside_run_tags():
    found = xmodal_strings(PLATFORM)
    stray = [f"{file}:{line}: {value!r}" for file, line, value in found if value not in NOT_TAGS]
    assert not stray, "tag names belong in xmodal/base/run_tags.py (or, if not a tag, in NOT_TAGS here):\n" + "\n".join(stray)
    stale = set(NOT_TAGS) - {value for _, _, value in found}
    assert not stale, f"NOT_TAGS lists strings platform/ no longer has: {sorted(stale)}"


def test_the_scan_sees_plain_strings_and_f_strings_but_not_docstrings(tmp_path):
    (tmp_path / "m.py").write_text('"""xmodal.docstring"""\n'
                                   'A = {"xmodal.plain": 1}\n'
                                   'B = f"xmodal.{A}"\n')
    assert xmodal_strings(tmp_path, tmp_path) == [("m.py", 2, "xmodal.plain"), ("m.py", 3, "xmodal.")]


def test_no_two_constants_name_the_same_tag():
    names: dict[str, list[str]] = {}
    for name, value in vars(run_tags).items():
        if name.isupper() and isinstance(value, str):
            names.setdefault(value, []).append(name)
    assert {v: n for v, n in names.items() if len(n) > 1} == {}


def test_run_tags_imports_nothing():
    """The bottom layer: every module may import it, so it may import none."""
    tree = ast.parse(RUN_TAGS.read_text())
    assert [n.lineno for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))] == []
