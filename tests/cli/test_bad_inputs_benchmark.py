"""Bad input to jobs/benchmark.py: its subcommands' numbers and choices, and where results and scratch
go (a result file is new, never written over; a scratch folder is removed however the benchmark ends);
each refused with one `error:` line, nothing written, nothing left in the temporary folder
(bad_input_harness)."""

from __future__ import annotations

import pytest
from bad_input_harness import GIVEN, Bad, run_bad

BENCHMARK = [
    Bad("lxmert-json-exists", ["lxmert", "--json", "r.json"], ["--json", "r.json' already exists", "--overwrite"],
        files={"r.json": "{\"mine\": 1}"}),
    Bad("lxmert-json-a-uri", ["lxmert", "--json", "s3://bucket/r.json"], ["--json", "is a URI"]),
    Bad("lxmert-json-half-uri", ["lxmert", "--json", "s3:/bucket/r.json"], ["--json", "slash missing"]),
    Bad("lxmert-negative-threads", ["lxmert", "--threads", "-1"], ["--threads -1", ">= 0"]),
    Bad("lxmert-zero-peak", ["lxmert", "--peak-tflops", "0"], ["--peak-tflops 0"]),
    Bad("suite-out-a-uri", ["suite", "--quick", "--out", "s3://bucket/results"], ["--out", "is a URI"]),
    Bad("suite-out-under-proc", ["suite", "--quick", "--out", "/proc/xmodal-bench"], ["--out", "cannot be written"]),
    Bad("suite-no-sections", ["suite", "--sections", ","], ["--sections", "none given"]),
    Bad("scale-work-a-uri", ["scale", "--quick", "--work", "s3://bucket/w"], ["--work", "is a URI"]),
    Bad("scale-too-few-images", ["scale", "--images", "10"], ["--images '10'", "at least 20"]),
    Bad("scale-images-not-numbers", ["scale", "--images", "100,abc"], ["--images '100,abc'"]),
    Bad("data-workdir-under-proc", ["data", "--workdir", "/proc/xmodal-w"], ["--workdir", "cannot be written"]),
    Bad("data-one-image", ["data", "--num-images", "1"], ["--num-images 1", ">= 2"]),
    Bad("data-negative-mix", ["data", "--mix-units", "-1"], ["--mix-units -1", ">= 0"]),
    Bad("mult-unknown-precision", ["mult", "--precision", "fp16"], ["--precision", "'fp16'"]),
    Bad("tracking-zero-writers", ["tracking", "--writers", "0"], ["--writers 0", ">= 1"]),
    Bad("tracking-unknown-backend", ["tracking", "--backend", "mysql"], ["--backend", "'mysql'"]),
    Bad("sweep-zero-trials", ["sweep", "--trials", "0"], ["--trials 0", ">= 1"]),
    Bad("sweep-zero-concurrent", ["sweep", "--concurrent", "0"], ["--concurrent 0", ">= 1"]),
    Bad("sweep-out-under-proc", ["sweep", "--out", "/proc/xmodal-bench"], ["--out", "cannot be written"]),
    Bad("sweep-work-is-a-file", ["sweep", "--work", "w"], ["--work", "'w'", "is a file"], files={"w": "x"}),
    Bad("extract-out-a-uri", ["extract", "--out", "s3://bucket/r"], ["--out", "is a URI"]),
    Bad("unknown-benchmark", ["bert"], ["invalid choice: 'bert'"]),
    Bad("examples-out-a-uri", ["examples", "--run-id", "abc", "--out", "s3://bucket/r"], ["--out", "is a URI"]),
    # a benchmark that fails once it has begun removes the scratch folder it made, and the --work folder
    # made for it
    Bad("examples-unknown-run-leaves-no-scratch", ["examples", "--run-id", "abc123", "--work", "scratch/w"],
        ["--run-id", "no MLflow run 'abc123'"], files={"mlflow.db": GIVEN}),
    Bad("sweep-eleven-trials", ["sweep", "--trials", "11", "--work", "new/w"], ["--trials 11", "at most 10"]),
]


@pytest.mark.parametrize("case", BENCHMARK, ids=[c.id for c in BENCHMARK])
def test_benchmark(case, tmp_path, monkeypatch, capsys, mlflow_template):
    run_bad("benchmark.py", case, tmp_path, monkeypatch, capsys, given=mlflow_template.read_bytes())


def test_the_table_holds_twenty_cases_or_more():
    assert len(BENCHMARK) >= 20 and len({c.id for c in BENCHMARK}) == len(BENCHMARK)
