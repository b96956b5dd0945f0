"""scripts/reference/recipes.py without the reference checkouts: its input checks (one `error:` line, exit
2, nothing written) and the targets it holds a training to (`recipes_compare.verdict`)."""

from __future__ import annotations

import importlib.util
import math
import sys

import pytest

from xmodal_testing import REPO

SCRIPT = REPO / "scripts" / "reference" / "recipes.py"
sys.path.insert(0, str(SCRIPT.parent))
from recipes_compare import Row, verdict  # noqa: E402

_spec = importlib.util.spec_from_file_location("reference_recipes", SCRIPT)
recipes = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(recipes)


def _checkout(root, kind: str):
    files = {"lxmert": ["src/lxrt/optimization.py", "src/lxrt/modeling.py", "src/lxrt/entry.py", "src/tasks/vqa.py",
                        "src/tasks/vqa_model.py", "src/param.py", "src/pretrain/lxmert_pretrain.py",
                        "src/pretrain/lxmert_data.py"],
             "mult": ["main.py", "src/train.py", "src/models.py", "modules/transformer.py"]}[kind]
    for f in files:
        (root / kind / f).parent.mkdir(parents=True, exist_ok=True)
        (root / kind / f).write_text("")
    return root / kind


@pytest.mark.parametrize(("args", "named"), [
    (["--trainings", "vqa"], ["--lxmert", "required", "airsplay/lxmert"]),
    (["--lxmert", "NOPE", "--trainings", "vqa"], ["--lxmert", "'NOPE'", "does not exist"]),
    (["--lxmert", "afile", "--trainings", "pretrain"], ["--lxmert", "'afile'", "not a folder"]),
    (["--lxmert", "empty", "--trainings", "vqa"], ["--lxmert", "not a checkout", "src/lxrt/optimization.py"]),
    (["--mult", "lxmert", "--trainings", "mult"], ["--mult", "not a checkout", "main.py"]),
    (["--lxmert", "lxmert", "--mult", "mult", "--steps", "-3"], ["--steps -3", "at least 50"]),
    (["--lxmert", "lxmert", "--steps", "many"], ["--steps", "invalid int value", "'many'"]),
    (["--lxmert", "lxmert", "--epochs", "3"], ["unrecognized arguments", "--epochs"]),
    (["--lxmert", "lxmert", "--mult", "mult", "--steps", "49"], ["--steps 49", "at least 50"]),
    (["--mult", "mult", "--trainings", "mult", "--mult-patience", "-1"], ["--mult-patience -1", ">= 0"]),
    (["--lxmert", "lxmert", "--trainings", "vqa,bert"], ["--trainings", "'vqa,bert'", "vqa, pretrain, mult"]),
    (["--lxmert", "lxmert", "--trainings", "vqa", "--dtypes", "float16"], ["--dtypes", "'float16'", "float64"]),
    (["--lxmert", "lxmert", "--trainings", "vqa", "--out", "kept.json"], ["--out", "kept.json'", "already exists"]),
])
def test_bad_input_is_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys, args, named):
    _checkout(tmp_path, "lxmert")
    _checkout(tmp_path, "mult")
    (tmp_path / "empty").mkdir()
    (tmp_path / "afile").write_text("x")
    (tmp_path / "kept.json").write_text("mine")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    monkeypatch.chdir(tmp_path)
    code = recipes.main(args)  # the checks come before anything runs or imports torch
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert all(n in lines[0] for n in named), lines[0]
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert (tmp_path / "kept.json").read_text() == "mine"


def _rows(loss: float, params: float, floor: float | None = None, n: int = 50) -> list[Row]:
    return [Row(i + 1, 2.0, 2.0 * (1 + loss), 1e-3, 1e-3, params, None if floor is None else 2.0 * (1 + floor),
                None if floor is None else floor) for i in range(n)]


def test_the_targets():
    def passed(training, dtype, rows, extra=lambda r: []):
        return verdict(training, dtype, rows, 50, extra).passed

    assert passed("vqa", "float64", _rows(5e-10, 5e-10))
    assert not passed("vqa", "float64", _rows(2e-9, 0.0))  # float64: below 1e-9
    assert not passed("vqa", "float64", _rows(0.0, 2e-9))
    assert not passed("vqa", "float64", _rows(0.0, 0.0, n=49))  # at least 50 steps
    assert passed("mult", "float32", _rows(9e-7, 9e-7, floor=1e-7))  # within 10x the floor
    assert not passed("mult", "float32", _rows(2e-6, 0.0, floor=1e-7))
    assert not passed("vqa", "float32", _rows(2e-6, 0.0, floor=1e-6))  # LXMERT: the loss below 1e-6 too
    assert not passed("mult", "float64", _rows(0.0, 0.0), extra=lambda r: ["no plateau drop"])
    rows = _rows(0.0, 0.0)
    rows[3].ref_loss = math.nan  # a batch without a target: the reference's loss is NaN, not compared
    v = verdict("pretrain", "float64", rows, 50, lambda r: [])
    assert v.passed and "steps [4]" in v.notes[0]
