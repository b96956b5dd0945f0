"""A sweep registers its best trial's model in the MLflow Model Registry (alias `best`), on the embedded
default (SQLite): a tiny MulT sweep of 2 trials, and the model loaded by alias in a fresh process."""

from __future__ import annotations

import os
import subprocess
import textwrap

import pytest
import torch

from xmodal import tracking
from xmodal.base import run_tags as T
from xmodal.base.errors import UserError
from xmodal_testing import PYTHON, REPO

NAME = "mult-depth-best"


@pytest.fixture(scope="module")
def mult_store(tmp_path_factory):
    from xmodal.data.mult.synthetic import SyntheticMultOptions, build_synthetic_store

    return build_synthetic_store(tmp_path_factory.mktemp("mult") / "store", SyntheticMultOptions(num_samples=120))


def space_file(tmp_path, store) -> str:
    path = tmp_path / "space.yaml"
    path.write_text(textwrap.dedent(f"""
        job: mult
        base:
          config:
            preset: tiny
            data: {{store: {store.path}}}
            train: {{epochs: 1, batch_size: 16, eval_every: 3, max_steps: 6, log_every: 3}}
            robust: {{conditions: []}}
            mlflow: {{system_metrics: false, tracking_uri: "sqlite:///{tmp_path / 'mlflow.db'}"}}
        metric: valid/mae
        mode: min
        num_samples: 2
        max_concurrent: 2
        scheduler: {{type: fifo}}
        parameters:
          model.layers: {{type: choice, values: [1, 2]}}
        try_first: [{{model.layers: 1}}, {{model.layers: 2}}]
        """))
    return str(path)


def test_a_bad_name_or_trials_that_would_register_are_refused(tmp_path, mult_store):
    from xmodal.sweep.plan import SweepOptions, plan_sweep

    space = space_file(tmp_path, mult_store)
    with pytest.raises(UserError, match="--register 'a/b': expected a model name"):
        plan_sweep(SweepOptions(space=space, register="a/b", storage_path=str(tmp_path / "runs")))
    with pytest.raises(UserError, match="mlflow.registered_model cannot be set for a sweep's trials; use jobs/sweep.py"):
        plan_sweep(SweepOptions(space=space, sets=["mlflow.registered_model=x"], storage_path=str(tmp_path / "runs")))
    assert not (tmp_path / "mlflow.db").exists()


@pytest.mark.slow
def test_a_sweep_registers_its_best_model_and_it_loads_by_alias(tmp_path, mult_store, ray_local, monkeypatch):
    from xmodal.sweep.plan import SweepOptions
    from xmodal.sweep.runner import run_sweep

    monkeypatch.chdir(tmp_path)  # MLflow's default artifact root is ./mlruns
    monkeypatch.setenv("TUNE_GLOBAL_CHECKPOINT_S", "2")  # what run_sweep sets, undone after the test
    space = space_file(tmp_path, mult_store)
    result = run_sweep(SweepOptions(space=space, storage_path=str(tmp_path / "runs"), report=False, register=NAME))
    uri, parent_id = result["tracking_uri"], result["parent_run_id"]
    assert result["errors"] == 0 and result["trials"] == 2
    parent = tracking.get_run(uri, parent_id)
    best = parent.tags[T.BEST + "run_id"]
    other = next(r.run_id for r in tracking.child_runs(uri, parent_id) if r.run_id != best)
    assert result["registered"]["version"] == 1 and parent.tags[T.REGISTERED] == f"{NAME}/1"

    version = tracking.get_model_version(uri, NAME, "best")
    assert version.version == 1 and version.aliases == ("best",) and version.run_id == best
    assert version.model_id == tracking.run_model_id(uri, best) == result["registered"]["model_id"]
    assert version.tags[T.SWEEP_PARENT] == parent_id and version.tags[T.SPACE] == space
    assert version.tags[T.SWEEP] == result["name"] and version.tags[T.METRIC] == "valid/mae"
    assert float(version.tags[T.BEST + "valid/mae"]) == parent.metrics["best/valid/mae"]

    # A fresh process with only the package on its path: the model by alias predicts what the best run's
    # own model does, and not what the other trial's does.
    params = tracking.get_run(uri, best).params
    g = torch.Generator().manual_seed(0)
    inputs = tuple(torch.randn(3, 5, int(params[f"model.{m}_dim"]), generator=g) for m in ("l", "a", "v"))
    torch.save(inputs, tmp_path / "inputs.pt")
    load = textwrap.dedent(f"""
        import mlflow.pytorch, torch
        inputs = torch.load("inputs.pt")
        for name, uri in [("alias", "models:/{NAME}@best"), ("run", "runs:/{best}/final_model"),
                          ("other", "runs:/{other}/final_model")]:
            model = mlflow.pytorch.load_model(uri)
            with torch.no_grad():
                out = model(*inputs)
            torch.save(out if isinstance(out, torch.Tensor) else out[0], f"{{name}}.pt")
    """)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(REPO / "platform"), MLFLOW_TRACKING_URI=uri)
    done = subprocess.run([PYTHON, "-c", load], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    alias, own, theirs = (torch.load(tmp_path / f"{n}.pt") for n in ("alias", "run", "other"))
    torch.testing.assert_close(alias, own, rtol=0, atol=0)
    assert not torch.allclose(alias, theirs)
