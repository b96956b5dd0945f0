"""MulT's example pages from a real tiny run (the shared local Ray, MLflow in SQLite): per clip the
prediction against its label and the crossmodal attention over time, the attention equal to the
model's own for that clip, the errors counted by label bin."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from xmodal.config.experiment import load_config
from xmodal.examples import ExamplesError, make_examples
from xmodal.jobs.mult_config import MultTrainConfig
from xmodal.runner import engine

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def test_mult_pages(stores, tmp_path, ray_local):
    from xmodal.data.mult.store import open_store
    from xmodal.export.source import from_run
    from xmodal.jobs.mult_job import MultJob
    from xmodal.models.mult import recording_crossmodal_attention

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    result = engine.run(MultJob(), load_config(MultTrainConfig, overrides=[
        f"data.store={stores['mult']}", "preset=tiny", "train.epochs=1", "train.batch_size=16",
        f"scale.storage_path={tmp_path / 'runs'}", f"mlflow.tracking_uri={uri}", "mlflow.system_metrics=false"]))
    built = make_examples(uri, result.run_id, None, 6, out=tmp_path / "pages")
    clips = built.mult
    assert built.a.split == "test" and len(clips) == 6
    assert sorted(p.name for p in built.out.glob("example-*.html")) == [f"example-{i:04d}.html" for i in range(6)]
    model = from_run(uri, result.run_id, tmp_path / "dl").model
    directions = [f"{s}->{t}" for s, t in model.directions]
    page = (built.out / "example-0000.html").read_text()
    assert page.count("<figure>") == len(directions) * model.config.layers
    assert f"label <b>{clips[0].label:+.3f}</b>" in page

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

    index = (built.out / "index.html").read_text()
    counts = [int(x) for x in re.findall(r"<tr><td>[+-]\d</td><td>(\d+)</td>", index)]
    assert sum(counts) == 6
    with pytest.raises(ExamplesError, match="--split train: run .* did not evaluate it"):
        make_examples(uri, result.run_id, "train", 3, out=tmp_path / "never")
    with pytest.raises(ExamplesError, match="--compare"):
        make_examples(uri, result.run_id, None, 3, compare_run=result.run_id, out=tmp_path / "never")
    assert not (tmp_path / "never").exists()
