"""How stores and sets are written (xmodal.data.atomic): a target that is not a store is refused, a failed
write removes only what it created, a finished one takes the target's place in one rename."""

from __future__ import annotations

from pathlib import Path

import pytest

from xmodal.base.outputs import discard_partial, missing_parents, publish_dir, read_record, temp_dir_beside
from xmodal.data.atomic import StagedDir, check_target
from xmodal.data.errors import StoreError
from xmodal.data.manifest import MANIFEST_FILE


def test_check_target_refuses_a_folder_that_is_not_a_store(tmp_path: Path):
    folder = tmp_path / "mine"
    folder.mkdir()
    (folder / "thesis.tex").write_text("keep me")
    with pytest.raises(StoreError, match="already exists and is not a store"):
        check_target(folder, False, "mult")
    with pytest.raises(StoreError, match=r"exists and is not a store \(no manifest.json\); refusing .* even with "
                                         "--overwrite"):
        check_target(folder, True, "mult")
    (folder / MANIFEST_FILE).write_text("{not json")
    with pytest.raises(StoreError, match="manifest.json cannot be read .* refusing to replace it"):
        check_target(folder, True, "mult")
    assert (folder / "thesis.tex").read_text() == "keep me"
    empty = tmp_path / "empty"
    empty.mkdir()
    check_target(empty, False, "lxmert")  # an empty folder is fine, and kept until the store replaces it
    assert empty.is_dir()


def test_a_failed_write_removes_only_what_it_created(tmp_path: Path):
    """An empty output folder the user made survives a failed write; folders the write made above
    its target do not; a finished write takes the empty folder's place."""
    mine = tmp_path / "mine"
    mine.mkdir()
    made = missing_parents(mine)
    tmp = temp_dir_beside(mine)
    discard_partial(tmp, made)
    assert mine.is_dir() and not any(mine.iterdir()) and sorted(tmp_path.iterdir()) == [mine]
    deep = tmp_path / "a" / "b" / "out"
    made = missing_parents(deep)
    assert made == [tmp_path / "a", tmp_path / "a" / "b"]
    discard_partial(temp_dir_beside(deep), made)
    assert sorted(tmp_path.iterdir()) == [mine]
    tmp = temp_dir_beside(mine)
    (tmp / MANIFEST_FILE).write_text("{}")
    publish_dir(tmp, mine, lambda: check_target(mine, False, "mult"))
    assert (mine / MANIFEST_FILE).is_file() and sorted(tmp_path.iterdir()) == [mine]


def test_a_staged_directory_is_published_or_removed_with_the_folders_it_made(tmp_path: Path):
    target = tmp_path / "a" / "b" / "store"
    with pytest.raises(RuntimeError), StagedDir(target, False, "mult") as staged:
        (staged.tmp / MANIFEST_FILE).write_text("{}")
        raise RuntimeError("the write failed")
    assert list(tmp_path.iterdir()) == []  # its temporary folder and the folders above the target: gone
    with StagedDir(target, False, "mult") as staged:
        (staged.tmp / MANIFEST_FILE).write_text('{"kind": "mult"}')
        staged.publish()
    assert (target / MANIFEST_FILE).read_text() == '{"kind": "mult"}' and sorted(target.parent.iterdir()) == [target]
    # published again over a store of the same kind only with overwrite (checked at publication too)
    with pytest.raises(StoreError, match="already exists; pass --overwrite"), StagedDir(target, False, "mult") as staged:
        (staged.tmp / MANIFEST_FILE).write_text('{"kind": "mult"}')
        staged.publish()
    assert sorted(target.parent.iterdir()) == [target]


def test_overwrite_never_replaces_a_store_holding_files_it_did_not_write(tmp_path: Path):
    """A store records its files when published (the output policy's record): `--overwrite` replaces it
    whole, but not while it holds a file of someone else's, which would go with it."""
    target = tmp_path / "store"
    for _ in range(2):  # the second time replaces the first store, with --overwrite
        with StagedDir(target, True, "mult") as staged:
            (staged.tmp / MANIFEST_FILE).write_text('{"kind": "mult", "schema_version": 1}')
            (staged.tmp / "train").mkdir()
            (staged.tmp / "train" / "part-0.parquet").write_text("rows")
            staged.publish()
    assert read_record(target) == {"command": "store mult", "files": [MANIFEST_FILE, "train/part-0.parquet"]}
    (target / "train" / "notes.txt").write_text("mine")
    with pytest.raises(StoreError, match=r"store: holds 'train/notes.txt', which is not part of the store; refusing "
                                         "to replace it even with --overwrite: move it out first"):
        check_target(target, True, "mult")
    assert (target / "train" / "notes.txt").read_text() == "mine"


def test_a_store_written_before_records_is_replaced_only_if_it_holds_store_files_alone(tmp_path: Path):
    """A store from before the output record: `--overwrite` replaces it when it holds only what a store's
    writers write (manifest, vocabulary, answers, Parquet shards at the top or one folder down), and
    refuses it, naming the file, when it holds anything else."""
    target = tmp_path / "old"
    (target / "train").mkdir(parents=True)
    (target / MANIFEST_FILE).write_text('{"kind": "mult", "schema_version": 1}')
    (target / "train" / "part-00000.parquet").write_text("rows")
    check_target(target, True, "mult")  # store files only: may be replaced
    for mine in ("notes.txt", "train/photo.jpg", "train/deep/part-1.parquet"):
        (target / mine).parent.mkdir(parents=True, exist_ok=True)
        (target / mine).write_text("mine")
        with pytest.raises(StoreError, match=f"holds '{mine}', which is not part of the store; refusing to replace "
                                             "it even with --overwrite"):
            check_target(target, True, "mult")
        (target / mine).unlink()
    # the folder the last case made stays, empty: a folder no store writer writes is the user's too
    with pytest.raises(StoreError, match="holds 'train/deep/', which is not part of the store"):
        check_target(target, True, "mult")
    (target / "train" / "deep").rmdir()
    with StagedDir(target, True, "mult") as staged:  # the old store replaced whole by a new one
        (staged.tmp / MANIFEST_FILE).write_text('{"kind": "mult", "schema_version": 1}')
        staged.publish()
    assert read_record(target) == {"command": "store mult", "files": [MANIFEST_FILE]}
