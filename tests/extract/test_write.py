"""The work folder of an extraction (xmodal.extract.chunks.WorkDir): finished chunks and what they hold."""

from __future__ import annotations

import numpy as np
import pytest

from xmodal.extract.chunks import WorkDir
from xmodal.extract.images import ExtractError

FINGERPRINT = {"format": "store", "boxes": [36, 36]}


def opened(out, fmt: str, restart: bool = False) -> WorkDir:
    """The work folder as a run that has started has it."""
    work = WorkDir.find(out, fmt, {**FINGERPRINT, "format": fmt}, restart=restart)
    work.start()
    return work


def regions(ids: list[str], k: int = 3, width: int = 8) -> dict[str, np.ndarray]:
    n = len(ids)
    rng = np.random.default_rng(0)
    return {"img_id": np.array(ids, dtype=object), "img_h": np.full(n, 48), "img_w": np.full(n, 64),
            "num_boxes": np.full(n, k), "features": rng.random((n, k, width), dtype=np.float32),
            "boxes": np.tile(np.array([0, 0, 10, 10], np.float32), (n, k, 1)), "obj_ids": np.ones((n, k), np.int64),
            "obj_conf": np.full((n, k), 0.5, np.float32), "attr_ids": np.zeros((n, k), np.int64),
            "attr_conf": np.full((n, k), 0.5, np.float32)}


@pytest.mark.parametrize("fmt", ["store", "tsv"])
def test_done_names_each_image_and_its_chunk(tmp_path, fmt):
    work = opened(tmp_path / "out", fmt)
    first = work.write(regions(["a", "b"]), 32)
    second = work.write(regions(["c"]), 32)
    assert work.done() == {"a": first.name, "b": first.name, "c": second.name}


@pytest.mark.parametrize("fmt", ["store", "tsv"])
def test_an_image_in_two_chunks_is_refused_naming_both(tmp_path, fmt):
    """Two chunks holding one image would publish it twice (an extraction's driver once wrote a chunk again
    when Ctrl-C came just after its rename): the work folder is refused, not published."""
    work = opened(tmp_path / "out", fmt)
    first = work.write(regions(["a", "b"]), 32)
    second = work.write(regions(["b", "c"]), 32)
    with pytest.raises(ExtractError) as err:
        work.done()
    assert str(err.value) == (f"{work.path}: img_id 'b' is in {first.name} and in {second.name}: the unfinished "
                              "extraction kept here holds an image twice; pass --restart to discard it and start over")
    # --restart discards it
    again = opened(tmp_path / "out", fmt, restart=True)
    assert again.done() == {}
