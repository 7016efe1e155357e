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

* the row sums ``l`` come out of the second matrix product for free: each key block multiplies
  the values with a column of ones appended (``[V | 1]``), so ``acc[:, Dv]`` is ``l``;
* the shift ``m`` is folded into the first product, ``[q * scale | -m] @ [k | 1]^T``, and it
  is moved lazily: a row keeps its shift while no term ``exp(score - m)`` can exceed
  ``exp(LAZY_MARGIN)``, which the tile's row sums (from the second product) prove. Then nothing
  overflows and ``l >= 1``, so the result is exact to rounding although ``m`` may lag behind
  the true maximum; only a tile that breaks the bound is recomputed with a new shift (the
  classical rescaling). Most tiles thus cost two matrix products and one ``exp``: no pass for
  the row maximum, none for the subtraction, no rescaling of ``acc``;
* exactness whatever the bias: the rescaling step works on the raw scores (nothing folded in,
  rounded exactly as the reference path rounds them), and a shift is folded in only while
  ``|m| <= FOLD_LIMIT``. A row whose scores are dominated by a huge bias (a float mask of
  ``finfo.min`` or ``-1e9``, as padding masks are often written) subtracts its shift after the
  product instead, since ``fl(q.k - m)`` would round ``q.k`` away;
* blocks entirely outside a causal or sliding-window band are never visited, and blocks
  entirely inside it are not masked; only the blocks the band's edge crosses are masked;
* independent work units (one query block of one head, with the query rows of all heads that
  share a key/value head folded in, so each key tile is loaded once for the whole group) run in
  a pool of worker threads while BLAS is held to one thread each (with ``threadpoolctl``):
  NumPy releases the GIL inside matrix products and ufunc loops, so the threads run in
  parallel. BLAS's own threading parallelises each small product badly.

Shape letters: ``T`` queries, ``S`` keys, ``Dk``/``Dv`` head widths, ``Bq``/``Bk`` tile sizes,
``F`` query heads folded into the rows of one tile (``G`` under grouped-query attention).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from ._checks import (
    check_alignment,
    check_bool,
    check_nonneg_int,
    check_positive_int,
    check_window,
)

__all__ = ["tile_map"]

# Tile sizes, chosen by measurement on a 2-core AMD EPYC (Zen 3, 512 KiB L2 per core); see
# benchmarks/tune.py. ``BLOCK_ROWS`` is the number of query rows per tile *after* folding the
# heads of a group, so the tile of scores is at most BLOCK_ROWS x BLOCK_K.
BLOCK_ROWS = {np.dtype(np.float32): 256, np.dtype(np.float64): 256}
BLOCK_K = {np.dtype(np.float32): 512, np.dtype(np.float64): 256}

SKIPPED, PARTIAL, FULL = 0, 1, 2  # what the band does to a tile

# Lazy rescaling: a row keeps its shift m while its scores stay below m + LAZY_MARGIN, so most
# tiles need neither a row-maximum pass nor a rescaling of the accumulator. A tile is accepted
# when every row sum of exp(scores - m) is at most LAZY_BOUND, which bounds each term.
LAZY_MARGIN = 20.0
LAZY_BOUND = float(np.exp(LAZY_MARGIN))

# The values travel with a column of ones (their product with the probabilities is the row sum
# l) and zeros up to a multiple of this width: BLAS kernels work on panels of 4 or 8 columns, and
# a product with Dv + 1 = 65 columns ran about 20 % slower than one with 72 (float32).
VALUE_WIDTH_MULTIPLE = 8

# The elementwise exponential of the tiles, NumPy's own. It is the one pass over each tile that no
# trick removes, and NumPy's exp costs far more than a compiled kernel's vectorised one; the
# benchmark (benchmarks/run.py, "where the time goes") swaps it for a multiplication to measure
# that share. Nothing else should touch it.
_tile_exp = np.exp


@dataclass
class TileStats:
    """Counters filled by :func:`attention_tiled` when asked (a test and teaching hook)."""

    computed: int = 0  # tiles whose scores were computed
    rescaled: int = 0  # computed tiles that moved the shift m (each unit's first tile, at least)
    skipped_band: int = 0  # tiles never visited: entirely outside the causal/window band
    skipped_mask: int = 0  # tiles dropped because the boolean mask disallows all of them
    per_worker: list = field(default_factory=list)


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
    from .masks import alignment_offset, band_limits

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


# Below this many scores (summed over heads) the reference path is as fast or faster whatever
# the shapes: the tiled path pays for Python-level loops and thread hand-offs.
MIN_TILED_SCORES = 1 << 17

# The cost model behind implementation="auto": wall time in microseconds on idle cores.
# Counting scores alone (the rule until issue 9) sent 20000 heads of 4 x 4 scores to the tiled
# path, 32 times slower than the reference path: every work unit and every tile costs a fixed
# amount of Python and NumPy call overhead that small heads cannot amortise. The constants come
# from `benchmarks/tune.py auto` on the 2-core benchmark machine: single-thread CPU times of
# both paths over 70 shapes, fitted term by term (CPU time, unlike wall time, stays put while
# other processes share the machine), then spread over the cores each part runs on: the tiled
# path's work over its workers, the reference path's products (the term in the head width)
# over BLAS's threads; its softmax passes run on one core.
REFERENCE_COST = dict(
    call=60.0,  # validation and dispatch (estimated: tiny calls' wall time is noise when shared)
    matrix=0.5,  # per (T, S) matrix: the batched products' loop
    io=0.001,  # per entry of the inputs read per matrix, (T + S) (Dk + Dv): small products
    score=0.0064,  # per score: the softmax's passes, one core
    score_width=0.000015,  # per score and unit of Dk + Dv: the two products, on BLAS's threads
    masked=0.003,  # per score, with a mask or a band: one more pass
)
TILED_COST = dict(
    call=250.0,  # validation, the plan, starting the worker threads (estimated, as above)
    unit=95.0,  # per work unit: its first tile and its bookkeeping
    tile=20.0,  # per further tile (the fit cannot separate it from the unit; a floor)
    score=0.0037,  # per computed score: exp and the row sums
    score_width=0.000045,  # per computed score and unit of Dk + Dv: the two products
)


def tiling_geometry(problem, block_q=None, block_k=None) -> tuple[int, int, int, int]:
    """``(units, tiles, scores, workers)`` that the tiled path would use for ``problem``.

    ``units`` are the independent work units (one block of query rows of one head, with the
    heads that share keys folded in), ``tiles`` the tiles it computes (those the causal/window
    band skips are not counted; those a boolean mask turns out to disallow are), ``scores``
    the entries of those tiles. Computed from the shapes, without touching the data.
    """
    bs = problem.batch_shape
    T, S = problem.T, problem.S
    F = bs[-1] if _fold_axis(problem) else 1
    outer = int(np.prod(bs, dtype=np.int64)) // max(F, 1)
    dtype = problem.work_dtype
    bq = max(1, BLOCK_ROWS.get(dtype, 128) // F) if block_q is None else block_q
    bk = BLOCK_K.get(dtype, 512) if block_k is None else block_k
    t0 = np.arange(0, T, bq, dtype=np.int64)  # the first query of each block
    t1 = np.minimum(t0 + bq, T)
    lo, hi = problem.band
    start = np.zeros_like(t0) if lo is None else np.maximum(0, t0 + problem.offset + lo)
    stop = np.full_like(t0, S) if hi is None else np.minimum(S, t1 + problem.offset + hi)
    stop = np.maximum(start, stop)
    n_tiles = np.where(stop > start, -(-stop // bk) - start // bk, 0)
    units = outer * t0.size
    tiles = outer * int(n_tiles.sum())
    scores = outer * F * int(((t1 - t0) * (stop - start)).sum())
    workers = min(default_workers(), max(units, 1))
    return units, tiles, scores, workers


def estimated_times(problem) -> tuple[float, float]:
    """``(reference, tiled)``: the cost model's estimate of both paths' wall time, in us."""
    T, S, Dk, Dv = problem.T, problem.S, problem.Dk, problem.Dv
    n_matrices = int(np.prod(problem.batch_shape, dtype=np.int64))
    n_scores = n_matrices * T * S
    width = Dk + Dv
    masked = problem.allowed is not None or problem.bias is not None or problem.band != (None, None)
    r = REFERENCE_COST
    reference = (
        r["call"]
        + n_matrices * (r["matrix"] + r["io"] * (T + S) * width)
        + n_scores * (r["score"] + r["score_width"] * width + r["masked"] * masked)
    )
    units, tiles, scores, workers = tiling_geometry(problem)
    c = TILED_COST
    work = (
        c["unit"] * units
        + c["tile"] * max(0, tiles - units)
        + scores * (c["score"] + c["score_width"] * width)
    )
    return reference, c["call"] + work / workers


def worth_tiling(problem) -> bool:
    """Whether ``implementation="auto"`` should take the tiled path for this problem.

    Never below ``MIN_TILED_SCORES`` scores; above, when the cost model predicts the tiled
    path to be faster (:func:`estimated_times`), or when the reference path's ``(T, S)``
    matrices would take more than a quarter of the available memory.
    """
    n_scores = int(np.prod(problem.batch_shape, dtype=np.int64)) * problem.T * problem.S
    if n_scores < MIN_TILED_SCORES:
        return False
    reference, tiled = estimated_times(problem)
    if tiled < reference:
        return True
    need = 3 * n_scores * problem.work_dtype.itemsize
    if need > (1 << 28):  # 256 MiB: worth asking how much memory there is
        from ._checks import available_memory

        available = available_memory()
        return available is not None and need > available / 4
    return False


# ----------------------------------------------------------------------------------------
# Worker threads and BLAS threads
# ----------------------------------------------------------------------------------------

_controller = None
_blas_lock = threading.Lock()
_blas_holders = 0  # calls currently inside single_threaded_blas(), in any thread
_blas_limiter = None  # the threadpoolctl limiter of the first of them; restored by the last


def default_workers() -> int:
    """Number of cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        return os.cpu_count() or 1


@contextlib.contextmanager
def single_threaded_blas():
    """Hold BLAS to one thread for the duration of a call (no-op without threadpoolctl).

    BLAS's thread count is a setting of the whole process, so overlapping calls from several
    threads share one limit: the first call to enter saves the setting and limits it, the last
    to leave restores it. (Each call restoring what it saw on entry would leave BLAS at one
    thread whenever two calls overlap and the first finishes first.)
    """
    global _controller, _blas_holders, _blas_limiter
    with _blas_lock:
        if _blas_holders == 0:
            try:
                from threadpoolctl import ThreadpoolController
            except ImportError:  # pragma: no cover - threadpoolctl is a dependency
                ThreadpoolController = None
            if ThreadpoolController is not None:
                if _controller is None:
                    _controller = ThreadpoolController()  # inspecting the libraries is slow
                _blas_limiter = _controller.limit(limits=1, user_api="blas")
        _blas_holders += 1
    try:
        yield
    finally:
        with _blas_lock:
            _blas_holders -= 1
            if _blas_holders == 0 and _blas_limiter is not None:
                _blas_limiter.restore_original_limits()
                _blas_limiter = None


def run_in_threads(tasks: list) -> list:
    """Run each callable in a thread of its own, with BLAS held to one thread; their results.

    The threads are created for the call rather than kept in a pool. Measured on the 2-core
    benchmark machine, a pool's idle threads, woken together by the calling thread, often
    shared one core for the first tens of milliseconds (Linux wakes a thread near its waker
    and balances the load only later), so a 20 ms problem took 30 to 35 ms; new threads are
    placed on idle cores at once, and creating them costs well under a millisecond.
    """
    with single_threaded_blas(), ThreadPoolExecutor(max_workers=len(tasks)) as pool:
        futures = [pool.submit(task) for task in tasks]
        return [f.result() for f in futures]


# ----------------------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------------------


@dataclass
class _Plan:
    """Everything a worker needs, as views shaped ``(*outer, F, ...)`` or ``(*outer, ...)``."""

    q: np.ndarray  # (*outer, F, T, Dk)
    k1: np.ndarray  # (*outer, S, Dk + 1): keys with a column of ones
    v1: np.ndarray  # (*outer, S, Wv): values, a column of ones, zeros up to the width Wv
    allowed: np.ndarray | None  # (*outer, F, T, S) bool view, or None
    bias: np.ndarray | None  # (*outer, F, T, S) view, or None
    out: np.ndarray  # (*outer, F, T, Dv), written by the workers
    lse: np.ndarray  # (*outer, F, T)
    m: np.ndarray | None  # (*outer, F, T): the final shift of each row, when asked for
    ell: np.ndarray | None  # (*outer, F, T): the row sums at that shift, when asked for
    scale: float
    offset: int
    lo: int | None
    hi: int | None
    T: int
    S: int
    Dk: int
    Dv: int
    Wv: int
    F: int
    block_q: int
    block_k: int
    dtype: np.dtype
    may_overflow: bool  # check every tile's scores for overflow (see attention.check_overflow)
    problem: object  # the AttentionProblem, for error messages


def _fold_axis(problem) -> bool:
    """Fold the last batch axis into the query rows when keys and values do not vary along it."""
    bs = problem.batch_shape
    if not bs or bs[-1] <= 1:
        return False
    for a in (problem.key, problem.value):
        lead = a.shape[:-2]  # right-aligned with bs, and at most as long
        if lead and lead[-1] != 1:
            return False
    return True


def _make_plan(problem, block_q, block_k, with_stats=False) -> _Plan:
    T, S, Dk, Dv = problem.T, problem.S, problem.Dk, problem.Dv
    dtype = problem.work_dtype
    bs = problem.batch_shape
    fold = _fold_axis(problem)
    if fold:
        outer, F = bs[:-1], bs[-1]
    else:
        outer, F = bs, 1

    def rows_view(a, last):  # broadcast a (..., T, last) array to (*outer, F, T, last)
        full = np.broadcast_to(a, (*bs, T, last))
        return full if fold else full[..., None, :, :]

    def keys_view(a, last):  # broadcast a (..., S, last) array to (*outer, S, last)
        if fold:
            return np.broadcast_to(a, (*outer, 1, S, last))[..., 0, :, :]
        return np.broadcast_to(a, (*bs, S, last))

    k1 = np.empty((*problem.key.shape[:-1], Dk + 1), dtype=dtype)
    k1[..., :Dk] = problem.key
    k1[..., Dk] = 1
    Wv = -(-(Dv + 1) // VALUE_WIDTH_MULTIPLE) * VALUE_WIDTH_MULTIPLE
    v1 = np.zeros((*problem.value.shape[:-1], Wv), dtype=dtype)
    v1[..., :Dv] = problem.value
    v1[..., Dv] = 1
    allowed = bias = None
    if problem.allowed is not None:
        allowed = rows_view(problem.allowed, S)
    if problem.bias is not None:
        bias = rows_view(problem.bias, S)
    if block_q is None:
        block_q = max(1, BLOCK_ROWS.get(dtype, 128) // F)
    if block_k is None:
        block_k = BLOCK_K.get(dtype, 512)
    lo, hi = problem.band
    return _Plan(
        q=rows_view(problem.query, Dk),
        k1=keys_view(k1, Dk + 1),
        v1=keys_view(v1, Wv),
        allowed=allowed,
        bias=bias,
        out=np.empty((*outer, F, T, Dv), dtype=dtype),
        lse=np.empty((*outer, F, T), dtype=dtype),
        m=np.empty((*outer, F, T), dtype=dtype) if with_stats else None,
        ell=np.empty((*outer, F, T), dtype=dtype) if with_stats else None,
        scale=problem.scale,
        offset=problem.offset,
        lo=lo,
        hi=hi,
        T=T,
        S=S,
        Dk=Dk,
        Dv=Dv,
        Wv=Wv,
        F=F,
        block_q=int(block_q),
        block_k=int(block_k),
        dtype=dtype,
        may_overflow=problem.may_overflow,
        problem=problem,
    )


# The shift m of a row is folded into the first matrix product only while |m| is at most this.
# Folding computes fl(q.k - m) instead of fl(q.k) - m: its rounding error grows with |m|, which
# costs nothing while m is of the size of the scores (it lags at most LAZY_MARGIN behind their
# maximum), but a row whose scores are dominated by a large bias (a float mask filled with
# finfo.min or -1e9) must subtract m separately, as the reference path does, or q.k is lost.
FOLD_LIMIT = 64.0


class _Worker:
    """One thread's scratch tiles, allocated once and reused for every work unit it takes."""

    def __init__(self, plan: _Plan):
        p = plan
        rows = p.F * p.block_q
        bk = min(p.block_k, p.S)
        self.plan = p
        self.q = np.empty(rows * (p.Dk + 1), dtype=p.dtype)
        self.s = np.empty(rows * bk, dtype=p.dtype)  # scores, then exp(scores - m), in place
        self.pv = np.empty(rows * p.Wv, dtype=p.dtype)
        self.acc = np.empty(rows * p.Wv, dtype=p.dtype)
        self.m = np.empty(rows, dtype=p.dtype)
        self.unfolded = np.empty(rows, dtype=p.dtype)
        self.masked = np.empty(rows * bk, dtype=bool) if p.allowed is not None else None
        self.band_cache: dict = {}
        self.computed = 0
        self.skipped_mask = 0
        self.rescaled = 0

    def band_masked(self, t0, t1, s0, s1):
        """Boolean (t1-t0, s1-s0) tile, True where the band *disallows*; cached by geometry."""
        p = self.plan
        key = (s0 - t0, t1 - t0, s1 - s0)
        tile = self.band_cache.get(key)
        if tile is None:
            diff = np.arange(s0, s1)[None, :] - (np.arange(t0, t1)[:, None] + p.offset)
            tile = np.zeros(diff.shape, dtype=bool)
            if p.lo is not None:
                tile |= diff < p.lo
            if p.hi is not None:
                tile |= diff > p.hi
            if len(self.band_cache) > 64:
                self.band_cache.clear()
            self.band_cache[key] = tile
        return tile

    def run(self, o: tuple, t0: int, t1: int) -> None:
        """Attention for the query rows ``t0:t1`` of every folded head at outer index ``o``."""
        p = self.plan
        F, Dk, Dv, bq = p.F, p.Dk, p.Dv, t1 - t0
        rows = F * bq
        # q = [query * scale | -m]: (rows, Dk + 1), the folded heads' rows one under the other.
        # Against keys with a column of ones, [k | 1], one product gives the scores minus the
        # running shift m, so no separate pass subtracts it.
        q = self.q[: rows * (Dk + 1)].reshape(rows, Dk + 1)
        np.multiply(p.q[o][:, t0:t1, :], p.scale, out=q.reshape(F, bq, Dk + 1)[..., :Dk])
        folded = q[:, Dk]  # -m for the rows whose shift is folded in, 0 for the others
        folded.fill(0)
        k1, v1 = p.k1[o], p.v1[o]  # (S, Dk + 1), (S, Wv)
        allowed = None if p.allowed is None else p.allowed[o]
        bias = None if p.bias is None else p.bias[o]
        m = self.m[:rows]  # the shift of each row; 0 until the row has met an allowed key
        m.fill(0)
        unfolded = self.unfolded[:rows]  # m for the rows whose shift is not folded in, else 0
        unfolded.fill(0)
        any_unfolded = False
        started = np.zeros(rows, dtype=bool)  # rows that have met an allowed key
        all_started = False
        acc = self.acc[: rows * p.Wv].reshape(rows, p.Wv)
        pv = self.pv[: rows * p.Wv].reshape(rows, p.Wv)
        acc.fill(0)
        first, stop = _key_block_range(t0, t1, p.S, p.block_k, p.offset, p.lo, p.hi)
        key_start, key_stop = _band_keys(t0, t1, p.S, p.offset, p.lo, p.hi)
        for b in range(first, stop):
            # The tile's keys, trimmed to the keys the band allows to some query of the block
            # (under a causal mask the last tile of a row of tiles stops at the diagonal).
            s0 = max(b * p.block_k, key_start)
            s1 = min((b + 1) * p.block_k, key_stop)
            bk = s1 - s0
            kind = _tile_kind(t0, t1, s0, s1, p.offset, p.lo, p.hi)
            assert kind != SKIPPED, "the key-block range holds only tiles the band touches"
            masked = None
            if allowed is not None:
                masked = self.masked[: rows * bk].reshape(F, bq, bk)
                np.logical_not(allowed[:, t0:t1, s0:s1], out=masked)
                if kind == PARTIAL:
                    np.logical_or(masked, self.band_masked(t0, t1, s0, s1), out=masked)
                if masked.all():  # the user's mask disallows the whole tile
                    self.skipped_mask += 1
                    continue
            elif kind == PARTIAL:
                masked = self.band_masked(t0, t1, s0, s1)
            self.computed += 1
            s = self.s[: rows * bk].reshape(rows, bk)
            bias_tile = None if bias is None else bias[:, t0:t1, s0:s1]
            if all_started and not p.may_overflow:
                # The common case: exp(scores - m) at the current shift. It is exact as long as
                # no score exceeds m by more than LAZY_MARGIN (then nothing overflows and
                # l >= 1), which the tile's row sums, a by-product of the second product, prove.
                self.scores(s, q, k1[s0:s1], bias_tile, masked, unfolded if any_unfolded else None)
                _tile_exp(s, out=s)
                np.matmul(s, v1[s0:s1], out=pv)  # (rows, bk) @ (bk, Wv) -> (rows, Wv)
                if pv[:, Dv].max() <= LAZY_BOUND:
                    acc += pv  # acc[:, :Dv] += p @ v;  acc[:, Dv] = l += rowsum(p)
                    continue
            # The exact step, the online softmax as written: the raw scores (nothing folded in,
            # so they are rounded exactly as the reference path rounds them), the new maximum
            # m_new = max(m, rowmax), the old sums rescaled by alpha = exp(m - m_new). A row
            # meeting its first allowed key starts at that tile's maximum.
            self.rescaled += 1
            folded.fill(0)
            self.scores(s, q, k1[s0:s1], bias_tile, masked, None, check=p.may_overflow)
            r = np.max(s, axis=1)  # -inf where nothing is allowed
            meets = r > -np.inf
            m_new = np.where(started, np.maximum(m, r), np.where(meets, r, 0))
            alpha = np.where(started, np.exp(m - m_new), 0)  # exp(-inf) = 0: no overflow
            np.subtract(s, m_new[:, None], out=s)
            _tile_exp(s, out=s)  # p = exp(scores - m_new), at most 1
            np.matmul(s, v1[s0:s1], out=pv)
            acc *= alpha[:, None]
            acc += pv
            m[:] = m_new
            small = np.abs(m) <= FOLD_LIMIT  # rows whose shift can be folded in exactly
            np.negative(m, out=folded)
            folded[~small] = 0
            any_unfolded = not small.all()
            np.copyto(unfolded, m)
            unfolded[small] = 0
            started |= meets
            all_started = bool(started.all())
        folded.fill(0)
        # out = acc / l and lse = m + log l; rows that never met an allowed key have l = 0.
        ell = acc[:, Dv]
        seen = ell > 0
        inv = np.zeros(rows, dtype=p.dtype)
        np.divide(1, ell, out=inv, where=seen)
        out = p.out[o][:, t0:t1, :]  # (F, bq, Dv) view of the result
        np.multiply(acc[:, :Dv].reshape(F, bq, Dv), inv.reshape(F, bq, 1), out=out)
        lse = np.full(rows, -np.inf, dtype=p.dtype)
        np.log(ell, out=lse, where=seen)
        np.add(lse, m, out=lse, where=seen)
        p.lse[o][:, t0:t1] = lse.reshape(F, bq)
        if p.m is not None:
            p.m[o][:, t0:t1] = m.reshape(F, bq)
            p.ell[o][:, t0:t1] = ell.reshape(F, bq)

    def scores(self, s, q, k1, bias, masked, unfolded, check=False):
        """``s = scale * q k^T - folded + bias - unfolded`` on one tile (the shift ``m`` of each
        row is in ``folded`` or in ``unfolded``), disallowed entries set to ``-inf``.

        With ``check``, the raw scores (nothing subtracted) are checked for overflow first.
        """
        np.matmul(q, k1.T, out=s)  # (rows, Dk+1) @ (Dk+1, bk) -> (rows, bk)
        if bias is not None or masked is not None or unfolded is not None or check:
            s3 = s.reshape(self.plan.F, -1, s.shape[1])  # (F, bq, bk)
            if bias is not None:
                np.add(s3, bias, out=s3)
            if unfolded is not None:
                np.subtract(s, unfolded[:, None], out=s)
            if check:
                from .attention import check_overflow

                check_overflow(
                    self.plan.problem, s3, None if masked is None else ~masked, bias
                )
            if masked is not None:
                np.copyto(s3, -np.inf, where=masked)

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


def attention_tiled(
    problem,
    *,
    block_q=None,
    block_k=None,
    workers=None,
    stats=None,
    return_stats=False,
    mark=True,
):
    """The online-softmax tiled path on a prepared problem; returns ``(out, lse)``.

    ``out`` has the shape ``(*problem.batch_shape, T, Dv)`` and ``lse`` ``(*batch_shape, T)``,
    both in ``problem.work_dtype`` (the caller casts and ungroups, as for
    :func:`sdpa.attention.attention_reference`). ``block_q`` is the number of query positions
    per tile (default: chosen so that a tile holds about ``BLOCK_ROWS`` rows after folding the
    heads of a group), ``block_k`` the number of keys; ``workers`` the number of threads
    (default: the cores available). ``stats``, a :class:`TileStats`, receives tile counts.
    With ``return_stats`` the result is ``(out, lse, m, ell)``: ``lse = m + log(ell)`` in two
    parts, the shift ``m`` (close to the row maximum) and the row sum ``ell`` at that shift,
    which the backward pass needs when ``lse`` is too large for its rounding to be negligible.
    Rows reached by a non-finite input are NaN in ``out`` and ``lse`` (not in ``m``, ``ell``)
    unless ``mark`` is False (the backward pass marks its own).
    """
    from .attention import mark_poisoned

    if block_q is not None:
        block_q = check_positive_int(block_q, "block_q")
    if block_k is not None:
        block_k = check_positive_int(block_k, "block_k")
    T, S, Dv = problem.T, problem.S, problem.Dv
    dtype = problem.work_dtype
    if S == 0 or T == 0 or 0 in problem.batch_shape:
        out = np.zeros((*problem.batch_shape, T, Dv), dtype=dtype)
        lse = np.full((*problem.batch_shape, T), -np.inf, dtype=dtype)
        m, ell = np.zeros_like(lse), np.zeros_like(lse)
        if mark:
            out, lse, _ = mark_poisoned(problem, out, lse)
        return (out, lse, m, ell) if return_stats else (out, lse)
    plan = _make_plan(problem, block_q, block_k, with_stats=return_stats)
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
    n_workers = min(workers or default_workers(), len(work))
    counter = itertools.count()
    workers_ = [_Worker(plan) for _ in range(max(1, n_workers))]
    if n_workers <= 1:
        workers_[0].drain(work, counter)
    else:
        run_in_threads([functools.partial(w.drain, work, counter) for w in workers_])
    if stats is not None:
        n_k = -(-S // plan.block_k)
        total = n_q * n_k * int(np.prod(outer, dtype=np.int64))
        stats.computed += sum(w.computed for w in workers_)
        stats.skipped_mask += sum(w.skipped_mask for w in workers_)
        stats.rescaled += sum(w.rescaled for w in workers_)
        stats.skipped_band += total - sum(u[0] for u in units)
        stats.per_worker.append([w.computed for w in workers_])
    bs = problem.batch_shape
    out, lse = plan.out.reshape(*bs, T, Dv), plan.lse.reshape(*bs, T)
    if mark:
        out, lse, _ = mark_poisoned(problem, out, lse)
    if return_stats:
        return out, lse, plan.m.reshape(*bs, T), plan.ell.reshape(*bs, T)
    return out, lse
