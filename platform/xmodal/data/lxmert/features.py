"""Feature-only image stores (kind "features"): the images of reference feature TSVs without sentences.

NLVR2's own images (nlvr2_imgfeat/train_obj36.tsv, valid_obj36.tsv, test_obj36.tsv), GQA testdev and COCO test2015 have no pretraining
sentences, so an LXMERT store (`jobs/ingest.py lxmert`) leaves them out. A feature-only store holds
them for fine-tuning sets (`xmodal.data.finetune`), which look their images up across one or several
image stores:

    STORE/manifest.json               kind "features": dims, shards with their row counts, inputs
    STORE/images/part-NNNNN.parquet   one row per image

The rows are an LXMERT store's image columns (`store.image_schema`: img_id, img_h, img_w,
num_boxes, float16 features, normalised boxes, object/attribute ids and confidences), decoded and
checked by the same code (`ingest.scan_tsv_ids`, `ingest.parse_tsv_line`); there is no vocabulary,
answer table or sentence column. A store that `jobs/extract.py` wrote has one more column, `source`
(string): where each image came from, relative to the IMAGES root its manifest records
(`options.images_root`) or a URI or absolute path; `image_sources` reads them. Stores without it
(written from TSV files, or by an earlier extraction) stay valid. Written in a hidden temporary directory and renamed into place
(`common.publish_dir`). Imports numpy and pyarrow only.
"""

from __future__ import annotations

import datetime
import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import pyarrow as pa
import pydantic

from xmodal.base.console import progress_bar
from xmodal.data.common import (
    KINDS,
    Location,
    Manifest,
    StoreError,
    check_target,
    discard_partial,
    kind_at,
    local_target,
    locate,
    missing_parents,
    open_listed_parquet,
    open_parquet,
    publish_dir,
    store_path,
    temp_dir_beside,
)
from xmodal.data.lxmert.ingest import (
    IngestError,
    check_tsv_inputs,
    item_bytes,
    mark_random_weights,
    pack_images,
    parse_item,
    scan_tsv_ids,
    tsv_lines,
)
from xmodal.data.lxmert.store import (
    LxmertStore,
    image_columns,
    image_schema,
    open_store,
    read_shard,
    write_shard,
)

KIND = "features"
SCHEMA_VERSION = 1
SHARD_DIR = "images"
SOURCE = pa.field("source", pa.string())  # an extracted store's column: where each image came from
IMAGES_ROOT = "images_root"  # the manifest's option the relative sources are relative to


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


def image_sources(store: FeatureStore | str | Path | Location) -> dict[str, str]:
    """img_id -> where the image came from (an absolute local path or a URI), for a store written by
    `jobs/extract.py`; {} for a store that does not record it (built from TSV files, or older). Reads the
    img_id and source columns only."""
    if not isinstance(store, FeatureStore):
        store = open_features(store)
    root = store.manifest.options.get(IMAGES_ROOT)
    out: dict[str, str] = {}
    for f in store.image_files():
        if SOURCE.name not in open_parquet(store.path / f).schema_arrow.names:
            return {}
        t = store.read_table(f, columns=["img_id", SOURCE.name])
        for img_id, src in zip(t.column("img_id").to_pylist(), t.column(SOURCE.name).to_pylist(), strict=True):
            out[img_id] = _absolute(src, root)
    return out


def _absolute(source: str, root: str | None) -> str:
    if "://" in source or source.startswith("/") or not root:
        return source
    return f"{root.rstrip('/')}/{source}" if "://" in root else str(Path(root) / source)


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


def ingest_features(out: str | Path, tsv: Sequence[str | Path], *, num_objects: int = 36,
                    feat_dim: int | None = None, num_object_labels: int = 1600, num_attr_labels: int = 400,
                    images_per_shard: int = 256, row_group_images: int = 32, overwrite: bool = False,
                    progress: bool = True) -> FeatureStore:
    """Reference feature TSVs -> a feature-only store at `out`. Every line is pre-scanned first (a line
    cut short, a duplicate img_id or another feature width fails, named by file:line, before any
    decoding), then decoded and checked as the LXMERT ingest does; nothing is left behind on error."""
    out_path = local_target(out)
    check_target(out_path, overwrite, KIND)  # before reading anything
    paths = [Path(p).expanduser().resolve() for p in tsv]
    if not paths:
        raise IngestError("need at least one feature TSV file")
    check_tsv_inputs(paths)  # a feature TSV file, or a store from jobs/extract.py
    for name, value in (("num_objects", num_objects), ("num_object_labels", num_object_labels),
                        ("num_attr_labels", num_attr_labels), ("images_per_shard", images_per_shard),
                        ("row_group_images", row_group_images), ("feat_dim", 1 if feat_dim is None else feat_dim)):
        if value < 1:
            raise IngestError(f"--{name.replace('_', '-')} {value}: expected >= 1")
    located = scan_tsv_ids(paths, progress, feat_dim)
    if not located:
        raise IngestError(f"no image in {', '.join(str(p) for p in paths)}: the files hold no line")
    options = {"num_objects": num_objects, "feat_dim": feat_dim, "num_object_labels": num_object_labels,
               "num_attr_labels": num_attr_labels, "images_per_shard": images_per_shard,
               "row_group_images": row_group_images}
    mark_random_weights(paths, options)
    made = missing_parents(out_path)
    tmp = temp_dir_beside(out_path)
    try:
        (tmp / SHARD_DIR).mkdir()
        shards: list[FeatureShard] = []
        buffer = []
        width = feat_dim

        def flush() -> None:
            rel = f"{SHARD_DIR}/part-{len(shards):05d}.parquet"
            assert width is not None
            cols = image_columns(pack_images(buffer, num_objects, width))
            write_shard(pa.Table.from_pydict(cols, schema=image_schema(num_objects, width)), tmp / rel,
                        min(row_group_images, images_per_shard))
            shards.append(FeatureShard(file=rel, rows=len(buffer)))
            buffer.clear()

        digest = hashlib.sha256()
        bar = progress_bar(len(located), "decode TSV", "img", progress)
        for where, line in tsv_lines(paths):
            digest.update(item_bytes(line))
            digest.update(b"\n")
            im = parse_item(line, where, feat_dim=width, num_objects=num_objects,
                                num_object_labels=num_object_labels, num_attr_labels=num_attr_labels)
            width = im.features.shape[1]
            buffer.append(im)
            if len(buffer) >= images_per_shard:
                flush()
            bar.update(1)
        bar.close()
        if buffer:
            flush()
        assert width is not None
        FeatureManifest(
            schema_version=SCHEMA_VERSION, kind=KIND, num_objects=num_objects, feat_dim=width,
            num_object_labels=num_object_labels, num_attr_labels=num_attr_labels, shards=shards, source="tsv",
            inputs=[str(p) for p in paths], content_sha256=digest.hexdigest(), options={**options, "feat_dim": width},
            created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")).write(tmp)
        open_features(tmp)  # check what was written before it becomes visible
        publish_dir(tmp, out_path, lambda: check_target(out_path, overwrite, KIND))
    except BaseException:
        discard_partial(tmp, made)
        raise
    return open_features(out_path)
