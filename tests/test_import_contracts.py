"""The import-linter contract type of our own (scripts/import_contracts.py) on the real import graph."""

from __future__ import annotations

import importlib.util

import pytest

from xmodal_testing import REPO

grimp = pytest.importorskip("grimp", reason="import-linter (test extra) is not installed")


def contract_class():
    spec = importlib.util.spec_from_file_location("import_contracts", REPO / "scripts" / "import_contracts.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ExclusiveImportContract


@pytest.fixture(scope="module")
def graph():
    return grimp.build_graph("xmodal", "xmodal_bench", "xmodal_rehearsal", include_external_packages=True)


def offences(graph, modules, allowed):
    contract = contract_class()("t", {}, {"modules": modules, "allowed_importers": allowed})
    check = contract.check(graph, verbose=False)
    assert check.kept == (not check.metadata["offences"])
    return check.metadata["offences"]


def test_subpackages_of_external_packages_are_told_apart(graph):
    # ray.data, not ray.train: one line per import statement, wherever in the module (lazy imports too)
    found = offences(graph, ["ray.data"], ["xmodal.data.lxmert.pipeline"])
    importers = {i for i, _, _ in found}
    assert "xmodal.data.mult.pipeline" in importers and "xmodal.data.lxmert.pipeline" not in importers
    assert all(name == "ray.data" or name.startswith("ray.data.") for _, _, name in found)
    assert len({(i, line) for i, line, _ in found}) == len(found)
    assert offences(graph, ["ray.data"], ["xmodal.data", "xmodal.extract", "xmodal.runner", "xmodal.jobs", "xmodal.core", "xmodal_bench"]) == []


def test_only_the_allowed_importers_are_let_through(graph):
    importers = {i for i, _, _ in offences(graph, ["mlflow"], ["xmodal.nothing"])}
    assert importers and {i.rpartition(".")[0] for i in importers} == {"xmodal.tracking"}, importers
    assert offences(graph, ["mlflow"], ["xmodal.tracking"]) == []  # a package lets its modules through
    assert offences(graph, ["no_such_package"], []) == []


def test_every_module_of_the_package_is_in_a_layer():
    import re

    import tomllib

    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    layers = next(c for c in contracts if c["type"] == "layers")["layers"]
    named = {m for layer in layers for m in re.findall(r"xmodal\.\w+", layer)}
    package = REPO / "platform" / "xmodal"
    top = {f"xmodal.{p.stem}" for p in package.glob("*.py") if p.stem != "__init__"}
    top |= {f"xmodal.{p.name}" for p in package.iterdir() if (p / "__init__.py").exists()}
    assert top - named == set(), f"modules in no layer of pyproject.toml: {sorted(top - named)}"


def test_the_ray_edges_are_exactly_the_modules_that_import_ray_and_the_design_doc_names_them(graph):
    import tomllib

    contracts = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (edges,) = [c["allowed_importers"] for c in contracts if c["type"] == "exclusive" and c["modules"] == ["ray"]]
    assert offences(graph, ["ray"], edges) == []
    importers = set(graph.find_modules_that_directly_import("ray", as_package=True))
    # no allowance wider than the edges: each one named imports Ray itself (a module that stops needing
    # Ray leaves the list)
    assert all(any(i == e or i.startswith(e + ".") for i in importers) for e in edges), \
        sorted(e for e in edges if not any(i == e or i.startswith(e + ".") for i in importers))
    doc = (REPO / "docs" / "architecture.md").read_text()
    named = [e.removeprefix("xmodal.").replace(".", "/") + ".py" if e.startswith("xmodal.") else e for e in edges]
    assert [n for n in named if f"`{n}`" not in doc] == []
    # and it bites: the console, a leaf every layer uses, is not an edge
    assert "xmodal.base.console" not in edges and offences(graph, ["ray"], [e for e in edges if e != "xmodal.runner.engine"])
