"""The fine-tuning job and the pretrain-then-fine-tune chain end to end: real Ray (the shared local
cluster), real MLflow (SQLite), real Parquet stores and fine-tuning sets."""

from __future__ import annotations

import csv
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from xmodal import tracking
from xmodal.config.experiment import ConfigError, load_config
from xmodal.data.finetune.sets import open_finetune
from xmodal.data.finetune.synthetic import build_synthetic_nlvr2, build_synthetic_vqa
from xmodal.data.lxmert.synthetic import build_synthetic_store
from xmodal.data.options import SyntheticLxmertOptions
from xmodal.jobs.chain_config import PretrainFinetuneConfig
from xmodal.jobs.finetune_config import FinetuneConfig
from xmodal.runner import engine
from xmodal_testing import spy_checks_and_prepares

TINY = ["preset=tiny", "train.batch_size=16", "train.eval_every=4", "train.log_every=2",
        "mlflow.system_metrics=false"]


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    root = tmp_path_factory.mktemp("finetune")
    store = build_synthetic_store(root / "images", SyntheticLxmertOptions(
        num_images=160, num_objects=8, feat_dim=16, num_object_labels=40, num_attr_labels=8, num_answers=60,
        sentences_per_image=6, minival_fraction=0.25))  # a corpus whose vocabulary spells the NLVR2 statements
    vqa = build_synthetic_vqa(store.path, root / "vqa", questions_per_image=2)
    # 156 valid pairs: no multiple of 2 workers x micro-batch 8, so the two workers' shares differ
    nlvr2 = build_synthetic_nlvr2(store.path, root / "nlvr2", statements_per_image=0.975)
    return {"images": store.path, "vqa": vqa.path, "nlvr2": nlvr2.path}


def config(tmp: Path, *overrides: str, cls=FinetuneConfig):
    return load_config(cls, overrides=[f"mlflow.tracking_uri=sqlite:///{tmp / 'mlflow.db'}",
                                       f"scale.storage_path={tmp / 'runs'}", *overrides])


def artifact(uri: str, run_id: str, path: str, tmp: Path) -> Path:
    return tracking.download_artifacts(uri, run_id, path, tmp / "artifacts" / run_id)


# ---------------------------------------------------------------- bad input, before Ray starts


@pytest.mark.parametrize("overrides, message", [
    (["init.source=run", "init.run_id=0123456789abcdef"], "init.run_id: no MLflow run '0123456789abcdef'"),
    (["init.source=checkpoint", "init.path={tmp}"], "is not a checkpoint: model.pt, meta.json missing"),
    (["init.source=transformers", "init.path={tmp}"], "init.path: .*config.json not found"),
    (["init.source=reference", "init.path={tmp}"], "init.path: .* is not a file; expected a snapshot"),
    (["init.source=reference", "init.path={tmp}/notes.pth"], "init.path: .*notes.pth: not a torch state dict file"),
    (["task=nlvr2"], "is a vqa set, but task='nlvr2'"),
    (["data.store={tmp}/nowhere"], "data.store: '.*nowhere' does not exist"),
    (["train.best_metric=valid/consistency"], "not measured on vqa; valid: valid/accuracy, valid/loss"),
    # the set fixes the model's sizes: one set otherwise was replaced silently
    (["model.visual_feat_dim=7"], r"model.visual_feat_dim: 7 set, but the model's visual_feat_dim comes from the "
                                  r"data, and the fine-tuning set .*vqa has features 16 wide; drop the key \(or set "
                                  r"it to 16\)"),
])
def test_bad_config_fails_before_ray_starts(sets, tmp_path, overrides, message):
    from xmodal.jobs.finetune_job import FinetuneJob

    overrides = [o.format(tmp=tmp_path) for o in overrides]
    (tmp_path / "notes.pth").write_text("not a checkpoint\n")
    with pytest.raises(ConfigError, match=message):
        engine.check(FinetuneJob(), config(tmp_path, f"data.store={sets['vqa']}", "init.source=scratch", *overrides))
    assert not (tmp_path / "runs").exists()


@pytest.fixture(scope="module")
def mult_run(tmp_path_factory):
    """A MulT run as jobs/train_mult.py opens it (the engine's own check and open_run: its tags say MulT), with a
    `model` artifact as its end logs one: a MulT checkpoint's model.pt and meta.json."""
    from xmodal.base import run_tags
    from xmodal.data.mult.synthetic import SyntheticMultOptions
    from xmodal.data.mult.synthetic import build_synthetic_store as build_mult
    from xmodal.jobs.mult_config import MultTrainConfig
    from xmodal.jobs.mult_job import MultJob
    from xmodal.runner import engine

    root = tmp_path_factory.mktemp("mult_run")
    store = build_mult(root / "mult", SyntheticMultOptions(num_samples=60)).path
    uri = f"sqlite:///{root / 'mlflow.db'}"
    cfg = load_config(MultTrainConfig, overrides=[f"data.store={store}", "preset=tiny", f"mlflow.tracking_uri={uri}",
                                                  "mlflow.run_name=mult", f"scale.storage_path={root / 'runs'}"])
    spec = MultJob()
    checked = engine.check(spec, cfg)
    plan = engine.open_run(spec, checked, "test", tags={run_tags.SOURCE_NAME: "jobs/train_mult.py"})
    folder = root / "ckpt"
    folder.mkdir()
    torch.save(spec.build_objective(checked.prepared.cfg, checked.prepared.data).state_dict(), folder / "model.pt")
    (folder / "meta.json").write_text(json.dumps({"step": 1, "config": plan.config.model_dump(mode="json"), "store": plan.data}))
    for f in ("model.pt", "meta.json"):
        tracking.log_artifact(uri, plan.run_id, folder / f, "model")
    tracking.set_terminated(uri, plan.run_id, "FINISHED")
    return uri, plan.run_id


def test_init_run_of_a_mult_run_is_refused_in_the_users_terms_before_any_download(mult_run, tmp_path):
    """jobs/finetune.py --init run with a MulT run: one error line saying so (not LxmertConfig's own
    TypeError), exit 2, and nothing downloaded or made under runs/."""
    from xmodal_testing import PYTHON, REPO

    uri, run_id = mult_run
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("MLFLOW_TRACKING_URI", "RAY_ADDRESS")}
    env["PYTHONPATH"] = str(REPO / "platform")
    out = subprocess.run([PYTHON, str(REPO / "jobs" / "finetune.py"), "--init", "run", "--init-run-id", run_id,
                          "--set", f"mlflow.tracking_uri={uri}"], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 2, out.stdout[-3000:] + out.stderr[-3000:]
    assert "Traceback" not in out.stdout + out.stderr
    (line,) = [x for x in out.stderr.splitlines() if x.startswith("error:")]
    assert line == (f"error: init.run_id: run '{run_id}' is a MulT run (job train_mult); --init run needs an LXMERT "
                    "pretraining or fine-tuning run")
    assert list(cwd.iterdir()) == []  # no runs/<name>/init/, no mlflow.db, no data/


def test_an_untagged_mult_run_is_refused_after_its_download_which_is_removed(mult_run, tmp_path):
    """A run whose tags do not say its model (a MulT run whose `model` tag is gone): its checkpoint is
    downloaded and read, refused in the user's terms, and the download and the folders made for it removed."""
    from mlflow import MlflowClient

    from xmodal.jobs.finetune_job import FinetuneJob

    uri, run_id = mult_run
    db = tmp_path / "mlflow.db"
    db.write_bytes(Path(uri.removeprefix("sqlite:///")).read_bytes())  # a copy: the module's run keeps its tags
    copy = f"sqlite:///{db}"
    MlflowClient(copy).delete_tag(run_id, "model")
    cfg = config(tmp_path, "init.source=run", f"init.run_id={run_id}")
    with pytest.raises(ConfigError, match=rf"init.run_id: the `model` artifact of run '{run_id}' holds a MulT model's "
                                          "checkpoint; fine-tuning needs an LXMERT pretraining or fine-tuning"):
        engine.check(FinetuneJob(), cfg.model_copy(update={"mlflow": cfg.mlflow.model_copy(update={"tracking_uri": copy})}))
    assert not (tmp_path / "runs").exists()


# ---------------------------------------------------------------- end to end


@pytest.mark.slow
def test_chain_fine_tunes_from_the_weights_its_pretraining_run_saved(sets, tmp_path, ray_local):
    from xmodal.base.run_tags import CHAIN_STAGE
    from xmodal.jobs.chain_job import ChainJob
    from xmodal.jobs.finetune_init import Init, load_init, resolve_init
    from xmodal.jobs.finetune_job import FinetuneJob
    from xmodal.jobs.pretrain_job import PretrainJob

    # The chain's own mlflow section holds system_metrics, and the fine-tuning stage takes the pretraining
    # stage's architecture (the config refuses them in the stages). Each stage trains 8 steps: two
    # evaluations of the fine-tuning (steps 4 and 8) for its selection (2 epochs, before, were 30 steps).
    stage = [o for o in TINY if not o.startswith(("mlflow.", "preset="))]
    cfg = config(tmp_path, "pretrain.preset=tiny", *[f"pretrain.{o}" for o in stage], *[f"finetune.{o}" for o in stage],
                 "mlflow.system_metrics=false",
                 f"pretrain.data.store={sets['images']}", "pretrain.train.max_steps=8",
                 f"finetune.data.store={sets['vqa']}", "finetune.train.max_steps=8", "mlflow.run_name=chain",
                 cls=PretrainFinetuneConfig)
    with pytest.MonkeyPatch.context() as mp:
        calls = spy_checks_and_prepares(mp, PretrainJob, FinetuneJob)
        out = engine.run(ChainJob(), cfg)
    # Both stages checked once, before the first starts (the chain's check is theirs); each stage then runs
    # with its checked result: its data opened once, the fine-tuning stage's weights put in once they exist.
    assert calls == {"check": ["chain", "chain-pretrain", "chain"], "prepare": ["chain-pretrain", "chain"]}
    uri = out.tracking_uri
    fine = tracking.get_run(uri, out.run_id)
    pre_id = fine.tags["pretrain_run_id"]
    pre = tracking.get_run(uri, pre_id)
    assert (pre.status, fine.status) == ("FINISHED", "FINISHED")
    assert (pre.tags[CHAIN_STAGE], fine.tags[CHAIN_STAGE]) == ("pretrain", "finetune")
    assert (fine.tags["init"], fine.tags["init_run_id"]) == ("run", pre_id)
    m = fine.metrics
    hist = [x.value for x in tracking.metric_points(uri, fine.run_id, "valid/accuracy")]
    assert len(hist) >= 2 and m["best_valid/accuracy"] == pytest.approx(max(hist))

    # The reference submission shape, one prediction per validation question, answers from the table.
    data = open_finetune(sets["vqa"])
    preds = json.loads((artifact(uri, fine.run_id, "predictions", tmp_path) / "valid_predict.json").read_text())
    assert sorted(p["question_id"] for p in preds) == sorted(data.ids("valid"))
    assert {p["answer"] for p in preds} <= set(data.answers.answers)

    # Initialising from that run by its id loads exactly the weights it saved.
    fcfg = FinetuneConfig.model_validate(json.loads(json.dumps(cfg.finetune.model_dump(mode="json"))))
    fcfg = fcfg.model_copy(update={"init": fcfg.init.model_copy(update={"source": "run", "run_id": pre_id})})
    init, model_cfg = resolve_init(fcfg.model_copy(update={"mlflow": cfg.mlflow}), str(sets["images"]), uri,
                                   tmp_path / "init")
    assert isinstance(init, Init) and init.source == "run" and init.pretrain_answers
    saved = torch.load(artifact(uri, pre_id, "model", tmp_path) / "model.pt", weights_only=True)
    objective = FinetuneJob().build_objective(fcfg.model_copy(update={"model": model_cfg}), data)
    line = load_init(objective, init, list(data.answers.answers), True)
    assert "answer head" in line
    enc = objective.model.encoder.state_dict()
    assert enc and all(torch.equal(v, saved[f"model.encoder.{k}"]) for k, v in enc.items())


@pytest.mark.slow
def test_nlvr2_on_two_workers_survives_a_worker_fault_and_writes_the_prediction_csv(sets, tmp_path, ray_local):
    from xmodal.jobs.finetune_job import FinetuneJob

    # A worker exits once at step 6; training resumes from the step-4 checkpoint with its selection, and ends
    # at step 10 (evaluations at 4, 8 and 10). The predictions cover the whole validation split whatever the
    # length, and exact resume needs no more steps after the fault (3 epochs, as before, were 79 steps a run).
    short = ["train.epochs=1", "train.max_steps=10", "scale.num_workers=2"]
    out = engine.run(FinetuneJob(), config(tmp_path, *TINY, "task=nlvr2", f"data.store={sets['nlvr2']}", "init.source=scratch",
                              *short, "train.fail_at_step=6", "mlflow.run_name=nlvr2"))
    uri = out.tracking_uri
    run = tracking.get_run(uri, out.run_id)
    assert run.status == "FINISHED" and run.tags["init"] == "scratch"
    assert {"valid/accuracy", "valid/consistency", "best_valid/consistency"} <= set(run.metrics)
    # Robustness (robust.* defaults): the validation split once more per condition, at the end only.
    for condition in ("feat_noise", "shuffle_boxes"):
        assert {f"robust/{condition}/{k}" for k in ("accuracy", "loss", "consistency")} <= set(run.metrics)
        assert len(tracking.metric_points(uri, out.run_id, f"robust/{condition}/accuracy")) == 1
    assert [m.value for m in tracking.metric_points(uri, out.run_id, "train/resumed_from_step")] == [4]
    evals = [m.step for m in tracking.metric_points(uri, out.run_id, "valid/accuracy")]
    assert evals == sorted(set(evals))  # one history: no step logged twice
    hist = [m.value for m in tracking.metric_points(uri, out.run_id, "valid/accuracy")]
    assert run.metrics["best_valid/accuracy"] == pytest.approx(max(hist))
    rows = list(csv.reader((artifact(out.tracking_uri, out.run_id, "predictions", tmp_path)
                            / "valid_predict.csv").open()))
    ids = open_finetune(sets["nlvr2"]).ids("valid")
    assert len(ids) % (2 * 8)  # the last batch is short: nothing may be dropped
    # Every pair predicted exactly once over the two workers, each reading its own row groups.
    assert len(rows) == len(ids) and sorted(r[0] for r in rows) == sorted(ids)
    assert {r[1] for r in rows} <= {"True", "False"}

    # Exact resume: the same run without the fault logs the same losses and evaluations at every step.
    clean = engine.run(FinetuneJob(), config(tmp_path, *TINY, "task=nlvr2", f"data.store={sets['nlvr2']}",
                                     "init.source=scratch", *short, "mlflow.run_name=nlvr2-clean"))
    for key in ("train/loss", "valid/accuracy", "valid/loss", "best_valid/accuracy"):
        f, c = (dict(tracking.metric_history(uri, r, key)) for r in (out.run_id, clean.run_id))
        assert f.keys() == c.keys() and f, key
        worst = max(abs(f[k] - c[k]) for k in c)
        assert worst <= 1e-5, f"{key}: the resumed run differs from the uninterrupted one by {worst}"
    # The fault fired once (its marker), on rank 1; the run's record names its workers and data.
    assert [m.name for m in (tmp_path / "runs" / "nlvr2" / ".faults").iterdir()] == ["step6-rank1"]
    assert run.tags["xmodal.repro.workers"] == "2" and run.tags["xmodal.repro.data_manifest_sha256"] != "-"
    # cost/*: the FLOPs counted on the same batch shape in each attempt; the wall time carried over the
    # restart in the checkpoints; device-hours of 2 workers x the CPUs each reserved (scale.cpus_per_worker)
    cost, clean_cost = ({k: v for k, v in tracking.get_run(uri, r).metrics.items() if k.startswith("cost/")}
                        for r in (out.run_id, clean.run_id))
    assert cost["cost/gflop_per_sample"] > 0
    assert cost["cost/gflop_per_sample"] == pytest.approx(clean_cost["cost/gflop_per_sample"])
    assert cost["cost/params"] == clean_cost["cost/params"] > 0
    assert cost["cost/samples_per_s"] > 0 and cost["cost/peak_mem_gib"] > 0.1
    with out.checkpoint.as_directory() as d:
        meta = json.loads((Path(d) / "meta.json").read_text())
    assert meta["finished"] and 0 < cost["cost/wall_s"] <= meta["wall_s"] < cost["cost/wall_s"] + 10
    cpus = config(tmp_path, *TINY).scale.cpus_per_worker
    assert cost["cost/device_hours"] == pytest.approx(cost["cost/wall_s"] * 2 * cpus / 3600)


def test_a_transformers_checkpoint_fixes_the_architecture_and_loads_through_the_adapter(sets, tmp_path):
    transformers = pytest.importorskip("transformers")
    from xmodal.jobs.finetune_init import Init, load_init
    from xmodal.jobs.finetune_job import FinetuneJob
    from xmodal.models.lxmert.init import encoder_state_from_hf_dir

    data = open_finetune(sets["vqa"])
    store = data.store.manifest
    hf_cfg = transformers.LxmertConfig(
        vocab_size=store.vocab_size, hidden_size=32, num_attention_heads=4, intermediate_size=48, l_layers=1,
        r_layers=1, x_layers=1, max_position_embeddings=40, visual_feat_dim=store.feat_dim, num_qa_labels=7)
    transformers.LxmertForPreTraining(hf_cfg).save_pretrained(tmp_path / "hf")
    job = FinetuneJob()
    checked = engine.check(job, config(tmp_path, f"data.store={sets['vqa']}", "init.source=transformers",
                               f"init.path={tmp_path / 'hf'}", "mlflow.system_metrics=false"))
    cfg = checked.prepared.cfg
    assert (cfg.model.hidden_size, cfg.model.x_layers, cfg.model.token_type_embedding) == (32, 1, True)
    objective = job.build_objective(cfg, data)
    line = load_init(objective, Init(**checked.prepared.start), list(data.answers.answers), True)
    assert line.startswith("encoder from transformers")  # no answer table in a transformers checkpoint
    _, want = encoder_state_from_hf_dir(tmp_path / "hf")
    assert all(torch.equal(v, want[f"encoder.{k}"]) for k, v in objective.model.encoder.state_dict().items())


def test_a_reference_snapshot_fixes_the_architecture_and_loads_through_the_adapter(sets, tmp_path):
    from lxmert_reference_layout import randomised, reference_pretraining
    from xmodal.jobs.finetune_init import Init, load_init
    from xmodal.jobs.finetune_job import FinetuneJob
    from xmodal.models.lxmert.model import LxmertConfig, LxmertForPretraining

    data = open_finetune(sets["vqa"])
    store = data.store.manifest
    src = randomised(LxmertForPretraining(LxmertConfig(
        vocab_size=store.vocab_size, hidden_size=64, num_heads=1, ffn_size=48, l_layers=1, r_layers=1, x_layers=1,
        max_positions=40, token_type_embedding=True, visual_feat_dim=store.feat_dim, num_qa_labels=7)))
    torch.save(reference_pretraining(src), tmp_path / "model_LXRT.pth")
    job = FinetuneJob()
    checked = engine.check(job, config(tmp_path, f"data.store={sets['vqa']}", "init.source=reference",
                               f"init.path={tmp_path / 'model_LXRT.pth'}", "mlflow.system_metrics=false"))
    assert checked.prepared.cfg.model == src.config  # the reference's architecture: 64-wide heads, token types, pooler
    assert checked.prepared.start == {"source": "reference", "path": str(tmp_path / "model_LXRT.pth"), "run_id": None,
                             "pretrain_answers": None, "tracking_uri": None}
    objective = job.build_objective(checked.prepared.cfg, data)
    line = load_init(objective, Init(**checked.prepared.start), list(data.answers.answers), True)
    assert line == f"encoder from reference {tmp_path / 'model_LXRT.pth'}"
    want = src.encoder.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in objective.model.encoder.state_dict().items())


@pytest.mark.parametrize("task", ["vqa", "gqa", "nlvr2"])
def test_every_task_builds_its_set_on_the_embedded_stores_corpus(task, tmp_path):
    """`jobs/finetune.py --task T` with no store builds T's set on the embedded store: its statements must
    fit that corpus's vocabulary and max_seq_len (16). NLVR2's "... in both images" took 17 tokens there,
    so the documented `--task nlvr2` failed on the default data. Fewer images, the same corpus rules."""
    import dataclasses

    from xmodal.data.finetune.synthetic import ensure_synthetic_finetune
    from xmodal.jobs.pretrain_config import embedded_lxmert_store

    options = dataclasses.replace(embedded_lxmert_store(), num_images=400)
    store = build_synthetic_store(tmp_path / "images", options)
    made = ensure_synthetic_finetune(task, store.path, tmp_path / task)
    assert open_finetune(made.path).task == task and len(open_finetune(made.path).split("train")) > 0
