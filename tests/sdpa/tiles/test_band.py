"""The dense face's band geometry (sdpa.tiles.band) against brute force on a small boolean band.

The band is written here from its definition, query ``i`` may attend key ``j`` when
``lo <= j - (i + offset) <= hi`` (either limit None: unbounded), as a ``(T, S)`` matrix; every
function is then checked on every tile it is asked about, over random ``T``, ``S``, offsets
and limits (Hypothesis).
"""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from sdpa.block_mask import EMPTY, FULL, PARTIAL
from sdpa.problem import prepare_attention
from sdpa.tiles.band import (
    BandTiles,
    allowed_in_run,
    band_keys,
    block_key_spans,
    fold_axis,
    key_block_range,
    partial_rows,
    rows_meeting,
    square_width,
    tile_kind,
    tile_plan_sizes,
    unit_pieces,
)
from sdpa.tuning import BLOCK_K, BLOCK_K_BAND, BLOCK_ROWS, BLOCK_ROWS_FULL


def band(T, S, offset, lo, hi):
    """``(T, S)`` bool, True = may attend, one entry at a time."""
    allowed = np.zeros((T, S), dtype=bool)
    for i in range(T):
        for j in range(S):
            d = j - (i + offset)
            allowed[i, j] = (lo is None or d >= lo) and (hi is None or d <= hi)
    return allowed


def run_of(flags):
    """``(first, stop)`` of the True entries of ``flags``, checked to be one run; None if none."""
    where = np.flatnonzero(flags)
    if where.size == 0:
        return None
    first, stop = int(where[0]), int(where[-1]) + 1
    assert where.size == stop - first, f"not one run: {where}"
    return first, stop


@st.composite
def geometry(draw):
    T, S = draw(st.integers(1, 11)), draw(st.integers(1, 13))
    offset = draw(st.integers(-6, 6))
    lo = draw(st.none() | st.integers(-7, 4))
    hi = draw(st.none() | st.integers(-4 if lo is None else lo, 7))  # lo <= hi
    t0 = draw(st.integers(0, T - 1))
    t1 = draw(st.integers(t0 + 1, T))
    s0 = draw(st.integers(0, S - 1))
    s1 = draw(st.integers(s0 + 1, S))
    return T, S, offset, lo, hi, (t0, t1, s0, s1)


SETTINGS = settings(max_examples=300, deadline=None)


@SETTINGS
@given(g=geometry())
def test_tile_kind(g):
    T, S, offset, lo, hi, (t0, t1, s0, s1) = g
    tile = band(T, S, offset, lo, hi)[t0:t1, s0:s1]
    want = FULL if tile.all() else EMPTY if not tile.any() else PARTIAL
    assert tile_kind(t0, t1, s0, s1, offset, lo, hi) == want


@SETTINGS
@given(g=geometry())
def test_band_keys_are_the_keys_some_query_may_attend(g):
    T, S, offset, lo, hi, (t0, t1, _, _) = g
    keys = run_of(band(T, S, offset, lo, hi)[t0:t1].any(axis=0))
    start, stop = band_keys(t0, t1, S, offset, lo, hi)
    if keys is None:
        assert start == stop
    else:
        assert (start, stop) == keys


@SETTINGS
@given(g=geometry(), block_k=st.integers(1, 6))
def test_key_block_range_is_the_blocks_holding_an_allowed_key(g, block_k):
    T, S, offset, lo, hi, (t0, t1, _, _) = g
    allowed = band(T, S, offset, lo, hi)[t0:t1].any(axis=0)
    n_blocks = -(-S // block_k)
    blocks = [allowed[b * block_k : (b + 1) * block_k].any() for b in range(n_blocks)]
    want = run_of(blocks)
    first, stop = key_block_range(t0, t1, S, block_k, offset, lo, hi)
    assert (first, stop) == (want if want is not None else (0, 0))


@SETTINGS
@given(g=geometry())
def test_rows_meeting_are_the_rows_with_an_allowed_key_of_the_tile(g):
    T, S, offset, lo, hi, (t0, t1, s0, s1) = g
    rows = band(T, S, offset, lo, hi)[t0:t1, s0:s1].any(axis=1)
    got = rows_meeting(t0, t1, s0, s1, offset, lo, hi)
    np.testing.assert_array_equal(np.arange(t1 - t0)[got], np.flatnonzero(rows))
    run_of(rows)  # one run, as the docstring says


@SETTINGS
@given(g=geometry())
def test_partial_rows_hold_every_row_the_band_s_edge_crosses(g):
    T, S, offset, lo, hi, (t0, t1, s0, s1) = g
    tile = band(T, S, offset, lo, hi)[t0:t1, s0:s1]
    run = rows_meeting(t0, t1, s0, s1, offset, lo, hi)
    if run.stop == run.start or tile[run].all():
        return  # the face asks only about the rows meeting a piece's keys, when some is crossed
    crossed = ~tile[run].all(axis=1)  # rows of the run with a disallowed key
    got = partial_rows(t0, s0, s1, run, offset, lo, hi)
    assert 0 <= got.start < got.stop <= run.stop - run.start
    inside = np.zeros_like(crossed)
    inside[got] = True
    assert not np.any(crossed & ~inside)  # every crossed row is masked
    # ... and the rows left out are full ones at an end of the run: the masked rows are the
    # crossed rows' span (which holds full rows too when a window's full rows lie between
    # crossed ones)
    where = np.flatnonzero(crossed)
    assert (got.start, got.stop) == (where[0], where[-1] + 1)


@SETTINGS
@given(g=geometry(), block_q=st.integers(1, 5))
def test_block_key_spans_are_every_block_s_band_keys(g, block_q):
    T, S, offset, lo, hi, _ = g
    t0, t1, start, stop = block_key_spans(T, S, block_q, offset, lo, hi)
    assert t0.tolist() == list(range(0, T, block_q))
    assert t1.tolist() == [min(T, a + block_q) for a in range(0, T, block_q)]
    for a, b, s0, s1 in zip(t0, t1, start, stop):
        keys = band_keys(int(a), int(b), S, offset, lo, hi)
        assert (s0, s1) == keys or (s0 == s1 and keys[0] == keys[1])  # empty: any place


def test_allowed_in_run_allows_the_rows_outside_the_masked_ones():
    disallowed = np.array([[True, False], [False, False]])  # rows 1 and 2 of a run of 4
    got = allowed_in_run((3, 4, 2), disallowed, slice(1, 3))
    want = np.ones((4, 2), bool)
    want[1:3] = ~disallowed
    np.testing.assert_array_equal(got, np.broadcast_to(want, (3, 4, 2)))


def test_partial_rows_of_a_causal_strip():
    # Causal, offset 0: keys 8:12 meet the rows 8:16 of queries 0:16 (run 8:16); rows 8, 9 and
    # 10 (0, 1 and 2 of the run) lack a key (row 11 sees keys up to 11): the masked rows.
    run = rows_meeting(0, 16, 8, 12, 0, None, 0)
    assert run == slice(8, 16)
    assert partial_rows(0, 8, 12, run, 0, None, 0) == slice(0, 3)
    # A window (lo = -2, hi = 0): rows 8:14 meet keys 8:12; rows 11 alone sees them all.
    run = rows_meeting(0, 16, 8, 12, 0, -2, 0)
    assert run == slice(8, 14)
    assert partial_rows(0, 8, 12, run, 0, -2, 0) == slice(0, 6)  # full row 11 inside: all


@SETTINGS
@given(g=geometry(), dtype=st.sampled_from([np.float32, np.float64]))
def test_band_tiles_give_the_band_s_mask(g, dtype):
    T, S, offset, lo, hi, (t0, t1, s0, s1) = g
    tiles = BandTiles(offset, lo, hi, np.dtype(dtype))
    got, weights = tiles.tiles(t0, t1, s0, s1)
    assert got.dtype == bool and weights.dtype == dtype
    want = ~band(T, S, offset, lo, hi)[t0:t1, s0:s1]
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(weights, np.where(want, 0, 1))
    assert tiles.disallowed(t0, t1, s0, s1) is got


def test_band_tiles_cache_returns_equal_tiles_for_one_geometry():
    # Causal with offset 1: tiles at the same distance from the diagonal are the same mask.
    T, S, offset, lo, hi = 12, 14, 1, None, 0
    allowed = band(T, S, offset, lo, hi)
    tiles = BandTiles(offset, lo, hi, np.dtype(np.float64))
    first = tiles.disallowed(2, 5, 3, 7)
    again = tiles.disallowed(6, 9, 7, 11)  # shifted by 4 along the diagonal: the cached tile
    assert again is first
    np.testing.assert_array_equal(again, ~allowed[6:9, 7:11])
    np.testing.assert_array_equal(first, ~allowed[2:5, 3:7])
    other = tiles.disallowed(2, 5, 4, 8)  # one key further: another tile
    np.testing.assert_array_equal(other, ~allowed[2:5, 4:8])
    assert not np.array_equal(other, first)


def test_band_tiles_stay_right_after_the_cache_starts_over():
    T, S, offset, lo, hi = 40, 40, 0, -3, 2
    allowed = band(T, S, offset, lo, hi)
    tiles = BandTiles(offset, lo, hi, np.dtype(np.float64))
    for t0 in range(0, 30, 3):
        for s0 in range(0, 30, 2):
            for size in (1, 4):  # well over 64 geometries
                got = tiles.disallowed(t0, t0 + size, s0, s0 + 5)
                np.testing.assert_array_equal(got, ~allowed[t0 : t0 + size, s0 : s0 + 5])


def problem(hq, hkv, T=5, S=7, *, batch=True, dtype=np.float64, **kw):
    """A validated call with query heads ``hq`` over ``hkv`` key heads (enable_gqa)."""
    lead = (2, hq) if batch else ()
    q = np.ones((*lead, T, 3), dtype)
    kv = np.ones(((2, hkv) if batch else ()) + (S, 3), dtype)
    return prepare_attention(q, kv, kv, enable_gqa=batch, **kw)


def test_fold_axis_folds_query_heads_that_share_their_keys():
    assert fold_axis(problem(8, 2))  # 4 query heads per key head share one key tile
    assert not fold_axis(problem(3, 3))  # each head its own keys
    assert not fold_axis(problem(1, 1))  # nothing to fold
    assert not fold_axis(problem(1, 1, batch=False))  # no batch axis


def test_tile_plan_sizes():
    G, block_q, block_k = tile_plan_sizes(problem(8, 2), block_q=100, block_k=100)
    assert (G, block_q, block_k) == (4, 5, 7)  # clipped to T = 5 and S = 7
    assert tile_plan_sizes(problem(3, 3), block_q=2, block_k=3) == (1, 2, 3)
    # Under a causal mask the rows grow towards BLOCK_ROWS_FULL too, while every thread gets
    # two units: 4 outer heads and one thread, one block of the 2000 rows per head (G 2000
    # rows, more than BLOCK_ROWS_FULL); BLOCK_K_BAND keys.
    big = problem(8, 2, T=2000, S=3000, is_causal=True)
    G, block_q, block_k = tile_plan_sizes(big, num_threads=1)
    rows = BLOCK_ROWS[big.work_dtype]
    assert G == 4 and G * block_q == BLOCK_ROWS_FULL[big.work_dtype]
    assert block_k == BLOCK_K_BAND[big.work_dtype]
    # 4 threads: 2 units each, 2 blocks per head, of G 1000 rows, within BLOCK_ROWS_FULL
    G, block_q, _ = tile_plan_sizes(big, num_threads=4)
    assert G * block_q == min(BLOCK_ROWS_FULL[big.work_dtype], G * 1000)
    # 16 threads: 8 blocks per head of 250 rows (G 250 = 1000 rows)
    G, block_q, _ = tile_plan_sizes(big, num_threads=16)
    assert G * block_q == max(rows, G * 250)
    assert (
        tile_plan_sizes(problem(8, 2, T=2000, S=3000), num_threads=1)[2] == BLOCK_K[big.work_dtype]
    )
    # Without a band the rows grow towards BLOCK_ROWS_FULL, while every thread gets a unit:
    # 4 outer heads (2 batch entries x 2 key heads) and 8 threads give 2 blocks per head.
    G, block_q, _ = tile_plan_sizes(problem(8, 2, T=2000, S=3000), num_threads=8)
    assert G * block_q == min(BLOCK_ROWS_FULL[big.work_dtype], G * 1000)
    G, block_q, _ = tile_plan_sizes(problem(8, 2, T=2000, S=3000), num_threads=64)
    assert G * block_q == max(rows, G * 2000 // 16)  # 16 blocks per head: at least BLOCK_ROWS


def covered(pieces, t0, t1, S):
    """``(t1 - t0, S)`` int: how many of the pieces compute each score of the unit's rows,
    each square of a piece in squares at its own keys, and the pieces' key widths."""
    count = np.zeros((t1 - t0, S), dtype=int)
    for p in pieces:
        w = (t1 - t0) // p.parts
        for b in range(p.parts):
            rows = slice(b * w + p.run.start, b * w + p.run.stop)
            count[rows, p.s0 + b * w : p.s1 + b * w] += 1
    return count


@st.composite
def causal_unit(draw):
    """A unit of a causal-like band (upper edge only), tile sizes that may put its diagonal in
    squares, and its band's mask."""
    diagonal = draw(st.integers(1, 4))
    block_k = diagonal * draw(st.integers(1, 4))
    t0 = draw(st.integers(0, 12))
    t1 = t0 + draw(st.sampled_from([block_k, 2 * block_k, 3 * block_k, draw(st.integers(1, 13))]))
    T, S = t1 + draw(st.integers(0, 3)), draw(st.integers(1, 40))
    offset, hi = draw(st.integers(-6, 6)), draw(st.integers(-3, 3))
    wide = draw(st.sampled_from([0, block_k, 2 * block_k, 3 * block_k, block_k + 1]))
    return T, S, offset, hi, t0, t1, block_k, diagonal, wide


@SETTINGS
@given(u=causal_unit())
def test_unit_pieces_compute_every_allowed_score_once(u):
    # In strips or in squares, the pieces cover each allowed score of the unit exactly once;
    # what they compute beyond the band lies, in squares, inside the diagonal's pieces of
    # `diagonal` keys (half a square of them per row at most), and no piece is empty. In
    # squares, the keys before the diagonal come in pieces of `wide` keys (when a multiple of
    # block_k), which every row meets; strips are never wider than block_k.
    T, S, offset, hi, t0, t1, block_k, diagonal, wide = u
    allowed = band(T, S, offset, None, hi)[t0:t1]
    for d in (0, diagonal):
        pieces = unit_pieces(t0, t1, S, block_k, d, offset, None, hi, wide)
        count = covered(pieces, t0, t1, S)
        assert (count[allowed] == 1).all() and count.max() <= 1
        assert all(p.s1 > p.s0 and p.run.stop > p.run.start for p in pieces)
        wasted = (count == 1) & ~allowed
        if square_width(t0, t1, S, block_k, d, offset, None, hi):
            k0 = t0 + offset + hi  # the diagonal's first key
            left = [p for p in pieces if p.s1 <= k0 and p.parts == 1 and p.run.start == 0]
            step = wide if wide > block_k and wide % block_k == 0 else block_k
            assert [(p.s0, p.s1) for p in left] == [
                (s0, min(s0 + step, k0)) for s0 in range(0, max(k0, 0), step)
            ]
            assert all(p.s1 - p.s0 == d for p in pieces if p.parts > 1)
            assert wasted.sum(axis=1).max() <= d - 1  # the row's own sub-square, above it
            assert len(pieces) == block_k // d + (t1 - t0) // block_k - 1 + -(-k0 // step)
        else:
            assert all(p.s1 - p.s0 <= block_k for p in pieces)


def test_unit_pieces_of_a_causal_unit_in_squares():
    # Rows 8:16 of a causal band (offset 0, hi 0) with 16 keys: squares of 4 rows, pieces of 2
    # keys inside them. Row 8 + y meets the keys up to 8 + y, so the diagonal starts at key 8.
    pieces = unit_pieces(8, 16, 16, 4, 2, 0, None, 0)
    assert [tuple(p) for p in pieces] == [
        (8, 10, slice(0, 4), 2),  # keys 8:10 of square 0, 12:14 of square 1: all their rows
        (10, 12, slice(2, 4), 2),  # keys 10:12 and 14:16: the rows from 2 on of each square
        (8, 12, slice(4, 8), 1),  # square 0's keys for the rows below it
        (0, 4, slice(0, 8), 1),  # the keys before the diagonal, every row: strips of 4
        (4, 8, slice(0, 8), 1),
    ]
    assert square_width(8, 16, 16, 4, 2, 0, None, 0) == 4
    # with pieces of 8 keys before the diagonal: one of them
    wide = unit_pieces(8, 16, 16, 4, 2, 0, None, 0, wide=8)
    assert wide[:3] == pieces[:3] and tuple(wide[3]) == (0, 8, slice(0, 8), 1) and len(wide) == 4
    # no squares: a window (a lower edge too), rows not a whole number of squares, the
    # diagonal past the last key, a diagonal width that does not divide the squares'
    assert square_width(8, 16, 16, 4, 2, 0, -5, 0) == 0
    assert square_width(8, 14, 16, 4, 2, 0, None, 0) == 0
    assert square_width(8, 16, 15, 4, 2, 0, None, 0) == 0
    assert square_width(8, 16, 16, 4, 3, 0, None, 0) == 0
    assert square_width(8, 16, 16, 4, 0, 0, None, 0) == 0
    assert square_width(8, 12, 16, 4, 2, 0, None, 0) == 0  # one square: strips
    # every unit at once, as the cost model asks: the same answers
    t0, t1 = np.array([8, 8, 8, 0]), np.array([16, 14, 12, 8])
    np.testing.assert_array_equal(square_width(t0, t1, 16, 4, 2, 0, None, 0), [4, 0, 0, 4])
    np.testing.assert_array_equal(square_width(t0, t1, 16, 4, 2, 0, -5, 0), 0)
