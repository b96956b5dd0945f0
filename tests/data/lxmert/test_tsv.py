"""The image inputs of an ingest (xmodal.data.lxmert.tsv): a feature-only store read in place of a TSV
file, row group by row group in a random order; the random-weight features of an extraction marked in
every store built from them; where an extraction's images came from, carried into the LXMERT store."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from refdata import RefCorpus

from xmodal.data.lxmert.feature_writer import ingest_features
from xmodal.data.lxmert.features import image_sources, open_features
from xmodal.data.lxmert.ingest import ingest_lxmert
from xmodal.data.lxmert.rows import IMAGES_ROOT, SOURCE, write_shard
from xmodal.data.lxmert.store import open_store
from xmodal.data.lxmert.tsv import RANDOM_WEIGHTS_KEY, tsv_lines_at


def test_a_store_read_in_random_order_row_group_by_row_group(reference: RefCorpus, tmp_path: Path):
    """`tsv_lines_at` over a feature-only store (what `ingest lxmert --tsv STORE` reads in its seeded
    order): each image is its row, found through the one row group that holds it, and named by its
    row in the shard."""
    store = ingest_features(tmp_path / "feats", reference.tsv, images_per_shard=8, row_group_images=3,
                            progress=False)  # 3 shards of 8 rows: row groups of 3, 3 and 2
    shards = store.manifest.shards
    natural = {(i, r): img_id for i, s in enumerate(shards)
               for r, img_id in enumerate(store.read_table(s.file, columns=["img_id"]).column("img_id").to_pylist())}
    order = sorted(natural)
    random.Random(0).shuffle(order)
    got = list(tsv_lines_at([store.path], ((0, i, r) for i, r in order)))
    assert [im.img_id for _, im in got] == [natural[loc] for loc in order]
    for (where, im), (i, r) in zip(got, order, strict=True):
        assert where == f"{store.path}: {Path(shards[i].file).name} row {r} (img_id {im.img_id!r})"
        ref = reference.images[im.img_id]
        np.testing.assert_array_equal(im.obj_ids, ref.obj_ids)
        np.testing.assert_allclose(im.features.astype(np.float32), ref.features, rtol=1e-3, atol=1e-3)


def test_a_store_of_random_weight_features_is_marked_where_it_goes(reference: RefCorpus, tmp_path: Path, capsys):
    """A store that `jobs/extract.py --random-weights` wrote (its manifest says so), ingested as --tsv:
    a warning on the console, and the built store's manifest names it, and so on down the line."""
    first = ingest_features(tmp_path / "feats", reference.tsv, progress=False)
    capsys.readouterr()
    assert RANDOM_WEIGHTS_KEY not in first.manifest.options
    again = ingest_features(tmp_path / "again", [first.path], progress=False)
    assert RANDOM_WEIGHTS_KEY not in again.manifest.options and "RANDOM WEIGHTS" not in capsys.readouterr().out
    raw = json.loads((first.path / "manifest.json").read_text())
    raw["options"]["random_weights"] = {"tiny": True, "seed": 0}  # what an extraction with random weights records
    (first.path / "manifest.json").write_text(json.dumps(raw))
    second = ingest_features(tmp_path / "second", [first.path], progress=False)
    out = capsys.readouterr().out
    assert f"warning: RANDOM WEIGHTS: {first.path} holds features of a detector with random weights" in out
    assert second.manifest.options[RANDOM_WEIGHTS_KEY] == [str(first.path)]
    third = ingest_features(tmp_path / "third", [second.path], progress=False)  # a store built from it
    assert third.manifest.options[RANDOM_WEIGHTS_KEY] == [str(second.path)] and "RANDOM WEIGHTS" in capsys.readouterr().out


def _give_sources(store, root: Path) -> dict[str, str]:
    """Write into a feature store what an extraction records: each image's file relative to IMAGES (its
    manifest's images_root) in a `source` column. Returns img_id -> the file's absolute path."""
    expected = {}
    for s in store.manifest.shards:
        p = store.path / s.file
        t = pq.read_table(p)
        rel = [f"sub/{i}.jpg" for i in t.column("img_id").to_pylist()]
        write_shard(t.append_column(SOURCE, pa.array(rel, SOURCE.type)), p, 4)
        expected.update({i: str(root / r) for i, r in zip(t.column("img_id").to_pylist(), rel, strict=True)})
    raw = json.loads((store.path / "manifest.json").read_text())
    raw["options"][IMAGES_ROOT] = str(root)
    (store.path / "manifest.json").write_text(json.dumps(raw))
    return expected


def _store_sources(path: Path) -> tuple[set[str], dict[str, str | None]]:
    """The column names of an LXMERT store's shards, and img_id -> its `source` value (None: no column)."""
    lx = open_store(path)
    names, out = set(), {}
    for split in ("train", "minival"):
        for f in lx.shard_paths(split):
            t = pq.read_table(f)
            names.add(tuple(t.column_names))
            src = t.column("source").to_pylist() if "source" in t.column_names else [None] * t.num_rows
            out.update(zip(t.column("img_id").to_pylist(), src, strict=True))
    return names, out


def test_an_lxmert_store_keeps_where_its_extracted_images_came_from(reference: RefCorpus, tmp_path: Path):
    """`ingest lxmert --tsv STORE` over a store that records its images' files: the LXMERT store records them
    too, absolute, and `image_sources` reads them from it; beside a TSV file, that file's images have none,
    and every shard has the one schema."""
    feats = ingest_features(tmp_path / "feats", reference.tsv[:1], images_per_shard=8, progress=False)
    expected = _give_sources(open_features(feats.path), tmp_path / "imgs")
    assert image_sources(feats.path) == expected
    ingest_lxmert(tmp_path / "lx", [feats.path, reference.tsv[1]], reference.json, vocab_size=200,
                  images_per_shard=5, progress=False)
    names, stored = _store_sources(tmp_path / "lx")
    assert len(names) == 1 and "source" in next(iter(names))  # every shard: the same columns, source among them
    from_store = {i for i in stored if i in expected}
    assert from_store and len(from_store) < len(stored)  # images from both inputs
    assert {i: stored[i] for i in from_store} == {i: expected[i] for i in from_store}
    assert all(stored[i] is None for i in stored if i not in expected)  # the TSV file's images: none recorded
    assert image_sources(tmp_path / "lx") == {i: expected[i] for i in from_store}
    block = open_store(tmp_path / "lx").read_split("train")  # the rows read back carry it too
    assert block.source is not None and {i: s for i, s in zip(block.img_id, block.source, strict=True)
                                         if s is not None} == {i: expected[i] for i in block.img_id if i in expected}


def test_an_lxmert_store_from_tsv_files_has_no_source_column(reference: RefCorpus, tmp_path: Path):
    ingest_lxmert(tmp_path / "lx", reference.tsv, reference.json, vocab_size=200, progress=False)
    names, stored = _store_sources(tmp_path / "lx")
    assert not any("source" in n for n in names) and set(stored.values()) == {None}
    assert image_sources(tmp_path / "lx") == {}
