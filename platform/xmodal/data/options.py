"""Options of the data side, as plain dataclasses (validated by the experiment config: the bounds are
`Annotated` metadata from xmodal.base.bounds, the checks across fields are in `__post_init__`)."""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from annotated_types import Ge, Interval

from xmodal.base.bounds import (
    Fraction,
    NonNegFloat,
    PosFloat,
    PosInt,
    Probability,
    Seed,
    SeqLen,
    bounds_of,
    describe_bounds,
)
from xmodal.base.errors import UserError

# The seeds that no config bounds (`Seed` does those): numpy's generators take any non-negative integer,
# the manifests record it as a JSON integer, which readers take as int64.
SEED_LIMIT = 2**63


def seed_problem(option: str, value: Any) -> str | None:
    """What is wrong with a seed given as `option` (a command-line flag), or None: one check, one
    message, for the seed flags no config bounds (--order-seed, synthetic-vqa|gqa|nlvr2 --seed); the
    seeds of `synthetic` and `mult-synthetic` are config fields too, so they keep the configs' `Seed`."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < SEED_LIMIT:
        return f"{option} {value}: expected an integer in [0, 2**63)"
    return None


def out_of_bounds(options: Any) -> dict[str, str]:
    """Each field of a dataclass of options outside the bounds its `Annotated` type states (a float
    must be finite too: NaN or inf is never a meaningful count, fraction or scale), field name ->
    `--flag value (field=value): expected ...`, as the command line that takes the fields as flags
    (`jobs/ingest.py synthetic`) names them; the field name is what a config or a manifest says."""
    hints = typing.get_type_hints(type(options), include_extras=True)
    problems: dict[str, str] = {}
    for f in dataclasses.fields(options):
        value, meta = getattr(options, f.name), getattr(hints[f.name], "__metadata__", ())
        if isinstance(value, bool) or not isinstance(value, int | float) or not meta:
            continue
        ge, gt, le, lt = bounds_of(list(meta))
        ok = ((ge is None or value >= ge) and (gt is None or value > gt) and (le is None or value <= le)
              and (lt is None or value < lt) and math.isfinite(value))  # comparisons with NaN are all False
        if not ok:
            kind = "an integer" if isinstance(value, int) else "a finite number"
            flag = "--" + f.name.replace("_", "-")
            problems[f.name] = f"{flag} {value} ({f.name}={value}): expected {describe_bounds(list(meta), kind)}"
    return problems


@dataclass
class MaskingOptions:
    """Pretraining sample construction (paper §3.1; BERT 80/10/10 rule as in the reference)."""

    __pydantic_config__ = {"extra": "forbid"}

    word_mask_prob: Probability = 0.15
    obj_mask_prob: Probability = 0.15
    mismatch_prob: Probability = 0.5
    # Tokens per sample incl. [CLS]/[SEP]; None = the store's (longer pads with [PAD]).
    max_seq_len: SeqLen | None = None
    # QA target from a question's soft answer scores: "sample" draws one answer with probability
    # proportional to its score (docs/papers.md#lxmert-pretraining-tasks-and-losses, as the reference
    # loader does); "argmax" always takes the highest-scoring answer (deterministic labels).
    qa_target: Literal["sample", "argmax"] = "sample"


@dataclass
class SyntheticLxmertOptions:
    """The learnable synthetic corpus (see xmodal.data.lxmert.synthetic)."""

    __pydantic_config__ = {"extra": "forbid"}

    num_images: Annotated[int, Ge(2)] = 2000  # mismatched sentences come from other images
    minival_fraction: Fraction = 0.1
    num_objects: PosInt = 36
    feat_dim: PosInt = 2048
    num_object_labels: Annotated[int, Ge(2)] = 1600  # named classes + background classes
    num_attr_labels: PosInt = 400
    num_answers: PosInt = 9500
    sentences_per_image: PosInt = 5
    seed: Seed = 0
    # Defaults keep configs written before these options valid.
    max_seq_len: Annotated[int, Ge(8)] = 20  # tokens per sentence incl. [CLS]/[SEP], fixed at ingest
    question_fraction: Probability = 1 / 3  # paper: about a third of the sentences are questions
    feature_noise: NonNegFloat = 0.5  # std of the Gaussian noise added to each object's prototype
    images_per_shard: PosInt = 256
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

    num_samples: Annotated[int, Ge(10)] = 2000
    valid_fraction: Annotated[float, Interval(gt=0, lt=1)] = 0.1  # valid + test < 1
    test_fraction: Annotated[float, Interval(gt=0, lt=1)] = 0.1
    text_dim: PosInt = 16
    audio_dim: PosInt = 8
    vision_dim: PosInt = 6
    # Inclusive range of words. 3-6 words: a full `small` MulT leaves the plateau in ~150-300 steps
    # (6-12 words: 250-450 steps and a wider spread); single streams still know nothing of the label.
    text_len: tuple[PosInt, PosInt] = (3, 6)
    # Steps per word; the shortest audio / vision sequence must hold the event (EVENT_STEPS).
    audio_rate: PosFloat = 3.0  # audio steps per word
    vision_rate: PosFloat = 2.0  # vision steps per word
    vocab_size: PosInt = 40  # filler words
    event_strength: NonNegFloat = 3.0
    noise: NonNegFloat = 0.5
    label_noise: NonNegFloat = 0.0
    # How the label is made: "product" (the default, needs text AND audio), or controls:
    # "text" = polarity x intensity, "audio" = +-2 from the event, "sum" = polarity x intensity / 2 +- 1.5.
    rule: Literal["product", "text", "audio", "sum"] = "product"
    seed: Seed = 0

    def __post_init__(self) -> None:
        self.check()

    def check(self) -> None:
        def bad(field: str, expected: str):
            raise UserError(f"SyntheticMultOptions.{field} = {getattr(self, field)!r}: expected {expected}")

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
        for f in ("audio_rate", "vision_rate"):  # `not ... > 0`: NaN fails too
            if not 0 < getattr(self, f) < float("inf"):
                bad(f, "a finite number > 0")
        for f in ("event_strength", "noise", "label_noise"):
            if not 0 <= getattr(self, f) < float("inf"):
                bad(f, "a finite number >= 0")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**32:
            bad("seed", "an integer in [0, 2**32) (numpy's seed range, as a config's seed)")
