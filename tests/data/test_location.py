"""`data.location.Location`: a local path and a URI behind the one interface the store readers use."""

from __future__ import annotations

import pickle

import pyarrow.fs as pafs
import pytest

from xmodal.data.errors import StoreError
from xmodal.data.location import Location, is_uri, locate, store_path


def test_a_local_path_is_a_local_file_system_and_stays_a_path(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "store").mkdir()
    (tmp_path / "store" / "vocab.txt").write_text("[PAD]\nword\n")
    loc = locate("store")
    assert str(loc) == str(tmp_path / "store") and not loc.remote
    assert isinstance(loc.fs, pafs.LocalFileSystem) and store_path(loc) == tmp_path / "store"
    assert loc.is_dir() and (loc / "vocab.txt").is_file() and not (loc / "nothing").exists()
    assert (loc / "vocab.txt").read_text() == "[PAD]\nword\n" and (loc / "vocab.txt").name == "vocab.txt"
    with pytest.raises(FileNotFoundError):
        (loc / "nothing").read_bytes()


def test_a_uri_keeps_its_scheme_bucket_and_options(tmp_path):
    loc = locate("s3://bucket/prefix/store/?region=us-east-1")
    assert str(loc) == "s3://bucket/prefix/store?region=us-east-1"  # no trailing '/', the query kept
    shard = loc / "train/part-00000.parquet"
    assert str(shard) == "s3://bucket/prefix/store/train/part-00000.parquet?region=us-east-1"
    assert shard.name == "part-00000.parquet" and str(shard.parent.parent) == str(loc)
    assert shard.fs_path == "bucket/prefix/store/train/part-00000.parquet" and shard.remote
    with pytest.raises(TypeError, match="a remote location has no local path"):
        open(shard)  # noqa: SIM115 - never opened: a URI is not taken for a local file
    assert pickle.loads(pickle.dumps(shard)) == shard
    # A file:// URI is local: its path is the local one.
    (tmp_path / "a b").mkdir()
    local = locate(f"file://{tmp_path}/a%20b")
    assert local.local == tmp_path / "a b" and not local.remote and local.is_dir()
    assert is_uri("gs://b/k") and not is_uri("/data/s3:/b") and not is_uri("relative/path")


def test_a_location_pyarrow_cannot_read_is_a_store_error():
    with pytest.raises(StoreError, match="nosuch://b/store: not a location pyarrow can read .*expected a local path "
                                         "or a URI such as s3://bucket/prefix/store"):
        Location("nosuch://b/store").exists()
