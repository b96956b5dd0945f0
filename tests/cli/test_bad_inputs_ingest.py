"""Bad input to jobs/ingest.py: its sources' options, files that are not what they claim, stores whose
columns hold the wrong types, and outputs it must not write over; each refused with one `error:` line,
nothing written, the user's files untouched (bad_input_harness)."""

from __future__ import annotations

import base64
import io
import json
import pickle
import tempfile
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from bad_input_harness import Bad, lxmert_store, run_bad

from xmodal.base.outputs import RECORD


def _b64(values, dtype: str) -> str:
    return base64.b64encode(np.asarray(values, dtype=dtype).tobytes()).decode()


def tsv_line(img_id: str, feats: list[float], boxes: int = 2) -> str:
    """One reference feature TSV line: `boxes` boxes of len(feats) // boxes features each."""
    return "\t".join([img_id, "20", "20", _b64([1] * boxes, "int64"), _b64([0.5] * boxes, "float32"),
                      _b64([1] * boxes, "int64"), _b64([0.5] * boxes, "float32"), str(boxes),
                      _b64([0, 0, 10, 10] * boxes, "float32"), _b64(feats, "float32")])


TSV = tsv_line("COCO_1", [1.0] * 8) + "\n" + tsv_line("COCO_2", [2.0] * 8) + "\n"
SENTENCES = json.dumps([{"img_id": "COCO_1", "sentf": {"mscoco": ["a cat on a mat"]}, "labelf": {}}])


def _real_feature_store() -> dict[str, bytes]:
    """The files of a feature-only store of the two images of TSV, as `ingest.py features` writes it."""
    from xmodal.data.lxmert.feature_writer import ingest_features

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "f.tsv").write_text(TSV)
        ingest_features(Path(tmp) / "st", [Path(tmp) / "f.tsv"], progress=False)
        root = Path(tmp) / "st"
        return {p.relative_to(root).as_posix(): p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _lxmert_store() -> dict[str, bytes]:
    """The files of a small synthetic LXMERT store under `lx/` (it has the tokenizer a set needs)."""
    with tempfile.TemporaryDirectory() as tmp:
        root = lxmert_store(Path(tmp))
        return {f"lx/{p.relative_to(root).as_posix()}": p.read_bytes() for p in root.rglob("*") if p.is_file()}


STORE = _real_feature_store()
LXMERT = _lxmert_store()
(SHARD,) = [k for k in STORE if k.startswith("images/") and k.endswith(".parquet")]  # named by its content


def feature_store(**columns) -> dict[str, str | bytes]:
    """The files of that store under `st/`, its shard's columns replaced or added by `columns` (name ->
    arrow array): a store another tool wrote."""
    table = pq.read_table(io.BytesIO(STORE[SHARD]))
    for name, values in columns.items():
        i = table.schema.get_field_index(name)
        table = table.set_column(i, name, values) if i >= 0 else table.append_column(name, values)
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return {**{f"st/{k}": v for k, v in STORE.items()}, f"st/{SHARD}": buf.getvalue()}


def mult_pickle(data) -> bytes:
    return pickle.dumps(data, protocol=4)


INGEST = [
    Bad("lxmert-store-source-numbers", ["lxmert", "out", "--tsv", "st", "--json", "s.json", "--no-progress"],
        [f"st: {SHARD.removeprefix('images/')}: column 'source' holds int64; expected text"],
        files={**feature_store(source=pa.array([5, 6], pa.int64())), "s.json": SENTENCES}),
    Bad("features-store-source-numbers", ["features", "out", "--tsv", "st", "--no-progress"],
        ["column 'source' holds int64"], files=feature_store(source=pa.array([5, 6], pa.int64()))),
    Bad("features-store-ids-numbers", ["features", "out", "--tsv", "st", "--no-progress"],
        ["column 'img_id' holds int64", "each image's id"], files=feature_store(img_id=pa.array([1, 2], pa.int64()))),
    Bad("synthetic-zero-images", ["synthetic", "out", "--num-images", "0"], ["num_images", "0"]),
    Bad("synthetic-negative-noise", ["synthetic", "out", "--feature-noise", "-1"], ["feature_noise", "-1"]),
    Bad("synthetic-question-fraction-above-one", ["synthetic", "out", "--question-fraction", "1.5"],
        ["question_fraction", "1.5"]),
    Bad("mult-synthetic-text-length-reversed", ["mult-synthetic", "out", "--text-len", "5", "3"], ["text_len", "5"]),
    Bad("mult-synthetic-zero-audio-rate", ["mult-synthetic", "out", "--audio-rate", "0"], ["audio_rate", "0"]),
    Bad("mult-synthetic-zero-text-dim", ["mult-synthetic", "out", "--text-dim", "0"], ["text_dim", "0"]),
    Bad("mult-pickle-a-list", ["mult", "out", "--pickle", "p.pkl", "--format", "reference"], ["p.pkl"],
        files={"p.pkl": mult_pickle([1, 2, 3])}),
    Bad("mult-pickle-without-valid", ["mult", "out", "--pickle", "p.pkl", "--format", "mmsa"], ["p.pkl", "valid"],
        files={"p.pkl": mult_pickle({"train": {}, "test": {}})}),
    Bad("vqa-json-not-json", ["vqa", "out", "--store", "lx", "--train", "t.json"], ["t.json", "JSON"],
        files={**LXMERT, "t.json": "question,answer\n"}),
    Bad("vqa-json-a-mapping", ["vqa", "out", "--store", "lx", "--train", "t.json"], ["t.json"],
        files={**LXMERT, "t.json": "{}"}),
    Bad("vqa-features-store-alone", ["vqa", "out", "--store", "st", "--train", "t.json"],
        ["none of the stores", "is an LXMERT store", "tokenizer"], files={**feature_store(), "t.json": "[]"}),
    Bad("vqa-store-not-a-store", ["vqa", "out", "--store", "imgs", "--train", "t.json"], ["imgs", "manifest.json"],
        files={"imgs": None, "t.json": "[]"}),
    Bad("nlvr2-record-without-label", ["nlvr2", "out", "--store", "lx", "--train", "t.json"], ["t.json", "label"],
        files={**LXMERT, "t.json": json.dumps([{"identifier": "a-0", "img0": "COCO_1", "img1": "COCO_2",
                                                 "sent": "two cats"}])}),
    Bad("synthetic-nlvr2-zero-pairs", ["synthetic-nlvr2", "out", "--store", "st", "--pairs-per-statement", "0"],
        ["pairs", "0"], files=feature_store()),
    Bad("features-zero-objects", ["features", "out", "--tsv", "f.tsv", "--num-objects", "0"], ["--num-objects", "0"],
        files={"f.tsv": TSV}),
    Bad("features-width-not-the-files", ["features", "out", "--tsv", "f.tsv", "--feat-dim", "3", "--no-progress"],
        ["f.tsv", "3"], files={"f.tsv": TSV}),
    Bad("features-zero-images-per-shard", ["features", "out", "--tsv", "f.tsv", "--images-per-shard", "0"],
        ["--images-per-shard", "0"], files={"f.tsv": TSV}),
    Bad("features-onto-a-store-without-overwrite", ["features", "st", "--tsv", "f.tsv"], ["st", "--overwrite"],
        files={**feature_store(), "f.tsv": TSV}),
    Bad("features-overwrite-a-store-holding-the-users-file", ["features", "st", "--tsv", "f.tsv", "--overwrite"],
        ["st: holds 'notes.txt', which is not part of the store", "move it out first"],
        files={**feature_store(), "st/notes.txt": "mine", "f.tsv": TSV,
               f"st/{RECORD}": json.dumps({"command": "store features", "files": [SHARD, "manifest.json"]})}),
    Bad("features-out-is-a-file", ["features", "out", "--tsv", "f.tsv"], ["out", "already exists and is not a store"],
        files={"out": "x", "f.tsv": TSV}),
    Bad("lxmert-vocab-missing", ["lxmert", "out", "--tsv", "f.tsv", "--json", "s.json", "--vocab", "vocab.txt"],
        ["vocab.txt"], files={"f.tsv": TSV, "s.json": SENTENCES}),
    Bad("lxmert-minival-fraction-above-one", ["lxmert", "out", "--tsv", "f.tsv", "--json", "s.json", "--split",
                                              "hash", "--minival-fraction", "1.5"],
        ["--minival-fraction", "1.5"], files={"f.tsv": TSV, "s.json": SENTENCES}),
    Bad("lxmert-reference-split-without-minival", ["lxmert", "out", "--tsv", "f.tsv", "--json", "s.json", "--split",
                                                   "reference"], ["--split reference", "--minival"],
        files={"f.tsv": TSV, "s.json": SENTENCES}),
    Bad("features-field-not-base64", ["features", "out", "--tsv", "f.tsv", "--no-progress"], ["f.tsv:1"],
        files={"f.tsv": TSV.replace(_b64([0.5] * 2, "float32"), "not*base64", 1)}),
    Bad("mult-unknown-dataset", ["mult", "out", "--pickle", "p.pkl", "--format", "mmsa", "--dataset", "imdb"],
        ["--dataset", "'imdb'"], files={"p.pkl": mult_pickle({})}),
    Bad("no-source", [], ["required"]),
    # A negative seed: one check and message for every seed flag (numpy's generators raised ValueError).
    Bad("mult-synthetic-negative-seed", ["mult-synthetic", "out", "--seed", "-1"],
        ["seed = -1", "expected an integer in [0, 2**32)"]),
    Bad("synthetic-negative-seed", ["synthetic", "out", "--seed", "-1", "--no-progress"],
        ["--seed -1", "expected an integer in [0, "]),
    *(Bad(f"{source}-negative-seed", [source, "out", "--store", "lx", "--seed", "-1"],
          ["--seed -1", "expected an integer in [0, 2**63)"], files=LXMERT)
      for source in ("synthetic-vqa", "synthetic-gqa", "synthetic-nlvr2")),
    Bad("lxmert-negative-order-seed", ["lxmert", "out", "--tsv", "f.tsv", "--json", "s.json", "--order-seed", "-1"],
        ["--order-seed -1", "expected an integer in [0, 2**63)"], files={"f.tsv": TSV, "s.json": SENTENCES}),
    # Numbers that are no number: NaN slips past `x <= 0`, and round() of it or of inf raised.
    *(Bad(f"synthetic-nlvr2-{value}-statements", ["synthetic-nlvr2", "out", "--store", "lx", "--statements-per-image",
                                                   value], [f"--statements-per-image {value}", "finite"], files=LXMERT)
      for value in ("nan", "inf")),
    Bad("synthetic-vqa-nan-near-answer", ["synthetic-vqa", "out", "--store", "lx", "--near-answer-prob", "nan"],
        ["--near-answer-prob nan", "[0, 1]"], files=LXMERT),
    Bad("synthetic-inf-question-fraction", ["synthetic", "out", "--question-fraction", "inf"],
        ["--question-fraction inf", "[0, 1]"]),
    Bad("lxmert-nan-minival-fraction", ["lxmert", "out", "--tsv", "f.tsv", "--json", "s.json", "--split", "hash",
                                        "--minival-fraction", "nan"],
        ["--minival-fraction nan", "[0, 1)"], files={"f.tsv": TSV, "s.json": SENTENCES}),
    # A store without a train image was written, exit 0, and refused only by what read it later.
    Bad("synthetic-minival-fraction-leaves-no-train", ["synthetic", "out", "--num-images", "20", "--minival-fraction",
                                                       "0.99", "--no-progress"],
        ["--minival-fraction 0.99", "no training image", "--num-images 20", "at least one train image"]),
    Bad("lxmert-minival-file-holds-every-image", ["lxmert", "out", "--tsv", "f.tsv", "--json", "s.json", "--minival",
                                                  "s.json", "--no-progress"],
        ["s.json", "every one of the 1 images", "no training image", "at least one train image"],
        files={"f.tsv": TSV, "s.json": SENTENCES}),
    Bad("lxmert-minival-fraction-leaves-no-train", ["lxmert", "out", "--tsv", "f.tsv", "--json", "s.json", "--split",
                                                    "hash", "--minival-fraction", "0.999", "--no-progress"],
        ["--minival-fraction 0.999", "no training image", "at least one train image"],
        files={"f.tsv": TSV, "s.json": SENTENCES}),
    # Only the options that are wrong are named, by their flags.
    Bad("synthetic-zero-images-per-shard", ["synthetic", "out", "--images-per-shard", "0"],
        ["--images-per-shard 0", "expected an integer >= 1"], not_said=["feature_noise", "--feature-noise"]),
    Bad("synthetic-vqa-near-answer-above-one", ["synthetic-vqa", "out", "--store", "lx", "--near-answer-prob", "2"],
        ["--near-answer-prob 2.0", "expected a number in [0, 1]"], files=LXMERT,
        not_said=["questions_per_image", "--questions-per-image"]),
    Bad("synthetic-nlvr2-one-pair", ["synthetic-nlvr2", "out", "--store", "lx", "--pairs-per-statement", "1"],
        ["--pairs-per-statement 1", "expected an integer >= 2"], files=LXMERT,
        not_said=["statements_per_image", "--statements-per-image"]),
    Bad("synthetic-nlvr2-odd-pairs", ["synthetic-nlvr2", "out", "--store", "lx", "--pairs-per-statement", "3"],
        ["--pairs-per-statement 3", "even"], files=LXMERT),
    # A --store that is a regular file was called a store that does not exist.
    Bad("synthetic-vqa-store-a-file", ["synthetic-vqa", "out", "--store", "afile"],
        ["--store afile", "is a file, not a store folder"], files={"afile": "x"}, not_said=["does not exist"]),
    Bad("vqa-store-a-file", ["vqa", "out", "--store", "afile", "--train", "t.json"],
        ["--store afile", "is a file, not a store folder"], files={"afile": "x", "t.json": "[]"},
        not_said=["manifest.json"]),
    # A file given twice: the features ingest called its second copy's lines duplicate images, the LXMERT
    # ingest read it once without a word.
    Bad("features-tsv-given-twice", ["features", "out", "--tsv", "f.tsv", "--tsv", "./f.tsv", "--no-progress"],
        ["--tsv f.tsv and --tsv ./f.tsv", "given twice"], files={"f.tsv": TSV}, not_said=["already has features"]),
    Bad("lxmert-json-given-twice", ["lxmert", "out", "--tsv", "f.tsv", "--json", "s.json", "--json", "s.json",
                                    "--no-progress"],
        ["--json s.json: given twice"], files={"f.tsv": TSV, "s.json": SENTENCES}),
    Bad("lxmert-tsv-given-twice", ["lxmert", "out", "--tsv", "f.tsv", "--tsv", "f.tsv", "--json", "s.json",
                                   "--no-progress"],
        ["--tsv f.tsv: given twice"], files={"f.tsv": TSV, "s.json": SENTENCES}),
    # --vocab-size is the most tokens of a trained vocabulary: below what the sentences need, the store's was
    # silently larger; with --vocab it was silently ignored.
    Bad("lxmert-vocab-size-below-the-minimum", ["lxmert", "out", "--tsv", "f.tsv", "--json", "s.json",
                                                "--vocab-size", "5", "--no-progress"],
        ["--vocab-size 5", "below the smallest vocabulary", "special tokens", "expected >= "],
        files={"f.tsv": TSV, "s.json": SENTENCES}),
    Bad("lxmert-vocab-size-with-a-vocab-file", ["lxmert", "out", "--tsv", "f.tsv", "--json", "s.json", "--vocab",
                                                "vocab.txt", "--vocab-size", "50", "--no-progress"],
        ["--vocab-size 50", "--vocab vocab.txt"], files={"f.tsv": TSV, "s.json": SENTENCES, "vocab.txt": "[PAD]\n"}),
    # One file twice in a split: refused by name, not later as repeated ids.
    *(Bad(f"{task}-file-twice-in-a-split", [task, "out", "--store", "lx", "--train", "t.json,t.json"],
          ["--train t.json: given twice"], files={**LXMERT, "t.json": "[]"}, not_said=["repeats"])
      for task in ("vqa", "gqa", "nlvr2")),
    # a feature-only store is written to S3 directly (data/lxmert/feature_writer.py); a bucket it cannot reach
    # is named before any TSV is read
    Bad("features-out-an-unreachable-bucket", ["features", "s3://bucket/store", "--tsv", "f.tsv"],
        ["s3://bucket/store", "cannot be written", "credentials"], files={"f.tsv": TSV}),
]


@pytest.mark.parametrize("case", INGEST, ids=[c.id for c in INGEST])
def test_ingest(case, tmp_path, monkeypatch, capsys):
    run_bad("ingest.py", case, tmp_path, monkeypatch, capsys)


def test_the_table_holds_twenty_cases_or_more():
    assert len(INGEST) >= 20 and len({c.id for c in INGEST}) == len(INGEST)
