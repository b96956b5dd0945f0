"""The detector actor's batches, without Ray: every batch has the same array shapes, whatever it holds."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from xmodal.extract.pipeline import DetectorActor, prepare_blob
from xmodal.extract.spec import DetectorSpec
from xmodal.models.butd.config import DetectorConfig


def _batch(rows: list[dict]) -> pa.Table:
    return pa.Table.from_pylist(rows, schema=pa.schema([
        ("path", pa.string()), ("img_id", pa.string()), ("source", pa.string()), ("size", pa.int64()),
        ("mtime", pa.int64()), ("given", pa.binary()), ("h", pa.int32()), ("w", pa.int32()),
        ("bh", pa.int32()), ("bw", pa.int32()), ("scale", pa.float64()), ("pixels", pa.large_binary()),
        ("reject", pa.string()), ("reject_kind", pa.string())]))


def test_a_batch_of_rejects_has_the_shapes_of_a_batch_of_images():
    """Ray Data stacks the actor's batches into one column: a batch of rejects with narrower features
    made that column ragged and the job failed at its end."""
    actor = DetectorActor(DetectorSpec(DetectorConfig.tiny()))
    image = np.random.default_rng(0).integers(0, 255, (40, 56, 3), dtype=np.uint8)
    blob, scale = prepare_blob(image, actor.detector.cfg.input)
    good = _batch([{"path": "a.jpg", "img_id": "a", "source": "a.jpg", "size": 9, "mtime": 1, "given": b"", "h": 40, "w": 56, "bh": blob.shape[0],
                    "bw": blob.shape[1], "scale": scale, "pixels": blob.tobytes(), "reject": "", "reject_kind": ""}])
    bad = _batch([{"path": p, "img_id": p, "source": p, "size": 0, "mtime": 1, "given": b"", "h": 0, "w": 0, "bh": 0, "bw": 0, "scale": 1.0, "pixels": b"",
                   "reject": "empty file", "reject_kind": "image"} for p in ("b.jpg", "c.jpg")])
    a, b = actor(good), actor(bad)
    assert set(a) == set(b)
    for key in a:
        assert a[key].shape[1:] == b[key].shape[1:] and a[key].dtype == b[key].dtype, key
    assert a["features"].shape == (1, 36, actor.detector.cfg.feature_dim) and a["num_boxes"][0] == 36
    assert list(b["reject"]) == ["empty file"] * 2 and (b["num_boxes"] == 0).all()


def test_an_actor_refuses_weights_other_than_the_file_the_driver_checked(tmp_path):
    """On a cluster each node reads the weights path from its own disk: a copy that differs from the
    file the driver checked and recorded must not give features silently."""
    import hashlib

    import pytest

    from xmodal.models.butd.detector import random_detector
    from xmodal.models.butd.weights import WeightsError, save_in_layout

    path = tmp_path / "w.pkl"
    save_in_layout(random_detector(DetectorConfig.tiny()).state_dict(), "detectron2", path)
    checked = hashlib.sha256(path.read_bytes()).hexdigest()
    spec = DetectorSpec(DetectorConfig.tiny(), weights=str(path), weights_sha256=checked)
    assert DetectorActor(spec).detector.cfg == DetectorConfig.tiny()  # the same file loads
    save_in_layout(random_detector(DetectorConfig.tiny(), seed=1).state_dict(), "detectron2", path)
    with pytest.raises(WeightsError, match=f"{path}: sha256 .* on this node, not the {checked} the driver checked"):
        DetectorActor(spec)


def test_a_cpu_actor_sets_its_torch_threads_from_the_spec():
    """Ray sets OMP_NUM_THREADS=1 in an actor that reserves one CPU; the spec's threads (its share of
    the node's cores) replace that, and a spec without them leaves the process's setting alone."""
    import os

    import torch

    cores = len(os.sched_getaffinity(0))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        DetectorActor(DetectorSpec(DetectorConfig.tiny(), threads=cores))
        assert torch.get_num_threads() == cores
        DetectorActor(DetectorSpec(DetectorConfig.tiny()))
        assert torch.get_num_threads() == cores
        # a share counted in Ray's logical CPUs (a local Ray has at least 4) is capped at the node's cores
        DetectorActor(DetectorSpec(DetectorConfig.tiny(), threads=cores + 4))
        assert torch.get_num_threads() == cores
    finally:
        torch.set_num_threads(before)
