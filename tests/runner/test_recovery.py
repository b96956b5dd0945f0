"""Ray Train's list of a run's checkpoints set aside when a rerun could not start from it
(xmodal.runner.recovery.set_aside_unreadable_ray_list); the real rerun after an emptied list is in
tests/runner/test_interrupt.py."""

from __future__ import annotations

import json

import pyarrow.fs
import pytest

from xmodal.base.errors import UserError
from xmodal.config.experiment import load_config
from xmodal.core import checkpoint as ckpt
from xmodal.jobs.pretrain_config import PretrainConfig
from xmodal.runner import recovery


def ray_list(names: list[str]) -> str:
    return json.dumps({"checkpoint_results": [{"checkpoint_dir_name": n} for n in names], "ray_version": "x"})


@pytest.mark.parametrize(("written", "why"), [
    ("", "is empty (a stop landed while Ray Train wrote it)"),
    ('{"checkpoint_results": [{"checkpoint_dir_', "is not JSON ("),
    ("[]", "holds no list of checkpoint_results"),
    (json.dumps({"checkpoint_results": [{"checkpoint_dir_name": "checkpoint_gone"}]}),
     "names a checkpoint folder that is not there ('checkpoint_gone')"),
])
def test_a_list_the_rerun_could_not_start_from_is_moved_aside_and_named(tmp_path, capsys, written, why):
    (tmp_path / "checkpoint_2026-12-07_01-00-00.000000").mkdir()
    (tmp_path / recovery.RAY_LIST).write_text(written)
    line = recovery.set_aside_unreadable_ray_list(pyarrow.fs.LocalFileSystem(), str(tmp_path))
    assert line is not None and f"{tmp_path / recovery.RAY_LIST} {why}" in line
    assert line in capsys.readouterr().out
    assert not (tmp_path / recovery.RAY_LIST).exists()
    assert (tmp_path / f"{recovery.RAY_LIST}.unreadable").read_text() == written  # kept as it was
    assert (tmp_path / "checkpoint_2026-12-07_01-00-00.000000").is_dir()  # the checkpoints untouched


def test_a_good_list_or_none_is_left_as_it_is(tmp_path, capsys):
    fs = pyarrow.fs.LocalFileSystem()
    assert recovery.set_aside_unreadable_ray_list(fs, str(tmp_path / "no-run-yet")) is None
    (tmp_path / "checkpoint_a").mkdir()
    good = ray_list(["checkpoint_a"])
    (tmp_path / recovery.RAY_LIST).write_text(good)
    assert recovery.set_aside_unreadable_ray_list(fs, str(tmp_path)) is None
    assert (tmp_path / recovery.RAY_LIST).read_text() == good
    assert capsys.readouterr().out == ""


def a_checkpoint(folder, cfg, step: int = 8) -> None:
    """A sealed checkpoint folder of `cfg` at `step`, as rank 0 leaves it (its weights a stand-in)."""
    d = folder / "checkpoint_2026-12-07_02-00-00.000000"
    d.mkdir(parents=True)
    (d / "model.pt").write_bytes(b"weights")
    (d / "meta.json").write_text(json.dumps({"step": step, "finished": False, "config": cfg.model_dump(mode="json")}))
    ckpt.seal(d)


def test_a_rerun_resumes_only_the_config_its_checkpoint_was_trained_with(tmp_path):
    base = ["preset=tiny", "mlflow.run_name=r1", "train.max_steps=40"]
    a_checkpoint(tmp_path / "r1", load_config(PretrainConfig, overrides=base))
    found, _ = recovery.newest_intact(*recovery.run_folder(str(tmp_path), "r1"))
    assert found.step == 8 and not found.finished
    assert recovery.newest_intact(*recovery.run_folder(str(tmp_path), "r2")) == (None, [])  # no folder
    recovery.check_same_config(None, "r2", load_config(PretrainConfig, overrides=base))
    # where and how it is tracked, placed and stored, its pages, the testing aids: the same run
    same = load_config(PretrainConfig, overrides=[*base, "mlflow.experiment=elsewhere", "scale.max_failures=3",
                                                  "examples.count=0", "train.fail_at_step=5"])
    recovery.check_same_config(found, "r1", same)
    changed = load_config(PretrainConfig, overrides=[*base, "optim.lr=0.005", "train.max_steps=80"])
    with pytest.raises(UserError) as e:
        recovery.check_same_config(found, "r1", changed)
    assert str(e.value) == (
        f"mlflow.run_name = 'r1': the run's folder {tmp_path / 'r1'} holds its checkpoint at step 8, trained "
        "with optim.lr = 0.002, but this config has 0.005 (and 1 more: train.max_steps); a rerun resumes the "
        "same run: give the run's own settings to continue it, or another --run-name for a new run")


def test_a_controller_that_cannot_write_to_the_storage_gives_one_line_naming_the_checkpoint_left(tmp_path):
    """On a full disk Ray Train's controller can fail rewriting its list of checkpoints while a worker's
    next checkpoint is copied; `fit()` then raises the controller's error, not the worker's. The driver's
    line names the run's folder, the failure and the newest intact checkpoint, like a worker's write error."""
    from ray.train import ControllerError, WorkerGroupError

    a_checkpoint(tmp_path / "full", load_config(PretrainConfig, overrides=["preset=tiny", "mlflow.run_name=full"]))
    full = OSError(28, "No space left on device")
    line = recovery.controller_write_advice(ControllerError(full), str(tmp_path), "full")
    (found,) = (tmp_path / "full").glob("checkpoint_*")
    assert line == (f"writing Ray Train's list of the checkpoints of run full under {tmp_path}/full failed: "
                    f"[Errno 28] No space left on device; the previous checkpoint (step 8, {found}) is intact: "
                    "make the storage writable (or free space) and rerun with mlflow.run_name=full to resume")
    nothing = recovery.controller_write_advice(ControllerError(full), str(tmp_path), "other")
    assert nothing.endswith("failed: [Errno 28] No space left on device; no checkpoint was written before: make the "
                            "storage writable (or free space) and rerun with mlflow.run_name=other to resume")
    # not the storage, or not the controller: the error goes on as it is
    assert recovery.controller_write_advice(ControllerError(ValueError("bad")), str(tmp_path), "full") is None
    assert recovery.controller_write_advice(WorkerGroupError("w", {0: full}), str(tmp_path), "full") is None
    # a worker's own write error, when it is what fit() raises, keeps its own line
    write = ckpt.CheckpointWriteError("full", f"{tmp_path}/full", 12, "disk full", (8, str(found)))
    assert recovery.checkpoint_write_error(WorkerGroupError("w", {0: write})) is write
