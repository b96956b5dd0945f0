"""Feature-only image stores (`jobs/ingest.py features`): reference TSV round trip, errors named by
file:line with nothing left behind, and the store kinds that open as image stores."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from refdata import RefCorpus, read_images

from xmodal.cli.ingest import main as ingest_main
from xmodal.data.errors import StoreError
from xmodal.data.lxmert.feature_writer import ingest_features
from xmodal.data.lxmert.features import (
    FeatureStore,
    image_sources,
    open_features,
    open_image_store,
)
from xmodal.data.lxmert.rows import image_schema
from xmodal.data.lxmert.store import LxmertStore
from xmodal.data.lxmert.tsv import IngestError


def _nothing_written(out: Path) -> None:
    assert not out.exists(), f"{out} was created by a failed ingest"
    assert not [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


def test_round_trip_of_the_reference_tsv(reference: RefCorpus, tmp_path: Path):
    store = ingest_features(tmp_path / "feats", reference.tsv, images_per_shard=8, row_group_images=4,
                            progress=False)
    m = store.manifest
    assert isinstance(store, FeatureStore) and m.kind == "features" and m.images == len(reference.images) == 24
    assert (m.num_objects, m.feat_dim, len(m.shards)) == (36, 32, 3)
    assert m.inputs == [str(p) for p in reference.tsv] and m.source == "tsv"
    assert json.loads((store.path / "manifest.json").read_text())["kind"] == "features"
    # The same image columns as an LXMERT store's shards, and no sentences.
    assert store.read_table(m.shards[0].file).schema.equals(image_schema(36, 32))
    got = read_images(store)
    assert list(got["img_id"]) == list(reference.images)  # file order
    for k, ref in enumerate(reference.images.values()):
        n = len(ref.obj_ids)
        assert (got["img_h"][k], got["img_w"][k], got["num_boxes"][k]) == (ref.img_h, ref.img_w, n)
        assert got["features"].dtype == np.float16
        np.testing.assert_allclose(got["features"][k, :n].astype(np.float32), ref.features, rtol=1e-3, atol=1e-3)
        scale = np.array([ref.img_w, ref.img_h, ref.img_w, ref.img_h], np.float32)
        np.testing.assert_allclose(got["boxes"][k, :n], ref.boxes / scale, rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(got["obj_ids"][k, :n], ref.obj_ids)
        np.testing.assert_array_equal(got["attr_ids"][k, :n], ref.attr_ids)
        np.testing.assert_allclose(got["obj_conf"][k, :n], ref.obj_conf)
        np.testing.assert_allclose(got["attr_conf"][k, :n], ref.attr_conf)
    assert open_image_store(store.path).manifest == open_features(store.path).manifest
    assert image_sources(store) == {}  # a store from TSV files does not know where its images came from


def test_cut_line_and_duplicates_are_named_and_leave_nothing(reference: RefCorpus, tmp_path: Path):
    lines = reference.tsv[1].read_bytes().splitlines(keepends=True)
    reference.tsv[1].write_bytes(b"".join(lines[:4]) + lines[4][:200])  # the file ends inside line 5
    out = tmp_path / "feats"
    with pytest.raises(IngestError, match=rf"{re.escape(str(reference.tsv[1]))}:5: .*got 4 .*cut off"):
        ingest_features(out, reference.tsv, progress=False)
    _nothing_written(out)
    reference.tsv[1].write_bytes(b"".join(lines[:4]))
    with pytest.raises(IngestError, match=rf"{re.escape(str(reference.tsv[1]))}:1: img_id 'COCO_000012' already "
                                          "has features at " + re.escape(f"{reference.tsv[1]}:1")):
        ingest_features(out, [reference.tsv[1], reference.tsv[1]], progress=False)
    _nothing_written(out)
    # --num-objects smaller than a line's boxes: the decode names the line, the temporary directory goes.
    with pytest.raises(IngestError, match=rf"{re.escape(str(reference.tsv[0]))}:1 .*at most --num-objects 8"):
        ingest_features(out, reference.tsv[:1], num_objects=8, progress=False)
    _nothing_written(out)


def test_targets_and_kinds(reference: RefCorpus, tmp_path: Path, small_store: LxmertStore):
    store = ingest_features(tmp_path / "feats", reference.tsv[:1], progress=False)
    with pytest.raises(StoreError, match="already exists; pass --overwrite"):
        ingest_features(store.path, reference.tsv[:1], progress=False)
    assert ingest_features(store.path, reference.tsv, overwrite=True, progress=False).manifest.images == 24
    # Never replaces a store of another kind, even with --overwrite.
    with pytest.raises(StoreError, match="holds an LXMERT feature store .* refusing"):
        ingest_features(small_store.path, reference.tsv, overwrite=True, progress=False)
    with pytest.raises(StoreError, match="expected a feature-only image store"):
        open_features(small_store.path)
    assert isinstance(open_image_store(small_store.path), LxmertStore)
    with pytest.raises(StoreError, match=r"nowhere: does not exist; expected an LXMERT feature store or a "
                                         r"feature-only image store"):
        open_image_store(tmp_path / "nowhere")
    # The command line: one line per store, exit 0; a missing input is exit 2.
    assert ingest_main(["features", str(tmp_path / "cli"), "--tsv", str(reference.tsv[0]), "--tsv",
                        str(reference.tsv[1]), "--no-progress"]) == 0
    assert open_features(tmp_path / "cli").manifest.images == 24
    assert ingest_main(["features", str(tmp_path / "cli2"), "--tsv", str(tmp_path / "no.tsv")]) == 2


def test_a_store_written_to_s3_reads_as_the_local_one(reference: RefCorpus, tmp_path: Path, s3):
    """The same writer on S3 (the tests' moto server): the shards and the manifest written there, the
    manifest last; read back through the same readers, the rows of the local store; replaced with
    --overwrite, the old shards go once the new manifest is in place."""
    import uuid

    from xmodal_testing import S3_BUCKET

    uri = f"s3://{S3_BUCKET}/feats-{uuid.uuid4().hex[:8]}"
    local = ingest_features(tmp_path / "feats", reference.tsv, images_per_shard=8, progress=False)
    remote = ingest_features(uri, reference.tsv, images_per_shard=8, progress=False)
    assert str(remote.path) == uri and remote.manifest.content_sha256 == local.manifest.content_sha256
    a, b = read_images(local), read_images(remote)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    prefix = uri.split("/", 3)[3]
    keys = lambda: sorted(o["Key"].removeprefix(prefix + "/")  # noqa: E731
                          for o in s3.client().list_objects_v2(Bucket=S3_BUCKET, Prefix=prefix)["Contents"]
                          if not o["Key"].endswith("/"))
    assert keys() == sorted(["manifest.json", *remote.image_files()])
    with pytest.raises(StoreError, match=f"output folder {uri}: already exists; pass --overwrite"):
        ingest_features(uri, reference.tsv[:1], progress=False)
    again = ingest_features(uri, reference.tsv[:1], images_per_shard=8, overwrite=True, progress=False)
    assert again.manifest.images == 12 and keys() == sorted(["manifest.json", *again.image_files()])
