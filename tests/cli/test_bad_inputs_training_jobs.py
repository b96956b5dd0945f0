"""Bad input to the training jobs (jobs/pretrain.py, jobs/finetune.py, jobs/train_mult.py): their flags,
--set values and config files, each refused with one `error:` line before Ray, MLflow or any data
start, the user's folder unchanged (bad_input_harness)."""

from __future__ import annotations

import pytest
from bad_input_harness import Bad, run_bad, sets

CONFIG = "--config"

PRETRAIN = [
    Bad("bool-given-a-number", sets("train.compile=1"), ["train.compile = 1", "expected true or false", "a number"]),
    Bad("int-given-a-fraction", sets("train.epochs=2.0"), ["train.epochs = 2.0", "an integer >= 1", "(write 2)"]),
    Bad("int-given-quoted-text", sets("train.batch_size='64'"), ["train.batch_size = '64'", "without them"]),
    Bad("float-given-a-bool", sets("optim.lr=true"), ["optim.lr = True", "a finite number > 0", "true or false"]),
    Bad("bool-given-a-word", sets("tasks.qa=maybe"), ["tasks.qa = 'maybe'", "true or false"]),
    Bad("betas-one-item", sets("optim.betas=[0.9]"), ["optim.betas.1: required"]),
    Bad("betas-three-items", sets("optim.betas=[0.9, 0.99, 0.999]"), ["optim.betas", "at most 2 items"]),
    Bad("warmup-ratio-one-in-a-file", [CONFIG, "c.yaml"], ["c.yaml", "optim.warmup_ratio = 1", "[0, 1)"],
        files={"c.yaml": "optim:\n  lr: 1e-3\n  warmup_ratio: 1\n"}),
    Bad("section-given-a-value", [CONFIG, "c.yaml"], ["c.yaml", "train = 3"], files={"c.yaml": "train: 3\n"}),
    Bad("config-not-utf8", [CONFIG, "c.yaml"], ["c.yaml", "not UTF-8"], files={"c.yaml": b"train:\n  epochs: \xff\xfe\n"}),
    Bad("fault-at-step-zero", sets("train.fail_at_step=[0]"), ["train.fail_at_step.0 = 0", ">= 1"]),
    Bad("negative-seed", ["--seed", "-1"], ["train.seed = -1", "[0, 4294967296)"]),
    Bad("seed-beyond-numpy", ["--seed", "4294967296"], ["train.seed = 4294967296", "[0, 4294967296)"]),
    Bad("seed-with-a-fraction", ["--seed", "1.5"], ["train.seed = 1.5", "an integer"]),
    Bad("zero-workers", ["--num-workers", "0"], ["scale.num_workers = 0", ">= 1"]),
    Bad("fractional-workers", ["--num-workers", "1.5"], ["scale.num_workers = 1.5", "an integer"]),
    Bad("negative-gpus", ["--gpus-per-worker", "-1"], ["scale.gpus_per_worker = -1", ">= 0"]),
    Bad("placement-lower-case", sets("scale.placement_strategy=spread"), ["scale.placement_strategy", "'spread'",
                                                                           "'SPREAD'"]),
    Bad("outage-wait-above-an-hour", sets("mlflow.outage_wait_s=4000"), ["mlflow.outage_wait_s = 4000", "[0, 3600]"]),
    Bad("register-name-with-a-slash", ["--register", "team/model"], ["mlflow.registered_model", "'team/model'"]),
    Bad("zero-heads", sets("model.num_heads=0"), ["model.num_heads = 0", ">= 1"]),
    Bad("empty-storage-path", ["--storage-path", ""], ["scale.storage_path = ''", "a non-empty string"]),
    Bad("negative-mask-probability", sets("data.masking.word_mask_prob=-0.1"),
        ["data.masking.word_mask_prob = -0.1", "[0, 1]"]),
    Bad("eval-every-zero", sets("train.eval_every=0"), ["train.eval_every = 0", ">= 1"]),
    Bad("run-name-dot-dot", ["--run-name", ".."], ["mlflow.run_name", "'..'"]),
    Bad("set-without-a-key", sets("=3"), ["--set '=3'", "KEY=VALUE"]),
    Bad("model-section-a-list", [CONFIG, "c.yaml"], ["c.yaml", "model"], files={"c.yaml": "model: [1, 2]\n"}),
    Bad("best-mode-maximum", sets("train.best_mode=maximum"), ["train.best_mode", "'maximum'", "'max'"]),
    Bad("empty-experiment", ["--experiment", ""], ["mlflow.experiment = ''", "a non-empty string"]),
    Bad("store-is-a-file", ["--store", "notes.txt"], ["data.store", "notes.txt", "feature store does not exist (build it with"], files={"notes.txt": "my notes\n"}),
    Bad("store-half-uri", ["--store", "s3:/bucket/store"], ["data.store", "'s3:/bucket/store'"]),
    Bad("synthetic-images-fraction", sets("data.synthetic.num_images=1e3"),
        ["data.synthetic.num_images = 1000.0", "(write 1000)"]),
    Bad("qa-from-fraction-one", sets("schedule.qa_from_fraction=1"), ["schedule.qa_from_fraction = 1", "[0, 1)"]),
    Bad("examples-count-true", sets("examples.count=true"), ["examples.count = True", "an integer in [0, 1000]"]),
    # a flag of text is text whatever it looks like: only the bad value beside it is named
    Bad("text-flags-that-look-like-numbers", ["--run-name", "2024", "--experiment", "1e3", "--register", "7", *sets(
        "train.epochs=0")], ["train.epochs = 0"],
        not_said=["mlflow.run_name =", "mlflow.experiment =", "mlflow.registered_model ="]),
    # a flag is `--set KEY=...`: beside a --set of its key, one of them would be dropped
    Bad("seed-flag-and-set", ["--seed", "2", *sets("train.seed=1")],
        ["--seed 2 and --set train.seed=1 both set train.seed", "expected one of them"]),
    Bad("run-name-flag-and-set", sets("mlflow.run_name=a") + ["--run-name", "b"],
        ["--run-name b", "--set mlflow.run_name=a", "both set mlflow.run_name"]),
    Bad("storage-path-flag-and-set", ["--storage-path", "x", *sets("scale.storage_path=y")],
        ["--storage-path x", "--set scale.storage_path=y", "both set scale.storage_path"]),
    Bad("workers-flag-and-set-of-the-section", ["--num-workers", "2", *sets("scale={num_workers: 1}")],
        ["--num-workers 2", "scale={num_workers: 1}", "both set scale.num_workers", "sets all of scale"]),
    Bad("recipe-flag-and-set", ["--recipe", "lxmert-pretrain", *sets("recipe=lxmert-pretrain")],
        ["--recipe lxmert-pretrain", "--set recipe=lxmert-pretrain", "both set recipe"]),
    # a key twice in --set: the first value (bad or not) would be thrown away
    Bad("set-key-twice", sets("train.max_steps=0", "train.max_steps=2"),
        ["--set train.max_steps=0 and --set train.max_steps=2 both set train.max_steps", "expected each key once"]),
    Bad("set-key-then-its-section", sets("train.epochs=1", "train={}"),
        ["--set train.epochs=1", "train={}", "both set train.epochs", "sets all of train", "each key once"]),
    Bad("set-section-then-its-key", sets("optim={lr: 0.1}", "optim.lr=0.2"),
        ["optim={lr: 0.1}", "--set optim.lr=0.2", "both set optim.lr", "each key once"]),
    Bad("set-list-then-an-item", sets("train.fail_at_step=[3]", "train.fail_at_step.0=4"),
        ["both set train.fail_at_step.0"]),
    # another layer is no conflict: --set over --config, --set over the recipe (only the bad value is named)
    Bad("set-over-config-and-recipe", [CONFIG, "c.yaml", "--recipe", "lxmert-pretrain",
                                       *sets("train.epochs=3", "train.batch_size=0")],
        ["train.batch_size = 0"], files={"c.yaml": "train:\n  epochs: 2\n"}, not_said=["both set"]),
    Bad("run-name-spaces", ["--run-name", " "], ["mlflow.run_name", "' '", "non-empty name"]),
    Bad("run-name-trailing-space", ["--run-name", "run "], ["mlflow.run_name", "'run '", "trailing spaces"]),
    Bad("experiment-spaces", ["--experiment", "  "], ["mlflow.experiment", "'  '", "non-empty name"]),
    Bad("run-name-spaces-in-a-file", [CONFIG, "c.yaml"], ["c.yaml", "mlflow.run_name", "' '"],
        files={"c.yaml": "mlflow:\n  run_name: ' '\n"}),
]

FINETUNE = [
    Bad("task-in-capitals", ["--task", "VQA"], ["task", "'VQA'", "'vqa'"]),
    Bad("answer-head-switch-a-number", sets("init.answer_head_from_qa=1"), ["init.answer_head_from_qa = 1",
                                                                             "true or false"]),
    Bad("condition-twice", sets("robust.conditions=[feat_noise, feat_noise]"), ["robust.conditions", "once"]),
    Bad("unknown-condition", sets("robust.conditions=[blur]"), ["robust.conditions.0", "'blur'", "'feat_noise'"]),
    Bad("noise-sigma-zero", sets("robust.noise_sigma=0"), ["robust.noise_sigma = 0", "(0, 10]"]),
    Bad("noise-sigma-above-ten", sets("robust.noise_sigma=11"), ["robust.noise_sigma = 11", "(0, 10]"]),
    Bad("examples-count-true", sets("examples.count=true"), ["examples.count = True", "an integer in [0, 1000]"]),
    Bad("examples-count-negative", sets("examples.count=-1"), ["examples.count = -1", "[0, 1000]"]),
    Bad("examples-of-the-train-split", sets("examples.split=train"), ["examples.split", "'train'"]),
    Bad("transformers-without-a-path", ["--init", "transformers"], ["init.path", "required", "--init-path"]),
    Bad("checkpoint-is-a-text-file", ["--init", "checkpoint", "--init-path", "notes.txt"], ["init.path", "notes.txt"],
        files={"notes.txt": "my notes\n"}),
    Bad("qa-loss-unknown", sets("qa_loss=mse"), ["qa_loss", "'mse'"]),
    Bad("questions-per-image-zero", sets("data.synthetic_questions_per_image=0"),
        ["data.synthetic_questions_per_image = 0", ">= 1"]),
    Bad("empty-init-run-id", ["--init", "run", "--init-run-id", ""], ["init.run_id", "''"]),
    Bad("config-run-without-id", [CONFIG, "c.yaml"], ["c.yaml", "init.run_id", "required"],
        files={"c.yaml": "init:\n  source: run\n"}),
    Bad("config-task-a-list", [CONFIG, "c.yaml"], ["c.yaml", "task", "['vqa']"], files={"c.yaml": "task: [vqa]\n"}),
    Bad("hidden-not-multiple-of-heads", ["--init", "scratch", *sets("preset=tiny", "model.hidden_size=13")],
        ["model.hidden_size", "13"]),
    Bad("store-half-uri", ["--store", "s3:/bucket/set"], ["data.store", "'s3:/bucket/set'"]),
    Bad("reference-path-is-a-folder", ["--init", "reference", "--init-path", "snap"], ["init.path", "snap"],
        files={"snap": None}),
    Bad("empty-pretrain-experiment", sets("init.pretrain_experiment="), ["init.pretrain_experiment = ''"]),
    Bad("eval-batches-zero", sets("data.eval_batches=0"), ["data.eval_batches = 0", ">= 1"]),
    Bad("robust-seed-text", sets("robust.seed=abc"), ["robust.seed = 'abc'", "an integer"]),
    Bad("init-run-id-of-digits-is-text", ["--init", "run", "--init-run-id", "0123e4", *sets("train.epochs=0")],
        ["train.epochs = 0"], not_said=["init.run_id ="]),
    Bad("store-flag-and-set", ["--store", "a", *sets("data.store=b")],
        ["--store a and --set data.store=b both set data.store", "expected one of them"]),
    Bad("init-flag-and-set", ["--init", "scratch", *sets("init.source=latest")],
        ["--init scratch", "--set init.source=latest", "both set init.source"]),
    Bad("task-twice-in-set", sets("task=vqa", "task=gqa"), ["--set task=vqa and --set task=gqa", "each key once"]),
    Bad("run-name-spaces", ["--run-name", "\t"], ["mlflow.run_name", "'\\t'", "non-empty name"]),
]

MULT = [
    Bad("seed-with-a-fraction", ["--seeds", "1.5"], ["seeds.0 = 1.5", "an integer"]),
    Bad("no-seeds", ["--seeds", ""], ["seeds", "at least 1 item"]),
    Bad("negative-seed", ["--seeds", "-1"], ["seeds.0 = -1", "[0, 4294967296)"]),
    Bad("seeds-as-words", ["--seeds", "a,b"], ["seeds.0 = 'a'", "an integer"]),
    Bad("unknown-variant", sets("model.variant=full_fusion"), ["model.variant", "'full_fusion'", "'early_fusion'"]),
    Bad("zero-layers", sets("model.layers=0"), ["model.layers = 0", ">= 1"]),
    Bad("unknown-loss", sets("regression_loss=l3"), ["regression_loss", "'l3'", "'smooth_l1'"]),
    Bad("fraction-a-bool", sets("data.synthetic.valid_fraction=true"), ["data.synthetic.valid_fraction = True"]),
    Bad("grad-accum-zero", sets("train.grad_accum=0"), ["train.grad_accum = 0", ">= 1"]),
    Bad("cpus-per-worker-zero", sets("scale.cpus_per_worker=0"), ["scale.cpus_per_worker = 0", "> 0"]),
    Bad("condition-twice", sets("robust.conditions=[zero_audio, zero_audio]"), ["robust.conditions", "once"]),
    Bad("unknown-condition", sets("robust.conditions=[mute]"), ["robust.conditions.0", "'mute'"]),
    Bad("negative-dim", sets("preset=reference", "model.dim=-3"), ["model.dim = -3"]),
    Bad("config-seed-with-a-fraction", [CONFIG, "c.yaml"], ["c.yaml", "seeds.1 = 2.0", "(write 2)"],
        files={"c.yaml": "seeds: [1, 2.0]\n"}),
    Bad("keep-best-zero", sets("train.keep_best=0"), ["train.keep_best = 0", ">= 1"]),
    Bad("eps-zero", sets("optim.eps=0"), ["optim.eps = 0", "> 0"]),
    Bad("negative-grad-clip", sets("optim.grad_clip=-1"), ["optim.grad_clip = -1", ">= 0"]),
    Bad("negative-attention-dropout", sets("model.attn_dropout=-0.1"), ["model.attn_dropout = -0.1", "[0, 1)"]),
    Bad("store-is-a-file", ["--store", "clips.pkl"], ["data.store", "clips.pkl"], files={"clips.pkl": "x"}),
    Bad("unknown-f1-protocol", sets("f1_protocol=macro"), ["f1_protocol", "'macro'"]),
    Bad("preset-of-another-job", sets("preset=paper"), ["preset", "'paper'", "'paper_mosei'"]),
    Bad("config-unknown-key-in-model", [CONFIG, "c.yaml"], ["c.yaml", "model.dimension", "unknown key"],
        files={"c.yaml": "model:\n  dimension: 40\n"}),
    Bad("seeds-set-and-flag", [*sets("seeds=[1,2]"), "--seeds", "3,4"],
        ["--seeds 3,4", "--set 'seeds=[1,2]'", "both set seeds", "expected one of them"]),
    Bad("seeds-twice-in-set", sets("seeds=[1]", "seeds=[2]"), ["both set seeds", "each key once"]),
    Bad("workers-flag-and-set", ["--num-workers", "2", *sets("scale.num_workers=1")],
        ["--num-workers 2 and --set scale.num_workers=1 both set scale.num_workers"]),
    Bad("run-name-spaces", ["--run-name", " "], ["mlflow.run_name", "' '", "non-empty name"]),
]


@pytest.mark.parametrize("case", PRETRAIN, ids=[c.id for c in PRETRAIN])
def test_pretrain(case, tmp_path, monkeypatch, capsys):
    run_bad("pretrain.py", case, tmp_path, monkeypatch, capsys)


@pytest.mark.parametrize("case", FINETUNE, ids=[c.id for c in FINETUNE])
def test_finetune(case, tmp_path, monkeypatch, capsys):
    run_bad("finetune.py", case, tmp_path, monkeypatch, capsys)


@pytest.mark.parametrize("case", MULT, ids=[c.id for c in MULT])
def test_train_mult(case, tmp_path, monkeypatch, capsys):
    run_bad("train_mult.py", case, tmp_path, monkeypatch, capsys)


def test_each_table_holds_twenty_cases_or_more():
    for table in (PRETRAIN, FINETUNE, MULT):
        assert len(table) >= 20 and len({c.id for c in table}) == len(table)
