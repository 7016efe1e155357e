r"""Linear attention (Katharopoulos et al., 2020): a kernel in place of the softmax.

Softmax attention weighs value ``j`` for query ``i`` by ``exp(q_i . k_j / sqrt(Dk))``, normalised
over ``j``. Linear attention replaces that similarity by a kernel written as a dot product of
feature maps, ``sim(q, k) = phi(q) . phi(k)`` with ``phi`` non-negative, so that

    out_i = phi(q_i)^T (sum_j phi(k_j) v_j^T) / (phi(q_i)^T sum_j phi(k_j)).

The two sums do not depend on ``i``: computed once, they make the cost O(n F Dv) instead of
O(n^2 Dk) (associativity: ``(phi(Q) phi(K)^T) V = phi(Q) (phi(K)^T V)``). Under a causal mask the
sums become running (prefix) sums over the keys, which is the recurrent form of the model.

Shape letters: ``T`` queries, ``S`` keys, ``Dk`` query/key width, ``Dv`` value width, ``F`` the
width of the features ``phi(x)`` (``F = Dk`` for the default map).
"""

from __future__ import annotations

import math
from numbers import Real
from typing import Callable

import numpy as np
from numpy.typing import ArrayLike

from ._checks import (
    as_float_array,
    check_alignment,
    check_bool,
    check_positive_int,
    compute_dtype,
)
from .masks import alignment_offset

__all__ = ["elu_feature_map", "linear_attention"]


def elu_feature_map(x: ArrayLike) -> np.ndarray:
    r"""The feature map ``phi(x) = elu(x) + 1`` of Katharopoulos et al. (2020), elementwise.

    ``elu(x) + 1`` is ``x + 1`` for ``x > 0`` and ``exp(x)`` for ``x <= 0``: positive everywhere,
    smooth, and with a gradient that never vanishes for negative inputs (unlike ``relu``).

    Parameters
    ----------
    x : (..., D) array_like

    Returns
    -------
    (..., D) np.ndarray
        Strictly positive, in the floating dtype of ``x`` (integers and bools give float64).

    Raises
    ------
    TypeError
        For complex, object or string input.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa import elu_feature_map
    >>> np.round(elu_feature_map(np.array([-2.0, 0.0, 1.5])), 4)
    array([0.1353, 1.    , 2.5   ])
    """
    x = as_float_array(x, "x")
    # exp of min(x, 0) so that large positive inputs cannot overflow in the unused branch
    return np.where(x > 0, x + 1, np.exp(np.minimum(x, 0)))


def _check_features(phi: np.ndarray, source: np.ndarray, name: str) -> np.ndarray:
    if not isinstance(phi, np.ndarray) or phi.dtype.kind not in "biuf":
        raise TypeError(
            f"feature_map must return a real array; got {type(phi).__name__} "
            f"for {name}" + (f" with dtype {phi.dtype}" if isinstance(phi, np.ndarray) else "")
        )
    if phi.ndim != source.ndim or phi.shape[:-1] != source.shape[:-1]:
        raise ValueError(
            f"feature_map must map (..., L, D) to (..., L, F), keeping every axis but the last; "
            f"got {name}.shape={source.shape} -> feature_map({name}).shape={phi.shape}"
        )
    if not np.isfinite(phi).all() or (phi < 0).any():
        raise ValueError(
            f"feature_map must return finite, non-negative features (a kernel phi(q) . phi(k) "
            f">= 0); feature_map({name}) has negative or non-finite entries"
        )
    return phi


def linear_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    *,
    is_causal: bool = False,
    causal_alignment: str = "top_left",
    feature_map: Callable[[np.ndarray], ArrayLike] | None = None,
    eps: float = 1e-6,
    chunk_size: int = 64,
) -> np.ndarray:
    r"""Linear attention ``phi(Q) (phi(K)^T V)`` normalised row by row, in O(n F Dv).

    Parameters
    ----------
    query : (..., T, Dk) array_like
        Leading dimensions broadcast by NumPy rules against those of ``key`` and ``value``.
    key : (..., S, Dk) array_like
    value : (..., S, Dv) array_like
    is_causal : bool, default False
        Query ``i`` only sees keys ``j <= i + o`` (``o`` from ``causal_alignment``), computed
        with running sums over the keys.
    causal_alignment : {"top_left", "bottom_right"}, default "top_left"
        ``o = 0`` or ``o = S - T``, as in :func:`scaled_dot_product_attention`.
    feature_map : callable, optional
        ``phi``, applied to ``query`` and ``key`` in the working dtype; maps ``(..., L, Dk)``
        to ``(..., L, F)`` with finite, non-negative entries. Default
        :func:`elu_feature_map`.
    eps : float, default 1e-6
        Added to each normaliser ``phi(q_i) . sum_j phi(k_j)``, as in the paper's code, so that
        tiny normalisers cannot blow up. Must be finite and non-negative.
    chunk_size : int, default 64
        Causal case only: queries are processed in chunks of this size; keys before a chunk
        enter through the running sums, keys inside it through a small masked quadratic
        product. ``chunk_size=1`` is the pure recurrence. The result does not depend on it
        beyond rounding.

    Returns
    -------
    out : (..., T, Dv) np.ndarray
        In the dtype of the inputs (float16 is computed in float32; integer inputs give
        float64).

    Raises
    ------
    TypeError
        For complex or object inputs, a ``feature_map`` that is not callable or returns a
        non-real array, or a non-bool ``is_causal``.
    ValueError
        For inputs with fewer than 2 dimensions, mismatched ``Dk`` or ``S``, leading shapes
        that do not broadcast, features of the wrong shape, negative or non-finite features, a
        bad ``eps``, ``chunk_size`` or ``causal_alignment``.

    Notes
    -----
    With ``sim(q, k) = phi(q) . phi(k)`` the result is the kernel-weighted average

    .. math:: o_i = \frac{\sum_{j \in A_i} \mathrm{sim}(q_i, k_j)\, v_j}
                         {\varepsilon + \sum_{j \in A_i} \mathrm{sim}(q_i, k_j)}
              = \frac{\phi(q_i)^\top \big(\sum_{j \in A_i} \phi(k_j) v_j^\top\big)}
                     {\varepsilon + \phi(q_i)^\top \sum_{j \in A_i} \phi(k_j)},

    where ``A_i`` is every key, or ``j <= i + o`` when causal. No scale ``1/sqrt(Dk)`` is
    applied (the paper uses none); scale ``query`` yourself if you want one. A query that sees
    no key (``S = 0``, or ``i + o < 0`` under bottom-right alignment) returns 0, as in
    :func:`scaled_dot_product_attention`. Cost: O((T + S) F Dv) time and O(F Dv) extra
    memory per batch element without a mask; with it, O((T + S) F Dv + T C (F + Dv)) for
    chunks of ``C`` queries.

    **Overflow.** The sums over keys can overflow although every feature is finite (features
    of ``1e30`` in float32). The features of each query, and the features and values of each
    batch element, are scaled by a power of two that brings their largest entry near one
    before the sums, and the scales are divided out after: exact, so ordinary inputs give the
    same result to the last bit, and large ones no NaN.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa import linear_attention, elu_feature_map
    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((2, 5, 4))  # (B, T, Dk)
    >>> k = rng.standard_normal((2, 7, 4))  # (B, S, Dk)
    >>> v = rng.standard_normal((2, 7, 3))  # (B, S, Dv)
    >>> out = linear_attention(q, k, v)
    >>> out.shape
    (2, 5, 3)

    The same numbers from the quadratic form, with the weights written out:

    >>> sim = elu_feature_map(q) @ np.swapaxes(elu_feature_map(k), -1, -2)  # (B, T, S)
    >>> weights = sim / (1e-6 + sim.sum(-1, keepdims=True))
    >>> bool(np.allclose(out, weights @ v))
    True

    Causal: the first query sees only the first key, so it returns the first value:

    >>> out = linear_attention(q[0], k[0, :5], v[0, :5], is_causal=True, eps=0.0)
    >>> bool(np.allclose(out[0], v[0, 0]))
    True
    """
    q = as_float_array(query, "query")
    k = as_float_array(key, "key")
    v = as_float_array(value, "value")
    for name, a in (("query", q), ("key", k), ("value", v)):
        if a.ndim < 2:
            raise ValueError(
                f"{name} must have at least 2 dimensions (..., L, D); got {name}.shape={a.shape}"
            )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(
            f"query and key must share the last dimension Dk; got query.shape={q.shape}, "
            f"key.shape={k.shape}"
        )
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(
            f"key and value must share the sequence length S (axis -2); got key.shape={k.shape}, "
            f"value.shape={v.shape}"
        )
    try:
        lead = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    except ValueError:
        raise ValueError(
            f"the leading dimensions of query, key and value must broadcast; got "
            f"query.shape={q.shape}, key.shape={k.shape}, value.shape={v.shape}"
        ) from None
    is_causal = check_bool(is_causal, "is_causal")
    alignment = check_alignment(causal_alignment)
    if feature_map is None:
        feature_map = elu_feature_map
    elif not callable(feature_map):
        raise TypeError(f"feature_map must be callable or None; got {type(feature_map).__name__}")
    if isinstance(eps, (bool, np.bool_)) or not isinstance(eps, Real):
        raise TypeError(f"eps must be a real number; got {eps!r}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be finite and non-negative; got {eps!r}")
    chunk_size = check_positive_int(chunk_size, "chunk_size")

    out_dtype, work = compute_dtype(q, k, v)
    q, k, v = (a.astype(work, copy=False) for a in (q, k, v))
    phi_q = _check_features(np.asarray(feature_map(q)), q, "query").astype(work, copy=False)
    phi_k = _check_features(np.asarray(feature_map(k)), k, "key").astype(work, copy=False)
    if phi_q.shape[-1] != phi_k.shape[-1]:
        raise ValueError(
            f"feature_map must give queries and keys the same feature width F; got "
            f"{phi_q.shape[-1]} and {phi_k.shape[-1]}"
        )
    T, S, Dv = q.shape[-2], k.shape[-2], v.shape[-1]
    # Finite features can still overflow in the sums (features of 1e30 in float32): scale each
    # query's features, and each batch element's key features and values, by a power of two
    # that brings their largest entry into [1/2, 1). The scales are exact and cancel in the
    # ratio (eps is scaled with the normaliser), so ordinary inputs give the same bits.
    s_q = _power_of_two_scale(phi_q, axis=(-1,))  # (..., T, 1)
    s_k = _power_of_two_scale(phi_k, axis=(-2, -1))  # (..., 1, 1)
    s_v = _power_of_two_scale(v, axis=(-2, -1))
    phi_q, phi_k, v = phi_q * s_q, phi_k * s_k, v * s_v
    with np.errstate(under="ignore"):
        eps_w = (work.type(eps) * s_q) * s_k  # (..., T, 1)

    if not is_causal:
        kv = np.swapaxes(phi_k, -1, -2) @ v  # (..., F, S) @ (..., S, Dv) -> (..., F, Dv)
        z = phi_k.sum(axis=-2)[..., :, None]  # (..., S, F) -> (..., F, 1)
        num = phi_q @ kv  # (..., T, F) @ (..., F, Dv) -> (..., T, Dv)
        den = phi_q @ z + eps_w  # (..., T, F) @ (..., F, 1) -> (..., T, 1)
    else:
        num, den = _causal_sums(phi_q, phi_k, v, alignment_offset(T, S, alignment), chunk_size)
        den = den + eps_w

    out = np.zeros(np.broadcast_shapes(num.shape, den.shape), dtype=work)
    np.divide(num, den, out=out, where=den > 0)  # a query that sees no key returns 0
    out /= s_v  # exact, and |out| <= max |v|: no overflow
    return np.broadcast_to(out, (*lead, T, Dv)).astype(out_dtype)


def _power_of_two_scale(x: np.ndarray, axis: tuple[int, ...]) -> np.ndarray:
    """``2**-e`` with ``max |x| = f 2**e``, ``f`` in ``[1/2, 1)``, over ``axis`` (kept); 1 for
    zeros. Clipped so that the scale itself stays a normal number of ``x``'s dtype."""
    if x.size == 0:
        return np.ones((1,) * x.ndim, dtype=x.dtype)
    _, e = np.frexp(np.max(np.abs(x), axis=axis, keepdims=True))
    limit = np.finfo(x.dtype).maxexp - 2
    return np.ldexp(np.ones(e.shape, dtype=x.dtype), np.clip(-e, -limit, limit))


def _causal_sums(phi_q, phi_k, v, offset: int, chunk: int):
    """Numerators ``(..., T, Dv)`` and normalisers ``(..., T, 1)`` under ``j <= i + offset``.

    Queries go in chunks ``[t0, t1)``. Keys ``j < p = t0 + offset + 1`` are visible to the whole
    chunk and enter through the running state ``kv = sum_j phi(k_j) v_j^T`` (``(..., F, Dv)``)
    and ``z = sum_j phi(k_j)``; keys in ``[p, t1 + offset]`` are visible to part of the chunk
    and enter through a masked ``(C, C)`` product. Every key is added to the state once.
    """
    T, S, F, Dv = phi_q.shape[-2], phi_k.shape[-2], phi_q.shape[-1], v.shape[-1]
    kv_lead = np.broadcast_shapes(phi_k.shape[:-2], v.shape[:-2])
    kv = np.zeros((*kv_lead, F, Dv), dtype=phi_q.dtype)  # running sum of phi(k_j) v_j^T
    z = np.zeros((*phi_k.shape[:-2], F, 1), dtype=phi_q.dtype)  # running sum of phi(k_j)
    nums, dens = [], []
    done = 0  # keys [0, done) are in the state
    for t0 in range(0, T, chunk):
        t1 = min(t0 + chunk, T)
        p = min(max(t0 + offset + 1, 0), S)  # keys before p: seen by every query of the chunk
        if p > done:
            pk = phi_k[..., done:p, :]
            kv = kv + np.swapaxes(pk, -1, -2) @ v[..., done:p, :]  # (..., F, n) @ (..., n, Dv)
            z = z + pk.sum(axis=-2)[..., :, None]
            done = p
        pq = phi_q[..., t0:t1, :]  # (..., C, F)
        num = pq @ kv  # (..., C, F) @ (..., F, Dv) -> (..., C, Dv)
        den = pq @ z  # (..., C, 1)
        e = min(max(t1 + offset, 0), S)  # keys [p, e) are seen by some queries of the chunk
        if e > p:
            sim = pq @ np.swapaxes(phi_k[..., p:e, :], -1, -2)  # (..., C, F) @ (..., F, e-p)
            rows = np.arange(t0, t1)[:, None] + offset
            sim = np.where(np.arange(p, e)[None, :] <= rows, sim, 0)  # causal inside the chunk
            num = num + sim @ v[..., p:e, :]  # (..., C, e-p) @ (..., e-p, Dv)
            den = den + sim.sum(axis=-1, keepdims=True)
        nums.append(num)
        dens.append(den)
    if not nums:  # T == 0
        lead = np.broadcast_shapes(phi_q.shape[:-2], kv_lead)
        return np.zeros((*lead, 0, Dv), phi_q.dtype), np.zeros((*lead, 0, 1), phi_q.dtype)
    lead = np.broadcast_shapes(*(n.shape[:-2] for n in nums), *(d.shape[:-2] for d in dens))
    num = np.concatenate([np.broadcast_to(n, (*lead, *n.shape[-2:])) for n in nums], axis=-2)
    den = np.concatenate([np.broadcast_to(d, (*lead, *d.shape[-2:])) for d in dens], axis=-2)
    return num, den
