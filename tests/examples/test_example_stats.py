"""The summary's counts and McNemar's test of two runs on the same examples."""

from __future__ import annotations

import math

import numpy as np
import pytest

from xmodal.examples.qa import Example
from xmodal.examples.stats import answer_type, by, compare, confusions, mcnemar, question_type


def ex(i: int, text: str, gold: str, pred: str) -> Example:
    return Example(row=i, id=f"q{i}", text=text, tokens=["[CLS]"], pictures=[], gold=[(gold, 1.0)], pred=pred,
                   top=[(pred, 1.0)], score=float(gold == pred), attention=np.zeros((1, 1, 1, 1, 1), np.float32))


def test_mcnemar_exact_for_few_disagreements():
    # b=1, c=6: two-sided exact binomial p = 2 * (C(7,0) + C(7,1)) / 2^7
    assert mcnemar(1, 6) == (pytest.approx(2 * 8 / 128), "exact binomial")
    assert mcnemar(0, 0)[0] == 1.0
    assert mcnemar(5, 5)[0] == 1.0  # capped at 1


def test_mcnemar_chi_square_from_25_disagreements():
    p, test = mcnemar(5, 25)
    assert test.startswith("chi-square")
    assert p == pytest.approx(math.erfc(math.sqrt((20 - 1) ** 2 / 30 / 2)))


def test_the_two_runs_table_adds_up():
    a = [ex(0, "a", "x", "x"), ex(1, "b", "x", "x"), ex(2, "c", "x", "y"), ex(3, "d", "x", "y"), ex(4, "e", "x", "z")]
    b = [ex(0, "a", "x", "x"), ex(1, "b", "x", "y"), ex(2, "c", "x", "x"), ex(3, "d", "x", "x"), ex(4, "e", "x", "y")]
    c = compare(a, b)
    assert (c.both_right, c.only_a, c.only_b, c.both_wrong) == (1, 1, 2, 1)
    assert c.total == 5
    with pytest.raises(ValueError):
        compare(a, b[::-1])


def test_types_and_confusions():
    e = [ex(0, "how many cones are there?", "2", "3"), ex(1, "how many balls?", "1", "1"),
         ex(2, "is there a cube?", "yes", "no"), ex(3, "what color is the cup?", "red", "no"),
         ex(4, "is there a cup?", "yes", "no")]
    assert [question_type(x, "vqa") for x in e[:3]] == ["how many", "how many", "is there"]
    assert [answer_type(x, "vqa") for x in e] == ["number", "number", "yes/no", "other", "yes/no"]
    groups = {g.name: (g.count, g.right) for g in by(e, lambda x: answer_type(x, "vqa"))}
    assert groups == {"number": (2, 1), "yes/no": (2, 0), "other": (1, 0)}
    assert confusions(e)[0] == ("yes", "no", 2)
    assert question_type(ex(5, "the left image has two dogs", "true", "true"), "nlvr2") == "1-8 words"
