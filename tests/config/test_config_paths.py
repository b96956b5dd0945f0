"""The config type tree's walker and the dotted-key tools on raw dicts (xmodal.config.paths)."""

import pytest

from xmodal.config.paths import (
    config_has,
    deep_merge,
    get_dotted,
    keys_beside,
    set_dotted,
    type_at,
    unknown_key,
)
from xmodal.jobs.mult_config import MultTrainConfig
from xmodal.jobs.pretrain_config import PretrainConfig


def test_type_at_follows_sections_items_and_mappings():
    assert type_at(PretrainConfig, ("model", "hidden_size"))[0] is int  # a dataclass inside a pydantic section
    assert type_at(PretrainConfig, ("train", "max_steps"))[0] is int  # `| None` and Annotated unwrapped
    assert type_at(PretrainConfig, ("train", "fail_at_step", 0))[0] is int  # a list item
    assert type_at(PretrainConfig, ("optim", "betas", 1))[0] is float  # a tuple position
    assert type_at(PretrainConfig, ("scale", "resources_per_worker", "gpu"))[0] is float  # a mapping value
    typ, meta = type_at(PretrainConfig, ("train", "epochs"))
    assert typ is int and [m.ge for m in meta] == [1]
    assert type_at(PretrainConfig, ("train", "nope")) == (None, [])


def test_dotted_keys_against_the_config_class():
    assert config_has(PretrainConfig, "train.epochs") and config_has(PretrainConfig, "model.hidden_size")
    assert not config_has(PretrainConfig, "scale.resources_per_worker.gpu")  # sections only
    assert not config_has(MultTrainConfig, "tasks")
    assert unknown_key(PretrainConfig, "train.epochs") is None
    assert unknown_key(PretrainConfig, "scale.resources_per_worker.gpu") is None  # free-form: validation judges
    assert "epochs" in unknown_key(PretrainConfig, "train.epoch")
    assert keys_beside(PretrainConfig, ("train", "epoch")) == unknown_key(PretrainConfig, "train.epoch")
    assert keys_beside(PretrainConfig, ("nope", "x")) == []


def test_set_get_and_merge_copy_and_never_change_their_input():
    base = {"train": {"epochs": 2}, "preset": "tiny"}
    out = set_dotted(base, "train.batch_size", [1])
    assert out == {"train": {"epochs": 2, "batch_size": [1]}, "preset": "tiny"}
    assert base == {"train": {"epochs": 2}, "preset": "tiny"}
    assert get_dotted(out, "train.epochs") == (True, 2) and get_dotted(out, "train.x") == (False, None)
    with pytest.raises(ValueError, match=r"^--set preset.x: 'preset' is a value, not a section$"):
        set_dotted(base, "preset.x", 1, "--set ")
    update = {"train": {"seed": [3]}}
    merged = deep_merge(base, update)
    assert merged["train"] == {"epochs": 2, "seed": [3]} and merged["train"]["seed"] is not update["train"]["seed"]
