"""Reference TSV + JSON -> store -> read back; every kind of bad input fails clearly and writes nothing."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from refdata import FEAT_DIM, RAW, RefCorpus, ref_image, write_reference

from xmodal.cli.ingest import main as ingest_main
from xmodal.data.answers import AnswerTable, normalize_answer
from xmodal.data.errors import StoreError
from xmodal.data.lxmert.ingest import ingest_lxmert
from xmodal.data.lxmert.store import open_store
from xmodal.data.lxmert.tsv import IngestError


def _ingest(ref: RefCorpus, out: Path, **kw):
    kw.setdefault("progress", False)
    kw.setdefault("minival_fraction", 0.25)
    kw.setdefault("images_per_shard", 8)
    kw.setdefault("row_group_images", 4)
    return ingest_lxmert(out, ref.tsv, ref.json, **kw)


def _nothing_written(out: Path) -> None:
    assert not out.exists(), f"{out} was created by a failed ingest"
    leftovers = [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]
    assert not leftovers, f"temporary directories left behind: {leftovers}"


# ----------------------------------------------------------------------------- round trip


def test_round_trip_reference_formats(reference: RefCorpus, tmp_path: Path):
    store = _ingest(reference, tmp_path / "store")
    m = store.manifest
    assert (m.num_objects, m.feat_dim, m.num_object_labels, m.num_attr_labels) == (36, FEAT_DIM, 1600, 400)
    assert m.source == "lxmert" and m.max_seq_len == 20 and m.special_tokens["[PAD]"] == 0
    assert m.vocab_size == store.tokenizer().vocab_size and m.num_answers == len(store.answers())
    assert (store.path / "vocab.txt").is_file() and (store.path / "answers.json").is_file()

    tok, table = store.tokenizer(), store.answers()
    seen: dict[str, str] = {}
    for split in ("train", "minival"):
        block = store.read_split(split)
        assert m.images(split) == block.num_images and m.sentences(split) == block.num_sentences
        for k, img_id in enumerate(block.img_id):
            assert img_id not in seen, f"{img_id} is in both {seen[img_id]} and {split}"
            seen[img_id] = split
            ref = reference.images[img_id]
            n = len(ref.obj_ids)
            assert block.num_boxes[k] == n
            np.testing.assert_allclose(block.features[k, :n].astype(np.float32), ref.features, rtol=1e-3, atol=1e-4)
            wh = np.array([ref.img_w, ref.img_h, ref.img_w, ref.img_h], np.float32)
            np.testing.assert_allclose(block.boxes[k, :n], ref.boxes / wh, rtol=1e-6, atol=1e-6)
            assert block.boxes.min() >= 0 and block.boxes.max() <= 1
            np.testing.assert_array_equal(block.obj_ids[k, :n], ref.obj_ids)
            np.testing.assert_array_equal(block.attr_ids[k, :n], ref.attr_ids)
            np.testing.assert_array_equal(block.obj_conf[k, :n], ref.obj_conf)
            np.testing.assert_array_equal(block.attr_conf[k, :n], ref.attr_conf)
            s0, s1 = block.sent_offsets[k], block.sent_offsets[k + 1]
            assert [tok.decode(r) for r in block.input_ids[s0:s1]] == [s.lower() for s in reference.sentences[img_id]]
            assert (block.input_ids[s0:s1, 0] == tok.cls_id).all()
            for s, raw in zip(range(s0, s1), reference.labels[img_id], strict=True):
                a0, a1 = block.ans_offsets[s], block.ans_offsets[s + 1]
                got = {table.answer(int(i)): float(sc) for i, sc in zip(block.ans_ids[a0:a1], block.ans_scores[a0:a1],
                                                                        strict=True)}
                want = {normalize_answer(a): float(np.float32(sc)) for a, sc in (raw or {}).items()}
                assert got == want
    assert set(seen) == set(reference.images)
    assert {"train", "minival"} == set(seen.values())


def test_answer_normalisation_and_reference_answer_table(reference: RefCorpus, tmp_path: Path):
    assert normalize_answer("Two") == "2" and normalize_answer("The red.") == "red"
    assert normalize_answer("an apple") == "apple" and normalize_answer("grey") == "gray"
    all_ans = tmp_path / "all_ans.json"
    all_ans.write_text(json.dumps([{"ans": a, "dsets": ["vqa"]} for a in ("yes", "no", "2", "red")]))
    store = _ingest(reference, tmp_path / "store", answers=all_ans)
    assert store.answers().answers == ["yes", "no", "2", "red"]
    # Answers outside the 4-answer table are counted, not stored.
    known = {"yes", "no", "2", "red"}
    unknown = sum(1 for labs in reference.labels.values() for lab in labs if lab
                  for a in lab if normalize_answer(a) not in known)
    assert store.manifest.unknown_answers == unknown > 0
    assert RAW["2"] == "two" and AnswerTable(["2"]).index("two") == 0


def test_given_vocab_file(reference: RefCorpus, tmp_path: Path):
    from refdata import WORDS

    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", "?", "is", *WORDS]) + "\n")
    store = _ingest(reference, tmp_path / "store", vocab=vocab)
    assert store.manifest.vocab_size == len(vocab.read_text().splitlines())
    assert (store.path / "vocab.txt").read_text() == vocab.read_text()
    block = store.read_split("train")
    assert store.tokenizer().decode(block.input_ids[0]) == reference.sentences[block.img_id[0]][0].lower()


def test_cli_and_no_overwrite(reference: RefCorpus, tmp_path: Path, capsys):
    out = tmp_path / "store"
    args = ["lxmert", str(out), "--tsv", str(reference.tsv[0]), "--tsv", str(reference.tsv[1]),
            "--json", str(reference.json[0]), "--json", str(reference.json[1]), "--no-progress",
            "--images-per-shard", "8"]
    assert ingest_main(args) == 0
    before = json.loads((out / "manifest.json").read_text())["created"]
    shard = sorted(out.glob("train/*.parquet"))[0]
    mtime = shard.stat().st_mtime_ns
    assert ingest_main(args) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert shard.stat().st_mtime_ns == mtime and json.loads((out / "manifest.json").read_text())["created"] == before
    assert ingest_main([*args, "--overwrite"]) == 0
    assert open_store(out).manifest.images("train") + open_store(out).manifest.images("minival") == 24
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".store.")]


# ----------------------------------------------------------------------------- bad inputs


def _rewrite_line(path: Path, index: int, change) -> None:
    lines = path.read_text().splitlines(keepends=True)
    fields = lines[index].rstrip("\n").split("\t")
    change(fields)
    lines[index] = "\t".join(fields) + "\n"
    path.write_text("".join(lines))


def _expect_error(ref: RefCorpus, out: Path, *fragments: str, **kw) -> str:
    with pytest.raises((IngestError, StoreError)) as e:
        _ingest(ref, out, **kw)
    msg = str(e.value)
    for f in fragments:
        assert f in msg, f"{f!r} not in error: {msg}"
    _nothing_written(out)
    return msg


def test_garbled_base64(reference: RefCorpus, tmp_path: Path):
    good = _ingest(reference, tmp_path / "good")
    _rewrite_line(reference.tsv[0], 2, lambda f: f.__setitem__(9, "@@not base64!" + f[9][13:]))
    _expect_error(reference, tmp_path / "store", f"{reference.tsv[0]}:3", "'features'", "invalid base64")
    # A failed --overwrite leaves the existing store as it was.
    with pytest.raises(IngestError, match="invalid base64"):
        _ingest(reference, good.path, overwrite=True)
    assert open_store(good.path).manifest == good.manifest
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".good.")]


def test_wrong_number_of_boxes(reference: RefCorpus, tmp_path: Path):
    _rewrite_line(reference.tsv[1], 0, lambda f: f.__setitem__(7, "35"))  # arrays hold 36 boxes
    _expect_error(reference, tmp_path / "store", f"{reference.tsv[1]}:1", "'objects_id'", "wrong number of boxes")


def test_wrong_feature_width(reference: RefCorpus, tmp_path: Path):
    img = ref_image(np.random.default_rng(5), "COCO_000001", feat_dim=FEAT_DIM - 1)
    _rewrite_line(reference.tsv[0], 1, lambda f: f.__setitem__(9, img.fields()[9]))
    _expect_error(reference, tmp_path / "store", f"{reference.tsv[0]}:2", "'features'", f"width {FEAT_DIM - 1}",
                  f"expected {FEAT_DIM}")


def test_sentence_without_features(reference: RefCorpus, tmp_path: Path):
    recs = json.loads(reference.json[1].read_text())
    recs.append({"img_id": "COCO_999999", "sentf": {"vqa": ["what is this?"]}, "labelf": {"vqa": [{"dog": 1.0}]}})
    reference.json[1].write_text(json.dumps(recs))
    _expect_error(reference, tmp_path / "store", str(reference.json[1]), f"record #{len(recs) - 1}",
                  "'COCO_999999'", "no features")
    # ... or, asked to, drop them.
    store = _ingest(reference, tmp_path / "store2", allow_missing_images=True)
    assert store.manifest.options["missing_images"] == 1


def test_box_outside_image(reference: RefCorpus, tmp_path: Path):
    img = reference.images["COCO_000003"]
    boxes = img.boxes.copy()
    boxes[7, 2] = img.img_w + 50
    _rewrite_line(reference.tsv[0], 3, lambda f: f.__setitem__(8, img.__class__(**{**img.__dict__, "boxes": boxes}).fields()[8]))
    _expect_error(reference, tmp_path / "store", f"{reference.tsv[0]}:4", "'boxes'", "box 7", "not inside")


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_non_finite_features(reference: RefCorpus, tmp_path: Path, bad: float):
    img = reference.images["COCO_000000"]
    feats = img.features.copy()
    feats[4, 9] = bad
    _rewrite_line(reference.tsv[0], 0, lambda f: f.__setitem__(9, img.__class__(**{**img.__dict__, "features": feats}).fields()[9]))
    _expect_error(reference, tmp_path / "store", f"{reference.tsv[0]}:1", "'features'", "non-finite", "box 4, dim 9")


def test_malformed_json_record(reference: RefCorpus, tmp_path: Path):
    recs = json.loads(reference.json[0].read_text())
    recs[3]["labelf"] = {"mscoco": [{"yes": 1.0}] * (len(recs[3]["sentf"]["mscoco"]) + 1)}  # one label too many
    reference.json[0].write_text(json.dumps(recs))
    _expect_error(reference, tmp_path / "store", str(reference.json[0]), "record #3", "labelf.mscoco")


def test_invalid_json_syntax(reference: RefCorpus, tmp_path: Path):
    reference.json[1].write_text('[{"img_id": "COCO_000001",\n "sentf": {"vqa": ["a"]] }]')
    _expect_error(reference, tmp_path / "store", str(reference.json[1]), "line 2", "not valid JSON")


def test_wrong_field_count_and_duplicate_image(reference: RefCorpus, tmp_path: Path):
    _rewrite_line(reference.tsv[0], 0, lambda f: f.pop())
    _expect_error(reference, tmp_path / "store", f"{reference.tsv[0]}:1", "expected 10 tab-separated fields", "got 9")
    ref2 = write_reference(tmp_path / "ref2")
    ref2.tsv[1].write_text(ref2.tsv[1].read_text() + ref2.images["COCO_000000"].line())
    _expect_error(ref2, tmp_path / "store", f"{ref2.tsv[1]}:13", "'COCO_000000'", f"{ref2.tsv[0]}:1")


def test_corrupted_shard(reference: RefCorpus, tmp_path: Path):
    store = _ingest(reference, tmp_path / "store")
    shard = Path(store.shard_paths("train")[1])
    data = bytearray(shard.read_bytes())
    data[-12:-4] = b"\xff" * 8  # footer length / metadata
    shard.write_bytes(bytes(data))
    with pytest.raises(StoreError, match=f"{shard}.*corrupted"):
        open_store(store.path)
    shard.write_bytes(bytes(data[: len(data) // 2]))  # truncated
    with pytest.raises(StoreError, match=f"{shard}.*corrupted"):
        open_store(store.path)


def test_manifest_does_not_match_shards(reference: RefCorpus, tmp_path: Path):
    store = _ingest(reference, tmp_path / "store")
    mpath = store.path / "manifest.json"
    original = mpath.read_text()
    m = json.loads(original)
    m["shards"]["train"][0]["rows"] += 1
    mpath.write_text(json.dumps(m))
    with pytest.raises(StoreError, match=r"part-00000\.parquet: has \d+ rows, manifest says \d+"):
        open_store(store.path)
    m = json.loads(original)
    m["shards"]["train"][0]["sentences"] += 3
    mpath.write_text(json.dumps(m))
    with pytest.raises(StoreError, match=r"part-00000\.parquet: holds about \d+ sentences, manifest says"):
        open_store(store.path)
    m = json.loads(original)
    m["feat_dim"] = 2048
    mpath.write_text(json.dumps(m))
    with pytest.raises(StoreError, match=r"column 'features' has type .*expected"):
        open_store(store.path)
    m = json.loads(original)
    m["vocab_size"] += 1
    mpath.write_text(json.dumps(m))
    with pytest.raises(StoreError, match=r"vocab\.txt: has \d+ tokens, manifest says"):
        open_store(store.path)
    (store.path / "minival" / "part-00000.parquet").unlink()
    mpath.write_text(original)
    with pytest.raises(StoreError, match=r"minival/part-00000\.parquet: shard listed in manifest\.json is missing"):
        open_store(store.path)


def test_shard_layout(reference: RefCorpus, tmp_path: Path):
    store = _ingest(reference, tmp_path / "store")
    pf = pq.ParquetFile(store.shard_paths("train")[0])
    assert pf.metadata.num_rows == 8 and pf.metadata.num_row_groups == 2
    feats = pf.read(columns=["features"]).column("features").combine_chunks().to_numpy_ndarray()
    assert feats.shape == (8, 36, FEAT_DIM) and feats.dtype == np.float16
