"""The inputs' identity: what a resumed extraction checks before it keeps any earlier shard.

Each image is known by its id, its path (or URI), its size in bytes and its modification time
(`stat_images`: one `stat` a local file, an `s3://` prefix's from its one listing). Every shard records these for
its rows in its footer (`write.INPUTS`); a rerun compares them with the images as listed now
(`first_change`) and refuses to resume when any differs, naming the first: an id now given to another
file (an `--ids` file corrected), an image replaced or edited since, an image no longer among IMAGES.
Redoing only what changed would keep the rest; refusing is what we do, because a changed input usually
means the user changed the run (the error says to rerun with the inputs the work was made from, or to
pass --restart).
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from xmodal.extract.images import ExtractError, ImageRef

STAT_THREADS = 16


def _stat_uris(paths: list[str]) -> dict[str, tuple[int, int]]:
    """A list file's URI entries, one request each (a prefix's images have their listing's)."""
    import pyarrow as pa
    import pyarrow.fs as pafs

    out: dict[str, tuple[int, int]] = {}
    for p in paths:
        try:
            fs, path = pafs.FileSystem.from_uri(p)
            info = fs.get_file_info(path)
        except (OSError, pa.ArrowException, ValueError) as e:
            raise ExtractError(f"image {p}: cannot be read ({type(e).__name__}: {e}); check the location and, "
                               "for s3://, the AWS_* credentials, endpoint and region") from None
        out[p] = (int(info.size or 0), int(info.mtime_ns or 0))
    return out


def _stat_local(path: str) -> tuple[int, int]:
    try:
        st = os.stat(path)
    except OSError as e:
        raise ExtractError(f"image {path}: cannot be read ({e.strerror or e})") from None
    return st.st_size, st.st_mtime_ns


def stat_images(refs: Sequence[ImageRef]) -> dict[str, tuple[int, int]]:
    """path -> (size in bytes, modification time in ns) of every image: as listed, else asked."""
    out = {r.path: r.stat for r in refs if r.stat is not None}
    out.update(_stat_uris([r.path for r in refs if r.remote and r.stat is None]))
    local = [r.path for r in refs if not r.remote]
    with ThreadPoolExecutor(STAT_THREADS) as pool:
        out.update(zip(local, pool.map(_stat_local, local), strict=True))
    return out


def _when(ns: int) -> str:
    return datetime.datetime.fromtimestamp(ns / 1e9, datetime.timezone.utc).isoformat(timespec="seconds")


def first_change(kept: Mapping[str, Any], refs: Sequence[ImageRef], stats: Mapping[str, tuple[int, int]],
                 where: str) -> str | None:
    """How the images differ from what the kept shards (name -> their footer's inputs) were made from, the
    first difference in words; None when every kept image is what it was."""
    by_id = {r.img_id: r for r in refs}
    for shard, inputs in sorted(kept.items()):
        for img_id, path, size, mtime in inputs:
            r = by_id.get(img_id)
            made = f"{where}: {shard} holds img_id {img_id!r} extracted from {path}"
            if r is None:
                return f"{made}, and no image of IMAGES has that id now"
            if r.path != path:
                return f"{made}; IMAGES now gives that id to {r.path}"
            now = stats[path]
            if now[0] != size:
                return f"{made} when it had {size} bytes; it has {now[0]} now"
            if now[1] != mtime:
                return f"{made} when it was modified at {_when(mtime)}; it was modified at {_when(now[1])} since"
    return None
