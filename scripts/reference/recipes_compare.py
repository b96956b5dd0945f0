"""What `recipes.py` compares at every step, and what it holds a training to.

A training runs three things in lockstep on the same initial weights and batches: the reference's own
loop (its model, its optimizer, its step), ours (our model and the recipe's optimizer, through
`core.runtime.prepare` and `core.step.train_step`) and, in float32, the floor (our model driven by the
reference's own optimizer and loop body: what float32 alone makes of two models that agree). After
each reference step the other two take theirs, and one `Row` records both losses, both rates and the
largest parameter difference.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor

FLOAT64_TARGET = 1e-9  # relative loss and parameter difference at every step, float64
FLOOR_FACTOR = 10.0  # float32: ours within this many times the floor
LXMERT_FLOAT32_LOSS = 1e-6  # float32, LXMERT: relative loss difference over the run


def rel(ours: float, ref: float) -> float:
    """|ours - ref| / |ref| (0 when both are 0)."""
    if ours == ref:
        return 0.0
    return abs(ours - ref) / abs(ref) if ref != 0 else math.inf


@torch.no_grad()
def param_diff(ref: Mapping[str, Tensor], ours: Mapping[str, Tensor]) -> float:
    """The largest relative parameter difference: over the tensors (in our names), max |ours - ref|
    divided by the tensor's largest |ref|. Every tensor must be in both."""
    if ref.keys() != ours.keys():
        missing = sorted(ref.keys() ^ ours.keys())
        raise KeyError(f"the models' parameters differ in name: {', '.join(missing[:6])}")
    worst, where = 0.0, ""
    for k, r in ref.items():
        o = ours[k].to(r.dtype)
        scale = float(r.abs().max()) if r.numel() else 0.0
        d = float((o - r).abs().max()) if r.numel() else 0.0
        found = d / scale if scale > 0 else (0.0 if d == 0 else math.inf)
        if found > worst:
            worst, where = found, k
    param_diff.where = where  # the tensor of the last call's largest difference (reference names)
    return worst


@dataclass
class Row:
    step: int
    ref_loss: float
    our_loss: float
    ref_lr: float
    our_lr: float
    params: float  # largest relative parameter difference, ours against the reference, after the step
    floor_loss: float | None = None  # float32: the floor's loss, and its parameter difference
    floor_params: float | None = None
    note: str = ""  # e.g. a plateau drop after this step

    @property
    def loss(self) -> float:
        return rel(self.our_loss, self.ref_loss)


HEADER = (f"{'step':>5} {'reference loss':>22} {'our loss':>22} {'rel. diff':>9} {'reference lr':>12} "
          f"{'our lr':>12} {'params':>9} {'floor loss':>10} {'floor par.':>10}")


def line(r: Row) -> str:
    floor = (f" {rel(r.floor_loss, r.ref_loss):10.2e} {r.floor_params:10.2e}" if r.floor_loss is not None
             else f" {'-':>10} {'-':>10}")
    return (f"{r.step:5d} {r.ref_loss:22.15g} {r.our_loss:22.15g} {r.loss:9.2e} {r.ref_lr:12.6g} {r.our_lr:12.6g} "
            f"{r.params:9.2e}{floor}{'  ' + r.note if r.note else ''}")


@dataclass
class Verdict:
    training: str
    dtype: str
    steps: int
    max_loss: float
    max_params: float
    max_lr: float
    floor_loss: float | None
    floor_params: float | None
    limits: dict[str, float]
    notes: list[str] = field(default_factory=list)
    passed: bool = False

    def as_dict(self) -> dict:
        return asdict(self)


def verdict(training: str, dtype: str, rows: list[Row], min_steps: int, extra: Callable[[list[Row]], list[str]]
            ) -> Verdict:
    """The run against its targets: float64 below FLOAT64_TARGET at every step; float32 within
    FLOOR_FACTOR times the floor (and, for LXMERT, the loss below LXMERT_FLOAT32_LOSS); at least
    `min_steps` steps; `extra`: the training's own requirements (a plateau drop), as failures."""
    # A batch where a task has no target (no masked word, no question): the reference's CrossEntropyLoss
    # averages over nothing and its loss is NaN, its gradients are not; its parameters are still compared.
    undefined = [r.step for r in rows if math.isnan(r.ref_loss)]
    losses = [r for r in rows if not math.isnan(r.ref_loss)]
    v = Verdict(training, dtype, len(rows), max((r.loss for r in losses), default=math.inf),
                max((r.params for r in rows), default=math.inf),
                max((rel(r.our_lr, r.ref_lr) for r in rows), default=math.inf), None, None, {})
    failures = []
    if len(rows) < min_steps:
        failures.append(f"{len(rows)} steps; the check needs at least {min_steps}")
    if undefined:
        v.notes.append(f"the reference's loss is NaN at steps {undefined} (a task without a target); not compared")
    if len(undefined) > len(rows) // 10:
        failures.append(f"the reference's loss is NaN at {len(undefined)} of {len(rows)} steps")
    if dtype == "float64":
        v.limits = {"loss": FLOAT64_TARGET, "params": FLOAT64_TARGET}
    else:
        v.floor_loss = max(rel(r.floor_loss, r.ref_loss) for r in losses)
        v.floor_params = max(r.floor_params for r in rows)
        v.limits = {"loss": FLOOR_FACTOR * v.floor_loss, "params": FLOOR_FACTOR * v.floor_params}
        if training != "mult":
            v.limits["loss"] = min(v.limits["loss"], LXMERT_FLOAT32_LOSS)
    for what, found in (("loss", v.max_loss), ("params", v.max_params)):
        if not found <= v.limits[what]:
            failures.append(f"{what}: {found:.2e} above the limit {v.limits[what]:.2e}")
    failures += extra(rows)
    v.notes, v.passed = v.notes + failures, not failures
    return v
