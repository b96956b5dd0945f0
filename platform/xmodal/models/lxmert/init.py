"""Start LXMERT fine-tuning from pretrained weights. Imports torch only (and `xmodal.base.errors`).

- `load_pretrained_encoder(model, state_dict)`: the `encoder.*` weights of a pretraining state
  dict into a fine-tuning model (strict: every key, every shape).
- `init_answer_head_from_qa(model, state_dict, source_rows)`: the reference's `load_lxmert_qa`
  trick: the pretraining QA head (fc1, LayerNorm) copied whole, and the output rows of the answers
  both tables share copied row by row. Which answers are shared is the data layer's business
  (`xmodal.data.answers.AnswerTable.index` normalises them): the caller passes, for each
  fine-tuning answer, the pretraining row it takes or None.
- `encoder_state_from_hf_dir(path)`: (config, our state dict) from a transformers
  `LxmertForPreTraining` checkpoint directory, for the two functions above.
- `reference_weights(path)` / `convert_reference_state_dict(sd)`: (config, our state dict, which
  fine-tuning head it holds) from a snapshot of the reference code (airsplay/lxmert): the pretrained
  `model_LXRT.pth` or a fine-tuned `BEST.pth` (VQA / GQA / NLVR2); `load_finetuned_head` copies a
  fine-tuned head into a model whose head has the same shapes.
- `reference_incompatibilities(config)` / `to_reference_state_dict(config, state_dict, head)`: the
  other direction (`xmodal.export`): what the reference cannot hold, and our state dict in its layout.

Accepted state dicts: `LxmertForPretraining.state_dict()` (`encoder.*`), the pretraining job's
`model.pt` (the objective's state dict: `model.encoder.*`), and either of those with DDP
(`module.`) or torch.compile (`_orig_mod.`) prefixes. A fine-tuning model's state dict works too.
"""

from __future__ import annotations

import os
import re
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from xmodal.base.errors import UserError
from xmodal.models.lxmert.model import LxmertConfig

# Leading key parts added by wrappers: DDP, torch.compile, and the objective holding the model.
_WRAPPER_PARTS = ("module", "_orig_mod", "model")
ENCODER_PREFIX = "encoder."
QA_PREFIX = "qa_head."


class PretrainedWeightsError(UserError):
    """A pretrained state dict does not fit the model; the message lists every offending key."""


def strip_wrappers(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Drop leading `module.` / `_orig_mod.` / `model.` parts from every key.

    None of our LXMERT modules has a child with one of these names, so the first remaining
    part is the model's own attribute (`encoder`, `qa_head`, ...).
    """
    out: dict[str, Tensor] = {}
    for key, value in state_dict.items():
        parts = key.split(".")
        i = 0
        while i < len(parts) - 1 and parts[i] in _WRAPPER_PARTS:
            i += 1
        name = ".".join(parts[i:])
        if name in out:
            raise PretrainedWeightsError(f"two entries become {name!r} once wrapper prefixes are dropped "
                                         f"(one is {key!r}); pass the state dict of one model")
        out[name] = value
    return out


def _section(state_dict: Mapping[str, Tensor], prefix: str, what: str) -> dict[str, Tensor]:
    sd = strip_wrappers(state_dict)
    sub = {k[len(prefix):]: v for k, v in sd.items() if k.startswith(prefix)}
    if not sub:
        sample = ", ".join(list(state_dict)[:4])
        hint = (" It looks like a transformers checkpoint: use encoder_state_from_hf_dir."
                if any(k.startswith(("lxmert.", "answer_head.")) for k in sd) else "")
        raise PretrainedWeightsError(f"the state dict has no {what} entries ({prefix}*); its keys start "
                                     f"with: {sample}.{hint}")
    return sub


def _listing(items: list[str], sep: str = ", ", limit: int = 12) -> str:
    more = f"{sep}... ({len(items) - limit} more)" if len(items) > limit else ""
    return sep.join(items[:limit]) + more


def _check(target: Mapping[str, Tensor], source: Mapping[str, Tensor], prefix: str) -> None:
    """Raise one error naming every missing key, unexpected key and shape mismatch."""
    # In state-dict order: the embeddings come first, whose shapes show a size mismatch plainly.
    missing = [k for k in target if k not in source]
    unexpected = [k for k in source if k not in target]
    shapes = [f"{prefix}{k}: checkpoint {tuple(source[k].shape)}, model {tuple(target[k].shape)}"
              for k in target if k in source and source[k].shape != target[k].shape]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing from the checkpoint: " + _listing([prefix + k for k in missing]))
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected in the checkpoint: "
                        + _listing([prefix + k for k in unexpected]))
    if shapes:
        problems.append(f"{len(shapes)} shape mismatches: " + _listing(shapes, "; "))
    if problems:
        raise PretrainedWeightsError(
            "pretrained weights do not fit the model (is the model built with the pretraining config?): "
            + " | ".join(problems))


@torch.no_grad()
def load_pretrained_encoder(model: nn.Module, state_dict: Mapping[str, Tensor]) -> nn.Module:
    """Copy the `encoder.*` entries of a pretraining state dict into `model.encoder` (strict).

    Every encoder entry must be present with the model's shape; the other entries (pretraining
    heads) are ignored. Raises `PretrainedWeightsError` naming each missing or unexpected key
    and each shape mismatch with both shapes. Returns `model`.
    """
    source = _section(state_dict, ENCODER_PREFIX, "encoder")
    target = model.encoder.state_dict()
    _check(target, source, ENCODER_PREFIX)
    model.encoder.load_state_dict(source, strict=True)
    return model


@torch.no_grad()
def init_answer_head_from_qa(
    model: nn.Module,
    pretrain_state_dict: Mapping[str, Tensor],
    source_rows: Sequence[int | None],
    *,
    num_pretrain_answers: int | None = None,
    zero_unmatched: bool = True,
) -> int:
    """Initialise `model.answer_head` from the pretraining QA head (reference `load_lxmert_qa`).

    fc1 and the LayerNorm are copied whole. `source_rows[i]` is the pretraining row of fine-tuning
    answer i (the same answer, matched by the caller as the reference's `convert_ans` lookup), or
    None; output row i (weight and bias of fc2) is copied from it. With `zero_unmatched` (the
    reference) the rows of answers the pretraining table lacks are set to 0, otherwise they keep
    their initialisation. `num_pretrain_answers`, when given, must be the pretraining head's
    number of outputs (a check that the rows index the table the checkpoint was trained with).
    Returns the number of answers copied.
    """
    rows = list(source_rows)
    if any(not (r is None or (isinstance(r, int) and not isinstance(r, bool))) for r in rows):
        raise TypeError("source_rows: expected, per fine-tuning answer, a pretraining row (int) or None; "
                        "map answer strings to rows first (xmodal.data.answers.AnswerTable(pretrain).index)")
    source = _section(pretrain_state_dict, QA_PREFIX, "QA head")
    head = model.answer_head
    target = head.state_dict()
    weight, bias = source.get("fc2.weight"), source.get("fc2.bias")
    n_pre = weight.shape[0] if weight is not None else None
    if n_pre is not None and num_pretrain_answers is not None and n_pre != num_pretrain_answers:
        raise PretrainedWeightsError(f"{QA_PREFIX}fc2.weight has {n_pre} rows but the pretraining answer "
                                     f"table has {num_pretrain_answers} answers; expected the same table")
    if len(rows) != target["fc2.weight"].shape[0]:
        raise PretrainedWeightsError(f"source_rows has {len(rows)} answers but the model's "
                                     f"answer head has {target['fc2.weight'].shape[0]} outputs")
    if n_pre is not None:
        bad = [f"{i} -> {r}" for i, r in enumerate(rows) if r is not None and not 0 <= r < n_pre]
        if bad:
            raise PretrainedWeightsError(f"source_rows outside the pretraining head's {n_pre} rows: "
                                         + _listing(bad))
    # fc2 differs in rows by design: compare its input width only.
    expect = dict(target)
    if weight is not None:
        expect["fc2.weight"] = target["fc2.weight"].new_empty((n_pre, target["fc2.weight"].shape[1]))
    if bias is not None:
        expect["fc2.bias"] = target["fc2.bias"].new_empty((bias.shape[0],))
    _check(expect, source, QA_PREFIX)

    head.fc1.load_state_dict({"weight": source["fc1.weight"], "bias": source["fc1.bias"]})
    head.norm.load_state_dict({"weight": source["norm.weight"], "bias": source["norm.bias"]})
    copied = 0
    for i, j in enumerate(rows):
        if j is not None:
            head.fc2.weight[i] = weight[j]
            head.fc2.bias[i] = bias[j]
            copied += 1
        elif zero_unmatched:
            head.fc2.weight[i] = 0.0
            head.fc2.bias[i] = 0.0
    return copied


def encoder_state_from_hf_dir(path: str | os.PathLike) -> tuple[LxmertConfig, dict[str, Tensor]]:
    """Our config and full `LxmertForPretraining` state dict (encoder and heads, QA head included)
    from a local transformers `LxmertForPreTraining` checkpoint directory (no network).

    Builds the pretraining model once (strict conversion in `lxmert_hf`); build the fine-tuning
    model with the returned config (dropout can be changed with `config.replace`).
    """
    from xmodal.models.lxmert.hf import from_pretrained_dir

    pretrained = from_pretrained_dir(path)
    return pretrained.config, pretrained.state_dict()


# -- the reference code's snapshots (airsplay/lxmert) -------------------------------------------
#
# `LXMERT.save` (src/pretrain/lxmert_pretrain.py) saves `LXRTPretraining.state_dict()`: `bert.*`
# (LXRTModel), `cls.*`, `obj_predict_head.*`, `answer_head.logit_fc.{0,2,3}.*`, with `module.` in
# front when trained under DataParallel (--multiGPU). The tasks' `save` (src/tasks/*.py) saves the
# task model: `lxrt_encoder.model.bert.*` (`lxrt_encoder.model.module.bert.*` under --multiGPU) and
# `logit_fc.{0,2,3}.*`. transformers' LXMERT port kept the reference's names below the top level,
# so after `bert.` -> `lxmert.` the names go through the transformers mapping (`lxmert_hf.key_map`).

REFERENCE_HEAD_SIZE = 64  # BERT-base's 768 / 12: the reference always builds bert-base-uncased's config
_REF_ENCODER = "bert."
_REF_FINETUNED = "lxrt_encoder.model."
_REF_PRETRAIN_HEADS = ("cls.", "obj_predict_head.", "answer_head.")
_REF_TASK_HEAD = {"logit_fc.0": "fc1", "logit_fc.2": "norm", "logit_fc.3": "fc2"}
_TIED_DECODER = "cls.predictions.decoder.weight"


@dataclass
class ReferenceWeights:
    """A reference snapshot in our names: the architecture it fixes and our state dict.

    `state` holds `encoder.*`, the pretraining heads the snapshot has (`mlm_head.*`, `match_head.*`,
    `object_heads.*`, `qa_head.*`), and a fine-tuned snapshot's head as `answer_head.*` (VQA, GQA) or
    `classifier.*` (NLVR2), named by `head` (None for a pretrained snapshot).
    """

    config: LxmertConfig
    state: dict[str, Tensor]
    head: str | None


def _without_advice(reason: str) -> str:
    """torch's reason for refusing a file, less its advice to rerun with weights_only=False (which would
    run a foreign file's code) and its pointers to the docs and the issue tracker."""
    found = re.search(r"WeightsUnpickler error: (.*?)(?: Check the documentation of torch\.load.*)?$", reason)
    if found:
        return found.group(1)
    advice = r"weights_only|Weights only load failed|trusted source|file an issue|documentation of torch\.load"
    kept = [s for s in re.split(r"(?<=\.) ", reason) if not re.search(advice, s)]
    return " ".join(kept) or "torch's weights-only loader refused it"


def read_state_dict_file(path: str | os.PathLike) -> dict[str, Tensor]:
    """A file written by `torch.save(state_dict)`, read with `weights_only=True` (no code runs).

    Raises `PretrainedWeightsError` naming the file when it is not a torch file or holds anything
    but a mapping of names to tensors.
    """
    path = Path(path)
    # mmap (zip format, torch >= 1.6) leaves the tensors on disk until used; older files load whole.
    mmap = zipfile.is_zipfile(path)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:  # pickle, zip and torch each raise their own types for a foreign file
        # torch's whole reason on one line: for a file that needs code to load, it names the blocked
        # global (e.g. `posix.system`), which is what tells a malicious file from a foreign one.
        reason = " ".join(str(e).split())
        reason = _without_advice(reason)
        raise PretrainedWeightsError(f"{path}: not a torch state dict file ({type(e).__name__}: {reason}); "
                                     "expected a file written by torch.save(model.state_dict())") from None
    if not isinstance(obj, Mapping) or not obj \
            or not all(isinstance(k, str) and isinstance(v, Tensor) for k, v in obj.items()):
        what = f"a {type(obj).__name__}" if not isinstance(obj, Mapping) else "a mapping that is not name -> tensor"
        if isinstance(obj, Mapping) and not obj:
            what = "an empty mapping"
        raise PretrainedWeightsError(f"{path}: holds {what}; expected a state dict (parameter name -> tensor)")
    return dict(obj)


def _reference_names(state_dict: Mapping[str, Tensor], source: str) -> tuple[dict[str, Tensor], bool]:
    """Drop DataParallel's `module.` parts and a task model's `lxrt_encoder.model.`; True when fine-tuned."""
    out: dict[str, Tensor] = {}
    finetuned = False
    for key, value in state_dict.items():
        name = ".".join(p for p in key.split(".") if p != "module")  # no reference module is called `module`
        if name.startswith(_REF_FINETUNED):
            name, finetuned = name[len(_REF_FINETUNED):], True
        if name in out:
            raise PretrainedWeightsError(f"{source}: two entries become {name!r} once `module.` and "
                                         f"`lxrt_encoder.model.` are dropped (one is {key!r})")
        out[name] = value
    return out, finetuned


def _count_layers(sd: Mapping[str, Tensor], prefix: str) -> int:
    found = {int(m.group(1)) for k in sd if (m := re.match(re.escape(prefix) + r"(\d+)\.", k))}
    return max(found) + 1 if found else 0  # gaps show up as missing keys in the strict mapping


def _reference_config(sd: Mapping[str, Tensor], source: str) -> LxmertConfig:
    """The architecture, from the tensors' shapes; what shapes cannot tell is the reference's (bert-base)."""
    from xmodal.models.lxmert.hf import HF_DEFAULTS, config_from_hf

    def shape(key: str, dim: int, default: int | None = None) -> int:
        if key not in sd:
            if default is not None:
                return default
            raise PretrainedWeightsError(f"{source}: {key} is missing; expected a reference LXMERT snapshot")
        return int(sd[key].shape[dim])

    hidden = shape("bert.embeddings.word_embeddings.weight", 1)
    if hidden % REFERENCE_HEAD_SIZE:
        raise PretrainedWeightsError(
            f"{source}: hidden size {hidden} is not a multiple of {REFERENCE_HEAD_SIZE}; the reference's attention "
            f"heads are {REFERENCE_HEAD_SIZE} wide (bert-base: 768 = 12 x 64), so the head count cannot be told")
    layer = "bert.encoder.layer.0.intermediate.dense.weight"
    inter = layer if layer in sd else "bert.encoder.x_layers.0.lang_inter.dense.weight"
    hf = {
        "vocab_size": shape("bert.embeddings.word_embeddings.weight", 0),
        "hidden_size": hidden,
        "num_attention_heads": hidden // REFERENCE_HEAD_SIZE,
        "intermediate_size": shape(inter, 0, HF_DEFAULTS["intermediate_size"]),
        "l_layers": _count_layers(sd, "bert.encoder.layer."),
        "x_layers": _count_layers(sd, "bert.encoder.x_layers."),
        "r_layers": _count_layers(sd, "bert.encoder.r_layers."),
        "max_position_embeddings": shape("bert.embeddings.position_embeddings.weight", 0),
        "type_vocab_size": shape("bert.embeddings.token_type_embeddings.weight", 0),
        "visual_feat_dim": shape("bert.encoder.visn_fc.visn_fc.weight", 1),
        "visual_pos_dim": shape("bert.encoder.visn_fc.box_fc.weight", 1),
        # Heads a snapshot may lack (a fine-tuned one has none): the reference's sizes.
        "num_object_labels": shape("obj_predict_head.decoder_dict.obj.weight", 0, HF_DEFAULTS["num_object_labels"]),
        "num_attr_labels": shape("obj_predict_head.decoder_dict.attr.weight", 0, HF_DEFAULTS["num_attr_labels"]),
        "num_qa_labels": shape("answer_head.logit_fc.3.weight", 0, HF_DEFAULTS["num_qa_labels"]),
    }
    try:
        return config_from_hf(hf)  # dropout 0.1 and initializer_range 0.02: bert-base's, as the reference
    except ValueError as e:
        raise PretrainedWeightsError(f"{source}: {e}") from None


def _head_group(ours: str) -> str:
    """Entries that come together: the QA head whole, every other module its weight with its bias."""
    return "qa_head" if ours.startswith("qa_head.") else ours.rsplit(".", 1)[0]


def convert_reference_state_dict(state_dict: Mapping[str, Tensor], source: str = "the state dict"
                                 ) -> ReferenceWeights:
    """A reference snapshot's state dict (see `ReferenceWeights`) in our names; strict.

    Every encoder entry must be there; each pretraining head is taken whole or not at all; every
    entry of the snapshot must find a place. Raises `PretrainedWeightsError` starting with `source`
    and listing the missing and unexpected keys (in the reference's names).
    """
    from xmodal.models.lxmert.hf import key_map

    sd, finetuned = _reference_names(state_dict, source)
    if "bert.embeddings.word_embeddings.weight" not in sd:
        hint = ""
        if any(k.startswith("lxmert.") for k in sd):
            hint = " It looks like a transformers checkpoint: use --init transformers with its directory."
        elif any(re.match(r"((module|_orig_mod|model)\.)*encoder\.", k) for k in state_dict):
            hint = " It looks like an xmodal checkpoint: use --init checkpoint with its folder."
        raise PretrainedWeightsError(
            f"{source}: not a reference LXMERT snapshot (no bert.embeddings.word_embeddings.weight, with or without "
            f"module. / lxrt_encoder.model. in front); its keys start with: {_listing(list(state_dict), limit=4)}.{hint}")
    config = _reference_config(sd, source)
    hf = {("lxmert." + k[len(_REF_ENCODER):] if k.startswith(_REF_ENCODER) else k): v for k, v in sd.items()}
    rows = key_map(config)
    groups: dict[str, list[tuple[str, list[str]]]] = {}
    for ours, theirs in rows:
        groups.setdefault("encoder" if ours.startswith("encoder.") else _head_group(ours), []).append((ours, theirs))
    out: dict[str, Tensor] = {}
    used: set[str] = set()
    missing: list[str] = []
    for group, members in groups.items():
        # A head is there when any of its own entries is (the tied MLM decoder reads the embedding).
        head_keys = {t for _, theirs in members for t in theirs if not t.startswith("lxmert.")}
        if group != "encoder" and not head_keys & hf.keys():
            continue
        for ours, theirs in members:
            absent = [t for t in theirs if t not in hf]
            if absent:
                missing += [_reference_key(t, finetuned) for t in absent]
                continue
            out[ours] = hf[theirs[0]] if len(theirs) == 1 else torch.cat([hf[t] for t in theirs], dim=0)
            used.update(theirs)
    if _TIED_DECODER in hf:
        used.add(_TIED_DECODER)
        word = hf["lxmert.embeddings.word_embeddings.weight"]
        if hf[_TIED_DECODER].shape != word.shape or not torch.equal(hf[_TIED_DECODER], word):
            raise PretrainedWeightsError(f"{source}: {_TIED_DECODER} differs from bert.embeddings.word_embeddings"
                                         ".weight; our MLM decoder is tied to the word embedding, as the reference's")
    head = None
    if any(k.startswith("logit_fc.") for k in hf):
        fc1 = hf.get("logit_fc.0.weight")
        # VQA/GQA classify the pooled output (D wide), NLVR2 the two images' pooled outputs side by side (2D).
        head = "classifier" if fc1 is not None and fc1.shape[1] == 2 * config.hidden_size else "answer_head"
        for theirs, mine in _REF_TASK_HEAD.items():
            for p in ("weight", "bias"):
                if f"{theirs}.{p}" in hf:
                    out[f"{head}.{mine}.{p}"] = hf[f"{theirs}.{p}"]
                    used.add(f"{theirs}.{p}")
                else:
                    missing.append(f"{theirs}.{p}")
    unexpected = [_reference_key(k, finetuned) for k in hf if k not in used]
    problems = []
    if missing:
        problems.append(f"{len(missing)} missing from the checkpoint: " + _listing(missing))
    if unexpected:
        problems.append(f"{len(unexpected)} unexpected in the checkpoint: " + _listing(unexpected))
    if problems:
        raise PretrainedWeightsError(
            f"{source}: the reference snapshot does not fit an LXMERT of the architecture its shapes give "
            f"({config.l_layers}/{config.x_layers}/{config.r_layers} language/cross/object layers, hidden "
            f"{config.hidden_size}; keys without module.): " + " | ".join(problems))
    return ReferenceWeights(config, out, head)


def _reference_key(hf_key: str, finetuned: bool) -> str:
    """A key as the reference names it (for error messages)."""
    if hf_key.startswith("lxmert."):
        return (_REF_FINETUNED if finetuned else "") + _REF_ENCODER + hf_key[len("lxmert."):]
    return hf_key


def reference_weights(path: str | os.PathLike) -> ReferenceWeights:
    """`convert_reference_state_dict` of a reference snapshot file (`torch.load(weights_only=True)`)."""
    return convert_reference_state_dict(read_state_dict_file(path), source=str(path))


@torch.no_grad()
def load_finetuned_head(model: nn.Module, weights: ReferenceWeights) -> bool:
    """Copy a fine-tuned snapshot's head into `model` when the model has that head with the same shapes.

    Returns False (and copies nothing) for a pretrained snapshot, another task's head (the NLVR2 pair
    classifier for a QA model, another answer count) or NLVR2's sigmoid output (the reference's is a
    2-way softmax). The answer rows are copied by index: the answer table must be the reference's.
    """
    if weights.head is None or not hasattr(model, weights.head):
        return False
    prefix = weights.head + "."
    source = {k[len(prefix):]: v for k, v in weights.state.items() if k.startswith(prefix)}
    target = getattr(model, weights.head).state_dict()
    if source.keys() != target.keys() or any(source[k].shape != target[k].shape for k in target):
        return False
    getattr(model, weights.head).load_state_dict(source, strict=True)
    return True


def reference_incompatibilities(config: LxmertConfig) -> list[str]:
    """The options of `config` the reference code has no equivalent of, one line each (empty: a
    snapshot can hold the model). The reference is what transformers ported, plus bert-base's
    64-wide heads (the head count is not in a snapshot: `reference_weights` derives it)."""
    from xmodal.models.lxmert.hf import hf_incompatibilities

    problems = [p.replace("transformers' LXMERT", "the reference") for p in hf_incompatibilities(config)]
    if config.hidden_size != config.num_heads * REFERENCE_HEAD_SIZE:
        problems.append(f"num_heads={config.num_heads} at hidden_size={config.hidden_size} (the reference's heads are "
                        f"{REFERENCE_HEAD_SIZE} wide: num_heads must be hidden_size / {REFERENCE_HEAD_SIZE})")
    return problems


def to_reference_state_dict(config: LxmertConfig, state_dict: Mapping[str, Tensor], head: str | None = None
                            ) -> dict[str, Tensor]:
    """Our state dict in the reference's layout, the inverse of `convert_reference_state_dict`:
    an `LxmertForPretraining` one (`head` None) as `LXRTPretraining.state_dict()` (model_LXRT.pth:
    `bert.*`, `cls.*` with the tied decoder under both names, `obj_predict_head.*`,
    `answer_head.logit_fc.*`); a fine-tuning model's (`head` `answer_head`: VQA / GQA, `classifier`:
    NLVR2's 2-way softmax) as a task's BEST.pth (`lxrt_encoder.model.bert.*`, `logit_fc.{0,2,3}.*`).
    A model without a token-type embedding gets a zero table (the reference adds row 0)."""
    from xmodal.models.lxmert.hf import to_hf_state_dict

    sd = strip_wrappers(state_dict)
    if head is None:
        hf = to_hf_state_dict(config, sd, "pretraining")
        return {(_REF_ENCODER + k[len("lxmert."):] if k.startswith("lxmert.") else k): v for k, v in hf.items()}
    if head not in ("answer_head", "classifier"):
        raise KeyError(f"head {head!r}; expected None (pretraining), 'answer_head' or 'classifier'")
    prefix = head + "."
    rest = [k for k in sd if not k.startswith((ENCODER_PREFIX, prefix))]
    if rest:
        raise KeyError(f"entries neither encoder nor {head}: {', '.join(rest[:8])}")
    hf = to_hf_state_dict(config, {k: v for k, v in sd.items() if k.startswith(ENCODER_PREFIX)}, "encoder")
    out = {_REF_FINETUNED + _REF_ENCODER + k[len("lxmert."):]: v for k, v in hf.items()}
    for theirs, mine in _REF_TASK_HEAD.items():
        for p in ("weight", "bias"):
            out[f"{theirs}.{p}"] = sd[f"{prefix}{mine}.{p}"].detach()
    return out
