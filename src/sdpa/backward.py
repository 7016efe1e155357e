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

An attention sink ``s_i`` is one more column of the softmax whose value is zero: its ``dP`` is
0, so ``D`` keeps its formula and the sink's gradient is that column's ``dS``,
``ds_i = P_sink,i (0 - D_i) = -exp(s_i - lse_i) D_i``; the keys' columns are as above, with
``P`` the weights that leave the sink its share.

Two implementations share one validation step (:func:`sdpa.problem.prepare_attention`, the
same as the forward pass, so every argument means exactly what it means there):

* :func:`backward_reference` builds the whole ``(T, S)`` weight matrix, one formula per line;
* :func:`backward_tiled` is the FlashAttention-2 backward: it stores nothing of size ``T x S``,
  but recomputes ``P`` tile by tile from the log-sum-exp ``lse`` saved by the forward pass,
  ``P_ij = exp(S_ij - lse_i)``, so its extra memory is ``O(T + S)`` per head. Where the scores
  are large (``RENORMALISE_RMS``) the forward pass's ``lse`` and ``D``, rounded in another
  arithmetic, are not accurate enough: a first pass over those query tiles recomputes each
  row's maximum ``m``, normaliser ``l`` and ``D`` from the backward's own scores, and
  ``P_ij = exp(S_ij - m_i) / l_i``. Its worker threads share the key tiles by a fixed rule,
  so its results are the same to the bit on every call with the same ``num_threads``.

Shape letters: ``B`` batch, ``Hq``/``Hkv`` query and key/value heads, ``T`` queries, ``S`` keys,
``Dk`` query/key width, ``Dv`` value width, ``Bq``/``Bk`` tile sizes.
"""

from __future__ import annotations

import functools
import math

import numpy as np
from numpy.typing import ArrayLike

from ._checks import ATTENTION_MASK_HINT, as_float_array, check_positive_int, check_range
from .attention import attention_reference
from .cost_model import worth_tiling
from .problem import (
    AttentionProblem,
    allowed_block,
    masked_scores,
    overflow_checked,
    poisoned_rows,
    prepare_attention,
)
from .threads import default_num_threads, run_in_threads, single_threaded_blas
from .tiled import attention_tiled
from .tuning import (
    BACKWARD_BLOCK_K,
    BACKWARD_BLOCK_Q,
    LSE_EXACT_LIMIT,
    RENORMALISE_LSE,
    RENORMALISE_RMS,
)

__all__ = ["scaled_dot_product_attention_backward"]

IMPLEMENTATIONS = ("auto", "reference", "tiled")


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


def _weights_from_lse(scores: np.ndarray, lse: np.ndarray) -> np.ndarray:
    """``P = exp(scores - lse)``; rows with ``lse = -inf`` (fully masked) give zeros, not NaN."""
    shift = np.where(np.isneginf(lse), 0, lse).astype(scores.dtype, copy=False)
    p = scores - shift[..., None]  # (..., T, S) - (..., T, 1)
    np.exp(p, out=p)
    return p


def _sink_weights(sinks: np.ndarray, shift: np.ndarray) -> np.ndarray:
    """``exp(s - shift)``, ``(*batch, T)``: the sinks' weights when ``shift`` is ``lse`` (or
    ``m``, then divided by ``l``); 0 where the sink is ``-inf``, also in a row whose ``lse`` is
    ``-inf`` (no key and no sink), where ``s - lse`` would be NaN."""
    shift = np.where(np.isneginf(shift), 0, shift).astype(shift.dtype, copy=False)
    with np.errstate(over="ignore"):  # a difference below -max is -inf: weight 0
        return np.exp(np.broadcast_to(sinks, shift.shape) - shift)


def _inexact_lse(lse: np.ndarray) -> np.ndarray:
    """Rows whose stored ``lse`` is too large for ``exp(scores - lse)`` to be exact."""
    return np.isfinite(lse) & (np.abs(lse) > LSE_EXACT_LIMIT)


# --------------------------------------------------------------------------------------------
# The two implementations (on a prepared problem, in the working dtype, grouped shapes)
# --------------------------------------------------------------------------------------------


def backward_reference(
    problem: AttentionProblem,
    d_out: np.ndarray,
    out: np.ndarray | None = None,
    lse: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """The textbook backward pass on a prepared problem; returns full-batch
    ``(d_q, d_k, d_v, d_sinks)``, ``d_sinks`` ``(*batch, T)`` or None without sinks.

    ``d_out`` and ``out`` are ``(*batch, T, Dv)``, ``lse`` is ``(*batch, T)`` in the grouped
    layout and working dtype. Without ``out`` and ``lse`` the forward pass is recomputed;
    with them only the weights are, from ``lse`` (or by the softmax itself when a row's
    ``lse`` is too large to be exact, see ``LSE_EXACT_LIMIT``). The results still carry every
    broadcast dimension; the caller sums them back to the inputs' shapes.
    """
    q, k, v = problem.query, problem.key, problem.value
    scale = problem.work_dtype.type(problem.scale)
    if out is None:
        out, weights, lse = attention_reference(problem, mark=False)
    elif _inexact_lse(lse).any():
        _, weights, lse = attention_reference(problem, mark=False)  # the exact lse, for sinks
    else:
        with overflow_checked(problem):
            q_scaled = q * scale
        scores = masked_scores(problem, q_scaled, 0, problem.T, 0, problem.S)
        weights = _weights_from_lse(scores, lse)  # (..., T, S)
    d_v = np.swapaxes(weights, -1, -2) @ d_out  # (..., S, T) @ (..., T, Dv) -> (..., S, Dv)
    d_weights = d_out @ np.swapaxes(v, -1, -2)  # (..., T, Dv) @ (..., Dv, S) -> (..., T, S)
    D = np.sum(d_out * out, axis=-1, keepdims=True)  # (..., T, 1): rowsum(dO * O)
    d_scores = weights * (d_weights - D)  # (..., T, S): the softmax's vector-Jacobian product
    d_q = (d_scores @ k) * scale  # (..., T, S) @ (..., S, Dk) -> (..., T, Dk)
    d_k = (np.swapaxes(d_scores, -1, -2) @ q) * scale  # (..., S, T) @ (..., T, Dk) -> (..., S, Dk)
    d_sinks = None
    if problem.sinks is not None:  # the sink's column: weight exp(s - lse), dP = 0
        d_sinks = -_sink_weights(problem.sinks, lse) * D[..., 0]  # (..., T)
    return d_q, d_k, d_v, d_sinks


def backward_tiled(
    problem: AttentionProblem,
    d_out: np.ndarray,
    out: np.ndarray,
    lse: np.ndarray,
    *,
    m: np.ndarray | None = None,
    ell: np.ndarray | None = None,
    block_q: int = BACKWARD_BLOCK_Q,
    block_k: int = BACKWARD_BLOCK_K,
    num_threads: int = 1,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]:
    """The FlashAttention-2 backward pass: recompute ``P`` one ``(Bq, Bk)`` tile at a time.

    The outer loop runs over key/value tiles, which own their ``d_k`` and ``d_v`` rows; the
    inner loop over query tiles adds into ``d_q``. Tiles that the causal/window band masks out
    entirely are skipped. With ``num_threads > 1`` the key/value tiles are shared out among
    worker threads by a fixed rule (:func:`_assign_tiles`), each with its own ``d_q``
    accumulator, summed at the end in worker order, and BLAS held to one thread: the results
    are the same to the bit on every call with the same inputs and ``num_threads``.

    ``P = exp(scores - lse)`` and ``D = rowsum(dO * O)`` from the forward pass, except in the
    query tiles that hold a row of large scores (:func:`_renormalised_rows`): there each row's
    maximum ``m``, normaliser ``l`` and ``D`` are recomputed first from the scores exactly as
    this pass rounds them (:func:`_row_statistics`), and ``P = exp(scores - m) / l``. Same
    arguments and results as :func:`backward_reference`, except that ``out`` and ``lse`` are
    required; ``m`` and ``ell`` (the forward pass's two parts of ``lse``) are accepted and not
    used: the recomputed ones replace them, wherever ``lse`` alone would not be exact. With
    sinks, ``lse``, ``m`` and ``l`` include the sink's term, and the sinks' weights come from
    them as the keys' do (``exp(s - lse)``, or ``exp(s - m) / l``).
    """
    del m, ell  # the forward pass's normalisers: _row_statistics recomputes them where needed
    q, k, v = problem.query, problem.key, problem.value
    dtype = problem.work_dtype
    scale = dtype.type(problem.scale)
    T, S, Dk, Dv = problem.T, problem.S, problem.Dk, problem.Dv
    batch = problem.batch_shape
    with overflow_checked(problem):
        q_scaled = q * scale  # (..., T, Dk): scaled once, as the forward pass does
    q_spans, k_spans = _spans(T, block_q), _spans(S, block_k)
    # P = exp(scores - shift) * inv_l (in the query tiles starting at `renormalised` only)
    shift, inv_l, D, renormalised = _normalisers(
        problem, q_scaled, d_out, out, lse, q_spans, k_spans, num_threads
    )
    d_k = np.zeros((*batch, S, Dk), dtype=dtype)
    d_v = np.zeros((*batch, S, Dv), dtype=dtype)

    def key_tile(span: tuple[int, int], d_q: np.ndarray) -> None:
        # scores - shift may overflow to -inf (P = 0). And OpenBLAS's small-matrix kernels can
        # leave the invalid flag set on finite inputs (seen once in a worker thread, on float16
        # inputs in float32, not reproducible): non-finite inputs are found and their rows marked
        # from the inputs themselves (_mark_gradients), as the forward's workers do, not from
        # the flags.
        with np.errstate(over="ignore", invalid="ignore"):
            key_tile_rows(*span, d_q)

    def key_tile_rows(s0: int, s1: int, d_q: np.ndarray) -> None:
        k_tile = k[..., s0:s1, :]  # (..., Bk, Dk)
        v_tile = v[..., s0:s1, :]  # (..., Bk, Dv)
        d_k_tile = d_k[..., s0:s1, :]  # views: this tile's rows are written by this task only
        d_v_tile = d_v[..., s0:s1, :]
        for t0, t1 in q_spans:
            if not _tile_in_band(problem, t0, t1, s0, s1):
                continue  # the whole tile is outside the causal/window band
            scores = masked_scores(problem, q_scaled, t0, t1, s0, s1)  # (*batch, Bq, Bk)
            p = scores - shift[..., t0:t1, None]
            np.exp(p, out=p)  # P recomputed: no (T, S) matrix is ever stored
            if t0 in renormalised:
                p *= inv_l[..., t0:t1, None]
            d_out_tile = d_out[..., t0:t1, :]  # (*batch, Bq, Dv)
            d_v_tile += np.swapaxes(p, -1, -2) @ d_out_tile  # (..., Bk, Bq) @ (..., Bq, Dv)
            d_p = d_out_tile @ np.swapaxes(v_tile, -1, -2)  # (..., Bq, Dv) @ (..., Dv, Bk)
            d_p -= D[..., t0:t1, None]
            d_p *= p  # d_scores = P * (dP - D)
            d_q[..., t0:t1, :] += d_p @ k_tile  # (..., Bq, Bk) @ (..., Bk, Dk)
            d_k_tile += np.swapaxes(d_p, -1, -2) @ q_scaled[..., t0:t1, :]  # (..., Bk, Dk)

    costs = [_band_area(problem, q_spans, [span]) for span in k_spans]
    d_q = _run_threaded(key_tile, k_spans, costs, num_threads, (*batch, T, Dk), dtype)
    d_q *= scale
    d_sinks = None
    if problem.sinks is not None:  # the sink's column: weight exp(s - shift) * inv_l, dP = 0
        p_sink = _sink_weights(problem.sinks, shift)
        if inv_l is not None:
            p_sink *= inv_l
        d_sinks = -p_sink * D  # (*batch, T)
    return d_q, d_k, d_v, d_sinks


# --------------------------------------------------------------------------------------------
# The tiled path's normalisers, tiles and threads
# --------------------------------------------------------------------------------------------


def _normalisers(problem, q_scaled, d_out, out, lse, q_spans, k_spans, num_threads):
    """``(shift, inv_l, D, renormalised)``: the main pass rebuilds ``P = exp(scores - shift)``,
    times ``inv_l`` in the query tiles whose starts are in the set ``renormalised``.

    ``shift = lse`` (0 in fully masked rows) and ``D = rowsum(dO * O)`` from the forward pass,
    except in the query tiles holding a row of large scores (:func:`_renormalised_rows`),
    whose rows take ``shift = m``, ``inv_l = 1 / l`` and ``D`` from :func:`_row_statistics`.
    Each of ``shift``, ``inv_l`` (None if no tile is renormalised) and ``D`` is
    ``(*batch_shape, T)``.
    """
    shift = np.where(np.isneginf(lse), 0, lse).astype(problem.work_dtype, copy=False)
    D = np.sum(d_out * out, axis=-1)  # (*batch, T): rowsum(dO * O)
    with single_threaded_blas():  # see _run_shared
        large = _renormalised_rows(problem, q_scaled, lse)
    spans = [(t0, t1) for t0, t1 in q_spans if large[..., t0:t1].any()]
    if not spans:
        return shift, None, D, set()
    m, ell, D_own = _row_statistics(problem, q_scaled, d_out, spans, k_spans, num_threads)
    own = ell > 0  # the rows of those tiles (a fully masked row keeps P = 0)
    inv_l = np.ones_like(shift)
    np.divide(1, ell, out=inv_l, where=own)
    return np.where(own, m, shift), inv_l, np.where(own, D_own, D), {t0 for t0, _ in spans}


def _renormalised_rows(problem: AttentionProblem, q_scaled: np.ndarray, lse: np.ndarray):
    """``(*batch_shape, T)`` bool: rows whose scores are large enough for the forward pass's
    rounding of them to matter (see ``RENORMALISE_RMS``); never a fully masked one.

    The root-mean-square score of row ``i`` over all ``S`` keys (masks aside) comes from the
    keys' Gram matrix, ``rms_i^2 = q_i^T (K^T K) q_i / S`` with ``q_i`` scaled: ``T Dk^2`` work
    per head, not ``T S Dk``. A bias shows in ``lse`` instead, as does a single large score.
    """
    k = problem.key
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow gives inf or NaN: flagged
        gram = np.swapaxes(k, -1, -2) @ k  # (..., Dk, S) @ (..., S, Dk) -> (..., Dk, Dk)
        mean_square = np.sum((q_scaled @ gram) * q_scaled, axis=-1) / max(problem.S, 1)
    small = (mean_square <= RENORMALISE_RMS**2) & (np.abs(lse) <= RENORMALISE_LSE)  # (..., T)
    return ~small & np.isfinite(lse)


def _row_statistics(problem, q_scaled, d_out, spans, k_spans, num_threads):
    """``(m, ell, D)``, each ``(*batch_shape, T)``, of the rows of the query tiles ``spans``,
    from the scores exactly as the main pass rounds them (``ell = 0`` in the other rows).

    ``m`` is a row's maximum, ``ell`` the sum of ``exp(scores - m)``, and ``D = rowsum(dO * O)``
    with ``O = P V`` rebuilt from these weights: the main pass's rows ``P = exp(scores - m) /
    ell`` then sum to one to rounding, and ``D`` is the ``rowsum(P * dP)`` of that very ``P``,
    so that the rounding cancels in ``P * (dP - D)`` as on the reference path. One pass of the
    online softmax (a new maximum rescales the sums) over the key tiles of each query tile, on
    the scores of :func:`sdpa.problem.masked_scores` for the main pass's tiles. Each query tile
    is the task of one worker, which owns its rows: no sums across threads.
    """
    dtype = problem.work_dtype
    batch, T, Dv = problem.batch_shape, problem.T, problem.Dv
    m = np.full((*batch, T), -np.inf, dtype=dtype)
    ell = np.zeros((*batch, T), dtype=dtype)
    D = np.zeros((*batch, T), dtype=dtype)
    v = problem.value
    ones = np.ones(max((s1 - s0 for s0, s1 in k_spans), default=0), dtype=dtype)
    sinks = None if problem.sinks is None else np.broadcast_to(problem.sinks, (*batch, T))

    def query_tile(span: tuple[int, int], _) -> None:
        t0, t1 = span
        m_t, ell_t = m[..., t0:t1], ell[..., t0:t1]  # (*batch, Bq) views of this task's rows
        acc = np.zeros((*batch, t1 - t0, Dv), dtype=dtype)  # sum of exp(scores - m) v
        for s0, s1 in k_spans:
            if not _tile_in_band(problem, t0, t1, s0, s1):
                continue
            scores = masked_scores(problem, q_scaled, t0, t1, s0, s1)  # (*batch, Bq, Bk)
            m_new = np.maximum(m_t, np.max(scores, axis=-1))  # -inf: no allowed key yet
            shift = np.where(np.isneginf(m_new), 0, m_new).astype(dtype, copy=False)
            p = scores - shift[..., None]
            np.exp(p, out=p)  # exp(scores - m_new), at most 1
            alpha = np.exp(m_t - shift)  # (*batch, Bq): the old sums, to the new maximum
            ell_t *= alpha
            ell_t += p @ ones[: s1 - s0]  # row sums: (..., Bq, Bk) @ (Bk,) -> (..., Bq)
            acc *= alpha[..., None]
            acc += p @ v[..., s0:s1, :]  # (..., Bq, Bk) @ (..., Bk, Dv) -> (..., Bq, Dv)
            m_t[...] = m_new
        if sinks is not None:  # the sink: one more term of the normaliser, with no value
            _add_sink(m_t, ell_t, acc, sinks[..., t0:t1])
        d_out_acc = np.sum(d_out[..., t0:t1, :] * acc, axis=-1)  # (*batch, Bq): ell * D
        np.divide(d_out_acc, ell_t, out=D[..., t0:t1], where=ell_t > 0)

    costs = [_band_area(problem, [span], k_spans) for span in spans]
    _run_shared(query_tile, spans, costs, num_threads)
    return m, ell, D


def _add_sink(m: np.ndarray, ell: np.ndarray, acc: np.ndarray, s: np.ndarray) -> None:
    """Add each row's sink ``s`` to its running maximum ``m``, normaliser ``ell`` and the
    rescaled ``acc`` (``(..., Bq)``, ``(..., Bq)``, ``(..., Bq, Dv)``, in place), as one more
    key whose score is ``s`` and whose value is zero."""
    m_new = np.maximum(m, s)
    shift = np.where(np.isneginf(m_new), 0, m_new).astype(m.dtype, copy=False)
    alpha = np.exp(m - shift)  # 0 where no key was allowed (m = -inf), else <= 1
    ell *= alpha
    ell += np.exp(s - shift)
    acc *= alpha[..., None]
    m[...] = m_new


def _spans(n: int, block: int) -> list[tuple[int, int]]:
    """The tiles ``(start, stop)`` of ``range(n)`` in blocks of ``block``."""
    return [(start, min(start + block, n)) for start in range(0, n, block)]


def _tile_in_band(problem: AttentionProblem, t0: int, t1: int, s0: int, s1: int) -> bool:
    """Whether the causal/window band lets some query of ``t0:t1`` attend some key of ``s0:s1``.

    Query ``i`` may attend key ``j`` when ``lo <= j - (i + o) <= hi``; over the tile,
    ``j - (i + o)`` takes every integer from ``s0 - (t1 - 1) - o`` to ``s1 - 1 - t0 - o``.
    """
    lo, hi = problem.band
    first = s0 - (t1 - 1) - problem.offset
    last = s1 - 1 - t0 - problem.offset
    return max(first, -math.inf if lo is None else lo) <= min(last, math.inf if hi is None else hi)


def _band_area(problem: AttentionProblem, q_spans, k_spans) -> int:
    """The scores computed on the tiles ``q_spans x k_spans`` in the band: a tile's cost."""
    return sum(
        (t1 - t0) * (s1 - s0)
        for t0, t1 in q_spans
        for s0, s1 in k_spans
        if _tile_in_band(problem, t0, t1, s0, s1)
    )


def _assign_tiles(costs: list[int], num_threads: int) -> list[list[int]]:
    """Share tiles among ``num_threads`` workers by a fixed rule: the indices each one runs.

    The costliest tile first, each to the worker with the least work so far (the lowest index
    on a tie); each worker then runs its tiles in index order. The shares depend on the costs
    alone, never on the scheduling, so the order of every addition into a worker's ``d_q`` is
    fixed; longest first keeps the work balanced under a causal mask, where the last key tiles
    cost least (costs 8, 6, 4, 2 on two workers: 8 + 2 and 6 + 4).
    """
    loads = [0] * num_threads
    shares: list[list[int]] = [[] for _ in range(num_threads)]
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):  # stable: ties in index order
        w = min(range(num_threads), key=lambda w: (loads[w], w))
        shares[w].append(i)
        loads[w] += costs[i]
    return [sorted(share) for share in shares]


def _run_shared(task, items, costs, num_threads, accumulator=None) -> list:
    """Run ``task(item, acc)`` for every item, on workers holding the shares of
    :func:`_assign_tiles`; each worker's ``acc`` is its own ``accumulator()`` (or None). Returns
    the accumulators in worker order.

    BLAS is held to one thread throughout, also with one worker (which runs in the calling
    thread) and in the small products just before: on the 2-core test machine OpenBLAS's own
    threads, spinning after a product of the calling thread, made the workers' tiles up to
    twice as slow, and while other processes were busy its threaded small products made the
    one-worker path about 10 times as slow.
    """
    num_threads = max(1, min(num_threads, len(items)))
    shares = _assign_tiles(costs, num_threads)

    def worker(share: list[int]):
        acc = None if accumulator is None else accumulator()
        for i in share:
            task(items[i], acc)
        return acc

    if num_threads == 1:
        with single_threaded_blas():  # as in the threads: BLAS's own threads slow tiles down
            return [worker(shares[0])]
    return run_in_threads([functools.partial(worker, share) for share in shares])


def _run_threaded(task, items, costs, num_threads, d_q_shape, dtype) -> np.ndarray:
    """Run ``task(item, d_q)`` for every key tile on ``num_threads`` workers, each adding into a
    ``d_q`` of its own; return their sum, added in worker order (the same additions every call)."""

    def accumulator() -> np.ndarray:
        return np.zeros(d_q_shape, dtype=dtype)

    partials = _run_shared(task, items, costs, num_threads, accumulator)
    total = partials[0]
    for partial in partials[1:]:
        total += partial
    return total


# --------------------------------------------------------------------------------------------
# The public function
# --------------------------------------------------------------------------------------------


def _keys_reached(problem: AttentionProblem, rows: np.ndarray) -> np.ndarray:
    """``(*batch_shape, S)`` bool: keys that at least one of the flagged query ``rows`` may
    attend (boolean mask and band; a float bias never protects a key). In chunks of keys."""
    T, S = problem.T, problem.S
    result = np.zeros((*problem.batch_shape, S), dtype=bool)
    step = max(1, (1 << 22) // max(1, rows.size))
    for s0 in range(0, S, step):
        s1 = min(S, s0 + step)
        hit = np.broadcast_to(rows[..., None], (*rows.shape, s1 - s0))  # (..., T, c)
        allowed = allowed_block(problem, 0, T, s0, s1)
        if allowed is not None:
            hit = hit & allowed
        result[..., s0:s1] = np.any(hit, axis=-2)
    return result


def _mark_gradients(problem, d_q, d_k, d_v, d_sinks, rows):
    """NaN in, NaN out: a query row that a non-finite input reaches gets a NaN ``d_q`` row (and
    a NaN sink gradient), and every key it may attend gets NaN ``d_k`` and ``d_v`` rows (before
    the broadcast sums)."""
    nan = problem.work_dtype.type(np.nan)
    if d_sinks is not None:
        d_sinks = np.array(np.broadcast_to(d_sinks, rows.shape))
        d_sinks[rows] = nan
    d_q = np.array(np.broadcast_to(d_q, (*problem.batch_shape, problem.T, problem.Dk)))
    d_q[rows] = nan
    keys = _keys_reached(problem, rows)
    d_k = np.array(np.broadcast_to(d_k, (*problem.batch_shape, problem.S, problem.Dk)))
    d_v = np.array(np.broadcast_to(d_v, (*problem.batch_shape, problem.S, problem.Dv)))
    d_k[keys] = nan
    d_v[keys] = nan
    return d_q, d_k, d_v, d_sinks


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
    sinks: ArrayLike | None = None,
    out: ArrayLike | None = None,
    lse: ArrayLike | None = None,
    implementation: str = "auto",
    block_q: int | None = None,
    block_k: int | None = None,
    num_threads: int | None = None,
) -> tuple[np.ndarray, ...]:
    r"""Gradients of :func:`sdpa.scaled_dot_product_attention` with respect to its three inputs.

    Given ``d_out = dL/d(out)`` for some scalar loss ``L``, returns ``(dL/dquery, dL/dkey,
    dL/dvalue)``, the same numbers as ``torch.autograd`` on PyTorch's attention, and
    ``dL/dsinks`` fourth when the call has ``sinks``. Every argument from ``query`` to
    ``sinks`` means exactly what it means in the forward call.

    Parameters
    ----------
    d_out : (..., Hq, T, Dv) array_like
        Gradient of the loss with respect to the forward output; it must have the output's
        full (broadcast) shape.
    query, key, value, attn_mask, is_causal, scale, enable_gqa, causal_alignment, window
        As in :func:`sdpa.scaled_dot_product_attention`.
    sinks : (..., Hq, T) array_like, optional
        The attention sinks' logits of the forward call; their gradient is returned too.
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
        would (:func:`sdpa.cost_model.worth_tiling`).
    block_q, block_k : int, optional
        Tile sizes ``Bq`` and ``Bk`` of the tiled path (default 128 and 256).
    num_threads : int, optional
        Worker threads of the tiled path; default: the cores available
        (:func:`sdpa.threads.default_num_threads`), as for the forward pass. They share the
        key tiles by a fixed rule: for the same inputs and ``num_threads`` the gradients are
        the same to the bit on every call, from any calling thread.

    Returns
    -------
    d_query : np.ndarray
        Same shape and dtype as ``query`` (float64 for integer or bool inputs).
    d_key : np.ndarray
        Same shape and dtype as ``key``.
    d_value : np.ndarray
        Same shape and dtype as ``value``.
    d_sinks : np.ndarray
        Only when ``sinks`` is given (the tuple then has four entries): same shape and dtype
        as ``sinks`` (float64 for integer sinks or a Python number), summed over every row
        that shares a sink, as autograd sums a broadcast input's gradient.

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

    **Sinks.** A sink is one more column of the softmax with the value 0: its ``dP`` is 0,
    ``D`` keeps its formula, and ``ds_i = -P_sink,i D_i`` with ``P_sink,i = exp(s_i - lse_i)``,
    the weight the sink takes. A row with no allowed key has ``out = 0``, hence ``D = 0`` and
    no gradient; a sink of ``-inf`` gets 0.

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
    that bias). The reference path therefore computes the softmax anew in rows beyond 64. The
    tiled path's forward pass rounds its scores in another arithmetic (its own tiles, base 2
    where that is faster, a shift folded into the product), so its ``lse`` and ``out`` are off
    from the backward's own by about ``|score| * eps``: in the query tiles holding a row whose
    root-mean-square score exceeds 1.5 or whose ``|lse|`` exceeds 16, the tiled path first
    recomputes each row's maximum ``m``, normaliser ``l`` and ``D = rowsum(dO * O)`` from its
    own scores, and uses ``P = exp(scores - m) / l``. Its gradients are then as accurate as the
    reference path's (within a factor 2, measured with scores up to 10^4, and whatever the
    bias), at the price of about two thirds of the backward's time again on those tiles.

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

    With sinks a fourth gradient comes back, shaped like ``sinks`` (here one logit per head,
    ``(H, 1)``, so each entry sums over the head's ``T`` rows). Raising a sink moves weight
    from the keys to it, so ``L = sum(out)`` changes by ``-P_sink,i * D_i`` per row:

    >>> qh, kh, vh = q[None], k[None], v[None]  # one head: (1, T, Dk), (1, S, Dk), (1, S, Dv)
    >>> sinks = np.array([[0.5]])  # (H, 1)
    >>> grads = attention_backward(np.ones((1, 3, 2)), qh, kh, vh, sinks=sinks)
    >>> len(grads), grads[3].shape
    (4, (1, 1))
    >>> fd = (attention(qh, kh, vh, sinks=sinks + 1e-6).sum()
    ...       - attention(qh, kh, vh, sinks=sinks - 1e-6).sum()) / 2e-6
    >>> bool(np.isclose(grads[3][0, 0], fd, rtol=1e-6))
    True
    """
    if implementation not in IMPLEMENTATIONS:
        raise ValueError(f"implementation must be one of {IMPLEMENTATIONS}; got {implementation!r}")
    block_q = BACKWARD_BLOCK_Q if block_q is None else check_positive_int(block_q, "block_q")
    block_k = BACKWARD_BLOCK_K if block_k is None else check_positive_int(block_k, "block_k")
    if num_threads is None:
        num_threads = default_num_threads()
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
        sinks=sinks,
    )
    T, Dv = problem.T, problem.Dv
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
        implementation = "tiled" if worth_tiling(problem) else "reference"
    if implementation == "reference":
        grads = backward_reference(problem, d_out, out, lse)
    else:
        if out is None:  # O(T + S) memory per head, like the backward
            out, lse = attention_tiled(problem, mark=False)
        out = np.broadcast_to(out, (*full, T, Dv))
        lse = np.broadcast_to(lse, (*full, T))
        grads = backward_tiled(
            problem,
            d_out,
            out,
            lse,
            block_q=block_q,
            block_k=block_k,
            num_threads=num_threads,
        )
    rows = [np.broadcast_to(r, (*full, T)) for r in bad_rows if r is not None]
    if rows:
        grads = _mark_gradients(problem, *grads, np.logical_or.reduce(rows))
    return _user_gradients(problem, grads, (query, key, value, sinks))


def _user_gradients(problem: AttentionProblem, grads, inputs) -> tuple[np.ndarray, ...]:
    """``(d_query, d_key, d_value[, d_sinks])`` in the shapes and dtypes of ``inputs``.

    Each full-batch gradient of ``grads`` is summed over the axes along which its input was
    broadcast (and over the GQA group), then shaped like the input; ``d_sinks`` only when the
    call had sinks.
    """
    grouped = (problem.query, problem.key, problem.value, problem.sinks)
    results = []
    for grad, prepared, original in zip(grads, grouped, inputs):
        if prepared is None:  # no sinks
            continue
        grad = _sum_to_shape(grad, prepared.shape)  # undo broadcasting and the GQA grouping
        results.append(grad.reshape(np.shape(original)).astype(_grad_dtype(original)))
    return tuple(results)
