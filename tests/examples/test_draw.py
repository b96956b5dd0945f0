"""The pictures: a synthetic scene and a blank canvas, with their boxes where their coordinates say; the
picture itself never recoloured (every pixel outside the boxes is the source's); readable labels."""

from __future__ import annotations

import numpy as np
from PIL import Image

from xmodal.examples.draw import (
    LABEL_PX,
    OUTLINE_PX,
    PALETTE_BOXES,
    attribute_colour,
    base,
    box_colour,
    heat_map,
    picture,
    pixels,
    size_of,
    text_colour,
)
from xmodal.examples.pictures import Box, Picture


def test_a_box_lands_on_the_pixels_of_its_coordinates():
    red_cube = Box((0.25, 0.25, 0.75, 0.75), obj=0, attr=0, obj_conf=1.0, attr_conf=1.0, label="red cube",
                   obj_name="cube", attr_name="red")
    pic = Picture("img0", 640, 480, [red_cube], "synthetic")
    img = picture(pic).convert("RGB")
    assert img.size == size_of(pic) == (512, 384)
    x1, y1, x2, y2 = pixels(red_cube, img.size)
    assert (x1, y1, x2, y2) == (128, 96, 383, 287)
    assert img.getpixel(((x1 + x2) // 2, (y1 + y2) // 2)) == (255, 0, 0)  # the cube, filled with its colour
    outline = box_colour(0)
    assert img.getpixel((x2, (y1 + y2) // 2)) == outline  # the box's right and bottom edges
    assert img.getpixel(((x1 + x2) // 2, y2)) == outline
    assert img.getpixel((x1 - 1, (y1 + y2) // 2)) == (236, 236, 236)  # nothing outside it
    assert img.getpixel((x2 + 1, (y1 + y2) // 2)) == (236, 236, 236)
    # its label: a chip of the box's colour inside its top-left corner, the text at least LABEL_PX high
    chip = np.array(img)[y1 + OUTLINE_PX:y1 + OUTLINE_PX + LABEL_PX, x1 + OUTLINE_PX:x1 + 60]
    ink = (chip == text_colour(outline)).all(axis=-1)  # black on a light chip, white on a dark one
    rows = np.flatnonzero(ink.any(axis=1))
    assert rows.size and rows[-1] - rows[0] + 1 >= 9  # cap height of a 13 px font: the text is not a 6 px bitmap
    assert (chip[~ink] == outline).all(axis=-1).mean() > 0.6


def test_the_picture_is_never_recoloured_outside_its_box_outlines(tmp_path):
    """A photograph under boxes of every kind (large, tiny, at the edges, overlapping, too small for a
    label): every pixel outside the boxes' rectangles is the source picture's."""
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 256, (300, 400, 3), dtype=np.uint8)).save(tmp_path / "photo.png")
    boxes = [Box(xyxy, obj=i, attr=i, obj_conf=1.0, attr_conf=1.0, label=f"long attribute name object {i}")
             for i, xyxy in enumerate([(0.1, 0.1, 0.6, 0.7), (0.0, 0.0, 0.05, 0.04), (0.5, 0.5, 1.0, 1.0),
                                       (0.3, 0.2, 0.32, 0.9), (0.55, 0.05, 0.95, 0.3)])]
    pic = Picture("photo", 400, 300, boxes, "file", str(tmp_path / "photo.png"))
    source = np.array(base(pic).convert("RGB")).astype(int)
    drawn = np.array(picture(pic).convert("RGB")).astype(int)
    inside = np.zeros(source.shape[:2], bool)
    for b in boxes:
        x1, y1, x2, y2 = pixels(b, (source.shape[1], source.shape[0]))
        inside[y1:y2 + 1, x1:x2 + 1] = True
    assert (drawn[~inside] == source[~inside]).all()
    assert (drawn[inside] != source[inside]).any(axis=-1).mean() > 0.05  # the outlines and labels are there


def test_a_picture_without_an_image_is_a_blank_canvas_of_its_size():
    box = Box((0.0, 0.5, 0.5, 1.0), obj=3, attr=-1, obj_conf=1.0, attr_conf=0.0, label="obj 3")
    img = picture(Picture("x", 1000, 500, [box], "blank")).convert("RGB")
    assert img.size == (512, 256)
    x1, y1, x2, y2 = pixels(box, img.size)
    assert img.getpixel((x2, (y1 + y2) // 2)) == box_colour(0)
    assert img.getpixel((400, 60)) == (236, 236, 236)


def test_every_box_keeps_its_own_colours_in_a_palette_and_beyond_one():
    """A flat picture is a palette picture: each box's outline and each object's fill are still their own
    colours (two per box); with more boxes than a palette holds the picture is RGB, every box still drawn right."""
    for n, mode in ((PALETTE_BOXES, "P"), (PALETTE_BOXES + 10, "RGB")):
        cols = 13
        rows = -(-n // cols)
        boxes = [Box(((i % cols) / cols, (i // cols) / rows, (i % cols + 0.9) / cols, (i // cols + 0.9) / rows), obj=0,
                     attr=i, obj_conf=1.0, attr_conf=1.0, label="") for i in range(n)]  # a grid of rectangles
        png = picture(Picture("many", 640, 480, boxes, "synthetic"))
        assert png.mode == mode and png.size == (512, 384)
        img = png.convert("RGB")
        for i, b in enumerate(boxes):
            x1, y1, x2, y2 = pixels(b, img.size)
            assert img.getpixel((x2, (y1 + y2) // 2)) == box_colour(i), (n, i)  # its outline
            assert img.getpixel((x2 - 4, y2 - 4)) == attribute_colour(b), (n, i)  # its object's fill


def test_an_attention_map_is_on_one_absolute_scale_and_a_flat_row_stays_flat():
    """MulT's heat map: one colour scale for the whole map (not per row): a uniform row is drawn one colour,
    paler than a peaked row's peak; the entropy strip is black for the uniform row."""
    m = np.array([[0.25, 0.25, 0.25, 0.25], [0.97, 0.01, 0.01, 0.01]])
    img = np.array(heat_map(m))
    scale = img.shape[0] // 2
    assert np.array(heat_map(m, scale=1)).shape == (2, 4 + 2, 3)  # the pages' map: a pixel a cell
    flat, peaked = img[scale // 2], img[scale + scale // 2]
    cells = [flat[c * scale + scale // 2] for c in range(4)]
    assert all((c == cells[0]).all() for c in cells)  # a uniform row: one colour
    assert cells[0][0] > peaked[scale // 2][0]  # paler than the peak (not scaled up to its row's largest)
    assert (img[scale // 2, -1] == 0).all() and img[scale + scale // 2, -1][0] > 150  # entropy strip: uniform black
