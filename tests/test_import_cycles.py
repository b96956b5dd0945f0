"""No module of the packages under platform/ (xmodal, xmodal_bench, xmodal_rehearsal) imports another in
a circle, within a package or across them. Read as text (ast): every import counts, those inside
functions and under `if TYPE_CHECKING:` too, since a lazy import that closes a circle hides a layering
the package does not have."""

from __future__ import annotations

import ast
from pathlib import Path

from xmodal_testing import REPO

PLATFORM = REPO / "platform"
PACKAGES = ("xmodal", "xmodal_bench", "xmodal_rehearsal")


def module_files(packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    out = {}
    for package in packages:
        for f in (PLATFORM / package).rglob("*.py"):
            parts = f.relative_to(PLATFORM).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def imports_of(name: str, file: Path, known: set[str]) -> set[str]:
    """The package's modules `name` imports: `import a.b`, `from a.b import c` (c a module or a name
    in a.b), relative imports resolved; a package's own `__init__` counts as the package."""
    package = name if file.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(file.read_text(), str(file))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            targets = [f"{base}.{alias.name}" for alias in node.names] + [base]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `xmodal.core.checkpoint.save` -> xmodal.core.checkpoint
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    out = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    component.append(m)
                    if m == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return out


def import_graph(packages: tuple[str, ...] = PACKAGES) -> dict[str, set[str]]:
    files = module_files(packages)
    known = set(files)
    # A package's __init__ importing its own submodules is how a facade re-exports: not a circle.
    return {name: {t for t in imports_of(name, f, known) if not (f.name == "__init__.py" and t.startswith(name + "."))}
            for name, f in files.items()}


def test_no_import_cycle_inside_the_packages():
    graph = import_graph()
    assert {name.split(".")[0] for name in graph} == set(PACKAGES)  # each package found and scanned
    found = cycles(graph)
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


def test_the_cycle_finder_finds_a_cycle_and_a_lazy_import_counts(tmp_path):
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert cycles(graph) == [["a", "b", "c"]]
    lazy = tmp_path / "x.py"
    lazy.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import z\n"
                    "def f():\n    from xmodal.y import thing\n")
    assert imports_of("xmodal.x", lazy, {"xmodal.x", "xmodal.y", "xmodal.z"}) == {"xmodal.y", "xmodal.z"}
