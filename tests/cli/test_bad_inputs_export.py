"""Bad input to jobs/export.py: targets, sources that are not what they claim, and outputs it must not
write into; each refused with one `error:` line, nothing written, the user's files untouched
(bad_input_harness)."""

from __future__ import annotations

import json

import pytest
from bad_input_harness import Bad, run_bad

REF = ["--to", "reference"]
CKPT = {"ck/meta.json": json.dumps({"config": {"model": {"hidden_size": 8, "num_heads": 2}}}), "ck/model.pt": "x"}

EXPORT = [
    Bad("unknown-target", ["--to", "onnx", "--checkpoint", "ck", "--out", "o"], ["--to", "'onnx'"]),
    Bad("no-source", [*REF, "--out", "o"], ["one of the arguments --run-id --checkpoint --logged-model is required"]),
    Bad("two-sources", [*REF, "--out", "o", "--checkpoint", "ck", "--run-id", "abc"], ["not allowed with"]),
    Bad("checkpoint-missing", [*REF, "--out", "o", "--checkpoint", "ck"], ["--checkpoint", "ck"]),
    Bad("checkpoint-is-a-file", [*REF, "--out", "o", "--checkpoint", "model.pt"], ["--checkpoint", "model.pt"],
        files={"model.pt": "x"}),
    Bad("checkpoint-without-weights", [*REF, "--out", "o", "--checkpoint", "ck"], ["--checkpoint", "model.pt"],
        files={"ck/meta.json": CKPT["ck/meta.json"]}),
    Bad("checkpoint-meta-not-json", [*REF, "--out", "o", "--checkpoint", "ck"], ["--checkpoint", "meta.json"],
        files={"ck/meta.json": "{", "ck/model.pt": "x"}),
    Bad("checkpoint-meta-a-list", [*REF, "--out", "o", "--checkpoint", "ck"], ["--checkpoint", "meta.json"],
        files={"ck/meta.json": "[1, 2]", "ck/model.pt": "x"}),
    Bad("checkpoint-weights-not-torch", [*REF, "--out", "o", "--checkpoint", "ck"], ["model.pt"], files=CKPT),
    Bad("out-holds-the-users-file", [*REF, "--out", "o", "--checkpoint", "ck"],
        ["--out", "already holds 'notes.txt', which export did not write there", "--overwrite"],
        files={**CKPT, "o/notes.txt": "mine"}),
    Bad("out-is-a-file", [*REF, "--out", "o", "--checkpoint", "ck"], ["--out", "'o'", "is a file"],
        files={**CKPT, "o": "x"}),
    Bad("out-a-uri", [*REF, "--out", "s3://bucket/out", "--checkpoint", "ck"],
        ["--out", "'s3://bucket/out' is a URI", "local folder"], files=CKPT),
    Bad("out-half-uri", [*REF, "--out", "s3:/bucket/out", "--checkpoint", "ck"], ["--out", "slash missing"],
        files=CKPT),
    Bad("out-under-proc", [*REF, "--out", "/proc/xmodal-out", "--checkpoint", "ck"], ["--out", "cannot be written"],
        files=CKPT),
    Bad("out-is-the-checkpoint", [*REF, "--out", "ck", "--checkpoint", "ck"],
        ["--out", "already holds", "which export did not write there"], files=CKPT),
    Bad("run-without-database", [*REF, "--out", "o", "--run-id", "abc123"], ["mlflow.db", "no MLflow"]),
    Bad("run-database-empty-file", [*REF, "--out", "o", "--run-id", "abc123"], ["mlflow.db", "an empty file"],
        files={"mlflow.db": ""}),
    Bad("logged-model-without-database", [*REF, "--out", "o", "--logged-model", "models:/m-123"],
        ["mlflow.db", "no MLflow"]),
    Bad("tracking-uri-a-bare-file", [*REF, "--out", "o", "--run-id", "abc", "--tracking-uri", "mlflow.db"],
        ["--tracking-uri: 'mlflow.db' has no scheme", "sqlite:///"], not_said=["mlflow.tracking_uri"]),
    Bad("tracking-uri-sqlite-in-memory", [*REF, "--out", "o", "--run-id", "abc", "--tracking-uri", "sqlite://"],
        ["--tracking-uri: 'sqlite://'", "sqlite:///RELATIVE/PATH"]),
    Bad("tracking-uri-a-text-file", [*REF, "--out", "o", "--run-id", "abc", "--tracking-uri", "sqlite:///runs.db"],
        ["runs.db", "not an SQLite database"], files={"runs.db": "my notes\n"}),
    Bad("empty-out", [*REF, "--out", "", "--checkpoint", "ck"], ["--out"], files=CKPT),
    Bad("empty-checkpoint", [*REF, "--out", "o", "--checkpoint", ""], ["--checkpoint: '' is empty", "checkpoint folder"],
        not_said=["is not a checkpoint"]),
    Bad("checkpoint-a-log-file", [*REF, "--out", "o", "--checkpoint", "somefile.log"],
        ["--checkpoint", "somefile.log' is a file", "expected a checkpoint folder"], files={"somefile.log": "x"},
        not_said=["missing"]),
    Bad("out-holds-the-users-empty-folder", [*REF, "--out", "o", "--checkpoint", "ck"],
        ["--out", "already holds 'keepme/deeper/', which export did not write there", "--overwrite"],
        files={**CKPT, "o/keepme/deeper": None}),
    Bad("tracking-uri-empty", [*REF, "--out", "o", "--run-id", "abc", "--tracking-uri", ""],
        ["--tracking-uri: '' is empty", "sqlite:///"], not_said=["no MLflow database"]),
    Bad("logged-model-not-a-model-uri", [*REF, "--out", "o", "--logged-model", "final_model"],
        ["--logged-model", "'final_model'", "models:/"], files={"mlflow.db": ""}),
    Bad("checkpoint-half-uri", [*REF, "--out", "o", "--checkpoint", "s3:/bucket/ck"],
        ["--checkpoint", "'s3:/bucket/ck'"]),
]


@pytest.mark.parametrize("case", EXPORT, ids=[c.id for c in EXPORT])
def test_export(case, tmp_path, monkeypatch, capsys):
    run_bad("export.py", case, tmp_path, monkeypatch, capsys)


def test_the_table_holds_twenty_cases_or_more():
    assert len(EXPORT) >= 20 and len({c.id for c in EXPORT}) == len(EXPORT)
