"""Checkpoints: model, optimizer, scheduler, step, data position and RNG state. Imports only torch.

Files are written with `torch.save` and read with `torch.load(weights_only=True)`:
a checkpoint cannot execute code when loaded.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch
from torch import nn

from xmodal.train.step import TrainState

STATE_FILE = "state.pt"
MODEL_FILE = "model.pt"
META_FILE = "meta.json"


def unwrap(model: nn.Module) -> nn.Module:
    """The plain module under DDP and torch.compile wrappers."""
    while True:
        if hasattr(model, "_orig_mod"):
            model = model._orig_mod
        elif isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        else:
            return model


def save(directory: str | Path, state: TrainState, meta: dict[str, Any]) -> Path:
    """Write a checkpoint folder. `meta` (JSON) carries the step, data position, config and run ids."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    torch.save(unwrap(state.model).state_dict(), d / MODEL_FILE)
    rng = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1])}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save({
        "optimizer": state.optimizer.state_dict(),
        "scheduler": state.scheduler.state_dict() if state.scheduler is not None else None,
        "step": state.step,
        "rng": rng,
    }, d / STATE_FILE)
    (d / META_FILE).write_text(json.dumps({**meta, "step": state.step}, indent=2, default=str))
    return d


def read_meta(directory: str | Path) -> dict[str, Any]:
    return json.loads((Path(directory) / META_FILE).read_text())


def load_model_weights(directory: str | Path, model: nn.Module, strict: bool = True) -> None:
    sd = torch.load(Path(directory) / MODEL_FILE, map_location="cpu", weights_only=True)
    unwrap(model).load_state_dict(sd, strict=strict)


def restore(directory: str | Path, state: TrainState) -> dict[str, Any]:
    """Load everything `save` wrote into `state`; returns the meta dict."""
    d = Path(directory)
    load_model_weights(d, state.model)
    blob = torch.load(d / STATE_FILE, map_location="cpu", weights_only=True)
    state.optimizer.load_state_dict(blob["optimizer"])
    if state.scheduler is not None and blob["scheduler"] is not None:
        state.scheduler.load_state_dict(blob["scheduler"])
    state.step = int(blob["step"])
    rng = blob["rng"]
    torch.set_rng_state(rng["torch"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    random.setstate((3, tuple(rng["python"]), None))
    return read_meta(d)
