"""One split of a fine-tuning set (xmodal.data.finetune.split): its examples as Arrow and back, the same
arrays, and the checks that keep a bad split from being written."""

from __future__ import annotations

import numpy as np
import pytest

from xmodal.data.finetune.split import (
    FinetuneError,
    FinetuneSplit,
    check_task,
    split_to_table,
    table_to_split,
)


def _qa() -> FinetuneSplit:
    return FinetuneSplit(task="vqa", ids=np.array(["q1", "q2", "q3"], dtype=object),
                         img_ids=np.array(["a", "b", "a"], dtype=object),
                         input_ids=np.arange(12, dtype=np.int32).reshape(3, 4),
                         ans_offsets=np.array([0, 2, 2, 3]), ans_ids=np.array([4, 1, 0], np.int32),
                         ans_scores=np.array([1.0, 0.3, 0.6], np.float32))


def test_a_qa_split_round_trips_and_gives_its_soft_targets():
    sp = _qa()
    sp.check("vqa", num_answers=5)
    back = table_to_split(split_to_table(sp), "vqa")
    for name in ("ids", "img_ids", "input_ids", "ans_offsets", "ans_ids", "ans_scores"):
        np.testing.assert_array_equal(getattr(back, name), getattr(sp, name))
    targets = back.targets(np.array([0, 1, 2]), 5)
    assert targets.shape == (3, 5) and targets[0, 4] == 1.0 and targets[0, 1] == np.float32(0.3)
    assert not targets[1].any() and targets[2, 0] == np.float32(0.6)


def test_an_nlvr2_split_round_trips_with_its_two_images():
    sp = FinetuneSplit(task="nlvr2", ids=np.array(["x-0", "x-1"], dtype=object),
                       img_ids=np.array([["l0", "r0"], ["l1", "r1"]], dtype=object),
                       input_ids=np.ones((2, 4), np.int32), labels=np.array([1, -1], np.int8))
    sp.check("nlvr2")
    back = table_to_split(split_to_table(sp), "nlvr2")
    assert back.img_ids.tolist() == [["l0", "r0"], ["l1", "r1"]] and back.labels.tolist() == [1, -1]


def test_a_bad_split_or_task_is_named():
    with pytest.raises(FinetuneError, match="answer labels outside"):
        _qa().check("vqa train", num_answers=4)
    with pytest.raises(FinetuneError, match="task 'coco': expected one of vqa, gqa, nlvr2"):
        check_task("coco")
