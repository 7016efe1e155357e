r"""Programmable attention: PyTorch's FlexAttention (a ``score_mod`` and a block mask) in NumPy.

Most attention variants change one thing: the score of query ``i`` against key ``j``, or
whether ``i`` may attend ``j`` at all. :func:`sdpa.flex_attention` takes both as functions:

* ``score_mod(score, b, h, q_idx, kv_idx)`` returns the modified scaled scores: ALiBi is
  ``score + slope[h] * (kv_idx - q_idx)``, soft-capping ``cap * np.tanh(score / cap)``;
* a :class:`sdpa.BlockMask` made by :func:`sdpa.create_block_mask` from
  ``mask_mod(b, h, q_idx, kv_idx)`` says which keys each query may attend (causal is
  ``q_idx >= kv_idx``), and which blocks of the score matrix hold no allowed entry at all.

The mods receive integer index arrays that broadcast against the scores, so that one NumPy
expression modifies a whole block of them at once.

Two paths give the same result to rounding. The **reference** path is the formula as written:
the whole ``(B, Hq, T, S)`` score matrix, ``score_mod`` on all of it, the mask, a softmax. The
**tiled** path is a face over the engine of :mod:`sdpa.tiles`, which the tiled path of
:func:`sdpa.scaled_dot_product_attention` runs on too. Each unit is a run of consecutive query
blocks of the mask, up to ``sdpa.tuning.BLOCK_ROWS_FULL`` rows (when the mask does not depend on
the head, of the query heads that share a key head, and of several key heads at once, as many
as ``sdpa.tuning.UNIT_SCORES`` and ``MIN_UNITS`` allow):

1. gather the key blocks the block mask marks non-empty, skipping the empty ones entirely:
   no product, no ``score_mod``, no ``mask_mod`` on their entries; a key block meets only the
   unit's query blocks whose block of it is not empty (under a causal mask, the query blocks
   from the diagonal down: a staircase of strips, or, when the unit's rows are squares along
   the diagonal, the squares all at once in narrow pieces, :mod:`sdpa.tiles.blocks`);
2. one product for the key blocks that meet the same run of query blocks and are full there,
   and one for those with *partial* blocks (each in pieces of at most ``block_k`` keys), so
   that every tile is contiguous;
3. ``score_mod`` on those scores; the partial pieces' masks, from ``mask_mod`` (evaluated once
   per block mask and kept beside it, on the rows holding a partial block), zero their
   disallowed terms;
4. the engine's online softmax across the pieces, the full ones first: without a
   ``score_mod`` a unit starts at the shift 0, its pieces take the lazy step, each checked by
   its row sums and computed again by the exact step in the rare case that fails, and the
   unit is walked again if a row's scores all lie too far below 0.

Without a ``score_mod`` the scores are computed in base 2 where ``exp2`` is the faster
exponential (:func:`sdpa.tuning.tile_exponential`). Without a block mask the units and pieces
are the dense path's (a long block of rows, keys in tiles of ``sdpa.tuning.BLOCK_K``), so both
APIs take the same time there. Values near the ends of the dtype's range are found in the
result and the call computed again on values scaled by a power of two per column.
:func:`flex_attention_tiled` runs this path with its tunables and counts what it did in a
:class:`FlexStats`; the bits do not depend on the number of threads.

Shape letters: ``B`` batch, ``Hq``/``Hkv`` query and key/value heads, ``G = Hq // Hkv``,
``T`` queries, ``S`` keys, ``Dk``/``Dv`` head widths, ``Bq``/``Bk`` block sizes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from ._checks import check_bool, check_memory, check_positive_int
from .block_mask import FULL, BlockMask, evaluate_mask_mod
from .cost_model import flex_worth_tiling
from .flex_call import (
    AuxRequest,
    FlexCall,
    apply_score_mod,
    check_aux,
    check_call,
    empty_result,
    finish,
    is_empty,
)
from .problem import check_overflow, overflow_checked
from .softmax_stable import softmax_and_lse
from .threads import default_num_threads
from .tiles.band import allowed_in_run, unit_rows
from .tiles.blocks import Piece, PlanCache, UnitPlan, mask_row, plans_beside, unit_list, unit_plan
from .tiles.ranges import restore_scale, value_exponents, values_may_be_out_of_range
from .tiles.softmax import LN2, LOG2E, OnlineSoftmax, Workspace
from .tiles.workers import Counts, column_top, run_units
from .tuning import (
    BLOCK_K,
    BLOCK_K_BAND,
    BLOCK_K_DIAGONAL,
    PIECE_KEYS,
    PLAN_CACHE_BYTES,
    tile_exponential,
)

__all__ = ["FlexStats", "flex_attention", "flex_attention_tiled"]


@dataclass
class FlexStats(Counts):
    """Counters of the work the tiled path of :func:`sdpa.flex_attention` did.

    Filled when passed to :func:`flex_attention_tiled` as ``stats``. Blocks are those of the
    block mask, counted once for each batch entry and query head (a unit that folds ``G``
    heads counts ``G`` of each), so that ``computed + skipped`` is ``B * Hq * n_q * n_kv``.
    The counts add up over calls (and over the second pass of a call whose values are scaled
    into range).

    Attributes
    ----------
    units : int
        Work units: a run of consecutive query blocks of one head, of the heads that share a
        key head, or (when the mask does not depend on the head) of several key heads.
    tiles : int
        Pieces: a unit's gathered key blocks that meet the same run of its query blocks, all
        full or some partial there, at most ``block_k`` keys, each one matrix product with
        the run's queries (two when the piece is computed again, counted in ``redone``).
    computed : int
        Blocks whose scores were computed (0 without a block mask).
    masked : int
        Computed blocks to which ``mask_mod`` applies: the partial ones. (It is evaluated on a
        block once per block mask and setting, and kept: see ``PLAN_CACHE_BYTES``.)
    skipped : int
        Blocks the block mask marks empty: no mod sees them, and without a ``score_mod`` they
        are computed (and masked) only where a strip or a square of partial blocks crosses
        them (under a causal mask, above the diagonal).
    redone : int
        Pieces computed twice. Without a ``score_mod`` a unit starts every row at the shift 0,
        and each piece takes the rows' present shifts (the online softmax's lazy steps),
        unless a row's scores end up too far above them (by ``sdpa.tuning.LAZY_MARGIN``):
        then the piece is computed again with the row maxima as the shift. A unit in which a
        row that meets an allowed key has all its scores too far below 0 is walked again
        from the exact step, each of its pieces counted.

    Examples
    --------
    >>> from sdpa.flex import FlexStats
    >>> FlexStats()
    FlexStats(units=0, tiles=0, computed=0, masked=0, skipped=0, redone=0)
    """

    units: int = 0
    tiles: int = 0
    computed: int = 0
    masked: int = 0
    skipped: int = 0
    redone: int = 0

    def add(self, other: FlexStats) -> None:
        """Add the counts of ``other`` to these.

        Parameters
        ----------
        other : FlexStats
            The counts to add (for example one worker thread's).

        Examples
        --------
        >>> from sdpa.flex import FlexStats
        >>> total = FlexStats(units=2, computed=5)
        >>> total.add(FlexStats(units=1, computed=3, skipped=1))
        >>> total.units, total.computed, total.skipped
        (3, 8, 1)
        """
        super().add(other)


# ----------------------------------------------------------------------------------------
# The reference path: the whole score matrix
# ----------------------------------------------------------------------------------------


def _dense_mask(block_mask: BlockMask) -> np.ndarray:
    """``(B or 1, H or 1, T, S)`` bool: the mask entry by entry, from its ``mask_mod``."""
    Bm, Hm, T, S = block_mask.shape
    return evaluate_mask_mod(block_mask.mask_mod, range(Bm), range(Hm), range(T), range(S))


def _flex_reference(call: FlexCall, want_top: bool = False) -> tuple:
    """``(out (B, Hq, T, Dv), lse (B, Hq, T), top)`` in the working dtype, from the whole
    scores; ``top`` the row maxima (B, Hq, T) if ``want_top``, else None."""
    problem, B, Hq, dtype = call.problem, call.B, call.Hq, call.dtype
    T, S = problem.T, problem.S
    shape = (B, Hq, T, S)
    check_memory(
        3 * B * Hq * T * S * dtype.itemsize,
        f"the reference path's scores and weights of shape {shape} in {dtype}",
        "use implementation='tiled' (which holds one block of rows at a time) or smaller inputs",
    )
    with overflow_checked(problem):
        q_scaled = call.query * dtype.type(problem.scale)  # (B, Hkv, G, T, Dk)
        # (B, Hkv, G, T, Dk) @ (B, Hkv, 1, Dk, S) -> (B, Hkv, G, T, S) -> (B, Hq, T, S)
        scores = (q_scaled @ np.swapaxes(call.key, -1, -2)).reshape(shape)
    allowed = None if call.block_mask is None else _dense_mask(call.block_mask)
    if problem.may_overflow:
        check_overflow(problem, scores, allowed, None)
    if call.score_mod is not None:
        scores = apply_score_mod(call, scores, range(B), range(Hq), range(T), range(S))
    if allowed is not None:
        scores = np.where(allowed, scores, dtype.type(-np.inf))
    top = scores.max(axis=-1) if want_top else None
    weights, lse = softmax_and_lse(scores, axis=-1)  # (B, Hq, T, S), (B, Hq, T, 1)
    weights = weights.reshape(B, call.Hkv, call.G, T, S)
    out = (weights @ call.value).reshape(B, Hq, T, problem.Dv)  # (..., T, S) @ (..., S, Dv)
    lse = lse[..., 0]
    # A score_mod that returns +inf has no softmax; the tiled path gives NaN there, so here too.
    infinite = np.isposinf(lse)
    if infinite.any():
        out[infinite] = np.nan
        lse[infinite] = np.nan
    return out, lse, top


# ----------------------------------------------------------------------------------------
# The tiled path: a block of query rows at a time, empty key blocks skipped
# ----------------------------------------------------------------------------------------


@dataclass
class _Tiling:
    """The plan of a call: what every work unit reads and writes."""

    call: FlexCall
    factor: np.floating  # the queries' factor: the scale, times log2(e) in base 2
    kinds: np.ndarray  # (1 or B, 1 or Hq, n_q, n_kv) int8: EMPTY, PARTIAL or FULL
    block_q: int  # query positions per block
    block_kv: int  # keys per block
    block_k: int  # keys per piece, at most (at least one block)
    strip_keys: int | None  # keys per strip of partial blocks; None: pieces of equal runs
    diagonal: int  # keys per piece of a diagonal in squares of strip_keys (0: none)
    exp: Callable  # the exponential of the pieces: numpy.exp, or numpy.exp2 on scores in base 2
    plans: PlanCache  # the plans of the mask's rows: kept beside the block mask, or the call's
    units: list  # (b, hk0, hk1, g0, g1, m0, m1) of every unit: the query blocks m0:m1
    out: np.ndarray  # (B, Hkv, G, T, Dv), written by the units (every row: not zeroed first)
    lse: np.ndarray  # (B, Hkv, G, T)
    value: np.ndarray  # (B, Hkv, 1, S, Dv): the call's, or scaled by 2 ** -v_exp
    v_exp: np.ndarray | None  # (Dv,) int: the powers of two the values were scaled by, or None
    top: np.ndarray | None  # (B, Hkv, G, T): each row's largest allowed score, if asked for

    def space(self) -> Workspace:
        """A worker's buffers, for the largest unit and piece of the plan."""
        rows = max((u[2] - u[1]) * (u[4] - u[3]) * (u[6] - u[5]) for u in self.units)
        rows *= self.block_q
        keys = min(self.call.problem.S, max(self.block_k, self.block_kv))
        return Workspace(rows, keys, self.call.problem.Dv, self.call.dtype)


def _blocks(call: FlexCall, block_k: int | None, num_threads=None) -> tuple[np.ndarray, int, int]:
    """``(kinds, block_q, block_kv)``: the block mask's, or without one every key block full,
    in the dense path's units and tiles (:func:`sdpa.tiles.band.unit_rows`, ``BLOCK_K``)."""
    bm = call.block_mask
    if bm is not None:
        return bm.kinds, *bm.BLOCK_SIZE
    T, S = call.problem.T, call.problem.S
    rows = unit_rows(call.dtype, T, call.G, call.B * call.Hkv, num_threads)
    block_q = max(1, rows // call.G)
    block_kv = min(_piece_keys(call, block_k), S)
    return (
        np.full((1, 1, -(-T // block_q), -(-S // block_kv)), FULL, dtype=np.int8),
        block_q,
        block_kv,
    )


def _piece_keys(call: FlexCall, block_k: int | None) -> int:
    """Keys per piece: ``block_k`` if given, else ``PIECE_KEYS`` with a block mask (its blocks
    gathered) and the dense path's ``BLOCK_K`` without one (the same units, the same speed)."""
    if block_k is not None:
        return block_k
    return PIECE_KEYS if call.block_mask is not None else BLOCK_K.get(call.dtype, 512)


def _tiling(call: FlexCall, block_k, num_threads, v_exp=None, want_top=False) -> _Tiling:
    problem, bm = call.problem, call.block_mask
    kinds, block_q, block_kv = _blocks(call, block_k, num_threads)
    block_k = _piece_keys(call, block_k)
    # Scores in base 2 where exp2 is the faster (the scale times log2(e): 2 ** x is e ** score),
    # unless a score_mod must see them in natural units or a score may overflow.
    exp = tile_exponential(call.dtype)
    if call.score_mod is not None or problem.may_overflow:
        exp = np.exp
    factor = call.dtype.type(problem.scale * (LOG2E if exp is np.exp2 else 1.0))
    return _Tiling(
        call=call,
        factor=factor,
        kinds=kinds,
        block_q=block_q,
        block_kv=block_kv,
        block_k=block_k,
        # Strips of partial blocks as wide as the dense path's under a causal mask; a strip
        # computes (masked) empty blocks beside them, which a score_mod must never see.
        strip_keys=None if call.score_mod is not None else BLOCK_K_BAND.get(call.dtype, 256),
        diagonal=0 if call.score_mod is not None else BLOCK_K_DIAGONAL.get(call.dtype, 0),
        exp=exp,
        plans=PlanCache(PLAN_CACHE_BYTES) if bm is None else plans_beside(bm, PLAN_CACHE_BYTES),
        units=unit_list(call.B, call.Hkv, call.G, kinds, block_q, block_kv),
        out=np.empty((call.B, call.Hkv, call.G, problem.T, problem.Dv), dtype=call.dtype),
        lse=np.full((call.B, call.Hkv, call.G, problem.T), -np.inf, dtype=call.dtype),
        value=call.value if v_exp is None else np.ldexp(call.value, -v_exp),  # exact
        v_exp=v_exp,
        top=np.full((call.B, call.Hkv, call.G, problem.T), -np.inf, call.dtype)
        if want_top
        else None,
    )


class _Worker:
    """One thread: its buffers, its counts, and the walk of each unit it takes.

    Units whose rows of the block mask are equal (the heads and batch entries of a mask
    created with None, the same query block) share a plan, made once
    (:class:`sdpa.tiles.blocks.PlanCache`).
    """

    def __init__(self, tiling: _Tiling):
        self.tiling = tiling
        self.space = tiling.space()
        self.stats = FlexStats()

    def run(self, b: int, hk0: int, hk1: int, g0: int, g1: int, m0: int, m1: int) -> None:
        """Attention of the query blocks ``m0:m1`` of the query heads ``g0:g1`` of the key
        heads ``hk0:hk1`` (all of their query heads when there are several)."""
        tiling, stats = self.tiling, self.stats
        call = tiling.call
        G, heads = call.G, (hk1 - hk0) * (g1 - g0)
        t0, t1 = m0 * tiling.block_q, min(call.problem.T, m1 * tiling.block_q)
        h = range(hk0 * G + g0, hk0 * G + g0 + heads)  # query heads, in order
        row = (*mask_row(tiling.kinds, b, h.start, 0)[:2], m0, m1)
        key = (tiling.block_k, tiling.strip_keys, tiling.diagonal, row)
        plan = tiling.plans.get(key, lambda: self.make_plan(row, t0, t1))
        stats.units += 1
        stats.tiles += len(plan.pieces)
        if call.block_mask is not None:
            stats.computed += heads * plan.computed
            stats.skipped += heads * ((m1 - m0) * tiling.kinds.shape[-1] - plan.computed)
            stats.masked += heads * plan.partial
        out = tiling.out[b, hk0:hk1, g0:g1, t0:t1]  # (n, G', rows, Dv) view
        if not plan.pieces:  # every block empty: out 0, and lse -inf as set up
            out[...] = 0
            return
        with overflow_checked(call.problem):  # scaled here, in the worker threads
            q_tile = call.query[b, hk0:hk1, g0:g1, t0:t1] * tiling.factor  # (n, G', rows, Dk)
        key, value = call.key[b, hk0:hk1, 0], tiling.value[b, hk0:hk1, 0]  # (n, S, Dk), (n, S, Dv)
        unit = _Unit(self, q_tile, key, value, (b, h, t0, t1))
        softmax = unit.walk(plan)
        lse, _, _ = softmax.finish(out)
        restore_scale(out, tiling.v_exp, self.space.top)
        tiling.lse[b, hk0:hk1, g0:g1, t0:t1] = lse.reshape(out.shape[:-1])
        if tiling.top is not None:  # in natural units, as lse
            top = unit.top * LN2 if tiling.exp is np.exp2 else unit.top
            tiling.top[b, hk0:hk1, g0:g1, t0:t1] = top.reshape(out.shape[:-1])

    def make_plan(self, row: tuple[int, int, int, int], t0: int, t1: int) -> UnitPlan:
        """The plan of the rows ``kinds[b, h, m0:m1]`` (``row``) of queries ``t0:t1``."""
        tiling = self.tiling
        mask_mod = None if tiling.call.block_mask is None else tiling.call.block_mask.mask_mod
        return unit_plan(
            tiling.kinds[row[0], row[1], row[2] : row[3]],
            mask_mod,
            row[:2],
            range(t0, t1),
            tiling.block_q,
            tiling.block_kv,
            tiling.call.problem.S,
            tiling.block_k,
            tiling.strip_keys,
            tiling.diagonal,
        )


class _Unit:
    """One unit's walk over its pieces: the queries ``q_tile`` ``(n, G', rows, Dk)`` of the
    ``G'`` query heads of each of ``n`` key heads, their keys and values ``(n, S, D)``, and
    the online softmax of the rows (a block of them per query head, a piece meeting a run of
    each block).

    Without a ``score_mod``, a unit starts every row at the shift 0 (no row maximum, no
    subtraction); its pieces take the lazy step at the shifts they find, each checked by its
    row sums and computed again by the exact step in the rare case that fails, and the unit is
    walked again from the exact step if a row's scores all lie too far below zero (both
    counted in ``FlexStats.redone``).
    """

    def __init__(self, worker: _Worker, q_tile, key, value, where: tuple):
        self.worker, self.q_tile, self.key, self.value = worker, q_tile, key, value
        self.rows = q_tile.shape[0] * q_tile.shape[1] * q_tile.shape[2]
        self.where = where  # (b, query heads, t0, t1)
        # The running maximum of each row's allowed scores, if asked for: the softmax's shift
        # is not it (lazy steps lag behind it; a unit may start at the shift 0).
        dtype = worker.tiling.call.dtype
        self.top = None if worker.tiling.top is None else np.full(self.rows, -np.inf, dtype)

    def walk(self, plan: UnitPlan) -> OnlineSoftmax:
        """Add the plan's pieces (each with its run of rows, its masked rows and their mask,
        True = disallowed, or None) in order: from the shift 0 where no ``score_mod`` applies,
        and again from the exact step if that shift did not hold."""
        if self.worker.tiling.call.score_mod is None:
            softmax = self.walk_from(plan, at_zero=True)
            if softmax is not None:
                return softmax
        return self.walk_from(plan, at_zero=False)

    def walk_from(self, plan: UnitPlan, at_zero: bool) -> OnlineSoftmax | None:
        """The walk, every row starting at the shift 0 if ``at_zero``; None if that shift did
        not hold: a row that meets an allowed key ends with a sum below ``LAZY_FLOOR``
        (checked after the first piece already when that piece is full and meets every row,
        so that scores far below zero waste one piece, not the whole walk)."""
        stats = self.worker.stats
        _, first_run, _, first_mask = plan.pieces[0]
        early = at_zero and first_mask is None and first_run == slice(0, self.length)
        softmax, checked = self.softmax(at_zero), False
        for i, (piece, run, masked, mask) in enumerate(plan.pieces):
            keys, values, parts = piece.gather(self.key), piece.gather(self.value), piece.parts
            if parts > 1:  # (n, 1, parts, keys, Dv): each square's, for every query head
                values = values[:, None]
            if softmax.started_in(run, parts):
                scores = self.scores(keys, piece, run, masked, mask)
                if softmax.moved:  # else every shift is 0: nothing to subtract
                    softmax.subtract_shift(scores, run, parts)
                if softmax.lazy_step(scores, values, mask, run, masked, parts):
                    if i == 0 and early:
                        if not softmax.sums_hold():
                            stats.redone += 1
                            return None
                        checked = True
                    continue
                stats.redone += 1
                if i == 0 and at_zero:  # the shift 0 does not hold: start without it
                    return None
            scores = self.scores(keys, piece, run, masked, mask)
            if mask is not None:  # replaced: a score_mod's NaN is hidden
                np.copyto(scores[..., masked, :], scores.dtype.type(-np.inf), where=mask)
            softmax.exact_step(scores, values, mask is not None, run, parts)
        if at_zero and not checked and not softmax.sums_hold(among=plan.met):
            stats.redone += len(plan.pieces)
            return None
        return softmax

    @property
    def length(self) -> int:
        """Rows per query head: the unit's queries."""
        return self.q_tile.shape[2]

    def softmax(self, at_zero: bool) -> OnlineSoftmax:
        """A fresh online softmax of the unit's rows."""
        tiling = self.worker.tiling
        return OnlineSoftmax(
            self.worker.space,
            self.rows,
            tiling.call.problem.Dv,
            tiling.exp,
            tiling.exp is np.exp2,
            at_zero,
            groups=self.rows // self.length,
        )

    def scores(self, keys: np.ndarray, piece: Piece, run: slice, masked: slice, mask):
        """A piece's modified scores ``(1, heads, r, keys)`` of the rows ``run`` of each query
        head (``(n, G', parts, r, keys)`` of each square, for a piece in squares), in the
        worker's buffer, the mask (of the rows ``masked`` of the run) not applied: ``keys``
        ``(n, keys, Dk)`` (or ``(n, parts, keys, Dk)``) are the ``n`` key heads' gathered
        keys."""
        call = self.worker.tiling.call
        problem = call.problem
        b, h, t0, _ = self.where
        n, G, length, Dk = self.q_tile.shape
        r, width, parts = run.stop - run.start, keys.shape[-2], piece.parts
        squares = (parts,) if parts > 1 else ()
        scores = self.worker.space.scores_view((n, G, *squares, r, width))
        keys_t = keys.swapaxes(-1, -2)  # (n, [parts,] Dk, keys)
        with overflow_checked(problem):
            if parts > 1:  # (n, G', parts, r, Dk) @ (n, 1, parts, Dk, keys)
                q = self.q_tile.reshape(n, G, parts, -1, Dk)[:, :, :, run]
                np.matmul(q, keys_t[:, None], out=scores)
            elif r == length:  # (n, G' rows, Dk) @ (n, Dk, keys): one product per key head
                q = self.q_tile.reshape(n, G * r, Dk)
                np.matmul(q, keys_t, out=scores.reshape(n, G * r, width))
            else:  # the run's rows of each query head
                np.matmul(self.q_tile[:, :, run], keys_t[:, None], out=scores)
        if parts == 1:
            scores = scores.reshape(1, len(h), r, width)
        allowed = True
        if mask is not None and (problem.may_overflow or self.top is not None):
            allowed = allowed_in_run((*squares, r, width), mask, masked)
        if problem.may_overflow:  # then the scores are in base e
            check_overflow(problem, scores, None if mask is None else allowed, None)
        if call.score_mod is not None:
            q_idx = range(t0 + run.start, t0 + run.stop)
            scores = apply_score_mod(call, scores, [b], h, q_idx, piece.cols())
        if self.top is not None:  # one maximum per row over the allowed scores (NaN stays)
            top = np.max(scores, axis=-1, initial=-np.inf, where=allowed)  # (..., r)
            running = self.top.reshape(len(h) * parts, length // parts)[:, run]
            np.maximum(running, top.reshape(running.shape), out=running)
        return scores


def _run(tiling: _Tiling, num_threads: int | None, stats: FlexStats | None) -> np.ndarray:
    """Share the units out among worker threads; add their counts to ``stats``. Returns the
    largest ``|out|`` of each column ``(Dv,)``, NaN where a result was NaN."""
    n_threads = max(1, min(num_threads or default_num_threads(), len(tiling.units)))
    workers = [_Worker(tiling) for _ in range(n_threads)]
    run_units(tiling.units, workers, stats)
    return column_top(workers)


def _flex_tiled(call: FlexCall, block_k: int | None, num_threads, stats, want_top=False) -> tuple:
    """``(out (B, Hq, T, Dv), lse (B, Hq, T), top)`` in the working dtype, a block of rows at a
    time (``top`` as :func:`_flex_reference`'s); values near the ends of the range as
    :mod:`sdpa.tiles.ranges` finds them."""
    tiling = _tiling(call, block_k, num_threads, None, want_top)
    top = _run(tiling, num_threads, stats)
    if values_may_be_out_of_range(top):
        v_exp = value_exponents(call.value, call.problem.S)
        if v_exp is not None:
            tiling = _tiling(call, block_k, num_threads, v_exp, want_top)
            _run(tiling, num_threads, stats)
    T = call.problem.T
    out = tiling.out.reshape(call.B, call.Hq, T, call.problem.Dv)
    top = None if tiling.top is None else tiling.top.reshape(call.B, call.Hq, T)
    return out, tiling.lse.reshape(call.B, call.Hq, T), top


def _worth_tiling(call: FlexCall) -> bool:
    """The rule of ``implementation="auto"``, from the shapes as the tiled path cuts the work
    (:func:`sdpa.cost_model.flex_worth_tiling`)."""
    shape = (call.B, call.Hkv, call.G, call.problem.T, call.problem.S)
    return flex_worth_tiling(shape, *_blocks(call, None), call.dtype.itemsize)


# ----------------------------------------------------------------------------------------
# The public functions
# ----------------------------------------------------------------------------------------


def flex_attention(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    score_mod: Callable | None = None,
    block_mask: BlockMask | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    implementation: str = "auto",
    *,
    return_aux: AuxRequest | None = None,
):
    r"""Attention with a programmable score (``score_mod``) and mask (``block_mask``).

    PyTorch's ``torch.nn.attention.flex_attention`` in NumPy: one function for ALiBi,
    soft-capping, causal, sliding-window, document and prefix-LM attention and their
    combinations, each written as a line of NumPy.

    Parameters
    ----------
    query : (B, Hq, T, Dk) array_like
        Queries.
    key : (B, Hkv, S, Dk) array_like
        Keys.
    value : (B, Hkv, S, Dv) array_like
        Values.
    score_mod : callable, optional
        ``score_mod(score, b, h, q_idx, kv_idx) -> array``: the modified scores. ``score`` is
        a 4-D array of scaled scores ``scale * q . k`` (all of them, or a block of them), and
        ``b``, ``h``, ``q_idx``, ``kv_idx`` are integer arrays of shapes ``(n_b, 1, 1, 1)``,
        ``(1, n_h, 1, 1)``, ``(1, 1, n_q, 1)`` and ``(1, 1, 1, n_kv)`` that broadcast against
        it: the batch entry, query head, query position and key position of each score,
        always inside the matrix. It returns an array of the scores' shape (or one that
        broadcasts to it), which is read, never written into (a stored bias may be returned).
        The result must not depend on which block it is called on. A score it sets to
        ``-inf`` is excluded like a masked one.
    block_mask : BlockMask, optional
        From :func:`sdpa.create_block_mask`, of shape ``(B or 1, Hq or 1, T, S)``: entries its
        ``mask_mod`` returns False for get weight exactly 0, and the tiled path never
        computes a block that holds no allowed entry.
    scale : float, optional
        Multiplier of ``q . k``; default ``1 / sqrt(Dk)``.
    enable_gqa : bool, default False
        Grouped-query attention: ``Hq`` a multiple of ``Hkv``, query head ``h`` using key/value
        head ``h // (Hq // Hkv)``. Without it the heads must be equal, or ``Hkv = 1``.
    return_lse : bool, default False
        Also return the log-sum-exp of each row.
    implementation : {"auto", "reference", "tiled"}, default "auto"
        ``"reference"`` forms the whole ``(B, Hq, T, S)`` score matrix; ``"tiled"`` works on
        one block of query rows at a time and skips the empty blocks (see
        :func:`sdpa.flex.flex_attention_tiled`); ``"auto"`` takes the tiled path when the
        score matrix holds at least ``2**19`` scores and the tiled path's work units at least
        ``2**14`` scores each on average, or when the reference path would take more than a
        quarter of the available memory. Both give the same result to rounding.
    return_aux : AuxRequest, optional
        Keyword-only, as in PyTorch 2.13: return ``(out, AuxOutput)`` with the fields the
        :class:`sdpa.AuxRequest` asks for (the others None). Not with ``return_lse``.

    Returns
    -------
    out : (B, Hq, T, Dv) np.ndarray
        Alone, or first in ``(out, lse)`` or ``(out, aux)``.
    lse : (B, Hq, T) np.ndarray
        With ``return_lse``: the natural log of ``sum(exp(scores))`` over the modified,
        allowed scores of each row; ``-inf`` for a row with no allowed key.
    aux : AuxOutput
        With ``return_aux``: ``lse`` as above and ``max_scores`` ``(B, Hq, T)``, each row's
        largest modified, allowed score (natural units; ``-inf`` for a row with none), both
        in float32 for float16 inputs, else in the inputs' dtype.

    Raises
    ------
    TypeError
        For complex, object or masked-array inputs, a ``score_mod`` that is not callable or
        returns no real array, a ``block_mask`` that is not a :class:`sdpa.BlockMask`, a
        ``mask_mod`` that returns no bool array, or a flag that is not a bool.
    ValueError
        For inputs that are not 4-D or do not share ``Dk`` and ``S``, head counts that do not
        fit, ``return_lse=True`` with ``return_aux``, a ``block_mask`` of another shape (other lengths, or a batch or head count other
        than 1 and the call's), a mod result of the wrong shape, a bad ``scale`` or
        ``implementation``, and scores that overflow the working dtype.
    MemoryError
        When the reference path's score matrix would not fit in the available memory.

    Notes
    -----
    For query ``i`` of head ``h`` in batch entry ``b``, with ``z_ij`` the result of
    ``score_mod`` on ``scale * q_i . k_j`` and ``M`` the entries ``mask_mod`` allows,

    .. math:: o_i = \frac{\sum_{j \in M_i} e^{z_{ij}} v_j}{\sum_{j \in M_i} e^{z_{ij}}},
              \qquad \operatorname{lse}_i = \log \sum_{j \in M_i} e^{z_{ij}}.

    **Fully masked rows.** A row with no allowed key (every entry masked, or set to ``-inf``
    by ``score_mod``) gets ``out = 0`` and ``lse = -inf``, with no NaN and no warning, on both
    paths. A ``score_mod`` that returns NaN or ``+inf`` for an allowed entry makes its row NaN.

    **Dtypes.** float16, float32 and float64 inputs give ``out`` in their dtype (float16 is
    computed in float32, its ``lse`` returned in float32); mixed dtypes promote; the mods see
    scores in the working dtype and may return any real dtype (cast back to it). Near the ends
    of the dtype's range the tiled path is as accurate as the reference path: it computes
    again, on values scaled by a power of two per column (exact), a result that overflowed or
    came out near the smallest normal numbers.

    **The mods' calls.** ``score_mod`` is called on the whole score matrix (reference) or on
    the computed blocks of one block of query rows (tiled), possibly from several threads at
    once; ``mask_mod`` on the whole matrix (reference) or on the partial blocks only (tiled).
    With a mask created with ``B`` or ``H`` None, ``mask_mod`` is called with ``b = 0`` or
    ``h = 0``.

    **Non-finite inputs** (NaN in, NaN out): a query row holding NaN or inf, or a key it may
    attend, makes its ``out`` and ``lse`` NaN; a value it may attend, its ``out``. A key the
    mask hides never reaches a row.

    **Differences from PyTorch.** The mods are vectorised NumPy functions of index arrays, not
    scalar functions traced by ``torch.compile``; ``lse`` is returned with ``return_lse`` (kept
    here; deprecated in PyTorch 2.13) or ``return_aux``; ``max_scores`` is computed on every
    path (PyTorch 2.13 refuses it on CPU; its kernels keep it in base 2 and return it, as
    here, in natural units); a block mask's shorter last block may be full.
    The tiled path keeps ``max_scores`` as a running maximum of its own, one ``np.max`` per
    piece when asked for and none otherwise: the online softmax's shift is not the row
    maximum (a lazy step leaves it behind, and a unit may start at the shift 0).

    Examples
    --------
    ALiBi is one line of ``score_mod``; a causal mask one line of ``mask_mod``:

    >>> import numpy as np
    >>> from sdpa import alibi_slopes, create_block_mask, flex_attention
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 4, 256, 16)) for _ in range(3))  # (B, H, T, D)
    >>> slopes = alibi_slopes(4)  # one per head
    >>> def alibi(score, b, h, q_idx, kv_idx):
    ...     return score + slopes[h] * (kv_idx - q_idx)
    >>> def causal(b, h, q_idx, kv_idx):
    ...     return q_idx >= kv_idx
    >>> mask = create_block_mask(causal, None, None, 256, 256, BLOCK_SIZE=64)
    >>> mask.sparsity()  # 6 of the 16 blocks hold no allowed entry: never computed
    37.5
    >>> out, lse = flex_attention(q, k, v, score_mod=alibi, block_mask=mask, return_lse=True)
    >>> out.shape, lse.shape
    ((1, 4, 256, 16), (1, 4, 256))

    The same as ALiBi's explicit bias with a causal mask:

    >>> from sdpa import alibi_bias, scaled_dot_product_attention
    >>> bias = np.where(np.tri(256, dtype=bool), alibi_bias(4, 256, 256), -np.inf)
    >>> bool(np.allclose(out, scaled_dot_product_attention(q, k, v, bias)))
    True

    Soft-capping squeezes every score into ``(-cap, cap)``; the first query sees one key only:

    >>> capped = flex_attention(q, k, v, score_mod=lambda s, b, h, i, j: 30 * np.tanh(s / 30),
    ...                         block_mask=mask)
    >>> bool(np.allclose(capped[0, :, 0], v[0, :, 0]))
    True

    The largest allowed score of each row, beside ``lse`` (``sdpa.AuxRequest``):

    >>> from sdpa import AuxRequest
    >>> out, aux = flex_attention(q, k, v, block_mask=mask,
    ...                           return_aux=AuxRequest(lse=True, max_scores=True))
    >>> first = (q[0, :, 0] * k[0, :, 0]).sum(-1) / 4  # query 0 sees key 0 only; scale 1/4
    >>> bool(np.allclose(aux.max_scores[0, :, 0], first)), bool(np.allclose(aux.lse[0, :, 0], first))
    (True, True)
    """
    return_lse = check_bool(return_lse, "return_lse")
    if implementation not in ("auto", "reference", "tiled"):
        raise ValueError(
            f"implementation must be 'auto', 'reference' or 'tiled'; got {implementation!r}"
        )
    aux = check_aux(return_aux, return_lse)
    want_top = aux is not None and aux.max_scores
    call = check_call(query, key, value, score_mod, block_mask, scale, enable_gqa)
    if is_empty(call):
        result = empty_result(call)
    elif implementation == "tiled" or (implementation == "auto" and _worth_tiling(call)):
        result = _flex_tiled(call, None, None, None, want_top)
    else:
        result = _flex_reference(call, want_top)
    return finish(call, result, return_lse, aux)


def flex_attention_tiled(
    query: ArrayLike,
    key: ArrayLike,
    value: ArrayLike,
    score_mod: Callable | None = None,
    block_mask: BlockMask | None = None,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    *,
    return_aux: AuxRequest | None = None,
    block_k: int | None = None,
    num_threads: int | None = None,
    stats: FlexStats | None = None,
):
    """The tiled path of :func:`sdpa.flex_attention`, with its tunables and its counts.

    Parameters
    ----------
    query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse, return_aux
        As in :func:`sdpa.flex_attention` (``return_aux`` keyword-only).
    block_k : int, optional
        Keys per product: a block of query rows' non-empty key blocks are gathered and cut
        into pieces of at most this many keys (whole blocks, one at least), with an online
        softmax across the pieces. Default: ``sdpa.tuning.PIECE_KEYS`` (4096) with a block
        mask; without one, the keys are cut as :func:`sdpa.scaled_dot_product_attention`'s
        tiled path cuts them (``sdpa.tuning.BLOCK_K``), in units of as many query rows.
    num_threads : int, optional
        Worker threads; default :func:`sdpa.threads.default_num_threads`. The result is the
        same, bit for bit, for every thread count.
    stats : FlexStats, optional
        Receives the counts of units, products and computed, masked and skipped blocks.

    Returns
    -------
    out : (B, Hq, T, Dv) np.ndarray
        Alone, or first in ``(out, lse)`` or ``(out, aux)``.
    lse : (B, Hq, T) np.ndarray
        With ``return_lse``.
    aux : AuxOutput
        With ``return_aux``.

    Raises
    ------
    TypeError, ValueError
        As :func:`sdpa.flex_attention`, and for a ``block_k`` or ``num_threads`` that is not a
        positive integer, or ``stats`` that is not a :class:`FlexStats`.

    Examples
    --------
    A causal block mask in 8 x 8 blocks of 32 x 32: 28 of the 64 blocks are skipped, and
    ``mask_mod`` runs on the 8 diagonal ones only:

    >>> import numpy as np
    >>> from sdpa import create_block_mask, flex_attention
    >>> from sdpa.flex import FlexStats, flex_attention_tiled
    >>> x = np.random.default_rng(1).standard_normal((1, 1, 256, 8))  # (B, H, T, D)
    >>> mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, 256, 256, BLOCK_SIZE=32)
    >>> stats = FlexStats()
    >>> out = flex_attention_tiled(x, x, x, block_mask=mask, stats=stats)
    >>> stats.computed, stats.masked, stats.skipped
    (36, 8, 28)
    >>> bool(np.allclose(out, flex_attention(x, x, x, block_mask=mask, implementation="reference")))
    True
    """
    return_lse = check_bool(return_lse, "return_lse")
    if block_k is not None:
        block_k = check_positive_int(block_k, "block_k")
    if num_threads is not None:
        num_threads = check_positive_int(num_threads, "num_threads")
    if stats is not None and not isinstance(stats, FlexStats):
        raise TypeError(f"stats must be a FlexStats or None; got {type(stats).__name__}")
    aux = check_aux(return_aux, return_lse)
    call = check_call(query, key, value, score_mod, block_mask, scale, enable_gqa)
    if is_empty(call):
        result = empty_result(call)
    else:
        result = _flex_tiled(call, block_k, num_threads, stats, aux is not None and aux.max_scores)
    return finish(call, result, return_lse, aux)
