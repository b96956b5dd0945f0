"""The pretraining corpus (xmodal.data.lxmert.corpus): the sentences of the JSON files in compact arrays,
a few bytes a sentence, and each question's known answers with their soft scores."""

from __future__ import annotations

import json
from pathlib import Path

from xmodal.data.answers import AnswerTable
from xmodal.data.lxmert.corpus import Corpus, answer_arrays, load_pretrain_json


def test_per_sentence_arrays_are_compact(tmp_path: Path):
    recs = [{"img_id": f"img{i}", "sentf": {"c": [f"a red dog number {j}." for j in range(4)], "q": ["is it red?"]},
             "labelf": {"q": [{"yes": 1.0, "no": 0.5}]}} for i in range(2000)]
    p = tmp_path / "s.json"
    p.write_text(json.dumps(recs))
    corpus = Corpus()
    load_pretrain_json(p, corpus)
    n = len(corpus)
    assert n == 10_000
    held = sum(len(a) * a.itemsize for a in (corpus.text_ends, corpus.sent_image, corpus.label_ends,
                                             corpus.raw_ids, corpus.raw_scores)) + len(corpus.question)
    assert held / n < 40 and len(corpus.text) / n < 25  # no Python object per sentence
    assert list(corpus.sentences())[:2] == ["a red dog number 0.", "a red dog number 1."]
    offsets, labels, scores, counts = answer_arrays(corpus, AnswerTable(["yes", "no"]))
    assert offsets[-1] == 4000 and labels[:2].tolist() == [0, 1] and scores[:2].tolist() == [1.0, 0.5]
    assert counts == {"unknown_answers": 0, "unanswerable_questions": 0}
