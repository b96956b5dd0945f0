"""Bad input to a command line, run in this process as `python SCRIPT ARGS` runs it (its `__main__` block,
its exit code), in a fresh, otherwise empty folder with the user's files of the case in it, RAY_ADDRESS pointing where nothing listens (a command
that tries to join or start Ray fails loudly) and no MLflow or storage settings from the environment.

A case passes when the command exits 2 with one `error:` line on stderr naming every piece the case
expects (the key, file or flag, the bad value, what is allowed), no traceback, and the folder, hashed
file by file before and after, unchanged: nothing written, nothing of the user's touched. The system's
temporary folder is one of the case's own for the call, and must be empty after it: no scratch left.
"""

from __future__ import annotations

import hashlib
import runpy
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from xmodal_testing import REPO

JOBS = REPO / "jobs"


@dataclass
class Bad:
    id: str
    argv: list[str]
    said: list[str]  # each piece must be on the error line
    files: dict[str, str | bytes | None] = field(default_factory=dict)  # name -> text or bytes; None: a folder
    env: dict[str, str] = field(default_factory=dict)  # set for the call (RAY_ADDRESS "": a local Ray's checks)
    setup: Callable[[Path], None] | None = None  # makes more of the user's files in the folder (a real store)
    not_said: list[str] = field(default_factory=list)  # each must not be on stderr (a value taken as meant)


def sets(*items: str) -> list[str]:
    return [a for item in items for a in ("--set", item)]


def command_path(script: str) -> Path:
    """jobs/<script>, or <script> from the repository's root where it names a folder (scripts/...)."""
    return REPO / script if "/" in script else JOBS / script


def folder_hash(root: Path) -> tuple[str, list[str]]:
    """A sha256 over every entry under `root` (its path, and a file's bytes), and the entries' list."""
    h, names = hashlib.sha256(), []
    for p in sorted(root.rglob("*")):
        rel = p.relative_to(root).as_posix() + ("/" if p.is_dir() else "")
        names.append(rel)
        h.update(rel.encode() + b"\0")
        if p.is_file():
            h.update(hashlib.sha256(p.read_bytes()).digest())
    return h.hexdigest(), names


def make_files(root: Path, files: dict[str, str | bytes | None]) -> None:
    for name, body in files.items():
        p = root / name
        p.parent.mkdir(parents=True, exist_ok=True)
        if body is None:
            p.mkdir(exist_ok=True)
        elif isinstance(body, bytes):
            p.write_bytes(body)
        else:
            p.write_text(body)


# A file of a case whose bytes a test's fixture makes (an MLflow database with runs): `run_bad`'s `given`.
GIVEN = b"<given by the test>"


def run_bad(script: str, case: Bad, tmp_path: Path, monkeypatch, capsys, given: bytes | None = None) -> None:
    """Run `case` against jobs/<script> and assert everything the module's docstring says. `given`: the
    bytes of the case's files that are GIVEN."""
    work, scratch = tmp_path / "work", tmp_path / "tmp"
    work.mkdir()
    scratch.mkdir()
    make_files(work, {k: given if v is GIVEN else v for k, v in case.files.items()})
    if case.setup is not None:
        case.setup(work)
    before = folder_hash(work)
    for name in ("MLFLOW_TRACKING_URI", "XMODAL_STORAGE_PATH"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")
    for name, value in case.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    monkeypatch.chdir(work)
    path = command_path(script)
    monkeypatch.setattr(sys, "argv", [str(path), *case.argv])
    monkeypatch.syspath_prepend(str(path.parent))  # as `python SCRIPT` puts the script's folder first
    capsys.readouterr()
    try:  # the script as `python SCRIPT ARGS` runs it: its `__main__` block, its exit code
        runpy.run_path(str(path), run_name="__main__")
        rc = 0
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    shown = f"$ {script} {' '.join(case.argv)}\n--- rc {rc}\n--- stdout\n{out}\n--- stderr\n{err}"
    assert "Traceback" not in out + err, shown
    assert rc == 2, shown
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, shown
    for piece in case.said:
        assert piece in lines[0] or piece in err, f"{piece!r} not said\n{shown}"
    for piece in case.not_said:
        assert piece not in err, f"{piece!r} said\n{shown}"
    assert folder_hash(work) == before, f"the folder changed: {folder_hash(work)[1]} (was {before[1]})\n{shown}"
    # (torch makes its compiler's per-user cache folder there the first time it is imported in a process)
    left = [p.name for p in scratch.iterdir() if not p.name.startswith("torchinductor_")]
    assert left == [], f"scratch left in the temporary folder: {left}\n{shown}"


def lxmert_store(root: Path, name: str = "lx") -> Path:
    """A small synthetic LXMERT store at root/name, a quarter of its 20 images in minival (a fine-tuning
    set over it takes them as its valid split; it has the tokenizer a fine-tuning set needs)."""
    from xmodal.data.lxmert.synthetic import build_synthetic_store
    from xmodal.data.options import SyntheticLxmertOptions

    build_synthetic_store(root / name, SyntheticLxmertOptions(num_images=20, num_objects=4, feat_dim=4,
                                                              sentences_per_image=2, minival_fraction=0.25))
    return root / name


def vqa_set(root: Path) -> None:
    """An LXMERT store `lx` and a synthetic VQA set `vqa` over it (its manifest names the store's path)."""
    from xmodal.data.finetune.synthetic import build_synthetic_vqa

    build_synthetic_vqa(lxmert_store(root), root / "vqa")
