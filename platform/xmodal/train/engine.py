"""The one job engine: a typed job spec, one driver and one worker for every training job.

A job (pretraining, fine-tuning, MulT, the pretrain-then-fine-tune chain) is a `JobSpec` subclass in
its own module: what data it reads, how the model's dimensions follow from that data, the objective,
the worker's train batches and evaluation, and what happens at the end. The engine does the rest,
the same way for every job:

    driver  check (config -> data -> dimensions -> steps -> model on the meta device -> batches)
            -> plan (MLflow run, found by name to resume) -> Ray Train -> finish (artifacts, status)
    worker  start-up -> seed -> objective -> starting weights -> restore -> `fit` with `RunHooks`

`check` runs every test a worker would make, before `ray.init` and before any MLflow run or database
exists: bad input fails in the driver as one `UserError`, never as retried worker failures.
The worker side is `xmodal.train.worker`; what a run records in MLflow, `xmodal.train.record`; fault
injection, `xmodal.train.faults`. `xmodal.train.inprocess.run_in_process` runs a job's worker in this
process without Ray (tests, learning measurements).
"""

from __future__ import annotations

import dataclasses
import functools
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import torch
import yaml
from torch import nn

from xmodal import console, errors, run_tags, tracking
from xmodal.config import ConfigError, flatten
from xmodal.data.common import epoch_samples
from xmodal.train import checkpoint as ckpt
from xmodal.train import record, recovery
from xmodal.train.cluster import check_cluster, connect, storage_path
from xmodal.train.faults import check_fault_storage, fault_schedule
from xmodal.train.interrupt import GracefulStop

if TYPE_CHECKING:  # the worker module imports this one; its Worker only annotates the spec's hooks here
    from xmodal.train.worker import Worker


class JobSpec:
    """One training job. Subclasses set the class attributes and override the hooks they need."""

    name: ClassVar[str]  # the job's key: sweeps' `job:`, MLflow's `task` tag, run names
    config_class: ClassVar[type]  # its pydantic config (xmodal.config)
    optimizer: ClassVar[str] = "adamw"  # or "adam" (the MulT reference)
    # Model selection on a validation split: the best weights travel in every checkpoint and
    # `held_out` evaluates them at the end.
    selects_on_validation: ClassVar[bool] = False

    # ------------------------------------------------ driver
    def check_inputs(self, cfg, tracking_uri: str) -> None:
        """Checks of the config's other inputs (files, runs) that need no data: made before the data is
        opened or the embedded default built."""

    def resolve_data(self, cfg) -> Any:
        """Open the configured data, or build the embedded default; a UserError names the key."""
        raise NotImplementedError

    def resolve_start(self, cfg, data, tracking_uri: str, download_dir: Path) -> tuple[dict[str, Any], Any]:
        """Where the weights come from: (plain data the workers get in the plan, the architecture it
        fixes or None). Default: from scratch, the configured architecture."""
        return {}, None

    def fit_to_data(self, cfg, data, pretrained) -> Any:
        """The config with the model's dimensions taken from the data; checks naming the key."""
        return cfg

    def train_examples(self, cfg, data) -> int:
        raise NotImplementedError

    def epoch_steps(self, cfg, data, micro: int, workers: int, epoch: int) -> int:
        """Optimizer steps of an epoch that every worker can take (its share of the train split)."""
        return self.train_examples(cfg, data) // workers // micro // cfg.train.grad_accum

    def run_name(self, cfg) -> str:
        return self.name

    def tags(self, cfg, data, start: dict[str, Any]) -> dict[str, str]:
        return {}

    def baselines(self, cfg, data) -> dict[str, list]:
        """metric -> [value, what it is] (chance level or prior), logged as `baseline/*`."""
        return {}

    def metric_order(self, cfg) -> list[str]:
        """The evaluation metrics in the order the console's tables show them (others follow by name)."""
        return []

    def dataset(self, cfg, data) -> dict[str, Any]:
        """The run's data as MLflow's dataset input shows it: {"name", "rows": {split: count}, "dims":
        {name: width}} (the path and fingerprint are the engine's)."""
        return {"name": Path(self.data_path(data)).name, "rows": {}, "dims": {}}

    def check_batches(self, cfg, data) -> None:
        """Build what turns the data into batches, so that a worker would not reject it."""

    # ------------------------------------------------ driver and worker
    def data_path(self, data) -> str:
        return str(data.path)

    def open_data(self, path: str) -> Any:
        raise NotImplementedError

    def build_objective(self, cfg, data) -> nn.Module:
        raise NotImplementedError

    def prepare_options(self, cfg) -> dict[str, Any]:
        return {}

    def exported_model(self, objective: nn.Module) -> nn.Module:
        """What the run's MLflow model holds: the bare model under the objective (no losses or
        metrics), the one a user runs on new inputs."""
        return getattr(objective, "model", objective)

    def step_kwargs(self, cfg) -> Callable[[int], dict[str, Any]]:
        """epoch -> train_step's keyword arguments (pretraining: the tasks active in that epoch)."""
        return _no_step_kwargs

    # ------------------------------------------------ worker
    def setup(self, w: Worker) -> None:
        """Once per worker, before training: build what the batches and evaluation share (`w.parts`)."""

    def load_start(self, objective: nn.Module, cfg, data, start: dict[str, Any]) -> str | None:
        """Put the starting weights in place (fresh runs only); returns a line saying what was loaded."""
        return None

    def train_batches(self, w: Worker, epoch: int, skip: int) -> Iterable[Any]:
        """This worker's micro-batches of `epoch`, the first `skip` left out (on the device)."""
        raise NotImplementedError

    def evaluate(self, w: Worker) -> dict[str, float]:
        raise NotImplementedError

    def held_out(self, w: Worker, folder: Path | None) -> dict[str, float]:
        """At the end, with the selected model (selects_on_validation): the held-out splits' metrics;
        files written to `folder` (rank 0 only) are logged as the run's artifacts."""
        return {}

    # ------------------------------------------------ the whole job
    def run(self, cfg, source: str = "defaults", parent_run_id: str | None = None,
            tags: dict[str, str] | None = None, callbacks: list | None = None) -> RunResult:
        """One run; a job made of stages (the chain) overrides this with engine calls of its own."""
        return run(self, cfg, source, parent_run_id, tags, callbacks)

    def check(self, cfg) -> Checked:
        return check(self, cfg)


def _no_step_kwargs(epoch: int) -> dict[str, Any]:
    return {}


# ---------------------------------------------------------------- driver


def configured_or_embedded(configured: str | None, embedded: Callable[[], Any], open_data: Callable[[Path], Any],
                           build_hint: str) -> Any:
    """`data.store` opened, or with it unset the job's embedded default (built on first use); a
    path that does not exist is an error saying how to build one (`build_hint`, a command line)."""
    if configured is None:
        return embedded()
    path = Path(configured).expanduser().resolve()
    if not path.exists():
        raise ConfigError(f"data.store: {str(path)!r} does not exist; build it with `{build_hint.format(path=path)}` "
                          "or leave data.store unset for the embedded synthetic data")
    return open_data(path)


@dataclass
class Checked:
    """A config that passed every check, with what the checks resolved."""

    cfg: Any  # dimensions from the data, run name set
    data: Any
    start: dict[str, Any]
    micro_batch: int
    total_steps: int
    tracking_uri: str
    storage: str
    faults: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # (step, rank): the testing aid
    epoch_steps: list[int] = dataclasses.field(default_factory=list)  # `epoch_plan`
    parameters: int = 0  # the model's, counted on the meta device


@dataclass
class RunPlan:
    """Everything a worker needs, resolved on the driver (plain JSON-able data)."""

    job: str
    config: dict[str, Any]
    data: str  # the path the job's `open_data` reopens on the worker
    start: dict[str, Any]  # the job's `resolve_start` result
    tracking_uri: str
    run_id: str
    run_name: str
    storage: str
    total_steps: int
    micro_batch: int
    faults: list[tuple[int, int]]  # (step, rank) at which a worker exits once (fault injection, a testing aid)
    fault_dir: str | None  # where each fault, once injected, leaves its marker
    epoch_steps: list[int]  # the steps of each epoch, the same on every worker (`epoch_plan`)
    baselines: dict[str, list] = dataclasses.field(default_factory=dict)
    metric_order: list[str] = dataclasses.field(default_factory=list)  # the console's tables
    verbose: bool = False  # Ray's own output on the workers too (`--verbose`)


@dataclass
class RunResult:
    """What a finished run returns: its MLflow run, its last report, its final checkpoint."""

    run_id: str
    run_name: str
    tracking_uri: str
    metrics: dict[str, Any]
    checkpoint: Any = None  # ray.train.Checkpoint
    baselines: dict[str, list] = dataclasses.field(default_factory=dict)


def split_batch(cfg) -> int:
    """The micro-batch per worker (the config checks at load that the batch splits evenly)."""
    return cfg.train.batch_size // (cfg.scale.num_workers * cfg.train.grad_accum)


def epoch_plan(spec: JobSpec, cfg, data, micro: int, workers: int) -> list[int]:
    """The optimizer steps of each epoch the run trains (the last one cut at `train.max_steps`):
    every worker takes exactly these, so the loop needs no agreement on who still has a batch."""
    plan: list[int] = []
    for epoch in range(cfg.train.epochs):
        steps = spec.epoch_steps(cfg, data, micro, workers, epoch)
        if steps < 1:
            raise ConfigError(f"train.batch_size {cfg.train.batch_size} is larger than a worker's share of the "
                              f"{spec.train_examples(cfg, data)} training examples of {spec.data_path(data)}")
        if cfg.train.max_steps and sum(plan) + steps >= cfg.train.max_steps:
            return [*plan, cfg.train.max_steps - sum(plan)]
        plan.append(steps)
    return plan


def dealt_epoch_steps(units, cfg, micro: int, workers: int, epoch: int) -> int:
    """`JobSpec.epoch_steps` of a job whose train split is dealt out in units (row groups, see
    `data.common.epoch_units`): every worker stops an epoch when the one with the fewest samples
    runs out."""
    shares = epoch_samples(units, seed=cfg.train.seed, epoch=epoch, world=workers)
    return min(shares) // micro // cfg.train.grad_accum


def check(spec: JobSpec, cfg) -> Checked:
    """Every check a worker would make, in the driver, before Ray or MLflow start: the config's own
    bounds (pydantic, at load), the job's other inputs, then the data, the dimensions, the steps, the
    model built on the meta device and the batch builder. Raises UserError."""
    micro = split_batch(cfg)
    uri = tracking.resolve_tracking_uri(cfg.mlflow.tracking_uri)
    storage = storage_path(cfg.scale.storage_path)
    name = cfg.mlflow.run_name or f"{spec.run_name(cfg)}-{time.strftime('%Y%m%d-%H%M%S')}"
    cfg = cfg.model_copy(update={"mlflow": cfg.mlflow.model_copy(update={"run_name": name})})
    spec.check_inputs(cfg, uri)
    check_fault_storage(cfg.train, storage)
    if cfg.train.max_steps:  # the run has at most max_steps steps: faults beyond them fail before any data
        fault_schedule(cfg.train, cfg.scale.num_workers, cfg.train.max_steps, storage, name)
    embedded = getattr(getattr(cfg, "data", None), "store", "") is None
    if embedded:  # an unreachable cluster is known before the embedded default is built, not after
        check_cluster(cfg.scale)
    data = spec.resolve_data(cfg)
    start, pretrained = spec.resolve_start(cfg, data, uri, Path(storage) / name / "init")
    cfg = spec.fit_to_data(cfg, data, pretrained)
    epochs = epoch_plan(spec, cfg, data, micro, cfg.scale.num_workers)
    total = sum(epochs)
    try:
        with torch.device("meta"):  # the whole model, no memory: shapes and options checked
            parameters = sum(p.numel() for p in spec.build_objective(cfg, data).parameters())
    except (ValueError, TypeError) as e:
        raise ConfigError(f"model: {e}") from None
    spec.check_batches(cfg, data)
    if not embedded:
        check_cluster(cfg.scale)
    return Checked(cfg, data, start, micro, total, uri, storage,
                   fault_schedule(cfg.train, cfg.scale.num_workers, total, storage, name), epochs, parameters)


def plan(spec: JobSpec, checked: Checked, source: str, parent_run_id: str | None = None,
         tags: dict[str, str] | None = None) -> RunPlan:
    """Open (or find again) the MLflow run of a checked config; log its baselines."""
    cfg, data = checked.cfg, checked.data
    name = cfg.mlflow.run_name
    all_tags = {run_tags.TASK: spec.name, run_tags.STORE: spec.data_path(data), run_tags.CONFIG_SOURCE: source,
                run_tags.TOTAL_STEPS: str(checked.total_steps),
                **record.reproducibility_tags(cfg, spec.data_path(data)),
                **spec.tags(cfg, data, checked.start), **(tags or {})}
    run_id = record.open_run(checked.tracking_uri, cfg.mlflow.experiment, name, flatten(cfg), all_tags,
                             parent_run_id, where=functools.partial(record.resume_note, checked.storage, name))
    record.log_dataset(spec, cfg, data, checked.tracking_uri, run_id)
    baselines = spec.baselines(cfg, data)
    if baselines:
        tracking.log_metrics(checked.tracking_uri, run_id,
                             {f"baseline/{k.split('/', 1)[-1]}": v[0] for k, v in baselines.items()})
    return RunPlan(job=spec.name, config=cfg.model_dump(mode="json"), data=spec.data_path(data),
                   start=checked.start, tracking_uri=checked.tracking_uri, run_id=run_id, run_name=name,
                   storage=checked.storage, total_steps=checked.total_steps, epoch_steps=checked.epoch_steps,
                   micro_batch=checked.micro_batch,
                   faults=checked.faults,
                   fault_dir=str(Path(checked.storage) / name / ".faults") if checked.faults else None,
                   baselines=baselines, metric_order=spec.metric_order(cfg), verbose=console.verbose())


def trainer(spec: JobSpec, plan: RunPlan, data, callbacks: list | None = None, stop_flag=None):
    """A TorchTrainer running `worker` for the plan: CPUs left for Ray Data, failures retried, the
    best checkpoints kept. Sweeps pass Tune's report callback; command-line runs the flag that
    Ctrl-C sets (`interrupt.GracefulStop`)."""
    import ray.train
    from ray.train.torch import TorchTrainer

    from xmodal.train.worker import worker  # imported here: the worker module imports the engine's RunPlan

    cfg = spec.config_class.model_validate(plan.config)
    scale, train = cfg.scale, cfg.train
    resources = {"CPU": scale.cpus_per_worker, **scale.resources_per_worker}
    if scale.gpus_per_worker:
        resources["GPU"] = scale.gpus_per_worker
    return TorchTrainer(
        functools.partial(worker, spec, stop_flag=stop_flag),
        train_loop_config=dataclasses.asdict(plan),
        scaling_config=ray.train.ScalingConfig(
            num_workers=scale.num_workers, use_gpu=scale.gpus_per_worker > 0, resources_per_worker=resources,
            placement_strategy=scale.placement_strategy),
        run_config=ray.train.RunConfig(
            name=plan.run_name, storage_path=plan.storage, callbacks=callbacks,
            # Ray Train's INFO lines (worker group start, every report and checkpoint) unless --verbose
            logging_config=ray.train.LoggingConfig(log_level="INFO" if plan.verbose else "WARNING"),
            failure_config=ray.train.FailureConfig(max_failures=scale.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(
                num_to_keep=train.keep_best, checkpoint_score_attribute=train.best_metric,
                checkpoint_score_order=train.best_mode)),
    )


def train_and_finish(spec: JobSpec, plan: RunPlan, data, callbacks: list | None = None) -> RunResult:
    """Ray Train, then the final artifacts; the MLflow run ends FINISHED, FAILED on any error, or
    KILLED when Ctrl-C stopped it (RunInterrupted). A run with callbacks is a sweep trial: Tune stops
    trials by interrupting them, and the sweep driver, which knows a stop from an error, marks the
    run's end (KILLED or FAILED)."""
    interruptible = callbacks is None and threading.current_thread() is threading.main_thread()
    term = signal.getsignal(signal.SIGTERM) if interruptible else None
    connect()
    if interruptible and term is not None:  # ray.init's SIGTERM handler exits without a word: keep the cli's
        signal.signal(signal.SIGTERM, term)
    console.CONSOLE.begin(plan.total_steps, plan.baselines, plan.metric_order)
    try:
        try:
            if interruptible:
                with GracefulStop() as stop:
                    result = stop.run(trainer(spec, plan, data, callbacks, stop.flag).fit)
            else:
                result = trainer(spec, plan, data, callbacks).fit()
            stopped = interruptible and stop.requested and (result.metrics or {}).get("final") != 1
            if result.metrics and "step" in result.metrics and not stopped:
                console.CONSOLE.settle(int(result.metrics["step"]), result.metrics)
        finally:
            console.CONSOLE.end()
        if stopped:
            step = int((result.metrics or {}).get("step", 0))
            raise _stopped(plan, errors.RunInterrupted(f"at step {step}", step))
        finish_run(plan, result.checkpoint, spec, data)
    except errors.RunInterrupted:
        raise
    except KeyboardInterrupt:
        if not interruptible:
            raise
        import ray

        # The workers end first (a local Ray stops, a cluster ends the job's actors): a checkpoint they
        # were still writing would otherwise land after the look at storage below.
        ray.shutdown()
        found, _ = recovery.newest_intact(*recovery.run_folder(plan.storage, plan.run_name))
        step = found.step if found is not None else 0
        raise _stopped(plan, errors.RunInterrupted("at once", step, "" if found else " (no checkpoint was written)")
                       ) from None
    except BaseException as e:
        if callbacks is None:
            out = outbox(plan)
            out.terminated("FAILED")
            out.report()
        write_error = checkpoint_write_error(e)
        if write_error is not None:
            raise ckpt.CheckpointStorageError(write_error.advice()) from None
        raise
    return RunResult(plan.run_id, plan.run_name, plan.tracking_uri, result.metrics or {}, result.checkpoint,
                     plan.baselines)


def _stopped(plan: RunPlan, stop: errors.RunInterrupted) -> errors.RunInterrupted:
    """The run's end after Ctrl-C: KILLED in MLflow, tagged with the step a rerun resumes from."""
    out = outbox(plan)
    out.tags({run_tags.STOPPED_AT_STEP: str(stop.step)})
    out.terminated("KILLED")
    out.report()
    return stop


def checkpoint_write_error(error: BaseException) -> ckpt.CheckpointWriteError | None:
    """The CheckpointWriteError a worker raised, wherever it sits in what `fit()` raised: Ray Train's
    WorkerGroupError holds each worker's exception (`worker_failures`), a ControllerError its cause."""
    seen: set[int] = set()
    todo: list[Any] = [error]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, ckpt.CheckpointWriteError):
            return e
        todo += [e.__cause__, e.__context__, getattr(e, "controller_failure", None),
                 *(getattr(e, "worker_failures", None) or {}).values()]
    return None


def run(spec: JobSpec, cfg, source: str = "defaults", parent_run_id: str | None = None,
        tags: dict[str, str] | None = None, callbacks: list | None = None) -> RunResult:
    """check -> plan -> Ray Train -> finish, for one run of any job."""
    checked = check(spec, cfg)
    p = plan(spec, checked, source, parent_run_id, tags)
    checked_cfg = checked.cfg  # the run name set; `cfg.mlflow.run_name` below is the one given
    console.CONSOLE.show(console.banner(
        job=spec.name, run_name=p.run_name, data=spec.data_path(checked.data),
        train_examples=spec.train_examples(checked_cfg, checked.data), preset=getattr(checked_cfg, "preset", None),
        parameters=checked.parameters, steps=p.total_steps, epochs=len(p.epoch_steps),
        batch_size=checked_cfg.train.batch_size, workers=checked_cfg.scale.num_workers,
        gpus_per_worker=checked_cfg.scale.gpus_per_worker, tracking_uri=p.tracking_uri,
        experiment=checked_cfg.mlflow.experiment, run_id=p.run_id, storage=p.storage))
    try:
        return train_and_finish(spec, p, checked.data, callbacks)
    except errors.RunInterrupted as e:
        if cfg.mlflow.run_name is None:  # a generated name: the same command would start a new run
            e.hint = f" with --run-name {p.run_name}"
        raise


def outbox(plan: RunPlan) -> tracking.Outbox:
    """The driver's end-of-run MLflow calls, retried while the server is down (`mlflow.outage_wait_s`),
    then kept in the run's spool file for jobs/replay_tracking.py."""
    return tracking.Outbox(plan.tracking_uri, plan.run_id, tracking.spool_path(plan.storage, plan.run_name),
                           plan.config["mlflow"]["outage_wait_s"])


def finish_run(plan: RunPlan, checkpoint, spec: JobSpec | None = None, data=None) -> None:
    """Log the resolved config and the final checkpoint's files as artifacts, the final model as the
    run's MLflow model (with `spec` and `data`), then mark the MLflow run finished."""
    out = outbox(plan)
    with tempfile.TemporaryDirectory() as tmp:
        cfg_file = Path(tmp) / "config.yaml"
        cfg_file.write_text(yaml.safe_dump(plan.config, sort_keys=False))
        out.artifact(cfg_file)
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            for f in (ckpt.MODEL_FILE, ckpt.META_FILE):
                out.artifact(Path(d) / f, "model")
            if spec is not None and not out.spooled and tracking.reachable(plan.tracking_uri):
                record.log_model(spec, plan, data, Path(d))
    out.terminated("FINISHED")
    out.report()


def run_job(spec: JobSpec, cfg, source: str = "defaults") -> RunResult:
    """What a job's command line runs: one run (the spec's `run`), or with `seeds` in the config one
    run per seed under a parent run holding every metric's mean and std over the seeds."""
    seeds = getattr(cfg, "seeds", None)
    if not seeds:
        return _run_and_sum_up(spec, cfg, source)
    for seed in seeds:  # every seed's config is checked before the first run starts
        spec.check(_seeded(cfg, seed, "check"))
    uri = tracking.resolve_tracking_uri(cfg.mlflow.tracking_uri)
    base = cfg.mlflow.run_name or f"{spec.run_name(cfg)}-{time.strftime('%Y%m%d-%H%M%S')}"
    parent = record.open_run(uri, cfg.mlflow.experiment, base, flatten(cfg),
                             {run_tags.TASK: spec.name, run_tags.SEEDS: ",".join(map(str, seeds))})
    try:
        finals = [_run_and_sum_up(spec, _seeded(cfg, seed, f"{base}-seed{seed}"), source, parent).run_id
                  for seed in seeds]
    except KeyboardInterrupt as e:  # the seed's run says where it stopped; a rerun resumes it
        tracking.set_terminated(uri, parent, "KILLED")
        if isinstance(e, errors.RunInterrupted) and cfg.mlflow.run_name is None:
            e.hint = f" with --run-name {base}"  # the seeds' runs are named after it
        raise
    return RunResult(parent, base, uri, record.finish_seeds_parent(uri, parent, finals, seeds))


def _run_and_sum_up(spec: JobSpec, cfg, source: str, parent_run_id: str | None = None) -> RunResult:
    started = time.monotonic()
    out = spec.run(cfg, source, parent_run_id=parent_run_id)
    c = console.CONSOLE
    c.show(console.end_summary(
        run_name=out.run_name, wall_s=time.monotonic() - started, metrics=out.metrics, history=c.history,
        baselines=out.baselines, order=c.order, checkpoint=out.checkpoint.path if out.checkpoint is not None else None,
        run_id=out.run_id, view=tracking.ui_command(out.tracking_uri)))
    return out


def _seeded(cfg, seed: int, name: str):
    return cfg.model_copy(update={"seeds": None, "train": cfg.train.model_copy(update={"seed": seed}),
                                  "mlflow": cfg.mlflow.model_copy(update={"run_name": name})})
