"""Search-space files: a typed schema, loading, and validation against the trial job's config.

A space file names the job every trial runs, its base config, the metric, the scheduler and the
parameters (dotted config keys, or named options that set several keys at once). Everything is
checked here, before Ray starts: the file's own schema (unknown keys are errors), the ranges,
the conditions, the configurations to try first, and every parameter value against the job's
pydantic config (each choice value, both ends of each range, and every combination when the
space is small). Imports no Ray and no Optuna: `DefineByRun` only calls a trial's `suggest_*`.
"""

from __future__ import annotations

import copy
import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from xmodal.config.experiment import (
    ConfigError,
    apply_overrides,
    check_used,
    format_validation_error,
    short_repr,
)
from xmodal.config.paths import config_has, deep_merge, dotted_keys, unknown_key
from xmodal.config.paths import set_dotted as _set_dotted
from xmodal.config.yaml_files import load_yaml, read_user_file, yaml_problem

Scalar = bool | int | float | str
NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9._-]*$"
# Keys the sweep sets itself for every trial (where the job's config has them).
SWEEP_OWNED = ("mlflow.", "scale.storage_path", "data.store", "data.synthetic.")
# Above this many combinations of probe values, parameters are checked one at a time only.
MAX_COMBINATIONS = 256
# An integer range's inner values checked one at a time (`interior_points`); a longer range: its first
# and last half of this many.
MAX_INTERIOR = 256


class SpaceError(ConfigError):
    """A bad search-space file; the message names the file, the key and what was expected."""


class _Strict(BaseModel):
    # strict: a space's numbers and switches are taken as YAML wrote them, never converted (`low: 1.0` is not
    # an integer, `log: 1` not true), as in the job configs (xmodal.config.experiment.type_problems)
    model_config = ConfigDict(extra="forbid", strict=True)


# ---------------------------------------------------------------- parameters


class _Param(_Strict):
    # `when: {other: value}` or `when: {other: [v1, v2]}`: the parameter exists only in trials where
    # every named (earlier) parameter took one of the listed values.
    when: dict[str, Scalar | list[Scalar]] | None = None

    def conditions(self) -> dict[str, list[Scalar]]:
        return {k: (v if isinstance(v, list) else [v]) for k, v in (self.when or {}).items()}

    def active(self, chosen: dict[str, Any]) -> bool:
        return all(k in chosen and _member(chosen[k], vs) for k, vs in self.conditions().items())

    def assignments(self, name: str, value: Any) -> dict[str, Any]:
        """Dotted config key -> value that this parameter's value stands for."""
        return {name: value}


class IntParam(_Param):
    type: Literal["int"]
    low: int
    high: int
    step: int = Field(1, ge=1)
    log: bool = False

    def problems(self) -> list[str]:
        out = []
        if self.low >= self.high:
            out.append(f"low ({self.low}) must be below high ({self.high})")
        if self.log and self.low <= 0:
            out.append(f"log: true needs low > 0 (got low={self.low})")
        if self.log and self.step != 1:
            out.append("log: true cannot be combined with step != 1 (Optuna refuses it)")
        if self.low < self.high and (self.high - self.low) % self.step:
            out.append(f"high - low ({self.high - self.low}) must be a multiple of step ({self.step})")
        return out

    def contains(self, v: Any) -> bool:
        return (isinstance(v, int) and not isinstance(v, bool) and self.low <= v <= self.high
                and (v - self.low) % self.step == 0)

    def describe(self) -> str:
        return f"an integer in [{self.low}, {self.high}]" + (f" in steps of {self.step}" if self.step > 1 else "")

    def probes(self) -> list[Any]:
        return [self.low, self.high]

    def suggest(self, trial: Any, name: str) -> Any:
        return trial.suggest_int(name, self.low, self.high, step=self.step, log=self.log)


class FloatParam(_Param):
    type: Literal["float"]
    low: float
    high: float
    log: bool = False
    step: float | None = Field(None, gt=0)

    def problems(self) -> list[str]:
        out = []
        if not (math.isfinite(self.low) and math.isfinite(self.high)):
            out.append(f"low and high must be finite numbers (got {self.low}, {self.high})")
        elif self.low >= self.high:
            out.append(f"low ({self.low:g}) must be below high ({self.high:g})")
        if self.log and self.low <= 0:
            out.append(f"log: true needs low > 0 (got low={self.low:g})")
        if self.log and self.step is not None:
            out.append("log: true cannot be combined with step (Optuna refuses it)")
        return out

    def contains(self, v: Any) -> bool:
        return isinstance(v, int | float) and not isinstance(v, bool) and self.low <= v <= self.high

    def describe(self) -> str:
        return f"a number in [{self.low:g}, {self.high:g}]" + (" (log scale)" if self.log else "")

    def probes(self) -> list[Any]:
        return [self.low, self.high]

    def suggest(self, trial: Any, name: str) -> Any:
        return trial.suggest_float(name, self.low, self.high, step=self.step, log=self.log)


class ChoiceParam(_Param):
    """`values: [...]` (the parameter is a config key) or `options: {label: {key: value, ...}}`
    (the parameter is a label; each option sets several config keys, e.g. a pretraining-task subset)."""

    type: Literal["choice"]
    values: list[Scalar] | None = None
    options: dict[str, dict[str, Any]] | None = None

    def problems(self) -> list[str]:
        if (self.values is None) == (self.options is None):
            return ["give exactly one of `values` (a list) or `options` (label -> {dotted key: value})"]
        labels = self.labels()
        if not labels:
            return ["needs at least one value"]
        out = []
        seen: list[Any] = []
        for v in labels:
            if _member(v, seen):
                out.append(f"value {v!r} is listed twice")
            seen.append(v)
        for label, mapping in (self.options or {}).items():
            for key in mapping:
                if not re.match(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$", str(key)):
                    out.append(f"option {label!r}: {key!r} is not a dotted config key")
        return out

    def labels(self) -> list[Any]:
        return list(self.values) if self.values is not None else list(self.options or {})

    def contains(self, v: Any) -> bool:
        return _member(v, self.labels())

    def describe(self) -> str:
        return "one of " + ", ".join(repr(v) for v in self.labels())

    def probes(self) -> list[Any]:
        return self.labels()

    def assignments(self, name: str, value: Any) -> dict[str, Any]:
        if self.options is not None:
            return dict(self.options[value])
        return {name: value}

    def suggest(self, trial: Any, name: str) -> Any:
        return trial.suggest_categorical(name, self.labels())


Param = Annotated[IntParam | FloatParam | ChoiceParam, Field(discriminator="type")]


def _same_point(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(_member(a[k], [b[k]]) for k in a)


def _member(v: Any, values: list[Any]) -> bool:
    """`v in values` that tells True from 1 and 1.0 from "1.0"."""
    return any(type(v) is type(x) and v == x for x in values) or (
        isinstance(v, int | float) and not isinstance(v, bool)
        and any(isinstance(x, int | float) and not isinstance(x, bool) and v == x for x in values))


# ---------------------------------------------------------------- the file


class AshaSpec(_Strict):
    """Asynchronous successive halving; time is counted in reports (one per evaluation)."""

    type: Literal["asha"]
    # A full trial's number of reports (evaluations). Rungs lie at grace_period * reduction_factor**k
    # below it; how long a trial trains is the job config's (train.max_steps / epochs), never cut at max_t.
    max_t: int = Field(ge=2)
    grace_period: int = Field(1, ge=1)  # no trial is stopped before this many reports
    reduction_factor: float = Field(2, gt=1)


class FifoSpec(_Strict):
    """No early stopping: every trial runs to its end."""

    type: Literal["fifo"]


class BaseSpec(_Strict):
    file: str | None = None  # a config YAML, relative to the space file
    config: dict[str, Any] = Field(default_factory=dict)  # inline config sections, merged over `file`
    set: list[str] = Field(default_factory=list)  # dotted KEY=VALUE overrides, applied last


class SearchSpace(_Strict):
    job: Literal["pretrain", "mult", "pretrain_finetune"]
    description: str = ""
    name: str | None = Field(None, pattern=NAME_RE)  # default: <file stem>-<timestamp>
    experiment: str | None = None  # MLflow experiment; default: xmodal-sweep-<file stem>
    base: BaseSpec = Field(default_factory=BaseSpec)
    metric: str
    mode: Literal["max", "min"]
    num_samples: int = Field(8, ge=1)
    max_concurrent: int = Field(2, ge=1)
    gpus_per_trial: float = Field(0, ge=0)
    # A trial whose Train run fails (its workers' own retries, scale.max_failures, spent) is started again
    # this many times; it resumes from its latest checkpoint into the same MLflow run.
    trial_retries: int = Field(1, ge=0)
    seed: int = 0  # the sampler's seed, and the trials' train.seed unless base or a parameter sets it
    scheduler: Annotated[AshaSpec | FifoSpec, Field(discriminator="type")]
    parameters: dict[str, Param] = Field(min_length=1)
    try_first: list[dict[str, Scalar]] = Field(default_factory=list)
    # The configuration the report tests every row against (t-tests, Holm-adjusted): a value for every
    # parameter that applies; run first when `try_first` does not list it. Default: try_first[0].
    baseline: dict[str, Scalar] | None = None

    def first_points(self) -> list[dict[str, Any]]:
        """The configurations Optuna evaluates first: the baseline (unless listed), then try_first."""
        points = [dict(p) for p in self.try_first]
        if self.baseline is not None and not any(_same_point(self.baseline, p) for p in points):
            points.insert(0, dict(self.baseline))
        return points

    def baseline_point(self) -> dict[str, Any] | None:
        """The report's baseline: `baseline`, else the first `try_first` configuration."""
        if self.baseline is not None:
            return dict(self.baseline)
        return dict(self.try_first[0]) if self.try_first else None

    def assignments(self, chosen: dict[str, Any]) -> dict[str, Any]:
        """A trial's parameter values -> the dotted config keys they set."""
        out: dict[str, Any] = {}
        for name, p in self.parameters.items():
            if name in chosen:
                out.update(p.assignments(name, chosen[name]))
        return out

    def config_keys(self) -> dict[str, list[str]]:
        """Config key -> the parameters that set it."""
        out: dict[str, list[str]] = {}
        for name, p in self.parameters.items():
            keys = [name] if not isinstance(p, ChoiceParam) or p.options is None else \
                sorted({k for m in p.options.values() for k in m})
            for k in keys:
                out.setdefault(k, []).append(name)
        return out


class DefineByRun:
    """Optuna define-by-run function of a space: conditional parameters are suggested only when their
    condition holds. A plain class (not a closure) because Tune saves the searcher with pickle."""

    def __init__(self, parameters: dict[str, Any]):
        self.parameters = dict(parameters)

    def __call__(self, trial: Any) -> None:
        chosen: dict[str, Any] = {}
        for name, p in self.parameters.items():
            if p.active(chosen):
                chosen[name] = p.suggest(trial, name)


# ---------------------------------------------------------------- loading


def _read_mapping(p: Path, prefix: str, what: str = "", kind: str = "config file") -> dict:
    text = read_user_file(p, kind, prefix, SpaceError)
    try:
        data = load_yaml(text)
    except yaml.YAMLError as e:
        raise SpaceError(f"{prefix}{p}: not valid YAML: {yaml_problem(e)}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise SpaceError(f"{prefix}{p}: expected a mapping {what}at the top level, got {type(data).__name__}")
    return data


def _loc(loc: tuple) -> str:
    parts = [p for p in loc if not (isinstance(p, str) and p.startswith("function-"))]
    if len(parts) >= 2 and parts[0] == "parameters":
        rest = [p for p in parts[2:] if p not in ("int", "float", "choice")]
        return f"parameters.{parts[1]}" + ("".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in rest))
    if len(parts) >= 2 and parts[0] == "scheduler" and parts[1] in ("asha", "fifo"):
        parts = [parts[0], *parts[2:]]
    return "".join(f"[{p}]" if isinstance(p, int) else (f".{p}" if i else str(p)) for i, p in enumerate(parts)) \
        or "<top level>"


def _schema_error(err: ValidationError, source: str, flags: dict[str, str] | None = None) -> SpaceError:
    """One line per problem; `flags`: the top-level keys the command line set, named as its options."""
    lines = [f"invalid search space ({source}):"]
    for e in err.errors():
        key = _loc(tuple(e["loc"]))
        key = (flags or {}).get(key, key)
        if e["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key; {_valid_here(e['loc'])}")
        elif e["type"] in ("union_tag_invalid", "union_tag_not_found"):
            tags = "int, float, choice" if e["loc"][:1] == ("parameters",) else "asha, fifo"
            given = e.get("input", {}).get("type") if isinstance(e.get("input"), dict) else None
            lines.append(f"  {key}: `type` must be one of {tags} (got {given!r})" if given is not None
                         else f"  {key}: needs a `type`: one of {tags}")
        elif e["type"] == "missing":
            lines.append(f"  {key}: required" + _REQUIRED_HINTS.get(key, ""))
        else:
            msg = str(e["msg"]).removeprefix("Value error, ").removeprefix("Input should be ")
            got = short_repr(e.get("input"))  # never a whole mapping
            lines.append(f"  {key} = {got}: expected {msg}" if got is not None else f"  {key}: expected {msg}")
    return SpaceError("\n".join(lines))


_REQUIRED_HINTS = {
    "scheduler": " ({type: asha, max_t: REPORTS, grace_period: 1, reduction_factor: 2} or {type: fifo})",
    "mode": " (max or min)",
    "metric": " (a metric every trial reports, e.g. eval/match_acc)",
    "job": " (pretrain, mult or pretrain_finetune)",
}


def _valid_here(loc: tuple) -> str:
    models: dict[str, type[BaseModel]] = {"int": IntParam, "float": FloatParam, "choice": ChoiceParam,
                                          "asha": AshaSpec, "fifo": FifoSpec}
    model: type[BaseModel] = SearchSpace
    if loc[:1] == ("parameters",) and len(loc) > 3:
        model = models.get(loc[2], ChoiceParam)
    elif loc[:1] == ("scheduler",) and len(loc) > 2:
        model = models.get(loc[1], AshaSpec)
    elif loc[:1] == ("base",) and len(loc) > 1:
        model = BaseSpec
    return "valid keys here: " + ", ".join(model.model_fields)


def load_space(path: str | Path, overrides: dict[str, Any] | None = None) -> SearchSpace:
    """Parse and check a space file on its own (no job config needed). `overrides` replace top-level
    fields (the command line's --num-samples etc.)."""
    p = Path(path)
    data = _read_mapping(p, "", "(job, base, metric, mode, scheduler, parameters, ...) ", "search space")
    given = {k: v for k, v in (overrides or {}).items() if v is not None}
    data.update(given)
    try:
        space = SearchSpace.model_validate(data)
    except ValidationError as e:
        # a value from the command line is named as its option, not as the file's key it replaced
        raise _schema_error(e, str(p), {k: f"--{k.replace('_', '-')}" for k in given}) from None
    problems = structure_problems(space)
    if problems:
        raise SpaceError(f"invalid search space ({p}):\n" + "\n".join(f"  {x}" for x in problems))
    return space


def structure_problems(space: SearchSpace) -> list[str]:
    """What is wrong with ranges, conditions, overlaps and try_first, without looking at any config."""
    out: list[str] = []
    names = list(space.parameters)
    for i, (name, p) in enumerate(space.parameters.items()):
        where = f"parameters.{name}"
        if not re.match(NAME_RE, name):
            out.append(f"{where}: a parameter name is a dotted config key or a label of letters, digits, . _ -")
        out += [f"{where}: {x}" for x in p.problems()]
        for ref, allowed in p.conditions().items():
            if ref not in space.parameters:
                out.append(f"{where}.when: {ref!r} is not a parameter of this space; parameters: {', '.join(names)}")
            elif names.index(ref) >= i:
                out.append(f"{where}.when: {ref!r} must be declared before {name!r} (conditions refer to "
                           "earlier parameters)")
            else:
                target = space.parameters[ref]
                for v in allowed:
                    if not target.contains(v):
                        out.append(f"{where}.when: {ref}={v!r} can never happen; {ref} is {target.describe()}")
    for key, setters in space.config_keys().items():
        if len(setters) > 1:
            out.append(f"parameters: config key {key!r} is set by more than one parameter ({', '.join(setters)})")
        if key.startswith(SWEEP_OWNED) or key in (s.rstrip(".") for s in SWEEP_OWNED):
            out.append(f"parameters: {key!r} cannot be searched: the sweep sets mlflow.*, scale.storage_path "
                       "and the data store for every trial (the store is resolved once per sweep)")
    first = space.first_points()
    if len(first) > space.num_samples:
        what = "try_first and the baseline" if len(first) > len(space.try_first) else "try_first"
        out.append(f"{what}: {len(first)} configurations but num_samples is {space.num_samples}")
    for i, point in enumerate(space.try_first):
        out += [f"try_first[{i}]: {x}" for x in point_problems(space, point)]
    if space.baseline is not None:
        problems = point_problems(space, space.baseline)
        out += [f"baseline: {x}" for x in problems]
        if not problems:
            missing = [n for n, p in space.parameters.items() if n not in space.baseline and p.active(space.baseline)]
            if missing:
                out.append(f"baseline: gives no value for {', '.join(missing)}; expected a value for every parameter "
                           "that applies (the baseline is one configuration, one row of the report)")
    if isinstance(space.scheduler, AshaSpec) and space.scheduler.grace_period >= space.scheduler.max_t:
        out.append(f"scheduler.grace_period ({space.scheduler.grace_period}) must be below max_t "
                   f"({space.scheduler.max_t}): trials can only be stopped before their last report")
    return out


def point_problems(space: SearchSpace, point: dict[str, Any]) -> list[str]:
    out = []
    for key in point:
        if key not in space.parameters:
            out.append(f"{key!r} is not a parameter of this space; parameters: {', '.join(space.parameters)}")
    fixed: dict[str, Any] = {}
    for name, p in space.parameters.items():
        undecided = [ref for ref in p.conditions() if ref not in point and ref in space.parameters]
        if name in point:
            if not p.contains(point[name]):
                out.append(f"{name}={point[name]!r} is outside the space; {name} is {p.describe()}")
            elif undecided:
                out.append(f"{name} depends on {', '.join(undecided)}, which this configuration does not fix")
            elif not p.active(fixed):
                out.append(f"{name} is given but its condition does not hold here (when: {p.when})")
            else:
                fixed[name] = point[name]
    return out


# ---------------------------------------------------------------- base config and trial configs


def set_dotted(data: dict, key: str, value: Any, where: str = "") -> dict:
    """xmodal.config.paths.set_dotted, with a part on the way that is a value a SpaceError."""
    return _set_dotted(data, key, value, where, SpaceError)


def with_assignments(base: dict, assignments: dict[str, Any], where: str = "") -> dict:
    data = copy.deepcopy(base)
    for key, value in assignments.items():
        data = set_dotted(data, key, value, where)
    return data


def base_config(space: SearchSpace, space_path: str | Path, extra_sets: list[str] | None = None) -> dict:
    """The trials' common raw config: `base.file`, then `base.config`, then `base.set`, then --set."""
    data: dict[str, Any] = {}
    if space.base.file:
        f = Path(space.base.file)
        if not f.is_absolute():
            f = Path(space_path).resolve().parent / f
        data = _read_mapping(f, f"{space_path}: base.file: ")
    data = deep_merge(data, space.base.config)
    try:
        return apply_overrides(data, list(space.base.set) + list(extra_sets or []))
    except ConfigError as e:
        raise SpaceError(f"{space_path}: base.set / --set: {e}") from None


def validate_config(config_cls: type, raw: dict, source: str) -> Any:
    try:
        return config_cls.model_validate(raw)
    except ValidationError as e:
        raise ConfigError(format_validation_error(e, config_cls, source)) from None


def validate_space(space: SearchSpace, config_cls: type, base: dict, source: str) -> Any:
    """Check the base config and every parameter value against the job's config, before any trial.

    Each value is applied on top of the base together with the values its conditions need; both ends
    of numeric ranges and every choice are tried, and every combination when there are few; then an
    integer range's inner values (`interior_points`).
    Returns the validated base config.
    """
    job = f"the {space.job} config ({config_cls.__name__})"
    try:
        base_cfg = validate_config(config_cls, base, f"{source}: base config")
        check_used(base_cfg, base, f"{source}: base config")
    except ConfigError as e:
        raise SpaceError(str(e)) from None
    problems: list[str] = []
    for key in space.config_keys():
        section = key.split(".")[0]
        if not config_has(config_cls, section):
            problems.append(f"parameters: {key!r}: {section!r} is not a section of {job}; valid: "
                            f"{', '.join(config_cls.model_fields)}")
        elif (valid := unknown_key(config_cls, key)) is not None:
            problems.append(f"parameters: {key!r} is not a key of {job}; valid keys there: {', '.join(valid)}")
    if problems:
        raise SpaceError(f"invalid search space ({source}):\n" + "\n".join(f"  {x}" for x in problems))

    def check(chosen: dict[str, Any], what: str, allowed: str | None) -> str | None:
        assigned = space.assignments(chosen)
        raw = with_assignments(base, assigned, f"{source}: ")
        try:
            # A value this configuration does not read makes a trial that repeats another; options of
            # the base that some configurations do not read are the base's business.
            check_used(validate_config(config_cls, raw, ""), dotted_keys(assigned), "")
        except ConfigError as e:
            detail = str(e).split("\n", 1)[-1]
            return f"{what} is rejected by {job}:\n{detail}" + (f"\n    (the space allows {allowed})" if allowed
                                                                 else "")
        return None

    for what, point, allowed in probe_points(space):
        msg = check(point, what, allowed)
        if msg:
            problems.append(msg)
    if not problems:  # an integer range's inner values, where a rule between keys can refuse one (dim % heads)
        for points in interior_points(space):
            msg = next((m for what, point, allowed in points if (m := check(point, what, allowed))), None)
            if msg:
                problems.append(msg)
    if not problems:
        combos = _combinations(space)
        if combos is not None:
            for chosen in combos:
                msg = check(chosen, "the combination " + ", ".join(f"{k}={v!r}" for k, v in chosen.items()), None)
                if msg:
                    problems.append(msg)
                    break
    if problems:
        raise SpaceError(f"invalid search space ({source}):\n" + "\n".join(f"  {x}" for x in problems))
    return base_cfg


def probe_points(space: SearchSpace) -> list[tuple[str, dict[str, Any], str | None]]:
    """The configurations a space is checked at before any trial, as (what, the parameters' values, what
    a choice allows): each value of a choice and both ends of each range, with the values its conditions
    need; then try_first's and the baseline."""
    out = []
    for name, p in space.parameters.items():
        needs = _condition_values(space, name)
        for v in p.probes():
            out.append((f"parameter {name!r} = {v!r}", {**needs, name: v},
                        p.describe() if isinstance(p, ChoiceParam) else None))
    out += [(f"try_first[{i}] {point}", dict(point), None) for i, point in enumerate(space.try_first)]
    if space.baseline is not None:
        out.append((f"baseline {space.baseline}", dict(space.baseline), None))
    return out


def interior_points(space: SearchSpace) -> list[list[tuple[str, dict[str, Any], None]]]:
    """Per integer range, its values between the ends (`probe_points` has the ends), as probe points:
    all of them up to MAX_INTERIOR, else the first and last MAX_INTERIOR // 2 (where a divisibility rule
    shows). Checked against the config only: the run's own checks (`engine.check`) take the probes."""
    out = []
    for name, p in space.parameters.items():
        if isinstance(p, IntParam):
            inner = range(p.low + p.step, p.high, p.step)
            if len(inner) > MAX_INTERIOR:
                inner = [*inner[:MAX_INTERIOR // 2], *inner[-(MAX_INTERIOR // 2):]]
            needs = _condition_values(space, name)
            out.append([(f"parameter {name!r} = {v!r} ({p.describe()})", {**needs, name: v}, None) for v in inner])
    return out


def _condition_values(space: SearchSpace, name: str) -> dict[str, Any]:
    """Values of the parameters `name`'s conditions need (recursively): the first allowed of each."""
    out: dict[str, Any] = {}
    for ref, allowed in space.parameters[name].conditions().items():
        out.update(_condition_values(space, ref))
        out[ref] = allowed[0]
    return out


def _combinations(space: SearchSpace) -> list[dict[str, Any]] | None:
    """Every combination of probe values that the conditions allow, or None when there are too many."""
    sizes = [len(p.probes()) for p in space.parameters.values()]
    if math.prod(sizes) > MAX_COMBINATIONS:
        return None
    out: list[dict[str, Any]] = [{}]
    for name, p in space.parameters.items():
        nxt = []
        for chosen in out:
            if p.active(chosen):
                nxt += [{**chosen, name: v} for v in p.probes()]
            else:
                nxt.append(chosen)
        out = nxt
    unique = {repr(sorted(c.items(), key=lambda kv: kv[0])): c for c in out}
    return list(unique.values())
