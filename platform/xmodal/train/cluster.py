"""Connecting to Ray and choosing where runs are stored. Imported only by drivers."""

from __future__ import annotations

import os
from pathlib import Path


def require_ray():
    try:
        import ray
        import ray.train  # noqa: F401
    except ImportError as e:
        raise ImportError("this job needs Ray: pip install 'ray[default,train,tune,data]'") from e
    return ray


def connect(min_logical_cpus: int = 4) -> None:
    """Attach to the cluster a job runs in (`ray job submit` sets RAY_ADDRESS), else start a local Ray.

    A local Ray gets at least `min_logical_cpus` logical CPUs: Train workers take
    fractions, and Ray Data's read tasks need CPUs of their own or `fit()` hangs.
    """
    from xmodal.console import attach_ray

    ray = require_ray()
    if not ray.is_initialized():
        if os.environ.get("RAY_ADDRESS"):
            ray.init(log_to_driver=True)
        else:
            ray.init(address="local", num_cpus=max(os.cpu_count() or 1, min_logical_cpus), log_to_driver=True)
    attach_ray()  # the workers' lines through the console (xmodal.console), where a command line set it up


def storage_path(configured: str | None) -> str:
    """Config > $XMODAL_STORAGE_PATH (set by the cluster) > ./runs. Local paths become absolute
    because workers do not share the driver's working directory."""
    path = configured or os.environ.get("XMODAL_STORAGE_PATH") or "runs"
    if "://" in path:
        return path
    return str(Path(path).expanduser().resolve())
