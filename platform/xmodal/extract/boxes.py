"""How many regions an image gets: `--boxes 36` (LXMERT's obj36), `--boxes 10-100` (the bottom-up
default: between 10 and 100 boxes, by confidence) or `--boxes-from FILE` (the regions are given:
features of those boxes, no selection).

`FILE` is a JSON object {img_id: [[x1, y1, x2, y2], ...]} in original-image pixels. Its shape, every
number (finite, x1 <= x2, y1 <= y2, not negative), its ids (each names an image, each image has
boxes) and that every box is inside its image are checked before Ray starts, the last against the
size in the image's header (`images.header_size`, the EXIF orientation applied as OpenCV applies it).
The decode tasks check it again on the decoded image (a header that could not be read, a remote PNG
whose orientation is not in its first bytes), and fail the run with the same kind of message.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np

from xmodal.extract.images import ExtractError, ImageRef, header_size

MAX_BOXES = 1000


def parse_boxes(text: str) -> tuple[int, int]:
    """`36` -> (36, 36); `10-100` -> (10, 100)."""
    m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", text)
    if m is None:
        raise ExtractError(f"--boxes {text!r}: expected a number of boxes (36) or a range MIN-MAX (10-100)")
    lo = int(m.group(1))
    hi = int(m.group(2)) if m.group(2) else lo
    if not 1 <= lo <= hi <= MAX_BOXES:
        raise ExtractError(f"--boxes {text!r}: expected 1 <= MIN <= MAX <= {MAX_BOXES}")
    return lo, hi


def read_boxes_file(file: str, img_ids: list[str]) -> dict[str, np.ndarray]:
    """`--boxes-from FILE` -> {img_id: (K, 4) float32}, checked against the images' ids."""
    p = Path(file).expanduser()
    if not p.is_file():
        raise ExtractError(f"--boxes-from {file}: {'is a folder' if p.is_dir() else 'does not exist'}; expected a "
                           "JSON object {img_id: [[x1, y1, x2, y2], ...]} in original-image pixels")
    try:
        raw = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ExtractError(f"--boxes-from {file}: not valid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ExtractError(f"--boxes-from {file}: cannot be read ({e})") from None
    if not isinstance(raw, dict):
        raise ExtractError(f"--boxes-from {file}: expected a JSON object {{img_id: [[x1, y1, x2, y2], ...]}}, "
                           f"got {type(raw).__name__}")
    out: dict[str, np.ndarray] = {}
    for img_id, boxes in raw.items():
        where = f"--boxes-from {file}: img_id {img_id!r}"
        if not isinstance(boxes, list) or not boxes:
            raise ExtractError(f"{where}: expected a non-empty list of [x1, y1, x2, y2] boxes, got {boxes!r:.60}")
        if len(boxes) > MAX_BOXES:
            raise ExtractError(f"{where}: {len(boxes)} boxes; expected at most {MAX_BOXES}")
        for i, b in enumerate(boxes):
            if not (isinstance(b, list) and len(b) == 4
                    and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in b)):
                raise ExtractError(f"{where}: box {i} = {b!r:.60}: expected [x1, y1, x2, y2], four numbers")
            if not all(math.isfinite(v) for v in b):
                raise ExtractError(f"{where}: box {i} = {b}: expected finite numbers")
            if b[0] > b[2] or b[1] > b[3] or b[0] < 0 or b[1] < 0:
                raise ExtractError(f"{where}: box {i} = {b}: expected 0 <= x1 <= x2 and 0 <= y1 <= y2 (pixels of "
                                   "the original image)")
        out[img_id] = np.asarray(boxes, dtype=np.float32).reshape(-1, 4)
    known = set(img_ids)
    stray = [k for k in out if k not in known]
    if stray:
        raise ExtractError(f"--boxes-from {file}: img_id {stray[0]!r} is not among the images of IMAGES "
                           f"({len(stray)} such id(s)); expected the ids the images get (their file names "
                           "without extension, or --ids)")
    missing = [k for k in img_ids if k not in out]
    if missing:
        raise ExtractError(f"--boxes-from {file}: no boxes for img_id {missing[0]!r} ({len(missing)} image(s) "
                           "without boxes); expected boxes for every image")
    return out


def outside(boxes: np.ndarray, h: int, w: int) -> str | None:
    """Why a given box is not inside the (w x h) image, or None."""
    bad = (boxes[:, 2] > w) | (boxes[:, 3] > h)
    if not bad.any():
        return None
    i = int(np.nonzero(bad)[0][0])
    return (f"box {i} = {boxes[i].tolist()} is not inside the {w}x{h} image (expected x2 <= img_w = {w} and "
            f"y2 <= img_h = {h})")


HEADER_THREADS = 16  # remote headers are read concurrently (one small ranged read each)


def check_inside(file: str, given: dict[str, np.ndarray], refs: list[ImageRef]) -> None:
    """Every given box inside its image, by the size in the image's header; the first that is not fails,
    naming the file, img_id, image, box and size. An image whose header says nothing is left to the
    decode tasks; one whose orientation is not certain fails only when the box fits neither way."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(HEADER_THREADS) as pool:
        sizes = pool.map(lambda r: header_size(r.path), refs)
        for r, size in zip(refs, sizes, strict=True):
            if size is None:
                continue
            bad = outside(given[r.img_id], size.h, size.w)
            if bad and (size.certain or outside(given[r.img_id], size.w, size.h)):
                raise ExtractError(f"--boxes-from {file}: img_id {r.img_id!r} ({r.path}): {bad}")


def regions_asked(boxes: str | None, boxes_from: str | None, refs: list[ImageRef]
                  ) -> tuple[tuple[int, int], dict[str, np.ndarray] | None]:
    """`--boxes` and `--boxes-from` -> (the boxes range, the given boxes by img_id or None), each given box
    checked inside its image by the image's header."""
    if boxes is not None and boxes_from is not None:
        raise ExtractError("--boxes and --boxes-from: give one (--boxes-from takes the boxes from the file)")
    boxes_range = parse_boxes(boxes or "36")
    if boxes_from is None:
        return boxes_range, None
    given = read_boxes_file(boxes_from, [r.img_id for r in refs])
    check_inside(str(boxes_from), given, refs)
    return boxes_range, given
