"""Where a page's pictures come from: an image store's row (its size, boxes, detected objects and
attributes) becomes a `Picture`: the image file the store records (an extraction's feature store, and an
LXMERT store ingested from one), the synthetic store's scene drawn from its own data, or a blank canvas of
the image's size where the store records no file (or the file moved: one warning line names it). Boxes are
named by the detector's vocabularies where the store has them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

META_COLUMNS = ("img_h", "img_w", "num_boxes", "boxes", "obj_ids", "obj_conf", "attr_ids", "attr_conf")
SYNTHETIC_SIZE = (640, 480)  # the synthetic store's img_w, img_h (data/lxmert/synthetic.py)
BLANK_SIZE = (640, 480)  # a canvas for an image whose store records no size


@dataclass
class Box:
    xyxy: tuple[float, float, float, float]  # normalised to the image: x1 y1 x2 y2 in [0, 1]
    obj: int  # the detector's object id (-1: none)
    attr: int  # its attribute id (-1: none)
    obj_conf: float
    attr_conf: float
    label: str  # "attribute object" by name where the store has names, else by id
    obj_name: str | None = None
    attr_name: str | None = None


@dataclass
class Picture:
    img_id: str
    width: int
    height: int
    boxes: list[Box]
    kind: str  # "file" (the image itself), "synthetic" (its scene drawn), "blank" (no image known),
    #            "missing" (its recorded file is not there)
    source: str | None = None  # the image's path or URI where the store records one


def label_names(store) -> tuple[list[str] | None, list[str] | None]:
    """(object names, attribute names) of an image store: the synthetic store's own class and colour
    names, the vocabularies an extraction recorded (`--objects-vocab/--attributes-vocab`; the first
    synonym of each line), or None where it has none."""
    m = store.manifest
    if getattr(m, "source", None) == "synthetic":
        from xmodal.data.lxmert.synthetic import class_names, colour_names

        return class_names(m.num_object_labels), colour_names(m.num_attr_labels)
    vocab = (getattr(m, "options", None) or {}).get("vocab") or {}

    def first(names):
        return [str(n).split(",")[0] for n in names] if isinstance(names, list) else None

    return first(vocab.get("objects")), first(vocab.get("attributes"))


def is_synthetic(store) -> bool:
    return getattr(store.manifest, "source", None) == "synthetic"


def store_sources(store) -> dict[str, str]:
    """img_id -> the image's path or URI, as the store records it (an extraction's feature store, or an
    LXMERT store ingested from one); {} where it records none: a store from a reference TSV."""
    from xmodal.data.lxmert.features import FeatureStore, image_sources
    from xmodal.data.lxmert.store import LxmertStore

    if not isinstance(store, FeatureStore | LxmertStore):
        return {}
    try:
        return image_sources(store)
    except (OSError, ValueError, KeyError) as e:
        log.warning("[xmodal] the image sources of %s cannot be read (%s): drawing blank canvases", store.path, e)
        return {}


def name_of(i: int, names: list[str] | None) -> str | None:
    return names[i] if names is not None and 0 <= i < len(names) else None


def box_label(obj: int, attr: int, objects: list[str] | None, attributes: list[str] | None) -> str:
    o = name_of(obj, objects) or f"obj {obj}"
    if attr < 0:
        return o
    return f"{name_of(attr, attributes) or f'attr {attr}'} {o}"


def picture_of(img: str, r: dict[str, Any], store, sources: dict[str, str], missing: list[str]) -> Picture:
    """The Picture of image `img` of `store` from its row `r` (boxes labelled, where its pixels come from);
    a recorded file that is not there goes to `missing`."""
    objects, attributes = label_names(store)
    boxes = []
    for j in range(int(r["num_boxes"])):
        o, a = int(r["obj_ids"][j]), int(r["attr_ids"][j])
        boxes.append(Box(tuple(float(v) for v in r["boxes"][j]), o, a, float(r["obj_conf"][j]),
                         float(r["attr_conf"][j]), box_label(o, a, objects, attributes), name_of(o, objects),
                         name_of(a, attributes)))
    w, h = int(r["img_w"]), int(r["img_h"])
    src = sources.get(img)
    if is_synthetic(store):
        kind = "synthetic"
        w, h = (w, h) if w > 0 and h > 0 else SYNTHETIC_SIZE
    elif src is not None and ("://" in src or Path(src).is_file()):
        kind = "file"
    elif src is not None:
        kind = "missing"
        missing.append(src)
    else:
        kind = "blank"
    if w <= 0 or h <= 0:
        w, h = BLANK_SIZE
    return Picture(img, w, h, boxes, kind, src)


def say_pictures(pictures: list[Picture], missing: list[str], notes: list[str]) -> None:
    """One warning line for images no longer where the store recorded them, and the pages' notes."""
    if missing:
        log.warning("[xmodal] %d image file(s) of the store are not where it records them (e.g. %s): drawn on blank "
                    "canvases", len(missing), missing[0])
        notes.append(f"{len(missing)} picture(s) are not where the store records them (e.g. {missing[0]}): their "
                     "boxes are drawn on a blank canvas of the image's size")
    kinds = {p.kind for p in pictures}
    if "blank" in kinds:
        notes.append("the image store records no pictures: boxes are drawn on a blank canvas of each image's size")
    if "synthetic" in kinds:
        notes.append("synthetic images: each scene is drawn from the store's own boxes, classes and colours")


