"""Fine-tuning sets over stores on S3 (a moto server, `s3` in tests/conftest.py): a set is made on a
local disk from an image store read on S3 (it records the store's URI), uploaded, and opened from its
own URI: it gives the examples, units and batches of the same set over the local copy; a bad set on
S3 names the object's URI."""

from __future__ import annotations

import uuid

import numpy as np
import pytest
import torch

from xmodal.data.finetune import stream
from xmodal.data.finetune.sets import open_finetune
from xmodal.data.finetune.split import FinetuneError
from xmodal.data.finetune.stream import split_layout
from xmodal.data.finetune.synthetic import build_synthetic_vqa
from xmodal.data.location import Location
from xmodal_testing import S3_BUCKET


def test_a_set_over_an_s3_store_reads_as_the_set_over_the_local_copy(s3, small_store, tmp_path):
    prefix = f"finetune-{uuid.uuid4().hex[:8]}"
    images = s3.upload(small_store.path, f"{prefix}/lxmert")
    made = build_synthetic_vqa(images, tmp_path / "vqa")  # reads the store's vocab and images on S3
    assert made.manifest.store == images and str(made.store.path) == images
    local = build_synthetic_vqa(small_store.path, tmp_path / "vqa-local")
    remote = open_finetune(s3.upload(tmp_path / "vqa", f"{prefix}/vqa"))
    assert isinstance(remote.path, Location) and str(remote.path) == f"s3://{S3_BUCKET}/{prefix}/vqa"
    assert remote.splits == local.splits and remote.answers.answers == local.answers.answers
    for split in remote.splits:
        a, b = remote.split(split), local.split(split)
        assert np.array_equal(a.ids, b.ids) and np.array_equal(a.input_ids, b.input_ids)
        assert np.array_equal(remote.images(split).features, local.images(split).features)
    units = split_layout(remote, "train").units
    assert units and all(u.file.startswith(f"{images}/") for u in units)
    assert [(u.group, u.rows, u.samples) for u in units] == [(u.group, u.rows, u.samples)
                                                             for u in split_layout(local, "train").units]
    kw = dict(seed=4, epoch=1, rank=1, world=2)
    got = list(stream.iter_train_batches(remote, "train", 8, **kw))
    want = list(stream.iter_train_batches(local, "train", 8, **kw))
    assert len(got) == len(want) > 0
    assert all(torch.equal(x.visual_feats, y.visual_feats) and torch.equal(x.targets, y.targets)
               for x, y in zip(got, want, strict=True))


def test_a_set_on_s3_without_a_split_file_names_its_uri(s3, small_store, tmp_path):
    made = build_synthetic_vqa(small_store.path, tmp_path / "vqa")
    uri = s3.upload(made.path, f"finetune-{uuid.uuid4().hex[:8]}/vqa")
    s3.delete(f"{uri.removeprefix(f's3://{S3_BUCKET}/')}/valid.parquet")
    with pytest.raises(FinetuneError, match=f"{uri}/valid.parquet: split file listed in manifest.json is missing"):
        open_finetune(uri)
