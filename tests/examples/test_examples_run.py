"""The example pages of a real tiny fine-tuning run (tests/runs_testing.py: the shared local Ray, a real
`mlflow server`) and of a pretraining run's QA head (MLflow in SQLite): logged into the run at its end (the index, the pictures named so the artifact tree reads, MLflow's table with a picture
column, the summary line and the address in the UI), built by jobs/examples.py (alone and against a run:
the console's 2x2 and p equal the page's, the comparison logged into run B, the same command again
replacing its own output), the attention a page holds equal to the model's own, and 20+ bad inputs of
jobs/examples.py and its benchmark refused with one line, nothing written and the user's folder unchanged."""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import re
import tempfile
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from xmodal import tracking
from xmodal.base import run_tags
from xmodal.examples import ExamplesError, make_examples
from xmodal.examples.build import EXAMPLES_TAG, INDEX, TABLE_FILE
from xmodal_testing import REPO

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

STEM = r"\d{4}-(right|wrong)-[a-z0-9-]+\.png"


@pytest.fixture
def run(vqa_run):
    """The session's VQA run (tests/runs_testing.py: a real `mlflow server`, 6 example pages logged at its end)."""
    return vqa_run.tmp, vqa_run.uri, vqa_run.run_id, vqa_run.data


def cli():
    """jobs/examples.py's `main`, in this process (its argv -> exit code)."""
    spec = importlib.util.spec_from_file_location("examples_cli", REPO / "jobs" / "examples.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def index_data(folder: Path) -> dict:
    text = (folder / "index.html").read_text()
    return json.loads(re.search(r"<script type='application/json' id='xm-data'>(.*?)</script>", text).group(1))


def test_a_finetuning_run_logs_its_example_pages(run):
    tmp, uri, run_id, _ = run
    names = {n.split("/")[-1] for n in tracking.list_artifacts(uri, run_id, "examples")}
    assert names == {"index.html", "pictures", "examples_table.json"}
    pictures = [n.split("/")[-1] for n in tracking.list_artifacts(uri, run_id, "examples/pictures")]
    assert len(pictures) == 6 and all(re.fullmatch(STEM, p) for p in pictures), pictures
    r = tracking.get_run(uri, run_id)
    right = int(re.search(r"6 valid examples, (\d+) right", r.tags[run_tags.EXAMPLES_SUMMARY]).group(1))
    assert r.status == "FINISHED" and r.tags[EXAMPLES_TAG] == INDEX
    # the description links the MLflow UI's own address of the index (on the server), and the end summary
    # prints it (a SQLite store's, on `mlflow ui`'s address: the pretraining run's test below)
    address = f"{uri}/#/experiments/{r.experiment_id}/runs/{run_id}/artifacts/{INDEX}{tracking.TRAINING_VIEW_QUERY}"
    assert f"[{INDEX}]({address})" in r.tags[run_tags.NOTE]
    assert tracking.ui_command(uri, run_id).splitlines()[-1] == \
        f"  pages       6 valid examples, {right} right: {address}"
    assert sum(p.split("-")[1] == "right" for p in pictures) == right
    parts = [r.metrics[f"time/examples/{p}_s"] for p in ("model", "predict", "pages", "log")]
    assert all(p > 0 for p in parts) and sum(parts) <= r.metrics["time/end_of_run_s"]
    # MLflow's table: one row per example, the picture an image column (its evaluation view shows it)
    table = json.loads(tracking.download_artifacts(uri, run_id, TABLE_FILE, tmp / "table").read_text())
    cols = table["columns"]
    assert cols[:2] == ["example_id", "question"] and len(table["data"]) == 6
    cells = [row[cols.index("picture")] for row in table["data"]]
    assert all(c["type"] == "image" and c["filepath"].endswith(".png") for c in cells)
    assert sorted(row[cols.index("file")].split("/")[-1] for row in table["data"]) == sorted(pictures)
    assert sum(row[cols.index("right")] for row in table["data"]) == right
    folder = tracking.download_artifacts(uri, run_id, "examples", tmp / "logged")
    data = index_data(folder)
    assert [it["id"] for it in data["items"]] == [row[0] for row in table["data"]]
    assert sum(it["facets"]["verdict"] == "wrong" for it in data["items"]) == 6 - right


def test_the_attention_a_page_holds_is_the_models_own(run, tmp_path):
    """The weights in the page for its first example equal the model's attention probabilities for that
    example, read through the same hook on a forward pass over inputs built apart (the set's in-memory
    path)."""
    from xmodal.data.finetune.sets import open_finetune
    from xmodal.export.source import from_run
    from xmodal.models.lxmert.model import recording_cross_attention

    _, uri, run_id, vqa = run
    built = make_examples(uri, run_id, "valid", 5, out=tmp_path / "pages")
    assert len(list((built.out / "pictures").iterdir())) == 5
    item = index_data(built.out)["items"][0]
    side = item["data"]["sides"][0]
    shown = np.frombuffer(base64.b64decode(side["att"]), "<f4").reshape(side["shape"])
    e = next(x for x in built.a.examples if x.id == item["id"])
    data = open_finetune(vqa.path)
    row = data.ids("valid").index(e.id)
    images, sp = data.images("valid"), data.split("valid")
    k = images.rows[row]
    model = from_run(uri, run_id, tmp_path / "dl").model
    ids = torch.from_numpy(sp.input_ids[row:row + 1].astype(np.int64))
    with torch.no_grad(), recording_cross_attention(model.encoder) as found:
        model(ids, ids != 0, torch.from_numpy(images.features[k:k + 1].astype(np.float32)),
              torch.from_numpy(images.boxes[k:k + 1]), torch.from_numpy(images.visual_mask[k:k + 1]))
    t = len(item["data"]["tokens"])
    want = torch.stack(found)[:, 0, :, :t].numpy()  # (L, H, T, N)
    np.testing.assert_allclose(shown[:, 0], want, atol=1e-6)  # (L, H, T, N) of the page's one picture
    assert item["data"]["tokens"][0] == "[CLS]" and item["data"]["tokens"][-1] == "[SEP]"


def test_two_runs_side_by_side_logged_and_rerun(run, tmp_path, capsys, monkeypatch):
    """`--compare`: the console's 2x2 and p are the page's, the page is logged into run B with a line of its
    description, and the same command again replaces its own output (folder and MLflow) and succeeds."""
    _, uri, run_id, _ = run
    main = cli()
    out = tmp_path / "cmp"
    argv = ["--run-id", run_id, "--compare", run_id, "--examples", "7", "--tracking-uri", uri, "--out", str(out)]
    for _ in range(2):
        assert main(argv) == 0, capsys.readouterr().err
        said = capsys.readouterr().out
        counts = [int(x) for x in re.findall(r"A (?:right|wrong) +(\d+) +(\d+)", said)[0] +
                  re.findall(r"A (?:right|wrong) +(\d+) +(\d+)", said)[1]]
        p = float(re.search(r"p = ([0-9.e-]+)", said).group(1))
        page = json.loads(re.search(r"id='xm-comparison'>(.*?)</script>", (out / "index.html").read_text()).group(1))
        assert counts == [page["both_right"], page["only_a"], page["only_b"], page["both_wrong"]]
        assert sum(counts) == 7 and p == pytest.approx(page["p_value"], rel=1e-3)
        logged = re.search(r"in MLflow +(\S+)", said).group(1)
        where = logged.split("/artifacts/")[1].rsplit("/", 1)[0]
        assert where.startswith("examples/vs-vqa-")
        assert {a.split("/")[-1] for a in tracking.list_artifacts(uri, run_id, where)} == {"index.html",
                                                                                       "comparison.json"}
        note = tracking.get_run(uri, run_id).tags[run_tags.NOTE]
        assert note.count(f"[{where}/index.html]({logged})") == 1  # replaced, not added, the second time
    assert len(list((out / "pictures").iterdir())) == 7  # its own earlier output replaced, nothing added


def folder_hash(root: Path) -> str:
    """Every file and folder under `root`, with its bytes."""
    h = hashlib.sha256()
    for p in sorted(root.rglob("*")):
        h.update(str(p.relative_to(root)).encode())
        if p.is_file():
            h.update(p.read_bytes())
    return h.hexdigest()


def bad_runs(uri: str, run_id: str, tmp: Path, vqa) -> dict[str, str]:
    """Runs that jobs/examples.py must refuse, made in the run's store: their tags and params are what such
    runs record (a pretraining run trained without QA, a run of another task, one whose data changed since,
    one fine-tuned on a smaller set with the first run's model)."""
    from xmodal.data.finetune.synthetic import build_synthetic_vqa

    exp = tracking.ensure_experiment(uri, "bad-inputs")
    store = json.loads((Path(vqa.path) / "manifest.json").read_text())["store"]
    store = store["path"] if isinstance(store, dict) else store
    made = {
        "no_qa": tracking.create_run(uri, exp, "pre", {"tasks.qa": False}, {run_tags.TASK: "pretrain",
                                                                            run_tags.STORE: store}),
        "pretrain": tracking.create_run(uri, exp, "pre2", {"tasks.qa": True}, {run_tags.TASK: "pretrain",
                                                                               run_tags.STORE: store}),
        "retrieval": tracking.create_run(uri, exp, "r", {}, {run_tags.TASK: "retrieval"}),
        "untagged": tracking.create_run(uri, exp, "u", {}, {}),
        "gqa": tracking.create_run(uri, exp, "g", {}, {run_tags.TASK: "finetune-gqa"}),
        "moved": tracking.create_run(uri, exp, "m", {}, {run_tags.TASK: "finetune-vqa",
                                                         run_tags.FINETUNE_SET: str(vqa.path),
                                                         run_tags.REPRO_DATA_MANIFEST: "0" * 16}),
        "gone": tracking.create_run(uri, exp, "x", {}, {run_tags.TASK: "finetune-vqa",
                                                        run_tags.FINETUNE_SET: str(tmp / "no-such-set")}),
    }
    smaller = build_synthetic_vqa(store, tmp / "vqa-small", questions_per_image=1)
    made["smaller"] = tracking.create_run(uri, exp, "s", {}, {run_tags.TASK: "finetune-vqa",
                                                             run_tags.FINETUNE_SET: str(smaller.path)})
    model = tracking.download_artifacts(uri, run_id, "model", tmp / "model-copy")
    tracking.log_artifacts(uri, made["smaller"], model, "model")  # the first run's model, on the smaller set
    return made


def test_bad_inputs_are_refused_with_one_line_and_nothing_written(run, tmp_path, capsys, monkeypatch):
    from xmodal_bench import main as bench

    tmp, uri, run_id, vqa = run
    b = bad_runs(uri, run_id, tmp_path / "made", vqa)
    user = tmp_path / "user"  # the user's folder: the working folder, with files of theirs
    (user / "kept").mkdir(parents=True)
    (user / "kept" / "notes.txt").write_text("mine")
    (user / "a-file").write_text("mine too")
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    monkeypatch.chdir(user)
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    missing_db = f"sqlite:///{tmp_path / 'none' / 'mlflow.db'}"
    go = ["--run-id", run_id, "--tracking-uri", uri]
    cases = [
        (go + ["--examples", "0"], "--examples 0: expected a whole number of examples from 1 to 1000"),
        (go + ["--examples", "-3"], "--examples -3: expected a whole number"),
        (go + ["--examples", "1001"], "--examples 1001: expected a whole number"),
        (go + ["--examples", "many"], "argument --examples: invalid int value: 'many'"),
        (["--tracking-uri", uri], "the following arguments are required: --run-id"),
        (["--run-id", "nope", "--tracking-uri", uri], f"--run-id: no MLflow run 'nope' at {uri}"),
        (["--run-id", run_id, "--tracking-uri", missing_db], "there is no MLflow store at"),
        (["--run-id", run_id, "--tracking-uri", "bogus://x"], "tracking URI 'bogus://x': "),
        (["--run-id", b["retrieval"], "--tracking-uri", uri], "is a 'retrieval' run; expected a fine-tuning run"),
        (["--run-id", b["untagged"], "--tracking-uri", uri], "is a run without a task tag"),
        (go + ["--split", "train"], f"--split train: run '{run_id}' did not evaluate it (its set trains on it)"),
        (go + ["--split", "nosuch"], "--split nosuch: run"),
        (go + ["--compare", b["gqa"]], "expected two runs of one task"),
        (go + ["--compare", "nope"], "--compare: no MLflow run 'nope'"),
        (go + ["--compare", b["smaller"]], "which the first run shows; expected two runs whose examples are the same"),
        (["--run-id", b["no_qa"], "--tracking-uri", uri], "was trained without the QA task (tasks.qa=false)"),
        (["--run-id", b["pretrain"], "--tracking-uri", uri, "--split", "valid"],
         "--split valid: pretraining run"),
        (["--run-id", b["moved"], "--tracking-uri", uri], "is not the data run"),
        (["--run-id", b["gone"], "--tracking-uri", uri], "the fine-tuning set of run"),
        (go + ["--out", "s3://bucket/prefix"], "--out: 's3://bucket/prefix' is a URI; jobs/examples.py writes a local"),
        (go + ["--out", "s3:/bucket/prefix"], "looks like a URI with a slash missing"),
        (go + ["--out", "a-file"], "is a file; expected a folder"),
        (go + ["--out", "a-file/pages"], "cannot be made"),
        (go + ["--log"], f"--log: run '{run_id}' already has example pages (examples/index.html)"),
        (["--run-id", b["pretrain"], "--tracking-uri", uri, "--log", "--compare", run_id], "expected one of --log or "
                                                                                          "--compare"),
        (go + ["--out", "kept"], "already holds 'notes.txt', which jobs/examples.py did not write there; choose a "
                                 "new or empty folder or pass --overwrite"),
    ]
    benched = ["examples", "--tracking-uri", uri, "--repeats", "1", "--out", "results", "--work", "work"]
    bench_cases = [
        (benched + ["--run-id", "nope"], "--run-id: no MLflow run 'nope'"),
        (benched + ["--run-id", run_id, "--examples", "0"], "--examples 0: expected a whole number"),
        (benched + ["--run-id", run_id, "--repeats", "0"], "--repeats 0: expected a number >= 1"),
        (benched + ["--run-id", b["pretrain"]], "this benchmark measures a fine-tuning run's pages"),
        (["examples", "--run-id", run_id, "--tracking-uri", uri, "--out", "a-file/results"], "cannot be made"),
        (["examples", "--run-id", run_id, "--tracking-uri", uri, "--work", "a-file"], "is a file"),
    ]
    main = cli()
    before = folder_hash(user)
    for runner, table in ((main, cases), (bench, bench_cases)):
        for argv, said in table:
            try:
                code = runner(argv)
            except SystemExit as e:  # argparse's own errors
                code = e.code
            err = capsys.readouterr().err
            lines = [x for x in err.splitlines() if x.startswith("error:") or ": error: " in x]
            assert code == 2 and len(lines) == 1 and said in lines[0], (argv, err)
            assert folder_hash(user) == before, argv  # nothing written, nothing of the user's changed
            assert list(scratch.iterdir()) == [], argv  # no scratch left behind
    assert len(cases) + len(bench_cases) >= 20


def test_the_pages_cost_benchmark(run, tmp_path):
    """jobs/benchmark.py examples on the run: the evaluation and the pages of each count measured, the
    passes the run made counted, a row per count in the table."""
    from xmodal_bench import main

    _, uri, run_id, _ = run
    assert main(["examples", "--run-id", run_id, "--tracking-uri", uri, "--examples", "2", "4", "--repeats", "1",
                 "--threads", "1", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")]) == 0
    res = json.loads(next((tmp_path / "out").glob("examples-*.json")).read_text())
    # evaluations logged under valid/accuracy, the held-out pass, two robustness conditions (the defaults)
    logged = len(tracking.metric_history(uri, run_id, "valid/accuracy"))
    assert res["passes"] == logged + 1 + 2 and logged >= 1
    assert res["eval_pass_s"] > 0 and res["evaluation_s"] == pytest.approx(res["eval_pass_s"] * res["passes"])
    assert [p["examples"] for p in res["pages"]] == [2, 4]
    assert res["evaluation_cpu_s"] == pytest.approx(res["eval_pass_cpu_s"] * res["passes"])
    assert res["meta"]["threads"] == 1
    for p in res["pages"]:
        assert p["predict_s"] > 0 and p["draw_s"] > 0 and p["pages_cpu_s"] > 0
        assert p["pages_share"] == pytest.approx(p["pages_s"] / res["evaluation_s"])
        assert p["pages_cpu_share"] == pytest.approx(p["pages_cpu_s"] / res["evaluation_cpu_s"])
    table = next((tmp_path / "out").glob("examples-*.md")).read_text()
    assert "| pages for 2 examples" in table and "| pages for 4 examples" in table
    assert not (tmp_path / "work").exists()  # the scratch, and the --work folder made for it, removed


def test_a_pretraining_run_logs_its_qa_head_s_pages(pretrain_run, tmp_path):
    """The QA head of a pretraining run (tests/runs_testing.py; MLflow in SQLite): questions of the store's
    minival split, their gold answers from the store, pages logged at the run's end and linked on `mlflow
    ui`'s address; jobs/examples.py makes them again, and refuses another split."""
    uri, run_id = pretrain_run.uri, pretrain_run.run_id
    listed = [n.split("/")[-1] for n in tracking.list_artifacts(uri, run_id, "examples/pictures")]
    assert len(listed) == 5 and all(re.fullmatch(STEM, n) for n in listed)
    r = tracking.get_run(uri, run_id)
    summary = r.tags[run_tags.EXAMPLES_SUMMARY]
    assert summary.startswith("5 minival examples")
    # a SQLite store's pages: on the address `mlflow ui` serves (the end summary says to start it)
    address = (f"http://127.0.0.1:5000/#/experiments/{r.experiment_id}/runs/{run_id}/artifacts/{INDEX}"
               f"{tracking.TRAINING_VIEW_QUERY}")
    assert f"[{INDEX}]({address})" in r.tags[run_tags.NOTE]
    assert tracking.ui_command(uri, run_id).splitlines()[-1] == f"  pages       {summary}: {address}"

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a job's console takes no library warning (tests/runner/test_interrupt.py)
        built = make_examples(uri, run_id, None, 4, out=tmp_path / "pages")
    assert built.a.split == "minival" and len(built.a.examples) == 4
    for e in built.a.examples:
        assert e.gold and e.text.endswith("?") and len(e.top) == 5 and e.loss > 0
        assert e.attention.shape[:2] == (1, 1) and e.pictures[0].kind == "synthetic"
    index = (built.out / "index.html").read_text()
    assert "pretrain examples of run" in index and "by question type" in index
    with pytest.raises(ExamplesError, match="--split valid: pretraining run .* evaluated on minival"):
        make_examples(uri, run_id, "valid", 4, out=tmp_path / "never")
    assert not (tmp_path / "never").exists()
