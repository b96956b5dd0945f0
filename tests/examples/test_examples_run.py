"""The example pages of a real tiny fine-tuning run (the shared local Ray, MLflow in SQLite): logged into
the run at its end, built by jobs/examples.py (alone and against a run), the attention a page holds equal
to the model's own for that example, and the inputs refused before anything is written."""

from __future__ import annotations

import json
import re
import subprocess
import warnings

import numpy as np
import pytest
import torch

from xmodal import tracking
from xmodal.base import run_tags
from xmodal.cli.jobs import end_of_run_pages
from xmodal.config.experiment import load_config
from xmodal.examples import ExamplesError, make_examples
from xmodal.examples.build import EXAMPLES_TAG, TABLE_FILE
from xmodal.jobs.finetune_config import FinetuneConfig
from xmodal.runner import engine
from xmodal_testing import PYTHON, REPO

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


@pytest.fixture(scope="module")
def run(tmp_path_factory, ray_local):
    from xmodal.data.finetune.synthetic import build_synthetic_vqa
    from xmodal.data.lxmert.synthetic import build_synthetic_store
    from xmodal.data.options import SyntheticLxmertOptions
    from xmodal.jobs.finetune_job import FinetuneJob

    tmp = tmp_path_factory.mktemp("examples")
    images = build_synthetic_store(tmp / "images", SyntheticLxmertOptions(
        num_images=64, num_objects=8, feat_dim=16, num_object_labels=10, num_attr_labels=4, num_answers=20))
    vqa = build_synthetic_vqa(images.path, tmp / "vqa", questions_per_image=2)
    uri = f"sqlite:///{tmp / 'mlflow.db'}"
    result = engine.run(FinetuneJob(), load_config(FinetuneConfig, overrides=[
        f"data.store={vqa.path}", "init.source=scratch", "preset=tiny", f"mlflow.tracking_uri={uri}",
        f"scale.storage_path={tmp / 'runs'}", "mlflow.run_name=vqa", "train.epochs=1", "train.batch_size=16",
        "mlflow.system_metrics=false", "examples.count=6"]), after_run=end_of_run_pages)
    return tmp, uri, result.run_id, vqa


def pages_in(folder):
    return sorted(p.name for p in folder.glob("example-*.html"))


def test_a_finetuning_run_logs_its_example_pages(run):
    tmp, uri, run_id, _ = run
    listed = tracking.list_artifacts(uri, run_id, "examples")
    names = {n.split("/")[-1] for n in listed}
    assert {"index.html", "img", "examples_table.json"} <= names
    assert len([n for n in names if re.fullmatch(r"example-\d{4}\.html", n)]) == 6
    r = tracking.get_run(uri, run_id)
    assert r.status == "FINISHED" and r.tags[EXAMPLES_TAG] == "examples/index.html"
    assert "examples/index.html" in r.tags[run_tags.NOTE] and "6 valid examples" in r.tags[run_tags.NOTE]
    assert r.metrics["time/end_of_run_s"] > 0
    parts = [r.metrics[f"time/examples/{p}_s"] for p in ("model", "predict", "pages", "log")]
    assert all(p > 0 for p in parts) and sum(parts) <= r.metrics["time/end_of_run_s"]
    table = json.loads(tracking.download_artifacts(uri, run_id, TABLE_FILE, tmp / "table").read_text())
    assert table["columns"][:5] == ["example_id", "question", "answers", "prediction", "right"]
    assert len(table["data"]) == 6
    folder = tracking.download_artifacts(uri, run_id, "examples", tmp / "logged")
    index = (folder / "index.html").read_text()
    assert all(f"href='{p}'" in index for p in pages_in(folder))
    for row in table["data"]:
        assert (folder / row[-1].removeprefix("examples/")).is_file()  # the picture beside the pages


def test_the_attention_a_page_holds_is_the_models_own(run, tmp_path):
    """The weights in example 0's page equal the model's attention probabilities for that example, read
    through the same hook on a forward pass over inputs built apart (the set's in-memory path)."""
    from xmodal.data.finetune.sets import open_finetune
    from xmodal.export.source import from_run
    from xmodal.models.lxmert import recording_cross_attention

    _, uri, run_id, vqa = run
    built = make_examples(uri, run_id, "valid", 5, out=tmp_path / "pages")
    assert pages_in(built.out) == [f"example-{i:04d}.html" for i in range(5)]
    page = (built.out / "example-0000.html").read_text()
    shown = json.loads(re.search(r"<script type='application/json' id='att-A'>(.*?)</script>", page).group(1))
    e = built.a.examples[0]
    data = open_finetune(vqa.path)
    row = data.ids("valid").index(e.id)
    images, sp = data.images("valid"), data.split("valid")
    k = images.rows[row]
    model = from_run(uri, run_id, tmp_path / "dl").model
    ids = torch.from_numpy(sp.input_ids[row:row + 1].astype(np.int64))
    with torch.no_grad(), recording_cross_attention(model.encoder) as found:
        model(ids, ids != 0, torch.from_numpy(images.features[k:k + 1].astype(np.float32)),
              torch.from_numpy(images.boxes[k:k + 1]), torch.from_numpy(images.visual_mask[k:k + 1]))
    t = len(shown["tokens"])
    want = torch.stack(found)[:, 0, :, :t].numpy()  # (L, H, T, N)
    got = np.array(shown["att"])[:, 0]  # (L, H, T, N) of the page's one picture
    np.testing.assert_allclose(got, want, atol=1e-6)
    np.testing.assert_allclose(np.array(shown["avg"])[:, 0], want.mean(axis=1), atol=1e-6)
    assert shown["tokens"][0] == "[CLS]" and shown["tokens"][-1] == "[SEP]"


def test_two_runs_side_by_side_add_up(run, tmp_path):
    _, uri, run_id, _ = run
    out = tmp_path / "cmp"
    proc = subprocess.run([PYTHON, str(REPO / "jobs/examples.py"), "--run-id", run_id, "--compare", run_id,
                           "--examples", "7", "--tracking-uri", uri, "--out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert len(pages_in(out)) == 7
    index = (out / "index.html").read_text()
    counts = re.search(r"both right (\d+), only A (\d+), only B (\d+), both wrong (\d+): (\d+) examples", index)
    both, only_a, only_b, wrong, total = map(int, counts.groups())
    assert (only_a, only_b, total) == (0, 0, 7) and both + wrong == 7  # a run against itself agrees everywhere
    assert "McNemar's test (exact binomial): p = 1" in index
    assert "id='att-B'" in (out / "example-0000.html").read_text()


def test_bad_runs_and_splits_are_refused_before_anything_is_written(run, tmp_path):
    _, uri, run_id, vqa = run
    exp = tracking.ensure_experiment(uri, "other")
    # a run whose recorded data digest is not the set's now: the set was ingested again since
    moved = tracking.create_run(uri, exp, "m", {}, {run_tags.TASK: "finetune-vqa", run_tags.FINETUNE_SET: str(vqa.path),
                                                     run_tags.REPRO_DATA_MANIFEST: "0" * 16})
    other = tracking.create_run(uri, exp, "r", {}, {run_tags.TASK: "retrieval"})
    gqa = tracking.create_run(uri, exp, "g", {}, {run_tags.TASK: "finetune-gqa"})
    out = tmp_path / "never"
    cases = [
        (dict(run_id=other), "--run-id: run '" + other + "' is a 'retrieval' run; expected a fine-tuning run"),
        (dict(run_id=run_id, split="train"), "--split train: run '" + run_id + "' did not evaluate it"),
        (dict(run_id=run_id, split="test"), "--split test"),
        (dict(run_id=run_id, compare_run=gqa), "two runs of one task"),
        (dict(run_id=run_id, n=0), "--examples 0"),
        (dict(run_id=moved), f"is not the data run '{moved}' read: its manifest's digest is "),
    ]
    for kwargs, said in cases:
        args = {"split": None, "n": 4, **kwargs}
        with pytest.raises(ExamplesError, match=re.escape(said)):
            make_examples(uri, args["run_id"], args["split"], args["n"], args.get("compare_run"), out)
        assert not out.exists() and not list(tmp_path.glob(".never*"))


def test_the_pages_cost_benchmark(run, tmp_path):
    """jobs/benchmark.py examples on the run: the evaluation and the pages of each count measured, the
    passes the run made counted, a row per count in the table."""
    from xmodal_bench import main

    _, uri, run_id, _ = run
    assert main(["examples", "--run-id", run_id, "--tracking-uri", uri, "--examples", "2", "4", "--repeats", "1", "--threads", "1",
                 "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")]) == 0
    res = json.loads(next((tmp_path / "out").glob("examples-*.json")).read_text())
    # evaluations logged under valid/accuracy, the held-out pass, two robustness conditions (the defaults)
    logged = len(tracking.metric_history(uri, run_id, "valid/accuracy"))
    assert res["passes"] == logged + 1 + 2 and logged >= 1
    assert res["eval_pass_s"] > 0 and res["evaluation_s"] == pytest.approx(res["eval_pass_s"] * res["passes"])
    assert [p["examples"] for p in res["pages"]] == [2, 4]
    assert res["evaluation_cpu_s"] == pytest.approx(res["eval_pass_cpu_s"] * res["passes"]) and res["meta"]["threads"] == 1
    for p in res["pages"]:
        assert p["predict_s"] > 0 and p["draw_s"] > 0 and p["pages_cpu_s"] > 0
        assert p["pages_share"] == pytest.approx(p["pages_s"] / res["evaluation_s"])
        assert p["pages_cpu_share"] == pytest.approx(p["pages_cpu_s"] / res["evaluation_cpu_s"])
    table = next((tmp_path / "out").glob("examples-*.md")).read_text()
    assert "| pages for 2 examples" in table and "| pages for 4 examples" in table
    assert not (tmp_path / "work").exists()  # the scratch, and the --work folder made for it, removed


def test_a_pretraining_run_logs_its_qa_head_s_pages(tiny_store, tmp_path, ray_local):
    """The QA head of a pretraining run: questions of the store's minival split, their gold answers from
    the store, pages logged at the run's end; jobs/examples.py makes them again, and refuses another split."""
    from xmodal.jobs.pretrain_config import PretrainConfig
    from xmodal.jobs.pretrain_job import PretrainJob

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    result = engine.run(PretrainJob(), load_config(PretrainConfig, overrides=[
        f"data.store={tiny_store}", "preset=tiny", "train.batch_size=16", "train.epochs=1",
        f"scale.storage_path={tmp_path / 'runs'}", f"mlflow.tracking_uri={uri}", "mlflow.system_metrics=false",
        "examples.count=5"]), after_run=end_of_run_pages)
    listed = {n.split("/")[-1] for n in tracking.list_artifacts(uri, result.run_id, "examples")}
    assert len([n for n in listed if re.fullmatch(r"example-\d{4}\.html", n)]) == 5 and "index.html" in listed

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a job's console takes no library warning (tests/runner/test_interrupt.py)
        built = make_examples(uri, result.run_id, None, 4, out=tmp_path / "pages")
    assert built.a.split == "minival" and len(built.a.examples) == 4
    for e in built.a.examples:
        assert e.gold and e.text.endswith("?") and len(e.top) == 5
        assert e.attention.shape[:2] == (1, 1) and e.pictures[0].kind == "synthetic"
    index = (built.out / "index.html").read_text()
    assert "pretrain examples of run" in index and "accuracy by question type" in index
    with pytest.raises(ExamplesError, match="--split valid: pretraining run .* evaluated on minival"):
        make_examples(uri, result.run_id, "valid", 4, out=tmp_path / "never")
    assert not (tmp_path / "never").exists()
