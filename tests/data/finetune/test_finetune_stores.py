"""Fine-tuning sets over several image stores: an NLVR2 set over a feature-only store, a VQA set whose
images are split between two stores, the missing-image error, a changed store detected on open, and
a set of the older one-store manifest format."""

from __future__ import annotations

import json
import pickle
import re
from pathlib import Path

import numpy as np
import pytest
from refdata import RefImage, read_images, ref_image

from xmodal.cli.ingest import main as ingest_main
from xmodal.data.finetune.ingest import ingest_finetune
from xmodal.data.finetune.sets import iter_finetune_batches, open_finetune
from xmodal.data.finetune.split import FinetuneError
from xmodal.data.lxmert.feature_writer import ingest_features
from xmodal.data.lxmert.features import FeatureStore
from xmodal.data.lxmert.store import LxmertStore


def _tsv(path: Path, img_ids: list[str], seed: int, num_objects: int = 12, feat_dim: int = 16) -> dict[str, RefImage]:
    """A reference-format TSV of `img_ids` (5..num_objects boxes each, so some rows are padded)."""
    rng = np.random.default_rng(seed)
    images = {i: ref_image(rng, i, n=int(rng.integers(5, num_objects + 1)), feat_dim=feat_dim) for i in img_ids}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(im.line() for im in images.values()))
    return images


def _features_store(tmp: Path, name: str, img_ids: list[str], seed: int, **kw) -> tuple[FeatureStore, dict]:
    images = _tsv(tmp / f"{name}.tsv", img_ids, seed, **kw)
    store = ingest_features(tmp / name, [tmp / f"{name}.tsv"], num_objects=kw.get("num_objects", 12),
                            images_per_shard=4, row_group_images=2, progress=False)
    return store, images


def _write(path: Path, records: list) -> Path:
    path.write_text(json.dumps(records))
    return path


def _check_feats(batch_feats: np.ndarray, batch_boxes: np.ndarray, ref: RefImage) -> None:
    n = len(ref.obj_ids)
    np.testing.assert_allclose(batch_feats[:n].astype(np.float32), ref.features, rtol=1e-3, atol=1e-3)
    assert not batch_feats[n:].any()  # padding objects
    scale = np.array([ref.img_w, ref.img_h, ref.img_w, ref.img_h], np.float32)
    np.testing.assert_allclose(batch_boxes[:n], ref.boxes / scale, rtol=1e-6, atol=1e-6)


def test_nlvr2_set_over_a_feature_only_store(tmp_path: Path, small_store: LxmertStore):
    ids = [f"train-{k}-img{j}" for k in range(6) for j in (0, 1)]
    feats, images = _features_store(tmp_path, "nlvr2_train", ids, seed=1)
    recs = [{"identifier": f"train-{k}-0-0", "img0": f"train-{k}-img0", "img1": f"train-{k}-img1",
             "sent": "there are two dogs", "label": k % 2} for k in range(6)]
    train = _write(tmp_path / "train.json", recs)
    # The pretraining store gives the tokenizer; the feature-only store the images.
    assert ingest_main(["nlvr2", str(tmp_path / "set"), "--store", str(small_store.path), "--store",
                        str(feats.path), "--train", str(train), "--valid", str(train)]) == 0
    data = open_finetune(tmp_path / "set")
    m = data.manifest
    assert data.store.path == small_store.path and [st.path for st in data.image_stores] == [small_store.path,
                                                                                             feats.path]
    assert [(r.path, r.kind) for r in m.image_stores] == [(str(small_store.path), "lxmert"),
                                                          (str(feats.path), "features")]
    assert m.splits == {"train": 6, "valid": 6} and m.ignored == {"missing_images": 0}
    want, _ = small_store.tokenizer().encode(["there are two dogs"])
    np.testing.assert_array_equal(data.split("train").input_ids[0], want[0])
    seen = 0
    for b in iter_finetune_batches(data, "train", 4, seed=0, epoch=0, shuffle=False, drop_last=False):
        assert tuple(b.visual_feats.shape[1:]) == (2, 12, 16)
        for row, feats_pair, boxes_pair, label in zip(b.index.tolist(), b.visual_feats.numpy(), b.boxes.numpy(),
                                                      b.labels.tolist(), strict=True):
            for j in (0, 1):
                _check_feats(feats_pair[j], boxes_pair[j], images[f"train-{row}-img{j}"])
            assert label == row % 2
            seen += 1
    assert seen == 6
    # Only feature-only stores: nothing to tokenise with.
    with pytest.raises(FinetuneError, match=r"none of the stores .* is an LXMERT store: .*tokenizer"):
        ingest_finetune("nlvr2", {"train": [train]}, [feats.path], tmp_path / "set2")


def test_vqa_set_over_two_stores_carries_the_right_features(tmp_path: Path, small_store: LxmertStore):
    a, img_a = _features_store(tmp_path, "a", [f"A_{i}" for i in range(5)], seed=2)
    b, img_b = _features_store(tmp_path, "b", [f"B_{i}" for i in range(5)], seed=3)
    # Also in the pretraining store: an image of a later store is taken from the first that holds it.
    coco = sorted(read_images(small_store)["img_id"].tolist())[:2]
    imgs = [x for pair in zip(img_a, img_b, strict=True) for x in pair] + coco
    recs = [{"question_id": 500 + i, "img_id": img, "sent": "what color is it ?", "label": {"red": 1.0}}
            for i, img in enumerate(imgs)]
    train = _write(tmp_path / "train.json", recs)
    data = ingest_finetune("vqa", {"train": [train]}, [small_store.path, a.path, b.path], tmp_path / "vqa")
    assert [r.path for r in data.manifest.image_stores] == [str(small_store.path), str(a.path), str(b.path)]
    index = data.store_index()
    assert index["A_3"][0] == 1 and index["B_0"][0] == 2 and index[coco[0]][0] == 0
    small = read_images(small_store)
    where = {str(x): k for k, x in enumerate(small["img_id"])}
    refs = {**img_a, **img_b}
    data = pickle.loads(pickle.dumps(open_finetune(data.path)))  # what a Ray worker gets
    seen = 0
    for batch in iter_finetune_batches(data, "train", 4, seed=7, epoch=1, shuffle=True, drop_last=False):
        for row, f, bx in zip(batch.index.tolist(), batch.visual_feats.numpy(), batch.boxes.numpy(), strict=True):
            img = imgs[row]
            if img in refs:
                _check_feats(f, bx, refs[img])
            else:
                np.testing.assert_array_equal(f, small["features"][where[img]])
            seen += 1
    assert seen == len(imgs) == 12


def test_missing_image_names_img_id_record_and_stores(tmp_path: Path, small_store: LxmertStore):
    a, img_a = _features_store(tmp_path, "a", ["A_0", "A_1"], seed=4)
    recs = [{"question_id": "q0", "img_id": "A_0", "sent": "a ?", "label": {"yes": 1}},
            {"question_id": "q1", "img_id": "NOWHERE_7", "sent": "b ?", "label": {"no": 1}},
            {"question_id": "q2", "img_id": "A_1", "sent": "c ?", "label": {"no": 1}}]
    train = _write(tmp_path / "train.json", recs)
    out = tmp_path / "gqa"
    stores = f"{small_store.path}, {a.path}"
    with pytest.raises(FinetuneError, match=re.escape(f"{train}: record #1 (id 'q1'): img_id 'NOWHERE_7' is in none "
                                                      f"of the image stores searched ({stores}); 1 record(s)")):
        ingest_finetune("gqa", {"train": [train]}, [small_store.path, a.path], out)
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".gqa.")]
    data = ingest_finetune("gqa", {"train": [train]}, [small_store.path, a.path], out, allow_missing_images=True)
    assert data.manifest.ignored == {"missing_images": 1, "unknown_answers": 0} and data.ids("train") == ["q0", "q2"]
    # Stores that disagree on the objects per image cannot share a set.
    wide, _ = _features_store(tmp_path / "w", "wide", ["W_0"], seed=5, num_objects=14)
    with pytest.raises(FinetuneError, match=rf"{re.escape(str(wide.path))} has num_objects=14, feat_dim=16, but "):
        ingest_finetune("gqa", {"train": [train]}, [small_store.path, wide.path], tmp_path / "g2")


def test_changed_store_is_detected_and_old_manifests_open(tmp_path: Path, small_store: LxmertStore):
    a, _ = _features_store(tmp_path, "a", ["A_0", "A_1", "A_2"], seed=6)
    recs = [{"question_id": i, "img_id": f"A_{i}", "sent": "x ?", "label": {"yes": 1}} for i in range(3)]
    train = _write(tmp_path / "train.json", recs)
    data = ingest_finetune("vqa", {"train": [train]}, [small_store.path, a.path], tmp_path / "vqa")
    assert open_finetune(data.path).image_stores[1].manifest == a.manifest
    # Rebuilt from the same file, changed (same images, other features): the set refuses it.
    _tsv(tmp_path / "a.tsv", ["A_0", "A_1", "A_2"], seed=99)
    rebuilt = ingest_features(a.path, [tmp_path / "a.tsv"], overwrite=True, progress=False).manifest
    assert (rebuilt.inputs, rebuilt.images) == (a.manifest.inputs, a.manifest.images)
    with pytest.raises(FinetuneError, match=rf"the store {re.escape(str(a.path))} is not the one this set was made "
                                            r"from .* re-create the set"):
        open_finetune(data.path)
    # A set of the older format (no image_stores: its one store is `store`) still opens and reads.
    imgs = sorted(read_images(small_store)["img_id"].tolist())[:3]
    old = [{"question_id": i, "img_id": img, "sent": "x ?", "label": {"yes": 1}} for i, img in enumerate(imgs)]
    one = ingest_finetune("vqa", {"train": [_write(tmp_path / "old.json", old)]}, small_store.path, tmp_path / "old")
    mpath = one.path / "manifest.json"
    raw = json.loads(mpath.read_text())
    assert raw["image_stores"] == [{"path": str(small_store.path), "kind": "lxmert",
                                    "fingerprint": raw["store_fingerprint"]}]
    del raw["image_stores"]
    mpath.write_text(json.dumps(raw))
    reopened = open_finetune(one.path)
    assert reopened.manifest.image_stores == [] and reopened.image_stores == [reopened.store]
    batch = next(iter_finetune_batches(reopened, "train", 3, seed=0, epoch=0, shuffle=False))
    small = read_images(small_store)
    k = [small["img_id"].tolist().index(img) for img in imgs]
    np.testing.assert_array_equal(batch.visual_feats.numpy(), small["features"][k])


def test_the_finetune_job_trains_on_a_set_over_a_feature_only_store(tmp_path: Path, small_store: LxmertStore):
    """The job's own path in process (no Ray): config checks, model dims, batches, evaluation, predictions."""
    from xmodal.config.experiment import load_config
    from xmodal.jobs.finetune_config import FinetuneConfig
    from xmodal.jobs.finetune_job import FinetuneJob
    from xmodal.runner.inprocess import run_in_process

    ids = [f"x-{k}-img{j}" for k in range(16) for j in (0, 1)]
    feats, _ = _features_store(tmp_path, "nlvr2_feats", ids, seed=8)
    recs = [{"identifier": f"x-{k}-0-0", "img0": f"x-{k}-img0", "img1": f"x-{k}-img1", "sent": "two dogs",
             "label": k % 2} for k in range(16)]
    split = _write(tmp_path / "s.json", recs)
    data = ingest_finetune("nlvr2", {"train": [split], "valid": [split]}, [small_store.path, feats.path],
                           tmp_path / "nlvr2")
    cfg = load_config(FinetuneConfig, overrides=[
        "task=nlvr2", "preset=tiny", "init.source=scratch", "train.batch_size=8", "train.eval_every=2",
        "train.log_every=1", f"data.store={data.path}", f"scale.storage_path={tmp_path / 'runs'}"])
    _, final = run_in_process(FinetuneJob(), cfg, open_finetune(data.path))
    # Evaluated on all 16 valid pairs: accuracy and consistency are multiples of 1/16 and 1/16 statements.
    clean = {k: v for k, v in final.items() if not k.startswith("robust/")}  # robustness: tests/jobs/test_robust_eval.py
    assert set(clean) == {"best_valid/accuracy", "best_valid/loss", "best_valid/consistency"}, final
    assert (final["best_valid/accuracy"] * 16).is_integer() and np.isfinite(final["best_valid/loss"]), final


def _readme_command(readme: str, head: str) -> list[str]:
    found = re.search(rf"^python jobs/ingest\.py ({re.escape(head)}(?:[^\n]*\\\n)*[^\n]*)$", readme, re.M)
    assert found is not None, f"docs/data.md no longer shows `jobs/ingest.py {head} ...`"
    return [a for line in found.group(1).split("\\\n") for a in line.split("#")[0].split()]


def test_the_readme_nlvr2_commands_on_files_named_as_the_reference(tmp_path: Path, small_store: LxmertStore,
                                                                   capsys):
    """docs/data.md's `features` and `nlvr2` examples, run as written on small files with the reference's names."""
    from xmodal_testing import REPO

    readme = (REPO / "docs" / "data.md").read_text()
    d = tmp_path / "reference"
    images: dict[str, RefImage] = {}
    for seed, split in enumerate(("train", "valid", "test")):
        images.update(_tsv(d / f"{split}_obj36.tsv", [f"{split}-{k}-img{j}" for k in range(3) for j in (0, 1)], seed))
        recs = [{"identifier": f"{split}-{k}-0-0", "img0": f"{split}-{k}-img0", "img1": f"{split}-{k}-img1",
                 "sent": "two dogs", **({} if split == "test" else {"label": k % 2})} for k in range(3)]
        _write(d / f"{split}.json", recs)
    paths = {"data/lxmert_store": str(small_store.path), "data/nlvr2_features": str(tmp_path / "feats"),
             "data/nlvr2": str(tmp_path / "nlvr2")}
    for head in ("features data/nlvr2_features", "nlvr2 data/nlvr2"):
        argv = [paths.get(a, str(d / a) if (d / a).is_file() else a) for a in _readme_command(readme, head)]
        # (the small pretraining store has 12 object slots, the reference 36)
        extra = ["--no-progress", "--num-objects", "12"] if head.startswith("features") else []
        assert ingest_main([*argv, *extra]) == 0, capsys.readouterr().err
    data = open_finetune(tmp_path / "nlvr2")
    assert data.manifest.splits == {"train": 3, "valid": 3, "test": 3}
    assert [r.kind for r in data.manifest.image_stores] == ["lxmert", "features"]
    np.testing.assert_array_equal(data.split("test").labels, [-1, -1, -1])
    b = next(iter_finetune_batches(data, "test", 3, seed=0, epoch=0, shuffle=False))
    _check_feats(b.visual_feats[2, 1].numpy(), b.boxes[2, 1].numpy(), images["test-2-img1"])
