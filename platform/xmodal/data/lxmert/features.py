"""Feature-only image stores (kind "features"): the images of reference feature TSVs without sentences.

NLVR2's own images (nlvr2_imgfeat/train_obj36.tsv, valid_obj36.tsv, test_obj36.tsv), GQA testdev and COCO test2015 have no pretraining
sentences, so an LXMERT store (`jobs/ingest.py lxmert`) leaves them out. A feature-only store holds
them for fine-tuning sets (`xmodal.data.finetune`), which look their images up across one or several
image stores:

    STORE/manifest.json               kind "features": dims, shards with their row counts, inputs
    STORE/images/part-NNNNN.parquet   one row per image

The rows are an LXMERT store's image columns (`rows.image_schema`: img_id, img_h, img_w,
num_boxes, float16 features, normalised boxes, object/attribute ids and confidences), decoded and
checked by the same code (`tsv.scan_tsv_ids`, `tsv.parse_tsv_line`); there is no vocabulary,
answer table or sentence column. A store that `jobs/extract.py` wrote has one more column, `source`
(string): where each image came from, relative to the IMAGES root its manifest records
(`options.images_root`) or a URI or absolute path; `image_sources` reads them (an LXMERT store's too:
`jobs/ingest.py lxmert` carries them over from such a store). Stores without it (written from TSV
files, or by an earlier extraction) stay valid. Written in a hidden temporary directory and renamed
into place (`feature_writer.FeatureWriter`, which writes every feature-only store). Imports numpy and
pyarrow only.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import pyarrow as pa
import pydantic

from xmodal.data.errors import StoreError
from xmodal.data.location import Location, locate, open_parquet, store_path
from xmodal.data.lxmert.rows import IMAGES_ROOT, SOURCE, absolute_source, image_schema, read_shard
from xmodal.data.lxmert.store import LxmertStore, open_store
from xmodal.data.manifest import KINDS, Manifest, kind_at
from xmodal.data.units import open_listed_parquet

KIND = "features"
SCHEMA_VERSION = 1
SHARD_DIR = "images"


class FeatureShard(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")

    file: str  # relative to the store directory
    rows: pydantic.NonNegativeInt  # images


class FeatureManifest(Manifest):
    """What a feature-only store's `manifest.json` holds; `open_features` checks it against the shards."""

    KIND: ClassVar[str] = KIND
    SCHEMA_VERSION: ClassVar[int] = SCHEMA_VERSION

    num_objects: pydantic.PositiveInt
    feat_dim: pydantic.PositiveInt
    num_object_labels: pydantic.PositiveInt
    num_attr_labels: pydantic.PositiveInt
    shards: list[FeatureShard]
    source: str  # "tsv": reference feature TSV files
    inputs: list[str] = []  # absolute paths of the files ingested
    # sha256 of the image lines ingested, in order: a store rebuilt from changed files at the same
    # paths gets another fingerprint (a fine-tuning set over it is refused)
    content_sha256: str
    options: dict[str, Any] = {}  # the options that built it
    created: str = ""

    @property
    def images(self) -> int:
        return sum(s.rows for s in self.shards)

    def identity(self) -> dict[str, Any]:
        """The manifest without its build date (what a fine-tuning set's store fingerprint hashes)."""
        d = self.dump()
        d.pop("created", None)
        return d


class FeatureStore:
    """An opened, checked feature-only store. Cheap to pickle (path + manifest)."""

    def __init__(self, path: Path | Location, manifest: FeatureManifest):
        self.path = path
        self.manifest = manifest

    def __repr__(self) -> str:
        m = self.manifest
        return (f"FeatureStore({str(self.path)!r}, {m.images} images, {m.num_objects} objects x {m.feat_dim} "
                f"features, {len(m.shards)} shard(s))")

    def image_files(self) -> list[str]:
        """Every shard (relative paths)."""
        return [s.file for s in self.manifest.shards]

    def read_table(self, file: str, row_groups: Sequence[int] | None = None,
                   columns: Sequence[str] | None = None) -> pa.Table:
        """Read one shard (or some of its row groups); errors name the shard."""
        return read_shard(self.path / file, row_groups, columns)


def open_features(path: str | Path | Location) -> FeatureStore:
    """Open a feature-only store and check its manifest against the shards' footers (files exist,
    are Parquet, have the rows and the schema the manifest says). Reads no feature data."""
    root = locate(path)
    m = FeatureManifest.read(root)  # names the path and the kind expected when it is not a feature-only store
    expected = image_schema(m.num_objects, m.feat_dim)
    for s in m.shards:
        p = root / s.file
        schema = open_listed_parquet(p, s.rows).schema_arrow
        if not (schema.equals(expected) or schema.equals(expected.append(SOURCE))):
            raise StoreError(f"{p}: columns {schema.names} of types {schema.types} differ from the image columns "
                             f"{expected.types} (manifest: num_objects={m.num_objects}, feat_dim={m.feat_dim})")
    return FeatureStore(store_path(root), m)


def image_sources(store: FeatureStore | LxmertStore | str | Path | Location) -> dict[str, str]:
    """img_id -> where the image came from (an absolute local path or a URI), for a store written by
    `jobs/extract.py` or an LXMERT store ingested from one; {} for a store that does not record it (built
    from TSV files, or older). An LXMERT store's images from TSV files are left out. Reads the img_id and
    source columns only."""
    if not isinstance(store, FeatureStore | LxmertStore):
        store = open_image_store(store)
    root = store.manifest.options.get(IMAGES_ROOT)  # an LXMERT store has none: its sources are absolute
    out: dict[str, str] = {}
    for f in store.image_files():
        if SOURCE.name not in open_parquet(store.path / f).schema_arrow.names:
            return {}
        t = store.read_table(f, columns=["img_id", SOURCE.name])
        for img_id, src in zip(t.column("img_id").to_pylist(), t.column(SOURCE.name).to_pylist(), strict=True):
            if src is not None:
                out[img_id] = absolute_source(src, root)
    return out


ImageStore = LxmertStore | FeatureStore


def open_image_store(path: str | Path | Location) -> ImageStore:
    """An LXMERT store or a feature-only store (a local folder or a URI), by the kind its manifest records."""
    root = locate(path)
    kind = kind_at(root) if root.is_dir() else None
    if kind == KIND:
        return open_features(root)
    if kind == "lxmert":
        return open_store(root)
    what = "does not exist" if not root.exists() else (
        "has no manifest.json" if kind is None else f"holds {KINDS.get(kind, f'a directory of kind {kind!r}')}")
    raise StoreError(f"{root}: {what}; expected {KINDS['lxmert']} or {KINDS[KIND]} (build one with "
                     "`python jobs/ingest.py lxmert|synthetic|features`)")
