"""An extraction's plan: every check that needs no Ray, made once, in the order a user fixes them
(`check(options) -> Plan`). The run (`run.py`) and the publish (`publish.py`) take the plan, never the
options.

1. the options' own values (`--format`, sizes, `--precision`, `--gpus-per-actor`, `--boxes`,
   `--input-size`, the weights' flags), `--max-rejected` read once into a number of images;
2. IMAGES: listed, ids assigned (`images.py`), each image's size and modification time (`identity.py`);
   `--boxes-from` read and checked against the images' headers (`boxes.py`);
3. OUT: a feature-only store (`data/lxmert/feature_writer.FeatureWriter`: a local folder or a URI, a
   store of another kind never replaced) or, with `--format tsv`, a local file under the output policy
   (`base/outputs.Output`, with its rejects' list beside it); the writer's record of an unfinished
   extraction with other options is refused, naming where it is kept;
4. the detector: its config built once (`DetectorConfig`: the size, the boxes, the input size), the
   network built once on the meta device (its parameter count, the shapes the weights must have), the
   weights file resolved once and loaded strictly as an actor will load it, the vocabularies;
5. the work already done: the shards an earlier run left, verified (`FeatureWriter.existing`), and the
   images they were made from compared with IMAGES now (`identity.first_change`): a difference is
   refused, naming it; the images no verified shard holds are what the run extracts.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from xmodal.base.console import say
from xmodal.base.outputs import Output
from xmodal.core.checkpoint import sha256_of
from xmodal.data.lxmert.feature_writer import LINES, Existing, FeatureWriter
from xmodal.data.lxmert.rows import IMAGES_ROOT, SOURCE, image_schema
from xmodal.extract.boxes import regions_asked
from xmodal.extract.identity import first_change, stat_images
from xmodal.extract.images import ExtractError, ImageRef, assign_ids, image_sources, list_images, read_id_map
from xmodal.extract.pipeline import DetectorSpec
from xmodal.extract.write import INPUTS
from xmodal.models.butd.config import PRECISIONS, DetectorConfig, InputConfig

RANDOM = "RANDOM WEIGHTS"
PUBLIC_WEIGHTS = (
    "airsplay/py-bottom-up-attention: faster_rcnn_from_caffe_attr.pkl",
    "MILVLG/bottom-up-attention.pytorch: bua-caffe-frcn-r101-k36.pth",
    "unc-nlp/frcnn-vg-finetuned (Hugging Face): pytorch_model.bin",
)
DEFAULT_MAX_REJECTED = "1%"
MIN_INPUT_SIDE = 32  # the backbone's stride is 16: a smaller input leaves the RPN a cell or two
WORK = "extract"  # a local OUT's unfinished work: `.OUT.extract` beside it
COMMAND = "extract"  # the name the output policy records


@dataclass
class ExtractOptions:
    """The command line's options, as given (`cli/extract.py`); only `check` reads them."""

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
    write_fault: str | None = None  # tests: a marker file; one write task dies after its write (`write.ShardWrite`)


@dataclass(frozen=True)
class Asked:
    """The run's resources as asked; `resources.place` decides them against the cluster."""

    batch_size: int | None
    actors: int | None
    gpus_per_actor: float | None
    decode_tasks: int | None


@dataclass
class Plan:
    """Everything the run and the publish need, resolved once (module docstring)."""

    images: str  # IMAGES as given
    refs: list[ImageRef]
    todo: list[ImageRef]  # the images no verified shard holds
    done: Existing  # the verified shards of an earlier run
    stats: dict[str, tuple[int, int]]  # path -> (size, mtime_ns)
    given: dict[str, np.ndarray] | None  # --boxes-from
    spec: DetectorSpec  # the detector (config, weights, precision), as each actor builds it
    params: int  # the detector's parameter count
    asked: Asked
    max_rejected: int  # images
    max_rejected_text: str  # as given, for messages
    writer: FeatureWriter  # the output's shards: the store itself, or the TSV's
    tsv: Output | None  # --format tsv: the file (None: a store)
    rejects: Output | None  # --format tsv: its rejects' list beside it
    manifest_options: dict[str, Any]  # what the store's manifest records of the run
    inputs: list[str]  # what the manifest records as the run's inputs
    sources: dict[str, str]  # img_id -> where the image came from (images.image_sources)
    images_per_shard: int
    row_group_images: int
    random: bool
    progress: bool
    boxes_from: str | None = None
    write_fault: str | None = None
    vocab: dict[str, list[str]] = field(default_factory=dict)
    began: float = field(default_factory=time.monotonic)  # when the plan was made: the summary's time

    @property
    def fmt(self) -> str:
        return "store" if self.tsv is None else "tsv"

    @property
    def out(self) -> str:
        return str(self.tsv.path if self.tsv is not None else self.writer.out)

    def tell(self, msg: str) -> None:
        """One line of the job's own; every line says RANDOM WEIGHTS when they are."""
        say(f"[xmodal] {RANDOM}: {msg}" if self.random else f"[xmodal] {msg}")


def parse_max_rejected(text: str, total: int) -> int:
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


def parse_input_size(text: str | None) -> tuple[int, int]:
    """`--input-size SHORT:MAX` -> (short side, long side's cap); None -> the reference's (`InputConfig`)."""
    if text is None:
        return InputConfig.scale, InputConfig.max_size
    m = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", text)
    if m is None or not MIN_INPUT_SIDE <= int(m.group(1)) <= int(m.group(2)):
        raise ExtractError(f"--input-size {text!r}: expected SHORT:MAX, whole pixels with {MIN_INPUT_SIDE} <= SHORT "
                           f"<= MAX (the reference's {InputConfig.scale}:{InputConfig.max_size}: the short side "
                           "scaled to SHORT unless the long side would pass MAX)")
    return int(m.group(1)), int(m.group(2))


def _check_values(o: ExtractOptions) -> None:
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
    if o.random_weights and o.weights:
        raise ExtractError("--weights and --random-weights: give one")
    if o.random_weights and o.layout != "auto":
        raise ExtractError("--layout: random weights have no layout")
    if not o.random_weights and not o.weights:
        raise ExtractError("--weights FILE is required: the detector's public weights are one of "
                           + "; ".join(PUBLIC_WEIGHTS)
                           + " (download one and give its path; --random-weights is for tests and benchmarks only)")


def _check_weights(path: Path | None, text: str | None, layout: str, cfg: DetectorConfig) -> tuple[str | None, int]:
    """(the weights' layout, recognised and loaded strictly as an actor loads them, or None for random
    weights; the detector's parameter count), from the detector built once on the meta device."""
    import torch

    from xmodal.models.butd import weights
    from xmodal.models.butd.detector import Detector

    if layout != "auto" and layout not in weights.LAYOUTS:
        raise ExtractError(f"--layout {layout!r}: expected auto or one of {', '.join(weights.LAYOUTS)}")
    with torch.device("meta"):  # the shapes the actors will load into, without allocating them
        detector = Detector(cfg)
    state, params = detector.state_dict(), sum(p.numel() for p in detector.parameters())
    if path is None:
        return None, params
    if not path.is_file():
        raise ExtractError(f"--weights {text}: {'is a folder' if path.is_dir() else 'does not exist'}; expected "
                           f"the detector's weights file, one of: {'; '.join(PUBLIC_WEIGHTS)}")
    try:
        found = weights.detect_layout(str(path))
        weights.load_state_dict(str(path), layout, expected={k: v.shape for k, v in state.items()})
    except weights.WeightsError as e:
        raise ExtractError(f"--weights {e}") from None  # the message starts with the file's path
    return (layout if layout != "auto" else str(found)), params


def _read_vocab(path: str | None, expected: int, option: str) -> list[str] | None:
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


@dataclass(frozen=True)
class Detector:
    """The detector part of a plan (`_detector`)."""

    spec: DetectorSpec
    params: int
    fingerprint: dict[str, Any]  # what of the detector decides the rows (the output's record)
    weights: str | None
    vocab: dict[str, list[str]]


def _detector(o: ExtractOptions, size: tuple[int, int], boxes_range: tuple[int, int],
              given: dict[str, np.ndarray] | None) -> Detector:
    """The detector's config built once, the network once on the meta device, the weights file resolved
    once, checked and hashed, the vocabularies read."""
    num_objects = max(len(b) for b in given.values()) if given else boxes_range[1]
    cfg = (DetectorConfig.tiny() if o.tiny else DetectorConfig()).with_boxes(boxes_range)
    cfg = cfg.replace_in("input", scale=size[0], max_size=size[1])
    weights = None if o.random_weights else Path(o.weights or "").expanduser().resolve()
    layout, params = _check_weights(weights, o.weights, o.layout, cfg)
    sha = sha256_of(weights) if weights is not None else None
    fingerprint = {
        "format": o.format, "weights_sha256": sha, "layout": layout,
        "random_weights": {"tiny": o.tiny, "seed": o.seed} if o.random_weights else None,
        "boxes": None if given else list(boxes_range),
        "boxes_from_sha256": sha256_of(Path(o.boxes_from).expanduser()) if o.boxes_from else None,
        "num_objects": num_objects, "precision": o.precision,
        # recorded where it is not the reference's, as a store's manifest has recorded it from the start
        **({"input_size": list(size)} if size != parse_input_size(None) else {}),
    }
    vocab = {k: v for k, v in (("objects", _read_vocab(o.objects_vocab, cfg.num_classes, "--objects-vocab")),
                               ("attributes", _read_vocab(o.attributes_vocab, cfg.num_attributes,
                                                          "--attributes-vocab"))) if v is not None}
    spec = DetectorSpec(cfg, weights=str(weights) if weights else None, weights_sha256=sha, layout=layout or "auto",
                        seed=o.seed, given=given is not None, precision=o.precision, num_objects=num_objects)
    return Detector(spec, params, fingerprint, str(weights) if weights else None, vocab)


def _outputs(o: ExtractOptions, fingerprint: dict[str, Any]) -> tuple[FeatureWriter, Output | None, Output | None]:
    """OUT's writer, and for a TSV its file and rejects' list under the output policy."""
    if o.format == "store":
        return FeatureWriter(o.out, options=fingerprint, overwrite=o.overwrite, restart=o.restart, work=WORK), None, None
    tsv = Output(o.out, "OUT", COMMAND, file=True, overwrite=o.overwrite)
    rejects = Output(tsv.path.with_name(tsv.path.name + ".rejects.jsonl"), "OUT's rejects", COMMAND, file=True,
                     overwrite=o.overwrite)
    return FeatureWriter(tsv.path, options=fingerprint, restart=o.restart, work=WORK, lines=True), tsv, rejects


def check(o: ExtractOptions) -> Plan:
    """The plan of one extraction (module docstring); an ExtractError (or StoreError, UserError) names the
    first bad input."""
    _check_values(o)
    size = parse_input_size(o.input_size)
    listing = list_images(o.images)
    refs = assign_ids(listing, read_id_map(o.ids) if o.ids else None, o.ids or "")
    max_rejected = parse_max_rejected(o.max_rejected, len(refs))
    sources = image_sources(listing, refs)
    boxes_range, given = regions_asked(o.boxes, o.boxes_from, refs)
    stats = stat_images(refs)
    detector = _detector(o, size, boxes_range, given)
    writer, tsv, rejects = _outputs(o, detector.fingerprint)
    done = writer.existing(LINES if tsv else image_schema(detector.spec.num_objects,
                                                          detector.spec.cfg.feature_dim).append(SOURCE))
    change = first_change({k: v.get(INPUTS, []) for k, v in done.kept.items()}, refs, stats, str(writer.root))
    if change:
        raise ExtractError(f"{change}: the unfinished extraction there was made from other inputs and is kept; rerun "
                           "it with the images (and --ids) it was made from, or pass --restart to discard it and "
                           "start over")
    writer.probe()  # the last check: a URI OUT written to
    manifest_options = {k: v for k, v in asdict(o).items()
                        if k not in ("images", "out", "progress", "overwrite", "restart", "write_fault")}
    manifest_options.update(detector.fingerprint, weights=detector.weights, **{IMAGES_ROOT: listing.root})
    if o.random_weights:
        manifest_options["warning"] = f"{RANDOM}: features of a detector with random weights, for tests and benchmarks only"
    if detector.vocab:
        manifest_options["vocab"] = detector.vocab
    held = done.ids()
    return Plan(o.images, refs, [r for r in refs if r.img_id not in held], done, stats, given, detector.spec,
                detector.params, Asked(o.batch_size, o.actors, o.gpus_per_actor, o.decode_tasks),
                max_rejected, o.max_rejected, writer, tsv, rejects, manifest_options,
                [o.images if listing.remote else str(Path(o.images).expanduser().resolve())], sources,
                o.images_per_shard, o.row_group_images, o.random_weights, o.progress, o.boxes_from, o.write_fault,
                detector.vocab)
