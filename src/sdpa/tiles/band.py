"""The dense face's plan: the causal/window band over the tiles, and the heads folded.

:mod:`sdpa.tiled` cuts a head's ``(T, S)`` scores into tiles of ``Bq`` query rows and ``Bk``
keys. Against the band (``lo <= j - (i + offset) <= hi``, either limit optional, see
``band_limits()``) a tile is *empty* (never computed), *full* (computed, no mask)
or *partial* (the band's edge crosses it: computed, then masked), as a block mask's blocks are
(``EMPTY``, ``FULL``, ``PARTIAL``). The rows of the band are intervals that
shift by one key per query and never cross, so the keys a block of queries may attend form one
interval, and the rows a key range reaches one run of rows.

Shape letters: ``T`` queries, ``S`` keys, ``G`` heads folded into a unit's rows.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from ..block_mask import EMPTY, FULL, PARTIAL
from ..problem import AttentionProblem
from ..threads import default_num_threads
from ..tuning import BLOCK_K, BLOCK_K_BAND, BLOCK_ROWS, BLOCK_ROWS_FULL, SHORT_CALL_SCORES
from .blocks import key_heads_per_unit

__all__: list[str] = []


def tile_kind(t0: int, t1: int, s0: int, s1: int, offset: int, lo, hi) -> int:
    """Classify the tile of queries ``t0:t1`` and keys ``s0:s1`` against the band."""
    d_min = s0 - (t1 - 1 + offset)  # smallest j - (i + o) in the tile
    d_max = (s1 - 1) - (t0 + offset)  # largest
    if (hi is not None and d_min > hi) or (lo is not None and d_max < lo):
        return EMPTY
    if (lo is None or d_min >= lo) and (hi is None or d_max <= hi):
        return FULL
    return PARTIAL


def band_keys(t0: int, t1: int, S: int, offset: int, lo, hi) -> tuple[int, int]:
    """Keys ``start:stop`` that the band allows to at least one of the queries ``t0:t1``."""
    start = 0 if lo is None else max(0, t0 + offset + lo)
    stop = S if hi is None else min(S, t1 + offset + hi)
    return start, max(start, stop)


def block_key_spans(T: int, S: int, block_q: int, offset: int, lo, hi):
    """``(t0, t1, start, stop)`` of every block of ``block_q`` queries, as int64 arrays: its
    queries ``t0:t1`` and the keys ``start:stop`` the band allows to one of them at least
    (:func:`band_keys` for all the blocks at once)."""
    t0 = np.arange(0, T, block_q, dtype=np.int64)
    t1 = np.minimum(t0 + block_q, T)
    start = np.zeros_like(t0) if lo is None else np.maximum(0, t0 + offset + lo)
    stop = np.full_like(t0, S) if hi is None else np.minimum(S, t1 + offset + hi)
    return t0, t1, start, np.maximum(start, stop)


def allowed_in_run(shape: tuple[int, ...], disallowed: np.ndarray, masked: slice) -> np.ndarray:
    """``shape`` bool, ``(..., r, keys)``: True where a piece's scores of a run of ``r`` rows are
    allowed, from ``disallowed`` on its rows ``masked`` (the run's other rows: all allowed)."""
    allowed = np.ones(shape, dtype=bool)
    np.logical_not(disallowed, out=allowed[..., masked, :])
    return allowed


class BandPiece(NamedTuple):
    """A piece of a dense unit's walk: the keys ``s0:s1`` for the rows ``run`` (a slice of the
    unit's rows); with ``parts > 1`` the unit's rows are cut into ``parts`` equal squares
    along the causal diagonal and the piece takes the rows ``run`` of each square, square
    ``b`` with the keys ``s0 + b w : s1 + b w`` (``w`` the squares' width): the same tile
    of every square, one batched product for them all."""

    s0: int
    s1: int
    run: slice
    parts: int = 1


def square_width(t0, t1, S: int, block_k: int, diagonal: int, offset: int, lo, hi):
    """The width of the squares the unit of queries ``t0:t1`` walks its causal diagonal in,
    or 0 when it walks strips of ``block_k`` keys (:func:`unit_pieces`); for ``t0`` and
    ``t1`` int arrays, of every unit at once (the cost model's count).

    Squares of ``block_k`` rows, when the band has an upper edge only (a causal mask), the
    unit's rows are two squares or more (a unit of one square would trade its one piece for
    ``block_k / diagonal`` small ones: at 1 x 1 x 1024, float32, units of one square took
    1.15 times as long), ``block_k`` is a multiple of ``diagonal`` (the width of the pieces
    inside a square, smaller), and the unit's diagonal lies within the keys ``0:S``."""
    if lo is not None or hi is None or not 0 < diagonal < block_k or block_k % diagonal:
        return 0 * t0
    rows, k0 = t1 - t0, t0 + offset + hi  # row t0 + y meets the keys up to k0 + y
    fits = (rows % block_k == 0) & (rows >= 2 * block_k) & (k0 >= 0) & (k0 + rows <= S)
    return block_k * fits


def keys_before_squares(problem: AttentionProblem, block_k: int | None, bk: int) -> int:
    """Keys per piece before a causal diagonal in squares (``unit_pieces``'s ``wide``):
    ``BLOCK_K`` when the band is causal-like (an upper edge only), the caller set no
    ``block_k`` and ``BLOCK_K`` is a multiple of the tiles' ``bk`` keys; else ``bk``."""
    wide = BLOCK_K.get(problem.work_dtype, 0)
    causal = problem.band[0] is None and problem.band[1] is not None
    return wide if causal and block_k is None and wide > bk and wide % bk == 0 else bk


def unit_pieces(
    t0: int, t1: int, S: int, block_k: int, diagonal: int, offset: int, lo, hi, wide: int = 0
) -> list[BandPiece]:
    """The pieces the dense face walks for the unit of queries ``t0:t1``, in order.

    By strips (``diagonal`` 0, or the unit's diagonal not in squares, see
    :func:`square_width`): the keys the band allows some row, cut at multiples of
    ``block_k``, each piece for the rows its keys are allowed to (:func:`rows_meeting`).

    By squares of ``w = block_k`` rows along a causal diagonal (row ``t0 + y`` meets the keys
    up to ``k0 + y``): first the squares themselves, a piece of ``diagonal`` keys at a time
    for all squares at once (``parts``), the one at ``a`` keys into each square for its rows
    from ``a`` on; then the strip of each square's keys for the rows below the square; then
    the keys before the diagonal, which every row meets, at multiples of ``wide`` (a multiple
    of ``block_k``; default ``block_k``). The masked triangle computed is then
    ``diagonal / 2`` keys a row rather than ``block_k / 2``.
    """
    band = (offset, lo, hi)
    wide = wide if wide > block_k and wide % block_k == 0 else block_k
    w = square_width(t0, t1, S, block_k, diagonal, *band)
    if not w:
        start, stop = band_keys(t0, t1, S, *band)
        first, last = key_block_range(t0, t1, S, block_k, *band)
        pieces = []
        for b in range(first, last):
            s0, s1 = max(b * block_k, start), min((b + 1) * block_k, stop)
            pieces.append(BandPiece(s0, s1, rows_meeting(t0, t1, s0, s1, *band)))
        return pieces
    rows, k0 = t1 - t0, t0 + offset + hi
    squares = rows // w
    pieces = [BandPiece(k0 + a, k0 + a + diagonal, slice(a, w), squares)
              for a in range(0, w, diagonal)]  # fmt: skip
    pieces += [BandPiece(k0 + b * w, k0 + (b + 1) * w, slice((b + 1) * w, rows))
               for b in range(squares - 1)]  # fmt: skip
    pieces += [BandPiece(s0, min(s0 + wide, k0), slice(0, rows))
               for s0 in range(0, k0, wide)]  # fmt: skip
    return pieces


def key_block_range(t0: int, t1: int, S: int, block_k: int, offset: int, lo, hi):
    """Indices ``(first, stop)`` of the key blocks that the band allows for queries ``t0:t1``."""
    start, stop = band_keys(t0, t1, S, offset, lo, hi)
    if start == stop:
        return 0, 0
    return start // block_k, -(-stop // block_k)


def rows_meeting(t0: int, t1: int, s0: int, s1: int, offset: int, lo, hi) -> slice:
    """The rows (``0`` to ``t1 - t0``) of the queries ``t0:t1`` that the band allows some key
    of ``s0:s1``: one run of rows."""
    first, stop = 0, t1 - t0
    if hi is not None:  # row i reaches key i + offset + hi >= s0
        first = max(first, s0 - offset - hi - t0)
    if lo is not None:  # row i starts at key i + offset + lo <= s1 - 1
        stop = min(stop, s1 - 1 - offset - lo - t0 + 1)
    return slice(first, max(first, stop))


def partial_rows(t0: int, s0: int, s1: int, run: slice, offset: int, lo, hi) -> slice:
    """The rows of ``run`` (rows of the queries from ``t0``, meeting keys ``s0:s1``) that the
    band's edge crosses, as a slice of the run: one run of rows holding every row that some
    key of ``s0:s1`` is outside the band of (all of ``run`` when the band's full rows lie
    strictly inside it, as a window's may)."""
    a, b = run.start, run.stop
    full_from = -(10**18) if hi is None else s1 - 1 - offset - hi - t0  # i + o + hi >= s1 - 1
    full_to = 10**18 if lo is None else s0 - offset - lo - t0 + 1  # i + o + lo <= s0
    f0, f1 = max(a, full_from), min(b, full_to)
    if f0 >= f1:  # no full row
        first, stop = a, b
    elif f0 == a:  # the full rows come first
        first, stop = f1, b
    elif f1 == b:  # ... or last
        first, stop = a, f0
    else:
        first, stop = a, b
    return slice(first - a, max(first, stop) - a)


class BandTiles:
    """The band's masks of tiles, cached by their geometry (a causal call meets the same few
    diagonal tiles in every unit). One per worker thread.

    Each comes twice: as bools, True where the band disallows (for the exact step, which sets
    those scores to ``-inf``), and as weights of the working ``dtype``, 0 there and 1 elsewhere
    (for the lazy step, which multiplies its terms by them: a third of the time of setting
    them to 0 where a bool mask says).
    """

    def __init__(self, offset: int, lo, hi, dtype):
        self.offset, self.lo, self.hi, self.dtype = offset, lo, hi, dtype
        self.cache: dict = {}

    def disallowed(self, t0: int, t1: int, s0: int, s1: int) -> np.ndarray:
        """``(t1 - t0, s1 - s0)`` bool: the band's mask of queries ``t0:t1``, keys ``s0:s1``."""
        return self.tiles(t0, t1, s0, s1)[0]

    def tiles(self, t0: int, t1: int, s0: int, s1: int) -> tuple[np.ndarray, np.ndarray]:
        """``(disallowed, weights)`` of queries ``t0:t1`` and keys ``s0:s1``, both
        ``(t1 - t0, s1 - s0)``: bools, True where the band disallows, and ``~disallowed`` in
        the working dtype."""
        key = (s0 - t0, t1 - t0, s1 - s0)
        tiles = self.cache.get(key)
        if tiles is None:
            diff = np.arange(s0, s1)[None, :] - (np.arange(t0, t1)[:, None] + self.offset)
            tile = np.zeros(diff.shape, dtype=bool)
            if self.lo is not None:
                tile |= diff < self.lo
            if self.hi is not None:
                tile |= diff > self.hi
            weights = (~tile).astype(self.dtype)
            for a in (tile, weights):  # shared by the worker's units: read, never written
                a.flags.writeable = False
            if len(self.cache) > 64:
                self.cache.clear()
            tiles = self.cache[key] = (tile, weights)
        return tiles


def fold_axis(problem: AttentionProblem) -> bool:
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
    """``(G, block_q, block_k)``: the heads folded into a unit's rows and the tile sizes.

    The last batch axis is folded into the query rows when keys and values do not vary along
    it (``G`` of its heads share one key tile); both tile sizes are clipped to the problem's
    ``T`` and ``S``. ``block_q`` defaults to up to ``BLOCK_ROWS_FULL`` rows after folding (long
    units cost less per score), at least ``BLOCK_ROWS``, and fewer while the units would leave
    one of the ``num_threads`` threads (default :func:`sdpa.threads.default_num_threads`)
    without work: one unit per thread without a band, two under a causal mask or a window,
    whose units differ in length. ``block_k`` defaults to ``BLOCK_K``, or ``BLOCK_K_BAND``
    under a band: a unit's piece meets only the rows its keys are allowed to (a causal piece,
    the rows at and below the diagonal), so narrower pieces follow the diagonal closer.
    """
    G = problem.batch_shape[-1] if fold_axis(problem) else 1
    banded = problem.band != (None, None)
    if block_q is None:
        outer = math.prod(problem.batch_shape) // G
        per_thread = 2 if banded else 1
        rows = unit_rows(problem.work_dtype, problem.T, G, outer, num_threads, per_thread)
        block_q = max(1, rows // G)
    if block_k is None:
        block_k = (BLOCK_K_BAND if banded else BLOCK_K).get(problem.work_dtype, 512)
    # Never larger than the problem: the workers' buffers are sized by the tiles.
    return G, int(min(block_q, max(problem.T, 1))), int(min(block_k, max(problem.S, 1)))


def unit_rows(
    dtype: np.dtype, T: int, G: int, outer: int, num_threads: int | None, per_thread: int = 1
) -> int:
    """Query rows of a unit (the ``G`` folded heads' rows counted): up to ``BLOCK_ROWS_FULL``
    (longer tiles cost less per score), at least ``BLOCK_ROWS``, and fewer when the ``outer``
    units of whole heads would leave a thread fewer than ``per_thread`` units."""
    rows = BLOCK_ROWS.get(dtype, 128)
    threads = num_threads or default_num_threads()
    blocks = -(-threads * per_thread // max(outer, 1))  # per head
    rows_per_block = G * -(-T // blocks)  # the rows, split into `blocks`
    return max(rows, min(BLOCK_ROWS_FULL.get(dtype, rows), rows_per_block))


def heads_per_unit(
    problem: AttentionProblem, G: int, block_q: int, outer: tuple[int, ...], num_threads=None
) -> int:
    """Entries of the last outer axis (heads, each with its ``G`` folded query heads) that one
    unit takes. A unit costs tens of microseconds of Python between NumPy's calls, during which
    another worker may wait for the GIL, so short units are folded together:

    * rows shorter than ``BLOCK_ROWS`` against a key tile or more (decoding, a few queries per
      head of a long cache): all the heads in one unit when the call holds at most
      ``SHORT_CALL_SCORES`` scores, else as many as leave each of the ``num_threads`` threads
      one unit, within ``BLOCK_ROWS_FULL`` rows (many heads of a few keys each stay apart:
      one short tile each, where the reference path's batched products are the faster);
    * under a causal mask or a window, whose pieces are narrower (``BLOCK_K_BAND``) and so
      more: as flex folds key heads (``key_heads_per_unit``: within ``UNIT_SCORES`` scores,
      leaving ``MIN_UNITS`` units);
    * otherwise one: the units are long already.

    Depends on the shapes (and the thread count) alone.
    """
    if not outer:
        return 1
    heads, dtype = outer[-1], problem.work_dtype
    rows = G * min(problem.T, block_q)  # a unit's rows for one head
    if rows < BLOCK_ROWS.get(dtype, 128) and problem.S >= BLOCK_K.get(dtype, 512):
        if math.prod(outer) * rows * problem.S <= SHORT_CALL_SCORES:
            return heads
        threads = num_threads or default_num_threads()
        return int(max(1, min(-(-heads // threads), BLOCK_ROWS_FULL.get(dtype, 1024) // rows)))
    if problem.band == (None, None):
        return 1
    # flex's rule for a mask that does not depend on the head: a row of one block as wide as
    # the widest unit's keys (S under a causal mask; the rows and the window under a window)
    n_q, lead = -(-problem.T // block_q), math.prod(outer[:-1])
    _, _, start, stop = block_key_spans(
        problem.T, problem.S, block_q, problem.offset, *problem.band
    )
    widest = int((stop - start).max())
    return int(key_heads_per_unit(lead, heads, G, n_q, np.array(1), block_q, max(1, widest)))


def unit_outer(problem: AttentionProblem, G: int) -> tuple[int, ...]:
    """The outer axes of the dense face's units (one at least): the batch axes, without the
    last when its ``G`` heads are folded into the rows."""
    bs = problem.batch_shape
    return (bs[:-1] if G > 1 else bs) or (1,)


def head_groups(problem: AttentionProblem, G: int, block_q: int, num_threads=None) -> int:
    """Units per block of query rows: the outer entries, ``heads_per_unit`` of the last outer
    axis to a unit."""
    outer = unit_outer(problem, G)
    n = heads_per_unit(problem, G, block_q, outer, num_threads)
    return math.prod(outer[:-1]) * -(-outer[-1] // n)
