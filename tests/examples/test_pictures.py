"""Where a page's pictures come from: the image file the store records, a blank canvas of the image's size
when it records none or the file moved (one warning line naming it), the detector's names on the boxes."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import numpy as np
from PIL import Image

from xmodal.examples.draw import picture, pixels
from xmodal.examples.pictures import picture_of, say_pictures, store_sources

VOCAB = {"objects": ["dog,puppy", "frisbee"], "attributes": ["brown", "red"]}


def extracted_store(vocab=VOCAB):
    """What an extraction's feature store manifest says of itself (source "extract", the vocabularies its
    --objects-vocab/--attributes-vocab recorded)."""
    return SimpleNamespace(path="/stores/x", manifest=SimpleNamespace(source="extract", options={"vocab": vocab}))


def row(w=300, h=200):
    return {"img_w": w, "img_h": h, "num_boxes": 2, "boxes": np.array([[0.1, 0.1, 0.5, 0.9], [0.6, 0.2, 0.9, 0.5]]),
            "obj_ids": np.array([0, 1]), "attr_ids": np.array([0, -1]), "obj_conf": np.array([0.9, 0.8]),
            "attr_conf": np.array([0.7, 0.0])}


def test_the_recorded_image_is_drawn_under_its_named_boxes(tmp_path):
    Image.new("RGB", (300, 200), (10, 200, 30)).save(tmp_path / "a.jpg")
    missing: list[str] = []
    pic = picture_of("a", row(), extracted_store(), {"a": str(tmp_path / "a.jpg")}, missing)
    assert (pic.kind, pic.width, pic.height, missing) == ("file", 300, 200, [])
    assert [b.label for b in pic.boxes] == ["brown dog", "frisbee"]  # first synonym; no attribute: the object
    img = picture(pic).convert("RGB")
    x1, y1, x2, y2 = pixels(pic.boxes[0], img.size)
    r, g, b = img.getpixel(((x1 + x2) // 2, (y1 + y2) // 2))
    assert g > 150 and r < 60  # the photograph's pixels, inside the box


def test_a_moved_image_is_one_warning_and_a_blank_canvas(tmp_path, caplog):
    missing: list[str] = []
    gone = str(tmp_path / "moved" / "b.jpg")
    pics = [picture_of(i, row(640, 427), extracted_store(), {"b": gone, "c": gone + "2"}, missing) for i in "bc"]
    assert [p.kind for p in pics] == ["missing", "missing"] and (pics[0].width, pics[0].height) == (640, 427)
    notes: list[str] = []
    with caplog.at_level(logging.WARNING):
        say_pictures(pics, missing, notes)
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and gone in lines[0] and "2 image file(s)" in lines[0]
    assert any("blank canvas" in n and gone in n for n in notes)
    assert picture(pics[0]).size == (512, round(427 * 512 / 640))  # the image's own aspect


def test_a_store_without_pictures_or_names(tmp_path):
    missing: list[str] = []
    pic = picture_of("d", row(), extracted_store(vocab={}), {}, missing)
    assert pic.kind == "blank" and [b.label for b in pic.boxes] == ["attr 0 obj 0", "obj 1"]
    notes: list[str] = []
    say_pictures([pic], missing, notes)
    assert notes == ["the image store records no pictures: boxes are drawn on a blank canvas of each image's size"]


def test_a_store_that_is_not_an_extractions_feature_store_has_no_sources():
    # only an image store records sources: those of an extraction's feature store, and of an LXMERT store
    # ingested from it, are checked on a real extraction in tests/extract/test_extract_job.py
    assert store_sources(extracted_store()) == {}


def test_synthetic_stores_draw_their_scenes():
    store = SimpleNamespace(path="/s", manifest=SimpleNamespace(source="synthetic", num_object_labels=4,
                                                                num_attr_labels=3))
    pic = picture_of("s", row(0, 0), store, {}, [])
    assert pic.kind == "synthetic" and (pic.width, pic.height) == (640, 480)
    assert [b.label for b in pic.boxes] == ["red cube", "ball"]  # the synthetic store's class and colour names
