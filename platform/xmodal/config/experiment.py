"""Typed experiment configs: YAML files plus dotted `--set key=value` overrides.

The sections every job shares (`optim`, `train`, `scale`, `mlflow`), the base of a job's config
(`JobConfig`) and the loader; each job's own config class lives beside its spec
(`xmodal.jobs.pretrain_config`, `finetune_config`, `mult_config`, `chain_config`).

Every section forbids unknown keys and every field has its bounds (here, or as `Annotated` metadata
in the model and data dataclasses, see xmodal.base.bounds), every float is finite, and an option the user
gave that the config does not read is an error (its class's `USES`), so a bad value fails here, before Ray or
MLflow start. Errors name the file, the dotted key, the bad value and what was expected, one line
each. Model sections start from a named preset and take overrides on top.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from xmodal.base.bounds import Dropout, PosInt, Seed, describe_bounds
from xmodal.config.paths import (
    config_values,
    deep_merge,
    dotted_keys,
    field_names,
    fits,
    keys_beside,
    mistyped_values,
    set_dotted,
    type_at,
)
from xmodal.config.recipes import Recipe, recipe_tree
from xmodal.config.yaml_files import ConfigError, load_yaml, read_user_file, yaml_problem

# A registered model's name: MLflow forbids "/" and ":", and "@" would cut `models:/NAME@alias`.
MODEL_NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class PlateauConfig(Section):
    """`optim.schedule=plateau`: the rate times `factor` once `metric` (a validation metric of the job,
    evaluated at the end of every epoch) has not improved for `patience` epochs (torch's
    ReduceLROnPlateau, relative `threshold`, as the MulT reference steps it once per epoch)."""

    metric: str = Field("valid/loss", min_length=1)
    mode: Literal["min", "max"] = "min"
    patience: int = Field(20, ge=0)  # the MulT reference's --when
    factor: float = Field(0.1, gt=0, lt=1)
    threshold: float = Field(1e-4, ge=0)


# optim.name -> the schedules it has (`core/optim.py`): BertAdam's are inside it, at step / t_total.
OPTIM_SCHEDULES: dict[str, tuple[str, ...]] = {
    "adamw": ("linear", "constant", "plateau"),
    "adam": ("linear", "constant", "plateau"),
    "bertadam": ("linear", "constant", "cosine"),
}


class OptimConfig(Section):
    # adamw: torch's AdamW; adam: torch's Adam (the MulT reference); bertadam: the LXMERT reference's
    # BertAdam (no bias correction, its schedule inside it). See core/optim.py.
    name: Literal["adamw", "adam", "bertadam"] = "adamw"
    schedule: Literal["linear", "constant", "cosine", "plateau"] = "linear"  # OPTIM_SCHEDULES[name]
    # matrices: no decay on biases and LayerNorm weights (BERT convention); all: every parameter (the
    # LXMERT reference passes model.parameters() to BertAdam).
    decay_on: Literal["all", "matrices"] = "matrices"
    lr: float = Field(1e-4, gt=0)  # the paper; the embedded default raises it (PretrainConfig.optim)
    weight_decay: float = Field(0.01, ge=0)
    betas: tuple[Dropout, Dropout] = (0.9, 0.999)  # each in [0, 1)
    eps: float = Field(1e-6, gt=0)
    warmup_ratio: float = Field(0.05, ge=0, lt=1)  # not with plateau (its rate starts at the peak)
    grad_clip: float = Field(1.0, ge=0)  # 0 = off
    plateau: PlateauConfig = Field(default_factory=PlateauConfig)

    @model_validator(mode="after")
    def _schedule(self) -> OptimConfig:
        allowed = OPTIM_SCHEDULES[self.name]
        if self.schedule not in allowed:
            raise ValueError(f"schedule = {self.schedule!r}: optim.name={self.name!r} has no such schedule; expected "
                             f"one of {', '.join(allowed)} (or another optim.name)")
        return self


class TrainConfig(Section):
    epochs: int = Field(20, ge=1)
    batch_size: int = Field(256, ge=1)  # global samples per optimizer step
    grad_accum: int = Field(1, ge=1)
    max_steps: PosInt | None = None  # stop early (smoke runs)
    precision: Literal["auto", "fp32", "bf16"] = "auto"  # auto = bf16 on GPU, fp32 on CPU
    compile: bool = False
    eval_every: int = Field(500, ge=1)  # steps; every evaluation also checkpoints
    keep_best: int = Field(2, ge=1)
    best_metric: str = Field("eval/match_acc", min_length=1)
    best_mode: Literal["max", "min"] = "max"
    log_every: int = Field(20, ge=1)
    seed: Seed = 0
    # A testing aid (docs/reliability.md, "Fault injection"): a Train worker exits once at each of these
    # steps (one step or a list), and at `random_faults` more steps drawn from `fault_seed` and the run name.
    fail_at_step: list[PosInt] | None = None
    random_faults: int = Field(0, ge=0)
    fault_seed: Seed = 0

    @field_validator("fail_at_step", mode="before")
    @classmethod
    def _one_or_more(cls, v: Any) -> Any:
        return [v] if isinstance(v, int) and not isinstance(v, bool) else v


class ScaleConfig(Section):
    num_workers: int = Field(1, ge=1)
    gpus_per_worker: float = Field(0, ge=0)
    # Leave CPUs for Ray Data's read tasks: workers holding every CPU starve the pipeline.
    cpus_per_worker: float = Field(0.5, gt=0)
    max_failures: int = Field(2, ge=0)
    storage_path: str | None = Field(None, min_length=1)  # default: ./runs (env XMODAL_STORAGE_PATH on a cluster)
    placement_strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] = "SPREAD"
    # Extra custom resources per worker.
    resources_per_worker: dict[Annotated[str, Field(min_length=1)], Annotated[float, Field(ge=0)]] = \
        Field(default_factory=dict)


# What xmodal.tracking.resolve_tracking_uri takes: a URI with a scheme, never a bare path.
TRACKING_URI_HELP = ("sqlite:///PATH (a SQLite file, e.g. sqlite:///mlflow.db), http(s)://HOST:PORT (a tracking "
                     "server), file:///DIR (a folder) or another MLflow store URI (postgresql://..., databricks://PROFILE)")


class MlflowConfig(Section):
    tracking_uri: str | None = None  # default: sqlite:///mlflow.db (env MLFLOW_TRACKING_URI wins)
    experiment: str = Field("xmodal-pretrain", min_length=1)
    # Also the Ray Train run name: rerun with the same name to resume.
    run_name: str | None = Field(None, min_length=1)
    system_metrics: bool = True
    # How long any wait of the run (driver and workers) for a busy or unreachable tracking store lasts
    # (seconds): then the metrics sender and the run's end write what they could not log to
    # <scale.storage_path>/<run name>/mlflow_unlogged.jsonl (replayed with jobs/replay_tracking.py) and
    # other calls fail. Training waits only at a checkpoint, for its steps' metrics to be sent or spooled.
    outage_wait_s: float = Field(300.0, ge=0, le=3600)
    # Register the run's final model (its MLflow logged model) in the Model Registry under this name, a
    # new version per run: `models:/NAME/<version>`. A sweep registers only its best trial's
    # (`jobs/sweep.py --register NAME`, alias `best`).
    registered_model: str | None = Field(None, pattern=MODEL_NAME_RE)

    @field_validator("experiment", "run_name")
    @classmethod
    def _trimmed(cls, name: str | None) -> str | None:
        # ' ' or 'run ' would name an MLflow run (and a folder) that looks unnamed or like another's.
        if name and name.strip() != name:
            raise ValueError(f"got {name!r}; expected a non-empty name without leading or trailing spaces")
        return name

    @field_validator("run_name")
    @classmethod
    def _folder_name(cls, name: str | None) -> str | None:
        # The run name is also its folder under scale.storage_path (checkpoints, fault markers).
        if name is not None and (any(c in name for c in "/\\") or name in (".", "..")):
            raise ValueError(f"got {name!r}; expected a name without / or \\ (it names the run's folder under "
                             "scale.storage_path)")
        return name

    @field_validator("tracking_uri")
    @classmethod
    def _uri(cls, uri: str | None) -> str | None:
        if uri is None:
            return uri
        scheme = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*):", uri)
        if scheme is None or (len(scheme.group(1)) == 1 and uri[2:3] in ("\\", "/")):  # C:\... is a path
            raise ValueError(f"not a URI; use {TRACKING_URI_HELP}")
        if scheme.group(1) == "sqlite" and not uri.startswith("sqlite:///"):
            raise ValueError("a SQLite URI is sqlite:///RELATIVE/PATH or sqlite:////ABSOLUTE/PATH")
        if scheme.group(1) in ("http", "https") and not re.match(r"^https?://[^/\s]+", uri):
            raise ValueError("expected http(s)://HOST[:PORT]")
        return uri


def store_field() -> Any:
    # None = the embedded synthetic store; a path is checked when the job opens it.
    return Field(None, min_length=1)


def _job_defaults(cls: type[BaseModel], data: Any) -> Any:
    """A partial config keeps this job's defaults for the keys it does not set: `load_config` fills its
    raw dict with them before the --set overrides (so `train.epochs.x=1` finds a value, not a section),
    and every job's validation does (a sweep's base config, `model_validate` of a YAML mapping): without
    this, a pretraining `{"train": {"max_steps": 1200}}` would fall back to TrainConfig's generic batch
    size 256. The model section is overrides on top of its preset instead (`_resolve_preset`)."""
    if not isinstance(data, dict):
        return data
    # model_construct: the defaults without this validation again (it would recurse); a recipe's values
    # between them and the data (the user's keys win). Neither the model nor the preset, a stage's (a
    # chain's `pretrain`) included: a default model there would be taken for overrides on the stage's preset.
    exclude: dict[str, Any] = {"model": True, "preset": True}
    exclude.update({field: {"model": True, "preset": True} for field, _ in _stages(cls)})
    defaults = cls.model_construct().model_dump(mode="python", exclude=exclude)
    return deep_merge(deep_merge(defaults, _recipe_layer(cls, data)), data)


def _stages(cls: type[BaseModel]) -> Iterable[tuple[str, type[JobConfig]]]:
    """The fields of a job's config that are job configs of their own (a chain's stages)."""
    for field, info in cls.model_fields.items():
        if isinstance(info.annotation, type) and issubclass(info.annotation, JobConfig):
            yield field, info.annotation


def _recipe_layer(cls: type[BaseModel], data: dict) -> dict:
    """The values of the recipes a raw config names, its own and its stages', as a nested dict."""
    out = recipe_tree(data.get("recipe"), getattr(cls, "RECIPES", {}))
    for field, stage in _stages(cls):
        layer = _recipe_layer(stage, data[field]) if isinstance(data.get(field), dict) else {}
        if layer:
            out = {**out, field: deep_merge(out.get(field, {}), layer)}
    return out


def with_recipes(cls: type[BaseModel], data: dict, given: dict) -> dict:
    """`data` (a job's defaults merged with what the user gave, `given`) with the values of the recipe it
    names wherever the user gave no value, down through the stages of a chain."""
    recipes = getattr(cls, "RECIPES", {})
    name = given.get("recipe")
    if recipes and name in recipes:
        mine = dotted_keys(given)
        for key, value in recipes[name].values().items():
            if key not in mine:
                data = set_dotted(data, key, value)
    for field, stage in _stages(cls):
        if isinstance(given.get(field), dict):
            data = {**data, field: with_recipes(stage, data.get(field, {}), given[field])}
    return data


def _resolve_preset(data: Any, presets: dict[str, Any], default: str) -> Any:
    """`preset: NAME` plus `model: {overrides}` -> a full model dict (overrides on top of the preset)."""
    if not isinstance(data, dict):
        return data
    name = data.get("preset", default)
    if name not in presets:
        return data  # the Literal check on `preset` reports it
    overrides = data.get("model") or {}
    if isinstance(overrides, dict) and not dataclasses.is_dataclass(overrides):
        data = {**data, "model": {**dataclasses.asdict(presets[name]), **overrides}}
    return data


class JobConfig(Section):
    """A job's whole config: a partial one keeps the job's defaults (`_job_defaults`); with `PRESETS`,
    its `model` section is overrides on top of the preset its `preset` names."""

    PRESETS: ClassVar[dict[str, Any] | None] = None
    USES: ClassVar[tuple[Use, ...]] = ()  # options read only under a condition (`unused_options`)
    RECIPES: ClassVar[dict[str, Recipe]] = {}  # the job's recipes (config/recipes.py), its `recipe` field's choices

    @field_validator("recipe", check_fields=False)
    @classmethod
    def _known_recipe(cls, name: str | None) -> str | None:
        if name is not None and name not in cls.RECIPES:
            raise ValueError(f"{name!r} is not a recipe of this job; valid: {', '.join(cls.RECIPES)} (each with its "
                             "values: --help)")
        return name

    @model_validator(mode="before")
    @classmethod
    def _defaults_and_preset(cls, data: Any) -> Any:
        data = _job_defaults(cls, data)
        if cls.PRESETS is not None:
            data = _resolve_preset(data, cls.PRESETS, cls.model_fields["preset"].default)
        problems = type_problems(cls, data)
        if problems:  # before pydantic, which would convert them
            raise ValueError("\n  ".join(problems))
        return data

    @model_validator(mode="after")
    def _finite(self) -> JobConfig:
        # pydantic's floats take inf and nan ('inf' and 'nan' as text too), and inf passes a lower bound
        # (`optim.lr=inf`): no option of ours means anything at either.
        for loc, value in config_values(self):
            if isinstance(value, float) and not math.isfinite(value):
                raise ValueError(f"{'.'.join(map(str, loc))} = {value}: expected {finite_bounds(type(self), loc)}")
        return self


_SCALAR_NAMES = {bool: "true or false", int: "an integer", float: "a finite number"}


def type_problems(model: type, data: Any) -> list[str]:
    """One line per value of the raw config `data` whose type a bool, int or float field of `model` does not
    take as it is (`config.paths.mistyped_values`): `true` is not 1, "3" is not 3, 1.0 is not an integer.
    A float field takes an integer (lr: 1 is 1.0)."""
    out = []
    for loc, value, typ, meta in mistyped_values(model, data):
        want = (describe_bounds(meta, _SCALAR_NAMES[typ]) if typ is not bool else None) or _SCALAR_NAMES[typ]
        shown = short_repr(value)
        out.append(f"{'.'.join(map(str, loc))}{f' = {shown}' if shown else ''}: expected {want}, got "
                   f"{_what_it_is(value, typ)}")
    return out


def _what_it_is(value: Any, typ: type) -> str:
    """What a mistyped value is, with the fix where it is only written the wrong way."""
    if isinstance(value, bool):
        return "true or false"
    if isinstance(value, float):
        return "a number with a fraction" + (f" (write {int(value)})" if value.is_integer() else "")
    if isinstance(value, int):
        return "a number"
    if isinstance(value, str):
        try:
            unquoted = load_yaml(value)
        except yaml.YAMLError:
            unquoted = None
        return "text" + (" (in quotes: write it without them)" if fits(typ, unquoted) else "")
    return f"a {type(value).__name__}"


def finite_bounds(model: type, loc: tuple) -> str:
    """'a finite number > 0', ...: what the float field at `loc` allows."""
    return describe_bounds(type_at(model, loc)[1], "a finite number") or "a finite number"


def check_batch(train: TrainConfig, scale: ScaleConfig) -> None:
    """The global batch splits evenly into workers x accumulation steps (the jobs' micro-batches)."""
    per_step = scale.num_workers * train.grad_accum
    if train.batch_size % per_step:
        raise ValueError(f"train.batch_size = {train.batch_size}: expected a multiple of scale.num_workers x "
                         f"train.grad_accum = {scale.num_workers} x {train.grad_accum} = {per_step}")


def check_plateau(optim: OptimConfig, valid: list[str], where: str) -> None:
    """The plateau watches a metric the job evaluates (`valid`, measured `where`)."""
    if optim.schedule == "plateau" and optim.plateau.metric not in valid:
        raise ValueError(f"optim.plateau.metric: {optim.plateau.metric!r} is not measured {where}; valid: "
                         f"{', '.join(valid)}")


class RobustSection(Section):
    @field_validator("conditions", check_fields=False)
    @classmethod
    def _distinct(cls, conditions: list[str]) -> list[str]:
        if len(set(conditions)) < len(conditions):
            raise ValueError(f"expected each condition once, got {conditions}")
        return conditions


# ---------------------------------------------------------------- options that nothing uses


@dataclass(frozen=True)
class Use:
    """An option (a field, or a whole section: every key under it) that the job reads only when `when`
    holds on its config: given otherwise, it would change nothing, so it is an error naming `what`
    reads it and the setting (`now`) that leaves it unread."""

    key: str  # dotted, from the job's config
    when: Callable[[Any], bool]
    what: str  # "by ...", "to ...": what reads it
    now: Callable[[Any], str]  # the setting that leaves it unread
    hint: str = "drop it"


EMBEDDED_USE = Use("data.synthetic", lambda c: c.data.store is None, "to build the embedded synthetic store "
                  "(data.store unset)", lambda c: f"data.store={c.data.store!r} is read instead")
FAULT_SEED_USE = Use("train.fault_seed", lambda c: c.train.random_faults > 0,
                     "to draw train.random_faults's steps", lambda c: "train.random_faults=0")
PLATEAU_USE = Use("optim.plateau", lambda c: c.optim.schedule == "plateau", "by the plateau schedule "
                  "(optim.schedule=plateau)", lambda c: f"optim.schedule={c.optim.schedule!r}")
WARMUP_USE = Use("optim.warmup_ratio", lambda c: c.optim.schedule != "plateau", "by the linear, constant and "
                 "cosine schedules", lambda c: "optim.schedule='plateau' (its rate starts at the peak)")
CROSS_USE = Use("model.shared_cross_attention", lambda c: c.model.x_layers > 0, "by the cross-modality layers "
                "(model.x_layers > 0)", lambda c: "model.x_layers=0")
# The conditional options every job has (the embedded store, random faults, the schedules); an LXMERT
# job adds CROSS_USE.
SHARED_USES = (EMBEDDED_USE, FAULT_SEED_USE, PLATEAU_USE, WARMUP_USE)


def unused_options(cfg: BaseModel, given: Iterable[str], prefix: str = "") -> list[str]:
    """One line per option in `given` (dotted keys a user set) that `cfg`, a job's validated config, does
    not read (its class's `USES`); the stages of a chain are walked under their own prefix."""
    keys = sorted(set(given))
    stage = f" (in {prefix.rstrip('.')})" if prefix else ""  # what/now name keys within the stage
    out = []
    for use in getattr(type(cfg), "USES", ()):  # a section has none
        if use.when(cfg):
            continue
        full = prefix + use.key
        for key in (k for k in keys if k == full or k.startswith(full + ".")):
            shown = short_repr(_value_at(cfg, key[len(prefix):]))
            out.append(f"{key}{f' = {shown}' if shown else ''}: only used {use.what}, but {use.now(cfg)}{stage}; "
                       f"{use.hint}")
    for name in type(cfg).model_fields:
        sub = getattr(cfg, name)
        if isinstance(sub, JobConfig):
            out += unused_options(sub, keys, f"{prefix}{name}.")
    return out


def _value_at(cfg: Any, key: str) -> Any:
    node = cfg
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else getattr(node, part, None)
    return node


def check_used(cfg: BaseModel, given: dict | Iterable[str], source: str) -> None:
    """Raise ConfigError listing every option a user gave (`given`: their raw config, or its dotted keys)
    that this config does not read."""
    problems = unused_options(cfg, dotted_keys(given) if isinstance(given, dict) else given)
    if problems:
        raise ConfigError(f"invalid config ({source}):\n" + "\n".join(f"  {x}" for x in problems))


# ---------------------------------------------------------------- loading and overrides


def format_validation_error(err: ValidationError, model: type, source: str) -> str:
    """One line per problem: the dotted key, the bad value and what is allowed (no pydantic noise,
    no dumps of whole sections)."""
    lines: list[str] = []
    for e in err.errors():
        line = error_line(e, model)
        if line not in lines:
            lines.append(line)
    return f"invalid config ({source}):\n" + "\n".join(f"  {x}" for x in lines)


_BOUND_ERRORS = ("greater_than", "greater_than_equal", "less_than", "less_than_equal")
# A check's message that starts with a field name ("hidden_size = 130: ...", "MultConfig.dim = 31: ...",
# "run_id: required ...", a dotted key within the section: "optim.lr = inf: ...") is reported under that
# field's dotted key.
_FIELD_MESSAGE = re.compile(r"^(?:[A-Z]\w*\.)?([a-z_][\w.]*)(?= = |: )")


def error_line(e: dict, model: type) -> str:
    """One pydantic error as `key = value: expected ...` (or `key: ...`)."""
    loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and p.startswith("function-")))
    key = ".".join(str(p) for p in loc)
    got = short_repr(e.get("input"))
    kind = e["type"]
    if kind in ("extra_forbidden", "unexpected_keyword_argument"):
        return f"{key}: unknown key; valid keys here: {', '.join(keys_beside(model, loc))}"
    if kind == "missing":
        return f"{key}: required"
    if kind in ("value_error", "assertion_error"):
        msg = str(e["msg"]).removeprefix("Value error, ").removeprefix("Assertion failed, ")
        m = _FIELD_MESSAGE.match(msg)
        if loc and m and m.group(1).split(".")[0] in field_names(type_at(model, loc)[0]):
            return f"{key}.{m.group(1)}{msg[m.end():]}"
        return f"{key}: {msg}" if loc else msg  # a check across sections names its keys itself
    msg = str(e["msg"]).removeprefix("Input should be ")
    if kind in _BOUND_ERRORS:
        typ, meta = type_at(model, loc)
        what = "an integer" if typ is int else "a finite number" if _non_finite(e.get("input")) else "a number"
        msg = describe_bounds(meta, what) or msg
    elif kind == "string_too_short":
        msg = "a non-empty string"
    elif kind == "too_short":
        n = (e.get("ctx") or {}).get("min_length", 1)
        msg = f"at least {n} item{'s' if n != 1 else ''}"
    elif kind == "string_type" and isinstance(e.get("input"), (bool, int, float)):
        msg = f"text (quote it: '{e['input']}')"
    where = key or "<top level>"
    return f"{where} = {got}: expected {msg}" if got is not None else f"{where}: expected {msg}"


def _non_finite(value: Any) -> bool:
    """Whether a value given for a float field is inf or nan (pydantic reads 'inf' and 'nan' as such)."""
    try:
        return not isinstance(value, bool) and not math.isfinite(float(value))
    except (TypeError, ValueError, OverflowError):
        return False


def short_repr(value: Any, limit: int = 60) -> str | None:
    """repr of a value, or None for a long one (a whole section is not worth printing)."""
    text = repr(value)
    return text if len(text) <= limit else None


def parse_override(item: str) -> tuple[list[str], Any]:
    key, _, raw = item.partition("=")
    if "=" not in item or not all(part.strip() for part in key.split(".")):
        raise ConfigError(f"--set {item!r}: expected KEY=VALUE with a dotted key, e.g. train.epochs=3")
    try:
        value = load_yaml(raw) if raw != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"--set {item!r}: the value is not valid YAML: {yaml_problem(e)}") from None
    return key.strip().split("."), value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    for item in overrides:
        path, value = parse_override(item)
        data = set_dotted(data, ".".join(path), value, "--set ", ConfigError)
    return data


def check_each_key_once(given: list[tuple[str, str]]) -> None:
    """Refuse two overrides of one layer (`given`: (how the user wrote it, KEY=VALUE)) that set the same
    key, or a section and a key inside it: applied in order, the later would silently throw the earlier
    away (a flag is an override too: `--seed 2 --set train.seed=1`)."""
    seen: list[tuple[str, list[str], bool]] = []  # (as written, key path, from --set)
    for shown, item in given:
        path, from_set = parse_override(item)[0], shown.startswith("--set ")
        for before, other, other_set in seen:
            n = min(len(path), len(other))
            if path[:n] == other[:n]:
                inner, outer = (path, other) if len(path) >= len(other) else (other, path)
                whole = "" if inner == outer else f" ({before if outer is other else shown} sets all of " \
                                                  f"{'.'.join(outer)})"
                expected = "each key once" if from_set and other_set else "one of them"
                raise ConfigError(f"{before} and {shown} both set {'.'.join(inner)}{whole}; expected {expected}")
        seen.append((shown, path, from_set))


def read_yaml(path: str | Path) -> dict:
    p = Path(path)
    text = read_user_file(p)
    try:
        data = load_yaml(text) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {yaml_problem(e)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a mapping of config sections at the top level, got {type(data).__name__}")
    return data


def load_config(model: type[Section], path: str | Path | None = None, overrides: list[str] | None = None,
                base: dict | None = None) -> Any:
    """YAML file (optional) + dotted overrides -> a validated config of type `model`.

    Files and overrides are merged into the config's own defaults, so `--set train.epochs=2`
    keeps the job's other `train` defaults. The model section is the exception: it is
    overrides on top of the chosen preset. An option given (in `base`, the file or an override)
    that the resulting config does not read is an error (`check_used`).
    """
    data = _job_defaults(model, base or {})
    given = base or {}  # what the user wrote, without the defaults: the options they set
    source = "defaults"
    if path is not None:
        raw = read_yaml(path)
        data, given = deep_merge(data, raw), deep_merge(given, raw)
        source = str(path)
    if overrides:
        data = apply_overrides(data, overrides)
        given = apply_overrides(given, overrides)
        source += " + --set " + " ".join(overrides)
    data = with_recipes(model, data, given)
    try:
        cfg = model.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, model, source)) from None
    check_used(cfg, given, source)
    return cfg


def flatten(cfg: BaseModel | dict, prefix: str = "") -> dict[str, Any]:
    """{'a': {'b': 1}} -> {'a.b': 1}, for MLflow params."""
    data = cfg.model_dump(mode="json") if isinstance(cfg, BaseModel) else cfg
    out: dict[str, Any] = {}
    for k, v in data.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v
    return out
