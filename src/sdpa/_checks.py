"""Input validation shared by every public function: one place, uniform messages.

Every message follows the same pattern: which argument, what was expected, what was given.
"""

from __future__ import annotations

import math
from numbers import Integral, Real

import numpy as np
from numpy.typing import ArrayLike

__all__ = [
    "as_float_array",
    "compute_dtype",
    "check_alignment",
    "check_window",
    "check_nonneg_int",
]

ALIGNMENTS = ("top_left", "bottom_right")


def as_float_array(x: ArrayLike, name: str) -> np.ndarray:
    """Convert ``x`` to an array, rejecting kinds that attention cannot use.

    Floating arrays keep their dtype; integer and bool arrays become float64 (NumPy's rule for
    ``np.true_divide``). Complex, object, string and datetime arrays raise ``TypeError``.
    The input is never copied unless a conversion is needed, and never modified.
    """
    arr = np.asarray(x)
    kind = arr.dtype.kind
    if kind == "f":
        return arr
    if kind in "biu":
        return arr.astype(np.float64)
    raise TypeError(
        f"{name} must be a real floating, integer or bool array; got dtype {arr.dtype}"
    )


def compute_dtype(*arrays: np.ndarray) -> tuple[np.dtype, np.dtype]:
    """Return ``(out_dtype, work_dtype)`` for floating arrays: float16 works in float32."""
    out = np.result_type(*arrays)
    work = np.dtype(np.float32) if out == np.float16 else out
    return out, work


def check_nonneg_int(value, name: str) -> int:
    """Return ``value`` as an ``int`` if it is a non-negative integer, else raise."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be a non-negative integer; got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be a non-negative integer; got {value!r}")
    return int(value)


def check_alignment(alignment, name: str = "causal_alignment") -> str:
    if alignment not in ALIGNMENTS:
        raise ValueError(f"{name} must be 'top_left' or 'bottom_right'; got {alignment!r}")
    return alignment


def check_window(window, name: str = "window") -> tuple[int | None, int | None] | None:
    """Validate ``window=(left, right)``: each a non-negative integer, or None for unbounded."""
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise ValueError(
            f"{name} must be a pair (left, right) of non-negative integers or None; got {window!r}"
        )
    out = []
    for side in window:
        if side is None:
            out.append(None)
            continue
        if isinstance(side, (bool, np.bool_)) or not isinstance(side, Integral) or side < 0:
            raise ValueError(
                f"{name} must be a pair (left, right) of non-negative integers or None; "
                f"got {window!r}"
            )
        out.append(int(side))
    return (out[0], out[1])


def check_scale(scale, head_dim: int) -> float:
    """Default ``1/sqrt(Dk)`` (1.0 when ``Dk = 0``); otherwise a finite real number."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, Real):
        raise TypeError(f"scale must be a real number or None; got {scale!r}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite; got {scale!r}")
    return float(scale)


def check_probability(p, name: str) -> float:
    if isinstance(p, (bool, np.bool_)) or not isinstance(p, Real):
        raise TypeError(f"{name} must be a real number in [0, 1]; got {p!r}")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"{name} must be in [0, 1]; got {p!r}")
    return float(p)


def check_rng(rng, name: str = "rng") -> np.random.Generator:
    if not isinstance(rng, np.random.Generator):
        raise TypeError(
            f"{name} must be a numpy.random.Generator, e.g. np.random.default_rng(0); "
            f"got {type(rng).__name__}"
        )
    return rng


def check_axis(x: np.ndarray, axis, name: str = "axis") -> int:
    if isinstance(axis, (bool, np.bool_)) or not isinstance(axis, Integral):
        raise TypeError(f"{name} must be an integer; got {axis!r}")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"{name}={axis} is out of range for an array of shape {x.shape}")
    return int(axis) % x.ndim
