"""Values near the ends of the dtype's range: found in the result, computed again when needed.

The lazy steps' weights ``exp(s - m)`` reach ``LAZY_BOUND`` (the shift lags the row maximum)
where the reference path's are at most 1, and drop to ``LAZY_FLOOR`` (a row at the shift 0)
where the reference path's largest is at least ``1 / S``. So values within a factor
``4 S LAZY_BOUND`` of the dtype's largest number may overflow the accumulator, and values
within ``2 ** VALUE_FLOOR_BITS`` of its smallest normal number may lose digits to subnormal
numbers. Neither is paid for on ordinary inputs: each worker records the largest ``|out|`` of
each value column (``widen_column_top()``); only when that shows an overflow or a column near
the smallest normal numbers (``values_may_be_out_of_range()``) are the values themselves
read (``value_exponents()``), and the call computed again on values scaled by a power of two
per column, which is exact, as is undoing it (``restore_scale()``).
"""

from __future__ import annotations

import math

import numpy as np

from ..tuning import VALUE_FLOOR_BITS, WIDE_ROW
from .softmax import LAZY_BOUND

__all__: list[str] = []


def value_exponents(value: np.ndarray, S: int) -> np.ndarray | None:
    """Powers of two ``e`` (one per column of the values, ``(Dv,)`` int) that bring each
    column's largest ``|v|`` into ``[0.5, 1)``; None when no column needs it (the columns
    within ``4 S LAZY_BOUND`` of the largest number or ``2 ** VALUE_FLOOR_BITS`` of the
    smallest normal one are scaled by ``2 ** -e``, the others left alone, bit for bit)."""
    finfo = np.finfo(value.dtype)
    axes = tuple(range(value.ndim - 1))
    top = np.maximum(np.max(value, axis=axes), -np.min(value, axis=axes))  # (Dv,): max |v|
    high = finfo.max / (4 * LAZY_BOUND * S)
    low = float(finfo.smallest_normal) * 2.0**VALUE_FLOOR_BITS
    scale = np.isfinite(top) & (top > 0) & ((top > high) | (top < low))
    if not scale.any():
        return None
    return np.where(scale, np.frexp(top)[1], 0).astype(np.int32)


def values_may_be_out_of_range(top: np.ndarray) -> bool:
    """Whether a result computed on unscaled values may have lost to the ends of the range,
    from ``top``, the largest ``|out|`` of each column ``(Dv,)`` (NaN if any was NaN).

    Overflow shows in the result as ``inf`` or NaN; digits lost to subnormal numbers show as
    a column whose results are all below ``2 ** VALUE_FLOOR_BITS`` times the smallest normal
    number.
    """
    low = float(np.finfo(top.dtype).smallest_normal) * 2.0**VALUE_FLOOR_BITS
    return not (top >= low).all() or not np.isfinite(top).all()


def widen_column_top(top: np.ndarray, out: np.ndarray) -> None:
    """Raise ``top`` ``(Dv,)`` in place to the largest ``|out|`` of each column of ``out``
    ``(..., rows, Dv)``; a NaN, once met, stays (``np.max`` and ``np.maximum`` keep it).

    A block of at least ``8 WIDE_ROW`` entries is first laid ``r`` rows side by side,
    ``(..., rows / r, r Dv)`` (a view: each block of rows is contiguous), so that NumPy's
    reduction over the leading axes runs along rows of about ``WIDE_ROW`` entries rather than
    ``Dv`` (see :mod:`sdpa.tuning`); a smaller block is reduced as it is, in fewer calls.
    """
    if not out.size:
        return
    rows, Dv = out.shape[-2:]
    r = math.gcd(rows, max(1, WIDE_ROW // Dv)) if rows * Dv >= 8 * WIDE_ROW else 1
    wide = out.reshape(*out.shape[:-2], rows // r, r * Dv)
    axes = tuple(range(wide.ndim - 1))
    high, low = np.maximum.reduce(wide, axis=axes), np.minimum.reduce(wide, axis=axes)
    if r > 1:
        high, low = np.maximum.reduce(high.reshape(r, Dv)), np.minimum.reduce(low.reshape(r, Dv))
    np.maximum(top, high, out=top)
    np.maximum(top, -low, out=top)


def restore_scale(out: np.ndarray, v_exp: np.ndarray | None, top: np.ndarray) -> None:
    """After a unit's ``out`` ``(..., Dv)`` is written: undo the values' scaling by
    ``2 ** -v_exp`` (exact), or, on unscaled values, record its largest ``|out|`` in ``top``
    while the block is in cache."""
    if v_exp is not None:
        np.ldexp(out, v_exp, out=out)
    else:
        widen_column_top(top, out)
