"""The pictures of the example pages (Pillow): the image itself where the store says where it is, the
scene of a synthetic image drawn from the store's own boxes, classes and colours, or a blank canvas of
the image's size; then each box outlined and labelled with the detector's names.

A synthetic scene and a blank canvas are drawn in palette mode (flat colours, one byte a pixel: their PNG
encodes five times faster than an RGB one, and most of a page's cost was that encoding); the labels use
Pillow's bitmap font, crisp without anti-aliasing and ten times faster to draw than its FreeType font. A
picture with more colours than a palette holds (over 120 boxes) and a real image are drawn in RGB.

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
from pathlib import Path

from PIL import Image, ImageColor, ImageDraw, ImageFont

from xmodal.examples.collect import Box, Picture

MAX_SIDE = 512  # a page's picture: the longer side, in pixels
CANVAS = (236, 236, 236)
BLANK_TEXT = (120, 120, 120)
SHAPE_EDGE = (70, 70, 70)
SHAPES = ("rectangle", "ellipse", "triangle", "diamond")


def box_colour(i: int) -> tuple[int, int, int]:
    """The outline colour of box i: well-separated hues."""
    r, g, b = colorsys.hsv_to_rgb((i * 0.618034) % 1.0, 0.85, 0.9)
    return int(r * 255), int(g * 255), int(b * 255)


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
    ImageDraw.Draw(img).text((6, size[1] - 16), f"{said} ({pic.width}x{pic.height})", fill=inks(img)(BLANK_TEXT),
                             font=font())
    return img


@functools.cache
def font() -> ImageFont.ImageFont:
    return ImageFont.load_default_imagefont()


PALETTE_BOXES = 120  # boxes a palette of 256 holds: two colours each (outline, object fill), the canvas's four


def draw_boxes(img: Image.Image, boxes: list[Box]) -> Image.Image:
    """Each box outlined in its colour (box_colour(i)) and labelled "i: attribute object"."""
    d, ink = ImageDraw.Draw(img), inks(img)
    white = ink((255, 255, 255))
    for i, box in enumerate(boxes):
        x1, y1, x2, y2 = pixels(box, img.size)
        c = ink(box_colour(i))
        d.rectangle((x1, y1, x2, y2), outline=c, width=2)
        text = f"{i}: {box.label}"
        left, top, right, bottom = d.textbbox((x1 + 3, y1 + 2), text, font=font())
        d.rectangle((left - 2, top - 1, right + 2, bottom + 1), fill=c)
        d.text((x1 + 3, y1 + 2), text, fill=white, font=font())
    return img


PNG_LEVEL = 1  # zlib level: the pictures are small and drawn flat; level 1 encodes several times faster than 6


def png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG", compress_level=PNG_LEVEL)
    return buf.getvalue()


def data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode("ascii")


def picture(pic: Picture) -> Image.Image:
    """The picture with its boxes: in palette mode where its colours fit one."""
    mode = "P" if len(pic.boxes) <= PALETTE_BOXES else "RGB"
    return draw_boxes(base(pic, mode), pic.boxes)


def save_png(img: Image.Image, path: Path) -> str:
    """`img` as a PNG at `path`; returns the same PNG as a data: URI for the pages (encoded once)."""
    png = png_bytes(img)
    path.write_bytes(png)
    return data_uri(png)


def picture_png(pic: Picture, path: Path) -> tuple[tuple[int, int], str]:
    """The picture with its boxes, as a PNG at `path`; returns its size in pixels and its data: URI."""
    img = picture(pic)
    return img.size, save_png(img, path)
