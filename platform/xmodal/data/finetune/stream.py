"""A fine-tuning split streamed from its image stores: each rank reads only its own row groups.

The job's path (`xmodal.jobs.finetune_job`); `sets.iter_finetune_batches` keeps a split's images in
memory and is left for small sets and tests.

Layout (`split_layout`, from metadata only: the split's rows, the stores' img_id columns and Parquet
footers): the units of a split are the row groups (`units.Unit`) of its image stores that hold at
least one image the split uses. Every example has one home unit, the row group of its (first) image;
`Unit.samples` counts the examples at home there. An NLVR2 example's second image may lie in another
unit: when it is not in the block being read it is read by a targeted read of its row group (one
row group at a time), so every example is built whatever unit its partner sits in.

Blocks: a rank's units, in its order, are read (`read_unit` in-process, or Ray Data tasks through
`reader.read_units` on a Train worker: the same tables) and concatenated into blocks of at least
`images_per_block` rows (`units.group_tables`); the examples at home in a block's units make up the
block. A worker holds the blocks in flight and the partner rows of one block, never the split.

Evaluation (`iter_eval_batches`): units in store order dealt round-robin to ranks
(`epoch_units(shuffle=False)`), examples of a block in row order, batches cut across blocks, the last
one short: every example of the split is predicted exactly once over the ranks.

Training (`iter_train_batches`): each epoch the units are shuffled from (seed, epoch) and dealt to
ranks (`epoch_units`), the examples of a block shuffled from (seed, epoch, rank, block). Ranks hold
different numbers of examples; every rank yields only the common count, min over ranks of
examples // batch_size (`job.epoch_plan` plans the same), so DDP ranks take the same number
of steps and the rest of a longer rank's examples are dropped for that epoch. `start_batch` skips
batches without reading the blocks before them, and the order depends on (seed, epoch, rank, world)
only, so a resumed epoch yields exactly the batches the interrupted run had left.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa

from xmodal.data.location import open_parquet
from xmodal.data.prefetch import prefetch_iter
from xmodal.data.units import Unit, epoch_units, group_tables, read_unit

if TYPE_CHECKING:
    from xmodal.core.batches import Nlvr2Batch, VqaBatch
    from xmodal.data.finetune.sets import FinetuneData

IMAGE_COLUMNS: tuple[str, ...] = ("img_id", "num_boxes", "features", "boxes")
IMAGES_PER_BLOCK = 64  # rows (images) a block holds at least; read when a call passes none (tests lower it)
Reader = Callable[[Sequence[Unit]], Iterable[pa.Table]]


@dataclass
class SplitLayout:
    """Where a split's images lie: U units (row groups), E examples (one image each, or two: nlvr2)."""

    units: list[Unit]  # in store order; samples = examples at home in the unit
    img_unit: np.ndarray  # (E,) or (E, 2) int64: unit of each example's image(s)
    img_row: np.ndarray  # (E,) or (E, 2) int64: row of that image in its unit
    img_ids: np.ndarray  # (E,) or (E, 2) object str
    used_rows: list[np.ndarray]  # per unit: its rows the split uses (ascending)
    unit_examples: list[np.ndarray]  # per unit: the examples at home there (ascending)

    @property
    def home(self) -> np.ndarray:
        return self.img_unit if self.img_unit.ndim == 1 else self.img_unit[:, 0]


def split_layout(data: FinetuneData, split: str) -> SplitLayout:
    """The split's units and where each example's images lie in them (no feature read), computed once
    per opened set and split."""
    if split not in data._layouts:
        data._layouts[split] = _layout(data, split)
    return data._layouts[split]


def _layout(data: FinetuneData, split: str) -> SplitLayout:
    from xmodal.data.finetune.split import FinetuneError

    sp = data.split(split)
    index = data.store_index()
    ids = sp.img_ids.astype(str)
    uniq, inverse = np.unique(ids, return_inverse=True)
    missing = [x for x in uniq if x not in index]
    if missing:
        raise FinetuneError(f"{data.path} split {split!r}: {len(missing)} image(s) are in none of the image stores "
                            f"{', '.join(str(st.path) for st in data.image_stores)} (e.g. {missing[0]!r}); a "
                            "store changed, re-create the set")
    stores = data.image_stores
    file_rank = {(i, f): k for i, st in enumerate(stores) for k, f in enumerate(st.image_files())}
    groups: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]] = {}  # (store, file) -> (starts, sizes)
    keys, rows = [], np.zeros(len(uniq), np.int64)
    for k, img in enumerate(uniq):
        i, file, row = index[img]
        if (i, file) not in groups:
            md = open_parquet(stores[i].path / file).metadata
            sizes = np.array([md.row_group(g).num_rows for g in range(md.num_row_groups)], np.int64)
            groups[(i, file)] = (np.concatenate([[0], np.cumsum(sizes)[:-1]]), sizes)
        starts, _ = groups[(i, file)]
        g = int(np.searchsorted(starts, row, side="right") - 1)
        keys.append((i, file_rank[(i, file)], file, g))
        rows[k] = row - starts[g]
    order = sorted(set(keys), key=lambda x: (x[0], x[1], x[3]))  # store, its file order, row group
    unit_no = {key: u for u, key in enumerate(order)}
    img_unit_u = np.array([unit_no[key] for key in keys], np.int64)  # (K,)
    img_unit = img_unit_u[inverse].reshape(ids.shape)
    img_row = rows[inverse].reshape(ids.shape)
    home = img_unit if img_unit.ndim == 1 else img_unit[:, 0]
    by_unit = np.argsort(home, kind="stable")
    bounds = np.searchsorted(home[by_unit], np.arange(len(order) + 1))
    unit_examples = [by_unit[bounds[u]:bounds[u + 1]] for u in range(len(order))]
    used_rows = [np.sort(rows[img_unit_u == u]) for u in range(len(order))]
    units = [Unit(str(stores[i].path / file), g, int(groups[(i, file)][1][g]), len(unit_examples[u]))
             for u, (i, _, file, g) in enumerate(order)]
    return SplitLayout(units, img_unit, img_row, ids.astype(object), used_rows, unit_examples)


def local_reader(columns: Sequence[str] = IMAGE_COLUMNS) -> Reader:
    """The units' tables straight from the files, one row group at a time (no Ray)."""
    return lambda units: (read_unit(u, columns) for u in units)


def ray_reader(columns: Sequence[str] = IMAGE_COLUMNS) -> Reader:
    """The same tables read by Ray Data tasks (`reader.read_units`)."""
    from xmodal.data.reader import read_units

    return lambda units: read_units(units, columns)


def _blocks(units: Sequence[int], layout: SplitLayout, images_per_block: int) -> list[list[int]]:
    """The units of each block: `group_tables`' rule on the units' row counts."""
    out: list[list[int]] = []
    pending: list[int] = []
    rows = 0
    for u in units:
        pending.append(u)
        rows += layout.units[u].rows
        if rows >= images_per_block:
            out.append(pending)
            pending, rows = [], 0
    if pending:
        out.append(pending)
    return out


@dataclass
class RankPlan:
    """One rank's blocks (unit numbers) and the examples of each block in the order it visits them."""

    blocks: list[list[int]]
    examples: list[np.ndarray]

    @property
    def num_examples(self) -> int:
        return int(sum(len(e) for e in self.examples))


def eval_plan(layout: SplitLayout, rank: int, world: int, images_per_block: int | None = None) -> RankPlan:
    """Evaluation: this rank's units in store order (every world-th), examples in row order."""
    images_per_block = images_per_block or IMAGES_PER_BLOCK
    mine = _rank_units(layout, rank=rank, world=world, seed=0, epoch=0, shuffle=False)
    blocks = _blocks(mine, layout, images_per_block)
    return RankPlan(blocks, [np.concatenate([layout.unit_examples[u] for u in b]) for b in blocks])


def train_plan(layout: SplitLayout, *, seed: int, epoch: int, rank: int, world: int,
               images_per_block: int | None = None) -> RankPlan:
    """Training: this rank's units of the epoch (`epoch_units`), each block's examples shuffled."""
    images_per_block = images_per_block or IMAGES_PER_BLOCK
    mine = _rank_units(layout, rank=rank, world=world, seed=seed, epoch=epoch, shuffle=True)
    blocks = _blocks(mine, layout, images_per_block)
    examples = []
    for b, units in enumerate(blocks):
        ex = np.concatenate([layout.unit_examples[u] for u in units])
        rng = np.random.default_rng([seed & 0xFFFFFFFF, epoch, rank, world, b, 0xB10C])
        examples.append(ex[rng.permutation(len(ex))])
    return RankPlan(blocks, examples)


def _rank_units(layout: SplitLayout, *, rank: int, world: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank={rank}, world={world}: expected 0 <= rank < world")
    number = {u: k for k, u in enumerate(layout.units)}
    return [number[u] for u in epoch_units(layout.units, seed=seed, epoch=epoch, rank=rank, world=world,
                                           shuffle=shuffle)]


def common_batches(layout: SplitLayout, batch_size: int, *, seed: int, epoch: int, world: int) -> int:
    """Batches every rank can yield in a training epoch: the fewest examples of any rank // batch_size
    (the same figure as `job.epoch_plan` before grad_accum)."""
    from xmodal.data.units import epoch_samples

    return min(epoch_samples(layout.units, seed=seed, epoch=epoch, world=world)) // batch_size


def iter_eval_batches(data: FinetuneData, split: str, batch_size: int, *, rank: int = 0, world: int = 1,
                      reader: Reader | None = None, images_per_block: int | None = None,
                      prefetch: int = 2) -> Iterator[VqaBatch | Nlvr2Batch]:
    """This rank's share of the split for prediction: over ranks 0..world-1 every example exactly
    once; the last batch may be short."""
    images_per_block = images_per_block or IMAGES_PER_BLOCK
    plan = eval_plan(split_layout(data, split), rank, world, images_per_block)
    batches = _batches(data, split, plan, batch_size, reader or local_reader(), images_per_block,
                       drop_last=False)
    yield from prefetch_iter(batches, prefetch)


def iter_train_batches(data: FinetuneData, split: str, batch_size: int, *, seed: int, epoch: int, rank: int = 0,
                       world: int = 1, start_batch: int = 0, reader: Reader | None = None,
                       images_per_block: int | None = None, prefetch: int = 2,
                       pin_memory: bool = False) -> Iterator[VqaBatch | Nlvr2Batch]:
    """One training epoch of this rank: `common_batches` full batches (a longer rank's extra examples
    are dropped), from `start_batch` on. The same batches with the local or the Ray Data reader."""
    images_per_block = images_per_block or IMAGES_PER_BLOCK
    layout = split_layout(data, split)
    plan = train_plan(layout, seed=seed, epoch=epoch, rank=rank, world=world, images_per_block=images_per_block)
    limit = common_batches(layout, batch_size, seed=seed, epoch=epoch, world=world)
    batches = _batches(data, split, plan, batch_size, reader or local_reader(), images_per_block,
                       drop_last=True, start_batch=start_batch, limit=limit)
    yield from prefetch_iter(batches, prefetch, pin_memory=pin_memory)


def _batches(data: FinetuneData, split: str, plan: RankPlan, batch_size: int, reader: Reader,
             images_per_block: int, *, drop_last: bool, start_batch: int = 0, limit: int | None = None
             ) -> Iterator[VqaBatch | Nlvr2Batch]:
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: expected >= 1")
    layout = split_layout(data, split)
    total = plan.num_examples
    n = total // batch_size if drop_last else -(-total // batch_size)
    if limit is not None:
        n = min(n, limit)
    begin, end = max(0, start_batch) * batch_size, min(n * batch_size, total)
    if begin >= end:
        return
    sizes = np.array([len(e) for e in plan.examples], np.int64)
    ends = np.cumsum(sizes)
    first = int(np.searchsorted(ends, begin, side="right"))
    last = int(np.searchsorted(ends, end - 1, side="right"))
    units = [layout.units[u] for b in plan.blocks[first:last + 1] for u in b]
    tables = group_tables(reader(units), images_per_block)
    pending: dict[str, np.ndarray] | None = None
    for b, table in zip(range(first, last + 1), tables, strict=True):
        if table.num_rows != sum(layout.units[u].rows for u in plan.blocks[b]):
            raise RuntimeError(f"block {b}: read {table.num_rows} rows, expected the rows of units "
                               f"{plan.blocks[b]} (a store changed while it was read?)")
        start = int(ends[b] - sizes[b])
        lo, hi = max(begin, start) - start, min(end, int(ends[b])) - start
        pieces = _Block(data, layout, plan.blocks[b], table, f"{data.path} split {split!r}")
        pos = lo
        while pos < hi:
            take = min(hi - pos, batch_size - (len(pending["rows"]) if pending else 0))
            piece = pieces.take(plan.examples[b][pos:pos + take])
            pos += take
            pending = piece if pending is None else {k: np.concatenate([pending[k], piece[k]]) for k in piece}
            if len(pending["rows"]) == batch_size:
                yield _to_batch(data, split, pending)
                pending = None
    if pending is not None:
        yield _to_batch(data, split, pending)  # the short last batch (drop_last=False only)


class _Block:
    """One block's images: a row of the block for images in its units, a targeted read for the rest."""

    def __init__(self, data: FinetuneData, layout: SplitLayout, units: list[int], table: pa.Table, where: str):
        from xmodal.data.finetune.sets import _tensor

        self.data, self.layout, self.where = data, layout, where
        self.offset = np.full(len(layout.units), -1, np.int64)
        self.offset[units] = np.concatenate([[0], np.cumsum([layout.units[u].rows for u in units])[:-1]])
        self.table_ids = table.column("img_id")
        self.features = _tensor(table.column("features"))  # (K, N, F) float16
        self.boxes = _tensor(table.column("boxes"))  # (K, N, 4) float32
        self.num_boxes = table.column("num_boxes").to_numpy()

    def take(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        """Arrays of the examples `rows`: features (n, [2,] N, F), boxes, visual_mask, and rows."""
        from xmodal.data.finetune.sets import _read_images

        unit, row = self.layout.img_unit[rows], self.layout.img_row[rows]
        local = np.where(self.offset[unit] >= 0, self.offset[unit] + row, -1)
        here = local >= 0
        ids = self.layout.img_ids[rows]
        check = local[here]
        if len(check) and [str(x) for x in self.table_ids.take(pa.array(check)).to_pylist()] != \
                [str(x) for x in ids[here]]:
            raise RuntimeError(f"{self.where}: the image store's rows moved since the set was opened; reopen it")
        n_obj = self.features.shape[1]
        feats = np.empty((*local.shape, *self.features.shape[1:]), self.features.dtype)
        boxes = np.empty((*local.shape, *self.boxes.shape[1:]), self.boxes.dtype)
        nbox = np.empty(local.shape, np.int64)
        feats[here], boxes[here], nbox[here] = self.features[check], self.boxes[check], self.num_boxes[check]
        if not here.all():  # nlvr2 partners in other units: their row groups, read now
            far = np.unique(ids[~here].astype(str))
            f, bx, nb = _read_images(self.data.image_stores, self.data.store_index(), far, self.where)
            at = np.searchsorted(far, ids[~here].astype(str))
            feats[~here], boxes[~here], nbox[~here] = f[at], bx[at], nb[at]
        return {"rows": np.asarray(rows, np.int64), "features": feats, "boxes": boxes,
                "visual_mask": np.arange(n_obj) < nbox[..., None]}

    def used_sums(self, units: list[int]) -> tuple[int, np.ndarray, np.ndarray]:
        """(entries, sum, sum of squares) over the real objects of the images the split uses here."""
        used = np.concatenate([self.offset[u] + self.layout.used_rows[u] for u in units])
        mask = np.arange(self.features.shape[1]) < self.num_boxes[used][:, None]  # (u, N)
        part = self.features[used][mask].astype(np.float64)  # (M, F)
        return part.shape[0], part.sum(0), np.square(part).sum(0)


def _to_batch(data: FinetuneData, split: str, a: dict[str, np.ndarray]) -> VqaBatch | Nlvr2Batch:
    import torch

    from xmodal.core.batches import Nlvr2Batch, VqaBatch

    sp = data.split(split)
    rows = a["rows"]
    ids = torch.from_numpy(sp.input_ids[rows].astype(np.int64))  # (B, T)
    common = dict(input_ids=ids, attention_mask=ids != 0, visual_feats=torch.from_numpy(a["features"]),
                  boxes=torch.from_numpy(a["boxes"]), visual_mask=torch.from_numpy(a["visual_mask"]),
                  index=torch.from_numpy(rows))
    if sp.is_qa:
        return VqaBatch(**common, targets=torch.from_numpy(sp.targets(rows, data.num_answers)))  # (B, A)
    assert sp.labels is not None
    return Nlvr2Batch(**common, labels=torch.from_numpy(sp.labels[rows].astype(np.int64)))


def feature_sums(data: FinetuneData, split: str, *, rank: int = 0, world: int = 1, reader: Reader | None = None,
                 images_per_block: int | None = None) -> tuple[int, np.ndarray, np.ndarray]:
    """(entries, sum, sum of squares) in float64 of each feature dimension over the real objects of
    the split's images in this rank's evaluation units; added over ranks they cover every image the
    split uses once (`robustness.feature_std`'s figures, streamed)."""
    images_per_block = images_per_block or IMAGES_PER_BLOCK
    layout = split_layout(data, split)
    plan = eval_plan(layout, rank, world, images_per_block)
    dim = data.image_stores[0].manifest.feat_dim
    n, total, squares = 0, np.zeros(dim), np.zeros(dim)
    units = [layout.units[u] for b in plan.blocks for u in b]
    tables = group_tables((reader or local_reader())(units), images_per_block)
    for units_b, table in zip(plan.blocks, tables, strict=True):
        m, s, q = _Block(data, layout, units_b, table, f"{data.path} split {split!r}").used_sums(units_b)
        n, total, squares = n + m, total + s, squares + q
    return n, total, squares
