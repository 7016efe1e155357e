"""The flex face's plan: a block mask's rows cut into pieces, the units, and the plan cache.

A block mask (:class:`sdpa.BlockMask`) says what each block of ``(Bq, Bk)`` scores holds:
empty, full or partial (``EMPTY``, ``FULL``, ``PARTIAL``). The units of
a row of query blocks skip the empty blocks entirely; the plan of a row (``RowPlan``)
gathers its full blocks into pieces and its partial blocks into other pieces, each of at most
``block_k`` keys (whole blocks, one at least), with the mask of each partial piece evaluated
once. Full and partial blocks go into separate pieces so that every operation on a piece's
scores runs on a contiguous tile (the columns of a partial block inside a wider tile are a
strided view, on which NumPy copied through buffers: at T = S = 4096, 8 heads of width 64,
float32, one thread, 2-core Xeon, the causal call spent 4 % of its time in those copies).

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

from ..block_mask import FULL, PARTIAL, BlockMask, evaluate_mask_mod
from ..tuning import MIN_UNITS, UNIT_SCORES

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


@dataclass(frozen=True)
class RowPlan:
    """What the units of one row of the block mask do (the row of a batch entry, a head and a
    query block): its pieces, the full ones first, each with its mask (True = disallowed;
    None for a piece of full blocks)."""

    computed: int  # non-empty blocks
    partial: int  # partial ones
    pieces: tuple[tuple[Piece, np.ndarray | None], ...]  # the masks read-only: plans are shared

    @property
    def nbytes(self) -> int:
        """The bytes of its masks."""
        return sum(mask.nbytes for _, mask in self.pieces if mask is not None)


def row_plan(
    kinds_row: np.ndarray,
    mask_mod,
    bh: tuple[int, int],
    rows: range,
    block_kv: int,
    S: int,
    block_k,
) -> RowPlan:
    """The plan of one row ``kinds_row`` ``(n_kv,)`` of a block mask, for batch entry and
    head ``bh`` and the queries ``rows``: pieces of at most ``block_k`` keys (whole blocks)."""
    per_piece = max(1, block_k // block_kv)
    pieces = []
    for kind in (FULL, PARTIAL):  # a row's first finite score spares the rest the empty-row care
        blocks = np.flatnonzero(kinds_row == kind).tolist()
        for first in range(0, len(blocks), per_piece):
            piece = Piece.of(blocks[first : first + per_piece], kind == PARTIAL, block_kv, S)
            mask = None
            if piece.masked:
                mask = ~evaluate_mask_mod(mask_mod, [bh[0]], [bh[1]], rows, piece.cols())
                mask.flags.writeable = False
            pieces.append((piece, mask))
    return RowPlan(
        computed=int(np.count_nonzero(kinds_row)),
        partial=int(np.count_nonzero(kinds_row == PARTIAL)),
        pieces=tuple(pieces),
    )


def mask_row(kinds: np.ndarray, b: int, h: int, m: int) -> tuple[int, int, int]:
    """Where batch entry ``b``, query head ``h`` and query block ``m`` read ``kinds``."""
    return (b if kinds.shape[0] > 1 else 0, h if kinds.shape[1] > 1 else 0, m)


def unit_list(
    B: int, Hkv: int, G: int, kinds: np.ndarray, block_q: int, block_kv: int
) -> list[tuple[int, int, int, int, int, int]]:
    """``(b, hk0, hk1, g0, g1, query_block)`` of every unit: the query heads ``g0:g1`` of the
    key heads ``hk0:hk1``; head after head, and the query blocks of a head the costliest first.

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
    nonempty = np.count_nonzero(kinds, axis=-1)  # (1 or B, 1 or Hq, n_q)
    units = []
    if kinds.shape[1] > 1:  # the mask depends on the head
        for b, hk, g, m in itertools.product(range(B), range(Hkv), range(G), range(kinds.shape[2])):
            cost = int(nonempty[mask_row(kinds, b, hk * G + g, m)])
            units.append((cost, (b, hk, hk + 1, g, g + 1, m)))
    else:
        for b, m in itertools.product(range(B), range(kinds.shape[2])):
            cost = int(nonempty[mask_row(kinds, b, 0, m)])
            fold = int(
                key_heads_per_unit(B, Hkv, G, kinds.shape[2], np.array(cost), block_q, block_kv)
            )
            for hk in range(0, Hkv, fold):
                units.append((cost, (b, hk, min(Hkv, hk + fold), 0, G, m)))
    units.sort(key=lambda u: (u[1][0], u[1][1], u[1][3], -u[0]))  # by (b, hk0, g0), then cost
    return [u[1] for u in units]


def key_heads_per_unit(B, Hkv, G, n_q, cost: np.ndarray, block_q: int, block_kv: int):
    """Key heads per unit for rows of the mask with ``cost`` non-empty blocks (an array), when
    the mask does not depend on the head: within ``UNIT_SCORES`` scores and ``MIN_UNITS``
    units (see :mod:`sdpa.tuning`)."""
    most = max(1, B * Hkv * n_q // MIN_UNITS)
    scores = np.maximum(1, cost * (block_kv * G * block_q))  # per key head
    return np.maximum(1, np.minimum(min(Hkv, most), UNIT_SCORES // scores))


def unit_count(B: int, Hkv: int, G: int, kinds: np.ndarray, block_q: int, block_kv: int) -> int:
    """``len(unit_list(...))``, without listing them."""
    n_q = kinds.shape[2]
    if kinds.shape[1] > 1:
        return B * Hkv * G * n_q
    cost = np.count_nonzero(kinds[:, 0], axis=-1)  # (1 or B, n_q)
    per_row = -(-Hkv // key_heads_per_unit(B, Hkv, G, n_q, cost, block_q, block_kv))
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
