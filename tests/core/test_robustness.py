"""The robustness perturbations (xmodal.core.robustness): pure functions of typed batches, no Ray."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from xmodal.core.batches import MultBatch, Nlvr2Batch, VqaBatch
from xmodal.core.robustness import (
    FINETUNE_CONDITIONS,
    MULT_CONDITIONS,
    feature_std,
    finetune_perturbation,
    mult_perturbation,
    noise_modality,
    noise_visual_feats,
    shuffle_boxes,
    zero_modality,
)


def mult_batch(b: int = 4, seed: int = 0) -> MultBatch:
    g = torch.Generator().manual_seed(seed)
    batch = MultBatch.random(b, dims=(6, 5, 4), seq_lens=(7, 9, 8), variable_lengths=True, generator=g)
    return batch.to("cpu", torch.float32)


def vqa_batch(b: int = 5, n: int = 6, f: int = 8, seed: int = 0) -> VqaBatch:
    g = torch.Generator().manual_seed(seed)
    nbox = torch.randint(2, n + 1, (b,), generator=g)
    mask = torch.arange(n)[None, :] < nbox[:, None]
    return VqaBatch(input_ids=torch.ones(b, 4, dtype=torch.long), attention_mask=torch.ones(b, 4, dtype=torch.bool),
                    visual_feats=torch.rand(b, n, f, generator=g) * mask[..., None],
                    boxes=torch.rand(b, n, 4, generator=g) * mask[..., None], visual_mask=mask,
                    targets=torch.zeros(b, 3), index=torch.arange(10, 10 + b))


def nlvr2_batch(b: int = 3, n: int = 5, f: int = 4) -> Nlvr2Batch:
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(b, 2, n, dtype=torch.bool)
    mask[:, 1, n - 2:] = False
    return Nlvr2Batch(input_ids=torch.ones(b, 4, dtype=torch.long), attention_mask=torch.ones(b, 4, dtype=torch.bool),
                      visual_feats=torch.rand(b, 2, n, f, generator=g), boxes=torch.rand(b, 2, n, 4, generator=g),
                      visual_mask=mask, labels=torch.zeros(b, dtype=torch.long), index=torch.arange(b))


def real_steps(batch: MultBatch, modality: str) -> torch.Tensor:
    """(B, T) True at the modality's real (unpadded) steps."""
    x, n = getattr(batch, modality), getattr(batch, f"{modality}_lengths")
    return torch.arange(x.shape[1])[None, :] < n[:, None]


@pytest.mark.parametrize("modality", ["text", "audio", "vision"])
def test_zeroing_zeroes_that_modality_only(modality):
    batch = mult_batch()
    out = zero_modality(batch, modality)
    assert getattr(out, modality).abs().max() == 0 and getattr(batch, modality).abs().max() > 0
    for f in dataclasses.fields(batch):
        if f.name != modality:
            assert torch.equal(getattr(out, f.name), getattr(batch, f.name)), f.name


@pytest.mark.parametrize("modality", ["text", "audio", "vision"])
def test_modality_noise_has_the_documented_scale_at_real_steps_only(modality):
    # Many rows of one step each: the noise's std per dimension is measurable.
    b, dim = 4000, 3
    std = torch.tensor([0.5, 2.0, 0.0])
    x = torch.zeros(b, 3, dim)
    lens = torch.full((b,), 2)
    batch = MultBatch(*(x.clone() for _ in range(3)), lens, lens, lens, labels=torch.zeros(b, 1),
                      index=torch.arange(b))
    out = noise_modality(batch, modality, sigma=0.5, std=std, seed=7)
    noise = getattr(out, modality)
    measured = noise[:, :2].reshape(-1, dim).std(0)
    assert torch.allclose(measured, 0.5 * std, rtol=0.05, atol=1e-6), measured  # sigma x the feature's std
    assert noise[:, 2].abs().max() == 0  # padding stays zero
    for other in {"text", "audio", "vision"} - {modality}:
        assert getattr(out, other).abs().max() == 0


def test_noise_is_seeded_per_example_whatever_the_batching():
    batch = mult_batch(6)
    std = feature_std(batch.audio[real_steps(batch, "audio")].numpy())
    whole = noise_modality(batch, "audio", 1.0, std, seed=3)
    again = noise_modality(batch, "audio", 1.0, std, seed=3)
    other = noise_modality(batch, "audio", 1.0, std, seed=4)
    assert torch.equal(whole.audio, again.audio) and not torch.equal(whole.audio, other.audio)
    # The same example gets the same noise in a batch of its own (rows padded to another length).
    for i in (0, 5):
        alone = MultBatch(**{f.name: getattr(batch, f.name)[i:i + 1] for f in dataclasses.fields(batch)})
        one = noise_modality(alone, "audio", 1.0, std, seed=3)
        n = int(batch.audio_lengths[i])
        assert torch.equal(one.audio[0, :n], whole.audio[i, :n])


def test_feature_std_measures_masked_entries_per_dimension():
    rng = np.random.default_rng(0)
    values = rng.normal(0, [1.0, 3.0], size=(50, 7, 2)).astype(np.float16)
    mask = rng.random((50, 7)) < 0.6
    got = feature_std(values, mask, chunk=8).numpy()  # chunks of the first axis: the same figure
    want = values[mask].astype(np.float64).std(0)
    assert np.allclose(got, want, rtol=1e-6)
    assert np.allclose(feature_std(values.reshape(-1, 2)).numpy(), values.reshape(-1, 2).astype(np.float64).std(0))
    with pytest.raises(ValueError, match="no entries"):
        feature_std(values, np.zeros((50, 7), bool))


def test_mult_conditions_map_to_their_perturbations():
    batch = mult_batch()
    stds = {m: torch.ones(getattr(batch, m).shape[-1]) for m in ("text", "audio", "vision")}
    for condition in MULT_CONDITIONS:
        kind, modality = condition.split("_")
        out = mult_perturbation(condition, 0.5, stds, 0)(batch)
        changed = {m for m in ("text", "audio", "vision") if not torch.equal(getattr(out, m), getattr(batch, m))}
        assert changed == {modality}, condition
        if kind == "zero":
            assert getattr(out, modality).abs().max() == 0
    with pytest.raises(ValueError, match="expected one of zero_text"):
        mult_perturbation("drop_text", 0.5, stds, 0)


def test_visual_noise_has_the_documented_scale_on_real_objects_only():
    b, n, f = 3000, 4, 2
    mask = torch.zeros(b, n, dtype=torch.bool)
    mask[:, :3] = True
    batch = VqaBatch(input_ids=torch.ones(b, 2, dtype=torch.long), attention_mask=torch.ones(b, 2, dtype=torch.bool),
                     visual_feats=torch.zeros(b, n, f), boxes=torch.rand(b, n, 4), visual_mask=mask,
                     targets=torch.zeros(b, 2), index=torch.arange(b))
    std = torch.tensor([1.0, 4.0])
    out = noise_visual_feats(batch, 0.25, std, seed=0)
    assert torch.allclose(out.visual_feats[:, :3].reshape(-1, f).std(0), 0.25 * std, rtol=0.05)
    assert out.visual_feats[:, 3].abs().max() == 0  # padded objects untouched
    assert torch.equal(out.boxes, batch.boxes)
    assert torch.equal(noise_visual_feats(batch, 0.25, std, seed=0).visual_feats, out.visual_feats)


@pytest.mark.parametrize("make", [vqa_batch, nlvr2_batch])
def test_box_shuffling_permutes_boxes_within_each_image_and_keeps_features(make):
    batch = make()
    out = shuffle_boxes(batch, seed=0)
    assert torch.equal(out.visual_feats, batch.visual_feats) and torch.equal(out.visual_mask, batch.visual_mask)
    boxes, before = out.boxes.reshape(-1, *out.boxes.shape[-2:]), batch.boxes.reshape(-1, *batch.boxes.shape[-2:])
    mask = batch.visual_mask.reshape(-1, batch.visual_mask.shape[-1])
    moved = 0
    for i in range(mask.shape[0]):
        real = mask[i]
        # The same boxes, each once, among the image's real objects; padded objects keep theirs.
        key = lambda t: sorted(map(tuple, t.tolist()))  # noqa: E731
        assert key(boxes[i][real]) == key(before[i][real])
        assert torch.equal(boxes[i][~real], before[i][~real])
        moved += int(not torch.equal(boxes[i][real], before[i][real]))
    assert moved >= mask.shape[0] // 2  # most images' boxes did move
    assert torch.equal(shuffle_boxes(batch, seed=0).boxes, out.boxes)  # seeded
    assert not torch.equal(shuffle_boxes(batch, seed=1).boxes, out.boxes)


def test_finetune_conditions_map_to_their_perturbations():
    batch = vqa_batch()
    std = torch.ones(batch.visual_feats.shape[-1])
    noised = finetune_perturbation("feat_noise", 0.5, std, 0)(batch)
    shuffled = finetune_perturbation("shuffle_boxes", 0.5, None, 0)(batch)
    assert not torch.equal(noised.visual_feats, batch.visual_feats) and torch.equal(noised.boxes, batch.boxes)
    assert torch.equal(shuffled.visual_feats, batch.visual_feats) and not torch.equal(shuffled.boxes, batch.boxes)
    assert set(FINETUNE_CONDITIONS) == {"feat_noise", "shuffle_boxes"}
    with pytest.raises(ValueError, match="expected one of feat_noise, shuffle_boxes"):
        finetune_perturbation("blur", 0.5, std, 0)


def test_the_report_shows_the_sweep_metric_under_each_condition_as_columns():
    from xmodal.report import TrialRun, build_table

    def run(name: str, layers: int, mae: float, zero_audio: float) -> TrialRun:
        metrics = {"valid/mae": mae, "test/mae": mae + 0.01, "robust/zero_audio/mae": zero_audio,
                   "robust/zero_audio/acc2": 0.5, "robust/noise_text/mae": mae + 0.2}
        return TrialRun(name, name, "p", {"model.layers": layers}, "0", "finished", metrics)

    table = build_table([run("a", 1, 0.3, 1.9), run("b", 2, 0.2, 2.1)], [], metric="valid/mae", mode="min")
    assert table.columns == ["valid/mae", "test/mae", "robust/noise_text/mae", "robust/zero_audio/mae"]
    best = table.rows[0]
    assert best.params == {"model.layers": 2} and best.stats["robust/zero_audio/mae"][0] == pytest.approx(2.1)


def test_the_end_summary_puts_each_condition_on_one_line():
    from xmodal.base.console import summary_table

    final = {"test/acc2": 0.99, "test/mae": 0.05, "robust/zero_audio/acc2": 0.49, "robust/zero_audio/mae": 1.86,
             "robust/zero_audio/loss": 1.9, "robust/noise_text/acc2": 0.92, "robust/noise_text/mae": 0.4}
    rows = summary_table(final, {}, {})
    assert rows[-2:] == ["  robust/noise_text  acc2 0.9200  mae 0.4000",
                         "  robust/zero_audio  acc2 0.4900  mae 1.8600"]
    assert len(rows) == 1 + 2 + 2  # header, the clean metrics, a line per condition


def test_robust_config_is_on_by_default_and_names_bad_values():
    from xmodal.config.experiment import ConfigError, load_config
    from xmodal.jobs.finetune_config import FinetuneConfig
    from xmodal.jobs.mult_config import MultTrainConfig

    assert tuple(load_config(MultTrainConfig).robust.conditions) == MULT_CONDITIONS
    assert tuple(load_config(FinetuneConfig).robust.conditions) == FINETUNE_CONDITIONS
    with pytest.raises(ConfigError, match=r"robust.conditions.0 = 'zero_smell': expected 'zero_text'"):
        load_config(MultTrainConfig, overrides=["robust.conditions=[zero_smell]"])
    with pytest.raises(ConfigError, match=r"robust.conditions: expected each condition once"):
        load_config(FinetuneConfig, overrides=["robust.conditions=[feat_noise, feat_noise]"])
    with pytest.raises(ConfigError, match=r"robust.noise_sigma = -1: expected a number in \(0, 10\]"):
        load_config(FinetuneConfig, overrides=["robust.noise_sigma=-1"])
