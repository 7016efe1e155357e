r"""The attention problem: one validated call, the starting point of every implementation.

:func:`prepare_attention` validates every argument of an attention call in one place and turns
it into an :class:`AttentionProblem`: arrays in the working dtype, grouped-query heads reshaped
so that plain broadcasting does the grouping, the user's mask split into a boolean *allowed*
mask and an additive *bias*, and the causal/window band described by three integers. The
reference path (:mod:`sdpa.attention`), the tiled path (:mod:`sdpa.tiled`) and the backward
pass (:func:`sdpa.scaled_dot_product_attention_backward`) all start from it, so they cannot disagree about what a call means,
and :meth:`AttentionProblem.finish` turns their results back into the caller's shapes and dtype.

The module also holds what every implementation needs on a prepared problem: the masked
scores of a block of queries and keys (``masked_scores``), the overflow
check, and the rows that a non-finite input reaches (NaN in, NaN out).

Shape letters: ``B`` batch, ``Hq``/``Hkv`` query and key/value heads, ``G = Hq // Hkv``,
``T`` queries, ``S`` keys, ``Dk`` query/key width, ``Dv`` value width.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from ._checks import (
    ATTENTION_MASK_HINT,
    as_array,
    broadcasts_to,
    check_alignment,
    check_bool,
    check_query_key_value,
    check_range,
    check_scale,
    check_window,
    compute_dtype,
    lse_dtype,
    range_error,
    shape_error,
)
from .masks import alignment_offset, band_limits, band_mask

__all__ = ["AttentionProblem", "prepare_attention"]


@dataclass(frozen=True)
class AttentionProblem:
    """A validated attention call, ready for any implementation.

    Built by :func:`prepare_attention`, never by hand. Its arrays are in the working dtype and
    in the *grouped* layout: with ``enable_gqa`` the head axis is split into ``(Hkv, G)`` with
    ``G = Hq // Hkv``, queries become ``(..., Hkv, G, T, Dk)`` and keys and values
    ``(..., Hkv, 1, S, D)``, and masks follow, so that query head ``h`` meets key/value head
    ``h // G`` by broadcasting, with no copies. :meth:`finish` undoes the grouping on results.

    Attributes
    ----------
    query, key, value : np.ndarray
        ``(..., T, Dk)``, ``(..., S, Dk)``, ``(..., S, Dv)`` in ``work_dtype``; rows holding NaN
        or inf are replaced by zeros and flagged in ``bad_query``, ``bad_key``, ``bad_value``.
    allowed : np.ndarray or None
        The user's boolean mask (True = may attend), broadcastable to the scores.
    bias : np.ndarray or None
        The user's float mask in ``work_dtype``, added to the scaled scores.
    scale : float
        Multiplier of ``query @ key^T``.
    offset : int
        Alignment offset ``o``: query ``i`` sits at key position ``i + o``.
    band : tuple of (int or None)
        ``(lo, hi)``: query ``i`` may attend key ``j`` when ``lo <= j - (i + o) <= hi``.
    batch_shape : tuple of int
        Leading shape of the (grouped) scores, without ``(T, S)``.
    T, S, Dk, Dv : int
        Query length, key length, query/key and value widths.
    out_dtype, work_dtype : np.dtype
        Dtype of the results and dtype of the computation (float32 for float16 inputs).
    groups : int or None
        ``G`` when ``enable_gqa`` split the heads, else None.
    bad_query, bad_key, bad_value : np.ndarray or None
        ``(..., T)`` or ``(..., S)`` bool: rows that held a non-finite entry.
    may_overflow : bool
        False when the norms of query and key and the size of the bias prove that no score
        (nor any intermediate of the tiled path) can overflow.
    sinks : np.ndarray or None
        The attention sinks' logits in ``work_dtype``, broadcastable to ``(*batch_shape, T)``
        (one extra logit per row in the softmax's denominator, with no value), or None.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa.problem import prepare_attention
    >>> q = np.ones((2, 8, 5, 4))  # (B, Hq, T, Dk)
    >>> kv = np.ones((2, 2, 7, 4))  # (B, Hkv, S, Dk)
    >>> problem = prepare_attention(q, kv, kv, enable_gqa=True)
    >>> problem.query.shape, problem.key.shape, problem.batch_shape
    ((2, 2, 4, 5, 4), (2, 2, 1, 7, 4), (2, 2, 4))
    >>> problem.finish(np.zeros((2, 2, 4, 5, 4))).shape  # back to (B, Hq, T, Dv)
    (2, 8, 5, 4)
    """

    query: np.ndarray  # (..., T, Dk), working dtype
    key: np.ndarray  # (..., S, Dk)
    value: np.ndarray  # (..., S, Dv)
    allowed: np.ndarray | None  # user's boolean mask, broadcastable to the scores, or None
    bias: np.ndarray | None  # user's float mask in the working dtype, or None
    scale: float
    offset: int  # alignment offset o: query i sits at key position i + o
    band: tuple[int | None, int | None]  # (lo, hi): allowed j - (i + o) in [lo, hi]
    batch_shape: tuple[int, ...]  # leading shape of the (grouped) scores, without (T, S)
    T: int
    S: int
    Dk: int
    Dv: int
    out_dtype: np.dtype
    work_dtype: np.dtype
    groups: int | None  # G when enable_gqa split the heads, else None
    # Non-finite inputs (NaN, inf) are replaced by zeros in query, key and value above, and
    # remembered here, so that every implementation computes with finite numbers and then
    # marks exactly the rows that such an input reaches (see poisoned_rows).
    bad_query: np.ndarray | None = None  # (..., T) bool: query rows with a non-finite entry
    bad_key: np.ndarray | None = None  # (..., S) bool: keys with a non-finite entry
    bad_value: np.ndarray | None = None  # (..., S) bool: values with a non-finite entry
    # False when the norms of query and key and the size of the bias prove that no score (nor
    # any intermediate of the tiled path) can overflow; True means: check the scores.
    may_overflow: bool = False
    # The sinks' logits s_i, broadcastable to (*batch_shape, T), or None: every implementation
    # adds exp(s_i) to row i's normaliser (the weights then sum to less than one).
    sinks: np.ndarray | None = None

    @property
    def scores_shape(self) -> tuple[int, ...]:
        return (*self.batch_shape, self.T, self.S)

    def band_mask(self, t0: int = 0, t1: int | None = None, s0: int = 0, s1: int | None = None):
        """The causal/window band for queries ``t0:t1`` and keys ``s0:s1``; None if unbounded."""
        t1 = self.T if t1 is None else t1
        s1 = self.S if s1 is None else s1
        lo, hi = self.band
        return band_mask(np.arange(t0, t1), np.arange(s0, s1), self.offset, lo, hi)

    def ungroup(self, x: np.ndarray, trailing: int) -> np.ndarray:
        """Merge the ``(Hkv, G)`` axes of a result back into ``Hq``; ``trailing`` axes follow them."""
        if self.groups is None:
            return x
        shape = x.shape
        cut = len(shape) - trailing
        return x.reshape(*shape[: cut - 2], shape[cut - 2] * shape[cut - 1], *shape[cut:])

    def finish(
        self, out: np.ndarray, weights: np.ndarray | None = None, lse: np.ndarray | None = None
    ):
        """The caller's results from an implementation's: full batch shape, heads, dtype.

        ``out`` is ``(*batch_shape, T, Dv)`` (or broadcastable to it), ``weights``
        ``(*batch_shape, T, S)`` and ``lse`` ``(*batch_shape, T)``, in the grouped layout and
        the working dtype. Returns ``out`` alone, or ``(out, weights, lse)`` keeping only the
        arrays given, broadcast to the full batch shape, with grouped heads merged back into
        ``Hq`` and cast to ``out_dtype`` (``lse`` to at least float32: float16 overflows
        beyond 65504).
        """
        full = self.batch_shape
        out = _as_result(self.ungroup(_broadcast(out, (*full, self.T, self.Dv)), 2), self.out_dtype)
        if weights is None and lse is None:
            return out
        result = [out]
        if weights is not None:
            weights = self.ungroup(_broadcast(weights, self.scores_shape), 2)
            result.append(_as_result(weights, self.out_dtype))
        if lse is not None:
            lse = self.ungroup(_broadcast(lse, (*full, self.T)), 1)
            result.append(_as_result(lse, lse_dtype(self.out_dtype)))
        return tuple(result)


def _broadcast(x: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """``x`` broadcast to ``shape``: a read-only view, unless ``x`` has that shape already."""
    return x if x.shape == shape else np.broadcast_to(x, shape)


def _as_result(x: np.ndarray, dtype) -> np.ndarray:
    """``x`` in ``dtype`` as an array of the caller's own: ``x`` itself when it is a writeable
    array of that dtype already (the implementations return arrays they made for the call),
    else a copy (a broadcast view is read-only). Copying 4 x 8 heads of 1024 x 64 float32
    took about 0.5 ms, 1 % of the tiled path's time on two cores."""
    return x.astype(dtype, copy=not x.flags.writeable)


def _check_mask(attn_mask, full_heads_shape: tuple[int, ...], work_dtype: np.dtype):
    """Split ``attn_mask`` into ``(allowed, bias, bias_bound)``; check it fits the scores.

    ``bias_bound`` is the largest magnitude of a finite bias entry (0 without a bias).
    """
    if attn_mask is None:
        return None, None, 0.0
    hint = "pass a plain bool array (True = may attend) or float bias"
    mask = as_array(attn_mask, "attn_mask", masked_hint=hint)
    kind = mask.dtype.kind
    if kind in "iu":
        raise TypeError(
            f"attn_mask has integer dtype {mask.dtype}, whose meaning is ambiguous: "
            "convert it to bool with True = may attend (PyTorch SDPA and JAX convention), "
            "e.g. attn_mask.astype(bool), or to a float bias; note that "
            "torch.nn.MultiheadAttention uses True = masked out, the opposite"
        )
    if kind not in "bf":
        raise TypeError(
            f"attn_mask must be a bool array (True = may attend) or a float bias; "
            f"got dtype {mask.dtype}"
        )
    if mask.ndim == 0:
        raise ValueError("attn_mask must have at least one dimension (S,); got a 0-d array")
    if not broadcasts_to(mask.shape, full_heads_shape):
        raise ValueError(
            f"attn_mask must broadcast to the attention weights of shape {full_heads_shape} "
            f"(..., H, T, S); got attn_mask.shape={mask.shape}"
        )
    if kind == "b":
        return mask, None, 0.0
    if mask.size == 0:
        return None, mask.astype(work_dtype), 0.0
    hi, lo = mask.max(), mask.min()  # NaN if the mask holds a NaN
    if np.isnan(hi) or hi == np.inf:
        raise ValueError(
            "attn_mask as a float bias must not contain NaN or +inf; got "
            + ("NaN" if np.isnan(hi) else "+inf")
        )
    if lo == -np.inf:  # -inf disallows; the bound is over the finite entries
        finite = mask[np.isfinite(mask)]
        lo = finite.min() if finite.size else 0.0
        hi = finite.max() if finite.size else 0.0
    with np.errstate(over="ignore"):  # the cast itself: what rounds to the largest is kept
        beyond = np.isinf(np.array([lo, hi]).astype(work_dtype)).any()
    if beyond:
        worst = float(lo) if -float(lo) > float(hi) else float(hi)
        raise range_error(
            "attn_mask",
            work_dtype,
            worst,
            ", the dtype the scores are computed in",
            " (use -inf to disallow a key)",
        )
    return None, mask.astype(work_dtype, copy=False), max(-float(lo), float(hi))


def _check_sinks(sinks, rows_shape: tuple[int, ...], work_dtype: np.dtype) -> np.ndarray | None:
    """``sinks`` as an array in ``work_dtype`` that broadcasts to ``rows_shape`` ``(..., H, T)``.

    A sink is a logit in the units of the scaled scores: finite, or ``-inf`` (no sink). NaN,
    ``+inf`` (every weight would be 0 and ``lse`` infinite) and finite values that the working
    dtype cannot hold are refused, as is a bool array (a mask passed in the wrong place).
    """
    if sinks is None:
        return None
    hint = "pass a plain array of logits (-inf for no sink)"
    arr = as_array(sinks, "sinks", masked_hint=hint)
    if arr.dtype.kind not in "fiu":
        raise TypeError(
            f"sinks must be a real floating or integer array of logits; got dtype {arr.dtype}"
        )
    if not broadcasts_to(arr.shape, rows_shape):
        raise ValueError(
            f"sinks must broadcast to the weights' shape without the key axis, {rows_shape} "
            f"(..., H, T): a per-head logit is sinks[:, None], of shape (H, 1); "
            f"got sinks.shape={arr.shape}"
        )
    if arr.dtype.kind == "f" and arr.size:
        with np.errstate(invalid="ignore"):
            bad = np.isnan(arr) | np.isposinf(arr)
        if bad.any():
            raise ValueError(
                "sinks must hold finite logits or -inf (no sink); got "
                + ("NaN" if np.isnan(arr).any() else "+inf")
            )
        check_range(arr, work_dtype, "sinks", ", the dtype the scores are computed in")
    return arr.astype(work_dtype)  # a copy: the problem never shares the caller's array


def _finite_rows(x: np.ndarray) -> tuple[np.ndarray, np.ndarray | None, float]:
    """``(x with non-finite rows zeroed, bad rows or None, largest row norm)`` of ``(..., L, D)``.

    The sum of squares of each row is one pass over ``x``; when every sum is finite, ``x`` holds
    no NaN or inf and the norms are known. Otherwise the rows are examined entry by entry, and
    the norms recomputed in float64 (a float32 square can overflow where the float64 does not).
    """
    squares = np.einsum("...d,...d->...", x, x)  # (..., L)
    if np.isfinite(squares).all():
        return x, None, float(np.sqrt(squares.max())) if squares.size else 0.0
    bad = ~np.isfinite(x).all(axis=-1)  # (..., L)
    if bad.any():
        x = np.where(bad[..., None], x.dtype.type(0), x)
    else:
        bad = None
    x64 = x.astype(np.float64)
    with np.errstate(over="ignore"):
        squares = np.einsum("...d,...d->...", x64, x64)
    return x, bad, float(np.sqrt(squares.max())) if squares.size else 0.0


def _may_overflow(scale: float, q_norm: float, k_norm: float, bias_bound: float, dtype) -> bool:
    """Whether a score, or an intermediate of the tiled path, could overflow ``dtype``.

    By Cauchy-Schwarz every partial sum of ``scale * q . k`` is at most ``b = scale |q| |k|``
    in magnitude; the tiled path also subtracts a running maximum, at most ``b + bias_bound``.
    Rounding to nearest overflows only beyond ``max + ulp(max) / 2``, which leaves room even
    for a bias of ``finfo.min`` (the Hugging Face convention).
    """
    finfo = np.finfo(dtype)
    limit = float(finfo.max)
    top_ulp = limit - float(np.nextafter(finfo.max, finfo.dtype.type(0)))
    room = (limit - bias_bound) + top_ulp / 4
    b = scale * q_norm * k_norm
    return not (scale * q_norm < limit / 2 and 2 * b * (1 + 1e-6) < room)


def prepare_attention(
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
) -> AttentionProblem:
    """Validate an attention call and normalise it into an :class:`AttentionProblem`.

    Parameters
    ----------
    query, key, value, attn_mask, is_causal, scale, enable_gqa, causal_alignment, window, sinks
        As in :func:`sdpa.scaled_dot_product_attention`.

    Returns
    -------
    AttentionProblem
        The call in the working dtype and the grouped layout, with every check done.

    Raises
    ------
    TypeError, ValueError
        As :func:`sdpa.scaled_dot_product_attention`, for the arguments above.

    See Also
    --------
    sdpa.tiled.attention_tiled : The tiled path on a prepared problem.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa.problem import prepare_attention
    >>> problem = prepare_attention(np.ones((3, 4)), np.ones((5, 4)), np.ones((5, 2)), is_causal=True)
    >>> problem.T, problem.S, problem.Dk, problem.Dv, problem.scale
    (3, 5, 4, 2, 0.5)
    >>> problem.band_mask().astype(int)
    array([[1, 0, 0, 0, 0],
           [1, 1, 0, 0, 0],
           [1, 1, 1, 0, 0]])
    """
    q, k, v = check_query_key_value(query, key, value, masked_hint=ATTENTION_MASK_HINT)
    is_causal = check_bool(is_causal, "is_causal")
    enable_gqa = check_bool(enable_gqa, "enable_gqa")
    alignment = check_alignment(causal_alignment)
    window = check_window(window)
    T, S, Dk, Dv = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    if enable_gqa:
        lead, Hq, Hkv = _grouped_batch_shape(q, k, v)
        full_heads_shape = (*lead, Hq, T, S)
    else:
        lead = _plain_batch_shape(q, k, v)
        full_heads_shape = (*lead, T, S)

    out_dtype, work_dtype = compute_dtype(q, k, v)
    allowed, bias, bias_bound = _check_mask(attn_mask, full_heads_shape, work_dtype)
    sinks = _check_sinks(sinks, full_heads_shape[:-1], work_dtype)
    scale = check_scale(scale, Dk)
    if abs(scale) > float(np.finfo(work_dtype).max):
        raise ValueError(
            f"scale must fit in {work_dtype}, the dtype the scores are computed in; got {scale!r}"
        )
    q, k, v = (a.astype(work_dtype, copy=False) for a in (q, k, v))
    q, bad_query, q_norm = _finite_rows(q)
    k, bad_key, k_norm = _finite_rows(k)
    v, bad_value, _ = _finite_rows(v)
    may_overflow = _may_overflow(abs(scale), q_norm, k_norm, bias_bound, work_dtype)

    groups = None
    batch_shape = tuple(lead)
    if enable_gqa:
        groups = Hq // Hkv
        batch_shape = (*lead, Hkv, groups)
        # Queries and their masks: (..., Hq, ...) -> (..., Hkv, G, ...); keys and values (and
        # their masks) gain an axis of length 1 that broadcasts against G.
        q, bad_query = (
            _split_heads(a, Hkv, groups, trailing) for a, trailing in ((q, 2), (bad_query, 1))
        )
        k, v, bad_key, bad_value = (
            None if a is None else np.expand_dims(a, -1 - trailing)
            for a, trailing in ((k, 2), (v, 2), (bad_key, 1), (bad_value, 1))
        )
        allowed, bias = (_split_heads(a, Hkv, groups, 2) for a in (allowed, bias))
        sinks = _split_heads(sinks, Hkv, groups, 1)

    return AttentionProblem(
        query=q,
        key=k,
        value=v,
        allowed=allowed,
        bias=bias,
        scale=scale,
        offset=alignment_offset(T, S, alignment),
        band=band_limits(is_causal, window),
        batch_shape=batch_shape,
        T=T,
        S=S,
        Dk=Dk,
        Dv=Dv,
        out_dtype=out_dtype,
        work_dtype=work_dtype,
        groups=groups,
        bad_query=bad_query,
        bad_key=bad_key,
        bad_value=bad_value,
        may_overflow=may_overflow,
        sinks=sinks,
    )


def _plain_batch_shape(q: np.ndarray, k: np.ndarray, v: np.ndarray) -> tuple[int, ...]:
    """The broadcast leading shape ``(..., H)`` of query, key and value, heads included."""
    try:
        return np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    except ValueError:
        raise shape_error(
            "the batch and head dimensions of query, key and value must broadcast "
            "(pass enable_gqa=True for grouped-query attention)",
            query=q,
            key=k,
            value=v,
        ) from None


def _grouped_batch_shape(q: np.ndarray, k: np.ndarray, v: np.ndarray):
    """``(batch, Hq, Hkv)`` under ``enable_gqa``: the broadcast batch shape and the heads."""
    for name, a in (("query", q), ("key", k), ("value", v)):
        if a.ndim < 3:
            raise ValueError(
                f"enable_gqa=True needs a heads axis (..., H, L, D) in {name}; "
                f"got {name}.shape={a.shape}"
            )
    Hq, Hkv = q.shape[-3], k.shape[-3]
    if v.shape[-3] != Hkv:
        raise shape_error("key and value must have the same number of heads", key=k, value=v)
    if Hkv == 0 or Hq % Hkv != 0:
        raise shape_error(
            f"with enable_gqa=True the query heads Hq={Hq} must be a multiple of the "
            f"key/value heads Hkv={Hkv}",
            query=q,
            key=k,
        )
    try:
        batch = np.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
    except ValueError:
        raise shape_error(
            "the batch dimensions of query, key and value must broadcast", query=q, key=k, value=v
        ) from None
    return batch, Hq, Hkv


def _split_heads(a: np.ndarray | None, Hkv: int, groups: int, trailing: int) -> np.ndarray | None:
    """Split the heads axis (``trailing`` axes from the end) of a query-side array into
    ``(Hkv, G)``; a heads axis of 1 becomes ``(1, 1)``; an array without one is left as is."""
    if a is None or a.ndim <= trailing:
        return a  # e.g. a (T, S) or (S,) mask: no heads axis, broadcasts as it is
    axis = a.ndim - trailing - 1
    heads = (Hkv, groups) if a.shape[axis] != 1 else (1, 1)
    return a.reshape(*a.shape[:axis], *heads, *a.shape[axis + 1 :])


def overflow_error(problem: AttentionProblem) -> ValueError:
    """The error for scores that overflow the working dtype although every input is finite."""
    dtype = problem.work_dtype
    limit = float(np.finfo(dtype).max)
    wider = "" if dtype == np.float64 else ", or pass float64 inputs"
    return ValueError(
        f"query and key give scores scale * query @ key^T (+ attn_mask) beyond the range of "
        f"{dtype} (|score| <= {limit:.4g}), where the softmax is undefined: scale query or "
        f"key down{wider}"
    )


def overflow_checked(problem: AttentionProblem):
    """Silence NumPy's overflow warnings where :func:`check_overflow` will raise instead."""
    if problem.may_overflow:
        return np.errstate(over="ignore", invalid="ignore")
    return contextlib.nullcontext()


def check_overflow(problem: AttentionProblem, raw: np.ndarray, allowed, bias) -> None:
    """Raise :func:`overflow_error` if an allowed entry of ``raw`` scores is not finite.

    ``raw = scale * q @ k^T + bias`` before masking, computed from finite inputs, so the only
    legitimate non-finite entries are ``-inf`` from a ``-inf`` bias and disallowed entries.
    """
    with np.errstate(invalid="ignore"):
        bad = ~np.isfinite(raw)
        if bias is not None:
            bad &= ~(np.isneginf(raw) & np.isneginf(bias))
        if allowed is not None:
            bad &= allowed
    if bad.any():
        raise overflow_error(problem)


def rows_reaching(problem: AttentionProblem, bad_keys: np.ndarray) -> np.ndarray:
    """``(*batch_shape, T)`` bool: query rows that may attend at least one key flagged in
    ``bad_keys`` (``(..., S)``), under the boolean mask and the causal/window band.

    A float bias never protects a key (``NaN + -inf`` is NaN), as in PyTorch. Only the flagged
    keys are examined, in chunks, so the memory stays far below one ``(T, S)`` matrix per head.
    """
    T, S = problem.T, problem.S
    result = np.zeros((*problem.batch_shape, T), dtype=bool)
    cols = np.flatnonzero(bad_keys.reshape(-1, S).any(axis=0)) if S else np.zeros(0, int)
    step = max(1, (1 << 22) // max(1, result.size))
    for c0 in range(0, cols.size, step):
        j = cols[c0 : c0 + step]
        hit = bad_keys[..., None, j]  # (..., 1, c)
        if problem.allowed is not None:
            allowed = np.broadcast_to(problem.allowed, (*problem.allowed.shape[:-1], S))
            hit = hit & allowed[..., j]  # (..., T, c)
        band = band_mask(np.arange(T), j, problem.offset, *problem.band)
        if band is not None:
            hit = hit & band
        result |= np.any(hit, axis=-1)
    return result


def poisoned_rows(problem: AttentionProblem) -> tuple[np.ndarray | None, np.ndarray | None]:
    """``(score_rows, value_rows)``: the query rows that a non-finite input reaches.

    ``score_rows`` (``(*batch_shape, T)`` bool, or None if there are none): rows whose query,
    or a key they may attend, holds NaN or inf; their weights, log-sum-exp and output are NaN.
    ``value_rows``: rows that may attend a value holding NaN or inf; their output is NaN.
    """
    score = value = None
    if problem.bad_query is not None:
        score = np.broadcast_to(problem.bad_query, (*problem.batch_shape, problem.T)).copy()
    if problem.bad_key is not None:
        reached = rows_reaching(problem, problem.bad_key)
        score = reached if score is None else score | reached
    if problem.bad_value is not None:
        value = rows_reaching(problem, problem.bad_value)
    return score, value


def mark_poisoned(problem: AttentionProblem, out, lse, weights=None):
    """Set to NaN the rows of ``out``, ``lse`` (and ``weights``) that a non-finite input reaches.

    Returns the (possibly broadcast and copied) arrays.
    """
    score, value = poisoned_rows(problem)
    if score is None and value is None:
        return out, lse, weights
    full = problem.batch_shape
    out = np.array(np.broadcast_to(out, (*full, problem.T, problem.Dv)))
    lse = np.array(np.broadcast_to(lse, (*full, problem.T)))
    nan = problem.work_dtype.type(np.nan)
    if score is not None:
        lse[score] = nan
        out[score] = nan
        if weights is not None:
            weights = np.array(np.broadcast_to(weights, problem.scores_shape))
            weights[score] = nan
    if value is not None:
        out[value] = nan
    return out, lse, weights


def mask_block(mask: np.ndarray | None, t0: int, t1: int, s0: int, s1: int) -> np.ndarray | None:
    """Rows ``t0:t1`` and columns ``s0:s1`` of a mask that may be broadcast along either axis."""
    if mask is None:
        return None
    if mask.shape[-1] != 1:
        mask = mask[..., s0:s1]
    if mask.ndim >= 2 and mask.shape[-2] != 1:
        mask = mask[..., t0:t1, :]
    return mask


def allowed_block(problem: AttentionProblem, t0: int, t1: int, s0: int, s1: int):
    """The user's boolean mask AND the band on queries ``t0:t1`` and keys ``s0:s1``, or None."""
    allowed = mask_block(problem.allowed, t0, t1, s0, s1)
    band = problem.band_mask(t0, t1, s0, s1)
    if band is None:
        return allowed
    return band if allowed is None else allowed & band


def masked_scores(
    problem: AttentionProblem, q_scaled: np.ndarray, t0: int, t1: int, s0: int, s1: int
):
    """``scale * q k^T + bias`` on queries ``t0:t1`` and keys ``s0:s1``, disallowed entries ``-inf``.

    ``q_scaled`` is ``problem.query * scale`` (scaled once by the caller). The scores are
    checked for overflow when that is possible (:func:`check_overflow`). Every implementation
    that forms scores with NumPy's broadcasting (the reference path, both backward passes)
    forms them here, so they round and mask alike.
    """
    bias = mask_block(problem.bias, t0, t1, s0, s1)
    with overflow_checked(problem):  # an overflow is an error raised below, not a warning
        # (..., Bq, Dk) @ (..., Dk, Bk) -> (..., Bq, Bk)
        scores = q_scaled[..., t0:t1, :] @ np.swapaxes(problem.key[..., s0:s1, :], -1, -2)
        if bias is not None:
            scores = scores + bias
    allowed = allowed_block(problem, t0, t1, s0, s1)
    if problem.may_overflow:
        check_overflow(problem, scores, allowed, bias)
    if allowed is not None:
        scores = np.where(allowed, scores, problem.work_dtype.type(-np.inf))
    return scores
