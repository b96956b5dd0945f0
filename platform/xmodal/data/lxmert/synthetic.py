"""Synthetic learnable LXMERT corpus -> feature store (`python jobs/ingest.py synthetic OUT`).

Every pretraining task is learnable, so "it learns" is a checkable claim:
- Each image holds 1-3 groups of foreground objects (distinct classes, 1-4 objects each, one colour
  attribute per group); the other object slots are background classes that no sentence names, or,
  with `background_objects=False`, padding (the image holds its named objects only).
- An object's feature = its class prototype + its attribute prototype + Gaussian noise, so a
  nearest-prototype classifier recovers the class; the detector labels are the true class and
  attribute with a confidence in [0.5, 1] / [0.3, 1]. Boxes are random but valid.
- Captions name the foreground objects present ("a red cube and two blue balls"), in random order:
  a masked object or colour word can only be recovered from the image. A caption drawn from another
  image (a mismatch) names classes that are almost surely absent here. A caption names one, two or
  all of the groups, or, with `captions_name_all_groups=True`, all of them.
- Questions ask colour ("what color is the cube ?" -> red), count ("how many balls are there ?"
  -> 2) and presence ("is there a cone ?" -> yes/no); the answers follow from the objects.
Classes and colours beyond the built-in word lists get pronounceable made-up names, so paper dims
(1600 classes, 400 attributes) work. Builds ~2000 images at feat_dim 64 in about a second.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from xmodal.base.errors import UserError
from xmodal.data.answers import AnswerTable
from xmodal.data.errors import StoreError
from xmodal.data.lxmert.rows import ImageBlock
from xmodal.data.lxmert.store import KIND, LxmertManifest, LxmertStore, MinivalSplit, StoreWriter, open_store
from xmodal.data.manifest import ensure_derived, options_diff, options_json
from xmodal.data.options import SyntheticLxmertOptions, out_of_bounds
from xmodal.data.tokenizer import WordPieceTokenizer

COLOURS = ["red", "blue", "green", "yellow", "purple", "orange", "white", "black", "gray", "brown",
           "pink", "cyan", "gold", "silver", "tan", "navy"]
SHAPES = ["cube", "ball", "cone", "cup", "box", "ring", "star", "disk", "block", "vase", "bowl", "shoe", "hat",
          "lamp", "book", "chair", "table", "clock", "bottle", "plate", "key", "bell", "drum", "kite", "fork",
          "spoon", "bag", "boat", "car", "tree", "flower", "leaf", "bird", "fish", "cat", "dog", "horse", "train",
          "bus", "phone"]
COUNT_WORDS = {1: "a", 2: "two", 3: "three", 4: "four"}
MAX_GROUPS = 3
MAX_COUNT = 4
_SYLLABLES = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]


def _made_up(i: int) -> str:
    """A distinct pronounceable 6-letter word for each i < 70**3 (CVCVCV; no template word has that shape)."""
    n = len(_SYLLABLES)
    return _SYLLABLES[i % n] + _SYLLABLES[(i // n) % n] + _SYLLABLES[(i // n // n) % n]


def class_names(n: int) -> list[str]:
    return [SHAPES[i] if i < len(SHAPES) else _made_up(i) for i in range(n)]


def colour_names(n: int) -> list[str]:
    return [COLOURS[i] if i < len(COLOURS) else _made_up(150_000 + i) for i in range(n)]


@dataclasses.dataclass
class _Scene:
    obj_ids: np.ndarray  # (K, N) int32 true class, -1 on padding
    attr_ids: np.ndarray  # (K, N) int32 true attribute, -1 on padding
    num_boxes: np.ndarray  # (K,) int32 real objects (the first num_boxes slots)
    sentences: list[list[str]]  # per image
    answers: list[list[str | None]]  # per image, per sentence (None = caption)


# Why a bound is what it is, where the bound alone does not say.
_WHY = {"num_images": "mismatched sentences come from other images",
        "num_object_labels": "foreground and background classes",
        "max_seq_len": "the synthetic sentences need 8 tokens"}


def minival_images(o: SyntheticLxmertOptions) -> int:
    """How many of the images the store deals into minival."""
    return int(round(o.num_images * o.minival_fraction))


def _check(o: SyntheticLxmertOptions) -> None:
    """Only the options that are wrong, each by its flag and value and what it allows; then the store's
    one need across options: at least one train image (a store without is of no use to pretraining or
    to a fine-tuning set over it)."""
    problems = [p + (f" ({_WHY[k]})" if k in _WHY else "") for k, p in out_of_bounds(o).items()]
    if problems:
        raise UserError("invalid synthetic options: " + "; ".join(problems))
    n_val = minival_images(o)
    if n_val >= o.num_images:
        raise UserError(f"--minival-fraction {o.minival_fraction} leaves no training image of --num-images "
                        f"{o.num_images} ({n_val} would be minival); expected at least one train image: a "
                        f"smaller fraction (below {1 - 0.5 / o.num_images:g}) or more images")


def _scenes(o: SyntheticLxmertOptions, rng: np.random.Generator) -> _Scene:
    k, n = o.num_images, o.num_objects
    n_bg = max(1, o.num_object_labels // 5)
    n_fg = o.num_object_labels - n_bg  # classes [0, n_fg) are named; [n_fg, L) are background
    cls_names, col_names = class_names(n_fg), colour_names(o.num_attr_labels)
    obj_ids = (n_fg + rng.integers(0, n_bg, size=(k, n))).astype(np.int32)  # background everywhere first
    attr_ids = rng.integers(0, o.num_attr_labels, size=(k, n)).astype(np.int32)
    num_boxes = np.full(k, n, np.int32)
    if not o.background_objects:
        obj_ids[:], attr_ids[:] = -1, -1
    sentences: list[list[str]] = []
    answers: list[list[str | None]] = []
    for i in range(k):
        g = int(rng.integers(1, min(MAX_GROUPS, n_fg, n) + 1))
        classes = rng.choice(n_fg, size=g, replace=False)
        counts = rng.integers(1, MAX_COUNT + 1, size=g)
        while counts.sum() > n:  # few object slots: shrink the largest group
            counts[np.argmax(counts)] -= 1
        keep = counts > 0
        classes, counts = classes[keep], counts[keep]
        colours = rng.integers(0, o.num_attr_labels, size=len(classes))
        if o.background_objects:
            slots = rng.permutation(n)[: counts.sum()]
        else:  # only the named objects, in the first slots
            slots = rng.permutation(int(counts.sum()))
            num_boxes[i] = len(slots)
        obj_ids[i, slots] = np.repeat(classes, counts)
        attr_ids[i, slots] = np.repeat(colours, counts)

        def phrase(j: int, counts=counts, colours=colours, classes=classes) -> str:
            c = int(counts[j])
            return f"{COUNT_WORDS[c]} {col_names[colours[j]]} {cls_names[classes[j]]}{'s' if c > 1 else ''}"

        sents: list[str] = []
        answs: list[str | None] = []
        for _ in range(o.sentences_per_image):
            j = int(rng.integers(len(classes)))
            name = cls_names[classes[j]]
            if rng.random() < o.question_fraction:
                kind = int(rng.integers(4))
                if kind == 0:
                    sents.append(f"what color is the {name} ?")
                    answs.append(col_names[colours[j]])
                elif kind == 1:
                    sents.append(f"how many {name}s are there ?")
                    answs.append(str(int(counts[j])))
                elif kind == 2 or n_fg <= len(classes):
                    sents.append(f"is there a {name} ?")
                    answs.append("yes")
                else:
                    absent = int(rng.integers(n_fg - len(classes)))  # uniform over the absent classes:
                    for c in np.sort(classes):  # shift past each present class, ascending
                        absent += absent >= c
                    sents.append(f"is there a {cls_names[absent]} ?")
                    answs.append("no")
            else:
                kind = 0 if o.captions_name_all_groups else int(rng.integers(3))
                order = rng.permutation(len(classes))
                if kind == 0:
                    sents.append(" and ".join(phrase(int(x)) for x in order))
                elif kind == 1 or len(classes) < 2:
                    sents.append(f"there {'is' if counts[j] == 1 else 'are'} {phrase(j)}")
                else:
                    sents.append(f"{phrase(int(order[0]))} next to {phrase(int(order[1]))}")
                answs.append(None)
        sentences.append(sents)
        answers.append(answs)
    return _Scene(obj_ids=obj_ids, attr_ids=attr_ids, num_boxes=num_boxes, sentences=sentences, answers=answers)


def prototypes(o: SyntheticLxmertOptions) -> tuple[np.ndarray, np.ndarray]:
    """(class prototypes (L, F), attribute prototypes (A, F)) float32, from the options' seed."""
    rng = np.random.default_rng([o.seed, 0xFEA7])
    cls = rng.standard_normal((o.num_object_labels, o.feat_dim), dtype=np.float32)
    attr = 0.5 * rng.standard_normal((o.num_attr_labels, o.feat_dim), dtype=np.float32)
    return cls, attr


def _blocks(o: SyntheticLxmertOptions, scene: _Scene, tokenizer: WordPieceTokenizer, table: AnswerTable,
            split_of: np.ndarray, chunk: int, counters: dict[str, int]) -> Iterator[tuple[str, ImageBlock]]:
    rng = np.random.default_rng([o.seed, 0xB0C5])
    p_cls, p_attr = prototypes(o)
    k, n = o.num_images, o.num_objects
    for lo in range(0, k, chunk):
        hi = min(k, lo + chunk)
        m = hi - lo
        obj, attr = scene.obj_ids[lo:hi], scene.attr_ids[lo:hi]
        feats = p_cls[obj] + p_attr[attr]  # (m, N, F)
        feats += o.feature_noise * rng.standard_normal(feats.shape, dtype=np.float32)
        xy = rng.uniform(0.0, 0.9, size=(m, n, 2)).astype(np.float32)
        wh = (rng.uniform(0.05, 1.0, size=(m, n, 2)) * (1.0 - xy)).astype(np.float32)
        padding = obj < 0  # (m, N)
        feats[padding], xy[padding], wh[padding] = 0, 0, 0
        sents = [s for i in range(lo, hi) for s in scene.sentences[i]]
        ids, truncated = tokenizer.encode(sents)
        counters["truncated_sentences"] += truncated
        ans_ids, ans_counts = [], []
        for i in range(lo, hi):
            for a in scene.answers[i]:
                label = table.index(a) if a is not None else None
                if a is not None and label is None:
                    counters["unknown_answers"] += 1
                    counters["unanswerable_questions"] += 1
                ans_counts.append(0 if label is None else 1)
                if label is not None:
                    ans_ids.append(label)
        block = ImageBlock(
            img_id=np.array([f"syn{i:07d}" for i in range(lo, hi)], dtype=object),
            img_h=np.full(m, 480, np.int32), img_w=np.full(m, 640, np.int32), num_boxes=scene.num_boxes[lo:hi],
            features=feats.astype(np.float16), boxes=np.concatenate([xy, xy + wh], axis=-1),
            obj_ids=obj, obj_conf=np.where(padding, 0, rng.uniform(0.5, 1.0, size=(m, n))).astype(np.float32),
            attr_ids=attr, attr_conf=np.where(padding, 0, rng.uniform(0.3, 1.0, size=(m, n))).astype(np.float32),
            sent_offsets=np.arange(m + 1, dtype=np.int64) * o.sentences_per_image, input_ids=ids,
            ans_offsets=np.concatenate([[0], np.cumsum(ans_counts)]).astype(np.int64),
            ans_ids=np.array(ans_ids, dtype=np.int32), ans_scores=np.ones(len(ans_ids), np.float32))
        splits = split_of[lo:hi]
        for split in ("train", "minival"):
            idx = np.nonzero(splits == (split == "minival"))[0]
            if len(idx):
                yield split, block.take(idx)


def build_synthetic_store(path: str | Path, options: SyntheticLxmertOptions | None = None, *,
                          overwrite: bool = False, progress: bool = False) -> LxmertStore:
    """Generate the corpus, train its WordPiece vocabulary, write the store (atomically)."""
    o = options or SyntheticLxmertOptions()
    _check(o)
    rng = np.random.default_rng([o.seed, 0x5CE4E])
    with StoreWriter(path, num_objects=o.num_objects, feat_dim=o.feat_dim, max_seq_len=o.max_seq_len,
                     images_per_shard=o.images_per_shard, row_group_images=min(32, o.images_per_shard),
                     overwrite=overwrite) as writer:
        scene = _scenes(o, rng)
        corpus = [s for sents in scene.sentences for s in sents]
        tokenizer = WordPieceTokenizer.train(corpus, o.max_seq_len)
        table = AnswerTable.most_frequent([a for ans in scene.answers for a in ans if a is not None], o.num_answers)
        n_val = minival_images(o)
        split_of = np.zeros(o.num_images, dtype=bool)  # True = minival
        split_of[rng.permutation(o.num_images)[:n_val]] = True
        counters = {"truncated_sentences": 0, "unknown_answers": 0, "unanswerable_questions": 0}
        chunk = max(1, min(o.images_per_shard, (64 << 20) // max(1, o.num_objects * o.feat_dim * 4)))
        blocks = _blocks(o, scene, tokenizer, table, split_of, chunk, counters)
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=o.num_images, unit="img", desc="synthetic", dynamic_ncols=True)
            for split, block in blocks:
                writer.add(split, block)
                bar.update(block.num_images)
            bar.close()
        else:
            for split, block in blocks:
                writer.add(split, block)
        return writer.finish(tokenizer=tokenizer, answers=table, source="synthetic",
                             num_object_labels=o.num_object_labels, num_attr_labels=o.num_attr_labels,
                             options=_options_dict(o),
                             minival_split=MinivalSplit(method="seeded", fraction=o.minival_fraction), **counters)


def _options_dict(o: SyntheticLxmertOptions) -> dict:
    return options_json(dataclasses.asdict(o))  # as it reads back from manifest.json


def ensure_synthetic_store(path: str | Path, options: SyntheticLxmertOptions | None = None, *,
                           progress: bool = False) -> LxmertStore:
    """The embedded synthetic store at `path` (derived data, see `xmodal.data.manifest.ensure_derived`):
    built if missing, reused if built with these options, rebuilt (with a one-line note) if built with
    other options or its manifest is of an older format. A store ingested from real files there is
    never replaced. For a store the user named, use `open_store` (it never modifies anything)."""
    o = options or SyntheticLxmertOptions()
    want = _options_dict(o)

    def stale(m: LxmertManifest) -> str | None:
        if m.source != "synthetic":
            raise StoreError(f"{path}: holds an LXMERT store ingested from {m.source!r} files, not the embedded "
                             "synthetic store built here; it is not replaced: move it away, or name it as the "
                             "store to use")
        diff = options_diff(m.options, want)
        return f"built with other synthetic options ({'; '.join(diff)})" if diff else None

    return ensure_derived(path, kind=KIND, read=LxmertManifest.read, stale=stale, open_fn=open_store,
                          build=lambda p, overwrite: build_synthetic_store(p, o, overwrite=overwrite,
                                                                           progress=progress),
                          what="the embedded synthetic LXMERT store")
