"""What every Ray Train job shares: the run plan, the MLflow run, the TorchTrainer, the hooks
that log, evaluate, checkpoint and inject faults on the workers, and the end of a run.

Task modules (`train/pretrain.py`, `train/mult.py`) supply the model, data and evaluation.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from xmodal import tracking
from xmodal.config import ScaleConfig, TrainConfig
from xmodal.train import checkpoint as ckpt
from xmodal.train.cluster import require_ray
from xmodal.train.loop import Throughput, all_reduce_sums
from xmodal.train.step import TrainState


@dataclass
class RunPlan:
    """Everything a worker needs, resolved on the driver (plain JSON-able data)."""

    config: dict[str, Any]
    store: str
    tracking_uri: str
    run_id: str
    run_name: str
    storage: str
    total_steps: int
    micro_batch: int
    fail_marker: str | None
    # metric -> [value, what it is], e.g. {"eval/match_acc": [0.5, "chance"]}: what the metric reads
    # for a model that learnt nothing from the other modality; printed beside the final results.
    baselines: dict[str, list] = dataclasses.field(default_factory=dict)


def fail_marker(storage: str, name: str) -> str | None:
    """Where the test-only fault switch records that it fired (local storage only)."""
    return None if "://" in storage else str(Path(storage) / name / ".fail_injected")


def open_run(uri: str, experiment: str, name: str, params: dict[str, Any], tags: dict[str, str],
             parent_run_id: str | None = None) -> str:
    """The MLflow run named `name` (resumed: marked running again) or a new one with params and tags."""
    exp_id = tracking.ensure_experiment(uri, experiment)
    existing = tracking.find_run(uri, exp_id, name)
    if existing is not None:
        tracking.mark_running(uri, existing.info.run_id)
        print(f"[xmodal] resuming run {name!r} (MLflow run {existing.info.run_id})")
        return existing.info.run_id
    return tracking.create_run(uri, exp_id, name, params, {"git_commit": tracking.git_commit(), **tags},
                               parent_run_id)


def make_trainer(worker: Callable[[dict], None], plan: RunPlan, scale: ScaleConfig, train: TrainConfig,
                 datasets: dict[str, Any], callbacks: list | None = None):
    """A TorchTrainer: CPUs left for Ray Data, failures retried, the best checkpoints kept."""
    require_ray()
    import ray.data
    import ray.train
    from ray.train.torch import TorchTrainer

    # Per-operator progress bars from every split coordinator swamp the job's log; training prints its own.
    ray.data.DataContext.get_current().enable_progress_bars = False
    resources = {"CPU": scale.cpus_per_worker, **scale.resources_per_worker}
    if scale.gpus_per_worker:
        resources["GPU"] = scale.gpus_per_worker
    return TorchTrainer(
        worker,
        train_loop_config=dataclasses.asdict(plan),
        scaling_config=ray.train.ScalingConfig(
            num_workers=scale.num_workers, use_gpu=scale.gpus_per_worker > 0, resources_per_worker=resources,
            placement_strategy=scale.placement_strategy),
        run_config=ray.train.RunConfig(
            name=plan.run_name, storage_path=plan.storage, callbacks=callbacks,
            failure_config=ray.train.FailureConfig(max_failures=scale.max_failures),
            checkpoint_config=ray.train.CheckpointConfig(
                num_to_keep=train.keep_best, checkpoint_score_attribute=train.best_metric,
                checkpoint_score_order=train.best_mode)),
        datasets=datasets,
    )


def run_job(prepare_run: Callable, build_trainer: Callable, cfg, source: str,
            parent_run_id: str | None = None) -> dict[str, Any]:
    """One run of a job module's prepare_run / build_trainer: train, log the final artifacts, mark
    the MLflow run FINISHED (or FAILED on any error) and print how to open it."""
    plan, store = prepare_run(cfg, source, parent_run_id)
    try:
        result = build_trainer(plan, store).fit()
        finish_run(plan, result.checkpoint)
    except BaseException:
        tracking.set_terminated(plan.tracking_uri, plan.run_id, "FAILED")
        raise
    if result.metrics:
        print(summary_table(result.metrics, plan.baselines))
    print(f"[xmodal] finished MLflow run {plan.run_id} ({plan.run_name})")
    print(f"[xmodal] view it: {tracking.ui_command(plan.tracking_uri)}")
    return {"run_id": plan.run_id, "run_name": plan.run_name, "tracking_uri": plan.tracking_uri,
            "checkpoint": result.checkpoint, "metrics": result.metrics}


def summary_table(metrics: dict[str, float], baselines: dict[str, list]) -> str:
    """The last evaluation as a table, each metric beside its chance level or prior where known."""
    step = metrics.get("step")
    rows = [(k, v) for k, v in sorted(metrics.items())
            if "/" in k and isinstance(v, (int, float)) and not k.split("/", 1)[1].startswith("loss")]
    width = max((len(k) for k, _ in rows), default=6)
    lines = [f"[xmodal] final evaluation (step {step}):", f"  {'metric':<{width}}   value   baseline"]
    for k, v in rows:
        base = baselines.get(k)
        shown = f"{base[0]:.3f} ({base[1]})" if base else "-"
        lines.append(f"  {k:<{width}}  {v:6.3f}   {shown}")
    return "\n".join(lines)


def finish_run(plan: RunPlan, checkpoint) -> None:
    """Log the resolved config and the final model as artifacts, then mark the MLflow run finished."""
    uri, run_id = plan.tracking_uri, plan.run_id
    with tempfile.TemporaryDirectory() as tmp:
        cfg_file = Path(tmp) / "config.yaml"
        cfg_file.write_text(yaml.safe_dump(plan.config, sort_keys=False))
        tracking.log_artifact(uri, run_id, cfg_file)
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            for f in (ckpt.MODEL_FILE, ckpt.META_FILE):
                tracking.log_artifact(uri, run_id, Path(d) / f, "model")
    tracking.set_terminated(uri, run_id, "FINISHED")


@dataclass
class WorkerStart:
    """Where a Train worker stands when it starts: its place in the group, its device, and the
    checkpoint Ray hands it (None on a fresh start) with that checkpoint's meta."""

    rank: int
    world: int
    device: torch.device
    resume: Any  # ray.train.Checkpoint | None
    meta: dict[str, Any]


def worker_start() -> WorkerStart:
    """Every worker's first step (a checkpoint marked finished makes a rerun return at once)."""
    import ray.train
    import ray.train.torch

    ctx = ray.train.get_context()
    resume = ray.train.get_checkpoint()
    meta: dict[str, Any] = {}
    if resume is not None:
        with resume.as_directory() as d:
            meta = ckpt.read_meta(d)
    return WorkerStart(ctx.get_world_rank(), ctx.get_world_size(), ray.train.torch.get_device(), resume, meta)


class ValidationSelection:
    """Model selection on a validation split (MulT, fine-tuning): every worker keeps the best weights
    by `metric`; they travel in each checkpoint (`BEST_FILE`), so a resumed run keeps its selection,
    and the held-out splits are evaluated once with them at the end."""

    BEST_FILE = "best_model.pt"

    def __init__(self, model: torch.nn.Module, metric: str, mode: str):
        self.model, self.metric, self.mode = model, metric, mode
        self.score: float | None = None
        self.valid: dict[str, float] = {}
        self.weights: dict[str, torch.Tensor] | None = None

    def consider(self, metrics: dict[str, float]) -> None:
        score = metrics[self.metric]
        if self.score is None or (score > self.score) == (self.mode == "max"):
            self.score, self.valid = score, dict(metrics)
            self.weights = {k: v.detach().to("cpu", copy=True) for k, v in self.model.state_dict().items()}

    def save(self, _state: TrainState, folder: Path, _is_new_best: bool) -> None:
        """A RunHooks `on_checkpoint`."""
        if self.weights is not None:
            torch.save({"weights": self.weights, "score": self.score, "valid": self.valid}, folder / self.BEST_FILE)

    def restore(self, folder: str | Path) -> None:
        f = Path(folder) / self.BEST_FILE
        if f.exists():
            blob = torch.load(f, map_location="cpu", weights_only=True)
            self.weights, self.score, self.valid = blob["weights"], blob["score"], blob["valid"]

    def load_selected(self) -> dict[str, float]:
        """Put the selected weights into the model; returns their validation metrics as best_<metric>."""
        if self.weights is None:
            raise RuntimeError("no model was selected: the validation split was never evaluated")
        self.model.load_state_dict(self.weights)
        return {f"best_{k}": v for k, v in self.valid.items()}


class RunHooks:
    """Logging, evaluation, checkpoints and the test-only fault switch, run on every worker
    (collectives need all of them); only rank 0 prints and writes to MLflow."""

    def __init__(self, plan: RunPlan, train: TrainConfig, system_metrics: bool, rank: int, world: int,
                 device: torch.device, evaluate: Callable[[], dict[str, float]], meta: dict[str, Any],
                 on_checkpoint: Callable[[TrainState, Path, bool], None] | None = None,
                 on_end: Callable[[TrainState], dict[str, float]] | None = None):
        """`on_checkpoint(state, folder, is_new_best)` adds files to a checkpoint (rank 0);
        `on_end(state)` runs on every worker after the final checkpoint (e.g. the test split on
        the selected model) and its metrics are logged and reported."""
        self.plan, self.train, self.rank, self.world, self.device = plan, train, rank, world, device
        self.on_checkpoint, self.on_end = on_checkpoint, on_end
        self.evaluate = evaluate
        self.last_eval_step = meta.get("step", -1)
        self.best = meta.get("best")
        self.meter = Throughput(meta.get("step", 0), plan.total_steps)
        self.logger = (tracking.RunLogger(plan.tracking_uri, plan.run_id, system_metrics)
                       if rank == 0 else None)
        self.window: dict[str, float] = {}
        self.window_steps = 0
        self.last_metrics: dict[str, float] = {}
        if self.logger is not None and "step" in meta:
            # Marks the restart in MLflow: training continued from this checkpointed step.
            self.logger.log({"train/resumed_from_step": meta["step"]}, meta["step"], force=True)
            say(f"[xmodal] resumed from checkpoint at step {meta['step']} (epoch {meta.get('epoch')})")

    def after_step(self, state: TrainState, epoch: int, pos: int, losses: dict[str, torch.Tensor]) -> None:
        t = self.train
        self.meter.add(t.batch_size)
        self._maybe_fail(state.step)
        for k, v in losses.items():
            self.window[k] = self.window.get(k, 0.0) + float(v)
        self.window_steps += 1
        if state.step % t.log_every == 0:
            sums = all_reduce_sums(self.window, self.device)
            n = self.window_steps * self.world
            metrics = {f"train/{k}": v / n for k, v in sums.items()}
            self.window, self.window_steps = {}, 0
            rate, eta = self.meter.read(state.step)
            metrics.update({"train/lr": state.scheduler.get_last_lr()[0], "train/samples_per_s": rate,
                            "train/epoch": epoch})
            if self.rank == 0:
                say(f"[xmodal] step {state.step}/{self.plan.total_steps} epoch {epoch} "
                    f"loss {metrics.get('train/loss', float('nan')):.4f} {rate:,.0f} samples/s "
                    f"ETA {_fmt_eta(eta)}")
                self.logger.log(metrics, state.step)
        if state.step % t.eval_every == 0:
            self._eval_and_checkpoint(state, epoch, pos, finished=False)

    def at_end(self, state: TrainState, epoch: int, pos: int) -> None:
        import ray.train

        rerun = state.step != self.last_eval_step or not self.last_metrics
        self._eval_and_checkpoint(state, epoch, pos, finished=True, rerun_eval=rerun)
        if self.on_end is not None:
            final = self.on_end(state)
            if self.rank == 0:
                say("[xmodal] final: " + " ".join(f"{k} {v:.4f}" for k, v in sorted(final.items())))
                self.logger.log(final, state.step, force=True)
            ray.train.report({**self.last_metrics, **final, "step": state.step, "epoch": epoch, "final": 1})
        if self.logger is not None:
            self.logger.close()

    def _eval_and_checkpoint(self, state, epoch, pos, finished, rerun_eval=True) -> None:
        import ray.train

        metrics = self.evaluate() if rerun_eval else dict(self.last_metrics)
        self.last_eval_step, self.last_metrics = state.step, metrics
        score = metrics.get(self.train.best_metric)
        new_best = score is not None and (
            self.best is None or (score > self.best) == (self.train.best_mode == "max"))
        if new_best:
            self.best = score
        if self.rank == 0 and rerun_eval:
            shown = " ".join(f"{k.removeprefix('eval/')} {v:.4f}" for k, v in sorted(metrics.items()))
            say(f"[xmodal] eval @ step {state.step}: {shown}")
            self.logger.log(metrics, state.step)
        report = {**metrics, "step": state.step, "epoch": epoch}
        if finished and self.on_end is None:
            report["final"] = 1  # the run's last report (with on_end, that report comes after)
        if self.rank == 0:
            with tempfile.TemporaryDirectory() as tmp:
                ckpt.save(tmp, state, {"epoch": epoch, "pos": pos, "finished": finished, "best": self.best,
                                       "run_id": self.plan.run_id, "config": self.plan.config,
                                       "store": self.plan.store})
                if self.on_checkpoint is not None:
                    self.on_checkpoint(state, Path(tmp), new_best)
                ray.train.report(report, checkpoint=ray.train.Checkpoint.from_directory(tmp))
        else:
            ray.train.report(report)

    def _maybe_fail(self, step: int) -> None:
        """Test-only: one worker exits once at `train.fail_at_step` to exercise FailureConfig."""
        marker = self.plan.fail_marker
        if self.train.fail_at_step != step or marker is None or self.rank != min(1, self.world - 1):
            return
        if Path(marker).exists():
            return
        Path(marker).parent.mkdir(parents=True, exist_ok=True)
        Path(marker).write_text(json.dumps({"step": step, "time": time.time()}))
        say(f"[xmodal] fault injection: worker {self.rank} exits at step {step}")
        # Ray Train V2 collects reports when it polls the workers (every 2 s): a worker that dies
        # sooner after a checkpoint loses it, and the run resumes from the one before. Wait out a
        # poll, so that the test exercises resuming from the latest checkpoint.
        time.sleep(2 * 2.0 + 1)
        os._exit(1)


def say(message: str) -> None:
    """Progress from a Train worker. Ray Train patches `print` into its logger and, when another
    library has wrapped sys.stdout (MLflow does), also tees it: lines came out twice."""
    print(message, file=sys.__stdout__, flush=True)


def _fmt_eta(seconds: float) -> str:
    if seconds == float("inf"):
        return "?"
    m, s = divmod(int(seconds), 60)
    h, m = divmod(m, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"
