"""Output locations checked before work starts (xmodal.base.outputs): each bad place is one UserError naming
the option and the value, and no check leaves anything behind."""

from __future__ import annotations

import re

import pytest

from xmodal.base.errors import UserError
from xmodal.base.outputs import (
    RECORD,
    Output,
    Scratch,
    check_output_location,
    check_uri,
    check_writable_dir,
    check_writable_file,
    read_record,
)


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


# ---------------------------------------------------------------------------- the output policy

def _tree(root):
    """Every file under `root` with its bytes: what a user's folder held, to compare before and after."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _write(stage, files):
    for name, text in files.items():
        (stage.tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (stage.tmp / name).write_text(text)


def test_a_new_folder_is_published_whole_with_its_record(tmp_path):
    out = Output(tmp_path / "a" / "pages", "--out", "examples")
    with out.stage() as stage:
        _write(stage, {"index.html": "i", "img/0.png": "p"})
        assert not out.path.exists()  # nothing visible before publish
        stage.publish()
    assert _tree(out.path) == {"index.html": b"i", "img/0.png": b"p", RECORD: _tree(out.path)[RECORD]}
    assert read_record(out.path) == {"command": "examples", "files": ["img/0.png", "index.html"]}
    assert [p.name for p in tmp_path.iterdir()] == ["a"] and [p.name for p in (tmp_path / "a").iterdir()] == ["pages"]


def test_the_same_commands_earlier_output_is_replaced_and_nothing_else(tmp_path):
    for files in ({"index.html": "1", "old.png": "1"}, {"index.html": "2"}):
        with Output(tmp_path / "pages", "--out", "examples").stage() as stage:
            _write(stage, files)
            stage.publish()
    assert set(_tree(tmp_path / "pages")) == {"index.html", RECORD}
    assert (tmp_path / "pages" / "index.html").read_text() == "2"


@pytest.mark.parametrize("other", ["thesis.tex", "img/mine.png"])
def test_a_folder_holding_anything_else_is_refused_and_left_as_it_was(tmp_path, other):
    with Output(tmp_path / "pages", "--out", "examples").stage() as stage:
        _write(stage, {"index.html": "1", "img/0.png": "p"})
        stage.publish()
    (tmp_path / "pages" / other).write_text("keep me")
    before = _tree(tmp_path)
    with pytest.raises(UserError) as e:
        Output(tmp_path / "pages", "--out", "examples")
    assert str(e.value).startswith(f"--out: {str(tmp_path / 'pages')!r} already holds {other!r}, which examples did "
                                   "not write there; choose a new or empty folder or pass --overwrite")
    assert _tree(tmp_path) == before


def test_another_commands_output_is_not_its_own(tmp_path):
    with Output(tmp_path / "o", "--out", "report").stage() as stage:
        _write(stage, {"report.md": "r"})
        stage.publish()
    with pytest.raises(UserError, match="already holds 'report.md', which examples did not write there"):
        Output(tmp_path / "o", "--out", "examples")


def test_overwrite_writes_beside_the_users_files_and_removes_only_its_own(tmp_path):
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "notes.txt").write_text("mine")
    for files in ({"a.html": "1", "b.html": "1"}, {"a.html": "2"}):
        with Output(tmp_path / "o", "--out", "examples", overwrite=True).stage() as stage:
            _write(stage, files)
            stage.publish()
    assert {k: v for k, v in _tree(tmp_path / "o").items() if k != RECORD} == {"a.html": b"2", "notes.txt": b"mine"}
    assert read_record(tmp_path / "o")["files"] == ["a.html"]
    assert [p.name for p in tmp_path.iterdir()] == ["o"]


def test_a_failed_write_leaves_nothing_and_keeps_the_users_empty_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    for target in (tmp_path / "empty", tmp_path / "x" / "y"):
        with pytest.raises(RuntimeError), Output(target, "--out", "examples").stage() as stage:
            _write(stage, {"a": "1"})
            raise RuntimeError("killed midway")
    assert [p.name for p in tmp_path.iterdir()] == ["empty"] and not any((tmp_path / "empty").iterdir())


def test_an_output_file_must_not_exist_unless_overwrite(tmp_path):
    (tmp_path / "w.pkl").write_text("the user's weights")
    with pytest.raises(UserError, match=r"--out: '.*w.pkl' already exists; choose a new file or pass --overwrite"):
        Output(tmp_path / "w.pkl", "--out", "weights", file=True)
    out = Output(tmp_path / "w.pkl", "--out", "weights", file=True, overwrite=True)
    with out.stage() as stage:
        stage.tmp.write_text("new")
        assert (tmp_path / "w.pkl").read_text() == "the user's weights"
        stage.publish()
    assert (tmp_path / "w.pkl").read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["w.pkl"]


@pytest.mark.parametrize(("where", "file", "said"), [
    ("", False, "--out: '' is empty; expected a folder name"),
    ("", True, "--out: '' is empty; expected a file name"),
    ("s3://bucket/prefix", False, "'s3://bucket/prefix' is a URI; examples writes a local folder only"),
    ("s3:/bucket/prefix", False, "looks like a URI with a slash missing"),
    ("FILE", False, "is a file; expected a folder"),
    ("DIR", True, "is a folder; expected a file name"),
])
def test_outputs_that_cannot_be_meant_are_refused_before_anything_is_written(tmp_path, monkeypatch, where, file, said):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "FILE").write_text("x")
    (tmp_path / "DIR").mkdir()
    before = _tree(tmp_path)
    with pytest.raises(UserError, match=re.escape(said)):
        Output(where, "--out", "examples", file=file)
    assert _tree(tmp_path) == before and sorted(p.name for p in tmp_path.iterdir()) == ["DIR", "FILE"]


def test_a_command_without_overwrite_does_not_offer_it(tmp_path):
    (tmp_path / "f").write_text("x")
    with pytest.raises(UserError) as e:
        Output(tmp_path / "f", "--out", "weights", file=True, overwrite=None)
    assert "--overwrite" not in str(e.value)


def test_a_scratch_folder_is_removed_with_the_folders_made_for_it_however_the_command_ends(tmp_path):
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "mine.txt").write_text("keep me")
    for under in (tmp_path / "w", tmp_path / "new" / "deeper"):
        with pytest.raises(RuntimeError), Scratch(under, "--work", "xmodal-test-") as work:
            assert work.parent == under and work.is_dir() and work.name.startswith("xmodal-test-")
            (work / "store").mkdir()
            (work / "store" / "part.parquet").write_text("rows")
            raise RuntimeError("the benchmark failed")
    assert _tree(tmp_path) == {"w/mine.txt": b"keep me"} and sorted(p.name for p in tmp_path.iterdir()) == ["w"]
    kept = Scratch(tmp_path / "k", "--work", "xmodal-test-", keep=True)
    kept.remove()
    assert kept.path.is_dir()  # --keep: the user asked to look at it
    for bad, said in (("s3://bucket/w", "is a URI"), ("", "is empty"), (str(tmp_path / "w" / "mine.txt"), "is a file")):
        with pytest.raises(UserError, match=re.escape(said)):
            Scratch(bad, "--work", "xmodal-test-")


# ------------------------------------------------------------- folders, links and `..` in an output

def _entries(root):
    """Every file and folder under `root` (a folder as `name/`): an empty folder counts."""
    return sorted(p.relative_to(root).as_posix() + ("/" if p.is_dir() else "") for p in root.rglob("*"))


def test_an_empty_folder_of_the_users_is_refused_and_with_overwrite_kept(tmp_path):
    (tmp_path / "o" / "keepme" / "deeper").mkdir(parents=True)
    with pytest.raises(UserError) as e:
        Output(tmp_path / "o", "--out", "export")
    assert str(e.value) == (f"--out: {str(tmp_path / 'o')!r} already holds 'keepme/deeper/', which export did not "
                            "write there; choose a new or empty folder or pass --overwrite to write beside what is "
                            "there (none of it is removed)")
    for files in ({"a.bin": "1", "sub/b.bin": "1"}, {"a.bin": "2"}):
        with Output(tmp_path / "o", "--out", "export", overwrite=True).stage() as stage:
            _write(stage, files)
            stage.publish()
    assert _entries(tmp_path / "o") == [RECORD, "a.bin", "keepme/", "keepme/deeper/", "sub/"]
    assert [p.name for p in tmp_path.iterdir()] == ["o"]  # nothing staged left beside it


def test_an_empty_folder_added_to_the_commands_own_output_is_the_users(tmp_path):
    with Output(tmp_path / "o", "--out", "export").stage() as stage:
        _write(stage, {"sub/a.bin": "1"})
        stage.publish()
    (tmp_path / "o" / "sub" / "a.bin").unlink()  # a folder it wrote into stays its own, emptied or not
    Output(tmp_path / "o", "--out", "export")
    (tmp_path / "o" / "mine").mkdir()
    with pytest.raises(UserError, match="already holds 'mine/', which export did not write there"):
        Output(tmp_path / "o", "--out", "export")
    assert (tmp_path / "o" / "mine").is_dir()


def test_an_empty_folder_the_command_writes_is_recorded_and_replaced_as_its_own(tmp_path):
    for _ in range(2):
        with Output(tmp_path / "o", "--out", "export").stage() as stage:
            (stage.tmp / "cache").mkdir()
            _write(stage, {"a.bin": "1"})
            stage.publish()
    assert read_record(tmp_path / "o")["files"] == ["a.bin", "cache/"]
    assert _entries(tmp_path / "o") == [RECORD, "a.bin", "cache/"]


def test_an_empty_output_folder_is_still_taken(tmp_path):
    (tmp_path / "o").mkdir()
    with Output(tmp_path / "o", "--out", "export").stage() as stage:
        _write(stage, {"a.bin": "1"})
        stage.publish()
    assert _entries(tmp_path) == ["o/", f"o/{RECORD}", "o/a.bin"]


def test_dot_dot_is_resolved_so_the_stage_is_beside_the_real_folder(tmp_path):
    (tmp_path / "e4" / "sub").mkdir(parents=True)
    # e4 holds the user's empty `sub`: refused as the folder it is, named both ways
    with pytest.raises(UserError, match=re.escape(f"--out: '{tmp_path}/e4/sub/..' (that is '{tmp_path}/e4') "
                                                  "already holds 'sub/', which export did not write there")):
        Output(f"{tmp_path}/e4/sub/..", "--out", "export")
    out = Output(f"{tmp_path}/e4/sub/..", "--out", "export", overwrite=True)
    assert out.path == tmp_path / "e4"
    with out.stage() as stage:
        assert stage.tmp.parent == tmp_path  # beside e4, not inside it
        _write(stage, {"a.bin": "1"})
        stage.publish()
    assert _entries(tmp_path) == ["e4/", f"e4/{RECORD}", "e4/a.bin", "e4/sub/"]  # sub: the user's, kept
    assert Output(f"{tmp_path}/e4/nowhere/..", "--out", "export", overwrite=True).path == tmp_path / "e4"


def test_a_link_is_written_through_and_stays_a_link(tmp_path):
    with Output(tmp_path / "ex1", "--out", "export").stage() as stage:
        _write(stage, {"a.bin": "old"})
        stage.publish()
    (tmp_path / "linkex").symlink_to("ex1")
    out = Output(tmp_path / "linkex", "--out", "export")
    assert out.path == tmp_path / "ex1"
    with out.stage() as stage:
        _write(stage, {"a.bin": "new"})
        stage.publish()
    assert (tmp_path / "linkex").is_symlink() and str((tmp_path / "linkex").readlink()) == "ex1"
    assert (tmp_path / "ex1" / "a.bin").read_text() == "new" and sorted(p.name for p in tmp_path.iterdir()) == [
        "ex1", "linkex"]
    (tmp_path / "ex1" / "mine.txt").write_text("x")
    with pytest.raises(UserError, match=re.escape(f"--out: '{tmp_path}/linkex' (a link to '{tmp_path}/ex1') already "
                                                  "holds 'mine.txt'")):
        Output(tmp_path / "linkex", "--out", "export")
    (tmp_path / "w.txt").write_text("old")
    (tmp_path / "wlink").symlink_to("w.txt")  # a file output through a link: the file replaced, the link kept
    with Output(tmp_path / "wlink", "--out", "weights", file=True, overwrite=True).stage() as stage:
        stage.tmp.write_text("new")
        stage.publish()
    assert (tmp_path / "wlink").is_symlink() and (tmp_path / "w.txt").read_text() == "new"


def test_a_link_that_appears_while_the_command_runs_is_not_replaced(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    out = Output(tmp_path / "o", "--out", "export")
    with out.stage() as stage:
        _write(stage, {"a.bin": "1"})
        (tmp_path / "o").symlink_to("elsewhere")
        with pytest.raises(UserError, match="is now a link .*nothing was published"):
            stage.publish()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["elsewhere", "o"] and (tmp_path / "o").is_symlink()
    assert list((tmp_path / "elsewhere").iterdir()) == []


def test_a_loop_of_links_is_one_error(tmp_path):
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    with pytest.raises(UserError, match=r"--out: '.*/a'"):
        Output(tmp_path / "a", "--out", "export")
