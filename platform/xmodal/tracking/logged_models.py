"""Models: a run's model as an MLflow logged model (`log_pytorch_model`, the `mlflow.pytorch` flavor)
and read back (`load_logged_model`), and its versions in the Model Registry (`register_model`,
`get_model_version`)."""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from xmodal.base import run_tags as T
from xmodal.base.errors import UserError
from xmodal.tracking.connection import _client, _mlflow
from xmodal.tracking.retry import _first_line, _waited

# What a logged model's environment lists: the versions it was trained with, named rather than
# inferred (MLflow's inference runs a subprocess that imports the model: seconds per run).
MODEL_REQUIREMENTS = ("torch", "numpy", "pyyaml", "pydantic")


# The name of a run's MLflow model: not "model", the run's artifact folder of checkpoint files (MLflow 3
# merges a logged model into the run's artifact paths of its name, and then looks the model up through
# the process's global tracking URI, not the client's).
LOGGED_MODEL = "final_model"


def log_pytorch_model(uri: str, run_id: str, model, name: str = LOGGED_MODEL, config: dict[str, Any] | None = None,
                      metadata: dict[str, Any] | None = None, step: int = 0) -> str:
    """`model` (an nn.Module) as the run's MLflow model (`mlflow.pytorch` flavor, pickled by reference
    to its classes: loading needs the package importable), with `config` as `config.yaml` beside it
    and as the model's params; returns the model id. Load it with
    `mlflow.pytorch.load_model("runs:/<run_id>/final_model")` or `("models:/<model id>")`."""
    import importlib.metadata
    import warnings

    import yaml
    from mlflow.entities import LoggedModelOutput, LoggedModelStatus
    from mlflow.models import Model

    mlflow = _mlflow()
    doing = f"logging model {name!r}"

    def call(method: str, *args, **kwargs):  # each MLflow call retried on its own (none is repeated)
        return _waited(uri, doing, lambda: getattr(_client(uri), method)(*args, **kwargs))

    run = call("get_run", run_id)
    params = {k: str(v)[:6000] for k, v in _flat(config or {}).items()}
    # The run's source tags on the model too: the UI's model list shows them as "Logged from".
    tags = {k: v for k, v in run.data.tags.items() if k.startswith(T.SOURCE)}
    tags[T.MODEL_CLASS] = f"{type(model).__module__}.{type(model).__qualname__}"
    logged = call("create_logged_model", run.info.experiment_id, name=name, source_run_id=run_id, params=params or None,
                                   tags=tags)
    requirements = []
    for package in MODEL_REQUIREMENTS:
        try:
            requirements.append(f"{package}=={importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            pass
    with tempfile.TemporaryDirectory() as tmp:
        extra = []
        if config is not None:
            (Path(tmp) / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
            extra.append(str(Path(tmp) / "config.yaml"))
        local = Path(tmp) / "model"
        info = Model(artifact_path=logged.artifact_location, model_uuid=logged.model_id, run_id=run_id,
                     model_id=logged.model_id, metadata=metadata)
        # The pickle format's own caution (a warning and a log line on every save), said once in the
        # docs instead.
        pytorch_log = logging.getLogger("mlflow.pytorch")
        level = pytorch_log.level
        pytorch_log.setLevel(logging.ERROR)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mlflow.pytorch.save_model(model, str(local), mlflow_model=info, pip_requirements=requirements,
                                          serialization_format="pickle", extra_files=extra or None)
        finally:
            pytorch_log.setLevel(level)
        call("log_model_artifacts", logged.model_id, str(local))
    call("log_outputs", run_id, [LoggedModelOutput(logged.model_id, step=step)])
    call("finalize_logged_model", logged.model_id, LoggedModelStatus.READY)
    return logged.model_id


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


@dataclass(frozen=True)
class LoggedModel:
    """A logged model read back (`load_logged_model`): the module, the config logged beside it, and
    the run that logged it."""

    module: Any  # the nn.Module, unpickled
    config: dict[str, Any] | None  # extra_files/config.yaml
    run_id: str | None
    path: Path  # the downloaded model folder


def load_logged_model(uri: str, model_uri: str, dst_dir: str | Path) -> LoggedModel:
    """Read only: a model `log_pytorch_model` logged (`models:/<model id>` or `runs:/<run id>/<name>`,
    e.g. `runs:/<run id>/final_model`), found in the store at `uri`, downloaded from its artifact
    location into `dst_dir` and unpickled by `mlflow.pytorch` (the pickle refers to xmodal's classes:
    only load models of your own runs). An unknown URI or a folder that is no pytorch model is a
    UserError naming it. (MLflow's own `runs:/` resolution looks the model up through the process's
    global tracking URI, so the lookup is made here, in this store.)"""
    import yaml

    mlflow = _mlflow()

    def find():
        client = _client(uri)
        if model_uri.startswith("models:/"):
            wanted = f"model_id = '{model_uri[len('models:/'):].strip('/')}'"
        elif model_uri.startswith("runs:/") and model_uri[len("runs:/"):].count("/") == 1:
            run_id, name = model_uri[len("runs:/"):].split("/")
            wanted = f"name = '{name}' AND source_run_id = '{run_id}'"
        else:
            return None
        experiments = [e.experiment_id for e in client.search_experiments()]
        found = client.search_logged_models(experiments, filter_string=wanted) if experiments else []
        return max(found, key=lambda m: m.creation_timestamp) if found else None

    if not model_uri.startswith(("models:/", "runs:/")):
        raise UserError(f"logged model {model_uri!r}: expected models:/<model id> or runs:/<run id>/final_model")
    try:
        logged = _waited(uri, f"looking up model {model_uri}", find)
    except UserError:
        raise
    except Exception as e:  # a permanent MLflow error: a malformed id in the search filter
        raise UserError(f"logged model {model_uri!r}: cannot be looked up at {uri} ({_first_line(e)})") from None
    if logged is None:
        raise UserError(f"logged model {model_uri!r}: no such model at {uri}; expected models:/<model id> or "
                        "runs:/<run id>/final_model of a finished xmodal run")
    Path(dst_dir).mkdir(parents=True, exist_ok=True)
    try:
        # A server's model lives at an mlflow-artifacts: URI, resolved through the tracking URI given here
        # (not the process's default, which is ./mlflow.db).
        local = Path(mlflow.artifacts.download_artifacts(artifact_uri=logged.artifact_location, dst_path=str(dst_dir),
                                                         tracking_uri=uri))
        from mlflow.models import Model

        Model.load(str(local))
        module = mlflow.pytorch.load_model(str(local), map_location="cpu")
    except Exception as e:  # the artifacts gone, a missing MLmodel, another flavour
        raise UserError(f"logged model {model_uri!r} at {uri}: cannot be read from {logged.artifact_location} "
                        f"({_first_line(e)}); expected a model of an xmodal run") from None
    found = sorted(local.rglob("config.yaml"))
    config = yaml.safe_load(found[0].read_text()) if found else None
    return LoggedModel(module, config, logged.source_run_id, local)


# ---------------------------------------------------------------- the Model Registry


@dataclass(frozen=True)
class ModelVersion:
    """One version of a registered model, as plain data."""

    name: str
    version: int
    model_id: str | None  # the logged model it registers
    run_id: str | None
    aliases: tuple[str, ...]
    tags: dict[str, str] = field(default_factory=dict, hash=False)


def run_model_id(uri: str, run_id: str, name: str = LOGGED_MODEL) -> str | None:
    """The id of the logged model `name` the run logged (its latest, by step), None if it logged none."""
    def find() -> str | None:
        client = _client(uri)
        run = client.get_run(run_id)
        outputs = sorted(run.outputs.model_outputs if run.outputs else [], key=lambda o: o.step)
        for out in reversed(outputs):
            if client.get_logged_model(out.model_id).name == name:
                return out.model_id
        return None

    return _waited(uri, f"finding the logged model of run {run_id}", find)


def register_model(uri: str, name: str, model_id: str, run_id: str, alias: str | None = None,
                   tags: dict[str, str] | None = None) -> ModelVersion:
    """Register the logged model `model_id` (of run `run_id`) as a new version of the registered model
    `name`, created if new, with `tags` on the version and `alias` (e.g. "best") pointed at it: then
    `mlflow.pytorch.load_model(f"models:/{name}@{alias}")` loads it. Each MLflow call is retried on its
    own, as in `log_pytorch_model`."""
    from mlflow.exceptions import MlflowException

    doing = f"registering model {name!r}"

    def call(method: str, *args, **kwargs):
        return _waited(uri, doing, lambda: getattr(_client(uri), method)(*args, **kwargs))

    try:
        call("create_registered_model", name)
    except MlflowException as e:
        if e.error_code != "RESOURCE_ALREADY_EXISTS":
            raise UserError(f"MLflow at {uri}: {doing}: {_first_line(e)}") from None
    version = call("create_model_version", name, source=f"models:/{model_id}", run_id=run_id, tags=tags or None,
                   model_id=model_id)
    if alias:
        call("set_registered_model_alias", name, alias, version.version)
    return get_model_version(uri, name, alias) if alias else get_model_version(uri, name, int(version.version))


def get_model_version(uri: str, name: str, version_or_alias: int | str) -> ModelVersion:
    """A registered model's version by number, or by alias (a string)."""
    def get():
        client = _client(uri)
        if isinstance(version_or_alias, str):
            return client.get_model_version_by_alias(name, version_or_alias)
        return client.get_model_version(name, str(version_or_alias))

    v = _waited(uri, f"reading model {name!r} version {version_or_alias!r}", get)
    # A SQLite store leaves the version's model_id empty; its source names the logged model.
    model_id = getattr(v, "model_id", None) or (v.source[len("models:/"):] if v.source.startswith("models:/") else None)
    return ModelVersion(name=v.name, version=int(v.version), model_id=model_id, run_id=v.run_id,
                        aliases=tuple(v.aliases or ()), tags=dict(v.tags or {}))
