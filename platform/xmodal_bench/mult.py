"""MulT train-step throughput and peak memory at unaligned MOSEI shapes (text 50x300, audio 500x74, vision 500x35).

    python jobs/benchmark.py mult [--batch 24 256] [--precision fp32 bf16] [--device cpu|cuda]
                                  [--steps N] [--compile] [--plain] [--lengths full|variable]

One step = `xmodal.core.step.train_step` (forward, L1 loss, backward, grad-norm clip 0.8,
Adam), the `reference` preset unless --preset says otherwise. --plain also times
`PlainMult`, a straightforward per-direction re-implementation of the reference
architecture (nn.MultiheadAttention, a float -inf causal mask, one module per
transformer), and prints the ratio. Peak memory: CUDA's max allocated; on CPU the
process's peak resident set (monotone across rows, so an upper bound).

GPU targets: >= 1,500 samples/s at batch 24 and >= 7,000 at batch 256 with <= 6 GiB peak
(peer: the reference code 147 / 713 samples/s, 56 GiB at batch 256; docs/papers.md#mult-peer).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import math
import time

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from xmodal.base.console import say
from xmodal.base.errors import UserError
from xmodal.core.batches import MultBatch
from xmodal.core.cost import peak_memory_gib
from xmodal.core.runtime import apply_precision, compile_module
from xmodal.core.step import TrainState, train_step
from xmodal.models.mult.config import PRESETS, MultConfig, preset
from xmodal.models.mult.model import DIRECTIONS, MODALITIES, TARGET_SOURCES, Mult, sinusoidal_positions
from xmodal.objectives.sentiment import MultObjective
from xmodal_bench import at_least, cuda_arg, preset_arg

MOSEI_SHAPES = {"dims": (300, 74, 35), "seq_lens": (50, 500, 500)}


# -- the plain re-implementation ---------------------------------------------------------------


def reference_future_mask(t: int, s: int, device=None) -> Tensor:
    """The reference's float mask: -inf above the diagonal offset by 1 + |S - T|."""
    return torch.triu(torch.full((t, s), float("-inf"), device=device), 1 + abs(s - t))


class PlainLayer(nn.Module):
    def __init__(self, dim: int, heads: int, attn_dropout: float, relu_dropout: float, res_dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, dropout=attn_dropout, batch_first=True)
        self.ln2 = nn.LayerNorm(dim)
        self.fc1 = nn.Linear(dim, 4 * dim)
        self.fc2 = nn.Linear(4 * dim, dim)
        self.relu_dropout, self.res_dropout = relu_dropout, res_dropout

    def forward(self, x: Tensor, kv: Tensor | None, mask: Tensor | None) -> Tensor:
        h = self.ln1(x)
        src = h if kv is None else self.ln1(kv)  # one LayerNorm for queries and keys (reference)
        a, _ = self.attn(h, src, src, attn_mask=mask, need_weights=False)
        x = x + F.dropout(a, self.res_dropout, self.training)
        h = F.dropout(F.relu(self.fc1(self.ln2(x))), self.relu_dropout, self.training)
        return x + F.dropout(self.fc2(h), self.res_dropout, self.training)


class PlainEncoder(nn.Module):
    """One transformer: embed (scale, positions, dropout) its inputs, layers, final LayerNorm."""

    def __init__(self, dim: int, heads: int, layers: int, attn_dropout: float, c: MultConfig):
        super().__init__()
        self.layers = nn.ModuleList(PlainLayer(dim, heads, attn_dropout, c.relu_dropout, c.res_dropout)
                                    for _ in range(layers))
        self.ln = nn.LayerNorm(dim)
        self.c = c

    def embed(self, x: Tensor) -> Tensor:
        t, d = x.shape[1], x.shape[2]
        x = (math.sqrt(d) if self.c.embed_scale else 1.0) * x + sinusoidal_positions(t, d, x.device)
        return F.dropout(x, self.c.embed_dropout, self.training)

    def forward(self, x: Tensor, kv: Tensor | None = None) -> Tensor:
        s = x.shape[1] if kv is None else kv.shape[1]
        mask = reference_future_mask(x.shape[1], s, x.device) if self.c.causal else None
        x = self.embed(x)
        kv = None if kv is None else self.embed(kv)
        for layer in self.layers:
            x = layer(x, kv, mask)
        return self.ln(x)


class PlainMult(nn.Module):
    """The full MulT, one module per transformer, every step real (no lengths), as the reference runs."""

    def __init__(self, c: MultConfig):
        super().__init__()
        self.c = c
        dims = {"l": c.l_dim, "a": c.a_dim, "v": c.v_dim}
        kernels = {"l": c.l_kernel, "a": c.a_kernel, "v": c.v_kernel}
        self.proj = nn.ModuleDict({m: nn.Conv1d(dims[m], c.dim, kernels[m], padding=kernels[m] // 2, bias=False)
                                   for m in MODALITIES})
        p = {"l": c.attn_dropout, "a": c.attn_dropout_a, "v": c.attn_dropout_v}
        self.cross = nn.ModuleDict({f"{s}{t}": PlainEncoder(c.dim, c.num_heads, c.layers, p[s], c)
                                    for s, t in DIRECTIONS})
        self.mem = nn.ModuleDict({t: PlainEncoder(2 * c.dim, c.num_heads, c.self_depth, c.attn_dropout, c)
                                  for t in MODALITIES})
        n = 6 * c.dim
        self.proj1, self.proj2, self.out_layer = nn.Linear(n, n), nn.Linear(n, n), nn.Linear(n, c.output_dim)

    def forward(self, text: Tensor, audio: Tensor, vision: Tensor) -> Tensor:
        raw = {"l": F.dropout(text, self.c.text_dropout, self.training), "a": audio, "v": vision}
        x = {m: self.proj[m](raw[m].transpose(1, 2)).transpose(1, 2) for m in MODALITIES}  # (B, T, D)
        last = []
        for t in MODALITIES:
            h = torch.cat([self.cross[f"{s}{t}"](x[t], x[s]) for s in TARGET_SOURCES[t]], dim=-1)
            last.append(self.mem[t](h)[:, -1])
        hs = torch.cat(last, dim=-1)
        return self.out_layer(self.proj2(F.dropout(F.relu(self.proj1(hs)), self.c.out_dropout, self.training)) + hs)

    @torch.no_grad()
    def load_from(self, model: Mult) -> PlainMult:
        """Copy the weights of a full `Mult` (for equivalence tests)."""
        if model.config.variant != "full":
            raise ValueError(f"PlainMult.load_from: variant {model.config.variant!r}; expected 'full'")
        for m in MODALITIES:
            self.proj[m].weight.copy_(model.embed[m].conv.weight)
        for stack, encoders in ((model.crossmodal, [self.cross[f"{s}{t}"] for s, t in model.directions]),
                                (model.fusion, [self.mem[t] for t in model.targets])):
            for j, enc in enumerate(encoders):
                for i, layer in enumerate(enc.layers):
                    params = dict(layer.named_parameters())
                    for name, value in stack.stream_state(j, i).items():
                        params[name].copy_(value)
                enc.ln.weight.copy_(stack.final_weight[j])
                enc.ln.bias.copy_(stack.final_bias[j])
        for name in ("proj1", "proj2", "out_layer"):
            getattr(self, name).load_state_dict(getattr(model, name).state_dict())
        return self


class _PlainObjective(nn.Module):
    def __init__(self, model: PlainMult):
        super().__init__()
        self.model = model

    def forward(self, batch: MultBatch) -> dict[str, Tensor]:
        out = self.model(batch.text, batch.audio, batch.vision).float()
        loss = F.l1_loss(out, batch.labels.float().reshape(out.shape))
        return {"loss": loss, "loss/l1": loss}


# -- the benchmark -----------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--batch", type=int, nargs="+", default=[24, 256], help="batch sizes (default: 24 256)")
    p.add_argument("--precision", choices=["fp32", "bf16"], nargs="+", default=["fp32", "bf16"])
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=None, help="timed steps (default: 30 on cuda, 2 on cpu)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps first (default: 5 on cuda, 1 on cpu)")
    p.add_argument("--preset", default="reference", help="MulT preset (default: reference)")
    p.add_argument("--lengths", choices=["full", "variable"], default="full",
                   help="full: every step real (fused causal masks); variable: random true lengths + padding masks")
    p.add_argument("--compile", action="store_true", help="compile the model as training does (train.compile)")
    p.add_argument("--plain", action="store_true", help="also time the plain per-direction re-implementation")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="FIELD=VALUE",
                   help="override a MultConfig field of the preset (repeatable), e.g. --set attn_dropout=0")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="skip the equivalence check against the plain model on the device (run before timing)")


def time_steps(objective: nn.Module, batch: MultBatch, device: torch.device, precision: str,
               steps: int, warmup: int, compile: bool = False) -> dict[str, float]:
    """Samples/s and peak memory of `steps` train steps after `warmup` ones; the precision and
    compilation applied as training applies them (runtime.prepare)."""
    objective = apply_precision(objective.to(device), torch.bfloat16 if precision == "bf16" else None)
    opt = torch.optim.Adam(objective.parameters(), lr=1e-3)
    model = compile_module(objective) if compile else objective
    state = TrainState(model=model, optimizer=opt, grad_clip=0.8)
    b = batch.to(device, float_dtype=torch.float32)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(warmup):
        train_step(state, [b])
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for _ in range(steps):
        losses = train_step(state, [b])
    sync()
    dt = time.perf_counter() - t0
    loss = float(losses["loss"])
    if not math.isfinite(loss):
        raise RuntimeError(f"non-finite loss {loss} in the benchmark")
    n = len(b)
    return {"samples_s": n * steps / dt, "ms_step": 1000 * dt / steps, "peak_gib": peak_memory_gib(device)}


def check_against_plain(config: MultConfig, device: torch.device, batch: int = 4) -> list[str]:
    """Compare `Mult` with `PlainMult` (same weights, eval) on `device` at MOSEI shapes, full and
    padded lengths, fp32 and bf16 autocast: the device's own SDPA kernels (flash / memory-efficient,
    CausalBias, additive masks) against nn.MultiheadAttention with the reference's float mask.
    Returns the failures (empty = equal within tolerance)."""
    torch.manual_seed(0)
    model = Mult(config).to(device).eval()
    plain = PlainMult(config).to(device).load_from(model).eval()
    # Ours in bf16 as training runs it (its precision applied); the plain model under bare autocast.
    ours_at = {"fp32": model, "bf16": apply_precision(copy.deepcopy(model), torch.bfloat16)}
    b = MultBatch.random(batch, generator=torch.Generator().manual_seed(1), dims=(config.l_dim, config.a_dim, config.v_dim),
                         seq_lens=MOSEI_SHAPES["seq_lens"]).to(device, torch.float32)
    x = (b.text, b.audio, b.vision)
    failures = []
    for prec, tol in (("fp32", 2e-3), ("bf16", 0.15)):
        model = ours_at[prec]
        with torch.no_grad():
            ours = model(*x).output.float()
            with torch.autocast(device.type, torch.bfloat16, enabled=prec == "bf16"):
                ref = plain(*x).float()
            # Padded copy of sample 0's first half: the padded batch must give the unpadded result.
            half = [t[:1, : t.shape[1] // 2] for t in x]
            alone = model(*half).output.float()
            padded = [torch.cat([h, torch.zeros_like(t[:1, h.shape[1]:])], 1) for h, t in zip(half, x, strict=True)]
            lens = tuple(torch.tensor([h.shape[1]], device=device) for h in half)
            masked = model(*padded, lengths=lens).output.float()
        for name, a, r in (("vs plain", ours, ref), ("padding", masked, alone)):
            err = (a - r).abs().max().item()
            status = "ok" if err <= tol * max(1.0, r.abs().max().item()) else "MISMATCH"
            say(f"check {prec:<4} {name:<9} max |diff| {err:.2e} ({status})")
            if status != "ok":
                failures.append(f"{prec} {name}: {err:.3e}")
    return failures


def _value(text: str, kind: type, item: str):
    if kind is bool:
        if text.lower() in ("1", "true", "yes", "on"):
            return True
        if text.lower() in ("0", "false", "no", "off"):
            return False
        raise UserError(f"--set {item!r}: {text!r} is not a boolean; expected true or false")
    try:
        return kind(text)
    except ValueError:
        raise UserError(f"--set {item!r}: {text!r} is not {'an integer' if kind is int else f'a {kind.__name__}'}") from None


def override(config: MultConfig, items: list[str]) -> MultConfig:
    """`--set FIELD=VALUE` items applied to a preset, each checked (the field, its type, the config's bounds)."""
    names = [f.name for f in dataclasses.fields(MultConfig)]
    for item in items:
        field, eq, value = item.partition("=")
        if not eq or not value:
            raise UserError(f"--set {item!r}: expected FIELD=VALUE with a MultConfig field")
        if field not in names:
            raise UserError(f"--set {item!r}: unknown MultConfig field {field!r}; expected one of {', '.join(names)}")
        current = getattr(config, field)
        kind = type(current) if current is not None else int
        changed = {field: _value(value, kind, item)}
        try:
            config = config.replace(**changed)
        except ValueError as e:  # MultConfig.validate: the field, the value, what is expected
            raise UserError(f"--set {item!r}: {e}") from None
    return config


def run(args: argparse.Namespace) -> int:
    cuda_arg(args.device)
    at_least(args, 1, "batch", "steps", "threads")
    at_least(args, 0, "warmup")
    preset_arg("--preset", args.preset, PRESETS)
    config = override(preset(args.preset), args.overrides)
    device = torch.device(args.device)
    if args.threads:
        torch.set_num_threads(args.threads)
    steps = args.steps or (30 if device.type == "cuda" else 2)
    warmup = args.warmup if args.warmup is not None else (5 if device.type == "cuda" else 1)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # fp32 rows use TF32 matmuls, as any PyTorch fp32 peer
        torch.backends.cudnn.allow_tf32 = True
    say(f"MulT train step, preset {args.preset!r} (d={config.dim}, {config.layers} layers, {config.num_heads} heads,"
        f" causal={config.causal}{', ' + ', '.join(args.overrides) if args.overrides else ''}), shapes text 50x300 audio 500x74 vision 500x35, lengths {args.lengths},"
        f" device {device}, {steps} timed steps")
    if args.check:
        failures = check_against_plain(config, device)
        if failures:
            say(f"benchmark mult: the model differs from the plain implementation on {device}: {failures}",
                err=True)
            return 1
    header = f"{'impl':<8} {'batch':>5} {'prec':>5} {'samples/s':>10} {'ms/step':>9} {'peak GiB':>9} {'vs plain':>8}"
    say(header)
    say("-" * len(header))
    variable = args.lengths == "variable"
    for bs in args.batch:
        # MOSEI's lengths; the feature dims are the preset's (the reference preset's are MOSEI's).
        batch = MultBatch.random(bs, variable_lengths=variable, generator=torch.Generator().manual_seed(0),
                                 dims=(config.l_dim, config.a_dim, config.v_dim), seq_lens=MOSEI_SHAPES["seq_lens"])
        for prec in args.precision:
            torch.manual_seed(0)
            model = Mult(config)
            objective = MultObjective(model, use_lengths=variable)
            ours = time_steps(objective, batch, device, prec, steps, warmup, compile=args.compile)
            plain = None
            if args.plain:
                del model, objective
                torch.manual_seed(0)
                plain = time_steps(_PlainObjective(PlainMult(config)), batch, device, prec, steps, warmup)
            ratio = f"{ours['samples_s'] / plain['samples_s']:7.2f}x" if plain else ""
            say(f"{'xmodal':<8} {bs:>5} {prec:>5} {ours['samples_s']:>10.1f} {ours['ms_step']:>9.1f}"
                f" {ours['peak_gib']:>9.2f} {ratio:>8}")
            if plain:
                say(f"{'plain':<8} {bs:>5} {prec:>5} {plain['samples_s']:>10.1f} {plain['ms_step']:>9.1f}"
                    f" {plain['peak_gib']:>9.2f}")
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return 0
