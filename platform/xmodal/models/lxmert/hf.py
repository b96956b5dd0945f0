"""Adapter between transformers' `LxmertForPreTraining` and our `LxmertForPretraining`.

- `config_from_hf(hf_config)`: a transformers `LxmertConfig` (or its config.json dict) -> our config.
- `config_to_hf(config)`: the reverse, as a transformers `LxmertConfig` (imports transformers).
- `load_hf_state_dict(model, hf_state_dict)`: strict conversion of the weights.
- `from_pretrained_dir(path)`: a local checkpoint directory (config.json + safetensors or .bin),
  read without network and without importing transformers.
- `hf_incompatibilities(config)` / `to_hf_state_dict(config, state_dict, model)`: the export direction
  (`xmodal.export`): what transformers cannot express of a config, and our state dict in transformers'
  names through the same `key_map` (split where we fuse, written once where we share or tie).

transformers is imported lazily and only by `config_to_hf`: the platform runs without it.

Weight layout differences handled here:
- HF keeps separate query/key/value Linears; we hold ONE fused (3D, D) `in_proj` = cat(W_q, W_k, W_v).
- HF has one cross-attention module per cross layer (`visual_attention`), used in both
  directions; ours is `cross_l`, with `cross_v` the same module (shared_cross_attention=True),
  so both state-dict prefixes are filled from it.
- HF's MLM decoder is tied to the word embedding, as ours (`mlm_head.decoder_weight`).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from xmodal.models.lxmert.model import LxmertConfig, LxmertForPretraining

# transformers' LxmertConfig defaults. `save_pretrained` writes only the values that differ
# from these, so reading a config.json without transformers needs them.
HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 30522,
    "hidden_size": 768,
    "num_attention_heads": 12,
    "num_qa_labels": 9500,
    "num_object_labels": 1600,
    "num_attr_labels": 400,
    "intermediate_size": 3072,
    "hidden_act": "gelu",
    "hidden_dropout_prob": 0.1,
    "attention_probs_dropout_prob": 0.1,
    "max_position_embeddings": 512,
    "type_vocab_size": 2,
    "l_layers": 9,
    "x_layers": 5,
    "r_layers": 5,
    "visual_feat_dim": 2048,
    "visual_pos_dim": 4,
    "initializer_range": 0.02,
    "task_obj_predict": True,
    "task_qa": True,
    "visual_obj_loss": True,
    "visual_attr_loss": True,
    "visual_feat_loss": True,
    "tie_word_embeddings": True,
}

# Our field <- HF field, for the fields that map one to one.
_FIELDS: dict[str, str] = {
    "vocab_size": "vocab_size",
    "hidden_size": "hidden_size",
    "num_heads": "num_attention_heads",
    "ffn_size": "intermediate_size",
    "l_layers": "l_layers",
    "r_layers": "r_layers",
    "x_layers": "x_layers",
    "max_positions": "max_position_embeddings",
    "visual_feat_dim": "visual_feat_dim",
    "visual_pos_dim": "visual_pos_dim",
    "dropout": "hidden_dropout_prob",
    "attention_dropout": "attention_probs_dropout_prob",
    "num_object_labels": "num_object_labels",
    "num_attr_labels": "num_attr_labels",
    "initializer_range": "initializer_range",
    "num_qa_labels": "num_qa_labels",
}

HF_LAYER_NORM_EPS = 1e-12  # hard-coded in transformers' LXMERT


def _hf_dict(hf_config: Any) -> dict[str, Any]:
    if isinstance(hf_config, Mapping):
        raw = dict(hf_config)
    elif hasattr(hf_config, "to_dict"):
        raw = hf_config.to_dict()
    else:
        raise TypeError(f"expected a transformers LxmertConfig or a config.json dict, got {type(hf_config).__name__}")
    if raw.get("model_type", "lxmert") != "lxmert":
        raise ValueError(f"config has model_type {raw['model_type']!r}; expected 'lxmert'")
    return {**HF_DEFAULTS, **raw}


def config_from_hf(hf_config: Any) -> LxmertConfig:
    """Our config for a transformers `LxmertConfig` (or a config.json dict; missing keys take HF defaults).

    The result reproduces HF's computation: token-type embedding on, one shared
    cross-attention, tanh pooler, LayerNorm eps 1e-12.
    """
    c = _hf_dict(hf_config)
    if c["hidden_act"] != "gelu":
        raise ValueError(f"hidden_act {c['hidden_act']!r} is not supported; our LXMERT uses exact 'gelu'")
    if c["type_vocab_size"] != 2:
        raise ValueError(f"type_vocab_size {c['type_vocab_size']} is not supported; our token-type table has 2 rows")
    if not c["tie_word_embeddings"]:
        raise ValueError("tie_word_embeddings=False is not supported: our MLM decoder is tied to the word embedding")
    return LxmertConfig(
        **{ours: c[theirs] for ours, theirs in _FIELDS.items()},
        token_type_embedding=True,
        layer_norm_eps=HF_LAYER_NORM_EPS,
        shared_cross_attention=True,
        pooler=True,
    )


# What transformers' LXMERT hard-codes, as our field -> the value it needs.
_HF_FIXED: dict[str, Any] = {
    "shared_cross_attention": True,  # one `visual_attention` module per cross layer
    "pooler": True,  # tanh pooler on [CLS], always applied
    "layer_norm_eps": HF_LAYER_NORM_EPS,
}


def hf_incompatibilities(config: LxmertConfig, zero_token_type: bool = True) -> list[str]:
    """The options of `config` transformers' LXMERT has no equivalent of, one line each (empty: it
    can hold the model). Without a token-type embedding the model is HF's with a zero token-type
    table (token type 0 adds row 0), so that is expressible when `zero_token_type`."""
    fixed = dict(_HF_FIXED) if zero_token_type else {"token_type_embedding": True, **_HF_FIXED}
    return [f"{name}={getattr(config, name)!r} (transformers' LXMERT needs {need!r})"
            for name, need in fixed.items() if getattr(config, name) != need]


def config_to_hf(config: LxmertConfig, zero_token_type: bool = False, **overrides: Any):
    """transformers' `LxmertConfig` with our architecture (imports transformers).

    Only configs that HF can express are accepted (shared cross-attention, pooler, eps 1e-12, and a
    token-type embedding unless `zero_token_type`: the exporter then writes a zero table);
    `overrides` set HF-only fields (e.g. visual_loss_normalizer, task flags).
    """
    problems = hf_incompatibilities(config, zero_token_type)
    if problems:
        raise ValueError("transformers' LXMERT cannot express " + "; ".join(problems))
    from transformers import LxmertConfig as HFLxmertConfig

    kwargs = {theirs: getattr(config, ours) for ours, theirs in _FIELDS.items()}
    return HFLxmertConfig(**{**kwargs, **overrides})


def _attn(ours: str, hf: str) -> list[tuple[str, list[str]]]:
    """Rows for one attention sub-layer: fused in_proj = cat(query, key, value), out_proj, post-LayerNorm.

    `ours` is the PostLNAttention prefix; `hf` is "<prefix holding query/key/value>|<prefix
    holding dense and LayerNorm>".
    """
    qkv, out = hf.split("|")
    rows = []
    for p in ("weight", "bias"):
        rows.append((f"{ours}.attn.in_proj.{p}", [f"{qkv}.{n}.{p}" for n in ("query", "key", "value")]))
        rows.append((f"{ours}.attn.out_proj.{p}", [f"{out}.dense.{p}"]))
        rows.append((f"{ours}.norm.{p}", [f"{out}.LayerNorm.{p}"]))
    return rows


def _ffn(ours: str, hf_inter: str, hf_out: str) -> list[tuple[str, list[str]]]:
    rows = []
    for p in ("weight", "bias"):
        rows.append((f"{ours}.fc1.{p}", [f"{hf_inter}.dense.{p}"]))
        rows.append((f"{ours}.fc2.{p}", [f"{hf_out}.dense.{p}"]))
        rows.append((f"{ours}.norm.{p}", [f"{hf_out}.LayerNorm.{p}"]))
    return rows


def _linear(ours: str, hf: str) -> list[tuple[str, list[str]]]:
    return [(f"{ours}.{p}", [f"{hf}.{p}"]) for p in ("weight", "bias")]


def key_map(config: LxmertConfig) -> list[tuple[str, list[str]]]:
    """(our key, [HF keys concatenated along dim 0]) for every entry of our state dict.

    `mlm_head.decoder_weight` (tied) maps to the word embedding; a separate HF
    `cls.predictions.decoder.weight` is checked against it in `load_hf_state_dict`.
    """
    e, he = "encoder", "lxmert.encoder"
    rows: list[tuple[str, list[str]]] = [
        (f"{e}.word_embedding.word.weight", ["lxmert.embeddings.word_embeddings.weight"]),
        (f"{e}.word_embedding.position.weight", ["lxmert.embeddings.position_embeddings.weight"]),
        *_linear(f"{e}.word_embedding.norm", "lxmert.embeddings.LayerNorm"),
        *_linear(f"{e}.object_embedding.feat_fc", f"{he}.visn_fc.visn_fc"),
        *_linear(f"{e}.object_embedding.feat_norm", f"{he}.visn_fc.visn_layer_norm"),
        *_linear(f"{e}.object_embedding.box_fc", f"{he}.visn_fc.box_fc"),
        *_linear(f"{e}.object_embedding.box_norm", f"{he}.visn_fc.box_layer_norm"),
    ]
    if config.token_type_embedding:
        rows.append((f"{e}.word_embedding.token_type.weight", ["lxmert.embeddings.token_type_embeddings.weight"]))
    for ours, theirs, n in (("lang_layers", "layer", config.l_layers), ("visn_layers", "r_layers", config.r_layers)):
        for i in range(n):
            o, h = f"{e}.{ours}.{i}", f"{he}.{theirs}.{i}"
            rows += _attn(f"{o}.attn", f"{h}.attention.self|{h}.attention.output")
            rows += _ffn(f"{o}.ffn", f"{h}.intermediate", f"{h}.output")
    for i in range(config.x_layers):
        o, h = f"{e}.x_layers.{i}", f"{he}.x_layers.{i}"
        cross = f"{h}.visual_attention.att|{h}.visual_attention.output"
        rows += _attn(f"{o}.cross_l", cross)
        rows += _attn(f"{o}.cross_v", cross)  # the same module when shared; HF has only one
        rows += _attn(f"{o}.self_l", f"{h}.lang_self_att.self|{h}.lang_self_att.output")
        rows += _attn(f"{o}.self_v", f"{h}.visn_self_att.self|{h}.visn_self_att.output")
        rows += _ffn(f"{o}.ffn_l", f"{h}.lang_inter", f"{h}.lang_output")
        rows += _ffn(f"{o}.ffn_v", f"{h}.visn_inter", f"{h}.visn_output")
    if config.pooler:
        rows += _linear(f"{e}.pooler", "lxmert.pooler.dense")
    rows += [
        *_linear("mlm_head.transform.dense", "cls.predictions.transform.dense"),
        *_linear("mlm_head.transform.norm", "cls.predictions.transform.LayerNorm"),
        ("mlm_head.bias", ["cls.predictions.bias"]),
        ("mlm_head.decoder_weight", ["lxmert.embeddings.word_embeddings.weight"]),
        *_linear("match_head", "cls.seq_relationship"),
        *_linear("object_heads.transform.dense", "obj_predict_head.transform.dense"),
        *_linear("object_heads.transform.norm", "obj_predict_head.transform.LayerNorm"),
        *_linear("object_heads.obj", "obj_predict_head.decoder_dict.obj"),
        *_linear("object_heads.attr", "obj_predict_head.decoder_dict.attr"),
        *_linear("object_heads.feat", "obj_predict_head.decoder_dict.feat"),
        *_linear("qa_head.fc1", "answer_head.logit_fc.0"),
        *_linear("qa_head.norm", "answer_head.logit_fc.2"),
        *_linear("qa_head.fc2", "answer_head.logit_fc.3"),
    ]
    return rows


# Entries of HF checkpoints that carry no weights we need.
_IGNORED_HF = re.compile(r"(^|\.)position_ids$")
_TIED_DECODER = "cls.predictions.decoder.weight"


def _normalise_hf_keys(sd: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """Old (TF-converted) checkpoints name LayerNorm parameters gamma/beta; transformers renames them on load."""
    out = {}
    for k, v in sd.items():
        k = re.sub(r"\.gamma$", ".weight", k)
        k = re.sub(r"\.beta$", ".bias", k)
        out[k] = v
    return out


def convert_hf_state_dict(config: LxmertConfig, hf_state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """HF `LxmertForPreTraining` state dict -> our state dict (strict, see `load_hf_state_dict`)."""
    sd = _normalise_hf_keys(hf_state_dict)
    out: dict[str, Tensor] = {}
    used: set[str] = set()
    missing: list[str] = []
    for ours, theirs in key_map(config):
        absent = [k for k in theirs if k not in sd]
        if absent:
            missing.append(f"{ours} (needs HF {', '.join(absent)})")
            continue
        parts = [sd[k] for k in theirs]
        out[ours] = parts[0] if len(parts) == 1 else torch.cat(parts, dim=0)
        used.update(theirs)
    if missing:
        raise KeyError(
            f"HF state dict lacks {len(missing)} entries our LxmertForPretraining needs: "
            + "; ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
            + ". Expected a full LxmertForPreTraining checkpoint (task_obj_predict, task_qa and all "
            "visual losses on)."
        )
    if _TIED_DECODER in sd:
        used.add(_TIED_DECODER)
        word = sd["lxmert.embeddings.word_embeddings.weight"]
        if sd[_TIED_DECODER].shape != word.shape or not torch.equal(sd[_TIED_DECODER], word):
            raise ValueError(
                f"HF {_TIED_DECODER} differs from lxmert.embeddings.word_embeddings.weight; our MLM decoder is "
                "tied to the word embedding, so an untied checkpoint cannot be converted"
            )
    unexpected = sorted(k for k in sd if k not in used and not _IGNORED_HF.search(k))
    if unexpected:
        raise KeyError(
            f"HF state dict has {len(unexpected)} entries with no place in our LxmertForPretraining: "
            + ", ".join(unexpected[:8]) + (" ..." if len(unexpected) > 8 else "")
            + ". Does the checkpoint's config (layer counts, sizes) match the model's config?"
        )
    return out


@torch.no_grad()
def load_hf_state_dict(model: LxmertForPretraining, hf_state_dict: Mapping[str, Tensor]) -> LxmertForPretraining:
    """Copy an HF `LxmertForPreTraining` state dict into `model`; strict both ways.

    Every entry of our state dict must be filled (KeyError naming the missing HF
    keys), every HF entry must be used (KeyError naming the unexpected ones), and
    shapes must agree (ValueError naming the key and both shapes).
    """
    if not model.config.shared_cross_attention:
        # Filling both directions from HF's single module would silently untie them on the next step.
        raise ValueError("HF LXMERT shares one cross-attention; build the model with shared_cross_attention=True")
    ours = convert_hf_state_dict(model.config, hf_state_dict)
    target = model.state_dict()
    not_filled = sorted(set(target) - set(ours))
    if not_filled:
        raise KeyError(f"conversion left our keys unfilled: {', '.join(not_filled[:8])}")
    for k, v in ours.items():
        if k not in target:
            raise KeyError(f"conversion produced {k!r}, which our model does not have (config mismatch?)")
        if v.shape != target[k].shape:
            raise ValueError(f"shape mismatch for {k}: HF gives {tuple(v.shape)}, our model expects "
                             f"{tuple(target[k].shape)} (check the config)")
    model.load_state_dict(ours, strict=True)
    return model


# Which of our models -> which rows of `key_map` it has and the prefix its head takes there.
HF_MODELS = {
    "pretraining": "LxmertForPreTraining: encoder and every pretraining head",
    "qa": "LxmertForQuestionAnswering: encoder and answer_head (our LxmertForQuestionAnswering)",
    "encoder": "LxmertModel: the encoder alone",
}


def to_hf_state_dict(config: LxmertConfig, state_dict: Mapping[str, Tensor], model: str = "pretraining"
                     ) -> dict[str, Tensor]:
    """Our state dict in transformers' names: the inverse of `convert_hf_state_dict`, row for row of
    `key_map` (a fused in_proj split into query, key, value; the shared cross-attention and the tied
    decoder written once, checked equal). `model` (HF_MODELS): `pretraining` takes an
    `LxmertForPretraining` state dict, `qa` an `LxmertForQuestionAnswering` one (`answer_head.*`
    -> HF `answer_head.logit_fc.*`), `encoder` the `encoder.*` entries alone (HF `LxmertModel`,
    `lxmert.` prefix kept). A model without a token-type embedding gets a zero table. Strict: every
    entry of `state_dict` must find a place (KeyError naming the others)."""
    if model not in HF_MODELS:
        raise KeyError(f"model {model!r}; expected one of {', '.join(HF_MODELS)}")
    sd = dict(state_dict)
    if model == "qa":
        sd = {("qa_head." + k[len("answer_head."):] if k.startswith("answer_head.") else k): v for k, v in sd.items()}
    rows = key_map(config)
    if model != "pretraining":
        keep = ("encoder.", "qa_head.") if model == "qa" else ("encoder.",)
        rows = [(ours, theirs) for ours, theirs in rows if ours.startswith(keep)]
    out: dict[str, Tensor] = {}
    missing = [ours for ours, _ in rows if ours not in sd]
    if missing:
        raise KeyError(f"the state dict lacks {len(missing)} entries of the {model} model: {', '.join(missing[:8])}")
    for ours, theirs in rows:
        parts = sd[ours].detach().chunk(len(theirs), dim=0) if len(theirs) > 1 else (sd[ours].detach(),)
        for name, value in zip(theirs, parts, strict=True):
            if name in out and not torch.equal(out[name], value):
                raise ValueError(f"{name} gets two different values ({ours} and an earlier entry): is the "
                                 "cross-attention shared and the MLM decoder tied to the word embedding?")
            out[name] = value.contiguous()
    used = {ours for ours, _ in rows}
    unexpected = sorted(k for k in sd if k not in used)
    if unexpected:
        raise KeyError(f"{len(unexpected)} entries have no place in transformers' {model} model: "
                       + ", ".join(unexpected[:8]))
    if not config.token_type_embedding:
        word = out["lxmert.embeddings.word_embeddings.weight"]
        out["lxmert.embeddings.token_type_embeddings.weight"] = word.new_zeros((2, word.shape[1]))
    if model == "pretraining":
        out[_TIED_DECODER] = out["lxmert.embeddings.word_embeddings.weight"]
    return out


WEIGHT_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json", "model.safetensors", "pytorch_model.bin")


def weights_present(path: str | os.PathLike) -> bool:
    """Whether a checkpoint directory holds one of the weight files `_read_weights` reads (not read here)."""
    return any((Path(path) / name).is_file() for name in WEIGHT_FILES)


def _read_weights(path: Path) -> dict[str, Tensor]:
    """config dir -> HF state dict: model.safetensors, its sharded index, pytorch_model.bin or its index."""
    for index_name, loader in (("model.safetensors.index.json", "safetensors"),
                               ("pytorch_model.bin.index.json", "torch")):
        index = path / index_name
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            sd: dict[str, Tensor] = {}
            for shard in shards:
                sd.update(_read_file(path / shard, loader))
            return sd
    if (path / "model.safetensors").is_file():
        return _read_file(path / "model.safetensors", "safetensors")
    if (path / "pytorch_model.bin").is_file():
        return _read_file(path / "pytorch_model.bin", "torch")
    raise FileNotFoundError(
        f"no weights in {path}: expected model.safetensors, model.safetensors.index.json, "
        "pytorch_model.bin or pytorch_model.bin.index.json"
    )


def _read_file(file: Path, loader: str) -> dict[str, Tensor]:
    if not file.is_file():
        raise FileNotFoundError(f"weight shard {file} named by the index does not exist")
    if loader == "safetensors":
        try:
            from safetensors.torch import load_file
        except ImportError as err:
            raise ImportError(f"reading {file} needs the safetensors package (pip install safetensors)") from err

        return load_file(str(file), device="cpu")
    # weights_only: a .bin is a pickle; refuse anything but tensors and plain containers.
    return torch.load(file, map_location="cpu", weights_only=True)


def config_from_hf_dir(path: str | os.PathLike) -> LxmertConfig:
    """Our config from a transformers checkpoint directory's config.json (weights not read)."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{cfg_file} not found: expected a transformers checkpoint directory")
    return config_from_hf(json.loads(cfg_file.read_text()))


def from_pretrained_dir(path: str | os.PathLike) -> LxmertForPretraining:
    """Our model from a local transformers `LxmertForPreTraining` checkpoint directory (no network)."""
    path = Path(path)
    config = config_from_hf_dir(path)
    model = LxmertForPretraining(config)
    try:
        load_hf_state_dict(model, _read_weights(path))
    except (KeyError, ValueError) as err:
        raise type(err)(f"{path}: {err.args[0]}") from err
    return model.eval()
