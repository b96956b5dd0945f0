"""What the pages count: accuracy by question and answer type, the most frequent confusions, the entropy
of attention rows, and, for two runs on the same examples, the 2x2 table of right and wrong with
McNemar's test and the per-type table of both runs' accuracies. Any example with `right` and `score`
is counted (every kind's); the types are LXMERT's questions'."""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np

NUMBER_WORDS = {"zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"}
LENGTH_BINS = ((1, 8), (9, 12), (13, 16), (17, None))  # NLVR2: statement length in words
EXACT_BELOW = 25  # McNemar: the exact binomial test below this many disagreements, chi-square from it on


def question_type(e: Any, task: str) -> str:
    """VQA and GQA: the question's first two words ("what color", "how many", "is there": VQA's question
    types are such prefixes; the sets here carry no type column); NLVR2: the statement's length."""
    words = re.findall(r"[a-z0-9']+", e.text.lower())
    if task == "nlvr2":
        n = len(words)
        for lo, hi in LENGTH_BINS:
            if n >= lo and (hi is None or n <= hi):
                return f"{lo}-{hi} words" if hi is not None else f"{lo}+ words"
    return " ".join(words[:2]) or "(empty)"


def answer_type(e: Any, task: str) -> str:
    """VQA's answer types from the most-agreed gold answer: yes/no, number, other; NLVR2: the label."""
    if not e.gold:
        return "unlabelled"
    a = e.gold[0][0].lower()
    if task == "nlvr2":
        return a
    if a in ("yes", "no"):
        return "yes/no"
    if a.isdigit() or a in NUMBER_WORDS:
        return "number"
    return "other"


@dataclass
class Group:
    name: str
    count: int
    right: int
    score: float  # mean of the job's scores (VQA: soft accuracy)


def by(examples: list[Any], key) -> list[Group]:
    groups: dict[str, list[Any]] = {}
    for e in examples:
        groups.setdefault(key(e), []).append(e)
    out = [Group(k, len(v), sum(e.right for e in v), sum(e.score for e in v) / len(v)) for k, v in groups.items()]
    return sorted(out, key=lambda g: (-g.count, g.name))


def confusions(examples: list[Any], top: int = 10) -> list[tuple[str, str, int]]:
    """(gold, predicted, count) of the wrong predictions, most frequent first."""
    c = Counter((e.gold[0][0], e.pred) for e in examples if e.gold and not e.right)
    return [(g, p, n) for (g, p), n in sorted(c.items(), key=lambda t: (-t[1], t[0]))[:top]]


@dataclass
class Comparison:
    both_right: int
    only_a: int
    only_b: int
    both_wrong: int
    p_value: float
    test: str  # which test gave p

    @property
    def total(self) -> int:
        return self.both_right + self.only_a + self.only_b + self.both_wrong


def mcnemar(only_a: int, only_b: int) -> tuple[float, str]:
    """McNemar's two-sided p-value of the discordant counts: exact (binomial, p = 1/2) for fewer than
    EXACT_BELOW disagreements, else the chi-square with continuity correction."""
    n = only_a + only_b
    if n == 0:
        return 1.0, "exact binomial"
    if n < EXACT_BELOW:
        k = min(only_a, only_b)
        tail = sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n
        return min(1.0, 2 * tail), "exact binomial"
    chi2 = (abs(only_a - only_b) - 1) ** 2 / n
    return math.erfc(math.sqrt(chi2 / 2)), "chi-square, continuity-corrected"


def row_entropy(m: np.ndarray) -> np.ndarray:
    """The entropy (nats) of each distribution along the last axis (zeros count as nothing): log N for a
    uniform row over N, 0 for one that puts everything on one place."""
    p = np.asarray(m, np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return -np.where(p > 0, p * np.log(p), 0.0).sum(axis=-1)


@dataclass
class PairGroup:
    name: str
    count: int
    a: float  # run A's accuracy on the group (mean score)
    b: float

    @property
    def difference(self) -> float:
        return self.b - self.a


def by_pair(a: list[Any], b: list[Any], key) -> list[PairGroup]:
    """Two runs' accuracies on the same examples, by the group `key` gives (of A's example), largest first."""
    groups: dict[str, list[int]] = {}
    for i, e in enumerate(a):
        groups.setdefault(key(e), []).append(i)
    out = [PairGroup(k, len(v), sum(a[i].score for i in v) / len(v), sum(b[i].score for i in v) / len(v))
           for k, v in groups.items()]
    return sorted(out, key=lambda g: (-g.count, g.name))


def compare(a: list[Any], b: list[Any]) -> Comparison:
    """The 2x2 table of two runs' right and wrong on the same examples (in the same order)."""
    if [e.id for e in a] != [e.id for e in b]:
        raise ValueError("the two runs' examples differ; expected the same examples in the same order")
    pairs = [(x.right, y.right) for x, y in zip(a, b, strict=True)]
    only_a, only_b = pairs.count((True, False)), pairs.count((False, True))
    p, test = mcnemar(only_a, only_b)
    return Comparison(pairs.count((True, True)), only_a, only_b, pairs.count((False, False)), p, test)
