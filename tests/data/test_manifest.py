"""What every kind of store shares (xmodal.data.manifest): typed manifests, kind-checked overwrite,
refusing folders that are not stores, and the embedded-default policy across kinds."""

from __future__ import annotations

import dataclasses
import json
import pickle
from pathlib import Path

import numpy as np
import pytest

from xmodal.base.errors import UserError
from xmodal.data.errors import StoreError
from xmodal.data.finetune.sets import open_finetune
from xmodal.data.finetune.synthetic import build_synthetic_vqa
from xmodal.data.lxmert.store import LxmertStore, open_store
from xmodal.data.lxmert.synthetic import build_synthetic_store, ensure_synthetic_store
from xmodal.data.manifest import MANIFEST_FILE
from xmodal.data.mult.store import MultStore, write_store
from xmodal.data.mult.synthetic import generate
from xmodal.data.options import SyntheticLxmertOptions, SyntheticMultOptions

TINY = SyntheticLxmertOptions(num_images=20, num_objects=4, feat_dim=8, num_object_labels=10, num_attr_labels=4,
                              num_answers=20, sentences_per_image=2, images_per_shard=16)
TINY_MULT = SyntheticMultOptions(num_samples=20)


@pytest.fixture
def lxmert(tmp_path: Path) -> LxmertStore:
    return build_synthetic_store(tmp_path / "lxmert", TINY)


def _snapshot(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


def _edit_manifest(path: Path, change) -> None:
    m = json.loads((path / MANIFEST_FILE).read_text())
    change(m)
    (path / MANIFEST_FILE).write_text(json.dumps(m))


# ----------------------------------------------------------------------------- typed manifests


def test_manifest_errors_name_the_file_the_field_the_value_and_what_was_expected(lxmert: LxmertStore):
    mpath = lxmert.path / MANIFEST_FILE
    good = mpath.read_text()

    def error(change) -> str:
        mpath.write_text(good)
        _edit_manifest(lxmert.path, change)
        with pytest.raises(StoreError) as e:
            open_store(lxmert.path)
        assert isinstance(e.value, UserError)
        return str(e.value)

    msg = error(lambda m: m["shards"]["train"][0].update(rows="many"))
    assert msg.startswith(f"{mpath}: ") and "field shards.train.0.rows = \"many\"" in msg and "valid integer" in msg
    msg = error(lambda m: m.update(feat_dim=[8]))
    assert "field feat_dim = [8]: expected a valid integer" in msg
    msg = error(lambda m: m.update(colour="red"))
    assert "unknown field colour = \"red\"" in msg and "expected only:" in msg and "num_objects" in msg
    msg = error(lambda m: m.pop("vocab_size"))
    assert f"{mpath}: field vocab_size is missing" in msg
    msg = error(lambda m: m["shards"].update(test=[]))
    assert "field shards has key \"test\": expected 'train' or 'minival'" in msg
    msg = error(lambda m: m.update(schema_version=7))
    assert "field schema_version = 7" in msg and "reads version 1" in msg


def test_every_manifest_records_its_kind(tmp_path: Path, lxmert: LxmertStore):
    mult = write_store(tmp_path / "mult", generate(TINY_MULT), dataset="synthetic", source={})
    vqa = build_synthetic_vqa(lxmert.path, tmp_path / "vqa")
    kinds = [json.loads((p / MANIFEST_FILE).read_text())["kind"] for p in (lxmert.path, mult.path, vqa.path)]
    assert kinds == ["lxmert", "mult", "lxmert-finetune"]


# ----------------------------------------------------------------------------- folders that are not stores


def test_opening_a_folder_that_is_not_the_expected_store_names_path_and_kind(tmp_path: Path, lxmert: LxmertStore):
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "notes.txt").write_text("x")
    vqa = build_synthetic_vqa(lxmert.path, tmp_path / "vqa")
    mult = write_store(tmp_path / "mult", generate(TINY_MULT), dataset="synthetic", source={})
    cases = [
        (open_store, plain, [str(plain), "has no manifest.json", "expected an LXMERT feature store", "'lxmert'"]),
        (open_store, vqa.path, [str(vqa.path / MANIFEST_FILE), "an LXMERT fine-tuning set",
                                "expected an LXMERT feature store"]),
        (open_store, mult.path, ["a MulT store", "expected an LXMERT feature store"]),
        (MultStore.open, plain, [str(plain), "expected a MulT store"]),
        (MultStore.open, lxmert.path, [str(lxmert.path), "an LXMERT feature store", "expected a MulT store"]),
        (open_finetune, lxmert.path, ["an LXMERT feature store", "expected an LXMERT fine-tuning set"]),
        (open_finetune, plain, [str(plain), "expected an LXMERT fine-tuning set"]),
        (MultStore.open, tmp_path / "nowhere", [str(tmp_path / "nowhere"), "does not exist"]),
    ]
    for fn, path, parts in cases:
        with pytest.raises(StoreError) as e:
            fn(path)
        for part in parts:
            assert part in str(e.value), (fn.__qualname__, path, str(e.value))


# ----------------------------------------------------------------------------- --overwrite and kinds


def test_overwrite_replaces_only_the_same_kind_and_leaves_nothing_half_written(tmp_path: Path, lxmert: LxmertStore):
    before = _snapshot(lxmert.path)
    with pytest.raises(StoreError) as e:
        write_store(lxmert.path, generate(TINY_MULT), dataset="synthetic", source={}, overwrite=True)
    msg = str(e.value)
    assert str(lxmert.path) in msg and "an LXMERT feature store (kind 'lxmert')" in msg
    assert "a MulT store (kind 'mult')" in msg and "even with --overwrite" in msg
    other = build_synthetic_store(tmp_path / "other", TINY)
    other_before = _snapshot(other.path)
    with pytest.raises(StoreError, match="holds an LXMERT feature store .*refusing to replace it with an LXMERT "
                                         "fine-tuning set"):
        build_synthetic_vqa(lxmert.path, other.path, overwrite=True)
    assert _snapshot(lxmert.path) == before and _snapshot(other.path) == other_before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["lxmert", "other"]  # no temporary directory
    # A MulT store over an LXMERT store, the other way round, and a set over a MulT store: refused too.
    mult = write_store(tmp_path / "mult", generate(TINY_MULT), dataset="synthetic", source={})
    with pytest.raises(StoreError, match="holds a MulT store"):
        build_synthetic_store(mult.path, TINY, overwrite=True)
    with pytest.raises(StoreError, match="holds a MulT store"):
        build_synthetic_vqa(lxmert.path, mult.path, overwrite=True)
    assert MultStore.open(mult.path).manifest.rows == mult.manifest.rows
    # The same kind is replaced.
    again = build_synthetic_store(lxmert.path, dataclasses.replace(TINY, seed=3), overwrite=True)
    assert again.manifest.options["seed"] == 3


# ----------------------------------------------------------------------------- older formats


def test_a_store_written_before_kinds_opens_and_an_embedded_one_is_rebuilt(tmp_path: Path, capsys):
    path = tmp_path / "syn"
    store = ensure_synthetic_store(path, TINY)
    data = build_synthetic_vqa(store.path, tmp_path / "vqa")
    _edit_manifest(path, lambda m: m.pop("kind"))  # as every LXMERT store was written before
    old = open_store(path)
    assert old.manifest.kind == "lxmert" and old.manifest.older_format == 'no "kind" field'
    assert open_finetune(data.path).store.path == path  # the set's store fingerprint did not change
    assert pickle.loads(pickle.dumps(old)).manifest == old.manifest  # what Ray workers receive
    capsys.readouterr()
    rebuilt = ensure_synthetic_store(path, TINY)
    assert rebuilt.manifest.older_format is None
    assert "older format (no \"kind\" field)" in capsys.readouterr().out
    assert json.loads((path / MANIFEST_FILE).read_text())["kind"] == "lxmert"


def test_an_embedded_default_path_never_replaces_what_it_did_not_build(tmp_path: Path, lxmert: LxmertStore):
    from xmodal.data.mult.synthetic import ensure_synthetic_store as ensure_mult

    real = write_store(tmp_path / "real", generate(TINY_MULT), dataset="mosi", source={"format": "mmsa",
                                                                                         "path": "/data/x.pkl"})
    before = _snapshot(real.path)
    with pytest.raises(StoreError, match="'mosi' ingested from /data/x.pkl, not the embedded synthetic store"):
        ensure_mult(real.path, TINY_MULT)
    with pytest.raises(StoreError, match="holds an LXMERT feature store, not a MulT store"):
        ensure_mult(lxmert.path, TINY_MULT)
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "a.txt").write_text("a")
    with pytest.raises(StoreError, match="exists and is not a store"):
        ensure_synthetic_store(folder, TINY)
    assert _snapshot(real.path) == before and (folder / "a.txt").read_text() == "a"
    assert np.array_equal(MultStore.open(real.path).split("train").labels, real.split("train").labels)
