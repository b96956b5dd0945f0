"""NLVR2: each example's two pictures, and the attention of each drawn over its own picture."""

from __future__ import annotations

import base64
import json
import re

import numpy as np
import pytest
import torch

from xmodal.data.finetune.sets import open_finetune
from xmodal.examples.build import write_rendered
from xmodal.examples.finetune import FinetuneKind, evaluate
from xmodal.examples.run import Shown, choose_rows
from xmodal.models.lxmert.finetune import LxmertForNlvr2
from xmodal.models.lxmert.model import PRESETS, recording_cross_attention

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("output", ["sigmoid", "softmax"])
def test_nlvr2_examples_show_both_pictures_with_their_own_attention(stores, tmp_path, output):
    data = open_finetune(stores["nlvr2"])
    m = data.store.manifest
    torch.manual_seed(0)
    model = LxmertForNlvr2(PRESETS["tiny"].replace(vocab_size=m.vocab_size, visual_feat_dim=m.feat_dim,
                                                   x_layers=2), output=output).eval()
    rows = choose_rows(len(data.split("valid")), 6)
    examples = evaluate(model, data, "valid", rows, [])
    sp = data.split("valid")
    for e, row in zip(examples, rows.tolist(), strict=True):
        assert [p.img_id for p in e.pictures] == [str(x) for x in sp.img_ids[row]]
        assert e.attention.shape[:3] == (2, 2, 4)  # layers, pictures, heads
        assert {a for a, _ in e.top} == {"true", "false"} and sum(p for _, p in e.top) == pytest.approx(1)
        assert e.right == (e.gold[0][0] == e.pred)
        assert e.pred == e.top[0][0]

    # picture 1's weights are those of the statement over the second image (the pair is stacked
    # [img0, img1] per example along the batch, the model's own layout)
    e, row = examples[0], int(rows[0])
    images = data.images("valid")
    k = images.rows[row]  # (2,) the two images
    ids = torch.from_numpy(sp.input_ids[row:row + 1].astype(np.int64)).repeat(2, 1)
    with torch.no_grad(), recording_cross_attention(model.encoder) as found:
        model.encoder(ids, ids != 0, torch.from_numpy(images.features[k].astype(np.float32)),
                      torch.from_numpy(images.boxes[k]), torch.from_numpy(images.visual_mask[k]))
    t = len(e.tokens)
    want = torch.stack(found)[:, :, :, :t].numpy()  # (L, 2, H, T, N)
    np.testing.assert_allclose(e.attention, want, atol=1e-6)

    a = Shown("r", "run", "finetune", "nlvr2", "valid", str(data.path), examples, len(sp), [])
    rendered = FinetuneKind().render(a)
    write_rendered(rendered, tmp_path)
    index = (tmp_path / "index.html").read_text()
    data_doc = json.loads(re.search(r"<script type='application/json' id='xm-data'>(.*?)</script>", index).group(1))
    first = data_doc["items"][0]
    assert first["detail"].count("<div class='pic'>") == 2 and "picture 2 (" in first["detail"]
    assert [len(s["pics"]) for s in first["data"]["sides"]] == [2]
    weights = np.frombuffer(base64.b64decode(first["data"]["sides"][0]["att"]), "<f4")
    same = next(e for e in examples if e.id == first["id"])
    np.testing.assert_array_equal(weights.reshape(first["data"]["sides"][0]["shape"]), same.attention)
    assert "by sentence length" in index
    # one file per example, its two pictures side by side, named by its verdict and statement length
    files = sorted(p.name for p in (tmp_path / "pictures").iterdir())
    assert len(files) == 6 and all(re.fullmatch(r"\d{4}-(right|wrong)-\d+-\d*-?words\.png", f) for f in files), files
