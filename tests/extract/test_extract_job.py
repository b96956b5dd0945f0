"""jobs/extract.py end to end: real image files, the tiny detector with random weights, a real local Ray.
Most tests call its `main` in this process on the session's Ray; two extractions are shared by the tests
that read what they wrote (`folder_run`, `extracted`); the process as a user starts it (its own Ray,
Ctrl-C, SIGTERM, the rerun) is one test."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from contextlib import redirect_stderr, redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

cv2 = pytest.importorskip("cv2")

from xmodal.cli.extract import main  # noqa: E402
from xmodal.data.lxmert.feature_writer import ingest_features  # noqa: E402
from xmodal.data.lxmert.features import image_sources, open_features  # noqa: E402
from xmodal.models.butd.detector import DetectorConfig, random_detector  # noqa: E402
from xmodal.models.butd.weights import save_in_layout  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
AUTO_BATCH = ["--random-weights", "--tiny", "--no-progress"]  # the batch size chosen for the device
TINY = [*AUTO_BATCH, "--batch-size", "2"]


def _images(folder: Path, n: int = 4, seed: int = 0, width: int = 56) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    for i in range(n):
        p = folder / f"COCO_val2014_{i:012d}.jpg"
        cv2.imwrite(str(p), rng.integers(0, 255, (40 + 8 * i, width, 3), dtype=np.uint8))
        paths.append(p)
    return paths


def _rows(store) -> dict[str, dict]:
    """img_id -> its row (numpy values), whatever the shard order."""
    out = {}
    for f in store.image_files():
        t = store.read_table(f)
        cols = {c: (t.column(c).combine_chunks().to_numpy_ndarray()
                    if isinstance(t.column(c).type, pa.FixedShapeTensorType) else t.column(c).to_numpy(zero_copy_only=False))
                for c in t.column_names}
        for i, img_id in enumerate(cols["img_id"]):
            out[str(img_id)] = {c: v[i] for c, v in cols.items()}
    return out


def _run(*argv, capsys=None) -> tuple[int, str, str]:
    rc = main([str(a) for a in argv])
    out, err = capsys.readouterr() if capsys else ("", "")
    return rc, out, err


@pytest.fixture
def images(tmp_path):
    return _images(tmp_path / "imgs")


@dataclass
class Extraction:
    tmp: Path  # IMAGES is tmp/imgs, OUT tmp/store
    images: list[Path]  # the JPEGs
    store: Path
    stdout: str


@pytest.fixture(scope="module")
def folder_run(tmp_path_factory, ray_local, keep_console) -> Extraction:
    """One extraction of a folder, read by the tests of what it wrote and by the S3 test as the local
    store: four JPEGs, a grey PNG in a subfolder and a text file (not an image: not listed); the tiny
    detector, the default boxes (36) and the batch size chosen for the device."""
    tmp = tmp_path_factory.mktemp("folder")
    images = _images(tmp / "imgs")
    (tmp / "imgs" / "sub").mkdir()
    cv2.imwrite(str(tmp / "imgs" / "sub" / "grey.PNG"), np.full((30, 20), 90, np.uint8))
    (tmp / "imgs" / "notes.txt").write_text("not an image: not listed")
    out, err = io.StringIO(), io.StringIO()
    with keep_console(), redirect_stdout(out), redirect_stderr(err):
        rc = main([str(tmp / "imgs"), str(tmp / "store"), *AUTO_BATCH])
    assert rc == 0, err.getvalue()
    return Extraction(tmp, images, tmp / "store", out.getvalue())


@pytest.mark.slow
def test_folder_to_store_and_every_line_says_random(folder_run):
    tmp, images = folder_run.tmp, folder_run.images
    store = open_features(folder_run.store)
    m = store.manifest
    assert m.source == "extract" and m.images == 5 and m.num_objects == 36  # notes.txt not listed
    assert m.options["random_weights"] == {"tiny": True, "seed": 0} and "RANDOM WEIGHTS" in m.options["warning"]
    rows = _rows(store)
    assert set(rows) == {p.stem for p in images} | {"grey"}
    r = rows["grey"]
    assert (r["img_h"], r["img_w"]) == (30, 20) and 1 <= r["num_boxes"] <= 36  # a tiny image has few proposals
    assert any(x["num_boxes"] == 36 for x in rows.values())
    assert (0 <= r["boxes"]).all() and (r["boxes"] <= 1).all()
    # where each image came from: relative to IMAGES in the rows, absolute through image_sources
    assert r["source"] == "sub/grey.PNG" and m.options["images_root"] == str((tmp / "imgs").resolve())
    assert image_sources(store) == {**{p.stem: str(p.resolve()) for p in images},
                                    "grey": str((tmp / "imgs" / "sub" / "grey.PNG").resolve())}
    from xmodal.examples.pictures import store_sources

    assert store_sources(store) == image_sources(store)  # what the example pages draw the pictures from
    lines = [x for x in folder_run.stdout.splitlines() if x.strip()]
    assert lines and all("RANDOM WEIGHTS" in x for x in lines), lines
    assert any("extracted 5 images" in x and "rejected 0" in x for x in lines)
    # no --batch-size: chosen for the device, and said so (a CPU actor: 4)
    assert any("batch 4 (chosen for the device)" in x for x in lines), lines
    assert not any(p.name.startswith(".") for p in tmp.iterdir())  # the work folder is gone


@pytest.mark.slow
def test_rejects_listed_and_max_rejected(ray_local, tmp_path, capsys):
    # two readable images are enough: what is tested is that the failed run kept them and the rerun skips them
    good = _images(tmp_path / "imgs", 2)
    (tmp_path / "imgs" / "empty.jpg").write_bytes(b"")
    data = good[0].read_bytes()
    (tmp_path / "imgs" / "cut.jpg").write_bytes(data[: len(data) // 2])
    (tmp_path / "imgs" / "text.png").write_bytes(b"not a png at all")
    # too thin once scaled (0 x 1000, 1 x 1000): OpenCV's resize, then the backbone's pool, failed the run
    cv2.imwrite(str(tmp_path / "imgs" / "wide.png"), np.full((2, 4000, 3), 90, np.uint8))
    cv2.imwrite(str(tmp_path / "imgs" / "tall.jpg"), np.full((3000, 3, 3), 90, np.uint8))
    out = tmp_path / "store"
    rc, _, err = _run(tmp_path / "imgs", out, *TINY, "--max-rejected", "4", capsys=capsys)
    assert rc == 2 and err.count("\n") == 1 and err.startswith("error: ") and "more than --max-rejected 4" in err
    assert "Traceback" not in err and not out.exists()
    rc, stdout, err = _run(tmp_path / "imgs", out, *TINY, "--max-rejected", "5", capsys=capsys)
    assert rc == 0, err
    assert open_features(out).manifest.images == 2 and open_features(out).manifest.options["rejected"] == 5
    assert set(_rows(open_features(out))) == {p.stem for p in good}
    rejects = [json.loads(x) for x in (out / "rejects.jsonl").read_text().splitlines()]
    why = {Path(r["path"]).name: r["reason"] for r in rejects}
    assert set(why) == {"empty.jpg", "cut.jpg", "text.png", "wide.png", "tall.jpg"}
    assert "empty file" in why["empty.jpg"] and "truncated JPEG" in why["cut.jpg"]
    assert "not an image" in why["text.png"]
    assert why["wide.png"].startswith("4000x2 pixels (width x height), scaled to 1000x0 for the detector")
    assert why["tall.jpg"].startswith("3x3000 pixels (width x height), scaled to 1x1000 for the detector")
    assert all("a side under 3 pixels leaves the backbone nothing" in why[n] for n in ("wide.png", "tall.jpg"))
    assert "rejected 5" in stdout and "skipped 2 already done" in stdout  # the failed run's images were kept


@pytest.mark.slow
def test_a_run_that_writes_nothing_leaves_no_work_folder(ray_local, tmp_path, capsys):
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "empty.jpg").write_bytes(b"")
    (tmp_path / "imgs" / "text.png").write_bytes(b"not a png at all")
    for boxes in ("36", "10-100"):  # the second run, with other options, is not refused for the first's folder
        rc, stdout, err = _run(tmp_path / "imgs", tmp_path / "store", *TINY, "--boxes", boxes, "--max-rejected", "100%",
                               capsys=capsys)
        assert rc == 2 and "every image was rejected (2; each listed above" in err, err
        assert "rejected " in stdout and "empty file" in stdout
        assert not (tmp_path / ".store.extract").exists() and not (tmp_path / "store").exists()


@pytest.mark.slow
def test_tsv_round_trip_equals_the_store(extracted, tmp_path, capsys):
    """The TSV of the same images and options as `extracted`'s store, ingested again: the same rows."""
    store, images = extracted
    tsv = tmp_path / "out" / "feats.tsv"
    rc, _, err = _run(images[0].parent, tsv, *TINY, "--boxes", "10-100", "--format", "tsv", capsys=capsys)
    assert rc == 0, err
    assert not any(p.name.startswith(".") for p in tsv.parent.iterdir())
    a = _rows(open_features(store))
    m = open_features(store).manifest
    assert m.num_objects == 100
    again = ingest_features(tmp_path / "again", [tsv], num_objects=100, progress=False)
    b = _rows(again)
    assert set(a) == set(b)
    for k in a:
        n = a[k]["num_boxes"]
        assert 10 <= n <= 100 and n == b[k]["num_boxes"]
        for c in ("img_h", "img_w", "obj_ids", "attr_ids"):
            assert np.array_equal(a[k][c], b[k][c]), c
        for c in ("features", "boxes", "obj_conf", "attr_conf"):
            np.testing.assert_allclose(a[k][c].astype(np.float32), b[k][c].astype(np.float32), rtol=2e-3, atol=1e-6,
                                       err_msg=c)


@pytest.mark.slow
def test_boxes_from(ray_local, tmp_path, images, capsys):
    boxes = {p.stem: [[0, 0, 10, 12], [5, 5, 50, 30], [1, 2, 3, 4]] for p in images}
    boxes[images[0].stem] = [[0, 0, 56, 40]]
    f = tmp_path / "boxes.json"
    f.write_text(json.dumps(boxes))
    out = tmp_path / "store"
    rc, _, err = _run(tmp_path / "imgs", out, *TINY, "--boxes-from", f, capsys=capsys)
    assert rc == 0, err
    store = open_features(out)
    rows = _rows(store)
    assert store.manifest.num_objects == 3
    r = rows[images[1].stem]
    assert r["num_boxes"] == 3
    np.testing.assert_allclose(r["boxes"][1], np.array([5, 5, 50, 30]) / [56, 48, 56, 48], rtol=1e-6)
    assert rows[images[0].stem]["num_boxes"] == 1
    boxes[images[2].stem] = [[0, 0, 57, 10]]  # the image is 56 wide
    f.write_text(json.dumps(boxes))
    rc, _, err = _run(tmp_path / "imgs", tmp_path / "store2", *TINY, "--boxes-from", f, capsys=capsys)
    assert rc == 2 and str(f) in err and repr(images[2].stem) in err and "box 0 = [0.0, 0.0, 57.0, 10.0]" in err
    assert not (tmp_path / "store2").exists()


def test_no_weights_names_the_three_public_files(tmp_path, capsys):
    _images(tmp_path / "imgs", 1)
    rc, _, err = _run(tmp_path / "imgs", tmp_path / "o", capsys=capsys)
    assert rc == 2
    for name in ("faster_rcnn_from_caffe_attr.pkl", "bua-caffe-frcn-r101-k36.pth", "pytorch_model.bin"):
        assert name in err


@pytest.mark.slow
def test_placement_refused_in_the_driver_before_work_starts(ray_local, tmp_path, images, capsys):
    """Checks that need the cluster (the tests' local Ray: 4 CPUs, no GPU), made once it is reached and
    before the pipeline starts: one error line, no work folder, no store."""
    import ray

    cpus = int(ray.cluster_resources()["CPU"])
    cases = {
        "too many actors": (["--actors", cpus + 1], f"--actors {cpus + 1}: the cluster has {cpus} CPU(s) and no GPU"),
        "a GPU share on a CPU cluster": (["--gpus-per-actor", "0.5"], "--gpus-per-actor 0.5: the cluster has no GPU"),
        # the reference ResNet-101 (random weights, not --tiny): about 1.7 GiB a 600 x 1000 image in fp32
        "a batch that cannot fit": (["--batch-size", 10**5], "--batch-size 100000: one detector call is estimated at"),
    }
    for name, (extra, msg) in cases.items():
        tiny = [] if name == "a batch that cannot fit" else ["--tiny"]
        rc, out, err = _run(tmp_path / "imgs", tmp_path / "store", "--random-weights", *tiny, "--no-progress", *extra,
                            capsys=capsys)
        assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1 and msg in err, (name, err)
        assert sorted(p.name for p in tmp_path.iterdir() if p.name != "mlflow.db") == ["imgs"], name


def sigint_as_in_a_terminal() -> None:
    """A child's SIGINT as a terminal's foreground job has it (Python's KeyboardInterrupt): a test run
    started in the background by a script has SIGINT ignored, its children inherit that, and Python
    then leaves it ignored (Ctrl-C would do nothing, the run would finish with exit 0)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _finished_shards(root: Path) -> int:
    """Shards a run has finished at the work's root (a local shard's temporary file is not one)."""
    shards = root / "images"
    return sum(p.name.startswith("part-") and p.suffix == ".parquet" for p in shards.iterdir()) if shards.is_dir() else 0


@pytest.mark.slow
def test_ctrl_c_then_sigterm_keep_the_work_and_the_rerun_finishes_quietly(tmp_path):
    """The real process, as a user starts it (its own local Ray), three times with the same command, one
    image a shard: stopped by Ctrl-C (SIGINT to the process group, as a terminal sends it) once it has
    finished a shard; stopped again, resuming, by SIGTERM (a batch system's stop; Ray's own handler in
    the driver would abort the process and lose the images held) once it has finished one more; then
    run to the end. Each stop: exit 130, one line saying how many images are kept, nothing at OUT. The
    last run keeps every shard written, also those whose record had not reached the driver yet, prints
    only the job's lines (not Ray's start line, not the core worker's C++ error about actor restarts, not
    Ray Data's warnings), and publishes each image once."""
    n = 12
    paths = _images(tmp_path / "imgs", n)
    out, root = tmp_path / "store", tmp_path / ".store.extract"
    cmd = [sys.executable, str(REPO / "jobs" / "extract.py"), str(tmp_path / "imgs"), str(out), *TINY,
           "--images-per-shard", "1", "--batch-size", "1"]
    env = {**os.environ, "PYTHONPATH": str(REPO / "platform")}
    env.pop("RAY_ADDRESS", None)
    kept = 0  # images the last stopped run said it kept
    for stop in (signal.SIGINT, signal.SIGTERM):
        before = _finished_shards(root)
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True, preexec_fn=sigint_as_in_a_terminal)
        deadline = time.monotonic() + 300  # a hang guard
        while time.monotonic() < deadline and proc.poll() is None and _finished_shards(root) <= before:
            time.sleep(0.2)
        assert proc.poll() is None, proc.communicate()
        os.killpg(proc.pid, stop)
        stdout, err = proc.communicate(timeout=300)
        assert proc.returncode == 130, (stop, stdout, err)
        last = [x for x in err.splitlines() if "stopped extracting" in x]
        assert len(last) == 1 and "RANDOM WEIGHTS" in last[0] and "rerun the same command" in last[0], err
        # no traceback, nor an ignored exception's (Ray Data's iterator closed before ray.shutdown)
        assert "Traceback" not in err and "Exception ignored" not in err, err
        assert not out.exists() and root.is_dir()
        if kept:  # the second run went on from what the first kept
            resumed = int(stdout.split(f"resuming {root}: ")[1].split()[0])
            assert kept <= resumed < n, stdout
        done = int(last[0].split("stopped extracting: ")[1].split()[0])
        assert kept < done < n, (stop, kept, done)
        kept = done
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    both = run.stdout + run.stderr
    for noise in ("Started a local Ray instance", "core_worker.cc", "max_restarts > 0", "concurrent tasks",
                  "override_num_blocks", "warnings.warn"):
        assert noise not in both, both
    assert run.stderr == "", run.stderr
    lines = run.stdout.splitlines()
    assert lines and all(x.startswith("[xmodal] RANDOM WEIGHTS: ") for x in lines), lines
    assert "wrote " in lines[-1]
    # the rerun keeps every shard that was written, also those whose record had not reached the driver yet
    skipped = int(run.stdout.split("skipped ")[1].split()[0])
    assert kept <= skipped < n and f"resuming {root}: {skipped} of {n}" in run.stdout
    store = open_features(out)
    ids = [i for f in store.image_files() for i in store.read_table(f).column("img_id").to_pylist()]
    assert store.manifest.images == n and sorted(ids) == sorted(p.stem for p in paths)  # each image once
    assert not root.exists()


@pytest.fixture(scope="module")
def extracted(tmp_path_factory, ray_local, keep_console):
    """One extraction shared by the tests of what is built over a store: four images, 10 to 100 boxes."""
    tmp = tmp_path_factory.mktemp("extracted")
    paths = _images(tmp / "imgs")
    with keep_console():
        assert main([str(tmp / "imgs"), str(tmp / "store"), *TINY, "--boxes", "10-100"]) == 0
    return tmp / "store", paths


@pytest.mark.slow
def test_ingest_takes_an_extracted_store_as_tsv(extracted, tmp_path, capsys):
    from xmodal.cli.ingest import main as ingest_main
    from xmodal.data.lxmert.store import open_store

    store, images = extracted
    a = _rows(open_features(store))
    # features --tsv STORE: the same rows
    assert ingest_main(["features", str(tmp_path / "copy"), "--tsv", str(store), "--num-objects", "100",
                        "--no-progress"]) == 0
    b = _rows(open_features(tmp_path / "copy"))
    assert set(a) == set(b)
    for k in a:
        for c in b[k]:
            assert np.array_equal(a[k][c], b[k][c]), c
    assert set(a[k]) - set(b[k]) == {"source"} and image_sources(tmp_path / "copy") == {}  # not carried
    # lxmert --tsv STORE --json sentences (seeded order: rows read by random access)
    sents = [{"img_id": k, "sentf": {"mscoco": [f"a picture number {i}", "two words"]}, "labelf": {}}
             for i, k in enumerate(sorted(a))]
    (tmp_path / "train.json").write_text(json.dumps(sents))
    assert ingest_main(["lxmert", str(tmp_path / "lx"), "--tsv", str(store), "--json", str(tmp_path / "train.json"),
                        "--num-objects", "100", "--vocab-size", "200", "--minival-fraction", "0.5",
                        "--no-progress"]) == 0
    lx = open_store(tmp_path / "lx")
    # the extraction's random weights are said on the console and recorded in both stores built from it
    assert "warning: RANDOM WEIGHTS: " + str(store) in capsys.readouterr().out
    assert lx.manifest.options["random_weights_inputs"] == [str(store)]
    assert open_features(tmp_path / "copy").manifest.options["random_weights_inputs"] == [str(store)]
    got = {}
    for split in ("train", "minival"):
        for f in lx.shard_paths(split):
            t = pq.read_table(f, columns=["img_id", "features", "num_boxes"])
            feats = t.column("features").combine_chunks().to_numpy_ndarray()
            for i, k in enumerate(t.column("img_id").to_pylist()):
                got[k] = feats[i]
    assert set(got) == set(a)
    for k in a:
        assert np.array_equal(got[k], a[k]["features"])
    # where each image came from, carried into the LXMERT store: what its example pages draw
    from xmodal.examples.pictures import store_sources

    assert image_sources(lx) == image_sources(store) == {p.stem: str(p.resolve()) for p in images}
    assert store_sources(lx) == image_sources(store)
    # a folder that is not a store is refused in one line
    (tmp_path / "notastore").mkdir()
    rc = ingest_main(["features", str(tmp_path / "x"), "--tsv", str(tmp_path / "notastore")])
    assert rc == 2 and "not a feature-only store" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.parametrize("size", [None, "150:250"])
def test_weights_file_gives_the_detectors_own_regions(ray_local, tmp_path, capsys, size):
    # A detector saved in the detectron2 port's layout, run by the job, gives what the same detector
    # gives on the images as cv2.imread reads them and the reference's OpenCV code prepares them: the
    # whole path (listing, decoding and preparing in Ray tasks, the weights' import in each actor,
    # batching, the store's packing) changes nothing but float16. With --input-size, the detector's
    # input config is that size's, in the decode tasks and the actors alike. The default's images are
    # wide (640 pixels), so that the longest side's cap sets their scale (1000 / 640: inputs of about
    # 60-100 x 1000 pixels, not the 600 x 840 a 40 x 56 image is scaled to); --input-size 150:250's are
    # the short side's (40-64 x 56).
    images = _images(tmp_path / "imgs", width=56 if size else 640)
    short, cap = map(int, (size or "600:1000").split(":"))
    det = random_detector(DetectorConfig.tiny().replace_in("input", scale=short, max_size=cap), seed=7)
    save_in_layout(det.state_dict(), "detectron2", tmp_path / "w.pkl")
    out = tmp_path / "store"
    rc, stdout, err = _run(tmp_path / "imgs", out, "--weights", tmp_path / "w.pkl", "--tiny", "--no-progress",
                           "--batch-size", "3", *(["--input-size", size] if size else []), capsys=capsys)
    assert rc == 0, err
    assert "RANDOM" not in stdout
    store = open_features(out)
    assert store.manifest.options["layout"] == "detectron2"
    assert store.manifest.options.get("input_size") == (None if size is None else [short, cap])
    rows = _rows(store)
    import torch

    from xmodal.extract.pipeline import prepare_blob
    from xmodal.models.butd.image import PreparedImage

    for p in images:
        im = cv2.imread(str(p), cv2.IMREAD_COLOR)
        blob, scale = prepare_blob(im, det.cfg.input)
        assert (max(blob.shape[:2]) == cap) if size is None else (min(blob.shape[:2]) == short)  # the side that sets it
        expected = det.extract([PreparedImage(torch.from_numpy(blob), scale, *im.shape[:2])])[0]
        r, k = rows[p.stem], expected.boxes.shape[0]
        assert r["num_boxes"] == k and (r["img_h"], r["img_w"]) == (expected.img_h, expected.img_w)
        assert np.array_equal(r["obj_ids"][:k], expected.obj_ids.numpy())
        assert np.array_equal(r["attr_ids"][:k], expected.attr_ids.numpy())
        scale = np.array([r["img_w"], r["img_h"]] * 2, np.float32)
        assert np.allclose(r["boxes"][:k] * scale, expected.boxes.numpy(), atol=1e-3)
        assert np.allclose(r["features"][:k].astype(np.float32), expected.features.numpy(), rtol=1e-3, atol=1e-3)


@pytest.mark.slow
def test_images_and_store_on_s3_give_the_store_of_local_ones(folder_run, s3, tmp_path, capsys):
    """IMAGES as `s3://bucket/prefix` (the tests' moto server; `folder_run`'s folder): listed recursively,
    read by the decode tasks where they are; OUT as `s3://bucket/prefix`: the shards written there by the
    write tasks, the manifest last; the same rows as the local folder's local store (`folder_run`, the
    same options); a prefix holding nothing is one error."""
    import uuid

    from xmodal_testing import S3_BUCKET

    uri = s3.upload(folder_run.tmp / "imgs", f"photos-{uuid.uuid4().hex[:8]}")
    remote = f"s3://{S3_BUCKET}/stores/{uuid.uuid4().hex[:8]}"
    rc, out, err = _run(uri, remote, *AUTO_BATCH, "--images-per-shard", "2", capsys=capsys)
    assert rc == 0, err
    assert f"wrote {remote}: 5 images" in out and not any(p.name.startswith(".") for p in tmp_path.iterdir())
    a, b = _rows(open_features(folder_run.store)), _rows(open_features(remote))
    assert set(a) == set(b) == {p.stem for p in folder_run.images} | {"grey"}  # notes.txt not listed
    for k in a:
        for c in a[k]:
            if c != "source":
                assert np.array_equal(a[k][c], b[k][c]), (k, c)
    assert b["grey"]["source"] == f"{uri}/sub/grey.PNG" and a["grey"]["source"] == "sub/grey.PNG"
    assert image_sources(remote) == {k: f"{uri}/{r['source']}" for k, r in a.items()}
    keys = [o["Key"] for o in s3.client().list_objects_v2(Bucket=S3_BUCKET, Prefix=remote.split("/", 3)[3])["Contents"]
            if not o["Key"].endswith("/")]  # (the empty folder markers pyarrow keeps are no objects of the store)
    shards = {f"{remote.split('/', 3)[3]}/{f}" for f in open_features(remote).image_files()}
    assert sorted(keys) == sorted({*shards, f"{remote.split('/', 3)[3]}/manifest.json"}) and len(shards) == 3
    empty = f"s3://{S3_BUCKET}/nothing-{uuid.uuid4().hex[:8]}"
    rc, _, err = _run(empty, tmp_path / "o", *TINY, capsys=capsys)
    assert rc == 2 and err.count("\n") == 1 and empty in err, err
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_a_write_task_lost_after_writing_leaves_one_shard(ray_local, tmp_path, capsys):
    """A write task that dies after its shard is written and before it returns (its node lost, its process
    killed) is run again by Ray and writes the same shard again: one shard a batch, each image once."""
    paths = _images(tmp_path / "imgs", 4)
    out = tmp_path / "store"
    marker = tmp_path / "lost-once"
    from xmodal.extract.job import extract
    from xmodal.extract.plan import ExtractOptions

    summary = extract(ExtractOptions(str(tmp_path / "imgs"), str(out), random_weights=True, tiny=True, progress=False,
                                     batch_size=2, images_per_shard=2, write_fault=str(marker)))
    assert marker.exists()  # a write task died after writing
    store = open_features(out)
    ids = [i for f in store.image_files() for i in store.read_table(f).column("img_id").to_pylist()]
    assert sorted(ids) == sorted(p.stem for p in paths)  # each image once
    assert len(list((out / "images").iterdir())) == len(store.image_files()) == 2 and summary.written == 4


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_images_to_a_fine_tuning_run_and_its_pages(extracted, tmp_path):
    """The README's path from a folder of images: extract (above), ingest questions over the store (the
    tokenizer from an LXMERT store of the same dims, as a pretraining store gives it), fine-tune, and the
    run's example pages drawn on the pictures themselves."""
    from PIL import Image

    from xmodal import tracking
    from xmodal.cli.ingest import main as ingest_main
    from xmodal.cli.training import end_of_run_pages
    from xmodal.config.experiment import load_config
    from xmodal.data.lxmert.synthetic import build_synthetic_store
    from xmodal.data.options import SyntheticLxmertOptions
    from xmodal.jobs.finetune_config import FinetuneConfig
    from xmodal.jobs.finetune_job import FinetuneJob
    from xmodal.runner import engine

    store, images = extracted
    m = open_features(store).manifest
    vocab = build_synthetic_store(tmp_path / "pretraining", SyntheticLxmertOptions(
        num_images=32, num_objects=m.num_objects, feat_dim=m.feat_dim, num_object_labels=40, num_attr_labels=8,
        num_answers=20))
    questions = [{"question_id": f"{p.stem}-{k}", "img_id": p.stem, "sent": sent, "label": {answer: 1.0}}
                 for p in images for k, (sent, answer) in enumerate((("what colour is it", "red"),
                                                                     ("how many boxes are there", "two")))]
    (tmp_path / "q.json").write_text(json.dumps(questions))
    assert ingest_main(["vqa", str(tmp_path / "vqa"), "--store", str(vocab.path), "--store", str(store),
                        "--train", str(tmp_path / "q.json"), "--valid", str(tmp_path / "q.json")]) == 0
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    result = engine.run(FinetuneJob(), load_config(FinetuneConfig, overrides=[
        f"data.store={tmp_path / 'vqa'}", "init.source=scratch", "preset=tiny", f"mlflow.tracking_uri={uri}",
        f"scale.storage_path={tmp_path / 'runs'}", "train.epochs=1", "train.batch_size=4",
        "mlflow.system_metrics=false", "examples.count=4", "robust.conditions=[]"]), after_run=end_of_run_pages)
    run = tracking.get_run(uri, result.run_id)
    assert run.status == "FINISHED" and "best_valid/accuracy" in run.metrics
    pages = tracking.download_artifacts(uri, result.run_id, "examples", tmp_path / "pages")
    text = (pages / "index.html").read_text()
    data = json.loads(text.split("<script type='application/json' id='xm-data'>")[1].split("</script>")[0])
    assert len(data["items"]) == 4
    pictures = sorted((pages / "pictures").iterdir())
    # drawn on the photographs (RGB), not on the blank canvas (a palette) a store without its images' sources gets
    assert len(pictures) == 4 and all(Image.open(p).mode == "RGB" for p in pictures)
