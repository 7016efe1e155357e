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

This module is the dense face of the engine in :mod:`sdpa.tiles` (which the tiled path of
:func:`sdpa.flex_attention` runs on too): its plan of units and tiles against the
causal/window band, the boolean mask, the float bias and the sinks. What matters for speed on
a CPU, where every NumPy call is a full pass over a tile (the tunables are in
:mod:`sdpa.tuning`, each with the measurement that chose it):

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
  entirely inside it are not masked; a piece of keys the band's edge crosses is computed only
  for the rows its keys are allowed to (a causal block walks its diagonal as a staircase of
  strips, or, when its rows are whole squares of ``BLOCK_K_BAND``, walks the squares along
  its diagonal all at once in narrower pieces), and only the rows the edge crosses are masked;
* independent work units (one query block of one head, with the query rows of all heads that
  share a key/value head folded in, so each key tile is loaded once for the whole group; of
  several heads, their products batched, when the units are short) are
  shared out among threads started for the call (:func:`sdpa.threads.run_in_threads`), with
  BLAS held to one thread: NumPy releases the GIL inside matrix products and ufunc loops, so
  the threads run in parallel, and BLAS's own threading parallelises each small product badly.
  What a unit computes depends on its inputs alone, so the bits do not depend on the threads.

Shape letters: ``T`` queries, ``S`` keys, ``Dk``/``Dv`` head widths, ``Bq``/``Bk`` tile sizes,
``G`` query heads folded into the rows of one tile: the heads of a group under grouped-query
attention, or of any batch axis along which the keys and values do not vary.
"""

from __future__ import annotations

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
from .block_mask import EMPTY, PARTIAL
from .masks import alignment_offset, band_limits
from .problem import AttentionProblem, check_overflow, mark_poisoned
from .threads import default_num_threads
from .tiles.band import (
    BandPiece,
    BandTiles,
    allowed_in_run,
    heads_per_unit,
    key_block_range,
    keys_before_squares,
    partial_rows,
    tile_kind,
    tile_plan_sizes,
    unit_outer,
    unit_pieces,
)
from .tiles.blocks import SquarePiece
from .tiles.ranges import restore_scale, value_exponents, values_may_be_out_of_range
from .tiles.softmax import ALL, LOG2E, OnlineSoftmax, Workspace
from .tiles.workers import Counts, column_top, run_units
from .tuning import BLOCK_K_DIAGONAL, FOLD_LIMIT, tile_exponential

__all__ = ["TileStats", "attention_tiled", "tile_map"]

_EVERY_KEY = object()  # a tile whose every score the user's boolean mask disallows


@dataclass
class TileStats(Counts):
    """Counters of the work :func:`attention_tiled` did, filled when passed as ``stats``.

    The counts add up over calls, so one ``TileStats`` can total several.

    Attributes
    ----------
    units : int
        Work units run: one block of query rows of one head, with the heads that share its
        keys folded in (under a causal mask or a window, of several heads).
    computed : int
        Tiles whose scores were computed, counted for each head (a step along a causal
        diagonal in squares computes a tile of each square).
    steps : int
        Rounds of NumPy calls that computed them: a unit of several heads computes one tile
        of each in one step (``computed`` counts each head's).
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
    TileStats(units=0, computed=0, steps=0, rescaled=0, skipped_band=0, skipped_mask=0, redone=0, retried=0)
    """

    units: int = 0
    computed: int = 0
    steps: int = 0
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
        super().add(other)


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
        first, stop = key_block_range(t0, t1, S, block_k, offset, lo, hi)
        for b in range(first, stop):
            s0, s1 = b * block_k, min(S, (b + 1) * block_k)
            kinds[a, b] = tile_kind(t0, t1, s0, s1, offset, lo, hi)
    return kinds


# ----------------------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------------------


@dataclass
class _Plan:
    """Everything a worker needs, as views shaped ``(*outer, G, ...)`` or ``(*outer, ...)``,
    with at least one outer axis; a unit takes ``n`` consecutive entries of the last one."""

    q: np.ndarray  # (*outer, G, T, Dk)
    k: np.ndarray  # (*outer, S, Dk) view of the keys
    v: np.ndarray  # (*outer, S, Dv) view of the values (scaled by 2 ** -v_exp, if set)
    allowed: np.ndarray | None  # (*outer, G, T, S) bool view, or None
    bias: np.ndarray | None  # (*outer, G, T, S) view, or None
    sinks: np.ndarray | None  # (*outer, G, T) view of the sinks' logits, or None
    out: np.ndarray  # (*outer, G, T, Dv), written by the workers
    lse: np.ndarray  # (*outer, G, T)
    m: np.ndarray | None  # (*outer, G, T): the final shift of each row, when asked for
    l: np.ndarray | None  # (*outer, G, T): the row sums at that shift, when asked for
    scale: float  # the query's factor: the scale, times LOG2E in base 2
    fold_limit: float  # FOLD_LIMIT in the scores' units
    offset: int
    lo: int | None
    hi: int | None
    T: int
    S: int
    Dk: int
    Dv: int
    G: int
    n: int  # heads (entries of the last outer axis) per unit
    block_q: int
    block_k: int
    wide: int  # keys of a piece before a diagonal in squares (band.keys_before_squares)
    diagonal: int  # keys of a piece inside the squares of a causal diagonal (0: strips only)
    dtype: np.dtype
    may_overflow: bool  # check every tile's scores for overflow (see attention.check_overflow)
    problem: AttentionProblem  # for error messages
    exp: Callable[..., np.ndarray]  # the tiles' exponential, exp(x, out=x)
    base2: bool  # the scores are in base 2
    v_exp: np.ndarray | None  # (Dv,) int: the values were scaled by 2 ** -v_exp (or None)


def _make_plan(
    problem: AttentionProblem,
    block_q,
    block_k,
    block_diagonal,
    num_threads,
    with_stats=False,
    exp=None,
    v_exp=None,
) -> _Plan:
    T, S, Dk, Dv = problem.T, problem.S, problem.Dk, problem.Dv
    dtype = problem.work_dtype
    bs = problem.batch_shape
    G, block_q, bk = tile_plan_sizes(problem, block_q, block_k, num_threads)
    wide = keys_before_squares(problem, block_k, bk)  # the user's block_k sizes every piece
    block_k = bk
    fold = G > 1
    outer = bs[:-1] if fold else bs
    lead = (lambda a: a) if outer else (lambda a: a[None])  # one outer axis at least

    def rows_view(a, last):  # broadcast a (..., T, last) array to (*outer, G, T, last)
        full = np.broadcast_to(a, (*bs, T, last))
        return lead(full if fold else full[..., None, :, :])

    def row_sinks(a):  # broadcast the (..., T) sinks to (*outer, G, T)
        full = np.broadcast_to(a, (*bs, T))
        return lead(full if fold else full[..., None, :])

    def heads_view(a, last):  # the (S, last) head of a (..., S, last) array each outer index reads
        full = np.broadcast_to(a, (*bs, S, last))
        return lead(full[..., 0, :, :] if fold else full)

    # Base 2: the scores are computed in units of ln 2 (the query's scale times LOG2E), so
    # that the tiles' exponential is exp2. Not with a float bias (bias * LOG2E can overflow
    # where the bias did not) nor where scores may overflow.
    if exp is None:
        exp = tile_exponential(dtype)
    base2 = exp is np.exp2 and problem.bias is None and not problem.may_overflow
    if exp is np.exp2 and not base2:
        exp = np.exp
    to_base = LOG2E if base2 else 1.0
    allowed = None if problem.allowed is None else rows_view(problem.allowed, S)
    bias = None if problem.bias is None else rows_view(problem.bias, S)
    lo, hi = problem.band
    value = problem.value if v_exp is None else np.ldexp(problem.value, -v_exp)  # exact
    outer = unit_outer(problem, G)
    stat = (lambda: np.empty((*outer, G, T), dtype=dtype)) if with_stats else (lambda: None)
    return _Plan(
        q=rows_view(problem.query, Dk),
        k=heads_view(problem.key, Dk),
        v=heads_view(value, Dv),
        allowed=allowed,
        bias=bias,
        sinks=None if problem.sinks is None else row_sinks(problem.sinks),
        out=np.empty((*outer, G, T, Dv), dtype=dtype),
        lse=np.empty((*outer, G, T), dtype=dtype),
        m=stat(),
        l=stat(),
        scale=problem.scale * to_base,
        fold_limit=FOLD_LIMIT * to_base,
        offset=problem.offset,
        lo=lo,
        hi=hi,
        T=T,
        S=S,
        Dk=Dk,
        Dv=Dv,
        G=G,
        n=heads_per_unit(problem, G, block_q, outer, num_threads),
        block_q=int(block_q),
        block_k=int(block_k),
        wide=int(wide),
        diagonal=BLOCK_K_DIAGONAL.get(dtype, 0) if block_diagonal is None else block_diagonal,
        dtype=dtype,
        may_overflow=problem.may_overflow,
        problem=problem,
        exp=exp,
        base2=base2,
        v_exp=v_exp,
    )


class _Space(Workspace):
    """A worker's buffers (:class:`sdpa.tiles.softmax.Workspace`), with the dense face's own:
    the queries with a column for the folded shift, the user's mask of a tile, the unfolded
    shifts, and the keys with a column of ones (made only when a shift is folded in)."""

    def __init__(self, plan: _Plan):
        rows, bk = plan.n * plan.G * plan.block_q, min(plan.wide, plan.S)  # wide >= block_k
        super().__init__(rows, bk, plan.Dv, plan.dtype)
        self.q_shifted = np.empty(rows * (plan.Dk + 1), plan.dtype)  # [query * scale | -m]
        self.disallowed = np.empty(rows * bk, bool) if plan.allowed is not None else None
        self.unfolded = np.empty(rows, plan.dtype)  # m of the rows whose shift is not folded
        # [k | 1] of a unit's head, (S, Dk + 1): made (by copying the keys) only for a unit
        # that folds a shift into the first product, which inputs of moderate scores never do
        self.k1: np.ndarray | None = None

    def keys_with_ones(self, k: np.ndarray) -> np.ndarray:
        """``[k | 1]``: a unit's keys ``(n, S, Dk)`` with a column of ones, ``(n, S, Dk + 1)``."""
        n, S, Dk = k.shape
        if self.k1 is None or self.k1.shape[0] < n:
            self.k1 = np.empty((n, S, Dk + 1), k.dtype)
            self.k1[..., Dk] = 1
        k1 = self.k1[:n]
        k1[..., :Dk] = k
        return k1


class _Unit:
    """One work unit in progress: the query rows ``t0:t1`` of the ``G`` folded heads of the
    ``n`` heads at outer index ``o`` (its last entry a slice of the last outer axis),
    ``rows = n * G * (t1 - t0)`` rows of scores, and their online softmax.

    What the dense face adds to the engine's steps (:class:`sdpa.tiles.softmax.OnlineSoftmax`)
    is the folded shift: once a row's shift has moved, ``-m`` is the last column of
    ``q_shifted = [query * scale | -m]``, so that one product with ``[k | 1]`` gives the
    scores minus the shift, for the rows where that is exact (``|m| <= FOLD_LIMIT``); the
    other rows subtract their shift (``unfolded``) after the product.
    """

    def __init__(self, plan: _Plan, space: _Space, o: tuple, t0: int, t1: int, at_zero):
        G, Dk, bq = plan.G, plan.Dk, t1 - t0
        self.k, self.v = plan.k[o], plan.v[o]  # (n, S, Dk), (n, S, Dv): views of the heads
        n = self.k.shape[0]
        rows = n * G * bq
        self.plan, self.space = plan, space
        self.o, self.t0, self.t1, self.rows, self.n = o, t0, t1, rows, n
        self.k1_t = None  # (n, Dk + 1, S), [k | 1] transposed, made once a shift is folded in
        self.allowed = None if plan.allowed is None else plan.allowed[o]  # (n, G, T, S)
        self.bias = None if plan.bias is None else plan.bias[o]  # (n, G, T, S)
        self.q_shifted = space.q_shifted[: rows * (Dk + 1)].reshape(n, G * bq, Dk + 1)
        self.q_heads = self.q_shifted.reshape(n, G, bq, Dk + 1)  # a view per folded head
        np.multiply(plan.q[o][:, :, t0:t1, :], plan.scale, out=self.q_heads[..., :Dk])
        self.k_t = self.k.transpose(0, 2, 1)  # (n, Dk, S): the keys as the product takes them
        self.q_shifted[..., Dk] = 0  # -m of the rows whose shift is folded in, else 0
        self.any_folded = False  # while no shift is folded in, the keys need no column of ones
        self.unfolded = space.unfolded[:rows]
        self.unfolded.fill(0)
        self.any_unfolded = False
        self.softmax = OnlineSoftmax(
            space, rows, plan.Dv, plan.exp, plan.base2, at_zero, groups=n * G
        )

    def shift_columns(self, run: slice, parts: int = 1) -> tuple[np.ndarray, np.ndarray]:
        """``(folded, unfolded)`` of the rows ``run`` of each folded head (of each of its
        ``parts`` squares), ``(n G parts, r)`` views: ``-m`` where a row's shift is folded
        into ``q_shifted`` (its last column), else 0; ``m`` where it is subtracted after the
        product instead, else 0."""
        groups, length = self.n * self.plan.G * parts, (self.t1 - self.t0) // parts
        folded = self.q_heads.reshape(groups, length, -1)[:, run, -1]
        return folded, self.unfolded.reshape(groups, length)[:, run]

    def scores(self, piece: BandPiece) -> np.ndarray:
        """The scores buffer viewed as the piece's tile: ``(n, G, r, keys)`` of ``r`` rows per
        head, or ``(n, G, parts, r, keys)`` of ``r`` rows per square."""
        r, keys, parts = piece.run.stop - piece.run.start, piece.s1 - piece.s0, piece.parts
        squares = (parts,) if parts > 1 else ()
        return self.space.scores_view((self.n, self.plan.G, *squares, r, keys))

    def values(self, piece: BandPiece) -> np.ndarray:
        """The piece's values: ``(n, keys, Dv)``, or ``(n, 1, parts, keys, Dv)`` by square."""
        if piece.parts == 1:
            return self.v[:, piece.s0 : piece.s1]
        return self.by_square(self.v, piece)[:, None]

    def by_square(self, a: np.ndarray, piece: BandPiece) -> np.ndarray:
        """``(n, parts, keys, D)`` view of ``a`` ``(n, S, D)``: the piece's keys of each square
        (as flex's :class:`sdpa.tiles.blocks.SquarePiece` gathers them)."""
        w, a0 = (self.t1 - self.t0) // piece.parts, piece.run.start
        square = SquarePiece(piece.s0 - a0, w, piece.parts, a0, piece.s1 - piece.s0)
        return square.gather(a)

    def lazy_step(self, piece: BandPiece, disallowed, masked: slice) -> bool:
        """Add the piece's keys to its rows at their present shifts (the engine's lazy step);
        False if not exact."""
        scores = self.scores(piece)
        self.shifted_scores(scores, piece, folded=True)
        softmax, values = self.softmax, self.values(piece)
        return softmax.lazy_step(scores, values, disallowed, piece.run, masked, piece.parts)

    def exact_step(self, piece: BandPiece, disallowed, masked: slice) -> None:
        """The engine's exact step on the raw scores (nothing folded in, so in base e they are
        rounded exactly as the reference path rounds them); then the new shifts of the rows
        ``run`` are folded into ``q_shifted`` where that is exact and kept in ``unfolded``
        for the others."""
        plan, scores, run, parts = self.plan, self.scores(piece), piece.run, piece.parts
        self.shifted_scores(scores, piece, False, disallowed, masked, plan.may_overflow)
        values, masks = self.values(piece), disallowed is not None
        self.softmax.exact_step(scores, values, masks, run, parts)
        m = self.softmax.state(run, parts)[0]
        small = np.abs(m) <= plan.fold_limit  # rows whose shift can be folded in exactly
        folded, unfolded = self.shift_columns(run, parts)
        np.copyto(folded, np.where(small, -m, 0))
        np.copyto(unfolded, np.where(small, 0, m))
        whole = (run.stop - run.start) * parts == self.t1 - self.t0
        self.any_folded = bool(small.any()) or (self.any_folded and not whole)
        self.any_unfolded = bool(self.unfolded.any())

    def shifted_scores(
        self, scores, piece, folded, disallowed=None, masked=ALL, check=False
    ) -> None:
        """``scores = scale * q k^T + bias`` on the piece's tile (:meth:`scores`), less each
        row's shift ``m`` if ``folded`` (``m`` is folded into the product or subtracted after
        it), disallowed entries (of the rows ``masked`` of the run) set to ``-inf``. With
        ``check``, the raw scores are checked for overflow first."""
        s0, s1, run, parts = piece
        n, G, r, bk = scores.shape[0], scores.shape[1], *scores.shape[-2:]
        ones = folded and self.any_folded
        if ones and self.k1_t is None:
            self.k1_t = self.space.keys_with_ones(self.k).transpose(0, 2, 1)
        if parts > 1:  # (n, G, parts, r, Dk [+ 1]) @ (n, 1, parts, Dk [+ 1], bk)
            q = self.q_heads if ones else self.q_heads[..., :-1]
            q = q.reshape(n, G, parts, -1, q.shape[-1])[:, :, :, run]
            keys = self.by_square(self.space.k1[:n] if ones else self.k, piece)
            np.matmul(q, keys.swapaxes(-1, -2)[:, None], out=scores)
        elif r == self.t1 - self.t0:  # (n, G bq, Dk [+ 1]) @ (n, Dk [+ 1], bk): one per key head
            q = self.q_shifted if ones else self.q_shifted[..., :-1]
            keys = (self.k1_t if ones else self.k_t)[:, :, s0:s1]
            np.matmul(q, keys, out=scores.reshape(n, G * r, bk))
        else:  # the run's rows of each head: (n, G, r, Dk [+ 1]) @ (n, 1, Dk [+ 1], bk)
            q = self.q_heads if ones else self.q_heads[..., :-1]
            keys = (self.k1_t if ones else self.k_t)[:, :, s0:s1]
            np.matmul(q[:, :, run], keys[:, None], out=scores)
        t0, t1 = self.t0 + run.start, self.t0 + run.stop
        bias = None if self.bias is None else self.bias[:, :, t0:t1, s0:s1]  # (parts 1 only)
        if bias is not None:
            np.add(scores, bias, out=scores)
        if folded and self.any_unfolded:
            unfolded = self.shift_columns(run, parts)[1]  # (n G parts, r)
            rows = scores.reshape(n * G * parts, r, bk)
            np.subtract(rows, unfolded[..., None], out=rows)
        if check:
            allowed = None
            if disallowed is not None:
                allowed = allowed_in_run(scores.shape, disallowed, masked)
            check_overflow(self.plan.problem, scores, allowed, bias)
        if disallowed is not None:
            np.copyto(scores[..., masked, :], -np.inf, where=disallowed)

    def write_result(self) -> None:
        """The engine's finish (sinks included) into the plan's ``out``, ``lse``, ``m``, ``l``."""
        plan, o, t0, t1 = self.plan, self.o, self.t0, self.t1
        shape = (self.n, plan.G, t1 - t0)
        sinks = None if plan.sinks is None else plan.sinks[o][:, :, t0:t1].reshape(self.rows)
        out = plan.out[o][:, :, t0:t1, :]  # (n, G, bq, Dv) view of the result
        lse, m, l = self.softmax.finish(out, sinks)
        restore_scale(out, plan.v_exp, self.space.top)
        plan.lse[o][:, :, t0:t1] = lse.reshape(shape)
        if plan.m is not None:
            plan.m[o][:, :, t0:t1] = m.reshape(shape)
            plan.l[o][:, :, t0:t1] = l.reshape(shape)


class _Worker:
    """One thread: its buffers, its counters, and the walk of each unit it takes.

    :meth:`walk` reads top to bottom: for each key tile its mask, the lazy step (accepted when
    its row sums prove it exact) or else the exact step. What a unit computes depends on its
    own inputs only, never on the units the worker took before it.
    """

    def __init__(self, plan: _Plan):
        self.plan = plan
        self.space = _Space(plan)
        self.stats = TileStats()  # this worker's counts (units and skipped_band: the caller's)
        self.band = BandTiles(plan.offset, plan.lo, plan.hi, plan.dtype)

    def run(self, o: tuple, t0: int, t1: int) -> None:
        """Attention for the query rows ``t0:t1`` of every folded head at outer index ``o``.

        Without a mask or a bias the unit first tries the shift ``m = 0`` for every row; if a
        row's scores turn out too small for it, the unit is walked again from the exact step.
        """
        plan = self.plan
        at_zero = plan.allowed is None and plan.bias is None and not plan.may_overflow
        unit = _Unit(plan, self.space, o, t0, t1, at_zero)
        if not self.walk(unit, at_zero):
            self.stats.redone += 1
            unit = _Unit(plan, self.space, o, t0, t1, at_zero=False)
            self.walk(unit, at_zero=False)
        unit.write_result()

    def walk(self, unit: _Unit, at_zero: bool) -> bool:
        """Add up the unit's pieces of keys; False when a unit started ``at_zero`` must be
        redone: a row's sum ``l`` is below ``LAZY_FLOOR`` at the end, or already after the
        first piece for a row that met a key there (so scores far below zero waste one piece,
        not the whole walk)."""
        plan, stats, softmax = self.plan, self.stats, unit.softmax
        pieces = self.pieces(unit)
        checked_whole = False  # a single piece that every row met: checked after it already
        for i, piece in enumerate(pieces):
            run, strips = piece.run, -(-(piece.s1 - piece.s0) // plan.block_k)
            tiles = unit.n * piece.parts * strips  # a tile of each head (and square) and strip
            disallowed, weights, masked = self.piece_disallowed(unit, piece)
            if disallowed is _EVERY_KEY:
                stats.skipped_mask += tiles
                continue
            stats.computed += tiles
            stats.steps += 1
            lazy = softmax.started_in(run, piece.parts) and not plan.may_overflow
            if not (lazy and unit.lazy_step(piece, weights, masked)):
                stats.retried += lazy * tiles
                stats.rescaled += tiles
                unit.exact_step(piece, disallowed, masked)
            if at_zero and i == 0:
                if not softmax.sums_hold(run, parts=piece.parts):
                    return False
                whole = (run.stop - run.start) * piece.parts == unit.t1 - unit.t0
                checked_whole = len(pieces) == 1 and whole
        return not at_zero or checked_whole or softmax.sums_hold()

    def pieces(self, unit: _Unit) -> list[BandPiece]:
        """The unit's pieces (:func:`sdpa.tiles.band.unit_pieces`): the keys the band allows
        its rows, each piece for the rows its keys are allowed to; a causal diagonal in
        squares when there is neither a mask nor a bias."""
        plan = self.plan
        diagonal = plan.diagonal if unit.allowed is None and unit.bias is None else 0
        band = (plan.offset, plan.lo, plan.hi)
        return unit_pieces(unit.t0, unit.t1, plan.S, plan.block_k, diagonal, *band, plan.wide)

    def piece_disallowed(self, unit: _Unit, piece: BandPiece):
        """``(disallowed, weights, masked)`` of the piece: a bool array, True where the scores
        of the rows ``masked`` (a slice of the run) are disallowed (``(masked rows, bk)`` for
        the band alone, the same for every square of a piece in squares; ``(n, G, r, bk)``
        with the user's mask), None if none is, ``_EVERY_KEY`` if the user's mask disallows
        the whole piece (it is then skipped); and what the lazy step drops the disallowed
        terms by: the band's weights (:class:`sdpa.tiles.band.BandTiles`), else
        ``disallowed``. (Of the first square: the others are the same shifted along the
        diagonal.)"""
        plan, t0 = self.plan, unit.t0
        s0, s1, run, _ = piece
        r0, r1 = t0 + run.start, t0 + run.stop
        band = (plan.offset, plan.lo, plan.hi)
        kind = tile_kind(r0, r1, s0, s1, *band)
        assert kind != EMPTY, "the key-block range holds only tiles the band touches"
        if unit.allowed is None:
            if kind != PARTIAL:
                return None, None, ALL
            masked = partial_rows(t0, s0, s1, run, *band)  # the rows the band's edge crosses
            return *self.band.tiles(r0 + masked.start, r0 + masked.stop, s0, s1), masked
        r = run.stop - run.start
        disallowed = self.space.disallowed[: unit.n * plan.G * r * (s1 - s0)]
        disallowed = disallowed.reshape(unit.n, plan.G, r, s1 - s0)
        np.logical_not(unit.allowed[:, :, r0:r1, s0:s1], out=disallowed)
        if kind == PARTIAL:
            np.logical_or(disallowed, self.band.disallowed(r0, r1, s0, s1), out=disallowed)
        if disallowed.all():
            return _EVERY_KEY, None, ALL
        return disallowed, disallowed, ALL


def _run(plan: _Plan, num_threads: int | None, stats: TileStats | None) -> np.ndarray:
    """Share the plan's work units out among worker threads; add their counts to ``stats``.

    Returns the largest ``|out|`` of each column ``(Dv,)``, NaN where any result was NaN.
    """
    T, S = plan.T, plan.S
    outer = plan.out.shape[:-3]  # one axis at least; a unit takes n entries of the last
    heads = [slice(h, min(outer[-1], h + plan.n)) for h in range(0, outer[-1], plan.n)]
    n_q = -(-T // plan.block_q)
    units = []
    for a in range(n_q):
        t0, t1 = a * plan.block_q, min(T, (a + 1) * plan.block_q)
        first, stop = key_block_range(t0, t1, S, plan.block_k, plan.offset, plan.lo, plan.hi)
        for prefix in np.ndindex(*outer[:-1]):
            units.extend((stop - first, (*prefix, h), t0, t1) for h in heads)
    # Longest first, so the last units to finish are short ones (causal rows vary in length).
    units.sort(key=lambda u: -u[0])
    work = [u[1:] for u in units]
    n_threads = max(1, min(num_threads or default_num_threads(), len(work)))
    workers = [_Worker(plan) for _ in range(n_threads)]
    run_units(work, workers, stats)
    if stats is not None:
        n_k = -(-S // plan.block_k)
        visited = sum(u[0] * (u[1][-1].stop - u[1][-1].start) for u in units)  # per head
        stats.units += len(work)
        stats.skipped_band += n_q * n_k * math.prod(outer) - visited
    return column_top(workers)


def attention_tiled(
    problem: AttentionProblem,
    *,
    block_q: int | None = None,
    block_k: int | None = None,
    block_diagonal: int | None = None,
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
        Query positions per tile; default: up to ``BLOCK_ROWS_FULL`` rows after folding the
        heads that share a key/value head into the rows of one tile, at least ``BLOCK_ROWS``,
        fewer while a thread would get no unit (two, under a causal mask or a window).
    block_k : int, optional
        Keys per tile; default ``BLOCK_K``, or ``BLOCK_K_BAND`` under a causal mask or a
        window (whose pieces meet only the rows their keys are allowed to), the keys before
        a causal diagonal in squares then in pieces of ``BLOCK_K`` (two tiles to a step).
        Given, every piece is at most ``block_k`` keys.
    block_diagonal : int, optional
        Under a causal mask without a mask or a bias: keys per piece inside the squares of
        ``block_k`` rows that a unit walks its diagonal in, when ``block_k`` is a multiple of
        it and the unit's rows a multiple of ``block_k`` (``sdpa.tiles.band.unit_pieces``);
        ``0`` walks strips of ``block_k`` keys instead. Default ``BLOCK_K_DIAGONAL``.
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
    if block_diagonal is not None:
        block_diagonal = check_nonneg_int(block_diagonal, "block_diagonal")
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
    sizes = (problem, block_q, block_k, block_diagonal, num_threads)
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
