"""MulT pickle ingest: reference (front padding) and MMSA (end padding) fixtures written here,
round-tripped through the store; a malicious pickle refused with nothing written."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import numpy as np
import pytest

from xmodal.cli.ingest import main as ingest_main
from xmodal.data.mult.ingest import MultIngestError, ingest, safe_load
from xmodal.data.mult.store import MODALITIES, MultStore

DIMS = {"text": 6, "audio": 4, "vision": 3}
PAD = {"text": 7, "audio": 11, "vision": 9}


def _sequences(n: int, seed: int) -> dict[str, list[np.ndarray]]:
    """Unpadded sequences with no all-zero step at either end (so the padding is unambiguous)."""
    rng = np.random.default_rng(seed)
    out = {}
    for m in MODALITIES:
        lens = rng.integers(1, PAD[m] + 1, n)
        lens[0] = PAD[m]  # one full-length clip
        out[m] = [rng.uniform(0.1, 1.0, (t, DIMS[m])) * rng.choice([-1, 1], (t, DIMS[m])) for t in lens]
    return out


def _pad(seqs: list[np.ndarray], t: int, front: bool) -> np.ndarray:
    out = np.zeros((len(seqs), t, seqs[0].shape[1]), np.float32)
    for i, s in enumerate(seqs):
        if front:
            out[i, t - len(s):] = s
        else:
            out[i, :len(s)] = s
    return out


def _reference_pickle(path: Path, emotions: bool = False) -> dict:
    truth, data = {}, {}
    for k, split in enumerate(("train", "valid", "test")):
        n = 5 + k
        seqs = _sequences(n, k)
        arrays = {m: _pad(seqs[m], PAD[m], front=True) for m in MODALITIES}
        arrays["audio"][1, -1, 2] = -np.inf  # the reference's audio holds -inf: becomes 0
        seqs["audio"][1][-1, 2] = 0.0
        rng = np.random.default_rng(10 + k)
        if emotions:
            cls = rng.integers(0, 2, (n, 4))
            labels = np.eye(2, dtype=np.float32)[cls]  # [N, 4, 2] one-hot
            want = cls
        else:
            labels = rng.uniform(-3, 3, (n, 1, 1)).astype(np.float32)
            want = labels.reshape(n)
        ids = np.array([[f"vid{k}{i}".encode(), b"0", b"1"] for i in range(n)])  # MOSI-style [N, 3] bytes
        data[split] = {**arrays, "labels": labels, "id": ids}
        truth[split] = (seqs, want, [f"vid{k}{i}_0_1" for i in range(n)])
    path.write_bytes(pickle.dumps(data, protocol=4))
    return truth


def _mmsa_pickle(path: Path) -> dict:
    truth, data = {}, {}
    for k, split in enumerate(("train", "valid", "test")):
        n = 4 + k
        seqs = _sequences(n, 20 + k)
        seqs["vision"][2] = np.zeros((0, DIMS["vision"]))  # an empty sequence: kept as one zero step
        arrays = {m: _pad(seqs[m], PAD[m], front=False) for m in MODALITIES}
        labels = np.random.default_rng(k).uniform(-3, 3, n).astype(np.float32)
        data[split] = {
            "raw_text": np.array([f"words {i}" for i in range(n)], dtype=object), **arrays,
            "audio_lengths": [len(s) for s in seqs["audio"]], "vision_lengths": np.array([len(s) for s in seqs["vision"]]),
            "regression_labels": labels, "id": np.array([f"clip{k}$_${i}" for i in range(n)], dtype=object),
        }
        seqs["vision"][2] = np.zeros((1, DIMS["vision"]))
        truth[split] = (seqs, labels, [f"clip{k}$_${i}" for i in range(n)])
    path.write_bytes(pickle.dumps(data, protocol=2))
    return truth


def _check(store: MultStore, truth: dict) -> None:
    assert store.dims == DIMS
    for split, (seqs, labels, ids) in truth.items():
        sp = store.split(split)
        assert sp.ids.tolist() == ids
        np.testing.assert_allclose(sp.labels, labels, rtol=1e-6)
        for m in MODALITIES:
            assert sp.lengths[m].tolist() == [len(s) for s in seqs[m]], (split, m)
            for i, s in enumerate(seqs[m]):
                np.testing.assert_array_equal(getattr(sp.batch([i]), m)[0].numpy(), s.astype(np.float16))


def test_reference_round_trip(tmp_path: Path):
    pkl = tmp_path / "mosei_senti_data_noalign.pkl"
    truth = _reference_pickle(pkl)
    store = ingest(tmp_path / "store", pkl, "reference")
    _check(store, truth)
    m = store.manifest
    assert (m.dataset, m.task, m.source["format"]) == ("mosei", "sentiment", "reference")
    assert m.stats["nonfinite_replaced_by_0"]["audio"] == 3  # one -inf per split
    assert len(m.source["sha256"]) == 64


def test_reference_iemocap_labels(tmp_path: Path):
    pkl = tmp_path / "iemocap_data_noalign.pkl"
    truth = _reference_pickle(pkl, emotions=True)
    store = ingest(tmp_path / "store", pkl, "reference")
    assert (store.manifest.dataset, store.task) == ("iemocap", "emotions")
    _check(store, truth)
    with pytest.raises(MultIngestError, match="--dataset mosi but the labels are IEMOCAP emotions"):
        ingest(tmp_path / "other", pkl, "reference", "mosi")


def test_mmsa_round_trip_through_the_cli(tmp_path: Path, capsys):
    pkl = tmp_path / "unaligned_50.pkl"
    truth = _mmsa_pickle(pkl)
    out = tmp_path / "store"
    assert ingest_main(["mult", str(out), "--pickle", str(pkl), "--format", "mmsa", "--dataset", "mosi"]) == 0
    assert "wrote" in capsys.readouterr().out
    store = MultStore.open(out)
    _check(store, truth)
    assert store.manifest.stats["empty_sequences_given_one_zero_step"]["vision"] == 3
    # An existing store is kept unless --overwrite.
    assert ingest_main(["mult", str(out), "--pickle", str(pkl), "--format", "mmsa"]) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert ingest_main(["mult", str(out), "--pickle", str(pkl), "--format", "mmsa", "--overwrite"]) == 0


class _Evil:
    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_malicious_pickle_is_refused_and_nothing_is_written(tmp_path: Path, capsys):
    marker = tmp_path / "pwned"
    pkl = tmp_path / "evil.pkl"
    pkl.write_bytes(pickle.dumps({"train": {"text": _Evil(marker)}}))
    out = tmp_path / "deep" / "store"
    code = ingest_main(["mult", str(out), "--pickle", str(pkl), "--format", "reference"])
    err = capsys.readouterr().err
    assert code == 2
    assert str(pkl) in err and "refused to unpickle global" in err and "system" in err
    assert not marker.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["evil.pkl"]  # no store, no temp dir, no parent
    with pytest.raises(MultIngestError, match=r"refused to unpickle global builtins\.eval"):
        pkl.write_bytes(pickle.dumps(eval))
        safe_load(pkl)


def test_bad_inputs_name_file_and_key(tmp_path: Path):
    pkl = tmp_path / "x.pkl"
    pkl.write_bytes(pickle.dumps({"train": {}, "valid": {}, "test": {}}))
    with pytest.raises(MultIngestError, match=r"x.pkl\['train'\]: no key 'text'"):
        ingest(tmp_path / "s", pkl, "reference")
    pkl.write_bytes(pickle.dumps({"train": {}}))
    with pytest.raises(MultIngestError, match="no split 'valid'"):
        ingest(tmp_path / "s", pkl, "mmsa")
    pkl.write_bytes(b"not a pickle")
    with pytest.raises(MultIngestError, match="not a readable pickle"):
        ingest(tmp_path / "s", pkl, "reference")
    with pytest.raises(MultIngestError, match="no such file"):
        ingest(tmp_path / "s", tmp_path / "missing.pkl", "reference")
    mmsa = tmp_path / "m.pkl"
    _mmsa_pickle(mmsa)
    data = safe_load(mmsa)
    data["valid"]["audio_lengths"][1] = 99
    mmsa.write_bytes(pickle.dumps(data))
    with pytest.raises(MultIngestError, match=r"\['valid'\]\['audio_lengths'\]\[1\] = 99; expected an integer in \[0, 11\]"):
        ingest(tmp_path / "s", mmsa, "mmsa")
    assert not (tmp_path / "s").exists()


# Bad inputs through the CLI: (format, IEMOCAP labels, edit of the loaded pickle, what the one error line
# names). Each starts from a good fixture pickle, so the edit is the only thing wrong with it.
def _no_clips(data):
    data["train"] = {"text": np.zeros((0, 5, 6)), "audio": np.zeros((0, 5, 4)), "vision": np.zeros((0, 5, 3)),
                     "labels": np.zeros((0, 1, 1))}


def _no_steps(split, m):
    def edit(data):
        data[split][m] = np.zeros((len(data[split][m]), 0, DIMS[m]), np.float32)
    return edit


def _zero_width_vision(data):
    for split in ("train", "valid", "test"):
        data[split]["vision"] = np.zeros((len(data[split]["vision"]), PAD["vision"], 0), np.float32)


def _ragged_text(data):
    data["train"]["text"] = [t[k:].tolist() for k, t in enumerate(data["train"]["text"])]  # T 7, 6, 5, ...


def _repeated_id_in_train(data):
    data["train"]["id"][3] = data["train"]["id"][1]


def _train_id_again_in_valid(data):
    data["valid"]["id"][0] = data["train"]["id"][2]


def _pair(split, i, e, pair):
    def edit(data):
        data[split]["labels"][i, e] = pair
    return edit


def _wider_train_text(data):
    data["train"]["text"] = np.pad(data["train"]["text"], ((0, 0), (0, 0), (0, 1)))  # zeros: padding stays padding


def _emotions_in_valid(data):
    data["valid"]["labels"] = np.eye(2, dtype=np.float32)[np.zeros((6, 4), np.int64)]


BAD = {
    "split-without-clips": ("reference", False, _no_clips, ["['train']: holds no clips", "(0, 5, 6)",
                                                           "expected at least one"]),
    "audio-without-time-steps": ("reference", False, _no_steps("valid", "audio"),
                                 ["['valid']['audio']: shape (6, 0, 4), T = 0", "expected at least one time step"]),
    "mmsa-text-without-time-steps": ("mmsa", False, _no_steps("test", "text"),
                                     ["['test']['text']: shape (6, 0, 6), T = 0", "at least one time step"]),
    "vision-width-0": ("reference", False, _zero_width_vision,
                       ["['train']['vision']: shape (5, 9, 0), width 0", "expected a feature width >= 1"]),
    "ragged-text": ("reference", False, _ragged_text,
                    ["['train']['text']: not a rectangular array", "expected shape (N, T, D)"]),
    "id-twice-in-train": ("reference", False, _repeated_id_in_train,
                          ["clip id 'vid01_0_1' occurs twice", "['train']['id'][1]", "['train']['id'][3]"]),
    "id-in-train-and-valid": ("mmsa", False, _train_id_again_in_valid,
                              ["clip id 'clip0$_$2' occurs twice", "['train']['id'][2]", "['valid']['id'][0]"]),
    "iemocap-pair-all-zero": ("reference", True, _pair("test", 2, 1, [0, 0]),
                              ["['test']['labels'][2][1] = [0.0, 0.0]", "clip 2, emotion 'happy'",
                               "expected a one-hot pair ([1, 0] or [0, 1])"]),
    "iemocap-pair-both-set": ("reference", True, _pair("train", 0, 3, [1, 1]),
                              ["['train']['labels'][0][3] = [1.0, 1.0]", "emotion 'angry'", "one-hot pair"]),
    "iemocap-pair-soft": ("reference", True, _pair("valid", 4, 0, [0.5, 0.5]),
                          ["['valid']['labels'][4][0] = [0.5, 0.5]", "emotion 'neutral'", "one-hot pair"]),
    "text-width-differs-in-train": ("reference", False, _wider_train_text,
                                    ["text width: train 7, valid 6, test 6", "expected one width"]),
    "labels-differ-in-kind": ("reference", False, _emotions_in_valid,
                              ["train sentiment, valid emotions, test sentiment"]),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_pickle_is_one_error_naming_it_and_nothing_is_written(tmp_path: Path, capsys, case: str):
    fmt, emotions, edit, names = BAD[case]
    pkl = tmp_path / "clips.pkl"
    _reference_pickle(pkl, emotions) if fmt == "reference" else _mmsa_pickle(pkl)
    data = safe_load(pkl)
    edit(data)
    pkl.write_bytes(pickle.dumps(data, protocol=4))
    code = ingest_main(["mult", str(tmp_path / "out"), "--pickle", str(pkl), "--format", fmt])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("error: ") and len(err.strip().splitlines()) == 1, err
    for name in [str(pkl), *names]:
        assert name in err, (name, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clips.pkl"]  # no store, no temp dir


def test_pickle_without_ids_gets_unique_ids(tmp_path: Path):
    """The reference's IEMOCAP pickle has no 'id': each clip is named by its split and row."""
    pkl = tmp_path / "iemocap_data.pkl"
    _reference_pickle(pkl, emotions=True)
    data = safe_load(pkl)
    for split in data.values():
        del split["id"]
    pkl.write_bytes(pickle.dumps(data, protocol=4))
    store = ingest(tmp_path / "store", pkl, "reference")
    assert store.split("train").ids.tolist() == [f"train-{i}" for i in range(5)]
    assert store.split("valid").ids.tolist()[:2] == ["valid-0", "valid-1"]
