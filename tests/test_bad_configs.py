"""Bad configs, flags, files and search spaces on the command line: each job script fails with one clear
`error:` on stderr and exit code 2, before anything starts.

Every case runs the script as a process of its own in a fresh, otherwise empty working directory,
with RAY_ADDRESS=127.0.0.1:1 (nothing listens there: a job that tries to start or join Ray fails
loudly) and no MLFLOW_TRACKING_URI, and asserts: exit code 2, no traceback, the bad key or file named
on stderr, no Ray start-up text, and the working directory unchanged apart from the case's own files
(no mlflow.db, data/, runs/, mlruns/ or half-written store).

Each case's process is forked from one Python that has imported what the job scripts import (torch,
the jobs' configs and engine, MLflow, the extraction's pipeline with Ray, the benchmarks; `FORK_SERVER`),
and runs the script as `__main__` with its own arguments, working directory, stdout and stderr: a fresh
interpreter per case spent 2-4 s of CPU importing torch (about 150 s for the file, 125 cases, on a 2-core
machine), and a case forked before the jobs' own modules were imported 0.3 s (MLflow's and Ray's 1-4 s)
importing them. (Importing a module starts nothing: Ray and MLflow start only when a script calls them.)
The cases run four at a time (one module fixture) and are reported one test each.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import pickle
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest

from xmodal_testing import PYTHON, REPO

JOBS = REPO / "jobs"
SPACES = REPO / "search_spaces"
RAY_TEXT = ("Started a local Ray instance", "Connecting to existing Ray cluster", "ray.init", "raylet",
            "Ray runtime started", "View the dashboard", "GCS", "127.0.0.1:1")

EXTRACT_TINY = ["--random-weights", "--tiny", "--no-progress"]
IMAGE = {"a.jpg": "listed by name; first read in a decode task"}  # IMAGES "." for jobs/extract.py

SPACE = """\
job: pretrain
metric: eval/loss/mlm
mode: min
num_samples: 2
scheduler: {type: fifo}
parameters:
  optim.lr: {type: choice, values: [1e-3, 1e-2]}
"""


@dataclass
class Case:
    id: str
    script: str  # under jobs/
    args: list[str]
    named: list[str]  # each must appear on stderr (the key, the value, the file)
    files: dict[str, str | None] = field(default_factory=dict)  # name -> text, or None for an empty folder


def _space(old: str, new: str) -> str:
    assert old in SPACE, old
    return SPACE.replace(old, new)


def _set(*items: str) -> list[str]:
    return [a for item in items for a in ("--set", item)]


def _mult_pickle(fmt: str, **changes) -> str:
    """A small MulT pickle of plain lists, protocol 0 (ASCII text, so a case can hold it as a file):
    splits of 3 clips, 2 steps of 2 features per modality. `changes`: "split.key" -> new value."""
    def clip_split(split: str) -> dict:
        feats = [[[1.0, 2.0], [3.0, 4.0]] for _ in range(3)]
        d = {"text": feats, "audio": feats, "vision": feats}
        if fmt == "reference":
            d["labels"] = [[[0.5]], [[-1.0]], [[2.0]]]
        else:
            d.update(regression_labels=[0.5, -1.0, 2.0], audio_lengths=[2, 2, 2], vision_lengths=[2, 2, 2])
        return {**d, **{k.split(".", 1)[1]: v for k, v in changes.items() if k.split(".", 1)[0] == split}}

    return pickle.dumps({s: clip_split(s) for s in ("train", "valid", "test")}, protocol=0).decode("ascii")


def _tsv_line(img_id: str, feats: list[float]) -> str:
    """One reference feature TSV line with 2 boxes of len(feats) // 2 features each."""
    def b64(values: list, dtype: str) -> str:
        return base64.b64encode(np.asarray(values, dtype=dtype).tobytes()).decode()

    return "\t".join([img_id, "20", "20", b64([1, 2], "int64"), b64([0.5, 0.5], "float32"), b64([1, 2], "int64"),
                      b64([0.5, 0.5], "float32"), "2", b64([0, 0, 10, 10, 1, 1, 5, 5], "float32"),
                      b64(feats, "float32")])


def _spool(**record) -> str:
    return json.dumps({"op": "terminated", "uri": "sqlite:///mlflow.db", "run_id": "abc", "status": "FINISHED",
                       **record}) + "\n"


CASES = [
    # ---- jobs/pretrain.py: bounds of the model and data options
    Case("pretrain-hidden-not-multiple-of-heads", "pretrain.py", _set("model.hidden_size=130"),
         ["model.hidden_size", "130", "num_heads"]),
    Case("pretrain-dropout-above-1", "pretrain.py", _set("model.dropout=1.5"), ["model.dropout", "1.5", "[0, 1)"]),
    Case("pretrain-negative-layers", "pretrain.py", _set("model.l_layers=-1"), ["model.l_layers", "-1", ">= 0"]),
    Case("pretrain-mask-prob-2", "pretrain.py", _set("data.masking.word_mask_prob=2"),
         ["data.masking.word_mask_prob", "[0, 1]"]),
    Case("pretrain-seq-len-below-store", "pretrain.py", _set("data.masking.max_seq_len=5"),
         ["data.masking.max_seq_len", "5"]),
    Case("pretrain-seq-len-no-word", "pretrain.py", _set("data.masking.max_seq_len=2"),
         ["data.masking.max_seq_len", ">= 3"]),
    Case("pretrain-tracking-uri-bare-file", "pretrain.py", _set("mlflow.tracking_uri=mlflow.db"),
         ["mlflow.tracking_uri", "sqlite:///"]),
    Case("pretrain-unknown-key", "pretrain.py", _set("model.hiden=3"), ["model.hiden", "unknown key", "hidden_size"]),
    Case("pretrain-bad-literal", "pretrain.py", _set("train.precision=fp8"), ["train.precision", "'fp8'", "'bf16'"]),
    Case("pretrain-bad-type", "pretrain.py", _set("train.epochs=many"), ["train.epochs", "'many'", "integer"]),
    Case("pretrain-zero-lr", "pretrain.py", _set("optim.lr=0"), ["optim.lr", "> 0"]),
    Case("pretrain-set-without-value", "pretrain.py", _set("train.epochs"), ["train.epochs", "KEY=VALUE"]),
    Case("pretrain-batch-not-divisible", "pretrain.py", ["--num-workers", "2", *_set("train.batch_size=63")],
         ["train.batch_size", "63", "scale.num_workers"]),
    Case("pretrain-missing-config-file", "pretrain.py", ["--config", "missing.yaml"], ["missing.yaml"]),
    Case("pretrain-config-not-a-mapping", "pretrain.py", ["--config", "list.yaml"], ["list.yaml", "mapping"],
         files={"list.yaml": "- 1\n- 2\n"}),
    Case("pretrain-config-not-yaml", "pretrain.py", ["--config", "broken.yaml"], ["broken.yaml", "YAML"],
         files={"broken.yaml": "train: [1, 2\n"}),
    Case("pretrain-config-unknown-section", "pretrain.py", ["--config", "c.yaml"], ["trian", "unknown key"],
         files={"c.yaml": "trian:\n  epochs: 2\n"}),
    Case("pretrain-store-not-a-store", "pretrain.py", ["--store", "empty_store"], ["empty_store"],
         files={"empty_store": None}),
    Case("pretrain-store-missing", "pretrain.py", ["--store", "no_such_store"], ["no_such_store"]),
    Case("pretrain-unknown-recipe", "pretrain.py", ["--recipe", "lxmert-vqa"],
         ["recipe", "'lxmert-vqa'", "lxmert-pretrain, lxmert-pretrain-paper"]),
    Case("pretrain-plateau-without-minival", "pretrain.py",
         _set("optim.schedule=plateau", "data.synthetic.minival_fraction=0"),
         ["optim.schedule", "plateau", "minival_fraction = 0"]),
    # ---- jobs/finetune.py
    Case("finetune-bertadam-plateau", "finetune.py", ["--recipe", "lxmert-vqa", *_set("optim.schedule=plateau")],
         ["optim.schedule", "'plateau'", "bertadam", "linear, constant, cosine"]),
    Case("finetune-init-run-without-id", "finetune.py", ["--init", "run"], ["init.run_id", "--init-run-id"]),
    Case("finetune-init-checkpoint-missing", "finetune.py", ["--init", "checkpoint", "--init-path", "no_ckpt"],
         ["no_ckpt"]),
    Case("finetune-init-reference-missing", "finetune.py", ["--init", "reference", "--init-path", "no_such.pth"],
         ["init.path", "no_such.pth"]),
    Case("finetune-bad-task", "finetune.py", ["--task", "squad"], ["task", "'squad'", "'nlvr2'"]),
    Case("finetune-store-missing", "finetune.py", ["--task", "vqa", "--store", "no_such_set"], ["no_such_set"]),
    Case("finetune-bad-best-metric", "finetune.py", _set("train.best_metric=valid/bleu"),
         ["train.best_metric", "valid/bleu", "valid/accuracy"]),
    # ---- jobs/train_mult.py
    Case("mult-plateau-metric-not-measured", "train_mult.py", ["--recipe", "mult-reference",
                                                                *_set("optim.plateau.metric=valid/bleu")],
         ["optim.plateau.metric", "valid/bleu", "valid/loss"]),
    Case("mult-plateau-option-without-plateau", "train_mult.py", _set("optim.plateau.patience=5"),
         ["optim.plateau.patience", "optim.schedule='linear'"]),
    Case("mult-dim-not-multiple-of-heads", "train_mult.py", _set("preset=reference", "model.dim=31"),
         ["model.dim", "31", "num_heads"]),
    Case("mult-dropout-1", "train_mult.py", _set("model.attn_dropout=1"), ["model.attn_dropout", "[0, 1)"]),
    Case("mult-bad-fractions", "train_mult.py", _set("data.synthetic.valid_fraction=0.95"),
         ["data.synthetic.valid_fraction", "0.95"]),
    Case("mult-duplicate-seeds", "train_mult.py", ["--seeds", "1,1"], ["seeds", "distinct"]),
    Case("mult-store-not-a-store", "train_mult.py", ["--store", "empty_store"], ["empty_store"],
         files={"empty_store": None}),
    # ---- jobs/sweep.py
    Case("sweep-missing-space", "sweep.py", ["no_space.yaml"], ["no_space.yaml"]),
    Case("sweep-space-not-a-mapping", "sweep.py", ["space.yaml"], ["space.yaml", "mapping"],
         files={"space.yaml": "- job\n"}),
    Case("sweep-unknown-parameter-key", "sweep.py", ["space.yaml"], ["space.yaml", "parameters.optim.lr.lo"],
         files={"space.yaml": _space("{type: choice, values: [1e-3, 1e-2]}", "{type: float, lo: 1e-3, high: 1e-2}")}),
    Case("sweep-parameter-not-in-config", "sweep.py", ["space.yaml"], ["space.yaml", "model.hiden"],
         files={"space.yaml": _space("optim.lr: {type: choice, values: [1e-3, 1e-2]}",
                                     "model.hiden: {type: int, low: 1, high: 3}")}),
    Case("sweep-bad-distribution", "sweep.py", ["space.yaml"], ["space.yaml", "parameters.optim.lr", "'normal'"],
         files={"space.yaml": _space("{type: choice, values: [1e-3, 1e-2]}", "{type: normal, mean: 0, std: 1}")}),
    Case("sweep-range-the-config-rejects", "sweep.py", ["space.yaml"], ["space.yaml", "model.dropout", "[0, 1)"],
         files={"space.yaml": _space("optim.lr: {type: choice, values: [1e-3, 1e-2]}",
                                     "model.dropout: {type: float, low: 0.0, high: 1.5}")}),
    Case("sweep-bad-set", "sweep.py", [str(SPACES / "lxmert_layers.yaml"), *_set("model.hidden_size=130")],
         ["model.hidden_size", "130"]),
    Case("sweep-set-tracking-uri", "sweep.py", ["space.yaml", *_set("mlflow.tracking_uri=mlflow.db")],
         ["mlflow.tracking_uri", "sqlite:///"], files={"space.yaml": SPACE}),
    # ---- jobs/ingest.py
    Case("ingest-unknown-source", "ingest.py", ["bogus", "out"], ["bogus"]),
    Case("ingest-lxmert-missing-inputs", "ingest.py", ["lxmert", "out", "--tsv", "no.tsv", "--json", "no.json"],
         ["no.tsv"]),
    Case("ingest-lxmert-missing-labelf", "ingest.py", ["lxmert", "out", "--tsv", "f.tsv", "--json", "s.json"],
         ["s.json", "record #1", "'COCO_2'", "'labelf' is missing", "--allow-missing-labelf"],
         files={"f.tsv": "", "s.json": '[{"img_id": "COCO_1", "sentf": {"vqa": ["what?"]}, "labelf": {"vqa": [{}]}},'
                                       ' {"img_id": "COCO_2", "sentf": {"vqa": ["is it red?"]}}]'}),
    Case("ingest-features-cut-line", "ingest.py", ["features", "out", "--tsv", "f.tsv"],
         ["f.tsv:2", "tab-separated fields", "cut off"], files={"f.tsv": "\n" + "\t".join(["COCO_1", "480", "640"])}),
    Case("ingest-synthetic-seq-len", "ingest.py", ["synthetic", "out", "--max-seq-len", "2"], ["max_seq_len"]),
    Case("ingest-mult-missing-pickle", "ingest.py", ["mult", "out", "--pickle", "no.pkl", "--format", "reference"],
         ["no.pkl"]),
    Case("ingest-mult-synthetic-too-few", "ingest.py", ["mult-synthetic", "out", "--num-samples", "5"],
         ["num_samples"]),
    Case("ingest-vqa-store-missing", "ingest.py", ["vqa", "out", "--store", "no_such_store", "--train", "t.json"],
         ["no_such_store"], files={"t.json": "[]"}),
    Case("ingest-synthetic-vqa-not-a-store", "ingest.py", ["synthetic-vqa", "out", "--store", "empty_store"],
         ["empty_store"], files={"empty_store": None}),
    # ---- jobs/ingest.py: non-finite or malformed values; an empty output folder the user made stays
    Case("ingest-mult-nan-label-reference", "ingest.py", ["mult", "out", "--pickle", "p.pkl", "--format", "reference"],
         ["p.pkl", "['valid']['labels'][1]", "nan", "finite"],
         files={"out": None, "p.pkl": _mult_pickle("reference", **{"valid.labels": [[[0.5]], [[float("nan")]],
                                                                                   [[1.0]]]})}),
    Case("ingest-mult-inf-label-mmsa", "ingest.py", ["mult", "out", "--pickle", "p.pkl", "--format", "mmsa"],
         ["p.pkl", "['test']['regression_labels'][2]", "inf", "finite"],
         files={"out": None, "p.pkl": _mult_pickle("mmsa", **{"test.regression_labels": [0.0, 1.0, float("inf")]})}),
    Case("ingest-mult-mmsa-fractional-length", "ingest.py", ["mult", "out", "--pickle", "p.pkl", "--format", "mmsa"],
         ["p.pkl", "['train']['audio_lengths'][1] = 1.5", "integer in [0, 2]"],
         files={"out": None, "p.pkl": _mult_pickle("mmsa", **{"train.audio_lengths": [2, 1.5, 2]})}),
    Case("ingest-mult-text-labels", "ingest.py", ["mult", "out", "--pickle", "p.pkl", "--format", "reference"],
         ["p.pkl", "['train']['labels']", "not numbers"],
         files={"p.pkl": _mult_pickle("reference", **{"train.labels": [[["a"]], [["b"]], [["c"]]]})}),
    Case("ingest-mult-truncated-pickle", "ingest.py", ["mult", "out", "--pickle", "p.pkl", "--format", "reference"],
         ["p.pkl", "not a readable pickle"], files={"out": None, "p.pkl": _mult_pickle("reference")[:300]}),
    Case("ingest-mult-pickle-is-a-folder", "ingest.py", ["mult", "out", "--pickle", "data", "--format", "mmsa"],
         ["data", "is a directory"], files={"data": None}),
    Case("ingest-mult-zero-shard-rows", "ingest.py",
         ["mult", "out", "--pickle", "p.pkl", "--format", "reference", "--shard-rows", "0"],
         ["--shard-rows 0", ">= 1"], files={"p.pkl": _mult_pickle("reference")}),
    Case("ingest-mult-synthetic-nan-rate", "ingest.py", ["mult-synthetic", "out", "--audio-rate", "nan"],
         ["audio_rate", "nan", "finite"]),
    Case("ingest-mult-synthetic-negative-noise", "ingest.py", ["mult-synthetic", "out", "--label-noise", "-1"],
         ["label_noise", "-1.0", ">= 0"], files={"out": None}),
    Case("ingest-synthetic-nan-feature-noise", "ingest.py", ["synthetic", "out", "--feature-noise", "nan"],
         ["feature_noise=nan", "finite"], files={"out": None}),
    Case("ingest-features-nan-feature", "ingest.py", ["features", "out", "--tsv", "f.tsv", "--no-progress"],
         ["f.tsv:2", "'COCO_2'", "non-finite value nan"],
         files={"out": None, "f.tsv": _tsv_line("COCO_1", [1.0] * 8) + "\n"
                + _tsv_line("COCO_2", [1.0, 1.0, float("nan"), 1.0, 1.0, 1.0, 1.0, 1.0]) + "\n"}),
    Case("ingest-features-nan-feature-deep-out", "ingest.py", ["features", "a/b/out", "--tsv", "f.tsv", "--no-progress"],
         ["f.tsv:1", "non-finite value inf"], files={"f.tsv": _tsv_line("COCO_1", [float("inf")] + [1.0] * 7)}),
    Case("ingest-features-tsv-is-a-folder", "ingest.py", ["features", "out", "--tsv", "feats"],
         ["feats", "is a directory"], files={"feats": None}),
    Case("ingest-lxmert-zero-answers", "ingest.py",
         ["lxmert", "out", "--tsv", "f.tsv", "--json", "s.json", "--num-answers", "0"], ["--num-answers 0", ">= 1"],
         files={"f.tsv": "", "s.json": "[]"}),
    Case("ingest-lxmert-json-is-a-folder", "ingest.py", ["lxmert", "out", "--tsv", "f.tsv", "--json", "sents"],
         ["sents", "is a directory"], files={"f.tsv": "", "sents": None}),
    Case("ingest-vqa-zero-answers", "ingest.py",
         ["vqa", "out", "--store", "st", "--train", "t.json", "--num-answers", "0"], ["--num-answers 0", ">= 1"],
         files={"t.json": "[]"}),
    # ---- jobs/ingest.py: where a store or set would be written, checked before anything is read
    Case("ingest-synthetic-out-under-proc", "ingest.py", ["synthetic", "/proc/xmodal-store", "--no-progress"],
         ["output folder", "'/proc/xmodal-store'", "refuses new files"]),
    Case("ingest-mult-synthetic-out-under-a-file", "ingest.py", ["mult-synthetic", "afile/store"],
         ["'afile/store'", "is a file, not a folder"], files={"afile": "x"}),
    Case("ingest-features-out-half-uri", "ingest.py", ["features", "s3:/bucket/store", "--tsv", "f.tsv"],
         ["'s3:/bucket/store'", "a slash missing", "s3://bucket/prefix"], files={"f.tsv": ""}),
    # ---- jobs/report.py: a report only reads; it never creates or migrates a database
    Case("report-no-database", "report.py", ["--experiment", "x"], ["mlflow.db", "no MLflow database", "--tracking-uri"]),
    Case("report-database-is-an-empty-file", "report.py", ["--parent-run", "abc"], ["mlflow.db", "an empty file"],
         files={"mlflow.db": ""}),
    Case("report-database-is-text", "report.py", ["--experiment", "x", "--tracking-uri", "sqlite:///runs.db"],
         ["runs.db", "not an SQLite database"], files={"runs.db": "a few notes\n"}),
    Case("report-database-is-a-folder", "report.py", ["--experiment", "x", "--tracking-uri", "sqlite:///runs.db"],
         ["runs.db", "is a directory"], files={"runs.db": None}),
    Case("report-bad-tracking-uri", "report.py", ["--experiment", "x", "--tracking-uri", "mlflow.db"],
         ["'mlflow.db'", "sqlite:///"]),
    # ---- jobs/benchmark.py: every subcommand's bad input, before anything is measured
    Case("bench-examples-zero", "benchmark.py", ["examples", "--run-id", "abc", "--examples", "0"],
         ["--examples 0", "from 1 to 1000"]),
    Case("bench-examples-second-count-zero", "benchmark.py", ["examples", "--run-id", "abc", "--examples", "16", "0"],
         ["--examples 0", "from 1 to 1000"]),
    Case("bench-examples-threads-zero", "benchmark.py", ["examples", "--run-id", "abc", "--threads", "0"],
         ["--threads 0", ">= 1"]),
    Case("bench-mult-bad-preset", "benchmark.py", ["mult", "--preset", "huge"], ["--preset 'huge'", "reference"]),
    Case("bench-mult-set-not-a-number", "benchmark.py", ["mult", "--set", "dim=abc"], ["dim=abc", "not an integer"]),
    Case("bench-mult-set-unknown-field", "benchmark.py", ["mult", "--set", "dimm=3"], ["dimm", "unknown", "num_heads"]),
    Case("bench-mult-set-out-of-bounds", "benchmark.py", ["mult", "--set", "dim=31"], ["dim=31", "num_heads"]),
    Case("bench-mult-set-without-value", "benchmark.py", ["mult", "--set", "dim"], ["'dim'", "FIELD=VALUE"]),
    Case("bench-mult-set-bad-bool", "benchmark.py", ["mult", "--set", "causal=maybe"], ["'maybe'", "true or false"]),
    Case("bench-mult-zero-batch", "benchmark.py", ["mult", "--batch", "24", "0"], ["--batch 0", ">= 1"]),
    Case("bench-lxmert-zero-steps", "benchmark.py", ["lxmert", "--steps", "0"], ["--steps 0", ">= 1"]),
    Case("bench-lxmert-negative-warmup", "benchmark.py", ["lxmert", "--warmup", "-1"], ["--warmup -1", ">= 0"]),
    Case("bench-data-zero-batch", "benchmark.py", ["data", "--batch", "0"], ["--batch 0", ">= 1"]),
    Case("bench-data-workdir-is-a-file", "benchmark.py", ["data", "--workdir", "w"], ["--workdir: 'w'", "is a file"],
         files={"w": "x"}),
    Case("bench-suite-unknown-section", "benchmark.py", ["suite", "--sections", "lxmert,bert"],
         ["--sections", "'bert'", "ddp"]),
    Case("bench-suite-bad-preset", "benchmark.py", ["suite", "--mult-preset", "huge"], ["--mult-preset 'huge'", "tiny"]),
    Case("bench-suite-out-is-a-file", "benchmark.py", ["suite", "--quick", "--out", "results"],
         ["--out: 'results'", "is a file"], files={"results": "x"}),
    Case("bench-scale-bad-images", "benchmark.py", ["scale", "--images", "2k"], ["--images '2k'", "image counts"]),
    Case("bench-scale-work-under-a-file", "benchmark.py", ["scale", "--quick", "--work", "w/sub"],
         ["--work: 'w/sub'", "is a file"], files={"w": "x"}),
    Case("bench-scale-zero-batch", "benchmark.py", ["scale", "--quick", "--batch", "0"], ["--batch 0", ">= 1"]),
    # ---- jobs/replay_tracking.py: replay never creates a database, and reads only spool files
    Case("replay-database-missing", "replay_tracking.py", ["s.jsonl"],
         ["s.jsonl", "sqlite:///mlflow.db", "no MLflow database", "--tracking-uri"], files={"s.jsonl": _spool()}),
    Case("replay-tracking-uri-missing", "replay_tracking.py", ["s.jsonl", "--tracking-uri", "sqlite:///other.db"],
         ["other.db", "no MLflow database"], files={"s.jsonl": _spool(uri="sqlite:////nonexistent/m.db")}),
    Case("replay-database-is-an-empty-file", "replay_tracking.py", ["s.jsonl"], ["mlflow.db", "an empty file"],
         files={"s.jsonl": _spool(), "mlflow.db": ""}),
    Case("replay-missing-spool", "replay_tracking.py", ["no.jsonl"], ["no.jsonl", "no such file"]),
    Case("replay-empty-spool", "replay_tracking.py", ["s.jsonl"], ["s.jsonl", "holds no record"], files={"s.jsonl": ""}),
    Case("replay-spool-is-a-folder", "replay_tracking.py", ["runs"], ["runs", "is a directory"], files={"runs": None}),
    Case("replay-spool-not-json", "replay_tracking.py", ["s.jsonl"], ["s.jsonl, line 1", "not valid JSON"],
         files={"s.jsonl": "step,loss\n1,0.5\n"}),
    Case("replay-spool-of-another-format", "replay_tracking.py", ["s.jsonl"], ["s.jsonl, line 1", "unknown op", "metrics"],
         files={"s.jsonl": json.dumps({"run": "abc", "loss": [0.5, 0.4]}) + "\n"}),
    Case("replay-items-not-a-list", "replay_tracking.py", ["s.jsonl"], ["s.jsonl, line 1", "'items' is 5"],
         files={"s.jsonl": _spool(op="metrics", items=5)}),
    # ---- duplicate keys and unused options (every YAML a user writes is read by config.StrictLoader)
    Case("pretrain-config-duplicate-section", "pretrain.py", ["--config", "twice.yaml"],
         ["twice.yaml", "duplicate key 'train'", "line 1", "line 3"],
         files={"twice.yaml": "train:\n  max_steps: 40\ntrain:\n  epochs: 3\n"}),
    Case("pretrain-set-duplicate-key", "pretrain.py", _set("train={epochs: 1, epochs: 2}"),
         ["--set 'train={epochs: 1, epochs: 2}'", "duplicate key 'epochs'"]),
    Case("pretrain-set-unclosed-list", "pretrain.py", _set("train.fail_at_step=[1,2"),
         ["--set 'train.fail_at_step=[1,2'", "not valid YAML", "expected ',' or ']'"]),
    Case("sweep-space-duplicate-parameter", "sweep.py", ["space.yaml"],
         ["space.yaml", "duplicate key 'optim.lr'", "line 7", "line 8"],
         files={"space.yaml": SPACE + "  optim.lr: {type: choice, values: [1e-4]}\n"}),
    Case("sweep-base-file-duplicate-key", "sweep.py", ["space.yaml"],
         ["space.yaml", "base.yaml", "duplicate key 'max_steps'"],
         files={"space.yaml": SPACE + "base: {file: base.yaml}\n",
                "base.yaml": "train:\n  max_steps: 4\n  max_steps: 40\n"}),
    Case("finetune-init-run-id-without-init-run", "finetune.py", ["--init-run-id", "abc123"],
         ["init.run_id", "'abc123'", "source='latest'", "--init run", "--init-run-id"]),
    Case("finetune-init-scratch-with-run-id", "finetune.py", ["--init", "scratch", "--init-run-id", "abc123"],
         ["init.run_id", "'abc123'", "source='scratch'"]),
    Case("finetune-init-path-without-a-source-that-reads-it", "finetune.py", ["--init-path", "model_LXRT.pth"],
         ["init.path", "'model_LXRT.pth'", "source='latest'", "--init-path"]),
    Case("finetune-config-init-run-id-with-scratch", "finetune.py", ["--config", "c.yaml"],
         ["init.run_id", "'abc123'", "source='scratch'"],
         files={"c.yaml": "init:\n  source: scratch\n  run_id: abc123\n"}),
    Case("finetune-init-pretrain-experiment-unused", "finetune.py",
         ["--init", "scratch", *_set("init.pretrain_experiment=mine")], ["init.pretrain_experiment", "'mine'"]),
    Case("mult-seed-beside-seeds", "train_mult.py", ["--seed", "4", "--seeds", "1,2"], ["train.seed", "4", "seeds"]),
    Case("sweep-chain-stage-section-the-chain-replaces", "sweep.py", ["space.yaml"],
         ["space.yaml", "finetune.scale.num_workers", "scale.num_workers instead"],
         files={"space.yaml": "job: pretrain_finetune\nmetric: valid/accuracy\nmode: max\nnum_samples: 2\n"
                              "scheduler: {type: fifo}\nbase: {config: {finetune: {scale: {num_workers: 2}}}}\n"
                              "parameters:\n  pretrain.optim.lr: {type: choice, values: [1e-3, 1e-2]}\n"}),
    Case("pretrain-config-is-a-directory", "pretrain.py", ["--config", "c.yaml"], ["c.yaml", "is a directory"],
         files={"c.yaml": None}),
    Case("pretrain-set-empty-key-part", "pretrain.py", _set("train..epochs=3"), ["--set 'train..epochs=3'", "KEY=VALUE"]),
    Case("sweep-bad-name", "sweep.py", ["space.yaml", "--name", "mine/v2"], ["--name", "'mine/v2'", "letters, digits"],
         files={"space.yaml": SPACE}),
    Case("pretrain-run-name-with-slash", "pretrain.py", ["--run-name", "mine/v2"], ["mlflow.run_name", "'mine/v2'", "/"]),
    Case("sweep-space-is-a-directory", "sweep.py", ["space.yaml"], ["space.yaml", "is a directory"],
         files={"space.yaml": None}),
    # ---- checked before any data is built (the config, engine.check, then JobSpec.prepare before it opens data)
    Case("finetune-init-checkpoint-bad-meta", "finetune.py", ["--init", "checkpoint", "--init-path", "ck"],
         ["init.path", "meta.json", "not readable JSON"], files={"ck": None, "ck/meta.json": "{", "ck/model.pt": "x"}),
    Case("finetune-init-checkpoint-weights-not-torch", "finetune.py", ["--init", "checkpoint", "--init-path", "ck"],
         ["init.path", "model.pt", "not a torch state dict file"],
         files={"ck": None, "ck/meta.json": '{"config": {"model": {"hidden_size": 8, "num_heads": 2}}}', "ck/model.pt": "x"}),
    Case("finetune-init-run-without-database", "finetune.py", ["--init", "run", "--init-run-id", "abc123"],
         ["init.run_id", "'abc123'", "mlflow.db"]),
    Case("finetune-init-run-unknown-id", "finetune.py", ["--init", "run", "--init-run-id", "abc123"],
         ["init.run_id", "no MLflow run 'abc123'"], files={"mlflow.db": ""}),
    Case("finetune-init-transformers-not-a-checkpoint", "finetune.py", ["--init", "transformers", "--init-path", "hf"],
         ["init.path", "config.json"], files={"hf": None}),
    Case("finetune-init-transformers-without-weights", "finetune.py", ["--init", "transformers", "--init-path", "hf"],
         ["init.path", "no weights", "model.safetensors"], files={"hf": None, "hf/config.json": "{}"}),
    Case("finetune-init-reference-not-torch", "finetune.py", ["--init", "reference", "--init-path", "notes.pth"],
         ["init.path", "notes.pth", "not a torch state dict file"], files={"notes.pth": "not a checkpoint\n"}),
    Case("finetune-init-checkpoint-with-model-set", "finetune.py",
         ["--init", "checkpoint", "--init-path", "ckpt", *_set("model.hidden_size=128")],
         ["model.hidden_size", "init.source=checkpoint", "--init scratch"], files={"ckpt": None}),
    Case("pretrain-fault-beyond-max-steps", "pretrain.py", _set("train.max_steps=10", "train.fail_at_step=10"),
         ["train.fail_at_step", "[10]", "10 steps"]),
    Case("pretrain-random-faults-beyond-max-steps", "pretrain.py", _set("train.max_steps=3", "train.random_faults=5"),
         ["train.random_faults", "5", "at most 2"]),
    Case("pretrain-faults-with-remote-storage", "pretrain.py", ["--storage-path", "s3://bucket/runs",
                                                                *_set("train.fail_at_step=3")],
         ["train.fail_at_step", "local scale.storage_path", "s3://bucket/runs"]),
    Case("mult-best-metric-not-measured", "train_mult.py", _set("train.best_metric=valid/bleu"),
         ["train.best_metric", "'valid/bleu'", "valid/mae"]),
    # A job that passed every check: the cluster named by RAY_ADDRESS does not answer (before the
    # embedded default is built, so nothing is left behind).
    Case("pretrain-cluster-does-not-answer", "pretrain.py", [],
         ["RAY_ADDRESS", "'127.0.0.1:1'", "ray status --address 127.0.0.1:1"]),
    Case("sweep-cluster-does-not-answer", "sweep.py", ["space.yaml"],
         ["RAY_ADDRESS", "ray status --address 127.0.0.1:1"], files={"space.yaml": SPACE}),
    # ---- exports: the selected model, recorded checksums, the output folder
    Case("export-out-under-proc", "export.py", ["--to", "reference", "--checkpoint", "ckpt", "--out",
                                                 "/proc/xmodal-export"],
         ["--out", "'/proc/xmodal-export'", "refuses new files"], files={"ckpt": None}),
    Case("export-out-under-a-file", "export.py", ["--to", "reference", "--checkpoint", "ckpt", "--out", "notes.txt/out"],
         ["--out", "'notes.txt/out'", "is a file"], files={"ckpt": None, "notes.txt": "x"}),
    Case("export-out-is-a-uri", "export.py", ["--to", "reference", "--checkpoint", "ckpt", "--out", "s3://bucket/out"],
         ["--out", "'s3://bucket/out'", "writes a local folder only"], files={"ckpt": None}),
    Case("export-checkpoint-sha256-mismatch", "export.py", ["--to", "reference", "--checkpoint", ".", "--out", "out"],
         ["--checkpoint", "model.pt", "sha256", "refusing to export"],
         files={"model.pt": "garbage", "meta.json": json.dumps({"config": {}, "files": {
             "model.pt": {"bytes": 7, "sha256": "0" * 64}}})}),
    Case("export-checkpoint-without-its-selected-weights", "export.py",
         ["--to", "reference", "--checkpoint", ".", "--out", "out"],
         ["--checkpoint", "best_model.pt", "selected on validation", "--logged-model runs:/0123abcd/final_model"],
         files={"model.pt": "garbage", "meta.json": json.dumps({"run_id": "0123abcd", "config": {"task": "vqa"}, "files": {
             "model.pt": {"bytes": 7, "sha256": hashlib.sha256(b"garbage").hexdigest()},
             "best_model.pt": {"bytes": 7, "sha256": "0" * 64}}})}),
    # ---- output places and options that nothing uses (the whole config)
    Case("pretrain-storage-path-under-proc", "pretrain.py", ["--storage-path", "/proc/xmodal-runs"],
         ["scale.storage_path", "'/proc/xmodal-runs'", "cannot be written"]),
    Case("pretrain-storage-path-under-a-file", "pretrain.py", ["--storage-path", "notes/runs"],
         ["scale.storage_path", "'notes/runs'", "is a file"], files={"notes": "x"}),
    Case("mult-storage-path-slash-missing", "train_mult.py", ["--storage-path", "s3:/runs"],
         ["scale.storage_path", "'s3:/runs'", "slash missing"]),
    Case("finetune-storage-path-no-bucket", "finetune.py", ["--storage-path", "s3:///runs"],
         ["scale.storage_path", "'s3:///runs'", "names no bucket"]),
    Case("pretrain-storage-path-bucket-with-space", "pretrain.py", _set("scale.storage_path=s3://my bucket/runs"),
         ["scale.storage_path", "'my bucket'", "not a valid bucket name"]),
    Case("sweep-storage-path-slash-missing", "sweep.py", ["space.yaml", "--storage-path", "gs:runs"],
         ["'gs:runs'", "slash missing"], files={"space.yaml": SPACE}),
    Case("finetune-nlvr2-output-on-vqa", "finetune.py", ["--task", "vqa", *_set("nlvr2_output=softmax")],
         ["nlvr2_output", "'softmax'", "task=nlvr2", "task='vqa'"]),
    Case("finetune-qa-loss-on-nlvr2", "finetune.py", ["--task", "nlvr2", *_set("qa_loss=ce")],
         ["qa_loss", "'ce'", "task='nlvr2'"]),
    Case("finetune-answer-head-from-qa-from-scratch", "finetune.py",
         ["--init", "scratch", *_set("init.answer_head_from_qa=false")],
         ["init.answer_head_from_qa", "init.source='scratch'"]),
    Case("finetune-robust-seed-without-conditions", "finetune.py", _set("robust.conditions=[]", "robust.seed=4"),
         ["robust.seed", "robust.conditions=[]"]),
    Case("mult-noise-sigma-without-noise", "train_mult.py", _set("robust.conditions=[zero_audio]", "robust.noise_sigma=2"),
         ["robust.noise_sigma", "2", "noise_*", "['zero_audio']"]),
    Case("pretrain-feat-loss-without-feature-regression", "pretrain.py",
         _set("tasks.obj_feat=false", "tasks.feat_loss=smooth_l1"),
         ["tasks.feat_loss", "'smooth_l1'", "tasks.obj_feat=false"]),
    Case("pretrain-fault-seed-without-random-faults", "pretrain.py", _set("train.fault_seed=3"),
         ["train.fault_seed", "train.random_faults=0"]),
    Case("pretrain-config-synthetic-beside-a-store", "pretrain.py", ["--config", "c.yaml"],
         ["data.synthetic.num_images", "100", "data.store='st'"],
         files={"c.yaml": "data:\n  store: st\n  synthetic: {num_images: 100}\n"}),
    Case("sweep-parameter-nothing-uses-in-a-combination", "sweep.py", ["space.yaml"],
         ["space.yaml", "tasks.feat_loss", "tasks.obj_feat=false"],
         files={"space.yaml": SPACE + "  tasks.obj_feat: {type: choice, values: [true, false]}\n"
                                      "  tasks.feat_loss: {type: choice, values: [l2, smooth_l1]}\n"}),
    Case("sweep-chain-base-option-its-stage-does-not-use", "sweep.py", ["space.yaml"],
         ["space.yaml", "pretrain.schedule.qa_from_fraction", "tasks.qa=false (in pretrain)"],
         files={"space.yaml": "job: pretrain_finetune\nmetric: valid/accuracy\nmode: max\nnum_samples: 2\n"
                              "scheduler: {type: fifo}\nbase: {config: {pretrain: {tasks: {qa: false}, "
                              "schedule: {qa_from_fraction: 0.5}}}}\n"
                              "parameters:\n  pretrain.optim.lr: {type: choice, values: [1e-3, 1e-2]}\n"}),
    Case("pretrain-lr-inf", "pretrain.py", _set("optim.lr=inf"), ["optim.lr", "inf", "a finite number > 0"]),
    Case("pretrain-lr-nan", "pretrain.py", _set("optim.lr=nan"), ["optim.lr", "nan", "a finite number > 0"]),
    Case("mult-cpus-per-worker-inf", "train_mult.py", _set("scale.cpus_per_worker=.inf"),
         ["scale.cpus_per_worker", "inf", "finite"]),
    Case("finetune-initializer-range-overflows", "finetune.py", ["--init", "scratch",
                                                                 *_set("model.initializer_range=1e999")],
         ["model.initializer_range", "finite"]),
    # ---- tracking: replay, report, the tracking benchmark
    # (--baseline naming no row and a spool naming a deleted or foreign run need an MLflow database with
    # runs: tests/report/test_build.py and tests/tracking/test_spool.py run those scripts on one.)
    Case("report-out-unwritable", "report.py", ["--experiment", "x", "--out", "/proc/xmodal-report"],
         ["--out", "'/proc/xmodal-report'", "cannot be written"]),
    Case("report-out-is-a-file", "report.py", ["--experiment", "x", "--out", "r"], ["--out", "'r'", "is a file"],
         files={"r": "x"}),
    Case("bench-tracking-out-unwritable", "benchmark.py", ["tracking", "--writers", "1", "--out", "/proc/xmodal-bench"],
         ["--out", "'/proc/xmodal-bench'", "cannot be written"]),
    Case("bench-tracking-work-unwritable", "benchmark.py", ["tracking", "--writers", "1", "--work", "/proc/xmodal-w"],
         ["--work", "'/proc/xmodal-w'", "cannot be written"]),
    # ---- jobs/examples.py (a run of another task and a split the run did not evaluate need a database with
    # runs: tests/examples/test_examples_cli.py)
    Case("examples-zero", "examples.py", ["--run-id", "abc", "--examples", "0"], ["--examples 0", "from 1 to 1000"]),
    Case("examples-no-database", "examples.py", ["--run-id", "abc123"],
         ["--run-id", "'abc123'", "mlflow.db", "no MLflow store"]),
    Case("examples-unknown-run", "examples.py", ["--run-id", "abc123"], ["--run-id", "no MLflow run 'abc123'"],
         files={"mlflow.db": ""}),
    Case("examples-out-is-a-file", "examples.py", ["--run-id", "abc", "--out", "o"], ["--out", "'o'", "is a file"],
         files={"o": "x"}),
    # ---- fine-tuning's start and a failed start
    Case("finetune-init-checkpoint-of-mult", "finetune.py", ["--init", "checkpoint", "--init-path", "ck"],
         ["init.path", "meta.json", "holds a MulT model's checkpoint", "needs an LXMERT"],
         files={"ck": None, "ck/meta.json": '{"config": {"model": {"variant": "full", "l_dim": 300}}}', "ck/model.pt": "x"}),
    Case("finetune-init-checkpoint-foreign-model-keys", "finetune.py", ["--init", "checkpoint", "--init-path", "ck"],
         ["init.path", "meta.json", "keys an LXMERT model does not take: colour"],
         files={"ck": None, "ck/meta.json": '{"config": {"model": {"hidden_size": 8, "colour": 3}}}', "ck/model.pt": "x"}),
    # ---- benchmarks
    Case("bench-lxmert-json-is-a-folder", "benchmark.py", ["lxmert", "--json", "results"],
         ["--json", "'results'", "is a folder"], files={"results": None}),
    Case("bench-lxmert-json-under-a-file", "benchmark.py", ["lxmert", "--json", "notes.txt/r.json"],
         ["--json", "notes.txt", "is a file"], files={"notes.txt": "x"}),
    # ---- jobs/extract.py (more in tests/extract/test_extract_job.py, which needs real images)
    Case("extract-tsv-out-slash-missing", "extract.py",
         [".", "s3:/bucket/obj36.tsv", "--format", "tsv", *EXTRACT_TINY],
         ["OUT", "'s3:/bucket/obj36.tsv'", "slash missing"], files=IMAGE),
    # inputs read from the local disk only
    Case("finetune-init-path-is-a-uri", "finetune.py", ["--init", "checkpoint", "--init-path", "s3://bucket/ck"],
         ["init.path", "'s3://bucket/ck'", "only local paths are read here"]),
    Case("export-checkpoint-is-a-uri", "export.py", ["--to", "reference", "--checkpoint", "s3://bucket/ck", "--out", "o"],
         ["--checkpoint", "'s3://bucket/ck'", "only local paths are read here"]),
    Case("extract-weights-empty-file", "extract.py", [".", "out", "--weights", "w.pkl"],
         ["--weights", "w.pkl: empty file (0 bytes)"], files={**IMAGE, "w.pkl": ""}),
    Case("extract-list-file-path-twice", "extract.py", ["list.txt", "out", *EXTRACT_TINY],
         ["list.txt:3: image './a.jpg' is listed twice", "list.txt:1 names the same file"],
         files={**IMAGE, "list.txt": "a.jpg\n\n./a.jpg\n"}),
    # placement options: their ranges before Ray (--actors and --batch-size against the cluster once it is
    # reached: tests/extract/test_extract_job.py, with a local Ray)
    Case("extract-gpus-per-actor-zero", "extract.py", [".", "out", *EXTRACT_TINY, "--gpus-per-actor", "0"],
         ["--gpus-per-actor 0", "0 < F <= 1"], files=IMAGE),
    Case("extract-gpus-per-actor-above-one", "extract.py", [".", "out", *EXTRACT_TINY, "--gpus-per-actor", "1.5"],
         ["--gpus-per-actor 1.5", "0 < F <= 1"], files=IMAGE),
    Case("extract-actors-zero", "extract.py", [".", "out", *EXTRACT_TINY, "--actors", "0"],
         ["--actors 0", ">= 1"], files=IMAGE),
    Case("extract-input-size-not-short-max", "extract.py", [".", "out", *EXTRACT_TINY, "--input-size", "600"],
         ["--input-size '600'", "expected SHORT:MAX", "600:1000"], files=IMAGE),
    Case("extract-unknown-precision", "extract.py", [".", "out", *EXTRACT_TINY, "--precision", "fp16"],
         ["--precision", "'fp16'", "fp32", "tf32", "bf16"], files=IMAGE),
    # the work folder beside OUT is made once results arrive: a run that cannot reach Ray leaves none
    Case("extract-ray-unreachable-leaves-no-work-folder", "extract.py", [".", "out", *EXTRACT_TINY],
         ["RAY_ADDRESS", "127.0.0.1:1", "no Ray cluster answers"], files=IMAGE),
]


def _env() -> dict[str, str]:
    drop = ("RAY_ADDRESS", "MLFLOW_TRACKING_URI", "XMODAL_STORAGE_PATH", "PYTHONPATH")
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update({"PYTHONPATH": str(REPO / "platform"), "RAY_ADDRESS": "127.0.0.1:1", "RAY_USAGE_STATS_ENABLED": "0",
                "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    return env


def _tree(root: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*")}


@dataclass
class Result:
    rc: int | None
    stdout: str
    stderr: str
    before: set[str]
    after: set[str]


# Reads a JSON list of cases ({id, cwd, script, args, out, err}) on stdin, forks a process per case
# (at most `parallel` at once, each killed after `timeout` s), and prints {id: exit code or null} as
# JSON. A child runs the script as a fresh interpreter would (`python SCRIPT ARGS` in `cwd`), in a
# session of its own so that a timed-out case's process group is killed whole.
FORK_SERVER = r"""
import json, os, runpy, signal, sys, time

import mlflow  # noqa: F401
import torch  # noqa: F401
import xmodal.cli.extract  # noqa: F401
import xmodal.cli.training  # noqa: F401
import xmodal.config.experiment  # noqa: F401
import xmodal.examples  # noqa: F401
import xmodal.jobs.registry  # noqa: F401
import xmodal.runner.engine  # noqa: F401
import xmodal_bench  # noqa: F401

parallel, timeout = int(sys.argv[1]), float(sys.argv[2])
cases, running, codes = json.load(sys.stdin), {}, {}


def child(case):
    os.setsid()
    os.chdir(case["cwd"])
    for fd, path in ((1, case["out"]), (2, case["err"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644), fd)
    sys.argv = [case["script"], *case["args"]]
    sys.path[0] = os.path.dirname(case["script"])
    code = 0
    try:
        runpy.run_path(case["script"], run_name="__main__")
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


while cases or running:
    while cases and len(running) < parallel:
        case = cases.pop(0)
        pid = os.fork()
        if pid == 0:
            child(case)
        running[pid] = (case["id"], time.monotonic() + timeout)
    pid, status = os.waitpid(-1, os.WNOHANG)
    if pid:
        codes[running.pop(pid)[0]] = os.waitstatus_to_exitcode(status)
        continue
    for pid, (cid, deadline) in list(running.items()):
        if time.monotonic() > deadline:
            os.killpg(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            codes[running.pop(pid)[0]] = None
    time.sleep(0.01)
print(json.dumps(codes))
"""


def _prepare(case: Case, root: Path) -> tuple[dict, set[str]]:
    cwd = root / case.id
    cwd.mkdir()
    for name, text in case.files.items():
        if text is None:
            (cwd / name).mkdir()
        else:
            (cwd / name).write_text(text)
    before = _tree(cwd)
    logs = root / f"{case.id}.out", root / f"{case.id}.err"
    return ({"id": case.id, "cwd": str(cwd), "script": str(JOBS / case.script), "args": case.args,
             "out": str(logs[0]), "err": str(logs[1])}, before)


@pytest.fixture(scope="module")
def results(request, tmp_path_factory) -> dict[str, Result]:
    root = tmp_path_factory.mktemp("bad_configs")
    # only the cases this session runs (`-k extract` runs a few, not the whole table)
    selected = {item.callspec.params["case"].id for item in request.session.items
                if item.module is request.module and "case" in getattr(getattr(item, "callspec", None), "params", {})}
    prepared = {c.id: _prepare(c, root) for c in CASES if c.id in selected}
    out = subprocess.run([PYTHON, "-c", FORK_SERVER, "4", "180"], input=json.dumps([p[0] for p in prepared.values()]),
                         env=_env(), cwd=root, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stderr[-3000:]
    codes = json.loads(out.stdout.strip().splitlines()[-1])
    results = {}
    for cid, (job, before) in prepared.items():
        stderr = Path(job["err"]).read_text() + ("" if codes[cid] is not None else "\n[timed out]")
        results[cid] = Result(codes[cid], Path(job["out"]).read_text(), stderr, before, _tree(Path(job["cwd"])))
    return results


def test_the_table_is_large_and_ids_are_unique():
    assert len(CASES) >= 25 and len({c.id for c in CASES}) == len(CASES)
    assert {c.script for c in CASES} == {"pretrain.py", "finetune.py", "train_mult.py", "sweep.py", "ingest.py",
                                         "report.py", "benchmark.py", "replay_tracking.py", "export.py",
                                         "extract.py", "examples.py"}


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_fails_cleanly_before_anything_starts(case: Case, results: dict[str, Result]):
    r = results[case.id]
    shown = f"$ {case.script} {' '.join(case.args)}\n--- rc {r.rc}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}"
    both = r.stdout + r.stderr
    assert "Traceback" not in both, shown
    assert r.rc == 2, shown
    for piece in case.named:
        assert piece in r.stderr, f"{piece!r} not on stderr\n{shown}"
    for text in RAY_TEXT:  # (the address itself is expected where the case names it)
        assert text not in both or any(text in piece for piece in case.named), f"Ray start-up text {text!r}\n{shown}"
    assert r.after == r.before, f"the working directory changed: {sorted(r.after - r.before)}\n{shown}"
