"""Attention run on the two-level memory: the textbook algorithm and FlashAttention 1 and 2.

Each computes the real attention output while the memory counts the words it moved; the
Notes of each function derive the exact counts (see :mod:`sdpa.iomodel` for the model).
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike

from .._checks import check_bool, check_positive_int, check_scale
from ..blocked import _causal, _check_matrix
from .block_sizes import _check_capacity, _flash_blocks, textbook_block_size
from .machine import IOCount, TwoLevelMemory

__all__ = ["flash_attention2_io", "flash_attention_io", "textbook_attention_io"]


def _prepare(q, k, v, scale):
    q = _check_matrix(q, "q", "(T, Dk)").astype(np.float64)
    k = _check_matrix(k, "k", "(S, Dk)").astype(np.float64)
    v = _check_matrix(v, "v", "(S, Dv)").astype(np.float64)
    if q.shape[1] != k.shape[1]:
        raise ValueError(
            f"q and k must share the last dimension Dk; got q.shape={q.shape}, k.shape={k.shape}"
        )
    if k.shape[0] != v.shape[0] or k.shape[0] == 0:
        raise ValueError(
            f"k and v must have the same number of rows S >= 1; got k.shape={k.shape}, "
            f"v.shape={v.shape}"
        )
    if q.shape[1] == 0 or v.shape[1] == 0:
        raise ValueError(
            f"the widths Dk and Dv must be positive; got q.shape={q.shape}, v.shape={v.shape}"
        )
    return q, k, v, check_scale(scale, q.shape[1])


def _blocks(n: int, size: int):
    """``(start, stop)`` of the blocks of ``size`` that cover ``range(n)``."""
    return [(start, min(start + size, n)) for start in range(0, n, size)]


def textbook_attention_io(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    *,
    capacity: int,
    block: int | None = None,
    scale: float | None = None,
) -> IOCount:
    r"""Standard attention (FlashAttention's Algorithm 0) on fast memory of ``M`` words.

    Three passes, each through slow memory: the scores ``scale * Q K^T`` are computed in
    ``(b, b)`` tiles and written out; the softmax reads them back a few rows at a time and
    writes the weights ``P``; the output reads ``P`` and ``V`` in tiles and writes ``O``.

    Parameters
    ----------
    q, k, v : array_like
        ``(T, Dk)``, ``(S, Dk)``, ``(S, Dv)``, with ``S, Dk, Dv >= 1``.
    capacity : int
        ``M``, the words of fast memory.
    block : int, optional
        The tile ``b``; default :func:`textbook_block_size` of ``d = max(Dk, Dv)``.
    scale : float, optional
        Default ``1 / sqrt(Dk)``.

    Returns
    -------
    IOCount
        The output and the words moved; ``block_q == block_k == b``.

    Raises
    ------
    FastMemoryOverflow
        If a given ``block`` does not fit.
    TypeError, ValueError
        For arguments of the wrong kind, shape or value.

    Notes
    -----
    With :math:`r = \lceil T / b \rceil` blocks of queries, count the words of each pass:

    1. scores: every query row is loaded once (:math:`T D_k`), every key row once per query
       block (:math:`r S D_k`), and every score is stored (:math:`T S`);
    2. softmax: if a row of scores fits (:math:`S \le M`), as many rows as fit are loaded,
       normalised in place and stored: :math:`T S` loads and :math:`T S` stores. Otherwise
       each row is streamed three times in chunks of :math:`M - 2` words (its maximum, its
       sum, then the weights): :math:`3 T S` loads and :math:`T S` stores;
    3. output: every weight is loaded once (:math:`T S`), every value row once per query
       block (:math:`r S D_v`), and the output stored (:math:`T D_v`).

    .. math::
        \text{loads} = T D_k + r S (D_k + D_v) + 2 T S \;(\text{or } 4 T S), \qquad
        \text{stores} = 2 T S + T D_v .

    With :math:`T = S = N`, :math:`D_k = D_v = d` and ``b`` dividing ``N``: :math:`4 N^2 +
    2 N d + 2 N^2 d / b` words, which is :math:`\Theta(N^2 + N d)` once :math:`b \ge d`, that
    is :math:`M \ge 3 d^2`. Hand-checked case: ``N = 8``, ``d = 2``, ``M = 32`` gives ``b = 4``
    and 208 loads (16 + 2 * 8 * 4 + 128) and 144 stores (128 + 16).

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa.iomodel import textbook_attention_io
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((8, 2)) for _ in range(3))
    >>> count = textbook_attention_io(q, k, v, capacity=32)
    >>> count.block_q, count.loads, count.stores, count.peak
    (4, 208, 144, 32)
    """
    q, k, v, scale = _prepare(q, k, v, scale)
    capacity = _check_capacity(capacity)
    (T, Dk), (S, Dv) = q.shape, v.shape
    b = (
        textbook_block_size(max(Dk, Dv), capacity)
        if block is None
        else check_positive_int(block, "block")
    )
    mem = TwoLevelMemory(capacity)
    scores = np.empty((T, S))  # slow memory
    weights = np.empty((T, S))
    out = np.empty((T, Dv))

    for t0, t1 in _blocks(T, b):  # 1. scores, tile by tile
        q_i = mem.load("q_i", q[t0:t1])
        for s0, s1 in _blocks(S, b):
            k_j = mem.load("k_j", k[s0:s1])
            mem.hold("scores_ij", scale * (q_i @ k_j.T))
            mem.store("scores_ij", scores[t0:t1, s0:s1])
            mem.free("k_j", "scores_ij")
        mem.free("q_i")

    rows = min(capacity // S, T)
    if rows >= 1:  # 2. softmax, whole rows at a time
        for r0, r1 in _blocks(T, rows):
            x = mem.load("rows", scores[r0:r1])
            x -= x.max(axis=1, keepdims=True)
            np.exp(x, out=x)
            x /= x.sum(axis=1, keepdims=True)
            mem.store("rows", weights[r0:r1])
            mem.free("rows")
    else:  # a row does not fit: three streamed passes per row
        chunk = capacity - 2
        for r in range(T):
            m = mem.hold("m", [-np.inf])
            l = mem.hold("l", [0.0])
            for c0, c1 in _blocks(S, chunk):
                m[0] = max(m[0], mem.load("chunk", scores[r, c0:c1]).max())
                mem.free("chunk")
            for c0, c1 in _blocks(S, chunk):
                l[0] += np.exp(mem.load("chunk", scores[r, c0:c1]) - m[0]).sum()
                mem.free("chunk")
            for c0, c1 in _blocks(S, chunk):
                x = mem.load("chunk", scores[r, c0:c1])
                x[...] = np.exp(x - m[0]) / l[0]
                mem.store("chunk", weights[r, c0:c1])
                mem.free("chunk")
            mem.free("m", "l")

    for t0, t1 in _blocks(T, b):  # 3. out = P V, tile by tile
        o_i = mem.hold("o_i", np.zeros((t1 - t0, Dv)))
        for s0, s1 in _blocks(S, b):
            p_ij = mem.load("p_ij", weights[t0:t1, s0:s1])
            v_j = mem.load("v_j", v[s0:s1])
            o_i += p_ij @ v_j
            mem.free("p_ij", "v_j")
        mem.store("o_i", out[t0:t1])
        mem.free("o_i")
    return IOCount("textbook", out, mem.loads, mem.stores, mem.peak, b, b)


def flash_attention_io(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    *,
    capacity: int,
    block_q: int | None = None,
    block_k: int | None = None,
    scale: float | None = None,
    is_causal: bool = False,
) -> IOCount:
    r"""FlashAttention's Algorithm 1 on fast memory of ``M`` words.

    The outer loop loads one block of keys and values; the inner loop visits every query
    block, loading its queries, its partial output ``O_i`` and its statistics ``l_i``,
    ``m_i``, updating them with the block's scores and writing all three back. Causal, the
    inner loop skips the query blocks that end before the key block starts, and the key
    blocks after the last query are not loaded at all.

    Parameters
    ----------
    q, k, v : array_like
        ``(T, Dk)``, ``(S, Dk)``, ``(S, Dv)``, with ``S, Dk, Dv >= 1``.
    capacity : int
        ``M``, the words of fast memory.
    block_q, block_k : int, optional
        ``Br`` and ``Bc``; default :func:`flash_block_sizes` with ``loop_order="kv_outer"``.
    scale : float, optional
        Default ``1 / sqrt(Dk)``.
    is_causal : bool, default False
        Query ``i`` attends only the keys ``j <= i`` (top-left alignment); the tiles above the
        diagonal are skipped.

    Returns
    -------
    IOCount
        The words loaded and stored, the peak of fast memory, and the output computed.

    Raises
    ------
    FastMemoryOverflow
        If given block sizes do not fit.
    TypeError, ValueError
        For arguments of the wrong kind, shape or value, or a capacity too small for any
        block.

    Notes
    -----
    With :math:`c = \lceil S / B_c \rceil` key blocks: the algorithm first writes the initial
    ``O = 0``, ``l = 0``, ``m = -inf`` to slow memory (:math:`T (D_v + 2)` stores); it loads
    every key and value row once (:math:`S (D_k + D_v)`); and for each of the ``c`` key blocks
    it loads all of ``Q``, ``O``, ``l``, ``m`` (:math:`T (D_k + D_v + 2)`) and stores ``O``,
    ``l``, ``m`` (:math:`T (D_v + 2)`):

    .. math::
        \text{loads} = S (D_k + D_v) + c\, T (D_k + D_v + 2), \qquad
        \text{stores} = (c + 1)\, T (D_v + 2).

    ``Br`` does not appear: it only has to fit. With :math:`T = S = N`, :math:`D_k = D_v = d`
    and :math:`B_c = M / 4d` dividing ``N``, the words moved are about
    :math:`3 N d \cdot N / B_c = 12 N^2 d^2 / M`. Hand-checked case: ``N = 8``, ``d = 2``,
    ``M = 64`` gives ``Bc = 64 // 8 = 8`` (one key block, ``c = 1``) and ``Br = 1`` (with
    ``Br = 2`` the working set would be ``32 + 20 + 16 = 68`` words); loads
    ``8 * 4 + 8 * 6 = 80`` and stores ``2 * 8 * 4 = 64``.

    **Causal.** Key block ``j``, its keys from :math:`s_j`, is loaded only if
    :math:`s_j < T`, and then meets only the query blocks whose last query is at least
    :math:`s_j`: the :math:`T - \lfloor s_j / B_r \rfloor B_r` rows from the block that
    holds query :math:`s_j` on. Each of those rows is loaded (:math:`D_k + D_v + 2` words) and
    stored (:math:`D_v + 2`) once for the key block:

    .. math::
        \text{loads} = \sum_{j:\, s_j < T} \bigl(|K_j| (D_k + D_v)
            + (T - \lfloor s_j / B_r \rfloor B_r) (D_k + D_v + 2)\bigr), \qquad
        \text{stores} = T (D_v + 2)
            + \sum_{j:\, s_j < T} (T - \lfloor s_j / B_r \rfloor B_r) (D_v + 2).

    For :math:`T = S = N` and blocks that divide it, the rows met sum to about
    :math:`N^2 / 2 B_c`, half of the :math:`c N = N^2 / B_c` without the mask.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa import scaled_dot_product_attention
    >>> from sdpa.iomodel import flash_attention_io
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((8, 2)) for _ in range(3))
    >>> count = flash_attention_io(q, k, v, capacity=64)
    >>> (count.block_q, count.block_k), count.loads, count.stores
    ((1, 8), 80, 64)
    >>> bool(np.allclose(count.out, scaled_dot_product_attention(q, k, v)))
    True

    Causal, in blocks of 4 keys and 2 queries: the second key block (keys 4 to 7) meets only
    the query blocks from query 4 on, 4 rows instead of 8 (without the mask, 128 loads and
    96 stores):

    >>> causal = flash_attention_io(q, k, v, capacity=64, block_q=2, block_k=4, is_causal=True)
    >>> causal.loads, causal.stores  # 16 + 8*6 + 16 + 4*6 and 8*4 + 8*4 + 4*4
    (104, 80)
    >>> bool(np.allclose(causal.out, scaled_dot_product_attention(q, k, v, is_causal=True)))
    True
    """
    q, k, v, scale = _prepare(q, k, v, scale)
    is_causal = check_bool(is_causal, "is_causal")
    capacity = _check_capacity(capacity)
    (T, Dk), (S, Dv) = q.shape, v.shape
    Br, Bc = _flash_blocks(Dk, Dv, capacity, block_q, block_k, "kv_outer")
    mem = TwoLevelMemory(capacity)
    out, l, m = np.empty((T, Dv)), np.empty(T), np.empty(T)  # slow memory

    for t0, t1 in _blocks(T, Br):  # line 2: O = 0, l = 0, m = -inf, written to slow memory
        mem.hold("o_i", np.zeros((t1 - t0, Dv)))
        mem.hold("l_i", np.zeros(t1 - t0))
        mem.hold("m_i", np.full(t1 - t0, -np.inf))
        mem.store("o_i", out[t0:t1])
        mem.store("l_i", l[t0:t1])
        mem.store("m_i", m[t0:t1])
        mem.free("o_i", "l_i", "m_i")

    for s0, s1 in _blocks(S, Bc):  # outer loop: key/value blocks
        if is_causal and s0 > T - 1:
            break  # keys after the last query: no query sees them
        k_j = mem.load("k_j", k[s0:s1])
        v_j = mem.load("v_j", v[s0:s1])
        for t0, t1 in _blocks(T, Br):  # inner loop: every query block, read and written back
            if is_causal and t1 - 1 < s0:
                continue  # the tile lies above the diagonal: skipped, nothing moves
            q_i = mem.load("q_i", q[t0:t1])
            o_i = mem.load("o_i", out[t0:t1])
            l_i = mem.load("l_i", l[t0:t1])
            m_i = mem.load("m_i", m[t0:t1])
            p = mem.hold("scores_ij", scale * (q_i @ k_j.T))  # (Br, Bc)
            if is_causal:  # the diagonal may cross the tile: -inf for keys after their query
                p[~_causal(t0, s0, p.shape)] = -np.inf
            m_tilde = mem.hold("m_tilde", p.max(axis=1))
            # P~, in place of the scores; a row the tile masks whole (m~ = -inf) gets zeros
            np.exp(p - np.where(np.isfinite(m_tilde), m_tilde, 0.0)[:, None], out=p)
            l_tilde = mem.hold("l_tilde", p.sum(axis=1))
            m_new = mem.hold("m_new", np.maximum(m_i, m_tilde))
            old, new = np.exp(m_i - m_new), np.exp(m_tilde - m_new)
            l_new = mem.hold("l_new", old * l_i + new * l_tilde)
            o_i[...] = ((l_i * old)[:, None] * o_i + new[:, None] * (p @ v_j)) / l_new[:, None]
            mem.store("o_i", out[t0:t1])
            mem.store("l_new", l[t0:t1])
            mem.store("m_new", m[t0:t1])
            mem.free(
                "q_i", "o_i", "l_i", "m_i", "scores_ij", "m_tilde", "l_tilde", "m_new", "l_new"
            )
        mem.free("k_j", "v_j")
    return IOCount("FlashAttention", out, mem.loads, mem.stores, mem.peak, Br, Bc)


def flash_attention2_io(
    q: ArrayLike,
    k: ArrayLike,
    v: ArrayLike,
    *,
    capacity: int,
    block_q: int | None = None,
    block_k: int | None = None,
    scale: float | None = None,
    is_causal: bool = False,
) -> IOCount:
    r"""FlashAttention-2's loop order on fast memory of ``M`` words.

    The outer loop loads one block of queries and keeps its output accumulator and running
    statistics in fast memory; the inner loop streams every key/value block past it. The
    output is divided by ``l`` once and written once, with the log-sum-exp. This is the loop
    of :func:`sdpa.blocked_attention`; causal, the inner loop stops after the key block that
    holds the query block's last query, as there.

    Parameters
    ----------
    q, k, v : array_like
        ``(T, Dk)``, ``(S, Dk)``, ``(S, Dv)``, with ``S, Dk, Dv >= 1``.
    capacity : int
        ``M``, the words of fast memory.
    block_q, block_k : int, optional
        ``Br`` and ``Bc``; default :func:`flash_block_sizes` with ``loop_order="q_outer"``.
    scale : float, optional
        Default ``1 / sqrt(Dk)``.
    is_causal : bool, default False
        Query ``i`` attends only the keys ``j <= i`` (top-left alignment); the tiles above the
        diagonal are skipped.

    Returns
    -------
    IOCount
        The words loaded and stored, the peak of fast memory, and the output computed.

    Raises
    ------
    FastMemoryOverflow
        If given block sizes do not fit.
    TypeError, ValueError
        For arguments of the wrong kind, shape or value, or a capacity too small for any
        block.

    Notes
    -----
    With :math:`r = \lceil T / B_r \rceil` query blocks: every query row is loaded once
    (:math:`T D_k`), every key and value row once per query block (:math:`r S (D_k + D_v)`),
    and the output and log-sum-exp are stored once (:math:`T (D_v + 1)`):

    .. math::
        \text{loads} = T D_k + r\, S (D_k + D_v), \qquad \text{stores} = T (D_v + 1).

    ``Bc`` does not appear. With :math:`T = S = N`, :math:`D_k = D_v = d` and
    :math:`B_r = M / 4d` dividing ``N``: :math:`2 N d + N + 8 N^2 d^2 / M` words, two thirds of
    Algorithm 1's leading term, because ``O``, ``l`` and ``m`` never leave fast memory before
    they are final. Hand-checked case: ``N = 8``, ``d = 2``, ``M = 64`` gives
    ``Br = 64 // 16 = 4`` (``r = 2``) and ``Bc = 2`` (``32 + 8 + 8 = 48`` words); loads
    ``16 + 2 * 8 * 4 = 80`` and stores ``8 * 3 = 24``.

    **Causal.** Query block ``i``, its last query :math:`t_i - 1`, loads the key blocks that
    start at or before it: the first :math:`\min(S, \lceil t_i / B_c \rceil B_c)` keys and
    values. The stores do not change:

    .. math::
        \text{loads} = T D_k + (D_k + D_v) \sum_i \min(S, \lceil t_i / B_c \rceil B_c),
        \qquad \text{stores} = T (D_v + 1).

    For :math:`T = S = N` and blocks that divide it, the sum is about :math:`N^2 / 2 B_r`,
    half of the :math:`r N = N^2 / B_r` without the mask; in the hand-checked case, query
    block 1 loads keys 0 to 3 and block 2 all eight: ``16 + 4 * (4 + 8) = 64`` loads.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa import scaled_dot_product_attention
    >>> from sdpa.iomodel import flash_attention2_io
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((8, 2)) for _ in range(3))
    >>> count = flash_attention2_io(q, k, v, capacity=64)
    >>> (count.block_q, count.block_k), count.loads, count.stores
    ((4, 2), 80, 24)
    >>> bool(np.allclose(count.out, scaled_dot_product_attention(q, k, v)))
    True
    >>> causal = flash_attention2_io(q, k, v, capacity=64, is_causal=True)
    >>> causal.loads, causal.stores
    (64, 24)
    """
    q, k, v, scale = _prepare(q, k, v, scale)
    is_causal = check_bool(is_causal, "is_causal")
    capacity = _check_capacity(capacity)
    (T, Dk), (S, Dv) = q.shape, v.shape
    Br, Bc = _flash_blocks(Dk, Dv, capacity, block_q, block_k, "q_outer")
    mem = TwoLevelMemory(capacity)
    out, lse = np.empty((T, Dv)), np.empty(T)  # slow memory

    for t0, t1 in _blocks(T, Br):  # outer loop: query blocks, finished one at a time
        q_i = mem.load("q_i", q[t0:t1])
        o_i = mem.hold("o_i", np.zeros((t1 - t0, Dv)))
        l_i = mem.hold("l_i", np.zeros(t1 - t0))
        m_i = mem.hold("m_i", np.full(t1 - t0, -np.inf))
        for s0, s1 in _blocks(S, Bc):  # inner loop: every key/value block streams past
            if is_causal and s0 > t1 - 1:
                break  # this tile and the rest of the row lie above the diagonal: skipped
            k_j = mem.load("k_j", k[s0:s1])
            v_j = mem.load("v_j", v[s0:s1])
            p = mem.hold("scores_ij", scale * (q_i @ k_j.T))  # (Br, Bc)
            if is_causal:  # the diagonal may cross the tile: -inf for keys after their query
                p[~_causal(t0, s0, p.shape)] = -np.inf
            m_new = mem.hold("m_new", np.maximum(m_i, p.max(axis=1)))
            np.exp(p - m_new[:, None], out=p)
            alpha = mem.hold("alpha", np.exp(m_i - m_new))
            l_i[...] = alpha * l_i + p.sum(axis=1)
            o_i[...] = alpha[:, None] * o_i + p @ v_j
            m_i[...] = m_new
            mem.free("k_j", "v_j", "scores_ij", "m_new", "alpha")
        o_i /= l_i[:, None]  # normalised once
        m_i += np.log(l_i)  # m_i now holds the log-sum-exp
        mem.store("o_i", out[t0:t1])
        mem.store("m_i", lse[t0:t1])
        mem.free("q_i", "o_i", "l_i", "m_i")
    return IOCount("FlashAttention-2", out, mem.loads, mem.stores, mem.peak, Br, Bc)
