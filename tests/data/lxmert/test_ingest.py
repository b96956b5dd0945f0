"""LXMERT ingest: the reference's minival split, the hash split, a missing "labelf", a TSV cut mid-line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from refdata import ANSWERS, WORDS, RefCorpus

from xmodal.cli.ingest import main as ingest_main
from xmodal.data.errors import StoreError
from xmodal.data.lxmert.ingest import ingest_lxmert, minival_by_hash
from xmodal.data.lxmert.store import open_store
from xmodal.data.lxmert.tsv import IngestError
from xmodal_testing import REPO

MINIVAL = ["COCO_000001", "COCO_000004", "COCO_000009", "COCO_000014", "COCO_000020"]


def _ingest(ref: RefCorpus, out: Path, json_files: list[Path] | None = None, **kw):
    kw.setdefault("progress", False)
    kw.setdefault("images_per_shard", 8)
    kw.setdefault("row_group_images", 4)
    return ingest_lxmert(out, ref.tsv, json_files or ref.json, **kw)


def _nothing_written(out: Path) -> None:
    assert not out.exists(), f"{out} was created by a failed ingest"
    assert not [p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}.")]


def _split_images(store) -> dict[str, set[str]]:
    return {s: set(store.read_split(s).img_id) for s in ("train", "minival")}


def _move_to_minival(ref: RefCorpus, path: Path) -> str:
    """Move the MINIVAL images' records into the minival file `path`, except the questions of one of
    them, which stay in vqa_train.json: they must go to minival with their image. Returns that image."""
    # odd images are in vqa_train.json; this one has questions (its last sentence has labels)
    keep = next(i for i in MINIVAL if int(i[-1]) % 2 and ref.labels[i][-1] is not None)
    moved = []
    for path_in in ref.json:
        stay = []
        for rec in json.loads(path_in.read_text()):
            if rec["img_id"] == keep:
                moved.append({"img_id": keep, "sentf": {"mscoco": rec["sentf"]["mscoco"]}, "labelf": {}})
                stay.append({"img_id": keep, "sentf": {"vqa": rec["sentf"]["vqa"]}, "labelf": rec["labelf"]})
            else:
                (moved if rec["img_id"] in MINIVAL else stay).append(rec)
        path_in.write_text(json.dumps(stay))
    path.write_text(json.dumps(moved))
    assert sorted(r["img_id"] for r in moved) == MINIVAL
    return keep


# ----------------------------------------------------------------------------- the reference split


def test_reference_minival_split_given_and_found_by_name(reference: RefCorpus, tmp_path: Path, capsys):
    named = reference.json[0].parent / "mscoco_minival.json"
    _move_to_minival(reference, named)
    total = sum(len(s) for s in reference.sentences.values())

    # Given with --minival (under another name: the file name does not matter then).
    given = tmp_path / "my_minival.json"
    given.write_text(named.read_text())
    store = _ingest(reference, tmp_path / "given", minival=[given])
    assert "note" not in capsys.readouterr().out
    images = _split_images(store)
    assert images == {"minival": set(MINIVAL), "train": set(reference.images) - set(MINIVAL)}
    m = store.manifest
    assert (m.images("minival"), m.images("train")) == (5, 19)
    # Every sentence of a minival image goes with it, from any file (the questions left in vqa_train.json too).
    assert m.sentences("minival") == sum(len(reference.sentences[i]) for i in MINIVAL)
    assert m.sentences("train") + m.sentences("minival") == total
    assert m.minival_split is not None and m.minival_split.model_dump() == {
        "method": "reference", "files": [str(given)], "chosen_by_name": False, "fraction": None}
    assert str(given) in m.inputs and m.options["split"] == "reference"

    # Found among --json by the reference's file name, on the command line: a note says so.
    out = tmp_path / "named"
    argv = ["lxmert", str(out), "--no-progress", "--images-per-shard", "8"]
    for p in reference.tsv:
        argv += ["--tsv", str(p)]
    for p in [*reference.json, named]:
        argv += ["--json", str(p)]
    assert ingest_main(argv) == 0
    printed = capsys.readouterr().out
    assert f"note: minival = the images of {named} (the reference's split" in printed
    assert f"minival: the reference split, 5 images of {named}" in printed
    by_name = open_store(out)
    assert _split_images(by_name) == images
    assert by_name.manifest.minival_split.chosen_by_name and by_name.manifest.minival_split.files == [str(named)]

    # A file given both as --json and --minival is read once (no sentence twice).
    both = _ingest(reference, tmp_path / "both", [*reference.json, named], minival=[named])
    assert both.manifest.sentences("minival") == m.sentences("minival")
    assert both.manifest.sentences("train") + both.manifest.sentences("minival") == total


def test_hash_split_still_works_and_contradictions_fail(reference: RefCorpus, tmp_path: Path, capsys):
    named = reference.json[0].parent / "mscoco_minival.json"
    keep = _move_to_minival(reference, named)
    files = [*reference.json, named]
    # --split hash keeps the hash split even with the reference's minival file among --json.
    store = _ingest(reference, tmp_path / "hash", files, split="hash", minival_fraction=0.25)
    want = {i for i in reference.images if minival_by_hash(i, 0.25)}
    assert 0 < len(want) < len(reference.images)
    assert _split_images(store) == {"minival": want, "train": set(reference.images) - want}
    assert store.manifest.minival_split.model_dump() == {
        "method": "hash", "files": [], "chosen_by_name": False, "fraction": 0.25}
    # No minival file at all: the hash split at 0.1, and a note that says how to get the reference's.
    plain = _ingest(reference, tmp_path / "plain", reference.json)
    assert "--minival mscoco_minival.json" in capsys.readouterr().out
    assert plain.manifest.minival_split.method == "hash" and plain.manifest.minival_split.fraction == 0.1
    with_sentences = set(reference.images) - set(MINIVAL) | {keep}
    assert set(plain.read_split("minival").img_id) == {i for i in with_sentences if minival_by_hash(i, 0.1)}
    assert plain.manifest.images("train") + plain.manifest.images("minival") == len(with_sentences)

    for kw, fragments in [
        ({"split": "hash", "minival": [named]}, ["--minival", str(named), "--split hash"]),
        ({"minival_fraction": 0.2}, ["--minival-fraction 0.2", "only for --split hash", str(named)]),
        ({"split": "reference", "json_files": reference.json}, ["--split reference", "--minival FILE"]),
        ({"split": "hash", "minival_fraction": 1.0}, ["--minival-fraction 1.0", "[0, 1)"]),
    ]:
        with pytest.raises(IngestError) as e:
            _ingest(reference, tmp_path / "bad", kw.pop("json_files", files), **kw)
        for f in fragments:
            assert f in str(e.value), (f, str(e.value))
        _nothing_written(tmp_path / "bad")

    # A minival file none of whose images has features would give an empty minival.
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps([{"img_id": "VG_1", "sentf": {"vg": ["a cat."]}, "labelf": {}}]))
    with pytest.raises(IngestError, match=f"none of the 1 images of the minival file.*{elsewhere}"):
        _ingest(reference, tmp_path / "bad", files, minival=[elsewhere], allow_missing_images=True)
    _nothing_written(tmp_path / "bad")


# ----------------------------------------------------------------------------- labelf


def test_missing_labelf_is_an_error_unless_allowed_and_counted(reference: RefCorpus, tmp_path: Path, capsys):
    recs = json.loads(reference.json[1].read_text())
    i = next(k for k, r in enumerate(recs) if r["sentf"]["vqa"])  # a record with questions
    img_id = recs[i]["img_id"]
    del recs[i]["labelf"]
    recs[i + 3]["labelf"] = None
    reference.json[1].write_text(json.dumps(recs))
    with pytest.raises(IngestError) as e:
        _ingest(reference, tmp_path / "store", minival_fraction=0.25)
    msg = str(e.value)
    for f in (str(reference.json[1]), f"record #{i}", repr(img_id), "field 'labelf' is missing",
              "expected {source: [{answer: score}, ...]}", "2 record(s) of this file", "--allow-missing-labelf"):
        assert f in msg, (f, msg)
    _nothing_written(tmp_path / "store")

    # Allowed: the records count as having no questions, and the manifest and the CLI count them.
    store = _ingest(reference, tmp_path / "store", minival_fraction=0.25, allow_missing_labelf=True)
    assert store.manifest.missing_labelf == 2 and store.manifest.options["allow_missing_labelf"] is True
    split = "minival" if minival_by_hash(img_id, 0.25) else "train"
    block = store.read_split(split)
    k = list(block.img_id).index(img_id)
    s0, s1 = block.sent_offsets[k], block.sent_offsets[k + 1]
    assert s1 - s0 == len(reference.sentences[img_id])
    assert block.ans_offsets[s1] == block.ans_offsets[s0]  # its questions have no QA target
    out = tmp_path / "cli"
    argv = ["lxmert", str(out), "--no-progress", "--allow-missing-labelf"]
    for p in reference.tsv:
        argv += ["--tsv", str(p)]
    for p in reference.json:
        argv += ["--json", str(p)]
    assert ingest_main(argv) == 0
    assert "records without labelf 2" in capsys.readouterr().out


# ----------------------------------------------------------------------------- TSV cut mid-line


@pytest.mark.parametrize("keep", ["fields", "features", "features_groups", "features_boxes"])
def test_tsv_cut_mid_line_is_named_at_its_line(reference: RefCorpus, tmp_path: Path, keep: str):
    """The file ends inside line 5; the images of lines 6.. are missing, but the cut line is what is named."""
    path = reference.tsv[0]
    lines = path.read_bytes().splitlines(keepends=True)
    line = lines[4]
    features_at = line.rindex(b"\t") + 1
    cut = {"fields": line.index(b"\t", line.index(b"\t") + 1) + 3,  # inside img_w
           "features": features_at + 1001,  # not whole base64 groups
           "features_groups": features_at + 1000,  # whole groups (750 bytes), not whole boxes (36 x 4 bytes)
           "features_boxes": features_at + 192 * 5}[keep]  # whole boxes of 5 floats: the width is wrong
    path.write_bytes(b"".join(lines[:4]) + line[:cut])
    with pytest.raises((IngestError, StoreError)) as e:
        _ingest(reference, tmp_path / "store", minival_fraction=0.25)
    msg = str(e.value)
    assert msg.startswith(f"{path}:5"), msg
    assert "cut off" in msg and "no features" not in msg, msg
    if keep == "features_boxes":
        assert "width 5 per box" in msg and f"expected 32 (the width of the first image, at {path}:1)" in msg
    _nothing_written(tmp_path / "store")


def test_manifest_without_the_new_fields_still_opens(reference: RefCorpus, tmp_path: Path):
    store = _ingest(reference, tmp_path / "store", minival_fraction=0.25)
    mpath = store.path / "manifest.json"
    raw = json.loads(mpath.read_text())
    del raw["minival_split"], raw["missing_labelf"]
    mpath.write_text(json.dumps(raw))
    old = open_store(store.path).manifest
    assert old.minival_split is None and old.missing_labelf == 0 and old.older_format is None
    # A store written before these fields has the fingerprint it had (fine-tuning sets over it stay valid).
    assert "minival_split" not in old.identity() and "missing_labelf" not in old.identity()
    assert store.manifest.identity()["minival_split"]["method"] == "hash"


def test_the_readme_command_on_files_named_as_the_reference(reference: RefCorpus, tmp_path: Path, capsys):
    """docs/data.md's `jobs/ingest.py lxmert` example, run as written on small files with the reference's names."""
    readme = (REPO / "docs" / "data.md").read_text()
    command = re.search(r"^python jobs/ingest\.py (lxmert data/lxmert_store(?:[^\n]*\\\n)*[^\n]*)$", readme, re.M)
    assert command is not None, "docs/data.md no longer shows the reference ingest command"
    argv = command.group(1).replace("\\\n", " ").split()
    assert "--minival" in argv and "mscoco_minival.json" in argv

    d = tmp_path / "reference"
    d.mkdir()
    ids = sorted(reference.images)
    where = {"train2014_obj36.tsv": ids[:12], "val2014_obj36.tsv": ids[12:18], "vg_gqa_obj36.tsv": ids[18:]}
    for name, part in where.items():
        (d / name).write_text("".join(reference.images[i].line() for i in part))
    records = {r["img_id"]: r for p in reference.json for r in json.loads(p.read_text())}
    sentences = {"mscoco_train.json": ids[:12], "mscoco_nominival.json": ids[12:15],
                 "mscoco_minival.json": ids[15:18], "vgnococo.json": ids[18:]}
    for name, part in sentences.items():
        (d / name).write_text(json.dumps([records[i] for i in part]))
    (d / "all_ans.json").write_text(json.dumps([{"ans": a, "dsets": ["vqa"]} for a in ANSWERS]))
    (d / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", "?", "is", *WORDS]))
    out = tmp_path / "store"
    argv = [str(out) if a == "data/lxmert_store" else str(d / a) if (d / a).is_file() else a for a in argv]
    assert ingest_main([*argv, "--no-progress"]) == 0, capsys.readouterr().err
    store = open_store(out)
    assert _split_images(store) == {"minival": set(ids[15:18]), "train": set(ids) - set(ids[15:18])}
    assert store.manifest.minival_split.files == [str(d / "mscoco_minival.json")]
    assert store.answers().answers == ANSWERS


# ----------------------------------------------------------------------------- vocabulary, files, train split


def test_vocab_size_is_the_most_a_trained_vocabulary_holds(reference: RefCorpus, tmp_path: Path, capsys):
    """The trainer keeps the special tokens and every character whatever the size asked: below that minimum
    the store's vocabulary was silently larger; now refused, naming the minimum, which then works."""
    with pytest.raises(IngestError, match=r"--vocab-size 5: below the smallest vocabulary .* expected >= (\d+)") as e:
        _ingest(reference, tmp_path / "bad", vocab_size=5)
    _nothing_written(tmp_path / "bad")
    least = int(re.search(r"expected >= (\d+)", str(e.value)).group(1))
    assert _ingest(reference, tmp_path / "least", vocab_size=least).manifest.vocab_size == least
    with pytest.raises(IngestError, match=r"--vocab-size 50: sizes a trained vocabulary, but --vocab"):
        _ingest(reference, tmp_path / "bad", vocab=tmp_path / "vocab.txt", vocab_size=50)
    # A small corpus needs fewer tokens than the default's 30522: the summary says why it has fewer.
    out = tmp_path / "cli"
    argv = ["lxmert", str(out), *(a for p in reference.tsv for a in ("--tsv", str(p))),
            *(a for p in reference.json for a in ("--json", str(p))), "--no-progress"]
    assert ingest_main(argv) == 0
    size = open_store(out).manifest.vocab_size
    assert f"vocab {size} (every word piece of the sentences; --vocab-size 30522 is the most)" in capsys.readouterr().out


def test_a_file_given_twice_or_no_train_image_is_refused(reference: RefCorpus, tmp_path: Path):
    for kw, said in [({"json_files": [*reference.json, reference.json[0]]}, "--json"),
                     ({"minival": [reference.json[0], reference.json[0].parent / "." / reference.json[0].name]},
                      "--minival")]:
        with pytest.raises(IngestError, match=rf"{said} .*: (the same file )?given twice"):
            _ingest(reference, tmp_path / "bad", kw.pop("json_files", None), **kw)
        _nothing_written(tmp_path / "bad")
    # Every image in minival: the reference split by a minival file holding every sentence file's images.
    with pytest.raises(IngestError, match=r"every one of the \d+ images .* no training image would be left"):
        _ingest(reference, tmp_path / "bad", minival=reference.json)
    _nothing_written(tmp_path / "bad")
