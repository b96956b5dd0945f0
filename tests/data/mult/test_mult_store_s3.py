"""A MulT store read from S3 (a moto server, `s3` in tests/conftest.py): opened from its URI it gives
the units, splits and batches of its local copy, in-process and through Ray Data; a bad store is one
error naming the object's URI."""

from __future__ import annotations

import json
import uuid

import numpy as np
import pytest

from xmodal.data.errors import StoreError
from xmodal.data.location import Location
from xmodal.data.mult.store import MODALITIES, MultStore, write_store
from xmodal.data.mult.synthetic import SyntheticMultOptions, generate
from xmodal.data.units import read_unit
from xmodal_testing import S3_BUCKET


@pytest.fixture(scope="module")
def mult_store(tmp_path_factory) -> MultStore:
    return write_store(tmp_path_factory.mktemp("mult") / "syn", generate(SyntheticMultOptions(num_samples=80, seed=2)),
                       dataset="synthetic", source={}, shard_rows=12)


def upload(s3, store: MultStore) -> str:
    return s3.upload(store.path, f"mult-{uuid.uuid4().hex[:8]}/store")


def key(uri: str) -> str:
    return uri.removeprefix(f"s3://{S3_BUCKET}/")


def test_an_s3_mult_store_reads_as_its_local_copy(s3, mult_store: MultStore):
    uri = upload(s3, mult_store)
    remote = MultStore.open(uri)
    assert isinstance(remote.path, Location) and str(remote.path) == uri
    assert remote.manifest == mult_store.manifest
    for split in remote.splits:
        units, local = remote.units(split), mult_store.units(split)
        assert [u.file for u in units] == [u.file.replace(str(mult_store.path), uri) for u in local] and units
        assert [(u.group, u.rows) for u in units] == [(u.group, u.rows) for u in local]
        assert all(read_unit(u).equals(read_unit(v)) for u, v in zip(units, local, strict=True))
        a, b = remote.split(split), mult_store.split(split)
        np.testing.assert_array_equal(a.labels, b.labels)
        for m in MODALITIES:
            np.testing.assert_array_equal(a.values[m], b.values[m])


def test_ray_data_reads_an_s3_mult_store_as_its_local_copy(ray_local, s3, mult_store: MultStore):
    from xmodal.data.mult.pipeline import iter_rank_batches

    remote = MultStore.open(upload(s3, mult_store))
    args = dict(seed=4, epoch=1, rank=1, world=2)
    a = list(iter_rank_batches(remote, "train", 8, **args))
    b = list(iter_rank_batches(mult_store, "train", 8, **args))
    assert len(a) == len(b) > 0
    for x, y in zip(a, b, strict=True):
        assert np.array_equal(x.index.numpy(), y.index.numpy())
        assert np.array_equal(x.audio.numpy(), y.audio.numpy()) and np.array_equal(x.text.numpy(), y.text.numpy())


def test_bad_mult_stores_on_s3_name_the_uri(s3, mult_store: MultStore):
    nothing = f"s3://{S3_BUCKET}/no-such-mult-{uuid.uuid4().hex[:8]}"
    with pytest.raises(StoreError, match=f"{nothing}: does not exist; expected a MulT store"):
        MultStore.open(nothing)
    uri = upload(s3, mult_store)
    shards = mult_store.manifest.splits["train"]
    m = json.loads(s3.get(key(f"{uri}/manifest.json")))
    m["splits"]["train"][0]["rows"] += 1
    m["rows"]["train"] += 1  # the totals agree with the shards' rows: only the footer disagrees
    s3.put(key(f"{uri}/manifest.json"), json.dumps(m).encode())
    with pytest.raises(StoreError, match=f"{uri}/{shards[0].file}: has {shards[0].rows} rows, manifest says "
                                         f"{shards[0].rows + 1}"):
        MultStore.open(uri)
    m["splits"]["train"][0]["rows"] -= 1
    m["rows"]["train"] -= 1
    s3.put(key(f"{uri}/manifest.json"), json.dumps(m).encode())
    s3.put(key(f"{uri}/{shards[1].file}"), b"garbage" * 100)
    with pytest.raises(StoreError, match=f"{uri}/{shards[1].file}: not a readable Parquet file"):
        MultStore.open(uri)
    s3.delete(key(f"{uri}/{shards[1].file}"))
    with pytest.raises(StoreError, match=f"{uri}/{shards[1].file}: shard listed in manifest.json is missing"):
        MultStore.open(uri)
