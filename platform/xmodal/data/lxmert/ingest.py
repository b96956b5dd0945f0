"""Reference LXMERT feature TSV + pretraining JSON -> feature store (`python jobs/ingest.py lxmert OUT ...`).

Inputs (docs/papers.md#lxmert-data-formats): the pretraining JSON files, read into a compact corpus by
`xmodal.data.lxmert.corpus`, and the feature TSV files (or stores from `jobs/extract.py` in their
place), read by `xmodal.data.lxmert.tsv`.

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

import hashlib
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from xmodal.base.console import progress_bar, say
from xmodal.data.answers import AnswerTable
from xmodal.data.atomic import check_target, local_target
from xmodal.data.lxmert.corpus import Corpus, answer_arrays, load_pretrain_json
from xmodal.data.lxmert.rows import ImageBlock, concat_ranges
from xmodal.data.lxmert.store import KIND, ImageOrder, LxmertStore, MinivalSplit, StoreWriter
from xmodal.data.lxmert.tsv import (
    IngestError,
    TsvImage,
    check_tsv_inputs,
    fail,
    item_id,
    mark_random_weights,
    pack_images,
    parse_item,
    records_sources,
    scan_tsv_ids,
    tsv_lines,
    tsv_lines_at,
)
from xmodal.data.options import seed_problem
from xmodal.data.tokenizer import SPECIAL_TOKENS, WordPieceTokenizer

REFERENCE_MINIVAL = "mscoco_minival.json"  # the reference's minival sentences: their images are minival
SPLIT_METHODS: tuple[str, ...] = ("auto", "reference", "hash")
DEFAULT_MINIVAL_FRACTION = 0.1  # the hash split's default
DEFAULT_VOCAB_SIZE = 30522  # BERT's: a trained vocabulary's most tokens


# ============================================================================ minival


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


def _check_train(used_ids: list[str], split_of: Callable[[str], str], how: MinivalSplit) -> None:
    """At least one image to train on: a store without one is of no use (pretraining and the synthetic
    fine-tuning sets read its train split)."""
    if not used_ids or any(split_of(i) == "train" for i in used_ids):
        return  # (no image at all is the writer's error)
    if how.method == "reference":
        raise IngestError(f"every one of the {len(used_ids)} images with sentences and features is an image of the "
                          f"minival file(s) {', '.join(how.files)}: no training image would be left; expected at "
                          "least one train image (--minival names the held-out images only)")
    raise IngestError(f"--minival-fraction {how.fraction:g} leaves no training image: all {len(used_ids)} images "
                      "with sentences and features fall in minival by a hash of img_id; expected at least one "
                      "train image: a smaller fraction or more images")


def check_given_once(option: str, given: Iterable[str | Path]) -> list[Path]:
    """The files of a repeatable `option`, resolved; one named twice (as the same path or two spellings
    of it) is an error naming it, not read twice (nor, for some options, quietly once)."""
    seen: dict[Path, str | Path] = {}
    for g in given:
        p = Path(g).expanduser().resolve()
        if p in seen:
            both = f"{option} {g}: given twice" if str(seen[p]) == str(g) else \
                f"{option} {seen[p]} and {option} {g}: the same file given twice"
            raise IngestError(f"{both} ({p}); expected each file once")
        seen[p] = g
    return list(seen)


# ============================================================================ the ingest


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


def _block(images: list[TsvImage], sentences: Sentences, num_objects: int, feat_dim: int,
           with_sources: bool) -> ImageBlock:
    """The images with their sentences; `with_sources`: with where each came from (None for a TSV line's)."""
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
        ans_ids=ans_lab[idx], ans_scores=ans_score[idx],
        source=np.array([im.source for im in images], dtype=object) if with_sources else None)


def ingest_lxmert(out: str | Path, tsv: list[str | Path], json_files: list[str | Path], *,
                  vocab: str | Path | None = None, answers: str | Path | None = None, num_answers: int = 9500,
                  vocab_size: int | None = None, split: str = "auto", minival: list[str | Path] | None = None,
                  minival_fraction: float | None = None, max_seq_len: int = 20,
                  num_objects: int = 36, feat_dim: int | None = None, num_object_labels: int = 1600,
                  num_attr_labels: int = 400, images_per_shard: int = 256, row_group_images: int = 32,
                  allow_missing_images: bool = False, allow_missing_labelf: bool = False, overwrite: bool = False,
                  order_seed: int | None = 0, progress: bool = True) -> LxmertStore:
    """Build a store from reference files; see the module docstring for the checks and their order.
    `split`, `minival`, `minival_fraction`: how minival is chosen (`choose_minival`); the minival
    files are sentence files too (a file given both as --json and --minival is read once).
    `order_seed`: the images are written in the seeded random order of `order_key` (None: in the
    order of the TSV files), so every shard and row group mixes the sources (COCO, VG).
    `vocab_size`: the most tokens a trained vocabulary may hold (default 30522, BERT's; not with `vocab`)."""
    if order_seed is not None and (problem := seed_problem("--order-seed", order_seed)):
        raise IngestError(problem)
    vocab_size = _vocab_size(vocab, vocab_size)
    out_path = local_target(out)
    check_target(out_path, overwrite, KIND)  # before reading anything
    tsv_paths, json_paths = check_given_once("--tsv", tsv), check_given_once("--json", json_files)
    minival_paths = check_given_once("--minival", minival or [])
    _check_inputs(tsv_paths, json_paths, [*minival_paths, *(Path(x) for x in (vocab, answers) if x is not None)],
                  num_answers=num_answers, vocab_size=vocab_size, num_objects=num_objects,
                  num_object_labels=num_object_labels, num_attr_labels=num_attr_labels,
                  images_per_shard=images_per_shard, row_group_images=row_group_images,
                  feat_dim=1 if feat_dim is None else feat_dim)
    how, note = choose_minival(split, json_paths, minival_paths, minival_fraction)
    if note:
        say(f"[xmodal] note: {note}")

    # 1. sentences, answers, tokens
    sentence_files = list(dict.fromkeys([*json_paths, *minival_paths]))  # each file once, in order
    corpus, minival_ids = _read_corpus(sentence_files, how, allow_missing_labelf)
    table = _answer_table(corpus, answers, num_answers)
    tokenizer = WordPieceTokenizer.from_vocab(vocab, max_seq_len) if vocab is not None else \
        _trained_tokenizer(corpus, max_seq_len, vocab_size)
    sentences, counters = _sentences(corpus, table, tokenizer)

    # 2. which images have features (every line's shape, no decoding)
    offsets: dict[str, tuple[int, int, int]] = {}
    located = scan_tsv_ids(tsv_paths, progress, feat_dim, offsets)
    missing = _drop_missing_images(corpus, sentences, located, allow_missing_images)
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
    _check_train(used_ids, split_of, how)
    lines, order = _ordered_lines(tsv_paths, used_ids, offsets, order_seed)
    limits = dict(feat_dim=feat_dim, num_objects=num_objects, num_object_labels=num_object_labels,
                  num_attr_labels=num_attr_labels)
    layout = dict(max_seq_len=max_seq_len, images_per_shard=images_per_shard, row_group_images=row_group_images,
                  overwrite=overwrite)
    return _write(out_path, _progress(lines, sentences, len(used_ids), progress), sentences, split_of, limits, layout,
                  options, with_sources=records_sources(tsv_paths), tokenizer=tokenizer, answers=table, source="lxmert",
                  num_object_labels=num_object_labels, num_attr_labels=num_attr_labels,
                  inputs=[str(p) for p in [*tsv_paths, *sentence_files]], minival_split=how, image_order=order,
                  **counters)


def _check_inputs(tsv_paths: list[Path], json_paths: list[Path], other_files: list[Path], **counts: int) -> None:
    """The inputs exist and are of the right kind, and every count is >= 1 (named by its option)."""
    if not tsv_paths or not json_paths:
        raise IngestError("need at least one --tsv feature file and one --json sentence file")
    check_tsv_inputs(tsv_paths)
    for p in [*json_paths, *other_files]:
        if p.is_dir():
            raise IngestError(f"{p}: is a directory; expected an input file")
        if not p.is_file():
            raise IngestError(f"{p}: input file does not exist")
    for name, value in counts.items():
        if value < 1:
            raise IngestError(f"--{name.replace('_', '-')} {value}: expected >= 1")


def _read_corpus(sentence_files: list[Path], how: MinivalSplit, allow_missing_labelf: bool) -> tuple[Corpus, set[str]]:
    """Every sentence file into one corpus, and the img_ids of the minival files."""
    corpus = Corpus()
    minival_ids: set[str] = set()
    for p in sentence_files:
        ids = load_pretrain_json(p, corpus, allow_missing_labelf=allow_missing_labelf)
        if str(p) in how.files:
            if not ids:
                raise IngestError(f"{p}: the minival file has no records; expected the reference's minival "
                                  "sentences (a JSON list of {\"img_id\", \"sentf\", \"labelf\"} records)")
            minival_ids |= ids
    return corpus, minival_ids


def _vocab_size(vocab: str | Path | None, vocab_size: int | None) -> int:
    """The most tokens of a trained vocabulary; a size given with a vocabulary file would be ignored."""
    if vocab is not None and vocab_size is not None:
        raise IngestError(f"--vocab-size {vocab_size}: sizes a trained vocabulary, but --vocab {vocab} is used as it "
                          "is; drop one of them")
    return DEFAULT_VOCAB_SIZE if vocab_size is None else vocab_size


def _trained_tokenizer(corpus: Corpus, max_seq_len: int, vocab_size: int) -> WordPieceTokenizer:
    """A WordPiece vocabulary of at most `vocab_size` tokens trained on the corpus. The trainer always
    keeps the special tokens and every character of the sentences (alone and as a ## continuation),
    so it returns more than asked when they alone are more: that is refused, naming that minimum."""
    tokenizer = WordPieceTokenizer.train(corpus.sentences(), max_seq_len, vocab_size=vocab_size, length=len(corpus))
    if tokenizer.vocab_size > vocab_size:
        raise IngestError(f"--vocab-size {vocab_size}: below the smallest vocabulary of these sentences, "
                          f"{tokenizer.vocab_size} tokens (the {len(SPECIAL_TOKENS)} special tokens and every "
                          f"character of the sentences, alone and as a ## continuation); expected >= "
                          f"{tokenizer.vocab_size}")
    return tokenizer


def _answer_table(corpus: Corpus, answers: str | Path | None, num_answers: int) -> AnswerTable:
    """The reference's answer table (--answers), else the corpus's most frequent answers."""
    if answers is not None:
        return AnswerTable.from_reference(answers, limit=num_answers)
    table = AnswerTable.most_frequent(corpus.raw_answer_occurrences(), num_answers)
    return table if len(table) else AnswerTable(["yes"])  # a corpus without questions still needs a QA head


def _sentences(corpus: Corpus, table: AnswerTable, tokenizer: WordPieceTokenizer) -> tuple[Sentences, dict[str, int]]:
    """The corpus tokenised and its answers looked up (its text dropped after), with the manifest's counters."""
    counters = {"missing_labelf": corpus.missing_labelf}
    *ans, answer_counts = answer_arrays(corpus, table)
    counters.update(answer_counts)
    tokens, counters["truncated_sentences"] = tokenizer.encode_batches(corpus.sentence_batches(), len(corpus))
    corpus.drop_text()
    order, image_offsets = corpus.images()
    return Sentences(corpus.image_ids, order, image_offsets, tokens, tuple(ans)), counters


def _drop_missing_images(corpus: Corpus, sentences: Sentences, located: dict[str, str],
                         allow_missing_images: bool) -> list[str]:
    """The images with sentences but no features: an error naming the first, or (allowed) dropped."""
    missing = [i for i in corpus.image_ids if i not in located and sentences.count(i)]
    if missing and not allow_missing_images:
        first = missing[0]
        raise fail(corpus.first_seen(corpus.image_ids[first]),
                   f"img_id {first!r} has sentences but no features in any --tsv file "
                   f"({len(missing)} such image(s); --allow-missing-images drops them)")
    for i in missing:
        del sentences.image_ids[i]
    return missing


def _ordered_lines(tsv_paths: list[Path], used_ids: list[str], offsets: dict[str, tuple[int, int, int]],
                   order_seed: int | None) -> tuple[Iterable[tuple[str, str | TsvImage]], ImageOrder]:
    """The input lines in the order the store is written in: the files' (order_seed None), or the
    seeded random order of `order_key` (bounded memory: only the (image, offset) list is sorted; the
    lines are read one at a time)."""
    if order_seed is None:
        return tsv_lines(tsv_paths), ImageOrder(method="source")
    used_ids = sorted(used_ids, key=lambda i: order_key(i, order_seed))
    return tsv_lines_at(tsv_paths, (offsets[i] for i in used_ids)), ImageOrder(method="seeded", seed=order_seed)


def _progress(lines: Iterable[tuple[str, str | TsvImage]], sentences: Sentences, used: int,
              progress: bool) -> Iterator[tuple[str, str | TsvImage]]:
    """The lines of the images that have sentences, counted on a progress bar."""
    bar = progress_bar(used, "decode TSV", "img", progress)
    for where, line in lines:
        if sentences.count(item_id(line)):
            yield where, line
            bar.update(1)
    bar.close()


def _write(out_path: Path, lines: Iterable[tuple[str, str | TsvImage]], sentences: Sentences,
           split_of: Callable[[str], str], limits: dict[str, Any], layout: dict[str, Any], options: dict[str, Any],
           *, with_sources: bool, **finish: Any) -> LxmertStore:
    """Decode and check each line, deal the images into train and minival, write the store (with a
    `source` column when an input records where its images came from). The writer (the store's
    temporary folder) is made at the first image, whose width it takes."""
    writer: StoreWriter | None = None
    buffers: dict[str, list[TsvImage]] = {"train": [], "minival": []}
    chunk = max(1, min(layout["images_per_shard"], 64))
    num_objects = limits["num_objects"]
    try:
        for where, line in lines:
            im = parse_item(line, where, **limits)
            if writer is None:
                limits["feat_dim"] = options["feat_dim"] = im.features.shape[1]
                writer = StoreWriter(out_path, num_objects=num_objects, feat_dim=limits["feat_dim"], **layout)
            split = split_of(im.img_id)
            buffers[split].append(im)
            if len(buffers[split]) >= chunk:
                writer.add(split, _block(buffers[split], sentences, num_objects, limits["feat_dim"], with_sources))
                buffers[split] = []
        if writer is None:
            raise IngestError("no image has both features and sentences: nothing to write")
        for split, images in buffers.items():
            if images:
                writer.add(split, _block(images, sentences, num_objects, limits["feat_dim"], with_sources))
        return writer.finish(options=options, **finish)
    except BaseException:
        if writer is not None:
            writer.discard()
        raise
