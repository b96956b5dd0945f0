"""What every kind of data directory shares: LXMERT feature stores, MulT stores, LXMERT fine-tuning sets.

- `StoreError`: a missing, corrupted or inconsistent store or set (a `UserError`: one line, exit 2).
- `Manifest`: the base of the typed `manifest.json` models. Every manifest records its `kind`;
  reading one validates every field and names the file, the dotted field, the bad value and what
  was expected.
- `check_target` / `publish_dir` / `discard_partial`: the atomic write. A store is built in a hidden
  temporary directory beside the target and renamed into place; an existing directory is replaced only
  with `overwrite`, only when it is a store or set of the same kind, and never when it is not a store.
  A failed write removes only what it created (an empty output folder the user made stays).
- `ensure_derived`: the one policy for the embedded synthetic defaults (derived data, rebuilt when
  built otherwise); a store the user named is never modified.
- `prefetch_iter`: produce batches in a background thread, a few ahead of the training step.
- `Location` / `locate`: where a store is read from, a local folder or a URI (`s3://bucket/prefix`, anything
  `pyarrow.fs.FileSystem.from_uri` takes), read through pyarrow's file system either way.

The on-disk formats are described in docs/papers.md ("data formats"). Imports pydantic and pyarrow.
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import threading
import urllib.parse
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pydantic

from xmodal.base.console import say
from xmodal.base.errors import UserError
from xmodal.base.outputs import check_writable_dir

MANIFEST_FILE = "manifest.json"

# kind recorded in manifest.json -> what it is, in words
KINDS: dict[str, str] = {
    "lxmert": "an LXMERT feature store",
    "features": "a feature-only image store",
    "mult": "a MulT store",
    "lxmert-finetune": "an LXMERT fine-tuning set",
}

T = TypeVar("T")
M = TypeVar("M", bound="Manifest")


class StoreError(UserError):
    """A missing, corrupted or inconsistent store; the message names the file and what differs."""


def kind_name(kind: str | None) -> str:
    return KINDS.get(kind or "", f"a directory of unknown kind {kind!r}")


# ============================================================================ where a store lives


def is_uri(text: str) -> bool:
    """`s3://...`, `gs://...`, `file:///...`: a scheme before `://` (a local path has none)."""
    scheme, sep, _ = text.partition("://")
    return bool(sep) and scheme.replace("+", "").replace("-", "").replace(".", "").isalnum()


# One file system object per process and URI authority (scheme, bucket or host, query options):
# an S3 client costs a connection set-up and a region look-up, and Ray Data's read tasks read a
# row group each. The value: (file system, the path prefix of the URI's own path within it).
_FILESYSTEMS: dict[str, tuple[pafs.FileSystem, str]] = {}
_FS_LOCK = threading.Lock()
_LOCAL = pafs.LocalFileSystem()


def _split_uri(uri: str) -> tuple[str, str, str]:
    """(authority key, the URI's path unquoted without its leading '/', the query part)."""
    u = urllib.parse.urlsplit(uri)
    key = f"{u.scheme}://{u.netloc}" + (f"?{u.query}" if u.query else "")
    return key, urllib.parse.unquote(u.path).lstrip("/"), u.query


def _resolve(uri: str) -> tuple[pafs.FileSystem, str]:
    """The file system and the path within it of a URI, the file system cached per authority. What the
    credentials, endpoint and region are is pyarrow's to read from the environment (AWS_* for S3)."""
    key, rel, _ = _split_uri(uri)
    with _FS_LOCK:
        hit = _FILESYSTEMS.get(key)
    if hit is not None:
        return hit[0], hit[1] + rel
    try:
        fs, path = pafs.FileSystem.from_uri(uri)
    except (OSError, pa.ArrowException, ValueError) as e:
        raise StoreError(f"{uri}: not a location pyarrow can read ({type(e).__name__}: {e}); expected a local "
                         "path or a URI such as s3://bucket/prefix/store") from None
    if path.endswith(rel):  # the URI's path maps onto the file system's by a fixed prefix: cache it
        with _FS_LOCK:
            _FILESYSTEMS.setdefault(key, (fs, path[:len(path) - len(rel)]))
    return fs, path


class Location:
    """A file or folder of a store: a local path or a URI, read through a pyarrow file system (a local
    path is a `LocalFileSystem`, so every reader has one code path). What `pathlib.Path` offers that the
    readers use: `/`, `name`, `parent`, `exists`, `is_file`, `is_dir`, `read_text`, `read_bytes`;
    `str()` is the path or the URI, what error messages name; a local one is path-like. Pickles as that
    text; the file system is resolved again, once per process, where it is used (`_resolve`)."""

    __slots__ = ("text",)

    def __init__(self, text: str):
        self.text = text

    def __str__(self) -> str:
        return self.text

    def __repr__(self) -> str:
        return f"Location({self.text!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Location) and other.text == self.text

    def __hash__(self) -> int:
        return hash(self.text)

    def __getstate__(self) -> str:
        return self.text

    def __setstate__(self, state: str) -> None:
        self.text = state

    def __fspath__(self) -> str:
        """A local location is path-like (`Path(store.path)`, `open(...)` keep working); a remote one is
        not, and says so rather than being taken for a relative path."""
        local = self.local
        if local is None:
            raise TypeError(f"{self}: a remote location has no local path (read it through `Location`)")
        return str(local)

    @property
    def remote(self) -> bool:
        return is_uri(self.text) and not isinstance(self.fs, pafs.LocalFileSystem)

    @property
    def local(self) -> Path | None:
        """The local path, or None for a remote location."""
        if not is_uri(self.text):
            return Path(self.text)
        fs, path = _resolve(self.text)
        return Path(path) if isinstance(fs, pafs.LocalFileSystem) else None

    @property
    def fs(self) -> pafs.FileSystem:
        return _LOCAL if not is_uri(self.text) else _resolve(self.text)[0]

    @property
    def fs_path(self) -> str:
        return self.text if not is_uri(self.text) else _resolve(self.text)[1]

    def __truediv__(self, rel: str | Path) -> Location:
        if not is_uri(self.text):
            return Location(str(Path(self.text) / rel))
        head, sep, query = self.text.partition("?")
        return Location(f"{head.rstrip('/')}/{rel}{sep}{query}")

    @property
    def name(self) -> str:
        return Path(self.text.partition("?")[0] if is_uri(self.text) else self.text).name

    @property
    def parent(self) -> Location:
        if not is_uri(self.text):
            return Location(str(Path(self.text).parent))
        head, sep, query = self.text.partition("?")
        return Location(f"{head.rstrip('/').rsplit('/', 1)[0]}{sep}{query}")

    def _type(self) -> pafs.FileType:
        try:
            return self.fs.get_file_info(self.fs_path).type
        except (OSError, pa.ArrowException) as e:
            raise StoreError(f"{self}: cannot be looked up ({type(e).__name__}: {e}); check the location and, "
                             "for s3://, the AWS_* credentials, endpoint and region of this process") from None

    def exists(self) -> bool:
        return self._type() != pafs.FileType.NotFound

    def is_file(self) -> bool:
        return self._type() == pafs.FileType.File

    def is_dir(self) -> bool:
        return self._type() == pafs.FileType.Directory

    def read_bytes(self) -> bytes:
        """The file's bytes; a missing file raises FileNotFoundError, other failures OSError (as `Path`)."""
        try:
            with self.fs.open_input_stream(self.fs_path) as f:
                return f.read()
        except pa.ArrowException as e:
            raise OSError(str(e)) from None

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)

    def open_input_file(self) -> pa.NativeFile:
        """Random access (a Parquet footer, then row groups), as pyarrow's readers want."""
        return self.fs.open_input_file(self.fs_path)


def locate(path: str | Path | Location) -> Location:
    """A store's location: a URI as given (without a trailing '/'), a local path made absolute."""
    if isinstance(path, Location):
        return path
    text = str(path)
    if is_uri(text):
        head, sep, query = text.partition("?")
        return Location(head.rstrip("/") + sep + query)
    return Location(str(Path(text).expanduser().resolve()))


def store_path(location: Location) -> Path | Location:
    """What an opened store keeps as its `path`: a `Path` where the store is local (what callers have
    always had; reading it still goes through `locate`, a `LocalFileSystem`), the `Location` itself
    where it is remote. Both have the `/`, `name`, `read_text` ... the readers use."""
    return location.local or location


def open_parquet(path: str | Path | Location) -> pq.ParquetFile:
    """A Parquet file through its location's file system (reads the footer only)."""
    return pq.ParquetFile(locate(path).open_input_file())


# ============================================================================ typed manifests


def _show(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (dict, list, str, int, float, bool, type(None))) else repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


class Manifest(pydantic.BaseModel):
    """Base of every `manifest.json` model: unknown fields are errors, `kind` and `schema_version` are
    checked before the rest. Subclasses set KIND, SCHEMA_VERSION and, for manifests written before
    `kind` was recorded, `upgrade` (what an older format lacks, filled in on read)."""

    model_config = pydantic.ConfigDict(extra="forbid", validate_assignment=False)

    KIND: ClassVar[str]
    SCHEMA_VERSION: ClassVar[int]
    # fields that are written for readers of the JSON but derived from the others (dropped on read)
    DERIVED: ClassVar[tuple[str, ...]] = ()

    schema_version: int
    kind: str

    # Set on read when the file was of an older format (upgraded in memory); None = current.
    _older_format: str | None = pydantic.PrivateAttr(default=None)

    @property
    def older_format(self) -> str | None:
        """Why the file this was read from is of an older format, or None."""
        return self._older_format

    @classmethod
    def upgrade(cls, raw: dict[str, Any]) -> str | None:
        """Bring an older manifest up to date in place; return what was old (None = it was current)."""
        return None

    @classmethod
    def read(cls: type[M], directory: str | Path | Location) -> M:
        """Read and validate `directory/manifest.json` (a local folder or a URI); a StoreError names
        what is wrong and where."""
        root = locate(directory)
        path = root / MANIFEST_FILE
        if not path.is_file():
            what = "does not exist" if not root.exists() else "has no manifest.json"
            raise StoreError(f"{root}: {what}; expected {KINDS[cls.KIND]} ({MANIFEST_FILE} with "
                             f"\"kind\": {cls.KIND!r})")
        raw = read_manifest_json(path)
        found = manifest_kind(raw)
        if found != cls.KIND:
            raise StoreError(f"{path}: kind {found!r} is {kind_name(found)}; expected {KINDS[cls.KIND]} "
                             f"(\"kind\": {cls.KIND!r})")
        older = cls.upgrade(raw)
        version = raw.get("schema_version")
        if not isinstance(version, int) or isinstance(version, bool) or version != cls.SCHEMA_VERSION:
            raise StoreError(f"{path}: field schema_version = {_show(version)}: this code reads version "
                             f"{cls.SCHEMA_VERSION} of {KINDS[cls.KIND]}; re-create it")
        for name in cls.DERIVED:
            raw.pop(name, None)
        try:
            m = cls.model_validate(raw)
        except pydantic.ValidationError as e:
            raise StoreError(f"{path}: {_describe(e, cls)}") from None
        m._older_format = older
        m.check(str(path))
        return m

    def check(self, where: str) -> None:
        """Checks across fields (subclasses); raise StoreError naming `where`."""

    def dump(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def to_json(self) -> str:
        return json.dumps(self.dump(), indent=2) + "\n"

    def write(self, directory: str | Path) -> None:
        (Path(directory) / MANIFEST_FILE).write_text(self.to_json())


def _describe(e: pydantic.ValidationError, cls: type[Manifest]) -> str:
    """The first problems of a ValidationError as 'field a.b.c = value: expected ...'."""
    parts = []
    for err in e.errors()[:3]:
        loc = ".".join(str(x) for x in err["loc"]) or "(top level)"
        kind = err["type"]
        if err["loc"] and err["loc"][-1] == "[key]":  # a bad key of a mapping
            msg = err["msg"].removeprefix("Input should be ")
            parts.append(f"field {'.'.join(str(x) for x in err['loc'][:-2])} has key {_show(err['input'])}: "
                         f"expected {msg}")
        elif kind == "missing":
            parts.append(f"field {loc} is missing")
        elif kind == "extra_forbidden":
            known = ", ".join(f for f in cls.model_fields) if len(err["loc"]) == 1 else None
            parts.append(f"unknown field {loc} = {_show(err['input'])}"
                         + (f" (expected only: {known})" if known else ""))
        else:
            msg = err["msg"].removeprefix("Value error, ")
            msg = msg[0].lower() + msg[1:] if msg else msg
            parts.append(f"field {loc} = {_show(err['input'])}: expected {msg.removeprefix('input should be ')}")
    more = len(e.errors()) - len(parts)
    return "; ".join(parts) + (f" (and {more} more)" if more > 0 else "")


def read_manifest_json(path: Path | Location) -> dict[str, Any]:
    try:
        raw = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise StoreError(f"{path}: not valid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise StoreError(f"{path}: cannot be read ({type(e).__name__}: {e})") from None
    if not isinstance(raw, dict):
        raise StoreError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


def manifest_kind(raw: Mapping[str, Any]) -> str | None:
    """The kind a manifest records; LXMERT stores written before kinds were recorded have none but
    are recognised by their fields."""
    kind = raw.get("kind")
    if kind is None and "num_objects" in raw and "shards" in raw:
        return "lxmert"
    return kind if isinstance(kind, str) else None


def kind_at(path: Path | Location) -> str | None:
    """The kind of store or set at `path` (None if there is no manifest.json); StoreError if its
    manifest cannot be read."""
    mpath = path / MANIFEST_FILE
    if not mpath.is_file():
        return None
    return manifest_kind(read_manifest_json(mpath))


# ============================================================================ atomic writes


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
    set of the same kind; never a directory that is not a store at all. Raises StoreError naming the path."""
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


def missing_parents(path: Path) -> list[Path]:
    """The folders above `path` that do not exist yet, outermost first: what `temp_dir_beside` will
    create, for `discard_partial` to remove after a failure."""
    return [p for p in reversed(path.parents) if not p.exists()]


def discard_partial(tmp: Path | None, made: Sequence[Path]) -> None:
    """Undo a failed write: remove the temporary directory, then the folders in `made` (from
    `missing_parents`, taken before the write began), deepest first, each only while it is empty.
    Nothing else is touched: a folder the user had made (an empty output folder) stays."""
    if tmp is not None:
        shutil.rmtree(tmp, ignore_errors=True)
    for p in reversed(made):
        try:
            p.rmdir()
        except OSError:
            pass


def temp_dir_beside(path: Path) -> Path:
    """A new hidden directory next to `path` (same file system, so the final rename is atomic)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def publish_dir(tmp: Path, path: Path, check: Callable[[], None]) -> None:
    """Make the finished directory `tmp` visible as `path` by rename; an existing `path` (allowed by
    `check`, which raises otherwise) is moved aside first and put back if the rename fails, so
    readers see the old directory or the new one, never a half-written one."""
    old = None
    if path.exists():
        check()
    if path.is_dir() and not any(path.iterdir()):
        path.rmdir()  # an empty directory (e.g. the user's output folder): the finished one takes its place
        try:
            os.rename(tmp, path)
        except OSError:
            path.mkdir(exist_ok=True)
            raise
        return
    if path.exists():
        old = path.parent / f".{path.name}.old-{uuid.uuid4().hex[:8]}"
        os.rename(path, old)
    try:
        os.rename(tmp, path)
    except OSError:
        if old is not None:
            os.rename(old, path)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# ============================================================================ embedded defaults


def options_json(options: Any) -> Any:
    """Options as they read back from a manifest (tuples become lists, and so on)."""
    return json.loads(json.dumps(options))


def options_diff(recorded: Mapping[str, Any], wanted: Mapping[str, Any]) -> list[str]:
    """'name: built with X, asked for Y' for every option that differs."""
    keys = list(wanted) + [k for k in recorded if k not in wanted]
    return [f"{k}: built with {_show(recorded.get(k))}, asked for {_show(wanted.get(k))}" for k in keys
            if recorded.get(k) != wanted.get(k)]


def ensure_derived(path: str | Path, *, kind: str, read: Callable[[Path], Manifest],
                   stale: Callable[[Manifest], str | None], open_fn: Callable[[Path], T],
                   build: Callable[[Path, bool], T], what: str) -> T:
    """The policy of every embedded default (data the jobs build on first use): derived data.

    Missing: built. There and current: opened. Built with other options, or over another image store
    (`stale` returns why), or its manifest is of an older format: rebuilt atomically
    (`build(path, overwrite=True)`), with a one-line note on stdout saying why. `stale` raises for a
    directory at `path` that is not derived data (e.g. a store ingested from real files): that is
    never replaced, nor is a directory of another kind or one that is not a store.
    `what` names the default in messages ("the embedded synthetic LXMERT store").
    Derived data live on this machine's disk only: a remote `path` (a URI) is refused, never written
    (stores on S3 are made by ingesting locally and uploading, docs/cluster.md).
    """
    if is_uri(str(path)) and locate(path).local is None:
        raise StoreError(f"{path}: {what} is derived data, built on this machine's disk, never at a remote "
                         "location; give a local folder (a store on S3 is ingested locally, then uploaded)")
    p = Path(path).expanduser().resolve()
    for attempt in (0, 1):
        found = kind_at(p) if p.exists() else None
        if found is None:
            if p.exists() and not (p.is_dir() and not any(p.iterdir())):
                raise StoreError(f"{p}: exists and is not a store; {what} is built here: move it away")
            try:
                return build(p, False)
            except StoreError:
                if attempt == 0 and (p / MANIFEST_FILE).is_file():  # another process built it meanwhile
                    continue
                raise
        if found != kind:
            raise StoreError(f"{p}: holds {kind_name(found)}, not {KINDS[kind]}; {what} is built here: "
                             "move it away (it is not replaced)")
        manifest = read(p)
        why = stale(manifest)
        if why is None and manifest.older_format:
            why = f"its manifest is of an older format ({manifest.older_format})"
        if why is None:
            return open_fn(p)
        say(f"[xmodal] note: rebuilding {p} ({what}): {why}")
        return build(p, True)
    raise AssertionError("unreachable")


# ============================================================================ background prefetch

_END = object()


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


def prefetch_iter(items: Iterable[T], depth: int, pin_memory: bool = False) -> Iterator[T]:
    """Produce `items` in a background thread, up to `depth` ahead (0 = inline). The numpy gathers
    and Arrow reads release the GIL, so batches are built while the training step runs. Exceptions
    are re-raised in the consumer; leaving the loop early stops and closes the producer."""
    if depth <= 0:
        for item in items:
            yield item.pin_memory() if pin_memory else item  # type: ignore[attr-defined]
        return
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(x: Any) -> bool:
        while not stop.is_set():
            try:
                q.put(x, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        it = iter(items)
        try:
            for item in it:
                if pin_memory:
                    item = item.pin_memory()  # type: ignore[attr-defined]
                if not put(item):
                    break
            else:
                put(_END)
        except BaseException as e:  # noqa: BLE001 - re-raised in the consumer
            put(_Failure(e))
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()

    thread = threading.Thread(target=produce, name="xmodal-batch-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            x = q.get()
            if x is _END:
                return
            if isinstance(x, _Failure):
                raise x.exc
            yield x
    finally:
        stop.set()
        thread.join(timeout=5.0)


# ============================================================================ a worker's share of a split


@dataclass(frozen=True)
class Unit:
    """The unit a split is dealt out in: one Parquet row group of one shard, with its row count and
    its number of samples (LXMERT: sentences; MulT: clips)."""

    file: str  # absolute path or URI (`Location`)
    group: int
    rows: int
    samples: int


def epoch_units(units: Sequence[Unit], *, seed: int, epoch: int, rank: int = 0, world: int = 1,
                shuffle: bool = True) -> list[Unit]:
    """This rank's units of an epoch: one permutation of all units from (seed, epoch), the same on
    every rank, of which rank r takes every world-th from r. Ranks get disjoint units that together
    cover the split, and the same ones in the same order in every run: a run is reproducible and
    resumes exactly (docs/reliability.md, "Reproducible runs")."""
    units = list(units)
    if shuffle:
        order = np.random.default_rng([seed, epoch, 0x5EED]).permutation(len(units))
        units = [units[i] for i in order]
    return units[rank::world]


def epoch_samples(units: Sequence[Unit], *, seed: int, epoch: int, world: int, shuffle: bool = True) -> list[int]:
    """Samples per rank in an epoch (what the driver needs to count the steps every rank can take)."""
    return [sum(u.samples for u in epoch_units(units, seed=seed, epoch=epoch, rank=r, world=world, shuffle=shuffle))
            for r in range(world)]


def open_listed_parquet(path: str | Path | Location, rows: int, *, what: str = "shard",
                        error: type[UserError] = StoreError) -> pq.ParquetFile:
    """A Parquet file a manifest lists, checked against it as every store's `open` does: the file
    exists, its footer reads, and it holds the `rows` the manifest says. Reads the footer only (of a
    remote file too: nothing else is downloaded); the caller checks the schema it expects. `error`:
    the store's own error class."""
    path = locate(path)
    if not path.is_file():
        raise error(f"{path}: {what} listed in {MANIFEST_FILE} is missing")
    try:
        pf = open_parquet(path)
        got = pf.metadata.num_rows
    except (OSError, pa.ArrowException) as e:
        raise error(f"{path}: not a readable Parquet file ({type(e).__name__}: {e}); the {what} is corrupted, "
                    "re-ingest the store") from None
    if got != rows:
        raise error(f"{path}: has {got} rows, manifest says {rows}")
    return pf


def read_unit(unit: Unit, columns: Sequence[str] | None = None) -> pa.Table:
    """One row group of one shard, through its location's file system (cached per process: on a Ray
    Data task of any node, a remote shard's row group is read from the store, not from a copy)."""
    try:
        return open_parquet(Location(unit.file)).read_row_group(unit.group, columns=list(columns) if columns else None)
    except (OSError, pa.ArrowException) as e:
        raise StoreError(f"{unit.file}: cannot read row group {unit.group} ({type(e).__name__}: {e}); the shard "
                         "is corrupted, re-ingest the store") from None


def group_tables(tables: Iterable[pa.Table], min_rows: int) -> Iterator[pa.Table]:
    """Consecutive tables concatenated into tables of at least `min_rows` rows (the last may be short)."""
    pending: list[pa.Table] = []
    rows = 0
    for t in tables:
        pending.append(t)
        rows += t.num_rows
        if rows >= min_rows:
            yield pending[0] if len(pending) == 1 else pa.concat_tables(pending)
            pending, rows = [], 0
    if pending:
        yield pending[0] if len(pending) == 1 else pa.concat_tables(pending)
