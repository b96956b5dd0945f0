"""MulT's reference training (yaohungt/Multimodal-Transformer) against ours: `src/train.py: initiate` and
`train_model` (Adam, clip, ReduceLROnPlateau stepped once per epoch on the validation loss) with the
hyper-parameters `main.py` parses, run unchanged from the checkout, each reference optimizer step
followed by ours and the floor's (recipes_compare.py).

What this module supplies is what the reference reads from outside its code, and what today's torch
no longer takes:
- its command line (`main.py` parses sys.argv when run): its defaults but the check's sizes (layers,
  batch, epochs), dropout 0, and `--when` small enough for a plateau drop within the check's epochs;
  `main.py` is run as a module (not `__main__`) for its `hyp_params`, with `src.utils.get_data`
  handing it stand-in datasets of the sizes of the batches below;
- the batches `train_model` iterates (train, valid, test), each epoch's in a fixed order, every
  sequence at its full length (the reference attends over the padding);
- `ReduceLROnPlateau(..., verbose=True)`: torch 2.x dropped `verbose`; the same class without it;
- `load_model`'s `torch.load` of a whole pickled model: torch >= 2.6 loads weights only by default;
  the same call with `weights_only=False`, on the file the run itself saved;
- `modules/position_embedding.py: make_positions` returns `tensor.clone()...long()` of a transposed
  (non-contiguous) tensor and its caller `.view(-1)`s it: torch 1.0's `clone` made it contiguous, today's
  keeps the strides and `view` refuses; the same values, made contiguous;
- `input()` at the end of `train_model` answered with nothing; its files go to a temporary folder;
- in float64 only: `Tensor.float()` keeps float64 (`float64_throughout`), or its attention would take
  every softmax in float32.
The reference's model starts from ours (`models/mult/reference.py: to_reference_state_dict`).
"""

from __future__ import annotations

import builtins
import importlib.util
import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace

import torch
from recipes_compare import Row, param_diff
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from xmodal.config.experiment import load_config
from xmodal.core.batches import MultBatch
from xmodal.core.loop import epoch_ended
from xmodal.core.optim import current_lr
from xmodal.core.runtime import prepare
from xmodal.core.step import train_step
from xmodal.models.mult.reference import to_reference_state_dict

DIMS = {"text": 16, "audio": 8, "vision": 6}
LENS = {"text": 8, "audio": 12, "vision": 10}
VALID_BATCHES = 2


class Dataset:
    """What `main.py` asks of a dataset: its dimensions, lengths and size."""

    def __init__(self, n: int):
        self.n = n

    def get_dim(self):
        return DIMS["text"], DIMS["audio"], DIMS["vision"]

    def get_seq_len(self):
        return LENS["text"], LENS["audio"], LENS["vision"]

    def __len__(self) -> int:
        return self.n


def make_batches(n: int, batch: int, dtype: torch.dtype, g: torch.Generator, noise_labels: bool) -> list:
    """(batch_X, batch_Y, batch_META) as the reference's loader yields them; the label depends on the
    text and audio (train), or is noise (valid, test: so the validation loss stops improving and the
    plateau drops)."""
    out = []
    for i in range(n):
        x = {m: torch.randn(batch, LENS[m], DIMS[m], generator=g, dtype=dtype) for m in DIMS}
        y = (torch.rand(batch, 1, generator=g, dtype=dtype) * 6 - 3 if noise_labels
             else (x["text"][:, :, 0].mean(1, keepdim=True) * x["audio"][:, :, 0].mean(1, keepdim=True) * 9).clamp(-3, 3))
        out.append(((torch.arange(i * batch, (i + 1) * batch), x["text"], x["audio"], x["vision"]), y[:, :, None], None))
    return out


def our_batch(b) -> MultBatch:
    (index, text, audio, vision), y, _ = b
    n = len(index)
    return MultBatch(text=text, audio=audio, vision=vision, text_lengths=torch.full((n,), LENS["text"]),
                     audio_lengths=torch.full((n,), LENS["audio"]), vision_lengths=torch.full((n,), LENS["vision"]),
                     labels=y.squeeze(-1), index=index)


def hyper_parameters(checkout: Path, layers: int, batch: int, epochs: int, patience: int, n_train: int):
    """`main.py`'s `hyp_params`: the module run (not as __main__) on its parser, with stand-in data."""
    sys.path.insert(0, str(checkout))
    import src.utils

    sizes = {"train": n_train, "valid": VALID_BATCHES * batch, "test": VALID_BATCHES * batch}
    src.utils.get_data = lambda args, dataset, split="train": Dataset(sizes[split])
    zero = [f"--{k}" for k in ("attn_dropout", "attn_dropout_a", "attn_dropout_v", "relu_dropout", "embed_dropout",
                               "res_dropout", "out_dropout")]
    sys.argv = ["main.py", "--nlevels", str(layers), "--batch_size", str(batch), "--num_epochs", str(epochs),
                "--when", str(patience), *[a for k in zero for a in (k, "0.0")]]
    spec = importlib.util.spec_from_file_location("mult_reference_main", checkout / "main.py")
    main = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(main)
    return main.hyp_params


def float64_throughout() -> None:
    """In a float64 run, `Tensor.float()` leaves a float64 tensor as it is: the reference's attention
    upcasts its logits with `.float()` before the softmax (fairseq's guard for half precision), which
    would compute every softmax of a float64 run in float32."""
    to_float = torch.Tensor.float
    torch.Tensor.float = lambda self, *a, **k: self if self.dtype == torch.float64 else to_float(self, *a, **k)


def compatible(train_module) -> None:
    """What today's torch no longer takes (see the module's docstring)."""
    class Plateau(torch.optim.lr_scheduler.ReduceLROnPlateau):
        def __init__(self, *args, verbose=False, **kwargs):
            super().__init__(*args, **kwargs)

    def load_model(args, name=""):
        return torch.load(f"pre_trained_models/{train_module.save_load_name(args, name)}.pt", weights_only=False)

    import modules.position_embedding as positions

    make_positions = positions.make_positions
    train_module.ReduceLROnPlateau = Plateau
    train_module.load_model = load_model
    positions.make_positions = lambda *a, **k: make_positions(*a, **k).contiguous()
    builtins.input = lambda *a: ""


def our_config(layers: int, batch: int, epochs: int, patience: int):
    from xmodal.jobs.mult_config import MultTrainConfig

    zero = ("attn_dropout", "attn_dropout_a", "attn_dropout_v", "relu_dropout", "res_dropout", "embed_dropout",
            "text_dropout", "out_dropout")
    cfg = load_config(MultTrainConfig, overrides=[
        "recipe=mult-reference", "preset=reference", f"model.layers={layers}", f"train.batch_size={batch}",
        f"train.epochs={epochs}", f"optim.plateau.patience={patience}", "train.precision=fp32",
        *[f"model.{k}=0.0" for k in zero]])
    model = cfg.model.replace(l_dim=DIMS["text"], a_dim=DIMS["audio"], v_dim=DIMS["vision"], output_dim=1).validate()
    return cfg.model_copy(update={"model": model})


def valid_loss(objective, batches) -> float:
    """The mean validation loss over the samples (each batch's mean times its size), as both compute it."""
    objective.eval()
    with torch.no_grad():
        total = sum(float(objective(our_batch(b))["loss"]) * len(b[0][0]) for b in batches)
    return total / sum(len(b[0][0]) for b in batches)


class Side:
    """Ours (the recipe: Adam, plateau, `train_step`) or the floor (our model, the reference's optimizer,
    scheduler and loop body)."""

    def __init__(self, objective, cfg, steps: int, reference: bool):
        self.objective = objective
        if reference:
            self.opt = torch.optim.Adam(objective.parameters(), lr=cfg.optim.lr)
            self.plateau = torch.optim.lr_scheduler.ReduceLROnPlateau(self.opt, mode="min", patience=cfg.optim.plateau.patience,
                                                                      factor=0.1)
            self.state = None
        else:
            self.state = prepare(objective, torch.device("cpu"), cfg.train, cfg.optim, total_steps=steps)
        self.clip = cfg.optim.grad_clip

    def lr(self) -> float:
        return current_lr(self.state.optimizer, self.state.scheduler) if self.state else self.opt.param_groups[0]["lr"]

    def step(self, batch) -> float:
        if self.state is not None:
            return float(train_step(self.state, [batch])["loss"])
        self.objective.train()
        self.objective.zero_grad()
        loss = self.objective(batch)["loss"]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.objective.parameters(), self.clip)
        self.opt.step()
        return float(loss)

    def epoch_end(self, batches) -> None:
        loss = valid_loss(self.objective, batches)
        if self.state is not None:
            epoch_ended(self.state, {"valid/loss": loss}, "valid/loss")
        else:
            self.plateau.step(loss)


def run_mult(checkout: Path, dtype: torch.dtype, epochs: int, steps: int, layers: int, patience: int, emit,
             seed: int = 1111) -> list[Row]:
    """The reference's `initiate` + `train_model` against our MulT job's pieces under `recipe=mult-reference`."""
    from xmodal.jobs.mult_job import MultJob

    batch = 6
    work = Path(tempfile.mkdtemp(prefix="recipes-mult-"))
    (work / "pre_trained_models").mkdir()
    os.chdir(work)
    hyp = hyper_parameters(checkout, layers, batch, epochs, patience, steps * batch)
    from src import models
    from src import train as ref

    compatible(ref)
    if dtype == torch.float64:
        float64_throughout()
    torch.set_default_dtype(dtype)
    g = torch.Generator().manual_seed(seed)
    data = [make_batches(steps, batch, dtype, g, False) for _ in range(epochs)]
    valid, test = (make_batches(VALID_BATCHES, batch, dtype, g, True) for _ in range(2))
    cfg = our_config(layers, batch, epochs, patience)
    torch.manual_seed(seed)
    sides = {"ours": Side(MultJob().build_objective(cfg, SimpleNamespace(task="sentiment")).to(dtype), cfg,
                          epochs * steps, reference=False)}
    start = to_reference_state_dict(sides["ours"].objective.model)
    if dtype == torch.float32:
        floor = MultJob().build_objective(cfg, SimpleNamespace(task="sentiment")).to(dtype)
        floor.load_state_dict(sides["ours"].objective.state_dict())
        sides["floor"] = Side(floor, cfg, epochs * steps, reference=True)
    return lockstep(ref, models, hyp, data, valid, test, start, sides, steps, emit)


def lockstep(ref, models, hyp, data, valid, test, start, sides, steps: int, emit) -> list[Row]:
    """The reference's `initiate` run with hooks: after each of its optimizer steps, ours and the
    floor's on the same batch; after each of its plateau steps, ours."""
    rows: list[Row] = []
    seen = {"model": None, "lr": 0.0, "ours_lr": 0.0}

    original = models.MULTModel

    def started(hyp_params):  # the reference's model, from our initial weights (built once)
        models.MULTModel = original  # its __init__ calls super(MULTModel, self); its save pickles the class
        model = original(hyp_params)
        model.load_state_dict({k: v.to(torch.get_default_dtype()) for k, v in start.items()}, strict=True)
        seen["model"] = model
        return model

    class Watched(ref.ReduceLROnPlateau):  # each epoch's end: ours and the floor's plateau, the drops noted
        def step(self, metrics, *args, **kwargs):
            before = self.optimizer.param_groups[0]["lr"]
            super().step(metrics, *args, **kwargs)
            for side in sides.values():
                side.epoch_end(valid)
            after = self.optimizer.param_groups[0]["lr"]
            if after != before and rows:
                rows[-1].note = f"plateau: reference lr {before:g} -> {after:g}, ours -> {sides['ours'].lr():g}"
                print(f"{'':5} {rows[-1].note}", flush=True)

    models.MULTModel, ref.ReduceLROnPlateau = started, Watched

    def before(opt, *_):
        if opt.param_groups[0]["params"][0] is next(seen["model"].parameters()):
            seen["lr"], seen["ours_lr"] = opt.param_groups[0]["lr"], sides["ours"].lr()

    def after(opt, *_):
        if opt.param_groups[0]["params"][0] is not next(seen["model"].parameters()):
            return
        k = len(rows)
        batch = our_batch(data[k // steps][k % steps])
        ref_params = {name: p.detach() for name, p in seen["model"].named_parameters()}

        def params(objective) -> float:  # parameters only: MULTModel's buffers are not trained
            converted = to_reference_state_dict(objective.model)
            return param_diff(ref_params, {name: converted[name] for name in ref_params})

        row = Row(k + 1, float(seen["loss"]), sides["ours"].step(batch), seen["lr"], seen["ours_lr"],
                  params(sides["ours"].objective))
        if "floor" in sides:
            row.floor_loss = sides["floor"].step(batch)
            row.floor_params = params(sides["floor"].objective)
        rows.append(row)
        emit(row)

    class Loss(torch.nn.L1Loss):  # the reference's criterion, its training value kept
        def forward(self, preds, target):
            out = super().forward(preds, target)
            if torch.is_grad_enabled():
                seen["loss"] = out.detach()
            return out

    torch.nn.L1Loss = Loss  # `initiate` takes getattr(nn, hyp_params.criterion)()
    register_optimizer_step_pre_hook(lambda opt, a, k: before(opt))
    register_optimizer_step_post_hook(lambda opt, a, k: after(opt))
    ref.initiate(hyp, Loader(data), Loader([valid]), Loader([test]))
    return rows


class Loader:
    """Each iteration the next epoch's batches (valid and test: the same each time)."""

    def __init__(self, epochs: list[list]):
        self.epochs, self.next = epochs, 0

    def __iter__(self):
        epoch = self.epochs[min(self.next, len(self.epochs) - 1)]
        self.next += 1
        return iter(epoch)
