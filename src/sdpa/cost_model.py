"""The cost models behind ``implementation="auto"``: which path is faster for a problem.

Both rules live here, side by side: :func:`worth_tiling` for
:func:`sdpa.scaled_dot_product_attention` (and its backward), :func:`flex_worth_tiling` for
:func:`sdpa.flex_attention`. Neither times anything: the choice is made from the shapes.

:func:`worth_tiling` is the rule that :func:`sdpa.scaled_dot_product_attention` and its
backward both follow; :func:`estimated_times` predicts the wall time of the reference path and
of the tiled path from the shapes alone (scores, head widths, keys read, and the number of
tiles and work units of :func:`tiling_geometry`, each with its fixed cost), with the constants
``REFERENCE_COST`` and ``TILED_COST`` fitted by ``benchmarks/tune.py auto``.
"""

from __future__ import annotations

import math
from types import MappingProxyType

import numpy as np

from ._checks import available_memory
from .problem import AttentionProblem
from .threads import default_num_threads
from .tiles.band import (
    block_key_spans,
    head_groups,
    keys_before_squares,
    square_width,
    tile_plan_sizes,
)
from .tiles.blocks import unit_count
from .tuning import BLOCK_K_DIAGONAL

__all__ = [
    "CACHE_BYTES",
    "CACHED_READ",
    "DECODING_GROUP",
    "FLEX_MIN_TILED_SCORES",
    "MIN_TILED_SCORES",
    "MIN_UNIT_SCORES",
    "PACKED_READ",
    "REFERENCE_COST",
    "TILED_COST",
    "auto_path",
    "estimated_times",
    "flex_worth_tiling",
    "tiled_threads",
    "tiling_geometry",
    "worth_tiling",
]

# Below this many scores (summed over heads) the reference path is as fast or faster whatever
# the shapes: the tiled path pays for Python-level loops and thread hand-offs.
#: Below this many scores (summed over heads) ``"auto"`` never tiles.
MIN_TILED_SCORES = 1 << 17

# The cost model behind implementation="auto": wall time in microseconds, as `make bench`
# measures it (a pause before each call, the best of several rounds). Counting scores alone
# (the earlier rule) sent 20000 heads of 4 x 4 scores to the tiled path, 32 times slower than
# the reference path: every work unit and every tile costs a fixed amount of Python and NumPy
# call overhead that small heads cannot amortise. And decoding (one query against a long
# cache) went to the tiled path at 1.7 to 2.1 times the reference path's time: that overhead
# holds the GIL, so the worker threads do not share it; only the work inside NumPy's loops and
# products (per score) runs in parallel. A model fitted to single-thread CPU times, spread over
# the cores, put the tiled path's fixed costs at a quarter of what a call after a pause pays
# (its threads start on cold cores). So the constants are fitted to wall times, by
# `benchmarks/tune.py auto`: both paths as a user calls them, interleaved, over 160 shapes
# (many small heads, few large ones, batched heads, decoding with T from 1 to 64 and S to
# 16384, grouped-query decoding with 32 and 64 query heads over 8), with the auto grid of a
# `make bench` run beside them: least squares on relative errors, then a refinement of the
# constants and of the cache shares below that also penalises every shape where the model
# would take the slower path, by how much slower. Measured on an Intel Xeon (Sapphire Rapids,
# 2 cores, AVX-512, OpenBLAS), 2026-12-07: the path the model picks was within 1.10 of the
# faster one on 218 of the 220 rows, and 1.12 and 1.15 on the other two (GQA decoding at
# S = 16384, whose reference path took 10 ms in one run and 22 in another, and 8 heads of 64
# queries over 512 keys, 2.35 against 2.71 ms). Another machine moves the crossing;
# `make bench` checks it there. TILED_COST["solo"], the tiled path's call on one thread (see
# tiled_threads), was fitted on the same machine the next day, to the 160 shapes measured
# again with the tiled path on one thread as well; the other constants were kept, since
# refitted on that run they chose no better (worst chosen/faster 1.99 against 1.87, both on
# many heads of 256 x 256 scores, width 8, whose tiled path took 1.8 times as long on two
# threads as on one).
#: The reference path's costs, in microseconds: per call, per ``(T, S)`` matrix, per input
#: entry, per score, per score and unit of ``Dk + Dv``, per masked score.
REFERENCE_COST = MappingProxyType(
    dict(
        call=953.0,  # validation, dispatch, BLAS's threads waking
        matrix=0.568,  # per (T, S) matrix: the batched products' loop
        io=0.000272,  # per entry read per matrix, (T + S) (Dk + Dv) (see CACHED_READ)
        score=0.00489,  # per score: the softmax's passes
        score_width=0.00000632,  # per score and unit of Dk + Dv: the two products
        masked=0.00128,  # per score, with a mask or a band: one more pass
    )
)
# A key head read again by the next query heads of its group (one query row each, GQA
# decoding) comes from the cache, at a share of a first read's cost that depends on whether the
# key head (its keys and values) fits in the L2, CACHE_BYTES. One thread's CPU time of the
# reference path (32 query heads, T = 1, width 64, float32) at S = 4096: 3.69 ms over 32 key
# heads, 2.10 over 8, 1.32 over 1; at S = 16384 (a key head of 4 MiB, beyond the 2 MiB L2):
# 18.7, 14.4 and 11.2 ms; the fit below (T = 1, S = 2048 to 16384) puts the share at 0.12 to
# 0.17 within the L2, 0.35 to 0.56 beyond. A single share of 1/4 (the earlier rule) kept the
# reference path for 64 query heads over 8 at S = 16384, 1.13 to 1.18 times slower than the
# tiled path in three runs of five; 0.45 tiles it, and still keeps 32 over 8 there (15.4
# against 24.2 ms) and 64 over 8 at S = 2048 and 4096 (1.3 to 1.8 times as fast). These CPU
# times gave the shares their form; their values are now fitted with the wall-time constants
# (`benchmarks/tune.py auto`, which refines both together).
#: What a key head re-read from the cache costs, as a share of a first read (see ``io``),
#: while one key head's keys and values fit in ``CACHE_BYTES``, and beyond.
CACHED_READ = MappingProxyType(dict(within_cache=0.0896, beyond_cache=0.367))

# With T > 1 query rows the products are matrix products, and BLAS packs its operands (reads
# them and writes a copy) for each: a key entry costs more than a streamed read, and the next
# query heads of a group pack the same key head again, from the cache if it fits there. One
# thread's CPU time of the reference path, 32 query heads of width 64 over 32, 8, 4 and 1 key
# heads, T = 1, 2, 4, 8 (float32, OpenBLAS), fitted per score and per key entry (first and
# further reads, T = 1 and T > 1 apart), in streamed first reads (2.5e-4 us): a first packed
# read 2.0 to 2.2 at S = 2048 and 4096 (a key head's keys and values, 1 and 2 MiB, within the
# 2 MiB L2), 2.7 to 2.8 at S = 8192 and 16384; a further packed read 0.73 to 0.83 within L2,
# 1.6 to 1.8 beyond (a further streamed one, T = 1: CACHED_READ). At S = 2048, T = 2: 4.97 ms
# over 32 key heads, 3.20 over 8, 2.68 over 1 (T = 1: 2.51, 1.28, 0.76); at S = 16384: 48.3,
# 39.6, 32.9. The values below are fitted with the wall-time constants (`tune.py auto`).
#: What a key entry packed for a matrix product (T > 1) costs, as a multiple of a streamed
#: first read (see ``io``): the group's first head, then each further head while one key
#: head's keys and values fit in ``CACHE_BYTES``, and beyond.
PACKED_READ = MappingProxyType(dict(first=1.51, within_cache=0.837, beyond_cache=1.08))
#: The cache that holds a key head for the next heads of its group (L2 of one core).
CACHE_BYTES = 2 << 20

# A tile of few rows (decoding, GQA's G heads of T rows folded) costs mostly the reading of
# its keys and values: one thread's CPU time of the tiled path, 32 query heads over 8 key
# heads, T = 1 (4 rows per tile), S = 4096 and 16384: 42 to 46 us per tile of 512 keys at
# Dk = Dv = 64, 15 to 19 us at 16, that is 4.7e-4 us per entry of Dk + Dv read, as the
# reference path's packed read (PACKED_READ); at T = 128 a tile costs 690 us, the products.
#: The tiled path's costs, in microseconds: per call (with worker threads, and on one thread),
#: per work unit, per further step, per computed score, per computed score and unit of
#: ``Dk + Dv``, per key and value entry a tile reads (the last three shared by the threads).
TILED_COST = MappingProxyType(
    dict(
        call=2860.0,  # validation, the plan, starting the worker threads on cold cores
        solo=1240.0,  # the same on one thread, which starts none
        unit=83.6,  # per work unit: its first tile and its bookkeeping (holds the GIL)
        tile=27.0,  # per further step: the NumPy calls' dispatch (holds the GIL)
        score=0.00103,  # per computed score: exp and the row sums
        score_width=0.000021,  # per computed score and unit of Dk + Dv: the products
        io=0.000673,  # per entry of the keys and values a tile reads: packing them
    )
)


def tiling_geometry(
    problem: AttentionProblem,
    block_q: int | None = None,
    block_k: int | None = None,
    block_diagonal: int | None = None,
    num_threads: int | None = None,
) -> tuple[int, int, int, int, int]:
    """The work the tiled path would do for ``problem``, from the shapes alone.

    Parameters
    ----------
    problem : AttentionProblem
        From :func:`sdpa.problem.prepare_attention`.
    block_q, block_k, block_diagonal, num_threads : int, optional
        Tile sizes and threads, as in :func:`sdpa.tiled.attention_tiled` (default: its
        defaults; the default ``block_q`` depends on the threads).

    Returns
    -------
    units : int
        Independent work units: one block of query rows of one head, with the heads that
        share keys folded in.
    tiles : int
        Tiles computed, each head's counted: those the causal/window band skips are not
        counted, those a boolean mask turns out to disallow are.
    steps : int
        Rounds of NumPy calls that compute them: a unit of several heads computes a tile of
        each in one step.
    scores : int
        Entries of those tiles.
    num_threads : int
        Threads the tiled path would start (at most one per unit).

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa.cost_model import tiling_geometry
    >>> from sdpa.problem import prepare_attention
    >>> x = np.ones((1000, 8))  # one head, T = S = 1000
    >>> tiling_geometry(prepare_attention(x, x, x), block_q=250, block_k=500)[:4]
    (4, 8, 8, 1000000)
    """
    T, S = problem.T, problem.S
    num_threads = num_threads or default_num_threads()
    F, bq, bk = tile_plan_sizes(problem, block_q, block_k, num_threads)
    outer = math.prod(problem.batch_shape) // max(F, 1)
    groups = head_groups(problem, F, bq, num_threads)  # units per block of rows
    if problem.band == (None, None):  # every block of rows walks all the keys (decoding, fast)
        n_q = -(-T // bq)
        row_tiles = n_q * -(-S // bk) if S else 0
        units = groups * n_q
        return (
            units,
            outer * row_tiles,
            groups * row_tiles,
            outer * F * T * S,
            min(num_threads, max(units, 1)),
        )
    wide = keys_before_squares(problem, block_k, bk)
    t0, t1, start, stop = block_key_spans(T, S, bq, problem.offset, *problem.band)
    n_tiles = np.where(stop > start, -(-stop // bk) - start // bk, 0)
    n_steps = n_tiles.copy()
    scores = _band_scores(t0, t1, start, stop, n_tiles, bk, problem)
    if block_diagonal is None:
        block_diagonal = BLOCK_K_DIAGONAL.get(problem.work_dtype, 0)
    if problem.allowed is None and problem.bias is None:
        squares = _square_counts(t0, t1, S, bk, block_diagonal, wide, problem)
        if squares is not None:
            square, sq_tiles, sq_steps, sq_scores = squares
            n_tiles = np.where(square, sq_tiles, n_tiles)
            n_steps = np.where(square, sq_steps, n_steps)
            scores = np.where(square, sq_scores, scores)
    units = groups * t0.size
    tiles = outer * int(n_tiles.sum())
    steps = groups * int(n_steps.sum())
    return units, tiles, steps, outer * F * int(scores.sum()), min(num_threads, max(units, 1))


def _square_counts(t0, t1, S: int, bk: int, d: int, wide: int, problem: AttentionProblem):
    """For the blocks of rows that walk their causal diagonal in squares of ``bk`` rows, in
    pieces of ``d`` keys, and the keys before it in pieces of ``wide``
    (:func:`sdpa.tiles.band.unit_pieces`): ``(square, tiles, steps, scores)``, int64 arrays
    over the blocks (``square`` bool: the blocks that do), one head's counts (a tile: ``bk``
    keys of a piece, or a piece inside a square); None when no block can."""
    square = square_width(t0, t1, S, bk, d, problem.offset, *problem.band) > 0
    if not square.any():
        return None
    rows, k0 = t1 - t0, t0 + problem.offset + problem.band[1]  # row t0 + y: keys to k0 + y
    nb, left = rows // bk, np.maximum(k0, 0)  # squares; keys before the diagonal
    steps = bk // d + (nb - 1) + -(-left // wide)
    tiles = nb * (bk // d) + (nb - 1) + -(-left // bk)
    scores = rows * k0 + bk * bk * (nb - 1) * nb // 2 + nb * bk * (bk + d) // 2
    return square, tiles, steps, scores


def _band_scores(t0, t1, start, stop, n_tiles, bk: int, problem: AttentionProblem):
    """The scores one head's pieces compute under the band, walked in strips, for each block
    of rows (int64 array): each piece (keys ``s0:s1`` of a block's ``start:stop``, cut at
    multiples of ``bk``) times the rows it meets (those whose band reaches one of its keys),
    summed over every block's pieces at once."""
    block = np.repeat(np.arange(t0.size), n_tiles)  # the block of each piece
    first_piece = np.repeat(np.cumsum(n_tiles) - n_tiles, n_tiles)
    b = start[block] // bk + np.arange(block.size) - first_piece  # the piece's key block
    s0 = np.maximum(b * bk, start[block])
    s1 = np.minimum((b + 1) * bk, stop[block])
    lo, hi = problem.band
    r0, r1 = t0[block], t1[block]
    if hi is not None:  # row i reaches key i + offset + hi >= s0
        r0 = np.maximum(r0, s0 - problem.offset - hi)
    if lo is not None:  # row i starts at key i + offset + lo <= s1 - 1
        r1 = np.minimum(r1, s1 - problem.offset - lo)
    per_piece = np.maximum(0, r1 - r0) * (s1 - s0)
    return np.bincount(block, weights=per_piece, minlength=t0.size).astype(np.int64)


def estimated_times(
    problem: AttentionProblem,
    *,
    reference_cost: dict[str, float] | None = None,
    tiled_cost: dict[str, float] | None = None,
    num_threads: int | None = None,
) -> tuple[float, float]:
    """The cost model's estimate of both paths' wall time for ``problem``, in microseconds.

    Parameters
    ----------
    problem : AttentionProblem
        From :func:`sdpa.problem.prepare_attention`.
    reference_cost, tiled_cost : dict, optional
        The model's constants, with the keys of ``REFERENCE_COST`` and ``TILED_COST`` (the
        defaults); ``benchmarks/tune.py`` passes fitted ones to compare.
    num_threads : int, optional
        The tiled path's threads (default :func:`sdpa.threads.default_num_threads`).

    Returns
    -------
    reference, tiled : float
        Estimated wall times of the reference path and of the tiled path.

    Notes
    -----
    With one query row, query heads that share a key head (``enable_gqa``) read it from memory
    once and from the cache after that (``CACHED_READ``); with several, each head's products
    pack the keys and values, at a higher cost that a shared key head lowers less
    (``PACKED_READ``, by whether it fits in ``CACHE_BYTES``). The tiled path pays for the keys
    and values each of its tiles reads (``TILED_COST["io"]``), which dominates tiles of few
    rows. A tiled call of a single work unit starts no worker threads and pays the reference
    path's ``call`` cost.

    Examples
    --------
    Many small heads favour the reference path, a few long ones the tiled path:

    >>> import numpy as np
    >>> from sdpa.cost_model import estimated_times
    >>> from sdpa.problem import prepare_attention
    >>> small = np.ones((20000, 4, 8))
    >>> reference, tiled = estimated_times(prepare_attention(small, small, small))
    >>> bool(reference < tiled)
    True
    >>> long = np.ones((2, 4096, 64))
    >>> reference, tiled = estimated_times(prepare_attention(long, long, long))
    >>> bool(tiled < reference)
    True
    """
    r = REFERENCE_COST if reference_cost is None else reference_cost
    reference = _reference_time(problem, r)
    c = TILED_COST if tiled_cost is None else tiled_cost
    return reference, _tiled_time(c, *_tiled_terms(problem, c, num_threads))


def _tiled_time(c, overhead: float, work: float, num_threads: int) -> float:
    """The tiled path's estimate from its terms (:func:`_tiled_terms`) on ``num_threads``.

    One thread starts no workers (a single unit, as with one key head, or a short call on one
    thread): its call costs less. Hq = 32 query heads over one key head, T = 1, S = 4096: the
    tiled path took 1.39 to 1.57 ms, the model with the workers' start said 2.9 ms.
    """
    call = c["call"] if num_threads > 1 else c["solo"]
    return call + overhead + work / num_threads


def _reference_time(problem: AttentionProblem, r) -> float:
    """The reference path's estimate with the constants ``r``."""
    T, S, width = problem.T, problem.S, problem.Dk + problem.Dv
    n_matrices = math.prod(problem.batch_shape)
    masked = problem.allowed is not None or problem.bias is not None or problem.band != (None, None)
    return (
        r["call"]
        + n_matrices * (r["matrix"] + r["io"] * (T * width + _key_reads(problem)))
        + n_matrices * T * S * (r["score"] + r["score_width"] * width + r["masked"] * masked)
    )


def _tiled_terms(problem: AttentionProblem, c, num_threads: int | None):
    """``(overhead, work, threads)`` of the tiled path's estimate with the constants ``c``:
    what the threads do in turn, what they share, and how many there are."""
    units, tiles, steps, scores, num_threads = tiling_geometry(problem, num_threads=num_threads)
    width = problem.Dk + problem.Dv
    # Python between NumPy's calls holds the GIL: the workers take turns at it (per unit, per
    # step: a unit of several heads computes a tile of each in one round of calls), while the
    # work inside NumPy's loops and products (per score, per key entry a tile reads) runs in
    # parallel.
    overhead = c["unit"] * units + c["tile"] * max(0, steps - units)
    key_reads = tiles * tile_plan_sizes(problem)[2] * width  # a partial tile as a whole
    work = scores * (c["score"] + c["score_width"] * width) + c["io"] * key_reads
    return overhead, work, num_threads


def _key_reads(problem: AttentionProblem) -> float:
    """Entries of the keys and values that the reference path's products read per ``(T, S)``
    matrix, in units of a streamed first read (from memory): ``S (Dk + Dv)`` for one query row,
    less when the matrix before it read the same keys, more for several rows (packing).
    """
    S, width = problem.S, problem.Dk + problem.Dv
    G = tile_plan_sizes(problem)[0]  # consecutive matrices that share their keys (GQA's group)
    if problem.T > 1:
        # A product of T > 1 rows is a matrix product, which packs its keys anew each time:
        # the group's first head from memory, the others from the cache if the head fits.
        return S * width * (PACKED_READ["first"] + (G - 1) * PACKED_READ[_cache(problem)]) / G
    if G == 1:
        return S * width
    # One row: NumPy's matmul hands it to BLAS's matrix-vector product, which streams the keys
    # unpacked; the G query heads of a group read the same keys one after the other, the
    # first from memory, the others from the cache, at CACHED_READ of that cost.
    return S * width * (1 + (G - 1) * CACHED_READ[_cache(problem)]) / G


def _cache(problem: AttentionProblem) -> str:
    """Whether one key head's keys and values fit in ``CACHE_BYTES``: ``"within_cache"`` or
    ``"beyond_cache"``, the keys of ``CACHED_READ`` and ``PACKED_READ``."""
    nbytes = problem.S * (problem.Dk + problem.Dv) * problem.work_dtype.itemsize
    return "within_cache" if nbytes <= CACHE_BYTES else "beyond_cache"


def tiled_threads(problem: AttentionProblem) -> int:
    """The threads ``implementation="auto"`` runs the tiled path on: one when the cost model
    expects it to finish sooner than all of them, else all of them.

    Parameters
    ----------
    problem : AttentionProblem
        From :func:`sdpa.problem.prepare_attention`.

    Returns
    -------
    int
        ``1`` or :func:`sdpa.threads.default_num_threads`.

    Notes
    -----
    Worker threads start on cold cores: the model's fixed cost of a call with workers
    (``TILED_COST["call"]``) exceeds one without them (``TILED_COST["solo"]``, fitted to the
    tiled path on one thread over `benchmarks/tune.py auto`'s 160 shapes) by 1.6 ms on the
    2-core machine it was fitted on, which a second thread repays only from about 3 ms of
    work. Measured there (float32, width 64, one head, 10 ms idle before each
    call, medians of 30): at T = S = 512 one thread took 1.73 ms and two 2.42; at 1024 4.00
    and 3.93, causal 3.50 and 4.74; at 2048 13.4 and 9.7, causal 8.0 and 8.7; at 4096,
    causal, 26.8 and 17.8. The choice rests on the shapes alone, never on a timing.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa.cost_model import tiled_threads
    >>> from sdpa.problem import prepare_attention
    >>> x = np.ones((1024, 64), np.float32)
    >>> tiled_threads(prepare_attention(x, x, x, is_causal=True))  # about 4 ms of work
    1
    """
    return _best_tiled(problem)[2]


def _best_tiled(problem: AttentionProblem) -> tuple[float, float, int]:
    """``(reference, tiled, threads)``: the estimates of :func:`estimated_times` (the tiled
    path's on all cores) and the threads the tiled path would run on: one where the same
    units, overhead and work cost less without the workers' start and unshared (on one
    thread the units are as many or fewer, and as long or longer: the estimate errs towards
    all cores), else all of them."""
    c = TILED_COST
    threads = default_num_threads()
    reference = _reference_time(problem, REFERENCE_COST)
    overhead, work, n = _tiled_terms(problem, c, threads)
    tiled, alone = _tiled_time(c, overhead, work, n), _tiled_time(c, overhead, work, 1)
    return reference, tiled, 1 if alone <= tiled else threads


def auto_path(problem: AttentionProblem) -> int:
    """The path ``implementation="auto"`` takes for ``problem``: 0 for the reference path,
    else the threads of the tiled path (:func:`worth_tiling`, :func:`tiled_threads`).

    Parameters
    ----------
    problem : AttentionProblem
        From :func:`sdpa.problem.prepare_attention`.

    Returns
    -------
    int
        0, or the tiled path's thread count.

    Notes
    -----
    The path is chosen against the tiled path on all cores, as the constants were fitted and
    `make bench` checks the choice; the threads only then. Chosen against the tiled path on
    one thread, it would take the reference path where the model's estimate of it is too low
    and the tiled path on one thread the faster: 4 x 8 heads of 128 x 128 scores, width 64,
    the reference estimated at 4.3 ms and measured at 6.7 to 6.9, the tiled path 5.6 to 5.9
    ms on one thread and 7.5 on two.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa.cost_model import auto_path
    >>> from sdpa.problem import prepare_attention
    >>> x = np.ones((64, 8))
    >>> auto_path(prepare_attention(x, x, x))  # 4096 scores: the reference path
    0
    """
    n_scores = math.prod(problem.batch_shape) * problem.T * problem.S
    if n_scores < MIN_TILED_SCORES:
        return 0
    reference, tiled, threads = _best_tiled(problem)
    if tiled < reference:
        return threads
    need = 3 * n_scores * problem.work_dtype.itemsize
    if need > (1 << 28):  # 256 MiB: worth asking how much memory there is
        available = available_memory()
        if available is not None and need > available / 4:
            return threads
    return 0


def worth_tiling(problem: AttentionProblem) -> bool:
    """Whether ``implementation="auto"`` takes the tiled path for ``problem``.

    Parameters
    ----------
    problem : AttentionProblem
        From :func:`sdpa.problem.prepare_attention`.

    Returns
    -------
    bool
        False below ``MIN_TILED_SCORES`` scores; above, True when the cost model predicts the
        tiled path to be faster (:func:`estimated_times`), or when the reference path's
        ``(T, S)`` matrices would take more than a quarter of the available memory
        (:func:`auto_path`).

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa.cost_model import worth_tiling
    >>> from sdpa.problem import prepare_attention
    >>> x = np.ones((64, 8))
    >>> worth_tiling(prepare_attention(x, x, x))  # 4096 scores: far below the threshold
    False
    """
    return auto_path(problem) > 0


# -- flex_attention's rule ------------------------------------------------------------------

# flex_attention's implementation="auto" takes the tiled path when the reference path's score
# matrix holds at least FLEX_MIN_TILED_SCORES scores and the tiled path's work units hold at
# least MIN_UNIT_SCORES scores each on average (a unit costs tens of microseconds of Python
# between NumPy calls, which many small heads cannot amortise), or when the reference path's
# arrays would take more than a quarter of the available memory. Both paths timed on 14 shapes
# (float32, width 64, with and without a causal mask; 2-core Xeon): below 2**19 scores the
# reference path was up to 1.7 times as fast (at a few milliseconds); above, the tiled path was
# the faster wherever the units held 2**14 scores, and 4 to 17 times slower for heads of
# 16 x 16 and 32 x 32 scores. The units are counted as the tiled path cuts the work, several
# key heads to a unit where the mask allows (sdpa.tiles.blocks.unit_count). Timed again on 19
# shapes after that (B x H from 1 x 2 to 256 x 8, T = S from 32 to 2048, widths 16 to 64, each
# with and without a causal mask; Sapphire Rapids, two threads): the rule took the faster path,
# or one within 5 %, in 37 of the 38 cases, the other (64 x 16 heads of 32 x 32 scores,
# causal) taking 1.23 times as long; counting one unit per key head it had missed 4, by up to
# 2.4 times. 2**15 would miss 2, by up to 1.64 times.
#: Below this many scores (summed over heads) flex's ``"auto"`` never tiles ...
FLEX_MIN_TILED_SCORES = 1 << 19
#: ... nor when its units would hold fewer scores than this, on average.
MIN_UNIT_SCORES = 1 << 14

# One query row per head (decoding): the reference path's products are matrix-vector products,
# which stream each key head once and re-read it from the cache for the other query heads of
# its group, while a tiled unit of G rows reads the same keys and adds its Python. Up to
# DECODING_GROUP query heads per key head the reference path was the faster: 32 and 64 query
# heads over 8 key heads, S = 2048 to 16384 (width 64, float32, 2-core Xeon), tiled 1.03 to
# 1.33 times as long; with 16 per key head it was 1.29 times as fast at S = 2048 but 8 times
# slower at S = 16384, with 32 the slower at S = 4096 already.
#: Decoding (one query row) with at most this many query heads per key head stays unfolded.
DECODING_GROUP = 8


def flex_worth_tiling(
    shape: tuple[int, int, int, int, int], kinds: np.ndarray, block_q: int, block_kv: int, itemsize
) -> bool:
    """Whether :func:`sdpa.flex_attention`'s ``implementation="auto"`` takes the tiled path.

    Parameters
    ----------
    shape : tuple of int
        ``(B, Hkv, G, T, S)``: batch entries, key heads, query heads per key head, queries, keys.
    kinds : (1 or B, 1 or Hq, n_q, n_kv) np.ndarray
        What each block holds (:attr:`sdpa.BlockMask.kinds`, or all full without a mask).
    block_q, block_kv : int
        The blocks' sizes (the last of each axis may be shorter).
    itemsize : int
        Bytes of the working dtype.

    Returns
    -------
    bool
        False below ``FLEX_MIN_TILED_SCORES`` scores; above, True when the units of the tiled
        path would hold ``MIN_UNIT_SCORES`` computed scores each on average (except decoding
        with at most ``DECODING_GROUP`` query heads per key head), or when the reference
        path's arrays would take more than a quarter of the available memory.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa.cost_model import flex_worth_tiling
    >>> full = np.full((1, 1, 32, 1), 2)  # 32 blocks of 128 queries, one of 4096 keys: full
    >>> flex_worth_tiling((1, 8, 1, 4096, 4096), full, 128, 4096, 4)  # 8 heads of 4096 x 4096
    True
    >>> flex_worth_tiling((1, 8, 1, 16, 16), np.full((1, 1, 1, 1), 2), 16, 16, 4)  # 8 x 16 x 16
    False
    """
    B, Hkv, G, T, S = shape
    n_scores = B * Hkv * G * T * S
    if n_scores < FLEX_MIN_TILED_SCORES:
        return False
    rows = np.diff(np.minimum(np.arange(kinds.shape[2] + 1) * block_q, T))  # (n_q,)
    cols = np.diff(np.minimum(np.arange(kinds.shape[3] + 1) * block_kv, S))  # (n_kv,)
    per_mask = int(((kinds != 0) * rows[:, None] * cols[None, :]).sum())
    computed = per_mask * (B * Hkv * G) // (kinds.shape[0] * kinds.shape[1])
    units = unit_count(B, Hkv, G, kinds, block_q, block_kv)
    if computed >= MIN_UNIT_SCORES * units and not (T == 1 and G <= DECODING_GROUP):
        return True
    need = 3 * n_scores * itemsize
    available = available_memory() if need > (1 << 28) else None
    return available is not None and need > available / 4
