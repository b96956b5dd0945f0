"""Where a job will write, checked before any work starts: an output file or folder (`--out`,
`--storage-path`, a store being built) must be creatable and writable, and a URI well formed for its
scheme. Each check raises `UserError` naming the option, the value and what was wrong, so the command
line prints one `error:` line (xmodal.base.commands.user_errors) and nothing has been written.

Standard library only: every layer may call these, the config's validation included.
"""

from __future__ import annotations

import os
import re
import tempfile
import urllib.parse
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


def _refuse_half_uri(text: str, option: str) -> None:
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
    _refuse_half_uri(text, option)
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
    _refuse_half_uri(text, option)
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
