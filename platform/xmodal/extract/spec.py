"""How a detector actor builds its detector (`DetectorSpec`, pickled to every actor): the config the
driver built once (`plan.check`), the weights file it checked and their sha256, the precision."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from xmodal.models.butd.config import DetectorConfig


@dataclass(frozen=True)
class DetectorSpec:
    """How an actor builds its detector (pickled to every actor)."""

    cfg: DetectorConfig  # the whole detector: its size, boxes and input size (built once, by the driver)
    weights: str | None = None  # the weights file; None: random weights (tests and benchmarks)
    weights_sha256: str | None = None  # the file the driver checked: an actor whose copy differs refuses it
    layout: str = "auto"
    seed: int = 0  # random weights' seed
    given: bool = False  # boxes come with the images (--boxes-from)
    precision: str = "fp32"  # `config.PRECISIONS`: fp32 (exact), tf32, bf16
    num_objects: int = 36  # region slots per image in the run's output
    threads: int | None = None  # a CPU actor's torch threads (`resources.cpu_threads`); None: as Ray set them

    def build(self):
        from xmodal.models.butd.detector import random_detector

        if self.weights is None:
            return random_detector(self.cfg, seed=self.seed)
        from xmodal.core.checkpoint import sha256_of
        from xmodal.models.butd.weights import WeightsError, load_detector

        # On a cluster each node reads its own copy of the path: one that differs from the file the
        # driver checked (another version, a file replaced mid-run) would give other features silently.
        if self.weights_sha256 is not None and (found := sha256_of(Path(self.weights))) != self.weights_sha256:
            raise WeightsError(f"{self.weights}: sha256 {found} on this node, not the {self.weights_sha256} the "
                               "driver checked; give every node the same weights file")
        return load_detector(self.weights, layout=self.layout, cfg=self.cfg)
