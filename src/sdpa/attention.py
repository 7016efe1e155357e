r"""Scaled dot-product attention, ``softmax(Q K^T / sqrt(Dk)) V``, with PyTorch's API.

The public entry point, :func:`sdpa.scaled_dot_product_attention`, validates its call once
(:func:`sdpa.problem.prepare_attention`) and hands the prepared problem to one of two paths:

* :func:`attention_reference`, this module's textbook formula, one line per stage:
  ``scores -> weights -> out``;
* :func:`sdpa.tiled.attention_tiled`, the memory-efficient path,

as ``implementation`` says, or as the cost model of :mod:`sdpa.cost_model` predicts to be
faster (``"auto"``).

Shape letters: ``B`` batch, ``Hq``/``Hkv`` query and key/value heads, ``T`` queries, ``S`` keys,
``Dk`` query/key width, ``Dv`` value width.
"""

from __future__ import annotations

import math

import numpy as np
from numpy.typing import ArrayLike

from ._checks import check_bool, check_memory, check_probability, check_rng
from .cost_model import auto_path
from .problem import (
    AttentionProblem,
    mark_poisoned,
    masked_scores,
    overflow_checked,
    prepare_attention,
)
from .softmax_stable import softmax_and_lse
from .tiled import attention_tiled

__all__ = ["attention_reference", "scaled_dot_product_attention", "softmax_with_sinks"]


def softmax_with_sinks(scores: np.ndarray, sinks: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    r"""The softmax of each row of ``scores`` with one more logit, the sink, that has no value.

    Parameters
    ----------
    scores : (..., T, S) np.ndarray
        Scaled, masked scores: finite, or ``-inf`` where a key is disallowed.
    sinks : np.ndarray
        The sinks' logits ``s_i``, finite or ``-inf``, broadcastable to ``(..., T)``.

    Returns
    -------
    weights : (..., T, S) np.ndarray
        ``exp(z_ij) / (sum_j exp(z_ij) + exp(s_i))``: each row sums to less than one, the
        sink taking the rest.
    lse : (..., T, 1) np.ndarray
        ``log(sum_j exp(z_ij) + exp(s_i))``: ``s_i`` in a row with no allowed key, ``-inf``
        where the sink is ``-inf`` too.

    Notes
    -----
    The sink takes part in the row maximum, ``m_i = max(max_j z_ij, s_i)``, so no exponent is
    positive. With ``s_i = -inf`` each operation is the one of the plain softmax
    (``softmax_and_lse`` of ``sdpa.softmax_stable``) and gives its bits: ``exp(-inf) = 0``
    is added to the row sum.

    Examples
    --------
    Two equal scores and a sink at 0, the "softmax + 1": each key weighs 1/3.

    >>> import numpy as np
    >>> from sdpa.attention import softmax_with_sinks
    >>> weights, lse = softmax_with_sinks(np.zeros((1, 2)), np.zeros(1))
    >>> np.round(weights, 4), np.round(lse, 4)  # lse = log(1 + 1 + 1)
    (array([[0.3333, 0.3333]]), array([[1.0986]]))
    """
    rows = scores.shape[:-1]
    s = np.broadcast_to(sinks, rows)  # (..., T)
    row_max = np.max(scores, axis=-1) if scores.shape[-1] else np.full(rows, -np.inf, s.dtype)
    m = np.maximum(row_max, s)  # (..., T): the sink joins the maximum
    ordinary = m > -np.inf  # False: no allowed key and no sink
    shift = np.where(ordinary, m, 0).astype(scores.dtype, copy=False)
    with np.errstate(over="ignore"):  # a difference below -max is -inf: exp gives 0
        weights = scores - shift[..., None]  # (..., T, S) - (..., T, 1)
        sink_term = s - shift
    np.exp(weights, out=weights)
    total = np.sum(weights, axis=-1) + np.exp(sink_term)  # (..., T): >= 1 in ordinary rows
    total = np.where(ordinary, total, 1).astype(scores.dtype, copy=False)
    weights /= total[..., None]
    lse = np.where(ordinary, m + np.log(total), -np.inf).astype(scores.dtype, copy=False)
    return weights, lse[..., None]


def attention_reference(
    problem: AttentionProblem,
    dropout_p: float = 0.0,
    rng: np.random.Generator | None = None,
    *,
    mark: bool = True,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The textbook formula on a prepared problem, holding the ``(..., T, S)`` scores.

    Masked positions are *replaced* by ``-inf`` (not added to), so a NaN in a masked-out key
    cannot reach the output.

    Parameters
    ----------
    problem : AttentionProblem
        From :func:`sdpa.problem.prepare_attention`.
    dropout_p : float, default 0.0
        Probability of dropping each weight (validated by the caller).
    rng : numpy.random.Generator, optional
        Source of the dropout mask; required when ``dropout_p > 0``.
    mark : bool, default True
        Set to NaN the rows that a non-finite input reaches; the backward pass marks its own.

    Returns
    -------
    out : np.ndarray
        ``(*problem.batch_shape, T, Dv)`` in ``problem.work_dtype``, grouped heads not merged
        (:meth:`sdpa.problem.AttentionProblem.finish` does that).
    weights : np.ndarray
        ``(*problem.batch_shape, T, S)``, before dropout.
    lse : np.ndarray
        ``(*problem.batch_shape, T)``.

    Raises
    ------
    MemoryError
        When the scores and weights would not fit in the available memory.
    ValueError
        When a score overflows the working dtype although every input is finite.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa.attention import attention_reference
    >>> from sdpa.problem import prepare_attention
    >>> problem = prepare_attention(np.zeros((2, 3)), np.zeros((4, 3)), np.eye(4))
    >>> out, weights, lse = attention_reference(problem)
    >>> weights[0]  # equal scores: equal weights
    array([0.25, 0.25, 0.25, 0.25])
    >>> round(float(lse[0]), 6)  # log(4 * exp(0))
    1.386294
    """
    n_scores = math.prod(problem.scores_shape)
    itemsize = problem.work_dtype.itemsize
    need = n_scores * (3 * itemsize + (8 if dropout_p > 0.0 else 0))  # scores, weights, a copy
    check_memory(
        need,
        f"the reference path's scores and weights of shape {problem.scores_shape} in "
        f"{problem.work_dtype}",
        "use implementation='tiled' (which never forms them) or smaller inputs",
    )
    with overflow_checked(problem):
        q_scaled = problem.query * problem.work_dtype.type(problem.scale)  # (..., T, Dk), once
    scores = masked_scores(problem, q_scaled, 0, problem.T, 0, problem.S)  # (..., T, S)
    scores = np.broadcast_to(scores, problem.scores_shape)
    if problem.sinks is None:
        weights, lse = softmax_and_lse(scores, axis=-1)  # (..., T, S), (..., T, 1)
    else:
        weights, lse = softmax_with_sinks(scores, problem.sinks)
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
    sinks: ArrayLike | None = None,
    rng: np.random.Generator | None = None,
    return_weights: bool = False,
    return_lse: bool = False,
    implementation: str = "auto",
):
    r"""Scaled dot-product attention: ``softmax(query @ key^T * scale + mask) @ value``.

    The signature and layout follow ``torch.nn.functional.scaled_dot_product_attention``; the
    keyword-only options after ``*`` add what PyTorch lacks (bottom-right causal alignment,
    sliding windows, attention sinks, the weights and the log-sum-exp).

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
    sinks : (..., Hq, T) array_like, optional
        Attention sinks: one extra logit ``s_i`` per query row in the softmax's denominator,
        with no value (see Notes), in the units of the scaled scores. Broadcastable to the
        weights' shape without the key axis: a scalar for every row, ``(T,)`` per query, or a
        per-head logit as ``sinks[:, None]`` of shape ``(Hq, 1)``. ``-inf`` is no sink.
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
        model (``sdpa.cost_model.estimated_times``: the scores, the head widths, and the number of
        tiles and work units, each with its fixed cost) predicts it to be faster, or when the
        reference path's ``(..., T, S)`` arrays would take more than a quarter of the
        available memory; otherwise the reference path. Many small heads therefore stay on
        the reference path however many scores they hold. A tiled call too short to repay
        starting worker threads runs on one thread (``sdpa.cost_model.tiled_threads``). All
        give the same result up to rounding.

    Returns
    -------
    out : (..., Hq, T, Dv) np.ndarray
        Alone, or first in a tuple ``(out, weights, lse)`` keeping only what was requested.
    weights : (..., Hq, T, S) np.ndarray
        Each row is non-negative and sums to one (zero for fully masked rows); with
        ``sinks``, to less than one.
    lse : (..., Hq, T) np.ndarray
        ``log(sum(exp(scores)))`` per query; ``-inf`` for fully masked rows. With ``sinks``
        the sink's term is included, ``log(sum(exp(scores)) + exp(s_i))``, and a fully masked
        row has ``lse = s_i``. float32 for float16 inputs (as FlashAttention does), otherwise
        the dtype of ``out``.

    Raises
    ------
    TypeError
        For complex, object or masked-array (``numpy.ma``) inputs, an integer ``attn_mask``,
        a bool ``sinks``,
        a flag that is not a bool, an ``rng`` that is not a ``numpy.random.Generator``, or a
        missing ``rng`` with dropout.
    ValueError
        For inputs with fewer than 2 dimensions, mismatched ``Dk`` or ``S``, batch or mask
        shapes that do not broadcast, head counts that do not divide, a bad ``window``,
        ``causal_alignment``, ``dropout_p`` or ``implementation``, ``sinks`` that do not
        broadcast to ``(..., Hq, T)`` or hold NaN or ``+inf``, for
        ``implementation="tiled"`` together with ``return_weights`` or dropout, for a float
        mask holding NaN, ``+inf`` or a value beyond the working dtype's range, and for scores
        that overflow the working dtype (see Notes).
    MemoryError
        When the reference path's ``(..., T, S)`` scores and weights would not fit in the
        available memory (estimated before anything is allocated).

    Notes
    -----
    For one query row :math:`q_i` the result is

    .. math:: o_i = \sum_j \frac{e^{z_{ij}}}{\sum_{j'} e^{z_{ij'}}} v_j,
              \qquad z_{ij} = \text{scale}\; q_i \cdot k_j + b_{ij}.

    **Masks.** Boolean, causal and window masks *replace* disallowed scores by ``-inf``; float
    masks are *added*. A row in which every key is disallowed (including ``S = 0``) returns
    ``out = 0``, ``weights = 0`` and ``lse = -inf``, with no NaN and no warning, as PyTorch
    does since 2.5. A large finite bias (``np.finfo(dtype).min``, the Hugging Face convention,
    or ``-1e9``) is a bias like any other: a row whose every key carries it still gets a
    proper softmax over those keys, on both paths.

    **Attention sinks.** With ``sinks`` each row's softmax has one more logit ``s_i``, which
    attends to nothing (gpt-oss's learned per-head sinks; ``s_i = 0`` is the "softmax + 1"):

    .. math:: a_{ij} = \frac{e^{z_{ij}}}{\sum_{j'} e^{z_{ij'}} + e^{s_i}}, \qquad
              o_i = \sum_j a_{ij} v_j, \qquad
              \operatorname{lse}_i = \log\Big(\sum_j e^{z_{ij}} + e^{s_i}\Big).

    A query may thus attend to nothing much: its weights sum to ``1 - exp(s_i - lse_i)``. A
    row with no allowed key returns ``out = 0``, ``weights = 0`` and ``lse = s_i``.
    ``sinks = -inf`` is plain attention (on the reference path, bit for bit). Both paths take
    sinks: the tiled one adds ``exp(s_i - m_i)`` to each row's running normaliser at the
    end. Dropout acts on the keys' weights only, as in gpt-oss's reference code, where the
    sink's column is dropped before the dropout: the sink has no value, so dropping its
    weight would change nothing, and the kept weights are scaled by ``1 / (1 - dropout_p)``
    as without a sink.

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

    An attention sink per head (``(H, 1)``, broadcast over the queries) takes part of each
    row's weight; a sink of 0 on a row of equal scores over 3 keys leaves each key 1/4:

    >>> flat = np.zeros((2, 1, 3, 4))  # (B, H, T, Dk): every score is 0
    >>> w = scaled_dot_product_attention(
    ...     flat, flat, flat, sinks=np.zeros((1, 1)), return_weights=True
    ... )[1]
    >>> w[0, 0, 0]  # the first query's row: 1 / (3 + 1) each, the sink takes the rest
    array([0.25, 0.25, 0.25])
    >>> sinks = np.array([-1.0, 0.0, 1.0, 2.0])[:, None]  # (H, 1): one logit per head
    >>> w = scaled_dot_product_attention(q, k, v, sinks=sinks, return_weights=True)[1]
    >>> np.round(w.sum(-1).mean(axis=(0, 2)), 3)  # the larger the sink, the less on the keys
    array([0.958, 0.917, 0.749, 0.619])
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
        sinks=sinks,
    )
    threads = None  # implementation="tiled": all cores
    if implementation == "auto":
        auto = not return_weights and dropout_p == 0.0
        threads = auto_path(problem) if auto else 0  # 0: the reference path
    if implementation == "tiled" or threads:
        out, lse = attention_tiled(problem, num_threads=threads)
        weights = None
    else:
        out, weights, lse = attention_reference(problem, dropout_p, rng)
    return problem.finish(out, weights if return_weights else None, lse if return_lse else None)
