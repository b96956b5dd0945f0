"""MulT store: round trip, validation against the shards, and the deterministic numpy batch iterator."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from xmodal.data.errors import StoreError
from xmodal.data.manifest import MANIFEST_FILE
from xmodal.data.mult.store import (
    MODALITIES,
    MultSplit,
    MultStore,
    pad_packed,
    write_store,
)
from xmodal.data.mult.synthetic import SyntheticMultOptions, generate

DIMS = {"text": 5, "audio": 3, "vision": 2}


def _split(name: str, n: int, seed: int, emotions: bool = False) -> MultSplit:
    rng = np.random.default_rng(seed)
    lengths = {m: rng.integers(1, 9, n) for m in MODALITIES}
    values = {m: rng.normal(size=(int(lengths[m].sum()), DIMS[m])).astype(np.float16) for m in MODALITIES}
    labels = rng.integers(0, 2, (n, 4)) if emotions else rng.uniform(-3, 3, n).astype(np.float32)
    return MultSplit(name, np.array([f"{name}-{i}" for i in range(n)], dtype=object), labels, values, lengths)


@pytest.fixture
def splits() -> dict[str, MultSplit]:
    return {"train": _split("train", 23, 0), "valid": _split("valid", 7, 1), "test": _split("test", 5, 2)}


def test_round_trip(tmp_path: Path, splits):
    store = write_store(tmp_path / "s", splits, dataset="toy", source={"test": True}, shard_rows=10)
    assert store.manifest.rows == {"train": 23, "valid": 7, "test": 5}
    assert [sh.rows for sh in store.manifest.splits["train"]] == [10, 10, 3]
    assert store.dims == DIMS and store.task == "sentiment"
    again = MultStore.open(tmp_path / "s").split("train")
    src = splits["train"]
    np.testing.assert_array_equal(again.ids, src.ids)
    np.testing.assert_array_equal(again.labels, src.labels)
    for m in MODALITIES:
        np.testing.assert_array_equal(again.lengths[m], src.lengths[m])
        np.testing.assert_array_equal(again.values[m], src.values[m])
        assert getattr(again.batch([4]), m)[0].numpy().shape == (src.lengths[m][4], DIMS[m])
    assert store.manifest.max_len == {m: max(int(s.lengths[m].max()) for s in splits.values()) for m in MODALITIES}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporary left


def test_emotions_round_trip(tmp_path: Path):
    sp = {s: _split(s, 6, i, emotions=True) for i, s in enumerate(("train", "valid", "test"))}
    store = write_store(tmp_path / "e", sp, dataset="toy", source={})
    assert store.task == "emotions" and store.manifest.label_names == ["neutral", "happy", "sad", "angry"]
    got = store.split("valid")
    np.testing.assert_array_equal(got.labels, sp["valid"].labels)
    b = next(got.batches(4))
    assert b.labels.dtype == torch.int64 and b.labels.shape == (4, 4)


def test_validation_names_the_problem(tmp_path: Path, splits):
    path = tmp_path / "s"
    write_store(path, splits, dataset="toy", source={})
    mf = path / MANIFEST_FILE
    good = json.loads(mf.read_text())

    def broken(change) -> str:
        m = json.loads(json.dumps(good))
        change(m)
        mf.write_text(json.dumps(m))
        with pytest.raises(StoreError) as e:
            MultStore.open(path)
        return str(e.value)

    assert "field schema_version = 9" in broken(lambda m: m.update(schema_version=9))
    assert "kind 'lxmert'" in broken(lambda m: m.update(kind="lxmert"))
    assert "part-00000.parquet: has 23 rows, manifest says 22" in broken(
        lambda m: (m["splits"]["train"][0].update(rows=22), m["rows"].update(train=22)))
    assert "field rows.train = 99: expected 23" in broken(lambda m: m["rows"].update(train=99))
    assert "dims" in broken(lambda m: m["dims"].update(text=0))
    mf.write_text(json.dumps(good))
    (path / "test" / "part-00000.parquet").unlink()
    with pytest.raises(StoreError, match=r"test/part-00000\.parquet: shard listed in manifest\.json is missing"):
        MultStore.open(path)
    with pytest.raises(StoreError, match="no manifest.json"):
        MultStore.open(tmp_path)


def test_corrupt_value_length_is_caught(tmp_path: Path, splits):
    path = tmp_path / "s"
    store = write_store(path, splits, dataset="toy", source={})
    shard = path / "valid" / "part-00000.parquet"
    t = pq.read_table(shard)
    lens = t.column("audio_len").to_numpy().copy()
    lens[3] += 1
    t = t.set_column(t.schema.get_field_index("audio_len"), "audio_len", [lens.astype(np.int32)])
    pq.write_table(t, shard)
    with pytest.raises(StoreError, match="column audio: row 3 holds"):
        store.split("valid")


def test_refuses_to_overwrite_and_replaces_with_overwrite(tmp_path: Path, splits):
    path = tmp_path / "s"
    write_store(path, splits, dataset="one", source={})
    with pytest.raises(StoreError, match="already exists; pass --overwrite"):
        write_store(path, splits, dataset="two", source={})
    assert MultStore.open(path).manifest.dataset == "one"
    write_store(path, splits, dataset="two", source={}, overwrite=True)
    assert MultStore.open(path).manifest.dataset == "two"
    bad = dict(splits, valid=_split("valid", 3, 5, emotions=True))
    with pytest.raises(StoreError, match="differ"):
        write_store(tmp_path / "mixed", bad, dataset="x", source={})
    assert not (tmp_path / "mixed").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_pad_packed_matches_a_loop():
    rng = np.random.default_rng(0)
    lengths = np.array([3, 1, 4, 2])
    values = rng.normal(size=(int(lengths.sum()) + 5, 3)).astype(np.float16)
    starts = np.array([5, 0, 1, 8])
    got = pad_packed(values, starts, lengths, 6)
    want = np.zeros((4, 6, 3), np.float16)
    for b, (s, n) in enumerate(zip(starts, lengths, strict=True)):
        want[b, :n] = values[s:s + n]
    np.testing.assert_array_equal(got, want)


def test_batches_are_deterministic_and_cover_the_split(splits):
    sp = splits["train"]
    epoch0 = [b.index.tolist() for b in sp.batches(4, shuffle=True, seed=3, epoch=0)]
    assert epoch0 == [b.index.tolist() for b in sp.batches(4, shuffle=True, seed=3, epoch=0)]
    assert epoch0 != [b.index.tolist() for b in sp.batches(4, shuffle=True, seed=3, epoch=1)]
    assert sorted(sum(epoch0, [])) == list(range(23))
    assert [len(b) for b in sp.batches(4, drop_last=True)] == [4] * 5
    # Two workers: disjoint, equal shares (the tail is trimmed so that their steps match).
    shares = [sum((b.index.tolist() for b in sp.batches(4, shuffle=True, rank=r, world=2)), [])
              for r in range(2)]
    assert len(shares[0]) == len(shares[1]) == 11 and not set(shares[0]) & set(shares[1])
    assert sp.num_batches(4, world=2) == 3 and sp.num_batches(4, drop_last=True) == 5


def test_batch_contents_padding_and_static_shapes(splits):
    sp = splits["train"]
    rows = np.array([5, 0, 17])
    b = sp.batch(rows)
    for m, x, lens in zip(MODALITIES, (b.text, b.audio, b.vision), b.lengths(), strict=True):
        assert x.dtype == torch.float16 and x.shape[1] == int(sp.lengths[m][rows].max())
        for i, r in enumerate(rows):
            n = int(sp.lengths[m][r])
            assert int(lens[i]) == n
            np.testing.assert_array_equal(x[i, :n].numpy(), getattr(sp.batch([r]), m)[0].numpy())
            assert not x[i, n:].any()
    torch.testing.assert_close(b.labels[:, 0], torch.from_numpy(sp.labels[rows]))
    static = sp.batch(rows, pad_to="store")
    assert static.audio.shape[1] == sp.max_len["audio"]
    fixed = sp.batch(rows, pad_to={"text": 8, "audio": 8, "vision": 8})
    assert fixed.text.shape[1] == 8
    with pytest.raises(ValueError, match="more than pad_to 1"):
        sp.batch(rows, pad_to={"text": 1, "audio": 8, "vision": 8})


def test_ray_free_block_iterator_matches_store(tmp_path: Path):
    """The pipeline's core (Arrow blocks of any size -> batches) yields every clip once, with the
    same padded contents as the numpy iterator."""
    from xmodal.data.mult.store import arrow_schema  # noqa: F401  (the schema the blocks carry)

    pytest.importorskip("ray")
    from xmodal.data.mult.pipeline import batches_from_tables

    sp = generate(SyntheticMultOptions(num_samples=60, seed=1))
    store = write_store(tmp_path / "syn", sp, dataset="synthetic", source={}, shard_rows=16)
    tables = [pq.read_table(p) for p in store.shard_paths("train")]
    blocks = [t.slice(i, 5) for t in tables for i in range(0, t.num_rows, 5)]  # ragged small blocks
    whole = store.split("train")
    seen = []
    for b in batches_from_tables(blocks, store.dims, 7, seed=0, epoch=0, drop_last=False, min_block_rows=10):
        for i, r in enumerate(b.index.tolist()):
            n = int(b.audio_lengths[i])
            np.testing.assert_array_equal(b.audio[i, :n].numpy(), whole.batch([r]).audio[0].numpy())
        seen += b.index.tolist()
    assert sorted(seen) == list(range(len(whole)))
