"""docs/architecture.md names only what exists: every backticked file path resolves to a file or folder
of the repository, every `path.py: name` to a definition in that file, and every backticked dotted
name that starts with a module of `xmodal` (or `xmodal.` itself) to a module and the definitions
inside it. Dotted names that are config keys (`train.best_metric`) are checked against the jobs'
config classes instead. Read as text (ast), nothing imported but the config."""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path

from xmodal_testing import REPO

DOC = REPO / "docs" / "architecture.md"
PACKAGE_ROOT = REPO / "platform"
CODE = re.compile(r"`([^`\n]+)`")
PATH = re.compile(r"^[\w.\-/]+(\.(py|md|toml|yaml|yml|sh|json|txt)|/)$")
DOTTED = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")
# Where a relative path in the doc may start: the repository root, the package, the docs.
PATH_ROOTS = (REPO, PACKAGE_ROOT / "xmodal", PACKAGE_ROOT, REPO / "docs")


@cache
def modules() -> dict[str, Path]:
    """Dotted module name -> file, for every module and package under platform/."""
    out = {}
    for f in PACKAGE_ROOT.rglob("*.py"):
        parts = f.relative_to(PACKAGE_ROOT).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if parts:
            out[".".join(parts)] = f
    return out


@cache
def definitions(file: Path) -> dict[str, set[str]]:
    """Top-level names of a module -> the names defined inside each (a class's methods, fields and
    attributes; empty for functions and variables)."""
    tree = ast.parse(file.read_text())
    out: dict[str, set[str]] = {}
    for node in tree.body:
        for name, inner in _named(node):
            out.setdefault(name, set()).update(inner)
    return out


def _named(node: ast.AST):
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        yield node.name, set()
    elif isinstance(node, ast.ClassDef):
        inner = set()
        for item in node.body:
            inner.update(name for name, _ in _named(item))
        yield node.name, inner
    elif isinstance(node, ast.Assign):
        for target in node.targets:
            for n in ast.walk(target):
                if isinstance(n, ast.Name):
                    yield n.id, set()
    elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
        yield node.target.id, set()
    elif isinstance(node, (ast.Import, ast.ImportFrom)):
        for alias in node.names:
            yield (alias.asname or alias.name).split(".")[0], set()
    elif isinstance(node, (ast.If, ast.Try)):
        for item in node.body:
            yield from _named(item)


def _defined(file: Path, names: list[str]) -> bool:
    if not names:
        return True
    defs = definitions(file)
    if names[0] not in defs:
        return False
    return len(names) == 1 or (len(names) == 2 and names[1] in defs[names[0]])


def _module_candidates(first: str) -> list[str]:
    """Modules whose dotted name is `first` or ends with `.first` (`engine` -> xmodal.runner.engine)."""
    return [m for m in modules() if m == first or m.endswith("." + first)]


@cache
def classes() -> dict[str, list[tuple[set[str], list[str]]]]:
    """Class name -> (what it defines, its bases' names) for each class of that name in the package."""
    out: dict[str, list[tuple[set[str], list[str]]]] = {}
    for f in modules().values():
        for node in ast.parse(f.read_text()).body:
            if isinstance(node, ast.ClassDef):
                inner = {name for item in node.body for name, _ in _named(item)}
                bases = [ast.unparse(b).split(".")[-1].split("[")[0] for b in node.bases]
                out.setdefault(node.name, []).append((inner, bases))
    return out


def _class_has(name: str, attr: str, seen: frozenset = frozenset()) -> bool:
    """`attr` is defined by the class `name` or a base of it; a base from outside the package (pydantic's
    BaseModel, torch's Module) may define anything."""
    for inner, bases in classes().get(name, []):
        if attr in inner:
            return True
        for base in bases:
            if base not in classes() and base not in ("object", "Protocol", "NamedTuple"):
                return True
            if base not in seen and _class_has(base, attr, seen | {name}):
                return True
    return False


def resolves_dotted(text: str) -> bool | None:
    """True/False for a dotted name that starts with a module or a class of the package
    (`RunPlan.epoch_steps`); None when it does not (not code)."""
    parts = text.split(".")
    if parts[0] in classes():
        return len(parts) == 2 and _class_has(parts[0], parts[1])
    candidates = _module_candidates(parts[0])
    if not candidates:
        return None
    for base in candidates:
        for i in range(len(parts), 0, -1):  # the longest module prefix, then definitions inside it
            module = ".".join([base, *parts[1:i]])
            if module in modules() and _defined(modules()[module], parts[i:]):
                return True
    return False


def _found(path: str) -> Path | None:
    """The file or folder a path in the doc names: under one of PATH_ROOTS (a glob too), or, for a bare
    file name (`test_pretrain_job.py`), anywhere in the repository."""
    for root in PATH_ROOTS:
        hits = sorted(root.glob(path)) if "*" in path else [root / path] if (root / path).exists() else []
        if hits:
            return hits[0]
    if "/" not in path:
        return next((f for f in REPO.rglob(path) if ".venv" not in f.parts), None)
    return None


def resolves_path(text: str) -> bool:
    path, _, names = text.partition(": ")
    file = _found(path)
    if file is None:
        return False
    if not names or file.suffix != ".py":
        return True
    names = re.sub(r"\([^)]*\)?", "", names)  # `fit(...)`, `train_step(state, micro_batches)`: the name
    return all(_defined(file, n.strip().split(".")) for n in names.split(",") if n.strip())


@cache
def string_literals() -> set[str]:
    """Every string constant in the package (MLflow tag names such as `xmodal.ranked_step` are code too)."""
    out = set()
    for f in modules().values():
        out.update(n.value for n in ast.walk(ast.parse(f.read_text()))
                   if isinstance(n, ast.Constant) and isinstance(n.value, str))
    return out


@cache
def config_classes() -> list[type]:
    from xmodal.jobs.registry import JOBS

    return [spec.config_class for spec in JOBS.values()]


def is_config_key(text: str) -> bool:
    from xmodal.config.paths import config_has

    return any(config_has(cls, text) for cls in config_classes())


def test_every_name_and_path_the_design_doc_gives_exists():
    text = DOC.read_text()
    checked, wrong = 0, []
    for span in sorted(set(CODE.findall(text))):
        span = span.strip()
        path = span.partition(": ")[0]
        if " " in path or (path.endswith("/") and path.count("/") == 1 and not _found(path)) or \
                ("/" not in path and PATH.match(path) and not path.endswith(".py")):
            continue  # a command line, an artifact's folder (`predictions/`) or file (`meta.json`): not ours
        if PATH.match(path):
            checked += 1
            if not resolves_path(span):
                wrong.append(span)
        elif DOTTED.match(span.removesuffix("()")):
            name = span.removesuffix("()")
            found = resolves_dotted(name)
            if found is None or name in string_literals():
                continue
            checked += 1
            if not found and not is_config_key(name):
                wrong.append(span)
    assert not wrong, f"{DOC.name} names what does not exist: {wrong}"
    assert checked >= 40, f"only {checked} names checked: is the doc still the design document?"


def test_the_design_doc_is_short_enough_to_read():
    lines = len(DOC.read_text().splitlines())
    assert lines <= 420, f"{DOC.name} has {lines} lines; the design fits in about 400 (details go to the topical pages)"
