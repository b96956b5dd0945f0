"""MulT's example pages from a real tiny run (the session's, tests/runs_testing.py: the shared local Ray,
MLflow in SQLite): per clip the
prediction against its label and the crossmodal attention over time, the attention equal to the model's
own for that clip, the errors counted by label bin; a run against itself (the comparison of MulT runs)."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch

from xmodal import tracking
from xmodal.base import run_tags
from xmodal.examples import ExamplesError, make_examples
from xmodal.examples.build import TABLE_FILE

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def test_mult_pages(stores, tmp_path, mult_run):
    from xmodal.data.mult.store import open_store
    from xmodal.export.source import from_run
    from xmodal.models.mult.model import recording_crossmodal_attention

    uri, result = mult_run.uri, mult_run.result
    built = make_examples(uri, result.run_id, None, 6, out=tmp_path / "pages", log=True)
    clips = built.a.examples
    assert built.a.split == "test" and len(clips) == 6
    files = sorted(p.name for p in (built.out / "pictures").iterdir())
    assert len(files) == 6 and all(re.fullmatch(r"\d{4}-(right|wrong)-label-(pos|neg)?\d\.png", f) for f in files), files
    model = from_run(uri, result.run_id, tmp_path / "dl").model
    directions = [f"{s}->{t}" for s, t in model.directions]
    index = (built.out / "index.html").read_text()
    items = json.loads(re.search(r"id='xm-data'>(.*?)</script>", index).group(1))["items"]
    # every layer's map of every direction, for every clip
    assert [it["detail"].count("<figure>") for it in items] == [len(directions) * model.config.layers] * 6
    first = next(it for it in items if it["id"] == clips[0].id)
    assert f"label <b>{clips[0].label:+.3f}</b>" in first["detail"]

    # the attention of clip 0 is the model's own, on a batch built apart from the whole split
    split = open_store(stores["mult"]).split("test")
    b = split.batch(np.array([clips[0].row]))
    with torch.no_grad(), recording_crossmodal_attention(model) as found:
        pred = model(b.text.float(), b.audio.float(), b.vision.float(),
                     (b.text_lengths, b.audio_lengths, b.vision_lengths)).output[0, 0]
    assert float(pred) == pytest.approx(clips[0].pred, abs=1e-5)
    assert clips[0].label == pytest.approx(float(split.labels[clips[0].row]))
    for d in directions:
        src, tgt = d.split("->")
        t, s = clips[0].lengths[tgt], clips[0].lengths[src]
        want = np.stack([found[(i, (src, tgt))][0, :, :t, :s].numpy() for i in range(model.config.layers)])
        np.testing.assert_allclose(clips[0].attention[d], want, atol=1e-6)

    counts = [int(x) for x in re.findall(r"<tr><td>[+-]?\d</td><td class=n>(\d+)</td>", index)]
    assert sum(counts) == 6
    # logged into the run as a run's end logs pages: MLflow's table with the maps as its image column
    table = json.loads(tracking.download_artifacts(uri, result.run_id, TABLE_FILE, tmp_path / "t").read_text())
    assert table["columns"][:2] == ["clip_id", "attention"] and len(table["data"]) == 6
    assert all(row[1]["type"] == "image" for row in table["data"])
    assert built.logged in tracking.get_run(uri, result.run_id).tags[run_tags.NOTE]
    assert tracking.ui_command(uri, result.run_id).endswith(built.logged)
    with pytest.raises(ExamplesError, match="--log: run .* already has example pages"):
        make_examples(uri, result.run_id, None, 3, out=tmp_path / "never", log=True)
    with pytest.raises(ExamplesError, match="--split train: run .* did not evaluate it"):
        make_examples(uri, result.run_id, "train", 3, out=tmp_path / "never")
    assert not (tmp_path / "never").exists()
    # two MulT runs side by side (here a run and itself): the 2x2 of the sign, the page in the run
    both = make_examples(uri, result.run_id, None, 4, compare_run=result.run_id, out=tmp_path / "cmp")
    c = both.comparison
    assert (c.only_a, c.only_b, c.total) == (0, 0, 4) and "sign right by label bin" in (both.out / "index.html").read_text()
    assert both.logged.endswith("/index.html?workflowType=machine_learning")
