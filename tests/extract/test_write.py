"""The write tasks' side of an extraction, without Ray: a bundle of detected images becomes one shard named
by its content, written again under the same name when the task is retried; the store's writer verifies
what an earlier run left, keeps work made with other options, and commits only what it is given."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from xmodal.data.errors import StoreError
from xmodal.data.lxmert.feature_writer import RECORD, FeatureWriter, ShardInfo
from xmodal.data.lxmert.features import KIND, SCHEMA_VERSION, FeatureManifest, open_features
from xmodal.data.lxmert.rows import SOURCE, image_schema
from xmodal.extract.write import INPUTS, ShardWrite, write_batch

OPTIONS = {"format": "store", "boxes": [36, 36]}


def batch(ids: list[str], k: int = 3, width: int = 8, rejects: dict[str, str] | None = None) -> dict[str, np.ndarray]:
    """A bundle of the detector actors' output, as a write task gets it."""
    n, rejects = len(ids), rejects or {}
    features = np.stack([np.random.default_rng(list(i.encode())).random((k, width), dtype=np.float32) for i in ids])
    return {"img_id": np.array(ids, dtype=object), "path": np.array([f"/imgs/{i}.jpg" for i in ids], dtype=object),
            "source": np.array([f"{i}.jpg" for i in ids], dtype=object),
            "size": np.array([100 + ord(i[0]) for i in ids]), "mtime": np.full(n, 10**18), "reject": np.array([rejects.get(i, "") for i in ids], dtype=object),
            "reject_kind": np.array(["image" if i in rejects else "" for i in ids], dtype=object),
            "img_h": np.full(n, 48), "img_w": np.full(n, 64), "num_boxes": np.full(n, k),
            "features": features,
            "boxes": np.tile(np.array([0, 0, 10, 10], np.float32), (n, k, 1)), "obj_ids": np.ones((n, k), np.int64),
            "obj_conf": np.full((n, k), 0.5, np.float32), "attr_ids": np.zeros((n, k), np.int64),
            "attr_conf": np.full((n, k), 0.5, np.float32)}


SCHEMA = image_schema(3, 8).append(SOURCE)


def writer(out, options=OPTIONS, **kw) -> FeatureWriter:
    return FeatureWriter(out, options=options, work="extract", **kw)


def manifest(files, digest) -> FeatureManifest:
    return FeatureManifest(schema_version=SCHEMA_VERSION, kind=KIND, num_objects=3, feat_dim=8, num_object_labels=1600,
                           num_attr_labels=400, shards=files, source="extract", content_sha256=digest)


def test_a_bundle_becomes_one_shard_named_by_its_ids_and_a_retry_rewrites_it(tmp_path):
    w = writer(tmp_path / "store")
    w.start()
    write = ShardWrite(w.sink())
    # the same images in another order (another bundling of the blocks): the same shard
    first = write_batch(batch(["b", "a", "c"], rejects={"c": "empty file"}), write).to_pylist()[0]
    again = write_batch(batch(["a", "c", "b"], rejects={"c": "empty file"}), write).to_pylist()[0]
    assert first["shard"] == again["shard"] and first["shard"].startswith("part-a-") and first["ids"] == ["a", "b"]
    assert first["sha256"] == again["sha256"] and first["bytes"] > 0 and first["error"] == ""
    assert json.loads(first["rejects"]) == [["/imgs/c.jpg", "c", "empty file", "image"]]
    shards = list((tmp_path / ".store.extract" / "images").iterdir())
    assert [p.name for p in shards] == [first["shard"]]  # one file: the retry wrote the same one
    footer = json.loads(pq.read_schema(shards[0]).metadata[b"xmodal.shard"])
    assert [row[:2] for row in footer["keep"][INPUTS]] == [["a", "/imgs/a.jpg"], ["b", "/imgs/b.jpg"]]
    assert pq.read_table(shards[0]).column("source").to_pylist() == ["a.jpg", "b.jpg"]
    # the record holds names and ids, not features: small whatever the shard weighs
    assert write_batch(batch(["z"]), write).nbytes < 400


def test_a_tsv_shard_holds_the_reference_lines(tmp_path):
    w = FeatureWriter(tmp_path / "out.tsv", options={"format": "tsv"}, work="extract", lines=True)
    w.start()
    rec = write_batch(batch(["x", "y"]), ShardWrite(w.sink(), "tsv")).to_pylist()[0]
    lines = pq.read_table(tmp_path / ".out.tsv.extract" / "images" / rec["shard"]).column("line").to_pylist()
    assert [line.split("\t")[0] for line in lines] == ["x", "y"] and all(line.endswith("\n") for line in lines)
    assert len(lines[0].split("\t")) == 10


def test_a_rerun_keeps_verified_shards_and_the_commit_removes_the_rest(tmp_path):
    out = tmp_path / "store"
    w = writer(out)
    w.start()
    write = ShardWrite(w.sink())
    records = [write_batch(batch(ids), write).to_pylist()[0] for ids in (["a", "b"], ["c"], ["d"])]
    shards = tmp_path / ".store.extract" / "images"
    # a killed run's leftovers: a half-written shard under a finished name, a stranger's file, a temporary one
    (shards / records[2]["shard"]).write_bytes((shards / records[2]["shard"]).read_bytes()[:100])
    (shards / "part-e-0123456789abcdef.parquet").write_bytes((shards / records[1]["shard"]).read_bytes())
    (shards / ".tmp-part-f").write_bytes(b"half")
    again = writer(out)
    found = again.existing(SCHEMA)
    assert sorted(found.verified) == sorted(r["shard"] for r in records[:2])
    assert sorted(found.stray) == sorted([records[2]["shard"], "part-e-0123456789abcdef.parquet"])
    assert found.ids() == {"a": records[0]["shard"], "b": records[0]["shard"], "c": records[1]["shard"]}
    assert found.kept[records[1]["shard"]][INPUTS][0][:2] == ["c", "/imgs/c.jpg"]
    # the rerun writes d again and commits: only what it names is in the store
    again.start()
    d = write_batch(batch(["d"]), ShardWrite(again.sink())).to_pylist()[0]
    assert d["shard"] == records[2]["shard"]  # the run's key is the record's: the same name
    todo = [*found.verified.values(), ShardInfo(d["shard"], tuple(d["ids"]), d["sha256"])]
    again.commit(sorted(todo, key=lambda s: s.name), manifest)
    store = open_features(out)
    assert store.manifest.images == 4 and sorted(p.name for p in (out / "images").iterdir()) == sorted(
        s.name for s in todo)
    assert not (tmp_path / ".store.extract").exists() and not (out / RECORD).exists()


def test_work_of_other_options_or_format_is_kept_and_named(tmp_path):
    """An unfinished store's shards are refused, never discarded, by a run with other options, or by a TSV
    run to the same OUT (which once deleted them); --restart discards them when its run starts."""
    out = tmp_path / "store"
    w = writer(out)
    w.start()
    write_batch(batch(["a"]), ShardWrite(w.sink()))
    work = tmp_path / ".store.extract"
    before = sorted(p.relative_to(work) for p in work.rglob("*"))
    with pytest.raises(StoreError) as e:
        writer(out, {**OPTIONS, "boxes": [10, 100]})
    assert str(e.value).startswith(f"{work}: an unfinished features output made with other options is kept there "
                                   "(1 shard(s); boxes: built with [36, 36], asked for [10, 100]); rerun it")
    with pytest.raises(StoreError, match=r"an unfinished features output .*format: made as features, asked for tsv"):
        FeatureWriter(out, options=OPTIONS, work="extract", lines=True)
    assert sorted(p.relative_to(work) for p in work.rglob("*")) == before
    restarted = writer(out, {**OPTIONS, "boxes": [10, 100]}, restart=True)
    assert restarted.existing(SCHEMA).verified == {} and len(before) == 3  # nothing is removed before the start
    restarted.start()
    assert not list((work / "images").iterdir())
    # a folder at the root's name that no writer recorded is not ours: left alone, named
    (work / RECORD).unlink()
    with pytest.raises(StoreError, match="holds no record of an unfinished store"):
        writer(out, restart=True)
