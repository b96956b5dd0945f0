"""Options of the data side, as plain dataclasses (validated by the experiment config)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class MaskingOptions:
    """Pretraining sample construction (paper §3.1; BERT 80/10/10 rule as in the reference)."""

    __pydantic_config__ = {"extra": "forbid"}

    word_mask_prob: float = 0.15
    obj_mask_prob: float = 0.15
    mismatch_prob: float = 0.5
    max_seq_len: int | None = None  # tokens per sample; None = the store's (longer pads with [PAD])
    # QA target from a question's soft answer scores: "sample" draws one answer with probability
    # proportional to its score (docs/papers.md#lxmert-pretraining-tasks-and-losses, as the reference
    # loader does); "argmax" always takes the highest-scoring answer (deterministic labels).
    qa_target: Literal["sample", "argmax"] = "sample"


@dataclass
class SyntheticLxmertOptions:
    """The learnable synthetic corpus (see xmodal.data.lxmert.synthetic)."""

    __pydantic_config__ = {"extra": "forbid"}

    num_images: int = 2000
    minival_fraction: float = 0.1
    num_objects: int = 36
    feat_dim: int = 2048
    num_object_labels: int = 1600
    num_attr_labels: int = 400
    num_answers: int = 9500
    sentences_per_image: int = 5
    seed: int = 0
    # Added with the feature store; defaults keep older configs valid.
    max_seq_len: int = 20  # tokens per sentence incl. [CLS]/[SEP], fixed at ingest
    question_fraction: float = 1 / 3  # paper: about a third of the sentences are questions
    feature_noise: float = 0.5  # std of the Gaussian noise added to each object's prototype
    images_per_shard: int = 256
    # True: the object slots that no sentence names hold background classes (a detector's 36 boxes);
    # False: an image holds only its named objects, the other slots are padding (num_boxes < num_objects).
    background_objects: bool = True
    # True: every caption names every object group of its image ("a red cube and two blue balls");
    # False: a caption names one, two or all of them.
    captions_name_all_groups: bool = False


EVENT_STEPS = 3  # steps of the synthetic MulT audio event


@dataclass
class SyntheticMultOptions:
    """The synthetic MulT corpus (validated by the experiment config)."""

    __pydantic_config__ = {"extra": "forbid"}

    num_samples: int = 2000
    valid_fraction: float = 0.1
    test_fraction: float = 0.1
    text_dim: int = 16
    audio_dim: int = 8
    vision_dim: int = 6
    # Inclusive range of words. 3-6 words: a full `small` MulT leaves the plateau in ~150-300 steps
    # (6-12 words: 250-450 steps and a wider spread); single streams still know nothing of the label.
    text_len: tuple[int, int] = (3, 6)
    audio_rate: float = 3.0  # audio steps per word
    vision_rate: float = 2.0  # vision steps per word
    vocab_size: int = 40  # filler words
    event_strength: float = 3.0
    noise: float = 0.5
    label_noise: float = 0.0
    # How the label is made: "product" (the default, needs text AND audio), or controls:
    # "text" = polarity x intensity, "audio" = +-2 from the event, "sum" = polarity x intensity / 2 +- 1.5.
    rule: Literal["product", "text", "audio", "sum"] = "product"
    seed: int = 0

    def check(self) -> None:
        def bad(field: str, expected: str):
            raise ValueError(f"SyntheticMultOptions.{field} = {getattr(self, field)!r}: expected {expected}")

        if self.num_samples < 10:
            bad("num_samples", ">= 10")
        if not (0 < self.valid_fraction < 1 and 0 < self.test_fraction < 1
                and self.valid_fraction + self.test_fraction < 1):
            bad("valid_fraction", "valid and test fractions in (0, 1) summing below 1")
        lo, hi = self.text_len
        if not 1 <= lo <= hi:
            bad("text_len", "(min, max) with 1 <= min <= max")
        if min(self.audio_rate, self.vision_rate) * lo < EVENT_STEPS:
            bad("audio_rate", f"rates such that the shortest audio / vision sequence holds {EVENT_STEPS} steps")
        if self.rule not in ("product", "text", "audio", "sum"):
            bad("rule", "one of 'product', 'text', 'audio', 'sum'")
        for f in ("text_dim", "audio_dim", "vision_dim", "vocab_size"):
            if getattr(self, f) < 1:
                bad(f, "a positive integer")
