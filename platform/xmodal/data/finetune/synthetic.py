"""Synthetic learnable fine-tuning sets over the synthetic feature store
(`python jobs/ingest.py synthetic-vqa|synthetic-nlvr2 OUT --store STORE`).

Both are built from the store's true labels (in a synthetic store, obj_ids / attr_ids are the true
class and colour of every object; classes [0, n_fg) are named foreground, the last
n_bg = max(1, L // 5) are background that no sentence names, as in `xmodal.data.lxmert.synthetic`), so an
oracle that reads those labels scores 100 %, and a model can only do as well by reading the
features: a nearest-prototype classifier recovers class and colour from them (test_synthetic).
"train" is made from the store's train images, "valid" from its minival images (never pretrained
on), with a generator seeded apart from the pretraining corpus, so the questions are drawn anew.
Sentences use the pretraining templates' vocabulary plus a few words the store's WordPiece
vocabulary spells in pieces; a sentence that would hold [UNK] or be truncated is an error.

synthetic VQA: per image `questions_per_image` questions of three kinds, equally likely:
- colour   "what color is the cube ?"     -> the colour of that object group (1 of A colours);
- count    "how many cubes are there ?"   -> "1".."4"; with probability `near_answer_prob` a
  neighbouring count is also a label with score 0.3 (VQA-style soft scores, so BCE on soft scores
  and soft-score accuracy differ from plain classification; the oracle's argmax still scores 1.0);
- presence "is there a cone ?"            -> yes / no, balanced (an absent class is uniform over the
  absent foreground classes, a present one is a group of the image).
Chance: a text-only model knows the kind of question but not the image: presence 0.5, count about
0.3 (the most common count), colour 1/A; over all questions about (0.5 + 0.3 + 1/A) / 3, and the
most frequent answer is far below half of the questions. Measured on the default synthetic store
(1,500 images, 8 colours): oracle 1.0; the best answer per question text, fitted on train, scores
0.28 on valid (presence 0.51, count 0.26, colour 0.10).

synthetic GQA (task="gqa"): the same questions, exact match (one answer, score 1).

synthetic NLVR2: a statement about a pair of images, with `pairs_per_statement` (even) pairs per
statement, half true and half false, identifiers "split-statement-pair-0" (NLVR2's
"split-set_id-pair_id-sentence_id"; consistency = all pairs of one statement right). Templates, equally
likely, each true only by looking at BOTH images:
- both   "there is a red cube in both": true pairs both hold a red cube group; false pairs
         exactly one does (the other often holds a cube of another colour);
- total  "there are three cubes in total": both images hold 1..t-1 cubes; true iff the counts add
         up to t (t = 3 or 4: the store's vocabulary has no number words above four, and t = 2 could
         be refuted by one image); true and false pairs draw each image's count alike;
- one    "one image has two cubes": true iff EXACTLY one of the two images has exactly two cubes
         (an XOR: each image alone says nothing about the label).
Chance: every statement is true for exactly half of its pairs, so text alone is at 0.5 (and
consistency at 2^-P for P pairs). One image alone: "one" and "total" about 0.5 by construction;
"both" at most 0.75 (an image without the group shows the statement false). Measured on the
default synthetic store (1,500 images, 40 classes, 8 colours): oracle 1.0; one image alone 0.75
(both), ~0.5 (total, one).
Imports numpy and pyarrow only (via xmodal.data.finetune.sets).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from xmodal.data.answers import AnswerTable, normalize_answer
from xmodal.data.errors import StoreError
from xmodal.data.finetune.sets import (
    KIND,
    FinetuneData,
    FinetuneManifest,
    open_finetune,
    store_fingerprint,
    write_finetune,
)
from xmodal.data.finetune.split import FinetuneError, FinetuneSplit
from xmodal.data.lxmert.store import LxmertStore, open_store
from xmodal.data.lxmert.synthetic import COUNT_WORDS, MAX_COUNT, class_names, colour_names
from xmodal.data.manifest import ensure_derived, options_diff
from xmodal.data.options import seed_problem

SPLITS: dict[str, str] = {"train": "train", "valid": "minival"}  # fine-tuning split -> store split
_VQA, _NLVR2 = 0x51A, 0x2E7A  # generator streams apart from the pretraining corpus and each other


@dataclass
class ImageFacts:
    """The true content of K images of a synthetic store, for n_fg foreground classes."""

    img_ids: np.ndarray  # (K,) object str
    count: np.ndarray  # (K, n_fg) int64 objects of each class
    colour: np.ndarray  # (K, n_fg) int64 colour of the class's group, -1 = absent
    class_names: list[str]  # (n_fg,)
    colour_names: list[str]  # (A,)


def _count_problem(option: str, value: Any, least: int) -> str | None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        return f"{option} {value}: expected an integer >= {least}"
    return None


def _refuse(task: str, problems: list[str]) -> None:
    """One error naming only the options that are wrong."""
    if problems:
        raise FinetuneError(f"synthetic-{task}: " + "; ".join(problems))


def _synthetic(store_path: str | Path) -> LxmertStore:
    if Path(store_path).expanduser().is_file():  # open_store would call it a store that does not exist
        raise FinetuneError(f"--store {store_path}: is a file, not a store folder; expected a synthetic LXMERT "
                            "store (a folder from jobs/ingest.py synthetic)")
    store = open_store(store_path)
    if store.manifest.source != "synthetic":
        raise FinetuneError(f"{store.path}: source {store.manifest.source!r}; synthetic fine-tuning sets need a "
                            "synthetic store (jobs/ingest.py synthetic), whose object labels are the truth")
    return store


def image_facts(store: LxmertStore, store_split: str) -> ImageFacts:
    """Count and colour of every foreground class in every image of a store split (from obj_ids/attr_ids)."""
    m = store.manifest
    n_fg = m.num_object_labels - max(1, m.num_object_labels // 5)
    block = store.read_split(store_split)
    obj, attr = block.obj_ids.astype(np.int64), block.attr_ids.astype(np.int64)  # (K, N)
    k = block.num_images
    fg = (obj >= 0) & (obj < n_fg)
    img, slot = np.nonzero(fg)
    count = np.zeros((k, n_fg), np.int64)
    np.add.at(count, (img, obj[img, slot]), 1)
    lo = np.full((k, n_fg), np.iinfo(np.int64).max)
    hi = np.full((k, n_fg), -1)
    np.minimum.at(lo, (img, obj[img, slot]), attr[img, slot])
    np.maximum.at(hi, (img, obj[img, slot]), attr[img, slot])
    if np.any((count > 0) & (lo != hi)) or count.max(initial=0) > MAX_COUNT:
        raise FinetuneError(f"{store.path} split {store_split!r}: object groups with mixed colours or more than "
                            f"{MAX_COUNT} objects: not a store built by xmodal.data.lxmert.synthetic")
    return ImageFacts(img_ids=block.img_id, count=count, colour=np.where(count > 0, hi, -1),
                      class_names=class_names(n_fg), colour_names=colour_names(m.num_attr_labels))


def _rng(store: LxmertStore, seed: int, split: str, stream: int) -> np.random.Generator:
    return np.random.default_rng([int(store.manifest.options.get("seed", 0)), seed, list(SPLITS).index(split),
                                  stream])


def _encode(store: LxmertStore, sentences: list[str], what: str) -> np.ndarray:
    """Token ids (S, T) int32; a sentence the store's vocabulary cannot spell or that is cut is an error."""
    tok = store.tokenizer()
    ids, truncated = tok.encode(sentences)
    bad = [s for s, row in zip(sentences, ids, strict=True) if tok.unk_id in row]
    if truncated:
        bad += [s for s in dict.fromkeys(sentences) if tok.encode([s])[1]]
    if bad:
        row = tok.encode(bad[:1])[0][0]
        raise FinetuneError(f"{what}: the store's vocabulary ({store.path}, max_seq_len {tok.max_seq_len}) cannot "
                            f"hold {bad[0]!r} (it reads {tok.decode(row)!r}, {int((row != 0).sum())} tokens); use a "
                            "store whose corpus spells these words, with a longer max_seq_len")
    return ids


def _splits(store: LxmertStore) -> list[str]:
    out = [s for s, src in SPLITS.items() if store.manifest.shards.get(src)]
    if "train" not in out:
        raise FinetuneError(f"{store.path}: the store has no train images")
    return out


# ============================================================================ VQA


def vqa_answer_table(facts: ImageFacts) -> AnswerTable:
    answers = ["yes", "no", *(str(c) for c in range(1, MAX_COUNT + 1)), *facts.colour_names]
    normal = [normalize_answer(a) for a in answers]
    if len(set(normal)) != len(normal):
        raise FinetuneError(f"synthetic answers are not distinct after normalisation: {normal}")
    return AnswerTable(normal)


def _vqa_split(facts: ImageFacts, rng: np.random.Generator, questions_per_image: int,
               near_answer_prob: float) -> tuple[list[str], list[str], list[str], list[dict[str, float]]]:
    names, colours = facts.class_names, facts.colour_names
    n_fg = len(names)
    ids, imgs, sents, labels = [], [], [], []
    for k, img in enumerate(facts.img_ids):
        present = np.nonzero(facts.count[k])[0]
        absent = np.nonzero(facts.count[k] == 0)[0]
        if not len(present):
            continue
        for q in range(questions_per_image):
            kind = int(rng.integers(3))
            c = int(rng.choice(present))
            if kind == 0:
                sent, label = f"what color is the {names[c]} ?", {colours[facts.colour[k, c]]: 1.0}
            elif kind == 1:
                n = int(facts.count[k, c])
                sent, label = f"how many {names[c]}s are there ?", {str(n): 1.0}
                near = [x for x in (n - 1, n + 1) if 1 <= x <= MAX_COUNT]
                if rng.random() < near_answer_prob:
                    label[str(int(rng.choice(near)))] = 0.3
            elif rng.random() < 0.5 or not len(absent) or n_fg < 2:
                sent, label = f"is there a {names[c]} ?", {"yes": 1.0}
            else:
                sent, label = f"is there a {names[int(rng.choice(absent))]} ?", {"no": 1.0}
            ids.append(f"{img}-{q}")
            imgs.append(str(img))
            sents.append(sent)
            labels.append(label)
    return ids, imgs, sents, labels


def synthetic_options(task: str, **options) -> dict[str, Any]:
    """The full options of a synthetic set of `task` (defaults filled in), as its manifest records them."""
    if task == "nlvr2":
        full: dict[str, Any] = {"statements_per_image": 1.0, "pairs_per_statement": 4, "seed": 0}
    elif task in ("vqa", "gqa"):
        # GQA is exact match: one answer with score 1, no soft near answers.
        full = {"questions_per_image": 3, "near_answer_prob": 0.25 if task == "vqa" else 0.0, "seed": 0}
    else:
        raise FinetuneError(f"task {task!r}: expected vqa, gqa or nlvr2")
    if unknown := sorted(set(options) - set(full)):
        raise FinetuneError(f"synthetic {task}: unknown option(s) {', '.join(unknown)}; expected {', '.join(full)}")
    full.update({k: v for k, v in options.items() if v is not None})
    return full


def build_synthetic_vqa(store_path: str | Path, out_dir: str | Path, *, task: str = "vqa",
                        questions_per_image: int = 3, near_answer_prob: float | None = None, seed: int = 0,
                        overwrite: bool = False) -> FinetuneData:
    """VQA-style questions about each image of the synthetic store (see the module docstring).
    task="gqa": the same questions as a GQA set (exact match; near_answer_prob defaults to 0)."""
    options = synthetic_options(task, questions_per_image=questions_per_image, near_answer_prob=near_answer_prob,
                                seed=seed)
    near_answer_prob = options["near_answer_prob"]
    if task == "nlvr2":
        raise FinetuneError("task 'nlvr2': synthetic VQA-style questions are for task vqa or gqa")
    problems = [p for p in (_count_problem("--questions-per-image", questions_per_image, 1),
                            seed_problem("--seed", seed)) if p]
    if not 0 <= near_answer_prob <= 1:  # NaN fails too
        problems.append(f"--near-answer-prob {near_answer_prob}: expected a number in [0, 1]")
    elif task == "gqa" and near_answer_prob:
        problems.append(f"--near-answer-prob {near_answer_prob}: GQA is exact match (one answer a question); "
                        "expected 0 for gqa")
    _refuse(task, problems)
    store = _synthetic(store_path)
    splits: dict[str, FinetuneSplit] = {}
    table: AnswerTable | None = None
    for split in _splits(store):
        facts = image_facts(store, SPLITS[split])
        if table is None:
            table = vqa_answer_table(facts)
        ids, imgs, sents, labels = _vqa_split(facts, _rng(store, seed, split, _VQA), questions_per_image,
                                              near_answer_prob)
        if not ids:
            raise FinetuneError(f"{store.path}: no foreground object in the {SPLITS[split]} images")
        flat = [(table.index(a), s) for lab in labels for a, s in lab.items()]
        splits[split] = FinetuneSplit(
            task=task, ids=np.array(ids, dtype=object), img_ids=np.array(imgs, dtype=object),
            input_ids=_encode(store, sents, f"synthetic {task} {split}"),
            ans_offsets=np.concatenate([[0], np.cumsum([len(lab) for lab in labels])]).astype(np.int64),
            ans_ids=np.array([a for a, _ in flat], np.int32), ans_scores=np.array([s for _, s in flat], np.float32))
    return write_finetune(out_dir, task=task, store=store, splits=splits, answers=table, source="synthetic",
                          overwrite=overwrite, options=options,
                          ignored_by_split={s: {"missing_images": 0, "unknown_answers": 0} for s in splits})


# ============================================================================ NLVR2

Pair = tuple[int, int]


def _pick(rng: np.random.Generator, near: np.ndarray, pool: np.ndarray, avoid: int = -1) -> int:
    """An image of `pool`, half the time (when there is one) a near miss from `near`; not `avoid`."""
    for _ in range(20):
        src = near if len(near) and rng.random() < 0.5 else pool
        x = int(rng.choice(src))
        if x != avoid:
            return x
    return -1


def _swap(rng: np.random.Generator, a: int, b: int) -> Pair:
    return (b, a) if rng.random() < 0.5 else (a, b)


def _both(f: ImageFacts, rng: np.random.Generator, anchor: int, c: int, p: int):
    col = int(f.colour[anchor, c])
    s, not_s = np.nonzero(f.colour[:, c] == col)[0], np.nonzero(f.colour[:, c] != col)[0]
    near = np.nonzero((f.count[:, c] > 0) & (f.colour[:, c] != col))[0]
    if len(s) < 2 or not len(not_s):
        return None
    true = [tuple(int(x) for x in rng.choice(s, 2, replace=False)) for _ in range(p)]
    false = [_swap(rng, int(rng.choice(s)), _pick(rng, near, not_s)) for _ in range(p)]
    return f"there is a {f.colour_names[col]} {f.class_names[c]} in both", true, false


def _total(f: ImageFacts, rng: np.random.Generator, anchor: int, c: int, p: int):
    # Both images hold 1..t-1 objects of class c, drawn alike for true and false pairs, so that one
    # image's count says nothing about the label: true pairs are the ways (x, t - x), false pairs two
    # independent counts in 1..t-1 that do not add up to t (t = 2 has no false pair of that kind).
    cnt = f.count[:, c]
    by = {n: np.nonzero(cnt == n)[0] for n in range(1, MAX_COUNT + 1)}
    totals = [t for t in (3, 4) if all(len(by[x]) >= 2 for x in range(1, t))]
    if not totals:
        return None
    t = int(rng.choice(totals))
    true: list[Pair] = []
    false: list[Pair] = []
    while len(true) < p:
        x = int(rng.integers(1, t))
        a = int(rng.choice(by[x]))
        true.append((a, _pick(rng, by[t - x], by[t - x], avoid=a)))
    while len(false) < p:
        x, y = (int(v) for v in rng.integers(1, t, size=2))
        if x + y != t:
            a = int(rng.choice(by[x]))
            false.append((a, _pick(rng, by[y], by[y], avoid=a)))
    return f"there are {COUNT_WORDS[t]} {f.class_names[c]}s in total", true, false


def _one(f: ImageFacts, rng: np.random.Generator, anchor: int, c: int, p: int):
    n = int(f.count[anchor, c])
    cnt = f.count[:, c]
    h, not_h = np.nonzero(cnt == n)[0], np.nonzero(cnt != n)[0]
    near = np.nonzero((cnt > 0) & (cnt != n))[0]
    if len(h) < 2 or len(not_h) < 2:
        return None
    true = [_swap(rng, int(rng.choice(h)), _pick(rng, near, not_h)) for _ in range(p)]
    false: list[Pair] = []
    for _ in range(p):
        if rng.random() < 0.5:
            false.append(tuple(int(x) for x in rng.choice(h, 2, replace=False)))
        else:
            a = _pick(rng, near, not_h)
            false.append((a, _pick(rng, near, not_h, avoid=a)))
    return f"one image has {COUNT_WORDS[n]} {f.class_names[c]}{'s' if n > 1 else ''}", true, false


TEMPLATES: dict[str, Callable] = {"both": _both, "total": _total, "one": _one}


def _nlvr2_split(f: ImageFacts, rng: np.random.Generator, split: str, statements: int, pairs: int):
    ids, imgs, sents, labels = [], [], [], []
    candidates = np.nonzero(f.count.sum(1) > 0)[0]
    names = list(TEMPLATES)
    for s in range(statements):
        for _ in range(200):
            anchor = int(rng.choice(candidates))
            c = int(rng.choice(np.nonzero(f.count[anchor])[0]))
            made = TEMPLATES[names[int(rng.integers(len(names)))]](f, rng, anchor, c, pairs // 2)
            if made is not None and all(-1 not in pair for pair in made[1] + made[2]):
                break
        else:
            raise FinetuneError(f"synthetic nlvr2 {split}: found no statement with {pairs // 2} true and false "
                                f"pairs among {len(f.img_ids)} images; the store split is too small")
        text, true, false = made
        pool = [(pair, 1) for pair in true] + [(pair, 0) for pair in false]
        for j, i in enumerate(rng.permutation(len(pool))):
            (a, b), label = pool[i]
            ids.append(f"{split}-{s}-{j}-0")  # NLVR2: split-set_id-pair_id-sentence_id
            imgs.append((str(f.img_ids[a]), str(f.img_ids[b])))
            sents.append(text)
            labels.append(label)
    return ids, imgs, sents, labels


def build_synthetic_nlvr2(store_path: str | Path, out_dir: str | Path, *, statements_per_image: float = 1.0,
                          pairs_per_statement: int = 4, seed: int = 0, overwrite: bool = False) -> FinetuneData:
    """NLVR2-style statements about pairs of images of the synthetic store (see the module docstring)."""
    pairs = _count_problem("--pairs-per-statement", pairs_per_statement, 2)
    if pairs is None and pairs_per_statement % 2:
        pairs = (f"--pairs-per-statement {pairs_per_statement}: expected an even number (half of a statement's "
                 "pairs true, half false)")
    problems = [p for p in (pairs, seed_problem("--seed", seed)) if p]
    if not 0 < statements_per_image < math.inf:  # NaN fails too
        problems.append(f"--statements-per-image {statements_per_image}: expected a finite number > 0")
    _refuse("nlvr2", problems)
    store = _synthetic(store_path)
    splits: dict[str, FinetuneSplit] = {}
    for split in _splits(store):
        facts = image_facts(store, SPLITS[split])
        n = max(1, round(len(facts.img_ids) * statements_per_image))
        ids, imgs, sents, labels = _nlvr2_split(facts, _rng(store, seed, split, _NLVR2), split, n, pairs_per_statement)
        splits[split] = FinetuneSplit(task="nlvr2", ids=np.array(ids, dtype=object),
                                      img_ids=np.array(imgs, dtype=object).reshape(-1, 2),
                                      input_ids=_encode(store, sents, f"synthetic nlvr2 {split}"),
                                      labels=np.array(labels, np.int8))
    options = synthetic_options("nlvr2", statements_per_image=statements_per_image,
                                pairs_per_statement=pairs_per_statement, seed=seed)
    return write_finetune(out_dir, task="nlvr2", store=store, splits=splits, answers=None, source="synthetic",
                          overwrite=overwrite, options=options,
                          ignored_by_split={s: {"missing_images": 0} for s in splits})


def ensure_synthetic_finetune(task: str, store_path: str | Path, out_dir: str | Path, **options) -> FinetuneData:
    """The embedded synthetic set of `task` at `out_dir` over the image store at `store_path` (derived
    data, see `xmodal.data.manifest.ensure_derived`): built if missing, reused if built over this very
    store with these options, rebuilt (with a one-line note) if its options or task differ, its image
    store changed (another path, or rebuilt), or its manifest is of an older format. A set ingested
    from reference files there is never replaced. For a set the user named, use `open_finetune`."""
    want = synthetic_options(task, **options)
    store = open_store(store_path)
    fingerprint = store_fingerprint(store)

    def stale(m: FinetuneManifest) -> str | None:
        if m.source != "synthetic":
            raise StoreError(f"{out_dir}: holds a {m.task} set ingested from {m.source} files, not the embedded "
                             f"synthetic {task} set built here; it is not replaced: move it away, or name it "
                             "as the set to use")
        if m.task != task:
            return f"it is a synthetic {m.task} set, {task} asked for"
        if m.store != str(store.path) or m.store_fingerprint != fingerprint:
            return f"its image store changed ({m.store} fingerprint {m.store_fingerprint}, now {store.path} " \
                   f"fingerprint {fingerprint})"
        diff = options_diff(m.options, want)
        return f"built with other options ({'; '.join(diff)})" if diff else None

    def build(p: Path, overwrite: bool) -> FinetuneData:
        if task == "nlvr2":
            return build_synthetic_nlvr2(store.path, p, overwrite=overwrite, **want)
        return build_synthetic_vqa(store.path, p, task=task, overwrite=overwrite, **want)

    return ensure_derived(out_dir, kind=KIND, read=FinetuneManifest.read, stale=stale,
                          open_fn=lambda p: open_finetune(p, store.path), build=build,
                          what=f"the embedded synthetic {task} set")
