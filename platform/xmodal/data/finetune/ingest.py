"""Reference fine-tuning JSON -> fine-tuning set (`python jobs/ingest.py vqa|gqa|nlvr2 OUT --store STORE ...`).

The images are looked up in one or several image stores (`--store`, repeatable, in order; the first
store holding an img_id gives it): LXMERT stores and feature-only stores (`jobs/ingest.py features`,
e.g. NLVR2's own images or GQA testdev). The sentences are tokenised with the first LXMERT store's
tokenizer (the pretraining store: a feature-only store has no vocabulary), so one must be named.

Inputs (docs/papers.md#fine-tuning-json), each file a JSON list:
- vqa: {"question_id", "img_id", "sent", "label": {answer: soft score}} (3,129 answers);
- gqa: the same shape, label {answer: 1} (1,842 answers);
- nlvr2: {"identifier", "img0", "img1", "sent", "label": 0/1}.
Other keys (question_type, answer_type, ...) are ignored. question_id may be a JSON number (it is in
the reference VQA files) and is stored as a string. "label" may be missing only in a split named
"test" (the reference VQA test file has none): such a question has no target, such a pair label -1.

What the ingest does with imperfect data:
- a question/pair whose image is in none of the stores is an error naming the file, the record, the
  img_id and the stores searched; with allow_missing_images (--allow-missing-images) it is dropped
  and counted instead (manifest.ignored missing_images, with up to 5 examples), as the reference
  loaders do; even then, if EVERY record of a file misses its image the stores are the wrong ones,
  and that is an error naming the file and an img_id;
- an answer outside the answer table is dropped from that question's label (ignored
  unknown_answers); the question stays with its remaining answers (maybe none: stats
  unanswerable_questions), as the reference `VQATorchDataset` keeps it with a partial target;
- answers are normalised (answers.py) before lookup; variants that normalise alike keep the
  highest score.
Anything malformed (not a list, a missing key, a wrong type, a score outside [0, 1], an nlvr2 label
other than 0/1, a repeated id) is an error naming the file, the record index, the key, the value and
what was expected; everything is parsed and checked before anything is written.
The answer table is a reference file (`--answers`, e.g. trainval_label2ans.json, a list of strings, or
all_ans.json) or the most frequent answers of the train split (3,129 vqa / 1,842 gqa by default).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from xmodal.base.console import say
from xmodal.data.answers import AnswerError, AnswerTable, normalize_answer
from xmodal.data.finetune.sets import FinetuneData, check_same_dims, image_index, write_finetune
from xmodal.data.finetune.split import FinetuneError, FinetuneSplit, check_task
from xmodal.data.jsonfile import read_json_file
from xmodal.data.lxmert.features import ImageStore, open_image_store
from xmodal.data.lxmert.store import LxmertStore

DEFAULT_NUM_ANSWERS: dict[str, int] = {"vqa": 3129, "gqa": 1842}
MAX_MISSING_EXAMPLES = 5
UNLABELLED_SPLIT = "test"  # the only split whose records may lack "label"
_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object", list: "array",
               type(None): "null"}


def _show(value: Any) -> str:
    text = repr(value)
    if len(text) > 80:
        text = text[:77] + "..."
    return f"{text} ({_JSON_TYPES.get(type(value), type(value).__name__)})"


@dataclass
class _Records:
    """The parsed records of one split (before the images are checked)."""

    ids: list[str] = field(default_factory=list)
    img_ids: list[tuple[str, ...]] = field(default_factory=list)  # (img_id,) or (img0, img1)
    sents: list[str] = field(default_factory=list)
    labels: list[Any] = field(default_factory=list)  # {answer: score} | None (qa), 0/1/-1 (nlvr2)
    where: list[tuple[str, int]] = field(default_factory=list)  # (file, record index)


def _load_list(path: Path) -> list:
    data = read_json_file(path, FinetuneError, expected="a JSON list of records")
    if not isinstance(data, list):
        raise FinetuneError(f"{path}: expected a JSON list of records, got {_show(data)[:60]}")
    if not data:
        raise FinetuneError(f"{path}: the file holds no record")
    return data


def _parse_file(task: str, split: str, path: Path, out: _Records) -> None:
    """Check every record of one file and append it to `out`."""
    id_key = "identifier" if task == "nlvr2" else "question_id"
    for i, rec in enumerate(_load_list(path)):
        if not isinstance(rec, dict):
            raise FinetuneError(f"{path}: record #{i}: is {_show(rec)}, expected a JSON object")
        rid = rec.get(id_key)

        def bad(key: str, expected: str, rec: dict = rec, i: int = i, rid: Any = rid) -> FinetuneError:
            who = f" ({id_key} {rid!r})" if key != id_key and isinstance(rid, str | int) else ""
            value = _show(rec[key]) if key in rec else "missing"
            return FinetuneError(f"{path}: record #{i}{who}: key {key!r} is {value}, expected {expected}")

        def string(key: str, rec: dict = rec) -> str:
            v = rec.get(key)
            if not isinstance(v, str) or (key != "sent" and not v):
                raise bad(key, "a non-empty string" if key != "sent" else "a string")
            return v

        if task == "nlvr2":
            ident, imgs, sent = string("identifier"), (string("img0"), string("img1")), string("sent")
            if "label" not in rec and split == UNLABELLED_SPLIT:
                label: Any = -1
            else:
                label = rec.get("label")
                if type(label) is not int or label not in (0, 1):
                    raise bad("label", "0 or 1")
        else:
            q = rec.get("question_id")
            if type(q) is int or (isinstance(q, str) and q):
                ident = str(q)
            else:
                raise bad("question_id", "a non-empty string or an integer")
            imgs, sent = (string("img_id"),), string("sent")
            if "label" not in rec and split == UNLABELLED_SPLIT:
                label = None
            else:
                label = rec.get("label")
                if not isinstance(label, dict):
                    raise bad("label", "an object {answer: soft score}")
                for ans, score in label.items():
                    ok = type(score) in (int, float) and math.isfinite(score) and 0 <= score <= 1
                    if not ok:
                        raise FinetuneError(f"{path}: record #{i} (question_id {ident!r}): key 'label', "
                                            f"answer {ans!r}: score is {_show(score)}, expected a number in [0, 1]")
        out.ids.append(ident)
        out.img_ids.append(imgs)
        out.sents.append(sent)
        out.labels.append(label)
        out.where.append((str(path), i))


def _build_answers(task: str, records: dict[str, _Records], answers: str | Path | None,
                   num_answers: int | None) -> AnswerTable:
    if answers is not None:
        try:
            return AnswerTable.from_reference(answers, limit=num_answers)
        except AnswerError as e:
            raise FinetuneError(str(e)) from None
    if "train" not in records:
        raise FinetuneError(f"{task}: no answer table: give a reference answer file (--answers) or a train split "
                            "to take the most frequent answers from")
    k = num_answers if num_answers is not None else DEFAULT_NUM_ANSWERS[task]
    # Each question counts each of its (normalised) answers once.
    table = AnswerTable.most_frequent([a for lab in records["train"].labels if lab
                                       for a in {normalize_answer(x) for x in lab}], k)
    if len(table) == 0:
        raise FinetuneError(f"{task}: the train split has no answers to build the answer table from")
    return table


def open_image_stores(paths: str | Path | list[str | Path]) -> tuple[LxmertStore, list[ImageStore]]:
    """(the tokenizer store: the first LXMERT store, every image store in order) of `paths`."""
    given = [paths] if isinstance(paths, str | Path) else list(paths)
    if not given:
        raise FinetuneError("no image store given (--store)")
    stores: list[ImageStore] = []
    for p in given:
        if Path(p).expanduser().is_file():  # open_image_store would say it has no manifest.json
            raise FinetuneError(f"--store {p}: is a file, not a store folder; expected an LXMERT store or a "
                                "feature-only store (a folder from jobs/ingest.py lxmert|synthetic|features)")
        st = open_image_store(p)
        if any(st.path == x.path for x in stores):
            raise FinetuneError(f"--store {st.path}: given twice")
        stores.append(st)
    text = next((st for st in stores if isinstance(st, LxmertStore)), None)
    if text is None:
        raise FinetuneError(f"none of the stores {', '.join(str(st.path) for st in stores)} is an LXMERT store: "
                            "the sentences need its tokenizer (feature-only stores have no vocabulary); add the "
                            "pretraining store with --store")
    check_same_dims(stores, "--store")
    return text, stores


def _check_files_once(json_paths_by_split: dict[str, list[str | Path]]) -> None:
    """Each JSON file once in a split: twice would fail later as repeated ids, never saying why. One
    file as two splits is said (a valid split of the training questions scores the model on what it
    trained on: an overfitting check, not a validation); it is not refused, as such a check is a use."""
    seen: dict[Path, tuple[str, str | Path]] = {}
    for split, paths in json_paths_by_split.items():
        for p in paths:
            path = Path(p).expanduser().resolve()
            if path not in seen:
                seen[path] = (split, p)
                continue
            first, given = seen[path]
            if first == split:
                raise FinetuneError(f"--{split} {p}: given twice ({path}); expected each file once")
            say(f"[xmodal] note: --{first} {given} and --{split} {p} are the same file ({path}): split {split!r} "
                f"holds the {first} questions, so its scores show how well the model fits them, not how it "
                "does on questions it never saw")


def ingest_finetune(task: str, json_paths_by_split: dict[str, list[str | Path]],
                    store_path: str | Path | list[str | Path], out_dir: str | Path,
                    answers: str | Path | None = None, overwrite: bool = False, *,
                    num_answers: int | None = None, allow_missing_images: bool = False) -> FinetuneData:
    """Parse and check the reference JSON of each split, tokenise with the first LXMERT store's tokenizer,
    look every image up in the stores `store_path` (one or several, in order), and write the set
    (atomically). `answers`: a reference answer file, else the train split's most frequent
    `num_answers` answers (default 3,129 vqa / 1,842 gqa); with a file, `num_answers` keeps its first ones.
    `allow_missing_images`: drop (and count) examples whose image is in no store instead of failing."""
    check_task(task)
    if task == "nlvr2" and (answers is not None or num_answers is not None):
        raise FinetuneError("nlvr2 has no answer table: --answers / --num-answers do not apply")
    if num_answers is not None and num_answers < 1:
        raise FinetuneError(f"--num-answers {num_answers}: expected an answer table size >= 1")
    if not json_paths_by_split or not all(json_paths_by_split.values()):
        raise FinetuneError(f"{task}: no JSON file given for some split: {dict(json_paths_by_split)}")
    _check_files_once(json_paths_by_split)
    store, image_stores = open_image_stores(store_path)
    records: dict[str, _Records] = {}
    seen: dict[str, tuple[str, int]] = {}
    for split, paths in json_paths_by_split.items():
        rec = records[split] = _Records()
        seen.clear()
        for p in paths:
            start = len(rec.ids)
            _parse_file(task, split, Path(p).expanduser().resolve(), rec)
            for ident, where in zip(rec.ids[start:], rec.where[start:], strict=True):
                if ident in seen:
                    (f0, i0), (f1, i1) = seen[ident], where
                    raise FinetuneError(f"{f1}: record #{i1}: id {ident!r} repeats {f0} record #{i0} "
                                        f"(split {split!r}); ids must be unique within a split")
                seen[ident] = where
    table = _build_answers(task, records, answers, num_answers) if task != "nlvr2" else None
    return _write(task, store, image_stores, records, table, json_paths_by_split, out_dir, overwrite,
                  allow_missing_images)


def _write(task: str, store: LxmertStore, image_stores: list[ImageStore], records: dict[str, _Records],
           table: AnswerTable | None, inputs: dict[str, list[str | Path]], out_dir: str | Path, overwrite: bool,
           allow_missing_images: bool) -> FinetuneData:
    present = image_index(image_stores)
    searched = ", ".join(str(st.path) for st in image_stores)
    tokenizer = store.tokenizer()
    splits: dict[str, FinetuneSplit] = {}
    ignored: dict[str, dict[str, int]] = {}
    examples: list[dict[str, str]] = []
    stats = {"unanswerable_questions": 0, "truncated_sentences": 0}
    for split, rec in records.items():
        counts = ignored[split] = {"missing_images": 0}
        if task != "nlvr2":
            counts["unknown_answers"] = 0
        keep: list[int] = []
        by_file: dict[str, list[bool]] = {}
        for e, imgs in enumerate(rec.img_ids):
            gone = [x for x in imgs if x not in present]
            by_file.setdefault(rec.where[e][0], []).append(bool(gone))
            if gone:
                counts["missing_images"] += 1
                if len(examples) < MAX_MISSING_EXAMPLES:
                    examples.append({"split": split, "id": rec.ids[e], "img_id": gone[0]})
            else:
                keep.append(e)
        for file, missing in by_file.items():
            if all(missing):
                e = next(k for k, w in enumerate(rec.where) if w[0] == file)
                raise FinetuneError(f"{file}: none of its {len(missing)} records has its image in the store(s) "
                                    f"{searched} (e.g. img_id {[x for x in rec.img_ids[e] if x not in present][0]!r}); "
                                    "are they the stores of these images?")
        if counts["missing_images"] and not allow_missing_images:
            e = next(k for k, imgs in enumerate(rec.img_ids) if any(x not in present for x in imgs))
            file, i = rec.where[e]
            gone = next(x for x in rec.img_ids[e] if x not in present)
            raise FinetuneError(f"{file}: record #{i} (id {rec.ids[e]!r}): img_id {gone!r} is in none of the image "
                                f"stores searched ({searched}); {counts['missing_images']} record(s) of split "
                                f"{split!r} miss an image; add the store that holds them (--store), or "
                                "--allow-missing-images to drop and count them")
        ids, truncated = tokenizer.encode([rec.sents[e] for e in keep])
        stats["truncated_sentences"] += truncated
        common = dict(task=task, ids=np.array([rec.ids[e] for e in keep], dtype=object), input_ids=ids)
        if task == "nlvr2":
            splits[split] = FinetuneSplit(**common, img_ids=np.array([rec.img_ids[e] for e in keep], dtype=object),
                                          labels=np.array([rec.labels[e] for e in keep], dtype=np.int8))
            continue
        assert table is not None
        ans_ids: list[int] = []
        scores: list[float] = []
        counts_per_q = np.zeros(len(keep), np.int64)
        for q, e in enumerate(keep):
            label: dict[int, float] = {}
            for ans, score in (rec.labels[e] or {}).items():
                lab = table.index(ans)
                if lab is None:
                    counts["unknown_answers"] += 1
                else:
                    label[lab] = max(label.get(lab, 0.0), float(score))
            if rec.labels[e] is not None and not label:
                stats["unanswerable_questions"] += 1
            counts_per_q[q] = len(label)
            ans_ids.extend(label)
            scores.extend(label.values())
        offsets = np.zeros(len(keep) + 1, np.int64)
        np.cumsum(counts_per_q, out=offsets[1:])
        splits[split] = FinetuneSplit(**common, img_ids=np.array([rec.img_ids[e][0] for e in keep], dtype=object),
                                      ans_offsets=offsets, ans_ids=np.array(ans_ids, np.int32),
                                      ans_scores=np.array(scores, np.float32))
    return write_finetune(out_dir, task=task, store=store, image_stores=image_stores, splits=splits, answers=table,
                          source="reference",
                          overwrite=overwrite, ignored_by_split=ignored, missing_image_examples=examples,
                          stats=stats, inputs={s: [str(Path(p).expanduser().resolve()) for p in v]
                                               for s, v in inputs.items()})
