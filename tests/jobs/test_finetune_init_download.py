"""Fine-tuning's `--init run` where the driver's download is not the workers': storage that is a URI
(the driver's copy goes to a scratch folder, not a local folder named `s3:`), and a worker that cannot
see the driver's copy fetching the run's weights itself, each copy checked against the sha256 the run
recorded. Real MLflow (SQLite) and a real sealed checkpoint."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest
import torch

from xmodal import tracking
from xmodal.core import checkpoint as ckpt
from xmodal.jobs.finetune_init import Init, run_weights_here
from xmodal.runner.ray_cluster import init_download_dir


@pytest.fixture
def source_run(tmp_path):
    """A finished run whose `model` artifact is a sealed checkpoint folder (model.pt + meta.json)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id = tracking.create_run(uri, tracking.ensure_experiment(uri, "init"), "pre", {}, {})
    folder = tmp_path / "ckpt"
    folder.mkdir()
    weights = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}
    torch.save(weights, folder / ckpt.MODEL_FILE)
    (folder / ckpt.META_FILE).write_text("{}")
    ckpt.seal(folder)
    tracking.log_artifacts(uri, run_id, folder, "model")
    tracking.set_terminated(uri, run_id, "FINISHED")
    return uri, run_id, weights


def test_object_storage_downloads_to_a_scratch_folder_removed_after(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with init_download_dir("s3://bucket/runs", "ft") as scratch:
        assert scratch.is_absolute() and scratch.is_dir()
        assert Path(tempfile.gettempdir()) in scratch.parents
        (scratch / "x").write_text("downloaded")
    assert not scratch.exists()
    assert list(tmp_path.iterdir()) == []  # no folder named `s3:` in the working directory
    with init_download_dir(str(tmp_path / "runs"), "ft") as local:
        assert local == tmp_path / "runs" / "ft" / "init"


def test_a_worker_that_cannot_see_the_drivers_copy_downloads_and_checks_the_weights(source_run, tmp_path):
    uri, run_id, weights = source_run
    gone = tmp_path / "driver-only" / run_id / "model"  # the driver's copy, on another host
    init = Init("run", str(gone), run_id, tracking_uri=uri)
    before = set(os.listdir(tempfile.gettempdir()))
    with run_weights_here(init) as folder:
        assert folder != gone and (folder / ckpt.MODEL_FILE).is_file()
        got = torch.load(folder / ckpt.MODEL_FILE, weights_only=True)
    assert torch.equal(got["w"], weights["w"])
    assert not folder.exists()
    assert {n for n in set(os.listdir(tempfile.gettempdir())) - before if n.startswith("xmodal-init-")} == set()


def test_a_changed_copy_of_the_weights_is_refused_naming_the_file_and_the_run(source_run, tmp_path):
    uri, run_id, _ = source_run
    copy = tracking.download_artifacts(uri, run_id, "model", tmp_path / "init" / run_id)
    torch.save({"w": torch.zeros(3, 4)}, copy / ckpt.MODEL_FILE)
    with pytest.raises(ckpt.CorruptCheckpointError, match=rf"init.run_id: model.pt of run '{run_id}' in {copy} "
                                                          r"(has \d+ bytes|does not match the sha256)"):
        with run_weights_here(Init("run", str(copy), run_id, tracking_uri=uri)):
            pass
    with run_weights_here(Init("run", str(copy.parent / "elsewhere"), run_id, tracking_uri=uri)) as fresh:
        assert ckpt.file_mismatch(fresh, ckpt.MODEL_FILE, ckpt.read_meta(fresh)["files"][ckpt.MODEL_FILE]) is None
