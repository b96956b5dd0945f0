"""The pictures of the example pages (Pillow): the image itself where the store says where it is, the
scene of a synthetic image drawn from the store's own boxes, classes and colours, or a blank canvas of
the image's size; then each box outlined and labelled with the detector's names; and MulT's attention maps.

The picture is never recoloured: a box is an outline drawn inside its rectangle, its label a chip in a
real font (Pillow's own FreeType font, LABEL_PX high) inside the box's top-left corner, shortened to fit
the box and left out where it cannot fit; every pixel outside the boxes is the source's. The attention
is drawn over the picture by the pages (outlines whose width carries the weight), not into it.

A synthetic scene and a blank canvas are drawn in palette mode (flat colours, one byte a pixel: their PNG
encodes five times faster than an RGB one, and most of a page's cost was that encoding). A picture with
more colours than a palette holds (over 120 boxes) and a real image are drawn in RGB.

A synthetic scene is drawn deterministically: each object a shape of its class (rectangle, ellipse,
triangle or diamond: the class id modulo 4) filled with the colour its attribute names (a CSS colour
name, else one derived from the attribute id) at its box, the largest first, so smaller objects stay
visible.
"""

from __future__ import annotations

import base64
import colorsys
import functools
import io
from collections.abc import Callable

import numpy as np
from PIL import Image, ImageColor, ImageDraw, ImageFont

from xmodal.examples.pictures import Box, Picture
from xmodal.examples.stats import row_entropy

MAX_SIDE = 512  # a page's picture: the longer side, in pixels
CANVAS = (236, 236, 236)
BLANK_TEXT = (120, 120, 120)
SHAPE_EDGE = (70, 70, 70)
SHAPES = ("rectangle", "ellipse", "triangle", "diamond")


def box_colour(i: int) -> tuple[int, int, int]:
    """The outline colour of box i: well-separated hues."""
    r, g, b = colorsys.hsv_to_rgb((i * 0.618034) % 1.0, 0.85, 0.9)
    return int(r * 255), int(g * 255), int(b * 255)


def text_colour(c: tuple[int, int, int]) -> tuple[int, int, int]:
    """Black on a light chip, white on a dark one (by the colour's luma)."""
    return (0, 0, 0) if 0.299 * c[0] + 0.587 * c[1] + 0.114 * c[2] > 150 else (255, 255, 255)


def hex_colour(i: int) -> str:
    """box_colour(i) as a CSS colour."""
    return "#" + "".join(f"{c:02x}" for c in box_colour(i))


def attribute_colour(box: Box) -> tuple[int, int, int]:
    """A synthetic object's fill: its attribute's name as a colour where it is one, else from its id."""
    if box.attr_name:
        try:
            return ImageColor.getrgb(box.attr_name)[:3]
        except ValueError:
            pass
    r, g, b = colorsys.hsv_to_rgb((max(box.attr, 0) * 0.37) % 1.0, 0.6, 0.75)
    return int(r * 255), int(g * 255), int(b * 255)


def size_of(pic: Picture) -> tuple[int, int]:
    """The drawn size: the image's aspect, the longer side MAX_SIDE at most."""
    s = min(1.0, MAX_SIDE / max(pic.width, pic.height))
    return max(1, round(pic.width * s)), max(1, round(pic.height * s))


def pixels(box: Box, size: tuple[int, int]) -> tuple[int, int, int, int]:
    """A normalised box in pixels of a picture of `size` (inclusive corners)."""
    w, h = size
    x1, y1, x2, y2 = box.xyxy
    return (round(x1 * (w - 1)), round(y1 * (h - 1)), round(x2 * (w - 1)), round(y2 * (h - 1)))


def canvas(size: tuple[int, int], mode: str) -> Image.Image:
    """An empty picture: "P" (a palette, filled by `inks`) or "RGB"."""
    return Image.new(mode, size, CANVAS)


def inks(img: Image.Image) -> Callable[[tuple[int, int, int]], int | tuple[int, int, int]]:
    """RGB colour -> what ImageDraw draws with on `img`: on a palette picture the colour's index, added
    to its palette once (ImageDraw would search the palette on every call), else the colour itself."""
    if img.mode != "P":
        return lambda c: c
    known: dict[tuple[int, int, int], int] = {}

    def ink(c: tuple[int, int, int]) -> int:
        if c not in known:
            known[c] = img.palette.getcolor(c, img)
        return known[c]

    return ink


def scene(pic: Picture, mode: str = "P") -> Image.Image:
    """A synthetic image's scene: each object a shape of its class, in its attribute's colour, at its box."""
    size = size_of(pic)
    img = canvas(size, mode)
    d, ink = ImageDraw.Draw(img), inks(img)
    edge = ink(SHAPE_EDGE)  # a white or pale object stays visible on the canvas
    for box in sorted(pic.boxes, key=lambda b: -(b.xyxy[2] - b.xyxy[0]) * (b.xyxy[3] - b.xyxy[1])):
        x1, y1, x2, y2 = pixels(box, size)
        fill = ink(attribute_colour(box))
        shape = SHAPES[max(box.obj, 0) % len(SHAPES)]
        if shape == "rectangle":
            d.rectangle((x1, y1, x2, y2), fill=fill, outline=edge)
        elif shape == "ellipse":
            d.ellipse((x1, y1, x2, y2), fill=fill, outline=edge)
        elif shape == "triangle":
            d.polygon([((x1 + x2) / 2, y1), (x2, y2), (x1, y2)], fill=fill, outline=edge)
        else:
            d.polygon([((x1 + x2) / 2, y1), (x2, (y1 + y2) / 2), ((x1 + x2) / 2, y2), (x1, (y1 + y2) / 2)], fill=fill,
                      outline=edge)
    return img


def base(pic: Picture, mode: str = "P") -> Image.Image:
    """The picture under the boxes: the image file (RGB), the synthetic scene, or a blank canvas saying so
    (in `mode`)."""
    size = size_of(pic)
    if pic.kind == "file" and pic.source and "://" not in pic.source:
        try:
            with Image.open(pic.source) as im:
                return im.convert("RGB").resize(size)
        except OSError:
            pass  # an unreadable file: a blank canvas, as for a missing one
    if pic.kind == "synthetic":
        return scene(pic, mode)
    img = canvas(size, mode)
    said = "picture not found" if pic.kind == "missing" else "no picture recorded"
    ImageDraw.Draw(img).text((6, max(0, size[1] - LABEL_PX - 6)), f"{said} ({pic.width}x{pic.height})",
                             fill=inks(img)(BLANK_TEXT), font=font())
    return img


LABEL_PX = 13  # the labels' font size in pixels of the picture (shown at 1:1 on the pages)
OUTLINE_PX = 2  # a box's outline, drawn inside its rectangle


@functools.cache
def font(size: int = LABEL_PX) -> ImageFont.FreeTypeFont:
    return ImageFont.load_default(size=size)


PALETTE_BOXES = 120  # boxes a palette of 256 holds: two colours each (outline, object fill), the canvas's four


Chips = dict[tuple[str, int], tuple[Image.Image, int, int] | None]  # (label, room's width) -> its chip


def chip(text: str, width: int) -> tuple[Image.Image, int, int] | None:
    """The label `text` rendered as a chip's mask no wider than `width`: the text whole, or its longest
    beginning that fits with "…", found by measuring (rendered once); None when not even the box number
    (the text before ":") fits."""
    def need(t: str) -> float:
        return font().getlength(t) + 4

    if need(text) > width:
        head = text.split(":")[0]
        lo, hi = len(head), len(text) - 1  # the longest prefix text[:k] + "…" that fits, k >= len(head)
        if need(head) > width:
            return None
        while lo < hi:
            k = (lo + hi + 1) // 2
            lo, hi = (k, hi) if need(text[:k].rstrip() + "…") <= width else (lo, k - 1)
        text = text[:lo].rstrip() + ("…" if lo > len(head) else "")
    left, top, right, bottom = font().getbbox(text)
    mask = Image.new("L", (right + 4, bottom + 2))
    ImageDraw.Draw(mask).text((2, 0), text, fill=255, font=font())
    return mask, right + 4, bottom + 2


def draw_boxes(img: Image.Image, boxes: list[Box], chips: Chips | None = None) -> Image.Image:
    """Each box outlined in its colour (box_colour(i)) inside its rectangle, and labelled "i: attribute
    object" in a chip inside its top-left corner (shortened to the box, left out where it does not fit).
    `chips`: the labels already rendered by this set of pages (labels repeat across pictures)."""
    d, ink = ImageDraw.Draw(img), inks(img)
    chips = {} if chips is None else chips
    for i, box in enumerate(boxes):
        x1, y1, x2, y2 = pixels(box, img.size)
        c = ink(box_colour(i))
        text = ink(text_colour(box_colour(i)))
        d.rectangle((x1, y1, x2, y2), outline=c, width=OUTLINE_PX)
        room = (x2 - x1 + 1 - 2 * OUTLINE_PX, y2 - y1 + 1 - 2 * OUTLINE_PX)
        key = (f"{i}: {box.label}", room[0])
        if key not in chips:
            chips[key] = chip(*key)
        if chips[key] is not None and chips[key][2] <= room[1]:
            mask, w, h = chips[key]
            ox, oy = x1 + OUTLINE_PX, y1 + OUTLINE_PX
            d.rectangle((ox, oy, ox + w - 1, oy + h - 1), fill=c)
            d.bitmap((ox, oy), mask, fill=text)
    return img


PNG_LEVEL = 1  # zlib level: the pictures are small and drawn flat; level 1 encodes several times faster than 6


def png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=PNG_LEVEL)
    return buf.getvalue()


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def picture(pic: Picture, chips: Chips | None = None) -> Image.Image:
    """The picture with its boxes: in palette mode where its colours fit one. `base(pic)` is the same
    picture without them."""
    mode = "P" if len(pic.boxes) <= PALETTE_BOXES else "RGB"
    return draw_boxes(base(pic, mode), pic.boxes, chips)


def side_by_side(images: list[Image.Image], gap: int = 8) -> Image.Image:
    """Pictures in a row on the canvas colour (an NLVR2 example's pair, as one file)."""
    if len(images) == 1:
        return images[0]
    w = sum(i.width for i in images) + gap * (len(images) - 1)
    out = Image.new("RGB", (w, max(i.height for i in images)), (255, 255, 255))
    x = 0
    for i in images:
        out.paste(i.convert("RGB"), (x, 0))
        x += i.width + gap
    return out


def in_rows(images: list[Image.Image], per_row: int, gap: int = 8) -> Image.Image:
    """Pictures `per_row` to a row (each row `side_by_side`), the rows one under another."""
    rows = [side_by_side(images[i:i + per_row], gap) for i in range(0, len(images), per_row)]
    if len(rows) == 1:
        return rows[0]
    out = Image.new("RGB", (max(r.width for r in rows), sum(r.height for r in rows) + gap * (len(rows) - 1)),
                    (255, 255, 255))
    y = 0
    for r in rows:
        out.paste(r.convert("RGB"), (0, y))
        y += r.height + gap
    return out


# ----------------------------------------------------------------------------- MulT: attention over time

MAP_SIDE = 360  # a heat map's longer side, in pixels


def heat_map(m: np.ndarray, scale: int | None = None) -> Image.Image:
    """A (T, S) attention matrix (rows: the target's steps, each a distribution over the source's S steps)
    on one absolute scale: white at 0 to dark blue at the map's largest weight (which the pages state),
    never scaled per row, so a flat row stays pale. Beside it, after a white column, a column of each
    row's entropy over the uniform row's (log S): white at 0 (one step takes everything), black at 1
    (uniform). Each cell `scale` pixels square (default: the longer side MAP_SIDE); the pages draw it at
    1 and let the browser enlarge it (a map's PNG is then a few hundred bytes, encoded in microseconds)."""
    t, s = m.shape
    x = np.clip(m / (float(m.max()) or 1.0), 0, 1)
    rgb = np.stack([255 * (1 - 0.9 * x), 255 * (1 - 0.75 * x), 255 - 90 * x], axis=-1)
    h = np.clip(row_entropy(m) / (np.log(s) if s > 1 else 1.0), 0, 1)
    cells = np.concatenate([rgb, np.full((t, 1, 3), 255.0), np.repeat(255 * (1 - h)[:, None, None], 3, axis=2)], axis=1)
    img = Image.fromarray(cells.astype(np.uint8))
    scale = max(1, MAP_SIDE // max(t, s)) if scale is None else scale
    return img if scale == 1 else img.resize((img.width * scale, img.height * scale), Image.NEAREST)
