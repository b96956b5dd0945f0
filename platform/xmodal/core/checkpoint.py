"""Checkpoints: model, optimizer, schedules, step, data position and RNG state. Imports only torch.

Files are written with `torch.save` and read with `torch.load(weights_only=True)`:
a checkpoint cannot execute code when loaded. `seal` records every file's size and sha256 in the
meta, once the folder is complete; `verify` tells a truncated or corrupted folder from a good one.
"""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path
from typing import Any

import torch
from torch import nn

from xmodal.base.errors import UserError
from xmodal.core.step import TrainState

STATE_FILE = "state.pt"
MODEL_FILE = "model.pt"
META_FILE = "meta.json"


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module under DDP and torch.compile wrappers."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model


def save(directory: str | Path, state: TrainState, meta: dict[str, Any]) -> Path:
    """Write a checkpoint folder. `meta` (JSON) carries the step, data position, config and run ids."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    torch.save(unwrap(state.model).state_dict(), d / MODEL_FILE)
    rng = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1])}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save({
        "optimizer": state.optimizer.state_dict(),
        "scheduler": state.scheduler.state_dict() if state.scheduler is not None else None,
        "plateau": state.plateau.state_dict() if state.plateau is not None else None,
        "step": state.step,
        "rng": rng,
    }, d / STATE_FILE)
    (d / META_FILE).write_text(json.dumps({**meta, "step": state.step}, indent=2, default=str))
    return d


def read_meta(directory: str | Path) -> dict[str, Any]:
    return json.loads((Path(directory) / META_FILE).read_text())


def seal(directory: str | Path) -> None:
    """Record the size and sha256 of every file of the folder but the meta in the meta (`files`).
    Called last, when the folder is complete (after the jobs' `on_checkpoint` files)."""
    d = Path(directory)
    meta = read_meta(d)
    meta["files"] = {f.relative_to(d).as_posix(): {"bytes": f.stat().st_size, "sha256": sha256_of(f)}
                     for f in sorted(d.rglob("*")) if f.is_file() and f.relative_to(d).as_posix() != META_FILE}
    (d / META_FILE).write_text(json.dumps(meta, indent=2, default=str))


def verify(directory: str | Path) -> str | None:
    """Why the checkpoint folder is bad (meta missing or unreadable, a file missing, truncated or
    corrupted), or None. A folder written before checksums (no `files` in its meta) is accepted when
    its model and state files are there."""
    d = Path(directory)
    try:
        meta = read_meta(d)
    except FileNotFoundError:
        return f"{META_FILE} missing"
    except (OSError, ValueError) as e:
        return f"{META_FILE} unreadable: {' '.join(str(e).split())}"
    if not isinstance(meta, dict):
        return f"{META_FILE} holds no JSON object"
    files = meta.get("files")
    if files is None:
        missing = [name for name in (MODEL_FILE, STATE_FILE) if not (d / name).is_file()]
        return f"{', '.join(missing)} missing" if missing else None
    try:
        expected = {str(name): (int(want["bytes"]), str(want["sha256"])) for name, want in files.items()}
    except (AttributeError, KeyError, TypeError, ValueError):
        return f"{META_FILE}: 'files' is malformed"
    for name, (size, digest) in sorted(expected.items()):
        f = d / name
        if not f.is_file():
            return f"{name} missing"
        actual = f.stat().st_size
        if actual != size:
            return f"{name} has {actual} bytes, expected {size} (truncated or overwritten)"
        if sha256_of(f) != digest:
            return f"{name}: sha256 mismatch (corrupted)"
    return None


class CorruptCheckpointError(UserError):
    """A checkpoint folder that fails `verify`."""


class CheckpointWriteError(RuntimeError):
    """Rank 0 could not write a checkpoint to the run's storage (read-only, full, gone). Raised in a
    Train worker; the driver turns it into a `CheckpointStorageError`. `previous` is the last
    checkpoint written, (step, path), or None."""

    def __init__(self, run_name: str, where: str, step: int, error: str,
                 previous: tuple[int, str] | None = None):
        super().__init__(run_name, where, step, error, previous)
        self.run_name, self.where, self.step, self.error, self.previous = run_name, where, step, error, previous

    def __str__(self) -> str:
        return f"writing a checkpoint of run {self.run_name} under {self.where} failed at step {self.step}: {self.error}"

    def advice(self) -> str:
        """The driver's one line: what failed, what is left, how to go on."""
        return f"{self}; {resume_advice(self.run_name, self.previous)}"


def resume_advice(run_name: str, previous: tuple[int, str] | None) -> str:
    """The end of a storage failure's line: the checkpoint left, (step, path) or None, and how to go on."""
    if previous is None:
        left = "no checkpoint was written before: make the storage writable (or free space) and rerun"
    else:
        step, path = previous
        left = (f"the previous checkpoint (step {step}, {path}) is intact: make the storage writable "
                "(or free space) and rerun")
    return f"{left} with mlflow.run_name={run_name} to resume"


class CheckpointStorageError(UserError):
    """A checkpoint could not be written: the job stops; rerun with the same run name to resume."""


def is_storage_failure(error: BaseException) -> bool:
    """An OSError (pyarrow's IO errors are OSErrors) anywhere in the error's chain."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) or type(e).__module__.startswith("pyarrow"):
            return True
        e = e.__cause__ or e.__context__
    return False


def file_mismatch(folder: Path, name: str, record: Any) -> str | None:
    """How the file `name` of a checkpoint folder differs from its `record` in the meta's `files`
    ({bytes, sha256}, `seal`), as the end of a sentence naming the file, or None when it matches.
    Raises ValueError when the record itself is malformed."""
    try:
        size, digest = int(record["bytes"]), str(record["sha256"])
    except (KeyError, TypeError, ValueError):
        raise ValueError(f"{META_FILE} records {name} as {record!r}; expected {{bytes, sha256}}") from None
    actual = (folder / name).stat().st_size
    if actual != size:
        return f"has {actual} bytes, but {META_FILE} records {size}: truncated or changed since the run wrote it"
    found = sha256_of(folder / name)
    if found != digest:
        return (f"does not match the sha256 {META_FILE} records ({found[:12]}..., recorded {digest[:12]}...): "
                "changed or corrupted since the run wrote it")
    return None


def sha256_of(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def load_model_weights(directory: str | Path, model: nn.Module, strict: bool = True) -> None:
    sd = torch.load(Path(directory) / MODEL_FILE, map_location="cpu", weights_only=True)
    unwrap(model).load_state_dict(sd, strict=strict)


def restore(directory: str | Path, state: TrainState, verified: bool = False) -> dict[str, Any]:
    """Load everything `save` wrote into `state`; returns the meta dict. A folder that fails `verify`
    (unless the caller has just `verified` it) raises CorruptCheckpointError."""
    d = Path(directory)
    reason = None if verified else verify(d)
    if reason is not None:
        raise CorruptCheckpointError(f"checkpoint {d} is corrupt ({reason}); resume from an earlier checkpoint "
                                     "of the run or start a new run")
    load_model_weights(d, state.model)
    blob = torch.load(d / STATE_FILE, map_location="cpu", weights_only=True)
    state.optimizer.load_state_dict(blob["optimizer"])
    if state.scheduler is not None and blob["scheduler"] is not None:
        state.scheduler.load_state_dict(blob["scheduler"])
    if state.plateau is not None and blob.get("plateau") is not None:
        state.plateau.load_state_dict(blob["plateau"])  # its best, bad epochs and rates: the same drops after
    state.step = int(blob["step"])
    rng = blob["rng"]
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    random.setstate((3, tuple(rng["python"]), None))
    return read_meta(d)
