"""The flex face's plan: a block mask's rows cut into pieces, the units, and the plan cache.

A block mask (:class:`sdpa.BlockMask`) says what each block of ``(Bq, Bk)`` scores holds:
empty, full or partial (``EMPTY``, ``FULL``, ``PARTIAL``). A unit takes a run of consecutive
query blocks (``query_blocks_per_unit()``) and skips the empty blocks entirely. Its plan
(``UnitPlan``) gives each key block the run of the unit's query blocks it meets (under a causal
mask, the query blocks from the diagonal down), gathers the key blocks that are full for the
same run into pieces, and those with partial blocks into strips or pieces of their own, each
of at most ``block_k`` keys (whole blocks, one at least), with the mask of each partial piece
evaluated once, on its partial blocks only; rows along a causal diagonal compute its squares
apart, all at once, in narrow pieces (``diagonal_squares()``, ``SquarePiece``). Full and
partial blocks go into separate pieces so that every operation on a piece's scores runs on a
contiguous tile (the columns of a partial block inside a wider tile are a strided view, on
which NumPy copied through buffers: at T = S = 4096, 8 heads of width 64, float32, one thread,
2-core Xeon, the causal call spent 4 % of its time in those copies).

Units whose rows of the block mask are equal (every head of a mask created with ``H=None``)
share one plan, kept beside the block mask for its later calls (``plans_beside()``).

Shape letters: ``B`` batch, ``Hkv`` key heads, ``G`` query heads per key head, ``Bq``/``Bk``
block sizes.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..block_mask import EMPTY, FULL, PARTIAL, BlockMask, evaluate_mask_mod
from ..tuning import BLOCK_ROWS_FULL, MIN_UNITS, UNIT_SCORES

__all__: list[str] = []


@dataclass(frozen=True)
class Piece:
    """The keys of one step: blocks of one kind, full or partial (those need ``mask_mod``)."""

    spans: tuple[tuple[int, int], ...]  # key ranges s0:s1 of runs of consecutive blocks
    masked: bool  # partial blocks: mask_mod applies; else full ones

    @classmethod
    def of(cls, blocks: list[int], masked: bool, block_kv: int, S: int) -> Piece:
        """The piece of the key blocks ``blocks`` (in order), runs of them merged."""
        spans: list[tuple[int, int]] = []
        for n in blocks:
            s0, s1 = n * block_kv, min(S, (n + 1) * block_kv)
            if spans and spans[-1][1] == s0:  # the next block of a run: one view for both
                spans[-1] = (spans[-1][0], s1)
            else:
                spans.append((s0, s1))
        return cls(tuple(spans), masked)

    @property
    def size(self) -> int:
        """Its number of keys."""
        return sum(s1 - s0 for s0, s1 in self.spans)

    def cols(self) -> np.ndarray:
        """``(keys,)``: the key positions, in order (made when asked: plans are kept)."""
        return np.concatenate([np.arange(s0, s1) for s0, s1 in self.spans])

    def gather(self, x: np.ndarray) -> np.ndarray:
        """The piece's rows of ``x`` ``(..., S, D)``: a view for one run of blocks, else a copy."""
        if len(self.spans) == 1:
            ((s0, s1),) = self.spans
            return x[..., s0:s1, :]
        return np.concatenate([x[..., s0:s1, :] for s0, s1 in self.spans], axis=-2)

    parts = 1  # the rows of one unit, not cut into squares (see SquarePiece)


@dataclass(frozen=True)
class SquarePiece:
    """The keys of one step along a diagonal in squares: the unit's rows cut into ``parts``
    squares of ``width`` rows, square ``p`` with the keys ``start + p width + offset`` and the
    ``size`` after it (the same piece of every square, one batched product for them all)."""

    start: int  # the first square's first key
    width: int  # rows of a square, and keys from one square's to the next
    parts: int
    offset: int  # the piece's first key in its square
    size: int
    masked = True

    def gather(self, x: np.ndarray) -> np.ndarray:
        """The piece's keys of every square of ``x`` ``(n, S, D)``: ``(n, parts, size, D)``,
        a view."""
        n, _, D = x.shape
        squares = x[:, self.start : self.start + self.width * self.parts]
        squares = squares.reshape(n, self.parts, self.width, D)
        return squares[:, :, self.offset : self.offset + self.size]


@dataclass(frozen=True)
class UnitPlan:
    """What the units of a run of rows of the block mask do (a batch entry, a head and
    consecutive query blocks): their pieces, each with the *run* of the unit's rows it meets
    and, for a piece with partial blocks, the rows of the run that ``mask_mod`` applies to
    (``masked``) and their mask (True = disallowed, ``(masked rows, keys)``); a piece of full
    blocks has the mask None. The pieces that every row meets, of full blocks, come first."""

    computed: int  # non-empty blocks
    partial: int  # partial ones
    pieces: tuple[tuple[Piece, slice, slice, np.ndarray | None], ...]  # masks read-only: shared
    met: np.ndarray | None  # (rows,) bool: the rows that meet an allowed key; None if all do

    @property
    def nbytes(self) -> int:
        """The bytes of its masks."""
        return sum(mask.nbytes for *_, mask in self.pieces if mask is not None)


def unit_plan(
    kinds_rows: np.ndarray,
    mask_mod,
    bh: tuple[int, int],
    rows: range,
    block_q: int,
    block_kv: int,
    S: int,
    block_k,
    strip_keys: int | None = None,
    diagonal: int = 0,
) -> UnitPlan:
    """The plan of the rows ``kinds_rows`` ``(R, n_kv)`` of a block mask (consecutive query
    blocks), for batch entry and head ``bh`` and the queries ``rows``.

    A key block meets the query blocks whose block of it is not empty: under a causal mask,
    the query blocks from the diagonal down, so that a unit of several query blocks walks
    its diagonal as a staircase of strips. A key block that meets query blocks apart meets
    each run of them in a piece of its own. Key blocks that meet the same run and are full
    there are gathered into pieces of at most ``block_k`` keys (whole blocks), the longest
    runs first; then the others, in the order of the keys: gathered by equal runs into pieces
    of at most ``block_k`` keys, or with ``strip_keys`` into strips of at most that many keys
    (and ``block_k``) whose runs are nested (a strip also computes, masked, the blocks of its
    rows that are not its own: under a causal mask, half of the diagonal square of each
    strip). ``mask_mod`` is evaluated once per piece, on its partial blocks only.

    With ``diagonal`` (and ``strip_keys``), rows of the block mask that walk a diagonal of
    squares of ``strip_keys`` (:func:`diagonal_squares`) compute those squares last, all at
    once, in pieces of ``diagonal`` keys (:meth:`_PieceMaker.square_pieces`), and the rest
    as above.
    """
    maker = _PieceMaker(kinds_rows, mask_mod, bh, rows, block_q, block_kv, S)
    squares = None
    if strip_keys and diagonal:
        squares = diagonal_squares(kinds_rows, len(rows), block_q, block_kv, strip_keys, S)
    if squares is not None:
        kinds_rows = kinds_rows.copy()  # the squares' blocks are computed apart
        width = strip_keys // block_kv  # blocks a square
        for p in range(kinds_rows.shape[0] // width):
            first = squares + p * width
            kinds_rows[p * width : (p + 1) * width, first : first + width] = EMPTY
    full: dict[tuple[int, int], list[int]] = {}
    other: list[tuple[int, int, int]] = []  # (key block, first and stop query block met)
    for j in np.flatnonzero(kinds_rows.any(axis=0)).tolist():
        met = np.flatnonzero(kinds_rows[:, j])
        for run in np.split(met, np.flatnonzero(np.diff(met) > 1) + 1):
            ra, rb = int(run[0]), int(run[-1]) + 1
            if (kinds_rows[ra:rb, j] == FULL).all():
                full.setdefault((ra, rb), []).append(j)
            else:
                other.append((j, ra, rb))
    per_piece = max(1, block_k // block_kv)
    groups = [
        [(j, ra, rb) for j in blocks[first : first + per_piece]]
        for (ra, rb), blocks in sorted(full.items(), key=lambda g: (g[0][0] - g[0][1], g[0][0]))
        for first in range(0, len(blocks), per_piece)
    ]
    if strip_keys:
        groups += _strips(other, max(1, min(strip_keys, block_k) // block_kv))
    else:
        same: dict[tuple[int, int], list[int]] = {}
        for j, ra, rb in other:
            same.setdefault((ra, rb), []).append(j)
        groups += [
            [(j, ra, rb) for j in blocks[first : first + per_piece]]
            for (ra, rb), blocks in same.items()
            for first in range(0, len(blocks), per_piece)
        ]
    pieces = tuple(maker.piece(group) for group in groups)
    if squares is not None:
        pieces += maker.square_pieces(squares, strip_keys, diagonal)
    return UnitPlan(
        computed=int(np.count_nonzero(maker.kinds)),
        partial=int(np.count_nonzero(maker.kinds == PARTIAL)),
        pieces=pieces,
        met=_rows_met(pieces, len(rows)),
    )


def _rows_met(pieces, length: int) -> np.ndarray | None:
    """``(length,)`` bool: the rows that some piece allows a key; None if every row."""
    met = np.zeros(length, dtype=bool)
    for piece, run, masked, mask in pieces:
        by_part = met.reshape(piece.parts, -1)  # the rows of each square, or all of them
        rows = by_part[:, run]
        if mask is None:
            rows[:] = True
            continue
        rows[:, : masked.start] = True  # the run's rows outside `masked` see full blocks only
        rows[:, masked.stop :] = True
        rows[:, masked] |= ~mask.all(axis=-1)
    if met.all():
        return None
    met.flags.writeable = False
    return met


def diagonal_squares(kinds_rows, length: int, block_q: int, block_kv: int, width: int, S: int):
    """The first key block of the diagonal of squares that the rows ``kinds_rows``
    ``(R, n_kv)`` of a block mask walk, or None if they do not.

    The rows (``length`` queries, whole blocks) are cut into two squares or more of ``width``
    queries (a whole number of blocks, ``block_q == block_kv``); square ``p`` owns the
    ``width`` keys from ``start + p width`` (``start`` a key block): before them its blocks
    are all full, after them all empty (a causal mask's, with any alignment that keeps its
    diagonal on block boundaries within the keys). What the squares hold is left to
    ``mask_mod``."""
    R, n_kv = kinds_rows.shape
    w = width // block_kv
    if block_q != block_kv or width % block_kv or R % w or R < 2 * w or length != R * block_q:
        return None
    square_rows = kinds_rows.reshape(R // w, w, n_kv)
    full = (square_rows == FULL).all(axis=1)  # (squares, n_kv): full for each row of a square
    start = int(np.argmin(full[0])) if not full[0].all() else n_kv
    P = R // w
    if (start + P * w) * block_kv > S:
        return None
    for p in range(P):
        first = start + p * w
        if not full[p, :first].all() or (square_rows[p, :, first + w :] != EMPTY).any():
            return None
    return start


def _strips(runs: list[tuple[int, int, int]], most: int) -> list[list[tuple[int, int, int]]]:
    """The key blocks' runs ``(j, ra, rb)`` (in the order of ``j``) gathered greedily into
    strips of at most ``most`` key blocks, each its key block once, whose runs of query blocks
    are nested: the strip's run is one of them (under a causal mask the runs of neighbouring
    key blocks end together). Runs that merely overlap (a sliding window's) stay apart: their
    union would compute blocks of query rows that neither key block meets."""
    strips: list[list[tuple[int, int, int]]] = []
    for j, ra, rb in runs:
        last = strips[-1] if strips else None
        if last is not None and len(last) < most and last[-1][0] < j:
            ua, ub = min(r[1] for r in last), max(r[2] for r in last)
            if (ua <= ra and rb <= ub) or (ra <= ua and ub <= rb):
                last.append((j, ra, rb))
                continue
        strips.append([(j, ra, rb)])
    return strips


class _PieceMaker:
    """Makes a unit's pieces from groups of key blocks' runs ``(j, ra, rb)``."""

    def __init__(self, kinds_rows, mask_mod, bh, rows: range, block_q, block_kv, S):
        self.kinds, self.mask_mod, self.bh, self.rows = kinds_rows, mask_mod, bh, rows
        self.block_q, self.block_kv, self.S = block_q, block_kv, S

    def start(self, r: int) -> int:
        """The unit's row where its query block ``r`` starts."""
        return min(r * self.block_q, len(self.rows))

    def piece(
        self, group: list[tuple[int, int, int]]
    ) -> tuple[Piece, slice, slice, np.ndarray | None]:
        """``(piece, run, masked, mask)`` of the key blocks of ``group``, each over its own run
        of query blocks: the piece's run is their union, where a block outside a key block's
        own run counts as empty (disallowed)."""
        ua, ub = min(g[1] for g in group), max(g[2] for g in group)
        kinds = np.full((ub - ua, len(group)), EMPTY, dtype=self.kinds.dtype)
        for c, (j, ra, rb) in enumerate(group):
            kinds[ra - ua : rb - ua, c] = self.kinds[ra:rb, j]
        cols = [j for j, _, _ in group]
        piece = Piece.of(cols, not (kinds == FULL).all(), self.block_kv, self.S)
        run = slice(self.start(ua), self.start(ub))
        if not piece.masked:
            return piece, run, slice(None), None
        crossed = np.flatnonzero((kinds != FULL).any(axis=1))
        pa, pb = ua + int(crossed[0]), ua + int(crossed[-1]) + 1
        masked = slice(self.start(pa) - run.start, self.start(pb) - run.start)
        queries = self.rows[self.start(pa) : self.start(pb)]
        return piece, run, masked, self.mask(kinds[pa - ua : pb - ua], queries, piece)

    def mask(self, kinds, queries: range, piece: Piece) -> np.ndarray:
        """``(queries, keys)`` bool, True = disallowed: ``mask_mod`` on the partial blocks
        (``kinds``, ``(query blocks, key blocks)``), evaluated a row of blocks at a time and
        never on another block; full blocks allowed, empty ones disallowed."""
        bq, block_kv = self.block_q, self.block_kv
        widths = [
            min(s1, b + block_kv) - b for s0, s1 in piece.spans for b in range(s0, s1, block_kv)
        ]
        ends = np.cumsum([0, *widths])  # where each key block starts in the piece, and the end
        cols = piece.cols()
        mask = np.zeros((len(queries), cols.size), dtype=bool)
        for a in range(kinds.shape[0]):
            for c in np.flatnonzero(kinds[a] == EMPTY):
                mask[a * bq : (a + 1) * bq, ends[c] : ends[c + 1]] = True
            partial = np.flatnonzero(kinds[a] == PARTIAL)
            if partial.size:
                at = np.concatenate([np.arange(ends[c], ends[c + 1]) for c in partial])
                block_rows = queries[a * bq : (a + 1) * bq]
                allowed = evaluate_mask_mod(
                    self.mask_mod, [self.bh[0]], [self.bh[1]], block_rows, cols[at]
                )
                mask[a * bq : a * bq + len(block_rows), at] = ~allowed[0, 0]
        mask.flags.writeable = False
        return mask

    def square_pieces(self, start: int, width: int, diagonal: int) -> tuple:
        """The pieces of the squares of ``width`` keys along the diagonal from key block
        ``start`` (:func:`diagonal_squares`): ``diagonal`` keys at a time of every square,
        each for the rows of a square that one of its keys is allowed to (in one run, the
        same run of every square), masked in the rows some key is not."""
        w, P = width // self.block_kv, self.kinds.shape[0] * self.block_q // width
        blocks = [list(range(start + p * w, start + (p + 1) * w)) for p in range(P)]
        squares = np.stack([  # (P, width, width) bool, True = disallowed
            self.mask(
                self.kinds[p * w : (p + 1) * w, blocks[p][0] : blocks[p][-1] + 1],
                self.rows[p * width : (p + 1) * width],
                Piece.of(blocks[p], True, self.block_kv, self.S),
            )
            for p in range(P)
        ])  # fmt: skip
        pieces = []
        for a in range(0, width, diagonal):
            sub = squares[:, :, a : a + diagonal]  # (P, width, keys)
            met = np.flatnonzero(~sub.all(axis=(0, 2)))  # rows with an allowed key, any square
            if not met.size:
                continue
            run = slice(int(met[0]), int(met[-1]) + 1)
            piece = SquarePiece(start * self.block_kv, width, P, a, sub.shape[-1])
            crossed = np.flatnonzero(sub[:, run].any(axis=(0, 2)))
            if not crossed.size:
                pieces.append((piece, run, slice(None), None))
                continue
            masked = slice(int(crossed[0]), int(crossed[-1]) + 1)
            mask = np.ascontiguousarray(sub[:, run][:, masked])  # (P, masked rows, keys)
            mask.flags.writeable = False
            pieces.append((piece, run, masked, mask))
        return tuple(pieces)


def mask_row(kinds: np.ndarray, b: int, h: int, m: int) -> tuple[int, int, int]:
    """Where batch entry ``b``, query head ``h`` and query block ``m`` read ``kinds``."""
    return (b if kinds.shape[0] > 1 else 0, h if kinds.shape[1] > 1 else 0, m)


def query_blocks_per_unit(B: int, Hkv: int, G: int, kinds: np.ndarray, block_q: int) -> int:
    """Consecutive query blocks per unit: as many as make up to ``BLOCK_ROWS_FULL`` rows (the
    ``G`` query heads of a key head counted, or one head when the mask depends on the head),
    as long as the call keeps ``MIN_UNITS`` units. Depends on the shapes alone, not on the
    threads."""
    n_q = kinds.shape[2]
    heads = B * Hkv * (G if kinds.shape[1] > 1 else 1)  # units per run of query blocks
    rows = block_q * (1 if kinds.shape[1] > 1 else G)  # a block's rows in a unit
    most = max(1, min(BLOCK_ROWS_FULL.values()) // rows)
    return int(max(1, min(most, n_q, heads * n_q // MIN_UNITS)))


def unit_list(
    B: int, Hkv: int, G: int, kinds: np.ndarray, block_q: int, block_kv: int
) -> list[tuple[int, int, int, int, int, int, int]]:
    """``(b, hk0, hk1, g0, g1, m0, m1)`` of every unit: the query blocks ``m0:m1``
    (:func:`query_blocks_per_unit` of them) of the query heads ``g0:g1`` of the key heads
    ``hk0:hk1``; head after head, and the units of a head the costliest first.

    A unit holds one key head, unless the mask does not depend on the head: then it folds in
    as many key heads as :func:`key_heads_per_unit` allows (the fold depends on the shapes and
    the mask only, not on the threads).

    Head after head keeps a head's keys and values in the cache from one unit to the next
    (under a causal mask each unit reads a prefix of the previous one's). Ordered by cost
    alone, the 8 heads' units of one query block came one after the other, each reading keys
    another head had pushed out: the causal call at T = S = 4096 (8 heads of width 64,
    float32, one thread) took about 3 % more CPU time. Within a head the costliest come first,
    so the last units of the call are short.
    """
    n_q = kinds.shape[2]
    per_unit = query_blocks_per_unit(B, Hkv, G, kinds, block_q)
    runs = [(m, min(n_q, m + per_unit)) for m in range(0, n_q, per_unit)]
    nonempty = np.count_nonzero(kinds, axis=-1)  # (1 or B, 1 or Hq, n_q)
    units = []
    if kinds.shape[1] > 1:  # the mask depends on the head
        for b, hk, g, (m0, m1) in itertools.product(range(B), range(Hkv), range(G), runs):
            b_, h_, _ = mask_row(kinds, b, hk * G + g, 0)
            cost = int(nonempty[b_, h_, m0:m1].sum())
            units.append((cost, (b, hk, hk + 1, g, g + 1, m0, m1)))
    else:
        for b, (m0, m1) in itertools.product(range(B), runs):
            cost = int(nonempty[b if kinds.shape[0] > 1 else 0, 0, m0:m1].sum())
            fold = int(key_heads_per_unit(B, Hkv, G, len(runs), np.array(cost), block_q, block_kv))
            for hk in range(0, Hkv, fold):
                units.append((cost, (b, hk, min(Hkv, hk + fold), 0, G, m0, m1)))
    units.sort(key=lambda u: (u[1][0], u[1][1], u[1][3], -u[0]))  # by (b, hk0, g0), then cost
    return [u[1] for u in units]


def key_heads_per_unit(B, Hkv, G, n_runs, cost: np.ndarray, block_q: int, block_kv: int):
    """Key heads per unit for units with ``cost`` non-empty blocks (an array), when the mask
    does not depend on the head and the query blocks are cut into ``n_runs`` runs: within
    ``UNIT_SCORES`` scores and ``MIN_UNITS`` units (see :mod:`sdpa.tuning`)."""
    most = max(1, B * Hkv * n_runs // MIN_UNITS)
    scores = np.maximum(1, cost * (block_kv * G * block_q))  # per key head
    return np.maximum(1, np.minimum(min(Hkv, most), UNIT_SCORES // scores))


def unit_count(B: int, Hkv: int, G: int, kinds: np.ndarray, block_q: int, block_kv: int) -> int:
    """``len(unit_list(...))``, without listing them."""
    n_q = kinds.shape[2]
    per_unit = query_blocks_per_unit(B, Hkv, G, kinds, block_q)
    n_runs = -(-n_q // per_unit)
    if kinds.shape[1] > 1:
        return B * Hkv * G * n_runs
    nonempty = np.count_nonzero(kinds[:, 0], axis=-1)  # (1 or B, n_q)
    cost = np.add.reduceat(nonempty, np.arange(0, n_q, per_unit), axis=-1)  # (1 or B, n_runs)
    per_row = -(-Hkv // key_heads_per_unit(B, Hkv, G, n_runs, cost, block_q, block_kv))
    return int(per_row.sum()) * (B // kinds.shape[0])


class PlanCache:
    """The plans of rows of a block mask, keyed by the call's settings and the row; shared by
    the worker threads of a call, and kept beside the mask for later calls (up to ``budget``
    bytes of masks, whatever the settings; when full, it starts over). Each plan has
    ``nbytes``.

    A plan depends on its row of the mask and the settings alone, never on the inputs, so
    which thread made it, or which call, does not change a bit of any result. Two threads that
    miss the same row both make its plan, and the first one kept serves later units.
    """

    def __init__(self, budget: int):
        self.budget = budget
        self.plans: dict = {}
        self.nbytes = 0
        self.lock = threading.Lock()

    def get(self, key: tuple, make: Callable):
        """The plan of ``key``, made by ``make()`` if it is not kept."""
        plan = self.plans.get(key)
        if plan is not None:
            return plan
        plan = make()
        with self.lock:
            if key in self.plans:
                return self.plans[key]
            if self.nbytes + plan.nbytes > self.budget:
                self.plans.clear()
                self.nbytes = 0
            if plan.nbytes <= self.budget:
                self.plans[key] = plan
                self.nbytes += plan.nbytes
        return plan


# The plans of each block mask, beside it rather than in it: the mask stays an immutable value
# that pickles and deep-copies whatever calls it served (a copy makes its own plans), and its
# plans go when it goes (a BlockMask hashes by identity).
_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_PLANS_LOCK = threading.Lock()


def plans_beside(block_mask: BlockMask, budget: int) -> PlanCache:
    """The :class:`PlanCache` kept for ``block_mask`` (made on first use, with ``budget``,
    once whichever thread asks)."""
    with _PLANS_LOCK:
        plans = _PLANS.get(block_mask)
        if plans is None:
            plans = _PLANS[block_mask] = PlanCache(budget)
        return plans
