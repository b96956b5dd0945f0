"""Start LXMERT fine-tuning from pretrained weights. Imports torch only (and `xmodal.errors`).

- `load_pretrained_encoder(model, state_dict)`: the `encoder.*` weights of a pretraining state
  dict into a fine-tuning model (strict: every key, every shape).
- `init_answer_head_from_qa(model, state_dict, source_rows)`: the reference's `load_lxmert_qa`
  trick: the pretraining QA head (fc1, LayerNorm) copied whole, and the output rows of the answers
  both tables share copied row by row. Which answers are shared is the data layer's business
  (`xmodal.data.answers.AnswerTable.index` normalises them): the caller passes, for each
  fine-tuning answer, the pretraining row it takes or None.
- `encoder_state_from_hf_dir(path)`: (config, our state dict) from a transformers
  `LxmertForPreTraining` checkpoint directory, for the two functions above.

Accepted state dicts: `LxmertForPretraining.state_dict()` (`encoder.*`), the pretraining job's
`model.pt` (the objective's state dict: `model.encoder.*`), and either of those with DDP
(`module.`) or torch.compile (`_orig_mod.`) prefixes. A fine-tuning model's state dict works too.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import torch
from torch import Tensor, nn

from xmodal.errors import UserError
from xmodal.models.lxmert import LxmertConfig

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
    from xmodal.models.lxmert_hf import from_pretrained_dir

    pretrained = from_pretrained_dir(path)
    return pretrained.config, pretrained.state_dict()
