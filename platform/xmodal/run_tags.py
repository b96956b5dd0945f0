"""MLflow tag names shared by tracking, the sweep driver, its trials and the reports (no imports).

A module of its own, below both `xmodal.sweep` and `xmodal.report`: the sweep runner calls the
report, so the report must not import the sweep package.
"""

# every run
RUN_NAME_TAG = "xmodal.run_name"  # the run's name, by which a rerun finds it and resumes into it
STOPPED_AT_STEP = "xmodal.stopped_at_step"  # a run stopped by Ctrl-C: the step a rerun resumes from
PARENT_TAG = "mlflow.parentRunId"  # MLflow's own tag: the parent run of a child (sweep trial, MulT seed)

# sweeps
KIND = "xmodal.kind"  # "sweep" on the parent run, "trial" on each child
SWEEP = "xmodal.sweep"  # the sweep's name, on the parent and every child
TRIAL_ID = "xmodal.trial_id"
ABLATION_KEYS = "xmodal.ablation_keys"  # JSON list of the space's parameter names, on every child
ABLATION = "xmodal.ablation."  # + parameter name -> the value this trial took (absent: condition false)
SEED = "xmodal.seed"  # the trial's train.seed (runs that differ only in it are replicates)
TOTAL_STEPS = "xmodal.total_steps"  # set by the trial before fit(): tells a finished run from a stopped one
EARLY_STOPPED = "xmodal.early_stopped"  # "true" on trials the scheduler stopped before their end
STOPPED_AT = "xmodal.stopped_at_report"
ORPHANED = "xmodal.orphaned"  # a trial the driver had started but Tune's saved state had not recorded
ERROR = "xmodal.error"
METRIC = "xmodal.sweep.metric"
MODE = "xmodal.sweep.mode"
JOB = "xmodal.sweep.job"
SPACE = "xmodal.sweep.space"
BASELINE = "xmodal.sweep.baseline"  # JSON: the space's baseline configuration (reports test rows against it)
BEST = "xmodal.best."  # + trial_id / run_id / parameter name, on the parent at the end

# Parameters that make replicates rather than configurations: reports group runs over them.
REPLICATE_KEYS = ("train.seed",)

# MLflow's own tags that its UI reads (mlflow.utils.mlflow_tags; the experiment kind: the UI's own enum)
SOURCE_NAME = "mlflow.source.name"  # the entry point, e.g. jobs/pretrain.py
SOURCE_TYPE = "mlflow.source.type"  # JOB (`ray job submit`) or LOCAL
GIT_COMMIT = "mlflow.source.git.commit"
GIT_DIRTY = "mlflow.source.git.dirty"  # "true" when tracked files differ from the commit
COMMAND = "xmodal.command"  # the command line that started the run
EXPERIMENT_KIND = "mlflow.experimentKind"  # on experiments: which view the UI opens
TRAINING_EXPERIMENT = "custom_model_development"  # the training view (runs, charts), not the GenAI one
