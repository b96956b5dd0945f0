"""MulT (Tsai et al., 2019), one module per concern, as `data/mult/` holds its data:

- `config`: `MultConfig` (the Table 4 variant, sizes, dropouts) and its presets.
- `model`: the model (§3): temporal convolutions, crossmodal and self-attention transformers, prediction.
- `streams`: the transformer stacks as streams batched into one matmul per projection.
- `reference`: the weights in the reference code's layout, for export.
"""
