r"""Block sizes that fit a fast memory of ``M`` words, for the textbook and flash algorithms.

The paper's rule, :math:`B_c = \lceil M / 4d \rceil`, fits in :math:`O(M)` words only; these
sizes keep its orders of magnitude and fit in ``M`` (see :mod:`sdpa.iomodel`).
"""

from __future__ import annotations

import math

from .._checks import check_positive_int

__all__ = ["flash_block_sizes", "textbook_block_size"]


def _check_capacity(capacity) -> int:
    return check_positive_int(capacity, "capacity", unit="words")


def textbook_block_size(d: int, capacity: int) -> int:
    """The tile ``b`` of :func:`textbook_attention_io`: the largest with ``2 b d + b**2 <= M``.

    Computing a ``(b, b)`` tile of ``Q K^T`` needs ``b`` rows of ``Q`` and of ``K`` (``d``
    words each) and the tile itself; the output phase needs the same amount.

    Parameters
    ----------
    d : int
        Head width, positive.
    capacity : int
        Words of fast memory ``M``.

    Returns
    -------
    int
        The tile size ``b``.

    Examples
    --------
    >>> from sdpa.iomodel import textbook_block_size
    >>> textbook_block_size(d=2, capacity=32)  # 2*4*2 + 4*4 = 32
    4
    """
    d = check_positive_int(d, "d")
    capacity = _check_capacity(capacity)
    b = math.isqrt(d * d + capacity) - d  # the positive root of b**2 + 2 d b - M, rounded down
    if b < 1:
        raise ValueError(
            f"capacity must hold one row of Q, one of K and a score, 2 d + 1 = {2 * d + 1} "
            f"words for d = {d}; got capacity={capacity}"
        )
    return b


def flash_block_sizes(dk: int, dv: int, capacity: int, *, loop_order: str) -> tuple[int, int]:
    r"""Block sizes ``(Br, Bc)`` for the blocked algorithms on fast memory of ``M`` words.

    Parameters
    ----------
    dk, dv : int
        Query/key and value widths; ``d = max(dk, dv)`` in the rule below.
    capacity : int
        ``M``.
    loop_order : {"kv_outer", "q_outer"}
        FlashAttention's Algorithm 1 (key/value blocks outside) or FlashAttention-2's order.

    Returns
    -------
    (block_q, block_k) : tuple of int
        ``Br`` and ``Bc``.

    Raises
    ------
    ValueError
        For an unknown ``loop_order``, or if not even blocks of one row fit in ``M`` words.

    Notes
    -----
    The outer loop's block is the one the analysis wants large, because the inner loop
    re-reads everything else once per outer block. It gets as many rows as fill half of fast
    memory with what it keeps there: :math:`B_c = \lfloor M / 2 (D_k + D_v) \rfloor` (that is
    :math:`\lfloor M / 4d \rfloor` when :math:`D_k = D_v = d`, the paper's rule) for the key
    and value blocks of ``"kv_outer"``; :math:`B_r = \lfloor M / 2 (D_k + D_v + 4) \rfloor` for
    ``"q_outer"``, whose query block also keeps four vectors of statistics. The inner block
    is then the largest size up to :math:`\min(\text{outer}, d)` whose working set fits:

    * ``"kv_outer"`` holds :math:`B_c (D_k + D_v) + B_r (D_k + D_v + 6) + B_r B_c` words
      (``K_j``, ``V_j``; ``Q_i``, ``O_i`` and six vectors of ``B_r``: ``l_i``, ``m_i``, the
      block's row maxima and sums, the new ``m`` and ``l``; the scores, overwritten by
      ``exp``);
    * ``"q_outer"`` holds :math:`B_r (D_k + D_v + 4) + B_c (D_k + D_v) + B_r B_c` words
      (``Q_i``, ``O_i``, ``l``, ``m``, the new maxima and the rescaling factors; ``K_j``,
      ``V_j``; the scores).

    These block sizes ignore ``T`` and ``S``; the algorithms cut them to the problem.

    Examples
    --------
    >>> from sdpa.iomodel import flash_block_sizes
    >>> flash_block_sizes(16, 16, 4096, loop_order="kv_outer")  # Bc = 4096 // 64
    (16, 64)
    >>> flash_block_sizes(16, 16, 4096, loop_order="q_outer")  # Br = 4096 // 72
    (56, 16)
    """
    if loop_order not in ("kv_outer", "q_outer"):
        raise ValueError(f"loop_order must be 'kv_outer' or 'q_outer'; got {loop_order!r}")
    dk = check_positive_int(dk, "dk")
    dv = check_positive_int(dv, "dv")
    capacity = _check_capacity(capacity)
    d, width = max(dk, dv), dk + dv
    extra = 6 if loop_order == "kv_outer" else 4  # vectors of the query block's length
    outer = capacity // (2 * (width if loop_order == "kv_outer" else width + extra))
    inner = 0
    for size in range(min(outer, d), 0, -1):
        br, bc = (size, outer) if loop_order == "kv_outer" else (outer, size)
        if bc * width + br * (width + extra) + br * bc <= capacity:
            inner = size
            break
    if outer < 1 or inner < 1:
        raise ValueError(
            f"capacity={capacity} words cannot hold blocks of one row of widths dk={dk} and "
            f"dv={dv} with their running statistics"
        )
    return (inner, outer) if loop_order == "kv_outer" else (outer, inner)


def _flash_blocks(Dk, Dv, capacity, block_q, block_k, loop_order):
    """The flash algorithms' ``(block_q, block_k)``: those given, else flash_block_sizes'."""
    default_q, default_k = flash_block_sizes(Dk, Dv, capacity, loop_order=loop_order)
    block_q = default_q if block_q is None else check_positive_int(block_q, "block_q")
    block_k = default_k if block_k is None else check_positive_int(block_k, "block_k")
    return block_q, block_k
