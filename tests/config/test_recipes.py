"""Recipes (`config/recipes.py`): each sets what it says on the job's config, a key the user sets wins and
is named, and the run's banner and MLflow params carry it."""

from __future__ import annotations

import json

import pytest

from xmodal.config.experiment import ConfigError, flatten, load_config
from xmodal.config.paths import config_has
from xmodal.config.recipes import RECIPES, banner_lines, describe, overrides, recipe_params, recipes_for
from xmodal.jobs.chain_config import PretrainFinetuneConfig
from xmodal.jobs.finetune_config import FinetuneConfig
from xmodal.jobs.mult_config import MultTrainConfig
from xmodal.jobs.pretrain_config import PretrainConfig

CONFIGS = {"pretrain": PretrainConfig, "finetune": FinetuneConfig, "mult": MultTrainConfig}


def _value(cfg, key: str):
    return flatten(cfg)[key]


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_each_recipe_sets_every_value_it_names_with_its_source(name):
    recipe = RECIPES[name]
    config_class = CONFIGS[recipe.job]
    cfg = load_config(config_class, overrides=[f"recipe={name}"])
    assert cfg.recipe == name and recipe.settings
    for key, setting in recipe.settings.items():
        assert config_has(config_class, key), key
        assert _value(cfg, key) == json.loads(json.dumps(setting.value)), key
        assert setting.source.strip() and ":" in setting.source, key  # a file (or paper section) and where in it
    assert overrides(cfg, flatten(cfg)) == []
    assert recipe_params(cfg, flatten(cfg)) == {"recipe_overrides": "none"}


def test_the_reference_values_of_the_issue():
    vqa = load_config(FinetuneConfig, overrides=["recipe=lxmert-vqa"])
    assert (vqa.optim.name, vqa.optim.schedule, vqa.optim.decay_on, vqa.optim.lr, vqa.optim.warmup_ratio,
            vqa.optim.grad_clip, vqa.optim.embedding_row0, vqa.train.batch_size, vqa.train.epochs) == \
        ("bertadam", "linear", "all", 5e-5, 0.1, 5.0, "no_grad", 32, 4)
    assert load_config(FinetuneConfig, overrides=["recipe=lxmert-gqa"]).optim.lr == 1e-5
    pre = load_config(PretrainConfig, overrides=["recipe=lxmert-pretrain"])
    assert (pre.optim.lr, pre.optim.warmup_ratio, pre.optim.grad_clip, pre.train.batch_size, pre.train.epochs) == \
        (1e-4, 0.05, 1.0, 256, 20)
    assert load_config(PretrainConfig, overrides=["recipe=lxmert-pretrain-paper"]).schedule.qa_from_fraction == 0.5
    mult = load_config(MultTrainConfig, overrides=["recipe=mult-reference"])
    assert (mult.optim.name, mult.optim.schedule, mult.optim.lr, mult.optim.plateau.patience,
            mult.optim.plateau.factor, mult.optim.plateau.metric, mult.optim.grad_clip, mult.train.batch_size,
            mult.train.epochs) == ("adam", "plateau", 1e-3, 20, 0.1, "valid/loss", 0.8, 24, 40)


def test_a_key_the_user_sets_wins_and_is_named_on_the_banner_and_in_the_params(tmp_path):
    (tmp_path / "c.yaml").write_text("recipe: lxmert-vqa\noptim:\n  lr: 1.0e-5\n")
    cfg = load_config(FinetuneConfig, tmp_path / "c.yaml", ["train.epochs=2"])
    flat = flatten(cfg)
    assert cfg.optim.lr == 1e-5 and cfg.train.epochs == 2 and cfg.optim.name == "bertadam"
    assert overrides(cfg, flat) == [("optim.lr", 1e-5, 5e-5), ("train.epochs", 2, 4)]
    assert recipe_params(cfg, flat)["recipe_overrides"] == "optim.lr=1e-05 (recipe: 5e-05); train.epochs=2 (recipe: 4)"
    lines = banner_lines(cfg, flat, width=60)
    assert lines[0].startswith("lxmert-vqa (airsplay/lxmert): ") and len(lines) > 3
    assert all(len(line) <= 60 for line in lines[:-1])
    shown = " ".join(lines)
    assert all(f"{k}=" in shown for k in RECIPES["lxmert-vqa"].settings)  # each of its values
    assert lines[-1] == "overridden: optim.lr=1e-05 (recipe: 5e-05); train.epochs=2 (recipe: 4)"
    # a value set equal to the recipe's is no override; without a recipe there is no line
    same = load_config(FinetuneConfig, overrides=["recipe=lxmert-vqa", "optim.lr=5e-5"])
    assert banner_lines(same, flatten(same))[-1] == "overridden: nothing"
    assert banner_lines(load_config(FinetuneConfig), {}) == [] and recipe_params(load_config(FinetuneConfig), {}) == {}


def test_a_partial_mapping_and_a_chain_stage_take_their_recipe():
    """A sweep validates raw mappings; a chain's stages are job configs of their own."""
    cfg = MultTrainConfig.model_validate({"recipe": "mult-reference", "train": {"epochs": 3}})
    assert cfg.train.epochs == 3 and cfg.optim.schedule == "plateau" and cfg.train.batch_size == 24
    chain = load_config(PretrainFinetuneConfig, overrides=["pretrain.recipe=lxmert-pretrain", "finetune.recipe=lxmert-nlvr2",
                                                           "finetune.optim.lr=1e-5"])
    assert chain.pretrain.optim.name == "bertadam" and chain.pretrain.train.batch_size == 256
    assert chain.finetune.task == "nlvr2" and chain.finetune.nlvr2_output == "softmax" and chain.finetune.optim.lr == 1e-5
    raw = PretrainFinetuneConfig.model_validate({"finetune": {"recipe": "lxmert-gqa", "train": {"epochs": 1}}})
    assert (raw.finetune.task, raw.finetune.optim.lr, raw.finetune.train.epochs) == ("gqa", 1e-5, 1)
    assert raw.pretrain.optim.name == "adamw"  # the other stage keeps its defaults


@pytest.mark.parametrize(("job", "overrides_", "named"), [
    ("finetune", ["recipe=lxmert-mosei"], ["recipe", "'lxmert-mosei'", "lxmert-vqa", "lxmert-nlvr2-paper"]),
    ("mult", ["recipe=lxmert-vqa"], ["recipe", "'lxmert-vqa'", "mult-reference"]),
    ("finetune", ["recipe=lxmert-vqa", "optim.schedule=plateau"], ["optim.schedule", "'plateau'", "bertadam",
                                                                   "linear, constant, cosine"]),
    ("pretrain", ["optim.schedule=plateau", "optim.plateau.metric=valid/loss"],
     ["optim.plateau.metric", "'valid/loss'", "eval/loss"]),
    ("mult", ["optim.plateau.patience=3"], ["optim.plateau.patience", "optim.schedule=plateau"]),
    ("mult", ["recipe=mult-reference", "optim.warmup_ratio=0.1"], ["optim.warmup_ratio", "plateau"]),
])
def test_bad_recipe_and_schedule_input_names_the_key(job, overrides_, named):
    with pytest.raises(ConfigError) as e:
        load_config(CONFIGS[job], overrides=overrides_)
    assert all(n in str(e.value) for n in named), str(e.value)


def test_help_lists_each_recipe_value_and_its_file():
    for job in CONFIGS:
        text = describe(job)
        for name, recipe in recipes_for(job).items():
            assert f"recipe {name}: " in text
            for key, setting in recipe.settings.items():
                assert f"  {key} = {json.dumps(setting.value)}   [{setting.source}]" in text


def test_the_start_banner_shows_the_recipe_lines():
    from xmodal.base.console import banner

    cfg = load_config(MultTrainConfig, overrides=["recipe=mult-reference", "train.epochs=3"])
    text = banner(job="mult", run_name="r", data="/nowhere", train_examples=10, preset="small", parameters=1000,
                  steps=30, epochs=3, batch_size=24, workers=1, gpus_per_worker=0, tracking_uri="sqlite:///m.db",
                  experiment="e", run_id="1", storage="/runs", recipe=banner_lines(cfg, flatten(cfg)))
    lines = text.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("  recipe    mult-reference (yaohungt/"))
    assert lines[first - 1].startswith("  training ") and lines[first + 1].startswith("            ")
    assert "  overridden: train.epochs=3 (recipe: 40)" in text


def test_the_configuration_page_shows_the_recipes_as_they_are():
    from xmodal.config.recipes import markdown
    from xmodal_testing import REPO

    page = (REPO / "docs" / "configuration.md").read_text()
    start = page.index("-->\n", page.index("<!-- recipes:")) + len("-->\n")
    assert page[start:page.index("<!-- /recipes -->")] == markdown(), "regenerate the section from recipes.markdown()"
