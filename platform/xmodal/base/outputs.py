"""The output policy of every command that writes, and the checks of where a job will write.

Checks, before any work starts: an output file or folder (`--out`, `--storage-path`, a store being built)
must be creatable and writable, and a URI well formed for its scheme. Each check raises `UserError`
naming the option, the value and what was wrong, so the command line prints one `error:` line
(xmodal.base.commands.user_errors) and nothing has been written.

The policy (`Output`, `Stage`), the same for every command that publishes a folder or a file:
- an output folder must be new, empty, or hold only this command's own earlier output, recognised by the
  record it wrote there (`RECORD`: the command's name and every file it wrote); an output file must not
  exist. `--overwrite` (where the command has it) lets a folder that holds other files be written into,
  those files kept, and an existing file be replaced. A folder inside it counts as much as a file: an
  empty one the command did not write is the user's, refused and kept like their files;
- nothing a command did not write is ever removed: replacing its own earlier output removes only the
  files its record lists;
- the output's path is resolved when it is checked (`..` and links): `a/sub/..` is `a`, and a link to a
  folder (or file) is written through, at the place it points to, under the same policy; the link
  itself is never replaced nor removed;
- everything is written into a hidden folder (or file) beside the target and published by rename at the
  end, so a reader sees the old output or the new one; a failure removes only what the command made;
- an `s3://` (or other URI) output is refused with one line by a command that writes locally; the
  commands that write to a URI check it with `check_uri` and write there for real.

Standard library only: every layer may call these, the config's validation included.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import urllib.parse
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

from xmodal.base.errors import UserError

# Schemes a run folder or store may live under (pyarrow's file systems that a cluster can share), and
# what each needs after `scheme://`.
URI_SCHEMES = {"s3": "a bucket", "gs": "a bucket", "gcs": "a bucket", "hdfs": "a host", "file": "an absolute path"}
# S3's bucket naming rules (GCS's are the same for names without dots): 3-63 lower-case letters,
# digits, dots and hyphens, starting and ending with a letter or digit.
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
# `s3:/runs`, `gs:bucket`: a scheme with fewer than two slashes, which a local path would take as a
# folder named `s3:`.
_HALF_URI = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):(/?)(?!/)")


def check_uri(uri: str, option: str) -> str:
    """A URI (`scheme://...`) as the place of a run folder or store: a known scheme, and a bucket, host
    or path as that scheme needs. Returns it unchanged."""
    u = urllib.parse.urlsplit(uri)
    scheme = u.scheme.lower()
    if scheme not in URI_SCHEMES:
        raise UserError(f"{option}: {uri!r} has scheme {u.scheme!r}; expected a local path or one of "
                        f"{', '.join(s + '://' for s in URI_SCHEMES)}")
    if scheme == "file":
        if u.netloc not in ("", "localhost") or not u.path.startswith("/"):
            raise UserError(f"{option}: {uri!r} is not a file URI of an absolute path; expected "
                            "file:///absolute/path")
        return uri
    if not u.netloc:
        raise UserError(f"{option}: {uri!r} names no {URI_SCHEMES[scheme][2:]}; expected "
                        f"{scheme}://{'bucket' if scheme != 'hdfs' else 'host'}/prefix")
    if scheme != "hdfs":
        bucket = urllib.parse.unquote(u.netloc)
        if not _BUCKET.match(bucket):
            raise UserError(f"{option}: {uri!r} has bucket {bucket!r}, which is not a valid bucket name; expected "
                            "3 to 63 lower-case letters, digits, dots or hyphens, starting and ending with a "
                            "letter or digit")
    return uri


def refuse_half_uri(text: str, option: str) -> None:
    """`s3:/bucket/x` would be written under a local folder named `s3:` (unless one exists)."""
    half = _HALF_URI.match(text)
    if half and not os.path.exists(text.split("/", 1)[0]):
        raise UserError(f"{option}: {text!r} looks like a URI with a slash missing; expected "
                        f"{half.group(1)}://bucket/prefix, or a local path")


def check_local_input(text: str, option: str, expected: str) -> str:
    """An input that is read from the local disk only (a checkpoint folder, a weights file): a URI, or one
    with a slash missing, is refused by name rather than taken for a relative path. Returns it unchanged."""
    if "://" in text or _HALF_URI.match(text) and not os.path.exists(text.split("/", 1)[0]):
        raise UserError(f"{option}: {text!r} is a URI; only local paths are read here ({expected}): copy it to "
                        "this machine first and give its path")
    return text


def check_writable_dir(path: str | Path, option: str) -> Path:
    """A local folder that a job will create (with its parents) or write into: made absolute, and
    refused when it or a parent is a file, or when the nearest existing folder above it cannot be
    written to. The test writes a temporary folder there and removes it (as root, permission bits do
    not say what /proc or a read-only mount will refuse). Nothing is left behind."""
    text = str(path)
    refuse_half_uri(text, option)
    p = Path(text).expanduser().absolute()
    if p.exists() and not p.is_dir():
        raise UserError(f"{option}: {text!r} is a file; expected a folder (or a path where one can be made)")
    existing = p
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise UserError(f"{option}: {text!r} cannot be made: {str(existing)!r} is a file, not a folder")
    try:
        probe = tempfile.mkdtemp(prefix=".xmodal-write-test-", dir=existing)
    except OSError as e:
        raise UserError(f"{option}: {text!r} cannot be written: {str(existing)!r} refuses new files "
                        f"({e.strerror or e}); choose a writable place") from None
    os.rmdir(probe)
    return p


def check_writable_file(path: str | Path, option: str) -> Path:
    """A local file that a job will write (its folder made if missing): not an existing folder, and a
    folder above it that can be made and written (`check_writable_dir`). Returns it made absolute."""
    text = str(path)
    refuse_half_uri(text, option)
    p = Path(text).expanduser().absolute()
    if p.is_dir():
        raise UserError(f"{option}: {text!r} is a folder; expected a file name")
    check_writable_dir(p.parent, option)
    return p


def check_output_location(text: str, option: str) -> str:
    """A run folder or store that may be local or remote: a URI is checked for its form (its bucket is
    reached only when used), a local path for being writable. Returns the text unchanged."""
    if "://" in text:
        return check_uri(text, option)
    check_writable_dir(text, option)
    return text


# ============================================================================ the output policy

# The record a command leaves in each output folder it publishes: who wrote the folder and which files,
# so that the same command's next run may replace exactly those and nothing else.
RECORD = ".xmodal-output.json"


def missing_parents(path: Path) -> list[Path]:
    """The folders above `path` that do not exist yet, outermost first: what staging will create, for
    `discard_partial` to remove after a failure."""
    return [p for p in reversed(path.parents) if not p.exists()]


def discard_partial(tmp: Path | None, made: Sequence[Path]) -> None:
    """Undo a failed write: remove the temporary folder or file, then the folders in `made` (from
    `missing_parents`, taken before the write began), deepest first, each only while it is empty.
    Nothing else is touched: a folder the user had made (an empty output folder) stays."""
    if tmp is not None:
        if tmp.is_dir() and not tmp.is_symlink():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)
    for p in reversed(made):
        try:
            p.rmdir()
        except OSError:
            pass


def temp_dir_beside(path: Path) -> Path:
    """A new hidden folder next to `path` (same file system, so the final rename is atomic)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    return tmp


def publish_dir(tmp: Path, path: Path, check: Callable[[], None]) -> None:
    """Make the finished folder `tmp` visible as `path` by rename; an existing `path` (allowed by
    `check`, which raises otherwise) is moved aside first and put back if the rename fails, so
    readers see the old folder or the new one, never a half-written one."""
    old = None
    if path.is_symlink():
        # A link is the user's: moving it aside would leave it behind (rmtree refuses links) and put a
        # folder where it was. `Output` resolves links when made, so one here appeared while the command ran.
        raise UserError(f"{path}: is now a link (to {os.readlink(path)!r}), not the folder this command checked; "
                        "nothing was published: run it again")
    if path.exists():
        check()
    if path.is_dir() and not any(path.iterdir()):
        path.rmdir()  # an empty folder (e.g. the user's output folder): the finished one takes its place
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


def files_under(root: Path) -> list[str]:
    """Every file and link under `root`, and every empty folder as `name/`, as POSIX paths relative to it,
    sorted; the record left out. An empty folder is listed because it is something someone made: were it
    left out, a folder the user made and left empty would look free, and replacing the output would
    remove it. A folder that cannot be read is listed the same way (what it holds is unknown)."""
    found = []

    def unreadable(e: OSError) -> None:
        if e.filename is not None and Path(e.filename) != root:
            found.append(Path(e.filename).relative_to(root).as_posix() + "/")

    for dirpath, dirnames, filenames in os.walk(root, onerror=unreadable):
        rel = Path(dirpath).relative_to(root)
        # a link to a folder is listed as an entry, never followed
        links = [d for d in dirnames if (Path(dirpath) / d).is_symlink()]
        dirnames[:] = sorted(d for d in dirnames if d not in links)
        for name in filenames + links:
            found.append((rel / name).as_posix())
        if rel != Path(".") and not (filenames or dirnames or links):
            found.append(rel.as_posix() + "/")
    return sorted(f for f in found if f != RECORD)


def folders_of(files: Sequence[str]) -> set[str]:
    """The folders (as `name/`) that hold the listed files: made by whoever wrote those files."""
    folders = set()
    for f in files:
        parts = f.rstrip("/").split("/")
        folders.update("/".join(parts[:i]) + "/" for i in range(1, len(parts)))
    return folders


def read_record(folder: Path) -> dict | None:
    """The record a command left in `folder` ({"command": ..., "files": [...]}), or None where there is
    none or it cannot be read as one."""
    try:
        record = json.loads((folder / RECORD).read_text())
    except (OSError, ValueError):
        return None
    if (not isinstance(record, dict) or not isinstance(record.get("command"), str)
            or not isinstance(record.get("files"), list) or not all(isinstance(f, str) for f in record["files"])):
        return None
    return record


def write_record(folder: Path, command: str) -> list[str]:
    """Leave in `folder` (being staged) the record of what `command` wrote there: every file under it.
    Returns those files."""
    files = files_under(folder)
    (folder / RECORD).write_text(json.dumps({"command": command, "files": files}, indent=1) + "\n")
    return files


def foreign_entries(folder: Path, command: str) -> list[str]:
    """The files and empty folders (`name/`) in `folder` that `command` did not write there by its record:
    all of them where it left no record (or another command's), none where the folder holds only its own
    earlier output. A folder its record's files were written into is its own even when emptied since."""
    record = read_record(folder)
    own = set(record["files"]) if record is not None and record["command"] == command else set()
    own |= folders_of(sorted(own))
    return [f for f in files_under(folder) if f not in own]


def resolved_output(given: Path, text: str, option: str, file: bool) -> tuple[Path, str]:
    """Where an output checked as `given` really is, and how messages name it. Resolved (`..`, links) so
    that the stage beside it is beside the real place: unresolved, `e4/sub/..` would be staged inside e4
    (a foreign file there), and a link would be moved aside and replaced by a folder. A link is written
    through, under the same policy at the place it points to; the link itself stays as it was."""
    try:
        real = given.resolve()
    except (OSError, RuntimeError) as e:  # a loop of links (RuntimeError before Python 3.13)
        raise UserError(f"{option}: {text!r} cannot be followed ({e}); expected a {'file' if file else 'folder'} "
                        "path") from None
    if real == given:
        return given, repr(str(given))
    # the place the link (or `..`) leads to must be writable as well: the parents made there are new
    (check_writable_file if file else check_writable_dir)(real, option)
    how = "a link to" if given.is_symlink() else "that is"
    return real, f"{str(given)!r} ({how} {str(real)!r})"


class Output:
    """One output of a command, checked against the policy when made (before any work) and again when
    published. `path`: the folder or file (a URI is refused: this command writes locally); `option`: how
    the user named it (`--out`, `OUT`); `command`: the command's name, kept in the folder's record;
    `file`: a file rather than a folder; `overwrite`: the user's `--overwrite` (None where the command has
    no such option, so the error does not offer one)."""

    def __init__(self, path: str | Path, option: str, command: str, *, file: bool = False,
                 overwrite: bool | None = False):
        text = str(path)
        if not text.strip():  # an empty value would be the working folder itself
            raise UserError(f"{option}: {text!r} is empty; expected a {'file' if file else 'folder'} name")
        if "://" in text:
            raise UserError(f"{option}: {text!r} is a URI; {command} writes a local {'file' if file else 'folder'} "
                            "only: write it here, then copy it (e.g. with `aws s3 cp`)")
        self.option, self.command, self.file, self.overwrite = option, command, file, overwrite
        given = check_writable_file(text, option) if file else check_writable_dir(text, option)
        self.path, self.shown = resolved_output(given, text, option, file)
        self.check()

    def _refuse(self, what: str) -> UserError:
        offer = (" or pass --overwrite to replace it" if self.file else
                 " or pass --overwrite to write beside what is there (none of it is removed)")
        return UserError(f"{self.option}: {self.shown} {what}; choose a new {'file' if self.file else 'or empty folder'}"
                         f"{offer if self.overwrite is False else ''}")

    def check(self) -> None:
        """Raises UserError if the output may not be written now (it is checked again at publish: the place
        may have changed while the command ran)."""
        p = self.path
        if self.file:
            if p.is_dir():
                raise UserError(f"{self.option}: {self.shown} is a folder; expected a file name")
            if (p.exists() or p.is_symlink()) and not self.overwrite:
                raise self._refuse("already exists")
            return
        if p.exists() and not p.is_dir():
            raise UserError(f"{self.option}: {self.shown} is a file; expected a folder (or a path where one can be made)")
        if p.is_dir() and not self.overwrite:
            foreign = foreign_entries(p, self.command)
            if foreign:
                raise self._refuse(f"already holds {foreign[0]!r}{f' and {len(foreign) - 1} more' if len(foreign) > 1 else ''}, "
                                   f"which {self.command} did not write there")

    def stage(self) -> Stage:
        """A hidden folder (or file name) beside the output to write into: `Stage.publish()` puts it in place."""
        return Stage(self)


class Stage:
    """An output being written: `tmp` (a new hidden folder beside a folder output; for a file output, a
    name beside it, not yet created). `publish()` checks the output again and puts `tmp` in place;
    `discard()`, or leaving a `with` block unpublished, removes `tmp` and the folders made for it."""

    def __init__(self, output: Output):
        self.output = output
        path = output.path
        self.made = missing_parents(path)
        self.published = False
        try:
            if output.file:
                path.parent.mkdir(parents=True, exist_ok=True)
                self.tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
            else:
                self.tmp = temp_dir_beside(path)
        except BaseException:
            discard_partial(None, self.made)
            raise

    def __enter__(self) -> Stage:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.published:
            self.discard()

    def discard(self) -> None:
        discard_partial(self.tmp, self.made)

    def publish(self) -> Path:
        """Put the written output in place and return its path. A folder gets its record; replacing this
        command's own earlier output removes only the files that output's record lists; with --overwrite
        a folder holding other files gets the new files written in beside them."""
        out, path = self.output, self.output.path
        try:
            out.check()
            if out.file:
                os.replace(self.tmp, path)
            else:
                files = write_record(self.tmp, out.command)
                if path.is_dir() and foreign_entries(path, out.command):
                    self._merge(files)
                else:
                    publish_dir(self.tmp, path, out.check)
        except BaseException:
            self.discard()
            raise
        self.published = True
        return path

    def _merge(self, files: list[str]) -> None:
        """--overwrite into a folder that holds files of others: this command's earlier files (by its record)
        removed, the new ones moved in (each replacing a file of the same name), the others kept."""
        path = self.output.path
        record = read_record(path)
        old = set(record["files"]) if record is not None and record["command"] == self.output.command else set()
        for f in sorted(old - set(files), reverse=True):  # a folder's files before the folder
            if f.endswith("/"):  # an empty folder it wrote: removed only while still empty
                try:
                    (path / f).rmdir()
                except OSError:
                    pass
            else:
                (path / f).unlink(missing_ok=True)
        for f in files + [RECORD]:
            if f.endswith("/"):  # an empty folder of its output: made (one of the user's may stand there)
                (path / f).mkdir(parents=True, exist_ok=True)
                continue
            (path / f).parent.mkdir(parents=True, exist_ok=True)
            os.replace(self.tmp / f, path / f)
        shutil.rmtree(self.tmp, ignore_errors=True)


class Scratch:
    """A command's working folder (a benchmark's `--work`, a scratch store): a new folder under `under`
    (checked as an output place; None: the system's temporary folder) that the command removes whole
    when it ends, however it ends (`with Scratch(...) as work:`, or `remove()`), together with the
    folders above it that were made for it. Nothing that was there before is touched; `keep=True` leaves
    it for the user to look at."""

    def __init__(self, under: str | Path | None, option: str, prefix: str, keep: bool = False):
        if under is not None and ("://" in str(under) or not str(under).strip()):
            raise UserError(f"{option}: {str(under)!r} is {'a URI' if str(under).strip() else 'empty'}; expected a "
                            "local folder to work in")
        base = check_writable_dir(under, option) if under is not None else Path(tempfile.gettempdir())
        self.keep = keep
        self.made = missing_parents(base / "x")
        base.mkdir(parents=True, exist_ok=True)
        try:
            self.path = Path(tempfile.mkdtemp(prefix=prefix, dir=base))
        except BaseException:
            discard_partial(None, self.made)
            raise

    def __enter__(self) -> Path:
        return self.path

    def __exit__(self, exc_type, exc, tb) -> None:
        self.remove()

    def remove(self) -> None:
        """Remove the folder (unless kept) and the folders made for it, each only while empty."""
        if not self.keep:
            discard_partial(self.path, self.made)
