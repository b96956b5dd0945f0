"""What a training job is to the engine: a `JobSpec` (three small protocols), what its driver side
resolves (`PreparedJob`), the plan every worker gets (`RunPlan`), a config that passed every check
(`CheckedRun`, which a run takes as it is), and what a run returns (`RunResult`).

A job (pretraining, fine-tuning, MulT, the pretrain-then-fine-tune chain) is one `JobSpec` subclass
in its own module. It says three things, each a few methods:

    data        prepare (driver: config -> opened data, fitted config, what the run records about it)
                open_data (a worker reopens the data from its path)
    model       build_objective, load_start, step_kwargs
    worker      train_batches, evaluate, held_out

Checking and running a job are the engine's (`engine.check`, `engine.run`), the same for every
job. A job made of stages (the chain) is a `StagedJob`: stages of ordinary specs that the engine
checks and runs in order. docs/architecture.md, "The job spec: where a job plugs in", walks through one spec.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn

from xmodal.base.outputs import refuse_half_uri
from xmodal.config.experiment import ConfigError
from xmodal.data.errors import StoreError
from xmodal.data.location import locate
from xmodal.data.units import epoch_samples
from xmodal.runner.hooks import ValidationSelection


@dataclass
class PrepareContext:
    """What a job's `prepare` gets beside the config."""

    tracking_uri: str  # "" in-process (no MLflow)
    download_dir: Path  # where starting weights from an MLflow run are downloaded
    data: Any = None  # the data, already open (in-process runs); None: the configured or embedded data
    before_build: Callable[[], None] = lambda: None  # called before the embedded default is built


@dataclass
class PreparedJob:
    """What a job's driver side resolves from a config: the opened data, the config fitted to it,
    and what the engine records and plans with. Every check a worker would make on the data and the
    starting weights has passed."""

    cfg: Any  # the model's dimensions taken from the data
    data: Any  # the opened store or fine-tuning set
    path: str  # where the workers reopen it (`JobSpec.open_data`)
    train_examples: int
    units: Sequence[Any]  # the train split's units, dealt out to the workers each epoch (data/units.py)
    dataset: dict[str, Any]  # MLflow's dataset input: {"name", "rows": {split: count}, "dims": {name: width}}
    start: dict[str, Any] = dataclasses.field(default_factory=dict)  # where the weights come from (plain
    # data in the plan, for `load_start`); empty: from scratch
    tags: dict[str, str] = dataclasses.field(default_factory=dict)
    baselines: dict[str, list] = dataclasses.field(default_factory=dict)  # metric -> [chance or prior, what it is]
    metric_order: list[str] = dataclasses.field(default_factory=list)  # the console tables' order
    train_options: dict[str, Any] = dataclasses.field(default_factory=dict)  # runtime.prepare's DDP options
    # What the workers build their batches with, made once here (pretraining's masking batch builder:
    # plain data, pickled to the workers in the plan); None for jobs whose data builds its own.
    builder: Any = None


@dataclass
class RunPlan:
    """Everything a worker needs, resolved on the driver. `check` fills all but the MLflow run;
    `engine.open_run` sets `run_id`. The plan travels as itself: pickled to Ray Train's workers
    (`engine.trainer`), the config inside it the typed object `check` validated and fitted, the batch
    builder the one `prepare` made. The config is dumped to JSON only where it is written down (the
    run's `config.yaml`, a checkpoint's `meta.json`, the MLflow model)."""

    job: str
    config: Any  # the job's config class (pydantic), validated once, at load, and fitted by `prepare`
    data: str  # the path the job's `open_data` reopens on the worker
    start: dict[str, Any]  # PreparedJob.start
    train_options: dict[str, Any]  # PreparedJob.train_options
    tracking_uri: str
    run_name: str
    storage: str
    total_steps: int
    micro_batch: int
    epoch_steps: list[int]  # the steps of each epoch, the same on every worker (`epoch_plan`)
    faults: list[tuple[int, int]]  # (step, rank) at which a worker exits once (fault injection, a testing aid)
    fault_dir: str | None  # where each fault, once injected, leaves its marker
    baselines: dict[str, list] = dataclasses.field(default_factory=dict)
    metric_order: list[str] = dataclasses.field(default_factory=list)
    builder: Any = None  # PreparedJob.builder
    run_id: str = ""
    verbose: bool = False  # Ray's own output on the workers too (`--verbose`)


@dataclass
class CheckedRun:
    """A config that passed every check (`engine.check`): the plan the workers get (no MLflow run yet),
    with what the driver alone needs (the opened data, and the model's size for the banner). The run
    (`engine.run`) takes it as it is: nothing is checked or prepared twice."""

    plan: RunPlan
    prepared: PreparedJob
    parameters: int  # the model's, counted on the meta device
    generated_name: bool = False  # the run's name was made by `named` (a rerun must be given it to resume)
    resumes: Any = None  # the newest intact checkpoint a rerun resumes from (`recovery.Found`), found once


@dataclass
class CheckedStages:
    """A staged job's stages, each checked (`StagedJob.check_stages`) before the first starts, in the
    order they run, with the job's own config (its run named)."""

    cfg: Any
    stages: list[CheckedRun]
    generated_name: bool = False

    @property
    def plan(self) -> RunPlan:
        """The first stage's plan (its data is what the job reads first)."""
        return self.stages[0].plan


@dataclass
class CheckedSeeds:
    """A run of several seeds (`seeds` in the config): every seed's run checked before the first starts
    (`{name}-seed{seed}`), and the parent run's config (its run named) that holds their summary."""

    cfg: Any
    seeds: dict[int, CheckedRun]
    generated_name: bool = False


@dataclass
class RunResult:
    """What a finished run returns: its MLflow run, its last report, its final checkpoint."""

    run_id: str
    run_name: str
    tracking_uri: str
    metrics: dict[str, Any]
    checkpoint: Any = None  # ray.train.Checkpoint
    baselines: dict[str, list] = dataclasses.field(default_factory=dict)


@dataclass
class Trial:
    """A run that is a sweep trial: Tune stops it by interrupting it, and the sweep driver (which knows
    a stop from an error) marks the run's end (unless `marks_end`: the chain's pretraining stage).
    With `report` (Tune's), the run's one worker runs in this process and reports there
    (`session.TrialSession`); else Ray Train runs the workers and reports to Tune through `callbacks`."""

    callbacks: list = dataclasses.field(default_factory=list)
    report: Callable[[dict[str, Any]], None] | None = None
    marks_end: bool = False

    @property
    def in_process(self) -> bool:
        return self.report is not None


@dataclass
class Worker:
    """What a job's worker hooks see: the job's config and data, the training state, the place of
    this worker in the group, and how it reads its share of the train split (`ray_data`: through Ray
    Data on a Train worker; in-process, with the same units and batches, straight from the files)."""

    cfg: Any
    data: Any
    state: Any  # TrainState
    model: nn.Module  # the plain objective (no DDP, no compile): evaluation runs it directly
    rank: int
    world: int
    device: torch.device
    micro_batch: int
    ray_data: bool = False
    selection: ValidationSelection | None = None
    builder: Any = None  # the batch builder the driver made (`PreparedJob.builder`)

    def to_device(self, batch):
        return batch.to(self.device, torch.float32, non_blocking=True)


class JobSpec:
    """One training job. Subclasses set the class attributes and implement the protocols' methods."""

    name: ClassVar[str]  # the job's key: sweeps' `job:`, MLflow's `task` tag
    config_class: ClassVar[type]  # its pydantic config (xmodal.config.experiment)
    run_name: ClassVar[str]  # a run's default name (a timestamp follows): format fields of `cfg`
    # Model selection on a validation split: the best weights travel in every checkpoint and
    # `held_out` evaluates them at the end.
    selects_on_validation: ClassVar[bool] = False

    # ------------------------------------------------ data
    def prepare(self, cfg, inputs: PrepareContext) -> PreparedJob:
        """The data opened (`open_configured`), the starting weights resolved, the config fitted to
        both, and the batch builder made once. Raises UserError naming the key."""
        raise NotImplementedError

    def open_data(self, path: str) -> Any:
        raise NotImplementedError

    # ------------------------------------------------ model
    def build_objective(self, cfg, data) -> nn.Module:
        """The model under its losses and metrics; its bare model is `.model` (the run's MLflow model)."""
        raise NotImplementedError

    def load_start(self, objective: nn.Module, cfg, data, start: dict[str, Any]) -> str | None:
        """Put the starting weights in place (fresh runs only); returns a line saying what was loaded."""
        return None

    def step_kwargs(self, cfg) -> Callable[[int], dict[str, Any]]:
        """epoch -> train_step's keyword arguments (pretraining: the tasks active in that epoch)."""
        return _no_step_kwargs

    # ------------------------------------------------ worker
    def train_batches(self, w: Worker, epoch: int, skip: int) -> Iterable[Any]:
        """This worker's micro-batches of `epoch`, the first `skip` left out (on the device)."""
        raise NotImplementedError

    def evaluate(self, w: Worker) -> dict[str, float]:
        raise NotImplementedError

    def held_out(self, w: Worker, folder: Path | None) -> dict[str, float]:
        """At the end, with the selected model (selects_on_validation): the held-out splits' metrics;
        files written to `folder` (rank 0 only) are logged as the run's artifacts."""
        return {}


class StagedJob:
    """A job made of ordinary specs run one after the other (the pretrain-then-fine-tune chain). The
    engine knows it: `engine.check` and `engine.run` hand it their own `check` and `run`, with which it
    checks every stage once, before the first starts, and runs them in order, each with its checked
    result (`CheckedStages`); the last stage's run is the
    job's result (the one a sweep trial reports). Like a spec, it names its job and config class."""

    name: ClassVar[str]
    config_class: ClassVar[type]
    run_name: ClassVar[str]

    def check_stages(self, cfg, check: Callable[[JobSpec, Any], CheckedRun]) -> CheckedStages:
        """`check` (the engine's) on every stage's spec and config (`cfg`: the job's, its run named), once:
        their results, in order, with `cfg`."""
        raise NotImplementedError

    def run_stages(self, checked: CheckedStages, run: Callable[..., RunResult], source: str,
                   parent_run_id: str | None, tags: dict[str, str] | None, trial: Trial | None) -> RunResult:
        """The stages run in order through `run` (the engine's), each with its checked result
        (`run(..., checked=)`); returns the last stage's result."""
        raise NotImplementedError


def _no_step_kwargs(epoch: int) -> dict[str, Any]:
    return {}


def timestamped(stem: str) -> str:
    """`stem` and the time to the second: a new run's or sweep's name when none is given."""
    return f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}"


def named(spec: JobSpec | StagedJob, cfg) -> Any:
    """The config with its run's name: the one given (`mlflow.run_name`), else the job's default (its
    `run_name`, formatted with `cfg`) and the time. The one place a run is named."""
    if cfg.mlflow.run_name:
        return cfg
    name = timestamped(spec.run_name.format(cfg=cfg))
    return cfg.model_copy(update={"mlflow": cfg.mlflow.model_copy(update={"run_name": name})})


def open_configured(inputs: PrepareContext, configured: str | None, embedded: Callable[[], Any],
                    open_data: Callable[[Any], Any], build_hint: str) -> Any:
    """The data already open (`inputs.data`), or `data.store` opened, or with it unset the job's
    embedded default (built on first use, after `inputs.before_build`); a path that does not exist
    is an error saying how to build one (`build_hint`, a command line). `data.store` is a local path
    or a URI (`s3://bucket/prefix/store`: read where it is, `data.location.Location`)."""
    if inputs.data is not None:
        return inputs.data
    if configured is None:
        inputs.before_build()
        return embedded()
    refuse_half_uri(configured, "data.store")  # `s3:/bucket/x` is no local folder named `s3:`
    path = locate(configured)
    if not path.exists():
        build = (f"`{build_hint.format(path=path.name)}` and upload it to {path}" if path.remote
                 else f"`{build_hint.format(path=path)}`")
        raise ConfigError(f"data.store: {str(path)!r} does not exist; build it with {build} "
                          "or leave data.store unset for the embedded synthetic data")
    try:
        return open_data(path)
    except StoreError as e:  # the store's own message names the file; the key says where it was given
        raise ConfigError(f"data.store: {e}") from None


def with_data_sizes(model: Any, preset: Any, sizes: dict[str, tuple[int, str]], data: str) -> Any:
    """`model` (a model config dataclass) with the sizes its data fixes: `sizes` maps a field to the
    data's value and how to say it ("{} answers"). A field set away from its preset to another value
    than the data's could not be honoured, so it is an error naming the key, both values and the data;
    set to the data's value (a run's logged config on its own store), it passes."""
    for field, (value, what) in sizes.items():
        given = getattr(model, field)
        if given != value and given != getattr(preset, field):
            raise ConfigError(f"model.{field}: {given} set, but the model's {field} comes from the data, and "
                              f"{data} has {what.format(value)}; drop the key (or set it to {value})")
    return dataclasses.replace(model, **{field: value for field, (value, _) in sizes.items()})


def split_batch(cfg) -> int:
    """The micro-batch per worker (the config checks at load that the batch splits evenly)."""
    return cfg.train.batch_size // (cfg.scale.num_workers * cfg.train.grad_accum)


def epoch_plan(prepared: PreparedJob, micro: int, workers: int) -> list[int]:
    """The optimizer steps of each epoch the run trains (the last one cut at `train.max_steps`).
    Each epoch deals the train split's units out to the workers from the seed (`data.units.epoch_units`);
    every worker stops the epoch when the one with the fewest samples runs out, so every worker takes
    exactly these steps and the loop needs no agreement on who still has a batch."""
    cfg = prepared.cfg
    plan: list[int] = []
    for epoch in range(cfg.train.epochs):
        shares = epoch_samples(prepared.units, seed=cfg.train.seed, epoch=epoch, world=workers)
        steps = min(shares) // micro // cfg.train.grad_accum
        if steps < 1:
            raise ConfigError(f"train.batch_size {cfg.train.batch_size} is larger than a worker's share of the "
                              f"{prepared.train_examples} training examples of {prepared.path}")
        if cfg.train.max_steps and sum(plan) + steps >= cfg.train.max_steps:
            return [*plan, cfg.train.max_steps - sum(plan)]
        plan.append(steps)
    return plan
