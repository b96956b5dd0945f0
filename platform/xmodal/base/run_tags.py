"""Every MLflow tag name xmodal writes or reads, in one place (no imports); tests/base/test_run_tags.py
finds any "xmodal." tag name written elsewhere.

A module of its own, below both `xmodal.sweep` and `xmodal.report`: the sweep runner calls the
report, so the report must not import the sweep package.
"""

# every run
RUN_NAME_TAG = "xmodal.run_name"  # the run's name, by which a rerun finds it and resumes into it
STOPPED_AT_STEP = "xmodal.stopped_at_step"  # a run stopped by Ctrl-C: the step a rerun resumes from
PARENT_TAG = "mlflow.parentRunId"  # MLflow's own tag: the parent run of a child (sweep trial, MulT seed)
NOTE = "mlflow.note.content"  # MLflow's own tag: the run page's description (Markdown)
COMMIT = "git_commit"  # the checkout's commit ("unknown" outside git), on every run and sweep parent

# every training run (the engine and the job specs)
TASK = "task"  # the job's name (MulT: the store's task; fine-tuning: finetune-<task>)
# TASK and STORE are how fine-tuning finds the latest pretraining run on its image store.
STORE = "store"  # the store a run read (fine-tuning: its image store)
CONFIG_SOURCE = "config_source"  # the config file, or "defaults"
SEEDS = "seeds"  # comma-separated, on the parent of a multi-seed run
MODEL = "model"  # the architecture family: lxmert or mult
PRESET = "preset"  # the model preset the config named
VARIANT = "variant"  # MulT's variant
DATASET = "dataset"  # MulT: the store's dataset
F1_PROTOCOL = "f1_protocol"  # MulT: how F1 is computed, to compare with published tables
FINETUNE_SET = "finetune_set"  # fine-tuning: the fine-tuning set directory
INIT = "init"  # fine-tuning: where the weights came from (scratch, run, a path source)
INIT_RUN_ID = "init_run_id"  # fine-tuning from a run: that run
PRETRAIN_RUN_ID = "pretrain_run_id"  # a chain's fine-tuning stage: its pretraining stage's run
TOTAL_STEPS = "xmodal.total_steps"  # set before fit(): tells a finished run from a stopped one (sweeps read it)
CHAIN_STAGE = "xmodal.chain_stage"  # a chain's stage: "pretrain" or "finetune"
# What "same seed, data, config and workers -> the same metrics" rests on (docs/reliability.md)
REPRO_SEED = "xmodal.repro.seed"  # train.seed
REPRO_WORKERS = "xmodal.repro.workers"  # scale.num_workers
REPRO_DATA_MANIFEST = "xmodal.repro.data_manifest_sha256"  # also the logged dataset's digest
REPRO_VERSIONS = "xmodal.repro.versions"  # python and the packages a run's numbers depend on

# logged models
MODEL_CLASS = "xmodal.class"  # the model's module.qualname

# example pages (xmodal.examples)
EXAMPLES = "xmodal.examples"  # the artifact path of a run's example pages' index (examples/index.html)
EXAMPLES_SUMMARY = "xmodal.examples.summary"  # what they show: "16 valid examples, 9 right" (the end summary's line)

# sweeps
KIND = "xmodal.kind"  # "sweep" on the parent run, "trial" on each child
SWEEP = "xmodal.sweep"  # the sweep's name, on the parent and every child
TRIAL_ID = "xmodal.trial_id"
ABLATION_KEYS = "xmodal.ablation_keys"  # JSON list of the space's parameter names, on every child
ABLATION = "xmodal.ablation."  # + parameter name -> the value this trial took (absent: condition false)
SEED = "xmodal.seed"  # the trial's train.seed (runs that differ only in it are replicates)
EARLY_STOPPED = "xmodal.early_stopped"  # "true" on trials the scheduler stopped before their end
STOPPED_AT = "xmodal.stopped_at_report"
# On an early-stopped trial: the step of the last report Tune ranked it by (its workers may have
# evaluated once or twice more before they were stopped); the report reads its score at that step.
RANKED_STEP = "xmodal.ranked_step"
ORPHANED = "xmodal.orphaned"  # a trial the driver had started but Tune's saved state had not recorded
ERROR = "xmodal.error"
METRIC = "xmodal.sweep.metric"
MODE = "xmodal.sweep.mode"
JOB = "xmodal.sweep.job"
SPACE = "xmodal.sweep.space"
BASELINE = "xmodal.sweep.baseline"  # JSON: the space's baseline configuration (reports test rows against it)
# JSON on the parent: fANOVA parameter importances over the finished trials (sweep/runner.py writes it, the
# report shows it): {"method", "trials", "values": {parameter: share}, "left_out": [...], "why"}
IMPORTANCE = "xmodal.sweep.importance"
SWEEP_PARENT = "xmodal.sweep.parent_run_id"  # on a registered model version: the sweep that chose it
REGISTERED = "xmodal.registered_model"  # on a sweep's parent: NAME/version its best model was registered as
BEST = "xmodal.best."  # + trial_id / run_id / parameter name, on the parent at the end

# Parameters that make replicates rather than configurations: reports group runs over them.
REPLICATE_KEYS = ("train.seed",)

# MLflow's own tags that its UI reads (mlflow.utils.mlflow_tags; the experiment kind: the UI's own enum)
SOURCE = "mlflow.source."  # the prefix of MLflow's source tags, copied from a run onto its logged models
SOURCE_NAME = "mlflow.source.name"  # the entry point, e.g. jobs/pretrain.py
SOURCE_TYPE = "mlflow.source.type"  # JOB (`ray job submit`) or LOCAL
GIT_COMMIT = "mlflow.source.git.commit"
GIT_DIRTY = "mlflow.source.git.dirty"  # "true" when tracked files differ from the commit
COMMAND = "xmodal.command"  # the command line that started the run
EXPERIMENT_KIND = "mlflow.experimentKind"  # on experiments: which view the UI opens
TRAINING_EXPERIMENT = "custom_model_development"  # the training view (runs, charts), not the GenAI one
