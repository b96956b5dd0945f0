"""`python jobs/extract.py IMAGES OUT --weights FILE [options]`: region features of your own images.

IMAGES: a folder (searched recursively for .jpg, .jpeg, .png), a list file (one image path a line) or an
s3:// prefix. OUT: a feature-only store (kind "features", what `--store` of `jobs/ingest.py vqa|gqa|nlvr2`
and `--tsv` of `jobs/ingest.py lxmert|features` take), or with `--format tsv` the reference's TSV file.
A rerun of an interrupted command goes on where it stopped. Bad input is one line `error: ...` and exit 2.
"""

from __future__ import annotations

import argparse
import sys

from xmodal.base.commands import add_verbose, setup_console, user_errors
from xmodal.extract.plan import DEFAULT_MAX_REJECTED, PUBLIC_WEIGHTS, ExtractOptions
from xmodal.extract.resources import DEFAULT_GPU_SHARE
from xmodal.models.butd.config import PRECISIONS
from xmodal.models.butd.weights import LAYOUTS


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="extract.py", description=(__doc__ or "").split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("images", metavar="IMAGES", help="folder of images, list file of image paths, or s3:// prefix")
    p.add_argument("out", metavar="OUT", help="feature-only store to create (--format tsv: the TSV file)")
    p.add_argument("--weights", help="the detector's weights: " + "; ".join(PUBLIC_WEIGHTS))
    p.add_argument("--layout", default="auto",
                   help=f"the weights file's layout: auto (default: recognised from the file), {', '.join(LAYOUTS)}")
    p.add_argument("--boxes", help="boxes per image: 36 (default; LXMERT's obj36) or MIN-MAX (10-100: the bottom-up "
                                   "default, padded to MAX slots in a store)")
    p.add_argument("--boxes-from", metavar="FILE",
                   help="JSON {img_id: [[x1, y1, x2, y2], ...]} (original pixels): features of these boxes")
    p.add_argument("--precision", choices=PRECISIONS, default="fp32",
                   help="fp32 (default: exact, TF32 off), tf32 (TF32 convolutions and matmuls) or bf16 (bfloat16 "
                        "autocast over the network; boxes and NMS in float32)")
    p.add_argument("--input-size", metavar="SHORT:MAX",
                   help="the detector's input: the short side scaled to SHORT pixels unless the long side would "
                        "pass MAX (default 600:1000, the reference's and its weights'; another for a detector "
                        "trained at another size)")
    p.add_argument("--format", choices=("store", "tsv"), default="store",
                   help="store (default): a feature-only store; tsv: the reference's TSV")
    p.add_argument("--ids", metavar="FILE", help="image ids: JSON {path: img_id} or TSV path<TAB>img_id lines "
                                                 "(default: the file name without extension)")
    p.add_argument("--max-rejected", default=DEFAULT_MAX_REJECTED, metavar="N|P%",
                   help="unreadable images tolerated (listed and skipped) before the run fails: a number or a "
                        f"percentage of the images (default {DEFAULT_MAX_REJECTED})".replace("%", "%%"))
    p.add_argument("--batch-size", type=int, default=None,
                   help="images per detector call (default: on a GPU the largest the estimate of its memory fits "
                        "in an actor's share, at most 64; 4 on CPU; a given one is refused where the estimate "
                        "passes the share)")
    p.add_argument("--actors", type=int, default=None,
                   help="detector actors (default: as many as the cluster's GPUs place at --gpus-per-actor, "
                        "else 1 on CPU)")
    p.add_argument("--gpus-per-actor", type=float, default=None, metavar="F",
                   help=f"share of a GPU per detector actor, 0 < F <= 1 (default {DEFAULT_GPU_SHARE:g} on a "
                        "cluster with GPUs: two actors a GPU)")
    p.add_argument("--decode-tasks", type=int, default=None,
                   help="concurrent decoding tasks (default: the cluster's CPUs less one per detector actor, "
                        "at least 1)")
    p.add_argument("--images-per-shard", type=int, default=256, help="images per shard at most (default 256)")
    p.add_argument("--objects-vocab", metavar="FILE", help="object names (objects_vocab.txt), recorded in the manifest")
    p.add_argument("--attributes-vocab", metavar="FILE", help="attribute names (attributes_vocab.txt), recorded too")
    p.add_argument("--overwrite", action="store_true", help="replace an existing OUT")
    p.add_argument("--restart", action="store_true", help="discard an unfinished earlier extraction to OUT")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_verbose(p)
    p.add_argument("--random-weights", action="store_true", help=argparse.SUPPRESS)  # tests and benchmarks only
    p.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # tests: the tiny net (random or own weights)
    return p


def options(a: argparse.Namespace) -> ExtractOptions:
    return ExtractOptions(images=a.images, out=a.out, weights=a.weights, layout=a.layout,
                          random_weights=a.random_weights, tiny=a.tiny, boxes=a.boxes, boxes_from=a.boxes_from,
                          precision=a.precision, input_size=a.input_size, format=a.format, ids=a.ids,
                          max_rejected=a.max_rejected,
                          batch_size=a.batch_size, actors=a.actors, gpus_per_actor=a.gpus_per_actor,
                          decode_tasks=a.decode_tasks,
                          images_per_shard=a.images_per_shard, objects_vocab=a.objects_vocab,
                          attributes_vocab=a.attributes_vocab, overwrite=a.overwrite, restart=a.restart,
                          progress=not a.no_progress)


def main(argv: list[str] | None = None) -> int:
    """Run `jobs/extract.py` with `argv` (default: sys.argv[1:]); returns the exit code."""
    from xmodal.extract.job import extract

    a = parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    setup_console(a.verbose)
    o = options(a)

    def run() -> None:
        extract(o)

    return user_errors(run)
