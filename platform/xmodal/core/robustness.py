"""Test-time perturbations for robustness evaluation: pure functions of a typed batch (torch and numpy only).

MulT: one modality missing (its features zeroed at every step, lengths kept, so the model sees the
sequence's shape but no content) or noised. LXMERT fine-tuning: the visual features noised, or the
boxes shuffled across the real objects of each image (each feature keeps its place, so an object's
features now come with another object's position).

Noise is Gaussian with standard deviation `sigma` x the feature dimension's std (`feature_std`: over
the real steps or objects of the evaluated split), added at real steps or objects only (padding stays
zero). Every random draw comes from a generator seeded by (seed, condition, the example's row in its
split): the same perturbation whatever the batch size, the batch order or the number of workers.
"""

from __future__ import annotations

import dataclasses
import typing
import zlib
from collections.abc import Callable
from typing import Literal, TypeVar

import numpy as np
import torch
from torch import Tensor

from xmodal.core.batches import MultBatch, Nlvr2Batch, VqaBatch

MultCondition = Literal["zero_text", "zero_audio", "zero_vision", "noise_text", "noise_audio", "noise_vision"]
FinetuneCondition = Literal["feat_noise", "shuffle_boxes"]
MULT_CONDITIONS: tuple[str, ...] = typing.get_args(MultCondition)
FINETUNE_CONDITIONS: tuple[str, ...] = typing.get_args(FinetuneCondition)
MODALITIES = MultBatch.FEATURES  # text, audio, vision

VisualBatch = TypeVar("VisualBatch", VqaBatch, Nlvr2Batch)


def row_rng(seed: int, condition: str, row: int) -> np.random.Generator:
    """The generator of one example under one condition: fixed by (seed, condition, row)."""
    return np.random.default_rng([seed, zlib.crc32(condition.encode()), row])


def feature_std(values: np.ndarray, mask: np.ndarray | None = None, chunk: int = 1 << 16) -> Tensor:
    """Std of each feature dimension (last axis) over the entries `mask` keeps (all when None), in
    float64, a chunk of the first axis at a time (a split of float16 features may not fit twice)."""
    dim = values.shape[-1]
    n, total, squares = 0, np.zeros(dim), np.zeros(dim)
    for start in range(0, values.shape[0], chunk):
        part = values[start:start + chunk]
        part = (part[mask[start:start + chunk]] if mask is not None else part.reshape(-1, dim)).astype(np.float64)
        n += part.shape[0]
        total += part.sum(0)
        squares += np.square(part).sum(0)
    if n == 0:
        raise ValueError("feature_std: no entries to measure (an empty split, or a mask with no real entries)")
    mean = total / n
    return torch.from_numpy(np.sqrt(np.maximum(squares / n - mean * mean, 0.0))).float()


def _modality(modality: str) -> str:
    if modality not in MODALITIES:
        raise ValueError(f"modality = {modality!r}: expected one of {', '.join(MODALITIES)}")
    return modality


def zero_modality(batch: MultBatch, modality: str) -> MultBatch:
    """`batch` with `modality`'s features zeroed at every step (the modality missing)."""
    x = getattr(batch, _modality(modality))
    return dataclasses.replace(batch, **{modality: torch.zeros_like(x)})


def noise_modality(batch: MultBatch, modality: str, sigma: float, std: Tensor, seed: int) -> MultBatch:
    """`batch` with Gaussian noise of std `sigma` x `std` (F,) added to `modality`'s real steps."""
    x = getattr(batch, _modality(modality))
    lengths = getattr(batch, f"{modality}_lengths").tolist()
    noise = torch.zeros(x.shape, dtype=torch.float32)
    for b, (row, n) in enumerate(zip(batch.index.tolist(), lengths, strict=True)):
        draw = row_rng(seed, f"noise_{modality}", row).standard_normal((n, x.shape[-1]), dtype=np.float32)
        noise[b, :n] = torch.from_numpy(draw)
    scale = sigma * std.to(device=x.device, dtype=torch.float32)
    noised = x.float() + noise.to(x.device) * scale
    return dataclasses.replace(batch, **{modality: noised.to(x.dtype)})


def mult_perturbation(condition: str, sigma: float, stds: dict[str, Tensor], seed: int
                      ) -> Callable[[MultBatch], MultBatch]:
    """The perturbation of a MulT condition (`zero_<modality>` or `noise_<modality>`); `stds`: each
    noised modality's per-dimension std (`feature_std`)."""
    if condition not in MULT_CONDITIONS:
        raise ValueError(f"condition = {condition!r}: expected one of {', '.join(MULT_CONDITIONS)}")
    kind, modality = condition.split("_", 1)
    if kind == "zero":
        return lambda batch: zero_modality(batch, modality)
    return lambda batch: noise_modality(batch, modality, sigma, stds[modality], seed)


def noise_visual_feats(batch: VisualBatch, sigma: float, std: Tensor, seed: int) -> VisualBatch:
    """`batch` with Gaussian noise of std `sigma` x `std` (F,) added to the features of real objects."""
    x, mask = batch.visual_feats, batch.visual_mask  # (B, [2,] N, F), (B, [2,] N)
    if len(batch) == 0:
        return batch
    noise = torch.stack([torch.from_numpy(row_rng(seed, "feat_noise", row).standard_normal(
        tuple(x.shape[1:]), dtype=np.float32)) for row in batch.index.tolist()])
    scale = sigma * std.to(device=x.device, dtype=torch.float32)
    noised = x.float() + noise.to(x.device) * scale * mask[..., None].to(torch.float32)
    return dataclasses.replace(batch, visual_feats=noised.to(x.dtype))


def shuffle_boxes(batch: VisualBatch, seed: int) -> VisualBatch:
    """`batch` with the boxes of each image permuted at random among its real objects; features,
    masks and padded objects' boxes stay where they are."""
    boxes = batch.boxes.clone()
    mask = batch.visual_mask.cpu()
    flat_boxes = boxes.view(-1, *boxes.shape[-2:])  # (B x images, N, 4)
    flat_mask = mask.reshape(-1, mask.shape[-1])
    per_example = flat_mask.shape[0] // max(len(batch), 1)
    for b, row in enumerate(batch.index.tolist()):
        rng = row_rng(seed, "shuffle_boxes", row)
        for i in range(b * per_example, (b + 1) * per_example):
            real = torch.nonzero(flat_mask[i]).flatten()
            perm = torch.from_numpy(rng.permutation(len(real)))
            real = real.to(boxes.device)
            flat_boxes[i, real] = flat_boxes[i, real[perm.to(boxes.device)]]
    return dataclasses.replace(batch, boxes=boxes)


def finetune_perturbation(condition: str, sigma: float, std: Tensor | None, seed: int
                          ) -> Callable[[VisualBatch], VisualBatch]:
    """The perturbation of a fine-tuning condition (`feat_noise`, which needs `std`, or `shuffle_boxes`)."""
    if condition == "feat_noise":
        return lambda batch: noise_visual_feats(batch, sigma, std, seed)
    if condition == "shuffle_boxes":
        return lambda batch: shuffle_boxes(batch, seed)
    raise ValueError(f"condition = {condition!r}: expected one of {', '.join(FINETUNE_CONDITIONS)}")
