r"""Merging partial attention: the results over parts of the keys, combined into one.

Attention of a query over all ``S`` keys can be computed part by part: split the keys (and
their values) into ``P`` parts, attend to each part alone, and keep each part's output
``o_p`` and log-sum-exp ``lse_p`` (``return_lse=True``). Since ``exp(lse_p)`` is the part's
softmax denominator, the whole one is their sum, and each part's output is weighted by its
share of it:

.. math::
    \operatorname{lse} = \log \sum_p e^{\operatorname{lse}_p}, \qquad
    o = \sum_p e^{\operatorname{lse}_p - \operatorname{lse}}\, o_p.

This is the online softmax's rescaling step applied to whole parts, and the step that
split-KV decoding (Flash-Decoding: the parts on different thread blocks), ring attention (the
parts on different devices) and cascade attention (a shared prefix attended once) end with.
The module's one function, :func:`sdpa.merge_attention_states`, is exported by the package
and documented with its names.

Shape letters: ``T`` queries, ``Dv`` value width, ``P`` the number of parts.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike

from ._checks import as_float_array

__all__ = ["merge_attention_states"]


def _parts(items, name: str) -> list[np.ndarray]:
    """``items`` as a list of floating arrays; ``TypeError`` unless it is a list or tuple of
    array_likes (one array is refused: iterating it would cut it along its first axis)."""
    if not isinstance(items, (list, tuple)):
        hint = " (a single part goes in a list: [part])" if hasattr(items, "shape") else ""
        raise TypeError(
            f"{name} must be a list or tuple of arrays, one per part of the keys; "
            f"got {type(items).__name__}{hint}"
        )
    return [as_float_array(x, f"{name}[{p}]") for p, x in enumerate(items)]


def _check_parts(outputs: list[np.ndarray], lses: list[np.ndarray]) -> None:
    """One output ``(..., T, Dv)`` and one lse ``(..., T)`` per part, all parts alike."""
    if len(outputs) != len(lses):
        raise ValueError(
            f"outputs and lses must hold one entry per part; got {len(outputs)} outputs "
            f"and {len(lses)} lses"
        )
    if not outputs:
        raise ValueError("outputs and lses must hold at least one part; got 0 parts")
    first = outputs[0]
    if first.ndim < 1:
        raise ValueError(f"outputs[0] must have the shape (..., T, Dv); got shape {first.shape}")
    for p, (out, lse) in enumerate(zip(outputs, lses)):
        if out.shape != first.shape:
            raise ValueError(
                f"every part's output must have the shape of outputs[0], {first.shape}; "
                f"got outputs[{p}].shape={out.shape}"
            )
        if lse.shape != first.shape[:-1]:
            raise ValueError(
                f"every part's lse must have the shape of its output without the last axis, "
                f"{first.shape[:-1]}; got lses[{p}].shape={lse.shape}"
            )


def _empty_as_minus_inf(lse: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """``lse`` in ``dtype`` (a copy) with ``+inf``, a kernel's mark of a part with no keys,
    as ``-inf``, the log of its empty sum."""
    lse = lse.astype(dtype, copy=True)
    lse[np.isposinf(lse)] = -np.inf
    return lse


def merge_attention_states(
    outputs: Sequence[ArrayLike], lses: Sequence[ArrayLike]
) -> tuple[np.ndarray, np.ndarray]:
    r"""Combine attention over parts of the keys into attention over all of them.

    Parameters
    ----------
    outputs : sequence of (..., T, Dv) array_like
        One output per part: attention of the same queries over one part of the keys, as
        :func:`sdpa.scaled_dot_product_attention` returns it. A list or tuple of ``P`` arrays
        of one shape.
    lses : sequence of (..., T) array_like
        The parts' log-sum-exps (``return_lse=True``), in the same order.

    Returns
    -------
    out : (..., T, Dv) np.ndarray
        Attention over the union of the parts, in the outputs' dtype (their common dtype
        under NumPy's promotion; float64 for integer outputs).
    lse : (..., T) np.ndarray
        Its log-sum-exp, ``log(sum_p exp(lse_p))``, in the lses' dtype, at least float32.

    Raises
    ------
    TypeError
        If ``outputs`` or ``lses`` is not a list or tuple (a single array included), or one of
        its entries is not a real array.
    ValueError
        If there are no parts, not as many lses as outputs, or parts of different shapes (or
        an lse that does not have its output's shape without the last axis).

    See Also
    --------
    sdpa.scaled_dot_product_attention : What each part comes from, with ``return_lse=True``.

    Notes
    -----
    With ``m`` the largest ``lse_p`` of a row, part ``p`` weighs
    ``w_p = exp(lse_p - m) / sum_q exp(lse_q - m)``, so no exponent is positive:

    .. math:: o = \sum_p w_p\, o_p, \qquad
              \operatorname{lse} = m + \log \sum_p e^{\operatorname{lse}_p - m}.

    A part whose ``lse`` is ``-inf`` (it holds no key the query may attend) contributes
    nothing, whatever its output holds; a row in which every part is ``-inf`` gets
    ``out = 0`` and ``lse = -inf``, with no NaN and no warning. An ``lse`` of ``+inf``, which
    no finite scores give, counts as ``-inf`` too: split-KV kernels write it as their sentinel
    for a part with no keys (vLLM's merge kernel and its test map ``+inf`` to ``-inf``), so
    such a part is empty, not infinitely heavy. A NaN in a part's ``lse`` makes the row's
    ``out`` and ``lse`` NaN (NaN in, NaN out). Parts whose ``lse`` differ by more than the
    dtype's largest finite number (``3e38`` and ``-3e38`` in float32) merge without a warning:
    the smaller one's weight is 0, as it should be. The arithmetic is in float32 at least (float64 for float64 inputs), so
    float16 outputs lose nothing beyond their own rounding. ``P = 1`` returns the part as it
    is (copied, the ``lse`` at least float32, ``+inf`` in it as ``-inf``). The order of the parts does not matter, up to
    rounding: the merge is associative, so parts can be merged in a tree, or passed around
    a ring, as well as all at once. Attention sinks belong to exactly one part (include them
    in one call only), since each part's ``lse`` would count them.

    Examples
    --------
    Split 10 keys into parts of 3, 4 and 3, attend to each part, merge: the same as one call.

    >>> import numpy as np
    >>> from sdpa import merge_attention_states, scaled_dot_product_attention
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((2, 1, 8))  # (H, T, Dk): one new token, 2 heads
    >>> k, v = rng.standard_normal((2, 10, 8)), rng.standard_normal((2, 10, 4))
    >>> parts = [scaled_dot_product_attention(q, k[:, a:b], v[:, a:b], return_lse=True)
    ...          for a, b in [(0, 3), (3, 7), (7, 10)]]
    >>> out, lse = merge_attention_states([o for o, _ in parts], [l for _, l in parts])
    >>> whole, whole_lse = scaled_dot_product_attention(q, k, v, return_lse=True)
    >>> bool(np.allclose(out, whole, rtol=1e-14, atol=1e-15))
    True
    >>> bool(np.allclose(lse, whole_lse, rtol=1e-14))
    True

    Two parts with equal ``lse`` count equally; a part with no key (``lse = -inf``) not at all:

    >>> out, lse = merge_attention_states(
    ...     [np.array([[1.0, 3.0]]), np.array([[3.0, 5.0]]), np.array([[9.0, 9.0]])],
    ...     [np.array([0.0]), np.array([0.0]), np.array([-np.inf])],
    ... )
    >>> out, np.round(lse, 4)  # the mean of the first two; lse = log(1 + 1)
    (array([[2., 4.]]), array([0.6931]))
    """
    outputs = _parts(outputs, "outputs")
    lses = _parts(lses, "lses")
    _check_parts(outputs, lses)
    out_dtype = np.result_type(*outputs)
    lse_dtype = np.promote_types(np.result_type(*lses), np.float32)
    if len(outputs) == 1:
        return outputs[0].astype(out_dtype, copy=True), _empty_as_minus_inf(lses[0], lse_dtype)
    work = np.promote_types(np.result_type(out_dtype, lse_dtype), np.float32)
    lse_parts = [_empty_as_minus_inf(x, work) for x in lses]
    m = np.maximum.reduce(lse_parts)  # (..., T): NaN if a part's is NaN
    ordinary = np.isfinite(m)  # False: every part -inf (no key at all), or NaN met
    shift = np.where(ordinary, m, 0).astype(work, copy=False)
    # invalid: -inf - -inf in the rows that are not ordinary; over: a part more than finfo.max
    # below the largest gives -inf, whose exp is its right weight, 0
    with np.errstate(invalid="ignore", over="ignore"):
        weights = [np.exp(np.where(ordinary, x - shift, -np.inf)) for x in lse_parts]
    total = np.sum(weights, axis=0)  # (..., T): >= 1 in ordinary rows (the largest part's 1)
    inv = np.zeros_like(total)
    np.divide(1, total, out=inv, where=ordinary)
    out = np.zeros(outputs[0].shape, work)
    for out_p, w in zip(outputs, weights):
        share = (w * inv)[..., None]  # (..., T, 1): the part's share, the shares sum to one
        # a part adds nothing to the rows it has no share in, not even 0 * NaN
        out += np.where(share > 0, out_p, 0) * share
    lse = np.where(ordinary, m + np.log(np.where(ordinary, total, 1)), -np.inf)
    special = np.isnan(m)  # NaN in, NaN out
    if special.any():
        out[special] = np.nan
        lse = np.where(special, np.nan, lse)
    return out.astype(out_dtype, copy=False), lse.astype(lse_dtype, copy=False)
