import json
import re

import pytest

from xmodal.config.experiment import ConfigError, apply_overrides, check_each_key_once, flatten, load_config
from xmodal.config.yaml_files import load_yaml
from xmodal.jobs.pretrain_config import PretrainConfig


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
    ("train.epochs=many", ["train.epochs", "an integer >= 1, got text", "'many'"]),
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


def test_duplicate_keys_are_errors_naming_the_file_line_and_key(tmp_path):
    twice = tmp_path / "twice.yaml"
    twice.write_text("train:\n  max_steps: 40\noptim: {lr: 0.1}\ntrain:\n  epochs: 3\n")
    with pytest.raises(ConfigError, match=r"twice.yaml: .*duplicate key 'train' \(first given at line 1.*\(line 4"):
        load_config(PretrainConfig, twice)
    nested = tmp_path / "nested.yaml"
    nested.write_text("train: {epochs: 2, epochs: 3}\n")
    with pytest.raises(ConfigError, match="duplicate key 'epochs'"):
        load_config(PretrainConfig, nested)
    with pytest.raises(ConfigError, match=r"--set 'train=\{epochs: 1, epochs: 2\}'.*duplicate key 'epochs'"):
        apply_overrides({}, ["train={epochs: 1, epochs: 2}"])


def test_a_config_path_that_is_a_folder_or_not_utf8_is_named(tmp_path):
    with pytest.raises(ConfigError, match="is a directory; expected a YAML file"):
        load_config(PretrainConfig, tmp_path)
    (tmp_path / "latin1.yaml").write_bytes("train:\n  epochs: 2 # \xe9t\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError, match=r"latin1.yaml: not UTF-8 text \(byte 21\)"):
        load_config(PretrainConfig, tmp_path / "latin1.yaml")
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        apply_overrides({}, ["=3"])


def test_yaml_merge_keys_may_be_overridden_and_other_mappings_load_as_before():
    assert load_yaml("a: &x {b: 1, c: 2}\nd:\n  <<: *x\n  b: 3\n") == {"a": {"b": 1, "c": 2}, "d": {"b": 3, "c": 2}}
    assert load_yaml("a: 1\nb: [1, {c: 2}]\n") == {"a": 1, "b": [1, {"c": 2}]}


def test_a_bad_set_value_is_one_line_naming_the_item():
    with pytest.raises(ConfigError) as e:
        apply_overrides({}, ["train.fail_at_step=[1,2"])
    assert "\n" not in str(e.value) and "--set 'train.fail_at_step=[1,2'" in str(e.value), str(e.value)
    assert "expected ',' or ']'" in str(e.value) and "column 5" in str(e.value)


def test_override_syntax_errors():
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        apply_overrides({}, ["train.epochs"])
    with pytest.raises(ConfigError, match="is a value, not a section"):
        apply_overrides({"preset": "tiny"}, ["preset.x=1"])


@pytest.mark.parametrize("given, expected", [
    ([("--seed 2", "train.seed=2"), ("--set train.seed=1", "train.seed=1")],
     "--seed 2 and --set train.seed=1 both set train.seed; expected one of them"),
    ([("--set a.b=0", "a.b=0"), ("--set a.b=2", "a.b=2")], "--set a.b=0 and --set a.b=2 both set a.b; expected each key once"),
    ([("--set a.b=1", "a.b=1"), ("--set a={}", "a={}")],
     "--set a.b=1 and --set a={} both set a.b (--set a={} sets all of a); expected each key once"),
    ([("--set a={}", "a={}"), ("--set  a.b.c =1", " a.b.c =1")], "both set a.b.c (--set a={} sets all of a)"),
])
def test_a_key_set_twice_in_one_layer_is_refused_naming_both(given, expected):
    with pytest.raises(ConfigError) as e:
        check_each_key_once(given)
    assert expected in str(e.value) and "\n" not in str(e.value)


def test_distinct_keys_and_their_siblings_are_no_conflict():
    check_each_key_once([(f"--set {s}", s) for s in ("train.epoch=1", "train.epochs=2", "trains=3", "preset=tiny",
                                                     "model.hidden_size=8")])


def test_a_set_wins_over_the_file_as_before(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  epochs: 2\n")
    assert load_config(PretrainConfig, f, ["train.epochs=3"]).train.epochs == 3


@pytest.mark.parametrize("key", ["mlflow.run_name", "mlflow.experiment"])
@pytest.mark.parametrize("name", [" ", "\t", "run ", " run"])
def test_names_of_spaces_or_with_spaces_around_are_refused(key, name):
    with pytest.raises(ConfigError) as e:
        load_config(PretrainConfig, overrides=[f"{key}={json.dumps(name)}"])
    assert f"{key}: got {name!r}; expected a non-empty name without leading or trailing spaces" in str(e.value)


def test_flatten_gives_dotted_params():
    flat = flatten(load_config(PretrainConfig))
    assert flat["model.hidden_size"] == 64 and flat["tasks.mlm"] is True and flat["optim.lr"] == 2e-3
    assert flat["model.initializer_range"] == 0.1  # named in the run's MLflow params


def test_partial_section_override_keeps_the_jobs_other_defaults():
    from xmodal.jobs.mult_config import MultTrainConfig

    cfg = load_config(PretrainConfig, overrides=["train.epochs=2"])
    assert (cfg.train.epochs, cfg.train.batch_size, cfg.optim.lr) == (2, 64, 2e-3)
    mult = load_config(MultTrainConfig, overrides=["train.epochs=3"])
    assert (mult.train.epochs, mult.train.best_metric, mult.optim.grad_clip) == (3, "valid/mae", 0.8)


def test_mult_config_rejects_bad_model_values():
    from xmodal.jobs.mult_config import MultTrainConfig

    with pytest.raises(ConfigError, match="model.variant = 'xx': expected 'full'.*'early_fusion'"):
        load_config(MultTrainConfig, overrides=["model.variant=xx"])
    with pytest.raises(ConfigError, match="model.dim = 31: expected a multiple of num_heads = 5"):
        load_config(MultTrainConfig, overrides=["preset=reference", "model.dim=31"])


def test_mult_f1_protocol_takes_sklearn_or_reference():
    from xmodal.jobs.mult_config import MultTrainConfig

    assert load_config(MultTrainConfig).f1_protocol == "sklearn"
    assert load_config(MultTrainConfig, overrides=["f1_protocol=reference"]).f1_protocol == "reference"
    with pytest.raises(ConfigError, match="f1_protocol = 'macro': expected 'sklearn' or 'reference'"):
        load_config(MultTrainConfig, overrides=["f1_protocol=macro"])


# ---------------------------------------------------------------- bounds: every bad value fails at load


@pytest.mark.parametrize("config, override, expected", [
    ("pretrain", "model.hidden_size=130", "model.hidden_size = 130: expected a multiple of num_heads = 4"),
    ("pretrain", "model.dropout=1.5", "model.dropout = 1.5: expected a number in [0, 1)"),
    ("pretrain", "model.attention_dropout=-0.1", "model.attention_dropout = -0.1: expected a number in [0, 1)"),
    ("pretrain", "model.l_layers=-1", "model.l_layers = -1: expected an integer >= 0"),
    ("pretrain", "model.num_heads=0", "model.num_heads = 0: expected an integer >= 1"),
    ("pretrain", "model.max_positions=2", "model.max_positions = 2: expected an integer >= 3"),
    ("pretrain", "model.layer_norm_eps=0", "model.layer_norm_eps = 0: expected a number > 0"),
    ("pretrain", "data.masking.word_mask_prob=2", "data.masking.word_mask_prob = 2: expected a number in [0, 1]"),
    ("pretrain", "data.masking.max_seq_len=2", "data.masking.max_seq_len = 2: expected an integer >= 3"),
    ("pretrain", "data.masking.max_seq_len=5", "data.masking.max_seq_len = 5: expected at least the store's"),
    ("pretrain", "data.masking.max_seq_len=100", "data.masking.max_seq_len = 100: expected at most "
                                                 "model.max_positions = 64"),
    ("pretrain", "data.synthetic.num_images=1", "data.synthetic.num_images = 1: expected an integer >= 2"),
    ("pretrain", "data.eval_batches=0", "data.eval_batches = 0: expected an integer >= 1"),
    ("pretrain", "tasks.visual_loss_scale=0", "tasks.visual_loss_scale = 0: expected a number > 0"),
    ("pretrain", "schedule.qa_from_fraction=1", "schedule.qa_from_fraction = 1: expected a number in [0, 1)"),
    ("pretrain", "optim.lr=0", "optim.lr = 0: expected a number > 0"),
    ("pretrain", "optim.betas=[0.9, 1.0]", "optim.betas.1 = 1.0: expected a number in [0, 1)"),
    ("pretrain", "train.epochs=0", "train.epochs = 0: expected an integer >= 1"),
    ("pretrain", "train.log_every=0", "train.log_every = 0: expected an integer >= 1"),
    ("pretrain", "train.seed=-1", "train.seed = -1: expected an integer in [0, 4294967296)"),
    ("pretrain", "scale.num_workers=0", "scale.num_workers = 0: expected an integer >= 1"),
    ("pretrain", "scale.gpus_per_worker=-1", "scale.gpus_per_worker = -1: expected a number >= 0"),
    ("pretrain", "scale.resources_per_worker={accel: -1}",
     "scale.resources_per_worker.accel = -1: expected a number >= 0"),
    ("pretrain", "mlflow.experiment=", "mlflow.experiment = '': expected a non-empty string"),
    ("pretrain", "data.store=", "data.store = '': expected a non-empty string"),
    ("mult", "model.dim=31", "model.dim = 31: expected a multiple of num_heads = 4"),
    ("mult", "model.a_kernel=2", "model.a_kernel = 2: expected an odd positive integer"),
    ("mult", "model.layers=0", "model.layers = 0: expected an integer >= 1"),
    ("mult", "model.out_dropout=1", "model.out_dropout = 1: expected a number in [0, 1)"),
    ("mult", "data.synthetic.num_samples=5", "data.synthetic.num_samples = 5: expected an integer >= 10"),
    ("mult", "data.synthetic.text_len=[4, 3]", "data.synthetic.text_len = (4, 3): expected (min, max)"),
    ("mult", "seeds=[]", "seeds = []: expected at least 1 item"),
    ("mult", "seeds=[3, 3]", "seeds = [3, 3]: expected distinct seeds"),
    ("finetune", "data.synthetic_questions_per_image=0",
     "data.synthetic_questions_per_image = 0: expected an integer >= 1"),
    ("finetune", "init.run_id=", "init.run_id = '': expected a non-empty string"),
])
def test_bounds_name_the_key_the_value_and_what_is_allowed(config, override, expected):
    from xmodal.jobs.finetune_config import FinetuneConfig
    from xmodal.jobs.mult_config import MultTrainConfig

    cls = {"pretrain": PretrainConfig, "mult": MultTrainConfig, "finetune": FinetuneConfig}[config]
    with pytest.raises(ConfigError) as e:
        load_config(cls, overrides=[override])
    assert expected in str(e.value)


def test_messages_are_one_line_per_problem_without_pydantic_noise():
    from xmodal.jobs.finetune_config import FinetuneConfig

    with pytest.raises(ConfigError) as e:
        load_config(FinetuneConfig, overrides=["init.source=run"])
    header, line = str(e.value).splitlines()
    assert header == "invalid config (defaults + --set init.source=run):"
    assert line.startswith("  init.run_id: required with source=run") and "--init-run-id" in line
    for noise in ("Value error", "{", "Input should", "pydantic", "For further information"):
        assert noise not in str(e.value)
    with pytest.raises(ConfigError) as e:  # two problems: two lines after the header
        load_config(PretrainConfig, overrides=["model.dropout=2", "train.epochs=0"])
    assert len(str(e.value).splitlines()) == 3


def test_zero_layers_is_a_valid_ablation():
    cfg = load_config(PretrainConfig, overrides=["model.l_layers=0", "model.r_layers=0", "model.x_layers=0"])
    assert (cfg.model.l_layers, cfg.model.r_layers, cfg.model.x_layers) == (0, 0, 0)


@pytest.mark.parametrize("uri", ["sqlite:///mlflow.db", "sqlite:////abs/mlflow.db", "http://127.0.0.1:5000",
                                 "https://mlflow.example.org", "file:///tmp/mlruns", "postgresql://u@h/db",
                                 "databricks://profile"])
def test_tracking_uris_mlflow_takes(uri):
    assert load_config(PretrainConfig, overrides=[f"mlflow.tracking_uri={uri}"]).mlflow.tracking_uri == uri


@pytest.mark.parametrize("uri, expected", [
    ("mlflow.db", "use sqlite:///PATH (a SQLite file, e.g. sqlite:///mlflow.db)"),
    ("./mlruns", "not a URI"),
    ("databricks", "not a URI"),  # MLflow takes it, xmodal.tracking.resolve_tracking_uri does not
    ("C:\\\\runs\\\\mlflow.db", "not a URI"),
    ("sqlite://mlflow.db", "sqlite:///RELATIVE/PATH"),
    ("http://", "expected http(s)://HOST[:PORT]"),
])
def test_tracking_uri_that_is_not_a_uri(uri, expected):
    with pytest.raises(ConfigError) as e:
        load_config(PretrainConfig, overrides=[f"mlflow.tracking_uri={uri}"])
    assert "mlflow.tracking_uri" in str(e.value) and expected in str(e.value)


@pytest.mark.parametrize("config", ["pretrain", "mult", "finetune"])
def test_batch_size_splits_over_workers_and_accumulation(config):
    from xmodal.jobs.finetune_config import FinetuneConfig
    from xmodal.jobs.mult_config import MultTrainConfig

    cls = {"pretrain": PretrainConfig, "mult": MultTrainConfig, "finetune": FinetuneConfig}[config]
    ok = load_config(cls, overrides=["train.batch_size=12", "scale.num_workers=2", "train.grad_accum=3"])
    assert ok.train.batch_size == 12
    with pytest.raises(ConfigError, match=r"train.batch_size = 10: expected a multiple of scale.num_workers x "
                                          r"train.grad_accum = 2 x 3 = 6"):
        load_config(cls, overrides=["train.batch_size=10", "scale.num_workers=2", "train.grad_accum=3"])


def test_chain_checks_both_stages_batches_against_its_scale():
    from xmodal.jobs.chain_config import PretrainFinetuneConfig

    with pytest.raises(ConfigError, match=r"finetune.train.batch_size = 32: expected a multiple .* = 3"):
        load_config(PretrainFinetuneConfig, overrides=["scale.num_workers=3", "pretrain.train.batch_size=63"])


def test_a_chains_pretraining_stage_builds_the_preset_it_names():
    """`pretrain.preset=NAME` of a chain: the stage's model is that preset, its `model` keys on top (the
    chain's defaults gave the stage the default preset's whole model, taken for overrides: a chain asked
    for `paper` trained `small` and logged `paper`)."""
    from xmodal.jobs.chain_config import PretrainFinetuneConfig
    from xmodal.models.lxmert.model import PRESETS

    for name in PRESETS:
        assert load_config(PretrainFinetuneConfig, overrides=[f"pretrain.preset={name}"]).pretrain.model == PRESETS[name]
    cfg = load_config(PretrainFinetuneConfig, overrides=["pretrain.preset=paper", "pretrain.model.x_layers=2"])
    assert cfg.pretrain.model == PRESETS["paper"].replace(x_layers=2)
    raw = PretrainFinetuneConfig.model_validate({"pretrain": {"preset": "tiny"}})  # a sweep trial's dict
    assert raw.pretrain.model == PRESETS["tiny"] and raw.finetune.model == PRESETS["small"]


def test_every_preset_is_valid_and_checkpoint_every_is_gone():
    from xmodal.config.experiment import TrainConfig
    from xmodal.jobs.mult_config import MultTrainConfig
    from xmodal.models.lxmert.model import PRESETS as LXMERT
    from xmodal.models.mult.config import PRESETS as MULT

    for name in LXMERT:
        load_config(PretrainConfig, overrides=[f"preset={name}"])
    for name in MULT:
        load_config(MultTrainConfig, overrides=[f"preset={name}"])
    assert "checkpoint_every" not in TrainConfig.model_fields


# ---------------------------------------------------------------- non-finite numbers


def _float_keys(cls) -> list[str]:
    """The dotted key of every float option of a job's default config (not inside lists or tuples)."""
    from xmodal.config.paths import config_values

    return [".".join(loc) for loc, v in config_values(load_config(cls))
            if isinstance(v, float) and all(isinstance(p, str) for p in loc)]


@pytest.mark.parametrize("job", ["pretrain", "finetune", "mult"])
def test_every_float_option_rejects_inf_and_nan(job):
    from xmodal.jobs.finetune_config import FinetuneConfig
    from xmodal.jobs.mult_config import MultTrainConfig

    cls = {"pretrain": PretrainConfig, "mult": MultTrainConfig, "finetune": FinetuneConfig}[job]
    keys = _float_keys(cls)
    assert {"optim.lr", "train.fault_seed"} & set(keys) == {"optim.lr"} and len(keys) > 10, keys
    for key in keys:
        for bad in ("inf", "-inf", "nan", ".inf", "1e999"):
            with pytest.raises(ConfigError) as e:
                load_config(cls, overrides=[f"{key}={bad}"])
            assert f"  {key} = " in str(e.value) and "a finite number" in str(e.value), (key, bad, str(e.value))


@pytest.mark.parametrize("cls, override, expected", [
    (PretrainConfig, "optim.lr=inf", "optim.lr = 'inf': expected a finite number > 0, got text"),
    (PretrainConfig, "optim.lr=nan", "optim.lr = 'nan': expected a finite number > 0"),
    (PretrainConfig, "optim.betas=[.nan, 0.9]", "optim.betas.0 = nan: expected a finite number in [0, 1)"),
    (PretrainConfig, "scale.resources_per_worker={accel: .inf}",
     "scale.resources_per_worker.accel = inf: expected a finite number >= 0"),
    ("chain", "pretrain.model.initializer_range=inf", "pretrain.model.initializer_range = 'inf': expected a finite "
                                                      "number > 0, got text"),
    ("chain", "pretrain.model.initializer_range=.inf", "pretrain.model.initializer_range = inf: expected a finite "
                                                       "number > 0"),
])
def test_non_finite_values_name_the_key_and_what_is_allowed(cls, override, expected):
    from xmodal.jobs.chain_config import PretrainFinetuneConfig

    with pytest.raises(ConfigError) as e:
        load_config(PretrainFinetuneConfig if cls == "chain" else cls, overrides=[override])
    assert expected in str(e.value)


# ---------------------------------------------------------------- options that nothing uses


@pytest.mark.parametrize("job, overrides, expected", [
    ("finetune", ["nlvr2_output=softmax"], "nlvr2_output = 'softmax': only used by the NLVR2 classifier (task=nlvr2), "
                                           "but task='vqa'; drop it"),
    ("finetune", ["task=nlvr2", "qa_loss=ce"], "qa_loss = 'ce': only used by the VQA and GQA answer loss"),
    ("finetune", ["task=nlvr2", "qa_loss=bce"], "qa_loss = 'bce': only used"),  # given, even at its default
    ("finetune", ["init.source=transformers", "init.path=hf", "init.answer_head_from_qa=false"],
     "init.answer_head_from_qa = False: only used when a VQA or GQA answer head starts from pretrained weights"),
    ("finetune", ["robust.conditions=[shuffle_boxes]", "robust.noise_sigma=2"],
     "robust.noise_sigma = 2.0: only used by the feat_noise condition (in robust.conditions), but "
     "robust.conditions=['shuffle_boxes']"),
    ("finetune", ["data.store=set", "data.synthetic_questions_per_image=3"],
     "data.synthetic_questions_per_image = 3: only used to build the embedded VQA or GQA set"),
    ("finetune", ["task=nlvr2", "data.synthetic_questions_per_image=3"], "but task='nlvr2'"),
    ("finetune", ["init.source=checkpoint", "init.path=ck", "preset=tiny"],
     "preset = 'tiny': only used to build the model from scratch"),
    ("finetune", ["init.source=run", "init.run_id=abc", "model.hidden_size=128"],
     "model.hidden_size = 128: only used to build the model from scratch (init.source=scratch, or latest when no "
     "pretraining run is found), but init.source=run takes the architecture from its weights; drop it, or fine-tune "
     "from scratch (--init scratch)"),
    ("mult", ["robust.conditions=[zero_text, zero_audio]", "robust.noise_sigma=1"], "robust.noise_sigma = 1.0"),
    ("mult", ["robust.conditions=[zero_text]", "robust.seed=5"], "robust.seed = 5: only used by the noise_* conditions"),
    ("mult", ["data.store=st", "data.synthetic.num_samples=50"], "data.synthetic.num_samples = 50: only used to build "
                                                                 "the embedded synthetic store"),
    ("pretrain", ["tasks.obj_feat=false", "tasks.feat_loss=l2"], "tasks.feat_loss = 'l2': only used by the "
                                                                 "feature-regression task (tasks.obj_feat=true)"),
    ("pretrain", ["tasks.obj_label=false", "tasks.label_objects=all"], "tasks.label_objects = 'all'"),
    ("pretrain", ["tasks.obj_label=false", "tasks.label_confidence_weighted=true"], "tasks.label_confidence_weighted"),
    ("pretrain", ["tasks.obj_feat=false", "tasks.obj_label=false", "tasks.visual_loss_scale=6.667"],
     "tasks.visual_loss_scale = 6.667: only used by the visual tasks"),
    ("pretrain", ["tasks.qa=false", "schedule.qa_from_fraction=0.5"], "schedule.qa_from_fraction = 0.5"),
    ("pretrain", ["tasks.qa=false", "data.masking.qa_target=argmax"], "data.masking.qa_target = 'argmax'"),
    ("pretrain", ["data.store=st", "data.synthetic={num_images: 100, seed: 3}"], "data.synthetic.seed = 3"),
    ("pretrain", ["model.x_layers=0", "model.shared_cross_attention=false"], "model.shared_cross_attention = False"),
    ("pretrain", ["train.fault_seed=7"], "train.fault_seed = 7: only used to draw train.random_faults's steps"),
    ("chain", ["finetune.task=nlvr2", "finetune.qa_loss=ce"], "finetune.qa_loss = 'ce': only used by the VQA and "
                                                              "GQA answer loss (task=vqa or gqa), but task='nlvr2' "
                                                              "(in finetune)"),
])
def test_an_option_nothing_uses_is_an_error_naming_what_would(job, overrides, expected):
    from xmodal.jobs.chain_config import PretrainFinetuneConfig
    from xmodal.jobs.finetune_config import FinetuneConfig
    from xmodal.jobs.mult_config import MultTrainConfig

    cls = {"pretrain": PretrainConfig, "mult": MultTrainConfig, "finetune": FinetuneConfig,
           "chain": PretrainFinetuneConfig}[job]
    with pytest.raises(ConfigError) as e:
        load_config(cls, overrides=overrides)
    assert expected in str(e.value)


def test_options_are_fine_where_something_uses_them_and_defaults_never_trip(tmp_path):
    from xmodal.jobs.finetune_config import FinetuneConfig
    from xmodal.jobs.mult_config import MultTrainConfig

    for cls in (PretrainConfig, FinetuneConfig, MultTrainConfig):
        load_config(cls)
    load_config(FinetuneConfig, overrides=["task=nlvr2"])  # qa_loss, nlvr2_output... keep their defaults unread
    load_config(FinetuneConfig, overrides=["task=nlvr2", "nlvr2_output=softmax", "init.source=scratch"])
    load_config(FinetuneConfig, overrides=["task=gqa", "qa_loss=ce", "init.answer_head_from_qa=false"])
    load_config(FinetuneConfig, overrides=["preset=tiny"])  # latest: from scratch when no pretraining run is found
    load_config(PretrainConfig, overrides=["tasks.obj_label=false", "tasks.feat_loss=smooth_l1",
                                           "tasks.visual_loss_scale=6.667", "train.random_faults=1",
                                           "train.fault_seed=3"])
    load_config(MultTrainConfig, overrides=["robust.conditions=[noise_text]", "robust.noise_sigma=1", "robust.seed=2"])
    f = tmp_path / "c.yaml"
    f.write_text("data:\n  synthetic: {num_images: 100}\n")  # the embedded store's options, no store named
    assert load_config(PretrainConfig, f).data.synthetic.num_images == 100


def test_every_use_names_a_key_of_its_config_and_all_problems_are_listed():
    from xmodal.config.experiment import check_used
    from xmodal.config.paths import config_has
    from xmodal.jobs.registry import JOBS

    for cls in {spec.config_class for spec in JOBS.values()}:
        for use in cls.USES:
            assert config_has(cls, use.key), (cls.__name__, use.key)
    cfg = load_config(PretrainConfig, overrides=["tasks.qa=false", "tasks.obj_feat=false"])
    with pytest.raises(ConfigError) as e:  # dotted keys, as a search space assigns them
        check_used(cfg, ["schedule.qa_from_fraction", "tasks.feat_loss", "optim.lr"], "a space")
    assert str(e.value).splitlines()[0] == "invalid config (a space):"
    assert [x.split(" = ")[0] for x in str(e.value).splitlines()[1:]] == ["  tasks.feat_loss",
                                                                         "  schedule.qa_from_fraction"]


# ---------------------------------------------------------------- where a run writes: scale.storage_path


@pytest.mark.parametrize("configured, expected", [
    ("/proc/xmodal-runs", "scale.storage_path: '/proc/xmodal-runs' cannot be written"),
    ("notes/runs", "scale.storage_path: 'notes/runs' cannot be made"),
    ("s3:/runs", "scale.storage_path: 's3:/runs' looks like a URI with a slash missing"),
    ("s3:///runs", "scale.storage_path: 's3:///runs' names no bucket"),
    ("s3://my bucket/runs", "scale.storage_path: 's3://my bucket/runs' has bucket 'my bucket'"),
])
def test_storage_path_is_checked_before_any_work_and_nothing_is_made(tmp_path, monkeypatch, configured, expected):
    from xmodal.base.errors import UserError
    from xmodal.runner.ray_cluster import storage_path

    monkeypatch.chdir(tmp_path)
    (tmp_path / "notes").write_text("x")
    with pytest.raises(UserError) as e:
        storage_path(configured)
    assert expected in str(e.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes"]


def test_storage_path_from_the_environment_or_the_default_is_checked_too(tmp_path, monkeypatch):
    from xmodal.base.errors import UserError
    from xmodal.runner.ray_cluster import storage_path

    monkeypatch.setenv("XMODAL_STORAGE_PATH", "gs:bucket/runs")
    with pytest.raises(UserError, match=r"XMODAL_STORAGE_PATH \(scale.storage_path unset\): 'gs:bucket/runs' looks"):
        storage_path(None)
    assert storage_path("s3://bucket/runs") == "s3://bucket/runs"  # the config wins over the environment
    monkeypatch.delenv("XMODAL_STORAGE_PATH")
    monkeypatch.chdir("/proc")
    with pytest.raises(UserError, match=r"scale.storage_path \(unset: ./runs\): 'runs' cannot be written"):
        storage_path(None)
    monkeypatch.chdir(tmp_path)
    assert storage_path(None) == str(tmp_path.resolve() / "runs") and not (tmp_path / "runs").exists()


# ---------------------------------------------------------------- strict types: values taken as YAML typed them


@pytest.mark.parametrize("override, expected", [
    ("train.compile=1", "train.compile = 1: expected true or false, got a number"),
    ("tasks.qa=0", "tasks.qa = 0: expected true or false, got a number"),
    ("tasks.qa='true'", "tasks.qa = 'true': expected true or false, got text (in quotes: write it without them)"),
    ("train.epochs=3.0", "train.epochs = 3.0: expected an integer >= 1, got a number with a fraction (write 3)"),
    ("train.epochs=2.5", "train.epochs = 2.5: expected an integer >= 1, got a number with a fraction"),
    ("train.epochs='3'", "train.epochs = '3': expected an integer >= 1, got text (in quotes: write it without them)"),
    ("train.epochs=true", "train.epochs = True: expected an integer >= 1, got true or false"),
    ("train.epochs=[3]", "train.epochs = [3]: expected an integer >= 1, got a list"),
    ("optim.lr=true", "optim.lr = True: expected a finite number > 0, got true or false"),
    ("optim.lr='1e-3'", "optim.lr = '1e-3': expected a finite number > 0, got text (in quotes: write it without them)"),
    ("optim.betas=[0.9, false]", "optim.betas.1 = False: expected a finite number in [0, 1), got true or false"),
    ("model.hidden_size=128.0", "model.hidden_size = 128.0: expected an integer >= 1, got a number with a fraction"),
    ("data.synthetic.num_images=1e3", "data.synthetic.num_images = 1000.0: expected an integer >= 2"),
    ("train.fail_at_step=[1, 2.5]", "train.fail_at_step.1 = 2.5: expected an integer >= 1"),
    ("scale.resources_per_worker={accel: yes}", "scale.resources_per_worker.accel = True: expected a finite number >= 0"),
    ("mlflow.system_metrics=1", "mlflow.system_metrics = 1: expected true or false"),
    ("mlflow.run_name=123", "mlflow.run_name = 123: expected text (quote it: '123')"),
])
def test_values_are_taken_as_yaml_typed_them_never_converted(override, expected):
    with pytest.raises(ConfigError) as e:
        load_config(PretrainConfig, overrides=[override])
    assert f"\n  {expected}" in str(e.value), str(e.value)


def test_every_wrong_type_is_named_at_once_and_in_a_file_too(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("train:\n  epochs: 2.0\n  compile: 0\noptim:\n  lr: 5e-5\n")
    with pytest.raises(ConfigError) as e:
        load_config(PretrainConfig, f)
    lines = str(e.value).splitlines()
    assert lines[0] == f"invalid config ({f}):" and lines[1].startswith("  train.epochs = 2.0") \
        and lines[2].startswith("  train.compile = 0") and len(lines) == 3


def test_numbers_are_read_as_a_researcher_writes_them():
    # YAML 1.2's floats (PyYAML's YAML 1.1 reads 1e-3 as text), and an integer where a float is meant
    cfg = load_config(PretrainConfig, overrides=["optim.lr=1e-3", "optim.weight_decay=0", "optim.betas=[0.9, 1E-1]",
                                                 "scale.gpus_per_worker=0", "optim.eps=2.5e-8", "train.epochs=3"])
    assert (cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.betas, cfg.optim.eps, cfg.train.epochs) == \
        (1e-3, 0.0, (0.9, 0.1), 2.5e-8, 3)
    assert isinstance(cfg.optim.weight_decay, float) and isinstance(cfg.train.epochs, int)


def test_every_job_and_the_chain_are_strict():
    from xmodal.jobs.chain_config import PretrainFinetuneConfig
    from xmodal.jobs.finetune_config import FinetuneConfig
    from xmodal.jobs.mult_config import MultTrainConfig

    for cls, override, expected in ((FinetuneConfig, "examples.count=true", "examples.count = True"),
                                    (MultTrainConfig, "seeds=[1, 2.0]", "seeds.1 = 2.0"),
                                    (MultTrainConfig, "model.layers=4.0", "model.layers = 4.0"),
                                    (PretrainFinetuneConfig, "finetune.train.compile=1", "finetune.train.compile = 1"),
                                    (PretrainFinetuneConfig, "pretrain.tasks.mlm=0", "pretrain.tasks.mlm = 0")):
        with pytest.raises(ConfigError, match=re.escape(expected)):
            load_config(cls, overrides=[override])
