"""The pretraining corpus: the sentences of the reference's pretraining JSON files and their answers.

JSON (docs/papers.md#lxmert-data-formats): a list of {"img_id", "sentf": {source: [sentence, ...]},
"labelf": {source: [{answer: score}, ...]}}. Every record needs "labelf" (the reference reads it
unconditionally; `{}` = no questions); a missing one is an error unless allow_missing_labelf (then
counted in the manifest as missing_labelf). `load_pretrain_json` reads and checks a file into a
`Corpus` (compact arrays, not a Python object per sentence); `answer_arrays` gives each question its
known answers with their soft scores (a raw answer is normalised first; variants that normalise alike
keep the highest score). Part of `jobs/ingest.py lxmert` (`xmodal.data.lxmert.ingest`).
"""

from __future__ import annotations

import json
import math
from array import array
from collections.abc import Iterator
from itertools import repeat
from pathlib import Path
from typing import Any

import numpy as np

from xmodal.data.answers import AnswerTable
from xmodal.data.lxmert.tsv import fail


class Corpus:
    """All sentences of the JSON files in compact arrays, so memory is ~100 bytes a sentence, not a
    Python string and dict each: the UTF-8 text in one buffer (until it is tokenised), per sentence
    its image index, whether it is a question and where its raw answers end; the raw answers as ids
    into `raw_answers` with float32 scores. Sentences are numbered in the order they are read."""

    def __init__(self) -> None:
        self.text = bytearray()  # every sentence's UTF-8 bytes, back to back
        self.text_ends = array("q")  # per sentence: end of its bytes in `text`
        self.sent_image = array("i")  # per sentence: index into `image_ids`
        self.question = bytearray()  # per sentence: 1 if it has a label dict (a question), else 0
        self.label_ends = array("q")  # per sentence: end of its entries in raw_ids / raw_scores
        self.raw_ids = array("i")  # per raw answer entry: index into `raw_answers`
        self.raw_scores = array("f")  # per raw answer entry: its score, float32 (as stored)
        self.raw_answers: dict[str, int] = {}  # raw answer string -> id, in first-seen order
        self.image_ids: dict[str, int] = {}  # img_id -> index, in first-seen order
        self.first_file = array("i")  # per image: index into `files` of its first record
        self.first_record = array("q")  # per image: that record's index in its file
        self.files: list[str] = []
        self.missing_labelf = 0  # records without "labelf" taken as having no questions (when allowed)

    def __len__(self) -> int:
        return len(self.text_ends)

    def first_seen(self, image: int) -> str:
        """Where image (an index into `image_ids`) was first seen: "file: record #i (img_id ...)"."""
        img_id = next(k for k, v in self.image_ids.items() if v == image)
        return f"{self.files[self.first_file[image]]}: record #{self.first_record[image]} (img_id {img_id!r})"

    def sentence_batches(self, size: int = 8192) -> Iterator[list[str]]:
        """The sentences as str, `size` at a time (decoded from the buffer only while used)."""
        ends = self.text_ends
        for a in range(0, len(ends), size):
            b = min(a + size, len(ends))
            start = ends[a - 1] if a else 0
            yield [bytes(self.text[s:e]).decode("utf-8")
                   for s, e in zip([start, *ends[a:b - 1]], ends[a:b], strict=True)]

    def sentences(self) -> Iterator[str]:
        for batch in self.sentence_batches():
            yield from batch

    def drop_text(self) -> None:
        """Free the text once it is tokenised."""
        self.text = bytearray()
        self.text_ends = array("q", [])

    def images(self) -> tuple[np.ndarray, np.ndarray]:
        """(order, offsets): image k's sentences are order[offsets[k]:offsets[k + 1]], in reading order."""
        sent_image = np.frombuffer(self.sent_image, dtype=np.int32) if len(self.sent_image) else \
            np.zeros(0, np.int32)
        order = np.argsort(sent_image, kind="stable").astype(np.int64)
        offsets = np.zeros(len(self.image_ids) + 1, dtype=np.int64)
        np.cumsum(np.bincount(sent_image, minlength=len(self.image_ids)), out=offsets[1:])
        return order, offsets

    def raw_answer_occurrences(self) -> Iterator[str]:
        """Every raw answer entry's string (each question's candidates once), for `AnswerTable.most_frequent`."""
        counts = np.bincount(np.frombuffer(self.raw_ids, np.int32), minlength=len(self.raw_answers)) \
            if len(self.raw_ids) else np.zeros(len(self.raw_answers), np.int64)
        for a, n in zip(self.raw_answers, counts.tolist(), strict=True):
            yield from repeat(a, n)


def load_pretrain_json(path: Path, corpus: Corpus, *, allow_missing_labelf: bool = False) -> set[str]:
    """Parse and check one pretraining JSON file into `corpus` (records of one image are merged);
    returns the file's img_ids. Every record needs "labelf" (`{}` when it has no questions, as the
    reference's files write it); with `allow_missing_labelf` a record without it (or with null) is
    taken as having no questions and counted in `corpus.missing_labelf`. The parsed file is held
    only while it is read (each record is dropped once copied into the corpus's arrays)."""
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except json.JSONDecodeError as e:
        raise fail(f"{path}: line {e.lineno} column {e.colno}", f"not valid JSON ({e.msg})") from None
    except UnicodeDecodeError as e:
        raise fail(str(path), f"not UTF-8 text ({e})") from None
    if not isinstance(data, list):
        raise fail(str(path), f"expected a JSON list of {{\"img_id\", \"sentf\", \"labelf\"}} records, "
                   f"got {type(data).__name__}")
    file_index = len(corpus.files)
    corpus.files.append(str(path))
    img_ids: set[str] = set()
    c = corpus
    for i, rec in enumerate(data):
        data[i] = None  # free the parsed record as soon as it is copied
        where = f"{path}: record #{i}"
        if not isinstance(rec, dict):
            raise fail(where, f"expected an object with img_id, sentf, labelf, got {type(rec).__name__}")
        img_id = rec.get("img_id")
        if not isinstance(img_id, str) or not img_id:
            raise fail(where, f"field 'img_id': expected a non-empty string, got {img_id!r}")
        where = f"{where} (img_id {img_id!r})"
        sentf = rec.get("sentf")
        if not isinstance(sentf, dict):
            raise fail(where, f"field 'sentf': expected {{source: [sentence, ...]}}, got {type(sentf).__name__}")
        labelf = rec.get("labelf")
        if labelf is None:
            if not allow_missing_labelf:
                # Records before this one all had it (else they would have failed), and are dropped already.
                n = 1 + sum(1 for r in data[i + 1:] if isinstance(r, dict) and r.get("labelf") is None)
                got = "is missing" if "labelf" not in rec else "is null"
                raise fail(where, f"field 'labelf' {got}: expected {{source: [{{answer: score}}, ...]}} "
                           f"({{}} for a record without questions); {n} record(s) of this file lack it; "
                           "--allow-missing-labelf takes them as having no questions")
            c.missing_labelf += 1
            labelf = {}
        if not isinstance(labelf, dict):
            raise fail(where, f"field 'labelf': expected {{source: [{{answer: score}}, ...]}}, "
                       f"got {type(labelf).__name__}")
        for source in labelf:
            if source not in sentf:
                raise fail(where, f"field 'labelf.{source}': no sentences 'sentf.{source}' for these labels")
        img_ids.add(img_id)
        image = c.image_ids.setdefault(img_id, len(c.image_ids))
        if image == len(c.first_file):
            c.first_file.append(file_index)
            c.first_record.append(i)
        for source, sents in sentf.items():
            _add_sentences(c, where, source, sents, labelf.get(source), image)
    return img_ids


def _add_sentences(c: Corpus, where: str, source: str, sents: Any, labels: Any, image: int) -> None:
    """One record's sentences of one source (`sentf.<source>`) and, for questions, their label dicts
    (`labelf.<source>`, None: not questions) into the corpus, each checked."""
    if not isinstance(sents, list):
        raise fail(where, f"field 'sentf.{source}': expected a list of sentences, got {type(sents).__name__}")
    if labels is not None:
        if not isinstance(labels, list) or len(labels) != len(sents):
            n = len(labels) if isinstance(labels, list) else type(labels).__name__
            raise fail(where, f"field 'labelf.{source}': expected a list of {len(sents)} label dicts "
                       f"(one per sentence), got {n}")
    for j, s in enumerate(sents):
        if not isinstance(s, str):
            raise fail(where, f"field 'sentf.{source}[{j}]': expected a string, got {s!r:.60}")
        if labels is not None:
            label = labels[j]
            if not isinstance(label, dict):
                raise fail(where, f"field 'labelf.{source}[{j}]': expected {{answer: score}}, "
                           f"got {label!r:.60}")
            for a, sc in label.items():
                if isinstance(sc, bool) or not isinstance(sc, (int, float)) or not math.isfinite(sc) \
                        or sc < 0:
                    raise fail(where, f"field 'labelf.{source}[{j}][{a!r}]': expected a finite score "
                               f">= 0, got {sc!r}")
                c.raw_ids.append(c.raw_answers.setdefault(a, len(c.raw_answers)))
                c.raw_scores.append(float(sc))
        try:
            c.text += s.encode("utf-8")
        except UnicodeEncodeError as e:  # a lone surrogate escaped in the JSON ("\ud800")
            raise fail(where, f"field 'sentf.{source}[{j}]': not encodable as UTF-8 ({e})") from None
        c.text_ends.append(len(c.text))
        c.sent_image.append(image)
        c.question.append(labels is not None)
        c.label_ends.append(len(c.raw_ids))


def answer_arrays(corpus: Corpus, table: AnswerTable) -> tuple[np.ndarray, np.ndarray, np.ndarray, dict[str, int]]:
    """Per-sentence known answers -> (offsets (S+1,), labels (A,), scores (A,), counters). A raw
    answer is looked up after normalisation; variants that normalise alike keep the highest score,
    at the place of the first of them (vectorised: no Python per answer)."""
    num = len(corpus)
    label_of_raw = np.array([-1 if (k := table.index(a)) is None else k for a in corpus.raw_answers] or [-1],
                            dtype=np.int64)
    raw_ids = np.array(corpus.raw_ids, dtype=np.int64)
    labels = label_of_raw[raw_ids]
    scores = np.array(corpus.raw_scores, dtype=np.float32)
    ends = np.array(corpus.label_ends, dtype=np.int64)
    sent = np.repeat(np.arange(num, dtype=np.int64), np.diff(ends, prepend=0))
    known = labels >= 0
    unknown = int((~known).sum())
    sent, labels, scores = sent[known], labels[known], scores[known]
    key = sent * max(len(table), 1) + labels
    order = np.argsort(key, kind="stable")  # stable: each group's first element is its first occurrence
    starts = np.flatnonzero(np.r_[True, key[order][1:] != key[order][:-1]]) if len(order) else order
    best = np.maximum.reduceat(scores[order], starts) + np.float32(0) if len(order) else scores
    first = order[starts]
    back = np.argsort(first, kind="stable")  # groups back into reading order
    first, best = first[back], best[back]
    counts = np.bincount(sent[first], minlength=num)
    question = np.frombuffer(bytes(corpus.question), dtype=np.uint8).astype(bool)
    unanswerable = int((question & (counts == 0)).sum())
    offsets = np.zeros(num + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    return (offsets, labels[first].astype(np.int32), best.astype(np.float32),
            {"unknown_answers": unknown, "unanswerable_questions": unanswerable})
