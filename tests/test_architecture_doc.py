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


# ---------------------------------------------------------------- the code blocks

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)
PATH_NAME = re.compile(r"([\w./*-]+\.py): ([A-Za-z_]\w*(?:\.\w+)*)")
TOKEN = re.compile(r"(?<![\w./*-])[A-Za-z_*][\w*]*(?:[./][A-Za-z_*][\w*]*)*/?")
CAMEL = re.compile(r"^[A-Z][a-z0-9]+(?:[A-Z][a-z0-9]*)+$")
LABEL = re.compile(r"^(\S.*?)(?:\s{2,}(.*))?$")  # a trace line: its file (or who runs it), then the steps
# Names of other libraries the blocks give: each must exist there (imported and looked up).
EXTERNAL = {"Tuner": ("ray.tune", "Tuner"), "OptunaSearch": ("ray.tune.search.optuna", "OptunaSearch"),
            "ASHAScheduler": ("ray.tune.schedulers", "ASHAScheduler"),
            "TorchTrainer": ("ray.train.torch", "TorchTrainer"), "TorchTrainer.fit": ("ray.train.torch", "TorchTrainer.fit"),
            "iter_batches": ("ray.data", "Dataset.iter_batches"), "cv2.imread": ("cv2", "imread")}
# Words of the blocks' prose that look like code (the products' own capitals).
PROSE = {"MulT", "OpenCV"}


@cache
def every_name() -> set[str]:
    """Every top-level name of every module of the package, every name a class defines, every module's
    last part (`ray_cluster`)."""
    out = {m.rsplit(".", 1)[-1] for m in modules()}
    for f in modules().values():
        for name, inner in definitions(f).items():
            out.add(name)
            out |= inner
    return out


def external_exists(name: str) -> bool:
    import importlib

    module, attr = EXTERNAL[name]
    obj = importlib.import_module(module)
    for part in attr.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def resolves_code(token: str) -> bool:
    """A name a code block gives: a path (`runner/engine.py`, `examples/`), a path and a name in it
    without `.py` (`core/loop.fit`), a dotted name of the package (`engine.run_job`, `JobSpec.prepare`),
    a name defined anywhere in the package (`check`, `eval_every`) or a string it uses (`RAY_ADDRESS`),
    a config key, or a name of `EXTERNAL`."""
    if token in EXTERNAL:
        return external_exists(token)
    if "/" in token and not token.endswith((".py", "/")):  # core/loop.fit: a module path, then names in it
        path, _, names = token.rpartition("/")
        module, *inside = names.split(".")
        file = _found(f"{path}/{module}.py")
        return file is not None and _defined(file, inside)
    if PATH.match(token) or "*" in token:
        return _found(token) is not None
    if "." in token:
        return bool(resolves_dotted(token)) or token in string_literals() or is_config_key(token)
    return token in every_name() or token in string_literals()


def code_tokens(line: str) -> list[str]:
    """The names of a trace line that are code: a call (`check(`), a path or dotted name, a name with an
    underscore, a CamelCase name; `path.py: name` pairs whole."""
    out = [f"{p}: {n}" for p, n in PATH_NAME.findall(line)]
    line = PATH_NAME.sub(" ", line)
    for m in TOKEN.finditer(line):
        t = m.group()
        if t in PROSE or t[0] == "*":
            continue
        if "/" not in t and PATH.match(t) and not t.endswith(".py"):
            continue  # a file a run writes (`manifest.json`): not ours
        if line[m.end():m.end() + 1] == "(" or "/" in t or "." in t or "_" in t or CAMEL.match(t):
            out.append(t)
    return out


def trace_names(block: str) -> list[tuple[str, str]]:
    """The code names of a trace block (not Python): each line's file, when it is one, and its steps;
    each with the folder of the file its line is about, where a bare file name (`boxes.py`) is looked up
    first."""
    out, here = [], ""
    for line in block.splitlines():
        m = LABEL.match(line)
        if m and not line[0].isspace():
            label, line = m.group(1).strip(), m.group(2) or ""
            here = ""
            if PATH.match(label):
                out.append((label, ""))
                here = label.rpartition("/")[0]
        out += [(t, here) for t in code_tokens(line)]
    return out


def resolves_in_trace(token: str, here: str) -> bool:
    if here and "/" not in token.partition(": ")[0]:  # a bare file name: beside the line's file first
        if resolves_path(f"{here}/{token}") if ": " in token else resolves_code(f"{here}/{token}"):
            return True
    return resolves_path(token) if ": " in token else resolves_code(token)


def python_problems(block: str) -> list[str]:
    """What is wrong in an example Python block: a name used and neither bound in the block nor a builtin;
    an `xmodal` import that does not resolve (unless its module is the example's own new one, named
    after the job its first line's file adds); a keyword a package function does not take; a method or
    attribute a subclass of a package class sets that the class does not have (a spec's hook); an
    attribute of a parameter annotated with a package class (`w: Worker`) that the class does not have."""
    import builtins

    tree = ast.parse(block)
    new = Path(block.splitlines()[0].lstrip("# ").strip()).stem.removesuffix("_job")
    bound = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    bound |= {a.arg for n in ast.walk(tree) if isinstance(n, ast.arguments)
              for a in [*n.posonlyargs, *n.args, *n.kwonlyargs, n.vararg, n.kwarg] if a is not None}
    bound |= {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    imported: dict[str, Path] = {}  # a name imported from an existing module of the package -> its file
    problems = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            bound |= {a.asname or a.name for a in node.names}
            if not node.module.startswith("xmodal"):
                continue
            file = modules().get(node.module)
            if file is None:
                if new not in node.module.split("."):
                    problems.append(f"import from {node.module}: no such module")
                continue
            for a in node.names:
                if _defined(file, [a.name]):
                    imported[a.asname or a.name] = file
                else:
                    problems.append(f"{node.module}.{a.name}: not defined there")
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            if node.id not in bound and not hasattr(builtins, node.id):
                problems.append(f"{node.id}: used, never bound or imported")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in imported:
            takes = parameters(imported[node.func.id], node.func.id)
            problems += [f"{node.func.id}({k.arg}=...): no such parameter" for k in node.keywords
                         if takes is not None and k.arg is not None and k.arg not in takes]
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            typed = {a.arg: a.annotation.id for a in node.args.args
                     if isinstance(a.annotation, ast.Name) and a.annotation.id in imported}
            problems += [f"{n.value.id}.{n.attr}: {typed[n.value.id]} has no {n.attr}" for n in ast.walk(node)
                         if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in typed
                         and not _class_has(typed[n.value.id], n.attr)]
        elif isinstance(node, ast.ClassDef):
            for base in (b.id for b in node.bases if isinstance(b, ast.Name) and b.id in imported):
                for item in node.body:
                    for name, _ in _named(item):
                        if not _class_has(base, name):
                            problems.append(f"{node.name}.{name}: {base} has no {name}")
    return problems


def parameters(file: Path, name: str) -> set[str] | None:
    """The keyword names a function of `file` takes, or a dataclass's fields; None: any (**kwargs)."""
    for node in ast.parse(file.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            a = node.args
            return None if a.kwarg else {x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs]}
        if isinstance(node, ast.ClassDef) and node.name == name:
            return {t.target.id for t in node.body if isinstance(t, ast.AnnAssign) and isinstance(t.target, ast.Name)}
    return None


def test_every_name_the_design_docs_code_blocks_give_exists():
    blocks = FENCE.findall(DOC.read_text())
    wrong, checked = [], 0
    for lang, block in blocks:
        if lang == "python":
            problems = python_problems(block)
            wrong += problems
            checked += 1
            continue
        for token, here in trace_names(block):
            checked += 1
            if not resolves_in_trace(token, here):
                wrong.append(token)
    assert not wrong, f"{DOC.name}'s code blocks name what does not exist: {wrong}"
    assert len(blocks) >= 5 and checked >= 100, f"only {checked} names in {len(blocks)} blocks checked"


def test_the_code_block_check_catches_what_is_not_there():
    # a hook no spec has, a keyword the function does not take, an import of nothing, a name from nowhere
    bad = """# platform/xmodal/jobs/retrieval_job.py
from xmodal.runner.spec import JobSpec, PreparedJob, no_such_helper
from xmodal.models.retrieval import RetrievalModel

class RetrievalJob(JobSpec):
    def setup(self, w: Worker):
        return PreparedJob(cfg=w.cfg, shards=w.shards), RetrievalModel(), undefined_name
"""
    problems = python_problems(bad.replace("PreparedJob,", "PreparedJob, Worker,"))
    assert set(problems) == {"xmodal.runner.spec.no_such_helper: not defined there", "RetrievalJob.setup: JobSpec has no setup",
                             "PreparedJob(shards=...): no such parameter", "undefined_name: used, never bound or imported",
                             "w.shards: Worker has no shards"}
    trace = "runner/engine.py    run -> check(spec) -> spec.setup, connect_now, RunPlan (spec.py: named)\n"
    assert [t for t, here in trace_names(trace) if not resolves_in_trace(t, here)] == ["spec.setup", "connect_now"]
    assert resolves_code("JobSpec.prepare") and not resolves_code("JobSpec.setup")
    assert resolves_code("core/loop.fit") and not resolves_code("core/loop.fits")
    assert resolves_code("TorchTrainer.fit")


def test_the_design_doc_is_short_enough_to_read():
    lines = len(DOC.read_text().splitlines())
    assert lines <= 420, f"{DOC.name} has {lines} lines; the design fits in about 400 (details go to the topical pages)"
