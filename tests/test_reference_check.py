"""scripts/reference/'s own parts, without the reference checkout: the prototxt reader, the stand-in
Caffe layers' semantics, the pruning of a net to the blocks its weights hold, and the mapping of a
detectron2 pickle onto Caffe's blobs, checked against the extractor's independent reading of the same file."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from xmodal.models.butd.detector import DetectorConfig, random_detector
from xmodal.models.butd.weights import load_state_dict, save_in_layout

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from scripts.reference import caffe as rc  # noqa: E402


def test_prototxt_reader():
    text = '''name: "n"  # a comment
input: "data"
input_shape { dim: 1 dim: 3 dim: 224 dim: 224 }
layer { name: "rpn_conv/3x3" type: "Convolution" bottom: "a" top: "b"
  convolution_param { num_output: 24   # 2 * 12
    kernel_size: 1 pad: 0 stride: 1 bias_term: false } }
layer { name: 'proposal' type: 'Python' python_param { param_str: "'feat_stride': 16 \\n'scales': [4, 8]" } }
'''
    spec = rc.parse_prototxt(text)
    assert spec["input_shape"][0]["dim"] == [1, 3, 224, 224]
    conv, python = spec["layer"]
    assert conv["name"] == ["rpn_conv/3x3"] and conv["convolution_param"][0]["bias_term"] == ["false"]
    assert conv["convolution_param"][0]["num_output"] == [24]
    assert python["python_param"][0]["param_str"] == ["'feat_stride': 16 \n'scales': [4, 8]"]


def test_layers_in_caffes_semantics():
    # ArgMax: Caffe's partial sort of (value, index) pairs gives the HIGHER index on a tie
    tied = np.array([[1.0, 3.0, 3.0, 0.0], [5.0, 5.0, 5.0, 5.0]], np.float32)
    assert rc.run_layer("ArgMax", {"name": ["a"]}, [tied], []).ravel().tolist() == [2.0, 3.0]
    # MAX pooling 3x3 stride 2 without padding: ceil((H - 3) / 2) + 1
    x = np.arange(2 * 8 * 8, dtype=np.float32).reshape(1, 2, 8, 8)
    pool = {"name": ["p"], "pooling_param": [{"kernel_size": [3], "stride": [2], "pool": ["MAX"]}]}
    assert rc.run_layer("Pooling", pool, [x], []).shape == (1, 2, 4, 4)
    # Reshape's 0 copies the dimension, -1 is inferred
    reshape = {"name": ["r"], "reshape_param": [{"shape": [{"dim": [0, 2, -1, 0]}]}]}
    assert rc.run_layer("Reshape", reshape, [np.zeros((1, 24, 5, 7), np.float32)], []).shape == (1, 2, 60, 7)


def test_pickle_onto_caffe_blobs_agrees_with_the_extractors_reading(tmp_path):
    """The two readings of one detectron2 pickle were written separately; they must give the same network."""
    cfg = DetectorConfig.tiny().replace_in("backbone", blocks=(1, 4, 2)).replace_in("roi_head", num_classes=5,
                                                                                       num_attributes=3)
    path = tmp_path / "w.pkl"
    save_in_layout(random_detector(cfg, seed=3).state_dict(), "detectron2", path)
    ours = {k: v.numpy() for k, v in load_state_dict(path).items()}
    blobs = rc.caffe_blobs(path)
    pairs = {
        "conv1": ["backbone.stem.conv.weight"],
        "bn_conv1": ["backbone.stem.bn.running_mean", "backbone.stem.bn.running_var"],
        "scale_conv1": ["backbone.stem.bn.weight", "backbone.stem.bn.bias"],
        "res2a_branch1": ["backbone.res2.0.shortcut.weight"],
        "res3b3_branch2b": ["backbone.res3.3.conv2.weight"],  # res3 of 4 blocks: a, b1, b2, b3
        "scale3b3_branch2b": ["backbone.res3.3.bn2.weight", "backbone.res3.3.bn2.bias"],
        "res4b_branch2c": ["backbone.res4.1.conv3.weight"],  # 2 blocks: a, b (the reference's 23: a, b1..b22)
        "res5a_branch2a": ["head.res5.0.conv1.weight"],
        "rpn_conv/3x3": ["rpn.conv.weight", "rpn.conv.bias"],
        "rpn_cls_score": ["rpn.objectness.weight", "rpn.objectness.bias"],  # background zeros, then the logits
        "rpn_bbox_pred": ["rpn.deltas.weight", "rpn.deltas.bias"],  # anchors in generate_anchors' order
        "cls_score": ["head.cls_score.weight", "head.cls_score.bias"],  # background first
        "cls_embedding": ["head.cls_embedding.weight"],
        "fc_attr": ["head.fc_attr.weight", "head.fc_attr.bias"],
        "attr_score": ["head.attr_score.weight", "head.attr_score.bias"],
    }
    for layer, names in pairs.items():
        for blob, name in zip(blobs[layer], names, strict=False):
            assert np.array_equal(blob, ours[name]), (layer, name)
    assert blobs["bn_conv1"][2].tolist() == [1.0]  # the moving-average factor
    # box deltas: detectron2's (10, 10, 5, 5) weights undone in float64 both ways; background rows zero
    assert np.allclose(blobs["bbox_pred"][0], ours["head.bbox_pred.weight"], rtol=0, atol=1e-7)
    assert not blobs["bbox_pred"][0][:4].any()
    assert torch.equal(torch.from_numpy(blobs["rpn_cls_score"][0][:12]), torch.zeros(12, *blobs["rpn_cls_score"][0].shape[1:]))


def test_a_net_keeps_the_blocks_its_weights_hold():
    """The tiny net's weights hold one block a stage: the others' layers go, and what read a stage's last
    block of the full net (res2c, res4b22) reads the last block that is there."""
    def block(name, bottom):
        return [{"name": [f"res{name}_branch2a"], "type": ["Convolution"], "bottom": [bottom], "top": [f"res{name}_branch2a"]},
                {"name": [f"bn{name}_branch2a"], "type": ["BatchNorm"], "bottom": [f"res{name}_branch2a"], "top": [f"res{name}_branch2a"]},
                {"name": [f"res{name}"], "type": ["Eltwise"], "bottom": [bottom, f"res{name}_branch2a"], "top": [f"res{name}"]},
                {"name": [f"res{name}_relu"], "type": ["ReLU"], "bottom": [f"res{name}"], "top": [f"res{name}"]}]
    layers = (block("2a", "pool1") + block("2b", "res2a") + block("2c", "res2b") + block("4a", "res2c")
              + block("4b1", "res4a") + block("4b22", "res4b1")
              + [{"name": ["rpn_conv/3x3"], "type": ["Convolution"], "bottom": ["res4b22"], "top": ["rpn"]}])
    kept, renamed = rc.prune_blocks(layers, {"res2a_branch2a": [], "res4a_branch2a": []})
    names = [layer["name"][0] for layer in kept]
    assert names == ["res2a_branch2a", "bn2a_branch2a", "res2a", "res2a_relu", "res4a_branch2a", "bn4a_branch2a",
                     "res4a", "res4a_relu", "rpn_conv/3x3"]
    assert kept[4]["bottom"] == ["res2a"] and kept[-1]["bottom"] == ["res4a"]
    assert renamed == {"res2c": "res2a", "res4b22": "res4a"}
    assert rc.prune_blocks(layers, {f"res{b}_branch2a": [] for b in ("2a", "2b", "2c", "4a", "4b1", "4b22")})[0] == layers
