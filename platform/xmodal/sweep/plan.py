"""Planning a sweep: everything that can fail on bad input, before Ray starts and before MLflow is
written to. Loads and validates the space and the trials' base config, and chooses the sweep's name,
storage and MLflow experiment. Imports no Ray, Tune or Optuna.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xmodal import tracking
from xmodal.config.experiment import MODEL_NAME_RE
from xmodal.config.paths import config_has, get_dotted
from xmodal.jobs.registry import job_spec
from xmodal.runner.spec import timestamped
from xmodal.sweep.space import (
    NAME_RE,
    SearchSpace,
    SpaceError,
    base_config,
    load_space,
    set_dotted,
    validate_config,
    validate_space,
)


@dataclass
class SweepOptions:
    space: str
    sets: list[str] = field(default_factory=list)  # dotted overrides of the trials' base config
    resume: bool = False
    name: str | None = None
    num_samples: int | None = None
    max_concurrent: int | None = None
    gpus_per_trial: float | None = None
    storage_path: str | None = None
    report: bool = True
    register: str | None = None  # register the best trial's model under this name (alias `best`)


@dataclass
class SweepPlan:
    space: SearchSpace
    space_path: Path
    name: str
    root: str  # Tune storage path; the experiment lives in root/name
    experiment: str
    tracking_uri: str
    base: dict[str, Any]  # the trials' raw base config, sweep-owned keys set
    resume: bool
    report: bool = True
    register: str | None = None

    @property
    def path(self) -> str:
        return f"{self.root}/{self.name}"

    def setup(self, parent_run_id: str, experiment_id: str, in_process: bool = False) -> dict[str, Any]:
        """What every trial needs, plain JSON: passed with tune.with_parameters and saved beside Tune's
        state. `in_process`: each trial's one worker runs in the trial's process (`trial_resources`)."""
        return {"job": self.space.job, "space": self.space.model_dump(mode="json"), "base": self.base,
                "sweep": self.name, "source": str(self.space_path), "parent_run_id": parent_run_id,
                "experiment_id": experiment_id, "tracking_uri": self.tracking_uri, "in_process": in_process}


def trial_run_name(sweep: str, trial_id: str) -> str:
    """The child's MLflow run name and its Ray Train run name: fixed by the trial id, so a restored trial
    finds both again (Train resumes from the run's latest checkpoint)."""
    return f"{sweep}-{trial_id}"


# ---------------------------------------------------------------- planning (no Ray, no MLflow writes)


def _sweep_root(configured: str | None) -> str:
    from xmodal.runner.ray_cluster import storage_path

    if configured:
        return storage_path(configured)
    root = storage_path(None)
    return root if "://" in root else str(Path(root) / "sweeps")


def _choose_name(opts: SweepOptions, space: SearchSpace, stem: str, root: str) -> str:
    fixed = opts.name or space.name
    if opts.name is not None and not re.match(NAME_RE, opts.name):  # the Tune folder and the MLflow parent run
        raise SpaceError(f"--name {opts.name!r}: expected letters, digits, '.', '_' or '-' (starting with a letter "
                         "or digit)")
    local = "://" not in root
    if fixed:
        exists = local and (Path(root) / fixed / "tuner.pkl").exists()
        if opts.resume and local and not exists:
            raise SpaceError(f"--resume: no sweep named {fixed!r} under {root}")
        if not opts.resume and exists:
            raise SpaceError(f"sweep {fixed!r} already exists under {root}: pass --resume to continue it, "
                             "or --name to start another")
        return fixed
    if opts.resume:
        if not local:
            raise SpaceError("--resume on remote storage needs --name (the sweep to continue)")
        found = sorted(d.name for d in Path(root).glob(f"{stem}-*") if (d / "tuner.pkl").exists())
        if not found:
            raise SpaceError(f"--resume: no sweep of {stem!r} under {root} (looked for {stem}-*/tuner.pkl)")
        return found[-1]  # names end in a timestamp: the latest
    return timestamped(stem)


def plan_sweep(opts: SweepOptions) -> SweepPlan:
    """Load and validate the space and the trials' base config; choose the sweep's name and paths."""
    path = Path(opts.space)
    space = load_space(path, {"num_samples": opts.num_samples, "max_concurrent": opts.max_concurrent,
                              "gpus_per_trial": opts.gpus_per_trial})
    cls = job_spec(space.job).config_class
    base = base_config(space, path, opts.sets)
    try:
        uri = tracking.resolve_tracking_uri(get_dotted(base, "mlflow.tracking_uri")[1])
    except ValueError as e:
        raise SpaceError(f"{path}: {e}") from None
    root = _sweep_root(opts.storage_path)
    name = _choose_name(opts, space, path.stem, root)
    experiment = space.experiment or f"xmodal-sweep-{path.stem}"
    train_storage = f"{root}/{name}/train"
    forced: dict[str, Any] = {
        "mlflow.tracking_uri": uri, "mlflow.experiment": experiment, "scale.storage_path": train_storage,
        # Trials keep their best checkpoints by the sweep's metric; the config checks it is measured.
        "train.best_metric": space.metric, "train.best_mode": space.mode,
        # A pretrain-then-fine-tune chain is scored by its fine-tuning stage.
        "finetune.train.best_metric": space.metric, "finetune.train.best_mode": space.mode,
    }
    if not get_dotted(base, "train.seed")[0] and "train.seed" not in space.config_keys():
        forced["train.seed"] = space.seed
    for key, value in forced.items():
        if config_has(cls, key):
            base = set_dotted(base, key, value)
    if opts.register is not None and not re.match(MODEL_NAME_RE, opts.register):
        raise SpaceError(f"--register {opts.register!r}: expected a model name of letters, digits, '.', '_' and "
                         "'-' (no '/', ':' or '@'), starting with a letter or digit")
    if get_dotted(base, "mlflow.registered_model")[1] or "mlflow.registered_model" in space.config_keys():
        # Every trial would register its own model: the sweep registers its best one.
        raise SpaceError(f"{path}: mlflow.registered_model cannot be set for a sweep's trials; use jobs/sweep.py "
                         "--register NAME (the best trial's model, alias `best`)")
    if get_dotted(base, "seeds")[1] or "seeds" in space.config_keys():
        # MulT's `seeds` trains several models in one run; a trial is one Train run with one seed.
        raise SpaceError(f"{path}: `seeds` cannot be used in a sweep (a trial trains one seed): search "
                         "train.seed, or repeat the sweep with --set train.seed=N and report the experiment")
    base_cfg = validate_space(space, cls, base, str(path))
    if space.gpus_per_trial and config_has(cls, "scale.gpus_per_worker"):
        workers = getattr(getattr(base_cfg, "scale", None), "num_workers", 1) or 1
        base = set_dotted(base, "scale.gpus_per_worker", space.gpus_per_trial / workers)
        validate_config(cls, base, f"{path}: --gpus-per-trial {space.gpus_per_trial}")
    return SweepPlan(space=space, space_path=path, name=name, root=root, experiment=experiment,
                     tracking_uri=uri, base=base, resume=opts.resume, report=opts.report, register=opts.register)
