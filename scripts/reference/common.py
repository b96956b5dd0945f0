"""What every reference check shares: a reference checkout's files imported as they are, the numpy the
reference ran under, arguments checked with one `error:` line, and outputs under the project's policy.

- Importing: `import_from(roots)` lets `import x.y` find a checkout's files under `roots`; a Python 2
  file (one Python 3 cannot compile) has its `print` statements rewritten as calls by lib2to3's
  `fix_print` as it is imported, the only change (`REWRITTEN` counts the lines per file).
  `load_file(name, path)` imports one file (a script) the same way. `python2_runtime()` gives Python 3
  what Python 2 code calls: `xrange`, `cPickle`, numpy's removed `np.int` / `np.float`, PyYAML's old
  default loader, `easydict`.
- Arguments: `Checks` turns each bad value into `UserError` naming the option, the value and what is
  expected; `command(main)` prints it as one `error:` line, exit 2 (`xmodal.base.commands.user_errors`).
- Outputs: `output(...)` is `xmodal.base.outputs.Output` (a folder must be new, empty or hold only this
  command's own earlier output, recognised by the record it wrote there; a file must not exist unless
  --overwrite); a command writes into `Output.stage()` and publishes at the end, so nothing is half
  written and nothing of the user's is removed (Ctrl-C in a long run publishes the whole files done:
  `kept_on_interrupt`). `earlier(output)` lists the files of this command's own earlier output there,
  for a run that reuses them.
"""

from __future__ import annotations

import argparse
import builtins
import contextlib
import importlib.abc
import importlib.util
import math
import os
import pickle
import sys
import types
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from xmodal.base.commands import user_errors
from xmodal.base.errors import UserError
from xmodal.base.outputs import Output, read_record

REPO = Path(__file__).resolve().parents[2]
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")


# ============================================================================ arguments


def command(main: Callable[[list[str] | None], int], argv: list[str] | None = None) -> int:
    """Run a check's `main`: a `UserError` is one `error:` line on stderr and exit code 2."""
    return user_errors(lambda: main(argv))


class Parser(argparse.ArgumentParser):
    """argparse, whose own errors (an unknown option, a value of the wrong type) are one `error:` line too."""

    def error(self, message: str):
        self.exit(2, f"error: {self.prog}: {message} (see --help)\n")


def integer(option: str, value: int, low: int, high: int | None = None, meaning: str = "") -> int:
    if value < low or (high is not None and value > high):
        span = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise UserError(f"{option} {value}: expected an integer {span}{meaning}")
    return value


def real(option: str, value: float, low: float, high: float, *, open_low: bool = False) -> float:
    """A finite number in [low, high] (or (low, high] with open_low)."""
    if not math.isfinite(value) or value < low or value > high or (open_low and value == low):
        raise UserError(f"{option} {value}: expected a finite number in {'(' if open_low else '['}{low:g}, {high:g}]")
    return value


def existing_file(option: str, path: Path, what: str) -> Path:
    """A local file that is read: it exists, is a file and is not empty."""
    if not path.exists():
        raise UserError(f"{option} {str(path)!r}: does not exist; expected {what}")
    if path.is_dir():
        raise UserError(f"{option} {str(path)!r}: is a folder; expected {what}")
    if path.stat().st_size == 0:
        raise UserError(f"{option} {str(path)!r}: is empty (0 bytes); expected {what}")
    return path


def existing_folder(option: str, path: Path, what: str, needs: Sequence[str] = ()) -> Path:
    """A local folder that is read, holding each of `needs` (paths relative to it)."""
    if not path.exists():
        raise UserError(f"{option} {str(path)!r}: does not exist; expected {what}")
    if not path.is_dir():
        raise UserError(f"{option} {str(path)!r}: is a file; expected {what}")
    missing = [n for n in needs if not (path / n).exists()]
    if missing:
        raise UserError(f"{option} {str(path)!r}: has no {missing[0]}; expected {what}")
    return path


def images_in(option: str, folder: Path, limit: int = 0) -> list[Path]:
    """The images of a folder (not recursive: .jpg, .jpeg, .png in any case), sorted, the first `limit` (0: all)."""
    existing_folder(option, folder, "a folder of images (.jpg, .jpeg, .png)")
    found = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix.lower() in IMAGE_SUFFIXES)
    if not found:
        raise UserError(f"{option} {str(folder)!r}: holds no image; expected a folder of .jpg, .jpeg or .png files")
    return found[:limit] if limit else found


# ============================================================================ outputs


def output(path: Path, option: str, command_name: str, *, file: bool = False, overwrite: bool | None = None) -> Output:
    """The output policy's check of one output, before any work (`xmodal.base.outputs.Output`)."""
    return Output(path, option, command_name, file=file, overwrite=overwrite)


def earlier(out: Output) -> list[str]:
    """The files this command's own earlier output at `out` holds (its record's list); [] for a new folder."""
    if out.file or not out.path.is_dir():
        return []
    record = read_record(out.path)
    return list(record["files"]) if record is not None and record["command"] == out.command else []


def save_npz(path: Path, **arrays) -> None:
    """An .npz written whole or not at all (under a .part name, then renamed)."""
    part = path.with_name(path.name + ".part")
    with open(part, "wb") as f:
        np.savez(f, **arrays)
    os.replace(part, path)


@contextlib.contextmanager
def kept_on_interrupt(stage):
    """Ctrl-C during a long run publishes the whole files written so far (the record lists them), so that
    the same command goes on from them; any other failure publishes nothing."""
    try:
        yield
    except KeyboardInterrupt:
        for part in stage.tmp.glob("*.part"):
            part.unlink()
        stage.publish()
        print(f"stopped: the images done are kept in {stage.output.path}; the same command goes on from them",
              file=sys.stderr)
        raise


def command_of(folder: Path) -> str | None:
    """The command whose record `folder` holds (None: no record)."""
    record = read_record(folder)
    return None if record is None else record["command"]


# ============================================================================ the numpy the reference ran under


def require_numpy1(why: str) -> None:
    """Refuse numpy 2 (NEP 50 promotes by type where numpy <= 1.x promoted by value)."""
    if int(np.__version__.split(".")[0]) >= 2:
        raise UserError(f"numpy {np.__version__}: the reference needs numpy 1.x ({why}); run with a numpy 1.x "
                        "first on PYTHONPATH, e.g. PYTHONPATH=DIR_WITH_NUMPY_1_26:platform")


def float32_exp_off() -> float:
    """The share of numpy's float32 exp values that are not correctly rounded (numpy's SIMD paths make it 40 %)."""
    probe = (np.random.default_rng(0).standard_normal(100_000) + 1).astype(np.float32)
    return float((np.exp(probe) != np.exp(probe.astype(np.float64)).astype(np.float32)).mean())


# ============================================================================ a checkout's files, Python 2 ones too

REWRITTEN: dict[str, int] = {}  # file -> lines fix_print changed


class _Py2Loader(importlib.abc.SourceLoader):
    def __init__(self, path: str):
        self.path = path

    def get_filename(self, fullname):
        return self.path

    def get_data(self, path):
        source = Path(path).read_text()
        if path != self.path:
            return source.encode()
        try:
            compile(source, path, "exec")
            return source.encode()
        except SyntaxError:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                from lib2to3.refactor import RefactoringTool
            tool = RefactoringTool(["lib2to3.fixes.fix_print"])
            fixed = str(tool.refactor_string(source if source.endswith("\n") else source + "\n", path))
            REWRITTEN[path] = sum(a != b for a, b in zip(source.splitlines(), fixed.splitlines(), strict=False))
            return fixed.encode()

    def path_stats(self, path):
        raise OSError  # no bytecode cache: the source is compiled as rewritten


class _Py2Finder(importlib.abc.MetaPathFinder):
    def __init__(self, roots: list[Path]):
        self.roots = roots

    def find_spec(self, fullname, path=None, target=None):
        parts = fullname.split(".")
        for root in self.roots:
            for candidate in (root.joinpath(*parts).with_suffix(".py"), root.joinpath(*parts, "__init__.py")):
                if candidate.is_file():
                    is_pkg = candidate.name == "__init__.py"
                    return importlib.util.spec_from_file_location(
                        fullname, candidate, loader=_Py2Loader(str(candidate)),
                        submodule_search_locations=[str(candidate.parent)] if is_pkg else None)
        return None


def import_from(roots: list[Path]) -> None:
    """`import x.y` finds x/y.py under `roots` (first match), Python 2 files rewritten as they load."""
    sys.meta_path.insert(0, _Py2Finder(roots))


def load_file(name: str, path: Path) -> types.ModuleType:
    """One file (a script) imported as module `name`, a Python 2 one rewritten as it loads."""
    spec = importlib.util.spec_from_file_location(name, path, loader=_Py2Loader(str(path)))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class EasyDict(dict):
    """easydict's EasyDict (nested dicts become EasyDicts; keys are attributes), with Python 2's dict methods."""

    def __init__(self, d=None, **kw):
        super().__init__()
        for k, v in {**(d or {}), **kw}.items():
            self[k] = v

    def __setitem__(self, k, v):
        if isinstance(v, dict) and not isinstance(v, EasyDict):
            v = EasyDict(v)
        super().__setitem__(k, v)

    def __getattr__(self, k):
        try:
            return self[k]
        except KeyError as e:
            raise AttributeError(k) from e

    def __setattr__(self, k, v):
        self[k] = v

    def iteritems(self):
        return iter(self.items())

    def has_key(self, k):
        return k in self


def python2_runtime() -> None:
    """What Python 2 code of that time calls and Python 3 (and numpy >= 1.24, PyYAML >= 5) lack."""
    import yaml as real_yaml

    builtins.xrange = range
    sys.modules["cPickle"] = pickle
    np.int, np.float = int, float  # removed in numpy 1.24
    easydict = types.ModuleType("easydict")
    easydict.EasyDict = EasyDict
    sys.modules["easydict"] = easydict
    shim = types.ModuleType("yaml")
    shim.__dict__.update({k: getattr(real_yaml, k) for k in dir(real_yaml) if not k.startswith("__")})
    shim.load = lambda stream, Loader=real_yaml.UnsafeLoader: real_yaml.load(stream, Loader=Loader)  # PyYAML < 5
    sys.modules["yaml"] = shim


def stand_in(name: str, **attributes) -> types.ModuleType:
    """A module `name` holding `attributes`, put where `import name` finds it first."""
    module = types.ModuleType(name)
    module.__dict__.update(attributes)
    sys.modules[name] = module
    return module
