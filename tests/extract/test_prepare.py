"""The input blob a decode task makes: the reference's `_get_image_blob` with OpenCV itself."""

from __future__ import annotations

import cv2
import numpy as np
import pytest
import torch

from xmodal.extract.pipeline import prepare_blob
from xmodal.models.butd.config import DetectorConfig
from xmodal.models.butd.image import prepare_image, target_size


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
