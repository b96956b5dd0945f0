"""The input blob a decode task makes: the reference's `_get_image_blob` with OpenCV itself; an image too
thin for the network once scaled is a reject there."""

from __future__ import annotations

from pathlib import Path

import cv2
import numpy as np
import pyarrow as pa
import pytest
import torch

from xmodal.extract.pipeline import MIN_SCALED_SIDE, decode_batch, prepare_blob, too_thin
from xmodal.extract.write import IMAGE
from xmodal.models.butd.backbone import Stem
from xmodal.models.butd.config import DetectorConfig
from xmodal.models.butd.detector import random_detector
from xmodal.models.butd.image import PreparedImage, prepare_image, target_size


@pytest.mark.parametrize("size", [(480, 640), (375, 500), (333, 517), (1200, 1600), (400, 1600), (61, 47)])
def test_the_blob_is_the_reference_codes_bit_for_bit(size):
    rng = np.random.default_rng(size[0])
    im = rng.integers(0, 256, (*size, 3), dtype=np.uint8)
    blob, scale = prepare_blob(im, DetectorConfig().input)
    # lib/fast_rcnn/test.py's _get_image_blob, as written there
    im_orig = im.astype(np.float32, copy=True)
    im_orig -= np.array([[[102.9801, 115.9465, 122.7717]]])
    want = cv2.resize(im_orig, None, None, fx=scale, fy=scale, interpolation=cv2.INTER_LINEAR)
    assert blob.dtype == np.float32 and np.array_equal(blob, want)
    assert scale == target_size(*size)[0]


def test_the_generic_resize_is_the_same_blob_where_opencv_has_no_ipp():
    saved = cv2.ipp.useIPP()
    cv2.ipp.setUseIPP(False)
    try:
        im = np.random.default_rng(3).integers(0, 256, (375, 500, 3), dtype=np.uint8)
        blob, scale = prepare_blob(im, DetectorConfig().input)
        generic = prepare_image(torch.from_numpy(im))
        assert generic.scale == scale and np.array_equal(generic.blob.numpy(), blob)
    finally:
        cv2.ipp.setUseIPP(saved)


def _decoded(tmp_path, sizes: dict[str, tuple[int, int]], resize: str, cfg) -> dict[str, dict]:
    """decode_batch over images of these (h, w) sizes, written as files -> name -> its row."""
    paths = []
    for name, (h, w) in sizes.items():
        paths.append(tmp_path / name)
        cv2.imwrite(str(paths[-1]), np.full((h, w, 3), 90, np.uint8))
    batch = pa.table({"path": [str(p) for p in paths], "img_id": [p.stem for p in paths],
                      "given": pa.array([b""] * len(paths), pa.binary())})
    return {Path(r["path"]).name: r for r in decode_batch(batch, resize, cfg).to_pylist()}


@pytest.mark.parametrize("resize", ["opencv", "generic"])
@pytest.mark.parametrize("cfg", [DetectorConfig(), DetectorConfig.tiny()], ids=["full", "tiny"])
def test_an_image_too_thin_for_the_backbone_is_a_reject_not_a_crash(tmp_path, resize, cfg):
    """2 x 4000 scales to 0 x 1000 (cv2.resize raised `!dsize.empty()` in the decode task), 3000 x 3 to
    1000 x 1 (the stem's max pool raised in the actor): both failed the whole run. The thinnest that scales
    to 3 pixels is kept, and the detector runs on it."""
    rows = _decoded(tmp_path, {"wide.png": (2, 4000), "tall.jpg": (3000, 3), "thin_ok.png": (8, 2000),
                               "ok.jpg": (40, 56)}, resize, cfg.input)
    assert rows["wide.png"]["reject"] == (
        "4000x2 pixels (width x height), scaled to 1000x0 for the detector (short side to 600, long side at most "
        "1000): a side under 3 pixels leaves the backbone nothing; expected a less extreme aspect ratio (under 400:1)")
    assert "3x3000 pixels (width x height), scaled to 1x1000 for the detector" in rows["tall.jpg"]["reject"]
    for name in ("wide.png", "tall.jpg"):
        r = rows[name]
        assert r["reject_kind"] == IMAGE and r["pixels"] == b"" and (r["h"], r["w"], r["bh"], r["bw"]) == (0, 0, 0, 0)
    for name, size in (("thin_ok.png", (4, 1000)), ("ok.jpg", (600, 840))):
        r = rows[name]
        assert r["reject"] == "" and r["reject_kind"] == ""
        assert (r["bh"], r["bw"]) == (size if resize == "opencv" else (r["h"], r["w"]))
    # an aspect ratio of exactly 400:1 scales the short side to 2.5, which rounds (half to even) to 2
    assert too_thin(4, 1600, cfg.input) and too_thin(4, 1599, cfg.input) == "" and too_thin(1600, 5, cfg.input) == ""


@pytest.mark.parametrize("cfg", [DetectorConfig(), DetectorConfig.tiny()], ids=["full", "tiny"])
def test_the_thinnest_input_the_backbone_takes_is_the_one_decode_keeps(cfg):
    stem = Stem(cfg.backbone.stem_width, cfg.backbone.bn_eps)
    for h, w in ((MIN_SCALED_SIDE, 64), (64, MIN_SCALED_SIDE)):
        assert min(stem(torch.zeros(1, 3, h, w)).shape[2:]) == 1
        with pytest.raises(RuntimeError, match="output size is too small|Calculated output size"):
            stem(torch.zeros(1, 3, h - (h == MIN_SCALED_SIDE), w - (w == MIN_SCALED_SIDE)))
    if cfg == DetectorConfig.tiny():  # the whole network on it (the full one takes seconds on a CPU)
        det = random_detector(cfg)
        for size in ((MIN_SCALED_SIDE, 1000), (1000, MIN_SCALED_SIDE)):
            blob = torch.zeros(*size, 3)
            assert det.regions([PreparedImage(blob, 1.0, *size)]).num_boxes.shape == (1,)
