"""Checkpoint folders: checksums in the meta (`seal`), `verify`, restore of a bad folder, and the
choice of the folder to resume from (no Ray cluster: local files)."""

from __future__ import annotations

import pickle
import re

import pytest
import torch

from xmodal.base.errors import UserError
from xmodal.core import checkpoint as ckpt
from xmodal.core.runtime import prepare
from xmodal.runner import recovery
from xmodal.runner.recovery import checkpoint_write_error

pytestmark = pytest.mark.usefixtures("one_thread")


def make_state():
    from xmodal.config.experiment import OptimConfig, TrainConfig

    torch.manual_seed(0)
    return prepare(torch.nn.Linear(4, 3), torch.device("cpu"), TrainConfig(), OptimConfig(lr=1e-3), 10)


def sealed(folder, step=3, extra=True):
    state = make_state()
    state.step = step
    ckpt.save(folder, state, {"epoch": 0, "pos": step})
    if extra:  # a file a job's on_checkpoint adds after save (best_model.pt)
        torch.save({"score": 1.0}, folder / "best_model.pt")
    ckpt.seal(folder)
    return folder


def test_a_sealed_folder_verifies_and_lists_every_file(tmp_path):
    d = sealed(tmp_path / "c")
    assert ckpt.verify(d) is None
    assert set(ckpt.read_meta(d)["files"]) == {ckpt.MODEL_FILE, ckpt.STATE_FILE, "best_model.pt"}


@pytest.mark.parametrize("damage, reason", [
    (lambda d: (d / ckpt.MODEL_FILE).write_bytes((d / ckpt.MODEL_FILE).read_bytes()[:100]),
     r"model.pt has 100 bytes, expected \d+ \(truncated"),
    (lambda d: (d / "best_model.pt").write_bytes(bytes([(d / "best_model.pt").read_bytes()[0] ^ 1])
                                                 + (d / "best_model.pt").read_bytes()[1:]),
     r"best_model.pt: sha256 mismatch \(corrupted\)"),
    (lambda d: (d / ckpt.STATE_FILE).unlink(), "state.pt missing"),
    (lambda d: (d / ckpt.META_FILE).unlink(), "meta.json missing"),
    (lambda d: (d / ckpt.META_FILE).write_text('{"step": 3, "fil'), "meta.json unreadable"),
])
def test_verify_names_what_is_wrong(tmp_path, damage, reason):
    d = sealed(tmp_path / "c")
    damage(d)
    why = ckpt.verify(d)
    assert why is not None and re.search(reason, why), why


def test_a_checkpoint_from_before_checksums_is_accepted(tmp_path):
    d = tmp_path / "old"
    ckpt.save(d, make_state(), {"epoch": 0, "pos": 0})  # no seal: as written before checksums
    assert ckpt.verify(d) is None
    (d / ckpt.STATE_FILE).unlink()
    assert ckpt.verify(d) == "state.pt missing"


def test_restore_of_a_corrupt_folder_raises_a_clear_error(tmp_path):
    d = sealed(tmp_path / "c")
    (d / ckpt.MODEL_FILE).write_bytes(b"")
    with pytest.raises(ckpt.CorruptCheckpointError, match=f"checkpoint {d} is corrupt \\(model.pt has 0 bytes"):
        ckpt.restore(d, make_state())
    assert issubclass(ckpt.CorruptCheckpointError, UserError)


def test_resume_takes_the_newest_checkpoint_that_verifies_registered_or_not(tmp_path, capfd):
    """Ray Train's registry is not asked: a complete checkpoint it never registered (a worker or driver
    stopped before the controller's next poll) is resumed from like any other."""
    from pyarrow.fs import LocalFileSystem

    run = tmp_path / "run"
    for name, step in [("checkpoint_a", 4), ("checkpoint_b", 8), ("checkpoint_c", 12), ("checkpoint_d", 16)]:
        sealed(run / name, step)
    (run / "checkpoint_manager_snapshot.json").write_text("{}")  # Ray Train's file: no checkpoint folder
    fs = LocalFileSystem()
    found = recovery.resume_point(fs, str(run))
    assert (found.path, found.step) == (str(run / "checkpoint_d"), 16)
    assert capfd.readouterr().out == ""  # nothing skipped, nothing to say

    (run / "checkpoint_c" / ckpt.MODEL_FILE).write_bytes(b"x")  # step 12 is bad too
    (run / "checkpoint_e").mkdir()  # what a failed copy leaves: no meta (no step: sorted last)
    (run / "checkpoint_d" / ckpt.STATE_FILE).unlink()
    found = recovery.resume_point(fs, str(run))
    assert (found.path, found.step) == (str(run / "checkpoint_b"), 8)
    out = capfd.readouterr().out
    assert f"[xmodal] checkpoint {run / 'checkpoint_d'} is corrupt (state.pt missing); skipped" in out
    assert f"[xmodal] checkpoint {run / 'checkpoint_c'} is corrupt (model.pt has 1 bytes" in out
    assert "checkpoint_e" not in out  # no step to read: tried last, after the one found
    assert f"[xmodal] resuming from {run / 'checkpoint_b'} (step 8), the newest intact checkpoint" in out

    for name in ("checkpoint_a", "checkpoint_b"):
        (run / name / ckpt.META_FILE).unlink()
    assert recovery.resume_point(fs, str(run)) is None
    assert "[xmodal] no checkpoint of the run verifies; starting from scratch" in capfd.readouterr().out
    assert recovery.newest_intact(fs, str(tmp_path / "no_such_run")) == (None, [])


def test_a_write_error_crosses_processes_and_is_found_in_what_fit_raises():
    from ray.train import WorkerGroupError

    e = ckpt.CheckpointWriteError("r1", "/mnt/full/r1", 8, "[Errno 28] No space left on device",
                                  (4, "/mnt/full/r1/checkpoint_x"))
    e = pickle.loads(pickle.dumps(e))  # Ray pickles a worker's exception to the driver
    raised = WorkerGroupError("worker 0 failed", {1: RuntimeError("collateral"), 0: e})
    found = checkpoint_write_error(raised)
    assert found is not None and found.step == 8
    assert found.advice() == (
        "writing a checkpoint of run r1 under /mnt/full/r1 failed at step 8: [Errno 28] No space left on "
        "device; the previous checkpoint (step 4, /mnt/full/r1/checkpoint_x) is intact: make the storage "
        "writable (or free space) and rerun with mlflow.run_name=r1 to resume")
    assert checkpoint_write_error(WorkerGroupError("x", {0: RuntimeError("a bug")})) is None
    assert not ckpt.is_storage_failure(RuntimeError("copy failed"))
    try:
        try:
            raise OSError(28, "No space left on device")
        except OSError as inner:
            raise RuntimeError("upload failed") from inner
    except RuntimeError as outer:
        assert ckpt.is_storage_failure(outer)
