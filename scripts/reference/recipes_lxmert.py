"""LXMERT's reference training (airsplay/lxmert) against ours: VQA fine-tuning (`src/tasks/vqa.py:
VQA.__init__` and `VQA.train`) and pretraining with all five tasks (`src/pretrain/lxmert_pretrain.py:
LXMERT.__init__` and `LXMERT.train`), run unchanged from the checkout, each reference optimizer step
followed by ours and the floor's (recipes_compare.py).

What this module supplies is what the reference reads from outside its code:
- its command line (`param.py` parses sys.argv when imported): the run script's options, at the check's
  sizes (layers, batch, epochs), `--fromScratch` (its own initialisation) and a temporary `--output`;
- "bert-base-uncased", which it downloads: a local folder with a BERT config (64-wide heads as
  bert-base's; hidden 768 for VQA, whose head assumes it, 128 for pretraining; a small vocabulary and
  FFN; dropout 0), an empty weights file and a vocabulary, put in its two archive maps;
- its data: the datasets its loops read (`tasks/vqa.py: get_data_tuple`; `pretrain/lxmert_data.py`'s
  `LXMERTDataset`, `LXMERTTorchDataset`, `LXMERTEvaluator`) as stand-ins over random features, boxes,
  labels and sentences, each epoch's batches in a fixed order; its evaluators return 0;
- `.cuda()` on tensors and modules as a no-op (this runs on the CPU).
The reference's masking (pretraining) draws its own masks; the tensors it builds are read from its
model's inputs and handed to ours as they are.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import random
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
from recipes_compare import Row, param_diff
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from xmodal.config.experiment import load_config
from xmodal.core.batches import LxmertBatch, VqaBatch
from xmodal.core.optim import current_lr
from xmodal.core.runtime import prepare
from xmodal.core.step import train_step
from xmodal.models.lxmert.init import convert_reference_state_dict

WORDS = [f"w{i}" for i in range(96)]
VOCAB = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
BOXES = 8  # objects per image (the reference takes any number; its features are 2048 wide)
FEAT = 2048


def cpu_only() -> None:
    """The reference moves every tensor and module with `.cuda()`: here they stay where they are."""
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.nn.Module.cuda = lambda self, *a, **k: self


def fake_bert(folder: Path, ffn: int, hidden: int) -> Path:
    """A local "bert-base-uncased": config (64-wide heads, as bert-base's), an empty weights file
    (`--fromScratch` initialises every weight itself) and the vocabulary."""
    folder.mkdir(parents=True)
    config = {"vocab_size": len(VOCAB), "hidden_size": hidden, "num_hidden_layers": 1,
              "num_attention_heads": hidden // 64,
              "intermediate_size": ffn, "hidden_act": "gelu", "hidden_dropout_prob": 0.0,
              "attention_probs_dropout_prob": 0.0, "max_position_embeddings": 64, "type_vocab_size": 2,
              "initializer_range": 0.02}
    (folder / "bert_config.json").write_text(json.dumps(config))
    torch.save({}, folder / "pytorch_model.bin")
    (folder / "vocab.txt").write_text("\n".join(VOCAB) + "\n")
    return folder


def import_reference(checkout: Path, argv: list[str], work: Path, ffn: int, hidden: int):
    """The reference's packages importable, its command line set, "bert-base-uncased" local."""
    cpu_only()
    sys.path.insert(0, str(checkout / "src"))
    sys.argv = argv
    import lxrt.modeling
    import lxrt.tokenization

    bert = fake_bert(work / "bert-base-uncased", ffn, hidden)
    lxrt.modeling.PRETRAINED_MODEL_ARCHIVE_MAP["bert-base-uncased"] = str(bert)
    lxrt.tokenization.PRETRAINED_VOCAB_ARCHIVE_MAP["bert-base-uncased"] = str(bert / "vocab.txt")


def sentence(rng: random.Random, shortest: int = 3) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(shortest, 14)))


def boxes(rng: np.random.Generator, n: int) -> np.ndarray:
    xy = rng.random((n, 2)) * 0.5
    return np.concatenate([xy, xy + 0.5 * rng.random((n, 2))], 1)


class Epochs:
    """A loader that yields the next epoch's batches each time it is iterated (a fixed order)."""

    def __init__(self, epochs: list[list]):
        self.epochs, self.next = epochs, 0

    def __len__(self) -> int:
        return len(self.epochs[0])

    def __iter__(self):
        epoch = self.epochs[self.next % len(self.epochs)]
        self.next += 1
        return iter(epoch)


class Evaluator:
    def evaluate(self, *args, **kwargs) -> float:
        return 0.0


class Recording(torch.nn.Module):
    """A module as it is, its latest call's arguments and result kept (the reference's inputs and loss)."""

    def __init__(self, inner: torch.nn.Module):
        super().__init__()
        self.inner, self.args, self.out = inner, None, None

    def forward(self, *args):
        self.args, self.out = args, self.inner(*args)
        return self.out


def reference_steps(optimizer_class, owner: torch.nn.Module, before, after) -> None:
    """`before()` / `after()` around every step of an `optimizer_class` over `owner`'s parameters:
    global optimizer hooks, as the reference makes its optimizer inside the function it trains in."""
    first = next(owner.parameters())

    def mine(opt) -> bool:
        return type(opt) is optimizer_class and opt.param_groups[0]["params"][0] is first

    register_optimizer_step_pre_hook(lambda opt, a, k: before(opt) if mine(opt) else None)
    register_optimizer_step_post_hook(lambda opt, a, k: after(opt) if mine(opt) else None)


@dataclasses.dataclass
class Side:
    """Ours or the floor: an objective, how it steps, how its rate is read."""

    objective: torch.nn.Module
    step: object  # batch -> loss (float)
    lr: object  # () -> the next step's rate


def ours(objective: torch.nn.Module, cfg, t_total: int) -> Side:
    """Our objective under the recipe's optimizer and schedule: `prepare` and `train_step`, as a worker."""
    state = prepare(objective, torch.device("cpu"), cfg.train, cfg.optim, total_steps=t_total)
    return Side(objective, lambda b: float(train_step(state, [b])["loss"]),
                lambda: current_lr(state.optimizer, state.scheduler))


def floor(objective: torch.nn.Module, bert_adam, lr: float, warmup: float, t_total: int, clip: float) -> Side:
    """Our objective driven by the reference's BertAdam and its loop body (zero_grad, forward, backward,
    clip, step)."""
    opt = bert_adam(list(objective.parameters()), lr=lr, warmup=warmup, t_total=t_total)

    def step(batch) -> float:
        objective.train()
        opt.zero_grad()
        loss = objective(batch)["loss"]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(objective.parameters(), clip)
        opt.step()
        return float(loss)

    return Side(objective, step, lambda: reference_lr(opt))


def reference_lr(opt) -> float:
    """The rate BertAdam's next step takes, by its own schedule function at its first trained parameter's
    step count. (Its `get_lr()` answers [0] while any parameter has no state, and a parameter that never
    gets a gradient, such as the vision side of the last cross-modality layer under a task head, never has.)"""
    import lxrt.optimization

    group = opt.param_groups[0]
    step = next((opt.state[p]["step"] for p in group["params"] if opt.state[p]), 0)
    return group["lr"] * lxrt.optimization.SCHEDULES[group["schedule"]](step / group["t_total"], group["warmup"])


def our_names(model: torch.nn.Module) -> dict:
    return convert_reference_state_dict(model.state_dict(), "the reference model").state


def lockstep(ref_model, ref_loss, our_batch, sides: dict[str, Side], emit, notes=lambda step: ""):
    """(before, after) hooks of the reference's optimizer: its rate before each step; after it, our
    step and the floor's on the same batch, and the row."""
    seen = {"lr": 0.0, "step": 0}

    def before(opt) -> None:
        seen["lr"] = reference_lr(opt)
        seen["ours_lr"] = sides["ours"].lr()

    def after(opt) -> None:
        seen["step"] += 1
        batch = our_batch()
        ref = our_names(ref_model)
        row = Row(seen["step"], ref_loss(), sides["ours"].step(batch), seen["lr"], seen["ours_lr"],
                  param_diff(ref, sides["ours"].objective.model.state_dict()))
        if "floor" in sides:
            row.floor_loss = sides["floor"].step(batch)
            row.floor_params = param_diff(ref, sides["floor"].objective.model.state_dict())
        row.note = notes(seen["step"])
        emit(row)

    return before, after


def our_config(job_config, recipe: str, ref_model_sd: dict, batch: int, epochs: int, dtype: torch.dtype):
    """The recipe at the check's batch and epochs, on the reference model's architecture (dropout off)
    and weights; returns (config, our weights)."""
    weights = convert_reference_state_dict(ref_model_sd, "the reference model")
    cfg = load_config(job_config, overrides=[f"recipe={recipe}", f"train.batch_size={batch}",
                                             f"train.epochs={epochs}", "train.precision=fp32",
                                             *(["init.source=scratch"] if recipe != "lxmert-pretrain" else [])])
    model = dataclasses.replace(weights.config, dropout=0.0, attention_dropout=0.0)
    return cfg.model_copy(update={"model": model}), {k: v.to(dtype) for k, v in weights.state.items()}


# ---------------------------------------------------------------- VQA fine-tuning


def vqa_batches(epochs: int, steps: int, batch: int, answers: int, dtype: torch.dtype, seed: int) -> list[list]:
    """Each epoch's batches as `VQA.train` reads them: (question ids, features, boxes, sentences, targets)."""
    rng, nrng = random.Random(seed), np.random.default_rng(seed)
    out, qid = [], 0
    for _ in range(epochs):
        epoch = []
        for _ in range(steps):
            scores = np.zeros((batch, answers))
            for row in scores:
                for a in nrng.choice(answers, size=int(nrng.integers(1, 4)), replace=False):
                    row[a] = nrng.choice([0.3, 0.6, 0.9, 1.0])
            epoch.append((torch.arange(qid, qid + batch), torch.tensor(nrng.standard_normal((batch, BOXES, FEAT)).clip(0),
                          dtype=dtype), torch.tensor(np.stack([boxes(nrng, BOXES) for _ in range(batch)]), dtype=dtype),
                          [sentence(rng) for _ in range(batch)], torch.tensor(scores, dtype=dtype)))
            qid += batch
        out.append(epoch)
    return out


def run_vqa(checkout: Path, dtype: torch.dtype, epochs: int, steps: int, layers: tuple[int, int, int],
            emit, seed: int = 9595) -> list[Row]:
    """The reference's `VQA.__init__` and `VQA.train` (options of run/vqa_finetune.bash) against our
    fine-tuning job's pieces under `recipe=lxmert-vqa` (FinetuneConfig -> FinetuneJob.build_objective ->
    core.runtime.prepare -> core.step.train_step)."""
    from xmodal.jobs.finetune_config import FinetuneConfig
    from xmodal.jobs.finetune_job import FinetuneJob

    batch, answers, lr = 4, 40, "5e-5"
    work = Path(tempfile.mkdtemp(prefix="recipes-vqa-"))
    argv = ["vqa.py", "--train", "train", "--valid", "", "--llayers", str(layers[0]), "--xlayers", str(layers[1]),
            "--rlayers", str(layers[2]), "--batchSize", str(batch), "--optim", "bert", "--lr", lr, "--epochs",
            str(epochs), "--fromScratch", "--output", str(work / "out"), "--seed", str(seed)]
    import_reference(checkout, argv, work, ffn=64, hidden=768)  # VQAModel's head is 768 wide (LXRTEncoder.dim)
    torch.set_default_dtype(dtype)
    import lxrt.entry
    import lxrt.optimization
    import tasks.vqa as ref

    data = vqa_batches(epochs, steps, batch, answers, dtype, seed)
    label2ans = [f"a{i}" for i in range(answers)]
    dataset = SimpleNamespace(num_answers=answers, label2ans=label2ans, splits=["train"])
    ref.get_data_tuple = lambda splits, bs, shuffle=False, drop_last=False: ref.DataTuple(
        dataset=dataset, loader=Epochs(data), evaluator=Evaluator())
    vqa = ref.VQA()
    vqa.bce_loss = Recording(vqa.bce_loss)
    cfg, weights = our_config(FinetuneConfig, "lxmert-vqa", vqa.model.state_dict(), batch, epochs, dtype)
    t_total = epochs * steps
    sides = {}
    for name in ("ours", "floor") if dtype == torch.float32 else ("ours",):
        objective = FinetuneJob().build_objective(cfg, SimpleNamespace(num_answers=answers)).to(dtype)
        objective.model.load_state_dict(weights, strict=True)
        sides[name] = (ours(objective, cfg, t_total) if name == "ours" else
                       floor(objective, lxrt.optimization.BertAdam, float(lr), 0.1, t_total, 5.0))
    tokenizer, flat = vqa.model.lxrt_encoder.tokenizer, [b for e in data for b in e]
    rows: list[Row] = []

    def batch_at(step: int) -> VqaBatch:
        qid, feats, pos, sents, target = flat[step - 1]
        f = lxrt.entry.convert_sents_to_features(sents, vqa.model.lxrt_encoder.max_seq_length, tokenizer)
        return VqaBatch(input_ids=torch.tensor([x.input_ids for x in f]),
                        attention_mask=torch.tensor([x.input_mask for x in f]).bool(), visual_feats=feats,
                        boxes=pos, visual_mask=torch.ones(feats.shape[:2], dtype=torch.bool), targets=target,
                        index=qid)

    def ref_loss() -> float:
        out = vqa.bce_loss.out
        return float(out.detach() * vqa.bce_loss.args[0].size(1))  # the reference's `loss * logit.size(1)`

    def record(row: Row) -> None:
        rows.append(row)
        emit(row)

    before, after = lockstep(vqa.model, ref_loss, lambda: batch_at(len(rows) + 1), sides, record)
    reference_steps(lxrt.optimization.BertAdam, vqa.model, before, after)
    vqa.train(vqa.train_tuple, None)
    return rows


# ---------------------------------------------------------------- pretraining


def pretrain_examples(n: int, answers: int, dtype: np.dtype, seed: int, input_example) -> list:
    """`InputExample`s as the reference's LXMERTTorchDataset hands them to its loop: a sentence, the
    image's features and boxes, object and attribute labels with confidences, matched or not, and for
    some a label {answer id: score}."""
    rng, nrng = random.Random(seed), np.random.default_rng(seed)
    out = []
    for i in range(n):
        # Every batch (of 4, in order) has a question on a matched pair: with no QA target the reference's
        # CrossEntropyLoss averages over nothing and its loss is NaN (its gradients are not).
        matched = int(i % 4 == 0 or rng.random() < 0.5)
        label = None
        if matched and (i % 4 == 0 or rng.random() < 0.5):
            ids = nrng.choice(answers, size=int(nrng.integers(1, 3)), replace=False)
            label = {int(a): float(nrng.choice([0.3, 0.6, 1.0])) for a in ids}
        feats = nrng.standard_normal((BOXES, FEAT)).clip(0).astype(dtype)
        out.append(input_example(
            uid=f"u{i}", sent=sentence(rng, 10), visual_feats=(feats, boxes(nrng, BOXES).astype(dtype)),
            obj_labels=(nrng.integers(0, 1600, BOXES), nrng.random(BOXES).astype(dtype)),
            attr_labels=(nrng.integers(0, 400, BOXES), nrng.random(BOXES).astype(dtype)),
            is_matched=matched, label=label))
    return out


def pretrain_batch(args: tuple) -> LxmertBatch:
    """The tensors the reference's `LXMERT.forward` built, in our batch: its -1 "ignore" as our -100."""
    input_ids, segment_ids, input_mask, lm_labels, feats, pos, obj_labels, matched, ans = args
    (obj, obj_conf), (attr, attr_conf), (feat, feat_mask) = (obj_labels[k] for k in ("obj", "attr", "feat"))
    return LxmertBatch(
        input_ids=input_ids, attention_mask=input_mask.bool(), mlm_labels=lm_labels.masked_fill(lm_labels < 0, -100),
        visual_feats=feats, boxes=pos, visual_mask=torch.ones(feats.shape[:2], dtype=torch.bool),
        obj_masked=feat_mask.bool(), feat_targets=feat, obj_labels=obj, obj_conf=obj_conf, attr_labels=attr,
        attr_conf=attr_conf, is_matched=matched, qa_labels=ans.masked_fill(ans < 0, -100))


def pretrain_stand_ins(data_module, examples: list, answers: int) -> None:
    """The reference's datasets, over `examples` (what its module-level `get_tuple` builds on import)."""
    table = SimpleNamespace(num_answers=answers, id2ans=lambda i: f"a{i}")

    class Dataset:
        def __init__(self, splits, qa_sets=None):
            self.answer_table, self.data = table, examples

    class TorchDataset:
        def __init__(self, dset, topk=-1):
            self.dset = dset

        def __len__(self):
            return len(examples)

        def __getitem__(self, i):
            return copy.deepcopy(examples[i])

        def random_feat(self):  # as the reference's: a random object of a random image
            feats = examples[random.randint(0, len(examples) - 1)].visual_feats[0]
            return feats[random.randint(0, BOXES - 1)]

    data_module.LXMERTDataset, data_module.LXMERTTorchDataset = Dataset, TorchDataset
    data_module.LXMERTEvaluator = lambda dset: Evaluator()


def run_pretrain(checkout: Path, dtype: torch.dtype, epochs: int, steps: int, layers: tuple[int, int, int],
                 emit, seed: int = 9595) -> list[Row]:
    """The reference's `LXMERT.__init__` and `LXMERT.train` (options of run/lxmert_pretrain.bash, all five
    tasks, and `--multiGPU` as its README runs it: nn.DataParallel, which on a machine without GPUs calls
    the model as it is; without it the loop's end-of-epoch summary fails on its (1, 6) loss array)
    against our pretraining job's pieces under `recipe=lxmert-pretrain`."""
    from xmodal.jobs.pretrain_config import PretrainConfig
    from xmodal.jobs.pretrain_job import PretrainJob

    batch, answers, lr = 4, 30, "1e-4"
    work = Path(tempfile.mkdtemp(prefix="recipes-pretrain-"))
    argv = ["lxmert_pretrain.py", "--taskMaskLM", "--taskObjPredict", "--taskMatched", "--taskQA", "--visualLosses",
            "obj,attr,feat", "--wordMaskRate", "0.15", "--objMaskRate", "0.15", "--train", "train", "--valid", "valid",
            "--llayers", str(layers[0]), "--xlayers", str(layers[1]), "--rlayers", str(layers[2]), "--fromScratch",
            "--batchSize", str(batch), "--optim", "bert", "--lr", lr, "--epochs", str(epochs), "--output",
            str(work / "out"), "--seed", str(seed), "--multiGPU"]
    (work / "out").mkdir(parents=True)
    import_reference(checkout, argv, work, ffn=64, hidden=128)
    torch.set_default_dtype(dtype)
    import lxrt.optimization
    import pretrain.lxmert_data as data_module

    np_dtype = np.float64 if dtype == torch.float64 else np.float32
    examples = pretrain_examples(batch * steps + batch, answers, np_dtype, seed, data_module.InputExample)
    pretrain_stand_ins(data_module, examples, answers)
    import pretrain.lxmert_pretrain as ref

    lx = ref.LXMERT(max_seq_length=20)
    lx.model = Recording(lx.model)
    cfg, weights = our_config(PretrainConfig, "lxmert-pretrain", lx.model.inner.state_dict(), batch, epochs, dtype)
    t_total = epochs * steps
    sides = {}
    for name in ("ours", "floor") if dtype == torch.float32 else ("ours",):
        objective = PretrainJob().build_objective(cfg, None).to(dtype)
        objective.model.load_state_dict(weights, strict=True)
        sides[name] = (ours(objective, cfg, t_total) if name == "ours" else
                       floor(objective, lxrt.optimization.BertAdam, float(lr), 0.05, t_total, 1.0))
    order = [[examples[i * batch:(i + 1) * batch] for i in range(steps)] for _ in range(epochs)]
    train = ref.DataTuple(dataset=ref.train_tuple.dataset, torchdset=ref.train_tuple.torchdset, loader=Epochs(order),
                          evaluator=Evaluator())
    valid = ref.DataTuple(dataset=ref.train_tuple.dataset, torchdset=ref.train_tuple.torchdset,
                          loader=Epochs([[examples[-batch:]]]), evaluator=Evaluator())
    rows: list[Row] = []

    def record(row: Row) -> None:
        rows.append(row)
        emit(row)

    before, after = lockstep(lx.model.inner, lambda: float(lx.model.out[0]), lambda: pretrain_batch(lx.model.args),
                             sides, record)
    reference_steps(lxrt.optimization.BertAdam, lx.model.inner, before, after)
    lx.train(train, valid)
    return rows
