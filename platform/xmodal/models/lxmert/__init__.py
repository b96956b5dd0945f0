"""LXMERT (Tan & Bansal, 2019), one module per concern, as `data/lxmert/` holds its data:

- `model`: the config (`LxmertConfig`, presets), the encoders and the five pretraining heads (§2, §3.1).
- `finetune`: the VQA/GQA answer classifier and NLVR2's (§4, Appendix B).
- `init`: starting fine-tuning from pretrained weights (ours, transformers', the reference's files).
- `hf`: the adapter to and from transformers' `LxmertForPreTraining` (weights and config).
"""
