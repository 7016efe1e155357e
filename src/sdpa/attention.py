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

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from ._checks import (
    as_float_array,
    check_alignment,
    check_probability,
    check_rng,
    check_scale,
    check_window,
    compute_dtype,
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


def _check_mask(attn_mask, scores_shape: tuple[int, ...], full_heads_shape: tuple[int, ...]):
    """Split ``attn_mask`` into ``(allowed, bias)``; check it broadcasts to the scores."""
    if attn_mask is None:
        return None, None
    mask = np.asarray(attn_mask)
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
    if kind == "f":
        if np.isnan(mask).any() or np.isposinf(mask).any():
            raise ValueError("attn_mask as a float bias must not contain NaN or +inf")
        return None, mask
    return mask, None


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
    q = as_float_array(query, "query")
    k = as_float_array(key, "key")
    v = as_float_array(value, "value")
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
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"is_causal must be a bool; got {is_causal!r}")
    if not isinstance(enable_gqa, (bool, np.bool_)):
        raise TypeError(f"enable_gqa must be a bool; got {enable_gqa!r}")
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

    allowed, bias = _check_mask(attn_mask, (*lead, T, S), full_heads_shape)
    out_dtype, work_dtype = compute_dtype(q, k, v)
    q, k, v = (a.astype(work_dtype, copy=False) for a in (q, k, v))
    if bias is not None:
        bias = bias.astype(work_dtype, copy=False)

    if groups is not None:
        Hkv = k.shape[-3]
        q = q.reshape(*q.shape[:-3], Hkv, groups, T, Dk)
        k = k[..., None, :, :]  # (..., Hkv, 1, S, Dk)
        v = v[..., None, :, :]
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
        scale=check_scale(scale, Dk),
        offset=alignment_offset(T, S, alignment),
        band=band_limits(bool(is_causal), window),
        batch_shape=batch_shape,
        T=T,
        S=S,
        Dk=Dk,
        Dv=Dv,
        out_dtype=out_dtype,
        work_dtype=work_dtype,
        groups=groups,
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


def attention_reference(
    problem: AttentionProblem, dropout_p: float = 0.0, rng: np.random.Generator | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The textbook formula on a prepared problem; returns ``(out, weights, lse)``.

    Works in ``problem.work_dtype`` and returns the grouped shapes; the caller casts and
    ungroups. Masked positions are *replaced* by ``-inf`` (not added to), so a NaN in a
    masked-out key cannot reach the output.
    """
    q = problem.query * problem.work_dtype.type(problem.scale)  # (..., T, Dk), scaled once
    scores = q @ np.swapaxes(problem.key, -1, -2)  # (..., T, Dk) @ (..., Dk, S) -> (..., T, S)
    if problem.bias is not None:
        scores = scores + problem.bias
    allowed = combined_allowed(problem)
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
    return out, weights, lse[..., 0]


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
        apply dropout. ``"auto"`` takes the tiled path when neither is requested and the
        problem is large enough for it to be faster, otherwise the reference path. Both give
        the same result up to rounding.

    Returns
    -------
    out : (..., Hq, T, Dv) np.ndarray
        Alone, or first in a tuple ``(out, weights, lse)`` keeping only what was requested.
    weights : (..., Hq, T, S) np.ndarray
        Each row is non-negative and sums to one (zero for fully masked rows).
    lse : (..., Hq, T) np.ndarray
        ``log(sum(exp(scores)))`` per query; ``-inf`` for fully masked rows.

    Raises
    ------
    TypeError
        For complex or object inputs, an integer ``attn_mask``, a non-bool flag, or a missing or
        wrong ``rng`` with dropout.
    ValueError
        For inputs with fewer than 2 dimensions, mismatched ``Dk`` or ``S``, batch or mask
        shapes that do not broadcast, head counts that do not divide, a bad ``window``,
        ``causal_alignment``, ``dropout_p`` or ``implementation``, and for
        ``implementation="tiled"`` together with ``return_weights`` or dropout.

    Notes
    -----
    For one query row :math:`q_i` the result is

    .. math:: o_i = \sum_j \frac{e^{s_{ij}}}{\sum_{j'} e^{s_{ij'}}} v_j,
              \qquad s_{ij} = \text{scale}\; q_i \cdot k_j + b_{ij}.

    **Masks.** Boolean, causal and window masks *replace* disallowed scores by ``-inf``; float
    masks are *added*. A row in which every key is disallowed (including ``S = 0``) returns
    ``out = 0``, ``weights = 0`` and ``lse = -inf``, with no NaN and no warning, as PyTorch
    does since 2.5. A NaN in a masked-out *key* is removed by the replacement; a NaN in a
    masked-out *value* still propagates, because ``0 * nan`` is NaN in the final matrix
    product.

    **Dtypes.** float16, float32 and float64 inputs give outputs of the same dtype (float16 is
    computed in float32); mixed floating dtypes promote with ``np.result_type``; integer and
    bool inputs are computed in float64. A float mask is cast to the working dtype.

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
    if dropout_p > 0.0:
        if rng is None:  # a missing generator is the wrong kind (None), as the docstring says
            raise TypeError(
                f"dropout_p={dropout_p} > 0 needs an explicit rng=np.random.default_rng(seed)"
            )
        check_rng(rng)
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
    if return_lse:
        lse = problem.ungroup(np.broadcast_to(lse, (*full, problem.T)), 1)
        result.append(lse.astype(problem.out_dtype))
    return tuple(result)
