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
**tiled** path works on one block of query rows at a time (the mask's query block; when the
mask does not depend on the head, of the query heads that share a key head, and of several key
heads at once, as many as ``UNIT_SCORES`` and ``MIN_UNITS`` allow):

1. gather the key blocks the block mask marks non-empty, skipping the empty ones entirely:
   no product, no ``score_mod``, no ``mask_mod`` on their entries;
2. one product for the gathered full blocks and one for the gathered *partial* ones (each in
   pieces of at most ``block_k`` keys), so that every tile is contiguous;
3. ``score_mod`` on those scores, ``mask_mod`` on the tiles of partial blocks only (a full
   block needs no mask);
4. an online softmax (running maximum ``m`` and normaliser ``l``, as in :mod:`sdpa.tiled`)
   across the pieces, the full ones first.

Without a ``score_mod`` the scores are computed in base 2 where ``exp2`` is the faster
exponential (:func:`sdpa.tuning.tile_exponential`), as the tiled path of
:func:`sdpa.scaled_dot_product_attention` does, and the online softmax takes the lazy steps of
:mod:`sdpa.tiled`: a unit's first piece of full blocks at the shift 0, later pieces at the
shift they find, each checked by its row sums and computed again in the rare case that fails.
Units whose rows of the block mask are equal (every head of a mask created with ``H=None``)
share one plan: the layout of their gathered keys and the ``mask_mod`` of their partial
blocks, evaluated once and kept beside the block mask for its later calls. Values near the
ends of the dtype's range are found in the result, as in :mod:`sdpa.tiled`, and the call
computed again on values scaled by a power of two per column.

Work units are shared among threads (:func:`sdpa.threads.run_in_threads`, BLAS on one
thread); each unit's result depends on its inputs alone, so the bits do not depend on the
number of threads. :func:`flex_attention_tiled` runs this path with its tunables and counts
what it did in a :class:`FlexStats`.

Shape letters: ``B`` batch, ``Hq``/``Hkv`` query and key/value heads, ``G = Hq // Hkv``,
``T`` queries, ``S`` keys, ``Dk``/``Dv`` head widths, ``Bq``/``Bk`` block sizes.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from ._checks import (
    ATTENTION_MASK_HINT,
    as_array,
    available_memory,
    broadcasts_to,
    check_bool,
    check_memory,
    check_positive_int,
    check_query_key_value,
    lse_dtype,
)
from .block_mask import (
    FULL,
    PARTIAL,
    BlockMask,
    PlanCache,
    check_mod,
    evaluate_mask_mod,
    index_arrays,
    plans_beside,
)
from .problem import AttentionProblem, check_overflow, overflow_checked
from .problem import prepare_attention as _prepare_attention  # public in sdpa.problem only
from .softmax_stable import softmax_and_lse
from .threads import default_num_threads, run_in_threads, single_threaded_blas
from .tiled import (
    LAZY_BOUND,  # e ** +-LAZY_MARGIN: the lazy steps' row sums
    LAZY_FLOOR,
    value_exponents,
    values_may_be_out_of_range,
    widen_column_top,
)
from .tuning import tile_exponential

__all__ = ["FlexStats", "flex_attention", "flex_attention_tiled"]

SCORE_MOD_SIGNATURE = "score_mod(score, b, h, q_idx, kv_idx) -> array"
LOG2E = 1 / math.log(2)  # 2 ** (x * LOG2E) = e ** x
LN2 = math.log(2)

# Query rows of a work unit without a block mask (the heads folded in count as rows): the
# BlockMask's default block.
BLOCK_ROWS = 128
# Keys per product of the tiled path: a query block's gathered key blocks are cut into pieces
# of at most this many keys. A (128, 4096) float32 tile of scores is 2 MiB. At T = S = 4096, 8
# heads of width 64 in float32 on one core of the benchmark machine (2-core Xeon, Sapphire
# Rapids; best of 5), 4096 took 0.98 to 0.99 of the CPU time of 2048 and 0.86 to 0.87 of 512,
# with a causal block mask and without a mask.
BLOCK_K = 4096

# implementation="auto" takes the tiled path when the reference path's score matrix holds at
# least MIN_TILED_SCORES scores and the tiled path's work units hold at least MIN_UNIT_SCORES
# scores each on average (a unit costs tens of microseconds of Python between NumPy calls,
# which many small heads cannot amortise), or when the reference path's arrays would take
# more than a quarter of the available memory. Both paths timed on 14 shapes (float32, width
# 64, with and without a causal mask; 2-core Xeon): below 2**19 scores the reference path was
# up to 1.7 times as fast (at a few milliseconds); above, the tiled path was the faster
# wherever the units held 2**14 scores, and 4 to 17 times slower for heads of 16 x 16 and
# 32 x 32 scores. The units are counted as the tiled path cuts the work, several key heads to
# a unit where the mask allows (_unit_count). Timed again on 19 shapes after that (B x H from
# 1 x 2 to 256 x 8, T = S from 32 to 2048, widths 16 to 64, each with and without a causal
# mask; Sapphire Rapids, two threads): the rule took the faster path, or one within 5 %, in
# 37 of the 38 cases, the other (64 x 16 heads of 32 x 32 scores, causal) taking 1.23 times
# as long; counting one unit per key head it had missed 4, by up to 2.4 times. 2**15 would
# miss 2, by up to 1.64 times.
MIN_TILED_SCORES = 1 << 19
MIN_UNIT_SCORES = 1 << 14

# A unit takes the same query block of several key heads when the mask does not depend on the
# head: up to UNIT_SCORES scores, and never so many heads that the call has fewer than MIN_UNITS
# units (to share among threads). Every unit costs tens to hundreds of microseconds of Python,
# during which another worker thread waits whenever it needs the GIL too. At T = S = 4096, 8
# heads of width 64, float32, two threads (2-core Xeon, Sapphire Rapids), units of all 8 heads
# took 245 ms without a mask and 143 ms with a causal block mask, against 270 and 170 ms with a
# unit per head (and 2**20 or 2**21 scores: in between); on one thread, within 4 % either way.
UNIT_SCORES = 1 << 22  # 8 query blocks of 128 rows by 4096 keys: 16 MiB of float32
MIN_UNITS = 16

# A block mask keeps the tiled path's plans of its rows (their pieces, and what mask_mod gave on
# their partial blocks) for every later call with the same settings, up to PLAN_CACHE_BYTES of
# masks: a mask made once and used by every layer and step evaluates each partial block once,
# as create_block_mask evaluated each block once. At T = S = 4096, 8 heads of width 64, float32,
# two threads (2-core Xeon), a causal call spent about 8 ms of its threads' time making its 32
# plans (mask_mod on a 128 x 128 block, its bias: about 75 us each alone, more while the other
# thread contends for the GIL); kept, the call took 124-129 ms instead of 134-137.
PLAN_CACHE_BYTES = 1 << 26  # 64 MiB: causal at T = S = 32768 keeps 16 MiB of float32 biases


@dataclass
class FlexStats:
    """Counters of the work the tiled path of :func:`sdpa.flex_attention` did.

    Filled when passed to :func:`flex_attention_tiled` as ``stats``. Blocks are those of the
    block mask, counted once for each batch entry and query head (a unit that folds ``G``
    heads counts ``G`` of each), so that ``computed + skipped`` is ``B * Hq * n_q * n_kv``.
    The counts add up over calls (and over the second pass of a call whose values are scaled
    into range).

    Attributes
    ----------
    units : int
        Work units: one block of query rows of one head, of the heads that share a key head,
        or (when the mask does not depend on the head) of several key heads.
    tiles : int
        Pieces: a unit's gathered keys of one kind (full or partial blocks), at most
        ``block_k`` of them, each one matrix product with the unit's queries (two when the
        piece is computed again, counted in ``redone``).
    computed : int
        Blocks whose scores were computed (0 without a block mask).
    masked : int
        Computed blocks to which ``mask_mod`` applies: the partial ones. (It is evaluated on a
        block once per block mask and setting, and kept: see ``PLAN_CACHE_BYTES``.)
    skipped : int
        Blocks never computed: the block mask marks them empty.
    redone : int
        Pieces computed twice. A unit's first piece of full blocks takes the shift 0 for
        every row, and a later piece each row's present shift (the online softmax's lazy
        steps), unless a row's scores end up too far above it, or (for the shift 0) all too
        far below it (by ``sdpa.tuning.LAZY_MARGIN``); then the piece is computed again with
        the row maxima as the shift.

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
        for field in dataclasses.fields(self):
            setattr(self, field.name, getattr(self, field.name) + getattr(other, field.name))


# ----------------------------------------------------------------------------------------
# The call, validated
# ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _FlexCall:
    """A validated call in one layout: query heads split into ``(Hkv, G)``.

    Without ``enable_gqa``, keys and values with one head shared by all query heads are
    ``Hkv = 1, G = Hq`` (the heads fold into one unit's rows); otherwise ``Hkv = Hq, G = 1``.
    """

    problem: AttentionProblem  # validation, dtypes, scale, non-finite rows
    query: np.ndarray  # (B, Hkv, G, T, Dk) view
    key: np.ndarray  # (B, Hkv, 1, S, Dk) view
    value: np.ndarray  # (B, Hkv, 1, S, Dv) view
    score_mod: Callable | None
    block_mask: BlockMask | None
    B: int
    Hkv: int
    G: int

    @property
    def Hq(self) -> int:
        return self.Hkv * self.G

    @property
    def dtype(self) -> np.dtype:
        return self.problem.work_dtype


def _check_call(query, key, value, score_mod, block_mask, scale, enable_gqa) -> _FlexCall:
    """Every check of a call, up front; the arrays in the layout of :class:`_FlexCall`."""
    q, k, v = check_query_key_value(query, key, value, masked_hint=ATTENTION_MASK_HINT)
    for name, a in (("query", q), ("key", k), ("value", v)):
        if a.ndim != 4:
            raise ValueError(
                f"{name} must be 4-D (B, H, L, D), as in torch's flex_attention; "
                f"got {name}.shape={a.shape}"
            )
    if score_mod is not None:
        check_mod(score_mod, "score_mod", SCORE_MOD_SIGNATURE)
    if block_mask is not None and not isinstance(block_mask, BlockMask):
        raise TypeError(
            "block_mask must be a BlockMask made by sdpa.create_block_mask, or None; "
            f"got {type(block_mask).__name__}"
        )
    problem = _prepare_attention(q, k, v, None, False, scale=scale, enable_gqa=enable_gqa)
    T, S, Dk = problem.T, problem.S, problem.Dk
    B = problem.batch_shape[0]
    k, v = problem.key, problem.value
    if problem.groups is not None:  # (B, Hkv, G): the grouped layout already
        _, Hkv, G = problem.batch_shape
    elif k.shape[1] == 1 and v.shape[1] == 1:
        Hkv, G = 1, problem.batch_shape[1]  # every query head shares the one key head
    else:
        Hkv, G = problem.batch_shape[1], 1
    if problem.groups is None:  # add the axis of length G (queries) or 1 (keys and values)
        query = np.broadcast_to(problem.query, (B, Hkv * G, T, Dk)).reshape(B, Hkv, G, T, Dk)
        keys = [np.broadcast_to(a, (B, Hkv, S, a.shape[-1]))[:, :, None] for a in (k, v)]
    else:
        query = np.broadcast_to(problem.query, (B, Hkv, G, T, Dk))
        keys = [np.broadcast_to(a, (B, Hkv, 1, S, a.shape[-1])) for a in (k, v)]
    call = _FlexCall(problem, query, keys[0], keys[1], score_mod, block_mask, B, Hkv, G)
    if block_mask is not None:
        _check_fit(block_mask, call)
    return call


def _check_fit(block_mask: BlockMask, call: _FlexCall) -> None:
    Bm, Hm, T, S = block_mask.shape
    wanted = (call.B, call.Hq, call.problem.T, call.problem.S)
    if (T, S) != wanted[2:] or Bm not in (1, call.B) or Hm not in (1, call.Hq):
        raise ValueError(
            f"block_mask must fit the call: its shape (B, H, Q_LEN, KV_LEN) = "
            f"{block_mask.shape} against the call's (B, Hq, T, S) = {wanted}, where B and H "
            "may also be 1 (a mask created with None)"
        )


def _apply_score_mod(call: _FlexCall, scores: np.ndarray, b, h, q_idx, kv_idx) -> np.ndarray:
    """``score_mod`` on 4-D ``scores`` ``(n_b, n_h, n_q, n_kv)`` (an array the caller owns)
    and its index arrays, checked: ``scores``, holding the modified scores in the working dtype.

    The result is copied into ``scores`` unless it is ``scores`` itself: the tiled path writes
    into what this returns, and whatever else the mod returned may be the caller's (a stored
    bias, a view of one), which must not change. One pass over the tile, as a cast would be."""
    result = call.score_mod(scores, *index_arrays(b, h, q_idx, kv_idx))
    result = as_array(result, "score_mod's result")
    if result.dtype.kind not in "fiu":
        raise TypeError(
            f"score_mod must return real scores (a float array); got dtype {result.dtype}"
        )
    if not broadcasts_to(result.shape, scores.shape):
        raise ValueError(
            f"score_mod must return an array of the shape of its scores {scores.shape} (or one "
            f"that broadcasts to it); got shape {result.shape}"
        )
    if result is not scores:
        with np.errstate(over="ignore"):  # a score beyond the dtype's range is +-inf, as cast
            np.copyto(scores, result, casting="unsafe")  # broadcast, cast to the working dtype
    return scores


# ----------------------------------------------------------------------------------------
# The reference path: the whole score matrix
# ----------------------------------------------------------------------------------------


def _dense_mask(block_mask: BlockMask) -> np.ndarray:
    """``(B or 1, H or 1, T, S)`` bool: the mask entry by entry, from its ``mask_mod``."""
    Bm, Hm, T, S = block_mask.shape
    return evaluate_mask_mod(block_mask.mask_mod, range(Bm), range(Hm), range(T), range(S))


def _flex_reference(call: _FlexCall) -> tuple[np.ndarray, np.ndarray]:
    """``(out (B, Hq, T, Dv), lse (B, Hq, T))`` in the working dtype, from the whole scores."""
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
        scores = _apply_score_mod(call, scores, range(B), range(Hq), range(T), range(S))
    if allowed is not None:
        scores = np.where(allowed, scores, dtype.type(-np.inf))
    weights, lse = softmax_and_lse(scores, axis=-1)  # (B, Hq, T, S), (B, Hq, T, 1)
    weights = weights.reshape(B, call.Hkv, call.G, T, S)
    out = (weights @ call.value).reshape(B, Hq, T, problem.Dv)  # (..., T, S) @ (..., S, Dv)
    lse = lse[..., 0]
    # A score_mod that returns +inf has no softmax; the tiled path gives NaN there, so here too.
    infinite = np.isposinf(lse)
    if infinite.any():
        out[infinite] = np.nan
        lse[infinite] = np.nan
    return out, lse


# ----------------------------------------------------------------------------------------
# The tiled path: a block of query rows at a time, empty key blocks skipped
# ----------------------------------------------------------------------------------------


@dataclass
class _Tiling:
    """What every work unit reads and writes."""

    call: _FlexCall
    factor: np.floating  # the queries' factor: the scale, times log2(e) in base 2
    kinds: np.ndarray  # (1 or B, 1 or Hq, n_q, n_kv) int8: EMPTY, PARTIAL or FULL
    block_q: int  # query positions per block
    block_kv: int  # keys per block
    block_k: int  # keys per product, at most (at least one block)
    exp: Callable  # the exponential of the tiles: numpy.exp, or numpy.exp2 on scores in base 2
    plans: PlanCache  # the plans of the mask's rows: kept beside the block mask, or the call's
    settings: tuple  # what a plan depends on besides its row: (block_k, base 2, dtype)
    out: np.ndarray  # (B, Hkv, G, T, Dv), written by the units (every row: not zeroed first)
    lse: np.ndarray  # (B, Hkv, G, T)
    value: np.ndarray  # (B, Hkv, 1, S, Dv): the call's, or scaled by 2 ** -v_exp
    v_exp: np.ndarray | None  # (Dv,) int: the powers of two the values were scaled by, or None


def _mask_row(kinds: np.ndarray, b: int, h: int, m: int) -> tuple[int, int, int]:
    """Where batch entry ``b``, query head ``h`` and query block ``m`` read ``kinds``."""
    return (b if kinds.shape[0] > 1 else 0, h if kinds.shape[1] > 1 else 0, m)


def _blocks(call: _FlexCall, block_k: int) -> tuple[np.ndarray, int, int]:
    """``(kinds, block_q, block_kv)``: the block mask's, or without one every key block full
    and one block of rows (of the heads that share a key head) per unit."""
    bm = call.block_mask
    if bm is not None:
        return bm.kinds, *bm.BLOCK_SIZE
    T, S = call.problem.T, call.problem.S
    block_q = max(1, BLOCK_ROWS // call.G)
    block_kv = min(block_k, S)
    return (
        np.full((1, 1, -(-T // block_q), -(-S // block_kv)), FULL, dtype=np.int8),
        block_q,
        block_kv,
    )


def _tiling(call: _FlexCall, block_k: int, v_exp: np.ndarray | None = None) -> _Tiling:
    problem, bm = call.problem, call.block_mask
    T = problem.T
    kinds, block_q, block_kv = _blocks(call, block_k)
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
        exp=exp,
        plans=PlanCache(PLAN_CACHE_BYTES) if bm is None else plans_beside(bm, PLAN_CACHE_BYTES),
        settings=(block_k, exp is np.exp2, call.dtype.str),
        out=np.empty((call.B, call.Hkv, call.G, T, problem.Dv), dtype=call.dtype),
        lse=np.full((call.B, call.Hkv, call.G, T), -np.inf, dtype=call.dtype),
        value=call.value if v_exp is None else np.ldexp(call.value, -v_exp),  # exact
        v_exp=v_exp,
    )


def _units(
    call: _FlexCall, kinds: np.ndarray, block_q: int, block_kv: int
) -> list[tuple[int, int, int, int, int, int]]:
    """``(b, hk0, hk1, g0, g1, query_block)`` of every unit: the query heads ``g0:g1`` of the
    key heads ``hk0:hk1``; head after head, and the query blocks of a head the costliest first.

    A unit holds one key head, unless the mask does not depend on the head: then it holds as
    many key heads as keep its scores within ``UNIT_SCORES`` and the call's units at least
    ``MIN_UNITS`` (the fold depends on the shapes and the mask only, not on the threads).

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
        for b, hk, g, m in itertools.product(
            range(call.B), range(call.Hkv), range(call.G), range(kinds.shape[2])
        ):
            cost = int(nonempty[_mask_row(kinds, b, hk * call.G + g, m)])
            units.append((cost, (b, hk, hk + 1, g, g + 1, m)))
    else:
        for b, m in itertools.product(range(call.B), range(kinds.shape[2])):
            cost = int(nonempty[_mask_row(kinds, b, 0, m)])
            fold = int(_fold(call, kinds.shape[2], np.array(cost), block_q, block_kv))
            for hk in range(0, call.Hkv, fold):
                units.append((cost, (b, hk, min(call.Hkv, hk + fold), 0, call.G, m)))
    units.sort(key=lambda u: (u[1][0], u[1][1], u[1][3], -u[0]))  # by (b, hk0, g0), then cost
    return [u[1] for u in units]


def _fold(call: _FlexCall, n_q: int, cost: np.ndarray, block_q: int, block_kv: int) -> np.ndarray:
    """Key heads per unit for rows of the mask with ``cost`` non-empty blocks (an array), when
    the mask does not depend on the head: within ``UNIT_SCORES`` scores and ``MIN_UNITS``
    units."""
    most = max(1, call.B * call.Hkv * n_q // MIN_UNITS)
    scores = np.maximum(1, cost * (block_kv * call.G * block_q))  # per key head
    return np.maximum(1, np.minimum(min(call.Hkv, most), UNIT_SCORES // scores))


def _unit_count(call: _FlexCall, kinds: np.ndarray, block_q: int, block_kv: int) -> int:
    """``len(_units(...))``, without listing them."""
    n_q = kinds.shape[2]
    if kinds.shape[1] > 1:
        return call.B * call.Hq * n_q
    cost = np.count_nonzero(kinds[:, 0], axis=-1)  # (1 or B, n_q)
    per_row = -(-call.Hkv // _fold(call, n_q, cost, block_q, block_kv))
    return int(per_row.sum()) * (call.B // kinds.shape[0])


@dataclass(frozen=True)
class _Piece:
    """The keys of one product: blocks of one kind, full or partial (those need ``mask_mod``).

    Full and partial blocks go into separate pieces, so that every operation on a piece's
    scores runs on a contiguous tile. (The columns of a partial block inside a wider tile are
    a strided view, on which NumPy copied through buffers: at T = S = 4096, 8 heads of width
    64, float32, one thread, 2-core Xeon, the causal call spent 4 % of its time in those
    copies, and took 0.56 of the unmasked call's time in its units, against 0.54 apart.)
    """

    spans: tuple[tuple[int, int], ...]  # key ranges s0:s1 of runs of consecutive blocks
    masked: bool  # partial blocks: mask_mod applies; else full ones

    @classmethod
    def of(cls, blocks: list[int], masked: bool, block_kv: int, S: int) -> _Piece:
        spans = []
        for n in blocks:
            s0, s1 = n * block_kv, min(S, (n + 1) * block_kv)
            if spans and spans[-1][1] == s0:  # the next block of a run: one view for both
                spans[-1] = (spans[-1][0], s1)
            else:
                spans.append((s0, s1))
        return cls(tuple(spans), masked)

    def cols(self) -> np.ndarray:
        """``(keys,)``: the key positions, in order (made when asked: plans are kept)."""
        return np.concatenate([np.arange(s0, s1) for s0, s1 in self.spans])

    def gather(self, x: np.ndarray) -> np.ndarray:
        """The piece's rows of ``x`` ``(..., S, D)``: a view for one run of blocks, else a copy."""
        if len(self.spans) == 1:
            ((s0, s1),) = self.spans
            return x[..., s0:s1, :]
        return np.concatenate([x[..., s0:s1, :] for s0, s1 in self.spans], axis=-2)


class _Softmax:
    """The online softmax of one unit's rows over its pieces: ``m``, ``l`` and ``acc``.

    In base 2 (``exp`` is ``numpy.exp2``) the scores are ``log2(e)`` times the natural ones and
    so are ``m`` and the shift; the lse is converted back. SVML's ``exp2`` is several times
    slower on ``-inf`` than on finite numbers, so the tiles of partial blocks, where the
    disallowed entries are ``-inf``, take ``exp(x ln 2)`` instead.
    """

    def __init__(self, exp: Callable, modified: bool):
        self.exp = exp
        self.modified = modified  # a score_mod made the scores: any of them may be +-inf
        self.finite = False  # every row has had a finite score: m is finite, and then l >= 1
        self.m = None  # running maximum (after a lazy step: the shift), (rows,)
        self.shift = None  # what l and acc are relative to: m, or 0 where m = -inf
        self.l = None  # running normaliser, (rows,)
        self.acc = None  # sum of exp(score - shift) v, (rows, Dv)

    def add(self, tile: np.ndarray, value: np.ndarray, piece: _Piece, lazy: bool = True) -> bool:
        """Fold in a piece: its scores ``(1, heads, Bq, keys)`` (overwritten), with disallowed
        entries at ``-inf`` if its blocks are partial, and its values ``(n, keys, Dv)`` (of
        the unit's ``n`` key heads, each for ``heads / n`` query heads).

        A first piece of full blocks first tries the shift 0, and a later piece, once every
        row has a finite shift, the row's present shift (the lazy step); False means that it
        failed and changed nothing but the tile: fold the piece in again, ``lazy=False``.
        """
        s = tile.reshape(-1, tile.shape[-1])  # (rows, keys) view
        if lazy and self.m is None and not (piece.masked or self.modified):
            return self.start_at_zero(s, value, piece)
        if lazy and self.finite:
            return self.lazy_add(s, value, piece)
        m = s.max(axis=1)  # NaN stays NaN
        if self.m is not None:
            m = np.maximum(self.m, m)
        # a piece of full blocks gives every row a finite score
        self.finite = self.finite or not (piece.masked or self.modified)
        shift = m  # a row with no score yet keeps the shift 0
        if not self.finite:
            shift = np.where(np.isneginf(m), 0, m).astype(s.dtype, copy=False)
        # Scores and m far below the shift (near -finfo.max) may give -inf, whose exp is 0 as
        # it should be; a score_mod's +inf gives inf - inf = NaN, its row's result; values near
        # the largest number overflow acc, found and redone (see _products).
        with np.errstate(over="ignore", invalid="ignore"):
            np.subtract(s, shift[:, None], out=s)
            self.exponential(s, piece)  # every exponent <= 0
            l_piece = s.sum(axis=1)
            acc_piece = _products(s, value)
            if self.m is None:
                self.l, self.acc = l_piece, acc_piece
            else:
                alpha = self.exp(self.m - shift)  # 0 where nothing was seen yet; <= 1
                self.l = self.l * alpha + l_piece
                self.acc = self.acc * alpha[:, None] + acc_piece
        self.m, self.shift = m, shift
        return True

    def start_at_zero(self, s: np.ndarray, value: np.ndarray, piece: _Piece) -> bool:
        """The first piece at the shift 0 for every row: ``exp(s)`` straight away, with no row
        maximum and no subtraction, two passes fewer over the tile (without a mask, the whole
        row is one piece: T = S = 4096, 8 heads of 64, float32, one thread, 0.85 of the time).
        Exact when every row sum lies between ``LAZY_FLOOR`` and ``LAZY_BOUND``: no term
        overflows, and none that matters underflows."""
        with np.errstate(over="ignore"):  # a score far above 0: inf, and the step fails
            self.exponential(s, piece)
        l_piece = s.sum(axis=1)
        if not (l_piece.max() <= LAZY_BOUND and l_piece.min() >= LAZY_FLOOR):
            return False
        self.m = self.shift = np.zeros(s.shape[0], dtype=s.dtype)
        self.l, self.acc = l_piece, _products(s, value)
        self.finite = True
        return True

    def lazy_add(self, s: np.ndarray, value: np.ndarray, piece: _Piece) -> bool:
        """The lazy step: add ``exp(s - shift)`` at each row's present shift, with no row
        maximum and no rescaling of ``l`` and ``acc``. It is exact while no score exceeds the
        shift by more than ``LAZY_MARGIN``, which the row sums prove (each term is at most its
        row's sum; NaN fails too). Under a causal mask this is the diagonal block after the
        full ones: at T = S = 4096, 8 heads of 64, float32, its step took 0.42 ms instead of
        0.76 (the row maxima of short rows cost the most).
        """
        with np.errstate(over="ignore"):  # a score far above the shift: inf, and the step fails
            np.subtract(s, self.shift[:, None], out=s)
            self.exponential(s, piece)
        l_piece = s.sum(axis=1)
        if not l_piece.max() <= LAZY_BOUND:
            return False
        self.l += l_piece
        with np.errstate(over="ignore", invalid="ignore"):  # as in _products
            self.acc += _products(s, value)
        return True

    def exponential(self, s: np.ndarray, piece: _Piece) -> None:
        """``exp`` of ``s`` in place; in base 2, ``exp(x ln 2)`` on a tile of partial blocks."""
        if self.exp is np.exp2 and piece.masked:
            np.multiply(s, s.dtype.type(LN2), out=s)
            np.exp(s, out=s)
        else:
            self.exp(s, out=s)

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """``(out, lse)``: ``acc / l`` and ``shift + log l`` in natural units; 0 and -inf where
        ``l = 0``."""
        shift = self.shift * self.shift.dtype.type(LN2) if self.exp is np.exp2 else self.shift
        if self.finite:  # l >= 1: the largest score adds exp(0)
            lse = np.log(self.l)
            lse += shift
            return self.acc / self.l[:, None], lse
        empty = self.l == 0  # NaN is not empty: it stays NaN
        l = np.where(empty, 1, self.l)
        out = self.acc / l[:, None]
        with np.errstate(invalid="ignore"):
            lse = shift + np.log(l)
        if empty.any():
            out[empty] = 0
            lse[empty] = -np.inf
        return out, lse


def _products(p: np.ndarray, value: np.ndarray) -> np.ndarray:
    """``p @ value`` per key head: ``(n, rows / n, keys) @ (n, keys, Dv)`` as ``(rows, Dv)``.

    Values near the dtype's largest number may overflow here (``inf``, or NaN from mixed
    signs), silently: the call finds it in the result and computes again on scaled values."""
    with np.errstate(over="ignore", invalid="ignore"):
        products = p.reshape(value.shape[0], -1, p.shape[1]) @ value  # (n, rows / n, Dv)
    return products.reshape(p.shape[0], value.shape[-1])  # (Dv = 0 is allowed)


@dataclass(frozen=True)
class _RowPlan:
    """What the units of one row of the block mask do (the row of a batch entry, a head and a
    query block): its pieces, each with its mask (None for a piece of full blocks)."""

    computed: int  # non-empty blocks
    partial: int  # partial ones
    pieces: tuple[tuple[_Piece, np.ndarray | None], ...]  # the masks read-only: plans are shared

    @property
    def nbytes(self) -> int:
        """The bytes of its masks."""
        return sum(mask.nbytes for _, mask in self.pieces if mask is not None)


class _Worker:
    """One thread: its counts, and the units it takes.

    Units whose rows of the block mask are equal (the heads and batch entries of a mask
    created with None, the same query block) share a plan, made once
    (:class:`sdpa.block_mask.PlanCache`).
    """

    def __init__(self, tiling: _Tiling):
        self.tiling = tiling
        self.stats = FlexStats()
        self.top = np.zeros(tiling.call.problem.Dv, tiling.call.dtype)  # largest |out| per column

    def drain(self, units: list, counter, failed: list) -> None:
        """Take units from the shared list until it is empty, or another worker failed."""
        try:
            while not failed:
                i = next(counter)
                if i >= len(units):
                    return
                self.run(*units[i])
        except BaseException:
            failed.append(True)
            raise

    def run(self, b: int, hk0: int, hk1: int, g0: int, g1: int, m: int) -> None:
        """Attention of the query block ``m`` of the query heads ``g0:g1`` of the key heads
        ``hk0:hk1`` (all of their query heads when there are several)."""
        tiling, stats = self.tiling, self.stats
        call = tiling.call
        G, heads = call.G, (hk1 - hk0) * (g1 - g0)
        t0, t1 = m * tiling.block_q, min(call.problem.T, (m + 1) * tiling.block_q)
        h = range(hk0 * G + g0, hk0 * G + g0 + heads)  # query heads, in order
        plan = self.plan(b, h, m, t0, t1)
        stats.units += 1
        stats.tiles += len(plan.pieces)
        if call.block_mask is not None:
            stats.computed += heads * plan.computed
            stats.skipped += heads * (tiling.kinds.shape[-1] - plan.computed)
            stats.masked += heads * plan.partial
        if not plan.pieces:  # every block empty: out 0, and lse -inf as set up
            tiling.out[b, hk0:hk1, g0:g1, t0:t1] = 0
            return
        with overflow_checked(call.problem):  # scaled here, in the worker threads
            q_tile = call.query[b, hk0:hk1, g0:g1, t0:t1] * tiling.factor  # (n, G', Bq, Dk)
        q_tile = q_tile.reshape(hk1 - hk0, (g1 - g0) * (t1 - t0), -1)  # (n, G' Bq, Dk)
        key, value = call.key[b, hk0:hk1, 0], tiling.value[b, hk0:hk1, 0]  # (n, S, Dk), (n, S, Dv)
        softmax = _Softmax(tiling.exp, modified=call.score_mod is not None)
        for piece, mask in plan.pieces:
            keys, values = piece.gather(key), piece.gather(value)
            scores = self.scores(q_tile, keys, piece, mask, (b, h, t0, t1))
            if not softmax.add(scores, values, piece):  # the lazy step failed: a new shift
                stats.redone += 1
                scores = self.scores(q_tile, keys, piece, mask, (b, h, t0, t1))
                softmax.add(scores, values, piece, lazy=False)
        out, lse = softmax.result()
        if tiling.v_exp is None:  # did the values come near the ends of the range?
            widen_column_top(self.top, out)
        else:
            np.ldexp(out, tiling.v_exp, out=out)  # undo the values' scaling (exact)
        shape = (hk1 - hk0, g1 - g0, t1 - t0)
        tiling.out[b, hk0:hk1, g0:g1, t0:t1] = out.reshape(*shape, call.problem.Dv)
        tiling.lse[b, hk0:hk1, g0:g1, t0:t1] = lse.reshape(shape)

    def plan(self, b: int, h: range, m: int, t0: int, t1: int) -> _RowPlan:
        """The plan of the query block ``m`` of batch entry ``b`` and heads ``h`` (kept)."""
        tiling = self.tiling
        row = _mask_row(tiling.kinds, b, h.start, m)
        return tiling.plans.get((tiling.settings, row), lambda: self.make_plan(row, t0, t1))

    def make_plan(self, key: tuple[int, int, int], t0: int, t1: int) -> _RowPlan:
        """The pieces of the row ``kinds[key]`` of queries ``t0:t1``, with their masks: the full
        blocks first (a row's first finite score spares the rest the empty-row handling)."""
        tiling = self.tiling
        row = tiling.kinds[key]  # (n_kv,): what each key block holds
        per_piece = max(1, tiling.block_k // tiling.block_kv)
        pieces = []
        for kind in (FULL, PARTIAL):
            blocks = np.flatnonzero(row == kind).tolist()
            for first in range(0, len(blocks), per_piece):
                chunk = blocks[first : first + per_piece]
                piece = _Piece.of(chunk, kind == PARTIAL, tiling.block_kv, tiling.call.problem.S)
                mask = self.disallowed(piece, key, t0, t1)
                if mask is not None:
                    mask.flags.writeable = False
                pieces.append((piece, mask))
        return _RowPlan(
            computed=int(np.count_nonzero(row)),
            partial=int(np.count_nonzero(row == PARTIAL)),
            pieces=tuple(pieces),
        )

    def disallowed(self, piece: _Piece, key: tuple, t0: int, t1: int) -> np.ndarray | None:
        """The mask of a piece of partial blocks, broadcastable to ``(1, heads, t1 - t0,
        keys)``: ``~mask_mod`` (True = disallowed), or in base 2 a bias of 0 and ``-inf``,
        which one addition applies (the scores are finite there); None for full blocks."""
        tiling = self.tiling
        if not piece.masked:
            return None
        allowed = evaluate_mask_mod(
            tiling.call.block_mask.mask_mod, [key[0]], [key[1]], range(t0, t1), piece.cols()
        )
        if tiling.exp is np.exp2:
            dtype = tiling.call.dtype
            return np.where(allowed, dtype.type(0), dtype.type(-np.inf))
        return ~allowed

    def scores(self, q_tile, keys, piece: _Piece, mask, where) -> np.ndarray:
        """A piece's masked, modified scores ``(1, heads, t1 - t0, keys)``: ``q_tile`` ``(n,
        G' Bq, Dk)`` holds the queries of ``n`` key heads, ``keys`` ``(n, keys, Dk)`` their
        gathered keys; ``mask`` (None for full blocks) is the piece's (:meth:`disallowed`)."""
        call = self.tiling.call
        problem = call.problem
        b, h, t0, t1 = where
        with overflow_checked(problem):
            # (n, G' Bq, Dk) @ (n, Dk, keys) -> (n, G' Bq, keys)
            scores = q_tile @ np.swapaxes(keys, -1, -2)
        scores = scores.reshape(1, len(h), t1 - t0, -1)
        if problem.may_overflow:  # then the scores are in base e: a mask is ~mask_mod
            check_overflow(problem, scores, None if mask is None else ~mask, None)
        if call.score_mod is not None:
            scores = _apply_score_mod(call, scores, [b], h, range(t0, t1), piece.cols())
        if mask is not None and mask.dtype == bool:  # replaced: a score_mod's NaN is hidden
            np.copyto(scores, call.dtype.type(-np.inf), where=mask)
        elif mask is not None:  # a bias of 0 and -inf
            np.add(scores, mask, out=scores)
        return scores


def _run(tiling: _Tiling, num_threads: int | None, stats: FlexStats | None) -> np.ndarray:
    """Share the units out among worker threads; add their counts to ``stats``. Returns the
    largest ``|out|`` of each column ``(Dv,)``, NaN where a result was NaN."""
    units = _units(tiling.call, tiling.kinds, tiling.block_q, tiling.block_kv)
    n_threads = max(1, min(num_threads or default_num_threads(), len(units)))
    counter = itertools.count()
    failed = []  # set by a worker whose unit raised: the others stop taking units
    workers = [_Worker(tiling) for _ in range(n_threads)]
    if n_threads == 1:
        with single_threaded_blas():  # BLAS's threads slow small products down
            workers[0].drain(units, counter, failed)
    else:
        run_in_threads([functools.partial(w.drain, units, counter, failed) for w in workers])
    if stats is not None:
        for w in workers:
            stats.add(w.stats)
    return functools.reduce(np.maximum, [w.top for w in workers])


def _flex_tiled(call: _FlexCall, block_k: int, num_threads, stats) -> tuple[np.ndarray, np.ndarray]:
    """``(out (B, Hq, T, Dv), lse (B, Hq, T))`` in the working dtype, a block of rows at a time.

    Values near the ends of the range, as :func:`sdpa.tiled.attention_tiled` finds them (the
    weights of the lazy steps reach ``LAZY_BOUND`` and drop to ``LAZY_FLOOR``): a result that
    overflowed or came out near the smallest normal numbers is computed again on values scaled
    by a power of two per column, read only then."""
    tiling = _tiling(call, block_k)
    top = _run(tiling, num_threads, stats)
    if values_may_be_out_of_range(top):
        v_exp = value_exponents(call.value, call.problem.S)
        if v_exp is not None:
            tiling = _tiling(call, block_k, v_exp)
            _run(tiling, num_threads, stats)
    T = call.problem.T
    out = tiling.out.reshape(call.B, call.Hq, T, call.problem.Dv)
    return out, tiling.lse.reshape(call.B, call.Hq, T)


# ----------------------------------------------------------------------------------------
# Both paths: empty calls, non-finite inputs, the result
# ----------------------------------------------------------------------------------------


def _flags(bad: np.ndarray | None, call: _FlexCall, length: int) -> np.ndarray | None:
    """``(B, Hq, length)`` bool from the problem's flags of non-finite rows, or None."""
    if bad is None:
        return None
    full = np.broadcast_to(bad, (*call.problem.batch_shape, length))
    return full.reshape(call.B, call.Hq, length)


def _rows_reaching(call: _FlexCall, flags: np.ndarray) -> np.ndarray:
    """``(B, Hq, T)`` bool: the query rows that may attend a key flagged in ``flags``
    ``(B, Hq, S)``. ``mask_mod`` is called on the flagged keys' entries in partial blocks only,
    so never on an empty block."""
    T = call.problem.T
    bm = call.block_mask
    if bm is None:
        return np.broadcast_to(flags.any(axis=-1)[..., None], (call.B, call.Hq, T))
    reach = np.zeros((call.B, call.Hq, T), dtype=bool)
    block_q, block_kv = bm.BLOCK_SIZE
    for j in np.flatnonzero(flags.any(axis=(0, 1))):
        for mb, mh in np.ndindex(*bm.shape[:2]):
            kinds = np.repeat(bm.kinds[mb, mh, :, j // block_kv], block_q)[:T]  # (T,)
            allowed = kinds == FULL
            rows = np.flatnonzero(kinds == PARTIAL)
            if rows.size:
                allowed[rows] = evaluate_mask_mod(bm.mask_mod, [mb], [mh], rows, [j])[0, 0, :, 0]
            b = slice(None) if bm.shape[0] == 1 else mb
            h = slice(None) if bm.shape[1] == 1 else mh
            reach[b, h] |= allowed & flags[b, h, j][..., None]
    return reach


def _mark_non_finite(call: _FlexCall, out: np.ndarray, lse: np.ndarray) -> None:
    """NaN in, NaN out: set to NaN the rows of ``out`` and ``lse`` (in place) whose query holds
    NaN or inf or that may attend such a key, and the rows of ``out`` that may attend such a
    value, as :func:`sdpa.scaled_dot_product_attention` does (the inputs were zeroed there)."""
    problem = call.problem
    T, S = problem.T, problem.S
    bad_query = _flags(problem.bad_query, call, T)
    if bad_query is not None:
        out[bad_query] = np.nan
        lse[bad_query] = np.nan
    for bad, with_lse in ((problem.bad_key, True), (problem.bad_value, False)):
        flags = _flags(bad, call, S)
        if flags is None:
            continue
        reach = _rows_reaching(call, flags)
        out[reach] = np.nan
        if with_lse:
            lse[reach] = np.nan


def _is_empty(call: _FlexCall) -> bool:
    return 0 in (call.B, call.Hq, call.problem.T, call.problem.S)


def _finish(call: _FlexCall, out: np.ndarray, lse: np.ndarray, return_lse: bool):
    """The caller's dtypes: ``out`` in the inputs' dtype, ``lse`` at least in float32."""
    _mark_non_finite(call, out, lse)
    out = out.astype(call.problem.out_dtype, copy=False)
    if not return_lse:
        return out
    return out, lse.astype(lse_dtype(call.problem.out_dtype), copy=False)


def _empty(call: _FlexCall) -> tuple[np.ndarray, np.ndarray]:
    shape = (call.B, call.Hq, call.problem.T)
    out = np.zeros((*shape, call.problem.Dv), dtype=call.dtype)
    return out, np.full(shape, -np.inf, dtype=call.dtype)


def _computed_scores(call: _FlexCall, kinds: np.ndarray, block_q: int, block_kv: int) -> int:
    """Scores the tiled path would compute: the entries of the non-empty blocks."""
    T, S = call.problem.T, call.problem.S
    rows = np.diff(np.minimum(np.arange(kinds.shape[2] + 1) * block_q, T))  # (n_q,)
    cols = np.diff(np.minimum(np.arange(kinds.shape[3] + 1) * block_kv, S))  # (n_kv,)
    per_mask = int(((kinds != 0) * rows[:, None] * cols[None, :]).sum())
    return per_mask * (call.B * call.Hq) // (kinds.shape[0] * kinds.shape[1])


# One query row per head (decoding): the reference path's products are matrix-vector products,
# which stream each key head once and re-read it from the cache for the other query heads of
# its group, while a tiled unit of G rows reads the same keys and adds its Python. Up to
# DECODING_GROUP query heads per key head the reference path was the faster: 32 and 64 query
# heads over 8 key heads, S = 2048 to 16384 (width 64, float32, 2-core Xeon), tiled 1.03 to
# 1.33 times as long; with 16 per key head it was 1.29 times as fast at S = 2048 but 8 times
# slower at S = 16384, with 32 the slower at S = 4096 already.
DECODING_GROUP = 8


def _worth_tiling(call: _FlexCall) -> bool:
    """The rule of ``implementation="auto"`` (see ``MIN_TILED_SCORES``): no timing."""
    T, S = call.problem.T, call.problem.S
    n_scores = call.B * call.Hq * T * S
    if n_scores < MIN_TILED_SCORES:
        return False
    blocks = _blocks(call, BLOCK_K)  # as the tiled path would cut the work
    enough = _computed_scores(call, *blocks) >= MIN_UNIT_SCORES * _unit_count(call, *blocks)
    if enough and not (T == 1 and call.G <= DECODING_GROUP):
        return True
    need = 3 * n_scores * call.dtype.itemsize
    available = available_memory() if need > (1 << 28) else None
    return available is not None and need > available / 4


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

    Returns
    -------
    out : (B, Hq, T, Dv) np.ndarray
        Alone, or first in ``(out, lse)``.
    lse : (B, Hq, T) np.ndarray
        With ``return_lse``: the natural log of ``sum(exp(scores))`` over the modified,
        allowed scores of each row; ``-inf`` for a row with no allowed key.

    Raises
    ------
    TypeError
        For complex, object or masked-array inputs, a ``score_mod`` that is not callable or
        returns no real array, a ``block_mask`` that is not a :class:`sdpa.BlockMask`, a
        ``mask_mod`` that returns no bool array, or a flag that is not a bool.
    ValueError
        For inputs that are not 4-D or do not share ``Dk`` and ``S``, head counts that do not
        fit, a ``block_mask`` of another shape (other lengths, or a batch or head count other
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
    scalar functions traced by ``torch.compile``; ``lse`` is returned with ``return_lse``
    (PyTorch 2.13 asks for ``return_aux``); a block mask's shorter last block may be full.

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
    """
    return_lse = check_bool(return_lse, "return_lse")
    if implementation not in ("auto", "reference", "tiled"):
        raise ValueError(
            f"implementation must be 'auto', 'reference' or 'tiled'; got {implementation!r}"
        )
    call = _check_call(query, key, value, score_mod, block_mask, scale, enable_gqa)
    if _is_empty(call):
        out, lse = _empty(call)
    elif implementation == "tiled" or (implementation == "auto" and _worth_tiling(call)):
        out, lse = _flex_tiled(call, BLOCK_K, None, None)
    else:
        out, lse = _flex_reference(call)
    return _finish(call, out, lse, return_lse)


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
    block_k: int | None = None,
    num_threads: int | None = None,
    stats: FlexStats | None = None,
):
    """The tiled path of :func:`sdpa.flex_attention`, with its tunables and its counts.

    Parameters
    ----------
    query, key, value, score_mod, block_mask, scale, enable_gqa, return_lse
        As in :func:`sdpa.flex_attention`.
    block_k : int, optional
        Keys per product: a block of query rows' non-empty key blocks are gathered and cut
        into pieces of at most this many keys (whole blocks, one at least), with an online
        softmax across the pieces. Default ``BLOCK_K`` (4096).
    num_threads : int, optional
        Worker threads; default :func:`sdpa.threads.default_num_threads`. The result is the
        same, bit for bit, for every thread count.
    stats : FlexStats, optional
        Receives the counts of units, products and computed, masked and skipped blocks.

    Returns
    -------
    out : (B, Hq, T, Dv) np.ndarray
        Alone, or first in ``(out, lse)``.
    lse : (B, Hq, T) np.ndarray
        With ``return_lse``.

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
    block_k = BLOCK_K if block_k is None else check_positive_int(block_k, "block_k")
    if num_threads is not None:
        num_threads = check_positive_int(num_threads, "num_threads")
    if stats is not None and not isinstance(stats, FlexStats):
        raise TypeError(f"stats must be a FlexStats or None; got {type(stats).__name__}")
    call = _check_call(query, key, value, score_mod, block_mask, scale, enable_gqa)
    if _is_empty(call):
        out, lse = _empty(call)
    else:
        out, lse = _flex_tiled(call, block_k, num_threads, stats)
    return _finish(call, out, lse, return_lse)
