"""Ablation sweeps on Ray Tune + Optuna: a search-space file -> one Tune experiment, one MLflow parent
run, and per trial one run of the job logged as a child run. The only module that imports Tune (Optuna
too, with importance.py's fANOVA).
A trial of one worker runs that worker in the trial's own process (`in_process_trials`); a trial of
several is a Ray Train run.

    xmodal.sweep.plan.plan_sweep(options)  every check on the space and config, before Ray starts
    run_sweep(plan)      store, parent run, Tuner (new or restored), best-trial summary, report

Trials (`run_trial`) run the job's spec through the engine (`xmodal.runner.engine`); the job never
imports this package. What the trial function cannot do, the driver does through `SweepCallback`: code after
the training never runs for a trial the scheduler stops, so the driver marks its child run.

A trial's score is the one its worker reports under `scores.selected_key(metric)` (the best evaluation
of the sweep's metric, the checkpoint the trial keeps): Optuna, ASHA, Tune's best trial, the trial's
line, the parent run's `best/<metric>` and the report all read that value, never a recomputation.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import optuna
import yaml
from ray import tune
from ray.tune.integration.ray_train import TuneReportCallback
from ray.tune.schedulers import ASHAScheduler, FIFOScheduler
from ray.tune.search.optuna import OptunaSearch

from xmodal import tracking
from xmodal.base import console
from xmodal.base import run_tags as T
from xmodal.base.errors import RunInterrupted, UserError
from xmodal.base.scores import selected_key
from xmodal.config.experiment import ConfigError, flatten
from xmodal.config.paths import config_has
from xmodal.examples import end_of_run_pages
from xmodal.jobs.registry import job_spec
from xmodal.runner import engine, recovery, timeline
from xmodal.runner.spec import Trial
from xmodal.sweep.importance import log_importance
from xmodal.sweep.plan import SweepOptions, SweepPlan, plan_sweep, trial_run_name
from xmodal.sweep.space import (
    AshaSpec,
    DefineByRun,
    SearchSpace,
    probe_points,
    set_dotted,
    validate_config,
    with_assignments,
)

SETUP_FILE = "xmodal_sweep.json"  # the trials' common setup, beside Tune's state (read back by --resume)
# Trials take 1 CPU by default and starve their own Train workers; a trial function that starts a Ray
# Train run only waits.
TRIAL_RESOURCES = {"CPU": 0.01}
# Tune saves its experiment state at most every 10 s by default; a driver killed in between forgets
# trials it had started. The state is small: save it often.
TUNE_STATE_PERIOD_S = "2"
BEST_ALIAS = "best"  # the registered model's alias of a sweep's best trial: models:/NAME@best
NOTE_LIMIT = 7500  # a tag value's limit in MLflow's stores is 8000 characters
log = logging.getLogger(__name__)


def _check_base(plan: SweepPlan) -> tuple[dict[str, Any], Any]:
    """Every check of the job on the base config, once in the driver, before Ray starts; the data
    is built or opened here and trials get its absolute path: trials run in their own working
    directories, and concurrent trials must not build the same store. Then the configurations the
    trials will run (`_check_trials`). Returns (the base, its config)."""
    spec = job_spec(plan.space.job)
    cfg = validate_config(spec.config_class, plan.base, str(plan.space_path))
    try:
        checked = engine.check(spec, cfg)
        base = plan.base
        if config_has(spec.config_class, "data.store"):
            base = set_dotted(plan.base, "data.store", checked.plan.data)
        _check_trials(plan, spec, base)
    except ConfigError as e:
        raise ConfigError(f"{plan.space_path}: {e}") from None
    return base, cfg


def _check_trials(plan: SweepPlan, spec, base: dict[str, Any]) -> None:
    """Each configuration the space is checked at (`space.probe_points`: every choice, both ends of each
    range, try_first, the baseline) checked as its trial's run will check it (`engine.check`: the data,
    the model, the steps), once each: a value that only the data or the model refuses (a fine-tuning
    split the set does not have, a batch larger than the data) fails here, before the first trial,
    not in every trial that draws it, after its pretraining stage."""
    seen = {json.dumps(base, sort_keys=True, default=str)}
    for what, point, _ in probe_points(plan.space):
        raw = with_assignments(base, plan.space.assignments(point))
        key = json.dumps(raw, sort_keys=True, default=str)
        if key in seen:
            continue
        seen.add(key)
        try:
            engine.check(spec, validate_config(spec.config_class, raw, what))
        except ConfigError as e:
            raise ConfigError(f"{what}: {e}") from None


def in_process_trials(space: SearchSpace, cfg) -> bool:
    """A trial of one worker, in a space that searches no `scale.*` key, runs that worker in its own
    process (`Trial.in_process`); otherwise the trial function starts a Ray Train run and waits."""
    scale = getattr(cfg, "scale", None)
    return scale is not None and scale.num_workers == 1 and not any(k.startswith("scale.") for k in space.config_keys())


def trial_resources(in_process: bool, cfg) -> dict[str, float]:
    """What Tune reserves for each trial: the worker's resources when the trial is its worker, else a
    sliver (the trial function only waits; its Ray Train workers hold their own)."""
    if not in_process:
        return TRIAL_RESOURCES
    scale = cfg.scale
    resources = {"CPU": scale.cpus_per_worker, **scale.resources_per_worker}
    if scale.gpus_per_worker:
        resources["GPU"] = scale.gpus_per_worker
    return resources


# ---------------------------------------------------------------- MLflow parent run


def _space_params(space: SearchSpace) -> dict[str, Any]:
    params = flatten(space.model_dump(mode="json", exclude={"parameters", "try_first", "base", "description",
                                                            "baseline"}))
    for name, p in space.parameters.items():
        params[f"parameters.{name}"] = json.dumps(p.model_dump(mode="json", exclude_none=True))
    params["try_first"] = json.dumps(space.try_first)
    if space.baseline is not None:
        params["baseline"] = json.dumps(space.baseline)
    return params


def _description(space: SearchSpace) -> str:
    return space.description or f"ablation sweep over {', '.join(space.parameters)}"


def open_parent_run(plan: SweepPlan) -> tuple[str, str]:
    """(experiment id, parent run id): found again by its name tag when resuming, else created with the
    space file and the resolved sweep as artifacts."""
    uri = plan.tracking_uri
    exp_id = tracking.ensure_experiment(uri, plan.experiment)
    existing = tracking.find_run(uri, exp_id, plan.name)
    if existing is not None:
        tracking.mark_running(uri, existing.run_id)
        log.info(f"continuing sweep {plan.name!r} (MLflow parent run {existing.run_id})")
        return exp_id, existing.run_id
    s = plan.space
    run_id = tracking.create_run(uri, exp_id, plan.name, _space_params(s), {
        T.KIND: "sweep", T.SWEEP: plan.name, T.JOB: s.job, T.METRIC: s.metric, T.MODE: s.mode,
        T.SPACE: str(plan.space_path), T.COMMIT: tracking.git_commit(), **tracking.source_tags(),
        T.NOTE: _description(s),
        **({T.BASELINE: json.dumps(s.baseline_point())} if s.baseline_point() is not None else {})})
    tracking.log_artifact(uri, run_id, plan.space_path, "space")
    with tempfile.TemporaryDirectory() as tmp:
        resolved = Path(tmp) / "sweep.yaml"
        resolved.write_text(yaml.safe_dump({"name": plan.name, "storage": plan.path,
                                            "space": s.model_dump(mode="json"), "base_config": plan.base},
                                           sort_keys=False))
        tracking.log_artifact(uri, run_id, resolved, "space")
    return exp_id, run_id


# ---------------------------------------------------------------- the trial


def trial_tags(setup: dict[str, Any], space: SearchSpace, chosen: dict[str, Any], trial_id: str,
               cfg: Any) -> dict[str, str]:
    tags = {T.KIND: "trial", T.SWEEP: setup["sweep"], T.TRIAL_ID: trial_id,
            T.ABLATION_KEYS: json.dumps(list(space.parameters)), T.METRIC: space.metric, T.MODE: space.mode}
    tags.update({T.ABLATION + k: str(v) for k, v in chosen.items()})
    seed = getattr(getattr(cfg, "train", None), "seed", None)
    if seed is not None:
        tags[T.SEED] = str(seed)
    return tags


def run_trial(config: dict[str, Any], setup: dict[str, Any], verbose: bool = False) -> None:
    """One trial = one run of the space's job, reporting to Tune: its worker in this process, or a Ray
    Train run reporting through its callback (`setup["in_process"]`).

    `config` holds only the searched values (Optuna's define-by-run); `setup` (job, space, base config,
    sweep and parent run) comes through `tune.with_parameters`, so Tune's tables show the parameters only.
    `verbose`: the sweep's --verbose, for the trial's Train run.
    """
    console.set_verbose(verbose)
    console.quiet_libraries()
    chosen = dict(config)
    trial_id = tune.get_context().get_trial_id()
    run_name = trial_run_name(setup["sweep"], trial_id)
    if _replay_finished(setup, run_name):
        return
    space = SearchSpace.model_validate(setup["space"])
    spec = job_spec(setup["job"])
    raw = with_assignments(setup["base"], space.assignments(chosen))
    if config_has(spec.config_class, "mlflow.run_name"):
        raw = set_dotted(raw, "mlflow.run_name", run_name)
    source = f"{setup['source']} (sweep {setup['sweep']}, trial {trial_id})"
    cfg = validate_config(spec.config_class, raw, source)
    checked = engine.check(spec, cfg)
    resumes = getattr(checked, "resumes", None)  # a staged job's or seeds' config resumes per run
    # A trial is a run of its job like one from the command line: its example pages too, at its config's
    # `examples.count` (docs/tracking.md, "Example pages")
    engine.run(spec, cfg, source, parent_run_id=setup["parent_run_id"],
             tags={**setup.get("source_tags", {}), **trial_tags(setup, space, chosen, trial_id, cfg)},
             trial=Trial(report=tune.report) if setup.get("in_process") else Trial([TuneReportCallback()]),
             after_run=end_of_run_pages, checked=checked)
    if resumes is not None and resumes.finished:
        # The driver died after the trial's last checkpoint and before the trial's end was marked: the rerun
        # trained nothing and its workers reported nothing; the run's end (model, pages) is done now, and
        # Tune gets the final metrics the run logged.
        run = tracking.find_run(setup["tracking_uri"], setup["experiment_id"], run_name)
        console.say(f"[xmodal] {run_name} had trained to its end before the driver restarted: reporting its "
                    f"final metrics from MLflow run {run.run_id}")
        tune.report(_logged_result(run))


def _replay_finished(setup: dict[str, Any], run_name: str) -> bool:
    """A trial that finished while Tune's saved state still had it running (the driver died in between)
    is restored as running. Its MLflow run is FINISHED (finish_run sets that last): report its final
    metrics to Tune instead of training it again."""
    run = tracking.find_run(setup["tracking_uri"], setup["experiment_id"], run_name)
    if run is None or run.status != "FINISHED" or run.tags.get(T.EARLY_STOPPED) == "true":
        return False
    console.say(f"[xmodal] {run_name} had finished before the driver restarted: reporting its final metrics "
                f"from MLflow run {run.run_id} instead of training it again")
    tune.report(_logged_result(run))
    return True


def _logged_result(run: tracking.RunRecord) -> dict[str, Any]:
    """A finished trial's last result as its MLflow run holds it: eval/, valid/, test/, best_*, selected/
    (not train/ or system/), and its total steps."""
    metrics: dict[str, Any] = {k: v for k, v in run.metrics.items() if not k.startswith(("train/", "system/"))}
    if T.TOTAL_STEPS in run.tags:
        metrics["step"] = int(run.tags[T.TOTAL_STEPS])
    return metrics


def _trial_name(trial) -> str:
    return f"trial_{trial.trial_id}"


# ---------------------------------------------------------------- driver-side bookkeeping


def _values(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


class SweepCallback(tune.Callback):
    """Marks child runs from the driver: early-stopped trials (KILLED, xmodal.early_stopped=true), errored
    trials (FAILED), and at the end trials the driver started but Tune's saved state forgot (a driver
    killed between two state saves): those are KILLED and tagged xmodal.orphaned. Says one line when a
    trial starts and one when it ends (Tune's own status tables are off unless --verbose), with the
    trial's score: its last report's selected score (`scores.selected_key(metric)`)."""

    def __init__(self, uri: str, experiment_id: str, sweep: str, parent_run_id: str, metric: str = ""):
        self.uri, self.experiment_id, self.sweep, self.parent_run_id = uri, experiment_id, sweep, parent_run_id
        self.metric = metric
        self._stopped: dict[str, int] = {}
        self._started: dict[str, float] = {}  # wall time of each trial's start, for its overhead

    def __setstate__(self, state):
        # `--resume` unpickles the callback Tune saved with the sweep: one pickled without `metric` still
        # restores (its trial lines show no score).
        self.__dict__.update({"metric": "", "_started": {}, **state})

    def on_trial_start(self, iteration, trials, trial, **info):
        self._started[trial.trial_id] = time.time()
        log.info(f"trial {trial.trial_id} started: {_values(trial.config or {})}")

    def _ended(self, trial, how: str, spent: str = "") -> None:
        # The last result: Tune keeps it in its saved state, so a trial resumed by a restarted driver has it.
        score = (trial.last_result or {}).get(selected_key(self.metric)) if self.metric else None
        if not isinstance(score, (int, float)) or score != score:  # NaN: no evaluation gave a number
            score = None
        shown = f"{self.metric} {score:.4f}" if score is not None else f"no {self.metric or 'score'}"
        log.info(f"trial {trial.trial_id} {how}: {shown} ({_values(trial.config or {})}){spent}")

    def _child(self, trial_id: str) -> tracking.RunRecord | None:
        return tracking.find_run(self.uri, self.experiment_id, trial_run_name(self.sweep, trial_id))

    def on_trial_result(self, iteration, trials, trial, result, **info):
        # Tune sets done=True on the result that the scheduler answered with STOP (a trial that ends on
        # its own reports done=False and then returns).
        if result.get("done"):
            self._stopped[trial.trial_id] = int(result.get("training_iteration", 0))

    def on_trial_complete(self, iteration, trials, trial, **info):
        started = self._started.pop(trial.trial_id, None)  # None: started before a driver restart
        run = self._child(trial.trial_id)
        timed = (timeline.trial_overhead(time.time() - started, run.metrics)
                 if run is not None and started is not None else {})
        spent = (f" in {timed[timeline.TRIAL_LIFE]:.0f} s, {timed[timeline.TRIAL_OVERHEAD]:.0f} s of it outside "
                 "training" if timed else "")
        self._ended(trial, "stopped early" if trial.trial_id in self._stopped else "finished", spent)
        if run is None:
            return
        if timed:
            tracking.log_metrics(self.uri, run.run_id, timed)
        if trial.trial_id not in self._stopped:
            tracking.set_tags(self.uri, run.run_id, {T.EARLY_STOPPED: "false"})
            return
        reports = self._stopped.pop(trial.trial_id)
        # Every job marks its last report `final`; a trial replayed from MLflow (`_replay_finished`)
        # reports its logged metrics, without `final`, and its total steps.
        step, total = trial.last_result.get("step"), run.tags.get(T.TOTAL_STEPS)
        trained_out = trial.last_result.get("final") == 1 or (
            step is not None and total is not None and int(step) >= int(total))
        if trained_out:
            # Stopped on its final report (only when max_t exceeds a trial's reports): nothing was cut
            # short, but finish_run may not have logged the final model.
            tracking.set_tags(self.uri, run.run_id, {T.EARLY_STOPPED: "false", T.STOPPED_AT: str(reports)})
            tracking.set_terminated(self.uri, run.run_id, "FINISHED")
        else:
            tags = {T.EARLY_STOPPED: "true", T.STOPPED_AT: str(reports)}
            if step is not None:
                tags[T.RANKED_STEP] = str(int(step))
            tracking.set_tags(self.uri, run.run_id, tags)
            tracking.set_terminated(self.uri, run.run_id, "KILLED")
            log.info(f"trial {trial.trial_id} stopped early after {reports} reports "
                     f"(MLflow run {run.run_id} marked KILLED)")

    def on_trial_error(self, iteration, trials, trial, **info):
        self._ended(trial, f"failed (see {trial.error_file or 'the Tune logs'})")
        run = self._child(trial.trial_id)
        if run is not None:
            tracking.set_tags(self.uri, run.run_id, {T.ERROR: str(trial.error_file or "see Tune logs")[:500]})
            tracking.set_terminated(self.uri, run.run_id, "FAILED")

    def on_experiment_end(self, trials, **info):
        known = {t.trial_id for t in trials}
        for run in tracking.child_runs(self.uri, self.parent_run_id):
            if run.status == "RUNNING" and run.tags.get(T.TRIAL_ID) not in known:
                tracking.set_tags(self.uri, run.run_id, {T.ORPHANED: "true"})
                tracking.set_terminated(self.uri, run.run_id, "KILLED")


# ---------------------------------------------------------------- the sweep


def _tuner(plan: SweepPlan, setup: dict[str, Any], parent_run_id: str, experiment_id: str, cfg):
    in_process = setup.get("in_process", False)  # a resumed sweep's as it was started (`_sweep_setup`)
    trainable = tune.with_resources(tune.with_parameters(run_trial, setup=setup, verbose=console.verbose()),
                                    trial_resources(in_process, cfg))
    if plan.resume:
        # The trial function must be passed again; search state, scheduler and callbacks come back
        # from the experiment folder. Finished trials are kept, unfinished ones continue (their Train
        # runs, named by trial id, resume from their latest checkpoints).
        return tune.Tuner.restore(plan.path, trainable, resume_unfinished=True, resume_errored=True)
    s = plan.space
    score = selected_key(s.metric)
    if not console.verbose():  # Optuna's "A new study created in memory" line on the sweep's console
        optuna.logging.set_verbosity(optuna.logging.WARNING)
    search = OptunaSearch(space=DefineByRun(s.parameters), metric=score, mode=s.mode, seed=s.seed,
                          points_to_evaluate=s.first_points() or None)
    if isinstance(s.scheduler, AshaSpec):
        a = s.scheduler
        # max_t is a full trial's number of reports. Rungs go strictly below it and trials are never cut
        # at max_t itself: a trial stopped on its final report would lose finish_run (code after fit()).
        scheduler = ASHAScheduler(time_attr="training_iteration", max_t=max(a.max_t - 1, a.grace_period),
                                  grace_period=a.grace_period, reduction_factor=a.reduction_factor,
                                  stop_last_trials=False)
    else:
        scheduler = FIFOScheduler()
    return tune.Tuner(
        trainable,
        tune_config=tune.TuneConfig(
            search_alg=search, scheduler=scheduler, metric=score, mode=s.mode, num_samples=s.num_samples,
            max_concurrent_trials=s.max_concurrent, trial_name_creator=_trial_name,
            trial_dirname_creator=_trial_name,
            # A trial that is its worker runs in a Tune actor kept for the next trial: that one starts
            # with Python, torch and MLflow's store already loaded (seconds a trial, docs/performance.md).
            reuse_actors=in_process),
        run_config=tune.RunConfig(
            name=plan.name, storage_path=plan.root,
            # In process, a worker's failure is its trial's: the Train run's own retries come on top.
            failure_config=tune.FailureConfig(
                max_failures=s.trial_retries + (cfg.scale.max_failures if in_process else 0)),
            # Tune's status tables and per-result lines only with --verbose: SweepCallback says one line
            # per trial start and end
            verbose=None if console.verbose() else 0,
            callbacks=[SweepCallback(plan.tracking_uri, experiment_id, plan.name, parent_run_id, s.metric)]),
    )


def _sweep_setup(plan: SweepPlan, parent_run_id: str, experiment_id: str, in_process: bool) -> dict[str, Any]:
    """The trials' setup. A resumed sweep continues with the setup it was started with (saved beside
    Tune's state); settings changed on the command line since are reported and ignored."""
    setup = plan.setup(parent_run_id, experiment_id, in_process)
    if "://" in plan.root:
        return setup
    saved = Path(plan.path) / SETUP_FILE
    if plan.resume and saved.exists():
        before = {**json.loads(saved.read_text()), "parent_run_id": parent_run_id, "experiment_id": experiment_id}
        changed = [k for k in setup if before.get(k) != setup[k]]
        if changed:
            log.info(f"--resume continues sweep {plan.name!r} as it was started; ignoring changes to: "
                     f"{', '.join(changed)}")
        return before
    saved.parent.mkdir(parents=True, exist_ok=True)
    saved.write_text(json.dumps({k: v for k, v in setup.items() if k not in ("parent_run_id", "experiment_id")},
                                indent=1))
    return setup


def summarise(plan: SweepPlan, results, parent_run_id: str, experiment_id: str) -> dict[str, Any]:
    """The best trial as tags and a metric on the parent run. Each trial counts with its selected score
    (`scores.selected_key(metric)`) in its last report, the value Tune ranked it by: the score of the
    checkpoint it keeps (train.best_metric is the sweep's metric). The parent's `best/<metric>` is that
    value of the best trial."""
    s, uri, key = plan.space, plan.tracking_uri, selected_key(plan.space.metric)
    errors = [r for r in results if r.error is not None]
    # Tune ends fit() early on Ctrl-C: trials never started, or stopped midway, have no done=True result.
    # A trial is finished when Tune saw it return (done) or its last report was the job's final one: a
    # driver killed between that report and Tune recording the return leaves a restored trial without
    # `done`, though it has nothing left to train.
    unfinished = s.num_samples - len(results) + sum(
        1 for r in results if r.error is None and not (
            (r.metrics or {}).get("done", False) or (r.metrics or {}).get("final") == 1))
    summary: dict[str, Any] = {"trials": len(results), "errors": len(errors), "unfinished": unfinished,
                               "best": None}
    try:
        best = results.get_best_result(metric=key, mode=s.mode, scope="last", filter_nan_and_inf=True)
    except (RuntimeError, KeyError, ValueError):
        best = None
    metrics = {"sweep/trials": len(results), "sweep/errors": len(errors)}
    _log_searched_values(uri, parent_run_id)
    if best is not None and best.metrics and key in best.metrics:
        trial_id = best.metrics.get("trial_id", "")
        chosen = dict(best.config or {})
        child = tracking.find_run(uri, experiment_id, trial_run_name(plan.name, trial_id))
        tags = {T.BEST + "trial_id": trial_id, T.BEST + "run_id": child.run_id if child else ""}
        tags.update({T.BEST + k: str(v) for k, v in chosen.items()})
        tracking.set_tags(uri, parent_run_id, tags)
        score = float(best.metrics[key])
        metrics[f"best/{s.metric}"] = score
        if child is not None:  # what the best configuration cost, beside its score
            metrics.update({f"best/{k}": v for k, v in child.metrics.items() if k.startswith("cost/")})
        summary["best"] = {"trial_id": trial_id, "params": chosen, s.metric: score,
                           "run_id": tags[T.BEST + "run_id"]}
        if plan.register and child is not None:
            summary["registered"] = register_best(plan, parent_run_id, child.run_id, score)
    spent = timeline.sweep_summary([r.metrics for r in tracking.child_runs(uri, parent_run_id)])
    if spent:
        metrics.update(spent)
        summary["overhead"] = spent
        log.info(timeline.summary_line(spent))
    tracking.log_metrics(uri, parent_run_id, metrics)
    log_importance(uri, s, parent_run_id)
    return summary


def register_best(plan: SweepPlan, parent_run_id: str, run_id: str, score: float) -> dict[str, Any] | None:
    """The best trial's logged model as a new version of the registered model `plan.register`, alias
    `best` moved to it, tagged with the sweep, its parent run, its space file and the score; the parent
    run tagged with the version. None (and a line) when the best trial logged no model or the store
    refused: the sweep's results stand either way (jobs/sweep.py then exits 1)."""
    model_id = tracking.run_model_id(plan.tracking_uri, run_id)
    if model_id is None:
        log.warning(f"best trial's run {run_id} logged no model: nothing registered as {plan.register!r}")
        return None
    tags = {T.SWEEP: plan.name, T.SWEEP_PARENT: parent_run_id, T.SPACE: str(plan.space_path),
            T.METRIC: plan.space.metric, f"{T.BEST}{plan.space.metric}": repr(score)}
    try:
        version = tracking.register_model(plan.tracking_uri, plan.register, model_id, run_id, alias=BEST_ALIAS,
                                          tags=tags)
    except UserError as e:
        log.warning(f"the best trial's model was not registered as {plan.register!r}: {e}")
        return None
    tracking.set_tags(plan.tracking_uri, parent_run_id, {T.REGISTERED: f"{plan.register}/{version.version}"})
    log.info(f"registered the best trial's model as {plan.register!r} version {version.version}: "
             f"models:/{plan.register}@{BEST_ALIAS}")
    return {"name": plan.register, "version": version.version, "alias": BEST_ALIAS, "model_id": model_id}


def _log_searched_values(uri: str, parent_run_id: str) -> None:
    """Every trial's searched values as params `ablation.<parameter>` ("-" where its condition did not
    hold): one name per parameter across the trials, for MLflow's run comparison (a named option's
    label, which is no config key, included)."""
    for run in tracking.child_runs(uri, parent_run_id):
        if run.tags.get(T.KIND) != "trial":
            continue
        keys = json.loads(run.tags.get(T.ABLATION_KEYS, "[]"))
        tracking.log_params(uri, run.run_id, {f"ablation.{k}": run.tags.get(T.ABLATION + k, "-") for k in keys})


def run_sweep(opts: SweepOptions | SweepPlan) -> dict[str, Any]:
    """Run (or with opts.resume continue) a sweep; returns {"name", "path", "parent_run_id", ...}."""
    plan = opts if isinstance(opts, SweepPlan) else plan_sweep(opts)
    plan.base, cfg = _check_base(plan)

    from xmodal.runner.ray_cluster import connect

    os.environ.setdefault("TUNE_GLOBAL_CHECKPOINT_S", TUNE_STATE_PERIOD_S)
    console.CONSOLE.sweep = True  # trial lines only: no progress bar or tables from the trials' runs
    connect()
    experiment_id, parent_run_id = open_parent_run(plan)
    # The trials' runs are made in Ray's worker processes: they record the sweep's command as their source.
    setup = {**_sweep_setup(plan, parent_run_id, experiment_id, in_process_trials(plan.space, cfg)),
             "source_tags": tracking.source_tags()}
    uri = plan.tracking_uri
    log.info(f"sweep {plan.name!r}: {plan.space.num_samples} trials of {plan.space.job}, at most "
             f"{plan.space.max_concurrent} at a time; Tune state in {plan.path}")
    # Tune catches SIGINT itself (it saves its state and stops the trials); SIGTERM is made the same.
    previous = signal.signal(signal.SIGTERM, lambda *_: signal.raise_signal(signal.SIGINT))
    try:
        results = _tuner(plan, setup, parent_run_id, experiment_id, cfg).fit()
        summary = summarise(plan, results, parent_run_id, experiment_id)
    except KeyboardInterrupt:  # a second Ctrl-C: Tune stops at once
        raise _stopped(plan, parent_run_id, "at once") from None
    except BaseException:
        tracking.set_terminated(uri, parent_run_id, "FAILED")
        raise
    finally:
        signal.signal(signal.SIGTERM, previous)
    if summary["unfinished"]:  # Tune ends fit() early only when interrupted
        raise _stopped(plan, parent_run_id, f"with {summary['unfinished']} of {plan.space.num_samples} trials "
                                            "unfinished")
    report_dir = None
    if plan.report:
        report_dir = _report(plan, parent_run_id)
    status = "FINISHED" if summary["best"] is not None else "FAILED"
    tracking.set_terminated(uri, parent_run_id, status)
    if summary["best"]:
        b = summary["best"]
        log.info(f"best trial {b['trial_id']}: {plan.space.metric} = {b[plan.space.metric]:.4f} with "
                 + ", ".join(f"{k}={v}" for k, v in b["params"].items()))
    if summary["errors"]:
        log.info(f"{summary['errors']} of {summary['trials']} trials failed; see {plan.path}")
    log.info(f"MLflow parent run {parent_run_id} in experiment {plan.experiment!r}; view it: "
             f"{tracking.ui_command(uri, parent_run_id)}")
    return {"name": plan.name, "path": plan.path, "parent_run_id": parent_run_id, "tracking_uri": uri,
            "experiment": plan.experiment, "report": report_dir, **summary}


class SweepInterrupted(RunInterrupted):
    def __init__(self, how: str, name: str):
        super().__init__(how, 0)
        self.name = name

    def __str__(self) -> str:
        return (f"[xmodal] sweep {self.name!r} stopped {self.how}; continue it with the same command and "
                f"--resume --name {self.name} (finished trials are kept, the others resume from their checkpoints)")


def _stopped(plan: SweepPlan, parent_run_id: str, how: str) -> SweepInterrupted:
    """A sweep stopped by Ctrl-C or SIGTERM: its parent run and every trial still running are KILLED,
    each trial tagged with the step its Train run resumes from (`--resume` marks them RUNNING again)."""
    uri, storage = plan.tracking_uri, f"{plan.path}/train"  # the trials' Train runs (plan.plan_sweep)
    for run in tracking.child_runs(uri, parent_run_id):
        if run.status == "RUNNING":
            found, _ = recovery.newest_intact(*recovery.run_folder(storage, run.name))
            tracking.set_tags(uri, run.run_id, {T.STOPPED_AT_STEP: str(found.step if found else 0)})
            tracking.set_terminated(uri, run.run_id, "KILLED")
    tracking.set_terminated(uri, parent_run_id, "KILLED")
    return SweepInterrupted(how, plan.name)


def _report(plan: SweepPlan, parent_run_id: str) -> str | None:
    from xmodal.base.outputs import Scratch
    from xmodal.report import make_report

    remote = "://" in plan.root  # the report is made in a scratch folder and lives in MLflow only
    try:
        if remote:
            with Scratch(None, "report", "xmodal-report-") as scratch:
                rep = make_report(plan.tracking_uri, parent_run_id=parent_run_id, out_dir=scratch / "report")
        else:
            rep = make_report(plan.tracking_uri, parent_run_id=parent_run_id, out_dir=Path(plan.path) / "report")
        # the run page renders its description as Markdown: the table there, the files in `report`
        note = f"{_description(plan.space)}\n\n{rep.markdown}\n\nPlots and table.csv: artifacts, folder `report`."
        if len(note) > NOTE_LIMIT:
            note = f"{_description(plan.space)}\n\nThe report is in the artifacts, folder `report` (table.md)."
        tracking.set_tags(plan.tracking_uri, parent_run_id, {T.NOTE: note})
    except Exception as e:  # the sweep's results are in MLflow either way
        log.warning(f"report failed: {e}; rerun `python jobs/report.py --parent-run {parent_run_id}`")
        return None
    if remote:
        log.info("report: in the parent run's artifacts, folder `report`")
        return None
    log.info(f"report: {rep.out_dir}")
    return str(rep.out_dir)
