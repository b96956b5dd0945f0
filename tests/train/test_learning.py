"""It learns: the `small` preset pretrained on the synthetic store leaves chance on minival for
matching and QA, and fine-tuning from it beats fine-tuning from scratch with the same budget (the
paper's central claim, at toy scale).

In-process, without Ray: the same batch builder, objective, `train_step` and evaluation the workers
run (the jobs themselves are tested end to end in test_pretrain.py and test_finetune_job.py). One
pretraining serves both tests. Bars were set from measured runs (see BARS) with a margin.
"""

from __future__ import annotations

import collections

import numpy as np
import pytest
import torch

from xmodal.config import FinetuneConfig, PretrainConfig, load_config
from xmodal.data.finetune_synthetic import build_synthetic_vqa
from xmodal.data.loader import iter_local_batches
from xmodal.data.masking import LxmertBatchBuilder
from xmodal.data.options import MaskingOptions
from xmodal.data.synthetic import build_synthetic_store
from xmodal.models.lxmert import LxmertForPretraining
from xmodal.models.lxmert_init import init_answer_head_from_qa, load_pretrained_encoder
from xmodal.objectives.pretraining import PretrainingObjective
from xmodal.train.finetune import build_objective, with_data_dims
from xmodal.train.loop import evaluate_sums, ratios
from xmodal.train.runtime import prepare
from xmodal.train.step import train_step

pytestmark = pytest.mark.slow

PRETRAIN_STEPS = 3000
FINETUNE_STEPS = 300
# The embedded store's options, with 12 object slots instead of 36 (same corpus, cheaper steps).
STORE = ["data.synthetic.num_objects=12"]
PRETRAIN = ["optim.lr=1e-3", "schedule.qa_from_fraction=0", "train.batch_size=64"]


def cpu(batch):
    return batch.to("cpu", torch.float32)


@pytest.fixture(scope="module")
def one_thread():
    n = torch.get_num_threads()
    torch.set_num_threads(1)  # a 2-core machine shared with other tests: no OpenMP spinning
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory, one_thread):
    """(config, store, state dict, minival metrics) after PRETRAIN_STEPS steps of all five tasks."""
    from xmodal.train.pretrain import with_store_dims

    cfg = load_config(PretrainConfig, overrides=STORE + PRETRAIN)
    store = build_synthetic_store(tmp_path_factory.mktemp("learn") / "store", cfg.data.synthetic)
    cfg = with_store_dims(cfg, store)
    builder = LxmertBatchBuilder.from_store(store, cfg.data.masking)
    torch.manual_seed(0)
    objective = PretrainingObjective(LxmertForPretraining(cfg.model), cfg.tasks)
    state = prepare(objective, torch.device("cpu"), cfg.train, cfg.optim, PRETRAIN_STEPS)
    epoch = 0
    while state.step < PRETRAIN_STEPS:
        for batch in iter_local_batches(store, "train", builder, cfg.train.batch_size, epoch=epoch, seed=0):
            train_step(state, [cpu(batch)])
            if state.step == PRETRAIN_STEPS:
                break
        epoch += 1
    minival = iter_local_batches(store, "minival", builder, 128, epoch=0, seed=1, shuffle=False, drop_last=False)
    metrics = ratios(evaluate_sums(state.model, minival, cpu, None))
    return cfg, store, objective.model.state_dict(), metrics


def qa_text_prior(store) -> float:
    """Minival QA accuracy of the best text-only guess: the most frequent train answer of each
    question string (the language prior a model could learn without looking at the image)."""
    def questions(split):
        tok = store.tokenizer()
        # Unmasked, never mismatched: every question as written, with its answer.
        plain = LxmertBatchBuilder.from_store(store, MaskingOptions(word_mask_prob=0.0, mismatch_prob=0.0))
        for b in iter_local_batches(store, split, plain, 256, epoch=0, seed=2, shuffle=False, drop_last=False):
            for ids, mask, label in zip(b.input_ids, b.attention_mask, b.qa_labels, strict=True):
                if label >= 0:
                    yield tok.decode(ids[mask].tolist()), int(label)

    best: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for text, label in questions("train"):
        best[text][label] += 1
    overall = collections.Counter(lbl for c in best.values() for lbl in c.elements()).most_common(1)[0][0]
    hits = [label == (best[text].most_common(1)[0][0] if text in best else overall)
            for text, label in questions("minival")]
    return float(np.mean(hits))


def test_small_preset_learns_matching_and_qa_beyond_chance(pretrained):
    _, store, _, m = pretrained
    prior = qa_text_prior(store)
    shown = {k: round(v, 3) for k, v in m.items()} | {"qa_text_prior": round(prior, 3)}
    print("minival after pretraining:", shown)  # the figures behind BARS (pytest -s)
    # Chance: matching 0.5 (balanced); QA: the text-only prior (measured on the same minival).
    assert m["eval/match_acc"] >= BARS["match_acc"], shown
    assert m["eval/qa_acc"] >= prior + BARS["qa_over_prior"], shown
    assert m["eval/mlm_acc"] >= BARS["mlm_acc"], shown


def vqa_accuracy(objective, data) -> float:
    from xmodal.data.finetune import iter_finetune_batches

    objective.eval()
    score = n = 0.0
    with torch.no_grad():
        for b in iter_finetune_batches(data, "valid", 128, seed=0, epoch=0, shuffle=False, drop_last=False):
            b = cpu(b)
            score += float(b.targets.gather(1, objective.predict(b)[:, None]).sum())
            n += len(b)
    return score / n


def test_fine_tuning_from_pretrained_beats_scratch_with_the_same_budget(pretrained, tmp_path):
    from xmodal.data.finetune import iter_finetune_batches

    pcfg, store, weights, _ = pretrained
    data = build_synthetic_vqa(store.path, tmp_path / "vqa")
    fcfg = with_data_dims(load_config(FinetuneConfig, overrides=["optim.lr=3e-4"]), data, pcfg.model)
    answers = list(data.answers.answers)
    acc = {}
    for init in ("pretrained", "scratch"):
        torch.manual_seed(1)
        objective = build_objective(fcfg, data.num_answers)
        if init == "pretrained":
            load_pretrained_encoder(objective.model, weights)
            init_answer_head_from_qa(objective.model, weights, list(store.answers().answers), answers)
        state = prepare(objective, torch.device("cpu"), fcfg.train, fcfg.optim, FINETUNE_STEPS)
        epoch = 0
        while state.step < FINETUNE_STEPS:
            for batch in iter_finetune_batches(data, "train", 32, seed=0, epoch=epoch):
                train_step(state, [cpu(batch)])
                if state.step == FINETUNE_STEPS:
                    break
            epoch += 1
        acc[init] = vqa_accuracy(objective, data)
    print("synthetic VQA valid accuracy after fine-tuning:", acc)
    assert acc["pretrained"] >= acc["scratch"] + BARS["finetune_margin"], acc


# Measured with these settings (2-core CPU, one thread, 8 min): matching 0.688, QA 0.468 against a
# text-only prior of 0.351, masked LM 0.629; fine-tuned VQA accuracy 0.565 from pretrained against
# 0.419 from scratch. At 1,500 steps matching was still 0.53: the bars need the 3,000.
BARS = {"match_acc": 0.6, "qa_over_prior": 0.08, "mlm_acc": 0.55, "finetune_margin": 0.08}
