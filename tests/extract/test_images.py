"""Listing, ids, decoding and given boxes of jobs/extract.py: real files, no Ray."""

from __future__ import annotations

import io
import json
import re
import struct
import zlib

import numpy as np
import pytest

cv2 = pytest.importorskip("cv2")

from xmodal.extract.boxes import check_inside, outside, parse_boxes, read_boxes_file  # noqa: E402
from xmodal.extract.images import (  # noqa: E402
    HEADER_BYTES,
    ExtractError,
    ImageRef,
    Listing,
    assign_ids,
    decode,
    default_id,
    header_size,
    image_sources,
    list_images,
    read_id_map,
)


def _jpeg(h=48, w=64, seed=0) -> bytes:
    x = np.zeros((h, w, 3), np.uint8)
    x[:] = np.linspace(0, 255, w, dtype=np.uint8)[None, :, None]
    x[..., 1] = np.random.default_rng(seed).integers(0, 255, (h, w), dtype=np.uint8)
    return cv2.imencode(".jpg", x)[1].tobytes()


def _png(a: np.ndarray) -> bytes:
    return cv2.imencode(".png", a)[1].tobytes()


def test_folder_is_listed_recursively_case_insensitively(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    for rel in ("x.jpg", "a/y.JPEG", "a/b/z.Png", "notes.txt", "a/.hidden.jpg"):
        (tmp_path / rel).write_bytes(b"?")
    listed = list_images(str(tmp_path))
    assert [e.keys for e in listed.entries] == [("a/b/z.Png",), ("a/y.JPEG",), ("x.jpg",)]
    assert listed.root == str(tmp_path.resolve()) and not listed.remote
    assert [r.img_id for r in assign_ids(listed)] == ["z", "y", "x"]


def test_list_file_paths_relative_to_it(tmp_path):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "COCO_val2014_000000123456.jpg").write_bytes(b"?")
    lst = tmp_path / "list.txt"
    lst.write_text("# my images\n\nimgs/COCO_val2014_000000123456.jpg\n")
    refs = assign_ids(list_images(str(lst)))
    assert [r.img_id for r in refs] == ["COCO_val2014_000000123456"]  # the reference's COCO img_id
    lst.write_text("imgs/missing.jpg\n")
    with pytest.raises(ExtractError, match=r"list.txt:1: image 'imgs/missing.jpg' does not exist"):
        list_images(str(lst))


def test_default_id_is_the_stem():
    assert default_id("/d/COCO_train2014_000000000009.jpg") == "COCO_train2014_000000000009"
    assert default_id("s3://b/p/2345.png") == "2345"
    assert default_id("/d/a.b.jpg") == "a.b"


def test_duplicate_ids_name_both_paths(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "x.jpg").write_bytes(b"?")
    (tmp_path / "a" / "x.png").write_bytes(b"?")
    with pytest.raises(ExtractError, match=r"img_id 'x' is given to two images: .*a/x.png and .*x.jpg"):
        assign_ids(list_images(str(tmp_path)))


@pytest.mark.parametrize("fmt", ["json", "tsv"])
def test_ids_file(tmp_path, fmt):
    (tmp_path / "imgs").mkdir()
    for n in ("x.jpg", "y.jpg"):
        (tmp_path / "imgs" / n).write_bytes(b"?")
    ids = tmp_path / f"ids.{fmt}"
    if fmt == "json":
        ids.write_text(json.dumps({"x.jpg": "first", str(tmp_path / "imgs" / "y.jpg"): "second"}))
    else:
        ids.write_text(f"x.jpg\tfirst\n{tmp_path / 'imgs' / 'y.jpg'}\tsecond\n")
    refs = assign_ids(list_images(str(tmp_path / "imgs")), read_id_map(str(ids)), str(ids))
    assert [r.img_id for r in refs] == ["first", "second"]
    ids.write_text(json.dumps({"nope.jpg": "z"}) if fmt == "json" else "nope.jpg\tz\n")
    with pytest.raises(ExtractError, match=r"names no image of IMAGES, e.g. 'nope.jpg'"):
        assign_ids(list_images(str(tmp_path / "imgs")), read_id_map(str(ids)), str(ids))


def test_an_image_given_twice_by_an_ids_file_is_refused(tmp_path):
    """json.loads keeps the later of two equal keys without a word (the image got 'B', exit 0), and two
    keys naming one image (relative and absolute) were reported as an entry naming no image."""
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "img0.jpg").write_bytes(b"?")
    listing = list_images(str(tmp_path / "imgs"))
    ids = tmp_path / "ids.json"
    ids.write_text('{"img0.jpg": "A",\n "img0.jpg": "B"}')
    with pytest.raises(ExtractError, match=rf"^--ids {re.escape(str(ids))}: path 'img0.jpg' is given twice "
                                           r"\(ids 'A' and 'B'\); expected each path once$"):
        read_id_map(str(ids))
    ids.write_text('{"x": {"a": "1", "a": "2"}}')  # a repeat inside a value: the value is what is wrong
    with pytest.raises(ExtractError, match=r"entry 'x': expected an img_id string, got \{'a': '2'\}"):
        read_id_map(str(ids))
    absolute = str(tmp_path / "imgs" / "img0.jpg")
    for text in (json.dumps({"img0.jpg": "A", absolute: "B"}), f"img0.jpg\tA\n{absolute}\tB\n"):
        ids.write_text(text)
        with pytest.raises(ExtractError, match=re.escape(f"--ids {ids}: image {absolute} is given two ids by two "
                                                         f"entries: 'img0.jpg' -> 'A' and '{absolute}' -> 'B'; "
                                                         "expected one entry an image")):
            assign_ids(listing, read_id_map(str(ids)), str(ids))


def test_decode_equals_imread(tmp_path):
    p = tmp_path / "a.jpg"
    p.write_bytes(_jpeg())
    im, why = decode(p.read_bytes())
    assert why == "" and np.array_equal(im, cv2.imread(str(p), cv2.IMREAD_COLOR))


def test_grey_alpha_16bit_as_opencv_reads_them(tmp_path):
    grey = np.full((30, 40), 77, np.uint8)
    im, _ = decode(_png(grey))
    assert im.shape == (30, 40, 3) and (im == 77).all()
    bgra = np.zeros((30, 40, 4), np.uint8)
    bgra[..., 0], bgra[..., 2], bgra[..., 3] = 10, 200, 0  # fully transparent: the colour stays, alpha dropped
    im, _ = decode(_png(bgra))
    assert im.shape == (30, 40, 3) and (im[0, 0] == [10, 0, 200]).all()
    deep = np.full((3, 4, 3), 0x1234, np.uint16)
    deep[..., 2] = 0xFFFF
    p = tmp_path / "deep.png"
    p.write_bytes(_png(deep))
    im, _ = decode(p.read_bytes())
    assert im.dtype == np.uint8 and (im[0, 0] == [0x12, 0x12, 0xFF]).all()  # the high byte
    assert np.array_equal(im, cv2.imread(str(p), cv2.IMREAD_COLOR))


def test_cmyk_jpeg_as_opencv_reads_it(tmp_path):
    Image = pytest.importorskip("PIL.Image")
    buf = io.BytesIO()
    Image.new("CMYK", (40, 30), (10, 200, 30, 5)).save(buf, "JPEG")
    p = tmp_path / "cmyk.jpg"
    p.write_bytes(buf.getvalue())
    im, why = decode(p.read_bytes())
    assert why == "" and im.shape == (30, 40, 3)
    assert np.array_equal(im, cv2.imread(str(p), cv2.IMREAD_COLOR))
    rgb = np.asarray(Image.open(p).convert("RGB"))
    assert np.abs(im.astype(int) - rgb[..., ::-1].astype(int)).max() <= 2  # BGR of the same colours


def test_exif_orientation_applied_as_imread(tmp_path):
    Image = pytest.importorskip("PIL.Image")
    exif = Image.Exif()
    exif[274] = 6  # rotate 90
    buf = io.BytesIO()
    Image.new("RGB", (40, 30), (255, 0, 0)).save(buf, "JPEG", exif=exif)
    p = tmp_path / "rot.jpg"
    p.write_bytes(buf.getvalue())
    im, _ = decode(p.read_bytes())
    assert im.shape == cv2.imread(str(p), cv2.IMREAD_COLOR).shape == (40, 30, 3)


def test_bad_files_are_rejects_with_a_reason():
    good = _jpeg()
    png = _png(np.zeros((20, 20, 3), np.uint8))
    cases = {
        b"": "empty file",
        good[:-2]: "truncated JPEG: no end-of-image marker",
        good[:len(good) // 2]: "truncated JPEG",
        good[:100]: "truncated JPEG",
        png[:-12]: "truncated PNG: no IEND",
        png[:len(png) // 2]: "truncated PNG",
        b"hello, not an image": "not an image OpenCV can read",
        b"\xff\xd8\xff" + bytes(200): "truncated JPEG",
    }
    for data, reason in cases.items():
        im, why = decode(data)
        assert im is None and reason in why, (data[:20], why)


def test_bytes_after_the_end_marker_are_allowed():
    im, why = decode(_jpeg() + b"\x00\x00ftypmp4 a motion photo's video")
    assert why == "" and im.shape == (48, 64, 3)


def test_boxes_option():
    assert parse_boxes("36") == (36, 36) and parse_boxes("10-100") == (10, 100)
    for bad in ("0", "100-10", "x", "10-", "-5"):
        with pytest.raises(ExtractError, match="--boxes"):
            parse_boxes(bad)


def test_boxes_file_checked(tmp_path):
    f = tmp_path / "boxes.json"

    def check(content, ids=("a", "b")):
        f.write_text(json.dumps(content))
        return read_boxes_file(str(f), list(ids))

    got = check({"a": [[0, 0, 10, 10]], "b": [[1, 2, 3, 4], [0, 0, 5.5, 5]]})
    assert got["b"].shape == (2, 4) and got["b"].dtype == np.float32
    bad = {
        "x1 <= x2": {"a": [[5, 0, 1, 10]], "b": [[0, 0, 1, 1]]},
        "four numbers": {"a": [[0, 0, 1]], "b": [[0, 0, 1, 1]]},
        "non-empty list": {"a": [], "b": [[0, 0, 1, 1]]},
        "not among the images": {"a": [[0, 0, 1, 1]], "b": [[0, 0, 1, 1]], "c": [[0, 0, 1, 1]]},
        "no boxes for img_id 'b'": {"a": [[0, 0, 1, 1]]},
    }
    for msg, content in bad.items():
        with pytest.raises(ExtractError, match=msg) as e:
            check(content)
        assert str(f) in str(e.value)
    f.write_text('{"a": [[0, 0, 1, NaN]], "b": [[0, 0, 1, 1]]}')
    with pytest.raises(ExtractError, match=r"img_id 'a': box 0 = \[0, 0, 1, nan\]: expected finite"):
        read_boxes_file(str(f), ["a", "b"])
    assert outside(np.array([[0, 0, 40, 30]], np.float32), 30, 40) is None
    assert "box 0 = [0.0, 0.0, 41.0, 30.0] is not inside the 40x30 image" in outside(
        np.array([[0, 0, 41, 30]], np.float32), 30, 40)


def _tiff(orientation: int, big: bool) -> bytes:
    """An EXIF block (TIFF structure) holding one Orientation tag."""
    e = ">" if big else "<"
    return ((b"MM" if big else b"II") + struct.pack(e + "HI", 42, 8) + struct.pack(e + "H", 1)
            + struct.pack(e + "HHIH", 0x0112, 3, 1, orientation) + b"\0\0" + struct.pack(e + "I", 0))


def _segment(marker: int, payload: bytes) -> bytes:
    return bytes([0xFF, marker]) + struct.pack(">H", len(payload) + 2) + payload


def _chunk(kind: bytes, payload: bytes) -> bytes:
    return struct.pack(">I", len(payload)) + kind + payload + struct.pack(">I", zlib.crc32(kind + payload))


def _oriented_files() -> dict[str, bytes]:
    """JPEGs and PNGs of a 40 x 56 image under every EXIF orientation, where OpenCV reads it from."""
    a = np.random.default_rng(0).integers(0, 255, (40, 56, 3), dtype=np.uint8)
    jpg, png = _jpeg(40, 56), _png(a)
    files = {"plain.jpg": jpg, "plain.png": png, "grey.png": _png(a[..., 0]),
             "progressive.jpg": cv2.imencode(".jpg", a, [cv2.IMWRITE_JPEG_PROGRESSIVE, 1])[1].tobytes(),
             # segments before the frame header larger than the first read
             "big-app.jpg": jpg[:2] + _segment(0xE2, bytes(60000)) * 2 + _segment(0xE1, b"Exif\0\0" + _tiff(6, False))
             + jpg[2:]}
    for o in range(1, 9):
        tiff = _tiff(o, big=o % 2 == 0)
        files[f"o{o}.jpg"] = jpg[:2] + _segment(0xE0, b"JFIF\0") + _segment(0xE1, b"Exif\0\0" + tiff) + jpg[2:]
        files[f"o{o}-before-data.png"] = png[:33] + _chunk(b"eXIf", tiff) + png[33:]
        files[f"o{o}-after-data.png"] = png[:-12] + _chunk(b"eXIf", tiff) + png[-12:]
    return files


def test_header_size_is_the_size_opencv_decodes_to(tmp_path):
    for name, data in _oriented_files().items():
        p = tmp_path / name
        p.write_bytes(data)
        im = cv2.imread(str(p), cv2.IMREAD_COLOR)
        size = header_size(str(p))
        assert size is not None and size.certain, name
        assert (size.h, size.w) == im.shape[:2], name
    assert header_size(str(tmp_path / "o6.jpg")).h == 56  # the orientations 5-8 turn it
    (tmp_path / "text.jpg").write_bytes(b"not an image")
    (tmp_path / "cut.jpg").write_bytes(_jpeg()[:10])
    assert header_size(str(tmp_path / "text.jpg")) is None and header_size(str(tmp_path / "cut.jpg")) is None
    assert HEADER_BYTES < 120000  # big-app.jpg needed a second read


def test_boxes_outside_their_image_by_its_header(tmp_path):
    files = _oriented_files()
    refs = []
    for name in ("o1.jpg", "o6.jpg", "o8-after-data.png"):
        (tmp_path / name).write_bytes(files[name])
        refs.append(ImageRef(str(tmp_path / name), name.split(".")[0]))
    ok = {"o1": np.array([[0, 0, 56, 40]], np.float32), "o6": np.array([[0, 0, 40, 56]], np.float32),
          "o8-after-data": np.array([[1, 1, 40, 56]], np.float32)}
    check_inside("b.json", ok, refs)
    with pytest.raises(ExtractError) as e:
        check_inside("b.json", {**ok, "o6": np.array([[0, 0, 40, 10], [0, 0, 56, 40]], np.float32)}, refs)
    assert str(e.value) == (f"--boxes-from b.json: img_id 'o6' ({tmp_path / 'o6.jpg'}): box 1 = [0.0, 0.0, 56.0, "
                            "40.0] is not inside the 40x56 image (expected x2 <= img_w = 40 and y2 <= img_h = 56)")


def test_a_path_listed_twice_names_both_lines(tmp_path):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "a.jpg").write_bytes(_jpeg())
    lst = tmp_path / "list.txt"
    lst.write_text("imgs/a.jpg\n# a comment\n./imgs/../imgs/a.jpg\n")
    with pytest.raises(ExtractError) as e:
        list_images(str(lst))
    assert str(e.value) == (f"{lst}:3: image './imgs/../imgs/a.jpg' is listed twice: {lst}:1 names the same file "
                            f"({tmp_path / 'imgs' / 'a.jpg'}); remove one of the lines")
    lst.write_text("s3://bucket/a.jpg\ns3://bucket/a.jpg\n")
    with pytest.raises(ExtractError, match=r"list.txt:2: image 's3://bucket/a.jpg' is listed twice: .*list.txt:1 "
                                           "names the same URI"):
        list_images(str(lst))


def test_image_sources_relative_to_the_images_root(tmp_path):
    (tmp_path / "imgs" / "sub").mkdir(parents=True)
    (tmp_path / "other").mkdir()
    for f in ("imgs/a.jpg", "imgs/sub/b.png", "other/c.jpg"):
        (tmp_path / f).write_bytes(_jpeg())
    listing = list_images(str(tmp_path / "imgs"))
    assert listing.root == str(tmp_path / "imgs")
    assert image_sources(listing, assign_ids(listing)) == {"a": "a.jpg", "b": "sub/b.png"}
    lst = tmp_path / "imgs" / "list.txt"
    lst.write_text("sub/b.png\n../other/c.jpg\ns3://bucket/photos/d.jpg\n")
    listing = list_images(str(lst))
    assert listing.root == str(tmp_path / "imgs") and [e.remote for e in listing.entries] == [False, False, True]
    assert image_sources(listing, assign_ids(listing)) == {
        "b": "sub/b.png", "c": str(tmp_path / "other" / "c.jpg"), "d": "s3://bucket/photos/d.jpg"}
    uri = [ImageRef("s3://bucket/photos/x/e.jpg", "e", ("x/e.jpg",), remote=True)]
    assert image_sources(Listing("s3://bucket/photos", True, []), uri) == {"e": "s3://bucket/photos/x/e.jpg"}
