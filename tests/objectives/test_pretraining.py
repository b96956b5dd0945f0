"""The five LXMERT pretraining losses: gradients, task switches, options, overfitting (tiny preset)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
import torch.nn.functional as F

from xmodal.core.batches import LxmertBatch
from xmodal.core.step import TrainState, adamw, linear_warmup_decay, train_step
from xmodal.models.lxmert.model import LxmertForPretraining, preset
from xmodal.objectives.pretraining import (
    IGNORE,
    TASKS,
    PretrainingObjective,
    PretrainTasks,
    pretraining_eval_metrics,
    pretraining_losses,
)
from xmodal_testing import all_logits

CFG = preset("tiny")


def make_batch(b=8, seed=0, **kw) -> LxmertBatch:
    return LxmertBatch.random(
        b, vocab_size=CFG.vocab_size, visual_feat_dim=CFG.visual_feat_dim, num_object_labels=CFG.num_object_labels,
        num_attr_labels=CFG.num_attr_labels, num_qa_labels=CFG.num_qa_labels,
        generator=torch.Generator().manual_seed(seed), **kw,
    ).to("cpu", float_dtype=torch.float32)


def make_model(seed=0) -> LxmertForPretraining:
    torch.manual_seed(seed)
    return LxmertForPretraining(CFG)


def qa_pairs(batch: LxmertBatch) -> int:
    return int(((batch.qa_labels != IGNORE) & (batch.is_matched == 1)).sum())


# Parameters that belong to one task's head only (the MLM decoder is tied to the word embedding).
def head_params(model: LxmertForPretraining, task: str) -> list[torch.nn.Parameter]:
    h = model.object_heads
    return {
        "mlm": [*model.mlm_head.transform.parameters(), model.mlm_head.bias],
        "obj_feat": list(h.feat.parameters()),
        "obj_label": [*h.obj.parameters(), *h.attr.parameters()],
        "matching": list(model.match_head.parameters()),
        "qa": list(model.qa_head.parameters()),
    }[task]


def test_every_parameter_gets_a_gradient_with_all_tasks():
    batch = make_batch(16, seed=3)
    assert qa_pairs(batch) > 0 and batch.mlm_labels.ne(IGNORE).any() and batch.obj_masked.any()
    model = make_model()
    objective = PretrainingObjective(model, PretrainTasks())
    out = objective(batch)
    assert set(out) == {"loss", *(f"loss/{t}" for t in TASKS)}
    out["loss"].backward()
    for name, p in model.named_parameters():
        assert p.requires_grad, name
        assert p.grad is not None and p.grad.abs().sum() > 0, f"{name} got no gradient"


@pytest.mark.parametrize("off", TASKS)
def test_switching_a_task_off_drops_its_loss_and_its_gradient(off):
    batch = make_batch(16, seed=3)
    model = make_model()
    objective = PretrainingObjective(model, PretrainTasks().replace(**{off: False}))
    out = objective(batch)
    assert f"loss/{off}" not in out
    assert set(out) == {"loss", *(f"loss/{t}" for t in TASKS if t != off)}
    torch.testing.assert_close(out["loss"], sum(out[f"loss/{t}"] for t in TASKS if t != off))
    out["loss"].backward()
    for p in head_params(model, off):
        assert not p.requires_grad and p.grad is None
    for task in TASKS:
        if task != off:
            assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in head_params(model, task)), task


def test_both_object_tasks_off_freezes_the_shared_object_transform():
    model = make_model()
    objective = PretrainingObjective(model, PretrainTasks(obj_feat=False, obj_label=False))
    objective(make_batch(seed=3))["loss"].backward()
    assert all(p.grad is None for p in model.object_heads.parameters())


def test_active_narrows_the_tasks_for_one_step():
    model = make_model()
    out = PretrainingObjective(model, PretrainTasks())(make_batch(seed=3), active=("mlm", "matching"))
    assert set(out) == {"loss", "loss/mlm", "loss/matching"}


def test_mlm_qa_matching_equal_full_logit_references():
    """Heads applied only at the selected rows give the same losses as full logits + ignore_index."""
    batch = make_batch(16, seed=3)
    model = make_model().eval()
    res = pretraining_losses(model, batch, PretrainTasks())
    with torch.no_grad():
        logits = all_logits(model, model(batch.input_ids, batch.attention_mask, batch.visual_feats, batch.boxes,
                                        batch.visual_mask))
    mlm = F.cross_entropy(logits["mlm"].flatten(0, 1), batch.mlm_labels.flatten(), ignore_index=IGNORE)
    qa_target = batch.qa_labels.masked_fill(batch.is_matched == 0, IGNORE)
    qa = F.cross_entropy(logits["qa"], qa_target, ignore_index=IGNORE)
    torch.testing.assert_close(res["loss/mlm"], mlm)
    torch.testing.assert_close(res["loss/qa"], qa)
    torch.testing.assert_close(res["loss/matching"], F.cross_entropy(logits["match"], batch.is_matched))


@pytest.mark.parametrize("off", [None, "obj_label", "qa"])
def test_the_metric_table_names_what_the_objective_measures(off):
    tasks = PretrainTasks() if off is None else PretrainTasks().replace(**{off: False})
    res = pretraining_losses(make_model(), make_batch(4, seed=3), tasks, with_metrics=True)
    measured = {"eval/" + (k if k.startswith("loss") else k.split("/")[0]) for k in res}
    assert measured == set(pretraining_eval_metrics(tasks))


def test_metrics_are_sums_with_counts():
    batch = make_batch(16, seed=3)
    res = pretraining_losses(make_model(), batch, PretrainTasks(), with_metrics=True)
    assert int(res["mlm_acc/count"]) == int(batch.mlm_labels.ne(IGNORE).sum())
    assert int(res["qa_acc/count"]) == qa_pairs(batch)
    assert int(res["match_acc/count"]) == 16
    assert 0 <= int(res["obj_acc/correct"]) <= int(res["obj_acc/count"])


# Hand-computed object losses: the heads are set to constant outputs so that the expected
# value follows from the targets alone.

def constant_object_heads(model, feat_value=0.0, label_logit=2.0):
    """feat head predicts `feat_value` everywhere; obj/attr heads give class 0 logit `label_logit`, others 0."""
    h = model.object_heads
    with torch.no_grad():
        for lin in (h.feat, h.obj, h.attr):
            lin.weight.zero_()
            lin.bias.zero_()
        h.feat.bias.fill_(feat_value)
        h.obj.bias[0] = label_logit
        h.attr.bias[0] = label_logit
    return model


def object_case():
    """2 images x 4 objects; objects (0,0), (0,1), (1,2) masked; (1,3) is padding."""
    b = make_batch(2, num_objects=4)
    masked = torch.tensor([[1, 1, 0, 0], [0, 0, 1, 0]], dtype=torch.bool)
    valid = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)
    f = CFG.visual_feat_dim
    # Masked objects: half the dims 2.0, half 0.5. Others: 100 (must never count).
    target = torch.full((2, 4, f), 100.0)
    target[masked] = torch.tensor([2.0] * (f // 2) + [0.5] * (f - f // 2))
    # Label 0 on masked objects, 1 on the others; attribute of object (0,1) unknown.
    labels = (~masked).long()
    attrs = labels.clone()
    attrs[0, 1] = IGNORE
    conf = torch.tensor([[0.5, 1.0, 0.2, 0.4], [0.8, 0.6, 0.9, 0.7]])
    return LxmertBatch(**{**b.__dict__, "obj_masked": masked, "visual_mask": valid, "feat_targets": target,
                          "obj_labels": labels, "attr_labels": attrs, "obj_conf": conf, "attr_conf": conf})


def object_losses(tasks: PretrainTasks, **heads) -> dict[str, torch.Tensor]:
    model = constant_object_heads(make_model(), **heads)
    return pretraining_losses(model, object_case(), tasks.replace(mlm=False, matching=False, qa=False))


def test_feat_loss_l2_vs_smooth_l1_by_hand():
    # pred 0: L2 = (2^2 + 0.5^2) / 2; SmoothL1 (beta 1) = ((2 - 0.5) + 0.5 * 0.5^2) / 2.
    l2 = object_losses(PretrainTasks(feat_loss="l2"))["loss/obj_feat"]
    sl1 = object_losses(PretrainTasks(feat_loss="smooth_l1"))["loss/obj_feat"]
    assert l2.item() == pytest.approx((4.0 + 0.25) / 2)
    assert sl1.item() == pytest.approx((1.5 + 0.125) / 2)
    # pred 2.0 on dims whose target is 2.0 or 0.5: L2 = (0 + 1.5^2) / 2.
    assert object_losses(PretrainTasks(), feat_value=2.0)["loss/obj_feat"].item() == pytest.approx(2.25 / 2)


C_OBJ, C_ATTR = CFG.num_object_labels, CFG.num_attr_labels


def ce(label: int, classes: int, logit0: float = 2.0) -> float:
    """Cross-entropy when class 0 has logit `logit0` and the rest 0."""
    z = math.log(math.exp(logit0) + classes - 1)
    return z - (logit0 if label == 0 else 0.0)


def test_label_objects_masked_vs_all_by_hand():
    # masked: 3 objects, all label 0 (one attribute unknown -> 2 attribute terms).
    masked = object_losses(PretrainTasks(label_objects="masked"))["loss/obj_label"]
    assert masked.item() == pytest.approx(ce(0, C_OBJ) + ce(0, C_ATTR), rel=1e-5)
    # all: the 7 valid objects (padding excluded): 3 with label 0, 4 with label 1; attribute (0,1) unknown.
    everything = object_losses(PretrainTasks(label_objects="all"))["loss/obj_label"]
    obj = (3 * ce(0, C_OBJ) + 4 * ce(1, C_OBJ)) / 7
    attr = (2 * ce(0, C_ATTR) + 4 * ce(1, C_ATTR)) / 6
    assert everything.item() == pytest.approx(obj + attr, rel=1e-5)


def test_confidence_weighting_by_hand():
    # Reference: CE x detector confidence, averaged over the objects (as transformers' LXMERT).
    got = object_losses(PretrainTasks(label_objects="all", label_confidence_weighted=True))["loss/obj_label"]
    conf_masked = [0.5, 1.0, 0.9]  # objects (0,0), (0,1), (1,2)
    conf_other = [0.2, 0.4, 0.8, 0.6]  # (0,2), (0,3), (1,0), (1,1)
    obj = (sum(conf_masked) * ce(0, C_OBJ) + sum(conf_other) * ce(1, C_OBJ)) / 7
    attr = ((0.5 + 0.9) * ce(0, C_ATTR) + sum(conf_other) * ce(1, C_ATTR)) / 6
    assert got.item() == pytest.approx(obj + attr, rel=1e-5)


def test_visual_loss_scale_scales_only_the_visual_losses():
    batch = make_batch(16, seed=3)
    model = make_model()
    base = pretraining_losses(model, batch, PretrainTasks())
    scaled = pretraining_losses(model, batch, PretrainTasks(visual_loss_scale=1 / 0.15))
    for t in ("obj_feat", "obj_label"):
        torch.testing.assert_close(scaled[f"loss/{t}"], base[f"loss/{t}"] / 0.15)
    for t in ("mlm", "matching", "qa"):
        torch.testing.assert_close(scaled[f"loss/{t}"], base[f"loss/{t}"])
    torch.testing.assert_close(scaled["loss"], sum(scaled[f"loss/{t}"] for t in TASKS))


def test_reference_preset_matches_the_reference_code():
    r = PretrainTasks.reference()
    assert (r.feat_loss, r.label_objects, r.label_confidence_weighted) == ("smooth_l1", "all", True)
    assert r.visual_loss_scale == pytest.approx(1 / 0.15)
    p = PretrainTasks()  # paper defaults
    assert (p.feat_loss, p.label_objects, p.label_confidence_weighted, p.visual_loss_scale) == (
        "l2", "masked", False, 1.0)


def test_tiny_model_overfits_one_batch_on_all_tasks():
    batch = make_batch(8, seed=14, seq_len=12, num_objects=10, mask_prob=0.3)
    assert qa_pairs(batch) >= 2, "the batch must contain QA samples on matched pairs"
    assert batch.mlm_labels.ne(IGNORE).any() and batch.obj_masked.any()
    objective = PretrainingObjective(make_model(), PretrainTasks())
    steps = 250
    opt = adamw(objective, lr=5e-3, weight_decay=0.0)
    # Linear decay: at a constant lr Adam's loss spikes late in memorisation.
    state = TrainState(objective, opt, linear_warmup_decay(opt, steps, warmup_ratio=0.0))
    first = train_step(state, [batch])
    for _ in range(steps - 1):
        train_step(state, [batch])
    with torch.no_grad():
        last = objective(batch)
    for t in TASKS:
        before, after = first[f"loss/{t}"].item(), last[f"loss/{t}"].item()
        assert after <= 0.1 * before, f"{t}: {before:.3f} -> {after:.3f}"


def test_the_reference_feature_loss_divides_by_every_object():
    """feat_loss_mean=all: the masked objects' losses over the number of real objects, as the reference's
    `(loss * feat_mask).mean()`; the default divides by the masked objects."""
    batch = make_batch(4, seed=3, seq_len=10, num_objects=9, mask_prob=0.3)
    model = make_model()
    masked = pretraining_losses(model, batch, PretrainTasks(feat_loss="smooth_l1"))["loss/obj_feat"]
    every = pretraining_losses(model, batch, PretrainTasks(feat_loss="smooth_l1", feat_loss_mean="all"))["loss/obj_feat"]
    chosen = (batch.obj_masked & batch.visual_mask).sum()
    torch.testing.assert_close(every, masked * chosen / batch.visual_mask.sum())
    assert PretrainTasks.reference().feat_loss_mean == "all"


def test_losses_keep_float64():
    """A float64 model's losses stay float64 (the reference checks, scripts/reference/recipes.py)."""
    batch = make_batch(2, seed=1, seq_len=8, num_objects=5)
    batch = dataclasses.replace(batch, **{f.name: getattr(batch, f.name).double() for f in dataclasses.fields(batch)
                                          if getattr(batch, f.name).is_floating_point()})
    out = pretraining_losses(make_model().double(), batch, PretrainTasks.reference())
    assert {v.dtype for k, v in out.items() if k.startswith("loss")} == {torch.float64}
