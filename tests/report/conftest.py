"""The report tests' shared store: a made-up sweep logged through xmodal.tracking (report_testing.py)."""

from __future__ import annotations

import shutil

import pytest
from report_testing import sweep, trial

from xmodal import tracking
from xmodal.base import run_tags as T


@pytest.fixture(scope="module")
def store(tmp_path_factory, mlflow_template):
    """One database for each test module, a copy of the session's empty MLflow database (creating one runs
    every schema migration: seconds). Artifacts go under the working directory (MLflow's default
    artifact root), so work in the temporary folder."""
    tmp = tmp_path_factory.mktemp("mlflow")
    shutil.copyfile(mlflow_template, tmp / "mlflow.db")
    mp = pytest.MonkeyPatch()
    mp.chdir(tmp)
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    exp = tracking.ensure_experiment(uri, "xmodal-sweep-demo")
    parent = sweep(uri, exp, "demo-1")
    # configuration A (x_layers 1, no obj_feat): two seeds
    trial(uri, exp, parent, "a0", {"model.x_layers": 1, "tasks.obj_feat": False, "train.seed": 0}, [0.5, 0.6])
    trial(uri, exp, parent, "a1", {"model.x_layers": 1, "tasks.obj_feat": False, "train.seed": 1}, [0.5, 0.8])
    # configuration B (x_layers 2, obj_feat with smooth_l1): one finished, one stopped early
    trial(uri, exp, parent, "b0", {"model.x_layers": 2, "tasks.obj_feat": True, "tasks.feat_loss": "smooth_l1",
                                   "train.seed": 0}, [0.6, 0.9])
    trial(uri, exp, parent, "b1", {"model.x_layers": 2, "tasks.obj_feat": True, "tasks.feat_loss": "smooth_l1",
                                   "train.seed": 1}, [0.1], "KILLED", {T.EARLY_STOPPED: "true"})
    # configuration C: stopped early only
    trial(uri, exp, parent, "c0", {"model.x_layers": 3, "tasks.obj_feat": True, "tasks.feat_loss": "l2",
                                   "train.seed": 0}, [0.2], "KILLED", {T.EARLY_STOPPED: "true"})
    # configuration D: its best evaluation came first (the run keeps that checkpoint: selected on validation)
    trial(uri, exp, parent, "d0", {"model.x_layers": 4, "tasks.obj_feat": False, "train.seed": 0}, [0.95, 0.4])
    # left out: a failed trial and an orphan the driver closed
    trial(uri, exp, parent, "f0", {"model.x_layers": 3, "tasks.obj_feat": False, "train.seed": 0}, [0.3], "FAILED")
    trial(uri, exp, parent, "o0", {"model.x_layers": 1, "tasks.obj_feat": False, "train.seed": 0}, [0.99],
          "KILLED", {T.ORPHANED: "true"})
    yield uri, exp, parent
    mp.undo()
