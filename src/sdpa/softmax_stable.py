"""Numerically stable softmax, log-softmax and log-sum-exp.

All three subtract the slice maximum ``m`` before exponentiating, so ``exp`` never sees a
positive argument and cannot overflow. Two edge cases get exact answers instead of NaN:

* a slice that is entirely ``-inf`` (every position masked) has softmax ``0`` everywhere,
  log-sum-exp ``-inf`` and log-softmax ``-inf``;
* a slice that contains ``+inf`` puts all its mass, shared equally, on the ``+inf`` entries
  (the limit of softmax as those entries grow).

A NaN makes its whole slice NaN (softmax, log-softmax and log-sum-exp alike). None of these
cases raises a floating-point warning, and neither do finite inputs whose differences exceed
the dtype's range (``[1e308, -1e308]``): the far entry gets probability 0 and log-probability
``-inf``, the rounding of a value below the range.

float16 is computed in float32 and returned as float16;
integer and bool inputs are computed and returned in float64.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from ._checks import as_float_array, check_axis, compute_dtype

__all__ = ["softmax", "log_softmax", "logsumexp"]

SOFTMAX_MASK_HINT = "pass the plain array with the masked entries set to -inf"


def _prepare(x: ArrayLike, axis) -> tuple[np.ndarray, int, np.dtype]:
    arr = as_float_array(x, "x", masked_hint=SOFTMAX_MASK_HINT)
    if arr.ndim == 0:
        raise ValueError("x must have at least one dimension; got a 0-d array")
    axis = check_axis(arr, axis)
    out_dtype, work_dtype = compute_dtype(arr)
    return arr.astype(work_dtype, copy=False), axis, out_dtype


def softmax_and_lse(x: np.ndarray, axis: int = -1) -> tuple[np.ndarray, np.ndarray]:
    """Softmax and log-sum-exp of a floating array along ``axis`` (internal, no validation).

    Returns ``(p, lse)`` where ``lse`` keeps the reduced axis with length one. ``x`` is not
    modified and no floating-point warning is raised. Per slice:

    * finite maximum: the ordinary stable formula;
    * entirely ``-inf`` (or empty): ``p = 0`` and ``lse = -inf``;
    * containing ``+inf`` (and no NaN): the mass is shared equally by the ``+inf`` entries and
      ``lse = +inf``;
    * containing NaN: ``p`` and ``lse`` are NaN for the whole slice.
    """
    if x.shape[axis] == 0:
        lse_shape = list(x.shape)
        lse_shape[axis] = 1
        return np.zeros_like(x), np.full(lse_shape, -np.inf, dtype=x.dtype)
    m = np.max(x, axis=axis, keepdims=True)  # NaN if the slice holds a NaN
    ordinary = np.isfinite(m)
    if ordinary.all():
        with np.errstate(over="ignore"):  # x - m below -max is -inf: exp gives 0, as it should
            p = np.subtract(x, m)
        np.exp(p, out=p)  # every exponent <= 0: no overflow
        total = np.sum(p, axis=axis, keepdims=True)  # >= 1, since the maximum gives exp(0)
        p /= total
        return p, m + np.log(total)
    # Some slices are special (all -inf, +inf, NaN). Exponentiate only the ordinary ones;
    # the others start from exp(-inf) = 0 and are filled in below.
    shift = np.where(ordinary, m, 0).astype(x.dtype, copy=False)
    with np.errstate(over="ignore"):  # as above
        p = np.where(ordinary, x, x.dtype.type(-np.inf)) - shift
    np.exp(p, out=p)
    total = np.sum(p, axis=axis, keepdims=True)
    p /= np.where(ordinary, total, 1)
    lse = np.where(ordinary, m + np.log(np.where(ordinary, total, 1)), m)  # -inf, +inf or NaN
    has_pos_inf = np.isposinf(m)
    if has_pos_inf.any():  # the limit of softmax as the +inf entries grow together
        is_inf = np.isposinf(x)
        count = np.sum(is_inf, axis=axis, keepdims=True)
        share = is_inf / np.maximum(count, 1)
        p = np.where(has_pos_inf, share, p).astype(x.dtype, copy=False)
    has_nan = np.isnan(m)
    if has_nan.any():
        p = np.where(has_nan, x.dtype.type(np.nan), p)
    return p, lse.astype(x.dtype, copy=False)


def softmax(x: ArrayLike, axis: int = -1) -> np.ndarray:
    r"""Softmax along ``axis``: ``exp(x - m) / sum(exp(x - m))`` with ``m`` the slice maximum.

    Parameters
    ----------
    x : (..., N, ...) array_like
        Real scores. Integer and bool inputs are converted to float64.
    axis : int, default -1
        The axis that is normalised.

    Returns
    -------
    p : np.ndarray
        Same shape and floating dtype as ``x``; each slice along ``axis`` is non-negative and
        sums to one, except slices that are entirely ``-inf``, which are all zero.

    Raises
    ------
    TypeError
        If ``x`` is complex or not numeric, or ``axis`` is not an integer.
    ValueError
        If ``x`` is 0-d or ``axis`` is out of range.

    Notes
    -----
    Subtracting the maximum changes nothing mathematically, since
    :math:`e^{x_i - m} / \sum_j e^{x_j - m} = e^{x_i} / \sum_j e^{x_j}`, but it keeps every
    exponent at most zero, so float32 scores of ``1e4`` do not overflow.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa import softmax
    >>> np.round(softmax([2.0, 1.0, 0.1]), 3)
    array([0.659, 0.242, 0.099])
    >>> softmax(np.array([1e4, 0.0], dtype=np.float32))  # no overflow
    array([1., 0.], dtype=float32)
    >>> softmax([-np.inf, -np.inf])  # a fully masked slice is all zero, not NaN
    array([0., 0.])
    """
    arr, axis, out_dtype = _prepare(x, axis)
    p, _ = softmax_and_lse(arr, axis)
    return p.astype(out_dtype, copy=False)


def logsumexp(x: ArrayLike, axis: int = -1) -> np.ndarray:
    r"""Stable ``log(sum(exp(x)))`` along ``axis``; ``-inf`` for slices that are all ``-inf``.

    Parameters
    ----------
    x : (..., N, ...) array_like
        Real values.
    axis : int, default -1
        The axis that is reduced.

    Returns
    -------
    lse : np.ndarray
        ``x`` with ``axis`` removed, in the floating dtype of ``x``.

    Raises
    ------
    TypeError
        If ``x`` is complex or not numeric, or ``axis`` is not an integer.
    ValueError
        If ``x`` is 0-d or ``axis`` is out of range.

    Notes
    -----
    Computed as :math:`m + \log \sum_j e^{x_j - m}` with ``m`` the slice maximum. An empty
    slice has log-sum-exp ``-inf`` (the log of an empty sum).

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa import logsumexp
    >>> float(np.round(logsumexp([0.0, np.log(3.0)]), 6))  # log(1 + 3)
    1.386294
    >>> logsumexp(np.array([1e4, 1e4], dtype=np.float32))  # 1e4 + log 2, no overflow
    array(10000.693, dtype=float32)
    >>> logsumexp([-np.inf, -np.inf])
    array(-inf)
    """
    arr, axis, out_dtype = _prepare(x, axis)
    _, lse = softmax_and_lse(arr, axis)
    return np.squeeze(lse, axis=axis).astype(out_dtype, copy=False)


def log_softmax(x: ArrayLike, axis: int = -1) -> np.ndarray:
    """Stable ``log(softmax(x))`` along ``axis``, computed as ``x - logsumexp(x)``.

    Parameters
    ----------
    x : (..., N, ...) array_like
        Real scores.
    axis : int, default -1
        The axis that is normalised.

    Returns
    -------
    log_p : np.ndarray
        Same shape and floating dtype as ``x``. Entries that are ``-inf`` stay ``-inf``
        (probability zero), also in slices that are entirely ``-inf``.

    Raises
    ------
    TypeError
        If ``x`` is complex or not numeric, or ``axis`` is not an integer.
    ValueError
        If ``x`` is 0-d or ``axis`` is out of range.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa import log_softmax
    >>> np.round(log_softmax([2.0, 1.0, 0.1]), 3)
    array([-0.417, -1.417, -2.317])
    >>> log_softmax(np.array([-1e4, 1e4], dtype=np.float32))  # exact where naive log underflows
    array([-20000.,      0.], dtype=float32)
    """
    arr, axis, out_dtype = _prepare(x, axis)
    if arr.shape[axis] == 0:
        return arr.astype(out_dtype, copy=True)
    # (x - m) - log(sum(exp(x - m))): subtracting the maximum first keeps the small differences
    # exact; x - logsumexp(x) would lose them when |x| is large (float32 near 1e4).
    m = np.max(arr, axis=axis, keepdims=True)
    ordinary = np.isfinite(m)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        # x - m below -max is -inf: the log-probability is below the dtype's range
        z = np.where(ordinary, arr - np.where(ordinary, m, 0), arr.dtype.type(-np.inf))
        out = z - np.log(np.sum(np.exp(z), axis=axis, keepdims=True))
        if not ordinary.all():  # slices entirely -inf, or holding +inf or NaN
            p, lse = softmax_and_lse(arr, axis)
            # -inf entries have probability zero: -inf exactly, also where lse is -inf too
            # (slices entirely -inf), where the subtraction alone would give NaN.
            special = np.where(np.isneginf(arr) & ~np.isnan(lse), -np.inf, arr - lse)
            if np.isposinf(lse).any():  # slices holding +inf: log of the limit distribution
                special = np.where(np.isposinf(lse), np.log(p), special)
            out = np.where(ordinary, out, special)
    return out.astype(out_dtype, copy=False)
