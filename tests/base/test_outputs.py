"""Output locations checked before work starts (xmodal.base.outputs): each bad place is one UserError naming
the option and the value, and no check leaves anything behind."""

from __future__ import annotations

import pytest

from xmodal.base.errors import UserError
from xmodal.base.outputs import check_output_location, check_uri, check_writable_dir, check_writable_file


@pytest.mark.parametrize("uri", ["s3://bucket/runs", "s3://my.bucket-1/a/b", "gs://bkt/x", "file:///tmp/x",
                                 "hdfs://namenode:8020/runs"])
def test_well_formed_uris_pass(uri):
    assert check_uri(uri, "scale.storage_path") == uri


@pytest.mark.parametrize(("uri", "said"), [
    ("s3:///runs", "names no bucket"),
    ("s3://my bucket/runs", "not a valid bucket name"),
    ("s3://B/runs", "not a valid bucket name"),
    ("ftp://host/runs", "scheme 'ftp'"),
    ("file://host/runs", "absolute path"),
])
def test_malformed_uris_are_refused(uri, said):
    with pytest.raises(UserError) as e:
        check_uri(uri, "scale.storage_path")
    assert "scale.storage_path" in str(e.value) and repr(uri) in str(e.value) and said in str(e.value)


def test_a_uri_missing_a_slash_is_not_taken_for_a_local_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"--storage-path: 's3:/runs' looks like a URI with a slash missing"):
        check_output_location("s3:/runs", "--storage-path")
    assert list(tmp_path.iterdir()) == []


def test_writable_places_pass_and_leave_nothing(tmp_path):
    assert check_writable_dir(tmp_path / "a" / "b", "--out") == tmp_path / "a" / "b"
    assert check_writable_file(tmp_path / "c" / "report.md", "--out") == tmp_path / "c" / "report.md"
    assert check_output_location(str(tmp_path / "runs"), "--storage-path") == str(tmp_path / "runs")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("where", "said"), [
    ("/proc/xmodal-out", "cannot be written"),
    ("FILE/sub", "is a file, not a folder"),
    ("FILE", "is a file; expected a folder"),
])
def test_unwritable_folders_are_refused(tmp_path, where, said):
    (tmp_path / "FILE").write_text("x")
    where = where.replace("FILE", str(tmp_path / "FILE"))
    with pytest.raises(UserError) as e:
        check_writable_dir(where, "--out")
    assert "--out" in str(e.value) and repr(where) in str(e.value) and said in str(e.value)


def test_an_output_file_that_is_a_folder_is_refused(tmp_path):
    with pytest.raises(UserError, match="is a folder; expected a file name"):
        check_writable_file(tmp_path, "--out")
