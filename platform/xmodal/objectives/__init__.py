"""Losses and metrics of the tasks (torch only)."""

from __future__ import annotations

import torch
from torch import Tensor


def loss_precision(x: Tensor) -> Tensor:
    """`x` in float32 for a loss (bf16 logits under autocast are cast up), unless it is float64: a run in
    float64 (the reference checks, scripts/reference/) keeps its precision end to end."""
    return x if x.dtype == torch.float64 else x.float()
