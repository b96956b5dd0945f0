"""What the detector's stages hand each other: the images, the proposals, the regions, and the pass itself.

    ImageBatch    the prepared images on the device, in groups of one input size   (input -> every stage)
    Proposals     each image's proposal slots in input pixels                        (proposals -> RoI heads)
    RegionBatch   each image's regions, padded to K slots                            (RoI heads -> the caller)
    ImageRegions  one image's regions without the empty slots                        (`RegionBatch.images`)
    Pass          one call's options, device and stage clock                         (the detector -> every stage)

Imports only torch and the standard library.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from xmodal.models.butd.config import DetectOptions
from xmodal.models.butd.image import PreparedImage


class ImageBatch(NamedTuple):
    """A batch as the network sees it: each image's blob on the device, and the groups that go through the
    backbone together (indices of images of one input size, at most `backbone_batch` of them)."""

    images: list[PreparedImage]
    groups: list[list[int]]

    @classmethod
    def grouped(cls, images: list[PreparedImage], most: int) -> ImageBatch:
        """The images in groups of one input size, at most `most` each, in their first image's order."""
        by_size: dict[tuple[int, ...], list[int]] = {}
        for i, p in enumerate(images):
            by_size.setdefault(tuple(p.blob.shape), []).append(i)
        return cls(images, [m[s:s + most] for m in by_size.values() for s in range(0, len(m), most)])

    def input_size(self, group: Sequence[int]) -> tuple[int, int]:
        """(height, width) of the resized input, the same for the whole group."""
        return tuple(self.images[group[0]].blob.shape[:2])  # type: ignore[return-value]

    def blobs(self, group: Sequence[int]) -> Tensor:
        """The group's input (G, 3, h, w)."""
        return torch.stack([self.images[i].blob for i in group]).permute(0, 3, 1, 2).contiguous()

    def scales(self, group: Sequence[int] | None = None) -> Tensor:
        """The input scales (`im_scales`) of the group (all images by default), float32 on the host."""
        chosen = range(len(self.images)) if group is None else group
        return torch.tensor([self.images[i].scale for i in chosen], dtype=torch.float32)

    def sizes(self) -> Tensor:
        """(B, 2) int64: each image's original (height, width), on the host."""
        return torch.tensor([[p.img_h, p.img_w] for p in self.images], dtype=torch.int64)


class Proposals(NamedTuple):
    """The proposal layer's answer for a batch: R = post_nms_top_n slots per image."""

    rois: Tensor  # (B, R, 4) float32, input pixels; 0 in empty slots
    ok: Tensor  # (B, R) bool: the slot holds a proposal
    certified: Tensor  # (B,) bool: the proposal NMS's answer is certified (`boxes.window_nms`); else re-run


class ImageRegions(NamedTuple):
    """One image's regions, as the reference's TSV line holds them (boxes in original-image pixels)."""

    img_h: int
    img_w: int
    boxes: Tensor  # (K, 4) float32, x1 y1 x2 y2
    features: Tensor  # (K, feature_dim) float32: pool5_flat
    obj_ids: Tensor  # (K,) int64, 0-based over classes 1..num_classes
    obj_conf: Tensor  # (K,) float32
    attr_ids: Tensor  # (K,) int64, 0-based over attributes 1..num_attributes
    attr_conf: Tensor  # (K,) float32


class RegionBatch(NamedTuple):
    """The regions of a batch of images, padded to K slots each: what the detector hands back."""

    num_boxes: Tensor  # (B,) int64: slots [0, num_boxes) hold regions
    img_h: Tensor  # (B,) int64
    img_w: Tensor  # (B,) int64
    boxes: Tensor  # (B, K, 4) float32, original-image pixels; 0 in empty slots
    features: Tensor  # (B, K, D) float32; 0 in empty slots
    obj_ids: Tensor  # (B, K) int64; -1 in empty slots
    obj_conf: Tensor  # (B, K) float32
    attr_ids: Tensor  # (B, K) int64; -1 in empty slots
    attr_conf: Tensor  # (B, K) float32
    certified: Tensor  # (B,) bool: the proposal NMS's answer is certified (`boxes.window_nms`); else re-run

    @classmethod
    def padded(cls, batch: ImageBatch, count: Tensor, boxes: Tensor, features: Tensor,
               labels: tuple[Tensor, Tensor, Tensor, Tensor], certified: Tensor) -> RegionBatch:
        """The batch's regions with the slots past each image's `count` emptied: boxes (B, K, 4), features
        (B, K, D), labels (obj_ids, obj_conf, attr_ids, attr_conf) each (B, K)."""
        dev = boxes.device
        sizes = batch.sizes().to(dev)
        filled = torch.arange(boxes.shape[1], device=dev)[None, :] < count[:, None]  # (B, K)
        obj_ids, obj_conf, attr_ids, attr_conf = labels
        return cls(count, sizes[:, 0], sizes[:, 1], torch.where(filled[..., None], boxes, 0.0),
                   torch.where(filled[..., None], features, 0.0), torch.where(filled, obj_ids, -1),
                   torch.where(filled, obj_conf, 0.0), torch.where(filled, attr_ids, -1),
                   torch.where(filled, attr_conf, 0.0), certified)

    def to_host(self) -> RegionBatch:
        """The batch on the CPU in ONE device-to-host copy (all fields packed into one float32 buffer;
        ids and sizes are integers far below 2^24, so float32 holds them exactly)."""
        if self.boxes.device.type == "cpu":
            return self
        b, k = self.obj_ids.shape
        d = self.features.shape[2]
        per_image = torch.stack((self.num_boxes, self.img_h, self.img_w, self.certified.long()), dim=1).float()
        per_slot = torch.cat((self.boxes, self.obj_ids[..., None].float(), self.obj_conf[..., None],
                              self.attr_ids[..., None].float(), self.attr_conf[..., None], self.features), dim=2)
        host = torch.cat((per_image, per_slot.reshape(b, -1)), dim=1).cpu()  # the one copy
        slots = host[:, 4:].reshape(b, k, 8 + d)
        as_int = lambda t: t.round().to(torch.int64)  # noqa: E731
        return RegionBatch(as_int(host[:, 0]), as_int(host[:, 1]), as_int(host[:, 2]), slots[..., :4].contiguous(),
                           slots[..., 8:].contiguous(), as_int(slots[..., 4]), slots[..., 5].contiguous(),
                           as_int(slots[..., 6]), slots[..., 7].contiguous(), host[:, 3] > 0.5)

    def with_rows(self, rows: Sequence[int], other: RegionBatch) -> RegionBatch:
        """This batch with rows `rows` replaced by `other`'s rows 0, 1, ... (host batches of one K)."""
        index = torch.tensor(rows)
        fields = []
        for mine, theirs in zip(self, other, strict=True):
            mine = mine.clone()
            mine[index] = theirs
            fields.append(mine)
        return RegionBatch(*fields)

    def images(self) -> list[ImageRegions]:
        """Per image, its regions without the empty slots (on the batch's device; call on a host batch)."""
        out = []
        for i, k in enumerate(self.num_boxes.tolist()):
            out.append(ImageRegions(int(self.img_h[i]), int(self.img_w[i]), self.boxes[i, :k], self.features[i, :k],
                                    self.obj_ids[i, :k], self.obj_conf[i, :k], self.attr_ids[i, :k],
                                    self.attr_conf[i, :k]))
        return out


class StageClock:
    """Adds the seconds since the last lap to `stats[stage]`; does nothing when stats is None."""

    def __init__(self, stats: dict[str, float] | None, device: torch.device):
        self.stats, self.device = stats, device
        self.last = time.perf_counter()

    def lap(self, stage: str) -> None:
        if self.stats is None:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.stats[stage] = self.stats.get(stage, 0.0) + now - self.last
        self.last = now

    def count(self, name: str, n: int) -> None:
        if self.stats is not None:
            self.stats[name] = self.stats.get(name, 0) + n


class Pass(NamedTuple):
    """One `detect` call as its stages see it: its options, the model's device and the stage clock."""

    options: DetectOptions
    device: torch.device
    clock: StageClock

    def autocast(self) -> contextlib.AbstractContextManager:
        """The context the network's layers run in: bfloat16 autocast under "bf16", nothing otherwise
        (box arithmetic, NMS and the selection stay outside it, in float32)."""
        if self.options.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()
