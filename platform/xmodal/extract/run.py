"""An extraction's run on Ray (`run(plan) -> Outcome`): Ray reached (`runner.ray_cluster.connect`:
RAY_ADDRESS, else a local Ray), the run placed on the cluster and checked there (`resources.place`),
the output's root made and every other host's access to it probed (`resources.probe_nodes`), then the
pipeline (`pipeline.run`, iterated by its `Coordinator` actor on the driver's node): the write tasks write
the shards where the features are made, and the driver receives one small record a shard: its name, image
ids and rows, the rejected images. It lists the
rejects, fails once they pass --max-rejected, and keeps the records for the publish.

What the driver costs is measured by itself over the pipeline: its process's CPU time and the bytes of
the records it received (`Outcome.driver_cpu_s`, `driver_bytes`), and each write task's own time and
bytes (`ShardInfo.seconds`, `bytes`).

Ctrl-C (or SIGTERM) stops the run: the shards written so far stay at the output's root, and the same
command goes on from them (`ExtractInterrupted` says so); OUT is untouched.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from dataclasses import dataclass, field, replace

from xmodal.base import console
from xmodal.base.console import DriverNoise, progress_bar
from xmodal.base.errors import RunInterrupted
from xmodal.data.lxmert.feature_writer import ShardInfo
from xmodal.extract.images import ExtractError
from xmodal.extract.plan import RANDOM, Plan
from xmodal.extract.resources import Placement, cluster_view, place, probe_nodes
from xmodal.extract.write import BOXES, ShardWrite


@dataclass
class Outcome:
    """What a run made: its shards (as the write tasks recorded them) and rejects; what the driver cost."""

    shards: list[ShardInfo] = field(default_factory=list)
    rejects: list[tuple[str, str, str]] = field(default_factory=list)  # (path, img_id, reason)
    driver_cpu_s: float = 0.0  # the driver process's CPU time over the pipeline
    driver_bytes: int = 0  # the records it received

    @property
    def extracted(self) -> int:
        return sum(s.rows for s in self.shards)


class ExtractInterrupted(RunInterrupted):
    """Ctrl-C or SIGTERM during an extraction: one line saying where the finished images are kept."""

    def __init__(self, where: str, done: int, total: int, random: bool):
        super().__init__("extracting", done)
        self.where, self.done, self.total, self.random = where, done, total, random

    def __str__(self) -> str:
        mark = f" {RANDOM}:" if self.random else ""
        if not self.done:
            return (f"[xmodal]{mark} stopped extracting before any image was finished; nothing was kept or "
                    "written at OUT")
        return (f"[xmodal]{mark} stopped extracting: {self.done} of {self.total} images are done and kept in "
                f"{self.where}; nothing was written at OUT; rerun the same command to go on from there")


def _connect(plan: Plan) -> tuple[Placement, bool]:
    """Ray reached, the run placed on the cluster and checked there, the output's root made and probed from
    every other host (one `error:` line before any work); (the placement, whether Ray was started here).
    Ray is shut down again if a check fails."""
    import ray

    from xmodal.runner.ray_cluster import connect

    started_here = not ray.is_initialized()
    try:
        connect()
        a = plan.asked
        placed = place(cluster_view(), actors=a.actors, gpus_per_actor=a.gpus_per_actor, decode_tasks=a.decode_tasks,
                       batch_size=a.batch_size, precision=plan.spec.precision, cfg=plan.spec.cfg, params=plan.params)
        plan.writer.start()
        probe_nodes(plan.out, *plan.writer.probe_paths())
    except BaseException:
        if started_here and ray.is_initialized():
            ray.shutdown()
        raise
    return placed, started_here


def _items(plan: Plan) -> list[dict]:
    return [{"path": r.path, "img_id": r.img_id, "source": plan.sources[r.img_id], "size": plan.stats[r.path][0],
             "mtime": plan.stats[r.path][1],
             "given": plan.given[r.img_id].tobytes() if plan.given is not None else b""} for r in plan.todo]


def run(plan: Plan) -> Outcome:
    """Extract `plan.todo` (module docstring). A run that fails or is stopped before its first shard leaves
    no root behind (nothing to resume, nothing to block the next run)."""
    done = len(plan.refs) - len(plan.todo)
    if done:
        plan.tell(f"resuming {plan.writer.root}: {done} of {len(plan.refs)} images already done")
    if not plan.todo:
        return Outcome()
    try:
        return _run(plan)
    except BaseException:
        plan.writer.discard_if_empty()
        raise


def _run(plan: Plan) -> Outcome:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from xmodal.extract import pipeline

    placed, started_here = _connect(plan)
    spec = replace(plan.spec, threads=placed.threads_per_actor)
    items = _items(plan)
    # as many decode tasks as there are batches to decode at most (Ray Data warns of idle ones)
    decode_tasks = min(placed.decode_tasks, -(-len(items) // placed.batch_size))
    device = (f"GPU ({placed.gpus_per_actor:g} each)" if placed.gpus_per_actor
              else f"CPU (torch threads: {placed.threads_per_actor} each at most, no more than its node's cores)")
    boxes = spec.num_objects if plan.given else "-".join(map(str, sorted({spec.cfg.selection.min_boxes,
                                                                         spec.cfg.selection.max_boxes})))
    plan.tell(f"extracting {len(items)} images with {placed.actors} detector actor(s) on {device}, {decode_tasks} "
              f"decode task(s), batch {placed.batch_size}{' (chosen for the device)' if placed.batch_chosen else ''}, "
              f"{spec.precision}, boxes {boxes}{' from ' + str(plan.boxes_from) if plan.given else ''}; shards of "
              f"{plan.images_per_shard} images written to {plan.writer.root} until done")
    bar = progress_bar(len(items), f"extract ({RANDOM})" if plan.random else "extract", "img", plan.progress)
    out = Outcome()
    write = ShardWrite(plan.writer.sink(plan.row_group_images), plan.fmt, plan.write_fault)
    noise = DriverNoise().__enter__()
    term = _term_as_interrupt()
    cpu = time.process_time()
    here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    coordinator = pipeline.Coordinator.options(scheduling_strategy=here).remote(
        console.verbose(), items, spec, write, batch_size=placed.batch_size, actors=placed.actors,
        gpus_per_actor=placed.gpus_per_actor, decode_tasks=decode_tasks, images_per_shard=plan.images_per_shard)
    try:
        while (table := ray.get(coordinator.next_table.remote())) is not None:
            out.driver_bytes += table.nbytes
            for record in table.to_pylist():
                bar.update(_take(plan, record, out))
    except KeyboardInterrupt:
        raise ExtractInterrupted(str(plan.writer.root), _kept(plan, out), len(plan.refs), plan.random) from None
    finally:
        # the pipeline ends with its coordinator, while Ray is still up: its detector actors and tasks too
        ray.kill(coordinator, no_restart=True)
        out.driver_cpu_s = time.process_time() - cpu
        bar.close()
        if started_here and ray.is_initialized():
            ray.shutdown()
        noise.__exit__()
        term()
    return out


def _kept(plan: Plan, out: Outcome) -> int:
    """The images the output's root holds after an interrupt: its finished shards' (also those whose record
    had not reached the driver yet), or, where they cannot be listed now, those the driver knows of."""
    try:
        return plan.writer.finished_images()
    except Exception:  # noqa: BLE001 - the interrupt's message must come whatever the store says now
        return len(plan.done.ids()) + out.extracted


def _take(plan: Plan, record: dict, out: Outcome) -> int:
    """One write task's record into `out`: its shard kept, its rejects listed (a given box outside its image
    and features that do not fit the store fail the run); how many images it accounts for."""
    if record["error"]:
        raise ExtractError(record["error"])
    rejects = json.loads(record["rejects"])
    for path, img_id, reason, kind in rejects:
        if kind == BOXES:
            raise ExtractError(f"--boxes-from {plan.boxes_from}: img_id {img_id!r}: {reason}")
        out.rejects.append((path, img_id, reason))
        plan.tell(f"rejected {path}: {reason}")
    if record["shard"]:
        out.shards.append(ShardInfo(record["shard"], tuple(record["ids"]), record["sha256"], record["seconds"],
                                    record["bytes"]))
    n = len(out.rejects)
    if n > plan.max_rejected:
        raise ExtractError(
            f"{n} image{'s' if n > 1 else ''} rejected, more than --max-rejected {plan.max_rejected_text} (= "
            f"{plan.max_rejected} of {len(plan.refs)}); they are listed above; nothing was written at {plan.out}: "
            "fix or remove them and rerun (finished images are kept and skipped), or raise --max-rejected")
    return len(record["ids"]) + len(rejects)


def _term_as_interrupt():
    """SIGTERM taken as Ctrl-C while the extraction runs; returns what puts the handler before back.
    `ray.init` in the driver installs Ray's core worker's fatal-signal handler for SIGTERM, which aborts
    the process (exit 134 and a crash dump); a batch system's stop or a `kill` must stop the run as
    Ctrl-C does: exit 130, the shards written kept for the rerun."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.signal(signal.SIGTERM, _interrupt)

    def restore() -> None:
        # a handler installed outside Python (Ray's) reads as None; the default is what is left then
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)

    return restore


def _interrupt(signum, frame):
    raise KeyboardInterrupt
