"""MulT in the layout of the reference code (yaohungt/Multimodal-Transformer, src/models.py:
`MULTModel(hyp_params)`), for export. Imports only torch.

- `reference_incompatibilities(config)`: the options the reference's MULTModel cannot hold.
- `reference_hyperparameters(config)`: the `hyp_params` fields MULTModel reads (its main.py's
  argument names), so a user builds the model the state dict fits.
- `to_reference_state_dict(model)`: our `Mult`'s weights in MULTModel's names.

The reference's layout (read from its source): `proj_l|a|v` (Conv1d, kernel 1, no bias);
`trans_<target>_with_<source>` (the crossmodal TransformerEncoders) and `trans_<m>_mem` (the
self-attention ones), each `layers.<i>.self_attn.{in_proj_weight, in_proj_bias, out_proj.*}`,
`layers.<i>.fc1|fc2`, `layers.<i>.layer_norms.0|1` (before attention, which normalises queries and
keys/values alike, and before the FFN), `layer_norm` (final), and the buffers `version` and
`embed_positions._float_tensor`; then `proj1`, `proj2`, `out_layer`. It always builds all three
`trans_<m>_mem` (a one-target model uses one of them).
"""

from __future__ import annotations

import torch
from torch import Tensor

from xmodal.models.mult.config import MultConfig
from xmodal.models.mult.model import MODALITIES, Mult

REFERENCE_DIM = 30  # MULTModel: `self.d_l, self.d_a, self.d_v = 30, 30, 30`
REFERENCE_FFN_MULT = 4  # TransformerEncoderLayer: fc1 = Linear(d, 4 d)
# Our variant -> MULTModel's (lonly, aonly, vonly). The others (unimodal, early / late fusion,
# intermediate) are not in the reference.
REFERENCE_VARIANTS: dict[str, tuple[bool, bool, bool]] = {
    "full": (True, True, True),
    "target_l": (True, False, False),
    "target_a": (False, True, False),
    "target_v": (False, False, True),
}
# Our layer names (StreamStack.stream_state) -> the reference's TransformerEncoderLayer names.
_LAYER_NAMES = {
    "ln1": "layer_norms.0", "attn.in_proj_weight": "self_attn.in_proj_weight",
    "attn.in_proj_bias": "self_attn.in_proj_bias", "attn.out_proj": "self_attn.out_proj", "ln2": "layer_norms.1",
    "fc1": "fc1", "fc2": "fc2",
}


def reference_incompatibilities(config: MultConfig) -> list[str]:
    """One line per option of `config` that MULTModel has no equivalent of (empty: it holds the model).
    Dropout values are training settings, not weights: they go into the hyperparameters as they are,
    except `text_dropout`, which the reference ties to `embed_dropout` (noted by the exporter)."""
    c = config
    problems = []
    if c.variant not in REFERENCE_VARIANTS:
        problems.append(f"variant={c.variant!r} (the reference's MULTModel has {', '.join(REFERENCE_VARIANTS)}: "
                        "lonly / aonly / vonly)")
    if c.dim != REFERENCE_DIM:
        problems.append(f"dim={c.dim} (MULTModel fixes d_l = d_a = d_v = {REFERENCE_DIM})")
    for m in MODALITIES:
        if getattr(c, f"{m}_kernel") != 1:
            problems.append(f"{m}_kernel={getattr(c, f'{m}_kernel')} (MULTModel's projections are kernel 1)")
        if getattr(c, f"{m}_dim") == REFERENCE_DIM:
            problems.append(f"{m}_dim={REFERENCE_DIM} (MULTModel skips proj_{m} when the input is already "
                            f"{REFERENCE_DIM} wide; ours applies it)")
    if not c.embed_scale:
        problems.append("embed_scale=False (the reference's TransformerEncoder always scales its input by "
                        "sqrt(width))")
    if c.ffn_mult != REFERENCE_FFN_MULT:
        problems.append(f"ffn_mult={c.ffn_mult} (the reference's feed-forward is {REFERENCE_FFN_MULT} x wide)")
    if c.self_depth != max(c.layers, 3):
        problems.append(f"self_layers={c.self_layers} (the reference's self-attention transformers are "
                        f"max(layers, 3) = {max(c.layers, 3)} deep)")
    return problems


def reference_hyperparameters(config: MultConfig) -> dict:
    """The `hyp_params` MULTModel reads (its main.py's names; `attn_mask` is the causal mask)."""
    c = config
    lonly, aonly, vonly = REFERENCE_VARIANTS[c.variant]
    return {
        "orig_d_l": c.l_dim, "orig_d_a": c.a_dim, "orig_d_v": c.v_dim,
        "lonly": lonly, "aonly": aonly, "vonly": vonly,
        "num_heads": c.num_heads, "layers": c.layers,
        "attn_dropout": c.attn_dropout, "attn_dropout_a": c.attn_dropout_a, "attn_dropout_v": c.attn_dropout_v,
        "relu_dropout": c.relu_dropout, "res_dropout": c.res_dropout, "out_dropout": c.out_dropout,
        "embed_dropout": c.embed_dropout, "attn_mask": c.causal, "output_dim": c.output_dim,
    }


def _encoder_buffers(sd: dict[str, Tensor], name: str) -> None:
    sd[f"{name}.version"] = torch.tensor([2.0])  # TransformerEncoder.register_buffer('version', Tensor([2]))
    sd[f"{name}.embed_positions._float_tensor"] = torch.zeros(1)  # SinusoidalPositionalEmbedding's buffer


@torch.no_grad()
def to_reference_state_dict(model: Mult) -> dict[str, Tensor]:
    """MULTModel's state dict holding `model`'s weights (the variant must be one the reference has:
    `reference_incompatibilities` is empty). The self-attention transformers a one-target model does
    not use get LayerNorms of 1 / 0 and zero weights: MULTModel builds them but never runs them."""
    c = model.config
    problems = reference_incompatibilities(c)
    if problems:
        raise ValueError("the reference's MULTModel cannot hold " + "; ".join(problems))
    sd: dict[str, Tensor] = {}
    for m in MODALITIES:
        sd[f"proj_{m}.weight"] = model.embed[m].conv.weight.detach().clone()
    encoders = [(model.crossmodal, [f"trans_{t}_with_{s}" for s, t in model.directions]),
                (model.fusion, [f"trans_{t}_mem" for t in model.targets])]
    for stack, names in encoders:
        for j, name in enumerate(names):
            for i in range(stack.depth):
                for ours, value in stack.stream_state(j, i).items():
                    head, _, leaf = ours.rpartition(".")
                    key = _LAYER_NAMES.get(ours) or f"{_LAYER_NAMES[head]}.{leaf}"
                    sd[f"{name}.layers.{i}.{key}"] = value.detach().clone()
            sd[f"{name}.layer_norm.weight"] = stack.final_weight[j].detach().clone()
            sd[f"{name}.layer_norm.bias"] = stack.final_bias[j].detach().clone()
            _encoder_buffers(sd, name)
    width, depth = 2 * c.dim, max(c.layers, 3)
    for t in (t for t in MODALITIES if t not in model.targets):  # built by MULTModel, unused
        name = f"trans_{t}_mem"
        for i in range(depth):
            p = f"{name}.layers.{i}"
            sd[f"{p}.self_attn.in_proj_weight"] = torch.zeros(3 * width, width)
            sd[f"{p}.self_attn.in_proj_bias"] = torch.zeros(3 * width)
            sd[f"{p}.self_attn.out_proj.weight"] = torch.zeros(width, width)
            sd[f"{p}.self_attn.out_proj.bias"] = torch.zeros(width)
            sd[f"{p}.fc1.weight"] = torch.zeros(REFERENCE_FFN_MULT * width, width)
            sd[f"{p}.fc1.bias"] = torch.zeros(REFERENCE_FFN_MULT * width)
            sd[f"{p}.fc2.weight"] = torch.zeros(width, REFERENCE_FFN_MULT * width)
            sd[f"{p}.fc2.bias"] = torch.zeros(width)
            for n in (0, 1):
                sd[f"{p}.layer_norms.{n}.weight"], sd[f"{p}.layer_norms.{n}.bias"] = torch.ones(width), torch.zeros(width)
        sd[f"{name}.layer_norm.weight"], sd[f"{name}.layer_norm.bias"] = torch.ones(width), torch.zeros(width)
        _encoder_buffers(sd, name)
    for name in ("proj1", "proj2", "out_layer"):
        for p, value in getattr(model, name).state_dict().items():
            sd[f"{name}.{p}"] = value.detach().clone()
    return sd
