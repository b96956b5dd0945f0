"""Helpers for the data tests: input files in the exact reference TSV / JSON formats, written by the tests."""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from xmodal.data.options import SyntheticLxmertOptions

FEAT_DIM = 32
NUM_BOXES = 36


def b64(a: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(a).tobytes()).decode("ascii")


@dataclass
class RefImage:
    """One image as the reference TSV holds it (float32 features, pixel boxes, int64 ids)."""

    img_id: str
    img_h: int
    img_w: int
    obj_ids: np.ndarray
    obj_conf: np.ndarray
    attr_ids: np.ndarray
    attr_conf: np.ndarray
    boxes: np.ndarray  # (n, 4) pixels
    features: np.ndarray  # (n, F) float32

    def fields(self) -> list[str]:
        n = len(self.obj_ids)
        return [self.img_id, str(self.img_h), str(self.img_w), b64(self.obj_ids.astype(np.int64)),
                b64(self.obj_conf.astype(np.float32)), b64(self.attr_ids.astype(np.int64)),
                b64(self.attr_conf.astype(np.float32)), str(n), b64(self.boxes.astype(np.float32)),
                b64(self.features.astype(np.float32))]

    def line(self) -> str:
        return "\t".join(self.fields()) + "\n"


def ref_image(rng: np.random.Generator, img_id: str, n: int = NUM_BOXES, feat_dim: int = FEAT_DIM) -> RefImage:
    h, w = int(rng.integers(200, 640)), int(rng.integers(200, 640))
    x1 = rng.uniform(0, w * 0.8, n)
    y1 = rng.uniform(0, h * 0.8, n)
    x2 = x1 + rng.uniform(1, w - x1)
    y2 = y1 + rng.uniform(1, h - y1)
    return RefImage(img_id=img_id, img_h=h, img_w=w, obj_ids=rng.integers(0, 1600, n),
                    obj_conf=rng.uniform(0, 1, n).astype(np.float32), attr_ids=rng.integers(0, 400, n),
                    attr_conf=rng.uniform(0, 1, n).astype(np.float32),
                    boxes=np.stack([x1, y1, x2, y2], 1).astype(np.float32),
                    features=(rng.gamma(1.0, 1.0, (n, feat_dim)) * rng.choice([0, 1], (n, feat_dim))).astype(np.float32))


WORDS = ["man", "woman", "dog", "horse", "street", "table", "red", "small", "riding", "sitting", "on", "the",
         "next", "to", "with", "umbrella", "pizza", "plate", "green", "field"]
ANSWERS = ["yes", "no", "2", "red", "dog", "pizza", "gray", "3"]
RAW = {"2": "two", "red": "The red."}


@dataclass
class RefCorpus:
    tsv: list[Path]
    json: list[Path]
    images: dict[str, RefImage]
    sentences: dict[str, list[str]]  # img_id -> sentences in file order
    labels: dict[str, list[dict | None]]  # img_id -> label per sentence (None for captions)
    extra: dict = field(default_factory=dict)


def write_reference(directory: Path, num_images: int = 24, seed: int = 0, feat_dim: int = FEAT_DIM) -> RefCorpus:
    """Two TSV files and two JSON files in the exact reference formats."""
    rng = np.random.default_rng(seed)
    directory.mkdir(parents=True, exist_ok=True)
    images = {f"COCO_{i:06d}": ref_image(rng, f"COCO_{i:06d}", feat_dim=feat_dim) for i in range(num_images)}
    ids = list(images)
    tsv = [directory / "a.tsv", directory / "b.tsv"]
    half = num_images // 2
    for path, part in ((tsv[0], ids[:half]), (tsv[1], ids[half:])):
        path.write_text("".join(images[i].line() for i in part))
    sentences: dict[str, list[str]] = {}
    labels: dict[str, list[dict | None]] = {}
    records = [[], []]
    for k, img_id in enumerate(ids):
        caps = [" ".join(rng.choice(WORDS, int(rng.integers(3, 9)))) + "." for _ in range(int(rng.integers(1, 4)))]
        qs = [f"is the {rng.choice(WORDS)} {rng.choice(WORDS)}?" for _ in range(int(rng.integers(0, 3)))]
        labs = []
        for _ in qs:
            answers = rng.choice(ANSWERS, int(rng.integers(1, 4)), replace=False)
            # Raw spellings that normalise to the table's: "two" -> "2", "The red." -> "red".
            labs.append({RAW.get(str(a), str(a)): round(float(rng.uniform(0.1, 1.0)), 2) for a in answers})
        rec = {"img_id": img_id, "sentf": {"mscoco": caps, "vqa": qs}, "labelf": {"vqa": labs}}
        records[k % 2].append(rec)
        sentences[img_id] = caps + qs
        labels[img_id] = [None] * len(caps) + [{k2: v for k2, v in lab.items()} for lab in labs]
    js = [directory / "mscoco_train.json", directory / "vqa_train.json"]
    for path, recs in zip(js, records, strict=True):
        path.write_text(json.dumps(recs))
    return RefCorpus(tsv=tsv, json=js, images=images, sentences=sentences, labels=labels)

# A small synthetic corpus for the read-only tests (session-scoped store in conftest.py).
SMALL = SyntheticLxmertOptions(num_images=400, num_objects=12, feat_dim=16, num_object_labels=40,
                               num_attr_labels=8, num_answers=60, sentences_per_image=6, images_per_shard=64,
                               question_fraction=0.5)


def read_images(store) -> dict[str, np.ndarray]:
    """Every image of an LXMERT or feature-only store as numpy arrays (what a test wrote, read back):
    an LXMERT store's named like `rows.IMAGE_FIELDS`, a feature store's by column."""
    import pyarrow as pa

    from xmodal.data.lxmert.rows import IMAGE_FIELDS, table_to_block
    from xmodal.data.lxmert.store import LxmertStore

    t = pa.concat_tables([store.read_table(f) for f in store.image_files()])
    if isinstance(store, LxmertStore):
        b = table_to_block(t)
        return {name: getattr(b, name) for name in IMAGE_FIELDS}
    out: dict[str, np.ndarray] = {}
    for name in t.column_names:
        col = t.column(name)
        if isinstance(col.type, pa.FixedShapeTensorType):
            parts = [c.to_numpy_ndarray() for c in col.chunks]
            out[name] = parts[0] if len(parts) == 1 else np.concatenate(parts)
        else:
            out[name] = col.to_numpy(zero_copy_only=False)
    return out
