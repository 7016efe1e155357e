"""Input validation shared by every public function: one place, uniform messages.

Every message follows the same pattern: which argument, what was expected, what was given.
"""

from __future__ import annotations

import math
import os
import warnings
from numbers import Integral, Real

import numpy as np
from numpy.typing import ArrayLike

__all__ = [
    "as_array",
    "as_float_array",
    "compute_dtype",
    "lse_dtype",
    "check_alignment",
    "check_bool",
    "check_float_dtype",
    "check_memory",
    "MEMORY_CHECK_BYTES",
    "check_range",
    "check_real",
    "range_error",
    "check_window",
    "check_int",
    "check_nonneg_int",
    "check_positive_int",
    "check_query_key_value",
    "shape_error",
    "deprecated_name",
    "renamed_keyword",
]

ALIGNMENTS = ("top_left", "bottom_right")

MASKED_ARRAY_HINT = "pass a plain array"
ATTENTION_MASK_HINT = (
    "pass the plain array, and the masked positions as attn_mask (a bool array, True = may attend)"
)


def as_array(x: ArrayLike, name: str, *, masked_hint: str = MASKED_ARRAY_HINT) -> np.ndarray:
    """``np.asarray(x)`` with errors that name the argument.

    A ``numpy.ma.MaskedArray`` raises ``TypeError``: NumPy functions would silently drop its
    mask. A ragged nested sequence raises ``ValueError`` instead of NumPy's message, which does
    not say which argument was ragged. ``masked_hint`` says what to pass instead.
    """
    if x is None:
        raise TypeError(f"{name} must be an array; got None")
    if isinstance(x, np.ma.MaskedArray):
        raise TypeError(
            f"{name} must not be a numpy.ma.MaskedArray: its mask would be silently ignored; "
            f"{masked_hint}"
        )
    try:
        return np.asarray(x)
    except (ValueError, TypeError) as error:
        raise ValueError(
            f"{name} must be an array or a rectangular nested sequence of numbers; "
            f"NumPy could not convert it: {error}"
        ) from None


def as_float_array(x: ArrayLike, name: str, *, masked_hint: str = MASKED_ARRAY_HINT) -> np.ndarray:
    """Convert ``x`` to an array, rejecting kinds that attention cannot use.

    Floating arrays keep their dtype; integer and bool arrays become float64 (NumPy's rule for
    ``np.true_divide``). Complex, object, string and datetime arrays raise ``TypeError``, and
    so do masked arrays (see :func:`as_array`). The input is never copied unless a conversion
    is needed, and never modified.
    """
    arr = as_array(x, name, masked_hint=masked_hint)
    kind = arr.dtype.kind
    if kind == "f":
        return arr
    if kind in "biu":
        return arr.astype(np.float64)
    raise TypeError(f"{name} must be a real floating, integer or bool array; got dtype {arr.dtype}")


def compute_dtype(*arrays: np.ndarray) -> tuple[np.dtype, np.dtype]:
    """Return ``(out_dtype, work_dtype)`` for floating arrays: float16 works in float32."""
    out = np.result_type(*arrays)
    work = np.dtype(np.float32) if out == np.float16 else out
    return out, work


def lse_dtype(out_dtype: np.dtype) -> np.dtype:
    """The dtype of a returned log-sum-exp: at least float32 (float16 scores overflow at 65504)."""
    return np.promote_types(out_dtype, np.float32)


def check_bool(value, name: str) -> bool:
    """Return ``value`` as a ``bool`` if it is one (Python or NumPy), else raise ``TypeError``."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool; got {value!r}")
    return bool(value)


def check_float_dtype(dtype, name: str = "dtype") -> np.dtype:
    """A floating dtype (float16, float32, float64, ...) from anything ``np.dtype`` accepts.

    None is refused (``np.dtype(None)`` would silently mean float64), and so are integer, bool
    and complex dtypes, which would give all-zero or complex weights.
    """
    message = f"{name} must be a floating dtype (float16, float32 or float64); got "
    if dtype is None:
        raise TypeError(message + "None")
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(message + repr(dtype)) from None
    if dt.kind != "f":
        raise TypeError(message + str(dt))
    return dt


def check_range(x: np.ndarray, dtype, name: str, why: str = "") -> None:
    """Raise ``ValueError`` if a finite entry of ``x`` would overflow to infinity in ``dtype``.

    Casting such an entry would silently give ``inf`` (with a NumPy warning). ``why`` says why
    ``dtype`` matters, e.g. ``", the cache's dtype"``. Entries that are already infinite are
    left to the caller's own rules.

    The test is the cast itself, so it follows the dtype's rounding: an entry just beyond the
    largest finite value rounds down to it and is accepted (float16: up to 65520, half a unit
    in the last place above 65504, excluded), one from there on becomes ``inf`` and is refused.
    """
    dtype = np.dtype(dtype)
    if x.size == 0 or x.dtype.kind != "f" or np.finfo(x.dtype).max <= np.finfo(dtype).max:
        return
    with np.errstate(over="ignore"):  # the overflow is what we look for
        big = np.isinf(x.astype(dtype)) & np.isfinite(x)
    if big.any():
        worst = float(x[big][np.argmax(np.abs(x[big]))])
        raise range_error(name, dtype, worst, why)


def range_error(name: str, dtype, value: float, why: str = "", hint: str = "") -> ValueError:
    """The uniform message of :func:`check_range`."""
    limit = float(np.finfo(dtype).max)
    return ValueError(
        f"{name} must fit in {np.dtype(dtype)}{why} (|x| <= {limit:.4g}); got {value:.4g}, "
        f"which would become {'-' if value < 0 else '+'}inf{hint}"
    )


def available_memory() -> int | None:
    """Bytes of memory available to this process (Linux: MemAvailable), or None if unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, OSError, ValueError):  # pragma: no cover - not POSIX
        return None


# Below this many bytes an allocation is not checked (reading /proc/meminfo costs ~20 us).
MEMORY_CHECK_BYTES = 1 << 26


def check_memory(nbytes: int, what: str, hint: str = "") -> None:
    """Raise ``MemoryError`` before allocating ``nbytes`` if they exceed the available memory.

    ``what`` names the allocation and its shape, e.g. ``"the weights of shape (8, 500, 500)"``;
    ``hint`` says how to avoid it. An allocation that cannot fit would otherwise be attempted,
    and the system would swap or kill the process; NumPy's own ``MemoryError`` names no argument.
    """
    if nbytes <= MEMORY_CHECK_BYTES:
        return
    available = available_memory()
    if available is not None and nbytes > available:
        raise MemoryError(
            f"{what} would take about {_format_bytes(nbytes)} ({nbytes} bytes), more than the "
            f"{_format_bytes(available)} of memory available" + (f"; {hint}" if hint else "")
        )


def _format_bytes(n: float) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def check_int(value, name: str, *, minimum: int | None = None, unit: str = "") -> int:
    """Return ``value`` as an ``int`` if it is an integer (not a bool) ``>= minimum``, else raise.

    The one integer check: ``TypeError`` for a non-integer, ``ValueError`` below ``minimum``,
    both saying what was expected (with its ``unit``, if given: "a positive integer (words)")
    and what was given.
    """
    if minimum is None:
        expected = "an integer"
    elif minimum == 0:
        expected = "a non-negative integer"
    elif minimum == 1:
        expected = "a positive integer"
    else:
        expected = f"an integer >= {minimum}"
    if unit:
        expected += f" ({unit})"
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be {expected}; got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be {expected}; got {value!r}")
    return int(value)


def check_nonneg_int(value, name: str) -> int:
    """Return ``value`` as an ``int`` if it is a non-negative integer, else raise."""
    return check_int(value, name, minimum=0)


def check_positive_int(value, name: str, *, unit: str = "") -> int:
    """Return ``value`` as an ``int`` if it is a positive integer, else raise."""
    return check_int(value, name, minimum=1, unit=unit)


def broadcasts_to(shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether an array of ``shape`` broadcasts to exactly ``target`` (never beyond it).

    >>> broadcasts_to((1, 5), (3, 5)), broadcasts_to((2, 5), (3, 5)), broadcasts_to((2, 3, 5), (3, 5))
    (True, False, False)
    """
    try:
        return np.broadcast_shapes(shape, target) == tuple(target)
    except ValueError:
        return False


def shape_error(what: str, **arrays) -> ValueError:
    """``ValueError(what; got name.shape=..., ...)`` for arrays whose shapes do not fit."""
    given = ", ".join(f"{name}.shape={tuple(a.shape)}" for name, a in arrays.items())
    return ValueError(f"{what}; got {given}")


def check_query_key_value(
    query: ArrayLike, key: ArrayLike, value: ArrayLike, *, masked_hint: str = MASKED_ARRAY_HINT
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Query, key and value as floating arrays ``(..., T, Dk)``, ``(..., S, Dk)``, ``(..., S, Dv)``.

    Checks what every attention function needs: real arrays of at least two dimensions, one
    ``Dk`` shared by query and key, one ``S`` shared by key and value. Leading dimensions are
    left to the caller (their rules differ: heads, groups, batch).
    """
    q = as_float_array(query, "query", masked_hint=masked_hint)
    k = as_float_array(key, "key", masked_hint=masked_hint)
    v = as_float_array(value, "value", masked_hint=masked_hint)
    for name, a in (("query", q), ("key", k), ("value", v)):
        if a.ndim < 2:
            raise ValueError(
                f"{name} must have at least 2 dimensions (..., L, D); got {name}.shape={a.shape}"
            )
    if q.shape[-1] != k.shape[-1]:
        raise shape_error("query and key must share the last dimension Dk", query=q, key=k)
    if k.shape[-2] != v.shape[-2]:
        raise shape_error(
            "key and value must share the sequence length S (axis -2)", key=k, value=v
        )
    return q, k, v


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


def check_real(
    value, name: str, expected: str = "a finite real number", valid=math.isfinite
) -> float:
    """Return ``value`` as a ``float`` if it is a real number (not a bool) for which ``valid``
    holds, else raise.

    The one real-number check: ``TypeError`` for a non-number, ``ValueError`` when ``valid``
    fails, both with the message ``"{name} must be {expected}; got {value!r}"``.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, Real):
        raise TypeError(f"{name} must be {expected}; got {value!r}")
    if not valid(value):
        raise ValueError(f"{name} must be {expected}; got {value!r}")
    return float(value)


def check_scale(scale, head_dim: int) -> float:
    """Default ``1/sqrt(Dk)`` (1.0 when ``Dk = 0``); otherwise a finite real number."""
    if scale is None:
        return 1.0 / math.sqrt(head_dim) if head_dim > 0 else 1.0
    return check_real(scale, "scale", "a finite real number or None")


def check_probability(p, name: str) -> float:
    """A real number in ``[0, 1]``."""
    return check_real(p, name, "a real number in [0, 1]", lambda x: 0.0 <= x <= 1.0)


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


def deprecated_name(old: str, new: str) -> None:
    """Warn that ``old`` is a deprecated name of ``new`` (kept for one release)."""
    warnings.warn(
        f"{old} is deprecated and will be removed in the next release; use {new}",
        DeprecationWarning,
        stacklevel=3,
    )


def renamed_keyword(value, old_value, name: str, old_name: str):
    """The value of keyword ``name``, also accepted under its deprecated name ``old_name``.

    Passing the old name warns (``DeprecationWarning``); passing both is a ``TypeError``.
    """
    if old_value is None:
        return value
    if value is not None:
        raise TypeError(
            f"{name} and its deprecated name {old_name} were both given; pass {name} only; "
            f"got {name}={value!r}, {old_name}={old_value!r}"
        )
    warnings.warn(
        f"{old_name} is deprecated and will be removed in the next release; use {name}",
        DeprecationWarning,
        stacklevel=3,
    )
    return old_value


# Arguments of the array functions of sdpa.nn (their leading axes are anything).


def float_arrays(**arrays) -> tuple[list[np.ndarray], np.dtype]:
    """Convert the named arrays (None passes through) to their working dtype; return it too.

    The dtype policy of :mod:`sdpa.nn`'s functions: :func:`compute_dtype`.
    """
    converted = {name: None if a is None else as_float_array(a, name) for name, a in arrays.items()}
    present = [a for a in converted.values() if a is not None]
    out_dtype, work_dtype = compute_dtype(*present)
    work = [None if a is None else a.astype(work_dtype, copy=False) for a in converted.values()]
    return work, out_dtype


def check_features(x: np.ndarray, name: str) -> int:
    """``x`` must be ``(..., E)`` with ``E >= 1``; return ``E``."""
    if x.ndim == 0 or x.shape[-1] == 0:
        raise ValueError(
            f"{name} must have at least one dimension and a non-empty last axis (..., E); "
            f"got {name}.shape={x.shape}"
        )
    return x.shape[-1]


def check_vector(a: np.ndarray | None, name: str, size: int, of: str) -> None:
    if a is not None and a.shape != (size,):
        raise ValueError(
            f"{name} must have shape ({size},), the last axis of {of}; got {name}.shape={a.shape}"
        )


def check_grad_shape(d_y: np.ndarray, shape: tuple[int, ...], what: str) -> None:
    if d_y.shape != shape:
        raise ValueError(
            f"d_y must have the shape of the forward result {what}, {shape}; "
            f"got d_y.shape={d_y.shape}"
        )


def check_indices(
    indices: ArrayLike,
    name: str,
    shape: tuple[int, ...],
    size: int,
    ignore_index: int | None = None,
) -> np.ndarray:
    """Integer indices of the given shape, each in ``[0, size)`` or equal to ``ignore_index``."""
    idx = np.asarray(indices)
    if idx.dtype.kind not in "iu":
        raise TypeError(f"{name} must be an integer array; got dtype {idx.dtype}")
    if idx.shape != shape:
        raise ValueError(f"{name} must have shape {shape}; got {name}.shape={idx.shape}")
    valid = (idx >= 0) & (idx < size)
    if ignore_index is not None:
        valid |= idx == ignore_index
    if not valid.all():
        bad = idx[~valid].flat[0]
        raise ValueError(f"{name} must lie in [0, {size}); got the value {bad}")
    return idx
