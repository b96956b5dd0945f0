"""MulT sentiment pickles (reference or MMSA format) -> a MulT store.

    python jobs/ingest.py mult OUT --pickle PATH --format reference|mmsa [--dataset mosi|mosei|iemocap]
                                   [--overwrite] [--shard-rows N]

Formats (docs/papers.md#mult-data-formats):
- reference (yaohungt/Multimodal-Transformer, `{mosi,mosei_senti,iemocap}_data[_noalign].pkl`):
  {train, valid, test} -> {"text" [N, T_l, 300], "audio" [N, T_a, d_a], "vision" [N, T_v, d_v],
  "labels" [N, 1, 1] sentiment or [N, 4, 2] one-hot (IEMOCAP), "id"}; sequences zero-padded at
  the FRONT: the true length is what follows the leading all-zero steps. Audio may hold -inf.
- mmsa (thuiar/MMSA): {train, valid, test} -> {"raw_text", "text", "audio", "vision",
  "audio_lengths", "vision_lengths", "regression_labels", "id"}; padded at the END; text length
  = up to the last non-zero step.

Non-finite feature values (the reference's audio -inf, any NaN) become 0 and values beyond
float16's range are clipped to it; both are counted in the manifest's `stats`. A clip whose
sequence is empty keeps one zero step (length 1), also counted.

Pickle files execute code when loaded: they are read with an unpickler that admits only numpy
arrays, numpy dtypes / scalars and plain containers; anything else (os.system, a class from
some module) is refused with an error naming the file and the global it asked for. Everything
is converted in memory first and written through `write_store` (temporary directory renamed
into place): a failure leaves nothing behind (an empty output folder the user made stays).
Labels must be finite: a NaN or inf label is an error naming the file, split, key and row; an
IEMOCAP pair must be one-hot ([1, 0] or [0, 1]), as the reference's argmax takes it to be.
Every split needs at least one clip, and every feature array at least one time step and one
feature, the same width in every split; clip ids (where the pickle has them) must be unique
across all splits: each of these is an error naming the file before anything is written.
"""

from __future__ import annotations

import hashlib
import pickle
from pathlib import Path
from typing import Any

import numpy as np

from xmodal.base.errors import UserError
from xmodal.data.atomic import check_target, local_target
from xmodal.data.mult.store import (
    DEFAULT_SHARD_ROWS,
    EMOTIONS,
    KIND,
    MODALITIES,
    SPLITS,
    MultSplit,
    write_store,
)

FORMATS = ("reference", "mmsa")
DATASETS = ("mosi", "mosei", "iemocap")
F16_MAX = float(np.finfo(np.float16).max)
# What each key of a split holds, for the error when it is not a rectangular array.
SHAPES = {**dict.fromkeys(MODALITIES, "(N, T, D)"), "labels": "(N, 1, 1) or (N, 4, 2)",
          "regression_labels": "(N,)", "audio_lengths": "(N,)", "vision_lengths": "(N,)"}


class MultIngestError(UserError):
    """Bad MulT input: the message names the file, the key and what was expected (the LXMERT
    ingest's is `lxmert.tsv.IngestError`)."""


# ============================================================================ safe unpickling

# (module, name) pairs a numpy-array pickle needs, for numpy 1.x and 2.x module paths.
ALLOWED_GLOBALS: frozenset[tuple[str, str]] = frozenset({
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"), ("numpy._core.multiarray", "scalar"),
    ("numpy.core.numeric", "_frombuffer"), ("numpy._core.numeric", "_frombuffer"),
    ("numpy", "ndarray"), ("numpy", "dtype"),
    ("_codecs", "encode"),  # how Python 3 writes bytes in protocol 2 (numpy array buffers)
    ("collections", "OrderedDict"),
    ("builtins", "set"), ("builtins", "frozenset"), ("builtins", "bytearray"), ("builtins", "complex"),
    ("builtins", "list"), ("builtins", "dict"), ("builtins", "tuple"),
})


class RestrictedUnpickler(pickle.Unpickler):
    """Unpickles numpy arrays and plain containers only; refuses every other global."""

    def __init__(self, file, where: str):
        super().__init__(file, encoding="latin1")  # latin1: numpy arrays pickled by Python 2
        self.where = where

    def find_class(self, module: str, name: str):
        if (module, name) in ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise MultIngestError(f"{self.where}: refused to unpickle global {module}.{name}: only numpy arrays, "
                              "dtypes and plain containers are allowed (a pickle can run code when loaded)")

    def persistent_load(self, pid):
        raise MultIngestError(f"{self.where}: refused a persistent id in the pickle; expected plain data")


def safe_load(path: str | Path) -> Any:
    path = Path(path)
    if path.is_dir():
        raise MultIngestError(f"{path}: is a directory; expected the dataset pickle file (--pickle)")
    if not path.is_file():
        raise MultIngestError(f"{path}: no such file (--pickle)")
    with open(path, "rb") as f:
        try:
            return RestrictedUnpickler(f, str(path)).load()
        except MultIngestError:
            raise
        except Exception as e:  # truncated or not a pickle at all
            raise MultIngestError(f"{path}: not a readable pickle ({type(e).__name__}: {e})") from e


# ============================================================================ conversion


class _Stats:
    def __init__(self):
        self.nonfinite = dict.fromkeys(MODALITIES, 0)
        self.clipped = dict.fromkeys(MODALITIES, 0)
        self.empty = dict.fromkeys(MODALITIES, 0)

    def as_dict(self) -> dict[str, Any]:
        return {"nonfinite_replaced_by_0": self.nonfinite, "clipped_to_float16": self.clipped,
                "empty_sequences_given_one_zero_step": self.empty}


def _array(d: dict, key: str, where: str, ndim: int | None = None, n: int | None = None) -> np.ndarray:
    if key not in d:
        raise MultIngestError(f"{where}: no key {key!r}; the split has {sorted(map(str, d))}")
    try:
        a = np.asarray(d[key])
    except ValueError:  # nested lists of unequal lengths
        raise MultIngestError(f"{where}[{key!r}]: not a rectangular array (rows of different lengths); "
                              f"expected shape {SHAPES.get(key, '(N, ...)')}") from None
    if ndim is not None and a.ndim != ndim:
        raise MultIngestError(f"{where}[{key!r}]: shape {a.shape}; expected {ndim} dimensions")
    if n is not None and a.ndim == 0:
        raise MultIngestError(f"{where}[{key!r}]: a single value {a.item()!r}; expected {n} rows like 'text'")
    if n is not None and a.shape[0] != n:
        raise MultIngestError(f"{where}[{key!r}]: {a.shape[0]} rows; expected {n} like 'text'")
    return a


def _labels(labels: np.ndarray, key: str, where: str) -> np.ndarray:
    """Labels as float32, every one finite: a NaN or inf target would train on garbage (unlike a
    non-finite feature, which is padding in the reference's audio and is replaced by 0)."""
    try:
        labels = labels.astype(np.float32)
    except (TypeError, ValueError):
        raise MultIngestError(f"{where}[{key!r}]: dtype {labels.dtype}, not numbers; expected finite labels") from None
    bad = np.flatnonzero(~np.isfinite(labels.reshape(len(labels), -1)).all(axis=1))
    if len(bad):
        row = int(bad[0])
        raise MultIngestError(f"{where}[{key!r}][{row}] = {labels[row].ravel().tolist()}: row {row} has a non-finite "
                              f"label; expected finite labels ({len(bad)} row(s) of the split are not)")
    return labels


def _emotions(labels: np.ndarray, where: str) -> np.ndarray:
    """IEMOCAP [N, 4, 2] one-hot pairs -> (N, 4) class per emotion (the reference's argmax). A pair
    that is not [1, 0] or [0, 1] (all zeros, both set, soft) has no class: argmax would make it 0."""
    onehot = ((labels == 0) | (labels == 1)).all(-1) & (labels.sum(-1) == 1)  # (N, 4)
    if not onehot.all():
        i, e = (int(k) for k in np.argwhere(~onehot)[0])
        raise MultIngestError(f"{where}['labels'][{i}][{e}] = {labels[i, e].tolist()}: clip {i}, emotion "
                              f"{EMOTIONS[e]!r} is not one-hot; expected a one-hot pair ([1, 0] or [0, 1]) "
                              f"({int((~onehot).sum())} pair(s) of the split are not)")
    return labels.argmax(-1).astype(np.int64)


def _clean(x: np.ndarray, modality: str, stats: _Stats, where: str) -> np.ndarray:
    if x.dtype.kind not in "fiu":
        raise MultIngestError(f"{where}[{modality!r}]: dtype {x.dtype}; expected numbers")
    x = x.astype(np.float32, copy=True)
    bad = ~np.isfinite(x)
    if bad.any():
        stats.nonfinite[modality] += int(bad.sum())
        x[bad] = 0.0
    big = np.abs(x) > F16_MAX
    if big.any():
        stats.clipped[modality] += int(big.sum())
        np.clip(x, -F16_MAX, F16_MAX, out=x)
    return x


def _front_lengths(x: np.ndarray) -> np.ndarray:
    """True lengths of front-padded (N, T, F) sequences: T minus the leading all-zero steps."""
    nz = (x != 0).any(axis=2)  # (N, T)
    return np.where(nz.any(1), x.shape[1] - nz.argmax(1), 0)


def _end_lengths(x: np.ndarray) -> np.ndarray:
    """True lengths of end-padded (N, T, F) sequences: up to the last step that is not all zero."""
    nz = (x != 0).any(axis=2)
    return np.where(nz.any(1), x.shape[1] - nz[:, ::-1].argmax(1), 0)


def _pack(x: np.ndarray, lengths: np.ndarray, front: bool, modality: str, stats: _Stats) -> tuple[np.ndarray, np.ndarray]:
    """Padded (N, T, F) -> packed (sum(lengths), F) float16; empty sequences keep one zero step."""
    t = x.shape[1]
    lengths = lengths.astype(np.int64)
    empty = lengths == 0
    stats.empty[modality] += int(empty.sum())
    lengths = np.maximum(lengths, 1)
    pos = np.arange(t)[None, :]
    keep = pos >= (t - lengths)[:, None] if front else pos < lengths[:, None]
    return x[keep].astype(np.float16), lengths


def _ids(d: dict, n: int, split: str, where: str) -> np.ndarray:
    if "id" not in d:
        return np.array([f"{split}-{i}" for i in range(n)], dtype=object)
    raw = d["id"]

    def text(v) -> str:
        if isinstance(v, bytes):
            return v.decode("utf-8", "replace")
        if isinstance(v, np.ndarray) and v.ndim > 0 or isinstance(v, list | tuple):
            return "_".join(text(u) for u in (v.tolist() if isinstance(v, np.ndarray) else v))
        if isinstance(v, np.ndarray):
            return text(v.item())
        return str(v)

    ids = [text(v) for v in (raw if not isinstance(raw, np.ndarray) or raw.ndim else [raw.item()])]
    if len(ids) != n:
        raise MultIngestError(f"{where}['id']: {len(ids)} ids for {n} clips; expected one id per clip")
    return np.array(ids, dtype=object)


def _check_splits(data: Any, where: str) -> None:
    if not isinstance(data, dict):
        raise MultIngestError(f"{where}: top level is {type(data).__name__}; expected a dict of splits {list(SPLITS)}")
    missing = [s for s in SPLITS if s not in data]
    if missing:
        raise MultIngestError(f"{where}: no split {missing[0]!r}; the pickle has {sorted(map(str, data))}, "
                              f"expected {list(SPLITS)}")


def _split(data: dict, split: str, where: str, expected: str) -> tuple[dict, str]:
    """One split of a checked pickle (`_check_splits`) and its place for errors; a dict of `expected`."""
    d, w = data[split], f"{where}[{split!r}]"
    if not isinstance(d, dict):
        raise MultIngestError(f"{w}: {type(d).__name__}; expected a dict with {expected}")
    return d, w


def _modalities(d: dict, w: str) -> tuple[dict[str, np.ndarray], int]:
    """A split's three feature arrays ([N, T, D] each, N the text's) and N."""
    text = _array(d, "text", w, 3)
    n = text.shape[0]
    if n == 0:
        raise MultIngestError(f"{w}: holds no clips ('text' has shape {text.shape}); expected at least one")
    raw = {"text": text, "audio": _array(d, "audio", w, 3, n), "vision": _array(d, "vision", w, 3, n)}
    for m, x in raw.items():
        # An empty clip keeps one zero step (`_pack`), but an array with no step or no feature at all
        # is not a modality: the model's projections need a width >= 1.
        if x.shape[1] == 0:
            raise MultIngestError(f"{w}[{m!r}]: shape {x.shape}, T = 0; expected at least one time step")
        if x.shape[2] == 0:
            raise MultIngestError(f"{w}[{m!r}]: shape {x.shape}, width 0; expected a feature width >= 1")
    return raw, n


def _check_across_splits(splits: dict[str, MultSplit], where: str) -> None:
    """What the store needs of the splits together: one width per modality, one task, and clip ids
    that name one clip each (a clip in two splits, say train and test, would leak)."""
    for m in MODALITIES:
        widths = {s: sp.dims()[m] for s, sp in splits.items()}
        if len(set(widths.values())) > 1:
            raise MultIngestError(f"{where}: the splits' {m} widths differ ({m} width: "
                                  f"{', '.join(f'{s} {v}' for s, v in widths.items())}); expected one width")
    tasks = {s: sp.task for s, sp in splits.items()}
    if len(set(tasks.values())) > 1:
        kinds = ", ".join(f"{s} {t}" for s, t in tasks.items())
        raise MultIngestError(f"{where}: the splits' labels differ in kind ({kinds}); "
                              "expected [N, 1, 1] sentiment or [N, 4, 2] IEMOCAP emotions in every split")
    seen: dict[str, tuple[str, int]] = {}
    for s, sp in splits.items():
        for i, clip in enumerate(sp.ids.tolist()):
            if clip in seen:
                s0, i0 = seen[clip]
                raise MultIngestError(f"{where}: clip id {clip!r} occurs twice, at [{s0!r}]['id'][{i0}] and "
                                      f"[{s!r}]['id'][{i}]; expected each clip id once across all splits")
            seen[clip] = (s, i)


def from_reference(data: Any, where: str) -> tuple[dict[str, MultSplit], _Stats]:
    stats, out = _Stats(), {}
    _check_splits(data, where)
    for split in SPLITS:
        d, w = _split(data, split, where, "text, audio, vision, labels")
        raw, n = _modalities(d, w)
        labels = _labels(_array(d, "labels", w, None, n), "labels", w)
        if labels.size == n:
            labels = labels.reshape(n).astype(np.float32)
        elif labels.shape[1:] == (4, 2):
            labels = _emotions(labels, w)  # one-hot -> class per emotion (reference dataset.py)
        else:
            raise MultIngestError(f"{w}['labels']: shape {labels.shape}; expected [N, 1, 1] (sentiment) or "
                                  "[N, 4, 2] (IEMOCAP one-hot)")
        values, lengths = {}, {}
        for m in MODALITIES:
            x = _clean(raw[m], m, stats, w)
            values[m], lengths[m] = _pack(x, _front_lengths(x), True, m, stats)
        out[split] = MultSplit(split, _ids(d, n, split, w), labels, values, lengths)
    _check_across_splits(out, where)
    return out, stats


def from_mmsa(data: Any, where: str) -> tuple[dict[str, MultSplit], _Stats]:
    stats, out = _Stats(), {}
    _check_splits(data, where)
    for split in SPLITS:
        d, w = _split(data, split, where, "text, audio, vision, ...")
        if "text" not in d and "text_bert" in d:
            raise MultIngestError(f"{w}: only 'text_bert' (BERT token ids); this ingest needs 'text' features")
        raw, n = _modalities(d, w)
        labels = _labels(_array(d, "regression_labels", w, None, n), "regression_labels", w)
        if labels.size != n:
            raise MultIngestError(f"{w}['regression_labels']: shape {labels.shape}; expected one score per clip")
        values, lengths = {}, {}
        for m in MODALITIES:
            x = _clean(raw[m], m, stats, w)
            if m == "text":
                lens = _end_lengths(x)
            else:
                key = f"{m}_lengths"
                lens = _array(d, key, w, None, n)
                if lens.size != n:
                    raise MultIngestError(f"{w}[{key!r}]: shape {lens.shape}; expected one length per clip ({n})")
                lens = lens.reshape(n)
                if lens.dtype.kind not in "iuf":
                    raise MultIngestError(f"{w}[{key!r}]: dtype {lens.dtype}; expected integers in [0, {x.shape[1]}]")
                with np.errstate(invalid="ignore"):
                    wrong = ~np.isfinite(lens) | (lens != np.round(lens)) | (lens < 0) | (lens > x.shape[1]) \
                        if lens.dtype.kind == "f" else (lens < 0) | (lens > x.shape[1])
                if wrong.any():
                    i = int(np.flatnonzero(wrong)[0])
                    raise MultIngestError(f"{w}[{key!r}][{i}] = {lens[i].item()!r}; expected an integer in "
                                          f"[0, {x.shape[1]}]")
                lens = lens.astype(np.int64)
            values[m], lengths[m] = _pack(x, lens, False, m, stats)
        out[split] = MultSplit(split, _ids(d, n, split, w), labels.reshape(n).astype(np.float32), values, lengths)
    _check_across_splits(out, where)
    return out, stats


def _infer_dataset(path: Path, splits: dict[str, MultSplit]) -> str:
    if splits["train"].task == "emotions":
        return "iemocap"
    name = path.name.lower()
    for d in DATASETS:
        if d in name:
            return d
    return "unknown"


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def ingest(out: str | Path, pickle_path: str | Path, fmt: str, dataset: str | None = None, *,
           overwrite: bool = False, shard_rows: int = DEFAULT_SHARD_ROWS):
    """Convert one pickle into a store at `out`; returns the opened MultStore."""
    out, pickle_path = local_target(out), Path(pickle_path).expanduser()
    if fmt not in FORMATS:
        raise MultIngestError(f"--format {fmt!r}; expected one of {list(FORMATS)}")
    if dataset is not None and dataset not in DATASETS:
        raise MultIngestError(f"--dataset {dataset!r}; expected one of {list(DATASETS)}")
    if shard_rows < 1:
        raise MultIngestError(f"--shard-rows {shard_rows}: expected >= 1 clips per shard")
    check_target(out, overwrite, KIND)  # before the (possibly long) load
    data = safe_load(pickle_path)
    splits, stats = (from_reference if fmt == "reference" else from_mmsa)(data, str(pickle_path))
    task = splits["train"].task
    if dataset == "iemocap" and task != "emotions":
        raise MultIngestError(f"{pickle_path}: --dataset iemocap but the labels are sentiment scores; expected [N, 4, 2]")
    if dataset in ("mosi", "mosei") and task != "sentiment":
        raise MultIngestError(f"{pickle_path}: --dataset {dataset} but the labels are IEMOCAP emotions")
    dataset = dataset or _infer_dataset(pickle_path, splits)
    source = {"format": fmt, "path": str(pickle_path.resolve()), "bytes": pickle_path.stat().st_size,
              "sha256": _sha256(pickle_path)}
    return write_store(out, splits, dataset=dataset, source=source, overwrite=overwrite, shard_rows=shard_rows,
                       stats=stats.as_dict())
