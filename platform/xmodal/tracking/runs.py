"""Runs: experiments (created, marked as model-training, described), runs created with their tags and
params, the source and git tags MLflow's UI shows, and what is logged into an existing run (datasets,
params, metrics, artifacts, tags, its status). Each call goes through the retry policy (`_waited`)."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from xmodal.base import run_tags as T
from xmodal.base.run_tags import PARENT_TAG, RUN_NAME_TAG
from xmodal.tracking.connection import _client, _mlflow, artifact_location
from xmodal.tracking.retry import _waited

# MLflow's limit of metrics per log_batch, for `log_metrics` here and for the logger and the replay, which
# import this module (`RunLogger.BATCH`).
_METRICS_PER_BATCH = 500


# What an experiment holds, by the entry point that creates it (its description in the MLflow UI).
_DESCRIPTIONS = {
    "pretrain.py": "LXMERT pretraining runs (jobs/pretrain.py): one run per job, with its config, dataset, "
                   "metrics beside their chance levels, checkpoints and final model.",
    "finetune.py": "LXMERT fine-tuning runs (jobs/finetune.py) on VQA, GQA or NLVR2: one run per job, with its "
                   "config, dataset, metrics, prediction files and the model selected on validation.",
    "train_mult.py": "MulT training runs (jobs/train_mult.py): one run per job (a multi-seed job: a parent run "
                     "with one child per seed), with its config, dataset, metrics and the model selected on "
                     "validation.",
    "sweep.py": "Ablation sweeps (jobs/sweep.py): one parent run per sweep, holding its search space, best trial "
                "and report (jobs/report.py); one child run per trial.",
    "benchmark.py": "Throwaway runs of the tracking benchmark (jobs/benchmark.py tracking).",
}


def experiment_description(name: str, argv: list[str] | None = None) -> str:
    """The description (Markdown) of an experiment xmodal creates: what its runs are, by the job that
    creates it (`sys.argv[0]`), else a general one."""
    args = sys.argv if argv is None else argv
    entry = Path(args[0]).name if args else ""
    return _DESCRIPTIONS.get(entry, f"Model-training runs logged by xmodal (experiment {name!r}).")


def ensure_experiment(uri: str, name: str, description: str | None = None) -> str:
    """The experiment's id (created if new), marked as a model-training experiment unless it is
    marked otherwise (`mlflow.experimentKind`), and described (`mlflow.note.content`: `description`,
    default `experiment_description`) unless it has a description. MLflow's UI shows the description on
    the experiment's page; the kind is what MLflow records for the training view (its 3.17 UI opens that
    view from the address's query instead: `run_url`)."""
    text = description or experiment_description(name)

    def ensure() -> str:
        c = _client(uri)
        exp = c.get_experiment_by_name(name)
        if exp is None:
            try:
                return c.create_experiment(name, artifact_location=artifact_location(uri, name),
                                           tags={T.EXPERIMENT_KIND: T.TRAINING_EXPERIMENT, T.NOTE: text})
            except Exception:  # created concurrently by another driver
                exp = c.get_experiment_by_name(name)
                if exp is None:
                    raise
        if T.EXPERIMENT_KIND not in exp.tags:  # made before the kind was set, or by MLflow itself
            c.set_experiment_tag(exp.experiment_id, T.EXPERIMENT_KIND, T.TRAINING_EXPERIMENT)
        if not exp.tags.get(T.NOTE):  # made before experiments were described; a user's text stays
            c.set_experiment_tag(exp.experiment_id, T.NOTE, text)
        return exp.experiment_id

    return _waited(uri, f"opening experiment {name!r}", ensure, first_contact=True)


def create_run(uri: str, experiment_id: str, run_name: str, params: dict[str, Any], tags: dict[str, str],
               parent_run_id: str | None = None) -> str:
    """A new RUNNING run with params and tags logged in batches (MLflow caps a batch at 100 params).
    Each call is retried on its own: the run is created once, and a params batch sent again after a
    lost reply is accepted (the same values)."""
    all_tags = {RUN_NAME_TAG: run_name, **tags}
    if parent_run_id:
        all_tags[PARENT_TAG] = parent_run_id
    run_id = _waited(uri, f"creating run {run_name!r}", lambda: _client(uri).create_run(
        experiment_id, run_name=run_name, tags=all_tags).info.run_id)
    log_params(uri, run_id, params)
    return run_id


def _git(*args: str) -> str | None:
    """A git command's output in this package's checkout, None outside one (an installed package)."""
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_commit(short: bool = False) -> str:
    """The checkout's commit (`short`: abbreviated, as the benchmarks record it), "unknown" outside git."""
    return _git("rev-parse", *(("--short",) if short else ()), "HEAD") or "unknown"


def git_dirty() -> bool | None:
    """Whether tracked files differ from the commit (untracked files, e.g. mlflow.db, do not count)."""
    out = _git("status", "--porcelain", "--untracked-files=no")
    return None if out is None else bool(out)


# Set by `ray job submit` in the job's driver (ray._private.runtime_env.constants).
_RAY_JOB_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"


def source_tags(argv: list[str] | None = None) -> dict[str, str]:
    """MLflow's source tags, which its UI shows as the run's Source: the entry point (relative to the
    checkout when inside it), JOB under `ray job submit` else LOCAL, the git commit and whether the
    checkout was dirty; and the whole command line (`xmodal.command`)."""
    argv = list(sys.argv if argv is None else argv)
    entry = argv[0] if argv else "unknown"
    root = _git("rev-parse", "--show-toplevel")
    if root and entry:
        try:
            entry = Path(entry).resolve().relative_to(root).as_posix()
        except ValueError:
            pass
    tags = {T.SOURCE_NAME: entry, T.SOURCE_TYPE: "JOB" if _RAY_JOB_ENV in os.environ else "LOCAL",
            T.COMMAND: shlex.join([entry, *argv[1:]])[:5000]}
    commit, dirty = git_commit(), git_dirty()
    if commit != "unknown":
        tags[T.GIT_COMMIT] = commit
    if dirty is not None:
        tags[T.GIT_DIRTY] = str(dirty).lower()
    return tags


def log_dataset(uri: str, run_id: str, name: str, path: str, digest: str, profile: dict[str, Any],
                context: str = "train") -> None:
    """The run's data as an MLflow dataset input (the UI's Dataset column and panel): its name, where
    it is, its fingerprint as the digest, and `profile` (rows, dims, ...) as the dataset's profile.
    Logging the same dataset again (a resumed run) adds nothing."""
    import warnings

    from mlflow.data.meta_dataset import MetaDataset
    from mlflow.entities import DatasetInput, InputTag
    from mlflow.utils.mlflow_tags import MLFLOW_DATASET_CONTEXT

    if "://" in path:
        from mlflow.data.dataset_source_registry import resolve_dataset_source

        with warnings.catch_warnings():  # "can be interpreted in multiple ways": the first is right
            warnings.simplefilter("ignore")
            source = resolve_dataset_source(path)
    else:
        from mlflow.data.sources import LocalArtifactDatasetSource

        source = LocalArtifactDatasetSource(str(Path(path).resolve()))

    class StoreDataset(MetaDataset):
        @property
        def profile(self) -> dict[str, Any]:
            return profile

        def to_dict(self) -> dict[str, str]:
            return {**super().to_dict(), "profile": json.dumps(profile)}

    entity = StoreDataset(source, name=name, digest=digest)._to_mlflow_entity()
    inputs = [DatasetInput(entity, [InputTag(MLFLOW_DATASET_CONTEXT, context)])]
    _waited(uri, f"logging dataset {name!r}", lambda: _client(uri).log_inputs(run_id, inputs))


def log_params(uri: str, run_id: str, params: dict[str, Any]) -> None:
    """Params of an existing run (logging one again with the same value is allowed; another value is not)."""
    mlflow = _mlflow()
    items = [mlflow.entities.Param(k, str(v)[:6000]) for k, v in params.items()]
    for i in range(0, len(items), 100):
        _waited(uri, f"logging params of run {run_id}",
                lambda batch=items[i:i + 100]: _client(uri).log_batch(run_id, params=batch))


def log_metrics(uri: str, run_id: str, metrics: dict[str, float], step: int = 0) -> None:
    """Metrics of an existing run at one step. A batch retried after a failure first drops what its
    lost reply may have logged all the same, so no value appears twice."""
    mlflow = _mlflow()
    ts = int(time.time() * 1000)
    items = [mlflow.entities.Metric(k, float(v), ts, step) for k, v in metrics.items()]
    for i in range(0, len(items), _METRICS_PER_BATCH):
        _log_batch_once(uri, run_id, items[i:i + _METRICS_PER_BATCH], f"logging metrics of run {run_id}")


def _log_batch_once(uri: str, run_id: str, batch: list, doing: str) -> None:
    """`batch` (mlflow Metric) logged through `_waited`, each value once however many tries it took."""
    tried = False

    def send() -> None:
        nonlocal tried
        c = _client(uri)
        todo = _drop_logged(c, run_id, batch) if tried else batch
        tried = True
        if todo:
            c.log_batch(run_id, metrics=todo)

    _waited(uri, doing, send)


def _drop_logged(client, run_id: str, items: list) -> list:
    """`items` (mlflow Metric) less those whose (key, step) the run's history already holds: a retry or a
    replay after a partial success adds no duplicate."""
    seen = {k: {m.step for m in client.get_metric_history(run_id, k)} for k in {m.key for m in items}}
    return [m for m in items if m.step not in seen[m.key]]


# The calls below, as `Outbox` makes them: one attempt each, inside its own retry (`_retried`).


def _log_artifact(uri: str, run_id: str, local_path: str | Path, artifact_path: str | None = None) -> None:
    _client(uri).log_artifact(run_id, str(local_path), artifact_path)


def _set_terminated(uri: str, run_id: str, status: str) -> None:
    _client(uri).set_terminated(run_id, status=status)


def _set_tags(uri: str, run_id: str, tags: dict[str, str]) -> None:
    c = _client(uri)
    for k, v in tags.items():  # setting a tag again to the same value is harmless: retried whole
        c.set_tag(run_id, k, str(v))


def log_artifacts(uri: str, run_id: str, local_dir: str | Path, artifact_path: str | None = None) -> None:
    _waited(uri, f"logging artifacts from {local_dir}",
            lambda: _client(uri).log_artifacts(run_id, str(local_dir), artifact_path))


def log_artifact(uri: str, run_id: str, local_path: str | Path, artifact_path: str | None = None) -> None:
    _waited(uri, f"logging artifact {local_path}", lambda: _log_artifact(uri, run_id, local_path, artifact_path))


def log_table(uri: str, run_id: str, columns: dict[str, list[Any]], artifact_file: str) -> None:
    """A table (column name -> values, one row per index) as a run's JSON table artifact, which the
    MLflow UI shows in its evaluation view (`MlflowClient.log_table`)."""
    _waited(uri, f"logging table {artifact_file}",
            lambda: _client(uri).log_table(run_id, data=dict(columns), artifact_file=artifact_file))


def set_terminated(uri: str, run_id: str, status: str = "FINISHED") -> None:
    _waited(uri, f"marking run {run_id} {status}", lambda: _set_terminated(uri, run_id, status))


def set_tags(uri: str, run_id: str, tags: dict[str, str]) -> None:
    _waited(uri, f"setting tags of run {run_id}", lambda: _set_tags(uri, run_id, tags))


def mark_running(uri: str, run_id: str) -> None:
    """Re-open a run that a dead driver left FAILED/KILLED, when it is resumed."""
    _waited(uri, f"resuming run {run_id}", lambda: _client(uri).update_run(run_id, status="RUNNING"))
