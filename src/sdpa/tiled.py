r"""Memory-efficient attention: the forward pass of FlashAttention-2, in NumPy.

The textbook formula materialises the ``(T, S)`` scores of every head. This module never does:
it cuts the queries into blocks of ``Bq`` rows and the keys into blocks of ``Bk`` columns and,
for one query block at a time, walks along its row of key blocks keeping only three small
running quantities per query row (the *online softmax* of Milakov and Gimelshein, 2018, in
the arrangement of Dao's FlashAttention-2):

* ``m``, the largest score seen so far;
* ``l``, the sum of ``exp(score - m)`` over the keys seen so far;
* ``acc``, the sum of ``exp(score - m) * v`` over the keys seen so far.

When a new block raises the maximum from ``m`` to ``m_new``, the old sums are rescaled by
``alpha = exp(m - m_new)``; after the last block ``out = acc / l`` and ``lse = m + log(l)``.
An attention sink ``s`` (a logit with no value) is one more term of the normaliser, added at
the end like one more block: ``l = alpha l + exp(s - m_new)`` with ``m_new = max(m, s)``.
The result equals the formula up to rounding, and the extra memory is a few tiles per worker
thread instead of ``T * S`` numbers per head.

What matters for speed on a CPU, where every NumPy call is a full pass over a tile (the
tunables are in :mod:`sdpa.tuning`, each with the measurement that chose it):

* the shift ``m`` is moved lazily: a row keeps its shift while no term ``exp(score - m)`` can
  exceed ``exp(LAZY_MARGIN)``, which the tile's row sums prove. Then nothing overflows, so the
  result is exact to rounding although ``m`` may lag behind the true maximum; only a tile that
  breaks the bound is recomputed with a new shift (the classical rescaling). Without a mask or
  a bias every row starts at ``m = 0``: exact unless the row's scores all lie more than
  ``LAZY_MARGIN`` below zero, which its sum ``l`` shows after the first tile or at the end
  (the unit is then redone from the exact step). Most tiles thus cost two matrix products, one
  exponential and one matrix-vector product for the row sums (``p @ 1``, cheaper than a
  column of ones on the values, which widens the second product past BLAS's panel width): no
  pass for the row maximum, none for the subtraction, no rescaling of ``acc``;
* once a shift has moved, it is folded into the first product, ``[q * scale | -m] @ [k | 1]^T``
  (the unit's keys are then copied once, with a column of ones);
* exactness whatever the bias: the rescaling step works on the raw scores (nothing folded in,
  rounded as the reference path rounds them, in base e: base 2 is used only without a bias),
  and a shift is folded in only while ``|m| <= FOLD_LIMIT``. A row whose scores are dominated
  by a huge bias (a float mask of ``finfo.min`` or ``-1e9``, as padding masks are often
  written) subtracts its shift after the product instead, since ``fl(q.k - m)`` would round
  ``q.k`` away;
* exactness whatever the values' size: a result that overflowed, or came out near the smallest
  normal numbers, is computed again on values scaled by a power of two per column (exact);
* the exponential is ``exp2`` on scores in base 2 (the query's scale times ``log2(e)``) where
  NumPy computes ``exp2`` with SVML (:func:`sdpa.tuning.tile_exponential`), except with a
  float bias;
* blocks entirely outside a causal or sliding-window band are never visited, and blocks
  entirely inside it are not masked; only the blocks the band's edge crosses are masked;
* independent work units (one query block of one head, with the query rows of all heads that
  share a key/value head folded in, so each key tile is loaded once for the whole group) are
  shared out among threads started for the call (:func:`sdpa.threads.run_in_threads`), with
  BLAS held to one thread: NumPy releases the GIL inside matrix products and ufunc loops, so
  the threads run in parallel, and BLAS's own threading parallelises each small product badly.
  What a unit computes depends on its inputs alone, so the bits do not depend on the threads.

Shape letters: ``T`` queries, ``S`` keys, ``Dk``/``Dv`` head widths, ``Bq``/``Bk`` tile sizes,
``G`` query heads folded into the rows of one tile: the heads of a group under grouped-query
attention, or of any batch axis along which the keys and values do not vary.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ._checks import (
    check_alignment,
    check_bool,
    check_nonneg_int,
    check_positive_int,
    check_window,
)
from .masks import alignment_offset, band_limits
from .problem import AttentionProblem, check_overflow, mark_poisoned
from .threads import default_num_threads, run_in_threads, single_threaded_blas
from .tuning import (
    BLOCK_K,
    BLOCK_ROWS,
    BLOCK_ROWS_FULL,
    FOLD_LIMIT,
    LAZY_MARGIN,
    VALUE_FLOOR_BITS,
    tile_exponential,
)

__all__ = ["TileStats", "attention_tiled", "tile_map"]

SKIPPED, PARTIAL, FULL = 0, 1, 2  # what the band does to a tile
_EVERY_KEY = object()  # a tile whose every score the user's boolean mask disallows

# A tile is accepted by the lazy step when every row sum of exp(scores - m) is at most
# LAZY_BOUND, which bounds each term; a row that starts at m = 0 must end with l >= LAZY_FLOOR.
LAZY_BOUND = float(np.exp(LAZY_MARGIN))
LAZY_FLOOR = float(np.exp(-LAZY_MARGIN))


@dataclass
class TileStats:
    """Counters of the work :func:`attention_tiled` did, filled when passed as ``stats``.

    The counts add up over calls, so one ``TileStats`` can total several.

    Attributes
    ----------
    units : int
        Work units run: one block of query rows of one head (with the heads that share its
        keys folded in).
    computed : int
        Tiles whose scores were computed.
    rescaled : int
        Computed tiles that moved the shift ``m`` (with a mask or a bias, each unit's first
        tile, at least).
    skipped_band : int
        Tiles never visited: entirely outside the causal/window band.
    skipped_mask : int
        Tiles dropped because the boolean mask disallows all of them.
    redone : int
        Work units walked a second time, from the exact step, because a row's scores all lay
        too far below the shift ``m = 0`` that units without a mask or a bias start from.
    retried : int
        Computed tiles whose lazy step broke the bound and were computed again by the exact
        step (counted once in ``computed``).

    Examples
    --------
    >>> from sdpa.tiled import TileStats
    >>> TileStats()
    TileStats(units=0, computed=0, rescaled=0, skipped_band=0, skipped_mask=0, redone=0, retried=0)
    """

    units: int = 0
    computed: int = 0
    rescaled: int = 0
    skipped_band: int = 0
    skipped_mask: int = 0
    redone: int = 0
    retried: int = 0

    def add(self, other: TileStats) -> None:
        """Add the counts of ``other`` to these.

        Parameters
        ----------
        other : TileStats
            The counts to add (for example one worker thread's).

        Examples
        --------
        >>> from sdpa.tiled import TileStats
        >>> total = TileStats(units=2, computed=5)
        >>> total.add(TileStats(units=1, computed=3, rescaled=1))
        >>> total.units, total.computed, total.rescaled
        (3, 8, 1)
        """
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))


def _tile_kind(t0: int, t1: int, s0: int, s1: int, offset: int, lo, hi) -> int:
    """Classify the tile of queries ``t0:t1`` and keys ``s0:s1`` against the band."""
    d_min = s0 - (t1 - 1 + offset)  # smallest j - (i + o) in the tile
    d_max = (s1 - 1) - (t0 + offset)  # largest
    if (hi is not None and d_min > hi) or (lo is not None and d_max < lo):
        return SKIPPED
    if (lo is None or d_min >= lo) and (hi is None or d_max <= hi):
        return FULL
    return PARTIAL


def _band_keys(t0: int, t1: int, S: int, offset: int, lo, hi) -> tuple[int, int]:
    """Keys ``start:stop`` that the band allows to at least one of the queries ``t0:t1``.

    The rows of the band are intervals ``[i + o + lo, i + o + hi]`` that shift by one key per
    query and never cross (``lo <= hi``), so their union over the block is one interval.
    """
    start = 0 if lo is None else max(0, t0 + offset + lo)
    stop = S if hi is None else min(S, t1 + offset + hi)
    return start, max(start, stop)


def _key_block_range(t0: int, t1: int, S: int, block_k: int, offset: int, lo, hi):
    """Indices ``(first, stop)`` of the key blocks that the band allows for queries ``t0:t1``."""
    start, stop = _band_keys(t0, t1, S, offset, lo, hi)
    if start == stop:
        return 0, 0
    return start // block_k, -(-stop // block_k)


def tile_map(
    T: int,
    S: int,
    *,
    block_q: int,
    block_k: int,
    is_causal: bool = False,
    window=None,
    causal_alignment: str = "top_left",
) -> np.ndarray:
    """Which tiles of the ``(T, S)`` score matrix the tiled path computes, and how.

    Parameters
    ----------
    T, S : int
        Number of queries and keys.
    block_q, block_k : int
        Tile sizes ``Bq`` (query rows) and ``Bk`` (key columns), positive.
    is_causal, window, causal_alignment
        The band, as in :func:`sdpa.scaled_dot_product_attention`.

    Returns
    -------
    kinds : (ceil(T / Bq), ceil(S / Bk)) np.ndarray of int
        ``0`` for a tile entirely outside the band (never computed), ``1`` for a tile the
        band's edge crosses (computed, then masked), ``2`` for a tile entirely inside it
        (computed, no mask).

    Raises
    ------
    TypeError
        If a size is not an integer, or ``is_causal`` is not a bool.
    ValueError
        If a size is negative (tile sizes must be positive), or ``window`` or
        ``causal_alignment`` is invalid.

    Notes
    -----
    The classification is the one :func:`scaled_dot_product_attention` uses with
    ``implementation="tiled"``, so the map shows exactly the work it skips (the kernel also
    trims the keys of each computed tile to those the band allows to some query of its block). Tile ``(a, b)``
    covers queries ``a*Bq : (a+1)*Bq`` and keys ``b*Bk : (b+1)*Bk``.

    Examples
    --------
    A causal mask over 8 x 8 scores in 2 x 2 tiles: the four diagonal tiles are computed and
    masked, the six above them are never computed:

    >>> from sdpa import tile_map
    >>> tile_map(8, 8, block_q=2, block_k=2, is_causal=True)
    array([[1, 0, 0, 0],
           [2, 1, 0, 0],
           [2, 2, 1, 0],
           [2, 2, 2, 1]])
    """
    T = check_nonneg_int(T, "T")
    S = check_nonneg_int(S, "S")
    block_q = check_positive_int(block_q, "block_q")
    block_k = check_positive_int(block_k, "block_k")
    offset = alignment_offset(T, S, check_alignment(causal_alignment))
    lo, hi = band_limits(check_bool(is_causal, "is_causal"), check_window(window))
    n_q, n_k = -(-T // block_q), -(-S // block_k)
    kinds = np.zeros((n_q, n_k), dtype=int)
    for a in range(n_q):
        t0, t1 = a * block_q, min(T, (a + 1) * block_q)
        first, stop = _key_block_range(t0, t1, S, block_k, offset, lo, hi)
        for b in range(first, stop):
            s0, s1 = b * block_k, min(S, (b + 1) * block_k)
            kinds[a, b] = _tile_kind(t0, t1, s0, s1, offset, lo, hi)
    return kinds


# ----------------------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------------------


@dataclass
class _Plan:
    """Everything a worker needs, as views shaped ``(*outer, G, ...)`` or ``(*outer, ...)``."""

    q: np.ndarray  # (*outer, G, T, Dk)
    k: np.ndarray  # (*outer, S, Dk) view of the keys
    v: np.ndarray  # (*outer, S, Dv) view of the values
    allowed: np.ndarray | None  # (*outer, G, T, S) bool view, or None
    bias: np.ndarray | None  # (*outer, G, T, S) view, or None
    sinks: np.ndarray | None  # (*outer, G, T) view of the sinks' logits, or None
    out: np.ndarray  # (*outer, G, T, Dv), written by the workers
    lse: np.ndarray  # (*outer, G, T)
    m: np.ndarray | None  # (*outer, G, T): the final shift of each row, when asked for
    l: np.ndarray | None  # (*outer, G, T): the row sums at that shift, when asked for
    scale: float  # the query's factor: the scale, times LOG2E in base 2
    to_base: float  # natural units times this are the scores' units: 1.0 (e) or LOG2E (2)
    fold_limit: float  # FOLD_LIMIT in those units
    offset: int
    lo: int | None
    hi: int | None
    T: int
    S: int
    Dk: int
    Dv: int
    G: int
    block_q: int
    block_k: int
    dtype: np.dtype
    may_overflow: bool  # check every tile's scores for overflow (see attention.check_overflow)
    problem: AttentionProblem  # for error messages
    exp: Callable[..., np.ndarray]  # the tiles' exponential, exp(x, out=x)
    base_exp: Callable[..., np.ndarray]  # the true one of the base (np.exp or np.exp2)
    v_exp: np.ndarray | None  # (Dv,) int: the values were scaled by 2 ** -v_exp (or None)


def _fold_axis(problem: AttentionProblem) -> bool:
    """Fold the last batch axis into the query rows when keys and values do not vary along it."""
    bs = problem.batch_shape
    if not bs or bs[-1] <= 1:
        return False
    for a in (problem.key, problem.value):
        lead = a.shape[:-2]  # right-aligned with bs, and at most as long
        if lead and lead[-1] != 1:
            return False
    return True


def tile_plan_sizes(
    problem: AttentionProblem,
    block_q: int | None = None,
    block_k: int | None = None,
    num_threads: int | None = None,
) -> tuple[int, int, int]:
    """``(G, block_q, block_k)``: the heads folded into a tile's rows and the tile sizes.

    The last batch axis is folded into the query rows when keys and values do not vary along
    it (``G`` of its heads share one key tile); both tile sizes are clipped to the problem's
    ``T`` and ``S``; ``block_q`` defaults to about ``BLOCK_ROWS``
    rows after folding, ``block_k`` to ``BLOCK_K``. Without a band (no causal mask, no
    window) the rows go up to ``BLOCK_ROWS_FULL``, as long as the ``num_threads`` threads
    (default :func:`sdpa.threads.default_num_threads`) still get a work unit each.
    """
    G = problem.batch_shape[-1] if _fold_axis(problem) else 1
    if block_q is None:
        rows = BLOCK_ROWS.get(problem.work_dtype, 128)
        if problem.band == (None, None):
            outer = int(np.prod(problem.batch_shape, dtype=np.int64)) // G
            blocks = -(-(num_threads or default_num_threads()) // max(outer, 1))  # per head
            rows_per_block = G * -(-problem.T // blocks)  # the rows, split into `blocks`
            rows = max(rows, min(BLOCK_ROWS_FULL.get(problem.work_dtype, rows), rows_per_block))
        block_q = max(1, rows // G)
    if block_k is None:
        block_k = BLOCK_K.get(problem.work_dtype, 512)
    # Never larger than the problem: the workers' buffers are sized by the tiles.
    return G, int(min(block_q, max(problem.T, 1))), int(min(block_k, max(problem.S, 1)))


LOG2E = 1 / math.log(2)  # 2 ** (x * LOG2E) = e ** x


def _make_plan(
    problem: AttentionProblem,
    block_q,
    block_k,
    num_threads,
    with_stats=False,
    exp=None,
    v_exp=None,
) -> _Plan:
    T, S, Dk, Dv = problem.T, problem.S, problem.Dk, problem.Dv
    dtype = problem.work_dtype
    bs = problem.batch_shape
    G, block_q, block_k = tile_plan_sizes(problem, block_q, block_k, num_threads)
    fold = G > 1
    outer = bs[:-1] if fold else bs

    def rows_view(a, last):  # broadcast a (..., T, last) array to (*outer, G, T, last)
        full = np.broadcast_to(a, (*bs, T, last))
        return full if fold else full[..., None, :, :]

    def row_sinks(a):  # broadcast the (..., T) sinks to (*outer, G, T)
        full = np.broadcast_to(a, (*bs, T))
        return full if fold else full[..., None, :]

    def heads_view(a, last):  # the (S, last) head of a (..., S, last) array each outer index reads
        full = np.broadcast_to(a, (*bs, S, last))
        return full[..., 0, :, :] if fold else full

    # Base 2: the scores are computed in units of ln 2 (the query's scale times LOG2E), so
    # that the tiles' exponential is exp2. Not with a float bias (bias * LOG2E can overflow
    # where the bias did not) nor where scores may overflow.
    if exp is None:
        exp = tile_exponential(dtype)
    base2 = exp is np.exp2 and problem.bias is None and not problem.may_overflow
    if exp is np.exp2 and not base2:
        exp = np.exp
    to_base = LOG2E if base2 else 1.0
    allowed = bias = None
    if problem.allowed is not None:
        allowed = rows_view(problem.allowed, S)
    if problem.bias is not None:
        bias = rows_view(problem.bias, S)
    lo, hi = problem.band
    value = problem.value if v_exp is None else np.ldexp(problem.value, -v_exp)  # exact
    return _Plan(
        q=rows_view(problem.query, Dk),
        k=heads_view(problem.key, Dk),
        v=heads_view(value, Dv),
        allowed=allowed,
        bias=bias,
        sinks=None if problem.sinks is None else row_sinks(problem.sinks),
        out=np.empty((*outer, G, T, Dv), dtype=dtype),
        lse=np.empty((*outer, G, T), dtype=dtype),
        m=np.empty((*outer, G, T), dtype=dtype) if with_stats else None,
        l=np.empty((*outer, G, T), dtype=dtype) if with_stats else None,
        scale=problem.scale * to_base,
        to_base=to_base,
        fold_limit=FOLD_LIMIT * to_base,
        offset=problem.offset,
        lo=lo,
        hi=hi,
        T=T,
        S=S,
        Dk=Dk,
        Dv=Dv,
        G=G,
        block_q=int(block_q),
        block_k=int(block_k),
        dtype=dtype,
        may_overflow=problem.may_overflow,
        problem=problem,
        exp=exp,
        base_exp=np.exp2 if base2 else np.exp,
        v_exp=v_exp,
    )


def value_exponents(value: np.ndarray, S: int) -> np.ndarray | None:
    """Powers of two ``e`` (one per column of the values, ``(Dv,)`` int) that bring each
    column's largest ``|v|`` into ``[0.5, 1)``; None when no column needs it.

    The accumulator sums up to ``S`` terms ``exp(score - m) * v`` whose weights reach
    ``LAZY_BOUND`` (the shift lags the row maximum) where the reference path's weights are at
    most 1, and drop to ``LAZY_FLOOR`` (a row at the shift 0) where the reference path's
    largest weight is at least ``1 / S``. Values within ``4 S LAZY_BOUND`` of the dtype's
    largest number would overflow it, values within ``2 ** 64`` of its smallest normal number
    would lose digits to subnormal numbers; their columns are scaled by ``2 ** -e`` (exact)
    and the result by ``2 ** e``. Other inputs are left alone, bit for bit.
    """
    finfo = np.finfo(value.dtype)
    axes = tuple(range(value.ndim - 1))
    top = np.maximum(np.max(value, axis=axes), -np.min(value, axis=axes))  # (Dv,): max |v|
    high = finfo.max / (4 * LAZY_BOUND * S)
    low = float(finfo.smallest_normal) * 2.0**VALUE_FLOOR_BITS
    scale = np.isfinite(top) & (top > 0) & ((top > high) | (top < low))
    if not scale.any():
        return None
    return np.where(scale, np.frexp(top)[1], 0).astype(np.int32)


def values_may_be_out_of_range(top: np.ndarray) -> bool:
    """Whether a result computed on unscaled values may have lost to the ends of the range,
    from ``top``, the largest ``|out|`` of each column ``(Dv,)`` (NaN if any was NaN).

    Overflow shows in the result as ``inf`` or NaN; digits lost to subnormal numbers show as
    a column whose results are all below ``2 ** VALUE_FLOOR_BITS`` times the smallest normal
    number. Only then are the values themselves read (:func:`value_exponents`).
    """
    low = float(np.finfo(top.dtype).smallest_normal) * 2.0**VALUE_FLOOR_BITS
    return not (top >= low).all() or not np.isfinite(top).all()


def widen_column_top(top: np.ndarray, out: np.ndarray) -> None:
    """Raise ``top`` ``(Dv,)`` in place to the largest ``|out|`` of each column of ``out``
    ``(..., Dv)``; a NaN, once met, stays (``np.maximum``). What
    :func:`values_may_be_out_of_range` reads after the last unit."""
    if out.size:
        axes = tuple(range(out.ndim - 1))
        np.maximum(top, np.max(out, axis=axes), out=top)  # no temporary of out's size
        np.maximum(top, -np.min(out, axis=axes), out=top)


class _Buffers:
    """One worker thread's arrays, allocated once for the largest unit of the plan.

    Each is flat and viewed at the size of the unit at hand (:class:`_Unit`), so a thread
    allocates nothing per tile: one buffer per stage of a tile and per piece of running state.
    """

    def __init__(self, plan: _Plan):
        rows, bk, dtype = plan.G * plan.block_q, min(plan.block_k, plan.S), plan.dtype
        self.q_shifted = np.empty(rows * (plan.Dk + 1), dtype)  # [query * scale | -m]
        self.scores = np.empty(rows * bk, dtype)  # scores, then exp(scores - m) in place
        self.disallowed = np.empty(rows * bk, bool) if plan.allowed is not None else None
        self.tile_out = np.empty(rows * plan.Dv, dtype)  # exp(scores - m) @ v
        self.tile_l = np.empty(rows, dtype)  # exp(scores - m) @ 1: the tile's row sums
        self.acc = np.empty(rows * plan.Dv, dtype)  # running sum of exp(scores - m) @ v
        self.l = np.empty(rows, dtype)  # running sum of exp(scores - m)
        self.m = np.empty(rows, dtype)  # running shift of each row
        self.unfolded = np.empty(rows, dtype)  # m of the rows whose shift is not folded in
        self.ones = np.ones(bk, dtype)
        self.top = np.zeros(plan.Dv, dtype)  # the largest |out| of each column, over the units
        # [k | 1] of a unit's head, (S, Dk + 1): made (by copying the keys) only for a unit
        # that folds a shift into the first product, which inputs of moderate scores never do
        self.k1: np.ndarray | None = None

    def keys_with_ones(self, k: np.ndarray) -> np.ndarray:
        """``[k | 1]``: a unit's keys ``(S, Dk)`` with a column of ones, ``(S, Dk + 1)``."""
        S, Dk = k.shape
        if self.k1 is None:
            self.k1 = np.empty((S, Dk + 1), k.dtype)
            self.k1[:, Dk] = 1
        self.k1[:, :Dk] = k
        return self.k1


class _Unit:
    """One work unit in progress: the query rows ``t0:t1`` of the ``G`` folded heads at outer
    index ``o``, ``rows = G * (t1 - t0)`` rows of scores, and the running online softmax.

    The steps that add a key tile (:meth:`lazy_step`, :meth:`exact_step`) and the one that
    writes the result (:meth:`write_result`) are methods here; :class:`_Worker` decides which
    step each tile takes. With ``at_zero`` every row starts at the shift ``m = 0``, so the
    first tile can take the lazy step on the raw scores: ``exp(score)`` is exact while the
    scores stay within ``LAZY_MARGIN`` of zero, which the tile's row sums check from above;
    from below, a row whose sum ``l`` ends under ``exp(-LAZY_MARGIN)`` (all its scores below
    ``-LAZY_MARGIN``, or none allowed) makes the worker redo the unit. Otherwise a row starts
    once it meets an allowed key, in the exact step, at that tile's maximum.
    """

    def __init__(self, plan: _Plan, buffers: _Buffers, o: tuple, t0: int, t1: int, at_zero):
        G, Dk, Dv, bq = plan.G, plan.Dk, plan.Dv, t1 - t0
        rows = G * bq
        self.plan, self.buffers = plan, buffers
        self.o, self.t0, self.t1, self.rows = o, t0, t1, rows  # the block: (G * bq) rows
        # The inputs: views of the unit's head.
        self.k, self.v = plan.k[o], plan.v[o]  # (S, Dk), (S, Dv)
        self.k1 = None  # (S, Dk + 1), [k | 1], made once a shift is folded in
        self.allowed = None if plan.allowed is None else plan.allowed[o]  # (G, T, S)
        self.bias = None if plan.bias is None else plan.bias[o]  # (G, T, S)
        # q_shifted = [query * scale | -m]: (rows, Dk + 1), the folded heads' rows one under
        # the other. Against keys with a column of ones, [k | 1], one product gives the scores
        # minus the running shift m, so no separate pass subtracts it.
        self.q_shifted = buffers.q_shifted[: rows * (Dk + 1)].reshape(rows, Dk + 1)
        np.multiply(
            plan.q[o][:, t0:t1, :], plan.scale, out=self.q_shifted.reshape(G, bq, Dk + 1)[..., :Dk]
        )
        self.folded.fill(0)
        self.any_folded = False  # while no shift is folded in, the keys need no column of ones
        # The running state: the shift m of each row (0 until it meets an allowed key), the
        # part of it not folded into the product, the sums l and acc.
        self.m = _zeros(buffers.m, rows)
        self.unfolded = _zeros(buffers.unfolded, rows)
        self.any_unfolded = False
        self.started = np.full(rows, at_zero)  # rows whose shift m is set
        self.all_started = at_zero
        self.acc = _zeros(buffers.acc, rows * Dv).reshape(rows, Dv)
        self.l = _zeros(buffers.l, rows)

    # Views of the buffers at the unit's size (properties, so the unit's state stays short).

    @property
    def q_scaled(self) -> np.ndarray:
        """``(rows, Dk)``: the query rows times the scale (in the scores' base)."""
        return self.q_shifted[:, :-1]

    @property
    def folded(self) -> np.ndarray:
        """``(rows,)``: ``-m`` for the rows whose shift is folded in, else 0."""
        return self.q_shifted[:, -1]

    @property
    def tile_out(self) -> np.ndarray:
        """``(rows, Dv)``: one tile's ``exp(scores - m) @ v``."""
        return self.buffers.tile_out[: self.rows * self.plan.Dv].reshape(self.rows, -1)

    @property
    def tile_l(self) -> np.ndarray:
        """``(rows,)``: one tile's row sums ``exp(scores - m) @ 1``."""
        return self.buffers.tile_l[: self.rows]

    # -- the two steps ---------------------------------------------------------------------

    def lazy_step(self, s0: int, s1: int, disallowed) -> bool:
        """The common case: add the tile at the current shift ``m``; False if it is not exact.

        ``exp(scores - m)`` is exact as long as no score exceeds ``m`` by more than
        ``LAZY_MARGIN`` (then nothing overflows), which the tile's row sums prove; and ``l``
        stays large enough: ``l >= 1`` once ``m`` is an actual score, ``l >= LAZY_FLOOR`` at
        the shift 0 (checked by :meth:`_Worker.walk` after the first tile and at the unit's
        end). A tile that fails is redone by :meth:`exact_step`.

        Disallowed entries are zeroed after the exponential rather than set to ``-inf``
        before it: NumPy's vectorised ``exp2`` takes a slow path for ``-inf`` (a causal
        diagonal tile took 2.7 times as long).
        """
        plan = self.plan
        scores = self.buffers.scores[: self.rows * (s1 - s0)].reshape(self.rows, s1 - s0)
        unfolded = self.unfolded if self.any_unfolded else None
        self.shifted_scores(scores, s0, s1, None, unfolded)
        plan.exp(scores, out=scores)  # the probabilities, unnormalised: exp(scores - m)
        if disallowed is not None:
            np.copyto(scores.reshape(plan.G, -1, s1 - s0), 0, where=disallowed)
        # The row sums first: a tile that fails the bound costs no second product.
        np.matmul(scores, self.buffers.ones[: s1 - s0], out=self.tile_l)  # (rows, bk) @ (bk,)
        if not self.tile_l.max() <= LAZY_BOUND:  # (NaN fails too)
            return False
        np.matmul(scores, self.v[s0:s1], out=self.tile_out)  # (rows, bk) @ (bk, Dv)
        self.acc += self.tile_out
        self.l += self.tile_l
        return True

    def exact_step(self, s0: int, s1: int, disallowed) -> None:
        """The online softmax as written, on the raw scores, moving each row's shift ``m``.

        The raw scores (nothing folded in, so in base e they are rounded exactly as the
        reference path rounds them) give the new maximum ``m_new = max(m, rowmax)``; the old
        sums are rescaled by ``alpha = exp(m - m_new)``. A row meeting its first allowed key
        starts at that tile's maximum. Then the shift is folded into ``q_shifted`` again for
        the rows where that is exact (``|m| <= FOLD_LIMIT``), and kept in ``unfolded`` for the
        others.
        """
        plan = self.plan
        m, started = self.m, self.started
        scores = self.buffers.scores[: self.rows * (s1 - s0)].reshape(self.rows, s1 - s0)
        self.folded.fill(0)
        self.any_folded = False
        self.shifted_scores(scores, s0, s1, disallowed, None, check=plan.may_overflow)
        row_max = np.max(scores, axis=1)  # -inf where nothing is allowed
        meets = row_max > -np.inf
        m_new = np.where(started, np.maximum(m, row_max), np.where(meets, row_max, 0))
        alpha = np.where(started, plan.base_exp(m - m_new), 0)  # exp(-inf) = 0: no overflow
        np.subtract(scores, m_new[:, None], out=scores)
        plan.exp(scores, out=scores)  # exp(scores - m_new), at most 1
        self.tile_products(scores, s0, s1)
        self.acc *= alpha[:, None]
        self.acc += self.tile_out
        self.l *= alpha
        self.l += self.tile_l
        m[:] = m_new
        small = np.abs(m) <= plan.fold_limit  # rows whose shift can be folded in exactly
        np.negative(m, out=self.folded)
        self.folded[~small] = 0
        self.any_folded = bool(small.any())
        self.any_unfolded = not small.all()
        np.copyto(self.unfolded, m)
        self.unfolded[small] = 0
        started |= meets
        self.all_started = bool(started.all())

    def sums_hold(self, rows: slice = slice(None)) -> bool:
        """Whether every row has ``l >= LAZY_FLOOR`` (NaN fails too); with ``rows``, only the
        block's rows ``rows`` of each folded head."""
        l = self.l.reshape(self.plan.G, -1)[:, rows]
        return l.size == 0 or bool(l.min() >= LAZY_FLOOR)

    # -- the pieces of a step --------------------------------------------------------------

    def tile_products(self, probs: np.ndarray, s0: int, s1: int) -> None:
        """``tile_out = probs @ v`` and the row sums ``tile_l = probs @ 1`` of one tile.

        The row sums are a matrix-vector product: it reads the tile once more, from cache,
        which costs less than a column of ones appended to the values. For ``Dv = 64`` on a
        512 x 512 float32 tile (AMD EPYC Zen 4, one core): 65 columns took 1.18 times as long
        as 64, 72 (padded to BLAS's panel width) 1.13 times, and ``probs @ 1`` adds 0.05;
        NumPy's ``probs.sum(axis=1)`` would add 0.14.
        """
        np.matmul(probs, self.v[s0:s1], out=self.tile_out)  # (rows, bk) @ (bk, Dv)
        np.matmul(probs, self.buffers.ones[: s1 - s0], out=self.tile_l)  # (rows, bk) @ (bk,)

    def shifted_scores(self, scores, s0, s1, disallowed, unfolded, check=False) -> None:
        """``scores = scale * q k^T - folded + bias - unfolded`` on one tile (each row's shift
        ``m`` is in ``folded`` or in ``unfolded``), disallowed entries set to ``-inf``.

        With ``check``, the raw scores (nothing subtracted) are checked for overflow first.
        """
        plan = self.plan
        if self.any_folded:
            if self.k1 is None:
                self.k1 = self.buffers.keys_with_ones(self.k)
            np.matmul(self.q_shifted, self.k1[s0:s1].T, out=scores)  # (rows, Dk+1) @ (Dk+1, bk)
        else:
            np.matmul(self.q_scaled, self.k[s0:s1].T, out=scores)  # (rows, Dk) @ (Dk, bk)
        bias = None if self.bias is None else self.bias[:, self.t0 : self.t1, s0:s1]
        if bias is None and disallowed is None and unfolded is None and not check:
            return
        scores3 = scores.reshape(plan.G, -1, scores.shape[1])  # (G, bq, bk)
        if bias is not None:
            np.add(scores3, bias, out=scores3)
        if unfolded is not None:
            np.subtract(scores, unfolded[:, None], out=scores)
        if check:
            allowed = None if disallowed is None else ~disallowed
            check_overflow(plan.problem, scores3, allowed, bias)
        if disallowed is not None:
            np.copyto(scores3, -np.inf, where=disallowed)

    # -- the result ------------------------------------------------------------------------

    def write_result(self) -> None:
        """``out = acc / l`` and ``lse = m + log l``; rows that never met an allowed key have
        ``l = 0``, ``out = 0`` and ``lse = -inf``.

        With sinks, the sink's term joins each row's normaliser first (:func:`_add_sinks`):
        ``out = acc * alpha / l`` and ``lse = m + log l`` with the new ``m`` and ``l``.
        """
        plan, o, t0, t1 = self.plan, self.o, self.t0, self.t1
        G, Dv, bq, rows = plan.G, plan.Dv, t1 - t0, self.rows
        self.folded.fill(0)
        l = self.l
        m = self.m if plan.to_base == 1.0 else self.m / plan.to_base  # in natural units
        alpha = 1
        if plan.sinks is not None:
            m, l, alpha = _add_sinks(m, l, plan.sinks[o][:, t0:t1].reshape(rows))
        seen = l > 0
        inv = np.zeros(rows, dtype=plan.dtype)
        np.divide(alpha, l, out=inv, where=seen)
        out = plan.out[o][:, t0:t1, :]  # (G, bq, Dv) view of the result
        np.multiply(self.acc.reshape(G, bq, Dv), inv.reshape(G, bq, 1), out=out)
        if plan.v_exp is not None:
            np.ldexp(out, plan.v_exp, out=out)  # undo the values' scaling (exact)
        else:  # while the block is in cache: did the values come near the ends of the range?
            widen_column_top(self.buffers.top, out)
        lse = np.full(rows, -np.inf, dtype=plan.dtype)
        np.log(l, out=lse, where=seen)
        np.add(lse, m, out=lse, where=seen)
        plan.lse[o][:, t0:t1] = lse.reshape(G, bq)
        if plan.m is not None:
            plan.m[o][:, t0:t1] = m.reshape(G, bq)
            plan.l[o][:, t0:t1] = l.reshape(G, bq)


def _add_sinks(m: np.ndarray, l: np.ndarray, s: np.ndarray):
    """``(m, l, alpha)``: a unit's rows with each row's sink ``s`` added to its normaliser.

    ``m`` (the shift, in natural units), ``l`` (the sum of ``exp(score - m)``) and ``s`` are
    ``(rows,)``. The sink joins the shift, ``m_new = max(m, s)``, so that ``exp(s - m_new)``
    cannot overflow however far the lazy shift lags behind it; the keys' sums are rescaled by
    ``alpha = exp(m - m_new)``: ``l_new = alpha l + exp(s - m_new)`` and the output is
    ``alpha acc / l_new``. A row that met no allowed key (``l = 0``) gets ``m_new = s`` and
    ``l_new = 1`` (so ``lse = s`` exactly), or stays empty if its sink is ``-inf`` too. With
    ``s = -inf`` a row keeps its ``m`` and ``l`` bit for bit, and ``alpha = 1``.
    """
    seen = l > 0
    m_new = np.where(seen, np.maximum(m, s), s)
    shift = np.where(m_new > -np.inf, m_new, 0).astype(m.dtype, copy=False)
    alpha = np.zeros_like(l)
    np.exp(m - shift, out=alpha, where=seen)  # <= 1, and exactly 1 where the sink is below m
    l_new = l * alpha + np.exp(s - shift)  # exp(-inf) = 0 for a sink of -inf
    return m_new, l_new, alpha


def _zeros(buffer: np.ndarray, n: int) -> np.ndarray:
    """The first ``n`` entries of ``buffer``, set to zero."""
    view = buffer[:n]
    view.fill(0)
    return view


class _Worker:
    """One thread: its buffers, its counters, and the loop over the units it takes.

    :meth:`run` reads top to bottom: start the unit, then for each key tile its mask, the lazy
    step (accepted when its row sums prove it exact) or else the exact step, and at the end
    the result. What a unit computes depends on its own inputs only, never on the units the
    worker took before it, so that every thread count and every order in which the threads
    take the units give the same bits.
    """

    def __init__(self, plan: _Plan):
        self.plan = plan
        self.buffers = _Buffers(plan)
        self.stats = TileStats()  # this worker's counts (units and skipped_band: the caller's)
        self.band_cache: dict = {}

    def drain(self, units, counter) -> None:
        """Take units from the shared list until it is empty."""
        with np.errstate(all="ignore"):
            # Errors cannot arise here except in the deliberate -inf arithmetic above:
            # exp(-inf) = 0, m - m_new = -inf, and log(0) never reached (masked by ``where``);
            # overflow is excluded up front or checked (Plan.may_overflow).
            while True:
                i = next(counter)
                if i >= len(units):
                    return
                self.run(*units[i])

    def run(self, o: tuple, t0: int, t1: int) -> None:
        """Attention for the query rows ``t0:t1`` of every folded head at outer index ``o``.

        Without a mask or a bias the unit first tries the shift ``m = 0`` for every row; if a
        row's scores turn out too small for it, the unit is walked again from the exact step.
        """
        plan = self.plan
        at_zero = plan.allowed is None and plan.bias is None and not plan.may_overflow
        unit = _Unit(plan, self.buffers, o, t0, t1, at_zero)
        if not self.walk(unit, at_zero):
            self.stats.redone += 1
            unit = _Unit(plan, self.buffers, o, t0, t1, at_zero=False)
            self.walk(unit, at_zero=False)
        unit.write_result()

    def walk(self, unit: _Unit, at_zero: bool) -> bool:
        """Add up the unit's key tiles: for each, its mask, then the lazy or the exact step.

        Returns False when a unit started ``at_zero`` must be redone: a row's sum ``l`` is
        below ``LAZY_FLOOR`` at the end, or already after the first tile for a row that met a
        key there (so scores far below zero waste one tile, not the whole walk).
        """
        plan, stats, t0, t1 = self.plan, self.stats, unit.t0, unit.t1
        first, stop = _key_block_range(t0, t1, plan.S, plan.block_k, plan.offset, plan.lo, plan.hi)
        key_start, key_stop = _band_keys(t0, t1, plan.S, plan.offset, plan.lo, plan.hi)
        for b in range(first, stop):
            # The tile's keys, trimmed to the keys the band allows to some query of the block
            # (under a causal mask the last tile of a row of tiles stops at the diagonal).
            s0 = max(b * plan.block_k, key_start)
            s1 = min((b + 1) * plan.block_k, key_stop)
            disallowed = self.tile_disallowed(unit, s0, s1)
            if disallowed is _EVERY_KEY:
                stats.skipped_mask += 1
                continue
            stats.computed += 1
            lazy = unit.all_started and not plan.may_overflow
            if not (lazy and unit.lazy_step(s0, s1, disallowed)):
                stats.retried += lazy
                stats.rescaled += 1
                unit.exact_step(s0, s1, disallowed)
            if at_zero and b == first and not unit.sums_hold(self.rows_meeting(t0, t1, s0, s1)):
                return False
        return not at_zero or unit.sums_hold()

    # -- masks -----------------------------------------------------------------------------

    def tile_disallowed(self, unit: _Unit, s0: int, s1: int):
        """``(G, bq, bk)`` bool, True where the tile's scores are disallowed; None if none is;
        ``_EVERY_KEY`` if the user's mask disallows the whole tile (it is then skipped)."""
        plan, t0, t1 = self.plan, unit.t0, unit.t1
        kind = _tile_kind(t0, t1, s0, s1, plan.offset, plan.lo, plan.hi)
        assert kind != SKIPPED, "the key-block range holds only tiles the band touches"
        if unit.allowed is None:
            return self.band_disallowed(t0, t1, s0, s1) if kind == PARTIAL else None
        disallowed = self.buffers.disallowed[: unit.rows * (s1 - s0)]
        disallowed = disallowed.reshape(plan.G, t1 - t0, s1 - s0)
        np.logical_not(unit.allowed[:, t0:t1, s0:s1], out=disallowed)
        if kind == PARTIAL:
            np.logical_or(disallowed, self.band_disallowed(t0, t1, s0, s1), out=disallowed)
        return _EVERY_KEY if disallowed.all() else disallowed

    def band_disallowed(self, t0: int, t1: int, s0: int, s1: int) -> np.ndarray:
        """Boolean ``(t1-t0, s1-s0)`` tile, True where the band disallows; cached by geometry."""
        plan = self.plan
        key = (s0 - t0, t1 - t0, s1 - s0)
        tile = self.band_cache.get(key)
        if tile is None:
            diff = np.arange(s0, s1)[None, :] - (np.arange(t0, t1)[:, None] + plan.offset)
            tile = np.zeros(diff.shape, dtype=bool)
            if plan.lo is not None:
                tile |= diff < plan.lo
            if plan.hi is not None:
                tile |= diff > plan.hi
            if len(self.band_cache) > 64:
                self.band_cache.clear()
            self.band_cache[key] = tile
        return tile

    def rows_meeting(self, t0: int, t1: int, s0: int, s1: int) -> slice:
        """The block's rows (``0`` to ``t1 - t0``) that the band allows some key of ``s0:s1``:
        one run of rows, since the band's rows shift by one key per query."""
        plan = self.plan
        first, stop = 0, t1 - t0
        if plan.hi is not None:  # row i reaches key i + offset + hi >= s0
            first = max(first, s0 - plan.offset - plan.hi - t0)
        if plan.lo is not None:  # row i starts at key i + offset + lo <= s1 - 1
            stop = min(stop, s1 - 1 - plan.offset - plan.lo - t0 + 1)
        return slice(first, max(first, stop))


def _run(plan: _Plan, num_threads: int | None, stats: TileStats | None) -> np.ndarray:
    """Share the plan's work units out among worker threads; add their counts to ``stats``.

    Returns the largest ``|out|`` of each column ``(Dv,)``, NaN where any result was NaN.
    """
    T, S = plan.T, plan.S
    outer = plan.out.shape[:-3]
    n_q = -(-T // plan.block_q)
    units = []
    for a in range(n_q):
        t0, t1 = a * plan.block_q, min(T, (a + 1) * plan.block_q)
        first, stop = _key_block_range(t0, t1, S, plan.block_k, plan.offset, plan.lo, plan.hi)
        units.extend((stop - first, o, t0, t1) for o in np.ndindex(*outer))
    # Longest first, so the last units to finish are short ones (causal rows vary in length).
    units.sort(key=lambda u: -u[0])
    work = [u[1:] for u in units]
    n_threads = max(1, min(num_threads or default_num_threads(), len(work)))
    counter = itertools.count()
    workers = [_Worker(plan) for _ in range(n_threads)]
    if n_threads == 1:
        with single_threaded_blas():  # BLAS's threads slow small products down, here too
            workers[0].drain(work, counter)
    else:
        run_in_threads([functools.partial(w.drain, work, counter) for w in workers])
    if stats is not None:
        n_k = -(-S // plan.block_k)
        total = n_q * n_k * int(np.prod(outer, dtype=np.int64))
        for w in workers:
            stats.add(w.stats)
        stats.units += len(work)
        stats.skipped_band += total - sum(u[0] for u in units)
    return functools.reduce(np.maximum, [w.buffers.top for w in workers])


def attention_tiled(
    problem: AttentionProblem,
    *,
    block_q: int | None = None,
    block_k: int | None = None,
    num_threads: int | None = None,
    stats: TileStats | None = None,
    return_stats: bool = False,
    mark: bool = True,
    exp: Callable[..., np.ndarray] | None = None,
):
    """The online-softmax tiled path on a prepared problem.

    Parameters
    ----------
    problem : AttentionProblem
        From :func:`sdpa.problem.prepare_attention`.
    block_q : int, optional
        Query positions per tile; default: about ``BLOCK_ROWS`` rows after folding the heads
        that share a key/value head into the rows of one tile, up to ``BLOCK_ROWS_FULL``
        without a causal mask or a window.
    block_k : int, optional
        Keys per tile; default ``BLOCK_K``.
    num_threads : int, optional
        Worker threads; default :func:`sdpa.threads.default_num_threads`.
    stats : TileStats, optional
        Receives the counts of work units and of computed, rescaled and skipped tiles.
    return_stats : bool, default False
        Also return ``m`` and ``l``: ``lse = m + log(l)`` in two parts, the shift ``m``
        (close to the row maximum) and the row sum ``l`` at that shift, which the backward
        pass needs when ``lse`` is too large for its rounding to be negligible.
    mark : bool, default True
        Set to NaN the rows of ``out`` and ``lse`` that a non-finite input reaches (not those
        of ``m`` and ``l``); the backward pass marks its own.
    exp : callable, optional
        The elementwise exponential applied to each tile in place, as ``exp(x, out=x)``: the
        one pass over each tile that no trick removes. ``numpy.exp2`` computes the scores in
        base 2 (the query's scale times ``log2(e)``, so that ``2 ** score`` is the usual
        ``e ** score``), except with a float mask or where a score may overflow, which take
        ``numpy.exp``. Default: :func:`sdpa.tuning.tile_exponential`, chosen from the machine.
        Any other callable is applied to scores in base ``e``; the benchmark substitutes a
        cheaper function to measure the exponential's share of the time (the result is then
        wrong, of course).

    Returns
    -------
    out : np.ndarray
        ``(*problem.batch_shape, T, Dv)`` in ``problem.work_dtype``, grouped heads not merged
        (:meth:`sdpa.problem.AttentionProblem.finish` does that).
    lse : np.ndarray
        ``(*problem.batch_shape, T)``, the log-sum-exp of each row (``-inf`` when fully masked).
    m, l : np.ndarray
        With ``return_stats`` only, of the shape of ``lse``.

    Raises
    ------
    TypeError
        If a tile size or ``num_threads`` is not an integer.
    ValueError
        If a tile size or ``num_threads`` is not positive, or a score overflows the working
        dtype although every input is finite.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa import scaled_dot_product_attention
    >>> from sdpa.problem import prepare_attention
    >>> from sdpa.tiled import TileStats, attention_tiled
    >>> x = np.random.default_rng(0).standard_normal((64, 8))  # (T, Dk), T = S = 64
    >>> problem = prepare_attention(x, x, x, is_causal=True)
    >>> stats = TileStats()
    >>> out, lse = attention_tiled(problem, block_q=16, block_k=16, stats=stats)
    >>> stats.computed, stats.skipped_band  # 4 x 4 tiles: 10 on or below the diagonal
    (10, 6)
    >>> reference = scaled_dot_product_attention(x, x, x, is_causal=True, implementation="reference")
    >>> bool(np.allclose(problem.finish(out), reference, rtol=1e-12, atol=1e-12))
    True
    """
    if block_q is not None:
        block_q = check_positive_int(block_q, "block_q")
    if block_k is not None:
        block_k = check_positive_int(block_k, "block_k")
    if num_threads is not None:
        num_threads = check_positive_int(num_threads, "num_threads")
    T, S, Dv = problem.T, problem.S, problem.Dv
    dtype = problem.work_dtype
    if S == 0 or T == 0 or 0 in problem.batch_shape:
        out = np.zeros((*problem.batch_shape, T, Dv), dtype=dtype)
        lse = np.full((*problem.batch_shape, T), -np.inf, dtype=dtype)
        m, l = np.zeros_like(lse), np.zeros_like(lse)
        if problem.sinks is not None:  # no key: lse = s, as m + log(l) with m = s, l = 1
            lse[...] = problem.sinks
            has_sink = lse > -np.inf
            m[has_sink], l[has_sink] = lse[has_sink], 1
        if mark:
            out, lse, _ = mark_poisoned(problem, out, lse)
        return (out, lse, m, l) if return_stats else (out, lse)
    sizes = (problem, block_q, block_k, num_threads)
    plan = _make_plan(*sizes, with_stats=return_stats, exp=exp)
    top = _run(plan, num_threads, stats)
    if values_may_be_out_of_range(top):
        v_exp = value_exponents(problem.value, S)
        if v_exp is not None:  # computed again, on values scaled into range
            plan = _make_plan(*sizes, with_stats=return_stats, exp=exp, v_exp=v_exp)
            _run(plan, num_threads, stats)
    bs = problem.batch_shape
    out, lse = plan.out.reshape(*bs, T, Dv), plan.lse.reshape(*bs, T)
    if mark:
        out, lse, _ = mark_poisoned(problem, out, lse)
    if return_stats:
        return out, lse, plan.m.reshape(*bs, T), plan.l.reshape(*bs, T)
    return out, lse
