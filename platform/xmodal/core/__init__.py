"""The torch-only training core, in the model layer beside `xmodal.models` and `xmodal.objectives`:

    step.py        train_step: the one forward, backward, clipping and optimizer step
    loop.py        fit: epochs of micro-batches through the step, with the hooks the runner gives it
    runtime.py     device, precision, compilation, DDP and the optimizer, in one place (prepare)
    checkpoint.py  checkpoint folders: save, seal (sizes and sha256), verify, restore
    cost.py        FLOPs of a training step, counted once per attempt

It imports only torch, numpy and the standard library (a contract in pyproject.toml), so it runs where
Ray, MLflow and pyarrow are not installed.
"""
