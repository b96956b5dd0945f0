"""Everything a device run must show, measured in one process and one run:

    python jobs/benchmark.py suite [--device cuda|cpu] [--quick] [--out bench-results]

1. LXMERT pretraining step (forward, all five losses, backward, AdamW): ours and transformers'
   LxmertForPreTraining, each eager and compiled: samples/s, ms/step, peak memory, GFLOP per
   sample (counted by FlopCounterMode), MFU (CUDA), compile time, graph breaks.
2. MulT step (L1 loss, clip 0.8, Adam) at unaligned MOSEI shapes: ours and the plain per-direction
   re-implementation of the reference (`xmodal_bench.mult.PlainMult`), eager and compiled, per batch size.
3. DDP overhead: our LXMERT step wrapped in one-worker DistributedDataParallel against the bare step.
4. The data pipeline at paper dims (36 x 2048 fp16) on one core, at 5 and 50 sentences per image.
5. Region-feature extraction (`xmodal_bench.extract`, random weights): images/s of one detector worker,
   regions batched vs one image at a time, fp32 vs bf16 (reference ResNet-101 on CUDA, 64 images of
   480 x 640 in batches of 8; the tiny detector on 2 images on a CPU or with --quick).

Both contenders of a row go through the same `train_step`, precision (`runtime.apply_precision`)
and compile path (`runtime.compile_module`) as training. CUDA: one contender at a time, so that
`max_memory_allocated` is its own. CPU: the contenders of a section stay built and their timed steps
alternate in rounds, so the noise of a shared machine falls on all; memory = peak live CPU tensor
bytes of one step (torch.profiler), and samples/s comes from the median step time (the mean over all
steps, stalls included, is kept as `samples_s_mean`).

Writes `<out>/<UTC timestamp>.json` (every figure, the device, versions and settings) and a
Markdown table beside it, and prints the table. Defaults per device: CUDA = the paper presets at
the targets' shapes (LXMERT batch 256 bf16; MulT reference at batch 24 and 256, bf16); CPU = the
`small` LXMERT at batch 32 and the reference MulT at batch 24, fp32. `--quick` (CI) = tiny presets,
a few steps, compiled rows through dynamo's `eager` backend (the same graph capture, no AOT autograd
and no code generation), the tiny detector at a 96:160 input, and the CPU memory figure of each
section's first row only (its figures check the plumbing; they are not speed figures).
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import math
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from xmodal.base.console import say
from xmodal.base.errors import UserError
from xmodal.core.batches import LxmertBatch, MultBatch
from xmodal.core.cost import count_flops
from xmodal.core.runtime import apply_precision, compile_module, resolve_precision
from xmodal.core.step import TrainState, train_step
from xmodal.tracking import git_commit
from xmodal_bench.measure import H200_BF16_DENSE_TFLOPS, cpu_peak_tensor_bytes

SECTIONS = ("lxmert", "mult", "ddp", "data", "extract")
TARGETS = {  # samples/s on one H200 (docs/performance.md); the data target is per CPU core
    "lxmert_paper_b256_bf16": 8000.0,
    "mult_reference_b24": 1500.0,
    "mult_reference_b256": 7000.0,
    "data_per_core": 5000.0,
    "extract_images_s": 100.0,
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if available")
    p.add_argument("--quick", action="store_true",
                   help="tiny presets, few steps, compiled rows via dynamo's eager backend (CI: checks every field, not speed)")
    p.add_argument("--out", default="bench-results", help="folder for <timestamp>.json and .md")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {','.join(SECTIONS)}")
    p.add_argument("--steps", type=int, default=None, help="timed steps per contender (default: 20 cuda, 6 cpu, 3 quick)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps after the first (default: 3, 1 quick)")
    p.add_argument("--threads", type=int, default=0, help="CPU: torch.set_num_threads (0 = torch's default)")
    p.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS, help="accelerator peak for MFU")
    p.add_argument("--lxmert-preset", default=None, help="default: paper (cuda), small (cpu), tiny (quick)")
    p.add_argument("--lxmert-batch", type=int, default=None, help="default: 256 (cuda), 32 (cpu and quick)")
    p.add_argument("--mult-preset", default=None, help="default: reference; tiny with --quick")
    p.add_argument("--mult-batch", type=int, nargs="+", default=None, help="default: 24 256 (cuda), 24 (cpu), 4 (quick)")
    p.add_argument("--precision", choices=("fp32", "bf16"), default=None, help="default: bf16 on cuda, fp32 on cpu")
    p.add_argument("--warm-cache", action="store_true",
                   help="use inductor's usual cache folder (default: a fresh one, so compile times are cold)")


# ---- settings ------------------------------------------------------------------------------------

@dataclass
class Settings:
    device: torch.device
    quick: bool
    steps: int
    warmup: int
    precision: str
    backend: str
    lxmert_preset: str
    lxmert_batch: int
    mult_preset: str
    mult_batch: list[int]
    mult_seq_lens: tuple[int, int, int]
    data_images: int
    data_batches: int
    peak_tflops: float

    @classmethod
    def from_args(cls, a: argparse.Namespace) -> Settings:
        device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        cuda, q = device.type == "cuda", a.quick

        def pick(value, quick, on_cuda, on_cpu):
            return value if value is not None else quick if q else on_cuda if cuda else on_cpu

        return cls(
            device=device, quick=q, steps=pick(a.steps, 3, 20, 6), warmup=pick(a.warmup, 1, 3, 3),
            precision=a.precision or ("bf16" if cuda else "fp32"), backend="eager" if q else "inductor",
            lxmert_preset=pick(a.lxmert_preset, "tiny", "paper", "small"),
            lxmert_batch=pick(a.lxmert_batch, 32, 256, 32),
            mult_preset=pick(a.mult_preset, "tiny", "reference", "reference"),
            mult_batch=pick(a.mult_batch, [4], [24, 256], [24]),
            mult_seq_lens=(10, 50, 50) if q else (50, 500, 500),
            data_images=64 if q else 512, data_batches=4 if q else 30, peak_tflops=a.peak_tflops)


# ---- one contender: build, count, compile, time --------------------------------------------------

@dataclass
class Result:
    """One measured row. Figures a device cannot give are None (MFU on CPU)."""

    section: str
    impl: str
    mode: str  # "eager" | "compiled"
    preset: str
    batch: int
    precision: str
    params: int = 0
    samples_s: float = float("nan")  # CUDA: over all timed steps; CPU: from the median step (robust to stalls)
    samples_s_mean: float = float("nan")  # over all timed steps, stalls included
    ms_step: float = float("nan")  # CPU: the median step; CUDA: the mean
    peak_gib: float | None = None
    gflop_per_sample: float | None = None
    mfu: float | None = None
    compile_s: float | None = None
    graph_breaks: int | None = None
    final_loss: float = float("nan")
    step_ms: list[float] = field(default_factory=list)  # CPU: each timed step, whence ms_step and both samples/s


@dataclass
class Contender:
    result: Result
    build: Callable[[], tuple[nn.Module, torch.optim.Optimizer]]
    batch: Any
    wrap: Callable[[nn.Module], nn.Module] | None = None  # e.g. DDP, outside compile
    state: TrainState | None = None
    elapsed: float = 0.0
    steps: int = 0
    step_times: list[float] = field(default_factory=list)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def graph_breaks(module: nn.Module, batch) -> int:
    """Graph breaks of the training forward (torch._dynamo.explain: traced, no code generated)."""
    torch._dynamo.reset()
    breaks = torch._dynamo.explain(module)(batch).graph_break_count
    torch._dynamo.reset()
    return breaks




def setup(c: Contender, s: Settings, count: bool) -> None:
    """Build (seeded), apply precision, count FLOPs and graph breaks (eager rows), compile, and run
    the first step (timed: its excess over a steady step is the compile time) and the warm-up."""
    r = c.result
    torch.manual_seed(0)
    module, opt = c.build()
    module = apply_precision(module, resolve_precision(r.precision, s.device))
    r.params = sum(p.numel() for p in module.parameters())
    if count:
        r.gflop_per_sample = count_flops(module, c.batch) / r.batch / 1e9
        r.graph_breaks = graph_breaks(module, c.batch)
    model = compile_module(module, backend=s.backend) if r.mode == "compiled" else module
    if c.wrap is not None:
        model = c.wrap(model)
    c.state = TrainState(model=model, optimizer=opt, grad_clip=0.8 if r.section == "mult" else 0.0)
    t0 = time.perf_counter()
    train_step(c.state, [c.batch])
    _sync(s.device)
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    for _ in range(s.warmup):
        train_step(c.state, [c.batch])
    _sync(s.device)
    steady = (time.perf_counter() - t0) / max(s.warmup, 1)
    if r.mode == "compiled":
        r.compile_s = max(0.0, first - steady)


def time_steps(c: Contender, n: int, device: torch.device) -> None:
    start = time.perf_counter()
    for _ in range(n):
        t0 = time.perf_counter()
        out = train_step(c.state, [c.batch])
        if device.type == "cpu":  # per-step times on CPU only: a CUDA sync per step would drain the queue
            c.step_times.append(time.perf_counter() - t0)
    _sync(device)
    c.elapsed += time.perf_counter() - start
    c.steps += n
    c.result.final_loss = float(out["loss"])


def finish(c: Contender, s: Settings) -> None:
    r = c.result
    # CPU: both figures from the same recorded steps (`step_ms`); CUDA: over the whole timed stretch.
    r.samples_s_mean = r.batch / statistics.fmean(c.step_times) if c.step_times else c.steps * r.batch / c.elapsed
    r.ms_step = 1e3 * (statistics.median(c.step_times) if c.step_times else c.elapsed / c.steps)
    # On a shared CPU a few steps stall on other processes; the median step is the figure that
    # repeats. On CUDA steps are not synchronised one by one, so the mean over all is the figure.
    r.samples_s = r.batch / (r.ms_step / 1e3) if c.step_times else r.samples_s_mean
    r.step_ms = [1e3 * t for t in c.step_times]
    if r.gflop_per_sample is not None and s.device.type == "cuda":
        r.mfu = r.gflop_per_sample * 1e9 * r.samples_s / (s.peak_tflops * 1e12)
    if not math.isfinite(r.final_loss):
        raise RuntimeError(f"{r.section} {r.impl} {r.mode}: non-finite loss {r.final_loss}")
    c.state = None
    torch._dynamo.reset()  # compiled graphs hold the model's tensors
    gc.collect()
    if s.device.type == "cuda":
        torch.cuda.empty_cache()


def measure(contenders: list[Contender], s: Settings, count: bool = True) -> list[Result]:
    """CUDA: one at a time (peak memory its own). CPU: all built, timed steps alternating in rounds.
    `count`: FLOPs and graph breaks, once per implementation and batch (the eager model's)."""
    counted: set[str] = set()

    def first_of_impl(c: Contender) -> bool:
        key = f"{c.result.impl}/{c.result.batch}"
        fresh = count and key not in counted and c.wrap is None
        counted.add(key)
        return fresh

    if s.device.type == "cuda":
        for c in contenders:
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(s.device)
            setup(c, s, first_of_impl(c))
            time_steps(c, s.steps, s.device)
            c.result.peak_gib = torch.cuda.max_memory_allocated(s.device) / 2**30
            finish(c, s)
    else:
        # Eager ones first: counting graph breaks resets dynamo, which would drop compiled code.
        for i, c in enumerate(sorted(contenders, key=lambda c: c.result.mode == "compiled")):
            setup(c, s, first_of_impl(c))
            # The memory timeline (a profile with stacks) took a third of a quick run: --quick checks
            # the path on the section's first row only.
            if i == 0 or not s.quick:
                peak = cpu_peak_tensor_bytes(c.state, c.batch)
                c.result.peak_gib = None if peak is None else peak / 2**30
        rounds = max(1, min(3, s.steps))
        for i in range(rounds):
            n = s.steps // rounds + (1 if i < s.steps % rounds else 0)
            for c in (contenders if i % 2 == 0 else contenders[::-1]):
                time_steps(c, n, s.device)
        for c in contenders:
            finish(c, s)
    for c in contenders:  # FLOPs and breaks are the eager model's; share them with its compiled twin
        twin = next((o.result for o in contenders if o.result.impl == c.result.impl
                     and o.result.batch == c.result.batch and o.result.gflop_per_sample is not None), None)
        if twin is not None and c.result.gflop_per_sample is None and c.wrap is None:
            c.result.gflop_per_sample, c.result.graph_breaks = twin.gflop_per_sample, twin.graph_breaks
            if c.result.mfu is None and s.device.type == "cuda":
                c.result.mfu = twin.gflop_per_sample * 1e9 * c.result.samples_s / (s.peak_tflops * 1e12)
    return [c.result for c in contenders]


# ---- the sections --------------------------------------------------------------------------------

def lxmert_contenders(s: Settings, ddp: bool = False) -> list[Contender]:
    import transformers

    from xmodal.models.lxmert.hf import config_to_hf
    from xmodal.models.lxmert.model import preset
    from xmodal.objectives.pretraining import PretrainTasks
    from xmodal_bench.lxmert import NUM_OBJECTS, SEQ_LEN, build_ours, build_transformers

    # transformers' LXMERT always adds token-type embedding 0; ours gets it too so the configs are equal.
    config = preset(s.lxmert_preset).replace(token_type_embedding=True)
    batch = LxmertBatch.random(
        s.lxmert_batch, vocab_size=config.vocab_size, visual_feat_dim=config.visual_feat_dim,
        num_object_labels=config.num_object_labels, num_attr_labels=config.num_attr_labels,
        num_qa_labels=config.num_qa_labels, seq_len=SEQ_LEN, num_objects=NUM_OBJECTS,
        generator=torch.Generator().manual_seed(0)).to(s.device, float_dtype=torch.float32)

    ours = build_ours(config, PretrainTasks(), s.device, lr=1e-4)

    def row(impl: str, mode: str) -> Result:
        return Result("lxmert" if not ddp else "ddp", impl, mode, s.lxmert_preset, s.lxmert_batch, s.precision)

    if ddp:
        return [Contender(row("xmodal", "eager"), ours, batch),
                Contender(row("xmodal+ddp", "eager"), ours, batch, wrap=_ddp(s.device))]

    # As a transformers user would train it: torch.optim.AdamW with its default implementation.
    hf_config = transformers.LxmertConfig() if s.lxmert_preset == "paper" else config_to_hf(config)
    theirs = build_transformers(hf_config, s.device, lr=1e-4, fused_adamw=False)

    return [Contender(row(impl, mode), build, batch)
            for impl, build in (("xmodal", ours), ("transformers", theirs)) for mode in ("eager", "compiled")]


def _ddp(device: torch.device) -> Callable[[nn.Module], nn.Module]:
    def wrap(model: nn.Module) -> nn.Module:
        return nn.parallel.DistributedDataParallel(model, device_ids=[device.index or 0] if device.type == "cuda" else None)
    return wrap


def mult_contenders(s: Settings) -> list[Contender]:
    from xmodal.models.mult.config import preset
    from xmodal.models.mult.model import Mult
    from xmodal.objectives.sentiment import MultObjective
    from xmodal_bench.mult import PlainMult, _PlainObjective

    config = preset(s.mult_preset)
    out = []
    for bs in s.mult_batch:
        batch = MultBatch.random(bs, generator=torch.Generator().manual_seed(0),
                                 dims=(config.l_dim, config.a_dim, config.v_dim),
                                 seq_lens=s.mult_seq_lens).to(s.device, float_dtype=torch.float32)

        def ours():
            objective = MultObjective(Mult(config), use_lengths=False).to(s.device)
            return objective, torch.optim.Adam(objective.parameters(), lr=1e-3, fused=True)

        def plain():
            objective = _PlainObjective(PlainMult(config)).to(s.device)
            return objective, torch.optim.Adam(objective.parameters(), lr=1e-3)  # the reference's Adam

        for impl, build in (("xmodal", ours), ("plain", plain)):
            for mode in ("eager", "compiled"):
                out.append(Contender(Result("mult", impl, mode, s.mult_preset, bs, s.precision), build, batch))
    return out


def ddp_results(s: Settings) -> list[Result]:
    """One-worker DDP (gloo on CPU, nccl on CUDA; a file store, no port) around our eager step."""
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("nccl" if s.device.type == "cuda" else "gloo",
                                store=dist.FileStore(os.path.join(tmp, "store"), 1), rank=0, world_size=1)
        try:
            return measure(lxmert_contenders(s, ddp=True), s, count=False)
        finally:
            dist.destroy_process_group()


def data_results(s: Settings) -> list[dict]:
    """Our input pipeline at paper dims, one worker pinned to one core (in a child process, so the
    pinning does not reach the other sections), at 5 and 50 sentences per image."""
    rows = []
    for spi in (5, 50):
        code = (
            "import json, sys, tempfile, time\n"
            "from pathlib import Path\n"
            "from xmodal_bench.data import _one_core, our_batches, timed\n"
            "from xmodal.data.lxmert.synthetic import build_synthetic_store\n"
            "from xmodal.data.options import SyntheticLxmertOptions\n"
            "n, spi, batches = map(int, sys.argv[1:4])\n"
            "with tempfile.TemporaryDirectory() as tmp:\n"
            "    opts = SyntheticLxmertOptions(num_images=n, num_objects=36, feat_dim=2048, sentences_per_image=spi,\n"
            "                                  minival_fraction=0.0, images_per_shard=256)\n"
            "    store = build_synthetic_store(Path(tmp) / 's', opts, overwrite=True)\n"
            "    _one_core()\n"
            "    it = our_batches(store, 256)\n"
            "    next(it)\n"
            "    rates = [timed(it, max(1, batches // 3), 256) for _ in range(3)]\n"
            "print(json.dumps({'samples_s': max(rates), 'median_samples_s': sorted(rates)[1]}))\n")
        out = subprocess.run([sys.executable, "-c", code, str(s.data_images), str(spi), str(s.data_batches)],
                             capture_output=True, text=True, check=False)
        if out.returncode != 0:
            raise RuntimeError(f"data section ({spi} sentences/image) failed:\n{out.stderr[-2000:]}")
        fig = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append({"sentences_per_image": spi, "images": s.data_images, "batch": 256, "feat_dim": 2048,
                     "num_objects": 36, **fig, "target": TARGETS["data_per_core"]})
    return rows


def extract_results(s: Settings) -> list[dict]:
    """The extraction benchmark's detector rows (`xmodal_bench.extract.detector_rows`)."""
    from xmodal.models.butd.detector import DetectorConfig, random_detector
    from xmodal_bench.extract import detector_rows, matmul_tflops, synthetic_images

    full = s.device.type == "cuda" and not s.quick
    # The tiny net at the reference's 600:1000 input still spends seconds an image on a CPU (its proposal
    # NMS and RoI head scale with the input's area); its rows check the path, so a small input does.
    cfg = DetectorConfig() if full else DetectorConfig.tiny().replace_in("input", scale=96, max_size=160)
    images = synthetic_images(64 if full else 2, (480, 640) if full else (48, 64))
    peaks = {"fp32": matmul_tflops(s.device, torch.float32), "bf16": matmul_tflops(s.device, torch.bfloat16)}
    rows = detector_rows(random_detector(cfg, seed=0).to(s.device), images, 32 if full else 2, s.device, peaks)
    return [{"config": "reference" if full else "tiny", "target": TARGETS["extract_images_s"], **r} for r in rows]


# ---- ratios, the report --------------------------------------------------------------------------

def _find(rows: list[Result], **kw) -> Result:
    return next(r for r in rows if all(getattr(r, k) == v for k, v in kw.items()))


def ratios(res: dict[str, Any]) -> dict[str, float]:
    """ours / peer samples/s per mode and batch, and DDP's step time over the bare step."""
    out: dict[str, float] = {}
    lx = [Result(**r) for r in res.get("lxmert", [])]
    for mode in ("eager", "compiled"):
        if lx:
            out[f"lxmert_{mode}_vs_transformers_{mode}"] = (
                _find(lx, impl="xmodal", mode=mode).samples_s / _find(lx, impl="transformers", mode=mode).samples_s)
    if lx:
        out["lxmert_compiled_vs_transformers_best"] = (
            _find(lx, impl="xmodal", mode="compiled").samples_s
            / max(r.samples_s for r in lx if r.impl == "transformers"))
    mu = [Result(**r) for r in res.get("mult", [])]
    for bs in sorted({r.batch for r in mu}):
        for mode in ("eager", "compiled"):
            out[f"mult_b{bs}_{mode}_vs_plain_{mode}"] = (
                _find(mu, impl="xmodal", mode=mode, batch=bs).samples_s
                / _find(mu, impl="plain", mode=mode, batch=bs).samples_s)
    dd = [Result(**r) for r in res.get("ddp", [])]
    if dd:
        out["ddp_step_time_over_bare"] = _find(dd, impl="xmodal+ddp").ms_step / _find(dd, impl="xmodal").ms_step
    return out


def _f(x: float | None, spec: str) -> str:
    return "n/a" if x is None else format(x, spec)


def markdown(res: dict[str, Any]) -> str:
    m = res["meta"]
    lines = [f"Benchmark suite, {m['date']}, {m['device_name']} ({m['device']}), torch {m['torch']}, "
             f"transformers {m['transformers']}, compile backend {m['compile_backend']}"
             f"{', QUICK (plumbing check, not speed figures)' if m['quick'] else ''}", ""]
    rows = res.get("lxmert", []) + res.get("mult", []) + res.get("ddp", [])
    if rows:
        lines += ["| section | impl | mode | preset | batch | precision | samples/s | ms/step | peak GiB | "
                  "GFLOP/sample | MFU | compile s | graph breaks |",
                  "|---|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in rows:
            lines.append(
                f"| {r['section']} | {r['impl']} | {r['mode']} | {r['preset']} | {r['batch']} | {r['precision']} | "
                f"{r['samples_s']:,.1f} | {r['ms_step']:.2f} | {_f(r['peak_gib'], '.3f')} | "
                f"{_f(r['gflop_per_sample'], '.3f')} | {_f(None if r['mfu'] is None else 100 * r['mfu'], '.1f')}"
                f"{'%' if r['mfu'] is not None else ''} | {_f(r['compile_s'], '.1f')} | {_f(r['graph_breaks'], 'd')} |")
        lines += ["", "samples/s = batch / ms/step: " + (
            "the mean step over the timed stretch (steps are not synchronised one by one)" if m["device"] == "cuda"
            else "the median of the row's timed steps (each in the JSON, `step_ms`; `samples_s_mean` from their "
                 "mean, stalls included)"), ""]
    if res.get("data"):
        lines += ["| data pipeline (1 core) | sentences/image | samples/s (best) | median | target |",
                  "|---|---:|---:|---:|---:|"]
        for d in res["data"]:
            lines.append(f"| ours, 36 x 2048 fp16, batch {d['batch']} | {d['sentences_per_image']} | "
                         f"{d['samples_s']:,.0f} | {d['median_samples_s']:,.0f} | {d['target']:,.0f} |")
        lines.append("")
    if res.get("extract"):
        lines += ["| extraction (random weights) | config | images | precision | images/s | ms/image | host ms/image "
                  "| peak GiB | of matmul rate | target |", "|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
        for e in res["extract"]:
            lines.append(f"| detector worker | {e['config']} | {e['regions']} (x{e['batch']}) | {e['precision']} | "
                         f"{e['images_s']:,.2f} | {1000 * e['s_per_image']:,.0f} | {e['host_ms_per_image']:,.1f} | "
                         f"{e['peak_gib']:.2f} | "
                         f"{100 * e['of_matmul']:.0f} % | {e['target']:,.0f} |")
        lines.append("")
    if res["ratios"]:
        lines += ["| ratio | value |", "|---|---:|"]
        lines += [f"| {k} | {v:.2f}x |" for k, v in res["ratios"].items()]
        lines.append("")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    import transformers

    from xmodal.models.lxmert.model import PRESETS as LXMERT_PRESETS
    from xmodal.models.mult.config import PRESETS as MULT_PRESETS
    from xmodal_bench import at_least, cuda_arg, folder_arg, preset_arg, write_results

    cuda_arg(args.device)
    at_least(args, 1, "steps", "lxmert_batch", "mult_batch")
    at_least(args, 0, "warmup", "threads")
    at_least(args, 1e-9, "peak_tflops")
    preset_arg("--lxmert-preset", args.lxmert_preset, LXMERT_PRESETS)
    preset_arg("--mult-preset", args.mult_preset, MULT_PRESETS)
    folder_arg("--out", args.out)  # before the run, not after it
    sections = [x.strip() for x in args.sections.split(",") if x.strip()]
    bad = [x for x in sections if x not in SECTIONS]
    if bad or not sections:
        raise UserError(f"--sections {args.sections!r}: unknown {bad or 'none given'}; expected a comma-separated "
                        f"subset of {', '.join(SECTIONS)}")
    s = Settings.from_args(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    cache = None
    if not args.warm_cache:
        # Inductor reuses compiled kernels across processes: a second run would report compile
        # times of a few seconds. A fresh cache folder makes them the cold figures a first run pays.
        cache = tempfile.TemporaryDirectory(prefix="xmodal-suite-inductor-")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache.name
    if s.device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 on Hopper uses TF32, for every contender alike
        torch.backends.cudnn.allow_tf32 = True
    now = dt.datetime.now(dt.timezone.utc)
    name = (torch.cuda.get_device_name(s.device) if s.device.type == "cuda"
            else f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, {torch.get_num_threads()} threads")
    res: dict[str, Any] = {"meta": {
        "date": now.strftime("%Y-%m-%d %H:%M UTC"), "device": s.device.type, "device_name": name,
        "torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
        "git_commit": git_commit(short=True), "quick": s.quick, "compile_backend": s.backend,
        "inductor_cache": "warm" if args.warm_cache else "cold",
        "settings": {k: (str(v) if isinstance(v, torch.device) else v) for k, v in asdict(s).items()},
        "targets": TARGETS, "sections": sections}}
    say(f"benchmark suite on {name} ({s.device.type}); sections {', '.join(sections)}; "
        f"{'quick, ' if s.quick else ''}compile backend {s.backend}")
    t0 = time.perf_counter()
    timings = {}
    for sec in sections:
        ts = time.perf_counter()
        if sec == "lxmert":
            res["lxmert"] = [asdict(r) for r in measure(lxmert_contenders(s), s)]
        elif sec == "mult":
            res["mult"] = [asdict(r) for r in measure(mult_contenders(s), s)]
        elif sec == "ddp":
            res["ddp"] = [asdict(r) for r in ddp_results(s)]
        elif sec == "data":
            res["data"] = data_results(s)
        else:
            res["extract"] = extract_results(s)
        timings[sec] = time.perf_counter() - ts
        say(f"  {sec}: done in {timings[sec]:.0f} s")
    res["ratios"] = ratios(res)
    res["meta"]["section_seconds"] = timings
    res["meta"]["wall_s"] = time.perf_counter() - t0
    res["meta"]["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    write_results(args.out, now.strftime("%Y%m%dT%H%M%SZ"), res, markdown(res))
    return 0
