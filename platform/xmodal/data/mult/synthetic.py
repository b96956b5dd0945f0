"""Learnable synthetic MulT data: three unaligned streams whose label needs two of them.

    python jobs/ingest.py mult-synthetic OUT [--num-samples N] [--seed S] [--text-dim D] ... [--overwrite]

Each clip has three sequences of different lengths and rates (defaults: text 3-6 "words",
audio 3x as many steps, vision 2x), no alignment between them:
- text: filler words from a fixed random vocabulary, plus ONE key word somewhere; the 2 x 3 key
  words carry a polarity (+/-) and an intensity (1, 2, 3);
- audio: noise; in half the clips an EVENT (a fixed pattern over 3 steps) at a random time;
- vision: noise; in half the clips a DISTRACTOR event (another pattern), unrelated to the label.

label = polarity(key word) x intensity(key word) x (+1 if the audio event happened else -1),
a sentiment score in {+-1, +-2, +-3} (plus optional noise), so

- text alone knows |label| but not its sign: at best MAE ~ mean |label| = 2, Acc2 ~ 50 %;
- audio alone knows the sign flip but not the polarity: Acc2 ~ 50 % as well;
- vision alone knows nothing;
- only a model that combines the key word (text) with the event (audio) can predict it.

The product is a parity problem: a small MulT sits on a plateau before it breaks out (the `small`
preset at lr 3e-3, batch 24: ~150-300 steps with 3-6 words, 250-450 with 6-12; d = 16: ~700).
`rule` offers controls: "text" or "audio" alone (learnt by the unimodal variant of that stream),
and "sum" (both modalities add up).

Imports numpy and pyarrow (through the store) only.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np

from xmodal.data.errors import StoreError
from xmodal.data.manifest import ensure_derived, options_diff, options_json
from xmodal.data.mult.store import KIND, MODALITIES, MultManifest, MultSplit, MultStore, write_store
from xmodal.data.options import EVENT_STEPS, SyntheticMultOptions

GENERATOR = "xmodal.data.mult.synthetic"


def _patterns(rng: np.random.Generator, dim: int, k: int) -> np.ndarray:
    p = rng.normal(size=(k, dim))
    return p / np.linalg.norm(p, axis=1, keepdims=True)


def generate(options: SyntheticMultOptions) -> dict[str, MultSplit]:
    """The corpus in memory, split train / valid / test (deterministic given the options)."""
    o = options
    o.check()
    rng = np.random.default_rng(o.seed)
    n = o.num_samples
    words = rng.normal(size=(o.vocab_size + 6, o.text_dim))  # fillers, then the 6 key words
    event, distractor = _patterns(rng, o.audio_dim, 1)[0], _patterns(rng, o.vision_dim, 1)[0]

    t_len = rng.integers(o.text_len[0], o.text_len[1] + 1, n)
    # Different rates, each with its own jitter: the streams are not aligned.
    a_len = np.maximum(EVENT_STEPS, np.round(t_len * o.audio_rate * rng.uniform(0.8, 1.2, n))).astype(np.int64)
    v_len = np.maximum(EVENT_STEPS, np.round(t_len * o.vision_rate * rng.uniform(0.8, 1.2, n))).astype(np.int64)
    key = rng.integers(0, 6, n)  # key word per clip
    has_event = rng.random(n) < 0.5
    has_distractor = rng.random(n) < 0.5

    def starts(lengths: np.ndarray) -> np.ndarray:
        return np.concatenate([[0], np.cumsum(lengths)[:-1]])

    # text
    word_ids = rng.integers(0, o.vocab_size, int(t_len.sum()))
    word_ids[starts(t_len) + (rng.random(n) * t_len).astype(np.int64)] = o.vocab_size + key
    text = words[word_ids] + 0.1 * rng.normal(size=(len(word_ids), o.text_dim))

    def stream(lengths, dim, pattern, present):
        x = o.noise * rng.normal(size=(int(lengths.sum()), dim))
        at = starts(lengths) + (rng.random(n) * (lengths - EVENT_STEPS + 1)).astype(np.int64)
        for k in range(EVENT_STEPS):
            x[at[present] + k] += o.event_strength * pattern
        return x

    audio = stream(a_len, o.audio_dim, event, has_event)
    vision = stream(v_len, o.vision_dim, distractor, has_distractor)

    polarity = np.where(key < 3, 1.0, -1.0)
    intensity = key % 3 + 1
    event_sign = np.where(has_event, 1.0, -1.0)
    label = {"product": polarity * intensity * event_sign, "text": polarity * intensity, "audio": 2.0 * event_sign,
             "sum": polarity * intensity / 2 + 1.5 * event_sign}[o.rule]
    if o.label_noise:
        label = np.clip(label + o.label_noise * rng.normal(size=n), -3, 3)

    values = {"text": text, "audio": audio, "vision": vision}
    lengths = {"text": t_len, "audio": a_len, "vision": v_len}
    order = rng.permutation(n)
    n_valid, n_test = max(1, int(n * o.valid_fraction)), max(1, int(n * o.test_fraction))
    parts = {"train": order[n_valid + n_test:], "valid": order[:n_valid], "test": order[n_valid:n_valid + n_test]}
    out = {}
    for name, rows in parts.items():
        rows = np.sort(rows)
        split_vals = {}
        for m in MODALITIES:
            st = starts(lengths[m])
            idx = np.concatenate([np.arange(st[r], st[r] + lengths[m][r]) for r in rows])
            split_vals[m] = values[m][idx].astype(np.float16)
        out[name] = MultSplit(
            name=name, ids=np.array([f"syn-{r:06d}" for r in rows], dtype=object),
            labels=label[rows].astype(np.float32), values=split_vals,
            lengths={m: lengths[m][rows].astype(np.int64) for m in MODALITIES},
        )
    return out


def build_synthetic_store(path: str | Path, options: SyntheticMultOptions | None = None, *,
                          overwrite: bool = False) -> MultStore:
    options = options or SyntheticMultOptions()
    return write_store(path, generate(options), dataset="synthetic", overwrite=overwrite,
                       source={"generator": GENERATOR, "options": dataclasses.asdict(options)})


def ensure_synthetic_store(path: str | Path, options: SyntheticMultOptions | None = None) -> MultStore:
    """The embedded synthetic MulT store at `path` (derived data, see `xmodal.data.manifest.ensure_derived`):
    built if missing, reused if built with these options, rebuilt (with a one-line note) if built with
    other options or its manifest is of an older format. A store ingested from pickles there is never
    replaced. For a store the user named, use `open_store` (it never modifies anything)."""
    o = options or SyntheticMultOptions()
    want = options_json(dataclasses.asdict(o))

    def stale(m: MultManifest) -> str | None:
        recorded = m.source.get("options")
        if m.dataset != "synthetic" or not isinstance(recorded, dict):
            raise StoreError(f"{path}: holds a MulT store of {m.dataset!r} ingested from {m.source.get('path', '?')}, "
                             "not the embedded synthetic store built here; it is not replaced: move it away, or "
                             "name it as the store to use")
        diff = options_diff(recorded, want)
        return f"built with other synthetic options ({'; '.join(diff)})" if diff else None

    return ensure_derived(path, kind=KIND, read=MultManifest.read, stale=stale, open_fn=MultStore.open,
                          build=lambda p, overwrite: build_synthetic_store(p, o, overwrite=overwrite),
                          what="the embedded synthetic MulT store")
