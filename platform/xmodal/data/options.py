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
    max_seq_len: int = 20
    # QA target from a question's soft answer scores: "sample" draws one answer with probability
    # proportional to its score (FACTS: "target drawn from the soft answer scores", as the reference
    # loader does); "argmax" always takes the highest-scoring answer (deterministic labels).
    qa_target: Literal["sample", "argmax"] = "sample"


@dataclass
class SyntheticLxmertOptions:
    """The learnable synthetic corpus (see xmodal.data.synthetic)."""

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
    # Added with the feature store (issue #3); defaults keep older configs valid.
    max_seq_len: int = 20  # tokens per sentence incl. [CLS]/[SEP], fixed at ingest
    question_fraction: float = 1 / 3  # paper: about a third of the sentences are questions
    feature_noise: float = 0.5  # std of the Gaussian noise added to each object's prototype
    images_per_shard: int = 256
