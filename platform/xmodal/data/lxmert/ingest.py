"""Reference LXMERT feature TSV + pretraining JSON -> feature store (`python jobs/ingest.py lxmert OUT ...`).

Inputs (docs/papers.md#lxmert-data-formats):
- TSV, no header, one image a line: img_id, img_h, img_w, objects_id (b64 int64[N]), objects_conf
  (b64 float32[N]), attrs_id (b64 int64[N]), attrs_conf (b64 float32[N]), num_boxes, boxes (b64
  float32[N*4], pixel x1 y1 x2 y2), features (b64 float32[N*2048]).
- JSON: a list of {"img_id", "sentf": {source: [sentence, ...]}, "labelf": {source: [{answer: score}, ...]}}.
  Every record needs "labelf" (the reference reads it unconditionally; `{}` = no questions); a missing
  one is an error unless allow_missing_labelf (then counted in the manifest as missing_labelf).

The split is by image, so no image is in both: the reference's (the images of the minival JSON,
mscoco_minival.json; all its sentences from any file go with it) or a hash of img_id (does not
depend on file order). `choose_minival` decides; the manifest records it (minival_split).

Order of work, so that bad input fails before the expensive part and nothing is left behind:
1. parse and check every JSON record; build the answer table and the tokenizer; tokenise all
   sentences (fixed length, [CLS] ... [SEP]);
2. pre-scan every TSV line's shape without decoding (field count, base64 lengths against num_boxes,
   one feature width): a line cut short, duplicate images, then sentences whose image has no
   features fail here, in that order, before any base64 is decoded;
3. read the used lines in a seeded random order (`order_key`: a keyed hash of img_id; one seek a
   line, so memory stays bounded) or, with order_seed=None, in file order; decode and check each
   line (base64, box count, feature width, finite values, boxes inside the image, label ranges),
   normalise the boxes by the image size, cast features to float16, and append to the train or
   minival shards. The random order makes every shard and row group a mix of the sources (COCO,
   VG), which the reader's blocks (the pool of mismatched sentences) then mix further.
Images with features but no sentence are not stored (counted in the manifest as dropped_images).
QA targets: each question keeps all its known answers with their soft scores (a raw answer is
normalised first; variants that normalise alike keep the highest score); the batch builder draws
one per sample in proportion to the scores (MaskingOptions.qa_target="argmax" takes the best).
"""

from __future__ import annotations

import base64
import binascii
import bisect
import hashlib
import itertools
import json
import math
import zlib
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from itertools import repeat
from pathlib import Path

import numpy as np

from xmodal.base.console import progress_bar, say
from xmodal.base.errors import UserError
from xmodal.data.answers import AnswerTable
from xmodal.data.common import check_target, kind_at, local_target, open_parquet, read_manifest_json
from xmodal.data.lxmert.store import (
    KIND,
    ImageBlock,
    ImageOrder,
    LxmertStore,
    MinivalSplit,
    StoreWriter,
    concat_ranges,
    read_shard,
)
from xmodal.data.tokenizer import WordPieceTokenizer

TSV_FIELDS: tuple[str, ...] = ("img_id", "img_h", "img_w", "objects_id", "objects_conf", "attrs_id", "attrs_conf",
                               "num_boxes", "boxes", "features")
BOX_TOLERANCE_PX = 1.0  # detector boxes may poke a pixel past the border; more than that is bad data
REFERENCE_MINIVAL = "mscoco_minival.json"  # the reference's minival sentences: their images are minival
SPLIT_METHODS: tuple[str, ...] = ("auto", "reference", "hash")
DEFAULT_MINIVAL_FRACTION = 0.1  # the hash split's default


class IngestError(UserError):
    """Bad input: the message names the file, the line or record, the field, the value and what was expected."""


# ============================================================================ JSON


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


def _fail(where: str, msg: str) -> IngestError:
    return IngestError(f"{where}: {msg}")


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
        raise _fail(f"{path}: line {e.lineno} column {e.colno}", f"not valid JSON ({e.msg})") from None
    except UnicodeDecodeError as e:
        raise _fail(str(path), f"not UTF-8 text ({e})") from None
    if not isinstance(data, list):
        raise _fail(str(path), f"expected a JSON list of {{\"img_id\", \"sentf\", \"labelf\"}} records, "
                               f"got {type(data).__name__}")
    file_index = len(corpus.files)
    corpus.files.append(str(path))
    img_ids: set[str] = set()
    c = corpus
    for i, rec in enumerate(data):
        data[i] = None  # free the parsed record as soon as it is copied
        where = f"{path}: record #{i}"
        if not isinstance(rec, dict):
            raise _fail(where, f"expected an object with img_id, sentf, labelf, got {type(rec).__name__}")
        img_id = rec.get("img_id")
        if not isinstance(img_id, str) or not img_id:
            raise _fail(where, f"field 'img_id': expected a non-empty string, got {img_id!r}")
        where = f"{where} (img_id {img_id!r})"
        sentf = rec.get("sentf")
        if not isinstance(sentf, dict):
            raise _fail(where, f"field 'sentf': expected {{source: [sentence, ...]}}, got {type(sentf).__name__}")
        labelf = rec.get("labelf")
        if labelf is None:
            if not allow_missing_labelf:
                # Records before this one all had it (else they would have failed), and are dropped already.
                n = 1 + sum(1 for r in data[i + 1:] if isinstance(r, dict) and r.get("labelf") is None)
                got = "is missing" if "labelf" not in rec else "is null"
                raise _fail(where, f"field 'labelf' {got}: expected {{source: [{{answer: score}}, ...]}} "
                                   f"({{}} for a record without questions); {n} record(s) of this file lack it; "
                                   "--allow-missing-labelf takes them as having no questions")
            c.missing_labelf += 1
            labelf = {}
        if not isinstance(labelf, dict):
            raise _fail(where, f"field 'labelf': expected {{source: [{{answer: score}}, ...]}}, "
                               f"got {type(labelf).__name__}")
        for source in labelf:
            if source not in sentf:
                raise _fail(where, f"field 'labelf.{source}': no sentences 'sentf.{source}' for these labels")
        img_ids.add(img_id)
        image = c.image_ids.setdefault(img_id, len(c.image_ids))
        if image == len(c.first_file):
            c.first_file.append(file_index)
            c.first_record.append(i)
        for source, sents in sentf.items():
            if not isinstance(sents, list):
                raise _fail(where, f"field 'sentf.{source}': expected a list of sentences, got {type(sents).__name__}")
            labels = labelf.get(source)
            if labels is not None:
                if not isinstance(labels, list) or len(labels) != len(sents):
                    n = len(labels) if isinstance(labels, list) else type(labels).__name__
                    raise _fail(where, f"field 'labelf.{source}': expected a list of {len(sents)} label dicts "
                                       f"(one per sentence), got {n}")
            for j, s in enumerate(sents):
                if not isinstance(s, str):
                    raise _fail(where, f"field 'sentf.{source}[{j}]': expected a string, got {s!r:.60}")
                if labels is not None:
                    label = labels[j]
                    if not isinstance(label, dict):
                        raise _fail(where, f"field 'labelf.{source}[{j}]': expected {{answer: score}}, "
                                           f"got {label!r:.60}")
                    for a, sc in label.items():
                        if isinstance(sc, bool) or not isinstance(sc, (int, float)) or not math.isfinite(sc) \
                                or sc < 0:
                            raise _fail(where, f"field 'labelf.{source}[{j}][{a!r}]': expected a finite score "
                                               f">= 0, got {sc!r}")
                        c.raw_ids.append(c.raw_answers.setdefault(a, len(c.raw_answers)))
                        c.raw_scores.append(float(sc))
                try:
                    c.text += s.encode("utf-8")
                except UnicodeEncodeError as e:  # a lone surrogate escaped in the JSON ("\ud800")
                    raise _fail(where, f"field 'sentf.{source}[{j}]': not encodable as UTF-8 ({e})") from None
                c.text_ends.append(len(c.text))
                c.sent_image.append(image)
                c.question.append(labels is not None)
                c.label_ends.append(len(c.raw_ids))
    return img_ids


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


# ============================================================================ TSV


def _b64(value: str, name: str, dtype: type, where: str) -> np.ndarray:
    try:
        raw = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as e:
        raise _fail(where, f"field {name!r}: invalid base64 ({e}); value starts {value[:24]!r}") from None
    size = np.dtype(dtype).itemsize
    if len(raw) % size:
        raise _fail(where, f"field {name!r}: decodes to {len(raw)} bytes, not a whole number of "
                           f"{np.dtype(dtype).name} ({size} bytes each)")
    return np.frombuffer(raw, dtype=dtype)


def _int(value: str, name: str, where: str, minimum: int = 1) -> int:
    try:
        v = int(value)
    except ValueError:
        raise _fail(where, f"field {name!r}: expected an integer, got {value[:40]!r}") from None
    if v < minimum:
        raise _fail(where, f"field {name!r}: expected >= {minimum}, got {v}")
    return v


@dataclass
class TsvImage:
    img_id: str
    img_h: int
    img_w: int
    num_boxes: int
    obj_ids: np.ndarray  # (n,) int32
    obj_conf: np.ndarray  # (n,) float32
    attr_ids: np.ndarray
    attr_conf: np.ndarray
    boxes: np.ndarray  # (n, 4) float32 normalised
    features: np.ndarray  # (n, F) float16


def parse_tsv_line(line: str, where: str, *, feat_dim: int | None, num_objects: int, num_object_labels: int,
                   num_attr_labels: int) -> TsvImage:
    """Decode and check one reference TSV line (`where` = "file:line" for errors)."""
    fields = line.rstrip("\r\n").split("\t")
    if len(fields) != len(TSV_FIELDS):
        raise _fail(where, f"expected {len(TSV_FIELDS)} tab-separated fields ({', '.join(TSV_FIELDS)}), "
                           f"got {len(fields)}")
    img_id = fields[0]
    where = f"{where} (img_id {img_id!r})"
    h, w = _int(fields[1], "img_h", where), _int(fields[2], "img_w", where)
    n = _int(fields[7], "num_boxes", where)
    if n > num_objects:
        raise _fail(where, f"field 'num_boxes': {n} boxes, the store holds at most --num-objects {num_objects}")
    arrays = {}
    for name, dtype, per_box in (("objects_id", np.int64, 1), ("objects_conf", np.float32, 1),
                                 ("attrs_id", np.int64, 1), ("attrs_conf", np.float32, 1),
                                 ("boxes", np.float32, 4)):
        a = _b64(fields[TSV_FIELDS.index(name)], name, dtype, where)
        if a.size != n * per_box:
            raise _fail(where, f"field {name!r}: {a.size} values, expected num_boxes * {per_box} = {n * per_box} "
                               "(wrong number of boxes)")
        arrays[name] = a
    feats = _b64(fields[9], "features", np.float32, where)
    if feats.size % n:
        raise _fail(where, f"field 'features': {feats.size} float32 values is not a whole number per box "
                           f"(num_boxes={n}); expected num_boxes * feature width")
    width = feats.size // n
    if feat_dim is not None and width != feat_dim:
        raise _fail(where, f"field 'features': width {width} per box ({feats.size} values / {n} boxes), "
                           f"expected {feat_dim} (--feat-dim, else the width of the first image)")
    feats = feats.reshape(n, width)
    if not np.isfinite(feats).all():
        bad = np.argwhere(~np.isfinite(feats))[0]
        raise _fail(where, f"field 'features': non-finite value {feats[bad[0], bad[1]]} at box {bad[0]}, dim {bad[1]}")
    peak = float(np.abs(feats).max()) if feats.size else 0.0
    if peak > float(np.finfo(np.float16).max):
        raise _fail(where, f"field 'features': value {peak:g} does not fit float16 (max 65504)")
    for name, limit in (("objects_id", num_object_labels), ("attrs_id", num_attr_labels)):
        ids = arrays[name]
        bad = np.nonzero((ids < 0) | (ids >= limit))[0]
        if len(bad):
            raise _fail(where, f"field {name!r}: id {int(ids[bad[0]])} at box {bad[0]} outside [0, {limit}) "
                               f"(--num-{'object' if name == 'objects_id' else 'attr'}-labels {limit})")
    for name in ("objects_conf", "attrs_conf"):
        c = arrays[name]
        bad = np.nonzero(~np.isfinite(c) | (c < 0) | (c > 1.0 + 1e-3))[0]
        if len(bad):
            raise _fail(where, f"field {name!r}: confidence {c[bad[0]]} at box {bad[0]}, expected in [0, 1]")
    boxes = arrays["boxes"].reshape(n, 4)
    t = BOX_TOLERANCE_PX
    bad = ~np.isfinite(boxes).all(1) | (boxes[:, 0] < -t) | (boxes[:, 1] < -t) | (boxes[:, 2] > w + t) \
        | (boxes[:, 3] > h + t) | (boxes[:, 2] < boxes[:, 0]) | (boxes[:, 3] < boxes[:, 1])
    if bad.any():
        i = int(np.nonzero(bad)[0][0])
        raise _fail(where, f"field 'boxes': box {i} = {boxes[i].tolist()} (x1 y1 x2 y2, pixels) is not inside "
                           f"the {w}x{h} image (expected 0 <= x1 <= x2 <= img_w, 0 <= y1 <= y2 <= img_h)")
    norm = np.clip(boxes / np.array([w, h, w, h], np.float32), 0.0, 1.0)
    return TsvImage(img_id=img_id, img_h=h, img_w=w, num_boxes=n, obj_ids=arrays["objects_id"].astype(np.int32),
                    obj_conf=np.clip(arrays["objects_conf"], 0, 1), attr_ids=arrays["attrs_id"].astype(np.int32),
                    attr_conf=np.clip(arrays["attrs_conf"], 0, 1), boxes=norm, features=feats.astype(np.float16))


# base64 array fields: (name, bytes per value, values per box)
_B64_ARRAYS: tuple[tuple[str, int, int], ...] = (("objects_id", 8, 1), ("objects_conf", 4, 1), ("attrs_id", 8, 1),
                                                 ("attrs_conf", 4, 1), ("boxes", 4, 4))


def _b64_size(line: bytes, start: int, end: int) -> int | None:
    """Bytes that the base64 text line[start:end] decodes to; None if it is not whole 4-character groups."""
    n = end - start
    if n % 4:
        return None
    pad = (n >= 1 and line[end - 1] == 0x3D) + (n >= 2 and line[end - 2] == 0x3D)  # "="
    return n // 4 * 3 - pad


def check_line_shape(line: bytes, where: str, width: int | None, width_from: str) -> int:
    """The shape of one TSV line, without decoding: 10 fields, every base64 array holds num_boxes
    values, the features a whole `width` per box (None: any width). Returns the feature width. A
    line cut short (a truncated file) fails here, named by file:line, before images are matched."""
    cut = "" if line.endswith(b"\n") else " (the file ends in this line, without a line end: it looks cut off)"
    end = len(line)
    while end and line[end - 1] in (0x0A, 0x0D):
        end -= 1
    starts = [0]
    while len(starts) < len(TSV_FIELDS) and (tab := line.find(b"\t", starts[-1], end)) >= 0:
        starts.append(tab + 1)
    if len(starts) != len(TSV_FIELDS) or line.find(b"\t", starts[-1], end) >= 0:
        fields = line.count(b"\t", 0, end) + 1
        raise _fail(where, f"expected {len(TSV_FIELDS)} tab-separated fields ({', '.join(TSV_FIELDS)}), "
                           f"got {fields}{cut}")
    bounds = [(a, b - 1) for a, b in zip(starts, starts[1:], strict=False)] + [(starts[-1], end)]
    img_id = line[:bounds[0][1]].decode("utf-8", errors="replace")
    where = f"{where} (img_id {img_id!r})"
    a, b = bounds[TSV_FIELDS.index("num_boxes")]
    n = _int(line[a:b].decode("utf-8", errors="replace"), "num_boxes", where)
    for name, itemsize, per_box in _B64_ARRAYS:
        a, b = bounds[TSV_FIELDS.index(name)]
        size = _b64_size(line, a, b)
        if size is None or size != n * per_box * itemsize:
            got = f"{size // itemsize} values" if size is not None and size % itemsize == 0 else \
                f"{b - a} base64 characters ({size} bytes)"
            raise _fail(where, f"field {name!r}: {got}, expected num_boxes * {per_box} = {n * per_box} "
                               f"({itemsize}-byte values; wrong number of boxes){cut}")
    a, b = bounds[TSV_FIELDS.index("features")]
    size = _b64_size(line, a, b)
    if size is None or size % (4 * n):
        raise _fail(where, f"field 'features': {b - a} base64 characters ({size} bytes) are not a whole number "
                           f"of float32 values per box (num_boxes={n}); expected num_boxes * feature width{cut}")
    got_width = size // (4 * n)
    if width is not None and got_width != width:
        raise _fail(where, f"field 'features': width {got_width} per box ({size // 4} values / {n} boxes), "
                           f"expected {width} ({width_from}){cut}")
    return got_width


def scan_tsv_ids(paths: list[Path], progress: bool, feat_dim: int | None = None,
                 offsets: dict[str, tuple[int, int, int]] | None = None) -> dict[str, str]:
    """img_id -> "file:line", reading every line's shape but decoding nothing (`check_line_shape`):
    duplicate images, lines cut short and feature widths other than `feat_dim` (else the first
    line's) fail here. `offsets`, if given, receives img_id -> (file index, byte offset, line number)
    for `tsv_lines_at`."""
    seen: dict[str, str] = {}
    width, width_from = feat_dim, "--feat-dim"
    bar = progress_bar(sum(p.stat().st_size for p in paths if not p.is_dir()), "scan TSV", "B", progress)
    for k, p in enumerate(paths):
        if is_feature_store(p):  # an extracted store: its img_id column and its width
            shards, width_here = _store_shards(p)
            if width is None:
                width, width_from = width_here, f"the width of the first image, in {p}"
            elif width_here != width:
                raise _fail(str(p), f"features of width {width_here}, expected {width} ({width_from})")
            for j, (shard, _) in enumerate(shards):
                ids = read_shard(shard, columns=["img_id"]).column("img_id").to_pylist()
                for row, img_id in enumerate(ids):
                    where = f"{p}: {shard.name} row {row}"
                    if img_id in seen:
                        raise _fail(where, f"img_id {img_id!r} already has features at {seen[img_id]}")
                    seen[img_id] = where
                    if offsets is not None:
                        offsets[img_id] = (k, j, row)
            continue
        with open(p, "rb") as f:
            pos = 0
            for lineno, line in enumerate(f, 1):
                start, pos = pos, pos + len(line)
                bar.update(len(line))
                if not line.strip():
                    continue
                where = f"{p}:{lineno}"
                got = check_line_shape(line, where, width, width_from)
                if width is None:
                    width, width_from = got, f"the width of the first image, at {where}"
                img_id = line.split(b"\t", 1)[0].decode("utf-8", errors="replace")
                if img_id in seen:
                    raise _fail(where, f"img_id {img_id!r} already has features at {seen[img_id]}")
                seen[img_id] = where
                if offsets is not None:
                    offsets[img_id] = (k, start, lineno)
    bar.close()
    return seen


def order_key(img_id: str, seed: int) -> bytes:
    """The seeded position of an image in a store written in random order: a keyed hash of img_id, so
    the order depends on the seed and the images only, not on the files' order or contents."""
    return hashlib.blake2b(img_id.encode("utf-8"), digest_size=8, key=seed.to_bytes(8, "little")).digest()


def minival_by_hash(img_id: str, fraction: float) -> bool:
    """Stable, order-independent split by image: crc32(img_id) / 2**32 < fraction."""
    return zlib.crc32(img_id.encode("utf-8")) < fraction * 2**32


def choose_minival(split: str, json_paths: list[Path], minival_paths: list[Path],
                   minival_fraction: float | None) -> tuple[MinivalSplit, str | None]:
    """How minival is chosen, and a note for the user when it was chosen for them (None otherwise).

    `split`: "reference" (the images of the --minival files; with none given, of a --json named
    mscoco_minival.json), "hash" (`minival_fraction` of the images by a hash of img_id), or "auto":
    reference when there is a minival file (given, or found by that name), else hash.
    """
    if split not in SPLIT_METHODS:
        raise IngestError(f"--split {split!r}: expected one of {', '.join(SPLIT_METHODS)}")
    if minival_fraction is not None and not 0 <= minival_fraction < 1:
        raise IngestError(f"--minival-fraction {minival_fraction}: expected a fraction in [0, 1)")
    named = [p for p in json_paths if p.name == REFERENCE_MINIVAL]
    if split == "hash":
        if minival_paths:
            raise IngestError(f"--minival {minival_paths[0]}: --split hash chooses minival by a hash of img_id and "
                              "takes no minival file; drop one of them")
        return MinivalSplit(method="hash", fraction=_fraction(minival_fraction)), None
    if not minival_paths and not named:
        if split == "reference":
            raise IngestError(f"--split reference: no minival file; name it with --minival FILE (the reference's "
                              f"{REFERENCE_MINIVAL})")
        note = None if minival_fraction is not None else (
            f"minival = {_fraction(None):g} of the images by a hash of img_id: no --minival file and no --json "
            f"named {REFERENCE_MINIVAL} (the reference's split: --minival {REFERENCE_MINIVAL})")
        return MinivalSplit(method="hash", fraction=_fraction(minival_fraction)), note
    files = minival_paths or named
    if minival_fraction is not None:
        raise IngestError(f"--minival-fraction {minival_fraction}: only for --split hash; minival here is the "
                          f"images of {', '.join(str(p) for p in files)}")
    note = None if minival_paths else (
        f"minival = the images of {', '.join(str(p) for p in named)} (the reference's split, found by its file "
        "name); --split hash for a hash split instead")
    return MinivalSplit(method="reference", files=[str(p) for p in files], chosen_by_name=not minival_paths), note


def _fraction(value: float | None) -> float:
    return DEFAULT_MINIVAL_FRACTION if value is None else value


# ============================================================================ the ingest


def pack_images(images: list[TsvImage], num_objects: int, feat_dim: int) -> dict[str, np.ndarray]:
    """Decoded TSV images -> the image fields (`store.IMAGE_FIELDS`) as (K, ...) arrays, padded to
    `num_objects` slots (zero features/boxes, id -1)."""
    k, n = len(images), num_objects
    feats = np.zeros((k, n, feat_dim), np.float16)
    boxes = np.zeros((k, n, 4), np.float32)
    ints = {name: np.full((k, n), -1, np.int32) for name in ("obj_ids", "attr_ids")}
    confs = {name: np.zeros((k, n), np.float32) for name in ("obj_conf", "attr_conf")}
    for i, im in enumerate(images):  # per image (not per object or token): k <= a few hundred
        m = im.num_boxes
        feats[i, :m], boxes[i, :m] = im.features, im.boxes
        ints["obj_ids"][i, :m], ints["attr_ids"][i, :m] = im.obj_ids, im.attr_ids
        confs["obj_conf"][i, :m], confs["attr_conf"][i, :m] = im.obj_conf, im.attr_conf
    return dict(img_id=np.array([im.img_id for im in images], dtype=object),
                img_h=np.array([im.img_h for im in images], np.int32),
                img_w=np.array([im.img_w for im in images], np.int32),
                num_boxes=np.array([im.num_boxes for im in images], np.int32), features=feats, boxes=boxes,
                **ints, **confs)


@dataclass
class Sentences:
    """What the TSV pass needs of the corpus: per image its sentences (`Corpus.images`), the tokens
    and the answer arrays, all numpy (no Python object per sentence)."""

    image_ids: dict[str, int]  # img_id -> image index
    order: np.ndarray  # sentence indices grouped by image
    offsets: np.ndarray  # (I + 1,): image k's sentences are order[offsets[k]:offsets[k + 1]]
    tokens: np.ndarray  # (S, T) int32
    ans: tuple[np.ndarray, np.ndarray, np.ndarray]  # answer_arrays' offsets, labels, scores

    def count(self, img_id: str) -> int:
        k = self.image_ids.get(img_id)
        return 0 if k is None else int(self.offsets[k + 1] - self.offsets[k])


def _block(images: list[TsvImage], sentences: Sentences, num_objects: int, feat_dim: int) -> ImageBlock:
    k = np.array([sentences.image_ids[im.img_id] for im in images], dtype=np.int64)
    s0, s1 = sentences.offsets[k], sentences.offsets[k + 1]
    sents = sentences.order[concat_ranges(s0, s1)]
    ans_off, ans_lab, ans_score = sentences.ans
    a0, a1 = ans_off[sents], ans_off[sents + 1]
    idx = concat_ranges(a0, a1)
    tokens = sentences.tokens
    return ImageBlock(
        **pack_images(images, num_objects, feat_dim),
        sent_offsets=np.concatenate([[0], np.cumsum(s1 - s0)]).astype(np.int64),
        input_ids=tokens[sents],
        ans_offsets=np.concatenate([[0], np.cumsum(a1 - a0)]).astype(np.int64),
        ans_ids=ans_lab[idx], ans_scores=ans_score[idx])


def ingest_lxmert(out: str | Path, tsv: list[str | Path], json_files: list[str | Path], *,
                  vocab: str | Path | None = None, answers: str | Path | None = None, num_answers: int = 9500,
                  vocab_size: int = 30522, split: str = "auto", minival: list[str | Path] | None = None,
                  minival_fraction: float | None = None, max_seq_len: int = 20,
                  num_objects: int = 36, feat_dim: int | None = None, num_object_labels: int = 1600,
                  num_attr_labels: int = 400, images_per_shard: int = 256, row_group_images: int = 32,
                  allow_missing_images: bool = False, allow_missing_labelf: bool = False, overwrite: bool = False,
                  order_seed: int | None = 0, progress: bool = True) -> LxmertStore:
    """Build a store from reference files; see the module docstring for the checks and their order.
    `split`, `minival`, `minival_fraction`: how minival is chosen (`choose_minival`); the minival
    files are sentence files too (a file given both as --json and --minival is read once).
    `order_seed`: the images are written in the seeded random order of `order_key` (None: in the
    order of the TSV files), so every shard and row group mixes the sources (COCO, VG)."""
    if order_seed is not None and not 0 <= order_seed < 2**63:
        raise IngestError(f"--order-seed {order_seed}: expected an integer in [0, 2**63)")
    out_path = local_target(out)
    check_target(out_path, overwrite, KIND)  # before reading anything
    tsv_paths = [Path(p).expanduser().resolve() for p in tsv]
    json_paths = [Path(p).expanduser().resolve() for p in json_files]
    minival_paths = [Path(p).expanduser().resolve() for p in minival or []]
    if not tsv_paths or not json_paths:
        raise IngestError("need at least one --tsv feature file and one --json sentence file")
    check_tsv_inputs(tsv_paths)
    for p in [*json_paths, *minival_paths, *(Path(x) for x in (vocab, answers) if x is not None)]:
        if Path(p).is_dir():
            raise IngestError(f"{p}: is a directory; expected an input file")
        if not Path(p).is_file():
            raise IngestError(f"{p}: input file does not exist")
    for name, value in (("num_answers", num_answers), ("vocab_size", vocab_size), ("num_objects", num_objects),
                        ("num_object_labels", num_object_labels), ("num_attr_labels", num_attr_labels),
                        ("images_per_shard", images_per_shard), ("row_group_images", row_group_images),
                        ("feat_dim", 1 if feat_dim is None else feat_dim)):
        if value < 1:
            raise IngestError(f"--{name.replace('_', '-')} {value}: expected >= 1")
    how, note = choose_minival(split, json_paths, minival_paths, minival_fraction)
    if note:
        say(f"[xmodal] note: {note}")

    # 1. sentences, answers, tokens
    corpus = Corpus()
    sentence_files = list(dict.fromkeys([*json_paths, *minival_paths]))  # each file once, in order
    minival_ids: set[str] = set()
    for p in sentence_files:
        ids = load_pretrain_json(p, corpus, allow_missing_labelf=allow_missing_labelf)
        if str(p) in how.files:
            if not ids:
                raise IngestError(f"{p}: the minival file has no records; expected the reference's minival "
                                  "sentences (a JSON list of {\"img_id\", \"sentf\", \"labelf\"} records)")
            minival_ids |= ids
    counters_json = {"missing_labelf": corpus.missing_labelf}
    if answers is not None:
        table = AnswerTable.from_reference(answers, limit=num_answers)
    else:
        table = AnswerTable.most_frequent(corpus.raw_answer_occurrences(), num_answers)
        if len(table) == 0:
            table = AnswerTable(["yes"])  # a corpus without questions still needs a (1-answer) QA head
    *ans, answer_counts = answer_arrays(corpus, table)
    counters = {**answer_counts, **counters_json}
    if vocab is not None:
        tokenizer = WordPieceTokenizer.from_vocab(vocab, max_seq_len)
    else:
        tokenizer = WordPieceTokenizer.train(corpus.sentences(), max_seq_len, vocab_size=vocab_size,
                                             length=len(corpus))
    tokens, counters["truncated_sentences"] = tokenizer.encode_batches(corpus.sentence_batches(), len(corpus))
    corpus.drop_text()
    order, image_offsets = corpus.images()
    sentences = Sentences(corpus.image_ids, order, image_offsets, tokens, tuple(ans))

    # 2. which images have features (every line's shape, no decoding)
    offsets: dict[str, tuple[int, int, int]] = {}
    located = scan_tsv_ids(tsv_paths, progress, feat_dim, offsets)
    missing = [i for i in corpus.image_ids if i not in located and sentences.count(i)]
    if missing and not allow_missing_images:
        first = missing[0]
        raise _fail(corpus.first_seen(corpus.image_ids[first]),
                    f"img_id {first!r} has sentences but no features in any --tsv file "
                    f"({len(missing)} such image(s); --allow-missing-images drops them)")
    for i in missing:
        del sentences.image_ids[i]
    del corpus  # what is left of it (per-sentence image and answer arrays) is not needed while the TSV is read
    counters["dropped_images"] = sum(1 for i in located if not sentences.count(i))
    if how.method == "reference" and not any(sentences.count(i) for i in minival_ids):
        raise IngestError(f"none of the {len(minival_ids)} images of the minival file(s) {', '.join(how.files)} has "
                          "both sentences and features in the --tsv files: minival would be empty")

    def split_of(img_id: str) -> str:
        if how.method == "reference":
            return "minival" if img_id in minival_ids else "train"
        return "minival" if minival_by_hash(img_id, _fraction(minival_fraction)) else "train"

    # 3. decode, check, write
    options = {"vocab": str(vocab) if vocab else None, "answers": str(answers) if answers else None,
               "num_answers": num_answers, "vocab_size": vocab_size, "split": how.method,
               "minival": how.files, "minival_fraction": how.fraction,
               "max_seq_len": max_seq_len, "num_objects": num_objects, "feat_dim": feat_dim,
               "num_object_labels": num_object_labels, "num_attr_labels": num_attr_labels,
               "images_per_shard": images_per_shard, "row_group_images": row_group_images,
               "allow_missing_images": allow_missing_images, "missing_images": len(missing),
               "allow_missing_labelf": allow_missing_labelf, "order_seed": order_seed}
    mark_random_weights(tsv_paths, options)
    used_ids = [i for i in located if sentences.count(i)]
    used = len(used_ids)
    if order_seed is None:
        lines = tsv_lines(tsv_paths)
        order = ImageOrder(method="source")
    else:
        # Bounded memory: only the (image, offset) list is sorted; the lines are read one at a time.
        used_ids.sort(key=lambda i: order_key(i, order_seed))
        lines = tsv_lines_at(tsv_paths, (offsets[i] for i in used_ids))
        order = ImageOrder(method="seeded", seed=order_seed)
    writer: StoreWriter | None = None
    buffers: dict[str, list[TsvImage]] = {"train": [], "minival": []}
    chunk = max(1, min(images_per_shard, 64))
    try:
        bar = progress_bar(used, "decode TSV", "img", progress)
        for where, line in lines:
            img_id = item_id(line)
            if not sentences.count(img_id):
                continue
            im = parse_item(line, where, feat_dim=feat_dim, num_objects=num_objects,
                                num_object_labels=num_object_labels, num_attr_labels=num_attr_labels)
            if writer is None:
                feat_dim = im.features.shape[1]
                options["feat_dim"] = feat_dim
                writer = StoreWriter(out_path, num_objects=num_objects, feat_dim=feat_dim, max_seq_len=max_seq_len,
                                     images_per_shard=images_per_shard, row_group_images=row_group_images,
                                     overwrite=overwrite)
            split = split_of(img_id)
            buffers[split].append(im)
            if len(buffers[split]) >= chunk:
                writer.add(split, _block(buffers[split], sentences, num_objects, feat_dim))
                buffers[split] = []
            bar.update(1)
        bar.close()
        if writer is None:
            raise IngestError("no image has both features and sentences: nothing to write")
        for split, images in buffers.items():
            if images:
                writer.add(split, _block(images, sentences, num_objects, feat_dim))
        return writer.finish(tokenizer=tokenizer, answers=table, source="lxmert",
                             num_object_labels=num_object_labels, num_attr_labels=num_attr_labels,
                             inputs=[str(p) for p in [*tsv_paths, *sentence_files]], options=options,
                             minival_split=how, image_order=order, **counters)
    except BaseException:
        if writer is not None:
            writer.abort()
        raise


# ============================================================================ extracted stores as TSV input
#
# Every --tsv input may instead be a feature-only store directory (`jobs/extract.py` writes them; kind
# "features"): its rows are read as the TsvImage a TSV line decodes to (features float16, boxes
# normalised), and checked as one. A store's "line number" is its row index over all its shards.

FEATURE_STORE_KIND = "features"


def is_feature_store(p: Path) -> bool:
    """A feature-only store directory (what `jobs/extract.py` and `jobs/ingest.py features` write)."""
    return p.is_dir() and kind_at(p) == FEATURE_STORE_KIND


def check_tsv_inputs(paths: list[Path]) -> None:
    """Each --tsv input exists and is a TSV file or a feature-only store directory."""
    for p in paths:
        if p.is_dir() and not is_feature_store(p):
            raise IngestError(f"{p}: is a directory but not a feature-only store (no manifest.json of kind "
                              f"{FEATURE_STORE_KIND!r}); expected a feature TSV file or a store from jobs/extract.py")
        if not p.exists():
            raise IngestError(f"{p}: input file does not exist")


RANDOM_WEIGHTS_KEY = "random_weights_inputs"  # a built store's option: its inputs of random-weight features


def random_weight_inputs(paths: list[Path]) -> list[str]:
    """The --tsv inputs that are stores of features from a detector with random weights (`jobs/extract.py
    --random-weights`, for tests and benchmarks), or stores built from such stores."""
    found = []
    for p in paths:
        if is_feature_store(p):
            options = read_manifest_json(p / "manifest.json").get("options")
            if isinstance(options, dict) and (options.get("random_weights") or options.get(RANDOM_WEIGHTS_KEY)):
                found.append(str(p))
    return found


def mark_random_weights(paths: list[Path], options: dict) -> None:
    """Say so on the console, and record it in the options the new store's manifest keeps, when inputs
    hold random-weight features: a model trained on them learns nothing about the images."""
    found = random_weight_inputs(paths)
    if found:
        say(f"[xmodal] warning: RANDOM WEIGHTS: {', '.join(found)} hold{'s' if len(found) == 1 else ''} features of a "
            "detector with random weights (jobs/extract.py --random-weights, for tests and benchmarks only); a "
            "model trained on this store learns nothing about the images")
        options[RANDOM_WEIGHTS_KEY] = found


def _store_shards(p: Path) -> tuple[list[tuple[Path, int]], int]:
    """(shard path, rows) of a feature-only store, and its feature width."""
    raw = read_manifest_json(p / "manifest.json")
    try:
        return [(p / s["file"], int(s["rows"])) for s in raw["shards"]], int(raw["feat_dim"])
    except (KeyError, TypeError, ValueError) as e:
        raise IngestError(f"{p / 'manifest.json'}: not a readable feature-only store manifest ({e})") from None


def _store_images(p: Path, shard: Path, table, first_row: int = 0) -> Iterator[tuple[str, TsvImage]]:
    """The rows of `table` (the shard's rows from `first_row` on) as the TsvImage a line decodes to."""
    cols = {c: table.column(c).combine_chunks() for c in table.column_names}
    dense = {c: cols[c].to_numpy_ndarray() for c in ("features", "boxes", "obj_ids", "obj_conf", "attr_ids",
                                                     "attr_conf")}
    for i, img_id in enumerate(cols["img_id"].to_pylist()):
        n = int(cols["num_boxes"][i].as_py())
        yield f"{p}: {shard.name} row {first_row + i} (img_id {img_id!r})", TsvImage(
            img_id=img_id, img_h=int(cols["img_h"][i].as_py()), img_w=int(cols["img_w"][i].as_py()), num_boxes=n,
            obj_ids=dense["obj_ids"][i, :n].astype(np.int32), obj_conf=dense["obj_conf"][i, :n].astype(np.float32),
            attr_ids=dense["attr_ids"][i, :n].astype(np.int32), attr_conf=dense["attr_conf"][i, :n].astype(np.float32),
            boxes=dense["boxes"][i, :n].astype(np.float32), features=dense["features"][i, :n].astype(np.float16))


def check_store_image(im: TsvImage, where: str, *, feat_dim: int | None, num_objects: int, num_object_labels: int,
                      num_attr_labels: int) -> TsvImage:
    """The checks `parse_tsv_line` makes, on a row of a feature-only store."""
    n = im.num_boxes
    if n < 1:
        raise _fail(where, f"num_boxes {n}: expected >= 1")
    if n > num_objects:
        raise _fail(where, f"{n} boxes, the store being built holds at most --num-objects {num_objects}")
    if feat_dim is not None and im.features.shape[1] != feat_dim:
        raise _fail(where, f"feature width {im.features.shape[1]}, expected {feat_dim} (--feat-dim, else the width "
                           "of the first image)")
    for name, ids, limit in (("obj_ids", im.obj_ids, num_object_labels), ("attr_ids", im.attr_ids, num_attr_labels)):
        bad = np.nonzero((ids < 0) | (ids >= limit))[0]
        if len(bad):
            raise _fail(where, f"{name}: id {int(ids[bad[0]])} at box {bad[0]} outside [0, {limit})")
    return im


def parse_item(item: str | TsvImage, where: str, **limits) -> TsvImage:
    """A TSV line (`parse_tsv_line`) or an extracted store's row (`check_store_image`)."""
    if isinstance(item, str):
        return parse_tsv_line(item, where, **limits)
    return check_store_image(item, where, **limits)


def item_bytes(item: str | TsvImage) -> bytes:
    """What a content fingerprint hashes of an input image: a TSV line's text, a store row's arrays."""
    if isinstance(item, str):
        return item.rstrip("\r\n").encode("utf-8")
    return b"\t".join([item.img_id.encode("utf-8"), str((item.img_h, item.img_w, item.num_boxes)).encode()]
                      + [np.ascontiguousarray(a).tobytes() for a in (item.obj_ids, item.obj_conf, item.attr_ids,
                                                                     item.attr_conf, item.boxes, item.features)])


def item_id(item: str | TsvImage) -> str:
    return item.split("\t", 1)[0] if isinstance(item, str) else item.img_id


def tsv_lines(paths: list[Path]) -> Iterator[tuple[str, str | TsvImage]]:
    """Every line of the TSV files (an extracted store's rows as TsvImage), in order."""
    for p in paths:
        if is_feature_store(p):
            for shard, _ in _store_shards(p)[0]:
                yield from _store_images(p, shard, read_shard(shard))
            continue
        with open(p, "rb") as f:
            for lineno, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                yield f"{p}:{lineno}", _text(raw, f"{p}:{lineno}")


def tsv_lines_at(paths: list[Path], locations: Iterable[tuple[int, int, int]]) -> Iterator[
        tuple[str, str | TsvImage]]:
    """The lines at (file index, byte offset, line number), in the order given (random access: one
    seek and one line read per image, every file kept open). For an extracted store, (store index,
    shard index, row): only the row group holding the row is read (and kept while the next rows come
    from it). In the seeded random order nearly every image is in another shard than the last: reading
    whole shards cost 85 ms per image at 36 x 2048 (256 images a shard), one row group 32x less."""
    stores = {k: _store_shards(p)[0] for k, p in enumerate(paths) if is_feature_store(p)}
    files = {k: open(p, "rb") for k, p in enumerate(paths) if k not in stores}  # noqa: SIM115 - closed below
    starts: dict[tuple[int, int], list[int]] = {}  # (store, shard) -> first row of each row group, and the end
    cached: tuple[tuple[int, int, int], list[tuple[str, TsvImage]]] | None = None
    try:
        for k, offset, lineno in locations:
            if k in stores:
                shard = stores[k][offset][0]
                if (k, offset) not in starts:
                    meta = open_parquet(shard).metadata
                    starts[(k, offset)] = list(itertools.accumulate(
                        (meta.row_group(g).num_rows for g in range(meta.num_row_groups)), initial=0))
                bounds = starts[(k, offset)]
                group = bisect.bisect_right(bounds, lineno) - 1
                if cached is None or cached[0] != (k, offset, group):
                    table = read_shard(shard, row_groups=[group])
                    cached = ((k, offset, group), list(_store_images(paths[k], shard, table, bounds[group])))
                yield cached[1][lineno - bounds[group]]
                continue
            f = files[k]
            f.seek(offset)
            where = f"{paths[k]}:{lineno}"
            yield where, _text(f.readline(), where)
    finally:
        for f in files.values():
            f.close()


def _text(raw: bytes, where: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _fail(where, f"not UTF-8 text ({e})") from None
