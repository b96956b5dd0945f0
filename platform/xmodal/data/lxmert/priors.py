"""What a pretraining metric reads when the model has learnt nothing cross-modal: the chance level or
the best guess that ignores the image, per minival metric, so that a run's results can be printed
and logged beside it ("matching 0.85, chance 0.50").

Each prior is estimated from the store itself, training statistics applied to minival:
- `match_acc`: max(p, 1 - p) for the mismatch probability p (the label is a coin flip).
- `qa_acc`: the text-only prior: for each minival question, the most frequent train answer of that
  exact question (token sequence), else the most frequent train answer overall.
- `obj_acc`, `attr_acc`: the most frequent train label, scored on minival objects.
- `mlm_acc`: the most frequent train word (special tokens excluded), scored on minival words.
Reads only the label and token columns, from at most `max_images` images per split.
Imports numpy and pyarrow only.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from xmodal.data.lxmert.store import LxmertStore

LABEL_COLUMNS = ["num_boxes", "obj_ids", "attr_ids", "input_ids", "answer_ids", "answer_scores"]


def _labels(store: LxmertStore, split: str, max_images: int) -> dict[str, np.ndarray]:
    """Object, attribute and word labels and (question tokens, top answer) pairs of one split."""
    import pyarrow as pa

    tables, images = [], 0
    for shard in store.manifest.shards.get(split, []):
        tables.append(store.read_table(shard.file, columns=LABEL_COLUMNS))
        images += tables[-1].num_rows
        if images >= max_images:
            break
    t = pa.concat_tables(tables).slice(0, max_images).combine_chunks()
    n = store.manifest.num_objects
    real = np.arange(n)[None, :] < t.column("num_boxes").to_numpy()[:, None]  # (K, N)

    def per_object(name: str) -> np.ndarray:
        return t.column(name).chunk(0).storage.flatten().to_numpy().reshape(-1, n)[real]

    tokens = t.column("input_ids").chunk(0).flatten()  # one fixed-size list per sentence
    ids = tokens.flatten().to_numpy().reshape(len(tokens), -1)  # (S, T)
    answers = t.column("answer_ids").chunk(0).flatten()  # one list per sentence
    scores = t.column("answer_scores").chunk(0).flatten().flatten().to_numpy()
    offsets = answers.offsets.to_numpy().astype(np.int64)
    offsets -= offsets[0]
    values = answers.flatten().to_numpy()
    has_answer = np.diff(offsets) > 0
    top = [offsets[s] + int(np.argmax(scores[offsets[s]:offsets[s + 1]])) for s in np.nonzero(has_answer)[0]]
    specials = np.array(sorted(store.manifest.special_tokens.values()))
    return {"obj": per_object("obj_ids"), "attr": per_object("attr_ids"), "words": ids[~np.isin(ids, specials)],
            "questions": ids[has_answer], "answers": values[np.array(top, dtype=np.int64)]}


def _majority_rate(train: np.ndarray, test: np.ndarray) -> float:
    if len(train) == 0 or len(test) == 0:
        return float("nan")
    values, counts = np.unique(train, return_counts=True)
    return float(np.mean(test == values[np.argmax(counts)]))


def qa_text_prior(train_q: np.ndarray, train_a: np.ndarray, test_q: np.ndarray, test_a: np.ndarray) -> float:
    """Accuracy of answering each test question with the most frequent train answer of the same
    question (token sequence), else the most frequent train answer overall."""
    if len(train_a) == 0 or len(test_a) == 0:
        return float("nan")
    per_question: dict[bytes, Counter] = {}
    for q, a in zip(train_q, train_a, strict=True):
        per_question.setdefault(q.tobytes(), Counter())[int(a)] += 1
    overall = Counter(train_a.tolist()).most_common(1)[0][0]
    guesses = [per_question[q.tobytes()].most_common(1)[0][0] if q.tobytes() in per_question else overall
               for q in test_q]
    return float(np.mean(np.array(guesses) == test_a))


PRIOR_NAMES = {"eval/match_acc": "chance", "eval/qa_acc": "text-only prior", "eval/obj_acc": "majority label",
               "eval/attr_acc": "majority label", "eval/mlm_acc": "most frequent word"}


def pretraining_priors(store: LxmertStore, mismatch_prob: float, max_images: int = 20_000) -> dict[str, float]:
    """{"eval/<metric>": chance level or image-blind prior} for the minival metrics (names: PRIOR_NAMES)."""
    if not store.manifest.shards.get("minival"):
        return {}
    train, test = _labels(store, "train", max_images), _labels(store, "minival", max_images)
    return {
        "eval/match_acc": max(mismatch_prob, 1.0 - mismatch_prob),
        "eval/qa_acc": qa_text_prior(train["questions"], train["answers"], test["questions"], test["answers"]),
        "eval/obj_acc": _majority_rate(train["obj"], test["obj"]),
        "eval/attr_acc": _majority_rate(train["attr"], test["attr"]),
        "eval/mlm_acc": _majority_rate(train["words"], test["words"]),
    }
