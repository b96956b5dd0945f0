"""Snapshots in the layout of the reference code (airsplay/lxmert), written from our modules.

Named from the reference's source (src/lxrt/modeling.py: LXRTModel, LXRTPretraining and their heads;
src/tasks/*_model.py: the task models; DataParallel's `module.`), independently of the adapter's
mapping (`xmodal.models.lxmert.init.convert_reference_state_dict`), so tests check the one against
the other.
"""

from __future__ import annotations

import torch

from xmodal.models.lxmert.model import LxmertForPretraining


def randomised(model):
    """Every parameter random: BERT's init (zero biases, unit LayerNorm) would hide a misplaced one."""
    torch.manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.1)
    return model.eval()


# -- the reference's layout, from its modules ---------------------------------------------------


def _linear(sd, name, module):
    sd[f"{name}.weight"], sd[f"{name}.bias"] = module.weight, module.bias


def _bert_attention(sd, att, out, ours):
    """BertAttention (query, key, value) + BertAttOutput (dense, LayerNorm) from our fused attention."""
    for n, w, b in zip(("query", "key", "value"), ours.attn.in_proj.weight.chunk(3), ours.attn.in_proj.bias.chunk(3),
                       strict=True):
        sd[f"{att}.{n}.weight"], sd[f"{att}.{n}.bias"] = w, b
    _linear(sd, f"{out}.dense", ours.attn.out_proj)
    _linear(sd, f"{out}.LayerNorm", ours.norm)


def _bert_ffn(sd, inter, out, ours):
    """BertIntermediate (dense) + BertOutput (dense, LayerNorm)."""
    _linear(sd, f"{inter}.dense", ours.fc1)
    _linear(sd, f"{out}.dense", ours.fc2)
    _linear(sd, f"{out}.LayerNorm", ours.norm)


def reference_bert(encoder, p: str) -> dict:
    """LXRTModel's state dict under prefix `p` (BertEmbeddings, LXRTEncoder, BertPooler)."""
    sd = {f"{p}embeddings.word_embeddings.weight": encoder.word_embedding.word.weight,
          f"{p}embeddings.position_embeddings.weight": encoder.word_embedding.position.weight,
          f"{p}embeddings.token_type_embeddings.weight": encoder.word_embedding.token_type.weight}
    _linear(sd, f"{p}embeddings.LayerNorm", encoder.word_embedding.norm)
    v = f"{p}encoder.visn_fc"  # VisualFeatEncoder
    for theirs, ours in (("visn_fc", "feat_fc"), ("visn_layer_norm", "feat_norm"), ("box_fc", "box_fc"),
                         ("box_layer_norm", "box_norm")):
        _linear(sd, f"{v}.{theirs}", getattr(encoder.object_embedding, ours))
    for theirs, layers in (("layer", encoder.lang_layers), ("r_layers", encoder.visn_layers)):  # BertLayer
        for i, layer in enumerate(layers):
            h = f"{p}encoder.{theirs}.{i}"
            _bert_attention(sd, f"{h}.attention.self", f"{h}.attention.output", layer.attn)
            _bert_ffn(sd, f"{h}.intermediate", f"{h}.output", layer.ffn)
    for i, x in enumerate(encoder.x_layers):  # LXRTXLayer: ONE visual_attention for both directions
        h = f"{p}encoder.x_layers.{i}"
        _bert_attention(sd, f"{h}.visual_attention.att", f"{h}.visual_attention.output", x.cross_l)
        _bert_attention(sd, f"{h}.lang_self_att.self", f"{h}.lang_self_att.output", x.self_l)
        _bert_attention(sd, f"{h}.visn_self_att.self", f"{h}.visn_self_att.output", x.self_v)
        _bert_ffn(sd, f"{h}.lang_inter", f"{h}.lang_output", x.ffn_l)
        _bert_ffn(sd, f"{h}.visn_inter", f"{h}.visn_output", x.ffn_v)
    _linear(sd, f"{p}pooler.dense", encoder.pooler)
    return sd


def _logit_fc(sd, p, head):
    """nn.Sequential(Linear, GeLU, BertLayerNorm, Linear): entries 0, 2, 3."""
    for i, ours in ((0, head.fc1), (2, head.norm), (3, head.fc2)):
        _linear(sd, f"{p}logit_fc.{i}", ours)


def reference_pretraining(model: LxmertForPretraining, prefix="module.") -> dict:
    """`LXMERT.save`: LXRTPretraining.state_dict(), `module.` in front under --multiGPU."""
    sd = reference_bert(model.encoder, f"{prefix}bert.")
    c = f"{prefix}cls."
    _linear(sd, f"{c}predictions.transform.dense", model.mlm_head.transform.dense)
    _linear(sd, f"{c}predictions.transform.LayerNorm", model.mlm_head.transform.norm)
    sd[f"{c}predictions.decoder.weight"] = model.encoder.word_embedding.word.weight  # tied, saved under both names
    sd[f"{c}predictions.bias"] = model.mlm_head.bias
    _linear(sd, f"{c}seq_relationship", model.match_head)
    o = f"{prefix}obj_predict_head."
    _linear(sd, f"{o}transform.dense", model.object_heads.transform.dense)
    _linear(sd, f"{o}transform.LayerNorm", model.object_heads.transform.norm)
    for k in ("obj", "attr", "feat"):
        _linear(sd, f"{o}decoder_dict.{k}", getattr(model.object_heads, k))
    _logit_fc(sd, f"{prefix}answer_head.", model.qa_head)
    return {k: v.detach().clone() for k, v in sd.items()}


def reference_task(model, multi_gpu=False) -> dict:
    """A task's `save` (VQAModel / GQAModel / NLVR2Model): lxrt_encoder.model[.module].bert.* + logit_fc.*."""
    sd = reference_bert(model.encoder, "lxrt_encoder.model.module.bert." if multi_gpu else "lxrt_encoder.model.bert.")
    _logit_fc(sd, "", model.answer_head if hasattr(model, "answer_head") else model.classifier)
    return {k: v.detach().clone() for k, v in sd.items()}
