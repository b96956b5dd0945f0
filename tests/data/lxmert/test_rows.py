"""An LXMERT store's rows (xmodal.data.lxmert.rows): a block of images with their sentences as Arrow and
back gives the same arrays, sub-blocks and concatenations keep each image's sentences, answers and
source, and a recorded source is made absolute against the images' root."""

from __future__ import annotations

import numpy as np
import pytest

from xmodal.data.errors import StoreError
from xmodal.data.lxmert.rows import ImageBlock, absolute_source, block_to_table, table_to_block

FIELDS = ("img_id", "img_h", "img_w", "num_boxes", "features", "boxes", "obj_ids", "obj_conf", "attr_ids",
          "attr_conf", "sent_offsets", "input_ids", "ans_offsets", "ans_ids", "ans_scores")


def _block(source: list[str | None] | None = None) -> ImageBlock:
    rng = np.random.default_rng(0)
    k, n, f, t = 3, 4, 6, 5
    return ImageBlock(
        img_id=np.array(["a", "b", "c"], dtype=object), img_h=np.array([10, 20, 30], np.int32),
        img_w=np.array([11, 21, 31], np.int32), num_boxes=np.array([4, 2, 3], np.int32),
        features=rng.normal(size=(k, n, f)).astype(np.float16), boxes=rng.uniform(size=(k, n, 4)).astype(np.float32),
        obj_ids=rng.integers(0, 9, (k, n)).astype(np.int32), obj_conf=rng.uniform(size=(k, n)).astype(np.float32),
        attr_ids=rng.integers(0, 5, (k, n)).astype(np.int32), attr_conf=rng.uniform(size=(k, n)).astype(np.float32),
        sent_offsets=np.array([0, 2, 3, 5]), input_ids=rng.integers(0, 50, (5, t)).astype(np.int32),
        ans_offsets=np.array([0, 1, 1, 3, 3, 3]), ans_ids=np.array([7, 2, 4], np.int32),
        ans_scores=np.array([1.0, 0.5, 0.3], np.float32),
        source=None if source is None else np.array(source, dtype=object))


@pytest.mark.parametrize("source", [None, ["/imgs/a.jpg", None, "s3://b/c.jpg"]])
def test_a_block_round_trips_through_arrow(source):
    block = _block(source)
    block.check("block")
    table = block_to_table(block)
    assert ("source" in table.column_names) == (source is not None)
    back = table_to_block(table)
    for name in FIELDS:
        np.testing.assert_array_equal(getattr(back, name), getattr(block, name), err_msg=name)
    assert (back.source is None) if source is None else back.source.tolist() == source


def test_sub_blocks_and_concatenations_keep_each_images_rows():
    block = _block(["/imgs/a.jpg", None, "/imgs/c.jpg"])
    sub = block.take(np.array([2, 0]))
    assert sub.img_id.tolist() == ["c", "a"] and sub.source.tolist() == ["/imgs/c.jpg", "/imgs/a.jpg"]
    np.testing.assert_array_equal(sub.input_ids, block.input_ids[[3, 4, 0, 1]])
    assert sub.ans_ids.tolist() == [7] and sub.sent_offsets.tolist() == [0, 2, 4]
    both = ImageBlock.concat([sub, _block()])  # a block without sources: None for its images
    assert both.source.tolist() == ["/imgs/c.jpg", "/imgs/a.jpg", None, None, None]
    assert ImageBlock.concat([_block(), _block()]).source is None
    bad = _block(["x"])
    with pytest.raises(StoreError, match=r"field 'source' has shape \(1,\), expected \(3,\)"):
        bad.check("rows for train")


def test_a_relative_source_is_joined_to_its_root():
    assert absolute_source("sub/a.jpg", "/data/imgs") == "/data/imgs/sub/a.jpg"
    assert absolute_source("sub/a.jpg", "s3://bucket/imgs/") == "s3://bucket/imgs/sub/a.jpg"
    assert absolute_source("/abs/a.jpg", "/data/imgs") == "/abs/a.jpg"
    assert absolute_source("gs://b/a.jpg", "/data") == "gs://b/a.jpg" and absolute_source("a.jpg", None) == "a.jpg"
