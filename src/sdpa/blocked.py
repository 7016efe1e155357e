r"""Blocked attention, written to be read: FlashAttention-2's two loops and nothing else.

:mod:`sdpa.tiled` is the fast kernel (threads, lazy rescaling, folded shifts, scores in base
2). This module is the same algorithm as a learner would write it from the paper, the
way nanoGPT keeps its slow path beside its fast one: the forward pass is two loops over blocks
of queries and blocks of keys/values, carrying the online-softmax state, and the backward pass
is two loops the other way round, recomputing the probabilities from the log-sum-exp the
forward pass saved. Every line is one step of the maths, with its shapes in a comment, and
the local names are the book's (``scores``, ``weights``, ``m``, ``l``, ``lse``, ``delta``,
``dq``, ``dk``, ``dv``), since the book prints these functions' source.

Shape letters: ``T`` queries, ``S`` keys, ``Dk`` query/key width, ``Dv`` value width, ``Bq``
and ``Bk`` the block sizes (the last block of each loop may be shorter).

Supported: one head, 2-D arrays ``q (T, Dk)``, ``k (S, Dk)``, ``v (S, Dv)``, and the causal
mask (``is_causal=True``, aligned top left as in :func:`sdpa.scaled_dot_product_attention`:
query ``i`` attends the keys ``j <= i``), for which the loops skip every tile above the
diagonal and mask inside the tiles the diagonal crosses. Not supported, on purpose: other masks
(boolean or additive), batches, heads and grouped-query attention, dropout.
:func:`sdpa.scaled_dot_product_attention` has all of them.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numpy.typing import ArrayLike

from ._checks import (
    as_float_array,
    check_bool,
    check_positive_int,
    check_scale,
    compute_dtype,
    lse_dtype,
)
from .tuning import LSE_EXACT_LIMIT  # beyond it, the rounding of a saved lse moves the weights

__all__ = ["blocked_attention", "blocked_attention_backward"]


def _check_matrix(x: ArrayLike, name: str, letters: str) -> np.ndarray:
    arr = as_float_array(x, name)
    if arr.ndim != 2:
        raise ValueError(
            f"{name} must be a 2-D array {letters} (one head, no batch); "
            f"got {name}.shape={arr.shape}"
        )
    return arr


def _check_blocks(block_q, block_k) -> tuple[int, int]:
    return check_positive_int(block_q, "block_q"), check_positive_int(block_k, "block_k")


def _check_options(is_causal, on_tile) -> bool:
    if on_tile is not None and not callable(on_tile):
        raise TypeError(
            f"on_tile must be callable, as on_tile(i, j), or None; got {type(on_tile).__name__}"
        )
    return check_bool(is_causal, "is_causal")


def _causal(i: int, j: int, shape: tuple[int, int]) -> np.ndarray:
    """The causal mask of the tile whose first query is ``i`` and first key ``j``:
    ``(Bq, Bk)``, True where key ``j + b`` is not after query ``i + a``."""
    queries = np.arange(i, i + shape[0])[:, None]  # (Bq, 1)
    keys = np.arange(j, j + shape[1])[None, :]  # (1, Bk)
    return keys <= queries  # (Bq, Bk)


def _prepare(q, k, v, scale):
    """Validate the inputs; return them in the working dtype, the scale and the output dtype."""
    q = _check_matrix(q, "q", "(T, Dk)")
    k = _check_matrix(k, "k", "(S, Dk)")
    v = _check_matrix(v, "v", "(S, Dv)")
    if q.shape[1] != k.shape[1]:
        raise ValueError(
            f"q and k must share the last dimension Dk; got q.shape={q.shape}, k.shape={k.shape}"
        )
    if k.shape[0] != v.shape[0]:
        raise ValueError(
            f"k and v must have the same number of rows S; got k.shape={k.shape}, v.shape={v.shape}"
        )
    if k.shape[0] == 0:
        raise ValueError(
            "k and v must have at least one row (S >= 1): with no keys there is nothing to "
            f"attend to; got k.shape={k.shape}"
        )
    out_dtype, work = compute_dtype(q, k, v)
    scale = work.type(check_scale(scale, q.shape[1]))
    q, k, v = (x.astype(work, copy=False) for x in (q, k, v))
    return q, k, v, scale, out_dtype


def _check_like(x: ArrayLike, name: str, shape: tuple[int, ...], what: str) -> np.ndarray:
    arr = as_float_array(x, name)
    if arr.shape != shape:
        raise ValueError(
            f"{name} must have the shape {what}, {shape}; got {name}.shape={arr.shape}"
        )
    return arr


def _check_results(out, lse, d_out, q: np.ndarray, v: np.ndarray):
    """The forward results and the upstream gradient, checked, in the working dtype of q."""
    T, Dv = q.shape[0], v.shape[1]
    out = _check_like(out, "out", (T, Dv), "of the forward output (T, Dv)")
    lse = _check_like(lse, "lse", (T,), "of the forward log-sum-exp (T,)")
    d_out = _check_like(d_out, "d_out", (T, Dv), "of the forward output (T, Dv)")
    if np.isinf(lse).any():
        i = int(np.flatnonzero(np.isinf(lse))[0])
        raise ValueError(
            f"lse must be finite or NaN; got lse[{i}]={float(lse[i])!r} (blocked_attention never "
            "returns an infinite lse; a float16 lse overflows beyond 65504: pass the float32 lse "
            "that blocked_attention returns for float16 inputs)"
        )
    return (x.astype(q.dtype, copy=False) for x in (out, lse, d_out))


def _lse_rounding(q, k, lse, scale, block_q: int, block_k: int, is_causal: bool) -> np.ndarray:
    """Per query, ``log(rowsum(exp(scores - lse)))``: how far the saved ``lse`` is off.

    In exact arithmetic this is zero. ``lse`` was rounded to the working dtype, though (by up
    to 4e-3 at ``lse = 8e4`` in float32, which would scale every weight of the row by up to
    ``exp(4e-3)``), and computed here it is that rounding error, to working precision:
    ``scores - lse`` is exact for every score that carries weight. Only rows with
    ``|lse| > LSE_EXACT_LIMIT`` are measured; the others get 0 and are left as they are. The
    scores are recomputed by the same blocks as in the backward pass, so they round alike, and
    masked as there.
    """
    error = np.zeros_like(lse)  # (T,)
    far = np.abs(lse) > LSE_EXACT_LIMIT  # (T,), False for NaN
    for i in range(0, len(q), block_q):
        if not far[i : i + block_q].any():
            continue
        q_i = q[i : i + block_q] * scale  # (Bq, Dk), as in the backward pass
        lse_i = lse[i : i + block_q, None]  # (Bq, 1)
        total = np.zeros(len(q_i), lse.dtype)  # (Bq,), 1 but for the rounding of lse
        stop = min(len(k), i + len(q_i)) if is_causal else len(k)  # as in the forward
        for j in range(0, stop, block_k):
            scores = q_i @ k[j : j + block_k].T  # (Bq, Bk)
            if is_causal:
                scores = np.where(_causal(i, j, scores.shape), scores, -np.inf)
            total += np.exp(scores - lse_i).sum(axis=1)  # (Bq, Bk) -> (Bq,)
        error[i : i + block_q] = np.where(far[i : i + block_q], np.log(total), 0.0)
    return error


def _grad_dtype(x: ArrayLike) -> np.dtype:
    """A gradient has its input's floating dtype (float64 for integer or bool inputs)."""
    dtype = np.asarray(x).dtype
    return dtype if dtype.kind == "f" else np.dtype(np.float64)


def blocked_attention(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    *,
    block_q: int,
    block_k: int,
    scale: float | None = None,
    is_causal: bool = False,
    on_tile: Callable[[int, int], object] | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    r"""Attention computed block by block, as in FlashAttention-2's forward pass.

    The outer loop takes ``Bq`` queries at a time; the inner loop walks over the keys and
    values ``Bk`` at a time and updates three running quantities per query: the largest score
    seen so far ``m``, the sum ``l`` of ``exp(score - m)``, and ``acc``, the same sum weighted
    by the values. No ``(T, S)`` matrix is ever formed; the largest array is one
    ``(Bq, Bk)`` block of scores. With ``is_causal=True`` the inner loop stops after the key
    block that holds the query block's last query: the tiles beyond it are never computed.

    Parameters
    ----------
    q : (T, Dk) array_like
        Queries of one head.
    k : (S, Dk) array_like
        Keys, ``S >= 1``.
    v : (S, Dv) array_like
        Values.
    block_q, block_k : int
        Block sizes ``Bq`` and ``Bk``, positive. They need not divide ``T`` or ``S``, and may
        exceed them (one block then holds everything).
    scale : float, optional
        Multiplies the scores; default ``1 / sqrt(Dk)`` (1 when ``Dk = 0``).
    is_causal : bool, default False
        Query ``i`` attends only the keys ``j <= i`` (top-left alignment, as
        ``scaled_dot_product_attention(..., is_causal=True)``, also when ``T != S``).
    on_tile : callable, optional
        Called as ``on_tile(i, j)`` before each tile is computed, with the tile's first query
        ``i`` and first key ``j``: a trace of the loop's work, in its order (for tests and
        the book; the result does not depend on it).

    Returns
    -------
    out : (T, Dv) np.ndarray
        ``softmax(scale * q @ k.T) @ v``, with the causal mask when ``is_causal``.
    lse : (T,) np.ndarray
        The log-sum-exp of each row of scores, ``m + log(l)``: what the backward pass needs
        to recompute the weights. float32 for float16 inputs (as FlashAttention and
        :func:`sdpa.scaled_dot_product_attention` return it), otherwise the dtype of ``out``.

    Raises
    ------
    TypeError
        If a block size is not an integer, an input is not a real array, ``is_causal`` is not
        a bool or ``on_tile`` is not callable.
    ValueError
        If a block size is not positive, an input is not 2-D, the widths or lengths do not
        match, ``S = 0``, or ``scale`` is not finite.

    See Also
    --------
    blocked_attention_backward : The gradients, by the same blocks.
    sdpa.scaled_dot_product_attention : The full-featured function (masks, heads, the fast
        tiled kernel).

    Notes
    -----
    When a new block raises the running maximum from :math:`m` to :math:`m'`, every term
    summed so far was computed as :math:`e^{x - m}` and must become :math:`e^{x - m'}`, so the
    old sums are multiplied by :math:`\alpha = e^{m - m'} \le 1`:

    .. math::
        m' = \max(m, \max_j x_j), \quad
        \ell' = \alpha\,\ell + \sum_j e^{x_j - m'}, \quad
        a' = \alpha\,a + \sum_j e^{x_j - m'}\,v_j, \qquad \text{out} = a / \ell .

    The division by :math:`\ell` happens once, after the last block (FlashAttention-2's
    change to FlashAttention, which rescaled the output at every step).

    **Causal tiles.** The tile of queries ``i0 .. i1 - 1`` and keys ``j0 .. j1 - 1`` is
    entirely masked when its first key comes after its last query, ``j0 > i1 - 1``: the loop
    skips it. It is crossed by the diagonal when its last key comes after its first query,
    ``j1 - 1 > i0``: computed, with ``-inf`` in place of the scores of keys after their query.
    Every other tile is computed as without the mask. Key 0 is in every query block's first
    tile and visible to every query, so no row is fully masked: ``m`` is finite after the first
    tile, a masked score adds ``exp(-inf) = 0``, and ``lse`` is finite.
    For ``T = S = n`` in tiles of ``b x b``, ``b`` dividing ``n``, the loop computes
    ``(n / b) (n / b + 1) / 2`` of the ``(n / b)**2`` tiles, about half.

    **Dtypes.** ``out`` has the inputs' common floating dtype; float16 is computed in
    float32 and rounded once at the end, and its ``lse`` stays float32: scores above 65504
    (``q = k = 200`` with ``Dk = 4`` gives 80000) would overflow float16 to ``inf``. Integer
    and bool inputs give float64.

    Examples
    --------
    Blocks that divide nothing give the textbook result:

    >>> import numpy as np
    >>> from sdpa import blocked_attention, scaled_dot_product_attention
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((5, 4))  # (T, Dk)
    >>> k = rng.standard_normal((7, 4))  # (S, Dk)
    >>> v = rng.standard_normal((7, 3))  # (S, Dv)
    >>> out, lse = blocked_attention(q, k, v, block_q=2, block_k=3)
    >>> out.shape, lse.shape
    ((5, 3), (5,))
    >>> bool(np.allclose(out, scaled_dot_product_attention(q, k, v)))
    True

    The log-sum-exp turns the scores back into weights that sum to one:

    >>> weights = np.exp(q @ k.T / 2 - lse[:, None])  # scale = 1/sqrt(4)
    >>> np.round(weights.sum(axis=1), 12)
    array([1., 1., 1., 1., 1.])

    Causal: of the 3 x 3 tiles of (up to) 2 queries by 2 keys, the three above the diagonal
    are never computed (``on_tile`` records the first query and key of each tile computed):

    >>> tiles = []
    >>> out, lse = blocked_attention(q, k[:6], v[:6], block_q=2, block_k=2, is_causal=True,
    ...                              on_tile=lambda i, j: tiles.append((i, j)))
    >>> tiles
    [(0, 0), (2, 0), (2, 2), (4, 0), (4, 2), (4, 4)]
    >>> want = scaled_dot_product_attention(q, k[:6], v[:6], is_causal=True)
    >>> bool(np.allclose(out, want))
    True
    """
    block_q, block_k = _check_blocks(block_q, block_k)
    is_causal = _check_options(is_causal, on_tile)
    q, k, v, scale, out_dtype = _prepare(q, k, v, scale)
    T, S, Dv, dtype = q.shape[0], k.shape[0], v.shape[1], q.dtype
    out = np.empty((T, Dv), dtype)  # (T, Dv)
    lse = np.empty(T, dtype)  # (T,)
    for i in range(0, T, block_q):  # outer loop: one block of queries
        q_i = q[i : i + block_q] * scale  # (Bq, Dk), scaled once
        m = np.full(len(q_i), -np.inf, dtype)  # (Bq,) running maximum
        l = np.zeros(len(q_i), dtype)  # (Bq,) running sum of exp(scores - m)
        acc = np.zeros((len(q_i), Dv), dtype)  # (Bq, Dv) sum of exp(...) * v
        # causal: the keys after the block's last query are masked for all of its queries
        stop = min(S, i + len(q_i)) if is_causal else S
        for j in range(0, stop, block_k):  # inner loop: the key/value blocks up to stop
            if on_tile is not None:
                on_tile(i, j)  # a trace of the tiles computed
            k_j = k[j : j + block_k]  # (Bk, Dk)
            v_j = v[j : j + block_k]  # (Bk, Dv)
            scores = q_i @ k_j.T  # (Bq, Dk) @ (Dk, Bk) -> (Bq, Bk)
            if is_causal and j + len(k_j) > i + 1:  # the diagonal crosses the tile
                scores = np.where(_causal(i, j, scores.shape), scores, -np.inf)
            m_new = np.maximum(m, scores.max(axis=1))  # (Bq,)
            exp_scores = np.exp(scores - m_new[:, None])  # (Bq, Bk), <= 1
            alpha = np.exp(m - m_new)  # (Bq,) rescales the old sums, <= 1
            l = alpha * l + exp_scores.sum(axis=1)  # (Bq,)
            acc = alpha[:, None] * acc + exp_scores @ v_j  # (Bq, Dv)
            m = m_new
        out[i : i + block_q] = acc / l[:, None]  # (Bq, Dv), divided once
        lse[i : i + block_q] = m + np.log(l)  # (Bq,), for the backward pass
    return out.astype(out_dtype, copy=False), lse.astype(lse_dtype(out_dtype), copy=False)


def blocked_attention_backward(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    out: ArrayLike,
    lse: ArrayLike,
    d_out: ArrayLike,
    *,
    block_q: int,
    block_k: int,
    scale: float | None = None,
    is_causal: bool = False,
    on_tile: Callable[[int, int], object] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    r"""Gradients of :func:`blocked_attention`, block by block, as in FlashAttention-2.

    The weights are not stored by the forward pass: each ``(Bq, Bk)`` block of them is
    recomputed from the scores and the saved log-sum-exp, ``P = exp(scores - lse)``. The
    outer loop runs over key/value blocks, which own their rows of ``d_k`` and ``d_v``; the
    inner loop over query blocks adds into ``d_q``. With ``is_causal=True`` the inner loop
    starts at the query block that holds the key block's first key, skipping the tiles above
    the diagonal as the forward pass does.

    Parameters
    ----------
    q, k, v : array_like
        The forward inputs, ``(T, Dk)``, ``(S, Dk)`` and ``(S, Dv)``.
    out : (T, Dv) array_like
        The forward output.
    lse : (T,) array_like
        The forward log-sum-exp, as returned (float32 for float16 inputs); finite or NaN.
    d_out : (T, Dv) array_like
        Gradient of the loss with respect to ``out``.
    block_q, block_k : int
        Block sizes ``Bq`` and ``Bk``, positive; independent of the forward pass's.
    scale : float, optional
        As in the forward call; default ``1 / sqrt(Dk)``.
    is_causal : bool, default False
        As in the forward call: query ``i`` attends only the keys ``j <= i``.
    on_tile : callable, optional
        Called as ``on_tile(i, j)`` before each tile is computed, with the tile's first query
        ``i`` and first key ``j``, in the loop's order (key blocks outside).

    Returns
    -------
    d_q : (T, Dk) np.ndarray
        Gradient with respect to ``q``.
    d_k : (S, Dk) np.ndarray
        Gradient with respect to ``k``.
    d_v : (S, Dv) np.ndarray
        Gradient with respect to ``v``. Each gradient has its input's floating dtype (float64
        for integer or bool inputs).

    Raises
    ------
    TypeError
        As :func:`blocked_attention`, also for ``out``, ``lse`` and ``d_out``.
    ValueError
        As :func:`blocked_attention`; also if ``out``, ``lse`` or ``d_out`` does not have the
        shape of the forward result, or ``lse`` holds an infinity (which the forward pass never
        returns, not even with the causal mask, but a float16 copy of a large ``lse`` does).

    See Also
    --------
    sdpa.scaled_dot_product_attention_backward : The full-featured backward pass.

    Notes
    -----
    With :math:`P` the weights, :math:`O` the output and :math:`dO` the upstream gradient,

    .. math::
        dV = P^\top dO, \quad dP = dO\, V^\top, \quad
        \delta = \operatorname{rowsum}(dO \odot O), \quad
        dS = P \odot (dP - \delta), \quad
        dQ = \text{scale}\; dS\, K, \quad dK = \text{scale}\; dS^\top Q .

    :math:`\delta` (``delta``; :math:`D` in the FlashAttention papers) has one entry per query
    row, ``(T,)``: it is :math:`\operatorname{rowsum}(P \odot dP)`, the softmax's correction,
    rewritten with :math:`P V = O` so that it needs no ``(T, S)`` matrix. Inside a block it
    is the ``Bq`` entries of the block's rows. ``dK`` takes the *transpose* of ``dS``:
    ``dS`` is ``(T, S)`` and ``dK`` has one row per key.

    **Causal.** A masked weight is 0 (``exp(-inf - lse)``), so a masked score contributes
    nothing to any gradient: the tiles above the diagonal are skipped, the diagonal tiles are
    masked inside, and the keys after the last query (``j >= T``) are seen by no query; their
    rows of ``d_k`` and ``d_v`` are 0.

    **Exact weights from a rounded lse.** ``P = exp(scores - lse)`` inherits the rounding of
    ``lse`` in every exponent: half a unit in its last place, below 4e-6 for ``|lse| <= 64``
    but 4e-3 at ``lse = 8e4`` in float32, which would scale a whole row of ``P`` by 0.4%. For
    rows beyond 64 one extra pass over the blocks measures that error,
    ``log(rowsum(exp(scores - lse)))`` (zero in exact arithmetic), and subtracts it in the
    exponent, so the weights of each row sum to one to working precision. Other rows are
    computed exactly as above.

    **Dtypes.** Computed in the working dtype of the forward pass (float16 in float32); each
    gradient has its input's floating dtype.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa import blocked_attention, blocked_attention_backward
    >>> from sdpa import scaled_dot_product_attention_backward
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.standard_normal((5, 4)), rng.standard_normal((7, 4)), rng.standard_normal((7, 3))
    >>> out, lse = blocked_attention(q, k, v, block_q=2, block_k=3)
    >>> d_out = np.ones_like(out)  # the gradient of L = out.sum()
    >>> d_q, d_k, d_v = blocked_attention_backward(q, k, v, out, lse, d_out, block_q=4, block_k=2)
    >>> d_q.shape, d_k.shape, d_v.shape
    ((5, 4), (7, 4), (7, 3))
    >>> want = scaled_dot_product_attention_backward(d_out, q, k, v)
    >>> all(bool(np.allclose(got, ref)) for got, ref in zip((d_q, d_k, d_v), want))
    True

    Row ``j`` of ``d_v`` is the total weight the queries give key ``j``; there are five
    queries, so the weights add up to 5:

    >>> float(np.round(d_v[:, 0].sum(), 12))
    5.0

    Causal, with ``T = 5`` queries and ``S = 7`` keys: keys 5 and 6 come after every query,
    so no loss depends on them:

    >>> out, lse = blocked_attention(q, k, v, block_q=2, block_k=3, is_causal=True)
    >>> d_q, d_k, d_v = blocked_attention_backward(q, k, v, out, lse, d_out, block_q=2,
    ...                                            block_k=3, is_causal=True)
    >>> bool(np.all(d_k[5:] == 0) and np.all(d_v[5:] == 0))
    True
    >>> want = scaled_dot_product_attention_backward(d_out, q, k, v, is_causal=True)
    >>> all(bool(np.allclose(got, ref)) for got, ref in zip((d_q, d_k, d_v), want))
    True
    """
    q_in, k_in, v_in = q, k, v
    block_q, block_k = _check_blocks(block_q, block_k)
    is_causal = _check_options(is_causal, on_tile)
    q, k, v, scale, _ = _prepare(q, k, v, scale)
    out, lse, d_out = _check_results(out, lse, d_out, q, v)
    lse_error = _lse_rounding(q, k, lse, scale, block_q, block_k, is_causal)  # 0 unless |lse| > 64
    T, S = q.shape[0], k.shape[0]
    delta = np.sum(d_out * out, axis=1)  # (T,): rowsum(dO * O), one per query
    dq = np.zeros_like(q)  # (T, Dk), summed over the key blocks
    dk = np.zeros_like(k)  # (S, Dk); causal: keys after the last query keep 0
    dv = np.zeros_like(v)  # (S, Dv)
    stop = min(S, T) if is_causal else S  # causal: key j is seen by the queries i >= j only
    for j in range(0, stop, block_k):  # outer loop: one block of keys and values
        k_j = k[j : j + block_k]  # (Bk, Dk)
        v_j = v[j : j + block_k]  # (Bk, Dv)
        dk_j = np.zeros_like(k_j)  # (Bk, Dk)
        dv_j = np.zeros_like(v_j)  # (Bk, Dv)
        first = j // block_q * block_q if is_causal else 0  # the query block holding query j
        for i in range(first, T, block_q):  # inner loop: the query blocks from first
            if on_tile is not None:
                on_tile(i, j)  # a trace of the tiles computed
            q_i = q[i : i + block_q] * scale  # (Bq, Dk), as in the forward
            dout_i = d_out[i : i + block_q]  # (Bq, Dv)
            delta_i = delta[i : i + block_q, None]  # (Bq, 1)
            lse_i = lse[i : i + block_q, None]  # (Bq, 1)
            error_i = lse_error[i : i + block_q, None]  # (Bq, 1)
            scores = q_i @ k_j.T  # (Bq, Dk) @ (Dk, Bk) -> (Bq, Bk)
            if is_causal and j + len(k_j) > i + 1:  # the diagonal crosses the tile
                scores = np.where(_causal(i, j, scores.shape), scores, -np.inf)
            weights = np.exp(scores - lse_i - error_i)  # (Bq, Bk), masked: exp(-inf) = 0
            dv_j += weights.T @ dout_i  # (Bk, Bq) @ (Bq, Dv) -> (Bk, Dv)
            dweights = dout_i @ v_j.T  # (Bq, Dv) @ (Dv, Bk) -> (Bq, Bk)
            dscores = weights * (dweights - delta_i)  # (Bq, Bk)
            dq[i : i + block_q] += scale * dscores @ k_j  # (Bq, Bk) @ (Bk, Dk)
            dk_j += dscores.T @ q_i  # (Bk, Bq) @ (Bq, Dk): transposed
        dk[j : j + block_k] = dk_j
        dv[j : j + block_k] = dv_j
    grads = ((dq, q_in), (dk, k_in), (dv, v_in))
    return tuple(grad.astype(_grad_dtype(x), copy=False) for grad, x in grads)
