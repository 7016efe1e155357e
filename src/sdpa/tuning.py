"""The tiled paths' tunables (both faces of :mod:`sdpa.tiles`), in one place, each with the measurement that chose it.

Everything here is a choice of speed, never of the result's meaning: any tile size gives the
same answer to rounding, and the margins and limits only decide which of two exact steps the
kernel takes. Tile sizes and margins were measured with ``benchmarks/tune.py`` (CPU time of
one worker thread, BLAS on one thread, configurations interleaved); the exponential is chosen
from what the machine is, never from a timing in the user's process, so that every process on
one machine computes the same bits. Nothing here changes at run time.

Shape letters: ``Bq``/``Bk`` tile sizes (query rows, keys).
"""

from __future__ import annotations

import functools
import platform
import sys
from collections.abc import Callable
from types import MappingProxyType

import numpy as np

__all__ = [
    "BACKWARD_BLOCK_K",
    "BACKWARD_BLOCK_Q",
    "BLOCK_K",
    "BLOCK_K_BAND",
    "BLOCK_K_DIAGONAL",
    "BLOCK_ROWS",
    "BLOCK_ROWS_FULL",
    "FOLD_LIMIT",
    "LAZY_MARGIN",
    "LSE_EXACT_LIMIT",
    "MIN_UNITS",
    "PIECE_KEYS",
    "PLAN_CACHE_BYTES",
    "RENORMALISE_LSE",
    "RENORMALISE_RMS",
    "SCRATCH_BYTES",
    "SHORT_CALL_SCORES",
    "UNIT_SCORES",
    "VALUE_FLOOR_BITS",
    "WIDE_ROW",
    "svml_exp2",
    "tile_exponential",
]

_F32, _F64 = np.dtype(np.float32), np.dtype(np.float64)

# -- tile sizes of the forward kernel (sdpa.tiled) ------------------------------------------

# Chosen on a 2-core AMD EPYC (Zen 3, 512 KiB L2 per core) with `benchmarks/tune.py tiles`.
# The rows count *after* folding the heads of a group. Longer tiles cost less per score (fewer
# work units and NumPy calls, larger products): 4 x 8 heads of T = S = 1024 on 2 cores of an
# AMD EPYC Zen 4 took 0.95 of the time with 1024 rows as with 512 in float32, 0.92 in float64.
# Under a causal mask, now that a piece computes only the rows it meets (see BLOCK_K_BAND), the
# rows matter little from 512 on: float32, width 64, two threads (Intel Xeon, AVX-512, 2 cores;
# medians of 7 interleaved rounds), causal over unmasked time at 4 x 8 x 1024, 1 x 8 x 4096
# and 1 x 32 x 2048 was 0.79, 0.62, 0.66 with units of 256 rows; 0.73, 0.58, 0.64 with 512;
# 0.74, 0.58, 0.63 with 1024; 0.76, 0.57, 0.61 with 2048.
#: The fewest query rows per tile, after folding the heads of a group, by working dtype.
BLOCK_ROWS = MappingProxyType({_F32: 256, _F64: 256})
#: The most query rows per tile, by working dtype (lowered, down to ``BLOCK_ROWS``, so that
#: every thread still gets a work unit, or two under a causal mask or a window).
BLOCK_ROWS_FULL = MappingProxyType({_F32: 1024, _F64: 1024})
#: Keys per tile, by working dtype.
BLOCK_K = MappingProxyType({_F32: 512, _F64: 256})

# Under a causal mask or a window a unit's piece of keys computes only the rows those keys are
# allowed to (sdpa.tiles.band.rows_meeting): along the diagonal a causal unit walks a
# triangle, one strip of BLOCK_K_BAND keys at a time, each strip as tall as the rows at and
# below it, so the narrower the strips the less of the masked triangle is computed (half a
# strip's square per strip), and the more NumPy calls. Causal over unmasked time, float32,
# width 64, two threads (Intel Xeon, AVX-512, 2 cores; medians of 7 interleaved rounds), at
# 4 x 8 x 1024, 1 x 8 x 4096 and 1 x 32 x 2048: strips of 128 keys 0.73, 0.62, 0.64; of 256
# 0.70, 0.58, 0.64; of 384 0.77, 0.60, 0.64; of 512 0.83, 0.62, 0.68. Float64 keeps its
# BLOCK_K, unmeasured.
#: Keys per tile under a causal mask or a window, by working dtype.
BLOCK_K_BAND = MappingProxyType({_F32: 256, _F64: 256})

# A causal unit whose rows are whole squares of BLOCK_K_BAND keys (in both faces; in flex's, of
# whole blocks of a block mask whose rows are full before each square and empty after it) walks
# the squares along its diagonal together, one batched product for the same tile of every
# square, in pieces of BLOCK_K_DIAGONAL keys, each for the rows at and below its keys
# (sdpa.tiles.band.unit_pieces, sdpa.tiles.blocks.diagonal_squares):
# the masked triangle computed shrinks from BLOCK_K_BAND / 2 keys a row to BLOCK_K_DIAGONAL / 2
# for a few more steps, of small batched products. Causal over unmasked time, float32, width 64
# (Intel Xeon, AVX-512, 2 cores; medians of 9 interleaved rounds), at 4 x 8 x 1024 and
# 1 x 32 x 2048: on one thread, strips only 0.71 and 0.62, pieces of 32 keys 0.66 and 0.59, of
# 64 0.64 and 0.58, of 128 0.66 and 0.60; on two threads (1 x 8 x 4096 too) strips 0.74, 0.63,
# 0.59, pieces of 32 0.80, 0.67, 0.66, of 64 0.72, 0.61, 0.60, of 128 0.70, 0.62, 0.59 (the
# small products gain less on two threads: batched 64 x 64 products ran 1.44 times as fast on
# two threads as on one, 1024 x 256 ones 1.94 times).
# The keys before the squares, which every row of the unit meets, come in pieces of BLOCK_K
# (the dense face; flex's follow its blocks): fewer, longer steps. Against pieces of
# BLOCK_K_BAND, float32, two threads (same machine; medians of 7 runs in alternating
# processes): 1 x 8 x 4096 0.97, 1 x 32 x 2048 0.98, 1 x 1 x 4096 1.01 of the time. Strips
# meeting the same rows joined alike took 1.08 of the time at 1 x 1 x 1024 (units of 256 rows,
# in strips), and were left apart.
#: Keys per piece inside the squares of a causal diagonal, by working dtype (0: strips only).
BLOCK_K_DIAGONAL = MappingProxyType({_F32: 64, _F64: 64})

# Short rows (decoding: a few query rows per head) make short units, whose Python between
# NumPy's calls holds the GIL: the dense path folds several heads into one unit, its products
# batched over them. Grouped-query decoding, 32 query heads over 8 key heads, width 64, float32,
# two threads (2-core Xeon, Sapphire Rapids; medians of 15 interleaved rounds, on a loaded
# machine): at T = 2, S = 4096 a unit per key head took 5.1 ms, all 8 in one unit 3.5 (the
# reference path 5.1); at T = 4, S = 2048 6.5 and 2.5 ms (reference 3.4); one unit per thread
# (4 heads each) took 4.4 and 5.2 ms, the threads' start not paid back by calls of 2**18
# scores. At 64 over 8 key heads, T = 16, S = 16384 (2**24 scores) one unit per thread took
# 39 ms, one unit 62 and a unit per head 60.
#: Calls of short rows holding at most this many scores run all their heads in one unit.
SHORT_CALL_SCORES = 1 << 20

# -- the units and pieces of flex's tiled path (sdpa.flex, sdpa.tiles.blocks) --------------

# A row of query blocks' gathered key blocks are cut into pieces of at most this many keys. A
# (128, 4096) float32 tile of scores is 2 MiB. At T = S = 4096, 8 heads of width 64 in float32
# on one core of the benchmark machine (2-core Xeon, Sapphire Rapids; best of 5), 4096 took
# 0.98 to 0.99 of the CPU time of 2048 and 0.86 to 0.87 of 512, with a causal block mask and
# without a mask.
#: Keys per piece of flex's tiled path with a block mask (whole blocks of it, one at least;
#: without a mask flex cuts the keys as the dense path does, into ``BLOCK_K``).
PIECE_KEYS = 4096

# A unit takes the same query block of several key heads when the mask does not depend on the
# head: up to UNIT_SCORES scores, and never so many heads that the call has fewer than MIN_UNITS
# units (to share among threads). Every unit costs tens to hundreds of microseconds of Python,
# during which another worker thread waits whenever it needs the GIL too. At T = S = 4096, 8
# heads of width 64, float32, two threads (2-core Xeon, Sapphire Rapids), units of all 8 heads
# took 245 ms without a mask and 143 ms with a causal block mask, against 270 and 170 ms with a
# unit per head (and 2**20 or 2**21 scores: in between); on one thread, within 4 % either way.
#: Most scores of a flex unit that folds several key heads ...
UNIT_SCORES = 1 << 22  # 8 query blocks of 128 rows by 4096 keys: 16 MiB of float32
#: ... and the fewest units such folding leaves a call.
MIN_UNITS = 16

# A block mask keeps the tiled path's plans of its rows (their pieces, and what mask_mod gave on
# their partial blocks) for every later call with the same settings: a mask made once and used
# by every layer and step evaluates each partial block once, as create_block_mask evaluated
# each block once. At T = S = 4096, 8 heads of width 64, float32, two threads (2-core Xeon), a
# causal call spent about 8 ms of its threads' time making its 32 plans (mask_mod on a 128 x 128
# block: about 75 us each alone, more while the other thread contends for the GIL); kept, the
# call took 124-129 ms instead of 134-137.
#: Bytes of masks a block mask keeps beside it (causal at T = S = 32768 keeps 16 MiB).
PLAN_CACHE_BYTES = 1 << 26

# A worker's buffer of scores holds up to UNIT_SCORES entries (16 MiB of float32). Allocated at
# every call and freed after it, its pages are new to the process each time and fault when first
# written: flex_attention with a causal block mask at 1 x 8 x 4096 (width 64, float32, two
# threads, Intel Xeon with AVX-512, a virtual machine), timed between calls of other shapes
# (medians of 9 interleaved rounds), took 157 ms with fresh buffers, 135 ms when glibc was told
# to keep freed memory (MALLOC_TRIM_THRESHOLD_, MALLOC_MMAP_THRESHOLD_) and 135 ms with the
# buffers kept here; the dense causal call 127 and 125 ms. 64 MiB keeps the buffers of four
# workers of the largest units.
#: Bytes of the workers' buffers of scores kept for the next call (:mod:`sdpa.tiles.softmax`).
SCRATCH_BYTES = 1 << 26

# -- the backward kernel (sdpa.backward) ---------------------------------------------------

# A (Bq, Bk) tile of float64 scores is 256 KiB, half the 512 KiB level-2 cache of one core of
# the machine they were chosen on (AMD EPYC, Zen 3).
#: Query rows per tile of the tiled backward pass.
BACKWARD_BLOCK_Q = 128
#: Keys per tile of the tiled backward pass.
BACKWARD_BLOCK_K = 256

# The weights are rebuilt as P = exp(scores - lse). The rounding of a stored lse is an error in
# every exponent, of up to half a unit in its last place: negligible while |lse| is small, but
# at |lse| = 1e4 in float32 it is 5e-4, and at lse = finfo.min (a row whose every key carries
# the bias finfo.min) it swallows log(l) entirely. The reference path computes the softmax of
# the scores anew when a row's |lse| exceeds this limit; the tiled path renormalises its rows
# from a much lower one (RENORMALISE_LSE below).
#: Beyond this ``|lse|`` the reference backward computes a row's softmax anew.
LSE_EXACT_LIMIT = 64.0

# The tiled path rebuilds P from the forward pass's lse and D = rowsum(dO * O) from its output,
# which it computed from scores rounded in another arithmetic (sdpa.tiled works on tiles of
# its own, in base 2 where exp2 is the faster, and folds a shift into the product). The two
# roundings of a score differ by about |score| * eps, so a rebuilt row of P sums to
# 1 +- |score| eps, and D is not the rowsum(P * dP) of that P: the rounding no longer cancels
# in dS = P * (dP - D). At scores in the thousands in float32 that made the gradients 10 to
# 10^4 times less accurate than the reference path's. The query tiles holding a row whose
# root-mean-square score exceeds RENORMALISE_RMS, or whose |lse| exceeds RENORMALISE_LSE,
# therefore get their maximum, normaliser and D recomputed from the backward's own scores
# first (sdpa.backward's _row_statistics): about two thirds as much time again on those tiles, which
# ordinary inputs (scores of unit size, RMS about 1) do not pay. There the tiled path's errors
# were 0.4 to 1.2 times the reference path's; below the limits, where the forward pass's lse
# and D serve, typically 1 to 1.5 times and at worst 2.4 times (random float32 inputs with
# scores of RMS 0.25 to 1.5, Dk = 16 to 128).
#: The tiled backward recomputes a row's statistics when its scores' RMS exceeds this...
RENORMALISE_RMS = 1.5
#: ... or its ``|lse|`` exceeds this.
RENORMALISE_LSE = 16.0

# -- the online softmax's margins -----------------------------------------------------------

# Lazy rescaling: a row keeps its shift m while its scores stay below m + LAZY_MARGIN, so most
# tiles need neither a row-maximum pass nor a rescaling of the accumulator. A tile is accepted
# when every row sum of exp(scores - m) is at most e**LAZY_MARGIN, which bounds each term; a
# row that starts at the shift 0 must end with a sum of at least e**-LAZY_MARGIN. 20 leaves
# float32's e**88 far away and keeps the exact step rare (the fast-path appendix counts it).
#: How far above a row's shift ``m`` a score may lie before the shift must move.
LAZY_MARGIN = 20.0

# Folding computes fl(q.k - m) instead of fl(q.k) - m: its rounding error grows with |m|, which
# costs nothing while m is of the size of the scores, but a row whose scores are dominated by a
# large bias (a float mask filled with finfo.min or -1e9) must subtract m separately, as the
# reference path does, or q.k is lost.
#: The largest ``|m|`` that is folded into the first matrix product.
FOLD_LIMIT = 64.0

# The accumulator's weights reach e**LAZY_MARGIN where the reference path's are at most 1, and
# drop to e**-LAZY_MARGIN where the reference path's largest is at least 1 / S: values whose
# results come within 2**64 of the smallest normal number are scaled by a power of two first.
#: Results (of a value column) below ``2 ** VALUE_FLOOR_BITS`` times the smallest normal
#: number make the tiled path scale the values by a power of two and compute again.
VALUE_FLOOR_BITS = 64

# Each unit's result is read once for the largest |out| of each value column. NumPy reduces over
# the leading axes of an (rows, Dv) block along its rows, a loop of Dv entries per row; laid r rows
# side by side (a view) the loop runs over r Dv entries. For a (1024, 64) float32 block on one
# core (Intel Xeon, AVX-512; medians of 300 calls) that took 24 to 29 us with rows of 1024 or
# 4096 entries, against 71 us as (1024, 64): about 1.5 ms of a 114 ms one-thread call at
# 4 x 8 x 1024. Below 8 WIDE_ROW entries the extra calls cost more than they save: (64, 16) took
# 13.5 us laid side by side, 8.9 as it is; (128, 64) 11.9 and 12.8.
#: Entries per row of the reduction that finds each value column's largest ``|out|`` in a
#: unit's result (``widen_column_top`` of the engine's ``sdpa.tiles.ranges``).
WIDE_ROW = 1024


# -- the exponential ------------------------------------------------------------------------


def tile_exponential(dtype) -> Callable[..., np.ndarray]:
    """``numpy.exp2`` where NumPy computes it with SVML for ``dtype``, else ``numpy.exp``: the
    default exponential of :func:`sdpa.tiled.attention_tiled`.

    Decided from what the machine and NumPy's build are, never from a timing, so that every
    process on one machine computes the same bits: ``exp2`` for float32 on Linux x86-64 when
    NumPy dispatches its AVX-512 (SKX) loops, which hand float32 ``exp2`` to Intel's vector
    math library SVML. There it ran 1.7 to 2.1 times as fast as ``exp`` (Intel Xeon Sapphire
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
    >>> from sdpa.tuning import svml_exp2, tile_exponential
    >>> tile_exponential(np.float64) is np.exp  # exp2 is never chosen in float64
    True
    >>> tile_exponential(np.float32) is (np.exp2 if svml_exp2() else np.exp)
    True
    """
    return np.exp2 if np.dtype(dtype) == _F32 and svml_exp2() else np.exp


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
    >>> from sdpa.tuning import svml_exp2
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
