r"""A two-level memory that counts words moved, and attention algorithms that run on it.

FlashAttention's argument is about memory traffic, not arithmetic: a GPU computes far faster
than it can read its high-bandwidth memory (HBM), so an algorithm's cost is the number of words
it moves between that slow memory and the small on-chip SRAM. This module makes the argument
executable with the machine of the FlashAttention paper's analysis:

* **slow memory** is unbounded: here, ordinary NumPy arrays;
* **fast memory** holds at most ``M`` words (``capacity``): a :class:`TwoLevelMemory` keeps
  every array an algorithm has placed there under a name, and raises
  :class:`FastMemoryOverflow` the moment the named arrays would exceed ``M`` words;
* a **load** copies words from slow to fast memory and a **store** copies them back; both are
  counted, one word per array element. Arithmetic on arrays in fast memory is free, and is
  assumed to be done in place: only the arrays an algorithm names take space.

Three algorithms run on it, each computing the real attention output (so a test can check that
the simulated algorithm is attention) while the memory counts what it moved:

* :func:`textbook_attention_io`, the paper's Algorithm 0 ("standard attention"): the scores go
  to slow memory, the softmax reads them back and writes the weights, ``P V`` reads those;
* :func:`flash_attention_io`, FlashAttention's Algorithm 1: the outer loop over key/value
  blocks, the inner loop over query blocks, which read and write their output, ``l`` and ``m``
  at every step;
* :func:`flash_attention2_io`, the loop order of FlashAttention-2 (and of
  :func:`sdpa.blocked_attention`): the outer loop over query blocks, whose output and running
  statistics stay in fast memory until the block is finished.

With ``N`` queries and keys and width ``d``, the first moves :math:`\Theta(N d + N^2)` words and
the other two :math:`\Theta(N^2 d^2 / M)` (FlashAttention, Theorem 2), for
:math:`d \le M \le N d`. The functions' Notes derive the exact counts.

**Causal attention.** With ``is_causal=True`` (query ``i`` attends the keys ``j <= i``, aligned
top left) the two blocked algorithms skip every tile entirely above the diagonal, with the
loads and stores it would have cost, and mask inside the tiles the diagonal crosses, as
:func:`sdpa.blocked_attention` does. For ``T = S = N`` their quadratic term halves as ``N``
grows.

**Block sizes.** The paper sets :math:`B_c = \lceil M / 4d \rceil` and
:math:`B_r = \min(\lceil M / 4d \rceil, d)`. Those sizes fit in :math:`O(M)` words, not in
``M``: the blocks of ``K`` and ``V`` alone take :math:`2 B_c d \ge M / 2`, and the blocks of
``Q``, ``O`` and the scores up to :math:`3M/4` more. On a machine that enforces ``M`` we keep
the rule's orders of magnitude and make the blocks fit: the block of the outer loop (the one
the analysis wants large) gets as many rows as fill half of fast memory, which is
:math:`\lfloor M / 4d \rfloor` for the key/value blocks of Algorithm 1; the inner block is the
largest size up to :math:`\min(\text{outer}, d)` whose working set, counted word by word,
still fits (:func:`flash_block_sizes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from numbers import Integral

import numpy as np
from numpy.typing import ArrayLike

from ._checks import check_bool, check_scale
from .blocked import _causal, _check_block, _check_matrix

__all__ = [
    "FastMemoryOverflow",
    "IOCount",
    "TwoLevelMemory",
    "flash_attention2_io",
    "flash_attention_io",
    "flash_block_sizes",
    "textbook_attention_io",
    "textbook_block_size",
]


class FastMemoryOverflow(MemoryError):
    """An algorithm asked fast memory to hold more words than its capacity ``M``.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa.iomodel import FastMemoryOverflow, TwoLevelMemory
    >>> memory = TwoLevelMemory(capacity=4)
    >>> try:
    ...     memory.load("x", np.zeros(5))
    ... except FastMemoryOverflow:
    ...     print("5 words do not fit in 4")
    5 words do not fit in 4
    """


class TwoLevelMemory:
    """Fast memory of ``capacity`` words in front of an unbounded slow memory.

    Slow memory is any NumPy array. An algorithm copies a part of one into fast memory with
    :meth:`load`, places a result it computed there with :meth:`hold`, copies a fast array
    back into slow memory with :meth:`store` and releases space with :meth:`free`. Every array
    in fast memory has a name; giving a name again replaces its array.

    Parameters
    ----------
    capacity : int
        ``M``, the number of words (array elements) fast memory can hold; positive.

    Attributes
    ----------
    capacity : int
        ``M``.
    loads, stores : int
        Words copied from slow to fast memory, and from fast to slow memory, so far.
    peak : int
        The most words fast memory has held at once.

    Raises
    ------
    TypeError
        If ``capacity`` is not an integer.
    ValueError
        If ``capacity`` is not positive.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa.iomodel import TwoLevelMemory
    >>> slow = np.arange(12.0).reshape(3, 4)
    >>> mem = TwoLevelMemory(capacity=10)
    >>> row = mem.load("row", slow[1])  # 4 words in
    >>> total = mem.hold("total", row.sum(keepdims=True))  # computed in fast memory: free
    >>> mem.store("total", slow[0, :1])  # 1 word out
    >>> mem.loads, mem.stores, mem.used, mem.peak
    (4, 1, 5, 5)
    >>> float(slow[0, 0])
    22.0

    Asking for more than ``M`` words raises:

    >>> mem.load("two rows", slow[1:])
    Traceback (most recent call last):
    ...
    sdpa.iomodel.FastMemoryOverflow: fast memory of 10 words cannot hold 'two rows' (8 words) ...
    """

    def __init__(self, capacity: int) -> None:
        if isinstance(capacity, (bool, np.bool_)) or not isinstance(capacity, Integral):
            raise TypeError(f"capacity must be a positive integer (words); got {capacity!r}")
        if capacity < 1:
            raise ValueError(f"capacity must be a positive integer (words); got {capacity!r}")
        self.capacity = int(capacity)
        self.loads = 0
        self.stores = 0
        self.peak = 0
        self._fast: dict[str, np.ndarray] = {}
        self._used = 0

    @property
    def used(self) -> int:
        """Words held in fast memory now."""
        return self._used

    @property
    def words_moved(self) -> int:
        """``loads + stores``: the traffic between the two memories."""
        return self.loads + self.stores

    def __contains__(self, name: str) -> bool:
        return name in self._fast

    def __getitem__(self, name: str) -> np.ndarray:
        return self._fast[self._check_name(name)]

    def _check_name(self, name) -> str:
        if not isinstance(name, str):
            raise TypeError(f"name must be a string; got {name!r}")
        if name not in self._fast:
            held = ", ".join(self._fast) or "nothing"
            raise ValueError(f"{name!r} is not in fast memory, which holds: {held}")
        return name

    def _place(self, name: str, value: np.ndarray) -> np.ndarray:
        if not isinstance(name, str):
            raise TypeError(f"name must be a string; got {name!r}")
        replaced = self._fast[name].size if name in self._fast else 0
        if self._used - replaced + value.size > self.capacity:
            others = ", ".join(f"{n}: {a.size}" for n, a in self._fast.items() if n != name)
            raise FastMemoryOverflow(
                f"fast memory of {self.capacity} words cannot hold {name!r} ({value.size} "
                f"words) beside the {self._used - replaced} words it holds already ({others})"
            )
        self._fast[name] = value
        self._used += value.size - replaced
        self.peak = max(self.peak, self._used)
        return value

    def load(self, name: str, source: ArrayLike) -> np.ndarray:
        """Copy ``source`` (a part of slow memory) into fast memory as ``name``; count its words.

        Returns the copy in fast memory: changing it does not change slow memory.
        """
        value = np.array(source, dtype=np.float64, copy=True)
        self._place(name, value)
        self.loads += value.size
        return value

    def hold(self, name: str, value: ArrayLike) -> np.ndarray:
        """Place ``value``, computed from arrays in fast memory, there as ``name``; no traffic.

        Returns the array held, which the algorithm may then update in place.
        """
        return self._place(name, np.array(value, dtype=np.float64, copy=True))

    def store(self, name: str, target: np.ndarray) -> None:
        """Copy the fast array ``name`` into ``target`` (a view of slow memory); count its words."""
        value = self._fast[self._check_name(name)]
        if not isinstance(target, np.ndarray) or target.shape != value.shape:
            shape = getattr(target, "shape", type(target).__name__)
            raise ValueError(
                f"target must be a NumPy array (a view of slow memory) of the shape of "
                f"{name!r}, {value.shape}; got {shape}"
            )
        target[...] = value
        self.stores += value.size

    def free(self, *names: str) -> None:
        """Release the named arrays' space; freeing a name that is not held is an error."""
        for name in names:
            self._used -= self._fast.pop(self._check_name(name)).size


@dataclass(frozen=True)
class IOCount:
    """What an algorithm moved on a :class:`TwoLevelMemory`, and what it computed.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa.iomodel import flash_attention_io
    >>> x = np.ones((8, 2))
    >>> count = flash_attention_io(x, x, x, capacity=64)
    >>> count.words == count.loads + count.stores
    True
    """

    algorithm: str
    out: np.ndarray  # (T, Dv), the attention output the algorithm computed
    loads: int
    stores: int
    peak: int  # most words in fast memory at once, at most the capacity
    block_q: int  # Br, query rows per block
    block_k: int  # Bc, keys per block

    @property
    def words(self) -> int:
        """``loads + stores``, the words moved between slow and fast memory."""
        return self.loads + self.stores


# --------------------------------------------------------------------------------------------
# Block sizes
# --------------------------------------------------------------------------------------------


def _check_capacity(capacity) -> int:
    if isinstance(capacity, (bool, np.bool_)) or not isinstance(capacity, Integral):
        raise TypeError(f"capacity must be a positive integer (words); got {capacity!r}")
    if capacity < 1:
        raise ValueError(f"capacity must be a positive integer (words); got {capacity!r}")
    return int(capacity)


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
    d = _check_block(d, "d")
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
    dk = _check_block(dk, "dk")
    dv = _check_block(dv, "dv")
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


# --------------------------------------------------------------------------------------------
# The algorithms
# --------------------------------------------------------------------------------------------


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
        else _check_block(block, "block")
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


def _flash_blocks(Dk, Dv, capacity, block_q, block_k, loop_order):
    default_q, default_k = flash_block_sizes(Dk, Dv, capacity, loop_order=loop_order)
    block_q = default_q if block_q is None else _check_block(block_q, "block_q")
    block_k = default_k if block_k is None else _check_block(block_k, "block_k")
    return block_q, block_k


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
