"""The one job engine: one driver for every training job (`xmodal.runner.spec` says what a job is).

    driver  check (config -> faults -> the job's `prepare`: data, starting weights, dimensions ->
                   cluster -> steps -> model on the meta device) -> a `RunPlan`
            -> open_run (MLflow run, found by name to resume) -> Ray Train -> finish (artifacts, status)
    worker  `xmodal.runner.worker`: start-up -> seed -> objective -> starting weights -> restore -> `fit`

`check` runs every test a worker would make, before `ray.init` and before any MLflow run or database
exists: bad input fails in the driver as one `UserError`, never as retried worker failures.
What a run records in MLflow is `xmodal.runner.run_record`'s; fault injection, `xmodal.runner.faults`;
`xmodal.runner.inprocess.run_in_process` runs a job's worker in this process without Ray (tests,
learning measurements).
"""

from __future__ import annotations

import dataclasses
import functools
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import yaml

from xmodal import tracking
from xmodal.base import console, errors, run_tags
from xmodal.base.scores import SELECTED_PREFIX
from xmodal.config import recipes
from xmodal.config.experiment import ConfigError, flatten
from xmodal.core import checkpoint as ckpt
from xmodal.runner import recovery, timeline
from xmodal.runner import run_record as record
from xmodal.runner.faults import check_fault_storage, fault_schedule
from xmodal.runner.inprocess import in_trial_process
from xmodal.runner.interrupt import GracefulStop
from xmodal.runner.ray_cluster import check_cluster, connect, init_download_dir, storage_path
from xmodal.runner.spec import (
    CheckedRun,
    CheckedSeeds,
    CheckedStages,
    JobSpec,
    PrepareContext,
    RunPlan,
    RunResult,
    StagedJob,
    Trial,
    epoch_plan,
    named,
    split_batch,
)

# What a command line may add at the end of a run, before it is marked FINISHED: called with the plan, the
# final checkpoint's folder and the driver's data; returns whether it did anything (its time is then logged
# as `time/end_of_run_s`). The layers above the runner supply it (the example pages: `cli.job_main`).
AfterRun = Callable[[RunPlan, Path, Any], bool]


def check(spec: JobSpec | StagedJob, cfg) -> CheckedRun | CheckedStages | CheckedSeeds:
    """Every check a worker would make, in the driver, before Ray or MLflow start: the config's own
    bounds (pydantic, at load), the faults, the job's data and starting weights (`prepare`), the
    cluster's address, the steps, and the model built on the meta device. The run is named here, once
    (`named`); a staged job checks every stage, a config with `seeds` every seed's run, before the first
    starts. Each check and `prepare` happens once per run: `run` takes the result as it is. Raises
    UserError."""
    generated = not cfg.mlflow.run_name
    cfg = named(spec, cfg)
    if isinstance(spec, StagedJob):
        return dataclasses.replace(spec.check_stages(cfg, check), generated_name=generated)
    if getattr(cfg, "seeds", None):
        return CheckedSeeds(cfg, {seed: check(spec, _seeded(cfg, seed)) for seed in cfg.seeds}, generated)
    micro = split_batch(cfg)
    uri = tracking.resolve_tracking_uri(cfg.mlflow.tracking_uri)
    tracking.set_outage_wait(uri, cfg.mlflow.outage_wait_s)  # every wait of the driver on the store
    storage = storage_path(cfg.scale.storage_path)
    name = cfg.mlflow.run_name
    check_fault_storage(cfg.train, storage)
    if cfg.train.max_steps:  # the run has at most max_steps steps: faults beyond them fail before any data
        fault_schedule(cfg.train, cfg.scale.num_workers, cfg.train.max_steps, storage, name)
    cluster_checked = []

    def before_build() -> None:  # an unreachable cluster is known before an embedded default is built
        check_cluster(cfg.scale)
        cluster_checked.append(True)

    with init_download_dir(storage, name) as download:
        prepared = spec.prepare(cfg, PrepareContext(uri, download, before_build=before_build))
        if not cluster_checked:  # configured data: its errors come first, they need no cluster
            check_cluster(cfg.scale)
        cfg = prepared.cfg
        epochs = epoch_plan(prepared, micro, cfg.scale.num_workers)
        total = sum(epochs)
        try:
            with torch.device("meta"):  # the whole model, no memory: shapes and options checked
                parameters = sum(p.numel() for p in spec.build_objective(cfg, prepared.data).parameters())
        except (ValueError, TypeError) as e:
            raise ConfigError(f"model: {e}") from None
        resumes, _ = recovery.newest_intact(*recovery.run_folder(storage, name))
        recovery.check_same_config(resumes, name, cfg)
        faults = fault_schedule(cfg.train, cfg.scale.num_workers, total, storage, name)
        plan = RunPlan(job=spec.name, config=cfg, data=prepared.path, start=prepared.start,
                       train_options=prepared.train_options, tracking_uri=uri, run_name=name, storage=storage,
                       total_steps=total, micro_batch=micro, epoch_steps=epochs, faults=faults,
                       fault_dir=str(Path(storage) / name / ".faults") if faults else None,
                       baselines=prepared.baselines, metric_order=prepared.metric_order,
                       builder=prepared.builder, verbose=console.verbose())
        return CheckedRun(plan, prepared, parameters, generated, resumes)


def _seeded(cfg, seed: int):
    """One seed's run of a config with `seeds`: `{name}-seed{seed}`, its train.seed set."""
    name = f"{cfg.mlflow.run_name}-seed{seed}"
    return cfg.model_copy(update={"seeds": None, "train": cfg.train.model_copy(update={"seed": seed}),
                                  "mlflow": cfg.mlflow.model_copy(update={"run_name": name})})


def open_run(spec: JobSpec, checked: CheckedRun, source: str, parent_run_id: str | None = None,
             tags: dict[str, str] | None = None) -> RunPlan:
    """Open (or find again) the MLflow run of a checked config; log its data and baselines. Returns
    the plan with its run."""
    plan, prepared = checked.plan, checked.prepared
    cfg = prepared.cfg
    all_tags = {run_tags.TASK: spec.name, run_tags.STORE: plan.data, run_tags.CONFIG_SOURCE: source,
                run_tags.TOTAL_STEPS: str(plan.total_steps), **record.reproducibility_tags(cfg, plan.data),
                **prepared.tags, **(tags or {})}
    flat = flatten(cfg)
    run_id = record.open_run(plan.tracking_uri, cfg.mlflow.experiment, plan.run_name,
                             {**flat, **recipes.recipe_params(cfg, flat)}, all_tags,
                             parent_run_id, where=functools.partial(record.resume_note, checked.resumes, plan.storage, plan.run_name))
    plan = dataclasses.replace(plan, run_id=run_id)
    try:
        record.log_dataset(spec.name, prepared, plan.tracking_uri, run_id)
        if plan.baselines:
            tracking.log_metrics(plan.tracking_uri, run_id,
                                 {f"baseline/{k.split('/', 1)[-1]}": v[0] for k, v in plan.baselines.items()})
    except BaseException as e:
        end_failed(plan, e)
        raise
    return plan


def trainer(spec: JobSpec, plan: RunPlan, trial: Trial | None = None, stop_flag=None):
    """A TorchTrainer running `worker` for the plan: CPUs left for Ray Data, failures retried, the
    best checkpoints kept. A sweep trial passes Tune's report callback; command-line runs the flag
    that Ctrl-C sets (`interrupt.GracefulStop`)."""
    import ray.train
    from ray.train.torch import TorchTrainer

    from xmodal.runner.gloo import NodeInterfaceTorchConfig
    from xmodal.runner.worker import PLAN_KEY, worker

    cfg = plan.config
    scale, train = cfg.scale, cfg.train
    recovery.set_aside_unreadable_ray_list(*recovery.run_folder(plan.storage, plan.run_name))
    resources = {"CPU": scale.cpus_per_worker, **scale.resources_per_worker}
    if scale.gpus_per_worker:
        resources["GPU"] = scale.gpus_per_worker
    return TorchTrainer(
        functools.partial(worker, spec, stop_flag=stop_flag),
        # The plan itself, typed (pickled, not rebuilt from a dict): the worker gets the driver's config
        # object and batch builder as they are.
        train_loop_config={PLAN_KEY: plan},
        torch_config=NodeInterfaceTorchConfig(),  # gloo on the node IP's interface, never loopback by mistake
        scaling_config=ray.train.ScalingConfig(
            num_workers=scale.num_workers, use_gpu=scale.gpus_per_worker > 0, resources_per_worker=resources,
            placement_strategy=scale.placement_strategy),
        run_config=ray.train.RunConfig(
            name=plan.run_name, storage_path=plan.storage, callbacks=trial.callbacks if trial is not None else None,
            # Ray Train's INFO lines (worker group start, every report and checkpoint) unless --verbose
            logging_config=ray.train.LoggingConfig(log_level="INFO" if plan.verbose else "WARNING"),
            # A worker group that cannot start (its placement never fits, e.g. STRICT_SPREAD after a host
            # died) is retried every RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S (60 s); Ray's default is
            # without end. Those tries count against the same scale.max_failures.
            failure_config=ray.train.FailureConfig(max_failures=scale.max_failures,
                                                   controller_failure_limit=scale.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(
                num_to_keep=train.keep_best, checkpoint_score_attribute=train.best_metric,
                checkpoint_score_order=train.best_mode)),
    )


def train_and_finish(spec: JobSpec, plan: RunPlan, data, trial: Trial | None = None,
                     marks: dict[str, float] | None = None, after_run: AfterRun | None = None) -> RunResult:
    """Ray Train, then the final artifacts; the MLflow run ends FINISHED, FAILED on any error, or
    KILLED when Ctrl-C stopped it (RunInterrupted). A sweep trial's end is the sweep driver's to mark
    (`Trial`). `marks`: the run's timeline so far (`xmodal.runner.timeline`), logged as `time/*`."""
    marks = {} if marks is None else marks
    interruptible = trial is None and threading.current_thread() is threading.main_thread()
    term = signal.getsignal(signal.SIGTERM) if interruptible else None
    try:
        connect()  # a local Ray that does not start (LocalRayStartError) fails the run like any error below
        if interruptible and term is not None:  # ray.init's SIGTERM handler exits without a word: keep the cli's
            signal.signal(signal.SIGTERM, term)
        console.CONSOLE.begin(plan.total_steps, plan.baselines, plan.metric_order)
        timeline.mark(marks, "fit_call")
        try:
            if interruptible:
                with GracefulStop() as stop:
                    result = stop.run(trainer(spec, plan, stop_flag=stop.flag).fit)
            elif trial is not None and trial.in_process:
                result = in_trial_process(spec, plan, data, trial)
            else:
                result = trainer(spec, plan, trial).fit()
            timeline.mark(marks, "fit_return")
            worker = timeline.read_worker_marks(*recovery.run_folder(plan.storage, plan.run_name))
            marks.update(timeline.within(worker, marks["fit_call"], marks["fit_return"]))
            stopped = interruptible and stop.requested and (result.metrics or {}).get("final") != 1
            if result.metrics and "step" in result.metrics and not stopped:
                console.CONSOLE.settle(int(result.metrics["step"]), result.metrics)
        finally:
            console.CONSOLE.end()
        if stopped:
            step = int((result.metrics or {}).get("step", 0))
            raise _stopped(plan, errors.RunInterrupted(f"at step {step}", step))
        finish_run(plan, result.checkpoint, spec, data, marks, after_run)
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
        if trial is None or trial.marks_end:
            end_failed(plan, e)
        write_error = recovery.checkpoint_write_error(e)
        advice = write_error.advice() if write_error else recovery.controller_write_advice(e, plan.storage, plan.run_name)
        if advice is not None:
            raise ckpt.CheckpointStorageError(advice) from None
        raise
    return RunResult(plan.run_id, plan.run_name, plan.tracking_uri, result.metrics or {}, result.checkpoint,
                     plan.baselines)


def end_failed(plan: RunPlan, error: BaseException) -> None:
    """The end of an opened run that an error stopped: FAILED in MLflow (KILLED after Ctrl-C), so that no
    run the driver opened stays RUNNING; through the outbox, kept for replay while the store is down."""
    out = outbox(plan)
    out.terminated("KILLED" if isinstance(error, KeyboardInterrupt) else "FAILED")
    out.report()


def _stopped(plan: RunPlan, stop: errors.RunInterrupted) -> errors.RunInterrupted:
    """The run's end after Ctrl-C: KILLED in MLflow, tagged with the step a rerun resumes from."""
    out = outbox(plan)
    out.tags({run_tags.STOPPED_AT_STEP: str(stop.step)})
    out.terminated("KILLED")
    out.report()
    return stop


def run(spec: JobSpec | StagedJob, cfg=None, source: str = "defaults", parent_run_id: str | None = None,
        tags: dict[str, str] | None = None, trial: Trial | None = None, after_run: AfterRun | None = None,
        checked: CheckedRun | CheckedStages | CheckedSeeds | None = None) -> RunResult:
    """check -> open the MLflow run -> Ray Train -> finish, for one run of any job. `checked`: the result
    of `check(spec, cfg)` made already (a chain's stages), taken as it is; from here on the run reads
    that one config. A staged job runs its stages in order, a config with seeds its seeds' runs (each a
    run of its own, with its checked result). `after_run`: what the command line adds at the end of each
    run (`AfterRun`)."""
    checked = checked if checked is not None else check(spec, cfg)
    if isinstance(checked, CheckedStages):
        return spec.run_stages(checked, functools.partial(run, after_run=after_run), source, parent_run_id,
                               tags, trial)
    if isinstance(checked, CheckedSeeds):
        return _run_seeds(spec, checked, source, after_run)
    marks: dict[str, float] = {}
    timeline.mark(marks, "run_start")
    p = open_run(spec, checked, source, parent_run_id, tags)
    cfg = checked.prepared.cfg
    try:
        console.CONSOLE.show(console.banner(
            job=spec.name, run_name=p.run_name, data=p.data,
            train_examples=checked.prepared.train_examples, preset=getattr(cfg, "preset", None),
            parameters=checked.parameters, steps=p.total_steps, epochs=len(p.epoch_steps),
            batch_size=cfg.train.batch_size, workers=cfg.scale.num_workers,
            gpus_per_worker=cfg.scale.gpus_per_worker, tracking_uri=p.tracking_uri,
            experiment=cfg.mlflow.experiment, run_id=p.run_id, storage=p.storage,
            recipe=recipes.banner_lines(cfg, flatten(cfg))))
    except BaseException as e:  # train_and_finish ends the run from here on
        if trial is None or trial.marks_end:
            end_failed(p, e)
        raise
    try:
        return train_and_finish(spec, p, checked.prepared.data, trial, marks, after_run)
    except errors.RunInterrupted as e:
        if checked.generated_name:  # the same command would start a new run
            e.hint = f" with --run-name {p.run_name}"
        raise


def outbox(plan: RunPlan) -> tracking.Outbox:
    """The driver's end-of-run MLflow calls, retried while the server is down (`mlflow.outage_wait_s`),
    then kept in the run's spool file for jobs/replay_tracking.py."""
    return tracking.Outbox(plan.tracking_uri, plan.run_id, tracking.spool_path(plan.storage, plan.run_name),
                           plan.config.mlflow.outage_wait_s)


def finish_run(plan: RunPlan, checkpoint, spec: JobSpec | None = None, data=None,
               marks: dict[str, float] | None = None, after_run: AfterRun | None = None) -> None:
    """Log the resolved config and the final checkpoint's files as artifacts, the final model as the
    run's MLflow model (with `spec` and `data`), what `after_run` adds, where the run's time went
    (`time/*`, from `marks`), then mark the MLflow run finished."""
    out = outbox(plan)
    with tempfile.TemporaryDirectory() as tmp:
        cfg_file = Path(tmp) / "config.yaml"
        cfg_file.write_text(yaml.safe_dump(plan.config.model_dump(mode="json"), sort_keys=False))
        out.artifact(cfg_file)
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            for f in record.model_artifact_files(Path(d)):
                out.artifact(f, "model")
            if spec is not None and not out.spooled and tracking.reachable(plan.tracking_uri):
                model_id = record.log_model(spec, plan, data, Path(d))
                if model_id is not None and plan.config.mlflow.registered_model:
                    record.register(plan, model_id)
            if after_run is not None and not out.spooled and tracking.reachable(plan.tracking_uri):
                _after(plan, Path(d), data, after_run, out)
    if marks:
        timeline.mark(marks, "finished")
        spent = timeline.phases(marks)
        if "time/training_s" in spent:  # this fit() trained (a rerun of a finished run logs no second set)
            out.metrics(spent, plan.total_steps)
    out.terminated("FINISHED")
    out.report()


def _after(plan: RunPlan, folder: Path, data, after_run: AfterRun, out: tracking.Outbox) -> None:
    """`after_run`, timed. It adds to a run whose training is done: its failure is said in one line and
    the run still ends FINISHED (its model and metrics are whole)."""
    started = time.monotonic()
    try:
        did = after_run(plan, folder, data)
    except Exception as e:
        console.say(f"[xmodal] warning: the end-of-run pages of run {plan.run_name} were not made: "
                    f"{type(e).__name__}: {e}")
        return
    if did:
        out.metrics({"time/end_of_run_s": time.monotonic() - started}, plan.total_steps)


def run_job(spec: JobSpec, cfg, source: str = "defaults", after_run: AfterRun | None = None) -> RunResult:
    """What a job's command line runs: the config checked once (`check`), then its run with the end
    summary, or with `seeds` one run per seed under a parent run holding every metric's mean and std."""
    checked = check(spec, cfg)
    if isinstance(checked, CheckedSeeds):
        return _run_seeds(spec, checked, source, after_run)
    return _run_and_sum_up(spec, checked, source, after_run=after_run)


def _run_seeds(spec: JobSpec, checked: CheckedSeeds, source: str, after_run: AfterRun | None) -> RunResult:
    """Every seed's checked run in turn, children of one parent run named as the config's run."""
    cfg, seeds = checked.cfg, list(checked.seeds)
    uri, base = checked.seeds[seeds[0]].plan.tracking_uri, cfg.mlflow.run_name
    parent = record.open_run(uri, cfg.mlflow.experiment, base, flatten(cfg),
                             {run_tags.TASK: spec.name, run_tags.SEEDS: ",".join(map(str, seeds))})
    try:
        finals = [_run_and_sum_up(spec, checked.seeds[seed], source, parent, after_run).run_id for seed in seeds]
        summary = record.finish_seeds_parent(uri, parent, finals, seeds)
    except KeyboardInterrupt as e:  # the seed's run says where it stopped; a rerun resumes it
        tracking.set_terminated(uri, parent, "KILLED")
        if isinstance(e, errors.RunInterrupted) and checked.generated_name:
            e.hint = f" with --run-name {base}"  # the seeds' runs are named after it
        raise
    except BaseException:  # a seed's run failed (it ended FAILED itself): so does the parent
        tracking.set_terminated(uri, parent, "FAILED")
        raise
    return RunResult(parent, base, uri, summary)


def _run_and_sum_up(spec: JobSpec, checked: CheckedRun, source: str, parent_run_id: str | None = None,
                    after_run: AfterRun | None = None) -> RunResult:
    started = time.monotonic()
    out = run(spec, source=source, parent_run_id=parent_run_id, after_run=after_run, checked=checked)
    c = console.CONSOLE
    shown = {k: v for k, v in out.metrics.items() if not k.startswith(SELECTED_PREFIX)}  # the best column has it
    c.show(console.end_summary(
        run_name=out.run_name, wall_s=time.monotonic() - started, metrics=shown, history=c.history,
        baselines=out.baselines, order=c.order, checkpoint=out.checkpoint.path if out.checkpoint is not None else None,
        run_id=out.run_id, view=tracking.ui_command(out.tracking_uri, out.run_id)))
    return out
