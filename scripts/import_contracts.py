"""An import-linter contract type of our own, registered in pyproject.toml (`contract_types`).

`exclusive`: only the named importers (and their submodules) may import the named modules. Unlike
import-linter's `forbidden` type it lists who may, not who may not (a new module is covered the day it
is added), and it can name a subpackage of an external package (`ray.data`, `ray.tune`), which
`forbidden` refuses: import-linter keeps external packages as their top-level name only. So every
module importing the top-level package is parsed (`ast`) for the full names it imports.

`lint-imports` puts the working directory on sys.path, so run it from the repository root.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

from grimp import ImportGraph
from importlinter import Contract, ContractCheck, fields, output


def _imported_names(path: Path) -> list[tuple[int, str]]:
    """(line, dotted name) of everything a source file imports: `import a.b` -> a.b; `from a.b import c`
    -> a.b and a.b.c (c may be a submodule)."""
    tree = ast.parse(path.read_text(), str(path))
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names if alias.name != "*"]
    return out


def _within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


class ExclusiveImportContract(Contract):
    """Only `allowed_importers` (each with its submodules) may import any of `modules` (each with its
    submodules). `modules` may name external packages and their subpackages (`mlflow`, `ray.data`)."""

    modules = fields.ListField(subfield=fields.StringField())
    allowed_importers = fields.ListField(subfield=fields.StringField())

    def check(self, graph: ImportGraph, verbose: bool) -> ContractCheck:
        offences: list[tuple[str, int, str]] = []
        roots = {m.split(".")[0] for m in self.modules}
        for root in sorted(roots):
            if root not in graph.modules:
                continue  # nobody imports it
            for importer in sorted(graph.find_modules_that_directly_import(root, as_package=True)):
                if any(_within(importer, a) for a in self.allowed_importers):
                    continue
                if any(_within(importer, m) for m in self.modules):
                    continue  # the package itself
                spec = importlib.util.find_spec(importer)
                if spec is None or not spec.origin or not spec.origin.endswith(".py"):
                    continue
                for line, name in _imported_names(Path(spec.origin)):
                    if any(_within(name, m) for m in self.modules):
                        offences.append((importer, line, name))
        # One line per import statement: `from ray.data import X` names ray.data and ray.data.X.
        first: dict[tuple[str, int], str] = {}
        for importer, line, name in offences:
            key = (importer, line)
            if key not in first or len(name) < len(first[key]):
                first[key] = name
        found = [(importer, line, name) for (importer, line), name in sorted(first.items())]
        return ContractCheck(kept=not found, metadata={"offences": found})

    def render_broken_contract(self, check: ContractCheck) -> None:
        allowed = ", ".join(self.allowed_importers)
        output.print_error(f"Only {allowed} may import {', '.join(self.modules)}:", bold=True)
        output.new_line()
        for importer, line, name in check.metadata["offences"]:
            output.print_error(f"-   {importer}:{line} imports {name}", bold=False)
        output.new_line()
