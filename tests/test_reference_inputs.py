"""scripts/reference/extractor.py's bad inputs: each one `error:` line, exit code 2, nothing written, and the
user's files (a photos folder, a weights file, runs) the same bytes before and after, nothing left behind."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import cv2
import numpy as np
import pytest

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scripts.reference import common, extractor  # noqa: E402
from xmodal.base.outputs import RECORD  # noqa: E402

CHECKOUT_FILES = ("lib/fast_rcnn/test.py", "lib/rpn/proposal_layer.py", "experiments/cfgs/faster_rcnn_end2end_resnet.yml",
                  "models/vg/ResNet-101/faster_rcnn_end2end_final/test.prototxt")


def _run(folder: Path, images: list[str], command: str) -> Path:
    """A folder as `command` leaves it: one .npz per image (regions of 2 boxes) and its record."""
    folder.mkdir()
    for image in images:
        np.savez(folder / f"{image}.npz", boxes=np.zeros((2, 4), np.float32), features=np.zeros((2, 3), np.float32),
                 obj=np.zeros(2, np.int64), attr=np.zeros(2, np.int64), obj_conf=np.zeros(2, np.float32),
                 attr_conf=np.zeros(2, np.float32), scale=1.0, size=np.array([4, 4]))
    files = sorted(p.name for p in folder.iterdir())
    (folder / RECORD).write_text(json.dumps({"command": f"extractor.py {command}", "files": files}))
    return folder


@pytest.fixture(scope="module")
def place(tmp_path_factory) -> Path:
    """A user's files: photos (a JPEG, a broken JPEG in its own folder, notes), a weights file, runs."""
    tmp = tmp_path_factory.mktemp("reference_inputs")
    photos = tmp / "photos"
    photos.mkdir()
    ok, jpeg = cv2.imencode(".jpg", np.full((40, 60, 3), 90, np.uint8))
    (photos / "a.jpg").write_bytes(jpeg.tobytes())
    (photos / "notes.txt").write_text("the user's own notes\n")
    (tmp / "broken").mkdir()
    (tmp / "broken" / "cut.jpg").write_bytes(jpeg.tobytes()[:200])
    (tmp / "empty_folder").mkdir()
    (tmp / "weights.pkl").write_bytes(b"the user's weights, not to be overwritten" * 100)
    (tmp / "empty.pkl").write_bytes(b"")
    (tmp / "table.json").write_text("{}")
    (tmp / "not.tsv").write_bytes(b"\xff\xfe\x00binary")
    for name in CHECKOUT_FILES:  # the files a checkout must have (empty: the numpy check comes first)
        (tmp / "bua" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / "bua" / name).write_text("")
    (tmp / "extract_coco_image.py").write_text("def get_detections_from_im(net, im_file, image_id):\n    pass\n")
    (tmp / "other_script.py").write_text("print('not the script')\n")
    _run(tmp / "reference_run", ["a", "b"], "reference")
    _run(tmp / "ours_run", ["a", "b"], "ours")
    _run(tmp / "ours_one_image", ["a"], "ours")
    return tmp


def _tree(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


# (argv with {t} for the user's folder, text the one error line must hold)
CASES = [
    ("weights {t}/new.pkl --seed -1", "--seed -1: expected an integer in [0, 2147483647]"),
    ("weights {t}/new.pkl --logit-scale nan", "--logit-scale nan: expected a finite number in (0, 10000]"),
    ("weights {t}/new.pkl --logit-scale 0", "--logit-scale 0.0: expected a finite number in (0, 10000]"),
    ("weights {t}/new.pkl --rpn-size-bias inf", "--rpn-size-bias inf: expected a finite number in [-10, 10]"),
    ("weights {t}/weights.pkl", "weights.pkl' already exists"),  # the user's weights file: never overwritten
    ("weights {t}/photos", "photos' is a folder; expected a file name"),
    ("weights {t}/new.pkl --net resnet50", "invalid choice: 'resnet50'"),
    ("weights {t}/new.pkl --seed three", "invalid int value: 'three'"),
    ("photos {t}/photos", "already holds 'a.jpg' and 1 more, which extractor.py photos did not write"),
    ("photos {t}/weights.pkl", "weights.pkl' is a file; expected a folder"),
    ("ours --weights {t}/missing.pkl {t}/photos --out {t}/o", "--weights '{t}/missing.pkl': does not exist"),
    ("ours --weights {t}/photos {t}/photos --out {t}/o", "--weights '{t}/photos': is a folder"),
    ("ours --weights {t}/empty.pkl {t}/photos --out {t}/o", "--weights '{t}/empty.pkl': is empty (0 bytes)"),
    ("ours --weights {t}/weights.pkl {t}/photos --out {t}/o --limit -1", "--limit -1: expected an integer >= 0"),
    ("ours --weights {t}/weights.pkl {t}/photos --out {t}/o --batch-size 0", "--batch-size 0: expected an integer in [1, 64]"),
    ("ours --weights {t}/weights.pkl {t}/photos --out {t}/o --threads -2", "--threads -2: expected an integer in [0, 1024]"),
    ("ours --weights {t}/weights.pkl {t}/nowhere --out {t}/o", "IMAGES '{t}/nowhere': does not exist"),
    ("ours --weights {t}/weights.pkl {t}/empty_folder --out {t}/o", "holds no image"),
    ("ours --weights {t}/weights.pkl {t}/photos --out {t}/photos", "is the IMAGES folder"),
    ("ours --weights {t}/weights.pkl {t}/broken --out {t}/photos", "already holds 'a.jpg' and 1 more"),
    ("ours --weights {t}/weights.pkl {t}/photos --out {t}/table.json", "table.json' is a file; expected a folder"),
    ("ours --weights {t}/weights.pkl {t}/photos --out {t}/o", "weights.pkl: not a readable pickle"),
    ("ours {t}/photos --out {t}/o", "the following arguments are required: --weights"),
    ("reference --reference {t}/nowhere --lxmert-script {t}/extract_coco_image.py --weights {t}/weights.pkl "
     "{t}/photos --out {t}/o", "--reference '{t}/nowhere': does not exist"),
    ("reference --reference {t}/photos --lxmert-script {t}/extract_coco_image.py --weights {t}/weights.pkl "
     "{t}/photos --out {t}/o", "has no lib/fast_rcnn/test.py"),
    ("reference --reference {t}/bua --lxmert-script {t}/other_script.py --weights {t}/weights.pkl "
     "{t}/photos --out {t}/o", "defines no get_detections_from_im"),
    ("reference --reference {t}/bua --lxmert-script {t}/extract_coco_image.py --weights {t}/weights.pkl "
     "{t}/photos --out {t}/o", "the reference needs numpy 1.x"),
    ("compare {t}/reference_run", "give OURS (a run's folder) or --tsv"),
    ("compare {t}/nowhere {t}/ours_run", "REF '{t}/nowhere': does not exist"),
    ("compare {t}/photos {t}/ours_run", "holds no run of `extractor.py reference` or `extractor.py ours`"),
    ("compare {t}/ours_run {t}/reference_run", "the arguments are swapped"),
    ("compare {t}/reference_run {t}/ours_one_image", "OURS has no image 'b' that the other run has"),
    ("compare {t}/reference_run --tsv {t}/not.tsv", "is not text; expected an extraction's TSV"),
    ("compare {t}/reference_run {t}/ours_run --out {t}/table.json", "table.json' already exists"),
    ("keep {t}/reference_run --out {t}/weights.pkl", "weights.pkl' already exists"),
    ("keep {t}/nowhere --out {t}/kept.npz", "RUN '{t}/nowhere': does not exist"),
    ("nonsense", "invalid choice: 'nonsense'"),
]


@pytest.mark.parametrize("argv, expected", CASES, ids=[c[0].split()[0] + f"-{i}" for i, c in enumerate(CASES)])
def test_bad_input_is_one_error_line_and_nothing_changes(place, capsys, argv, expected):
    before = _tree(place)
    with pytest.raises(SystemExit) as stop:  # argparse's own errors exit; the checks return 2
        raise SystemExit(common.command(extractor.main, argv.format(t=place).split()))
    assert stop.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error:"), err
    assert expected.format(t=place) in err[0]
    assert _tree(place) == before  # nothing written, nothing removed, nothing left (no hidden stage either)


def test_a_failure_mid_run_leaves_nothing(place, capsys):
    """A run that fails after its staging began (an image the extraction rejects) publishes nothing."""
    weights = place.parent / "tiny.pkl"
    extractor.write_weights(weights, extractor.TINY, 0, 1.0, 0.0)
    before = _tree(place)
    code = common.command(extractor.main, f"ours --weights {weights} {place}/broken --out {place}/o".split())
    assert code == 2
    assert "cut.jpg: the extraction rejects it (truncated JPEG" in capsys.readouterr().err
    assert _tree(place) == before
