"""Which images, under which ids, and how each is decoded.

Listing (`list_images`, once a run): a folder (recursive; .jpg .jpeg .png in any case), a list file (one
path a line; a relative path is relative to the list file's folder; blank lines and `#` comments
skipped), or a URI prefix (`s3://bucket/prefix`, listed through pyarrow's file system, the same
suffixes; its listing gives each image's size and modification time too).

Ids (`assign_ids`): an image's id is its file name without the extension (`COCO_val2014_000000123456.jpg`
-> `COCO_val2014_000000123456`, the img_id of LXMERT's JSON files for COCO). The reference's
`extract_coco_image.py` takes the name up to its first dot (`name.split(".")[0]`); the two agree on
every reference data set (COCO, Visual Genome, NLVR2, GQA names hold one dot), and differ only for
names with several dots, where the stem keeps more of the name. `--ids FILE` (a JSON object or a
TSV of `path<TAB>id` lines) gives other ids; two images with one id are an error naming both paths, as
are a path given twice and one image named by two entries (its path as listed and its absolute path).

Decoding (`decode`): `cv2.imdecode(bytes, cv2.IMREAD_COLOR)`, what the reference's `cv2.imread(path)`
returns for the same file: BGR uint8 (H, W, 3), a grey image repeated over the three channels, an
alpha channel dropped, a 16-bit PNG taken down to 8 bits by its high byte, a CMYK JPEG converted to
BGR, the EXIF orientation applied. Before OpenCV, a JPEG and a PNG are checked for being whole: a
JPEG needs its end-of-image marker after its first scan (bytes after it, such as a motion photo's
video, are allowed), a PNG its IEND chunk; OpenCV 4 returned a cut JPEG as an image with a grey
bottom and only a warning on stderr. A file that fails is a reject (a reason), not an error.

Size from the header (`header_size`), for checking `--boxes-from` before Ray starts: a JPEG's frame
header (SOF) or a PNG's IHDR, turned as OpenCV turns the image by its EXIF orientation (5 to 8 swap
width and height; OpenCV reads it from a JPEG's APP1 segment and from a PNG's eXIf chunk, before or
after the image data). Only the first bytes are read; a local PNG's chunk list is walked to its end
by seeking, a remote one's only up to its image data, so a remote PNG without an eXIf chunk before
that has a size whose orientation is not certain.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from xmodal.base.errors import UserError
from xmodal.data.location import is_uri

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png")


class ExtractError(UserError):
    """Bad input to the extraction: names the file (and line, id or box), the value and what was expected."""


class Listed(NamedTuple):
    """One image as listed."""

    path: str  # absolute local path, or a URI
    keys: tuple[str, ...]  # the names `--ids` may use for it (as listed, relative to the folder)
    remote: bool = False  # a URI
    stat: tuple[int, int] | None = None  # (size, mtime_ns), where the listing gave them (an s3:// prefix's)


@dataclass(frozen=True)
class Listing:
    """IMAGES listed once (`list_images`): what each image is, and whether IMAGES is a URI prefix."""

    root: str  # the prefix (a URI, no trailing /), the folder, or the list file's folder
    remote: bool  # IMAGES is a URI prefix
    entries: list[Listed]


@dataclass(frozen=True)
class ImageRef:
    path: str  # absolute local path, or a URI
    img_id: str
    keys: tuple[str, ...] = ()  # the names `--ids` may use for it (as listed, relative to the folder)
    remote: bool = False  # a URI
    stat: tuple[int, int] | None = None  # (size, mtime_ns), where the listing gave them (`Listed.stat`)


def _image_name(name: str) -> bool:
    return name.lower().endswith(IMAGE_SUFFIXES)


def list_images(source: str) -> Listing:
    """Every image of `source` (a folder's and a prefix's sorted by path, a list file's in its order)."""
    if is_uri(source):
        return Listing(source.rstrip("/"), True, _list_uri(source))
    p = Path(source).expanduser()
    if not p.exists():
        raise ExtractError(f"IMAGES {source}: does not exist; expected a folder of images, a list file "
                           "(one image path a line) or an s3:// prefix")
    p = p.resolve()
    if p.is_dir():
        found = []
        for dirpath, dirnames, filenames in os.walk(p, followlinks=True):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            for name in filenames:
                if _image_name(name) and not name.startswith("."):
                    full = Path(dirpath) / name
                    found.append(Listed(str(full), (str(full.relative_to(p)),)))
        if not found:
            raise ExtractError(f"IMAGES {p}: holds no image (searched recursively for "
                               f"{', '.join(IMAGE_SUFFIXES)} in any case)")
        return Listing(str(p), False, sorted(found))
    return Listing(str(p.parent), False, _list_file(p))


def _list_file(p: Path) -> list[Listed]:
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ExtractError(f"IMAGES {p}: is neither a folder nor a list file of image paths (not UTF-8 "
                           "text; is it an image? give its folder)") from None
    except OSError as e:
        raise ExtractError(f"IMAGES {p}: cannot be read ({e.strerror or e})") from None
    found = []
    first: dict[str, int] = {}  # path -> the line that listed it
    for lineno, line in enumerate(text.splitlines(), 1):
        entry = line.strip()
        if not entry or entry.startswith("#"):
            continue
        remote = is_uri(entry)
        if remote:
            path = entry
        else:
            full = (p.parent / Path(entry).expanduser()).resolve()
            if not full.is_file():
                what = "is a folder" if full.is_dir() else "does not exist"
                raise ExtractError(f"{p}:{lineno}: image {entry!r} {what} ({full}); expected one image file a line")
            path = str(full)
        if path in first:
            raise ExtractError(f"{p}:{lineno}: image {entry!r} is listed twice: {p}:{first[path]} names the same "
                               f"{'URI' if remote else 'file'} ({path}); remove one of the lines")
        first[path] = lineno
        found.append(Listed(path, (entry,), remote))
    if not found:
        raise ExtractError(f"IMAGES {p}: the list file names no image (one image path a line)")
    return found


def _list_uri(source: str) -> list[Listed]:
    """The prefix's images, with the size and modification time its one listing gives."""
    import pyarrow as pa
    import pyarrow.fs as pafs

    head = source.rstrip("/")
    try:
        fs, root = pafs.FileSystem.from_uri(head)
        infos = fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
    except (OSError, pa.ArrowException, ValueError) as e:
        raise ExtractError(f"IMAGES {source}: cannot be listed ({type(e).__name__}: {e}); check the location "
                           "and, for s3://, the AWS_* credentials, endpoint and region") from None
    scheme = head.split("://", 1)[0]
    found = []
    for info in infos:
        if info.type == pafs.FileType.File and _image_name(info.base_name):
            rel = info.path[len(root):].lstrip("/")
            found.append(Listed(f"{head}/{rel}" if rel else f"{scheme}://{info.path}", (rel,), True,
                                (int(info.size or 0), int(info.mtime_ns or 0))))
    if not found:
        raise ExtractError(f"IMAGES {source}: holds no image (searched recursively for "
                           f"{', '.join(IMAGE_SUFFIXES)} in any case)")
    return sorted(found)


def image_sources(listing: Listing, refs: list[ImageRef]) -> dict[str, str]:
    """img_id -> where the image came from, as a store records it beside `listing.root`: under a folder
    the path relative to it; under an s3:// prefix, and for a list file's URI entries, the URI; for a
    list file's local entries the path relative to the list file's folder, or absolute when outside it."""
    out = {}
    for r in refs:
        if listing.remote or r.remote:
            out[r.img_id] = r.path
            continue
        try:
            out[r.img_id] = Path(r.path).relative_to(listing.root).as_posix()
        except ValueError:
            out[r.img_id] = r.path
    return out


def default_id(path: str) -> str:
    """The file name without its extension."""
    name = path.rstrip("/").rsplit("/", 1)[-1]
    return Path(name).stem


class _JsonObject(dict):
    """A JSON object that remembers its first key given twice: `json.loads` keeps the last value of a
    repeated key without a word, which would give an image the later of two ids silently."""

    twice: tuple[str, object, object] | None = None  # (key, first value, second value)

    @classmethod
    def of(cls, pairs: list[tuple[str, object]]) -> _JsonObject:
        obj = cls()
        for k, v in pairs:
            if k in obj and obj.twice is None:
                obj.twice = (k, obj[k], v)
            obj[k] = v
        return obj


def read_id_map(file: str) -> dict[str, str]:
    """`--ids FILE`: a JSON object {path: img_id}, or TSV lines `path<TAB>img_id`."""
    p = Path(file).expanduser()
    if not p.is_file():
        raise ExtractError(f"--ids {file}: {'is a folder' if p.is_dir() else 'does not exist'}; expected a JSON "
                           "object {path: img_id} or a TSV file of path<TAB>img_id lines")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ExtractError(f"--ids {file}: cannot be read ({e})") from None
    if text.lstrip().startswith("{"):
        try:
            raw = json.loads(text, object_pairs_hook=_JsonObject.of)
        except json.JSONDecodeError as e:
            raise ExtractError(f"--ids {file}: not valid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
        if raw.twice:
            k, first, then = raw.twice
            raise ExtractError(f"--ids {file}: path {k!r} is given twice (ids {first!r:.60} and {then!r:.60}); "
                               "expected each path once")
        for k, v in raw.items():
            if not isinstance(v, str):
                raise ExtractError(f"--ids {file}: entry {k!r}: expected an img_id string, got {v!r:.60}")
        return dict(raw)
    out: dict[str, str] = {}
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.rstrip("\r").split("\t")
        if len(parts) != 2:
            raise ExtractError(f"--ids {file}:{lineno}: expected path<TAB>img_id, got {len(parts)} tab-separated "
                               "field(s) (or give a JSON object {path: img_id})")
        if parts[0] in out:
            raise ExtractError(f"--ids {file}:{lineno}: path {parts[0]!r} is given twice")
        out[parts[0]] = parts[1]
    return out


def check_id(img_id: str, where: str) -> None:
    if not img_id or any(c in img_id for c in "\t\r\n"):
        raise ExtractError(f"{where}: img_id {img_id!r}: expected a non-empty id without tabs or line ends "
                           "(the TSV's first field)")


def assign_ids(listing: Listing, id_map: dict[str, str] | None = None, ids_file: str = "") -> list[ImageRef]:
    """The images with their ids; `id_map` (from `--ids`) names an image by its absolute path, by its path
    as listed or relative to the IMAGES folder; every entry must name an image. Duplicate ids fail."""
    refs = []
    used: set[str] = set()
    for path, keys, remote, stat in listing.entries:
        img_id = default_id(path)
        where = path
        if id_map:
            named = [k for k in dict.fromkeys((path, *keys)) if k in id_map]
            if len(named) > 1:  # 'x.jpg' and '/imgs/x.jpg': which id would win is the order of the keys
                named.sort(key=list(id_map).index)  # as the file gives them
                raise ExtractError(f"--ids {ids_file}: image {path} is given two ids by two entries: {named[0]!r} -> "
                                   f"{id_map[named[0]]!r} and {named[1]!r} -> {id_map[named[1]]!r}; expected one "
                                   "entry an image")
            if named:
                img_id, where = id_map[named[0]], f"--ids {ids_file}: entry {named[0]!r}"
                used.add(named[0])
        check_id(img_id, where)
        refs.append(ImageRef(path, img_id, keys, remote, stat))
    if id_map:
        unused = [k for k in id_map if k not in used]
        if unused:
            raise ExtractError(f"--ids {ids_file}: {len(unused)} entr{'y names' if len(unused) == 1 else 'ies name'} "
                               f"no image of IMAGES, e.g. {unused[0]!r}; expected paths as listed, relative to the "
                               "IMAGES folder, or absolute")
    seen: dict[str, str] = {}
    for r in refs:
        if r.img_id in seen:
            raise ExtractError(f"img_id {r.img_id!r} is given to two images: {seen[r.img_id]} and {r.path}; rename "
                               "one, or give ids with --ids FILE")
        seen[r.img_id] = r.path
    return refs


# ============================================================================ decoding


def _jpeg_incomplete(data: bytes) -> str | None:
    """Why a JPEG is not whole, or None: its marker segments up to the first scan (SOS) must be complete,
    and an end-of-image marker (FF D9) must follow that scan's data."""
    n, i = len(data), 2
    while True:
        while i < n and data[i] != 0xFF:  # bytes between segments: libjpeg skips them (with a warning)
            i += 1
        while i < n and data[i] == 0xFF:  # fill bytes
            i += 1
        if i >= n:
            return "truncated JPEG: the file ends in its headers, before the image data"
        marker = data[i]
        i += 1
        if marker == 0xD9:
            return "JPEG without image data: end-of-image marker before any scan"
        if marker in (0x01, 0xD8) or 0xD0 <= marker <= 0xD7:
            continue
        if i + 2 > n:
            return "truncated JPEG: the file ends in its headers, before the image data"
        length = int.from_bytes(data[i:i + 2], "big")
        if i + length > n:
            return "truncated JPEG: the file ends in its headers, before the image data"
        i += length
        if marker == 0xDA:  # start of scan: the entropy-coded data follows
            break
    if data.find(b"\xff\xd9", i) < 0:
        return "truncated JPEG: no end-of-image marker after the image data (the file looks cut off)"
    return None


def _png_incomplete(data: bytes) -> str | None:
    """Why a PNG is not whole, or None: its chunks must run whole up to IEND."""
    n, i = len(data), 8
    while i + 8 <= n:
        length = int.from_bytes(data[i:i + 4], "big")
        kind = data[i + 4:i + 8]
        if kind == b"IEND":
            return None
        i += 12 + length
    return "truncated PNG: no IEND chunk (the file looks cut off)"


def sniff(data: bytes) -> str | None:
    if data[:3] == b"\xff\xd8\xff":
        return "jpeg"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "png"
    return None


def decode(data: bytes) -> tuple[np.ndarray | None, str]:
    """(image, "") with the image as `cv2.imread(path, cv2.IMREAD_COLOR)` returns it, or (None, why not)."""
    import cv2

    if not data:
        return None, "empty file (0 bytes)"
    kind = sniff(data)
    why = _jpeg_incomplete(data) if kind == "jpeg" else _png_incomplete(data) if kind == "png" else None
    if why:
        return None, why
    try:
        im = cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)
    except cv2.error as e:
        return None, f"OpenCV cannot decode it ({' '.join(str(e).split())[:200]})"
    if im is None:
        return None, f"not an image OpenCV can read ({kind.upper() + ' data is corrupt' if kind else 'unknown format'})"
    if im.ndim != 3 or im.shape[2] != 3 or im.dtype != np.uint8 or im.shape[0] < 1 or im.shape[1] < 1:
        return None, f"OpenCV returned an unusable array ({im.dtype} {im.shape})"
    return im, ""


# ============================================================================ size from the header

HEADER_BYTES = 64 * 1024  # the first read; a JPEG whose segments before the scan are larger reads more
MAX_HEADER_BYTES = 16 * 1024 * 1024
_SOF = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}


@dataclass(frozen=True)
class HeaderSize:
    h: int  # as OpenCV returns the image (its EXIF orientation applied)
    w: int
    certain: bool = True  # False: the orientation could not be read (h and w may be swapped)


def _exif_orientation(tiff: bytes) -> int:
    """The Orientation tag (0x0112) of a TIFF-structured EXIF block; 1 where there is none."""
    if tiff[:2] not in (b"II", b"MM") or len(tiff) < 8:
        return 1
    e = "<" if tiff[:2] == b"II" else ">"
    ifd = struct.unpack(e + "I", tiff[4:8])[0]
    if ifd + 2 > len(tiff):
        return 1
    for k in range(struct.unpack(e + "H", tiff[ifd:ifd + 2])[0]):
        at = ifd + 2 + 12 * k
        if at + 12 > len(tiff):
            break
        tag, kind = struct.unpack(e + "HH", tiff[at:at + 4])
        if tag == 0x0112 and kind == 3:
            value = struct.unpack(e + "H", tiff[at + 8:at + 10])[0]
            return value if 1 <= value <= 8 else 1
    return 1


def _jpeg_size(read) -> tuple[int, int, int] | None:
    """(h, w, orientation) from the segments before the first scan; None where they do not say."""
    data = read(HEADER_BYTES)
    size, orientation, i = None, 1, 2
    while True:
        if i + 4 > len(data):
            if len(data) >= MAX_HEADER_BYTES or len(more := read(min(2 * len(data), MAX_HEADER_BYTES))) <= len(data):
                return None
            data = more
            continue
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker in (0x01, 0xD8) or 0xD0 <= marker <= 0xD7:
            i += 2
            continue
        length = int.from_bytes(data[i + 2:i + 4], "big")
        if i + 2 + length > len(data):
            if len(data) >= MAX_HEADER_BYTES or len(more := read(min(max(2 * len(data), i + 2 + length),
                                                                    MAX_HEADER_BYTES))) <= len(data):
                return None
            data = more
            continue
        body = data[i + 4:i + 2 + length]
        if marker in _SOF and len(body) >= 5 and size is None:
            size = (int.from_bytes(body[1:3], "big"), int.from_bytes(body[3:5], "big"))
        elif marker == 0xE1 and body[:6] == b"Exif\0\0" and orientation == 1:
            orientation = _exif_orientation(body[6:])
        elif marker in (0xDA, 0xD9):
            break
        i += 2 + length
    if size is None or size[0] < 1 or size[1] < 1:  # height 0: given later (DNL), OpenCV decides
        return None
    return size[0], size[1], orientation


def _png_size(read, read_at, walk_all: bool) -> tuple[int, int, int] | None:
    """(h, w, orientation, or 0 where unknown) from IHDR and an eXIf chunk."""
    data = read(HEADER_BYTES)
    if len(data) < 24 or data[12:16] != b"IHDR":
        return None
    w, h = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    i, seen_data = 8, False
    while True:
        head = data[i:i + 8] if i + 8 <= len(data) else (read_at(i, 8) if walk_all or not seen_data else b"")
        if len(head) < 8:
            return (h, w, 1) if walk_all else (h, w, 1 if not seen_data else 0)
        length, kind = int.from_bytes(head[:4], "big"), head[4:8]
        if kind == b"eXIf":
            tiff = data[i + 8:i + 8 + length] if i + 8 + length <= len(data) else read_at(i + 8, length)
            return h, w, _exif_orientation(tiff)
        if kind == b"IEND":
            return h, w, 1
        if kind == b"IDAT":
            seen_data = True
            if not walk_all and i + 12 + length > len(data):
                return h, w, 0
        i += 12 + length


def header_size(path: str) -> HeaderSize | None:
    """The size OpenCV will decode the image at `path` (a local path or a URI) to, read from its header;
    None for a file that is not a JPEG or PNG with a readable header (decoding will say why)."""
    from xmodal.data.location import Location

    loc = Location(path)
    try:
        with loc.fs.open_input_file(loc.fs_path) as f:
            total = f.size()

            def read(n: int) -> bytes:
                return f.read_at(min(n, total), 0)

            def read_at(offset: int, n: int) -> bytes:
                return f.read_at(max(0, min(n, total - offset)), offset) if offset < total else b""

            first = read(8)
            if first[:3] == b"\xff\xd8\xff":
                found = _jpeg_size(read)
            elif first == b"\x89PNG\r\n\x1a\n":
                found = _png_size(read, read_at, walk_all=not loc.remote)
            else:
                return None
    except (OSError, ValueError):
        return None
    if found is None:
        return None
    h, w, orientation = found
    if orientation >= 5:
        h, w = w, h
    return HeaderSize(h, w, certain=orientation != 0)
