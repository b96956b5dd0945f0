"""Which checkpoint a run resumes from: the newest intact one in the run's storage folder.

Ray Train registers a checkpoint only when its controller collects the report that carries it; a
worker killed, or a driver stopped, between the copy to storage and that poll leaves a complete
checkpoint on storage that Ray Train does not list. A run therefore resumes from what is on storage,
not from Ray Train's registry: every `checkpoint_*` folder of the run, newest step first, the first
that verifies (`checkpoint.verify`: every file's size and sha256 as sealed). The driver (to say where a
rerun resumes) and every worker (to restore) make the same choice from the same folders.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from xmodal.base.console import say
from xmodal.base.errors import UserError
from xmodal.config.experiment import flatten
from xmodal.core import checkpoint as ckpt

PREFIX = "checkpoint_"
# What a rerun may set otherwise than the run it resumes: where and how the run is tracked, placed and
# stored, its example pages, the testing aids that make workers fail, and its starting weights (`init.*`:
# the checkpoint's weights replace them; a chain's fine-tuning stage is checked before its pretraining run
# exists). Any other key decides the training itself: a checkpoint resumed under another value would
# continue one run as a different one.
RERUN_MAY_CHANGE = ("mlflow.", "scale.storage_path", "scale.max_failures", "scale.placement_strategy",
                    "scale.resources_per_worker", "examples.", "data.store", "init.", "train.fail_at_step",
                    "train.random_faults", "train.fault_seed")
RAY_LIST = "checkpoint_manager_snapshot.json"  # Ray Train's own list of the run's checkpoints


@dataclass(frozen=True)
class Found:
    """The checkpoint chosen: its folder on the filesystem, its step, and its meta as it was listed (read
    once, with the folder's other files verified against it)."""

    fs: Any  # pyarrow.fs.FileSystem
    path: str
    step: int
    meta: dict = field(default_factory=dict, compare=False)

    @property
    def finished(self) -> bool:
        """The run's last checkpoint: a rerun trains nothing."""
        return bool(self.meta.get("finished"))

    def checkpoint(self):
        from ray.train import Checkpoint

        return Checkpoint(path=self.path, filesystem=self.fs)


def run_folder(storage: str, run_name: str) -> tuple[Any, str]:
    """(filesystem, path) of a run's folder under `scale.storage_path` (a local path or a URI)."""
    import pyarrow.fs

    if "://" in storage:
        fs, root = pyarrow.fs.FileSystem.from_uri(storage)
    else:
        fs, root = pyarrow.fs.LocalFileSystem(), storage
    return fs, f"{root.rstrip('/')}/{run_name}"


def newest_intact(fs, folder: str) -> tuple[Found | None, list[tuple[str, str]]]:
    """(the newest checkpoint of the run folder that verifies or None, [(path, why)] of the newer
    folders that did not)."""
    import pyarrow.fs

    try:
        infos = fs.get_file_info(pyarrow.fs.FileSelector(folder, allow_not_found=True))
    except (FileNotFoundError, NotADirectoryError):
        return None, []
    metas = {i.path: _meta(fs, i.path) for i in infos
             if i.type == pyarrow.fs.FileType.Directory and i.base_name.startswith(PREFIX)}
    candidates = sorted(((_step(meta), path) for path, meta in metas.items()),
                        reverse=True)  # highest step first; unreadable metas (-1) last, then by name
    skipped: list[tuple[str, str]] = []
    for step, path in candidates:
        why = _verify(fs, path)
        if why is None:
            return Found(fs, path, step, metas[path]), skipped
        skipped.append((path, why))
    return None, skipped


def resume_point(fs, folder: str, loud: bool = True) -> Found | None:
    """`newest_intact`; `loud`: say which newer folders were skipped and why, and where it resumes."""
    found, skipped = newest_intact(fs, folder)
    if loud:
        for path, why in skipped:
            say(f"[xmodal] checkpoint {path} is corrupt ({why}); skipped")
        if skipped:
            say(f"[xmodal] resuming from {found.path} (step {found.step}), the newest intact checkpoint"
                if found is not None else
                "[xmodal] no checkpoint of the run verifies; starting from scratch")
    return found


def check_same_config(found: Found | None, run_name: str, cfg) -> None:
    """A rerun resumes the run's newest intact checkpoint (`found`, from `newest_intact`): the config its
    meta records must be this one, but for `RERUN_MAY_CHANGE`. Raises UserError naming the first key that
    differs, both values, and how many more differ."""
    recorded = found.meta.get("config") if found is not None else None
    if not isinstance(recorded, dict):
        return
    then, now = flatten(recorded), flatten(cfg)
    differ = [k for k in sorted(then.keys() | now.keys())
              if not k.startswith(RERUN_MAY_CHANGE) and then.get(k, "(not set)") != now.get(k, "(not set)")]
    if not differ:
        return
    k = differ[0]
    more = f" (and {len(differ) - 1} more: {', '.join(differ[1:4])}{', ...' if len(differ) > 4 else ''})" \
        if len(differ) > 1 else ""
    raise UserError(f"mlflow.run_name = {run_name!r}: the run's folder {found.path.rsplit('/', 1)[0]} holds its "
                    f"checkpoint at step {found.step}, trained with {k} = {then.get(k, '(not set)')!r}, but this "
                    f"config has {now.get(k, '(not set)')!r}{more}; a rerun resumes the same run: give the run's "
                    "own settings to continue it, or another --run-name for a new run")


def _verify(fs, path: str) -> str | None:
    from ray.train import Checkpoint

    try:
        with Checkpoint(path=path, filesystem=fs).as_directory() as d:
            return ckpt.verify(d)
    except OSError as e:  # a folder that vanished or cannot be read
        return " ".join(str(e).split())


def _meta(fs, folder: str) -> dict:
    """A checkpoint folder's meta, {} if it cannot be read (missing, truncated, not JSON: verification
    says why)."""
    try:
        with fs.open_input_stream(f"{folder}/{ckpt.META_FILE}") as f:
            meta = json.loads(f.read())
    except Exception:
        return {}
    return meta if isinstance(meta, dict) else {}


def _step(meta: dict) -> int:
    """The meta's step, -1 where it has none (sorted last)."""
    try:
        return int(meta["step"])
    except (KeyError, TypeError, ValueError):
        return -1


def checkpoint_write_error(error: BaseException) -> ckpt.CheckpointWriteError | None:
    """The CheckpointWriteError a worker raised, wherever it sits in what `fit()` raised: Ray Train's
    WorkerGroupError holds each worker's exception (`worker_failures`), a ControllerError its cause."""
    return next((e for e in _chain(error) if isinstance(e, ckpt.CheckpointWriteError)), None)


def controller_write_advice(error: BaseException, storage: str, run_name: str) -> str | None:
    """The driver's one line when Ray Train's controller, not a worker, failed on the run's storage: it
    rewrites its list of the run's checkpoints (`RAY_LIST`) when it registers one, and on a full disk that
    write can fail while a worker's next checkpoint is being copied (the worker's own failure is then not
    what `fit()` raises). None for any other error."""
    failure = next((f for f in _chain(error) if isinstance(getattr(f, "controller_failure", None), BaseException)),
                   None)
    if failure is None or not ckpt.is_storage_failure(failure.controller_failure):
        return None
    try:
        found, _ = newest_intact(*run_folder(storage, run_name))
    except OSError:  # the storage cannot even be listed: the line says no checkpoint is known
        found = None
    text = " ".join(str(failure.controller_failure).split())
    return (f"writing Ray Train's list of the checkpoints of run {run_name} under {storage.rstrip('/')}/{run_name} "
            f"failed: {text}; " + ckpt.resume_advice(run_name, None if found is None else (found.step, found.path)))


def _chain(error: BaseException):
    """The error and every exception it holds: causes, contexts, a controller's or workers' failures."""
    seen: set[int] = set()
    todo: list[Any] = [error]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        todo += [e.__cause__, e.__context__, getattr(e, "controller_failure", None),
                 *(getattr(e, "worker_failures", None) or {}).values()]


def set_aside_unreadable_ray_list(fs, folder: str) -> str | None:
    """Ray Train's list of a run's checkpoints (`RAY_LIST`, rewritten in place at every report) is
    empty or cut short when a stop lands while it is written, or names a checkpoint folder that is gone;
    Ray Train then refuses the rerun (CheckpointManagerInitializationError) although the checkpoints
    themselves are intact. Such a list is moved aside (`<name>.unreadable`): the rerun resumes from the
    newest intact checkpoint as always, and Ray Train starts a new list (the checkpoints of the earlier
    list are kept, never pruned by `train.keep_best`). Returns the line said, None when the list is
    fine or absent."""
    import pyarrow.fs

    path = f"{folder}/{RAY_LIST}"
    if fs.get_file_info(path).type != pyarrow.fs.FileType.File:
        return None
    with fs.open_input_stream(path) as f:
        raw = f.read()
    why = _ray_list_problem(fs, folder, raw)
    if why is None:
        return None
    fs.move(path, f"{path}.unreadable")
    line = (f"[xmodal] Ray Train's list of this run's checkpoints {path} {why}; moved aside to "
            f"{RAY_LIST}.unreadable (the run resumes from the newest intact checkpoint; the checkpoints "
            "that list named are kept)")
    say(line)
    return line


def _ray_list_problem(fs, folder: str, raw: bytes) -> str | None:
    import pyarrow.fs

    if not raw.strip():
        return "is empty (a stop landed while Ray Train wrote it)"
    try:
        state = json.loads(raw)
    except ValueError as e:
        return f"is not JSON ({e}; a stop landed while Ray Train wrote it)"
    results = state.get("checkpoint_results") if isinstance(state, dict) else None
    if not isinstance(results, list):
        return "holds no list of checkpoint_results"
    for r in results:
        name = r.get("checkpoint_dir_name") if isinstance(r, dict) else None
        if not isinstance(name, str) or fs.get_file_info(f"{folder}/{name}").type != pyarrow.fs.FileType.Directory:
            return f"names a checkpoint folder that is not there ({name!r})"
    return None
