"""LXMERT fine-tuning data: the on-disk set, reference JSON ingest (and its bad inputs), the synthetic
learnable VQA / NLVR2 sets (oracle 100 %, text-only near chance) and the deterministic batches."""

from __future__ import annotations

import json
import pickle
import re
import shutil
from collections import Counter, defaultdict
from pathlib import Path

import numpy as np
import pytest
import torch

from xmodal.cli.ingest import main as ingest_main
from xmodal.core.batches import Nlvr2Batch, VqaBatch
from xmodal.data.errors import StoreError
from xmodal.data.finetune import sets as finetune
from xmodal.data.finetune.ingest import ingest_finetune
from xmodal.data.finetune.sets import epoch_order, iter_finetune_batches, open_finetune
from xmodal.data.finetune.split import FinetuneError
from xmodal.data.finetune.synthetic import (
    build_synthetic_nlvr2,
    build_synthetic_vqa,
    ensure_synthetic_finetune,
)
from xmodal.data.lxmert.store import LxmertStore
from xmodal.data.lxmert.synthetic import build_synthetic_store, class_names, colour_names
from xmodal.data.options import SyntheticLxmertOptions
from xmodal.objectives.finetune import nlvr2_statement

torch.set_num_threads(1)


# ============================================================================ helpers


@pytest.fixture(scope="module")
def store_images(small_store: LxmertStore) -> dict[str, dict[str, np.ndarray]]:
    """img_id -> features, boxes, obj_ids, attr_ids of every image of the small store."""
    out = {}
    for split in ("train", "minival"):
        b = small_store.read_split(split)
        for k, img in enumerate(b.img_id):
            out[str(img)] = {"features": b.features[k], "boxes": b.boxes[k], "obj_ids": b.obj_ids[k],
                             "attr_ids": b.attr_ids[k], "split": split}
    return out


def _write(path: Path, records: list) -> Path:
    path.write_text(json.dumps(records))
    return path


def _vqa_records(imgs: list[str], start: int = 0) -> list[dict]:
    answers = [{"Two": 1.0, "2": 0.3, "yes": 0.6}, {"The red.": 0.9, "blue": 0.3}, {"yes": 1}, {"no": 0.3}]
    return [{"question_id": 1000 + start + i, "img_id": img, "sent": f"what color is the cube {i} ?",
             "label": answers[i % len(answers)], "question_type": "what"} for i, img in enumerate(imgs)]


def _nlvr2_records(imgs: list[str], split: str = "train") -> list[dict]:
    return [{"identifier": f"{split}-{i}-0-0", "img0": imgs[i], "img1": imgs[i + 1], "sent": "there is a cube",
             "label": i % 2} for i in range(len(imgs) - 1)]


def _no_leftovers(parent: Path, name: str) -> None:
    assert not (parent / name).exists()
    assert not [p.name for p in parent.iterdir() if p.name.startswith(f".{name}.")]


# ============================================================================ reference ingest


def test_vqa_ingest_round_trip(tmp_path: Path, small_store: LxmertStore, store_images):
    imgs = sorted(store_images)
    train = _write(tmp_path / "train.json", _vqa_records(imgs[:8]))
    train2 = _write(tmp_path / "nominival.json", _vqa_records(imgs[8:12], start=100))
    valid = _write(tmp_path / "minival.json", _vqa_records(imgs[12:16], start=200))
    data = ingest_finetune("vqa", {"train": [train, train2], "valid": [valid]}, small_store.path, tmp_path / "vqa")
    assert data.task == "vqa" and data.splits == ("train", "valid") and data.store.path == small_store.path
    m = data.manifest
    assert m.splits == {"train": 12, "valid": 4} and m.store == str(small_store.path) and m.source == "reference"
    assert m.inputs["train"] == [str(train.resolve()), str(train2.resolve())]
    assert m.ignored == {"missing_images": 0, "unknown_answers": 0}
    # Table from the train answers, normalised ("Two" -> "2", "The red." -> "red"), most frequent first.
    assert data.answers.answers[:2] == ["yes", "2"] and set(data.answers.answers) == {"yes", "2", "red", "blue", "no"}
    assert data.ids("train")[:2] == ["1000", "1001"] and data.ids("valid")[0] == "1200"
    sp = data.split("train")
    want, _ = small_store.tokenizer().encode([f"what color is the cube {i} ?" for i in range(8)])
    np.testing.assert_array_equal(sp.input_ids[:8], want)
    assert list(sp.img_ids[:8]) == imgs[:8]
    targets = sp.targets(np.arange(4), len(data.answers))
    a = data.answers.index
    assert targets[0, a("2")] == 1.0 and targets[0, a("yes")] == pytest.approx(0.6)  # "Two" and "2" merged: max
    assert targets[1, a("red")] == pytest.approx(0.9) and targets[1].sum() == pytest.approx(1.2)
    reopened = open_finetune(tmp_path / "vqa")
    assert reopened.ids("valid") == data.ids("valid") and reopened.num_answers == 5


def test_answer_table_from_reference_file_and_unknown_answers(tmp_path: Path, small_store, store_images):
    imgs = sorted(store_images)
    records = [{"question_id": "q0", "img_id": imgs[0], "sent": "a ?", "label": {"yes": 1, "maybe": 0.3}},
               {"question_id": "q1", "img_id": imgs[1], "sent": "b ?", "label": {"perhaps": 1}},
               {"question_id": "q2", "img_id": imgs[2], "sent": "c ?", "label": {}}]
    train = _write(tmp_path / "train.json", records)
    label2ans = _write(tmp_path / "trainval_label2ans.json", ["no", "yes", "2"])
    data = ingest_finetune("vqa", {"train": [train]}, small_store.path, tmp_path / "vqa", answers=label2ans)
    assert data.answers.answers == ["no", "yes", "2"]
    assert data.manifest.ignored == {"missing_images": 0, "unknown_answers": 2}
    assert data.manifest.stats["unanswerable_questions"] == 2  # q1 lost its only answer, q2 had none
    sp = data.split("train")
    assert len(sp) == 3  # the questions stay, with what is left of their labels
    np.testing.assert_array_equal(sp.targets(np.arange(3), 3), [[0, 1, 0], [0, 0, 0], [0, 0, 0]])


def test_missing_images_fail_or_are_counted_unless_all_are(tmp_path: Path, small_store, store_images):
    imgs = sorted(store_images)
    recs = _vqa_records(imgs[:4] + [f"COCO_missing_{i}" for i in range(7)])
    train = _write(tmp_path / "t.json", recs)
    # By default an image in no store is an error naming the file, the record, the img_id and the stores.
    with pytest.raises(FinetuneError, match=rf"t\.json: record #4 \(id '1004'\): img_id 'COCO_missing_0' is in none "
                                            rf"of the image stores searched \({re.escape(str(small_store.path))}\); "
                                            r"7 record\(s\) .*--allow-missing-images"):
        ingest_finetune("gqa", {"train": [train]}, small_store.path, tmp_path / "g")
    _no_leftovers(tmp_path, "g")
    data = ingest_finetune("gqa", {"train": [train]}, small_store.path, tmp_path / "g", allow_missing_images=True)
    m = data.manifest
    assert m.splits == {"train": 4} and m.ignored["missing_images"] == 7
    assert len(m.missing_image_examples) == 5
    assert m.missing_image_examples[0] == {"split": "train", "id": "1004", "img_id": "COCO_missing_0"}
    bad = _write(tmp_path / "valid.json", _vqa_records(["COCO_missing_a", "COCO_missing_b"]))
    with pytest.raises(FinetuneError, match=r"valid\.json: none of its 2 records .*'COCO_missing_a'"):
        ingest_finetune("gqa", {"train": [tmp_path / "t.json"], "valid": [bad]}, small_store.path, tmp_path / "g2",
                        allow_missing_images=True)
    _no_leftovers(tmp_path, "g2")


def _mutate(rec: dict, key: str, value) -> dict:
    rec = dict(rec)
    if value is KeyError:
        del rec[key]
    else:
        rec[key] = value
    return rec


@pytest.mark.parametrize("task, key, value, expected", [
    ("vqa", "img_id", KeyError, r"key 'img_id' is missing, expected a non-empty string"),
    ("vqa", "sent", 5, r"key 'sent' is 5 \(integer\), expected a string"),
    ("vqa", "question_id", 1.5, r"key 'question_id' is 1.5 \(number\), expected a non-empty string or an integer"),
    ("vqa", "label", ["yes"], r"key 'label' is \['yes'\] \(array\), expected an object"),
    ("vqa", "label", {"yes": "x"}, r"key 'label', answer 'yes': score is 'x' \(string\), expected a number in \[0, 1\]"),
    ("gqa", "label", {"yes": 1.5}, r"score is 1.5 \(number\), expected a number in \[0, 1\]"),
    ("vqa", "label", KeyError, r"key 'label' is missing"),
    ("nlvr2", "label", 2, r"key 'label' is 2 \(integer\), expected 0 or 1"),
    ("nlvr2", "label", True, r"key 'label' is True \(boolean\), expected 0 or 1"),
    ("nlvr2", "img1", None, r"key 'img1' is None \(null\), expected a non-empty string"),
])
def test_malformed_record_is_a_clear_error_and_writes_nothing(tmp_path, small_store, store_images, task, key, value,
                                                              expected):
    imgs = sorted(store_images)[:4]
    recs = _nlvr2_records(imgs) if task == "nlvr2" else _vqa_records(imgs)
    recs[1] = _mutate(recs[1], key, value)
    path = _write(tmp_path / "train.json", recs)
    with pytest.raises(FinetuneError, match=r"train\.json: record #1.*" + expected):
        ingest_finetune(task, {"train": [path]}, small_store.path, tmp_path / "out")
    _no_leftovers(tmp_path, "out")


def test_file_level_errors(tmp_path, small_store, store_images):
    imgs = sorted(store_images)[:3]
    cases = {"not_list.json": ({"a": 1}, r"expected a JSON list"), "empty.json": ([], r"holds no record"),
             "not_object.json": ([["x"]], r"record #0: is \['x'\] \(array\), expected a JSON object")}
    for name, (content, pattern) in cases.items():
        with pytest.raises(FinetuneError, match=re.escape(name) + ".*" + pattern):
            ingest_finetune("vqa", {"train": [_write(tmp_path / name, content)]}, small_store.path, tmp_path / "o")
    a = _write(tmp_path / "a.json", _vqa_records(imgs))
    b = _write(tmp_path / "b.json", _vqa_records(imgs[:1]))
    with pytest.raises(FinetuneError, match=r"b\.json: record #0: id '1000' repeats .*a\.json record #0"):
        ingest_finetune("vqa", {"train": [a, b]}, small_store.path, tmp_path / "o")
    with pytest.raises(FinetuneError, match=r"no answer table"):
        ingest_finetune("vqa", {"valid": [a]}, small_store.path, tmp_path / "o")
    with pytest.raises(FinetuneError, match=r"task 'okvqa'"):
        ingest_finetune("okvqa", {"train": [a]}, small_store.path, tmp_path / "o")
    with pytest.raises(FinetuneError, match=r"--train .*a\.json: given twice"):
        ingest_finetune("vqa", {"train": [a, b, a]}, small_store.path, tmp_path / "o")
    _no_leftovers(tmp_path, "o")


@pytest.mark.parametrize("task", ["vqa", "gqa", "nlvr2"])
def test_one_file_as_two_splits_is_said(tmp_path, small_store, store_images, task, capsys):
    """A valid split of the training questions scores the fit, not a validation: said, by both options and
    the file (not refused: an overfitting check is a use; tests/data/finetune/test_finetune_stores.py)."""
    imgs = sorted(store_images)[:4]
    t = _write(tmp_path / "t.json", _nlvr2_records(imgs) if task == "nlvr2" else _vqa_records(imgs))
    capsys.readouterr()
    data = ingest_finetune(task, {"train": [t], "valid": [tmp_path / "." / "t.json"]}, small_store.path,
                           tmp_path / "o")
    out = capsys.readouterr().out
    assert f"note: --train {t} and --valid {tmp_path / '.' / 't.json'} are the same file ({t})" in out, out
    assert "split 'valid' holds the train questions" in out
    assert data.manifest.splits["valid"] == data.manifest.splits["train"]


def test_synthetic_options_name_only_the_bad_ones(tmp_path, small_store):
    for kw, said, not_said in [
        ({"seed": -1}, "--seed -1: expected an integer in [0, 2**63)", "--questions"),
        ({"near_answer_prob": 2.0}, "--near-answer-prob 2.0: expected a number in [0, 1]", "questions"),
        ({"near_answer_prob": float("nan")}, "--near-answer-prob nan", "questions"),
        ({"questions_per_image": 0}, "--questions-per-image 0: expected an integer >= 1", "near"),
    ]:
        with pytest.raises(FinetuneError) as e:
            build_synthetic_vqa(small_store.path, tmp_path / "v", **kw)
        assert said in str(e.value) and not_said not in str(e.value), str(e.value)
    for kw, said, not_said in [
        ({"statements_per_image": float("nan")}, "--statements-per-image nan: expected a finite number > 0", "pairs"),
        ({"statements_per_image": float("inf")}, "--statements-per-image inf", "pairs"),
        ({"pairs_per_statement": 1}, "--pairs-per-statement 1: expected an integer >= 2", "statements"),
        ({"pairs_per_statement": 5}, "--pairs-per-statement 5: expected an even number", "statements"),
        ({"seed": 2**63}, f"--seed {2**63}: expected an integer in [0, 2**63)", "pairs"),
    ]:
        with pytest.raises(FinetuneError) as e:
            build_synthetic_nlvr2(small_store.path, tmp_path / "n", **kw)
        assert said in str(e.value) and not_said not in str(e.value), str(e.value)
    afile = _write(tmp_path / "afile", [])
    with pytest.raises(FinetuneError, match=r"afile: is a file, not a store folder"):
        build_synthetic_vqa(afile, tmp_path / "v")
    with pytest.raises(FinetuneError, match=r"afile: is a file, not a store folder"):
        ingest_finetune("vqa", {"train": [afile]}, afile, tmp_path / "v")
    _no_leftovers(tmp_path, "v")
    _no_leftovers(tmp_path, "n")


def test_nlvr2_ingest_and_unlabelled_test_split(tmp_path, small_store, store_images):
    imgs = sorted(store_images)[:9]
    train = _write(tmp_path / "train.json", _nlvr2_records(imgs[:5]) + [
        {"identifier": "train-x-0-0", "img0": imgs[0], "img1": "missing", "sent": "x", "label": 1}])
    test = _write(tmp_path / "test.json", [{k: v for k, v in r.items() if k != "label"}
                                           for r in _nlvr2_records(imgs[5:], "test")])
    data = ingest_finetune("nlvr2", {"train": [train], "test": [test]}, small_store.path, tmp_path / "n",
                           allow_missing_images=True)
    assert data.answers is None and data.manifest.num_answers == 0
    assert data.manifest.ignored == {"missing_images": 1}
    sp = data.split("train")
    assert data.ids("train") == [f"train-{i}-0-0" for i in range(4)]
    np.testing.assert_array_equal(sp.labels, [0, 1, 0, 1])
    assert [tuple(x) for x in sp.img_ids] == [(imgs[i], imgs[i + 1]) for i in range(4)]
    np.testing.assert_array_equal(data.split("test").labels, [-1, -1, -1])
    # "label" may be missing only in the test split.
    with pytest.raises(FinetuneError, match=r"record #0 .*key 'label' is missing"):
        ingest_finetune("nlvr2", {"valid": [test]}, small_store.path, tmp_path / "n2")


def test_overwrite_rules_and_atomic_failure(tmp_path, small_store, store_images, monkeypatch):
    imgs = sorted(store_images)[:4]
    train = _write(tmp_path / "train.json", _vqa_records(imgs))
    args = ("vqa", {"train": [train], "valid": [train]}, small_store.path)
    ingest_finetune(*args, tmp_path / "set")
    with pytest.raises(StoreError, match=r"already exists; pass --overwrite"):
        ingest_finetune(*args, tmp_path / "set")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("keep me")
    with pytest.raises(StoreError, match=r"exists and is not a store .*refusing"):
        ingest_finetune(*args, tmp_path / "other", overwrite=True)
    with pytest.raises(FinetuneError, match=r"inside the feature store"):
        ingest_finetune(*args, small_store.path / "vqa")
    # A failure while writing leaves the old set untouched and no temporary directory.
    before = (tmp_path / "set" / "manifest.json").read_text()
    real = finetune.split_to_table
    calls = []

    def failing(sp):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full")
        return real(sp)

    monkeypatch.setattr(finetune, "split_to_table", failing)
    with pytest.raises(OSError, match="disk full"):
        ingest_finetune(*args, tmp_path / "set", overwrite=True)
    assert (tmp_path / "set" / "manifest.json").read_text() == before
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".set.")]
    monkeypatch.setattr(finetune, "split_to_table", real)
    assert ingest_finetune(*args, tmp_path / "set", overwrite=True).manifest.splits == {"train": 4, "valid": 4}


def test_open_refuses_a_rebuilt_store(tmp_path):
    opts = SyntheticLxmertOptions(num_images=30, num_objects=4, feat_dim=8, num_object_labels=10, num_attr_labels=4,
                                  num_answers=20, sentences_per_image=2, images_per_shard=16)
    store = build_synthetic_store(tmp_path / "store", opts)
    data = build_synthetic_vqa(store.path, tmp_path / "vqa")
    shutil.copytree(store.path, tmp_path / "moved")  # a store that moved: open with store=
    assert open_finetune(data.path, store=tmp_path / "moved").ids("train") == data.ids("train")
    # Even a rebuild with the same options trains its WordPiece vocabulary anew (the ids of tied
    # tokens may change), so any rebuild is refused.
    build_synthetic_store(tmp_path / "store", SyntheticLxmertOptions(**{**vars(opts), "seed": 1}), overwrite=True)
    with pytest.raises(FinetuneError, match=r"not the one this set was made from .* re-create the set"):
        open_finetune(data.path)
    (tmp_path / "vqa" / "valid.parquet").unlink()
    with pytest.raises(FinetuneError, match=r"valid\.parquet: split file listed in manifest\.json is missing"):
        open_finetune(data.path)


def test_cli(tmp_path, small_store, store_images):
    imgs = sorted(store_images)
    a = _write(tmp_path / "a.json", _vqa_records(imgs[:3]))
    b = _write(tmp_path / "b.json", _vqa_records(imgs[3:6], start=10))
    v = _write(tmp_path / "v.json", _vqa_records(imgs[6:8], start=20))
    store = str(small_store.path)
    assert ingest_main(["vqa", str(tmp_path / "vqa"), "--store", store, "--train", f"{a},{b}", "--valid", str(v)]) == 0
    assert open_finetune(tmp_path / "vqa").manifest.splits == {"train": 6, "valid": 2}
    assert ingest_main(["vqa", str(tmp_path / "vqa"), "--store", store, "--train", str(a)]) == 2  # exists
    n = _write(tmp_path / "n.json", _nlvr2_records(imgs[:4]))
    assert ingest_main(["nlvr2", str(tmp_path / "n"), "--store", store, "--train", str(n), "--answers", str(a)]) == 2
    assert ingest_main(["nlvr2", str(tmp_path / "n"), "--store", store, "--test", str(n)]) == 0
    assert ingest_main(["synthetic-nlvr2", str(tmp_path / "sn"), "--store", store, "--questions-per-image", "2"]) == 2
    assert ingest_main(["synthetic-vqa", str(tmp_path / "sv"), "--store", store, "--questions-per-image", "1"]) == 0
    assert open_finetune(tmp_path / "sv").manifest.options["questions_per_image"] == 1


# ============================================================================ synthetic sets


@pytest.fixture(scope="module")
def syn_vqa(small_store, tmp_path_factory):
    return build_synthetic_vqa(small_store.path, tmp_path_factory.mktemp("ft") / "vqa")


@pytest.fixture(scope="module")
def syn_nlvr2(small_store, tmp_path_factory):
    return build_synthetic_nlvr2(small_store.path, tmp_path_factory.mktemp("ft") / "nlvr2")


def _names(store: LxmertStore) -> tuple[dict[str, int], list[str]]:
    m = store.manifest
    n_fg = m.num_object_labels - max(1, m.num_object_labels // 5)
    return {w: c for c, w in enumerate(class_names(n_fg))}, colour_names(m.num_attr_labels)


def _facts(store_images, img: str, c: int) -> tuple[int, set[int]]:
    """(number of objects of class c, their colours) in image `img`, from the store's true labels."""
    x = store_images[img]
    sel = x["obj_ids"] == c
    return int(sel.sum()), set(x["attr_ids"][sel].tolist())


def test_synthetic_vqa_oracle_is_perfect_and_text_alone_is_near_chance(syn_vqa, small_store, store_images):
    classes, colours = _names(small_store)
    tok, table = small_store.tokenizer(), syn_vqa.answers
    assert syn_vqa.splits == ("train", "valid") and syn_vqa.manifest.source == "synthetic"
    by_text: dict[str, dict[str, Counter]] = {}
    kinds = Counter()
    for split, store_split in (("train", "train"), ("valid", "minival")):
        sp = syn_vqa.split(split)
        targets = sp.targets(np.arange(len(sp)), len(table))  # (E, A)
        by_text[split] = defaultdict(Counter)
        for e in range(len(sp)):
            img = str(sp.img_ids[e])
            assert store_images[img]["split"] == store_split
            text = tok.decode(sp.input_ids[e]).replace("?", " ?")
            assert tok.unk_id not in sp.input_ids[e]
            if m := re.fullmatch(r"what color is the (\w+) \?", text):
                n, cols = _facts(store_images, img, classes[m[1]])
                assert n > 0 and len(cols) == 1
                oracle, kind = colours[cols.pop()], "colour"
            elif m := re.fullmatch(r"how many (\w+)s are there \?", text):
                oracle, kind = str(_facts(store_images, img, classes[m[1]])[0]), "count"
            elif m := re.fullmatch(r"is there a (\w+) \?", text):
                oracle, kind = ("yes" if _facts(store_images, img, classes[m[1]])[0] else "no"), "presence"
            else:
                raise AssertionError(f"unexpected question {text!r}")
            kinds[kind] += 1
            assert targets[e, table.index(oracle)] == 1.0 and targets[e].argmax() == table.index(oracle)  # oracle: 100 %
            by_text[split][text][int(targets[e].argmax())] += 1
    assert min(kinds.values()) > 0.25 * sum(kinds.values())
    train = syn_vqa.split("train")
    answers = Counter(int(train.ans_ids[o]) for o in train.ans_offsets[:-1])
    yes = answers[table.index("yes")] / sum(answers[table.index(a)] for a in ("yes", "no"))
    assert 0.4 < yes < 0.6, "presence questions are balanced"
    assert max(answers.values()) / len(train) < 0.5  # no answer is a majority
    assert (train.ans_scores == 0.3).any(), "some count questions have a soft near answer"
    # Text-only prior: the most frequent train answer of each question text, scored on valid.
    prior = {t: c.most_common(1)[0][0] for t, c in by_text["train"].items()}
    fallback = answers.most_common(1)[0][0]
    valid = syn_vqa.split("valid")
    vt = valid.targets(np.arange(len(valid)), len(table))
    guess = [prior.get(tok.decode(valid.input_ids[e]).replace("?", " ?"), fallback) for e in range(len(valid))]
    acc = vt[np.arange(len(valid)), guess].mean()
    assert acc < 0.55, f"text-only soft-score accuracy {acc:.3f}"


def _nlvr2_truth(text: str, imgs, classes, colours, store_images) -> tuple[bool, str, tuple]:
    """(label from the store's true labels, template, what one image tells: per image)."""
    counts = {"a": 1, "two": 2, "three": 3, "four": 4}
    if m := re.fullmatch(r"there is a (\w+) (\w+) in both", text):
        c, col = classes[m[2]], colours.index(m[1])
        has = tuple(col in _facts(store_images, i, c)[1] for i in imgs)
        return all(has), "both", has
    if m := re.fullmatch(r"there are (\w+) (\w+)s in total", text):
        n = tuple(_facts(store_images, i, classes[m[2]])[0] for i in imgs)
        return sum(n) == counts[m[1]], "total", tuple((counts[m[1]], x) for x in n)
    if m := re.fullmatch(r"one image has (\w+) (\w+)", text):
        k = counts[m[1]]
        name = m[2][:-1] if k > 1 else m[2]
        hit = tuple(_facts(store_images, i, classes[name])[0] == k for i in imgs)
        return hit[0] != hit[1], "one", hit
    raise AssertionError(f"unexpected statement {text!r}")


def test_synthetic_nlvr2_needs_both_images(syn_nlvr2, small_store, store_images):
    classes, colours = _names(small_store)
    tok = small_store.tokenizer()
    sp = syn_nlvr2.split("train")
    statements: dict[str, list[int]] = defaultdict(list)
    single: dict[tuple, Counter] = defaultdict(Counter)  # (template, what image p shows) -> labels
    templates = Counter()
    for e, ident in enumerate(syn_nlvr2.ids("train")):
        split, setid, pair, sentid = ident.split("-")  # NLVR2: split-set_id-pair_id-sentence_id
        assert split == "train" and sentid == "0" and pair.isdigit()
        statements[nlvr2_statement(ident)].append(e)
        text = tok.decode(sp.input_ids[e])
        assert tok.unk_id not in sp.input_ids[e]
        imgs = [str(x) for x in sp.img_ids[e]]
        assert imgs[0] != imgs[1] and all(store_images[i]["split"] == "train" for i in imgs)
        truth, template, views = _nlvr2_truth(text, imgs, classes, colours, store_images)
        assert truth == bool(sp.labels[e]), f"{ident} {text!r} {imgs}"  # the oracle is 100 % right
        templates[template] += 1
        for p in (0, 1):
            single[(template, p, views[p])][int(sp.labels[e])] += 1
    assert set(templates) == {"both", "total", "one"} and min(templates.values()) > 0.2 * len(sp)
    # Text alone is at chance: every statement is true for exactly half of its pairs.
    for rows in statements.values():
        assert len(rows) == 4 and sp.labels[rows].sum() == 2
        assert len({tok.decode(sp.input_ids[r]) for r in rows}) == 1
    # One image alone cannot decide: the best per-template rule on what it shows (fitted in-sample).
    for template, limit in (("both", 0.8), ("total", 0.62), ("one", 0.62)):
        for p in (0, 1):
            cells = [c for k, c in single.items() if k[0] == template and k[1] == p]
            acc = sum(max(c.values()) for c in cells) / sum(sum(c.values()) for c in cells)
            assert acc < limit, f"{template}: image {p} alone predicts {acc:.3f}"
    valid = syn_nlvr2.split("valid")
    assert len(valid) > 0 and all(store_images[str(i)]["split"] == "minival" for i in valid.img_ids.ravel())
    assert 0.45 < valid.labels.mean() < 0.55


def test_ensure_synthetic_reuses_or_rebuilds_and_gqa_is_exact_match(tmp_path, small_store, capsys):
    gqa = ensure_synthetic_finetune("gqa", small_store.path, tmp_path / "gqa", questions_per_image=2)
    assert gqa.task == "gqa" and gqa.manifest.options == {"questions_per_image": 2, "near_answer_prob": 0.0, "seed": 0}
    sp = gqa.split("train")
    assert len(sp) == 2 * small_store.manifest.images("train") and (sp.ans_scores == 1).all()
    assert (np.diff(sp.ans_offsets) == 1).all()  # one answer per question
    stamp = (tmp_path / "gqa" / "manifest.json").stat().st_mtime_ns
    again = ensure_synthetic_finetune("gqa", small_store.path, tmp_path / "gqa", questions_per_image=2)
    assert again.ids("valid") == gqa.ids("valid")
    assert (tmp_path / "gqa" / "manifest.json").stat().st_mtime_ns == stamp and "rebuilding" not in capsys.readouterr().out
    # Derived data: built with other options, it is rebuilt with a one-line note.
    three = ensure_synthetic_finetune("gqa", small_store.path, tmp_path / "gqa")
    assert three.manifest.options["questions_per_image"] == 3
    assert "note: rebuilding" in (out := capsys.readouterr().out) and "questions_per_image: built with 2, asked for 3" in out
    as_vqa = ensure_synthetic_finetune("vqa", small_store.path, tmp_path / "gqa", questions_per_image=2)
    assert as_vqa.task == "vqa" and "synthetic gqa set, vqa asked for" in capsys.readouterr().out
    with pytest.raises(FinetuneError, match=r"unknown option\(s\) pairs_per_statement"):
        ensure_synthetic_finetune("vqa", small_store.path, tmp_path / "v", pairs_per_statement=2)
    with pytest.raises(FinetuneError, match=r"0 for gqa"):
        build_synthetic_vqa(small_store.path, tmp_path / "g2", task="gqa", near_answer_prob=0.3)
    nlvr2 = ensure_synthetic_finetune("nlvr2", small_store.path, tmp_path / "n", pairs_per_statement=2)
    assert nlvr2.ids("train")[:2] == ["train-0-0-0", "train-0-1-0"]


# ============================================================================ batches


def test_vqa_batches_carry_the_store_features_and_soft_targets(syn_vqa, store_images, small_store):
    sp = syn_vqa.split("train")
    n = syn_vqa.num_batches("train", 32)
    batches = list(iter_finetune_batches(syn_vqa, "train", 32, seed=3, epoch=0))
    assert len(batches) == n == len(sp) // 32 and all(isinstance(b, VqaBatch) for b in batches)
    b = batches[0]
    rows = b.index.numpy()
    np.testing.assert_array_equal(rows, epoch_order(len(sp), seed=3, epoch=0)[:32])
    assert b.input_ids.dtype == torch.long and b.input_ids.shape == (32, small_store.manifest.max_seq_len)
    np.testing.assert_array_equal(b.input_ids.numpy(), sp.input_ids[rows])
    assert (b.input_ids[:, 0] == small_store.tokenizer().cls_id).all()
    assert torch.equal(b.attention_mask, b.input_ids != 0)
    assert b.visual_feats.dtype == torch.float16 and b.targets.dtype == torch.float32
    assert b.targets.shape == (32, syn_vqa.num_answers)
    for i, r in enumerate(rows):
        img = store_images[str(sp.img_ids[r])]
        np.testing.assert_array_equal(b.visual_feats[i].numpy(), img["features"])
        np.testing.assert_array_equal(b.boxes[i].numpy(), img["boxes"])
        np.testing.assert_array_equal(b.targets[i].numpy(), sp.targets(np.array([r]), syn_vqa.num_answers)[0])
    assert b.visual_mask.all()  # synthetic images fill every object slot
    moved = b.to("cpu", torch.bfloat16)
    assert moved.visual_feats.dtype == torch.bfloat16 and moved.targets.dtype == torch.float32


def test_batches_are_deterministic_and_ranks_take_equal_disjoint_shares(syn_vqa):
    e = len(syn_vqa.split("train"))
    world = 3

    def index(**kw) -> list[int]:
        return [i for b in iter_finetune_batches(syn_vqa, "train", 16, **kw) for i in b.index.tolist()]

    shares = [index(seed=1, epoch=2, rank=r, world=world, drop_last=False) for r in range(world)]
    assert [len(s) for s in shares] == [e // world] * world
    assert len(set().union(*shares)) == (e // world) * world
    assert sorted(set().union(*shares)) == sorted(epoch_order(e, seed=1, epoch=2)[: (e // world) * world].tolist())
    counts = {syn_vqa.num_batches("train", 16, world=world, drop_last=d) for d in (True, False)}
    assert counts == {(e // world) // 16, -(-(e // world) // 16)}
    assert index(seed=1, epoch=2, rank=1, world=world, drop_last=False) == shares[1]
    assert index(seed=1, epoch=3) != index(seed=1, epoch=2) != index(seed=2, epoch=2)
    full = index(seed=1, epoch=2)
    assert index(seed=1, epoch=2, start_batch=3) == full[3 * 16:]
    assert index(seed=0, epoch=0, shuffle=False, drop_last=False) == list(range(e))
    with pytest.raises(ValueError, match="rank"):
        index(seed=0, epoch=0, rank=3, world=3)
    with pytest.raises(FinetuneError, match="no split 'test'"):
        list(iter_finetune_batches(syn_vqa, "test", 4, seed=0, epoch=0))


def test_nlvr2_batches_pair_the_two_images(syn_nlvr2, store_images):
    sp = syn_nlvr2.split("valid")
    b = next(iter_finetune_batches(syn_nlvr2, "valid", 8, seed=0, epoch=0))
    assert isinstance(b, Nlvr2Batch) and b.visual_feats.shape[:2] == (8, 2) and b.visual_mask.shape[:2] == (8, 2)
    rows = b.index.numpy()
    np.testing.assert_array_equal(b.labels.numpy(), sp.labels[rows])
    for i, r in enumerate(rows):
        for p in (0, 1):
            img = store_images[str(sp.img_ids[r, p])]
            np.testing.assert_array_equal(b.visual_feats[i, p].numpy(), img["features"])
            np.testing.assert_array_equal(b.boxes[i, p].numpy(), img["boxes"])
    clone = pickle.loads(pickle.dumps(syn_nlvr2))  # as a Ray worker would receive it
    again = next(iter_finetune_batches(clone, "valid", 8, seed=0, epoch=0))
    assert torch.equal(again.visual_feats, b.visual_feats)


def test_json_and_answer_files_that_are_not_what_they_claim_are_one_error(tmp_path: Path):
    """A folder, a binary file (a pickle given as JSON): a FinetuneError / AnswerError naming the file,
    not a traceback from the reader."""
    from xmodal.data.answers import AnswerError, AnswerTable
    from xmodal.data.finetune.ingest import _load_list

    folder = tmp_path / "train.json"
    folder.mkdir()
    binary = tmp_path / "answers.json"
    binary.write_bytes(pickle.dumps({"yes": 1}))
    with pytest.raises(FinetuneError, match=r"train.json: cannot be read \(Is a directory\)"):
        _load_list(folder)
    with pytest.raises(FinetuneError, match="answers.json: not UTF-8 text"):
        _load_list(binary)
    with pytest.raises(AnswerError, match="answers.json: not UTF-8 text"):
        AnswerTable.from_reference(binary)
    with pytest.raises(AnswerError, match=r"train.json: cannot be read \(Is a directory\)"):
        AnswerTable.from_reference(folder)
    with pytest.raises(AnswerError, match="--num-answers 0: expected"):
        AnswerTable.from_reference(binary, limit=0)
