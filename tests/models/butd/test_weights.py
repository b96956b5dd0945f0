"""The weight-file adapter: each public layout round-trips, bad files are refused with one line, nothing runs.

The state dicts are those of a tiny random `Detector` (a few channels, five classes, three
attributes), so every file is a few hundred kilobytes.
"""

from __future__ import annotations

import builtins
import os
import pickle

import numpy as np
import pytest
import torch

from xmodal.models.butd.anchors import generate_anchors
from xmodal.models.butd.detector import DetectorConfig, random_detector
from xmodal.models.butd.weights import (
    CELL_ANCHORS,
    LAYOUTS,
    NUM_ANCHORS,
    WeightsError,
    canonical_names,
    detect_layout,
    load_detector,
    load_state_dict,
    read_vocab,
    save_in_layout,
)

PUBLIC = ("detectron2", "milvlg", "hf-frcnn")
SUFFIX = {"detectron2": ".pkl", "milvlg": ".pth", "hf-frcnn": ".bin", "xmodal": ".pt"}
BLOCKS = {"backbone.res2": 1, "backbone.res3": 1, "backbone.res4": 2, "head.res5": 1}


CFG = (DetectorConfig.tiny().replace_in("backbone", blocks=(1, 1, 2))
       .replace_in("roi_head", num_classes=5, num_attributes=3).replace_in("rpn", pre_nms_top_n=600, post_nms_top_n=30))


def canonical_state_dict(seed=0):
    """A random detector's state dict: stage outputs 32, 64, 128, 256; 5 classes; 3 attributes."""
    sd = {k: v.clone() for k, v in random_detector(CFG, seed).state_dict().items()}
    assert list(sd) == canonical_names(BLOCKS)
    return sd


def saved(tmp_path, layout, sd=None, name="weights"):
    path = tmp_path / (name + SUFFIX[layout])
    save_in_layout(canonical_state_dict() if sd is None else sd, layout, path)
    return path


def read_raw(path):
    """The file's flat {name: tensor or ndarray} and a function writing a changed one back the same way."""
    if path.suffix == ".pkl":
        with open(path, "rb") as f:
            data = pickle.load(f)

        def write(model):
            with open(path, "wb") as f:
                pickle.dump({"model": model, "__author__": "test"}, f)

        return data["model"], write
    return torch.load(path, weights_only=True), lambda model: torch.save(model, path)


def rpn_probs(weight, bias, x):
    """The reference's per-anchor foreground probability: softmax over each (background, foreground) pair."""
    logits = x @ weight.reshape(weight.shape[0], -1).T + bias  # (N, 2A)
    return torch.softmax(logits.reshape(-1, 2, NUM_ANCHORS), dim=1)[:, 1]  # (N, A)


@pytest.mark.parametrize("layout", [*PUBLIC, "xmodal"])
def test_round_trip_and_detection(tmp_path, layout):
    original = canonical_state_dict()
    path = saved(tmp_path, layout, original)
    assert detect_layout(path) == layout
    loaded = load_state_dict(path)
    assert list(loaded) == list(original)
    assert all(t.dtype == torch.float32 for t in loaded.values())
    changed = {"rpn.objectness.weight", "rpn.objectness.bias", "head.bbox_pred.weight", "head.bbox_pred.bias"}
    exact = original.keys() - changed if layout in ("detectron2", "hf-frcnn") else original.keys()
    for name in exact:
        assert torch.equal(loaded[name], original[name]), name
    if layout not in ("detectron2", "hf-frcnn"):
        return
    # One logit per anchor holds only foreground - background: the pair comes back as (0, fg - bg),
    # the same softmax up to float32 rounding of the difference.
    x = torch.randn(7, original["rpn.objectness.weight"].shape[1])
    want = rpn_probs(original["rpn.objectness.weight"], original["rpn.objectness.bias"], x)
    got = rpn_probs(loaded["rpn.objectness.weight"], loaded["rpn.objectness.bias"], x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert torch.equal(loaded["rpn.objectness.bias"][:NUM_ANCHORS], torch.zeros(NUM_ANCHORS))
    # Box deltas go through x (10, 10, 5, 5) and back, rounded to float32 each way: within a few ulps.
    # The background's 4 rows are not in detectron2's layout and come back as zeros.
    for key in ("head.bbox_pred.weight", "head.bbox_pred.bias"):
        torch.testing.assert_close(loaded[key][4:], original[key][4:], rtol=3e-7, atol=0)
        assert torch.equal(loaded[key][:4], torch.zeros_like(original[key][:4]))


@pytest.mark.parametrize("layout", [*PUBLIC, "xmodal"])
def test_loaded_detector_gives_the_original_regions(tmp_path, layout):
    original = random_detector(CFG.with_boxes((3, 5)), seed=1)
    path = saved(tmp_path, layout, original.state_dict())
    loaded = load_detector(path, cfg=CFG.with_boxes((3, 5)))
    image = torch.randint(0, 256, (40, 56, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    want, got = original.extract([image])[0], loaded.extract([image])[0]
    # The detectron2 family's RPN probability is sigmoid(fg - bg) instead of a softmax over the pair:
    # equal up to float32 rounding, which can reorder proposals only on exact ties (none here).
    for field in ("boxes", "features", "obj_ids", "obj_conf", "attr_ids", "attr_conf"):
        torch.testing.assert_close(getattr(got, field), getattr(want, field), rtol=1e-6, atol=1e-6, msg=field)
    if layout in ("milvlg", "xmodal"):
        assert all(torch.equal(getattr(got, f), getattr(want, f)) for f in ("boxes", "features", "obj_ids"))


def test_load_detector_refuses_another_config(tmp_path):
    path = saved(tmp_path, "milvlg")
    with pytest.raises(WeightsError, match=r"shape mismatch for our 'head\.cls_score\.weight': file \(6, 256\), model \(1601, 256\)"):
        load_detector(path, cfg=CFG.replace_in("roi_head", num_classes=1600))


def test_detectron2_orders_as_written(tmp_path):
    # Spot checks of the written file against the conventions it follows, independent of the reader.
    sd = canonical_state_dict()
    model, _ = read_raw(saved(tmp_path, "detectron2", sd))
    box = "roi_heads.box_predictor."
    assert np.array_equal(model[box + "cls_score.weight"][-1], sd["head.cls_score.weight"][0].numpy())  # background last
    assert np.array_equal(model[box + "attr_score.bias"][-1], sd["head.attr_score.bias"][0].numpy())  # no attribute last
    assert model[box + "bbox_pred.weight"].shape[0] == 4 * (sd["head.cls_score.weight"].shape[0] - 1)
    # detectron2's anchor 1 is size 64 ratio 1, the reference's anchor 4 (ratio 1, scale 4).
    fg = sd["rpn.objectness.bias"][NUM_ANCHORS:] - sd["rpn.objectness.bias"][:NUM_ANCHORS]
    assert model["proposal_generator.rpn_head.objectness_logits.bias"][1] == fg[4].item()
    deltas = model["proposal_generator.rpn_head.anchor_deltas.bias"]
    assert np.array_equal(deltas[4:8], sd["rpn.deltas.bias"][16:20].numpy())


def test_hf_anchor_buffer_decides_the_order(tmp_path):
    # A file whose anchors (and their channels) are in the reference's ratio-major order loads the same.
    original = canonical_state_dict()
    path = saved(tmp_path, "hf-frcnn", original)
    model, write = read_raw(path)
    rpn = "proposal_generator.rpn_head."
    size_major = [s * 3 + r for r in range(3) for s in range(4)]  # reference index k -> detectron2 index
    model[CELL_ANCHORS] = generate_anchors().float()
    model[rpn + "objectness_logits.bias"] = model[rpn + "objectness_logits.bias"][size_major]
    model[rpn + "objectness_logits.weight"] = model[rpn + "objectness_logits.weight"][size_major]
    w = model[rpn + "anchor_deltas.weight"]
    model[rpn + "anchor_deltas.weight"] = w.reshape(NUM_ANCHORS, 4, *w.shape[1:])[size_major].reshape(w.shape)
    b = model[rpn + "anchor_deltas.bias"]
    model[rpn + "anchor_deltas.bias"] = b.reshape(NUM_ANCHORS, 4)[size_major].reshape(-1)
    write(model)
    loaded = load_state_dict(path)
    assert torch.equal(loaded["rpn.deltas.weight"], original["rpn.deltas.weight"])
    assert torch.equal(loaded["rpn.deltas.bias"], original["rpn.deltas.bias"])


def test_anchor_buffer_of_other_anchors_is_refused(tmp_path):
    path = saved(tmp_path, "hf-frcnn")
    model, write = read_raw(path)
    model[CELL_ANCHORS] = torch.tensor([[-8.0, -24.0, 8.0, 24.0]] * NUM_ANCHORS)  # ratio 3
    write(model)
    with pytest.raises(WeightsError, match=r"aspect ratio 3\.000"):
        load_state_dict(path)
    del model[CELL_ANCHORS]
    write(model)
    with pytest.raises(WeightsError, match=f"missing key '{CELL_ANCHORS}'"):
        load_state_dict(path)


@pytest.mark.parametrize("layout", PUBLIC)
def test_missing_extra_and_misshaped_keys_are_named(tmp_path, layout):
    path = saved(tmp_path, layout)
    model, write = read_raw(path)
    pristine = dict(model)

    del model["backbone.res3.0.conv2.weight"]
    write(model)
    with pytest.raises(WeightsError, match=r"missing key 'backbone\.res3\.0\.conv2\.weight' \(for our 'backbone\.res3\.0\.conv2\.weight'\)") as e:
        load_state_dict(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)

    model = dict(pristine, **{"roi_heads.box_predictor.extra.weight": pristine["backbone.stem.conv1.weight"]})
    write(model)
    with pytest.raises(WeightsError, match=r"unused key 'roi_heads\.box_predictor\.extra\.weight'"):
        load_state_dict(path)

    model = dict(pristine)
    model["roi_heads.res5.0.conv3.norm.running_var"] = model["roi_heads.res5.0.conv3.norm.running_var"][:-1]
    write(model)
    with pytest.raises(WeightsError, match=r"shape mismatch for our 'head\.res5\.0\.bn3\.running_var': \(255,\)"):
        load_state_dict(path)


def test_shapes_against_the_model(tmp_path):
    sd = canonical_state_dict()
    path = saved(tmp_path, "milvlg", sd)
    expected = {k: v.shape for k, v in sd.items()}
    assert load_state_dict(path, expected=expected).keys() == sd.keys()
    expected["head.fc_attr.weight"] = torch.Size((16, 99))
    with pytest.raises(WeightsError, match=r"'head\.fc_attr\.weight': file \(16, 264\), model \(16, 99\)"):
        load_state_dict(path, expected=expected)
    with pytest.raises(WeightsError, match=r"missing key for our 'head\.extra'"):
        load_state_dict(path, expected={**sd, "head.extra": torch.zeros(1)})


def test_layout_names(tmp_path):
    assert set(LAYOUTS) == {"detectron2", "milvlg", "hf-frcnn", "xmodal"}
    path = saved(tmp_path, "milvlg")
    with pytest.raises(WeightsError, match=r"unknown layout 'caffe'; valid: 'auto', 'detectron2', 'milvlg'"):
        load_state_dict(path, layout="caffe")
    with pytest.raises(WeightsError, match=r"holds the 'milvlg' layout, not 'hf-frcnn'"):
        load_state_dict(path, layout="hf-frcnn")
    unknown = tmp_path / "other.pth"
    torch.save({"encoder.weight": torch.zeros(2)}, unknown)
    with pytest.raises(WeightsError, match=r"unknown layout \(torch file, 1 keys: encoder\.weight.*expected one of"):
        detect_layout(unknown)


class RunsACommand:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


class Evaluates:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (builtins.eval, (f"open({str(self.marker)!r}, 'w').close()",))


@pytest.mark.parametrize("payload", [RunsACommand, Evaluates])
def test_malicious_pickle_is_refused_before_anything_runs(tmp_path, payload):
    marker = tmp_path / "ran"
    path = tmp_path / "faster_rcnn_from_caffe_attr.pkl"
    with open(path, "wb") as f:
        pickle.dump({"model": {"backbone.stem.conv1.weight": payload(marker)}, "__author__": "x"}, f)
    with pytest.raises(WeightsError, match=r"refused: the pickle loads the global (posix|os|nt|builtins)\.(system|eval)") as e:
        load_state_dict(path)
    assert str(path) in str(e.value)
    with pytest.raises(WeightsError):
        detect_layout(path)
    assert not marker.exists()


@pytest.mark.parametrize("name", ["bua-caffe-frcn-r101-k36.pth", "pytorch_model.bin"])
def test_malicious_torch_file_is_refused_before_anything_runs(tmp_path, name):
    marker = tmp_path / "ran"
    path = tmp_path / name
    torch.save({"backbone.stem.conv1.weight": RunsACommand(marker)}, path)
    with pytest.raises(WeightsError, match=r"refused by torch\.load\(weights_only=True\)") as e:
        load_state_dict(path)
    assert str(path) in str(e.value) and "\n" not in str(e.value)
    assert not marker.exists()


def test_vocabulary(tmp_path):
    path = tmp_path / "objects_vocab.txt"
    path.write_text("yolk\nt-shirt,tshirt,tee shirt\nstreet sign\n")
    assert read_vocab(path, 3) == ["yolk", "t-shirt,tshirt,tee shirt", "street sign"]
    with pytest.raises(WeightsError, match=r"objects_vocab\.txt: 3 names, expected 1600"):
        read_vocab(path, 1600)
    path.write_text("yolk\n\nstreet sign\n")
    with pytest.raises(WeightsError, match=r"3 names \(1 empty\), expected 3"):
        read_vocab(path, 3)
