"""An LXMERT store read from S3 (a moto server, `s3` in tests/conftest.py) where it is: opened from its
URI, it gives the units, tables and batches of its local copy, through the Ray-free reader and through
Ray Data; a bad store on S3 is one clear error naming the object's URI."""

from __future__ import annotations

import json
import pickle
import uuid

import numpy as np
import pytest

from xmodal.data.errors import StoreError
from xmodal.data.location import Location, locate
from xmodal.data.lxmert.masking import LxmertBatchBuilder
from xmodal.data.lxmert.store import LxmertStore, open_store
from xmodal.data.units import read_unit
from xmodal_testing import S3_BUCKET


def upload(s3, store: LxmertStore) -> str:
    return s3.upload(store.path, f"lxmert-{uuid.uuid4().hex[:8]}/store")


def key(uri: str) -> str:
    return uri.removeprefix(f"s3://{S3_BUCKET}/")


def shard_suffixes(units) -> list[tuple[str, int, int, int]]:
    return [("/".join(u.file.split("/")[-2:]), u.group, u.rows, u.samples) for u in units]


def test_an_s3_store_opens_and_reads_as_its_local_copy(s3, small_store: LxmertStore):
    uri = upload(s3, small_store)
    remote = open_store(uri)
    assert isinstance(remote.path, Location) and remote.path.remote and str(remote.path) == uri
    assert remote.manifest == small_store.manifest
    assert remote.tokenizer().encode(["a red ball"])[0].tolist() == small_store.tokenizer().encode(["a red ball"])[0].tolist()
    assert remote.answers().answers == small_store.answers().answers
    for split in ("train", "minival"):
        units, local = remote.units(split), small_store.units(split)
        assert all(u.file.startswith(f"{uri}/{split}/part-") for u in units)  # each unit names its shard's URI
        assert shard_suffixes(units) == shard_suffixes(local) and units
        for u, v in zip(units, local, strict=True):
            assert read_unit(u).equals(read_unit(v))
        a, b = remote.read_split(split), small_store.read_split(split)
        assert np.array_equal(a.features, b.features) and np.array_equal(a.input_ids, b.input_ids)
    # What a Ray worker gets (the run plan carries the URI; units are pickled into the read tasks).
    again = pickle.loads(pickle.dumps(remote))
    assert str(again.path) == uri and again.units("train") == remote.units("train")
    assert open_store(str(remote.path)).units("train") == remote.units("train")


def test_the_ray_free_batches_of_an_s3_store_are_the_local_ones(s3, small_store: LxmertStore):
    from xmodal.data.lxmert.loader import iter_local_batches

    remote = open_store(upload(s3, small_store))
    builder = LxmertBatchBuilder.from_store(small_store)
    args = dict(seed=5, epoch=0, rank=1, world=2, mix_units=3)
    a = list(iter_local_batches(remote, "train", builder, 16, **args))
    b = list(iter_local_batches(small_store, "train", builder, 16, **args))
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        assert np.array_equal(x.input_ids.numpy(), y.input_ids.numpy())
        assert np.array_equal(x.visual_feats.numpy(), y.visual_feats.numpy())


def test_ray_data_reads_an_s3_store_as_its_local_copy(ray_local, s3, small_store: LxmertStore):
    """The training path: Ray Data tasks (worker processes of the shared Ray, which have the AWS_*
    variables as a cluster's nodes do) read each unit's row group from S3."""
    from xmodal.data.lxmert.pipeline import BATCH_COLUMNS, iter_rank_batches
    from xmodal.data.reader import read_units

    remote = open_store(upload(s3, small_store))
    tables = list(read_units(remote.units("train"), BATCH_COLUMNS))
    local = list(read_units(small_store.units("train"), BATCH_COLUMNS))
    assert sum(t.num_rows for t in tables) == small_store.manifest.images("train") > 0
    assert [t.num_rows for t in tables] == [t.num_rows for t in local]
    assert all(a.equals(b) for a, b in zip(tables, local, strict=True))
    builder = LxmertBatchBuilder.from_store(small_store)
    a = list(iter_rank_batches(remote, "train", builder, 16, seed=3, epoch=1, rank=0, world=2, mix_units=3))
    b = list(iter_rank_batches(small_store, "train", builder, 16, seed=3, epoch=1, rank=0, world=2, mix_units=3))
    assert len(a) == len(b) > 0
    assert all(np.array_equal(x.visual_feats.numpy(), y.visual_feats.numpy()) for x, y in zip(a, b, strict=True))


# ---------------------------------------------------------------- bad stores on S3


def test_a_missing_store_or_manifest_names_the_uri(s3, small_store: LxmertStore):
    nothing = f"s3://{S3_BUCKET}/no-such-store-{uuid.uuid4().hex[:8]}"
    with pytest.raises(StoreError, match=f"{nothing}: feature store does not exist .*then upload it"):
        open_store(nothing)
    uri = upload(s3, small_store)
    s3.delete(key(f"{uri}/manifest.json"))
    with pytest.raises(StoreError, match=f"{uri}: has no manifest.json; expected an LXMERT feature store"):
        open_store(uri)


def test_a_missing_shard_names_its_uri(s3, small_store: LxmertStore):
    uri = upload(s3, small_store)
    shard = f"{uri}/{small_store.manifest.shards['minival'][0].file}"
    s3.delete(key(shard))
    with pytest.raises(StoreError, match=f"{shard}: shard listed in manifest.json is missing"):
        open_store(uri)


def test_a_wrong_row_count_names_the_shard_and_both_counts(s3, small_store: LxmertStore):
    uri = upload(s3, small_store)
    m = json.loads(s3.get(key(f"{uri}/manifest.json")))
    first = m["shards"]["train"][0]
    first["rows"] += 1
    s3.put(key(f"{uri}/manifest.json"), json.dumps(m).encode())
    with pytest.raises(StoreError, match=f"{uri}/{first['file']}: has {first['rows'] - 1} rows, manifest says "
                                         f"{first['rows']}"):
        open_store(uri)


def test_a_corrupt_shard_names_its_uri_at_open_and_at_read(s3, small_store: LxmertStore):
    uri = upload(s3, small_store)
    shard = f"{uri}/{small_store.manifest.shards['train'][0].file}"
    good = s3.get(key(shard))
    s3.put(key(shard), b"not parquet at all" * 64)
    with pytest.raises(StoreError, match=f"{shard}: not a readable Parquet file .*re-ingest the store"):
        open_store(uri)
    # Opened while it was intact, corrupted afterwards: the read (on a Ray Data task) names it too.
    s3.put(key(shard), good)
    units = [u for u in open_store(uri).units("train") if u.file == shard]
    s3.put(key(shard), good[:len(good) // 2])
    with pytest.raises(StoreError, match=f"{shard}: cannot read row group 0 .*re-ingest the store"):
        read_unit(units[0])


def test_a_bad_manifest_on_s3_names_the_field(s3, small_store: LxmertStore):
    uri = upload(s3, small_store)
    m = json.loads(s3.get(key(f"{uri}/manifest.json")))
    m["feat_dim"] = "wide"
    s3.put(key(f"{uri}/manifest.json"), json.dumps(m).encode())
    with pytest.raises(StoreError, match=f"{uri}/manifest.json: field feat_dim = \"wide\""):
        open_store(uri)


def test_writers_and_derived_data_refuse_a_uri(tmp_path, monkeypatch, capsys):
    """Taken for a local path, s3://b/k would be the folder ./s3:/b/k: nothing is made here."""
    from xmodal.cli.ingest import main as ingest_main
    from xmodal.data.lxmert.store import StoreWriter
    from xmodal.data.lxmert.synthetic import ensure_synthetic_store

    monkeypatch.chdir(tmp_path)
    for source, *options in (("synthetic", "--no-progress"), ("mult-synthetic", "--num-samples", "10")):
        assert ingest_main([source, f"s3://{S3_BUCKET}/out/{source}", *options]) == 2
        assert f"s3://{S3_BUCKET}/out/{source}: stores and sets are written to a local folder" in capsys.readouterr().err
    target = f"s3://{S3_BUCKET}/out/store"
    with pytest.raises(StoreError, match=f"{target}: stores and sets are written to a local folder"):
        StoreWriter(target, num_objects=4, feat_dim=8, max_seq_len=8)
    with pytest.raises(StoreError, match=f"{target}: the embedded synthetic LXMERT store is derived data, built "
                                         "on this machine's disk.*give a local folder"):
        ensure_synthetic_store(target)
    assert list(tmp_path.iterdir()) == []
    assert locate(target).fs_path == f"{S3_BUCKET}/out/store"  # a location, not a local path "s3:/..."
