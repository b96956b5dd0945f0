"""The models, pure torch (torchvision for the detector's ops), each config dataclass beside its model:

- `lxmert/`: LXMERT's encoders, pretraining heads and fine-tuning heads; loading foreign checkpoints.
- `mult/`: MulT and its Table 4 variants.
- `butd/`: the bottom-up-attention region-feature detector, stage by stage.
- `attention.py`: the attention blocks LXMERT and MulT share.

Conversion of foreign checkpoints lives in its own module (`lxmert/hf.py`, `lxmert/init.py`,
`mult/reference.py`, `butd/weights.py`), never in a model file.
"""
