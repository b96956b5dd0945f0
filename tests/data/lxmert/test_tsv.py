"""The image inputs of an ingest (xmodal.data.lxmert.tsv): a feature-only store read in place of a TSV
file, row group by row group in a random order, and the random-weight features of an extraction marked
in every store built from them."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
from refdata import RefCorpus

from xmodal.data.lxmert.features import ingest_features
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
