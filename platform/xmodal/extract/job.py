"""One extraction, from the checks to the summary (`extract`).

Order of work, so that bad input fails before Ray starts and nothing is left visible at OUT:
1. checks: the options, IMAGES (listed, ids assigned, duplicates refused), `--boxes-from`, OUT (creatable;
   an existing one only with --overwrite, and only a feature-only store, or a file for --format tsv),
   the weights (the file exists and its layout is recognised) and the vocabularies;
2. the work folder beside OUT (`chunks.WorkDir`): an earlier unfinished run with the same options is
   resumed (its finished images are skipped), one with other options refused (--restart discards it);
   a new folder is made only when the first results arrive, and a run that ends with no finished
   image removes it (nothing is left to block the next run);
3. Ray (`runner.ray_cluster.connect`: RAY_ADDRESS, else a local Ray) and the pipeline
   (`pipeline.run`); the driver writes a chunk every `images_per_shard` images or `FLUSH_S` seconds,
   lists rejects, and fails once they pass --max-rejected;
4. publish: a store's manifest (kind "features", source "extract", the options and the weights'
   sha256) written in the work folder, the store checked (`open_features`) and renamed into place
   (`publish_dir`); for --format tsv, the chunks concatenated into a temporary file renamed to OUT.

Ctrl-C (or SIGTERM) stops after writing what is finished: one line says where the work is kept and
that the same command resumes it; OUT is untouched.
"""

from __future__ import annotations

import datetime
import hashlib
import math
import os
import re
import shutil
import signal
import threading
import time
import uuid
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from xmodal.base.console import DriverNoise, progress_bar, say
from xmodal.base.errors import RunInterrupted, UserError
from xmodal.base.outputs import check_writable_file, publish_dir
from xmodal.core.checkpoint import sha256_of
from xmodal.data.atomic import check_target, local_target
from xmodal.data.lxmert.features import KIND, FeatureManifest, FeatureShard, open_features
from xmodal.data.lxmert.rows import IMAGES_ROOT
from xmodal.extract.boxes import check_inside, parse_boxes, read_boxes_file
from xmodal.extract.chunks import REJECTS_FILE, STATE_FILE, WorkDir, take
from xmodal.extract.images import ExtractError, ImageRef, assign_ids, image_sources, list_images, read_id_map
from xmodal.extract.resources import cluster_view, place
from xmodal.models.butd.config import PRECISIONS

FLUSH_S = 60.0  # a chunk is written at least this often while images come (a slow CPU run loses little)
RANDOM = "RANDOM WEIGHTS"
PUBLIC_WEIGHTS = (
    "airsplay/py-bottom-up-attention: faster_rcnn_from_caffe_attr.pkl",
    "MILVLG/bottom-up-attention.pytorch: bua-caffe-frcn-r101-k36.pth",
    "unc-nlp/frcnn-vg-finetuned (Hugging Face): pytorch_model.bin",
)
DEFAULT_MAX_REJECTED = "1%"
MIN_INPUT_SIDE = 32  # the backbone's stride is 16: a smaller input leaves the RPN a cell or two


@dataclass
class ExtractOptions:
    images: str
    out: str
    weights: str | None = None
    layout: str = "auto"
    random_weights: bool = False  # tests and benchmarks only
    tiny: bool = False  # DetectorConfig.tiny(): tests and benchmarks (random weights, or weights they wrote)
    boxes: str | None = None  # "36" (default) or "MIN-MAX"
    boxes_from: str | None = None
    precision: str = "fp32"  # fp32 (exact), tf32, bf16 (config.PRECISIONS)
    input_size: str | None = None  # "SHORT:MAX" pixels; default the reference's 600:1000 (InputConfig)
    format: str = "store"  # or "tsv"
    ids: str | None = None
    max_rejected: str = DEFAULT_MAX_REJECTED  # N images, or P% of them
    batch_size: int | None = None  # default: chosen for the device (resources.place)
    actors: int | None = None  # default: as many as the cluster's GPUs place at gpus_per_actor, else 1
    gpus_per_actor: float | None = None  # default: 0.5 on a cluster with GPUs (resources.place)
    decode_tasks: int | None = None  # default: the cluster's CPUs less one per actor
    images_per_shard: int = 256
    row_group_images: int = 32
    objects_vocab: str | None = None
    attributes_vocab: str | None = None
    overwrite: bool = False
    restart: bool = False
    progress: bool = True
    seed: int = 0  # random weights' seed


@dataclass
class Summary:
    out: Path
    written: int  # images with features at OUT (this run's and the earlier runs' it resumed)
    extracted: int  # by this run
    skipped: int  # done by an earlier run
    rejected: int
    seconds: float
    rejects: Path | None  # the list of rejects, where there were any

    def lines(self) -> list[str]:
        rate = self.extracted / self.seconds if self.seconds > 0 else 0.0
        out = [f"extracted {self.extracted} images in {self.seconds:.1f} s ({rate:.2f} images/s); skipped "
               f"{self.skipped} already done; rejected {self.rejected}",
               f"wrote {self.out}: {self.written} images"]
        if self.rejects is not None:
            out.append(f"rejected images and why: {self.rejects}")
        return out


def max_rejected(text: str, total: int) -> int:
    """`N` -> N; `P%` -> floor(P% of total)."""
    t = text.strip()
    try:
        if t.endswith("%"):
            p = float(t[:-1])
            if not 0 <= p <= 100 or math.isnan(p):
                raise ValueError
            return int(math.floor(p / 100 * total + 1e-9))
        n = int(t)
        if n < 0:
            raise ValueError
        return n
    except ValueError:
        raise ExtractError(f"--max-rejected {text!r}: expected a number of images >= 0 (e.g. 10) or a percentage "
                           "of them (e.g. 1%)") from None


def input_size(text: str | None) -> tuple[int, int]:
    """`--input-size SHORT:MAX` -> (short side, long side's cap) of the detector's input; None -> the
    reference's (`InputConfig`: TEST.SCALES[0], TEST.MAX_SIZE)."""
    from xmodal.models.butd.config import InputConfig

    if text is None:
        return InputConfig.scale, InputConfig.max_size
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text)
    if m is None or not MIN_INPUT_SIDE <= int(m.group(1)) <= int(m.group(2)):
        raise ExtractError(f"--input-size {text!r}: expected SHORT:MAX, whole pixels with {MIN_INPUT_SIDE} <= SHORT "
                           f"<= MAX (the reference's {InputConfig.scale}:{InputConfig.max_size}: the short side "
                           "scaled to SHORT unless the long side would pass MAX)")
    return int(m.group(1)), int(m.group(2))


def weights_error() -> ExtractError:
    return ExtractError("--weights FILE is required: the detector's public weights are one of "
                        + "; ".join(PUBLIC_WEIGHTS)
                        + " (download one and give its path; --random-weights is for tests and benchmarks only)")


def check_weights(o: ExtractOptions) -> str:
    """The layout of `--weights` (recognised before Ray starts)."""
    p = Path(o.weights or "").expanduser()
    if not p.is_file():
        raise ExtractError(f"--weights {o.weights}: {'is a folder' if p.is_dir() else 'does not exist'}; expected "
                           f"the detector's weights file, one of: {'; '.join(PUBLIC_WEIGHTS)}")
    try:
        from xmodal.models.butd import weights
    except ImportError as e:  # pragma: no cover - the loader is part of the package
        raise ExtractError(f"--weights {o.weights}: the weights loader cannot be imported ({e})") from None
    if o.layout != "auto" and o.layout not in weights.LAYOUTS:
        raise ExtractError(f"--layout {o.layout!r}: expected auto or one of {', '.join(weights.LAYOUTS)}")
    import torch

    from xmodal.models.butd.detector import Detector, DetectorConfig

    with torch.device("meta"):  # the shapes the actors will load into, without allocating them
        expected = Detector(DetectorConfig.tiny() if o.tiny else DetectorConfig()).state_dict()
    try:
        found = weights.detect_layout(str(p))
        # the whole strict load an actor makes (every key used, every shape), here before Ray starts
        weights.load_state_dict(str(p), o.layout, expected={k: v.shape for k, v in expected.items()})
    except weights.WeightsError as e:
        raise ExtractError(f"--weights {e}") from None  # the message starts with the file's path
    return o.layout if o.layout != "auto" else str(found)


def read_vocab(path: str | None, expected: int, option: str) -> list[str] | None:
    if path is None:
        return None
    p = Path(path).expanduser()
    if not p.is_file():
        raise ExtractError(f"{option} {path}: {'is a folder' if p.is_dir() else 'does not exist'}; expected a text "
                           f"file of {expected} names, one a line")
    from xmodal.models.butd import weights

    try:
        return weights.read_vocab(str(p), expected)
    except weights.WeightsError as e:
        raise ExtractError(f"{option} {path}: {e}") from None


@dataclass
class Plan:
    refs: list[ImageRef]
    given: dict[str, np.ndarray] | None
    boxes_range: tuple[int, int]
    num_objects: int
    out: Path
    layout: str | None
    weights_sha256: str | None
    vocab: dict[str, list[str]]
    fingerprint: dict[str, Any]
    images_root: str = ""  # what the relative sources are relative to
    sources: dict[str, str] | None = None  # img_id -> where the image came from (images.image_sources)
    input_size: tuple[int, int] = (600, 1000)  # the detector's input: short side, long side's cap


def _detector_sizes(tiny: bool) -> tuple[int, int]:
    """(object labels, attribute labels) of the detector's config."""
    from xmodal.models.butd.detector import DetectorConfig

    cfg = DetectorConfig.tiny() if tiny else DetectorConfig()
    return (int(getattr(cfg, "num_classes", 1600)), int(getattr(cfg, "num_attributes", 400)))


def check(o: ExtractOptions) -> Plan:
    """Every check that needs no Ray, in the order a user fixes them."""
    if o.format not in ("store", "tsv"):
        raise ExtractError(f"--format {o.format!r}: expected store or tsv")
    for name in ("batch_size", "images_per_shard", "row_group_images", "decode_tasks", "actors"):
        if getattr(o, name) is not None and getattr(o, name) < 1:
            raise ExtractError(f"--{name.replace('_', '-')} {getattr(o, name)}: expected >= 1")
    if o.precision not in PRECISIONS:
        raise ExtractError(f"--precision {o.precision!r}: expected one of {', '.join(PRECISIONS)}")
    if o.gpus_per_actor is not None and not 0 < o.gpus_per_actor <= 1:
        raise ExtractError(f"--gpus-per-actor {o.gpus_per_actor:g}: expected a share of one GPU, 0 < F <= 1 "
                           "(0.5: two detector actors a GPU)")
    if o.boxes is not None and o.boxes_from is not None:
        raise ExtractError("--boxes and --boxes-from: give one (--boxes-from takes the boxes from the file)")
    boxes_range = parse_boxes(o.boxes or "36")
    size = input_size(o.input_size)
    if o.random_weights and o.weights:
        raise ExtractError("--weights and --random-weights: give one")
    if o.random_weights and o.layout != "auto":
        raise ExtractError("--layout: random weights have no layout")
    if not o.random_weights and not o.weights:
        raise weights_error()
    id_map = read_id_map(o.ids) if o.ids else None
    refs = assign_ids(list_images(o.images), id_map, o.ids or "")
    max_rejected(o.max_rejected, len(refs))
    given = read_boxes_file(o.boxes_from, [r.img_id for r in refs]) if o.boxes_from else None
    if given is not None:
        check_inside(str(o.boxes_from), given, refs)
    num_objects = max(len(b) for b in given.values()) if given else boxes_range[1]
    # OUT
    if o.format == "store":
        out = local_target(o.out)
        check_target(out, o.overwrite, KIND)
    else:
        if "://" in o.out:
            raise ExtractError(f"OUT {o.out}: --format tsv writes a local file; write it here, then upload it")
        out = check_writable_file(o.out, "OUT").resolve()
        if out.exists() and not o.overwrite:
            raise ExtractError(f"OUT {out}: already exists; pass --overwrite to replace it")
    layout = None if o.random_weights else check_weights(o)
    n_obj, n_attr = _detector_sizes(o.tiny)
    vocab = {k: v for k, v in (("objects", read_vocab(o.objects_vocab, n_obj, "--objects-vocab")),
                               ("attributes", read_vocab(o.attributes_vocab, n_attr, "--attributes-vocab")))
             if v is not None}
    sha = None if o.random_weights else sha256_of(Path(o.weights or "").expanduser())
    fingerprint = {
        "format": o.format, "weights_sha256": sha, "layout": layout,
        "random_weights": {"tiny": o.tiny, "seed": o.seed} if o.random_weights else None,
        "boxes": None if given else list(boxes_range),
        "boxes_from_sha256": sha256_of(Path(o.boxes_from).expanduser()) if o.boxes_from else None,
        "num_objects": num_objects, "precision": o.precision,
        # recorded where it is not the reference's, so that a work folder of an earlier version still resumes
        **({"input_size": list(size)} if size != input_size(None) else {}),
    }
    root, sources = image_sources(o.images, refs)
    return Plan(refs, given, boxes_range, num_objects, out, layout, sha, vocab, fingerprint, root, sources, size)


def _detector_params(tiny: bool) -> int:
    """The detector's parameter count (built on the meta device: nothing allocated)."""
    import torch

    from xmodal.models.butd.detector import Detector, DetectorConfig

    with torch.device("meta"):
        return sum(p.numel() for p in Detector(DetectorConfig.tiny() if tiny else DetectorConfig()).parameters())


def extract(o: ExtractOptions) -> Summary:
    """Run one extraction (module docstring); every line it says carries RANDOM WEIGHTS when they are."""

    def tell(msg: str) -> None:
        say(f"[xmodal] {RANDOM}: {msg}" if o.random_weights else f"[xmodal] {msg}")

    try:
        return _extract(o, tell)
    except UserError as e:
        if o.random_weights and RANDOM not in str(e):
            raise type(e)(f"{e} ({RANDOM})") from None
        raise


def _extract(o: ExtractOptions, tell) -> Summary:
    plan = check(o)
    start = time.monotonic()
    work = WorkDir.find(plan.out, o.format, plan.fingerprint, o.restart)
    try:
        return _resume(o, plan, work, start, tell)
    except BaseException:
        work.discard_if_empty()  # a run that wrote nothing leaves nothing (and blocks no other run)
        raise


def _resume(o: ExtractOptions, plan: Plan, work: WorkDir, start: float, tell) -> Summary:
    done = work.done()
    by_id = {r.img_id: r for r in plan.refs}
    stray = [i for i in done if i not in by_id]
    if stray:
        raise ExtractError(f"{work.path}: the unfinished extraction kept here holds img_id {stray[0]!r} "
                           f"({len(stray)} such), which is not among the images of IMAGES now; rerun it with the "
                           "same images to finish it, or pass --restart to start over")
    todo = [r for r in plan.refs if r.img_id not in done]
    limit = max_rejected(o.max_rejected, len(plan.refs))
    if done:
        tell(f"resuming {work.path}: {len(done)} of {len(plan.refs)} images already done")
    rejected = extracted = 0
    if todo:
        extracted, rejected = _run(o, plan, work, todo, limit, tell)
    summary = _publish(o, plan, work, rejected)
    summary.extracted, summary.skipped = extracted, len(done)
    summary.seconds = time.monotonic() - start
    for line in summary.lines():
        tell(line)
    return summary


def _connect(o: ExtractOptions, plan: Plan, pipeline) -> tuple[Any, Any, bool]:
    """Ray reached, the detector's spec and the run's placement on the cluster checked (one `error:` line
    before any work); (spec, placement, whether Ray was started here). Ray is shut down again if a check
    fails."""
    import ray

    from xmodal.runner.ray_cluster import connect

    started_here = not ray.is_initialized()
    try:
        connect()
        spec = pipeline.DetectorSpec(
            weights=None if o.random_weights else str(Path(o.weights or "").expanduser().resolve()),
            weights_sha256=plan.weights_sha256, layout=plan.layout or "auto", tiny=o.tiny, seed=o.seed,
            boxes_range=plan.boxes_range, given=plan.given is not None, precision=o.precision,
            num_objects=plan.num_objects, input_size=plan.input_size)
        placed = place(cluster_view(), actors=o.actors, gpus_per_actor=o.gpus_per_actor,
                       decode_tasks=o.decode_tasks, batch_size=o.batch_size, precision=o.precision,
                       cfg=spec.config(), params=_detector_params(o.tiny))
    except BaseException:
        if started_here and ray.is_initialized():
            ray.shutdown()
        raise
    return replace(spec, threads=placed.threads_per_actor), placed, started_here


def _run(o: ExtractOptions, plan: Plan, work: WorkDir, todo: list[ImageRef], limit: int, tell) -> tuple[int, int]:
    import ray

    from xmodal.extract import pipeline

    spec, placed, started_here = _connect(o, plan, pipeline)
    items = [{"path": r.path, "img_id": r.img_id,
              "given": plan.given[r.img_id].tobytes() if plan.given is not None else b""} for r in todo]
    # as many decode tasks as there are batches to decode at most (Ray Data warns of idle ones)
    decode_tasks = min(placed.decode_tasks, -(-len(items) // placed.batch_size))
    device = (f"GPU ({placed.gpus_per_actor:g} each)" if placed.gpus_per_actor
              else f"CPU (torch threads: {placed.threads_per_actor} each at most, no more than its node's cores)")
    tell(f"extracting {len(todo)} images with {placed.actors} detector actor(s) on {device}, {decode_tasks} decode "
         f"task(s), batch {placed.batch_size}{' (chosen for the device)' if placed.batch_chosen else ''}, "
         f"{o.precision}, boxes "
         f"{plan.num_objects if plan.given else '-'.join(map(str, sorted(set(plan.boxes_range))))}"
         f"{' from ' + str(o.boxes_from) if plan.given else ''}; work kept in {work.path} until done")
    bar = progress_bar(len(todo), f"extract ({RANDOM})" if o.random_weights else "extract", "img", o.progress)
    pending: list[tuple[dict[str, np.ndarray], np.ndarray]] = []
    count = extracted = rejected = 0
    first = 0.0

    def flush() -> None:
        # The rows leave `pending` before the chunk is written: a Ctrl-C landing after the chunk's rename
        # (anywhere in this function) must not have the interrupt's own flush write them a second time.
        # One landing before the rename loses them from this run only: the rerun does them again.
        nonlocal pending, count, extracted
        rows, n = (take(pending, plan.sources if o.format == "store" else None), count) if count else (None, 0)
        pending, count = [], 0
        if rows is not None:
            work.write(rows, o.row_group_images)
            extracted += n

    noise = DriverNoise().__enter__()
    term = _term_as_interrupt()
    try:
        for batch in pipeline.run(items, spec, batch_size=placed.batch_size, actors=placed.actors,
                                  gpus_per_actor=placed.gpus_per_actor, decode_tasks=decode_tasks):
            work.start()  # the run has really started: its work folder is made now
            reject = batch["reject"]
            for i in np.nonzero(reject != "")[0]:
                if batch["reject_kind"][i] == pipeline.BOXES:
                    flush()
                    raise ExtractError(f"--boxes-from {o.boxes_from}: img_id {batch['img_id'][i]!r}: {reject[i]}")
                rejected += 1
                work.reject(str(batch["path"][i]), str(batch["img_id"][i]), str(reject[i]))
                tell(f"rejected {batch['path'][i]}: {reject[i]}")
            ok = np.nonzero(reject == "")[0]
            if len(ok):
                if not count:
                    first = time.monotonic()
                pending.append((batch, ok))
                count += len(ok)
            bar.update(len(reject))
            if rejected > limit:
                flush()
                raise ExtractError(
                    f"{rejected} image{'s' if rejected > 1 else ''} rejected, more than --max-rejected {o.max_rejected} (= {limit} of "
                    f"{len(plan.refs)}); they are listed above{_kept(work)}; nothing was written at "
                    f"{plan.out}: fix or remove them and rerun (finished images are kept and skipped), or raise "
                    "--max-rejected")
            if count >= o.images_per_shard or (count and time.monotonic() - first >= FLUSH_S):
                flush()
        flush()
    except KeyboardInterrupt:
        try:
            flush()
        except Exception:  # noqa: BLE001 - a half chunk is never renamed into place; the interrupt wins
            pass
        raise ExtractInterrupted(work.path, len(work.done()), len(plan.refs), o.random_weights) from None
    finally:
        bar.close()
        if started_here and ray.is_initialized():
            ray.shutdown()
        noise.__exit__()
        term()
    return extracted, rejected


def _term_as_interrupt():
    """SIGTERM taken as Ctrl-C while the extraction runs; returns what puts the handler before back.
    `ray.init` in the driver installs Ray's core worker's fatal-signal handler for SIGTERM, which aborts
    the process (exit 134 and a crash dump) and loses the images held; a batch system's stop or a
    `kill` must stop the run as Ctrl-C does: the finished images written as a last chunk, exit 130."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = signal.signal(signal.SIGTERM, _interrupt)

    def restore() -> None:
        # a handler installed outside Python (Ray's) reads as None; the default is what is left then
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)

    return restore


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def _kept(work: WorkDir) -> str:
    """Where the rejects are listed too, while the work folder is kept (it holds finished images)."""
    return f" and in {work.path / REJECTS_FILE}" if work.chunks() else ""


class ExtractInterrupted(RunInterrupted):
    """Ctrl-C or SIGTERM during an extraction: one line saying where the finished images are kept."""

    def __init__(self, work: Path, done: int, total: int, random: bool):
        super().__init__("extracting", done)
        self.work, self.done, self.total, self.random = work, done, total, random

    def __str__(self) -> str:
        mark = f" {RANDOM}:" if self.random else ""
        if not self.done:
            return (f"[xmodal]{mark} stopped extracting before any image was finished; nothing was kept or "
                    "written at OUT")
        return (f"[xmodal]{mark} stopped extracting: {self.done} of {self.total} images are done and kept in "
                f"{self.work}; nothing was written at OUT; rerun the same command to go on from there")


def _publish(o: ExtractOptions, plan: Plan, work: WorkDir, rejected: int) -> Summary:
    chunks = work.chunks()
    rows = len(work.done())
    if not chunks:
        raise ExtractError(f"IMAGES {o.images}: every image was rejected ({rejected}; each listed above with "
                           f"why); nothing was written at {plan.out}")
    options = {k: v for k, v in asdict(o).items() if k not in ("images", "out", "progress", "overwrite", "restart")}
    options.update(plan.fingerprint, rejected=rejected,
                   weights=str(Path(o.weights).expanduser().resolve()) if o.weights else None)
    if o.random_weights:
        options["warning"] = f"{RANDOM}: features of a detector with random weights, for tests and benchmarks only"
    if plan.vocab:
        options["vocab"] = plan.vocab
    options[IMAGES_ROOT] = plan.images_root
    if o.format == "tsv":
        return _publish_tsv(o, plan, work, chunks, rows, rejected)
    import pyarrow.parquet as pq

    from xmodal.data.lxmert.features import SHARD_DIR

    first = pq.read_schema(chunks[0])
    shape = first.field("features").type.shape
    n_obj, n_attr = _detector_sizes(o.tiny)
    digest = hashlib.sha256()
    shards = []
    for p in chunks:
        digest.update(sha256_of(Path(p)).encode())
        shards.append(FeatureShard(file=f"{SHARD_DIR}/{p.name}", rows=pq.ParquetFile(p).metadata.num_rows))
    FeatureManifest(schema_version=FeatureManifest.SCHEMA_VERSION, kind=KIND, num_objects=int(shape[0]),
                    feat_dim=int(shape[1]), num_object_labels=n_obj, num_attr_labels=n_attr, shards=shards,
                    source="extract", inputs=[str(Path(o.images).expanduser().resolve()) if "://" not in o.images
                                              else o.images],
                    content_sha256=digest.hexdigest(), options=options,
                    created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")).write(work.path)
    (work.path / STATE_FILE).unlink()
    open_features(work.path)  # check what was written before it becomes visible
    publish_dir(work.path, plan.out, lambda: check_target(plan.out, o.overwrite, KIND))
    return Summary(plan.out, rows, 0, 0, rejected, 0.0, plan.out / REJECTS_FILE if rejected else None)


def _publish_tsv(o: ExtractOptions, plan: Plan, work: WorkDir, chunks: list[Path], rows: int,
                 rejected: int) -> Summary:
    out = plan.out
    tmp = out.parent / f".{out.name}.tmp-{uuid.uuid4().hex[:8]}"
    rejects = out.with_name(out.name + ".rejects.jsonl")
    try:
        with open(tmp, "wb") as f:
            for p in chunks:
                with open(p, "rb") as src:
                    shutil.copyfileobj(src, f, 1 << 20)
        if rejected:
            shutil.copyfile(work.path / REJECTS_FILE, rejects)
        elif rejects.exists() and o.overwrite:
            rejects.unlink()
        os.replace(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    shutil.rmtree(work.path)
    return Summary(out, rows, 0, 0, rejected, 0.0, rejects if rejected else None)
