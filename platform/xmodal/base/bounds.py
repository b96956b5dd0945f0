"""Bounds of config fields as `typing.Annotated` metadata (annotated_types), checked by pydantic when a
config is validated. The model and data modules use these aliases without importing pydantic; the
config loader (`xmodal.config.experiment`) reads the same metadata back to say what a field allows.
"""

from __future__ import annotations

from typing import Annotated, Any

from annotated_types import Ge, Gt, Interval

PosInt = Annotated[int, Ge(1)]  # counts, sizes, steps, epochs, intervals
NonNegInt = Annotated[int, Ge(0)]  # counts where 0 is meaningful (e.g. an ablation's zero layers)
PosFloat = Annotated[float, Gt(0)]  # learning rates, epsilons, scales
NonNegFloat = Annotated[float, Ge(0)]  # weight decay, noise, clipping (0 = off)
Probability = Annotated[float, Interval(ge=0, le=1)]
Dropout = Annotated[float, Interval(ge=0, lt=1)]  # 1 would drop everything
Fraction = Annotated[float, Interval(ge=0, lt=1)]  # a share of something that must leave a remainder
Seed = Annotated[int, Interval(ge=0, lt=2**32)]  # numpy's seed range
# Tokens per sentence including [CLS] and [SEP]: at least one word.
SeqLen = Annotated[int, Ge(3)]


def bounds_of(metadata: list[Any]) -> tuple[Any, Any, Any, Any]:
    """(ge, gt, le, lt) collected from annotated_types / pydantic constraint objects (None where unset)."""
    found: dict[str, Any] = {"ge": None, "gt": None, "le": None, "lt": None}
    for m in metadata:
        if getattr(m, "metadata", None):  # a pydantic FieldInfo inside Annotated
            inner = dict(zip(found, bounds_of(m.metadata), strict=True))
            found.update({k: v for k, v in inner.items() if v is not None})
        for k in found:
            v = getattr(m, k, None)
            if v is not None:
                found[k] = v
    return found["ge"], found["gt"], found["le"], found["lt"]


def describe_bounds(metadata: list[Any], kind: str = "a number") -> str | None:
    """'a number in [0, 1)', 'an integer >= 1', ... or None when the metadata has no bounds."""
    ge, gt, le, lt = (_num(v) for v in bounds_of(metadata))
    low = f"[{ge}" if ge is not None else (f"({gt}" if gt is not None else None)
    high = f"{le}]" if le is not None else (f"{lt})" if lt is not None else None)
    if low and high:
        return f"{kind} in {low}, {high}"
    if low:
        return f"{kind} >= {ge}" if ge is not None else f"{kind} > {gt}"
    if high:
        return f"{kind} <= {le}" if le is not None else f"{kind} < {lt}"
    return None


def _num(v: Any) -> str | None:
    return None if v is None else (f"{v:g}" if isinstance(v, float) else str(v))
