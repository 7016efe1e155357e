r"""Scaled dot-product attention, ``softmax(Q K^T / sqrt(Dk)) V``, with PyTorch's API.

The module has two parts:

* :func:`prepare_attention` validates every argument in one place and turns the call into an
  :class:`AttentionProblem`: arrays in the working dtype, grouped-query heads reshaped so that
  plain broadcasting does the grouping, the user's mask split into a boolean *allowed* mask and
  an additive *bias*, and the causal/window band described by three integers. Every
  implementation (this module's reference path, the tiled path, the backward pass) starts from
  it, so they cannot disagree about what a call means.
* :func:`attention_reference` is the textbook formula, one line per stage:
  ``scores -> weights -> out``.

Shape letters: ``B`` batch, ``Hq``/``Hkv`` query and key/value heads, ``T`` queries, ``S`` keys,
``Dk`` query/key width, ``Dv`` value width.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from ._checks import (
    ATTENTION_MASK_HINT,
    as_array,
    as_float_array,
    check_alignment,
    check_bool,
    check_memory,
    check_probability,
    check_rng,
    check_scale,
    check_window,
    compute_dtype,
    lse_dtype,
    range_error,
)
from .masks import alignment_offset, band_limits, band_mask
from .softmax import softmax_and_lse
from .tiled import attention_tiled, worth_tiling

__all__ = ["scaled_dot_product_attention"]


@dataclass(frozen=True)
class AttentionProblem:
    """A validated attention call, ready for any implementation.

    With ``enable_gqa`` the head axis is split into ``(Hkv, G)`` with ``G = Hq // Hkv``: queries
    become ``(..., Hkv, G, T, Dk)``, keys and values ``(..., Hkv, 1, S, D)``, and masks follow,
    so that query head ``h`` meets key/value head ``h // G`` by broadcasting, with no copies.
    :meth:`ungroup` undoes the split on results.
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


def _shape_error(what: str, **arrays) -> ValueError:
    given = ", ".join(f"{name}.shape={tuple(a.shape)}" for name, a in arrays.items())
    return ValueError(f"{what}; got {given}")


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
    try:
        fits = np.broadcast_shapes(mask.shape, full_heads_shape) == full_heads_shape
    except ValueError:
        fits = False
    if not fits:
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
    if max(-float(lo), float(hi)) > float(np.finfo(work_dtype).max):
        worst = float(lo) if -float(lo) > float(hi) else float(hi)
        raise range_error(
            "attn_mask", work_dtype, worst, ", the dtype the scores are computed in",
            " (use -inf to disallow a key)",
        )
    return None, mask.astype(work_dtype, copy=False), max(-float(lo), float(hi))


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
    window=None,
) -> AttentionProblem:
    """Validate an attention call and normalise it into an :class:`AttentionProblem`."""
    q = as_float_array(query, "query", masked_hint=ATTENTION_MASK_HINT)
    k = as_float_array(key, "key", masked_hint=ATTENTION_MASK_HINT)
    v = as_float_array(value, "value", masked_hint=ATTENTION_MASK_HINT)
    for name, a in (("query", q), ("key", k), ("value", v)):
        if a.ndim < 2:
            raise ValueError(
                f"{name} must have at least 2 dimensions (..., L, D); got {name}.shape={a.shape}"
            )
    if q.shape[-1] != k.shape[-1]:
        raise _shape_error("query and key must share the last dimension Dk", query=q, key=k)
    if k.shape[-2] != v.shape[-2]:
        raise _shape_error(
            "key and value must share the sequence length S (axis -2)", key=k, value=v
        )
    is_causal = check_bool(is_causal, "is_causal")
    enable_gqa = check_bool(enable_gqa, "enable_gqa")
    alignment = check_alignment(causal_alignment)
    window = check_window(window)
    T, S, Dk, Dv = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]

    groups = None
    if enable_gqa:
        for name, a in (("query", q), ("key", k), ("value", v)):
            if a.ndim < 3:
                raise ValueError(
                    f"enable_gqa=True needs a heads axis (..., H, L, D) in {name}; "
                    f"got {name}.shape={a.shape}"
                )
        Hq, Hkv = q.shape[-3], k.shape[-3]
        if v.shape[-3] != Hkv:
            raise _shape_error("key and value must have the same number of heads", key=k, value=v)
        if Hkv == 0 or Hq % Hkv != 0:
            raise _shape_error(
                f"with enable_gqa=True the query heads Hq={Hq} must be a multiple of the "
                f"key/value heads Hkv={Hkv}",
                query=q,
                key=k,
            )
        try:
            lead = np.broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
        except ValueError:
            raise _shape_error(
                "the batch dimensions of query, key and value must broadcast", query=q, key=k, value=v
            ) from None
        full_heads_shape = (*lead, Hq, T, S)
        groups = Hq // Hkv
    else:
        try:
            lead = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
        except ValueError:
            raise _shape_error(
                "the batch and head dimensions of query, key and value must broadcast "
                "(pass enable_gqa=True for grouped-query attention)",
                query=q,
                key=k,
                value=v,
            ) from None
        full_heads_shape = (*lead, T, S)

    out_dtype, work_dtype = compute_dtype(q, k, v)
    allowed, bias, bias_bound = _check_mask(attn_mask, full_heads_shape, work_dtype)
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

    if groups is not None:
        Hkv = k.shape[-3]
        q = q.reshape(*q.shape[:-3], Hkv, groups, T, Dk)
        k = k[..., None, :, :]  # (..., Hkv, 1, S, Dk)
        v = v[..., None, :, :]
        if bad_query is not None:
            bad_query = bad_query.reshape(*bad_query.shape[:-2], Hkv, groups, T)
        if bad_key is not None:
            bad_key = bad_key[..., None, :]
        if bad_value is not None:
            bad_value = bad_value[..., None, :]
        allowed = _group_mask(allowed, Hkv, groups)
        bias = _group_mask(bias, Hkv, groups)
        batch_shape = (*lead, Hkv, groups)
    else:
        batch_shape = tuple(lead)

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
    )


def _group_mask(mask: np.ndarray | None, Hkv: int, groups: int) -> np.ndarray | None:
    """Reshape a mask's head axis (1 or Hq) into (Hkv, G) or (1, 1)."""
    if mask is None or mask.ndim < 3:
        return mask  # (T, S) or (S,): no head axis, broadcasts as it is
    Hm = mask.shape[-3]
    if Hm == 1:
        return mask[..., None, :, :]
    return mask.reshape(*mask.shape[:-3], Hkv, groups, *mask.shape[-2:])


def combined_allowed(problem: AttentionProblem) -> np.ndarray | None:
    """The user's boolean mask AND the causal/window band, or None if nothing is masked."""
    band = problem.band_mask()
    if band is None:
        return problem.allowed
    if problem.allowed is None:
        return band
    return problem.allowed & band


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


def attention_reference(
    problem: AttentionProblem,
    dropout_p: float = 0.0,
    rng: np.random.Generator | None = None,
    *,
    mark: bool = True,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The textbook formula on a prepared problem; returns ``(out, weights, lse)``.

    Works in ``problem.work_dtype`` and returns the grouped shapes; the caller casts and
    ungroups. Masked positions are *replaced* by ``-inf`` (not added to), so a NaN in a
    masked-out key cannot reach the output. The rows that a non-finite input reaches are set
    to NaN (:func:`mark_poisoned`) unless ``mark`` is False (the backward pass marks its own).
    """
    n_scores = int(np.prod(problem.scores_shape, dtype=np.int64))
    itemsize = problem.work_dtype.itemsize
    need = n_scores * (3 * itemsize + (8 if dropout_p > 0.0 else 0))  # scores, weights, a copy
    check_memory(
        need,
        f"the reference path's scores and weights of shape {problem.scores_shape} in "
        f"{problem.work_dtype}",
        "use implementation='tiled' (which never forms them) or smaller inputs",
    )
    with overflow_checked(problem):  # an overflow is an error raised below, not a warning
        q = problem.query * problem.work_dtype.type(problem.scale)  # (..., T, Dk), scaled once
        scores = q @ np.swapaxes(problem.key, -1, -2)  # (..., T, Dk) @ (..., Dk, S) -> (..., T, S)
        if problem.bias is not None:
            scores = scores + problem.bias
    allowed = combined_allowed(problem)
    if problem.may_overflow:
        check_overflow(problem, scores, allowed, problem.bias)
    if allowed is not None:
        scores = np.where(allowed, scores, problem.work_dtype.type(-np.inf))
    scores = np.broadcast_to(scores, problem.scores_shape)
    weights, lse = softmax_and_lse(scores, axis=-1)  # (..., T, S), (..., T, 1)
    used = weights
    if dropout_p > 0.0:
        keep = rng.random(weights.shape) >= dropout_p
        used = weights * keep / (1.0 - dropout_p) if dropout_p < 1.0 else np.zeros_like(weights)
        used = used.astype(problem.work_dtype, copy=False)
    out = used @ problem.value  # (..., T, S) @ (..., S, Dv) -> (..., T, Dv)
    lse = lse[..., 0]
    if mark:
        out, lse, weights = mark_poisoned(problem, out, lse, weights)
    return out, weights, lse


def scaled_dot_product_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    attn_mask: ArrayLike | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
    causal_alignment: str = "top_left",
    window: tuple[int | None, int | None] | None = None,
    rng: np.random.Generator | None = None,
    return_weights: bool = False,
    return_lse: bool = False,
    implementation: str = "auto",
):
    r"""Scaled dot-product attention: ``softmax(query @ key^T * scale + mask) @ value``.

    The signature and layout follow ``torch.nn.functional.scaled_dot_product_attention``; the
    keyword-only options after ``*`` add what PyTorch lacks (bottom-right causal alignment,
    sliding windows, the weights and the log-sum-exp).

    Parameters
    ----------
    query : (..., Hq, T, Dk) array_like
        Queries. 2-D ``(T, Dk)`` works; leading dimensions broadcast by NumPy rules.
    key : (..., Hkv, S, Dk) array_like
        Keys.
    value : (..., Hkv, S, Dv) array_like
        Values.
    attn_mask : array_like, optional
        Broadcastable to the weights ``(..., Hq, T, S)``: for example ``(S,)``, ``(T, S)`` or
        ``(B, 1, 1, S)``. A bool mask means ``True`` = may attend (PyTorch SDPA and JAX);
        a float mask is a bias added to the scaled scores (``-inf`` disallows). Integer masks
        raise ``TypeError``: convert them to bool.
    dropout_p : float, default 0.0
        Probability of dropping each weight, in ``[0, 1]``; kept weights are scaled by
        ``1 / (1 - dropout_p)``. Needs ``rng`` when positive.
    is_causal : bool, default False
        Apply a causal mask, aligned by ``causal_alignment``. Combines with ``attn_mask`` and
        ``window`` by logical AND.
    scale : float, optional
        Multiplier of the scores; default ``1 / sqrt(Dk)``, and 1.0 when ``Dk = 0``.
    enable_gqa : bool, default False
        Grouped-query attention: ``Hq`` must be a multiple of ``Hkv``, and query head ``h``
        uses key/value head ``h // (Hq // Hkv)`` (PyTorch's ``repeat_interleave``). Without
        it, heads broadcast by NumPy rules (``Hkv = 1`` works).
    causal_alignment : {"top_left", "bottom_right"}, default "top_left"
        ``"top_left"``: ``tril(ones(T, S), 0)`` as in PyTorch. ``"bottom_right"``:
        ``tril(ones(T, S), S - T)``, the last query aligned with the last key (KV cache).
        Also positions the ``window``.
    window : (left, right), optional
        Sliding window: query ``i`` may attend keys ``i - left <= j <= i + right`` (shifted
        by ``S - T`` under bottom-right alignment). Either side may be None (unbounded).
    rng : numpy.random.Generator, optional
        Source of the dropout mask; required when ``dropout_p > 0``.
    return_weights : bool, default False
        Also return the attention weights (before dropout).
    return_lse : bool, default False
        Also return the log-sum-exp of the scaled, masked scores of each query.
    implementation : {"auto", "reference", "tiled"}, default "auto"
        ``"reference"`` evaluates the formula as written, holding the ``(..., T, S)`` scores.
        ``"tiled"`` is the memory-efficient path (the online softmax of FlashAttention-2, in
        tiles, on all cores): it never forms the scores, so it cannot return the weights or
        apply dropout. ``"auto"`` takes the tiled path when neither is requested and a cost
        model (``sdpa.tiled.estimated_times``: the scores, the head widths, and the number of
        tiles and work units, each with its fixed cost) predicts it to be faster, or when the
        reference path's ``(..., T, S)`` arrays would take more than a quarter of the
        available memory; otherwise the reference path. Many small heads therefore stay on
        the reference path however many scores they hold. Both give the same result up to
        rounding.

    Returns
    -------
    out : (..., Hq, T, Dv) np.ndarray
        Alone, or first in a tuple ``(out, weights, lse)`` keeping only what was requested.
    weights : (..., Hq, T, S) np.ndarray
        Each row is non-negative and sums to one (zero for fully masked rows).
    lse : (..., Hq, T) np.ndarray
        ``log(sum(exp(scores)))`` per query; ``-inf`` for fully masked rows. float32 for
        float16 inputs (as FlashAttention does), otherwise the dtype of ``out``.

    Raises
    ------
    TypeError
        For complex, object or masked-array (``numpy.ma``) inputs, an integer ``attn_mask``,
        a flag that is not a bool, an ``rng`` that is not a ``numpy.random.Generator``, or a
        missing ``rng`` with dropout.
    ValueError
        For inputs with fewer than 2 dimensions, mismatched ``Dk`` or ``S``, batch or mask
        shapes that do not broadcast, head counts that do not divide, a bad ``window``,
        ``causal_alignment``, ``dropout_p`` or ``implementation``, for
        ``implementation="tiled"`` together with ``return_weights`` or dropout, for a float
        mask holding NaN, ``+inf`` or a value beyond the working dtype's range, and for scores
        that overflow the working dtype (see Notes).
    MemoryError
        When the reference path's ``(..., T, S)`` scores and weights would not fit in the
        available memory (estimated before anything is allocated).

    Notes
    -----
    For one query row :math:`q_i` the result is

    .. math:: o_i = \sum_j \frac{e^{s_{ij}}}{\sum_{j'} e^{s_{ij'}}} v_j,
              \qquad s_{ij} = \text{scale}\; q_i \cdot k_j + b_{ij}.

    **Masks.** Boolean, causal and window masks *replace* disallowed scores by ``-inf``; float
    masks are *added*. A row in which every key is disallowed (including ``S = 0``) returns
    ``out = 0``, ``weights = 0`` and ``lse = -inf``, with no NaN and no warning, as PyTorch
    does since 2.5. A large finite bias (``np.finfo(dtype).min``, the Hugging Face convention,
    or ``-1e9``) is a bias like any other: a row whose every key carries it still gets a
    proper softmax over those keys, on both paths.

    **NaN and infinity (NaN in, NaN out).** A key or value that a boolean, causal or window
    mask hides from a query never reaches that query's output, not even as a NaN: both paths
    behave as if the hidden positions were absent (PyTorch's math path instead spreads a NaN
    from a hidden value through ``0 * nan``). Otherwise a NaN or an infinity in a query row,
    or in a key it may attend, makes that row's weights, ``lse`` and output NaN, and one in a
    value it may attend makes its output NaN. A float mask does not hide: a NaN key under a
    ``-inf`` bias still gives NaN (``nan + -inf``), as in PyTorch.

    **Overflow.** The scores are computed in the working dtype. A score that is not finite
    although query, key and mask are (``q = k = 1e200`` in float64) raises ``ValueError``
    rather than returning a guess; so does a float mask value that the working dtype cannot
    hold (``1e300`` with float32 inputs). The check costs nothing when the norms of query and
    key bound every score, which is the case for all but extreme inputs.

    **Dtypes.** float16, float32 and float64 inputs give outputs of the same dtype (float16 is
    computed in float32, and its ``lse`` is returned in float32: scores above 65504 would
    overflow float16); mixed floating dtypes promote with ``np.result_type``; integer and
    bool inputs are computed in float64. A float mask is cast to the working dtype.

    **Memory.** The reference path holds about three arrays of the ``(..., T, S)`` scores'
    size; the tiled path a few tiles per thread. Before a reference-path call that needs more
    than 64 MiB, the estimate is compared with the memory available (``MemAvailable`` on
    Linux) and a ``MemoryError`` names the shape and the bytes instead of swapping.

    **Differences from PyTorch, on purpose.** ``is_causal`` may be combined with ``attn_mask``
    (PyTorch raises; JAX allows); integer inputs are accepted (PyTorch raises); dropout needs
    an explicit generator, so results are reproducible.

    Examples
    --------
    The worked example "The cat sleeps." (no scaling in the source, hence ``scale=1.0``):

    >>> import numpy as np
    >>> from sdpa import scaled_dot_product_attention
    >>> q_cat = np.array([[0, 1]])
    >>> K = np.array([[1, 1], [0, 1], [1, 2]])
    >>> V = np.array([[1, 0], [0, 2], [1, 2]])
    >>> out, weights = scaled_dot_product_attention(q_cat, K, V, scale=1.0, return_weights=True)
    >>> np.round(weights, 3)
    array([[0.212, 0.212, 0.576]])
    >>> np.round(out, 3)
    array([[0.788, 1.576]])

    Batched multi-head input with a causal mask; each row of the weights sums to one:

    >>> rng = np.random.default_rng(0)
    >>> q = rng.standard_normal((2, 4, 5, 8))  # (B, H, T, Dk)
    >>> k = rng.standard_normal((2, 4, 7, 8))  # (B, H, S, Dk)
    >>> v = rng.standard_normal((2, 4, 7, 3))  # (B, H, S, Dv)
    >>> out, w = scaled_dot_product_attention(q, k, v, is_causal=True, return_weights=True)
    >>> out.shape, w.shape
    ((2, 4, 5, 3), (2, 4, 5, 7))
    >>> bool(np.allclose(w.sum(-1), 1.0))
    True

    The memory-efficient path gives the same result without forming the ``(T, S)`` weights:

    >>> tiled = scaled_dot_product_attention(q, k, v, is_causal=True, implementation="tiled")
    >>> bool(np.allclose(tiled, out, rtol=1e-12, atol=1e-12))
    True
    """
    dropout_p = check_probability(dropout_p, "dropout_p")
    return_weights = check_bool(return_weights, "return_weights")
    return_lse = check_bool(return_lse, "return_lse")
    if rng is not None:
        check_rng(rng)
    if implementation not in ("auto", "reference", "tiled"):
        raise ValueError(
            f"implementation must be 'auto', 'reference' or 'tiled'; got {implementation!r}"
        )
    if implementation == "tiled" and (return_weights or dropout_p > 0.0):
        raise ValueError(
            "implementation='tiled' never forms the attention weights, so it supports neither "
            f"return_weights=True nor dropout; got return_weights={return_weights}, "
            f"dropout_p={dropout_p}"
        )
    if dropout_p > 0.0 and rng is None:  # a missing generator is the wrong kind (None)
        raise TypeError(
            f"dropout_p={dropout_p} > 0 needs an explicit rng=np.random.default_rng(seed)"
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
    if implementation == "auto":
        tiled = not return_weights and dropout_p == 0.0 and worth_tiling(problem)
    else:
        tiled = implementation == "tiled"
    if tiled:
        out, lse = attention_tiled(problem)
        weights = None
    else:
        out, weights, lse = attention_reference(problem, dropout_p, rng)
    return _finish(problem, out, weights, lse, return_weights, return_lse)


def _finish(problem, out, weights, lse, return_weights, return_lse):
    """Broadcast to the full batch shape, merge grouped heads and cast to the output dtype."""
    full = problem.batch_shape
    out = np.broadcast_to(out, (*full, problem.T, problem.Dv))
    out = problem.ungroup(out, 2).astype(problem.out_dtype)
    if not (return_weights or return_lse):
        return out
    result = [out]
    if return_weights:
        weights = problem.ungroup(np.broadcast_to(weights, problem.scores_shape), 2)
        result.append(weights.astype(problem.out_dtype))
    if return_lse:  # float16 inputs: float32, since float16 overflows beyond 65504
        lse = problem.ungroup(np.broadcast_to(lse, (*full, problem.T)), 1)
        result.append(lse.astype(lse_dtype(problem.out_dtype)))
    return tuple(result)
