"""Scale rehearsal: the real ingest and data path on reference-format inputs at two store sizes.

    python jobs/benchmark.py scale [--images 2000,20000] [--mult-size mosei|small] [--out bench-results]
                                   [--work DIR] [--quick]

For each LXMERT size N (images), in a temporary folder under --work:
1. writes reference-format inputs: a feature TSV (base64, 36 boxes x 2048 float32 features, pixel
   boxes, int64 labels) and a pretraining JSON of 5 sentences per image (3 captions, 2 questions
   with soft answer scores), and a BERT-style vocab.txt (the paper's runs pass --vocab);
2. times `ingest_lxmert` (one process, as `jobs/ingest.py lxmert` runs it): wall and CPU seconds,
   its peak RSS, and separately the sentence part alone (JSON check + tokenising), so that the
   per-image and per-sentence costs can be extrapolated apart; then deletes the TSV and JSON;
3. the store: size on disk; time and peak memory to open it (`xmodal_bench.data.startup`, a fresh process);
   the data pipeline's samples/s on one pinned core (`xmodal_bench.data.our_batches`, as the suite's data
   section); the peak RSS of one training worker through one epoch: the pretraining job's worker
   (`inprocess.run_in_process`: the same objective, `fit` loop and batches a one-worker Ray Train run
   reads, straight from the files instead of through Ray Data) on the tiny preset, in a fresh process.
MulT: a MOSEI-size reference pickle (16,326 / 1,871 / 4,659 clips; text 50 x 300, audio 500 x 74,
vision 500 x 35, float32, front padding) or MOSI-size with --mult-size small; the same figures, the
worker (`jobs/mult_job.py`'s job, tiny preset) capped at --mult-steps steps (a MulT epoch at 500-step
sequences is minutes on a CPU; its data path reads one row group at a time, so a partial epoch
shows the same resident set).

Writes `<out>/scale-<UTC timestamp>.json` and `.md` (measured rows, the RSS ratio across the LXMERT
sizes, and the extrapolation to the paper's corpus) and prints the table. `--quick` (CI): 100 and
1,000 images of 10 boxes x 64 features, a 60-clip MulT pickle, batch 32.
"""

from __future__ import annotations

import argparse
import base64
import datetime as dt
import json
import math
import os
import pickle
import platform
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from xmodal.base.console import say
from xmodal.base.errors import UserError
from xmodal.tracking import git_commit

WORDS = ("man", "woman", "dog", "horse", "street", "table", "red", "small", "riding", "sitting", "on", "the", "next",
         "to", "with", "umbrella", "pizza", "plate", "green", "field", "a", "is", "what", "color", "how", "many",
         "there", "of", "in", "people", "two", "white", "black", "yes", "no")
ANSWERS = ("yes", "no", "2", "red", "dog", "pizza", "gray", "3", "white", "black", "1", "table")

# The paper's corpus and the fine-tuning sets (docs/papers.md; VQA v2 and GQA balanced train
# questions from their papers). VQA and GQA images are COCO / Visual Genome images, all already
# in the pretraining store; NLVR2 brings its own images (a feature-only store).
PAPER = {"images": 180_000, "sentences": 9_180_000}
FINETUNE_QUESTIONS = {"vqa": 443_757, "gqa": 943_000}
MOSEI = (16_326, 1_871, 4_659)
MOSI = (1_284, 229, 686)  # 2,199 clips in all (docs/papers.md); the reference's split
MULT_DIMS = {"mosei": ({"text": 300, "audio": 74, "vision": 35}, {"text": 50, "audio": 500, "vision": 500}),
             "small": ({"text": 300, "audio": 5, "vision": 20}, {"text": 50, "audio": 375, "vision": 500}),
             "quick": ({"text": 16, "audio": 6, "vision": 5}, {"text": 10, "audio": 40, "vision": 40})}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--images", default=None, help="comma-separated LXMERT store sizes (default 2000,20000; "
                                                  "quick 100,1000)")
    p.add_argument("--mult-size", choices=("mosei", "small", "none"), default="mosei",
                   help="MulT pickle: MOSEI-size (default), MOSI-size (small), or none")
    p.add_argument("--out", default="bench-results", help="folder for scale-<timestamp>.json and .md")
    p.add_argument("--work", default=None, help="where inputs and stores are built (default: a temporary folder)")
    p.add_argument("--keep", action="store_true", help="keep the stores under --work (inputs are always deleted)")
    p.add_argument("--quick", action="store_true", help="tiny sizes for CI (checks every field, not speed)")
    p.add_argument("--batch", type=int, default=None, help="pipeline and worker batch (default 256; quick 32)")
    p.add_argument("--mult-steps", type=int, default=None, help="MulT worker steps (default 30; quick 3)")


# ============================================================================ helpers


def _rss() -> dict[str, int]:
    """VmRSS and VmHWM (peak) of this process, in bytes."""
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS", "VmHWM")):
                k, v = line.split(":")
                out[k] = int(v.split()[0]) * 1024
    return out


def _reset_peak() -> None:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # the peak-RSS mark restarts from the current RSS
    except OSError:
        pass


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def du(path: Path) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def _child(func: str, **kwargs: Any) -> dict[str, Any]:
    """Run `func(**kwargs)` of this module in a fresh Python process; its JSON result."""
    code = ("import json, sys\nfrom xmodal_bench import scale\n"
            "print('@@' + json.dumps(getattr(scale, sys.argv[1])(**json.loads(sys.argv[2]))))")
    env = dict(os.environ)
    pkg = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([pkg, *filter(None, [env.get("PYTHONPATH")])])
    out = subprocess.run([sys.executable, "-c", code, func, json.dumps(kwargs)], capture_output=True, text=True,
                         env=env, check=False)
    lines = [x for x in out.stdout.splitlines() if x.startswith("@@")]
    if out.returncode != 0 or not lines:
        raise RuntimeError(f"scale: {func} failed (exit {out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(lines[-1][2:])


# ============================================================================ LXMERT inputs


def _b64(a: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(a).tobytes()).decode("ascii")


def write_lxmert_inputs(folder: str, images: int, num_objects: int, feat_dim: int, sentences_per_image: int = 5,
                        seed: int = 0) -> dict[str, Any]:
    """The reference's feature TSV, pretraining JSON (captions + questions with soft scores) and a
    vocab.txt, streamed in chunks (memory stays small at any size)."""
    d = Path(folder)
    d.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    tsv = d / "train_obj36.tsv"
    chunk = 128
    with open(tsv, "w") as f:
        for start in range(0, images, chunk):
            n = min(chunk, images - start)
            # Post-ReLU-like detector features: non-negative, a third zero; float32 as the reference writes.
            feats = rng.random((n, num_objects, feat_dim), dtype=np.float32) * 4.0
            feats[feats < 1.3] = 0.0
            hw = rng.integers(200, 640, (n, 2))
            x1 = rng.uniform(0, 0.7, (n, num_objects)) * hw[:, 1:2]
            y1 = rng.uniform(0, 0.7, (n, num_objects)) * hw[:, 0:1]
            x2 = x1 + rng.uniform(0.05, 0.3, (n, num_objects)) * hw[:, 1:2]
            y2 = y1 + rng.uniform(0.05, 0.3, (n, num_objects)) * hw[:, 0:1]
            boxes = np.stack([x1, y1, x2, y2], -1).astype(np.float32)
            obj, attr = rng.integers(0, 1600, (n, num_objects)), rng.integers(0, 400, (n, num_objects))
            conf = rng.uniform(0, 1, (n, 2, num_objects)).astype(np.float32)
            f.write("".join("\t".join([
                f"COCO_{start + k:08d}", str(hw[k, 0]), str(hw[k, 1]), _b64(obj[k].astype(np.int64)), _b64(conf[k, 0]),
                _b64(attr[k].astype(np.int64)), _b64(conf[k, 1]), str(num_objects), _b64(boxes[k]), _b64(feats[k])])
                + "\n" for k in range(n)))
    records = []
    words = np.array(WORDS)
    n_q = min(2, sentences_per_image - 1)
    for i in range(images):
        caps = [" ".join(rng.choice(words, 8)) + "." for _ in range(sentences_per_image - n_q)]
        qs = [f"what {' '.join(rng.choice(words, 5))}?" for _ in range(n_q)]
        labels = [{str(a): round(float(s), 2) for a, s in zip(rng.choice(ANSWERS, 2, replace=False),
                                                              rng.uniform(0.3, 1.0, 2), strict=True)} for _ in qs]
        records.append({"img_id": f"COCO_{i:08d}", "sentf": {"mscoco": caps, "vqa": qs}, "labelf": {"vqa": labels}})
    js = d / "mscoco_train.json"
    js.write_text(json.dumps(records))
    vocab = d / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", "?", *WORDS,
                                *(str(k) for k in range(10))]) + "\n")
    return {"tsv": str(tsv), "json": str(js), "vocab": str(vocab), "tsv_bytes": tsv.stat().st_size,
            "json_bytes": js.stat().st_size, "write_s": time.perf_counter() - t0,
            **sentence_part(str(js), str(vocab))}  # here: a child of its own would cost one more start-up


def sentence_part(json_file: str, vocab: str) -> dict[str, Any]:
    """The ingest's per-sentence work alone: parse and check the JSON, tokenise every sentence."""
    from xmodal.data.lxmert.corpus import Corpus, load_pretrain_json
    from xmodal.data.tokenizer import WordPieceTokenizer

    t, c = time.perf_counter(), _cpu_s()
    corpus = Corpus()
    load_pretrain_json(Path(json_file), corpus)
    WordPieceTokenizer.from_vocab(vocab, 20).encode_batches(corpus.sentence_batches(), len(corpus))
    return {"sentence_part_s": time.perf_counter() - t, "sentence_part_cpu_s": _cpu_s() - c,
            "sentences": len(corpus)}


def ingest_lxmert_timed(out: str, tsv: str, json_file: str, vocab: str, num_objects: int) -> dict[str, Any]:
    """`ingest_lxmert` as `jobs/ingest.py lxmert` calls it, timed, with this process's peak RSS."""
    from xmodal.data.lxmert.ingest import ingest_lxmert

    t, c = time.perf_counter(), _cpu_s()
    store = ingest_lxmert(out, [tsv], [json_file], vocab=vocab, num_objects=num_objects, split="hash",
                          progress=False)
    wall, cpu = time.perf_counter() - t, _cpu_s() - c
    m = store.manifest
    return {"ingest_s": wall, "ingest_cpu_s": cpu, "processes": 1, "ingest_peak_rss_bytes": _rss()["VmHWM"],
            "images_stored": m.images("train") + m.images("minival"), "train_images": m.images("train"),
            "train_sentences": m.sentences("train")}


def lxmert_pipeline(store: str, batch: int, batches: int) -> dict[str, Any]:
    """`xmodal_bench.data`'s measurement: our batches on one pinned core, best of 3 rounds after a warm-up."""
    from xmodal.data.lxmert.store import open_store
    from xmodal_bench.data import _one_core, our_batches, timed

    s = open_store(store)
    _one_core()
    it = our_batches(s, batch)
    next(it)
    n = max(1, batches // 3)
    rates = [timed(it, n, batch) for _ in range(3)]
    return {"samples_s": 3 / sum(1 / r for r in rates), "best_samples_s": max(rates)}


def _worker_run(job, cfg, store, batch: int) -> dict[str, Any]:
    """Train `job` on the opened `store` in this process (the worker of a one-worker run): its steps,
    time and peak RSS, and the RSS it started from."""
    import torch

    from xmodal.core.cost import peak_memory_gib
    from xmodal.runner.inprocess import run_in_process

    before = _rss()["VmRSS"]
    t = time.perf_counter()
    w, _ = run_in_process(job, cfg, store)
    return {"worker_peak_rss_bytes": int(peak_memory_gib(torch.device("cpu")) * 2**30),
            "worker_rss_before_bytes": before, "worker_steps": w.state.step, "worker_s": time.perf_counter() - t,
            "worker_samples": w.state.step * batch}


def lxmert_worker(store: str, batch: int) -> dict[str, Any]:
    """One epoch of the pretraining job's worker (tiny preset, CPU, in this process): peak RSS."""
    import torch

    from xmodal.config.experiment import load_config
    from xmodal.data.lxmert.store import open_store
    from xmodal.jobs.pretrain_config import PretrainConfig
    from xmodal.jobs.pretrain_job import PretrainJob

    torch.set_num_threads(1)
    s = open_store(store)
    cfg = load_config(PretrainConfig, overrides=[
        f"data.store={store}", "preset=tiny", "train.epochs=1", f"train.batch_size={batch}",
        "train.eval_every=1000000000", "data.eval_batches=2"])
    return _worker_run(PretrainJob(), cfg, s, batch)


def open_mult(store: str) -> dict[str, Any]:
    _reset_peak()
    before = _rss()["VmRSS"]
    t = time.perf_counter()
    from xmodal.data.mult.store import open_store

    s = open_store(store)
    return {"seconds": time.perf_counter() - t, "peak_bytes": _rss()["VmHWM"] - before,
            "rows": sum(s.manifest.rows.values())}


# ============================================================================ MulT inputs


def write_mult_pickle(path: str, size: str, splits: list[int], seed: int = 0) -> dict[str, Any]:
    """A reference-format pickle (front padding, -inf in audio, labels [N, 1, 1]), float32."""
    dims, lens = MULT_DIMS[size]
    rng = np.random.default_rng(seed)
    t0 = time.perf_counter()
    data = {}
    for name, n in zip(("train", "valid", "test"), splits, strict=True):
        part: dict[str, Any] = {}
        for m in ("text", "audio", "vision"):
            t = lens[m]
            a = rng.standard_normal((n, t, dims[m]), dtype=np.float32)
            a[a == 0] = 0.5
            # Real clips are shorter than the padded length: zero the leading steps of each.
            length = rng.integers(max(1, t // 4), t + 1, n)
            a[np.arange(t)[None, :] < (t - length)[:, None]] = 0.0
            part[m] = a
        part["audio"][0, -1, 0] = -np.inf
        part["labels"] = rng.uniform(-3, 3, (n, 1, 1)).astype(np.float32)
        part["id"] = np.array([[f"clip{name}{i}".encode(), b"0", b"1"] for i in range(n)])
        data[name] = part
    with open(path, "wb") as f:
        pickle.dump(data, f, protocol=5)  # protocol 5: arrays written from their buffers, no copy
    return {"pickle_bytes": Path(path).stat().st_size, "write_s": time.perf_counter() - t0}


def ingest_mult_timed(out: str, pkl: str, dataset: str) -> dict[str, Any]:
    from xmodal.data.mult.ingest import ingest

    t, c = time.perf_counter(), _cpu_s()
    store = ingest(out, pkl, "reference", dataset)
    wall, cpu = time.perf_counter() - t, _cpu_s() - c
    return {"ingest_s": wall, "ingest_cpu_s": cpu, "processes": 1, "ingest_peak_rss_bytes": _rss()["VmHWM"],
            "clips": sum(store.manifest.rows.values())}


def mult_pipeline(store: str, batch: int, batches: int) -> dict[str, Any]:
    """The MulT worker's in-process data path (`jobs/mult_job.py`): row groups -> MultBatches, one core."""
    import itertools

    from xmodal.data.mult.pipeline import batches_from_tables
    from xmodal.data.mult.store import open_store
    from xmodal.data.units import epoch_units, read_unit
    from xmodal_bench.data import _one_core

    s = open_store(store)
    _one_core()

    def endless():
        for epoch in itertools.count():
            units = epoch_units(s.units("train"), seed=0, epoch=epoch)
            yield from batches_from_tables((read_unit(u) for u in units), s.dims, batch, seed=0, epoch=epoch)

    it = endless()
    next(it)
    rates = []
    n = max(1, batches // 3)
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(n):
            next(it)
        rates.append(n * batch / (time.perf_counter() - t))
    # Over all timed batches: a round can be served from one decoded row group (a best round is not a rate).
    return {"samples_s": 3 / sum(1 / r for r in rates), "best_samples_s": max(rates)}


def mult_worker(store: str, batch: int, steps: int) -> dict[str, Any]:
    """The MulT job's worker (tiny preset, CPU, in this process) for `steps` steps: peak RSS."""
    import torch

    from xmodal.config.experiment import load_config
    from xmodal.data.mult.store import open_store
    from xmodal.jobs.mult_config import MultTrainConfig
    from xmodal.jobs.mult_job import MultJob

    torch.set_num_threads(1)
    s = open_store(store)
    cfg = load_config(MultTrainConfig, overrides=[
        f"data.store={store}", "preset=tiny", "train.epochs=1", f"train.batch_size={batch}",
        f"train.max_steps={steps}", f"train.eval_every={steps}"])
    return _worker_run(MultJob(), cfg, s, batch)


# ============================================================================ the rehearsal


def measure_lxmert(work: Path, images: int, quick: bool, batch: int, keep: bool) -> dict[str, Any]:
    from xmodal_bench.data import startup

    num_objects, feat_dim = (10, 64) if quick else (36, 2048)
    inputs = work / f"inputs-{images}"
    store = work / f"lxmert-{images}"
    say(f"lxmert {images:,} images: writing the reference TSV + JSON ...")
    try:
        wrote = _child("write_lxmert_inputs", folder=str(inputs), images=images, num_objects=num_objects,
                       feat_dim=feat_dim)
        say(f"  TSV {wrote['tsv_bytes'] / 2**30:.2f} GiB, JSON {wrote['json_bytes'] / 2**20:.1f} MiB "
            f"({wrote['write_s']:.0f} s); ingesting ...")
        ing = _child("ingest_lxmert_timed", out=str(store), tsv=wrote["tsv"], json_file=wrote["json"],
                     vocab=wrote["vocab"], num_objects=num_objects)
    finally:
        shutil.rmtree(inputs, ignore_errors=True)
    try:
        size = du(store)
        say(f"  ingest {ing['ingest_s']:.1f} s; store {size / 2**30:.2f} GiB; opening, pipeline, worker ...")
        opened = startup("store", store)
        pipe = _child("lxmert_pipeline", store=str(store), batch=batch, batches=6 if quick else 30)
        work_ = _child("lxmert_worker", store=str(store), batch=batch)
    finally:
        if not keep:
            shutil.rmtree(store, ignore_errors=True)
    n_sent = wrote["sentences"]
    return {"kind": "lxmert", "items": images, "unit": "images", "num_objects": num_objects, "feat_dim": feat_dim,
            "sentences": n_sent, "tsv_bytes": wrote["tsv_bytes"], "json_bytes": wrote["json_bytes"],
            "sentence_part_s": wrote["sentence_part_s"], "sentence_part_cpu_s": wrote["sentence_part_cpu_s"], **ing,
            "items_per_s_per_process": images / ing["ingest_s"], "items_per_cpu_s": images / ing["ingest_cpu_s"],
            # The image part = the whole ingest less its sentence part (measured alone, same work).
            "per_image_s": max(ing["ingest_s"] - wrote["sentence_part_s"], 1e-9) / images,
            "per_image_cpu_s": max(ing["ingest_cpu_s"] - wrote["sentence_part_cpu_s"], 1e-9) / images,
            "per_sentence_s": wrote["sentence_part_s"] / n_sent,
            "per_sentence_cpu_s": max(wrote["sentence_part_cpu_s"], 1e-9) / n_sent,
            "store_bytes": size, "store_bytes_per_image": size / images, "open_s": opened["seconds"],
            "open_peak_bytes": opened["peak_bytes"], "pipeline_samples_s": pipe["samples_s"],
            "pipeline_best_samples_s": pipe["best_samples_s"], "batch": batch, **work_}


def measure_mult(work: Path, size: str, quick: bool, batch: int, steps: int, keep: bool) -> dict[str, Any]:
    splits = [40, 10, 10] if quick else list(MOSEI if size == "mosei" else MOSI)
    key = "quick" if quick else size
    pkl = work / "mosei_senti_data_noalign.pkl"
    store = work / "mult"
    say(f"mult {key}: writing a {sum(splits):,}-clip reference pickle ...")
    try:
        wrote = _child("write_mult_pickle", path=str(pkl), size=key, splits=splits)
        say(f"  pickle {wrote['pickle_bytes'] / 2**30:.2f} GiB ({wrote['write_s']:.0f} s); ingesting ...")
        ing = _child("ingest_mult_timed", out=str(store), pkl=str(pkl), dataset="mosi" if size == "small" else "mosei")
    finally:
        pkl.unlink(missing_ok=True)
    try:
        size_b = du(store)
        say(f"  ingest {ing['ingest_s']:.1f} s; store {size_b / 2**30:.2f} GiB; opening, pipeline, worker ...")
        opened = _child("open_mult", store=str(store))
        pipe = _child("mult_pipeline", store=str(store), batch=batch, batches=6 if quick else 30)
        work_ = _child("mult_worker", store=str(store), batch=batch, steps=steps)
    finally:
        if not keep:
            shutil.rmtree(store, ignore_errors=True)
    dims, lens = MULT_DIMS[key]
    return {"kind": "mult", "size": key, "items": ing["clips"], "unit": "clips", "splits": splits, "dims": dims,
            "lengths": lens, "pickle_bytes": wrote["pickle_bytes"], **ing,
            "items_per_s_per_process": ing["clips"] / ing["ingest_s"], "items_per_cpu_s": ing["clips"] / ing["ingest_cpu_s"],
            "store_bytes": size_b,
            "open_s": opened["seconds"], "open_peak_bytes": opened["peak_bytes"],
            "pipeline_samples_s": pipe["samples_s"], "pipeline_best_samples_s": pipe["best_samples_s"],
            "batch": batch, "worker_steps_cap": steps, **work_}


def extrapolate(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """The paper's corpus from the largest LXMERT row: ingest time at its per-image and per-sentence
    costs (wall, one process; and CPU, one core), bytes per image on disk, the ingest's peak RSS
    grown along its per-sentence slope between the two sizes (it keeps every sentence and token in
    memory; the features stream), and the worker's resident set (flat in the store's size)."""
    lx = sorted((r for r in rows if r["kind"] == "lxmert"), key=lambda r: r["items"])
    big = lx[-1]
    slope = 0.0
    if len(lx) >= 2 and big["sentences"] > lx[0]["sentences"]:
        slope = max(0.0, (big["ingest_peak_rss_bytes"] - lx[0]["ingest_peak_rss_bytes"])
                    / (big["sentences"] - lx[0]["sentences"]))
    out: dict[str, Any] = {"from_images": big["items"], "per_image_s": big["per_image_s"],
                           "per_sentence_s": big["per_sentence_s"], "per_image_cpu_s": big["per_image_cpu_s"],
                           "per_sentence_cpu_s": big["per_sentence_cpu_s"], "bytes_per_image": big["store_bytes_per_image"],
                           "ingest_rss_bytes_per_sentence": slope, "rows": []}

    def row(name: str, images: int, sentences: int, note: str) -> None:
        seconds = images * big["per_image_s"] + sentences * big["per_sentence_s"]
        cpu = images * big["per_image_cpu_s"] + sentences * big["per_sentence_cpu_s"]
        ram = big["ingest_peak_rss_bytes"] + slope * max(0, sentences - big["sentences"])
        out["rows"].append({"name": name, "images": images, "sentences": sentences,
                            "ingest_hours_1proc": seconds / 3600, "ingest_hours_1core_cpu": cpu / 3600,
                            "processes_for_1h": max(1, math.ceil(seconds / 3600)),
                            "store_bytes": images * big["store_bytes_per_image"], "ingest_peak_rss_bytes": ram,
                            "worker_peak_rss_bytes": big["worker_peak_rss_bytes"], "note": note})

    row("LXMERT pretraining (paper)", PAPER["images"], PAPER["sentences"], "180 K images, 9.18 M sentences")
    row("VQA v2 train questions", 0, FINETUNE_QUESTIONS["vqa"], "images already in the pretraining store")
    row("GQA balanced train questions", 0, FINETUNE_QUESTIONS["gqa"], "images already in the pretraining store")
    row("NLVR2, per 100 K of its images", 100_000, 0, "feature-only store; scale by its image count")
    mu = next((r for r in rows if r["kind"] == "mult"), None)
    if mu is not None:
        out["mult"] = {"clips": mu["items"], "ingest_hours_1proc": mu["ingest_s"] / 3600,
                       "store_bytes": mu["store_bytes"], "ingest_peak_rss_bytes": mu["ingest_peak_rss_bytes"],
                       "worker_peak_rss_bytes": mu["worker_peak_rss_bytes"]}
    return out


def _gib(b: float) -> str:
    return f"{b / 2**30:.2f}"


def markdown(res: dict[str, Any]) -> str:
    m = res["meta"]
    rows = res["rows"]
    lines = [f"Scale rehearsal, {m['date']}, {m['machine']}, git {m['git_commit']}"
             f"{', QUICK (plumbing check, not figures)' if m['quick'] else ''}", "",
             "| store | items | ingest s (1 proc) | items/s (wall) | items/CPU-s | ingest peak RSS GiB | store GiB | "
             "open s | pipeline samples/s (1 core) | worker peak RSS GiB | worker steps |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        name = (f"LXMERT {r['items']:,} images ({r['num_objects']} x {r['feat_dim']})" if r["kind"] == "lxmert"
                else f"MulT {r['size']} {r['items']:,} clips")
        lines.append(f"| {name} | {r['items']:,} | {r['ingest_s']:,.1f} | {r['items_per_s_per_process']:,.1f} | "
                     f"{r['items_per_cpu_s']:,.1f} | {_gib(r['ingest_peak_rss_bytes'])} | {_gib(r['store_bytes'])} | "
                     f"{r['open_s']:.3f} | {r['pipeline_samples_s']:,.0f} | {_gib(r['worker_peak_rss_bytes'])} | "
                     f"{r['worker_steps']:,} |")
    lines.append("")
    if res.get("growth"):
        g = res["growth"]
        lines += [f"LXMERT {g['small']:,} vs {g['large']:,} images ({g['large'] / g['small']:.0f}x the store):",
                  "", "| figure | small | large | ratio large/small |", "|---|---:|---:|---:|"]
        for k, (a, b) in g["figures"].items():
            lines.append(f"| {k} | {a:,.3f} | {b:,.3f} | {b / a:.2f}x |")
        lines.append("")
    x = res.get("extrapolation")
    if x:
        lines += [f"Extrapolated from the {x['from_images']:,}-image row: {x['per_image_s'] * 1e3:.2f} ms per image and "
                  f"{x['per_sentence_s'] * 1e6:.1f} us per sentence wall ({x['per_image_cpu_s'] * 1e3:.2f} ms and "
                  f"{x['per_sentence_cpu_s'] * 1e6:.1f} us CPU), {x['bytes_per_image'] / 2**20:.3f} MiB per image on "
                  f"disk, ingest RSS +{x['ingest_rss_bytes_per_sentence']:,.0f} bytes per sentence:", "",
                  "| corpus | images | sentences | ingest h (1 proc, wall) | ingest h (CPU) | procs for < 1 h | "
                  "store GiB | ingest RSS GiB | worker RSS GiB |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for r in x["rows"]:
            lines.append(f"| {r['name']} | {r['images']:,} | {r['sentences']:,} | {r['ingest_hours_1proc']:.2f} | "
                         f"{r['ingest_hours_1core_cpu']:.2f} | {r['processes_for_1h']} | {_gib(r['store_bytes'])} | "
                         f"{_gib(r['ingest_peak_rss_bytes'])} | {_gib(r['worker_peak_rss_bytes'])} |")
        lines.append("")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    from xmodal_bench import at_least, folder_arg, scratch, write_results

    try:
        sizes = [int(x) for x in (args.images or ("100,1000" if args.quick else "2000,20000")).split(",") if x]
    except ValueError:
        raise UserError(f"--images {args.images!r}: expected comma-separated image counts, e.g. 2000,20000") from None
    if not sizes or min(sizes) < 20:
        raise UserError(f"--images {args.images!r}: expected counts of at least 20")
    at_least(args, 1, "batch", "mult_steps")
    folder_arg("--out", args.out)  # before the run, not after it
    batch = args.batch or (32 if args.quick else 256)
    steps = args.mult_steps or (3 if args.quick else 30)
    work = scratch(args.work, "--work", "scale", keep=args.keep)
    now = dt.datetime.now(dt.timezone.utc)
    machine = f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, " \
              f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM"
    res: dict[str, Any] = {"meta": {
        "date": now.strftime("%Y-%m-%d %H:%M UTC"), "machine": machine, "python": platform.python_version(),
        "git_commit": git_commit(short=True), "quick": args.quick, "images": sizes, "mult_size": args.mult_size,
        "batch": batch, "mult_steps": steps, "command": "python jobs/benchmark.py scale " + " ".join(sys.argv[2:])}}
    say(f"benchmark scale on {machine}: LXMERT {', '.join(f'{n:,}' for n in sizes)} images; MulT "
        f"{'quick' if args.quick else args.mult_size}; work in {work}")
    t0 = time.perf_counter()
    rows = [measure_lxmert(work, n, args.quick, batch, args.keep) for n in sizes]
    if args.mult_size != "none":
        rows.append(measure_mult(work, args.mult_size, args.quick, batch if args.quick else 24, steps, args.keep))
    res["rows"] = rows
    lx = sorted((r for r in rows if r["kind"] == "lxmert"), key=lambda r: r["items"])
    if len(lx) >= 2:
        a, b = lx[0], lx[-1]
        keys = {"worker peak RSS GiB": ("worker_peak_rss_bytes", 2**30), "store GiB": ("store_bytes", 2**30),
                "ingest images/s per process": ("items_per_s_per_process", 1),
                "ingest images per CPU-s": ("items_per_cpu_s", 1),
                "ingest peak RSS GiB": ("ingest_peak_rss_bytes", 2**30), "open s": ("open_s", 1),
                "pipeline samples/s (1 core)": ("pipeline_samples_s", 1)}
        res["growth"] = {"small": a["items"], "large": b["items"],
                         "figures": {k: (a[f] / d, b[f] / d) for k, (f, d) in keys.items()},
                         "worker_rss_ratio": b["worker_peak_rss_bytes"] / a["worker_peak_rss_bytes"]}
    res["extrapolation"] = extrapolate(rows)
    res["meta"]["wall_s"] = time.perf_counter() - t0
    write_results(args.out, "scale-" + now.strftime("%Y%m%dT%H%M%SZ"), res, markdown(res))
    return 0
