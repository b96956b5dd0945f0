"""How every store and set is written: atomically, so that readers see the old directory or the new one.

A store is built in a hidden temporary directory beside the target and renamed into place; an existing
directory is replaced only with `overwrite`, only when it is a store or set of the same kind, and never
when it is not a store or holds files that the store's record (the output policy's, written at publish)
does not list. A failed write removes only what it created (an empty output folder the user
made stays). `StagedDir` is that sequence for a writer; `check_target` is also called on its own, before
a long read, so that a target that will be refused fails first. Imports the standard library only (and
the data layer's `errors` and `manifest`).
"""

from __future__ import annotations

from pathlib import Path

from xmodal.base.outputs import (
    RECORD,
    check_writable_dir,
    discard_partial,
    files_under,
    foreign_entries,
    missing_parents,
    publish_dir,
    temp_dir_beside,
    write_record,
)
from xmodal.data.errors import StoreError
from xmodal.data.location import is_uri
from xmodal.data.manifest import KINDS, MANIFEST_FILE, kind_at, kind_name


def local_target(path: str | Path) -> Path:
    """Where a writer builds a store or set: a local folder, made absolute. A URI is refused (stores are
    written on a local disk, atomically by rename; one for S3 is uploaded after, docs/cluster.md)."""
    if is_uri(str(path)):
        raise StoreError(f"{path}: stores and sets are written to a local folder; write it here, then upload "
                         "it (e.g. `aws s3 sync STORE s3://bucket/prefix/STORE`)")
    target = Path(path).expanduser().resolve()
    # Creatable and writable before anything is read (a half URI such as `s3:/bucket` included): the
    # temporary folder beside it is the first thing written, after the (possibly long) read.
    check_writable_dir(path if not target.exists() else target.parent, "output folder")
    return target


def check_target(path: Path, overwrite: bool, kind: str) -> None:
    """May a `kind` store or set be written at `path`? Nothing there, or an empty directory: yes (the
    empty directory, e.g. made by the user, is left alone here and replaced only by `publish_dir`, so a
    failed write keeps it). An existing directory: only with `overwrite`, and only if it is a store or
    set of the same kind; never a directory that is not a store at all, nor one that holds files the store's
record (written at publish) does not list. Raises StoreError naming the path."""
    if not path.exists() or (path.is_dir() and not any(path.iterdir())):
        return
    writing = KINDS[kind]
    if not path.is_dir() or not (path / MANIFEST_FILE).is_file():
        if not overwrite:
            raise StoreError(f"{path}: already exists and is not a store; choose another path")
        raise StoreError(f"{path}: exists and is not a store (no {MANIFEST_FILE}); refusing to replace it "
                         f"with {writing} even with --overwrite")
    try:
        found = kind_at(path)
    except StoreError as e:
        raise StoreError(f"{path}: exists, and its {MANIFEST_FILE} cannot be read ({e}); refusing to replace it "
                         "even with --overwrite: remove it yourself if it is yours to delete") from None
    if found != kind:
        raise StoreError(f"{path}: holds {kind_name(found)} (kind {found!r}); refusing to replace it with "
                         f"{writing} (kind {kind!r}){' even with --overwrite' if overwrite else ''}: --overwrite "
                         "replaces only a store or set of the same kind; choose another path")
    if not overwrite:
        raise StoreError(f"{path}: already exists; pass --overwrite to replace it ({writing})")
    # A store written with its record: anything else in the folder is someone's, and stays. One written
    # before stores had records: only what a store's writers write (its manifest, vocabulary, answers and
    # Parquet shards, at the top or one folder down) may go with it.
    foreign = (foreign_entries(path, record_command(kind)) if (path / RECORD).is_file()
               else [f for f in files_under(path) if not _store_file(f)])
    if foreign:
        raise StoreError(f"{path}: holds {foreign[0]!r}{f' and {len(foreign) - 1} more' if len(foreign) > 1 else ''}, "
                         f"which is not part of the store; refusing to replace it even with --overwrite: move "
                         f"{'it' if len(foreign) == 1 else 'them'} out first")


STORE_FILES = (MANIFEST_FILE, "vocab.txt", "answers.json", "writing.json", "rejects.jsonl")


def _store_file(rel: str) -> bool:
    """Is `rel` (a POSIX path in a store folder) a file a store's writer makes?"""
    return rel in STORE_FILES or (rel.endswith(".parquet") and rel.count("/") <= 1)


def record_command(kind: str) -> str:
    """The command a store of `kind` names in its output record (xmodal.base.outputs.RECORD)."""
    return f"store {kind}"


class StagedDir:
    """A store or set of `kind` being written for `path` (local, from `local_target`): `tmp`, a new
    hidden directory beside it, to write into; `publish()` renames it into place (checking the target
    again: it may have changed while the store was built); `discard()`, or leaving a `with` block by an
    exception, removes it and the folders made for it."""

    def __init__(self, path: Path, overwrite: bool, kind: str):
        self.path, self.overwrite, self.kind = path, overwrite, kind
        self.made = missing_parents(path)
        try:
            self.tmp = temp_dir_beside(path)
        except BaseException:
            discard_partial(None, self.made)
            raise

    def __enter__(self) -> StagedDir:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.discard()

    def publish(self) -> None:
        write_record(self.tmp, record_command(self.kind))
        publish_dir(self.tmp, self.path, lambda: check_target(self.path, self.overwrite, self.kind))

    def discard(self) -> None:
        discard_partial(self.tmp, self.made)
