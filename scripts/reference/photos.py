"""The photographs the extractor's check runs on: every kind of file a user gives the extraction.

- scikit-image's 26 bundled photographs and scikit-learn's 2 (`china.jpg`, `flower.jpg`), copied byte for
  byte: JPEGs with ICC profiles, grey PNGs, RGBA PNGs (`horse`, `logo`), a 16-bit RGB PNG
  (`chessboard_RGB`), flat synthetic ones whose scores tie (`chessboard_*`, `phantom`), 102 to 1411 px;
- crops and rescales of them (11): 97 x 97 to 1200 x 1804, a scale of exactly 0.5, strips capped by the
  long side, portraits;
- re-encodings (the decoder's paths): progressive JPEGs, greyscale JPEGs, a PNG with an alpha channel, a
  16-bit PNG, JPEGs whose EXIF orientation (2, 3, 6, 8) turns or mirrors the image;
- sides up to 2000 px: 1281 x 1920, 2000 x 2000, a 2000 x 1500 portrait, a 2000 x 200 strip;
- generated scenes (6, seeded): shapes, gradients and noise on a canvas, 240 x 320 to 1024 x 768, one
  on a flat background.

`make(out)` writes them into `out` and returns one row per file (name, its size as the reference's
`cv2.imread` returns it, what kind of file it is).
"""

from __future__ import annotations

import importlib.util
import shutil
import struct
from pathlib import Path

import numpy as np

from xmodal.base.errors import UserError


def _package_data(package: str, sub: str, why: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None:
        raise UserError(f"{package} is not installed; it ships {why} (pip install {package.replace('sklearn', 'scikit-learn').replace('skimage', 'scikit-image')})")
    return Path(spec.submodule_search_locations[0]) / sub


def _exif_jpeg(jpeg: bytes, orientation: int) -> bytes:
    """The JPEG with an APP1 EXIF segment holding only the Orientation tag, right after its SOI marker."""
    ifd = struct.pack(">H", 1) + struct.pack(">HHIHH", 0x0112, 3, 1, orientation, 0) + struct.pack(">I", 0)
    tiff = b"MM\0*" + struct.pack(">I", 8) + ifd
    body = b"Exif\0\0" + tiff
    return jpeg[:2] + b"\xff\xe1" + struct.pack(">H", len(body) + 2) + body + jpeg[2:]


def _scene(seed: int, h: int, w: int, flat: bool) -> np.ndarray:
    """Shapes, lines and text over a gradient (or a flat colour) with noise: a generated photograph."""
    import cv2

    rng = np.random.default_rng(seed)
    if flat:
        im = np.full((h, w, 3), rng.integers(0, 256, 3), np.uint8)
    else:
        y, x = np.mgrid[0:h, 0:w]
        im = np.stack([(x * 255 // max(w - 1, 1)), (y * 255 // max(h - 1, 1)), ((x + y) * 127 // max(h + w, 1))],
                      axis=2).astype(np.uint8)
    for _ in range(int(rng.integers(8, 20))):
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        kind = int(rng.integers(0, 3))
        cx, cy = int(rng.integers(0, w)), int(rng.integers(0, h))
        size = int(rng.integers(max(4, min(h, w) // 20), max(5, min(h, w) // 3)))
        if kind == 0:
            cv2.rectangle(im, (cx, cy), (cx + size, cy + size * 2 // 3), colour, -1)
        elif kind == 1:
            cv2.circle(im, (cx, cy), size // 2, colour, -1)
        else:
            cv2.line(im, (cx, cy), (int(rng.integers(0, w)), int(rng.integers(0, h))), colour, max(1, size // 10))
    cv2.putText(im, f"scene {seed}", (w // 10, h // 2), cv2.FONT_HERSHEY_SIMPLEX, max(0.5, w / 600), (255, 255, 255), 2)
    if not flat:
        im = np.clip(im.astype(np.int16) + rng.integers(-12, 13, im.shape), 0, 255).astype(np.uint8)
    return im


def _derived(src: dict[str, np.ndarray], china: np.ndarray, flower: np.ndarray) -> dict[str, tuple[np.ndarray, str]]:
    """name -> (image, kind): the crops, rescales and large sizes, written as PNG or JPEG by their name."""
    import cv2

    area, lin = cv2.INTER_AREA, cv2.INTER_LINEAR
    return {
        "coffee_x2_1200.png": (cv2.resize(src["coffee"], None, fx=2, fy=2, interpolation=lin), "rescale: long side 1200"),
        "chelsea_half_scale.png": (cv2.resize(src["chelsea"], (1804, 1200), interpolation=lin), "scale exactly 600 / 1200"),
        "rocket_wide_strip.png": (src["rocket"][100:300, :], "200 x 640 strip: the long side caps the scale"),
        "astronaut_tall_crop.png": (src["astronaut"][:, 150:350], "512 x 200 portrait crop"),
        "coffee_small.png": (cv2.resize(src["coffee"], (150, 100), interpolation=area), "100 x 150: scale 6"),
        "chelsea_odd.png": (cv2.resize(src["chelsea"], (517, 333), interpolation=area), "odd sides"),
        "motorcycle_crop.png": (src["motorcycle"][50:450, 100:700], "crop"),
        "camera_grey_crop.png": (src["camera"][37:300, 11:480], "grey crop"),
        "hubble_square_small.png": (cv2.resize(src["hubble"][:, :872], (97, 97), interpolation=area), "97 x 97"),
        "rocket_transposed.png": (np.ascontiguousarray(src["rocket"].transpose(1, 0, 2)), "640 x 427 portrait"),
        "astronaut_panorama_1400.png": (cv2.resize(src["astronaut"][200:400], (1400, 350), interpolation=lin),
                                        "350 x 1400 panorama"),
        "china_x3.jpg": (cv2.resize(china, (1920, 1281), interpolation=lin), "1281 x 1920 JPEG"),
        "retina_2000.jpg": (cv2.resize(src["retina"], (2000, 2000), interpolation=lin), "2000 x 2000 JPEG"),
        "flower_portrait_2000.jpg": (cv2.resize(np.ascontiguousarray(flower.transpose(1, 0, 2)), (1500, 2000),
                                                interpolation=lin), "2000 x 1500 portrait JPEG"),
        "coffee_strip_2000.png": (cv2.resize(src["coffee"], (2000, 200), interpolation=area), "200 x 2000 strip"),
    }


def make(out: Path) -> list[dict]:
    """Write the photographs into the folder `out` (made); one row per file."""
    import cv2

    skimage_data = _package_data("skimage", "data", "26 of the photographs")
    sklearn_images = _package_data("sklearn", "datasets/images", "china.jpg and flower.jpg")
    out.mkdir(parents=True, exist_ok=True)
    kinds: dict[str, str] = {}
    for folder, package in ((skimage_data, "scikit-image"), (sklearn_images, "scikit-learn")):
        for f in sorted(folder.iterdir()):
            if f.suffix in (".png", ".jpg"):
                shutil.copyfile(f, out / f.name)
                kinds[f.name] = f"{package}'s own file"
    read = {n: cv2.imread(str(skimage_data / f)) for n, f in (
        ("astronaut", "astronaut.png"), ("coffee", "coffee.png"), ("chelsea", "chelsea.png"), ("rocket", "rocket.jpg"),
        ("hubble", "hubble_deep_field.jpg"), ("motorcycle", "motorcycle_left.png"), ("retina", "retina.jpg"))}
    read["camera"] = cv2.imread(str(skimage_data / "camera.png"), cv2.IMREAD_UNCHANGED)
    china, flower = (cv2.imread(str(sklearn_images / f)) for f in ("china.jpg", "flower.jpg"))
    made = _derived(read, china, flower)
    progressive = [cv2.IMWRITE_JPEG_PROGRESSIVE, 1, cv2.IMWRITE_JPEG_QUALITY, 90]
    for name, im in (("coffee", read["coffee"]), ("astronaut", read["astronaut"]), ("china", china)):
        made[f"{name}_progressive.jpg"] = (im, "progressive JPEG")
    for name, im in (("camera", read["camera"]), ("moon", cv2.imread(str(skimage_data / "moon.png"), cv2.IMREAD_UNCHANGED))):
        made[f"{name}_grey.jpg"] = (im, "greyscale JPEG (one channel)")
    alpha = np.linspace(0, 255, read["coffee"].shape[1], dtype=np.uint8)[None, :].repeat(read["coffee"].shape[0], 0)
    made["coffee_alpha.png"] = (np.dstack([read["coffee"], alpha]), "PNG with an alpha channel")
    made["chelsea_16bit.png"] = (read["chelsea"].astype(np.uint16) * 257 + 3, "16-bit PNG")
    for i, (seed, h, w, flat) in enumerate(((1, 480, 640, False), (2, 768, 1024, False), (3, 600, 600, False),
                                             (4, 300, 900, False), (5, 1024, 768, False), (6, 240, 320, True))):
        made[f"scene_{i + 1}_{h}x{w}.png"] = (_scene(seed, h, w, flat), "generated scene" + (", flat background" if flat else ""))
    for name, (im, kind) in made.items():
        params = progressive if "progressive" in kind else []
        ok, data = cv2.imencode(Path(name).suffix, im, params)
        assert ok, name
        (out / name).write_bytes(data.tobytes())
        kinds[name] = kind
    for orientation, name, im in ((2, "chelsea", read["chelsea"]), (3, "coffee", read["coffee"]),
                                  (6, "rocket", read["rocket"]), (8, "astronaut_tall", read["astronaut"][:, 150:350])):
        _, data = cv2.imencode(".jpg", im)
        (out / f"{name}_exif{orientation}.jpg").write_bytes(_exif_jpeg(data.tobytes(), orientation))
        kinds[f"{name}_exif{orientation}.jpg"] = f"JPEG with EXIF orientation {orientation}"
    rows = []
    for name in sorted(kinds):
        im = cv2.imread(str(out / name))
        rows.append({"image": name, "h": int(im.shape[0]), "w": int(im.shape[1]), "kind": kinds[name]})
    return rows
