"""The synthetic corpus is learnable: features identify classes, sentences follow from the objects."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from refdata import SMALL

from xmodal.base.errors import UserError
from xmodal.cli.ingest import main as ingest_main
from xmodal.data.lxmert.store import LxmertStore, open_store
from xmodal.data.lxmert.synthetic import (
    build_synthetic_store,
    class_names,
    colour_names,
    ensure_synthetic_store,
)
from xmodal.data.options import SyntheticLxmertOptions


def test_nearest_prototype_classifier_far_above_chance(small_store: LxmertStore):
    train, val = small_store.read_split("train"), small_store.read_split("minival")
    labels = small_store.manifest.num_object_labels
    x, y = train.features.reshape(-1, train.features.shape[-1]).astype(np.float32), train.obj_ids.reshape(-1)
    centroids = np.stack([x[y == c].mean(0) for c in range(labels)])  # (L, F) from the data alone
    xv, yv = val.features.reshape(-1, val.features.shape[-1]).astype(np.float32), val.obj_ids.reshape(-1)
    pred = ((xv[:, None, :] - centroids[None]) ** 2).sum(-1).argmin(1)
    acc = (pred == yv).mean()
    assert acc > 0.9 > 10 / labels, f"nearest-centroid accuracy {acc:.3f} (chance {1 / labels:.3f})"


def _fg(store: LxmertStore) -> int:
    n = store.manifest.num_object_labels
    return n - max(1, n // 5)


def test_sentences_follow_from_the_objects(small_store: LxmertStore):
    block, tok, table = small_store.read_split("train"), small_store.tokenizer(), small_store.answers()
    n_fg = _fg(small_store)
    names = {w: c for c, w in enumerate(class_names(n_fg))}
    names.update({w + "s": c for w, c in list(names.items())})
    colours = colour_names(small_store.manifest.num_attr_labels)
    checked = {"caption": 0, "color": 0, "count": 0, "presence": 0}
    absent_in_other = []
    for k in range(block.num_images):
        present = set(block.obj_ids[k][block.obj_ids[k] < n_fg].tolist())
        for s in range(block.sent_offsets[k], block.sent_offsets[k + 1]):
            words = tok.decode(block.input_ids[s]).replace("?", " ?").split()
            named = {names[w] for w in words if w in names}
            a0, a1 = block.ans_offsets[s], block.ans_offsets[s + 1]
            answer = table.answer(int(block.ans_ids[a0])) if a1 > a0 else None
            if words[-1] != "?":
                assert named and named <= present, f"caption {' '.join(words)!r} names absent objects"
                checked["caption"] += 1
                other = block.obj_ids[(k + 1) % block.num_images]
                absent_in_other.append(not named <= set(other.tolist()))
            elif words[:3] == ["what", "color", "is"]:
                (c,) = named
                attrs = block.attr_ids[k][block.obj_ids[k] == c]
                assert len(set(attrs.tolist())) == 1 and answer == colours[attrs[0]]
                checked["color"] += 1
            elif words[:2] == ["how", "many"]:
                (c,) = named
                assert answer == str(int((block.obj_ids[k] == c).sum()))
                checked["count"] += 1
            else:
                (c,) = named
                assert answer == ("yes" if c in present else "no")
                checked["presence"] += 1
    assert min(checked.values()) > 50, checked
    # A caption of another image (what a mismatch shows) names objects absent here.
    assert np.mean(absent_in_other) > 0.8


def test_builds_the_requested_sizes_and_supports_paper_dims(tmp_path: Path):
    o = SyntheticLxmertOptions(num_images=2000, feat_dim=64, num_object_labels=40, num_attr_labels=8, num_answers=60,
                               sentences_per_image=4)
    store = build_synthetic_store(tmp_path / "default", o)
    m = store.manifest
    assert m.images("train") == 1800 and m.images("minival") == 200
    # Every image gets its sentences; shards hold at most images_per_shard images.
    shards = [s for split in m.shards.values() for s in split]
    assert sum(s.sentences for s in shards) == 2000 * 4
    assert all(0 < s.rows <= o.images_per_shard for s in shards)
    assert m.options == dataclasses.asdict(o)

    paper = SyntheticLxmertOptions(num_images=12, images_per_shard=8)  # 36 x 2048, 1600 / 400 classes, 9500 answers
    store = build_synthetic_store(tmp_path / "paper", paper)
    m = store.manifest
    assert (m.num_objects, m.feat_dim, m.num_object_labels, m.num_attr_labels) == (36, 2048, 1600, 400)
    assert m.num_answers <= 9500 and store.read_split("train").features.shape[1:] == (36, 2048)


def test_ensure_synthetic_store_reuses_or_rebuilds(tmp_path: Path, capsys):
    o = dataclasses.replace(SMALL, num_images=40)
    path = tmp_path / "syn"
    first = ensure_synthetic_store(path, o)
    stamp = (path / "manifest.json").stat().st_mtime_ns
    again = ensure_synthetic_store(path, dataclasses.replace(o))
    assert again.manifest == first.manifest and (path / "manifest.json").stat().st_mtime_ns == stamp
    assert "rebuilding" not in capsys.readouterr().out
    # The embedded default is derived data: asked for other options, it is rebuilt with a note.
    other = ensure_synthetic_store(path, dataclasses.replace(o, feat_dim=24))
    assert other.manifest.feat_dim == 24 and other.manifest.options["feat_dim"] == 24
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and f"note: rebuilding {path}" in out and "feat_dim: built with 16, asked for 24" in out
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_images_without_background_hold_their_named_objects_only(tmp_path: Path):
    o = dataclasses.replace(SMALL, num_images=60, num_objects=12, background_objects=False,
                            captions_name_all_groups=True, question_fraction=0.25)
    store = build_synthetic_store(tmp_path / "nobg", o)
    block, tok = store.read_split("train"), store.tokenizer()
    n_fg = _fg(store)
    names = {w: c for c, w in enumerate(class_names(n_fg))}
    names.update({w + "s": c for w, c in list(names.items())})
    real = block.visual_mask
    assert (block.num_boxes < 12).any() and (block.num_boxes >= 1).all()
    assert (block.obj_ids[real] < n_fg).all() and (block.obj_ids[~real] == -1).all()
    assert not block.features[~real].any()  # padding slots hold zeros
    captions = 0
    for k in range(block.num_images):
        present = set(block.obj_ids[k][real[k]].tolist())
        for s in range(block.sent_offsets[k], block.sent_offsets[k + 1]):
            words = tok.decode(block.input_ids[s]).replace("?", " ?").split()
            if words[-1] != "?":
                assert {names[w] for w in words if w in names} == present, " ".join(words)
                captions += 1
    assert captions > 100


def test_a_store_the_user_named_is_never_modified(tmp_path: Path, capsys):
    o = dataclasses.replace(SMALL, num_images=40)
    named = build_synthetic_store(tmp_path / "mine", o)
    manifest = (named.path / "manifest.json").read_text()
    # The job opens a named store with open_store, whatever synthetic options its config holds.
    assert open_store(named.path).manifest.options["feat_dim"] == 16
    assert ingest_main(["synthetic", str(named.path), "--feat-dim", "24", "--no-progress"]) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert (named.path / "manifest.json").read_text() == manifest


def test_bad_options_are_named_alone_and_a_store_keeps_a_train_image(tmp_path: Path):
    """Only the wrong options are named, by flag and field; NaN and a negative seed are caught before numpy
    sees them; a minival fraction that leaves no train image is refused, nothing written."""
    tiny = dataclasses.replace(SMALL, num_images=20, images_per_shard=8)
    for change, said, not_said in [
        ({"images_per_shard": 0}, "--images-per-shard 0 (images_per_shard=0): expected an integer >= 1", "noise"),
        ({"feature_noise": float("nan")}, "--feature-noise nan (feature_noise=nan): expected a finite number >= 0",
         "shard"),
        ({"seed": -1}, "--seed -1 (seed=-1): expected an integer in [0, ", "noise"),
        ({"num_images": 1}, "--num-images 1 (num_images=1): expected an integer >= 2 (mismatched", "noise"),
        ({"minival_fraction": 0.99}, "--minival-fraction 0.99 leaves no training image of --num-images 20", "noise"),
    ]:
        with pytest.raises(UserError) as e:
            build_synthetic_store(tmp_path / "s", dataclasses.replace(tiny, **change))
        assert said in str(e.value) and not_said not in str(e.value), str(e.value)
        assert list(tmp_path.iterdir()) == []
    # The largest fraction that still leaves one: 19 of 20 images in minival.
    store = build_synthetic_store(tmp_path / "s", dataclasses.replace(tiny, minival_fraction=0.95))
    assert store.manifest.images("train") == 1 and store.manifest.images("minival") == 19
