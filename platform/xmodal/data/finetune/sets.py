"""LXMERT fine-tuning sets (VQA, GQA, NLVR2) on disk, and their batches.

A fine-tuning set references the images of existing image stores by img_id: LXMERT stores
(`xmodal.data.lxmert.store`) and feature-only stores (`xmodal.data.lxmert.features`, e.g. NLVR2's own
images, GQA testdev). Features are not copied, so a set is a few MB and several sets share a store:

    DIR/manifest.json     task, store (the LXMERT store whose tokenizer made input_ids: absolute path +
                          fingerprint), image_stores (every store the images are looked up in, in
                          order, with their fingerprints), examples per split, answer count, counters
                          of what the ingest ignored, where the set came from
    DIR/answers.json      vqa/gqa: the answer table (label index = position), `AnswerTable.save`
    DIR/<split>.parquet   one file per split

Rows: one Parquet file per split, `xmodal.data.finetune.split` (its examples in memory and as Arrow).
`input_ids` were tokenised with the store's tokenizer to the store's max_seq_len ([CLS] ... [SEP]
[PAD]...), so a set is only valid with the stores it was made from: the manifest keeps a fingerprint
of each store (manifest minus its date, plus vocab.txt for an LXMERT store) and `open_finetune` refuses a store that no longer matches. An image is taken from the first
store (in the recorded order) that holds its img_id. A set written before several stores were
recorded has no image_stores: its one store is `store`.

Writes go to a hidden temporary directory beside the target that is renamed into place only when
complete and re-opened; any error removes it. An existing set is replaced only with overwrite=True,
and never a directory that is not a fine-tuning set (e.g. the feature store itself).

Batches: the fine-tuning job streams a split, each rank reading only its own row groups
(`xmodal.data.finetune.stream`). `iter_finetune_batches` is the in-memory path for small sets and
tests: the image features a split needs are read from the stores once (only the row groups that
hold them) and kept as float16 arrays (`FinetuneData.images`); every epoch is a permutation fixed by
(seed, epoch), cut into equal shares per rank (the remainder is dropped). Imports numpy and pyarrow
only (torch when batches are made, so ingesting does not load it).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pydantic

from xmodal.data.answers import AnswerError, AnswerTable
from xmodal.data.atomic import StagedDir, check_target, local_target
from xmodal.data.errors import StoreError
from xmodal.data.finetune.split import (
    FinetuneError,
    FinetuneSplit,
    check_task,
    split_schema,
    split_to_table,
    table_to_split,
)
from xmodal.data.location import Location, locate, open_parquet, store_path
from xmodal.data.lxmert.features import FeatureStore, ImageStore, open_image_store
from xmodal.data.lxmert.store import LxmertStore, open_store
from xmodal.data.manifest import Manifest
from xmodal.data.tokenizer import VOCAB_FILE
from xmodal.data.units import open_listed_parquet

if TYPE_CHECKING:
    from xmodal.core.batches import Nlvr2Batch, VqaBatch

KIND = "lxmert-finetune"
SCHEMA_VERSION = 1
_SPLIT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")


# ============================================================================ manifest


class StoreRef(pydantic.BaseModel):
    """One image store a set looks its images up in."""

    model_config = pydantic.ConfigDict(extra="forbid")

    path: str  # absolute
    kind: Literal["lxmert", "features"]
    fingerprint: str  # `store_fingerprint(store)` when the set was made


class FinetuneManifest(Manifest):
    """What `manifest.json` holds (kind "lxmert-finetune"); `open_finetune` checks it against the files
    and the store."""

    KIND: ClassVar[str] = KIND
    SCHEMA_VERSION: ClassVar[int] = SCHEMA_VERSION

    task: Literal["vqa", "gqa", "nlvr2"]
    store: str  # absolute path of the LXMERT store whose tokenizer (and maybe images) this set uses
    store_fingerprint: str  # `store_fingerprint(store)` when the set was made
    # Where images are looked up, in order (the first store holding an img_id gives it); empty in
    # sets written before several stores were recorded: then `store` alone.
    image_stores: list[StoreRef] = []
    max_seq_len: pydantic.PositiveInt
    splits: dict[str, pydantic.NonNegativeInt]  # split -> examples
    num_answers: pydantic.NonNegativeInt  # answer table size (0 for nlvr2)
    source: str  # "reference" (fine-tuning JSON) or "synthetic"
    # Records the ingest left out or changed: missing_images (examples dropped), unknown_answers
    # (answers dropped from a question's label). Totals, then per split.
    ignored: dict[str, int] = {}
    ignored_by_split: dict[str, dict[str, int]] = {}
    missing_image_examples: list[dict[str, str]] = []  # up to 5
    # Informational: unanswerable_questions (no answer left in the table), truncated_sentences.
    stats: dict[str, int] = {}
    inputs: dict[str, list[str]] = {}  # split -> absolute paths ingested
    options: dict[str, Any] = {}  # what built it (synthetic sets)
    created: str = ""

    def store_refs(self) -> list[StoreRef]:
        """The image stores, in lookup order (an older set's one store included)."""
        return list(self.image_stores) or [StoreRef(path=self.store, kind="lxmert", fingerprint=self.store_fingerprint)]

    def check(self, where: str) -> None:
        for name in self.splits:
            if not _SPLIT_NAME.match(name):
                raise StoreError(f"{where}: field splits.{name} = {name!r}: expected a split name of letters, "
                                 "digits, '_' or '-'")


def store_fingerprint(store: ImageStore) -> str:
    """Identity of a store's contents: its manifest without the build date, and (LXMERT store) its
    vocabulary file. Any rebuild that changes images, counts or token ids changes it (a synthetic
    store rebuilt with the same options usually does too: its WordPiece training orders tied tokens
    differently)."""
    h = hashlib.sha256(json.dumps(store.manifest.identity(), sort_keys=True).encode())
    if isinstance(store, LxmertStore):
        h.update((store.path / VOCAB_FILE).read_bytes())
    return h.hexdigest()[:16]


def store_ref(store: ImageStore) -> StoreRef:
    return StoreRef(path=str(store.path), kind="features" if isinstance(store, FeatureStore) else "lxmert",
                    fingerprint=store_fingerprint(store))


def check_same_dims(stores: list[ImageStore], where: str) -> None:
    """Every image store of a set has the same objects per image and feature width (batches stack them)."""
    first = stores[0]
    for st in stores[1:]:
        a, b = first.manifest, st.manifest
        if (a.num_objects, a.feat_dim) != (b.num_objects, b.feat_dim):
            raise FinetuneError(f"{where}: the image store {st.path} has num_objects={b.num_objects}, "
                                f"feat_dim={b.feat_dim}, but {first.path} has num_objects={a.num_objects}, "
                                f"feat_dim={a.feat_dim}; the stores of one set must agree")


# ============================================================================ the opened set


@dataclass
class SplitImages:
    """The store images one split uses, in memory: K images, N objects, F features."""

    img_ids: np.ndarray  # (K,) object str
    features: np.ndarray  # (K, N, F) float16
    boxes: np.ndarray  # (K, N, 4) float32 normalised x1 y1 x2 y2
    visual_mask: np.ndarray  # (K, N) bool, True = real object
    rows: np.ndarray  # (E,) vqa/gqa or (E, 2) nlvr2, int64: image of each example


class FinetuneData:
    """An opened, checked fine-tuning set. Splits and their images are loaded on first use and kept.
    `store`: the LXMERT store whose tokenizer made the set; `image_stores`: where images are looked
    up, in order (default: `store` alone). Pickles as (path, manifest, stores, answers): caches are
    rebuilt where it is unpickled."""

    def __init__(self, path: Path | Location, manifest: FinetuneManifest, store: LxmertStore, answers: AnswerTable | None,
                 image_stores: list[ImageStore] | None = None):
        self.path = path
        self.manifest = manifest
        self.store = store
        self.answers = answers
        self.image_stores: list[ImageStore] = list(image_stores) if image_stores else [store]
        self._splits: dict[str, FinetuneSplit] = {}
        self._images: dict[str, SplitImages] = {}
        self._store_index: dict[str, tuple[int, str, int]] | None = None
        self._layouts: dict[str, Any] = {}  # split -> its layout, `stream.split_layout`'s cache

    def __getstate__(self) -> dict:
        return {"path": self.path, "manifest": self.manifest, "store": self.store, "answers": self.answers,
                "image_stores": self.image_stores}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["path"], state["manifest"], state["store"], state["answers"], state.get("image_stores"))

    def __repr__(self) -> str:
        sizes = ", ".join(f"{s} {n}" for s, n in self.manifest.splits.items())
        images = "" if [self.store] == self.image_stores else \
            f", images {', '.join(repr(str(st.path)) for st in self.image_stores)}"
        return f"FinetuneData({str(self.path)!r}, {self.task}, {sizes}, store {str(self.store.path)!r}{images})"

    @property
    def task(self) -> str:
        return self.manifest.task

    @property
    def splits(self) -> tuple[str, ...]:
        return tuple(self.manifest.splits)

    @property
    def num_answers(self) -> int:
        return self.manifest.num_answers

    def _check_split(self, name: str) -> None:
        if name not in self.manifest.splits:
            raise FinetuneError(f"{self.path}: no split {name!r}; it has {', '.join(self.manifest.splits)}")

    def split(self, name: str) -> FinetuneSplit:
        """The examples of split `name` (read once, then cached)."""
        self._check_split(name)
        if name not in self._splits:
            p = self.path / f"{name}.parquet"
            try:
                table = open_parquet(p).read()
            except (OSError, pa.ArrowException) as e:
                raise FinetuneError(f"{p}: cannot read ({type(e).__name__}: {e}); re-create the set") from None
            sp = table_to_split(table, self.task)
            sp.check(str(p), self.num_answers)
            self._splits[name] = sp
        return self._splits[name]

    def ids(self, split: str) -> list[str]:
        """question_id (vqa/gqa) or identifier (nlvr2) of each row of the split."""
        return self.split(split).ids.tolist()

    def num_batches(self, split: str, batch_size: int, world: int = 1, drop_last: bool = True) -> int:
        """Batches per rank per epoch of `iter_finetune_batches` with these arguments."""
        self._check_split(split)
        return num_batches(self.manifest.splits[split], batch_size, world, drop_last)

    # ----------------------------------------------------------------- images

    def store_index(self) -> dict[str, tuple[int, str, int]]:
        """img_id -> (image store index, shard file, row in the shard) over every shard of every image
        store (reads img_id only); the first store holding an img_id gives it."""
        if self._store_index is None:
            self._store_index = image_index(self.image_stores)
        return self._store_index

    def images(self, split: str) -> SplitImages:
        """Features, boxes and masks of all the images the split uses, in memory (read from the store
        once; `iter_finetune_batches`). The job streams instead (`layout`, `stream`)."""
        if split not in self._images:
            sp = self.split(split)
            uniq, inverse = np.unique(sp.img_ids.astype(str), return_inverse=True)
            feats, boxes, nbox = _read_images(self.image_stores, self.store_index(), uniq,
                                              f"{self.path} split {split!r}")
            n = feats.shape[1]
            self._images[split] = SplitImages(
                img_ids=uniq.astype(object), features=feats, boxes=boxes,
                visual_mask=np.arange(n)[None, :] < nbox[:, None],
                rows=inverse.reshape(sp.img_ids.shape).astype(np.int64))
        return self._images[split]


def _tensor(col: pa.ChunkedArray) -> np.ndarray:
    """A fixed_shape_tensor column -> (K, *shape) numpy."""
    parts = [c.to_numpy_ndarray() for c in col.chunks]
    return parts[0] if len(parts) == 1 else np.concatenate(parts)


def image_index(stores: list[ImageStore]) -> dict[str, tuple[int, str, int]]:
    """img_id -> (store index, shard file, row in the shard); the first store holding an img_id wins."""
    index: dict[str, tuple[int, str, int]] = {}
    for i, st in enumerate(stores):
        for file in st.image_files():
            ids = st.read_table(file, columns=["img_id"]).column("img_id").to_pylist()
            for r, img in enumerate(ids):
                index.setdefault(img, (i, file, r))
    return index


def _read_images(stores: list[ImageStore], index: Mapping[str, tuple[int, str, int]], img_ids: np.ndarray,
                 where: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(features (K, N, F) float16, boxes (K, N, 4) float32, num_boxes (K,)) of `img_ids`, reading only
    the row groups that hold them, one at a time."""
    m = stores[0].manifest
    k = len(img_ids)
    missing = [x for x in img_ids if x not in index]
    if missing:
        raise FinetuneError(f"{where}: {len(missing)} image(s) are in none of the image stores "
                            f"{', '.join(str(st.path) for st in stores)} (e.g. {missing[0]!r}); a store changed, "
                            "re-create the set")
    feats = np.zeros((k, m.num_objects, m.feat_dim), np.float16)
    boxes = np.zeros((k, m.num_objects, 4), np.float32)
    nbox = np.zeros(k, np.int64)
    by_file: dict[tuple[int, str], list[tuple[int, int]]] = {}
    for pos, img in enumerate(img_ids):
        i, file, row = index[img]
        by_file.setdefault((i, file), []).append((row, pos))
    for (i, file), wanted in by_file.items():
        store = stores[i]
        rows = np.array([r for r, _ in wanted], np.int64)
        pos = np.array([p for _, p in wanted], np.int64)
        md = open_parquet(store.path / file).metadata
        sizes = np.array([md.row_group(g).num_rows for g in range(md.num_row_groups)], np.int64)
        starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
        group = np.searchsorted(starts, rows, side="right") - 1  # row group of each wanted row
        for g in np.unique(group):  # one row group in memory at a time, beside the output
            table = store.read_table(file, [int(g)], columns=["num_boxes", "features", "boxes"])
            sel = group == g
            local = rows[sel] - starts[g]
            feats[pos[sel]] = _tensor(table.column("features"))[local]
            boxes[pos[sel]] = _tensor(table.column("boxes"))[local]
            nbox[pos[sel]] = table.column("num_boxes").to_numpy()[local]
    return feats, boxes, nbox


def open_finetune(path: str | Path | Location, store: str | Path | Location | None = None) -> FinetuneData:
    """Open a fine-tuning set and check it: manifest, split files (schema, row counts), answer table, and
    that every image store and the tokenizer store (the recorded path, or `store` if it moved) is
    still the one the set was made from, and that the stores agree on objects per image and width.
    `path` and the stores' recorded paths are local folders or URIs (s3://...: read there)."""
    root = locate(path)
    m = FinetuneManifest.read(root)  # names the path and the kind expected when it is not a fine-tuning set
    for split, rows in m.splits.items():
        p = root / f"{split}.parquet"
        schema = open_listed_parquet(p, rows, what="split file", error=FinetuneError).schema_arrow
        want = split_schema(m.task, m.max_seq_len)
        if not schema.equals(want):
            raise FinetuneError(f"{p}: schema {schema.types} differs from the {m.task} schema {want.types} "
                                f"(max_seq_len {m.max_seq_len})")
    answers = None
    if m.task != "nlvr2":
        try:
            answers = AnswerTable.load(root)
        except AnswerError as e:
            raise FinetuneError(str(e)) from None
        if len(answers) != m.num_answers:
            raise FinetuneError(f"{root / AnswerTable.FILE}: has {len(answers)} answers, manifest says "
                                f"num_answers={m.num_answers}")
    st = open_store(store if store is not None else m.store)
    _check_fingerprint(root, st, m.store_fingerprint)
    images: list[ImageStore] = []
    for ref in m.store_refs():
        if ref.path == m.store:  # the tokenizer store (maybe moved: `store`)
            images.append(st)
            continue
        other = open_image_store(ref.path)
        _check_fingerprint(root, other, ref.fingerprint)
        images.append(other)
    check_same_dims(images, str(root))
    return FinetuneData(store_path(root), m, st, answers, images)


def _check_fingerprint(root: Path | Location, st: ImageStore, recorded: str) -> None:
    if (fp := store_fingerprint(st)) != recorded:
        raise FinetuneError(f"{root}: the store {st.path} is not the one this set was made from (fingerprint "
                            f"{fp}, set has {recorded}): it was rebuilt, so token ids or images may "
                            "differ; re-create the set")


# ============================================================================ writing


def write_finetune(path: str | Path, *, task: str, store: LxmertStore, splits: Mapping[str, FinetuneSplit],
                   answers: AnswerTable | None, source: str, overwrite: bool = False,
                   ignored_by_split: Mapping[str, Mapping[str, int]] | None = None,
                   missing_image_examples: list[dict[str, str]] | None = None,
                   stats: Mapping[str, int] | None = None, inputs: Mapping[str, list[str]] | None = None,
                   options: Mapping[str, Any] | None = None,
                   image_stores: list[ImageStore] | None = None) -> FinetuneData:
    """Write the splits as a fine-tuning set at `path`, atomically (temporary directory + rename).
    `store` made the token ids; `image_stores` (default: `store` alone) hold the images, in lookup order."""
    check_task(task)
    root = local_target(path)
    stores = list(image_stores) if image_stores else [store]
    for st in [store, *stores]:
        if root == st.path or st.path in root.parents:
            raise FinetuneError(f"{root}: inside the feature store {st.path}; write the set elsewhere")
    check_same_dims([store, *stores], str(root))
    if (task == "nlvr2") != (answers is None):
        raise FinetuneError(f"task {task}: {'no answer table' if task == 'nlvr2' else 'an answer table'} expected")
    if not splits:
        raise FinetuneError(f"{root}: no split to write")
    t = store.manifest.max_seq_len
    for name, sp in splits.items():
        if not _SPLIT_NAME.match(name):
            raise FinetuneError(f"split name {name!r}: expected letters, digits, '_' or '-'")
        if sp.task != task:
            raise FinetuneError(f"split {name!r}: task {sp.task!r}, expected {task!r}")
        if len(sp) == 0:
            raise FinetuneError(f"split {name!r}: no examples to write")
        if sp.input_ids.shape[1] != t:
            raise FinetuneError(f"split {name!r}: {sp.input_ids.shape[1]} tokens per example, the store has "
                                f"max_seq_len {t}")
        sp.check(f"split {name!r}", len(answers) if answers is not None else 0)
    check_target(root, overwrite, KIND)
    by_split = {s: dict(c) for s, c in (ignored_by_split or {}).items()}
    totals: dict[str, int] = {}
    for c in by_split.values():
        for k, v in c.items():
            totals[k] = totals.get(k, 0) + v
    manifest = FinetuneManifest(
        schema_version=SCHEMA_VERSION, kind=KIND, task=task, store=str(store.path),
        store_fingerprint=store_fingerprint(store), image_stores=[store_ref(st) for st in stores], max_seq_len=t, splits={s: len(sp) for s, sp in splits.items()},
        num_answers=len(answers) if answers is not None else 0, source=source, ignored=totals,
        ignored_by_split=by_split, missing_image_examples=list(missing_image_examples or []),
        stats=dict(stats or {}), inputs={s: list(v) for s, v in (inputs or {}).items()}, options=dict(options or {}),
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    with StagedDir(root, overwrite, KIND) as staged:
        tmp = staged.tmp
        for name, sp in splits.items():
            pq.write_table(split_to_table(sp), tmp / f"{name}.parquet", row_group_size=1 << 16)
        if answers is not None:
            answers.save(tmp)
        manifest.write(tmp)
        open_finetune(tmp, store.path)  # check what was written before it becomes visible
        staged.publish()
    return open_finetune(root)


# ============================================================================ batches


def num_batches(num_examples: int, batch_size: int, world: int = 1, drop_last: bool = True) -> int:
    """Batches per rank: each rank gets num_examples // world examples."""
    if batch_size < 1 or world < 1:
        raise ValueError(f"batch_size={batch_size}, world={world}: expected >= 1")
    per_rank = num_examples // world
    return per_rank // batch_size if drop_last else math.ceil(per_rank / batch_size)


def epoch_order(num_examples: int, *, seed: int, epoch: int, rank: int = 0, world: int = 1,
                shuffle: bool = True) -> np.ndarray:
    """The rows rank `rank` visits in epoch `epoch`: a permutation fixed by (seed, epoch), the same on
    every rank, cut to a multiple of world and dealt round-robin (disjoint, equal shares)."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank={rank}, world={world}: expected 0 <= rank < world")
    if shuffle:
        order = np.random.default_rng([seed & 0xFFFFFFFF, epoch, 0xF17E]).permutation(num_examples)
    else:
        order = np.arange(num_examples)
    return order[: (num_examples // world) * world][rank::world]


def iter_finetune_batches(data: FinetuneData, split: str, batch_size: int, *, seed: int, epoch: int,
                          rank: int = 0, world: int = 1, shuffle: bool = True, drop_last: bool = True,
                          start_batch: int = 0) -> Iterator[VqaBatch | Nlvr2Batch]:
    """One epoch of one rank's batches, deterministic given (seed, epoch, rank, world).

    `start_batch` skips batches (resume within an epoch) without building them. With world > 1
    the last len(split) % world examples of the permutation are skipped, also with
    drop_last=False: evaluate a whole split with world=1.
    """
    import torch

    from xmodal.core.batches import Nlvr2Batch, VqaBatch

    sp = data.split(split)
    nb = num_batches(len(sp), batch_size, world, drop_last)
    order = epoch_order(len(sp), seed=seed, epoch=epoch, rank=rank, world=world, shuffle=shuffle)
    im = data.images(split)
    for b in range(max(0, start_batch), nb):
        rows = order[b * batch_size:(b + 1) * batch_size]  # (B,)
        ids = torch.from_numpy(sp.input_ids[rows].astype(np.int64))  # (B, T)
        img = im.rows[rows]  # (B,) or (B, 2)
        common = dict(input_ids=ids, attention_mask=ids != 0,
                      visual_feats=torch.from_numpy(im.features[img]),  # (B, N, F) or (B, 2, N, F) float16
                      boxes=torch.from_numpy(im.boxes[img]), visual_mask=torch.from_numpy(im.visual_mask[img]),
                      index=torch.from_numpy(rows.astype(np.int64)))
        if sp.is_qa:
            yield VqaBatch(**common, targets=torch.from_numpy(sp.targets(rows, data.num_answers)))  # (B, A)
        else:
            assert sp.labels is not None
            yield Nlvr2Batch(**common, labels=torch.from_numpy(sp.labels[rows].astype(np.int64)))
