import pytest

from xmodal.config import ConfigError, PretrainConfig, apply_overrides, flatten, load_config


def test_defaults_use_the_small_preset():
    cfg = load_config(PretrainConfig)
    assert cfg.preset == "small" and cfg.model.hidden_size == 64


def test_preset_plus_model_overrides(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("preset: paper\nmodel:\n  l_layers: 3\ntrain:\n  epochs: 2\n")
    cfg = load_config(PretrainConfig, f, ["model.x_layers=2"])
    assert (cfg.model.l_layers, cfg.model.r_layers, cfg.model.x_layers, cfg.model.hidden_size) == (3, 5, 2, 768)
    assert cfg.train.epochs == 2


@pytest.mark.parametrize("override, expected", [
    ("model.hiden=3", ["model.hiden: unknown key", "hidden_size"]),
    ("trian.epochs=3", ["trian: unknown key", "train"]),
    ("train.epochs=many", ["train.epochs", "valid integer", "'many'"]),
    ("train.precision=fp8", ["train.precision", "'fp32'", "'bf16'", "'fp8'"]),
    ("preset=huge", ["preset", "'small'", "'paper'", "'huge'"]),
    ("tasks.feat_loss=l3", ["tasks.feat_loss", "'l2'", "'smooth_l1'"]),
    ("train.best_metric=eval/bleu", ["train.best_metric", "eval/bleu", "eval/match_acc"]),
])
def test_bad_values_name_key_value_and_choices(override, expected):
    with pytest.raises(ConfigError) as e:
        load_config(PretrainConfig, overrides=[override])
    for piece in expected:
        assert piece in str(e.value)


def test_all_tasks_off_is_an_error():
    off = [f"tasks.{t}=false" for t in ("mlm", "obj_feat", "obj_label", "matching", "qa")]
    with pytest.raises(ConfigError, match="every pretraining task is switched off"):
        load_config(PretrainConfig, overrides=off)


def test_bad_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(PretrainConfig, tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("train: [1, 2\n")
    with pytest.raises(ConfigError, match="bad.yaml: not valid YAML"):
        load_config(PretrainConfig, bad)
    lst = tmp_path / "list.yaml"
    lst.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(PretrainConfig, lst)
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("train:\n  epoch: 3\n")
    with pytest.raises(ConfigError, match=r"unknown.yaml\):\n  train.epoch: unknown key"):
        load_config(PretrainConfig, unknown)


def test_override_syntax_errors():
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        apply_overrides({}, ["train.epochs"])
    with pytest.raises(ConfigError, match="is a value, not a section"):
        apply_overrides({"preset": "tiny"}, ["preset.x=1"])


def test_flatten_gives_dotted_params():
    flat = flatten(load_config(PretrainConfig))
    assert flat["model.hidden_size"] == 64 and flat["tasks.mlm"] is True and flat["optim.lr"] == 2e-3
    assert flat["model.initializer_range"] == 0.1  # named in the run's MLflow params


def test_partial_section_override_keeps_the_jobs_other_defaults():
    from xmodal.config import MultTrainConfig

    cfg = load_config(PretrainConfig, overrides=["train.epochs=2"])
    assert (cfg.train.epochs, cfg.train.batch_size, cfg.optim.lr) == (2, 64, 2e-3)
    mult = load_config(MultTrainConfig, overrides=["train.epochs=3"])
    assert (mult.train.epochs, mult.train.best_metric, mult.optim.grad_clip) == (3, "valid/mae", 0.8)


def test_mult_config_rejects_bad_model_values():
    from xmodal.config import MultTrainConfig

    with pytest.raises(ConfigError, match="model.variant = 'xx': expected 'full'.*'early_fusion'"):
        load_config(MultTrainConfig, overrides=["model.variant=xx"])
    with pytest.raises(ConfigError, match="model.dim = 31: expected a multiple of num_heads = 5"):
        load_config(MultTrainConfig, overrides=["preset=reference", "model.dim=31"])
