"""Recipes: the training of a paper's reference code (or of the paper, where it says otherwise), as a
named set of config values, each with the file or section it comes from (`recipe=NAME`, `--recipe NAME`).

A recipe sets the training (optimizer, schedule, warm-up, clip, batch, epochs, rate, the losses and
their scaling, model selection), never the architecture: the model is the `preset` key (the papers'
models are the presets `paper`, `reference`, `paper_mosei`, ...). A key the user sets beside a recipe
wins; the run says so (its banner's `recipe` line and the MLflow param `recipe_overrides`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from xmodal.config.paths import set_dotted

LXMERT = "airsplay/lxmert"
MULT = "yaohungt/Multimodal-Transformer"


@dataclass(frozen=True)
class Setting:
    value: Any
    source: str  # the file (or paper section) the value comes from, and where in it


@dataclass(frozen=True)
class Recipe:
    job: str  # the job whose config takes it: pretrain | finetune | mult
    what: str  # one line
    repo: str  # the code it comes from
    settings: dict[str, Setting]  # dotted config key -> value and source

    def values(self) -> dict[str, Any]:
        return {k: s.value for k, s in self.settings.items()}


def _s(value: Any, source: str) -> Setting:
    return Setting(value, source)


def _rate(lr: float) -> str:
    """1e-05 as the scripts write it: 1e-5."""
    return f"{lr:.0e}".replace("e-0", "e-")


_OPT = "src/lxrt/optimization.py"
_MODELING = "src/lxrt/modeling.py"
# Every LXMERT task of the reference: BertAdam over list(model.parameters()), its defaults, padding_idx=0.
_BERTADAM = {
    "optim.name": _s("bertadam", "{task}: BertAdam (--optim bert)"),
    "optim.schedule": _s("linear", f"{_OPT}: BertAdam(schedule='warmup_linear'), its default"),
    "optim.decay_on": _s("all", "{task}: BertAdam(list(self.model.parameters()), ...)"),
    "optim.weight_decay": _s(0.01, f"{_OPT}: BertAdam(weight_decay=0.01), its default"),
    "optim.betas": _s((0.9, 0.999), f"{_OPT}: BertAdam(b1=0.9, b2=0.999), its defaults"),
    "optim.eps": _s(1e-6, f"{_OPT}: BertAdam(e=1e-6), its default"),
    "optim.embedding_row0": _s("no_grad", f"{_MODELING}: BertEmbeddings, nn.Embedding(..., padding_idx=0)"),
}


def _bert(code: str, settings: dict[str, Setting]) -> dict[str, Setting]:
    out = {k: Setting(s.value, s.source.format(task=code)) for k, s in _BERTADAM.items()}
    return {**out, **settings}


def _finetune(task: str, script: str, lr: float, **more: Setting) -> dict[str, Setting]:
    code = f"src/tasks/{task}.py"
    return _bert(code, {
        "task": _s(task, f"{script}: python {code}"),
        "optim.lr": _s(lr, f"{script}: --lr {_rate(lr)}"),
        "optim.warmup_ratio": _s(0.1, f"{code}: BertAdam(warmup=0.1)"),
        "optim.grad_clip": _s(5.0, f"{code}: nn.utils.clip_grad_norm_(self.model.parameters(), 5.)"),
        "train.batch_size": _s(32, f"{script}: --batchSize 32"),
        "train.epochs": _s(4, f"{script}: --epochs 4"),
        "train.best_metric": _s("valid/accuracy", f"{code}: self.save('BEST') on the best valid score"),
        "train.best_mode": _s("max", f"{code}: valid_score > best_valid"),
        **more,
    })


_PRE = "src/pretrain/lxmert_pretrain.py"
_PRE_BASH = "run/lxmert_pretrain.bash"
_PRETRAIN = _bert(_PRE, {
    "optim.lr": _s(1e-4, f"{_PRE_BASH}: --lr 1e-4"),
    "optim.warmup_ratio": _s(0.05, f"{_PRE}: warmup_ratio = 0.05"),
    "optim.grad_clip": _s(1.0, f"{_PRE}: nn.utils.clip_grad_norm_(self.model.parameters(), 1.)"),
    "train.batch_size": _s(256, f"{_PRE_BASH}: --batchSize 256"),
    "train.epochs": _s(20, f"{_PRE_BASH}: --epochs 20"),
    "train.best_metric": _s("eval/loss", f"{_PRE}: self.save('BEST_EVAL_LOSS') on the lowest valid loss"),
    "train.best_mode": _s("min", f"{_PRE}: avg_eval_loss < best_eval_loss"),
    "tasks.mlm": _s(True, f"{_PRE_BASH}: --taskMaskLM"),
    "tasks.obj_feat": _s(True, f"{_PRE_BASH}: --taskObjPredict --visualLosses obj,attr,feat"),
    "tasks.obj_label": _s(True, f"{_PRE_BASH}: --taskObjPredict --visualLosses obj,attr,feat"),
    "tasks.matching": _s(True, f"{_PRE_BASH}: --taskMatched"),
    "tasks.qa": _s(True, f"{_PRE_BASH}: --taskQA"),
    "schedule.qa_from_fraction": _s(0.0, f"{_MODELING}: LXRTPretraining.forward ('this Github version pre-trains "
                                         "with QA loss from the beginning')"),
    "tasks.feat_loss": _s("smooth_l1", f"{_MODELING}: visual_losses 'l2': SmoothL1Loss"),
    "tasks.feat_loss_mean": _s("all", f"{_MODELING}: (visn_loss * mask_conf.view(-1)).mean()"),
    "tasks.label_objects": _s("all", f"{_MODELING}: the obj and attr losses over every object"),
    "tasks.label_confidence_weighted": _s(True, f"{_MODELING}: weighted by the detector's confidences"),
    "tasks.visual_loss_scale": _s(1 / 0.15, f"{_MODELING}: VISUAL_CONFIG.visual_loss_config weight 1/0.15"),
    "data.masking.word_mask_prob": _s(0.15, f"{_PRE_BASH}: --wordMaskRate 0.15"),
    "data.masking.obj_mask_prob": _s(0.15, f"{_PRE_BASH}: --objMaskRate 0.15"),
    "data.masking.mismatch_prob": _s(0.5, "src/pretrain/lxmert_data.py: random.random() < 0.5"),
    "data.masking.qa_target": _s("sample", f"{_PRE}: np.random.multinomial over the answers' scores"),
})

_PAPER = "LXMERT paper"
_MAIN = "main.py"
_TRAIN = "src/train.py"
_MULT_REFERENCE = {
    "optim.name": _s("adam", f"{_MAIN}: --optim Adam"),
    "optim.schedule": _s("plateau", f"{_TRAIN}: ReduceLROnPlateau, scheduler.step(val_loss) once per epoch"),
    "optim.plateau.metric": _s("valid/loss", f"{_TRAIN}: scheduler.step(val_loss)"),
    "optim.plateau.mode": _s("min", f"{_TRAIN}: ReduceLROnPlateau(mode='min')"),
    "optim.plateau.patience": _s(20, f"{_MAIN}: --when 20"),
    "optim.plateau.factor": _s(0.1, f"{_TRAIN}: ReduceLROnPlateau(factor=0.1)"),
    "optim.plateau.threshold": _s(1e-4, f"{_TRAIN}: ReduceLROnPlateau's default threshold"),
    "optim.lr": _s(1e-3, f"{_MAIN}: --lr 1e-3"),
    "optim.weight_decay": _s(0.0, f"{_TRAIN}: optim.Adam(model.parameters(), lr=...), no decay"),
    "optim.decay_on": _s("all", f"{_TRAIN}: optim.Adam(model.parameters(), ...)"),
    "optim.betas": _s((0.9, 0.999), f"{_TRAIN}: torch's Adam defaults"),
    "optim.eps": _s(1e-8, f"{_TRAIN}: torch's Adam default"),
    "optim.grad_clip": _s(0.8, f"{_MAIN}: --clip 0.8"),
    "train.batch_size": _s(24, f"{_MAIN}: --batch_size 24"),
    "train.epochs": _s(40, f"{_MAIN}: --num_epochs 40"),
    "train.best_metric": _s("valid/loss", f"{_TRAIN}: save_model when val_loss < best_valid"),
    "train.best_mode": _s("min", f"{_TRAIN}: val_loss < best_valid"),
    "regression_loss": _s("l1", f"{_MAIN}: criterion_dict.get(dataset, 'L1Loss')"),
}


def _mult_paper(dataset: str, batch: int, lr: float, epochs: int, clip: Setting) -> dict[str, Setting]:
    table = f"MulT paper, Table 5 ({dataset})"
    return {**_MULT_REFERENCE,
            "optim.lr": _s(lr, f"{table}: initial learning rate {_rate(lr)}"),
            "optim.grad_clip": clip,
            "train.batch_size": _s(batch, f"{table}: batch size {batch}"),
            "train.epochs": _s(epochs, f"{table}: {epochs} epochs")}


RECIPES: dict[str, Recipe] = {
    "lxmert-pretrain": Recipe("pretrain", "LXMERT pretraining as the reference code runs it", LXMERT, _PRETRAIN),
    "lxmert-pretrain-paper": Recipe("pretrain", "LXMERT pretraining as the paper describes it (the rest as the "
                                    "reference code)", LXMERT, {
        **_PRETRAIN,
        "schedule.qa_from_fraction": _s(0.5, f"{_PAPER} §3.3: image QA only in the last 10 of the 20 epochs"),
        "tasks.feat_loss": _s("l2", f"{_PAPER} §3.1.2: RoI-feature regression with L2 loss"),
        "tasks.feat_loss_mean": _s("masked", f"{_PAPER} §3.1.2: the loss of the masked objects"),
        "tasks.label_objects": _s("masked", f"{_PAPER} §3.1.2: the labels of the masked objects"),
        "tasks.label_confidence_weighted": _s(False, f"{_PAPER} §3.1.2: cross-entropy on the detected labels"),
        "tasks.visual_loss_scale": _s(1.0, f"{_PAPER} §3.3: the losses summed with equal weights"),
    }),
    "lxmert-vqa": Recipe("finetune", "LXMERT VQA fine-tuning as the reference code runs it", LXMERT,
                         _finetune("vqa", "run/vqa_finetune.bash", 5e-5, qa_loss=_s(
                             "bce", "src/tasks/vqa.py: BCEWithLogitsLoss, loss * logit.size(1)"))),
    "lxmert-gqa": Recipe("finetune", "LXMERT GQA fine-tuning as the reference code runs it", LXMERT,
                         _finetune("gqa", "run/gqa_finetune.bash", 1e-5, qa_loss=_s(
                             "bce", "src/tasks/gqa.py: BCEWithLogitsLoss, loss * logit.size(1) (no --mceLoss)"))),
    "lxmert-nlvr2": Recipe("finetune", "LXMERT NLVR2 fine-tuning as the reference code runs it", LXMERT,
                           _finetune("nlvr2", "run/nlvr2_finetune.bash", 5e-5, nlvr2_output=_s(
                               "softmax", "src/tasks/nlvr2_model.py: nn.Linear(hid_dim * 2, 2), CrossEntropyLoss"))),
    "lxmert-nlvr2-paper": Recipe("finetune", "LXMERT NLVR2 fine-tuning as the paper describes it (the rest as "
                                 "the reference code)", LXMERT,
                                 _finetune("nlvr2", "run/nlvr2_finetune.bash", 5e-5, nlvr2_output=_s(
                                     "sigmoid", f"{_PAPER}, Appendix B: one sigmoid output, binary cross-entropy"))),
    "mult-reference": Recipe("mult", "MulT as the reference code trains it (main.py's defaults: unaligned "
                             "CMU-MOSEI)", MULT, _MULT_REFERENCE),
    "mult-mosei-paper": Recipe("mult", "MulT on CMU-MOSEI as the paper trains it (the rest as the reference "
                               "code)", MULT, _mult_paper("CMU-MOSEI", 16, 1e-3, 20, _s(
                                   1.0, "MulT paper, Table 5 (CMU-MOSEI): gradient clip 1.0"))),
    "mult-mosi-paper": Recipe("mult", "MulT on CMU-MOSI as the paper trains it (the rest as the reference code)",
                              MULT, _mult_paper("CMU-MOSI", 128, 1e-3, 100, _s(
                                  0.8, "MulT paper, Table 5 (CMU-MOSI): gradient clip 0.8"))),
    "mult-iemocap-paper": Recipe("mult", "MulT on IEMOCAP as the paper trains it (the rest as the reference code)",
                                 MULT, _mult_paper("IEMOCAP", 32, 2e-3, 30, _s(
                                     0.8, f"{_MAIN}: --clip 0.8 (the paper's table gives none for IEMOCAP)"))),
}


def recipes_for(job: str) -> dict[str, Recipe]:
    return {name: r for name, r in RECIPES.items() if r.job == job}


def recipe_tree(name: str | None, recipes: dict[str, Recipe]) -> dict:
    """The recipe's values as a nested config dict ({} for none or an unknown name: the field's own
    check reports that)."""
    tree: dict = {}
    if name in recipes:
        for key, value in recipes[name].values().items():
            tree = set_dotted(tree, key, value)
    return tree


def _json(value: Any) -> Any:
    return json.loads(json.dumps(value))


def _recipe(cfg: Any) -> Recipe | None:
    return getattr(type(cfg), "RECIPES", {}).get(getattr(cfg, "recipe", None))


def overrides(cfg: Any, flat: dict[str, Any]) -> list[tuple[str, Any, Any]]:
    """(key, the run's value, the recipe's) for every key of the config's recipe that the run sets
    otherwise (`flat`: the config's values by dotted key, as JSON: `experiment.flatten`)."""
    recipe = _recipe(cfg)
    if recipe is None:
        return []
    return [(k, flat.get(k), v) for k, v in recipe.values().items() if flat.get(k) != _json(v)]


def _pairs(found: list[tuple[str, Any, Any]]) -> str:
    return "; ".join(f"{k}={json.dumps(v)} (recipe: {json.dumps(r)})" for k, v, r in found)


def recipe_params(cfg: Any, flat: dict[str, Any]) -> dict[str, str]:
    """The MLflow params a recipe adds to the config's own (which hold each of its values):
    `recipe_overrides`, the keys the run sets otherwise ("none" when none)."""
    return {} if _recipe(cfg) is None else {"recipe_overrides": _pairs(overrides(cfg, flat)) or "none"}


def banner_lines(cfg: Any, flat: dict[str, Any], width: int = 100) -> list[str]:
    """The start banner's recipe lines: its name and code, every value it sets, the keys overridden."""
    recipe = _recipe(cfg)
    if recipe is None:
        return []
    lines, line = [], f"{cfg.recipe} ({recipe.repo}):"
    for k, v in recipe.values().items():
        item = f" {k}={json.dumps(v)}"
        if len(line) + len(item) > width:
            lines.append(line)
            line = " "
        line += item
    lines.append(line)
    found = overrides(cfg, flat)
    lines.append(f"overridden: {_pairs(found)}" if found else "overridden: nothing")
    return lines


def describe(job: str) -> str:
    """Each recipe of a job with every value and its source (`--help`, docs/configuration.md)."""
    lines = []
    for name, r in recipes_for(job).items():
        lines.append(f"recipe {name}: {r.what} ({r.repo})")
        lines += [f"  {k} = {json.dumps(s.value)}   [{s.source}]" for k, s in r.settings.items()]
    return "\n".join(lines)


def _sources(settings: list[Setting]) -> str:
    """One `from` cell for a value several recipes share: the files, then what they say where it is the same."""
    unique = list(dict.fromkeys(x.source for x in settings))
    files = list(dict.fromkeys(x.split(":", 1)[0] for x in unique))
    rests = {x.split(":", 1)[1].strip() for x in unique}
    return f"{', '.join(files)}: {rests.pop()}" if len(rests) == 1 else "; ".join(unique)


def markdown() -> str:
    """The recipes as docs/configuration.md shows them: per code base, the values every recipe shares
    (with where they come from), then a table of the others, recipe by recipe, each value with its
    file (the full places: `--help`). A test keeps the page equal to this."""
    out = []
    for repo in dict.fromkeys(r.repo for r in RECIPES.values()):
        group = {name: r for name, r in RECIPES.items() if r.repo == repo}
        keys = list(dict.fromkeys(k for r in group.values() for k in r.settings))
        shared = [k for k in keys if all(k in r.settings for r in group.values())
                  and len({json.dumps(r.settings[k].value) for r in group.values()}) == 1]
        first = next(iter(group.values()))
        out += [f"{repo}, every recipe:", "", "| key | value | from |", "| --- | --- | --- |"]
        out += [f"| `{k}` | `{json.dumps(first.settings[k].value)}` | "
                f"{_sources([r.settings[k] for r in group.values()])} |" for k in shared]
        out += ["", "| key | " + " | ".join(f"`{n}`" for n in group) + " |", "| --- |" + " --- |" * len(group)]
        for k in (k for k in keys if k not in shared):
            cells = [f"`{json.dumps(r.settings[k].value)}` {r.settings[k].source.split(':')[0]}" if k in r.settings
                     else "-" for r in group.values()]
            out.append(f"| `{k}` | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)
