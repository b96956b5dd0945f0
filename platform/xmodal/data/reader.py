"""The Ray Data reader of a Train worker's share of a split (the training path of every job that
streams its train split): the worker's units (Parquet row groups, `units.epoch_units`) read by Ray
Data tasks, in the units' order.

Each rank reads only its own units, and the same ones in the same order in every run, so a run
with the same seed, store and number of workers sees the same samples, and a run resumed from a
checkpoint sees the samples the uninterrupted run saw (docs/reliability.md, "Reproducible runs").
Reads run as Ray tasks beside the workers: leave CPUs to them (`scale.cpus_per_worker` below 1).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import asdict

import pyarrow as pa
import ray.data

from xmodal.base import console
from xmodal.data.units import Unit, read_unit


def quiet_ray_data() -> None:
    """Ray Data's progress bars and per-execution INFO lines off in this process unless --verbose: a
    job shows its own progress (xmodal.base.console). Set where datasets are built, i.e. on the workers."""
    ray.data.DataContext.get_current().enable_progress_bars = console.verbose()
    console.quiet_ray_data(logging.getLogger("ray.data"))


def read_units(units: Sequence[Unit], columns: Sequence[str] | None = None, *,
               prefetch_tables: int = 2) -> Iterator[pa.Table]:
    """One Arrow table per unit, in the order of `units` (a new Ray Data execution per call)."""
    if not units:
        return iter(())
    ctx = ray.data.DataContext.get_current()
    ctx.execution_options.preserve_order = True  # the units' order, whatever task finishes first
    quiet_ray_data()
    cols = list(columns) if columns else None

    def read(batch: pa.Table) -> pa.Table:
        return pa.concat_tables([read_unit(Unit(**u), cols) for u in batch.to_pylist()])

    ds = ray.data.from_items([asdict(u) for u in units], override_num_blocks=len(units))
    # Reads in flight capped at the tables kept ready: each read task is a Ray worker process of its own
    # (~3 CPU-seconds to start), and Ray Data otherwise starts one per free CPU.
    ds = ds.map_batches(read, batch_size=1, batch_format="pyarrow",
                        compute=ray.data.TaskPoolStrategy(size=max(1, prefetch_tables)))
    return ds.iter_batches(batch_size=None, batch_format="pyarrow", prefetch_batches=prefetch_tables)
