"""What a run records in MLflow besides its metrics: the reproducibility tags, the run found again by
name or created (with its source), where a rerun resumes, the data as a dataset input, the final
model, and the multi-seed parent run's summary over its seeds (docs/tracking.md, "What a run
records for the MLflow UI"). The engine's driver calls these; the MLflow calls are `xmodal.tracking`'s.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import logging
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from xmodal import tracking
from xmodal.base import run_tags
from xmodal.core import checkpoint as ckpt
from xmodal.runner import recovery
from xmodal.runner.hooks import ValidationSelection, say

if TYPE_CHECKING:  # the engine imports this module; its types only annotate here
    from xmodal.runner.spec import JobSpec, PreparedJob, RunPlan

log = logging.getLogger(__name__)


def reproducibility_tags(cfg, data_path: str) -> dict[str, str]:
    """What the promise "same seed, data, config and workers -> the same metrics" rests on
    (docs/reliability.md, "Reproducible runs"); the config itself is the run's params."""
    digest = manifest_digest(data_path)
    versions = []
    for package in ("torch", "numpy", "pyarrow", "ray"):
        try:
            versions.append(f"{package}={importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(f"{package}=-")
    return {run_tags.REPRO_SEED: str(cfg.train.seed), run_tags.REPRO_WORKERS: str(cfg.scale.num_workers),
            run_tags.REPRO_DATA_MANIFEST: digest,
            run_tags.REPRO_VERSIONS: f"python={platform.python_version()} " + " ".join(versions)}


def manifest_digest(data_path: str) -> str:
    """The data's fingerprint: the first 16 hex digits of its manifest's sha256 ("-" without one);
    `data_path` is a local path or a URI (`data.location.locate`)."""
    from xmodal.data.location import locate

    manifest = locate(data_path) / "manifest.json"
    return hashlib.sha256(manifest.read_bytes()).hexdigest()[:16] if manifest.is_file() else "-"


def open_run(uri: str, experiment: str, name: str, params: dict[str, Any], tags: dict[str, str],
             parent_run_id: str | None = None, where: Callable[[], str] = lambda: "") -> str:
    """The MLflow run named `name` (resumed: marked running again, `where()` saying from which step)
    or a new one with params and tags."""
    exp_id = tracking.ensure_experiment(uri, experiment)
    existing = tracking.find_run(uri, exp_id, name)
    if existing is not None:
        tracking.mark_running(uri, existing.run_id)
        log.info(f"resuming run {name!r} (MLflow run {existing.run_id}){where()}")
        return existing.run_id
    return tracking.create_run(uri, exp_id, name, params,
                               {run_tags.COMMIT: tracking.git_commit(), **tracking.source_tags(), **tags}, parent_run_id)


def resume_note(found: recovery.Found | None, storage: str, run_name: str) -> str:
    """Where a rerun of the run resumes, as the driver's "resuming run" line says it: the step of the
    newest intact checkpoint on storage (`found`, as `engine.check` found it), which the workers restore."""
    if found is None:
        return f": from step 0, no intact checkpoint under {storage}/{run_name}"
    return f": from step {found.step}, {found.path.rsplit('/', 1)[-1]}"


def log_dataset(job: str, prepared: PreparedJob, uri: str, run_id: str) -> None:
    """The run's data as its MLflow dataset input (context "train"): the job's name, rows and dims,
    the path, and the manifest's fingerprint as the digest (the `xmodal.repro` tag's too)."""
    d = prepared.dataset
    digest = manifest_digest(prepared.path)
    tracking.log_dataset(uri, run_id, d["name"], prepared.path, digest,
                         {"job": job, "fingerprint": digest, "rows": d["rows"], "dims": d["dims"]})


def final_model(spec: JobSpec, cfg, data, folder: Path) -> tuple[nn.Module, str]:
    """The bare model (`exported_model`) with a checkpoint's weights, in eval mode: those selected
    on validation when the job selects (what its test metrics are of), else the last. Returns (model,
    which weights)."""
    objective = spec.build_objective(cfg, data)
    state, which = final_weights(folder)
    objective.load_state_dict(state)
    return exported_model(objective).eval(), which


def final_weights(folder: Path) -> tuple[dict[str, torch.Tensor], str]:
    """A checkpoint folder's objective state dict the run's model holds, and which weights it is:
    "selected" on validation (`best_model.pt`, selecting jobs) or the "last" (`model.pt`)."""
    best = Path(folder) / ValidationSelection.BEST_FILE
    if best.is_file():
        return torch.load(best, map_location="cpu", weights_only=True)["weights"], "selected"
    return torch.load(Path(folder) / ckpt.MODEL_FILE, map_location="cpu", weights_only=True), "last"


def model_artifact_files(folder: Path) -> list[Path]:
    """The final checkpoint's files the run's `model` artifact holds: the last weights, the meta (config
    and every file's sha256) and, for a selecting job, the weights selected on validation, so that an
    export from the run (`xmodal.export`) reads the model its MLflow model holds."""
    d = Path(folder)
    return [d / f for f in (ckpt.MODEL_FILE, ckpt.META_FILE, ValidationSelection.BEST_FILE) if (d / f).is_file()]


def exported_model(objective: nn.Module) -> nn.Module:
    """What the run's MLflow model holds: the bare model under the objective (no losses or metrics),
    the one a user runs on new inputs."""
    return getattr(objective, "model", objective)


def log_model(spec: JobSpec, plan: RunPlan, data, folder: Path) -> str | None:
    """The final checkpoint's model as the run's MLflow model (`tracking.log_pytorch_model`), the
    resolved config beside it; returns its id. Best effort: the run's `model` artifact holds the
    weights either way, so a failure is one line, not a failed run."""
    started = time.monotonic()
    try:
        cfg = plan.config
        model, which = final_model(spec, cfg, data, folder)
        step = ckpt.read_meta(folder).get("step", 0)
        metadata = {"xmodal_job": spec.name, "xmodal_run_name": plan.run_name, "step": step,
                    "weights": f"selected on {cfg.train.best_metric}" if which == "selected" else "last"}
        model_id = tracking.log_pytorch_model(plan.tracking_uri, plan.run_id, model, config=cfg.model_dump(mode="json"),
                                              metadata=metadata, step=step)
    except Exception as e:  # any failure to build, pickle or send it: the run's training is done
        say(f"[xmodal] the final model was not logged as an MLflow model ({type(e).__name__}: {e}); "
            "its weights are in the run's `model` artifact")
        return None
    log.debug(f"MLflow model {model_id} logged in {time.monotonic() - started:.2f} s")
    return model_id


def register(plan: RunPlan, model_id: str) -> tracking.ModelVersion | None:
    """The run's logged model as a new version of the registered model `mlflow.registered_model`. Best effort,
    as `log_model`: the run's training is done and its model logged either way; a failure is one line
    that says how to register it by hand."""
    name = plan.config.mlflow.registered_model
    try:
        version = tracking.register_model(plan.tracking_uri, name, model_id, plan.run_id,
                                          tags={run_tags.RUN_NAME_TAG: plan.run_name})
    except Exception as e:  # a store that refuses it: the model stays logged on the run
        say(f"[xmodal] the final model was not registered as {name!r} ({type(e).__name__}: {e}); register it "
            f"from the run's models (MLflow UI) or with mlflow.register_model('models:/{model_id}', {name!r})")
        return None
    say(f"[xmodal] registered model {name!r} version {version.version}: models:/{name}/{version.version}")
    return version


def seed_summary(finals: list[dict[str, float]]) -> dict[str, float]:
    """{metric_mean, metric_std} over seeds for the test, best-validation and robustness metrics every run has."""
    keys = set.intersection(*(set(m) for m in finals)) if finals else set()
    out: dict[str, float] = {}
    for k in sorted(k for k in keys if k.startswith(("test/", "best_valid/", "robust/"))):
        vals = [m[k] for m in finals]
        out[f"{k}_mean"] = statistics.fmean(vals)
        out[f"{k}_std"] = statistics.stdev(vals) if len(vals) > 1 else 0.0
    return out


def finish_seeds_parent(uri: str, parent: str, finals: list[str], seeds: list[int]) -> dict[str, float]:
    """The end of a multi-seed parent run: the mean and std over the seeds' runs (`finals`, their run
    ids) of every metric they all have, logged; the run FINISHED; a line with the test metrics."""
    summary = seed_summary([tracking.get_run(uri, r).metrics for r in finals])
    tracking.log_metrics(uri, parent, summary)
    tracking.set_terminated(uri, parent, "FINISHED")
    shown = {k.removesuffix("_mean"): (v, summary[k.removesuffix("_mean") + "_std"])
             for k, v in summary.items() if k.endswith("_mean") and k.startswith("test/")}
    log.info("over seeds " + ", ".join(map(str, seeds)) + ": " +
        "  ".join(f"{k} {m:.4f} ± {s:.4f}" for k, (m, s) in sorted(shown.items())))
    return summary
