"""The baselines printed beside pretraining results: each prior equals a direct count on the store."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from xmodal.data.lxmert.priors import pretraining_priors, qa_text_prior
from xmodal.data.lxmert.store import LxmertStore


def test_qa_text_prior_answers_each_question_with_its_most_frequent_train_answer():
    q = np.array([[1, 2], [1, 2], [1, 2], [3, 4]])
    a = np.array([7, 7, 8, 9])
    test_q = np.array([[1, 2], [1, 2], [3, 4], [5, 6]])  # the last question is unseen: overall majority (7)
    test_a = np.array([7, 8, 9, 7])
    assert qa_text_prior(q, a, test_q, test_a) == pytest.approx(3 / 4)


def test_priors_match_a_direct_count(small_store: LxmertStore):
    train, val = small_store.read_split("train"), small_store.read_split("minival")
    priors = pretraining_priors(small_store, mismatch_prob=0.3)
    assert priors["eval/match_acc"] == pytest.approx(0.7)

    def majority_rate(tr: np.ndarray, te: np.ndarray) -> float:
        return float(np.mean(te == Counter(tr.tolist()).most_common(1)[0][0]))

    real_tr, real_te = train.visual_mask, val.visual_mask
    assert priors["eval/obj_acc"] == pytest.approx(majority_rate(train.obj_ids[real_tr], val.obj_ids[real_te]))
    assert priors["eval/attr_acc"] == pytest.approx(majority_rate(train.attr_ids[real_tr], val.attr_ids[real_te]))
    special = list(small_store.manifest.special_tokens.values())
    words_tr = train.input_ids[~np.isin(train.input_ids, special)]
    words_te = val.input_ids[~np.isin(val.input_ids, special)]
    assert priors["eval/mlm_acc"] == pytest.approx(majority_rate(words_tr, words_te))

    def questions(block):
        for s in range(block.num_sentences):
            a0, a1 = block.ans_offsets[s], block.ans_offsets[s + 1]
            if a1 > a0:
                yield tuple(block.input_ids[s]), int(block.ans_ids[a0 + np.argmax(block.ans_scores[a0:a1])])

    by_q: dict[tuple, Counter] = {}
    for q, a in questions(train):
        by_q.setdefault(q, Counter())[a] += 1
    overall = Counter(a for _, a in questions(train)).most_common(1)[0][0]
    hits = [a == (by_q[q].most_common(1)[0][0] if q in by_q else overall) for q, a in questions(val)]
    assert priors["eval/qa_acc"] == pytest.approx(np.mean(hits))
    # The synthetic answers follow from the image: a text-only guess is far from perfect.
    assert 0.1 < priors["eval/qa_acc"] < 0.6
