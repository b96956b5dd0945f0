"""The MulT job end to end on the shared local Ray: selection on validation, test once, seeds."""

from __future__ import annotations

from pathlib import Path

import pytest

from xmodal import tracking
from xmodal.config.experiment import ConfigError, load_config
from xmodal.jobs.mult_config import MultTrainConfig
from xmodal.runner import engine
from xmodal_testing import spy_checks_and_prepares


@pytest.fixture(scope="module")
def mult_store(tmp_path_factory):
    from xmodal.data.mult.synthetic import SyntheticMultOptions, build_synthetic_store

    path = tmp_path_factory.mktemp("mult") / "store"
    return build_synthetic_store(path, SyntheticMultOptions(num_samples=120))  # 4 steps an epoch on 2 workers


def test_bad_best_metric_is_named_before_ray_starts(mult_store, tmp_path):
    from xmodal.jobs.mult_job import MultJob

    # A metric no MulT store measures fails at load; one of the other task's, once the store is opened.
    with pytest.raises(ConfigError, match="train.best_metric: 'valid/bleu'.*valid/mae"):
        load_config(MultTrainConfig, overrides=[f"data.store={mult_store.path}", "train.best_metric=valid/bleu"])
    cfg = load_config(MultTrainConfig, overrides=[f"data.store={mult_store.path}", "train.best_metric=valid/mean_f1",
                                                  f"mlflow.tracking_uri=sqlite:///{tmp_path / 'm.db'}"])
    with pytest.raises(ConfigError, match="train.best_metric: 'valid/mean_f1' is not measured on a sentiment store"):
        engine.check(MultJob(), cfg)
    assert not (tmp_path / "m.db").exists()


def test_run_tags_name_the_f1_protocol(mult_store):
    from xmodal.jobs.mult_job import MultJob
    from xmodal.runner.spec import PrepareContext

    for protocol in ("sklearn", "reference"):
        cfg = load_config(MultTrainConfig, overrides=[f"data.store={mult_store.path}", f"f1_protocol={protocol}"])
        tags = MultJob().prepare(cfg, PrepareContext("", Path("."), mult_store)).tags
        assert tags["f1_protocol"] == protocol and tags["task"] == "sentiment"


def test_a_model_size_the_store_fixes_is_refused_when_set_otherwise(mult_store, tmp_path):
    from xmodal.jobs.mult_job import MultJob
    from xmodal.runner.spec import PrepareContext

    text = mult_store.dims["text"]
    base = [f"data.store={mult_store.path}"]
    for key, given, message in [
        ("l_dim", text + 1, f"has text features {text} wide; drop the key (or set it to {text})"),
        ("output_dim", 8, "has the task 'sentiment', 1 output; drop the key (or set it to 1)"),
    ]:
        with pytest.raises(ConfigError) as e:
            MultJob().prepare(load_config(MultTrainConfig, overrides=[*base, f"model.{key}={given}"]),
                              PrepareContext("", tmp_path, mult_store))
        assert str(e.value).startswith(f"model.{key}: {given} set, but the model's {key} comes from the data")
        assert message in str(e.value)
    same = load_config(MultTrainConfig, overrides=[*base, f"model.l_dim={text}"])
    assert MultJob().prepare(same, PrepareContext("", tmp_path, mult_store)).cfg.model.l_dim == text


def test_pages_on_an_emotions_store_are_none_unless_asked_and_refused_when_asked(mult_store, tmp_path):
    import numpy as np

    from xmodal.data.mult.store import MODALITIES, MultSplit, write_store
    from xmodal.jobs.mult_job import MultJob
    from xmodal.runner.spec import PrepareContext

    rng = np.random.default_rng(0)
    dims = {"text": 5, "audio": 3, "vision": 2}

    def split(name: str, n: int) -> MultSplit:
        lengths = {m: rng.integers(1, 9, n) for m in MODALITIES}
        values = {m: rng.normal(size=(int(lengths[m].sum()), dims[m])).astype(np.float16) for m in MODALITIES}
        return MultSplit(name, np.array([f"{name}-{i}" for i in range(n)], dtype=object), rng.integers(0, 2, (n, 4)),
                         values, lengths)

    emotions = write_store(tmp_path / "emotions", {s: split(s, 6) for s in ("train", "valid", "test")},
                           dataset="toy", source={})
    base = ["train.best_metric=valid/mean_f1"]
    unset = load_config(MultTrainConfig, overrides=[f"data.store={emotions.path}", *base])
    assert unset.examples.count is None
    assert MultJob().prepare(unset, PrepareContext("", Path("."), emotions)).cfg.examples.count == 0
    on_sentiment = load_config(MultTrainConfig, overrides=[f"data.store={mult_store.path}"])
    assert MultJob().prepare(on_sentiment, PrepareContext("", Path("."), mult_store)).cfg.examples.count == 16
    # A count the user asked for is refused on an emotions store (it was set to 0 silently), before MLflow
    asked = load_config(MultTrainConfig, overrides=[f"data.store={emotions.path}", *base, "examples.count=4",
                                                    f"mlflow.tracking_uri=sqlite:///{tmp_path / 'm.db'}"])
    with pytest.raises(ConfigError, match=r"examples.count: 4 example pages asked.*holds the task 'emotions'; leave"):
        engine.check(MultJob(), asked)
    assert not (tmp_path / "m.db").exists()


# Two workers, an evaluation and checkpoint every 3 steps and at each epoch's end (4 steps), a log step
# every step: the seeds' runs, and the worker-fault case (which adds a fault at step 10). The MulT
# reference's recipe (Adam, its plateau), the plateau made to drop at epoch 2's end: no patience, and a
# better loss only at half the best. (Epochs of 4 steps rather than 12, as before, cost a third of the
# steps; the same decisions, checkpoints and fault fall in them.)
RUN = ["recipe=mult-reference", "preset=tiny", "train.epochs=3", "train.batch_size=16", "train.eval_every=3",
       "train.log_every=1", "train.best_metric=valid/mae", "optim.plateau.patience=0", "optim.plateau.threshold=0.5",
       "scale.num_workers=2", "scale.max_failures=2", "mlflow.system_metrics=false", "f1_protocol=reference"]


@pytest.fixture(scope="module")
def seeded(mult_store, tmp_path_factory, ray_local):
    """(tracking URI, the parent run's id, folder, the driver's calls): `seeds=[1, 2]` through the engine,
    as the job runs them, each run's example pages (4) logged at its end. The seed-1 run is also the fault-free run the worker-fault case must equal (one
    run less). The calls: the run name of each `engine.check` and each `MultJob.prepare` in the driver
    (spied on, then run as they are)."""
    from xmodal.cli.training import end_of_run_pages
    from xmodal.jobs.mult_job import MultJob
    from xmodal.runner.engine import run_job

    tmp = tmp_path_factory.mktemp("seeded")
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    cfg = load_config(MultTrainConfig, overrides=[
        f"data.store={mult_store.path}", f"scale.storage_path={tmp / 'runs'}", f"mlflow.tracking_uri={uri}",
        *RUN, "seeds=[1, 2]", "mlflow.run_name=seeded", "examples.count=4"])
    with pytest.MonkeyPatch.context() as mp:
        calls = spy_checks_and_prepares(mp, MultJob)
        parent = run_job(MultJob(), cfg, after_run=end_of_run_pages).run_id
    return uri, parent, tmp, calls


@pytest.mark.slow
def test_each_seeds_run_is_checked_and_prepared_once(seeded):
    # the job's one check checks, before the parent run opens, every seed's run under its own name; each
    # then runs with that result: no second check, no second opening of its data
    *_, calls = seeded
    assert calls == {"check": ["seeded", "seeded-seed1", "seeded-seed2"], "prepare": ["seeded-seed1", "seeded-seed2"]}


@pytest.mark.slow
def test_seeds_select_on_validation_and_report_mean_and_std(seeded):
    uri, parent_id, *_ = seeded
    parent = tracking.get_run(uri, parent_id)
    assert parent.status == "FINISHED"
    children = tracking.child_runs(uri, parent_id)
    assert sorted(r.params["train.seed"] for r in children) == ["1", "2"]
    maes = []
    for child in children:
        m = child.metrics
        assert child.status == "FINISHED"
        assert child.tags["f1_protocol"] == "reference" and child.params["f1_protocol"] == "reference"
        for key in ("test/mae", "test/corr", "test/acc7", "test/acc2", "test/f1", "test/acc2_has0", "best_valid/mae"):
            assert key in m, key
        # Robustness (robust.* defaults): the test split once more per condition, on both workers' rows.
        for condition in ("zero_text", "zero_audio", "zero_vision", "noise_text", "noise_audio", "noise_vision"):
            assert {f"robust/{condition}/{k}" for k in ("mae", "acc2", "f1", "loss")} <= set(m), condition
        assert len(tracking.metric_points(uri, child.run_id, "robust/zero_audio/mae")) == 1  # at the end only
        # The selected model is the best on validation: no logged validation MAE beats it.
        hist = [x.value for x in tracking.metric_points(uri, child.run_id, "valid/mae")]
        assert m["best_valid/mae"] == pytest.approx(min(hist))
        maes.append(m["test/mae"])
        # the run's example pages, logged at its end: 4 clips of the test split with the final model
        pictures = tracking.list_artifacts(uri, child.run_id, "examples/pictures")
        assert "examples/index.html" in tracking.list_artifacts(uri, child.run_id, "examples") and len(pictures) == 4
    pm = parent.metrics
    assert pm["test/mae_mean"] == pytest.approx(sum(maes) / 2)
    assert pm["test/mae_std"] == pytest.approx(abs(maes[0] - maes[1]) / 2 ** 0.5)
    assert pm["robust/zero_audio/acc2_mean"] == pytest.approx(
        sum(c.metrics["robust/zero_audio/acc2"] for c in children) / 2)


@pytest.mark.slow
def test_the_run_records_its_recipe_and_what_it_overrides(seeded):
    uri, parent_id, *_ = seeded
    params = tracking.child_runs(uri, parent_id)[0].params
    assert params["recipe"] == "mult-reference"
    assert (params["optim.name"], params["optim.schedule"], params["optim.lr"], params["optim.grad_clip"]) == \
        ("adam", "plateau", "0.001", "0.8")
    overridden = params["recipe_overrides"]
    assert "train.epochs=3 (recipe: 40)" in overridden and "optim.plateau.patience=0 (recipe: 20)" in overridden
    assert "optim.lr" not in overridden


@pytest.mark.slow
def test_a_worker_fault_after_a_plateau_drop_resumes_exactly(mult_store, seeded, ray_local):
    """MulT on 2 workers under the plateau: the rate drops at epoch 2's end (step 8), a worker dies at
    step 10 and the run resumes from its step-9 checkpoint; the seed-1 run of `seeded` (same seed and
    config, no fault) logged the same rates, per-step losses, validation and test metrics (the plateau's
    state travels in the checkpoint: its second decision, at step 12, is the same)."""
    from xmodal.jobs.mult_job import MultJob

    uri, parent_id, tmp, _ = seeded
    cfg = load_config(MultTrainConfig, overrides=[
        f"data.store={mult_store.path}", f"scale.storage_path={tmp / 'runs'}", f"mlflow.tracking_uri={uri}",
        *RUN, "train.seed=1", "mlflow.run_name=faulty", "train.fail_at_step=10"])
    faulty = engine.run(MultJob(), cfg).run_id
    (clean,) = [r.run_id for r in tracking.child_runs(uri, parent_id) if r.params["train.seed"] == "1"]
    assert [m.value for m in tracking.metric_points(uri, faulty, "train/resumed_from_step")] == [9]
    lr = dict(tracking.metric_history(uri, clean, "train/lr"))
    assert lr[8] == pytest.approx(1e-3) and lr[9] == pytest.approx(1e-4)  # the drop before the fault
    for key in ("train/lr", "train/loss", "valid/mae", "valid/acc2", "test/mae", "test/acc2", "best_valid/mae"):
        f, c = (dict(tracking.metric_history(uri, r, key)) for r in (faulty, clean))
        assert f.keys() == c.keys() and f, key
        worst = max(abs(f[s] - c[s]) for s in c)
        assert worst <= 1e-5, f"{key}: the resumed run differs from the uninterrupted one by {worst}"
