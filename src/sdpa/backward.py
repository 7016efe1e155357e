r"""The backward pass of scaled dot-product attention, derived by hand.

Forward, for one head (``P`` the weights, ``O`` the output):

.. math::
    S = \text{scale}\; Q K^\top + \text{bias}, \qquad P = \operatorname{softmax}(S), \qquad O = P V.

Given the upstream gradient ``dO = dL/dO`` the chain rule gives, line by line,

.. math::
    dV = P^\top dO, \quad dP = dO\, V^\top, \quad D = \operatorname{rowsum}(dO \odot O), \quad
    dS = P \odot (dP - D), \quad dQ = \text{scale}\; dS\, K, \quad dK = \text{scale}\; dS^\top Q.

``D`` is the softmax's correction term: ``rowsum(P * dP) = rowsum(dO * (P V)) = rowsum(dO * O)``,
so it needs the output, not the ``(T, S)`` matrices.

Two implementations share one validation step (:func:`sdpa.attention.prepare_attention`, the
same as the forward pass, so every argument means exactly what it means there):

* :func:`backward_reference` builds the whole ``(T, S)`` weight matrix, one formula per line;
* :func:`backward_tiled` is the FlashAttention-2 backward: it stores nothing of size ``T x S``,
  but recomputes ``P`` tile by tile from the log-sum-exp ``lse`` saved by the forward pass,
  ``P_ij = exp(S_ij - lse_i)``, so its extra memory is ``O(T + S)`` per head.

Shape letters: ``B`` batch, ``Hq``/``Hkv`` query and key/value heads, ``T`` queries, ``S`` keys,
``Dk`` query/key width, ``Dv`` value width, ``Bq``/``Bk`` tile sizes.
"""

from __future__ import annotations

import os
import threading

import numpy as np
from numpy.typing import ArrayLike

from . import attention as _attention
from . import tiled as _tiled
from ._checks import ATTENTION_MASK_HINT, as_float_array, check_positive_int, check_range
from .attention import (
    AttentionProblem,
    check_overflow,
    combined_allowed,
    overflow_checked,
    poisoned_rows,
    prepare_attention,
)

__all__ = ["scaled_dot_product_attention_backward"]

IMPLEMENTATIONS = ("auto", "reference", "tiled")

# Default tile sizes: a (Bq, Bk) tile of float64 scores is 256 KiB, half the 512 KiB level-2
# cache of one core of the machine they were chosen on (AMD EPYC, Zen 3). "auto" tiles exactly
# when the forward pass would (sdpa.tiled.worth_tiling, its cost model of both paths).
DEFAULT_BLOCK_Q = 128
DEFAULT_BLOCK_K = 256

# The weights are rebuilt as P = exp(scores - lse). The rounding of a stored lse is an error in
# every exponent, of up to half a unit in its last place: negligible while |lse| is small, but
# at |lse| = 1e4 in float32 it is 5e-4, and at lse = finfo.min (a row whose every key carries
# the bias finfo.min) it swallows log(l) entirely. Rows with |lse| above this limit use the
# forward pass's two parts instead, P = exp(scores - m) / l (recomputed if only lse is given).
LSE_EXACT_LIMIT = 64.0


# --------------------------------------------------------------------------------------------
# Shapes: from the user's arrays to the grouped problem and back
# --------------------------------------------------------------------------------------------


def _grad_dtype(x: ArrayLike) -> np.dtype:
    """The dtype of a gradient: the input's own floating dtype (float64 for int and bool)."""
    dtype = np.asarray(x).dtype
    return dtype if dtype.kind == "f" else np.dtype(np.float64)


def _full_shape(problem: AttentionProblem, trailing: tuple[int, ...]) -> tuple[int, ...]:
    """The user-facing shape of a result: batch dimensions with the heads merged, then ``trailing``."""
    batch = problem.batch_shape
    if problem.groups is not None:
        batch = (*batch[:-2], batch[-2] * batch[-1])
    return (*batch, *trailing)


def _grouped(problem: AttentionProblem, x: np.ndarray, trailing: int) -> np.ndarray:
    """Split the heads axis of a user-facing result into ``(Hkv, G)`` (inverse of ``ungroup``)."""
    if problem.groups is None:
        return x
    return x.reshape(*problem.batch_shape, *x.shape[x.ndim - trailing :])


def _check_result(x, name: str, problem: AttentionProblem, trailing: tuple[int, ...], what: str):
    """A forward result or upstream gradient, grouped, in the working dtype; NaN rows zeroed.

    Returns ``(array, bad_rows)``: ``bad_rows`` (``(*batch_shape, T)`` bool, or None) flags the
    query rows holding NaN or inf (for ``lse``: NaN or ``+inf``; ``-inf`` marks a fully masked
    row). Those rows are replaced by zeros, and the caller makes their gradients NaN.
    """
    arr = as_float_array(x, name, masked_hint=ATTENTION_MASK_HINT)
    expected = _full_shape(problem, trailing)
    if arr.shape != expected:
        raise ValueError(
            f"{name} must have the shape of the forward pass's {what}, {expected}; "
            f"got {name}.shape={arr.shape}"
        )
    check_range(arr, problem.work_dtype, name, ", the dtype the gradients are computed in")
    arr = _grouped(problem, arr.astype(problem.work_dtype, copy=False), len(trailing))
    bad = np.isnan(arr) | np.isposinf(arr) if trailing == (problem.T,) else ~np.isfinite(arr)
    if len(trailing) == 2:
        bad = bad.any(axis=-1)
    if not bad.any():
        return arr, None
    fill = bad if len(trailing) == 1 else bad[..., None]
    return np.where(fill, arr.dtype.type(0), arr), bad


def _sum_to_shape(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Sum a gradient over the dimensions along which its input was broadcast (as autograd does)."""
    extra = x.ndim - len(shape)
    assert extra >= 0, (x.shape, shape)
    if extra:
        x = x.sum(axis=tuple(range(extra)))
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    if axes:
        x = x.sum(axis=axes, keepdims=True)
    assert x.shape == tuple(shape), (x.shape, shape)
    return x


def _block(mask: np.ndarray | None, t0: int, t1: int, s0: int, s1: int) -> np.ndarray | None:
    """Rows ``t0:t1`` and columns ``s0:s1`` of a mask that may be broadcast along either axis."""
    if mask is None:
        return None
    if mask.shape[-1] != 1:
        mask = mask[..., s0:s1]
    if mask.ndim >= 2 and mask.shape[-2] != 1:
        mask = mask[..., t0:t1, :]
    return mask


def _weights_from_lse(scores: np.ndarray, lse: np.ndarray) -> np.ndarray:
    """``P = exp(scores - lse)``; rows with ``lse = -inf`` (fully masked) give zeros, not NaN."""
    shift = np.where(np.isneginf(lse), 0, lse).astype(scores.dtype, copy=False)
    p = scores - shift[..., None]  # (..., T, S) - (..., T, 1)
    np.exp(p, out=p)
    return p


def _inexact_lse(lse: np.ndarray) -> np.ndarray:
    """Rows whose stored ``lse`` is too large for ``exp(scores - lse)`` to be exact."""
    return np.isfinite(lse) & (np.abs(lse) > LSE_EXACT_LIMIT)


# --------------------------------------------------------------------------------------------
# The two implementations (on a prepared problem, in the working dtype, grouped shapes)
# --------------------------------------------------------------------------------------------


def _raw_scores(problem: AttentionProblem, q_scaled, k, t0, t1, s0, s1):
    """``scale * q k^T + bias`` on queries ``t0:t1`` and keys ``s0:s1``, checked for overflow
    when that is possible, and with disallowed entries set to ``-inf``."""
    bias = _block(problem.bias, t0, t1, s0, s1)
    with overflow_checked(problem):  # an overflow is an error raised below, not a warning
        scores = q_scaled[..., t0:t1, :] @ np.swapaxes(k[..., s0:s1, :], -1, -2)  # (..., Bq, Bk)
        if bias is not None:
            scores = scores + bias
    allowed = _block(problem.allowed, t0, t1, s0, s1)
    band = problem.band_mask(t0, t1, s0, s1)
    if band is not None:
        allowed = band if allowed is None else allowed & band
    if problem.may_overflow:
        check_overflow(problem, scores, allowed, bias)
    if allowed is not None:
        scores = np.where(allowed, scores, problem.work_dtype.type(-np.inf))
    return scores


def backward_reference(
    problem: AttentionProblem,
    d_out: np.ndarray,
    out: np.ndarray | None = None,
    lse: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The textbook backward pass on a prepared problem; returns full-batch ``(d_q, d_k, d_v)``.

    ``d_out`` and ``out`` are ``(*batch, T, Dv)``, ``lse`` is ``(*batch, T)`` in the grouped
    layout and working dtype. Without ``out`` and ``lse`` the forward pass is recomputed;
    with them only the weights are, from ``lse`` (or by the softmax itself when a row's
    ``lse`` is too large to be exact, see ``LSE_EXACT_LIMIT``). The results still carry every
    broadcast dimension; the caller sums them back to the inputs' shapes.
    """
    q, k, v = problem.query, problem.key, problem.value
    scale = problem.work_dtype.type(problem.scale)
    if out is None:
        out, weights, lse = _attention.attention_reference(problem, mark=False)
    elif _inexact_lse(lse).any():
        weights = _attention.attention_reference(problem, mark=False)[1]
    else:
        with overflow_checked(problem):
            q_scaled = q * scale
        scores = _raw_scores(problem, q_scaled, k, 0, problem.T, 0, problem.S)
        weights = _weights_from_lse(scores, lse)  # (..., T, S)
    d_v = np.swapaxes(weights, -1, -2) @ d_out  # (..., S, T) @ (..., T, Dv) -> (..., S, Dv)
    d_weights = d_out @ np.swapaxes(v, -1, -2)  # (..., T, Dv) @ (..., Dv, S) -> (..., T, S)
    D = np.sum(d_out * out, axis=-1, keepdims=True)  # (..., T, 1): rowsum(dO * O)
    d_scores = weights * (d_weights - D)  # (..., T, S): the softmax's vector-Jacobian product
    d_q = (d_scores @ k) * scale  # (..., T, S) @ (..., S, Dk) -> (..., T, Dk)
    d_k = (np.swapaxes(d_scores, -1, -2) @ q) * scale  # (..., S, T) @ (..., T, Dk) -> (..., S, Dk)
    return d_q, d_k, d_v


def backward_tiled(
    problem: AttentionProblem,
    d_out: np.ndarray,
    out: np.ndarray,
    lse: np.ndarray,
    *,
    m: np.ndarray | None = None,
    ell: np.ndarray | None = None,
    block_q: int = DEFAULT_BLOCK_Q,
    block_k: int = DEFAULT_BLOCK_K,
    num_threads: int = 1,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The FlashAttention-2 backward pass: recompute ``P`` one ``(Bq, Bk)`` tile at a time.

    The outer loop runs over key/value tiles, which own their ``d_k`` and ``d_v`` rows; the
    inner loop over query tiles adds into ``d_q``. Tiles that the causal/window band masks out
    entirely are skipped. With ``num_threads > 1`` the key/value tiles are shared out among
    worker threads, each with its own ``d_q`` accumulator (summed at the end) and BLAS held to
    one thread. Same arguments and results as :func:`backward_reference`, except that ``out``
    and ``lse`` are required; ``m`` and ``ell`` (from ``attention_tiled(return_stats=True)``)
    are the two parts of ``lse``, used for the rows where ``lse`` alone is not exact (they are
    recomputed when needed and not given).
    """
    q, k, v = problem.query, problem.key, problem.value
    dtype = problem.work_dtype
    scale = dtype.type(problem.scale)
    T, S, Dk, Dv = problem.T, problem.S, problem.Dk, problem.Dv
    batch = problem.batch_shape
    with overflow_checked(problem):
        q_scaled = q * scale  # (..., T, Dk): scaled once, as the forward pass does
    D = np.sum(d_out * out, axis=-1)  # (*batch, T): rowsum(dO * O)
    # P = exp(scores - shift) * inv_l: shift = lse, inv_l = 1 for most rows; shift = m and
    # inv_l = 1 / l for rows whose lse is too large to be exact.
    inexact = _inexact_lse(lse)
    if inexact.any():
        if m is None:
            _, _, m, ell = _tiled.attention_tiled(problem, return_stats=True, mark=False)
        m = np.broadcast_to(m, (*batch, T))
        ell = np.broadcast_to(ell, (*batch, T))
        shift = np.where(inexact, m, lse)
        inv_l = np.ones((*batch, T), dtype=dtype)
        np.divide(1, ell, out=inv_l, where=inexact & (ell > 0))
    else:
        shift, inv_l = lse, None
    shift = np.where(np.isneginf(shift), 0, shift).astype(dtype, copy=False)  # (*batch, T)
    d_k = np.zeros((*batch, S, Dk), dtype=dtype)
    d_v = np.zeros((*batch, S, Dv), dtype=dtype)

    def key_tile(s0: int, d_q: np.ndarray) -> None:
        with np.errstate(over="ignore"):  # scores - shift may overflow to -inf: P = 0
            key_tile_rows(s0, d_q)

    def key_tile_rows(s0: int, d_q: np.ndarray) -> None:
        s1 = min(s0 + block_k, S)
        k_tile = k[..., s0:s1, :]  # (..., Bk, Dk)
        v_tile = v[..., s0:s1, :]  # (..., Bk, Dv)
        d_k_tile = d_k[..., s0:s1, :]  # views: this tile's rows are written by this task only
        d_v_tile = d_v[..., s0:s1, :]
        for t0 in range(0, T, block_q):
            t1 = min(t0 + block_q, T)
            band = problem.band_mask(t0, t1, s0, s1)  # (Bq, Bk) or None
            if band is not None and not band.any():
                continue  # the whole tile is outside the causal/window band
            scores = _raw_scores(problem, q_scaled, k, t0, t1, s0, s1)  # (*batch, Bq, Bk)
            p = scores - shift[..., t0:t1, None]
            np.exp(p, out=p)  # P recomputed from lse: no (T, S) matrix is ever stored
            if inv_l is not None and inexact[..., t0:t1].any():
                p *= inv_l[..., t0:t1, None]
            d_out_tile = d_out[..., t0:t1, :]  # (*batch, Bq, Dv)
            d_v_tile += np.swapaxes(p, -1, -2) @ d_out_tile  # (..., Bk, Bq) @ (..., Bq, Dv)
            d_p = d_out_tile @ np.swapaxes(v_tile, -1, -2)  # (..., Bq, Dv) @ (..., Dv, Bk)
            d_p -= D[..., t0:t1, None]
            d_p *= p  # d_scores = P * (dP - D)
            d_q[..., t0:t1, :] += d_p @ k_tile  # (..., Bq, Bk) @ (..., Bk, Dk)
            d_k_tile += np.swapaxes(d_p, -1, -2) @ q_scaled[..., t0:t1, :]  # (..., Bk, Dk)

    starts = list(range(0, S, block_k))
    num_threads = max(1, min(num_threads, len(starts)))
    if num_threads == 1:
        d_q = np.zeros((*batch, T, Dk), dtype=dtype)
        for s0 in starts:
            key_tile(s0, d_q)
    else:
        d_q = _run_threaded(key_tile, starts, num_threads, (*batch, T, Dk), dtype)
    d_q *= scale
    return d_q, d_k, d_v


def _run_threaded(task, starts, num_threads, d_q_shape, dtype) -> np.ndarray:
    """Run ``task(s0, d_q)`` for every key tile on ``num_threads`` workers; return the summed ``d_q``."""
    lock = threading.Lock()
    pending = iter(starts)

    def worker() -> np.ndarray:
        d_q = np.zeros(d_q_shape, dtype=dtype)  # private accumulator: no two threads add into one
        while True:
            with lock:
                s0 = next(pending, None)
            if s0 is None:
                return d_q
            task(s0, d_q)

    partials = _tiled.run_in_threads([worker] * num_threads)
    total = partials[0]
    for partial in partials[1:]:
        total += partial
    return total


# --------------------------------------------------------------------------------------------
# The public function
# --------------------------------------------------------------------------------------------


def _worth_tiling(problem: AttentionProblem) -> bool:
    """Whether ``implementation="auto"`` tiles: the forward pass's own rule, so both agree."""
    return _tiled.worth_tiling(problem)


def _keys_reached(problem: AttentionProblem, rows: np.ndarray) -> np.ndarray:
    """``(*batch_shape, S)`` bool: keys that at least one of the flagged query ``rows`` may
    attend (boolean mask and band; a float bias never protects a key). In chunks of keys."""
    T, S = problem.T, problem.S
    result = np.zeros((*problem.batch_shape, S), dtype=bool)
    step = max(1, (1 << 22) // max(1, rows.size))
    for s0 in range(0, S, step):
        s1 = min(S, s0 + step)
        hit = np.broadcast_to(rows[..., None], (*rows.shape, s1 - s0))  # (..., T, c)
        allowed = _block(problem.allowed, 0, T, s0, s1)
        if allowed is not None:
            hit = hit & allowed
        band = problem.band_mask(0, T, s0, s1)
        if band is not None:
            hit = hit & band
        result[..., s0:s1] = np.any(hit, axis=-2)
    return result


def _mark_gradients(problem, d_q, d_k, d_v, rows):
    """NaN in, NaN out: a query row that a non-finite input reaches gets a NaN ``d_q`` row, and
    every key it may attend gets NaN ``d_k`` and ``d_v`` rows (before the broadcast sums)."""
    nan = problem.work_dtype.type(np.nan)
    d_q = np.array(np.broadcast_to(d_q, (*problem.batch_shape, problem.T, problem.Dk)))
    d_q[rows] = nan
    keys = _keys_reached(problem, rows)
    d_k = np.array(np.broadcast_to(d_k, (*problem.batch_shape, problem.S, problem.Dk)))
    d_v = np.array(np.broadcast_to(d_v, (*problem.batch_shape, problem.S, problem.Dv)))
    d_k[keys] = nan
    d_v[keys] = nan
    return d_q, d_k, d_v


def scaled_dot_product_attention_backward(
    d_out: ArrayLike,
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    attn_mask: ArrayLike | None = None,
    is_causal: bool = False,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
    causal_alignment: str = "top_left",
    window: tuple[int | None, int | None] | None = None,
    out: ArrayLike | None = None,
    lse: ArrayLike | None = None,
    implementation: str = "auto",
    block_q: int | None = None,
    block_k: int | None = None,
    num_threads: int | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    r"""Gradients of :func:`sdpa.scaled_dot_product_attention` with respect to its three inputs.

    Given ``d_out = dL/d(out)`` for some scalar loss ``L``, returns ``(dL/dquery, dL/dkey,
    dL/dvalue)``, the same numbers as ``torch.autograd`` on PyTorch's attention. Every argument
    from ``query`` to ``window`` means exactly what it means in the forward call.

    Parameters
    ----------
    d_out : (..., Hq, T, Dv) array_like
        Gradient of the loss with respect to the forward output; it must have the output's
        full (broadcast) shape.
    query, key, value, attn_mask, is_causal, scale, enable_gqa, causal_alignment, window
        As in :func:`sdpa.scaled_dot_product_attention`.
    out : (..., Hq, T, Dv) array_like, optional
        The forward output.
    lse : (..., Hq, T) array_like, optional
        The forward log-sum-exp (``return_lse=True``). Give ``out`` and ``lse`` together and the
        forward pass is not recomputed; the weights are rebuilt from ``lse`` instead (except
        for rows with ``|lse| > 64``, see Notes).
    implementation : {"auto", "reference", "tiled"}, default "auto"
        ``"reference"`` holds the whole ``(..., T, S)`` weight matrix; ``"tiled"`` (the
        FlashAttention-2 backward) recomputes it tile by tile from ``lse`` and needs memory
        proportional to ``T + S`` per head; ``"auto"`` tiles exactly when the forward pass
        would (``sdpa.tiled.worth_tiling``).
    block_q, block_k : int, optional
        Tile sizes ``Bq`` and ``Bk`` of the tiled path (default 128 and 256).
    num_threads : int, optional
        Worker threads of the tiled path; default: the number of CPUs, at most 2.

    Returns
    -------
    d_query : np.ndarray
        Same shape and dtype as ``query`` (float64 for integer or bool inputs).
    d_key : np.ndarray
        Same shape and dtype as ``key``.
    d_value : np.ndarray
        Same shape and dtype as ``value``.

    Raises
    ------
    TypeError
        As the forward pass; also for a non-integer tile size or thread count.
    ValueError
        As the forward pass; also if ``d_out``, ``out`` or ``lse`` does not have the forward
        result's shape or holds a value beyond the working dtype's range, if only one of
        ``out`` and ``lse`` is given, or for an unknown ``implementation`` or a non-positive
        tile size or thread count.
    MemoryError
        As the forward pass, for the reference path.

    Notes
    -----
    With ``P`` the weights and ``O`` the output of one head,

    .. math::
        dV = P^\top dO,\; dP = dO\,V^\top,\; D = \operatorname{rowsum}(dO \odot O),\;
        dS = P \odot (dP - D),\; dQ = \text{scale}\; dS\,K,\; dK = \text{scale}\; dS^\top Q.

    **Broadcasting.** An input that was broadcast in the forward pass (a shared key, a missing
    batch axis, ``Hkv = 1``) receives the sum of the gradients of all its uses, as autograd
    does. With ``enable_gqa=True`` each key/value head receives the sum over its group of
    ``Hq // Hkv`` query heads.

    **Masks** are constants: a float mask (bias) receives no gradient. Masked positions have
    ``P = 0`` and pass no gradient; fully masked rows (``lse = -inf``) give zero gradients, not
    NaN.

    **NaN in, NaN out.** A query row that a NaN or infinity reaches in the forward pass (see
    :func:`sdpa.scaled_dot_product_attention`), or whose ``d_out``, ``out`` or ``lse`` holds
    one, gets a NaN row of ``d_query``, and every key it may attend gets NaN rows of ``d_key``
    and ``d_value``. Keys and values hidden from it by a boolean, causal or window mask are
    untouched, on both paths.

    **Exact weights from lse.** ``P = exp(scores - lse)`` inherits the rounding of ``lse`` in
    every exponent: half a unit in its last place, negligible for ``|lse| <= 64`` but 5e-4 at
    ``lse = 1e4`` in float32, and everything at ``lse = finfo.min`` (a row whose keys all carry
    that bias). Rows beyond 64 therefore use the forward pass's maximum and sum separately,
    ``P = exp(scores - m) / l`` (recomputed when only ``lse`` is given), so the gradients are
    as exact as the reference path's whatever the bias.

    **Dropout** is not supported: this is the gradient of the call with ``dropout_p = 0``.

    **Dtypes.** Computed in the forward pass's working dtype (float16 in float32). The forward
    pass returns a float32 ``lse`` for float16 inputs; pass that one (a float16 ``lse``
    overflows beyond 65504 and has lost precision).

    Examples
    --------
    The gradient of ``L = sum(out)`` for a small causal problem, checked against central
    finite differences:

    >>> import numpy as np
    >>> from sdpa import scaled_dot_product_attention as attention
    >>> from sdpa import scaled_dot_product_attention_backward as attention_backward
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((3, 4))  # (T, Dk)
    >>> k = rng.standard_normal((5, 4))  # (S, Dk)
    >>> v = rng.standard_normal((5, 2))  # (S, Dv)
    >>> d_q, d_k, d_v = attention_backward(np.ones((3, 2)), q, k, v, is_causal=True)
    >>> d_q.shape, d_k.shape, d_v.shape
    ((3, 4), (5, 4), (5, 2))
    >>> e = np.zeros_like(q); e[1, 2] = 1e-6
    >>> fd = (attention(q + e, k, v, is_causal=True).sum()
    ...       - attention(q - e, k, v, is_causal=True).sum()) / 2e-6
    >>> bool(np.isclose(d_q[1, 2], fd, rtol=1e-6))
    True

    Here ``d_v = P^T @ ones``: row ``j`` is the total weight that the queries give key ``j``,
    so the column sums to ``T = 3``. Under the causal mask keys 3 and 4 are never attended to
    and get no gradient:

    >>> np.round(d_v, 3)
    array([[1.862, 1.862],
           [1.041, 1.041],
           [0.097, 0.097],
           [0.   , 0.   ],
           [0.   , 0.   ]])
    >>> float(np.round(d_v[:, 0].sum(), 12))
    3.0
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(
            f"implementation must be one of {IMPLEMENTATIONS}; got {implementation!r}"
        )
    block_q = DEFAULT_BLOCK_Q if block_q is None else check_positive_int(block_q, "block_q")
    block_k = DEFAULT_BLOCK_K if block_k is None else check_positive_int(block_k, "block_k")
    if num_threads is None:
        num_threads = min(2, os.cpu_count() or 1)
    else:
        num_threads = check_positive_int(num_threads, "num_threads")
    if (out is None) != (lse is None):
        given, missing = ("out", "lse") if lse is None else ("lse", "out")
        raise ValueError(
            f"out and lse must be given together (both from the forward pass) or not at all; "
            f"got {given} without {missing}"
        )
    problem = prepare_attention(
        query,
        key,
        value,
        attn_mask,
        is_causal,
        scale=scale,
        enable_gqa=enable_gqa,
        causal_alignment=causal_alignment,
        window=window,
    )
    T, S, Dv = problem.T, problem.S, problem.Dv
    full = problem.batch_shape
    d_out, bad = _check_result(d_out, "d_out", problem, (T, Dv), "output (..., Hq, T, Dv)")
    bad_rows = [bad]
    if out is not None:
        out, bad = _check_result(out, "out", problem, (T, Dv), "output (..., Hq, T, Dv)")
        bad_rows.append(bad)
        lse, bad = _check_result(lse, "lse", problem, (T,), "log-sum-exp (..., Hq, T)")
        bad_rows.append(bad)
    bad_rows.extend(poisoned_rows(problem))  # rows that a non-finite query, key or value reaches

    if implementation == "auto":  # the forward pass's rule, so both passes agree
        implementation = "tiled" if _worth_tiling(problem) else "reference"
    if implementation == "reference":
        d_q, d_k, d_v = backward_reference(problem, d_out, out, lse)
    else:
        m = ell = None
        if out is None:  # O(T + S) memory per head, like the backward
            out, lse, m, ell = _tiled.attention_tiled(problem, return_stats=True, mark=False)
        out = np.broadcast_to(out, (*full, T, Dv))
        lse = np.broadcast_to(lse, (*full, T))
        d_q, d_k, d_v = backward_tiled(
            problem, d_out, out, lse, m=m, ell=ell, block_q=block_q, block_k=block_k,
            num_threads=num_threads,
        )
    rows = [np.broadcast_to(r, (*full, T)) for r in bad_rows if r is not None]
    if rows:
        d_q, d_k, d_v = _mark_gradients(problem, d_q, d_k, d_v, np.logical_or.reduce(rows))

    results = []
    for grad, grouped, original in (
        (d_q, problem.query, query),
        (d_k, problem.key, key),
        (d_v, problem.value, value),
    ):
        grad = _sum_to_shape(grad, grouped.shape)  # undo broadcasting and the GQA grouping
        results.append(grad.reshape(np.shape(original)).astype(_grad_dtype(original)))
    return tuple(results)
