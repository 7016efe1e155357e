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
The result equals the formula up to rounding, and the extra memory is a few tiles per worker
thread instead of ``T * S`` numbers per head.

What matters for speed on a CPU, where every NumPy call is a full pass over a tile:

* the shift ``m`` is moved lazily: a row keeps its shift while no term ``exp(score - m)`` can
  exceed ``exp(LAZY_MARGIN)``, which the tile's row sums prove. Then nothing overflows, so the
  result is exact to rounding although ``m`` may lag behind the true maximum; only a tile that
  breaks the bound is recomputed with a new shift (the classical rescaling). Without a mask or
  a bias every row starts at ``m = 0``: exact unless the row's scores all lie more than
  ``LAZY_MARGIN`` below zero, which its final sum ``l`` shows (the unit is then redone from
  the exact step); a worker whose last unit's shifts ended farther than ``LAZY_MARGIN`` from
  zero starts its next unit from the exact step. Most tiles thus cost two matrix products, one exponential and one
  matrix-vector product for the row sums (``p @ 1``, cheaper than a column of ones on the
  values, which widens the second product past BLAS's panel width): no pass for the row
  maximum, none for the subtraction, no rescaling of ``acc``;
* once a shift has moved, it is folded into the first product, ``[q * scale | -m] @ [k | 1]^T``
  (the unit's keys are then copied once, with a column of ones);
* exactness whatever the bias: the rescaling step works on the raw scores (nothing folded in,
  rounded as the reference path rounds them, in base e: base 2 is used only without a bias),
  and a shift is folded in only while
  ``|m| <= FOLD_LIMIT``. A row whose scores are dominated by a huge bias (a float mask of
  ``finfo.min`` or ``-1e9``, as padding masks are often written) subtracts its shift after the
  product instead, since ``fl(q.k - m)`` would round ``q.k`` away;
* the exponential is ``exp2`` on scores in base 2 (the query's scale times ``log2(e)``) where
  NumPy's ``exp2`` is the faster (:func:`tile_exponential`), except with a float bias;
* blocks entirely outside a causal or sliding-window band are never visited, and blocks
  entirely inside it are not masked; only the blocks the band's edge crosses are masked;
* independent work units (one query block of one head, with the query rows of all heads that
  share a key/value head folded in, so each key tile is loaded once for the whole group) are
  shared out among threads started for the call (:func:`sdpa.threads.run_in_threads`), with
  BLAS held to one thread: NumPy releases the GIL inside matrix products and ufunc loops, so
  the threads run in parallel, and BLAS's own threading parallelises each small product badly.

Shape letters: ``T`` queries, ``S`` keys, ``Dk``/``Dv`` head widths, ``Bq``/``Bk`` tile sizes,
``F`` query heads folded into the rows of one tile (``G`` under grouped-query attention).
"""

from __future__ import annotations

import functools
import itertools
import math
import platform
import sys
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

__all__ = [
    "BLOCK_K",
    "BLOCK_ROWS",
    "BLOCK_ROWS_FULL",
    "FOLD_LIMIT",
    "LAZY_MARGIN",
    "TileStats",
    "attention_tiled",
    "svml_exp2",
    "tile_exponential",
    "tile_map",
]

# Tile sizes, chosen by measurement on a 2-core AMD EPYC (Zen 3, 512 KiB L2 per core); see
# benchmarks/tune.py. ``BLOCK_ROWS`` is the number of query rows per tile *after* folding the
# heads of a group, so the tile of scores is at most BLOCK_ROWS x BLOCK_K.
#: Default query rows per tile, after folding the heads of a group, by working dtype.
BLOCK_ROWS = {np.dtype(np.float32): 256, np.dtype(np.float64): 256}
# Without a causal mask or a window every tile is full, and longer tiles cost less per score:
# fewer work units and NumPy calls, larger products (4 x 8 heads of T = S = 1024 on 2 cores of
# an AMD EPYC Zen 4: 1024 rows took 0.95 of the time of 512 in float32 and 0.92 in float64;
# 512 took 0.92 of the time of 256 on one core). Under a band the shorter tiles win: they
# follow the diagonal more closely.
#: Default query rows per tile when no causal mask or window limits the keys, by working dtype
#: (lowered to ``BLOCK_ROWS`` at least, so that every thread still gets a work unit).
BLOCK_ROWS_FULL = {np.dtype(np.float32): 1024, np.dtype(np.float64): 1024}
#: Default keys per tile, by working dtype.
BLOCK_K = {np.dtype(np.float32): 512, np.dtype(np.float64): 256}

SKIPPED, PARTIAL, FULL = 0, 1, 2  # what the band does to a tile
_EVERY_KEY = object()  # a tile whose every score the user's boolean mask disallows

# Lazy rescaling: a row keeps its shift m while its scores stay below m + LAZY_MARGIN, so most
# tiles need neither a row-maximum pass nor a rescaling of the accumulator. A tile is accepted
# when every row sum of exp(scores - m) is at most LAZY_BOUND, which bounds each term.
#: How far above a row's shift ``m`` a score may lie before the shift must move.
LAZY_MARGIN = 20.0
LAZY_BOUND = float(np.exp(LAZY_MARGIN))
LAZY_FLOOR = float(np.exp(-LAZY_MARGIN))  # the least l of a row that starts at m = 0


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
    """Everything a worker needs, as views shaped ``(*outer, F, ...)`` or ``(*outer, ...)``."""

    q: np.ndarray  # (*outer, F, T, Dk)
    k: np.ndarray  # (*outer, S, Dk) view of the keys
    v: np.ndarray  # (*outer, S, Dv) view of the values
    allowed: np.ndarray | None  # (*outer, F, T, S) bool view, or None
    bias: np.ndarray | None  # (*outer, F, T, S) view, or None
    out: np.ndarray  # (*outer, F, T, Dv), written by the workers
    lse: np.ndarray  # (*outer, F, T)
    m: np.ndarray | None  # (*outer, F, T): the final shift of each row, when asked for
    ell: np.ndarray | None  # (*outer, F, T): the row sums at that shift, when asked for
    scale: float  # the query's factor: the scale, times LOG2E in base 2
    unit: float  # scores are in units of 1 / unit: 1.0 (base e) or LOG2E (base 2)
    fold_limit: float  # FOLD_LIMIT in those units
    offset: int
    lo: int | None
    hi: int | None
    T: int
    S: int
    Dk: int
    Dv: int
    F: int
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
    """``(F, block_q, block_k)``: the heads folded into a tile's rows and the tile sizes.

    The last batch axis is folded into the query rows when keys and values do not vary along
    it (``F`` of its heads share one key tile); both tile sizes are clipped to the problem's
    ``T`` and ``S``; ``block_q`` defaults to about ``BLOCK_ROWS``
    rows after folding, ``block_k`` to ``BLOCK_K``. Without a band (no causal mask, no
    window) the rows go up to ``BLOCK_ROWS_FULL``, as long as the ``num_threads`` threads
    (default :func:`sdpa.threads.default_num_threads`) still get a work unit each.
    """
    F = problem.batch_shape[-1] if _fold_axis(problem) else 1
    if block_q is None:
        rows = BLOCK_ROWS.get(problem.work_dtype, 128)
        if problem.band == (None, None):
            outer = int(np.prod(problem.batch_shape, dtype=np.int64)) // F
            blocks = -(-(num_threads or default_num_threads()) // max(outer, 1))  # per head
            rows_per_block = F * -(-problem.T // blocks)  # the rows, split into `blocks`
            rows = max(rows, min(BLOCK_ROWS_FULL.get(problem.work_dtype, rows), rows_per_block))
        block_q = max(1, rows // F)
    if block_k is None:
        block_k = BLOCK_K.get(problem.work_dtype, 512)
    # Never larger than the problem: the workers' buffers are sized by the tiles.
    return F, int(min(block_q, max(problem.T, 1))), int(min(block_k, max(problem.S, 1)))


LOG2E = 1 / math.log(2)  # 2 ** (x * LOG2E) = e ** x


def tile_exponential(dtype) -> Callable[..., np.ndarray]:
    """``numpy.exp2`` where NumPy computes it with SVML for ``dtype``, else ``numpy.exp``: the
    default exponential of :func:`attention_tiled`.

    Decided from what the machine and NumPy's build are, never from a timing, so that every
    process on one machine computes the same bits: ``exp2`` for float32 on Linux x86-64 when
    NumPy dispatches its AVX-512 (SKX) loops, which hand float32 ``exp2`` to Intel's vector
    math library SVML. There it ran 1.8 to 2.1 times as fast as ``exp`` (Intel Xeon Sapphire
    Rapids, AMD EPYC Zen 4) and is correctly rounded to within 1 ulp (``exp`` to 2.4 ulp).
    Float64 ``exp2`` gained at most 15 % there, and elsewhere ``exp2`` may be a scalar loop,
    many times slower, so both take ``exp``. (SVML's ``exp2`` is slow on ``-inf`` and on
    results that underflow: the kernel zeroes a tile's disallowed entries after the
    exponential rather than set them to ``-inf`` before it.)

    Parameters
    ----------
    dtype : dtype-like
        The working dtype of the scores.

    Returns
    -------
    numpy.ufunc
        ``numpy.exp2`` or ``numpy.exp``.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa.tiled import tile_exponential
    >>> tile_exponential(np.float64) is np.exp  # exp2 is never chosen in float64
    True
    >>> tile_exponential(np.float32) is (np.exp2 if svml_exp2() else np.exp)
    True
    """
    return np.exp2 if np.dtype(dtype) == np.float32 and svml_exp2() else np.exp


@functools.cache
def svml_exp2() -> bool:
    """Whether NumPy computes float32 ``exp2`` with SVML here: Linux, x86-64, and the AVX-512
    (SKX) loops enabled (``NPY_DISABLE_CPU_FEATURES`` can turn them off).

    Returns
    -------
    bool
        What NumPy's build and its CPU-feature detection say; the same in every process.

    Examples
    --------
    >>> from sdpa.tiled import svml_exp2
    >>> svml_exp2() in (True, False)
    True
    """
    if sys.platform != "linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        from numpy._core._multiarray_umath import __cpu_features__
    except ImportError:  # pragma: no cover - NumPy 1.x
        from numpy.core._multiarray_umath import __cpu_features__
    return bool(__cpu_features__.get("AVX512_SKX", False))


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
    F, block_q, block_k = tile_plan_sizes(problem, block_q, block_k, num_threads)
    fold = F > 1
    outer = bs[:-1] if fold else bs

    def rows_view(a, last):  # broadcast a (..., T, last) array to (*outer, F, T, last)
        full = np.broadcast_to(a, (*bs, T, last))
        return full if fold else full[..., None, :, :]

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
    unit = LOG2E if base2 else 1.0
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
        out=np.empty((*outer, F, T, Dv), dtype=dtype),
        lse=np.empty((*outer, F, T), dtype=dtype),
        m=np.empty((*outer, F, T), dtype=dtype) if with_stats else None,
        ell=np.empty((*outer, F, T), dtype=dtype) if with_stats else None,
        scale=problem.scale * unit,
        unit=unit,
        fold_limit=FOLD_LIMIT * unit,
        offset=problem.offset,
        lo=lo,
        hi=hi,
        T=T,
        S=S,
        Dk=Dk,
        Dv=Dv,
        F=F,
        block_q=int(block_q),
        block_k=int(block_k),
        dtype=dtype,
        may_overflow=problem.may_overflow,
        problem=problem,
        exp=exp,
        base_exp=np.exp2 if base2 else np.exp,
        v_exp=v_exp,
    )


def _value_exponents(value: np.ndarray, S: int) -> np.ndarray | None:
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
    low = float(finfo.smallest_normal) * 2.0**64
    scale = np.isfinite(top) & (top > 0) & ((top > high) | (top < low))
    if not scale.any():
        return None
    return np.where(scale, np.frexp(top)[1], 0).astype(np.int32)


def _values_may_be_out_of_range(out: np.ndarray) -> bool:
    """Whether a result computed on unscaled values may have lost to the ends of the range.

    Overflow shows in the result as ``inf`` or NaN; digits lost to subnormal numbers show as
    a column whose results are all below ``2 ** 64`` times the smallest normal number. A pass
    over the result, which is far smaller than the values unless ``T`` is close to ``S``:
    only then are the values themselves read (:func:`_value_exponents`).
    """
    if out.size == 0:
        return False
    low = float(np.finfo(out.dtype).smallest_normal) * 2.0**64
    top = np.max(np.abs(out).reshape(-1, out.shape[-1]), axis=0)  # NaN propagates
    return not (top >= low).all() or not np.isfinite(top).all()


# The shift m of a row is folded into the first matrix product only while |m| is at most this.
# Folding computes fl(q.k - m) instead of fl(q.k) - m: its rounding error grows with |m|, which
# costs nothing while m is of the size of the scores (it lags at most LAZY_MARGIN behind their
# maximum), but a row whose scores are dominated by a large bias (a float mask filled with
# finfo.min or -1e9) must subtract m separately, as the reference path does, or q.k is lost.
#: The largest ``|m|`` that is folded into the first matrix product.
FOLD_LIMIT = 64.0


class _Worker:
    """One thread's buffers, allocated once and reused for every work unit it takes.

    A work unit is the query rows ``t0:t1`` of the ``F`` folded heads at one outer index:
    ``rows = F * (t1 - t0)`` rows of scores, walked along their key tiles. :meth:`run` reads
    top to bottom: start the unit, then for each key tile its mask, the lazy step (accepted
    when its row sums prove it exact) or else the exact step, and at the end the result.
    Each step is a small method; the unit's running state lives on the worker meanwhile.
    """

    def __init__(self, plan: _Plan):
        rows = plan.F * plan.block_q
        bk = min(plan.block_k, plan.S)
        dtype = plan.dtype
        self.plan = plan
        # One buffer per stage of a tile (flat, viewed at each unit's size):
        self.q_shifted_buf = np.empty(rows * (plan.Dk + 1), dtype)  # [query * scale | -m]
        self.scores_buf = np.empty(rows * bk, dtype)  # scores, then exp(scores - m) in place
        self.disallowed_buf = np.empty(rows * bk, bool) if plan.allowed is not None else None
        self.tile_out_buf = np.empty(rows * plan.Dv, dtype)  # exp(scores - m) @ v
        self.tile_ell_buf = np.empty(rows, dtype)  # exp(scores - m) @ 1: the row sums
        self.acc_buf = np.empty(rows * plan.Dv, dtype)  # running sum of exp(scores - m) @ v
        self.ell_buf = np.empty(rows, dtype)  # running sum of exp(scores - m): l
        self.ones = np.ones(bk, dtype)
        # [k | 1] of a unit's head, (S, Dk + 1): made (by copying the keys) only for a unit
        # that folds a shift into the first product, which inputs of moderate scores never do
        self.k1_buf: np.ndarray | None = None
        self.m_buf = np.empty(rows, dtype)  # running shift of each row
        self.unfolded_buf = np.empty(rows, dtype)  # m of the rows whose shift is not folded in
        self.band_cache: dict = {}
        self.computed = 0
        self.skipped_mask = 0
        self.rescaled = 0
        self.redone = 0
        self.retried = 0

    # -- one work unit ---------------------------------------------------------------------

    def run(self, o: tuple, t0: int, t1: int) -> None:
        """Attention for the query rows ``t0:t1`` of every folded head at outer index ``o``.

        Without a mask or a bias the unit first tries the shift ``m = 0`` for every row (see
        :meth:`start_unit`); if a row's scores turn out too small for it, the unit is walked
        again from the exact step. What a unit computes depends on its own inputs only, not
        on the units the worker took before it, so that every thread count and every order in
        which the threads take the units give the same bits.
        """
        plan = self.plan
        at_zero = plan.allowed is None and plan.bias is None and not plan.may_overflow
        self.start_unit(o, t0, t1, at_zero)
        if not self.walk(t0, t1, at_zero):
            self.redone += 1
            self.start_unit(o, t0, t1, at_zero=False)
            self.walk(t0, t1, at_zero=False)
        self.write_result(o, t0, t1)

    def walk(self, t0: int, t1: int, at_zero: bool) -> bool:
        """Add up the unit's key tiles: for each, its mask, then the lazy or the exact step.

        Returns False when a unit started ``at_zero`` must be redone: a row's sum ``l`` is
        below ``LAZY_FLOOR`` at the end, or already after the first tile for a row that met a
        key there (so scores far below zero waste one tile, not the whole walk).
        """
        plan = self.plan
        first, stop = _key_block_range(t0, t1, plan.S, plan.block_k, plan.offset, plan.lo, plan.hi)
        key_start, key_stop = _band_keys(t0, t1, plan.S, plan.offset, plan.lo, plan.hi)
        for b in range(first, stop):
            # The tile's keys, trimmed to the keys the band allows to some query of the block
            # (under a causal mask the last tile of a row of tiles stops at the diagonal).
            s0 = max(b * plan.block_k, key_start)
            s1 = min((b + 1) * plan.block_k, key_stop)
            disallowed = self.tile_disallowed(t0, t1, s0, s1)
            if disallowed is _EVERY_KEY:
                self.skipped_mask += 1
                continue
            self.computed += 1
            lazy = self.all_started and not plan.may_overflow
            if not (lazy and self.lazy_step(s0, s1, disallowed)):
                self.retried += lazy
                self.exact_step(s0, s1, disallowed)
            if at_zero and b == first and not self.sums_hold(self.rows_meeting(t0, t1, s0, s1)):
                return False
        return not at_zero or self.sums_hold(slice(None))

    def sums_hold(self, rows) -> bool:
        """Whether every one of ``rows`` has ``l >= LAZY_FLOOR`` (NaN fails too)."""
        ell = self.ell[rows]
        return ell.size == 0 or bool(ell.min() >= LAZY_FLOOR)

    def rows_meeting(self, t0: int, t1: int, s0: int, s1: int) -> np.ndarray:
        """``(rows,)`` bool: the unit's rows that the band allows some key of ``s0:s1``."""
        plan = self.plan
        i = np.arange(t0, t1) + plan.offset
        meets = np.ones(t1 - t0, dtype=bool)
        if plan.lo is not None:
            meets &= i + plan.lo <= s1 - 1
        if plan.hi is not None:
            meets &= i + plan.hi >= s0
        return np.tile(meets, plan.F)

    def start_unit(self, o: tuple, t0: int, t1: int, at_zero: bool) -> None:
        """Views of the unit's inputs and buffers; the running state at its initial values.

        With ``at_zero`` every row starts at the shift ``m = 0``, so the first tile can take
        the lazy step on the raw scores: ``exp(score)`` is exact while the scores stay within
        ``LAZY_MARGIN`` of zero, which the tile's row sums check from above; from below, a
        row whose sum ``l`` ends under ``exp(-LAZY_MARGIN)`` (all its scores below
        ``-LAZY_MARGIN``, or none allowed) makes :meth:`run` redo the unit. Otherwise a row
        starts once it meets an allowed key, in the exact step, at that tile's maximum.
        """
        plan = self.plan
        F, Dk, bq = plan.F, plan.Dk, t1 - t0
        rows = F * bq
        self.rows, self.t0, self.t1 = rows, t0, t1
        # q_shifted = [query * scale | -m]: (rows, Dk + 1), the folded heads' rows one under
        # the other. Against keys with a column of ones, [k | 1], one product gives the scores
        # minus the running shift m, so no separate pass subtracts it.
        self.q_shifted = self.q_shifted_buf[: rows * (Dk + 1)].reshape(rows, Dk + 1)
        np.multiply(
            plan.q[o][:, t0:t1, :], plan.scale, out=self.q_shifted.reshape(F, bq, Dk + 1)[..., :Dk]
        )
        self.q_scaled = self.q_shifted[:, :Dk]  # (rows, Dk)
        self.folded = self.q_shifted[:, Dk]  # -m for the rows whose shift is folded in, else 0
        self.folded.fill(0)
        self.any_folded = False  # while no shift is folded in, the keys need no column of ones
        self.k = plan.k[o]  # (S, Dk)
        self.k1 = None  # (S, Dk + 1), [k | 1], made once a shift is folded in
        self.allowed = None if plan.allowed is None else plan.allowed[o]  # (F, T, S)
        self.bias = None if plan.bias is None else plan.bias[o]  # (F, T, S)
        self.m = self.m_buf[:rows]  # the shift of each row; 0 until it has met an allowed key
        self.m.fill(0)
        self.unfolded = self.unfolded_buf[:rows]  # m for the rows not folded in, else 0
        self.unfolded.fill(0)
        self.any_unfolded = False
        self.started = np.full(rows, at_zero)  # rows whose shift m is set
        self.all_started = at_zero
        self.acc = self.acc_buf[: rows * plan.Dv].reshape(rows, plan.Dv)
        self.acc.fill(0)
        self.ell = self.ell_buf[:rows]
        self.ell.fill(0)
        self.tile_out = self.tile_out_buf[: rows * plan.Dv].reshape(rows, plan.Dv)
        self.tile_ell = self.tile_ell_buf[:rows]
        self.v = plan.v[o]  # (S, Dv)

    # -- once per tile ---------------------------------------------------------------------

    def tile_disallowed(self, t0: int, t1: int, s0: int, s1: int):
        """``(F, bq, bk)`` bool, True where the tile's scores are disallowed; None if none is;
        ``_EVERY_KEY`` if the user's mask disallows the whole tile (it is then skipped)."""
        plan = self.plan
        kind = _tile_kind(t0, t1, s0, s1, plan.offset, plan.lo, plan.hi)
        assert kind != SKIPPED, "the key-block range holds only tiles the band touches"
        if self.allowed is None:
            return self.band_disallowed(t0, t1, s0, s1) if kind == PARTIAL else None
        disallowed = self.disallowed_buf[: self.rows * (s1 - s0)].reshape(plan.F, t1 - t0, s1 - s0)
        np.logical_not(self.allowed[:, t0:t1, s0:s1], out=disallowed)
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

    def lazy_step(self, s0: int, s1: int, disallowed) -> bool:
        """The common case: add the tile at the current shift ``m``; False if it is not exact.

        ``exp(scores - m)`` is exact as long as no score exceeds ``m`` by more than
        ``LAZY_MARGIN`` (then nothing overflows), which the tile's row sums prove; and ``l``
        stays large enough: ``l >= 1`` once ``m`` is an actual score, ``l >= LAZY_FLOOR`` at
        the shift 0 (checked by :meth:`walk` after the first tile and at the unit's end). A tile that fails is redone by
        :meth:`exact_step`.

        Disallowed entries are zeroed after the exponential rather than set to ``-inf``
        before it: NumPy's vectorised ``exp2`` takes a slow path for ``-inf`` (a causal
        diagonal tile took 2.7 times as long).
        """
        plan = self.plan
        scores = self.scores_buf[: self.rows * (s1 - s0)].reshape(self.rows, s1 - s0)
        unfolded = self.unfolded if self.any_unfolded else None
        self.shifted_scores(scores, s0, s1, None, unfolded)
        plan.exp(scores, out=scores)  # the probabilities, unnormalised: exp(scores - m)
        if disallowed is not None:
            np.copyto(scores.reshape(plan.F, -1, s1 - s0), 0, where=disallowed)
        # The row sums first: a tile that fails the bound costs no second product.
        np.matmul(scores, self.ones[: s1 - s0], out=self.tile_ell)  # (rows, bk) @ (bk,)
        if not self.tile_ell.max() <= LAZY_BOUND:  # (NaN fails too)
            return False
        np.matmul(scores, self.v[s0:s1], out=self.tile_out)  # (rows, bk) @ (bk, Dv)
        self.acc += self.tile_out
        self.ell += self.tile_ell
        return True

    def exact_step(self, s0: int, s1: int, disallowed) -> None:
        """The online softmax as written, on the raw scores, moving each row's shift ``m``.

        The raw scores (nothing folded in, so in base e they are rounded exactly as the
        reference path rounds them) give the new maximum ``m_new = max(m, rowmax)``; the old sums are rescaled
        by ``alpha = exp(m - m_new)``. A row meeting its first allowed key starts at that
        tile's maximum. Then the shift is folded into ``q_shifted`` again for the rows where
        that is exact (``|m| <= FOLD_LIMIT``), and kept in ``unfolded`` for the others.
        """
        plan = self.plan
        self.rescaled += 1
        m, started = self.m, self.started
        scores = self.scores_buf[: self.rows * (s1 - s0)].reshape(self.rows, s1 - s0)
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
        self.ell *= alpha
        self.ell += self.tile_ell
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

    def tile_products(self, probs: np.ndarray, s0: int, s1: int) -> None:
        """``tile_out = probs @ v`` and the row sums ``tile_ell = probs @ 1`` of one tile.

        The row sums are a matrix-vector product: it reads the tile once more, from cache,
        which costs less than a column of ones appended to the values. For ``Dv = 64`` on a
        512 x 512 float32 tile (AMD EPYC Zen 4, one core): 65 columns took 1.18 times as long
        as 64, 72 (padded to BLAS's panel width) 1.13 times, and ``probs @ 1`` adds 0.05;
        NumPy's ``probs.sum(axis=1)`` would add 0.14.
        """
        np.matmul(probs, self.v[s0:s1], out=self.tile_out)  # (rows, bk) @ (bk, Dv)
        np.matmul(probs, self.ones[: s1 - s0], out=self.tile_ell)  # (rows, bk) @ (bk,)

    def keys_with_ones(self) -> np.ndarray:
        """``[k | 1]``: the unit's keys with a column of ones, ``(S, Dk + 1)``."""
        plan = self.plan
        if self.k1_buf is None:
            self.k1_buf = np.empty((plan.S, plan.Dk + 1), plan.dtype)
            self.k1_buf[:, plan.Dk] = 1
        self.k1_buf[:, : plan.Dk] = self.k
        return self.k1_buf

    def shifted_scores(self, scores, s0, s1, disallowed, unfolded, check=False) -> None:
        """``scores = scale * q k^T - folded + bias - unfolded`` on one tile (each row's shift
        ``m`` is in ``folded`` or in ``unfolded``), disallowed entries set to ``-inf``.

        With ``check``, the raw scores (nothing subtracted) are checked for overflow first.
        """
        plan = self.plan
        if self.any_folded:
            if self.k1 is None:
                self.k1 = self.keys_with_ones()
            np.matmul(self.q_shifted, self.k1[s0:s1].T, out=scores)  # (rows, Dk+1) @ (Dk+1, bk)
        else:
            np.matmul(self.q_scaled, self.k[s0:s1].T, out=scores)  # (rows, Dk) @ (Dk, bk)
        bias = None if self.bias is None else self.bias[:, self.t0 : self.t1, s0:s1]
        if bias is None and disallowed is None and unfolded is None and not check:
            return
        scores3 = scores.reshape(plan.F, -1, scores.shape[1])  # (F, bq, bk)
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

    def write_result(self, o: tuple, t0: int, t1: int) -> None:
        """``out = acc / l`` and ``lse = m + log l``; rows that never met an allowed key have
        ``l = 0``, ``out = 0`` and ``lse = -inf``."""
        plan = self.plan
        F, Dv, bq, rows = plan.F, plan.Dv, t1 - t0, self.rows
        self.folded.fill(0)
        ell = self.ell
        seen = ell > 0
        inv = np.zeros(rows, dtype=plan.dtype)
        np.divide(1, ell, out=inv, where=seen)
        out = plan.out[o][:, t0:t1, :]  # (F, bq, Dv) view of the result
        np.multiply(self.acc.reshape(F, bq, Dv), inv.reshape(F, bq, 1), out=out)
        if plan.v_exp is not None:
            np.ldexp(out, plan.v_exp, out=out)  # undo the values' scaling (exact)
        m = self.m if plan.unit == 1.0 else self.m / plan.unit  # the shift in natural units
        lse = np.full(rows, -np.inf, dtype=plan.dtype)
        np.log(ell, out=lse, where=seen)
        np.add(lse, m, out=lse, where=seen)
        plan.lse[o][:, t0:t1] = lse.reshape(F, bq)
        if plan.m is not None:
            plan.m[o][:, t0:t1] = m.reshape(F, bq)
            plan.ell[o][:, t0:t1] = ell.reshape(F, bq)

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


def _run(plan: _Plan, num_threads: int | None, stats: TileStats | None) -> None:
    """Share the plan's work units out among worker threads; add their counts to ``stats``."""
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
        stats.units += len(work)
        stats.computed += sum(w.computed for w in workers)
        stats.skipped_mask += sum(w.skipped_mask for w in workers)
        stats.rescaled += sum(w.rescaled for w in workers)
        stats.redone += sum(w.redone for w in workers)
        stats.retried += sum(w.retried for w in workers)
        stats.skipped_band += total - sum(u[0] for u in units)


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
        Also return ``m`` and ``ell``: ``lse = m + log(ell)`` in two parts, the shift ``m``
        (close to the row maximum) and the row sum ``ell`` at that shift, which the backward
        pass needs when ``lse`` is too large for its rounding to be negligible.
    mark : bool, default True
        Set to NaN the rows of ``out`` and ``lse`` that a non-finite input reaches (not those
        of ``m`` and ``ell``); the backward pass marks its own.
    exp : callable, optional
        The elementwise exponential applied to each tile in place, as ``exp(x, out=x)``: the
        one pass over each tile that no trick removes. ``numpy.exp2`` computes the scores in
        base 2 (the query's scale times ``log2(e)``, so that ``2 ** score`` is the usual
        ``e ** score``), except with a float mask or where a score may overflow, which take
        ``numpy.exp``. Default: :func:`tile_exponential`, whichever of the two is faster here.
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
    m, ell : np.ndarray
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
        m, ell = np.zeros_like(lse), np.zeros_like(lse)
        if mark:
            out, lse, _ = mark_poisoned(problem, out, lse)
        return (out, lse, m, ell) if return_stats else (out, lse)
    sizes = (problem, block_q, block_k, num_threads)
    plan = _make_plan(*sizes, with_stats=return_stats, exp=exp)
    _run(plan, num_threads, stats)
    if _values_may_be_out_of_range(plan.out):
        v_exp = _value_exponents(problem.value, S)
        if v_exp is not None:  # computed again, on values scaled into range
            plan = _make_plan(*sizes, with_stats=return_stats, exp=exp, v_exp=v_exp)
            _run(plan, num_threads, stats)
    bs = problem.batch_shape
    out, lse = plan.out.reshape(*bs, T, Dv), plan.lse.reshape(*bs, T)
    if mark:
        out, lse, _ = mark_poisoned(problem, out, lse)
    if return_stats:
        return out, lse, plan.m.reshape(*bs, T), plan.ell.reshape(*bs, T)
    return out, lse
