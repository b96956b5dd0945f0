"""LXMERT train step: samples/s, peak memory and MFU of ours vs transformers' LxmertForPreTraining.

Both models get the same config, the same batch (`LxmertBatch.random`), the same precision and go
through the same `xmodal.core.step.train_step` (forward, all five pretraining losses, backward,
AdamW step). Ours: `PretrainingObjective` + `adamw`. transformers': `LxmertForPreTraining` with its
own losses (labels, obj_labels, matched_label, ans) + `torch.optim.AdamW`.

CUDA: the models run one after the other, so torch.cuda.max_memory_allocated is each one's own;
MFU = FLOPs counted by FlopCounterMode (forward + backward) x steps/s / --peak-tflops.
CPU: both models stay built and the timed steps alternate in rounds, so the noise of a shared
machine falls on both; memory = peak live CPU tensor bytes in one step (profiler memory timeline).
One torch thread unless --threads says otherwise: on a loaded 2-core machine two threads stalled each
other for up to seconds a step, and the ratio came out anywhere from 0.66x to 1.54x where one thread
gave 1.21x by both median and mean. Every CPU step is timed on its own, and all the step figures of
a row come from those same steps: samples/s = batch / the median step, beside the quartiles and the
mean (stalls included); the ratio is that of the samples/s shown. On CUDA steps are not synchronised
one by one: samples/s = batch / the mean step over the timed stretch. `--json FILE` keeps every figure and every step time.

Needs torch and transformers only (no Ray, MLflow or pyarrow); transformers is imported in `run()`.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from xmodal.base.console import say
from xmodal.base.outputs import Output
from xmodal.core.batches import LxmertBatch
from xmodal.core.cost import count_flops
from xmodal.core.runtime import apply_precision, compile_module, resolve_precision
from xmodal.core.step import TrainState, adamw, train_step
from xmodal.models.lxmert.model import PRESETS, LxmertConfig, LxmertForPretraining, preset
from xmodal.objectives.pretraining import PretrainingObjective, PretrainTasks
from xmodal_bench import at_least, cuda_arg
from xmodal_bench.measure import H200_BF16_DENSE_TFLOPS, cpu_peak_tensor_bytes

SEQ_LEN, NUM_OBJECTS = 20, 36  # paper: sentences of at most 20 tokens, 36 objects


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--precision", choices=("fp32", "bf16"), default="fp32",
                   help="bf16 = bf16 autocast for both models")
    p.add_argument("--compile", action="store_true", help="torch.compile both training modules")
    p.add_argument("--compile-mode", default="default",
                   choices=("default", "max-autotune-no-cudagraphs", "reduce-overhead"),
                   help="torch.compile mode (with --compile)")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if available")
    p.add_argument("--steps", type=int, default=40, help="timed steps per model")
    p.add_argument("--warmup", type=int, default=5, help="untimed steps per model first (compile happens here)")
    p.add_argument("--losses", choices=("paper", "reference"), default="paper",
                   help="our task options: 'paper' = the platform defaults (L2, labels on masked objects); "
                        "'reference' = transformers' semantics (SmoothL1, labels on all objects weighted by "
                        "confidence, x1/0.15)")
    p.add_argument("--only", choices=("both", "ours", "transformers"), default="both")
    p.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS,
                   help="accelerator peak for MFU (H200 dense bf16: 989)")
    p.add_argument("--peer-optimizer", choices=("default", "fused"), default="default",
                   help="transformers' AdamW: torch's default implementation, or fused like ours")
    p.add_argument("--rounds", type=int, default=10, help="CPU: timed steps are split into alternating rounds")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU: torch.set_num_threads (default 1: on a shared machine other processes stall "
                        "multi-threaded steps; 0 = torch's default)")
    p.add_argument("--no-flops", dest="flops", action="store_false", help="skip the FLOP count")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="FILE",
                   help="also write every figure and each timed step's time (CPU) to FILE (a new file)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing --json FILE")


@dataclass
class Contender:
    name: str
    build: Callable[[], tuple[nn.Module, torch.optim.Optimizer]]
    state: TrainState | None = None
    params: int = 0
    flops_per_step: int | None = None  # forward + backward, counted
    elapsed_s: float = 0.0
    steps: int = 0
    step_times: list[float] = field(default_factory=list)
    peak_mem_bytes: int | None = None
    final_loss: float = float("nan")

    def median_step_ms(self) -> float:
        """CPU: the median of the timed steps; CUDA: the mean over the timed stretch."""
        return 1e3 * (statistics.median(self.step_times) if self.step_times else self.elapsed_s / self.steps)

    def mean_step_ms(self) -> float:
        return 1e3 * (statistics.fmean(self.step_times) if self.step_times else self.elapsed_s / self.steps)

    def quartiles_ms(self) -> tuple[float, float]:
        """The 25th and 75th percentiles of the timed steps (CPU): how much they spread."""
        if len(self.step_times) < 2:
            return self.median_step_ms(), self.median_step_ms()
        q1, _, q3 = statistics.quantiles(self.step_times, n=4, method="inclusive")
        return 1e3 * q1, 1e3 * q3

    def samples_per_s(self, batch_size: int) -> float:
        """From the median step, the figure beside it in the table (the mean is at the mercy of stalls)."""
        return batch_size / (self.median_step_ms() / 1e3)

    def mean_samples_per_s(self, batch_size: int) -> float:
        return batch_size / (self.mean_step_ms() / 1e3)

    def figures(self, batch_size: int) -> dict:
        q1, q3 = self.quartiles_ms()
        return {"name": self.name, "params": self.params, "steps": self.steps,
                "samples_s": self.samples_per_s(batch_size), "samples_s_mean": self.mean_samples_per_s(batch_size),
                "median_ms": self.median_step_ms(), "mean_ms": self.mean_step_ms(), "p25_ms": q1, "p75_ms": q3,
                "step_ms": [1e3 * t for t in self.step_times], "peak_mem_bytes": self.peak_mem_bytes,
                "flops_per_step": self.flops_per_step, "final_loss": self.final_loss}


class HFPretraining(nn.Module):
    """transformers' LxmertForPreTraining behind the objective interface: forward(batch) -> {"loss"}.

    Its own losses: MLM CE over all positions with ignore_index; matching CE; QA CE on `ans`
    (-100 where there is no question or the pair is mismatched); obj/attr CE on all objects weighted
    by the detector confidence; SmoothL1 feature regression weighted by the mask (reference code).
    """

    def __init__(self, hf_model: nn.Module):
        super().__init__()
        self.hf = hf_model

    def forward(self, b: LxmertBatch) -> dict[str, torch.Tensor]:
        out = self.hf(
            input_ids=b.input_ids,
            visual_feats=b.visual_feats,
            visual_pos=b.boxes,
            attention_mask=b.attention_mask.long(),
            visual_attention_mask=b.visual_mask.long(),
            labels=b.mlm_labels,
            obj_labels={
                "obj": (b.obj_labels, b.obj_conf),
                "attr": (b.attr_labels, b.attr_conf),
                "feat": (b.feat_targets, b.obj_masked.to(b.feat_targets.dtype)),
            },
            matched_label=b.is_matched,
            ans=b.qa_labels,
            return_dict=True,
        )
        return {"loss": out.loss}


# ---- measuring ---------------------------------------------------------------------------------

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def setup(c: Contender, batch: LxmertBatch, args, device: torch.device) -> None:
    """Build (seeded), count parameters and FLOPs, compile as training does, run the warm-up steps."""
    dtype = resolve_precision(args.precision, device)
    torch.manual_seed(args.seed)
    module, opt = c.build()
    module = apply_precision(module, dtype)  # as training does (runtime.prepare)
    c.params = sum(p.numel() for p in module.parameters())
    if args.flops:
        c.flops_per_step = count_flops(module, batch)
    model = compile_module(module, mode=args.compile_mode) if args.compile else module
    c.state = TrainState(model=model, optimizer=opt)
    for _ in range(args.warmup):
        train_step(c.state, [batch])
    _sync(device)


def time_steps(c: Contender, batch: LxmertBatch, n: int, device: torch.device) -> None:
    start = time.perf_counter()
    for _ in range(n):
        t0 = time.perf_counter()
        out = train_step(c.state, [batch])
        if device.type == "cpu":  # per-step times on CPU only: a CUDA sync per step would drain the queue
            c.step_times.append(time.perf_counter() - t0)
    _sync(device)
    c.elapsed_s += time.perf_counter() - start
    c.steps += n
    c.final_loss = float(out["loss"])


def teardown(c: Contender, device: torch.device) -> None:
    c.state = None
    torch._dynamo.reset()  # compiled graphs hold the model's tensors; free them for the next contender
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---- the two contenders ------------------------------------------------------------------------

def build_ours(config: LxmertConfig, tasks: PretrainTasks, device: torch.device, lr: float):
    def build():
        with torch.device(device):
            objective = PretrainingObjective(LxmertForPretraining(config), tasks)
        return objective, adamw(objective, lr=lr, weight_decay=0.01)
    return build


def build_transformers(hf_config, device: torch.device, lr: float, fused_adamw: bool):
    def build():
        from transformers import LxmertForPreTraining

        with torch.device(device):
            module = HFPretraining(LxmertForPreTraining(hf_config))
        # As a transformers user would: torch.optim.AdamW with its default implementation
        # (for-each on CUDA, per-parameter loop on CPU); --peer-optimizer fused gives it ours.
        decay = [p for p in module.parameters() if p.ndim >= 2]
        no_decay = [p for p in module.parameters() if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}]
        opt = torch.optim.AdamW(groups, lr=lr, eps=1e-6, fused=True if fused_adamw else None)
        return module, opt
    return build


# ---- report --------------------------------------------------------------------------------------

def _fmt_bytes(n: int | None) -> str:
    if n is None:
        return "n/a"
    return f"{n / 2**20:,.1f} MiB" if n < 10 * 2**30 else f"{n / 2**30:,.2f} GiB"


UNSTEADY = 1.25  # mean step over median, or 75th over 25th percentile: the steps of a row vary too much


def print_table(cs: list[Contender], args, device: torch.device) -> None:
    cpu = device.type == "cpu"
    mfu_on = not cpu and args.flops
    head = f"{'model':<14}{'params':>10}{'samples/s':>12}"
    head += f"{'median ms':>11}{'p25-p75 ms':>16}{'mean ms':>10}" if cpu else f"{'mean ms':>10}"
    head += f"{'peak memory':>14}{'GFLOP/sample':>14}" + (f"{'MFU':>8}" if mfu_on else "")
    say(head)
    say("-" * len(head))
    for c in cs:
        sps = c.samples_per_s(args.batch)
        gflop = "n/a" if c.flops_per_step is None else f"{c.flops_per_step / args.batch / 1e9:,.3f}"
        line = f"{c.name:<14}{c.params / 1e6:>9.2f}M{sps:>12,.1f}"
        if cpu:
            q1, q3 = c.quartiles_ms()
            line += f"{c.median_step_ms():>11.2f}{f'{q1:.2f}-{q3:.2f}':>16}{c.mean_step_ms():>10.2f}"
        else:
            line += f"{c.mean_step_ms():>10.2f}"
        line += f"{_fmt_bytes(c.peak_mem_bytes):>14}{gflop:>14}"
        if mfu_on:
            mfu = c.flops_per_step * sps / args.batch / (args.peak_tflops * 1e12)
            line += f"{100 * mfu:>7.1f}%"
        say(line + f"   final loss {c.final_loss:.3f}")
    if cpu:
        say(f"samples/s = batch {args.batch} / median step, of {cs[0].steps} timed steps per model in alternating "
            f"rounds; mean ms over the same steps, stalls included")
    else:
        say(f"samples/s = batch {args.batch} / mean step over {cs[0].steps} timed steps per model")
    if len(cs) == 2:
        ours, theirs = cs
        b = args.batch
        line = f"ratio xmodal/transformers: {ours.samples_per_s(b) / theirs.samples_per_s(b):.2f}x samples/s"
        if cpu:
            line += f" ({ours.mean_samples_per_s(b) / theirs.mean_samples_per_s(b):.2f}x by the mean step)"
        if ours.peak_mem_bytes and theirs.peak_mem_bytes:
            line += f", {ours.peak_mem_bytes / theirs.peak_mem_bytes:.2f}x peak memory"
        say(line)
    unsteady = [c.name for c in cs if cpu and (c.mean_step_ms() > UNSTEADY * c.median_step_ms()
                                              or c.quartiles_ms()[1] > UNSTEADY * c.quartiles_ms()[0])]
    if unsteady:
        say(f"note: the steps of {' and '.join(unsteady)} vary widely (load average {os.getloadavg()[0]:.1f} on "
            f"{os.cpu_count()} cores): the figures will differ from run to run; more --steps, a quieter machine"
            f"{', or --threads 1' if torch.get_num_threads() > 1 else ''} steady them")


def run(args: argparse.Namespace) -> int:
    cuda_arg(args.device)
    at_least(args, 1, "steps", "batch", "rounds")
    at_least(args, 0, "warmup", "threads")
    at_least(args, 1e-9, "peak_tflops")
    json_out = _json_output(args)
    import transformers  # seconds to import: after the checks

    from xmodal.models.lxmert.hf import config_to_hf
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.threads and device.type == "cpu":
        torch.set_num_threads(args.threads)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 training on Hopper uses TF32; same for both
        torch.backends.cudnn.allow_tf32 = True
    lr = 1e-4

    # transformers' LXMERT always adds token-type embedding 0; ours gets it too so the configs are equal.
    config = preset(args.preset).replace(token_type_embedding=True)
    hf_config = transformers.LxmertConfig() if args.preset == "paper" else config_to_hf(config)
    tasks = PretrainTasks.reference() if args.losses == "reference" else PretrainTasks()
    batch = LxmertBatch.random(
        args.batch, vocab_size=config.vocab_size, visual_feat_dim=config.visual_feat_dim,
        num_object_labels=config.num_object_labels, num_attr_labels=config.num_attr_labels,
        num_qa_labels=config.num_qa_labels, seq_len=SEQ_LEN, num_objects=NUM_OBJECTS,
        generator=torch.Generator().manual_seed(args.seed),
    ).to(device, float_dtype=torch.float32)  # features travel as fp16; both models take fp32 (autocast casts)

    threads = torch.get_num_threads()
    where = (f"{threads} thread{'s' if threads > 1 else ''}, load average {os.getloadavg()[0]:.1f} on "
             f"{os.cpu_count()} cores"
             if device.type == "cpu" else torch.cuda.get_device_name(device))
    compiled = f"on ({args.compile_mode})" if args.compile else "off"
    say(f"LXMERT train step: preset={args.preset} batch={args.batch} T={SEQ_LEN} N={NUM_OBJECTS} "
        f"precision={args.precision} device={device.type} ({where}) compile={compiled} "
        f"steps={args.steps} warmup={args.warmup}")
    memory = ("torch.cuda.max_memory_allocated, models run one after the other" if device.type == "cuda" else
              "peak live CPU tensor bytes in one step (torch.profiler memory timeline); "
              "timing interleaved in rounds")
    say(f"torch {torch.__version__}, transformers {transformers.__version__}; our losses: {args.losses}; "
        f"peer optimizer: {args.peer_optimizer} AdamW; memory: {memory}")

    cs = []
    if args.only in ("both", "ours"):
        cs.append(Contender("xmodal", build_ours(config, tasks, device, lr)))
    if args.only in ("both", "transformers"):
        cs.append(Contender("transformers", build_transformers(hf_config, device, lr, args.peer_optimizer == "fused")))

    if device.type == "cuda":
        # One model at a time, so that max_memory_allocated is that model's alone.
        for c in cs:
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            setup(c, batch, args, device)
            time_steps(c, batch, args.steps, device)
            c.peak_mem_bytes = torch.cuda.max_memory_allocated(device)
            teardown(c, device)
    else:
        # Both models live; alternating rounds spread the noise of a shared CPU over both.
        for c in cs:
            setup(c, batch, args, device)
            c.peak_mem_bytes = cpu_peak_tensor_bytes(c.state, batch)
        rounds = max(1, min(args.rounds, args.steps))
        for r in range(rounds):
            n = args.steps // rounds + (1 if r < args.steps % rounds else 0)
            for c in (cs if r % 2 == 0 else cs[::-1]):
                time_steps(c, batch, n, device)
        for c in cs:
            teardown(c, device)

    say("")
    print_table(cs, args, device)
    if device.type == "cuda" and args.flops:
        say(f"MFU = counted FLOPs (forward + backward, FlopCounterMode) x steps/s / {args.peak_tflops:g} TFLOP/s")
    if json_out is not None:
        _write_json(json_out, {"settings": vars(args), "device": device.type, "batch": args.batch,
                               "models": [c.figures(args.batch) for c in cs]})
    return 0


def _json_output(args: argparse.Namespace) -> Output | None:
    """--json FILE under the output policy (a new file, unless --overwrite), checked before anything runs."""
    return None if args.json is None else Output(args.json, "--json", "benchmark lxmert", file=True,
                                                 overwrite=args.overwrite)


def _write_json(out: Output, figures: dict) -> None:
    with out.stage() as stage:  # the file whole or not at all
        stage.tmp.write_text(json.dumps(figures, indent=1, default=str))
        say(f"wrote {stage.publish()}")
