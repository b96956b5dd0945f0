"""Bad inputs of `jobs/extract.py` and `jobs/ingest.py features`, a table of them: each is one `error:` line
naming what is wrong, exit 2, before Ray starts, and the user's folder is byte for byte what it was
(a hash of every file's path and content before and after: nothing written, nothing removed). Among
them the cases that once lost data or gave a wrong result with exit 0: a TSV extraction to an OUT whose
unfinished store extraction it deleted, and a resume whose ids file had been corrected since, which
published rows with swapped features. The unfinished work those cases resume is made by the job's own
plan and write function, as an interrupted run leaves it."""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path

import numpy as np
import pytest

cv2 = pytest.importorskip("cv2")

from xmodal.cli.extract import main as extract_main  # noqa: E402
from xmodal.cli.extract import options, parser  # noqa: E402
from xmodal.cli.ingest import main as ingest_main  # noqa: E402
from xmodal.extract.plan import check  # noqa: E402
from xmodal.extract.write import ShardWrite, tsv_lines, write_batch  # noqa: E402
from xmodal.models.butd.detector import DetectorConfig, random_detector  # noqa: E402
from xmodal.models.butd.weights import save_in_layout  # noqa: E402

TINY = ["--random-weights", "--tiny", "--no-progress"]


def folder_hash(root: Path) -> str:
    """Every file and folder under `root`: its path, and a file's content."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(dirnames + filenames):
            p = Path(dirpath) / name
            h.update(str(p.relative_to(root)).encode() + b"\0")
            if p.is_file():
                h.update(p.read_bytes())
    return h.hexdigest()


def regions(n: int, k: int, width: int) -> dict[str, np.ndarray]:
    return {"img_h": np.full(n, 48), "img_w": np.full(n, 56), "num_boxes": np.full(n, 2),
            "features": np.ones((n, k, width), np.float32), "boxes": np.tile(np.float32([0, 0, 9, 9]), (n, k, 1)),
            "obj_ids": np.ones((n, k), np.int64), "obj_conf": np.full((n, k), 0.5, np.float32),
            "attr_ids": np.ones((n, k), np.int64), "attr_conf": np.full((n, k), 0.5, np.float32)}


def unfinished(argv: list) -> Path:
    """What a run of `argv` interrupted after its first shard leaves: its plan's writer started, one shard of
    its first two images written by the write tasks' own function. Returns the work's root."""
    plan = check(options(parser().parse_args([str(a) for a in argv])))
    plan.writer.start()
    refs = plan.todo[:2]
    batch = {"img_id": np.array([r.img_id for r in refs], dtype=object),
             "path": np.array([r.path for r in refs], dtype=object),
             "source": np.array([plan.sources[r.img_id] for r in refs], dtype=object),
             "size": np.array([plan.stats[r.path][0] for r in refs]), "mtime": np.array([plan.stats[r.path][1] for r in refs]),
             "reject": np.array(["", ""], dtype=object), "reject_kind": np.array(["", ""], dtype=object),
             **regions(2, plan.spec.num_objects, plan.spec.cfg.feature_dim)}
    write_batch(batch, ShardWrite(plan.writer.sink(plan.row_group_images), plan.fmt))
    return Path(str(plan.writer.root))


def tsv_file(path: Path, ids: list[str], cut: bool = False) -> Path:
    r = {"img_id": np.array(ids, dtype=object), **regions(len(ids), 2, 8)}
    text = "".join(tsv_lines(r))
    path.write_text(text[: len(text) - 40] if cut else text)
    return path


@pytest.fixture
def user(tmp_path) -> Path:
    """The user's folder: images (two of them named by an ids file), weights, boxes, stores and work."""
    imgs = tmp_path / "imgs"
    imgs.mkdir()
    for i, name in enumerate(("a.jpg", "b.jpg", "c.jpg")):
        cv2.imwrite(str(imgs / name), np.full((48, 56, 3), 40 * i, np.uint8))
    (tmp_path / "ids.tsv").write_text("a.jpg\timg73\nb.jpg\timg42\nc.jpg\timg7\n")
    (tmp_path / "weights.bin").write_bytes(b"not weights")
    save_in_layout(random_detector(DetectorConfig.tiny()).state_dict(), "detectron2", tmp_path / "tiny.pkl")
    (tmp_path / "empty").mkdir()
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "x").write_text("mine")
    (tmp_path / "outside.json").write_text(json.dumps({"a": [[0, 0, 56, 40]], "b": [[0, 0, 5, 5], [0, 0, 57, 10]],
                                                       "c": [[1, 1, 2, 2]]}))
    (tmp_path / "dup").mkdir()
    for n in ("a.jpg", "a.png"):
        cv2.imwrite(str(tmp_path / "dup" / n), np.zeros((8, 8, 3), np.uint8))
    (tmp_path / "stray.json").write_text(json.dumps({"a.jpg": "a", "zzz.jpg": "z"}))
    (tmp_path / "twice.json").write_text('{"a.jpg": "A", "a.jpg": "B"}')
    (tmp_path / "both.json").write_text(json.dumps({"a.jpg": "A", str(imgs / "a.jpg"): "B"}))
    (tmp_path / "list.txt").write_text("imgs/a.jpg\nimgs/gone.jpg\n")
    (tmp_path / "feats.tsv").write_text("written before\n")
    tsv_file(tmp_path / "ref.tsv", ["x", "y"])
    tsv_file(tmp_path / "cut.tsv", ["x", "y"], cut=True)
    return tmp_path


def cases(u: Path) -> dict[str, tuple[list, str]]:
    imgs, o = u / "imgs", u / "o"
    return {
        "no weights": ([imgs, o], "--weights FILE is required: the detector's public weights are one of airsplay"),
        "missing weights": ([imgs, o, "--weights", u / "nope.pkl"], f"--weights {u / 'nope.pkl'}: does not exist"),
        "not weights": ([imgs, o, "--weights", u / "weights.bin"], "weights.bin"),
        "weights of another size": ([imgs, o, "--weights", u / "tiny.pkl"],
                                    "tiny.pkl: missing key for our 'backbone.res2.1.conv1.weight'"),
        "layout with random weights": ([imgs, o, *TINY, "--layout", "milvlg"], "--layout: random weights have no layout"),
        "no images": ([u / "nothing", o, *TINY], f"IMAGES {u / 'nothing'}: does not exist"),
        "empty folder": ([u / "empty", o, *TINY], "holds no image"),
        "a list file's missing image": ([u / "list.txt", o, *TINY], f"{u / 'list.txt'}:2: image 'imgs/gone.jpg' does not exist"),
        "duplicate ids": ([u / "dup", o, *TINY], "img_id 'a' is given to two images"),
        "ids not strings": ([imgs, o, *TINY, "--ids", u / "outside.json"], "entry 'a': expected an img_id string"),
        "ids naming no image": ([imgs, o, *TINY, "--ids", u / "stray.json"], "1 entry names no image of IMAGES, e.g. "
                                "'zzz.jpg'"),
        "ids giving a path twice": ([imgs, o, *TINY, "--ids", u / "twice.json"], f"--ids {u / 'twice.json'}: path "
                                    "'a.jpg' is given twice (ids 'A' and 'B')"),
        "ids naming an image twice": ([imgs, o, *TINY, "--ids", u / "both.json"], f"image {imgs / 'a.jpg'} is given two "
                                      f"ids by two entries: 'a.jpg' -> 'A' and '{imgs / 'a.jpg'}' -> 'B'"),
        "bad boxes": ([imgs, o, *TINY, "--boxes", "50-10"], "--boxes '50-10': expected 1 <= MIN <= MAX <= 1000"),
        "boxes and boxes-from": ([imgs, o, *TINY, "--boxes", "36", "--boxes-from", u / "b.json"], "give one"),
        "missing boxes file": ([imgs, o, *TINY, "--boxes-from", u / "b.json"], "b.json: does not exist"),
        "box outside its image": ([imgs, o, *TINY, "--boxes-from", u / "outside.json"],
                                  f"outside.json: img_id 'b' ({imgs / 'b.jpg'}): box 1 = [0.0, 0.0, 57.0, 10.0] is not "
                                  "inside the 56x48 image"),
        "bad max-rejected": ([imgs, o, *TINY, "--max-rejected", "-1"], "--max-rejected '-1': expected a number"),
        "input size not SHORT:MAX": ([imgs, o, *TINY, "--input-size", "600x1000"], "--input-size '600x1000': expected"),
        "input size short above max": ([imgs, o, *TINY, "--input-size", "800:600"], "--input-size '800:600'"),
        "no images a shard": ([imgs, o, *TINY, "--images-per-shard", "0"], "--images-per-shard 0: expected >= 1"),
        "a GPU share above one": ([imgs, o, *TINY, "--gpus-per-actor", "2"], "--gpus-per-actor 2: expected a share"),
        "OUT not a store": ([imgs, u / "taken", *TINY], f"{u / 'taken'}: already exists and is not a store"),
        "OUT a half URI": ([imgs, "s3:/bucket/store", *TINY], "'s3:/bucket/store' looks like a URI with a slash missing"),
        "TSV OUT a URI": ([imgs, "s3://bucket/f.tsv", *TINY, "--format", "tsv"], "is a URI; extract writes a local file"),
        "TSV OUT exists": ([imgs, u / "feats.tsv", *TINY, "--format", "tsv"], "feats.tsv' already exists; choose a new"),
        "TSV OUT a folder": ([imgs, u / "taken", *TINY, "--format", "tsv"], "is a folder; expected a file name"),
        "ingest: missing TSV": (["features", u / "f", "--tsv", u / "no.tsv", "--no-progress"], f"{u / 'no.tsv'}: input file does not exist"),
        "ingest: a folder not a store": (["features", u / "f", "--tsv", u / "taken", "--no-progress"], "is a directory but not a "
                                         "feature-only store"),
        "ingest: OUT not a store": (["features", u / "taken", "--tsv", u / "ref.tsv", "--no-progress"], "already exists and is not a store"),
        "ingest: a cut line": (["features", u / "f", "--tsv", u / "cut.tsv", "--no-progress"],
                               f"{u / 'cut.tsv'}:2 (img_id 'y'): field 'features'"),
        "ingest: no slots": (["features", u / "f", "--tsv", u / "ref.tsv", "--num-objects", "0", "--no-progress"],
                             "--num-objects 0: expected >= 1"),
        "ingest: OUT a half URI": (["features", "s3:/b/f", "--tsv", u / "ref.tsv", "--no-progress"], "looks like a URI with a slash"),
    }


def refused(argv: list, expected: str, root: Path, capsys) -> str:
    """Run the command; assert one error line holding `expected`, exit 2, no Ray, `root` unchanged."""
    import ray

    before, ray_before = folder_hash(root), ray.is_initialized()
    argv = [str(a) for a in argv]
    rc = ingest_main(argv) if argv[0] == "features" else extract_main(argv)
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1 and expected in err, (argv, err)
    assert "Traceback" not in err and (ray_before or not ray.is_initialized())
    assert folder_hash(root) == before, argv
    if "--random-weights" in argv:
        assert "RANDOM WEIGHTS" in err
    return err


def test_bad_inputs_one_line_nothing_written(user, capsys):
    table = cases(user)
    assert len(table) >= 20
    for argv, expected in table.values():
        refused(argv, expected, user, capsys)


def test_work_and_stores_of_other_runs_are_kept_and_named(user, capsys):
    """What an earlier run left is refused by name and left as it was: its unfinished work when the options
    or the format differ (a TSV run once deleted a store run's work), when the ids file was corrected since
    (a resume once published rows with swapped features), when an image changed; a finished store of
    other options; a store of another kind even with --overwrite."""
    imgs, o = user / "imgs", user / "o"
    work = unfinished([imgs, o, *TINY, "--ids", user / "ids.tsv"])
    assert work == user / ".o.extract" and len(list((work / "images").iterdir())) == 1
    (user / "ids.tsv").write_text("a.jpg\timg42\nb.jpg\timg73\nc.jpg\timg7\n")  # the ids corrected
    err = refused([imgs, o, *TINY, "--ids", user / "ids.tsv"], f"{work}: part-img42-", user, capsys)
    assert f"holds img_id 'img42' extracted from {imgs / 'b.jpg'}; IMAGES now gives that id to {imgs / 'a.jpg'}" in err
    assert "is kept; rerun it with the images (and --ids) it was made from, or pass --restart" in err
    (user / "ids.tsv").write_text("a.jpg\timg73\nb.jpg\timg42\nc.jpg\timg7\n")
    os.utime(imgs / "b.jpg", ns=(1, 10**18))  # an image edited since
    err = refused([imgs, o, *TINY, "--ids", user / "ids.tsv"], "holds img_id 'img42' extracted from", user, capsys)
    assert "; it was modified at 2001-09-09T01:46:40+00:00 since" in err
    err = refused([imgs, o, *TINY, "--ids", user / "ids.tsv", "--boxes", "10-100"],
                  f"{work}: an unfinished features output made with other options is kept there (1 shard(s); boxes: "
                  "built with [36, 36], asked for [10, 100]; num_objects: built with 36, asked for 100", user, capsys)
    assert "rerun it with its options to finish it, or pass --restart to discard it and start over" in err
    refused([imgs, o, *TINY, "--ids", user / "ids.tsv", "--format", "tsv"],
            f"{work}: an unfinished features output made with other options is kept there (1 shard(s); format: built "
            "with \"store\", asked for \"tsv\"", user, capsys)
    (work / "writing.json").unlink()
    refused([imgs, o, *TINY, "--restart"], f"{work}: holds no record of an unfinished store", user, capsys)
    # a finished store at OUT (of other options, or of another kind): --overwrite, and only of its kind
    from xmodal.data.lxmert.feature_writer import ingest_features

    ingest_features(user / "store", [user / "ref.tsv"], num_objects=2, progress=False)
    refused([imgs, user / "store", *TINY], f"{user / 'store'}: already exists; pass --overwrite", user, capsys)
    (user / "mult").mkdir()
    (user / "mult" / "manifest.json").write_text(json.dumps({"kind": "mult", "schema_version": 1}))
    refused([imgs, user / "mult", *TINY, "--overwrite"], f"{user / 'mult'}: holds a MulT store (kind 'mult'); refusing "
            "to replace it with a feature-only image store (kind 'features') even with --overwrite", user, capsys)
    refused(["features", user / "mult", "--tsv", user / "ref.tsv", "--overwrite", "--no-progress"], "holds a MulT store", user, capsys)


def test_s3_outputs_refused_before_any_work(user, s3, capsys, monkeypatch):
    """OUT on S3 that cannot be written: one line naming the URI before any work, nothing written there."""
    from xmodal_testing import S3_BUCKET

    prefix = f"s3://{S3_BUCKET}/stores/{uuid.uuid4().hex[:8]}"
    s3.put(f"{prefix.split('/', 3)[3]}/notes.txt", b"someone else's")
    keys = sorted(o["Key"] for o in s3.client().list_objects_v2(Bucket=S3_BUCKET)["Contents"])
    imgs = user / "imgs"
    for argv, expected in {
        "no such bucket": ([imgs, "s3://no-such-bucket-xm/store", *TINY], "OUT s3://no-such-bucket-xm/store: cannot be "
                                                                         "written"),
        "a prefix of other objects": ([imgs, prefix, *TINY], f"OUT {prefix}: holds 'notes.txt', which is not part of a "
                                                            "store"),
        "ingest to no such bucket": (["features", "s3://no-such-bucket-xm/f", "--tsv", user / "ref.tsv", "--no-progress"],
                                     "output folder s3://no-such-bucket-xm/f: cannot be written"),
    }.values():
        refused(argv, expected, user, capsys)
    assert sorted(o["Key"] for o in s3.client().list_objects_v2(Bucket=S3_BUCKET)["Contents"]) == keys
