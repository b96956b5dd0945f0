"""The pictures: a synthetic scene and a blank canvas, with their boxes where their coordinates say."""

from __future__ import annotations

import base64

from PIL import Image

from xmodal.examples.collect import Box, Picture
from xmodal.examples.draw import PALETTE_BOXES, attribute_colour, box_colour, picture_png, pixels, size_of


def test_a_box_lands_on_the_pixels_of_its_coordinates(tmp_path):
    red_cube = Box((0.25, 0.25, 0.75, 0.75), obj=0, attr=0, obj_conf=1.0, attr_conf=1.0, label="red cube",
                   obj_name="cube", attr_name="red")
    pic = Picture("img0", 640, 480, [red_cube], "synthetic")
    size, uri = picture_png(pic, tmp_path / "p.png")
    assert uri == "data:image/png;base64," + base64.b64encode((tmp_path / "p.png").read_bytes()).decode()
    img = Image.open(tmp_path / "p.png").convert("RGB")
    assert img.size == size == size_of(pic) == (512, 384)
    x1, y1, x2, y2 = pixels(red_cube, img.size)
    assert (x1, y1, x2, y2) == (128, 96, 383, 287)
    assert img.getpixel(((x1 + x2) // 2, (y1 + y2) // 2)) == (255, 0, 0)  # the cube, filled with its colour
    outline = box_colour(0)
    assert img.getpixel((x2, (y1 + y2) // 2)) == outline  # the box's right and bottom edges
    assert img.getpixel(((x1 + x2) // 2, y2)) == outline
    assert img.getpixel((x1 - 3, (y1 + y2) // 2)) != outline  # nothing outside it
    assert img.getpixel((x2 + 3, (y1 + y2) // 2)) == (236, 236, 236)


def test_a_picture_without_an_image_is_a_blank_canvas_of_its_size(tmp_path):
    box = Box((0.0, 0.5, 0.5, 1.0), obj=3, attr=-1, obj_conf=1.0, attr_conf=0.0, label="obj 3")
    size, _ = picture_png(Picture("x", 1000, 500, [box], "blank"), tmp_path / "b.png")
    img = Image.open(tmp_path / "b.png").convert("RGB")
    assert size == img.size == (512, 256)
    x1, y1, x2, y2 = pixels(box, img.size)
    assert img.getpixel((x2, (y1 + y2) // 2)) == box_colour(0)
    assert img.getpixel((400, 60)) == (236, 236, 236)



def test_every_box_keeps_its_own_colours_in_a_palette_and_beyond_one(tmp_path):
    """A flat picture is a palette PNG: each box's outline and each object's fill are still their own colours
    (two per box); with more boxes than a palette holds the picture is RGB, every box still drawn right."""
    for n, mode in ((PALETTE_BOXES, "P"), (PALETTE_BOXES + 10, "RGB")):
        cols = 13
        rows = -(-n // cols)
        boxes = [Box(((i % cols) / cols, (i // cols) / rows, (i % cols + 0.9) / cols, (i // cols + 0.9) / rows), obj=0,
                     attr=i, obj_conf=1.0, attr_conf=1.0, label="") for i in range(n)]  # a grid of rectangles
        size, _ = picture_png(Picture("many", 640, 480, boxes, "synthetic"), tmp_path / f"{n}.png")
        png = Image.open(tmp_path / f"{n}.png")
        assert png.mode == mode and png.size == size == (512, 384)
        img = png.convert("RGB")
        for i, b in enumerate(boxes):
            x1, y1, x2, y2 = pixels(b, size)
            assert img.getpixel((x2, (y1 + y2) // 2)) == box_colour(i), (n, i)  # its outline
            assert img.getpixel((x2 - 4, y2 - 4)) == attribute_colour(b), (n, i)  # its object's fill
