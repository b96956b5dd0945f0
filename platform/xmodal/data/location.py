"""Where a store is read from: a local folder or a URI (`s3://bucket/prefix`, anything
`pyarrow.fs.FileSystem.from_uri` takes), read through pyarrow's file system either way (`Location`,
`locate`), one file system object per process and authority."""

from __future__ import annotations

import threading
import urllib.parse
from pathlib import Path

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq

from xmodal.data.errors import StoreError


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
