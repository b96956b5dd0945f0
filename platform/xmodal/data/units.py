"""A worker's share of a split: the `Unit` a split is dealt out in (one Parquet row group of one
shard), each epoch's deal by seed, rank and world size, and reading a unit's rows."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from xmodal.base.errors import UserError
from xmodal.data.errors import StoreError
from xmodal.data.location import Location, locate, open_parquet
from xmodal.data.manifest import MANIFEST_FILE


@dataclass(frozen=True)
class Unit:
    """The unit a split is dealt out in: one Parquet row group of one shard, with its row count and
    its number of samples (LXMERT: sentences; MulT: clips)."""

    file: str  # absolute path or URI (`Location`)
    group: int
    rows: int
    samples: int


def epoch_units(units: Sequence[Unit], *, seed: int, epoch: int, rank: int = 0, world: int = 1,
                shuffle: bool = True) -> list[Unit]:
    """This rank's units of an epoch: one permutation of all units from (seed, epoch), the same on
    every rank, of which rank r takes every world-th from r. Ranks get disjoint units that together
    cover the split, and the same ones in the same order in every run: a run is reproducible and
    resumes exactly (docs/reliability.md, "Reproducible runs")."""
    units = list(units)
    if shuffle:
        order = np.random.default_rng([seed, epoch, 0x5EED]).permutation(len(units))
        units = [units[i] for i in order]
    return units[rank::world]


def epoch_samples(units: Sequence[Unit], *, seed: int, epoch: int, world: int, shuffle: bool = True) -> list[int]:
    """Samples per rank in an epoch (what the driver needs to count the steps every rank can take)."""
    return [sum(u.samples for u in epoch_units(units, seed=seed, epoch=epoch, rank=r, world=world, shuffle=shuffle))
            for r in range(world)]


def open_listed_parquet(path: str | Path | Location, rows: int, *, what: str = "shard",
                        error: type[UserError] = StoreError) -> pq.ParquetFile:
    """A Parquet file a manifest lists, checked against it as every store's `open` does: the file
    exists, its footer reads, and it holds the `rows` the manifest says. Reads the footer only (of a
    remote file too: nothing else is downloaded); the caller checks the schema it expects. `error`:
    the store's own error class."""
    path = locate(path)
    if not path.is_file():
        raise error(f"{path}: {what} listed in {MANIFEST_FILE} is missing")
    try:
        pf = open_parquet(path)
        got = pf.metadata.num_rows
    except (OSError, pa.ArrowException) as e:
        raise error(f"{path}: not a readable Parquet file ({type(e).__name__}: {e}); the {what} is corrupted, "
                    "re-ingest the store") from None
    if got != rows:
        raise error(f"{path}: has {got} rows, manifest says {rows}")
    return pf


def read_unit(unit: Unit, columns: Sequence[str] | None = None) -> pa.Table:
    """One row group of one shard, through its location's file system (cached per process: on a Ray
    Data task of any node, a remote shard's row group is read from the store, not from a copy)."""
    try:
        return open_parquet(Location(unit.file)).read_row_group(unit.group, columns=list(columns) if columns else None)
    except (OSError, pa.ArrowException) as e:
        raise StoreError(f"{unit.file}: cannot read row group {unit.group} ({type(e).__name__}: {e}); the shard "
                         "is corrupted, re-ingest the store") from None


def group_tables(tables: Iterable[pa.Table], min_rows: int) -> Iterator[pa.Table]:
    """Consecutive tables concatenated into tables of at least `min_rows` rows (the last may be short)."""
    pending: list[pa.Table] = []
    rows = 0
    for t in tables:
        pending.append(t)
        rows += t.num_rows
        if rows >= min_rows:
            yield pending[0] if len(pending) == 1 else pa.concat_tables(pending)
            pending, rows = [], 0
    if pending:
        yield pending[0] if len(pending) == 1 else pa.concat_tables(pending)
