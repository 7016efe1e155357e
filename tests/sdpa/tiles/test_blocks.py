"""The flex face's plan (sdpa.tiles.blocks): pieces, the plan of a row of a block mask, the
units and their count, the plan cache and the plans kept beside a block mask.

Pieces are checked against the key positions written out by hand and against NumPy's fancy
indexing; a row's plan against a made-up row of block kinds and a mask evaluated in the test
entry by entry; the units against a count of every (batch entry, query head, query block)
(Hypothesis over the sizes and the masks, per head or shared).
"""

from __future__ import annotations

import copy
import gc
import itertools
import weakref

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sdpa import create_block_mask
from sdpa.block_mask import EMPTY, FULL, PARTIAL
from sdpa.tiles.blocks import (
    Piece,
    PlanCache,
    SquarePiece,
    UnitPlan,
    diagonal_squares,
    plans_beside,
    query_blocks_per_unit,
    unit_count,
    unit_list,
    unit_plan,
)


def test_piece_of_merges_runs_of_blocks():
    # Blocks of 4 keys, S = 26: blocks 0-1 and 3-4 are runs; block 6 is cut at S.
    piece = Piece.of([0, 1, 3, 4, 6], masked=True, block_kv=4, S=26)
    assert piece.spans == ((0, 8), (12, 20), (24, 26))
    assert piece.masked and piece.size == 18
    want = [*range(0, 8), *range(12, 20), 24, 25]
    np.testing.assert_array_equal(piece.cols(), want)
    assert Piece.of([2], masked=False, block_kv=4, S=26).spans == ((8, 12),)


def test_piece_gather_is_fancy_indexing(rng):
    x = rng.standard_normal((2, 3, 26, 5))  # (B, H, S, D)
    for blocks in ([0, 1, 3, 4, 6], [2, 3], [6], [5, 1]):
        piece = Piece.of(blocks, masked=False, block_kv=4, S=26)
        got = piece.gather(x)
        np.testing.assert_array_equal(got, x[..., piece.cols(), :])
        if len(piece.spans) == 1:
            assert np.shares_memory(got, x)  # one run: a view, no copy


def mod(b, h, q_idx, kv_idx):
    """A made-up mask: neither causal nor a band, depending on every index."""
    return (q_idx * 3 + kv_idx + h + 2 * b) % 4 != 0


def test_unit_plan_on_a_made_up_row():
    # One query block (rows 4:7); 7 key blocks of 2 keys (S = 13, the last block is key 12
    # alone); pieces of 2 blocks.
    kinds = np.array([[PARTIAL, FULL, EMPTY, FULL, PARTIAL, FULL, PARTIAL]])
    rows = range(4, 7)
    plan = unit_plan(kinds, mod, (1, 2), rows, block_q=3, block_kv=2, S=13, block_k=4)
    assert isinstance(plan, UnitPlan) and plan.computed == 6 and plan.partial == 3
    pieces = [piece for piece, *_ in plan.pieces]
    assert pieces == [
        Piece(((2, 4), (6, 8)), False),  # full blocks 1 and 3
        Piece(((10, 12),), False),  # full block 5
        Piece(((0, 2), (8, 10)), True),  # partial blocks 0 and 4
        Piece(((12, 13),), True),  # partial block 6
    ]
    assert all(run == slice(0, 3) for _, run, _, _ in plan.pieces)  # every row meets each
    assert [mask is None for *_, mask in plan.pieces] == [True, True, False, False]
    for piece, _, masked, mask in plan.pieces[2:]:
        assert masked == slice(0, 3)
        cols = piece.cols()
        want = np.array([[not mod(1, 2, i, j) for j in cols] for i in rows])  # True: disallowed
        np.testing.assert_array_equal(mask, want)
        assert not mask.flags.writeable  # plans are shared between threads and calls
    assert plan.nbytes == sum(mask.nbytes for *_, mask in plan.pieces[2:])


def test_unit_plan_walks_a_causal_diagonal_as_a_staircase():
    # Three query blocks of 2 rows (queries 6:12, the fourth to sixth blocks of a causal
    # mask), key blocks of 2 keys: key blocks 0-2 are full for every row; key block 3 meets
    # all three query blocks, partial in the first; block 4 the last two, partial in the
    # second; block 5 the last, partial there.
    kinds = np.array(
        [
            [FULL, FULL, FULL, PARTIAL, EMPTY, EMPTY],
            [FULL, FULL, FULL, FULL, PARTIAL, EMPTY],
            [FULL, FULL, FULL, FULL, FULL, PARTIAL],
        ]
    )
    causal = lambda b, h, q, k: q >= k  # noqa: E731
    plan = unit_plan(kinds, causal, (0, 0), range(6, 12), block_q=2, block_kv=2, S=12, block_k=8)
    assert plan.computed == 15 and plan.partial == 3
    got = [(piece.spans, run, masked) for piece, run, masked, _ in plan.pieces]
    assert got == [
        (((0, 6),), slice(0, 6), slice(None)),  # full, every row
        (((6, 8),), slice(0, 6), slice(0, 2)),  # the strip of key block 3: every row
        (((8, 10),), slice(2, 6), slice(0, 2)),  # block 4: from the second query block on
        (((10, 12),), slice(4, 6), slice(0, 2)),  # block 5: the last query block
    ]
    for piece, run, masked, mask in plan.pieces[1:]:
        q = np.arange(6, 12)[run][masked]
        want = ~(q[:, None] >= piece.cols()[None, :])
        np.testing.assert_array_equal(mask, want)
    # scores computed: 6 x 6 full, then strips of 6, 4 and 2 rows by 2 keys: 60 of 72
    assert sum((run.stop - run.start) * piece.size for piece, run, *_ in plan.pieces) == 60


def test_unit_plan_splits_a_key_block_meeting_query_blocks_apart():
    # Key block 1 meets query blocks 0 and 2, not 1: two pieces, one per run. A full block
    # inside a partial piece's masked rows stays allowed whatever mask_mod says.
    kinds = np.array(
        [
            [FULL, PARTIAL],
            [FULL, EMPTY],
            [PARTIAL, FULL],
        ]
    )
    never = lambda b, h, q, k: np.zeros(np.broadcast_shapes(q.shape, k.shape), bool)  # noqa: E731
    plan = unit_plan(kinds, never, (0, 0), range(0, 6), block_q=2, block_kv=3, S=6, block_k=6)
    got = [(piece.spans, piece.masked, run, masked) for piece, run, masked, _ in plan.pieces]
    assert got == [
        (((3, 6),), False, slice(4, 6), slice(None)),  # block 1 in query block 2: full
        (((0, 3),), True, slice(0, 6), slice(4, 6)),  # block 0: partial in query block 2
        (((3, 6),), True, slice(0, 2), slice(0, 2)),  # block 1 in query block 0: partial
    ]
    assert plan.pieces[1][3].all() and plan.pieces[2][3].all()  # mask_mod allows nothing


def test_strips_gather_key_blocks_whose_runs_overlap():
    # The causal staircase of the test above, in strips of up to 2 key blocks (4 keys): key
    # blocks 3 and 4 (runs of query blocks 0:3 and 1:3) make one strip over query blocks 0:3,
    # whose block (0, 4) is empty: computed, but disallowed, and never given to mask_mod;
    # key block 5 a strip of its own. mask_mod sees the partial blocks only.
    kinds = np.array(
        [
            [FULL, FULL, FULL, PARTIAL, EMPTY, EMPTY],
            [FULL, FULL, FULL, FULL, PARTIAL, EMPTY],
            [FULL, FULL, FULL, FULL, FULL, PARTIAL],
        ]
    )
    seen = []

    def causal(b, h, q, k):
        seen.append((np.asarray(q).ravel().copy(), np.asarray(k).ravel().copy()))
        return q >= k

    plan = unit_plan(
        kinds, causal, (0, 0), range(6, 12), block_q=2, block_kv=2, S=12, block_k=8, strip_keys=4
    )
    got = [(piece.spans, run, masked) for piece, run, masked, _ in plan.pieces]
    assert got == [
        (((0, 6),), slice(0, 6), slice(None)),  # full, every row
        (((6, 10),), slice(0, 6), slice(0, 4)),  # blocks 3-4: query blocks 0:2 masked
        (((10, 12),), slice(4, 6), slice(0, 2)),  # block 5: the last query block
    ]
    q = np.arange(6, 12)
    np.testing.assert_array_equal(plan.pieces[1][3], ~(q[:4, None] >= np.arange(6, 10)[None]))
    # mask_mod was called on rows 6:8 x keys 6:8, 8:10 x 8:10 and 10:12 x 10:12: the partial
    # blocks, never the empty block (rows 6:8, keys 8:10) nor a full one
    called = sorted((int(r[0]), int(r[-1]), int(c[0]), int(c[-1])) for r, c in seen)
    assert called == [(6, 7, 6, 7), (8, 9, 8, 9), (10, 11, 10, 11)]
    assert plan.met is None  # every row meets an allowed key
    # 6 x 6 full, then 6 x 4 and 2 x 2: 64 scores of 72 (the staircase of one-block strips
    # took 60, with one more product)
    assert sum((run.stop - run.start) * piece.size for piece, run, *_ in plan.pieces) == 64


def test_strips_never_join_runs_that_do_not_touch():
    # Key block 0 meets query blocks 0:1, key block 1 query blocks 2:3: a strip of both would
    # hold a query block that neither meets; two strips.
    kinds = np.array([[PARTIAL, EMPTY], [EMPTY, EMPTY], [EMPTY, PARTIAL]])
    plan = unit_plan(
        kinds, mod, (0, 0), range(6), block_q=2, block_kv=2, S=4, block_k=4, strip_keys=4
    )
    assert [(p.spans, run) for p, run, *_ in plan.pieces] == [
        (((0, 2),), slice(0, 2)),
        (((2, 4),), slice(4, 6)),
    ]
    # the rows of query block 1 meet no key block: they meet no allowed key
    np.testing.assert_array_equal(plan.met[2:4], [False, False])


def test_strips_never_join_runs_that_only_overlap():
    # A sliding window: key block 0 meets query blocks 0:2, key block 1 query blocks 1:3. The
    # runs overlap but neither holds the other: a strip of both would compute 3 query blocks
    # for each. Key block 2 meets query block 2 alone, inside key block 1's run: one strip.
    kinds = np.array(
        [
            [PARTIAL, EMPTY, EMPTY],
            [PARTIAL, PARTIAL, EMPTY],
            [EMPTY, PARTIAL, PARTIAL],
        ]
    )
    plan = unit_plan(
        kinds, mod, (0, 0), range(6), block_q=2, block_kv=2, S=6, block_k=6, strip_keys=4
    )
    assert [(p.spans, run) for p, run, *_ in plan.pieces] == [
        (((0, 2),), slice(0, 4)),
        (((2, 6),), slice(2, 6)),
    ]


def test_rows_a_mask_mod_disallows_entirely_meet_no_key():
    # One query block of 4 rows, two partial key blocks: rows 1 and 3 allowed nothing.
    kinds = np.array([[PARTIAL, PARTIAL]])
    odd_rows_out = lambda b, h, q, k: (q % 2 == 0) & (k >= 0)  # noqa: E731
    plan = unit_plan(kinds, odd_rows_out, (0, 0), range(4), block_q=4, block_kv=3, S=6, block_k=6)
    np.testing.assert_array_equal(plan.met, [True, False, True, False])
    full = unit_plan(np.array([[FULL, PARTIAL]]), odd_rows_out, (0, 0), range(4), 4, 3, 6, 6)
    assert full.met is None  # a full block: every row meets its keys


def test_unit_plan_takes_one_block_at_least_per_piece():
    kinds = np.array([[FULL, FULL, EMPTY, PARTIAL]])
    plan = unit_plan(kinds, mod, (0, 0), range(0, 2), block_q=2, block_kv=8, S=30, block_k=3)
    spans = [piece.spans for piece, *_ in plan.pieces]
    assert spans == [((0, 8),), ((8, 16),), ((24, 30),)]
    assert plan.nbytes == plan.pieces[2][3].nbytes


def test_an_empty_row_has_no_piece():
    plan = unit_plan(np.array([[EMPTY, EMPTY]]), mod, (0, 0), range(3), 3, 4, 8, 8)
    assert plan.pieces == () and plan.computed == 0 and plan.nbytes == 0


@st.composite
def unit_cases(draw):
    B, Hkv, G, n_q = (draw(st.integers(1, 3)) for _ in range(4))
    n_kv = draw(st.integers(1, 4))
    per_batch, per_head = draw(st.booleans()), draw(st.booleans())
    shape = (B if per_batch else 1, Hkv * G if per_head else 1, n_q, n_kv)
    seed = draw(st.integers(0, 2**32 - 1))
    kinds = np.random.default_rng(seed).integers(0, 3, size=shape)
    block = draw(st.sampled_from([1, 16, 2048]))  # 2048 x 2048 blocks: too large to fold
    return B, Hkv, G, kinds, block


@settings(max_examples=200, deadline=None)
@given(case=unit_cases())
def test_units_cover_every_query_block_of_every_head_once(case):
    B, Hkv, G, kinds, block = case
    n_q = kinds.shape[2]
    units = unit_list(B, Hkv, G, kinds, block, block)
    per_unit = query_blocks_per_unit(B, Hkv, G, kinds, block)
    seen = []
    for b, hk0, hk1, g0, g1, m0, m1 in units:
        assert 0 <= b < B and 0 <= hk0 < hk1 <= Hkv and 0 <= g0 < g1 <= G
        assert 0 <= m0 < m1 <= n_q and m0 % per_unit == 0 and m1 == min(n_q, m0 + per_unit)
        if kinds.shape[1] > 1:  # a mask per head: one query head per unit
            assert hk1 - hk0 == 1 and g1 - g0 == 1
        else:  # a shared mask: all the query heads of its key heads
            assert (g0, g1) == (0, G)
        seen += [
            (b, hk * G + g, m)
            for hk in range(hk0, hk1)
            for g in range(g0, g1)
            for m in range(m0, m1)
        ]
    everything = list(itertools.product(range(B), range(Hkv * G), range(n_q)))
    assert sorted(seen) == everything  # each once
    assert unit_count(B, Hkv, G, kinds, block, block) == len(units)
    # Head after head, the costliest units of a head first.
    order = [(b, hk0, g0) for b, hk0, _, g0, *_ in units]
    assert order == sorted(order)
    nonempty = np.count_nonzero(kinds, axis=-1)
    for _, group in itertools.groupby(units, key=lambda u: (u[0], u[1], u[3])):
        costs = [
            nonempty[b % kinds.shape[0], (hk * G + g) % kinds.shape[1], m0:m1].sum()
            for b, hk, _, g, _, m0, m1 in group
        ]
        assert costs == sorted(costs, reverse=True)


def test_query_blocks_per_unit():
    kinds = np.zeros((1, 1, 8, 8))  # 8 query blocks, a mask shared by the heads
    # 4 x 8 heads of 8 blocks of 128 rows: 1024 rows, 32 units (at least MIN_UNITS = 16)
    assert query_blocks_per_unit(4, 8, 1, kinds, 128) == 8
    assert query_blocks_per_unit(4, 2, 4, kinds, 128) == 2  # 4 query heads folded: 4 x 128 x 2
    assert query_blocks_per_unit(1, 1, 1, kinds, 128) == 1  # one head: 8 units of one block
    assert query_blocks_per_unit(1, 4, 1, kinds, 128) == 2  # 4 heads: 16 units of 2 blocks
    per_head = np.zeros((1, 8, 8, 8))  # a mask per head: one query head per unit
    assert query_blocks_per_unit(1, 2, 4, per_head, 128) == 4  # 8 heads: 16 units of 4 blocks
    assert query_blocks_per_unit(1, 8, 4, per_head, 128) == 8  # 32 heads: 32 units of 8


def test_a_shared_mask_folds_key_heads_and_large_blocks_do_not():
    kinds = np.full((1, 1, 4, 2), FULL)  # B = 4, Hkv = 8, G = 2: 128 units of one key head
    small = unit_list(4, 8, 2, kinds, 16, 16)
    assert len(small) < 4 * 8 * 4 and max(u[2] - u[1] for u in small) > 1
    large = unit_list(4, 8, 2, kinds, 4096, 4096)
    assert len(large) == 4 * 8 * 4 and all(u[2] - u[1] == 1 for u in large)


class Plan:
    def __init__(self, nbytes):
        self.nbytes = nbytes


def test_plan_cache_keeps_plans_within_its_budget():
    cache, made = PlanCache(budget=100), []

    def maker(key, nbytes):
        def make():
            made.append(key)
            return Plan(nbytes)

        return make

    a = cache.get("a", maker("a", 60))
    assert cache.get("a", maker("a", 60)) is a and made == ["a"]  # kept: made once
    assert cache.nbytes == 60
    b = cache.get("b", maker("b", 50))  # 110 > 100: the cache starts over with b alone
    assert set(cache.plans) == {"b"} and cache.nbytes == 50
    assert cache.get("b", maker("b", 50)) is b
    assert cache.get("a", maker("a", 60)) is not a  # made again
    assert made == ["a", "b", "a"] and set(cache.plans) == {"a"}
    big = cache.get("big", maker("big", 150))  # larger than the budget: used, never kept
    assert big.nbytes == 150 and "big" not in cache.plans and cache.nbytes == 0
    cache.get("big", maker("big", 150))
    assert made == ["a", "b", "a", "big", "big"]
    c = cache.get("c", maker("c", 0))  # a plan without masks costs nothing
    assert cache.get("c", maker("c", 0)) is c and cache.nbytes == 0


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def test_plans_beside_one_mask_and_not_its_copy():
    mask = create_block_mask(causal, None, None, 8, 8, BLOCK_SIZE=4)
    plans = plans_beside(mask, 1000)
    assert isinstance(plans, PlanCache) and plans.budget == 1000
    assert plans_beside(mask, 1000) is plans
    assert plans_beside(mask, 5) is plans  # the budget of its first use
    twin = copy.deepcopy(mask)
    assert plans_beside(twin, 1000) is not plans


def test_plans_beside_let_the_mask_go():
    mask = create_block_mask(causal, None, None, 8, 8, BLOCK_SIZE=4)
    plans = plans_beside(mask, 1000)
    plans.get("row", lambda: Plan(10))
    gone = weakref.ref(mask)
    del mask
    gc.collect()
    assert gone() is None


def test_unit_plan_walks_a_causal_diagonal_in_squares():
    # Four query blocks of 2 rows (queries 4:12 of a causal mask, so the diagonal starts at
    # key 4), key blocks of 2 keys, S = 12: squares of 4 rows (two blocks), pieces of 2 keys
    # inside them. Key blocks 0-1 are full for every row; each square's four blocks are
    # computed by the square pieces; block 2-3's lower neighbours (query blocks 2-3) by a
    # strip of full blocks.
    causal = lambda b, h, q, k: q >= k  # noqa: E731
    q_blocks = np.arange(2, 6)[:, None]  # query blocks 2:6 of a 6 x 6 causal block mask
    k_blocks = np.arange(6)[None, :]
    kinds = np.where(k_blocks < q_blocks, FULL, np.where(k_blocks == q_blocks, PARTIAL, EMPTY))
    assert diagonal_squares(kinds, 8, 2, 2, 4, 12) == 2
    plan = unit_plan(
        kinds, causal, (0, 0), range(4, 12), block_q=2, block_kv=2, S=12, block_k=8,
        strip_keys=4, diagonal=2,
    )  # fmt: skip
    assert plan.computed == 18 and plan.partial == 4
    got = [(piece, run, masked) for piece, run, masked, _ in plan.pieces]
    assert got == [
        (Piece(((0, 4),), False), slice(0, 8), slice(None)),  # before the diagonal
        (Piece(((4, 8),), False), slice(4, 8), slice(None)),  # square 0's keys, rows below it
        (SquarePiece(4, 4, 2, 0, 2), slice(0, 4), slice(0, 1)),  # keys 4:6 and 8:10
        (SquarePiece(4, 4, 2, 2, 2), slice(2, 4), slice(0, 1)),  # keys 6:8 and 10:12
    ]
    for piece, run, masked, mask in plan.pieces[2:]:
        for p in range(2):  # each square's rows of the run, and its keys
            q = np.arange(4, 12)[p * 4 : (p + 1) * 4][run][masked]
            cols = 4 + 4 * p + piece.offset + np.arange(piece.size)
            np.testing.assert_array_equal(mask[p], ~(q[:, None] >= cols[None, :]))
        assert not mask.flags.writeable
    # computed: 8 x 4, 4 x 4, then 2 squares of 4 x 2 and 2 x 2 = 72 of the 8 x 12
    scores = [(r.stop - r.start) * p.size * p.parts for p, r, *_ in plan.pieces]
    assert sum(scores) == 32 + 16 + 16 + 8


def test_gather_of_a_square_piece_is_each_square_s_keys(rng):
    x = rng.standard_normal((3, 20, 5))  # (n, S, D)
    piece = SquarePiece(start=4, width=6, parts=2, offset=2, size=3)
    got = piece.gather(x)
    np.testing.assert_array_equal(got, np.stack([x[:, 6:9], x[:, 12:15]], axis=1))
    assert np.shares_memory(got, x) and piece.masked and Piece(((0, 1),), False).parts == 1


@st.composite
def square_rows(draw):
    """A causal-like block mask's row of query blocks, possibly in squares, and a mask_mod
    that may disallow more inside the band (so that not every square is triangular)."""
    block = draw(st.sampled_from([2, 3, 4]))
    width = block * draw(st.integers(1, 3))
    R = (width // block) * draw(st.integers(1, 3))
    # queries t attend keys up to t + offset: whole blocks keep the diagonal in squares
    offset = draw(st.sampled_from([0, block, 2 * block, draw(st.integers(0, 2 * block))]))
    m0 = draw(st.integers(0, 2))
    S = (m0 + R) * block + offset + draw(st.integers(-block, block))
    holes = draw(st.integers(0, 3))  # every `holes`-th key disallowed too (0: none)

    def mask_mod(b, h, q, k):
        allowed = q + offset >= k
        return allowed & ((k % holes != 1) if holes else True)

    return block, width, R, m0, S, mask_mod


@settings(max_examples=150, deadline=None)
@given(case=square_rows())
def test_square_plans_compute_each_allowed_score_once(case):
    block, width, R, m0, S, mask_mod = case
    T = (m0 + R) * block
    if S <= 0:
        return
    bm = create_block_mask(mask_mod, None, None, T, S, BLOCK_SIZE=block)
    kinds = bm.kinds[0, 0, m0 : m0 + R]
    rows = range(m0 * block, T)
    q, k = np.arange(T)[rows][:, None], np.arange(S)[None, :]
    allowed = mask_mod(0, 0, q, k) & np.ones((len(rows), S), bool)
    for diagonal in (0, 1, 2):
        plan = unit_plan(kinds, mask_mod, (0, 0), rows, block, block, S, 4 * block, width, diagonal)
        count = np.zeros((len(rows), S), int)
        for piece, run, masked, mask in plan.pieces:
            if piece.parts == 1:
                cols = piece.cols()
                tile = np.ones((run.stop - run.start, cols.size), bool)
                if mask is not None:
                    tile[masked] = ~mask
                count[np.arange(run.start, run.stop)[:, None], cols] += tile
                continue
            for p in range(piece.parts):
                cols = piece.start + p * piece.width + piece.offset + np.arange(piece.size)
                tile = np.ones((run.stop - run.start, piece.size), bool)
                if mask is not None:
                    tile[masked] = ~mask[p]
                r0 = p * piece.width
                count[np.arange(r0 + run.start, r0 + run.stop)[:, None], cols] += tile
        np.testing.assert_array_equal(count, allowed)  # each allowed score once, nothing else
        met = allowed.any(axis=1)
        assert (plan.met is None and met.all()) or (plan.met == met).all()
        start = diagonal_squares(kinds, len(rows), block, block, width, S)
        assert any(piece.parts > 1 for piece, *_ in plan.pieces) == bool(
            diagonal and start is not None
        )
