"""LXMERT input pipeline: ready LxmertBatches per second on one CPU core vs the reference loader's work.

    python jobs/benchmark.py data [--num-images 512] [--batch 256] [--feat-dim 2048] [--ray]

1. Builds a synthetic store at paper dims (36 x 2048 float16, 1600 / 400 labels, 9,500 answers,
   --sentences-per-image 50 ~ the paper's 9.18 M sentences / 180 K images) and the same images as
   a reference feature TSV.
2. Ours: `iter_local_batches` (pyarrow read of the shards + vectorised masking + collation), the
   process pinned to one core and every library to one thread, measured after a warm-up batch.
   With --ray, also through Ray Data (read tasks on the other cores, the training path of one worker).
3. Baseline, the reference loader's work: features already decoded in memory as float32, one
   sample at a time in Python (mismatch draw, per-token 15 % / 80-10-10 masking loop, per-object
   masking loop with replacement from another image, box normalisation, soft-score QA draw), then
   `torch.utils.data.default_collate`. Sentences are pre-tokenised for it (the reference runs a
   Python WordPiece per sample, so the real baseline is slower than this).
4. Start-up: time and peak memory to open a store of N images vs to decode the same N images from
   the TSV into memory as the reference does before training starts (each in a fresh process).
5. Mixing: the fraction of matching negatives whose image shares the sample's shard, over one epoch
   (`loader.negative_shard_mix`) of a store shaped like the embedded default (5,400 train images in
   22 shards), with the old blocking (consecutive units) and with --mix-units, against uniform
   sampling over the store (sum over shards of (n_s/N)^2).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from xmodal.base.console import say


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """LXMERT data pipeline: samples/s to one worker vs the reference loader; store open vs TSV decode."""
    parser.add_argument("--num-images", type=int, default=512)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--feat-dim", type=int, default=2048)
    parser.add_argument("--num-objects", type=int, default=36)
    parser.add_argument("--sentences-per-image", type=int, default=50)
    parser.add_argument("--batches", type=int, default=90, help="batches to time for our pipeline (all rounds)")
    parser.add_argument("--baseline-batches", type=int, default=9, help="batches to time for the baseline")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (best and median reported)")
    parser.add_argument("--ray", action="store_true", help="also measure through Ray Data (starts a local Ray)")
    parser.add_argument("--mix-units", type=int, default=None,
                        help="units mixed into each block (default: the readers' default, 16; 0 = unmixed)")
    parser.add_argument("--workdir", help="where to build the store and TSV: a new folder is made in it (default: in "
                        "the temporary folder), removed at the end")
    parser.add_argument("--keep", action="store_true", help="keep the folder the store and TSV were built in")


def _one_core() -> str:
    """Pin this process to one core and every library to one thread (an honest per-worker figure)."""
    import pyarrow as pa
    import torch

    torch.set_num_threads(1)
    pa.set_cpu_count(1)
    pa.set_io_thread_count(1)
    if hasattr(os, "sched_setaffinity"):
        cpu = min(os.sched_getaffinity(0))
        os.sched_setaffinity(0, {cpu})
        return f"pinned to CPU {cpu}"
    return "not pinned (no sched_setaffinity)"


# ============================================================================ reference-style loader


def write_reference_tsv(store, path: Path) -> int:
    """The store's train images as a reference feature TSV (float32, pixel boxes)."""
    import base64

    def b64(a: np.ndarray) -> str:
        return base64.b64encode(np.ascontiguousarray(a).tobytes()).decode("ascii")

    block = store.read_split("train")
    with open(path, "w") as f:
        for k in range(block.num_images):
            n = int(block.num_boxes[k])
            h, w = int(block.img_h[k]), int(block.img_w[k])
            boxes = block.boxes[k, :n] * np.array([w, h, w, h], np.float32)
            f.write("\t".join([
                str(block.img_id[k]), str(h), str(w), b64(block.obj_ids[k, :n].astype(np.int64)),
                b64(block.obj_conf[k, :n]), b64(block.attr_ids[k, :n].astype(np.int64)), b64(block.attr_conf[k, :n]),
                str(n), b64(boxes), b64(block.features[k, :n].astype(np.float32))]) + "\n")
    return block.num_images


def load_obj_tsv(path: str, topk: int | None = None) -> list[dict]:
    """The reference `load_obj_tsv` (airsplay/lxmert src/utils.py): every image decoded to float32."""
    import base64
    import csv

    csv.field_size_limit(sys.maxsize)
    fields = ["img_id", "img_h", "img_w", "objects_id", "objects_conf", "attrs_id", "attrs_conf", "num_boxes",
              "boxes", "features"]
    data = []
    with open(path) as f:
        for i, item in enumerate(csv.DictReader(f, fields, delimiter="\t")):
            for key in ("img_h", "img_w", "num_boxes"):
                item[key] = int(item[key])
            boxes = item["num_boxes"]
            decode = [("objects_id", (boxes,), np.int64), ("objects_conf", (boxes,), np.float32),
                      ("attrs_id", (boxes,), np.int64), ("attrs_conf", (boxes,), np.float32),
                      ("boxes", (boxes, 4), np.float32), ("features", (boxes, -1), np.float32)]
            for key, shape, dtype in decode:
                item[key] = np.frombuffer(base64.b64decode(item[key]), dtype=dtype).reshape(shape)
                item[key].setflags(write=False)
            data.append(item)
            if topk is not None and i + 1 == topk:
                break
    return data


class ReferenceStyleDataset:
    """Per-sample pretraining example construction in Python, as the reference LXMERTTorchDataset."""

    def __init__(self, images: list[dict], sentences: list[tuple[str, list[int], dict[int, float] | None]],
                 vocab_size: int, special: dict[str, int]):
        self.imgid2img = {im["img_id"]: im for im in images}
        self.data = sentences
        self.vocab_size = vocab_size
        self.special = special

    def __len__(self) -> int:
        return len(self.data)

    def random_word(self, tokens: list[int]) -> tuple[list[int], list[int]]:
        out, labels = [], []
        for t in tokens:
            prob = random.random()
            if t in (self.special["[CLS]"], self.special["[SEP]"], self.special["[PAD]"]) or prob >= 0.15:
                out.append(t)
                labels.append(-100)
                continue
            prob /= 0.15
            if prob < 0.8:
                out.append(self.special["[MASK]"])
            elif prob < 0.9:
                out.append(random.randrange(5, self.vocab_size))
            else:
                out.append(t)
            labels.append(t)
        return out, labels

    def random_feat(self, feats: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        mask_feats = feats.copy()
        feat_mask = np.zeros(len(feats), dtype=np.float32)
        for i in range(len(feats)):
            prob = random.random()
            if prob < 0.15:
                prob /= 0.15
                if prob < 0.8:
                    mask_feats[i, :] = 0.0
                elif prob < 0.9:
                    other = self.imgid2img[self.data[random.randrange(len(self.data))][0]]["features"]
                    mask_feats[i, :] = other[random.randrange(len(other))]
                feat_mask[i] = 1.0
        return mask_feats, feat_mask

    def __getitem__(self, item: int) -> dict:
        img_id, tokens, label = self.data[item]
        info = self.imgid2img[img_id]
        feats = info["features"].copy()
        boxes = info["boxes"].copy()
        boxes[:, (0, 2)] /= info["img_w"]
        boxes[:, (1, 3)] /= info["img_h"]
        is_matched = 1
        if random.random() < 0.5:
            other = img_id
            while other == img_id:
                other_item = random.randrange(len(self.data))
                other, tokens, _ = self.data[other_item]
            is_matched = 0
        ans = -100
        if label and is_matched:
            keys, values = zip(*label.items(), strict=True)
            ans = keys[int(np.random.multinomial(1, np.array(values) / sum(values)).argmax())] if len(keys) > 1 \
                else keys[0]
        ids, lm_labels = self.random_word(tokens)
        masked_feats, feat_mask = self.random_feat(feats)
        return {"input_ids": np.array(ids), "input_mask": np.array([t != 0 for t in ids]),
                "lm_labels": np.array(lm_labels), "feats": masked_feats, "boxes": boxes,
                "obj_labels": info["objects_id"], "obj_confs": info["objects_conf"], "attr_labels": info["attrs_id"],
                "attr_confs": info["attrs_conf"], "feat_mask": feat_mask, "feat_targets": feats,
                "is_matched": is_matched, "ans": ans}


def baseline_batches(store, tsv: Path, batch: int) -> Iterator[dict]:
    """Endless reference-style batches: per-sample Python + default_collate."""
    from torch.utils.data import default_collate

    images = load_obj_tsv(str(tsv))
    block = store.read_split("train")
    data: list[tuple[str, list[int], dict[int, float] | None]] = []
    for k in range(block.num_images):
        for s in range(block.sent_offsets[k], block.sent_offsets[k + 1]):
            a0, a1 = block.ans_offsets[s], block.ans_offsets[s + 1]
            label = {int(a): float(sc) for a, sc in zip(block.ans_ids[a0:a1], block.ans_scores[a0:a1], strict=True)}
            data.append((str(block.img_id[k]), block.input_ids[s].tolist(), label or None))
    ds = ReferenceStyleDataset(images, data, store.manifest.vocab_size, store.manifest.special_tokens)
    order = list(range(len(ds)))
    rng = random.Random(0)
    while True:
        rng.shuffle(order)
        for b in range(len(order) // batch):
            yield default_collate([ds[i] for i in order[b * batch:(b + 1) * batch]])


# ============================================================================ ours


def our_batches(store, batch: int, mix_units: int | None = None) -> Iterator:
    """Endless LxmertBatches, epoch after epoch, built inline (no prefetch thread: one core)."""
    from xmodal.data.lxmert.loader import DEFAULT_MIX_UNITS, iter_local_batches
    from xmodal.data.lxmert.masking import LxmertBatchBuilder

    builder = LxmertBatchBuilder.from_store(store)
    epoch = 0
    while True:
        yield from iter_local_batches(store, "train", builder, batch, epoch=epoch, prefetch=0,
                                      mix_units=DEFAULT_MIX_UNITS if mix_units is None else mix_units)
        epoch += 1


def negative_mix(work: Path, mix_units: int | None) -> str:
    """One line: same-shard matching negatives, old blocking vs mixed vs uniform (see the docstring)."""
    from xmodal.data.lxmert.loader import DEFAULT_MIX_UNITS, negative_shard_mix
    from xmodal.data.lxmert.masking import LxmertBatchBuilder
    from xmodal.data.lxmert.synthetic import build_synthetic_store
    from xmodal.jobs.pretrain_config import embedded_lxmert_store

    k = DEFAULT_MIX_UNITS if mix_units is None else mix_units
    # The figure depends on the shard and row-group layout only: small features build it in a second.
    opts = dataclasses.replace(embedded_lxmert_store(), feat_dim=8)
    store = build_synthetic_store(work / "mix-store", opts, overwrite=True)
    builder = LxmertBatchBuilder.from_store(store)
    old, new = (negative_shard_mix(store, "train", builder, mix_units=m) for m in (0, k))
    return (f"matching negatives from the sample's own shard ({new.shards} shards, "
            f"{len(store.units('train'))} units, one epoch): old blocking {old.fraction:.3f}, "
            f"mixed ({k} units) {new.fraction:.3f}, uniform sampling {new.uniform:.3f}")


def ray_batches(store, batch: int) -> Iterator:
    """Endless LxmertBatches through Ray Data (read tasks run in Ray workers): the training path of
    one worker, `iter_rank_batches`."""
    from xmodal.data.lxmert.masking import LxmertBatchBuilder
    from xmodal.data.lxmert.pipeline import iter_rank_batches

    builder = LxmertBatchBuilder.from_store(store)
    epoch = 0
    while True:
        yield from iter_rank_batches(store, "train", builder, batch, seed=0, epoch=epoch, rank=0, world=1)
        epoch += 1


def timed(batches: Iterator, n: int, batch: int) -> float:
    """samples/s over the next n batches."""
    t0 = time.perf_counter()
    for _ in range(n):
        next(batches)
    return n * batch / (time.perf_counter() - t0)


# ============================================================================ start-up


_STARTUP = r"""
import json, sys, time
def rss():
    out = {}
    for line in open("/proc/self/status"):
        if line.startswith(("VmRSS", "VmHWM")):
            k, v = line.split(":"); out[k] = int(v.split()[0]) * 1024
    return out
import numpy as np
from xmodal.data.lxmert.store import open_store
from xmodal_bench.data import load_obj_tsv
try:
    open("/proc/self/clear_refs", "w").write("5")  # reset the peak-RSS mark after the imports
except OSError:
    pass
before = rss()["VmRSS"]
t = time.perf_counter()
what, path = sys.argv[1], sys.argv[2]
if what == "store":
    store = open_store(path)
    n = store.manifest.images("train")
else:
    n = len(load_obj_tsv(path))
dt = time.perf_counter() - t
print(json.dumps({"seconds": dt, "peak_bytes": rss()["VmHWM"] - before, "images": n}))
"""


def startup(what: str, path: Path) -> dict:
    out = subprocess.run([sys.executable, "-c", _STARTUP, what, str(path)], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# ============================================================================ main


def run(args: argparse.Namespace) -> int:
    from xmodal.data.lxmert.synthetic import build_synthetic_store
    from xmodal.data.options import SyntheticLxmertOptions
    from xmodal_bench import at_least, scratch

    at_least(args, 2, "num_images")  # mismatched sentences come from other images
    at_least(args, 1, "batch", "feat_dim", "num_objects", "sentences_per_image", "batches", "baseline_batches",
             "rounds")
    at_least(args, 0, "mix_units")
    work = scratch(args.workdir, "--workdir", "data", keep=args.keep)
    if args.keep:
        say(f"building in {work} (kept: --keep)")
    opts = SyntheticLxmertOptions(num_images=args.num_images, num_objects=args.num_objects, feat_dim=args.feat_dim,
                                  sentences_per_image=args.sentences_per_image, minival_fraction=0.0,
                                  images_per_shard=256)
    t = time.perf_counter()
    store = build_synthetic_store(work / "store", opts)
    build_s = time.perf_counter() - t
    tsv = work / "features.tsv"
    write_reference_tsv(store, tsv)
    m = store.manifest
    say(f"store: {m.images('train')} images x {m.num_objects} x {m.feat_dim} float16, "
        f"{m.sentences('train')} sentences, built in {build_s:.1f} s; TSV {tsv.stat().st_size / 2**20:.0f} MiB")

    s_open, s_tsv = startup("store", store.path), startup("tsv", tsv)
    if args.ray:  # before pinning: Ray's processes would inherit the one-core affinity
        from xmodal.runner.ray_cluster import start_local

        start_local(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, log_to_driver=False)
    pinned = _one_core()
    ours_it, base_it = our_batches(store, args.batch, args.mix_units), baseline_batches(store, tsv, args.batch)
    first = next(ours_it)  # warm-up (first read, first plan)
    next(base_it)
    ours, base = [], []
    for _ in range(args.rounds):  # interleaved rounds: a noisy neighbour hits both alike
        ours.append(timed(ours_it, max(1, args.batches // args.rounds), args.batch))
        base.append(timed(base_it, max(1, args.baseline_batches // args.rounds), args.batch))
    ray_r = None
    if args.ray:
        it = ray_batches(store, args.batch)
        try:
            next(it)
            ray_r = [timed(it, max(1, args.batches // args.rounds), args.batch) for _ in range(args.rounds)]
        finally:
            it.close()  # stop the prefetch thread and the Ray iterator before Ray goes
            import ray

            ray.shutdown()

    def fmt(r: list[float]) -> str:
        return f"best {max(r):8,.0f}  median {float(np.median(r)):8,.0f} samples/s"

    say(f"\none worker, one CPU core ({pinned}), batch {args.batch}, {args.rounds} interleaved rounds:")
    say(f"  ours (pyarrow + vectorised numpy -> LxmertBatch)    {fmt(ours)}")
    if ray_r is not None:
        say(f"  ours through Ray Data (read tasks on other cores)  {fmt(ray_r)}")
    say(f"  reference-style loader (Python/sample + collate)   {fmt(base)}")
    say(f"  ratio ours / baseline: best {max(ours) / max(base):.1f}x, median "
        f"{np.median(ours) / np.median(base):.1f}x   (targets: >= 5,000 samples/s, >= 3x)")
    say(f"  batch: visual_feats {tuple(first.visual_feats.shape)} {first.visual_feats.dtype}, "
        f"input_ids {tuple(first.input_ids.shape)}")
    say(f"  {negative_mix(work, args.mix_units)}")
    say(f"\nstart-up for {m.images('train')} images:")
    say(f"  open the store           {s_open['seconds']:8.3f} s   peak +{s_open['peak_bytes'] / 2**20:8.1f} MiB")
    say(f"  decode the TSV (ref.)    {s_tsv['seconds']:8.3f} s   peak +{s_tsv['peak_bytes'] / 2**20:8.1f} MiB")
    return 0
