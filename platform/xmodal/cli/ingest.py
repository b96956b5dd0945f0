"""`python jobs/ingest.py SOURCE OUT [options]`: build a feature store or a fine-tuning set.

One subcommand per source (`SOURCE --help` lists its options). This module owns the command line:
it parses the arguments and calls plain data-layer functions with keyword arguments. A source's
data module is imported only when that source is chosen (its dependencies stay its own). Bad
input of any source is one line `error: ...` on stderr and exit code 2 (`xmodal.base.commands.user_errors`).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable

from xmodal.base.commands import user_errors
from xmodal.base.console import say
from xmodal.base.errors import UserError

# ============================================================================ lxmert


def _lxmert_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", help="store directory to create")
    p.add_argument("--tsv", action="append", required=True, help="feature TSV (repeatable)")
    p.add_argument("--json", action="append", required=True, help="pretraining JSON (repeatable)")
    p.add_argument("--vocab", help="BERT vocab.txt (default: train a WordPiece vocabulary on the sentences)")
    p.add_argument("--vocab-size", type=int, default=None,
                   help="the most tokens a trained vocabulary may hold (default 30522, BERT's; not with --vocab): "
                        "a small corpus needs fewer, and the special tokens and every character of the sentences "
                        "are always in, so it is refused below that minimum")
    p.add_argument("--answers", help="reference all_ans.json (default: the most frequent answers)")
    p.add_argument("--num-answers", type=int, default=9500, help="answer table size (default 9500)")
    p.add_argument("--minival", action="append", metavar="FILE",
                   help="minival JSON (repeatable; the reference's mscoco_minival.json): its images are minival, "
                        "all others train; read as a sentence file too")
    p.add_argument("--split", choices=("auto", "reference", "hash"), default="auto",
                   help="how minival is chosen: reference (the --minival files' images), hash (--minival-fraction "
                        "of the images by a hash of img_id), auto (default: reference when --minival is given or "
                        "a --json is named mscoco_minival.json, else hash)")
    p.add_argument("--minival-fraction", type=float, default=None,
                   help="--split hash: fraction of images held out as minival (default 0.1)")
    p.add_argument("--max-seq-len", type=int, default=20, help="tokens per sentence incl. [CLS]/[SEP]")
    p.add_argument("--num-objects", type=int, default=36, help="object slots per image")
    p.add_argument("--feat-dim", type=int, default=None, help="feature width (default: from the first line)")
    p.add_argument("--num-object-labels", type=int, default=1600)
    p.add_argument("--num-attr-labels", type=int, default=400)
    p.add_argument("--images-per-shard", type=int, default=256)
    p.add_argument("--order-seed", type=int, default=0,
                   help="images are written in a random order from this seed (default 0), so every shard mixes "
                        "the sources; recorded in the manifest (image_order)")
    p.add_argument("--source-order", action="store_true",
                   help="write the images in the order of the --tsv files instead (no random order)")
    p.add_argument("--allow-missing-images", action="store_true",
                   help="drop sentences whose image has no features instead of failing")
    p.add_argument("--allow-missing-labelf", action="store_true",
                   help="take JSON records without \"labelf\" as having no questions (counted) instead of failing")
    p.add_argument("--overwrite", action="store_true", help="replace an existing LXMERT store")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _lxmert(args: argparse.Namespace) -> None:
    from xmodal.data.lxmert.ingest import ingest_lxmert

    store = ingest_lxmert(args.out, args.tsv, args.json, vocab=args.vocab, answers=args.answers,
                          num_answers=args.num_answers, vocab_size=args.vocab_size,
                          split=args.split, minival=args.minival, minival_fraction=args.minival_fraction,
                          max_seq_len=args.max_seq_len,
                          num_objects=args.num_objects, feat_dim=args.feat_dim,
                          num_object_labels=args.num_object_labels, num_attr_labels=args.num_attr_labels,
                          images_per_shard=args.images_per_shard, allow_missing_images=args.allow_missing_images,
                          allow_missing_labelf=args.allow_missing_labelf, overwrite=args.overwrite,
                          order_seed=None if args.source_order else args.order_seed, progress=not args.no_progress)
    m = store.manifest
    vocab = f"vocab {m.vocab_size}"
    if args.vocab is None and m.vocab_size < m.options["vocab_size"]:  # a trained one smaller than asked
        vocab += f" (every word piece of the sentences; --vocab-size {m.options['vocab_size']} is the most)"
    say(str(store))
    say(f"answers {m.num_answers}, {vocab}, unknown answers ignored {m.unknown_answers}, "
        f"questions without a known answer {m.unanswerable_questions}, truncated sentences "
        f"{m.truncated_sentences}, images without sentences {m.dropped_images}, records without labelf "
        f"{m.missing_labelf}")
    how = m.minival_split
    if how is not None and how.method == "reference":
        say(f"minival: the reference split, {m.images('minival')} images of {', '.join(how.files)}")
    elif how is not None:
        say(f"minival: {m.images('minival')} images, {how.fraction:g} of all by a hash of img_id")


# ============================================================================ features


def _features_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", help="store directory to create")
    p.add_argument("--tsv", action="append", required=True,
                   help="feature TSV (repeatable), e.g. the reference's data/nlvr2_imgfeat/train_obj36.tsv")
    p.add_argument("--num-objects", type=int, default=36, help="object slots per image")
    p.add_argument("--feat-dim", type=int, default=None, help="feature width (default: from the first line)")
    p.add_argument("--num-object-labels", type=int, default=1600)
    p.add_argument("--num-attr-labels", type=int, default=400)
    p.add_argument("--images-per-shard", type=int, default=256)
    p.add_argument("--overwrite", action="store_true", help="replace an existing feature-only store")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")


def _features(args: argparse.Namespace) -> None:
    from xmodal.data.lxmert.feature_writer import ingest_features
    from xmodal.data.lxmert.ingest import check_given_once

    check_given_once("--tsv", args.tsv)  # else the second copy's lines read as images already stored
    say(str(ingest_features(args.out, args.tsv, num_objects=args.num_objects, feat_dim=args.feat_dim,
                            num_object_labels=args.num_object_labels, num_attr_labels=args.num_attr_labels,
                            images_per_shard=args.images_per_shard, overwrite=args.overwrite,
                            progress=not args.no_progress)))


# ============================================================================ synthetic (LXMERT)


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"{text!r}: expected true or false")


def _synthetic_arguments(p: argparse.ArgumentParser) -> None:
    from xmodal.data.options import SyntheticLxmertOptions

    p.add_argument("out", help="store directory to create")
    for f in dataclasses.fields(SyntheticLxmertOptions):
        default = f.default
        kind = _bool if isinstance(default, bool) else type(default)
        p.add_argument("--" + f.name.replace("_", "-"), type=kind, default=default, help=f"(default {default})")
    p.add_argument("--overwrite", action="store_true", help="replace an existing LXMERT store")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def _synthetic(args: argparse.Namespace) -> None:
    from xmodal.data.lxmert.synthetic import build_synthetic_store
    from xmodal.data.options import SyntheticLxmertOptions

    o = SyntheticLxmertOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SyntheticLxmertOptions)})
    say(str(build_synthetic_store(args.out, o, overwrite=args.overwrite, progress=not args.no_progress)))


# ============================================================================ mult


def _mult_arguments(p: argparse.ArgumentParser) -> None:
    from xmodal.data.mult.ingest import DATASETS, FORMATS
    from xmodal.data.mult.store import DEFAULT_SHARD_ROWS

    p.add_argument("out", help="store directory to create")
    p.add_argument("--pickle", required=True, help="the dataset pickle")
    p.add_argument("--format", choices=FORMATS, required=True,
                   help="reference: yaohungt/Multimodal-Transformer (front padding); mmsa: thuiar/MMSA (end padding)")
    p.add_argument("--dataset", choices=DATASETS, default=None, help="default: from the labels and the file name")
    p.add_argument("--overwrite", action="store_true", help="replace an existing MulT store")
    p.add_argument("--shard-rows", type=int, default=DEFAULT_SHARD_ROWS, help="clips per Parquet shard")


def _mult(args: argparse.Namespace) -> None:
    from xmodal.data.mult.ingest import ingest

    store = ingest(args.out, args.pickle, args.format, args.dataset, overwrite=args.overwrite,
                   shard_rows=args.shard_rows)
    m = store.manifest
    say(f"wrote {store.path}: {m.dataset} ({m.task}), rows {m.rows}, dims {m.dims}, max lengths {m.max_len}")
    if any(v for d in m.stats.values() for v in d.values()):
        say(f"  cleaned: {m.stats}")


# ============================================================================ mult-synthetic


def _mult_synthetic_arguments(p: argparse.ArgumentParser) -> None:
    from xmodal.data.options import SyntheticMultOptions

    d = SyntheticMultOptions()
    p.add_argument("out", help="store directory to create")
    p.add_argument("--num-samples", type=int, default=d.num_samples)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--text-dim", type=int, default=d.text_dim)
    p.add_argument("--audio-dim", type=int, default=d.audio_dim)
    p.add_argument("--vision-dim", type=int, default=d.vision_dim)
    p.add_argument("--text-len", type=int, nargs=2, default=list(d.text_len), metavar=("MIN", "MAX"))
    p.add_argument("--audio-rate", type=float, default=d.audio_rate, help="audio steps per word")
    p.add_argument("--vision-rate", type=float, default=d.vision_rate, help="vision steps per word")
    p.add_argument("--label-noise", type=float, default=d.label_noise)
    p.add_argument("--overwrite", action="store_true", help="replace an existing MulT store")


def _mult_synthetic(args: argparse.Namespace) -> None:
    from xmodal.data.mult.synthetic import build_synthetic_store
    from xmodal.data.options import SyntheticMultOptions

    options = SyntheticMultOptions(
        num_samples=args.num_samples, seed=args.seed, text_dim=args.text_dim, audio_dim=args.audio_dim,
        vision_dim=args.vision_dim, text_len=tuple(args.text_len), audio_rate=args.audio_rate,
        vision_rate=args.vision_rate, label_noise=args.label_noise)
    store = build_synthetic_store(args.out, options, overwrite=args.overwrite)
    say(f"wrote {store.path}: rows {store.manifest.rows}, dims {store.dims}, max lengths {store.manifest.max_len}")


# ============================================================================ vqa / gqa / nlvr2


def _finetune_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", help="fine-tuning set directory to create")
    p.add_argument("--store", action="append", required=True, metavar="STORE",
                   help="image store (repeatable, searched in order): an LXMERT store (jobs/ingest.py lxmert; the "
                        "first one's tokenizer tokenises the sentences) or a feature-only store (jobs/ingest.py "
                        "features)")
    for split in ("train", "valid", "test"):
        p.add_argument(f"--{split}", action="append", metavar="A.json[,B.json]",
                       help=f"JSON file(s) of the {split} split (comma separated or repeated)")
    p.add_argument("--answers", help="reference answer file (trainval_label2ans.json; vqa/gqa; "
                                     "default: the train split's most frequent answers)")
    p.add_argument("--num-answers", type=int, default=None,
                   help="answer table size (default 3129 vqa / 1842 gqa, or the whole --answers file)")
    p.add_argument("--allow-missing-images", action="store_true",
                   help="drop (and count) questions whose image is in no --store instead of failing")
    p.add_argument("--overwrite", action="store_true", help="replace an existing fine-tuning set")


def _finetune(args: argparse.Namespace) -> None:
    from xmodal.data.finetune.ingest import ingest_finetune

    splits = {s: [f for v in getattr(args, s) or [] for f in v.split(",") if f] for s in ("train", "valid", "test")}
    splits = {s: v for s, v in splits.items() if v}
    if not splits:
        raise UserError(f"{args.command}: give at least one of --train, --valid, --test")
    data = ingest_finetune(args.command, splits, args.store, args.out, answers=args.answers,
                           overwrite=args.overwrite, num_answers=args.num_answers,
                           allow_missing_images=args.allow_missing_images)
    m = data.manifest
    say(str(data))
    say(f"answers {m.num_answers}, ignored {m.ignored}, {m.stats}")
    if m.missing_image_examples:
        say("examples of missing images: " + ", ".join(f"{x['id']} ({x['img_id']})"
                                                        for x in m.missing_image_examples))


# ============================================================================ synthetic-vqa / -gqa / -nlvr2

_VQA_ONLY = ("questions_per_image", "near_answer_prob")
_NLVR2_ONLY = ("statements_per_image", "pairs_per_statement")


def _synthetic_finetune_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("out", help="fine-tuning set directory to create")
    p.add_argument("--store", required=True, help="synthetic feature store (jobs/ingest.py synthetic)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--questions-per-image", type=int, default=None, help="synthetic-vqa/gqa (default 3)")
    p.add_argument("--near-answer-prob", type=float, default=None,
                   help="synthetic-vqa (default 0.25; gqa: 0, exact match)")
    p.add_argument("--statements-per-image", type=float, default=None, help="synthetic-nlvr2 (default 1.0)")
    p.add_argument("--pairs-per-statement", type=int, default=None, help="synthetic-nlvr2 (default 4)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing fine-tuning set")


def _synthetic_finetune(args: argparse.Namespace) -> None:
    from xmodal.data.finetune.synthetic import build_synthetic_nlvr2, build_synthetic_vqa

    task = args.command.removeprefix("synthetic-")
    vqa = task != "nlvr2"
    wrong = [k for k in (_NLVR2_ONLY if vqa else _VQA_ONLY) if getattr(args, k) is not None]
    if wrong:
        raise UserError(f"{args.command} does not take --{wrong[0].replace('_', '-')}")
    opts = {k: getattr(args, k) for k in (_VQA_ONLY if vqa else _NLVR2_ONLY) if getattr(args, k) is not None}
    if vqa:
        data = build_synthetic_vqa(args.store, args.out, task=task, seed=args.seed, overwrite=args.overwrite, **opts)
    else:
        data = build_synthetic_nlvr2(args.store, args.out, seed=args.seed, overwrite=args.overwrite, **opts)
    say(str(data))


# ============================================================================ the table

Source = tuple[Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], None], str]

# subcommand -> (its arguments, what it runs, one-line help)
SOURCES: dict[str, Source] = {
    "lxmert": (_lxmert_arguments, _lxmert, "reference feature TSV + pretraining JSON -> LXMERT store"),
    "features": (_features_arguments, _features, "reference feature TSV without sentences -> feature-only store"),
    "synthetic": (_synthetic_arguments, _synthetic, "learnable synthetic LXMERT corpus -> LXMERT store"),
    "mult": (_mult_arguments, _mult, "reference / MMSA sentiment pickles -> MulT store"),
    "mult-synthetic": (_mult_synthetic_arguments, _mult_synthetic, "learnable synthetic unaligned streams -> MulT store"),
    "vqa": (_finetune_arguments, _finetune, "reference VQA fine-tuning JSON -> fine-tuning set over image stores"),
    "gqa": (_finetune_arguments, _finetune, "reference GQA fine-tuning JSON -> fine-tuning set over image stores"),
    "nlvr2": (_finetune_arguments, _finetune, "reference NLVR2 JSON -> fine-tuning set over image stores"),
    "synthetic-vqa": (_synthetic_finetune_arguments, _synthetic_finetune,
                      "learnable synthetic VQA over a synthetic LXMERT store"),
    "synthetic-gqa": (_synthetic_finetune_arguments, _synthetic_finetune,
                      "learnable synthetic GQA over a synthetic LXMERT store"),
    "synthetic-nlvr2": (_synthetic_finetune_arguments, _synthetic_finetune,
                        "learnable synthetic NLVR2 over a synthetic LXMERT store"),
}


def parser(argv: list[str]) -> argparse.ArgumentParser:
    """The parser; only the chosen subcommand's arguments are added (they may import its module)."""
    p = argparse.ArgumentParser(prog="ingest.py", description=(__doc__ or "").split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True, metavar="{" + ",".join(SOURCES) + "}")
    chosen = argv[0] if argv and argv[0] in SOURCES else None
    for name, (arguments, _, help_text) in SOURCES.items():
        sp = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:
            arguments(sp)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run `jobs/ingest.py` with `argv` (default: sys.argv[1:]); returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parser(argv).parse_args(argv)
    return user_errors(lambda: SOURCES[args.command][1](args))
