"""The two-level memory simulator and the attention algorithms that run on it.

The counts are checked against closed forms derived by hand (the derivations are in the
docstrings' Notes of sdpa.iomodel, restated in the comments here), first on small cases whose
numbers are worked out in the comments, then on a grid of shapes through the general formulas
written out below (with ceilings for blocks that do not divide). Every algorithm must also
compute attention: its output is compared with the package's reference path.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from sdpa import scaled_dot_product_attention
from sdpa.iomodel import (
    FastMemoryOverflow,
    TwoLevelMemory,
    flash_attention2_io,
    flash_attention_io,
    flash_block_sizes,
    textbook_attention_io,
    textbook_block_size,
)

ALGORITHMS = [textbook_attention_io, flash_attention_io, flash_attention2_io]


def qkv(rng, t, s, dk, dv):
    return rng.standard_normal((t, dk)), rng.standard_normal((s, dk)), rng.standard_normal((s, dv))


# ---------------------------------------------------------------------------------------------
# The memory itself
# ---------------------------------------------------------------------------------------------


def test_counts_words_in_and_out():
    slow = np.arange(20.0).reshape(4, 5)
    mem = TwoLevelMemory(12)
    a = mem.load("a", slow[:2])  # 10 words
    assert (mem.loads, mem.stores, mem.used, mem.peak) == (10, 0, 10, 10)
    a *= 2  # arithmetic in fast memory: free, and slow memory is untouched
    assert slow[0, 1] == 1.0
    mem.store("a", slow[2:])
    np.testing.assert_array_equal(slow[2:], 2 * np.arange(10.0).reshape(2, 5))
    assert (mem.loads, mem.stores, mem.words_moved) == (10, 10, 20)
    mem.free("a")
    assert mem.used == 0 and mem.peak == 10 and "a" not in mem


def test_hold_moves_nothing_but_takes_space():
    mem = TwoLevelMemory(5)
    mem.hold("x", np.zeros(3))
    assert (mem.loads, mem.stores, mem.used) == (0, 0, 3)
    with pytest.raises(FastMemoryOverflow):
        mem.hold("y", np.zeros(3))


def test_a_load_beyond_capacity_raises_and_changes_nothing():
    mem = TwoLevelMemory(8)
    mem.load("a", np.ones(5))
    with pytest.raises(
        FastMemoryOverflow,
        match=(
            r"fast memory of 8 words cannot hold 'b' \(4 words\) beside the 5 words it holds "
            r"already \(a: 5\)"
        ),
    ):
        mem.load("b", np.ones(4))
    assert (mem.loads, mem.used, "b" in mem) == (5, 5, False)


def test_exactly_full_is_allowed():
    mem = TwoLevelMemory(8)
    mem.load("a", np.ones(5))
    mem.load("b", np.ones(3))
    assert mem.used == mem.peak == 8


def test_replacing_a_name_reuses_its_space():
    mem = TwoLevelMemory(6)
    mem.load("a", np.ones(5))
    mem.load("a", np.ones(6))  # replaces the 5 words: 6 <= 6
    assert (mem.used, mem.loads) == (6, 11)


def test_overflow_is_a_memory_error():
    assert issubclass(FastMemoryOverflow, MemoryError)


def test_getitem_returns_the_fast_array():
    mem = TwoLevelMemory(4)
    x = mem.hold("x", [1.0, 2.0])
    assert mem["x"] is x


@pytest.mark.parametrize("bad", [0, -3])
def test_capacity_must_be_positive(bad):
    with pytest.raises(
        ValueError, match=rf"capacity must be a positive integer \(words\); got {bad}"
    ):
        TwoLevelMemory(bad)


@pytest.mark.parametrize("bad", [4.0, True, "8"])
def test_capacity_must_be_an_integer(bad):
    with pytest.raises(TypeError, match=r"capacity must be a positive integer \(words\)"):
        TwoLevelMemory(bad)


def test_names_must_be_strings():
    mem = TwoLevelMemory(4)
    with pytest.raises(TypeError, match="name must be a string; got 3"):
        mem.hold(3, [1.0])
    with pytest.raises(TypeError, match="name must be a string; got 3"):
        mem.free(3)


def test_storing_or_freeing_what_is_not_held():
    mem = TwoLevelMemory(4)
    mem.hold("x", [1.0])
    with pytest.raises(ValueError, match="'y' is not in fast memory, which holds: x"):
        mem.store("y", np.zeros(1))
    mem.free("x")
    with pytest.raises(ValueError, match="'x' is not in fast memory, which holds: nothing"):
        mem.free("x")


def test_store_target_must_match():
    mem = TwoLevelMemory(4)
    mem.hold("x", [1.0, 2.0])
    with pytest.raises(
        ValueError,
        match=r"target must be a NumPy array .* of the shape of 'x', "
        r"\(2,\); got \(3,\)",
    ):
        mem.store("x", np.zeros(3))
    with pytest.raises(ValueError, match="got list"):
        mem.store("x", [0.0, 0.0])


# ---------------------------------------------------------------------------------------------
# Small cases worked out by hand (N = T = S, d = Dk = Dv)
# ---------------------------------------------------------------------------------------------


def test_textbook_by_hand(rng):
    # N = 8, d = 2, M = 32: b**2 + 2*2*b <= 32 gives b = 4 (32 words: Q_i, K_j, a 4x4 tile).
    # scores: Q once (16), K once per query block (2 * 16 = 32), 64 scores stored.
    # softmax: 32 // 8 = 4 rows at a time fit: 64 loads, 64 stores.
    # output: 64 weights loaded, V once per query block (32), 16 outputs stored.
    count = textbook_attention_io(*qkv(rng, 8, 8, 2, 2), capacity=32)
    assert (count.block_q, count.block_k) == (4, 4)
    assert count.loads == 16 + 32 + 64 + 64 + 32 == 208
    assert count.stores == 64 + 64 + 16 == 144
    assert count.peak == 32


def test_textbook_streams_rows_that_do_not_fit(rng):
    # N = 8, d = 1, M = 6: b**2 + 2b <= 6 gives b = 1. A row of 8 scores does not fit in 6
    # words, so each row is read three times in chunks of 6 - 2 = 4 (max, sum, weights).
    # scores: Q 8, K 8 per query block (8 blocks: 64); 64 stored.
    # softmax: 3 * 64 = 192 loads, 64 stores. output: 64 weights + 64 value loads, 8 stored.
    count = textbook_attention_io(*qkv(rng, 8, 8, 1, 1), capacity=6)
    assert count.block_q == 1
    assert count.loads == 8 + 64 + 192 + 64 + 64 == 392
    assert count.stores == 64 + 64 + 8 == 136
    assert count.peak <= 6


def test_flash_attention_by_hand(rng):
    # N = 8, d = 2, M = 64: Bc = 64 // (2 * 4) = 8, one key block. Br = 2 would need
    # 8*4 + 2*(4 + 6) + 2*8 = 68 words, so Br = 1 (8*4 + 10 + 8 = 50).
    # initial O, l, m written: 8 * (2 + 2) = 32 stores. K and V loaded once: 32.
    # one key block: Q, O, l, m loaded (8 * 6 = 48), O, l, m stored (32).
    count = flash_attention_io(*qkv(rng, 8, 8, 2, 2), capacity=64)
    assert (count.block_q, count.block_k) == (1, 8)
    assert count.loads == 32 + 48 == 80
    assert count.stores == 32 + 32 == 64
    assert count.peak == 50


def test_flash_attention_with_two_key_blocks_by_hand(rng):
    # N = 8, d = 2, M = 32: Bc = 32 // 8 = 4, Br: 16 + 2*10 + 8 = 44 > 32, so Br = 1
    # (16 + 10 + 4 = 30). Two key blocks: everything of Q, O, l, m goes round twice.
    # loads: 32 + 2 * 48 = 128; stores: 32 + 2 * 32 = 96.
    count = flash_attention_io(*qkv(rng, 8, 8, 2, 2), capacity=32)
    assert (count.block_q, count.block_k) == (1, 4)
    assert (count.loads, count.stores, count.peak) == (128, 96, 30)


def test_flash_attention2_by_hand(rng):
    # N = 8, d = 2, M = 64: Br = 64 // (2 * (4 + 4)) = 4, Bc = 2 (4*8 + 2*4 + 4*2 = 48 words).
    # loads: Q once (16), K and V once per query block (2 * 8 * 4 = 64); stores: O and lse
    # once (8 * 3 = 24).
    count = flash_attention2_io(*qkv(rng, 8, 8, 2, 2), capacity=64)
    assert (count.block_q, count.block_k) == (4, 2)
    assert (count.loads, count.stores, count.peak) == (80, 24, 48)


def test_flash_attention2_with_everything_in_one_block(rng):
    # N = 4, d = 1, M = 1000: Br = 1000 // 12 = 83 > N, one query block; Bc = 1.
    # The minimum any algorithm can move: Q, K, V in (12), O and lse out (8).
    count = flash_attention2_io(*qkv(rng, 4, 4, 1, 1), capacity=1000)
    assert (count.loads, count.stores) == (12, 8)


# ---------------------------------------------------------------------------------------------
# The general closed forms on a grid of shapes
# ---------------------------------------------------------------------------------------------


def textbook_closed_form(T, S, Dk, Dv, M, b):
    r = math.ceil(T / b)
    softmax_loads = T * S if S <= M else 3 * T * S
    return T * Dk + r * S * (Dk + Dv) + softmax_loads + T * S, 2 * T * S + T * Dv


def flash_closed_form(T, S, Dk, Dv, Bc):
    c = math.ceil(S / Bc)
    return S * (Dk + Dv) + c * T * (Dk + Dv + 2), (c + 1) * T * (Dv + 2)


def flash2_closed_form(T, S, Dk, Dv, Br):
    r = math.ceil(T / Br)
    return T * Dk + r * S * (Dk + Dv), T * (Dv + 1)


SHAPES = [  # T, S, Dk, Dv, M
    (8, 8, 2, 2, 64),
    (13, 11, 3, 5, 96),
    (17, 29, 4, 4, 200),
    (30, 7, 2, 3, 50),
    (40, 40, 8, 8, 300),
    (5, 50, 1, 2, 40),
]


@pytest.mark.parametrize("T, S, Dk, Dv, M", SHAPES)
def test_counts_equal_the_closed_forms(T, S, Dk, Dv, M, rng):
    q, k, v = qkv(rng, T, S, Dk, Dv)
    count = textbook_attention_io(q, k, v, capacity=M)
    assert (count.loads, count.stores) == textbook_closed_form(T, S, Dk, Dv, M, count.block_q)
    count = flash_attention_io(q, k, v, capacity=M)
    assert (count.loads, count.stores) == flash_closed_form(T, S, Dk, Dv, count.block_k)
    count = flash_attention2_io(q, k, v, capacity=M)
    assert (count.loads, count.stores) == flash2_closed_form(T, S, Dk, Dv, count.block_q)


@pytest.mark.parametrize("block_q, block_k", [(1, 1), (3, 5), (7, 2)])
def test_closed_forms_hold_for_chosen_blocks(block_q, block_k, rng):
    T, S, Dk, Dv = 13, 11, 3, 5
    q, k, v = qkv(rng, T, S, Dk, Dv)
    count = flash_attention_io(q, k, v, capacity=500, block_q=block_q, block_k=block_k)
    assert (count.loads, count.stores) == flash_closed_form(T, S, Dk, Dv, block_k)
    count = flash_attention2_io(q, k, v, capacity=500, block_q=block_q, block_k=block_k)
    assert (count.loads, count.stores) == flash2_closed_form(T, S, Dk, Dv, block_q)
    count = textbook_attention_io(q, k, v, capacity=500, block=block_k)
    assert (count.loads, count.stores) == textbook_closed_form(T, S, Dk, Dv, 500, block_k)


def test_the_theorem_in_numbers(rng):
    """Doubling N quadruples every count; doubling M halves the blocked ones only."""
    d = 4
    words = {}
    for N, M in [(128, 256), (256, 256), (256, 512)]:
        q, k, v = qkv(rng, N, N, d, d)
        words[N, M] = [f(q, k, v, capacity=M).words for f in ALGORITHMS]
    for i in range(3):
        assert 3.5 < words[256, 256][i] / words[128, 256][i] < 4.1
    assert words[256, 512][0] / words[256, 256][0] > 0.8  # the textbook barely moves
    for i in (1, 2):
        assert 0.45 < words[256, 512][i] / words[256, 256][i] < 0.6


# ---------------------------------------------------------------------------------------------
# Every simulated algorithm computes attention, within its capacity
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("T, S, Dk, Dv, M", SHAPES)
def test_output_is_attention(algorithm, T, S, Dk, Dv, M, rng):
    q, k, v = qkv(rng, T, S, Dk, Dv)
    count = algorithm(q, k, v, capacity=M)
    np.testing.assert_allclose(
        count.out, scaled_dot_product_attention(q, k, v), rtol=1e-12, atol=1e-13
    )
    assert count.peak <= M


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_explicit_scale(algorithm, rng):
    q, k, v = qkv(rng, 9, 6, 3, 2)
    count = algorithm(q, k, v, capacity=100, scale=2.5)
    np.testing.assert_allclose(
        count.out, scaled_dot_product_attention(q, k, v, scale=2.5), rtol=1e-12
    )


@pytest.mark.parametrize(
    "algorithm, blocks",
    [
        (textbook_attention_io, dict(block=8)),
        (flash_attention_io, dict(block_q=8, block_k=8)),
        (flash_attention2_io, dict(block_q=8, block_k=8)),
    ],
)
def test_blocks_too_large_for_the_capacity_raise(algorithm, blocks, rng):
    with pytest.raises(FastMemoryOverflow, match="fast memory of 64 words cannot hold"):
        algorithm(*qkv(rng, 16, 16, 4, 4), capacity=64, **blocks)


# ---------------------------------------------------------------------------------------------
# Block sizes
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("d, M, b", [(2, 32, 4), (2, 31, 3), (1, 3, 1), (16, 4096, 49), (4, 48, 4)])
def test_textbook_block_size(d, M, b):
    # b is the largest integer with b**2 + 2 d b <= M: (4, 32) 16 + 16; (3, 31) 9 + 12 = 21 and
    # b = 4 needs 32; (1, 3) 1 + 2; (49, 4096) 2401 + 1568 = 3969, 50 needs 4100; (4, 48) 48.
    assert textbook_block_size(d, M) == b


def test_textbook_block_size_too_small():
    with pytest.raises(
        ValueError,
        match=r"capacity must hold one row of Q, one of K and a score, "
        r"2 d \+ 1 = 9 words for d = 4; got capacity=8",
    ):
        textbook_block_size(4, 8)


def test_flash_block_sizes_follow_the_paper_when_d_is_the_width():
    # d = 64, M = 2**16 words: Bc = M / 4d = 256 as in the paper; Br = min(Bc, d) = 64 fits
    # (256 * 128 + 64 * 134 + 64 * 256 = 57728 <= 65536).
    assert flash_block_sizes(64, 64, 2**16, loop_order="kv_outer") == (64, 256)


@pytest.mark.parametrize("loop_order", ["kv_outer", "q_outer"])
@pytest.mark.parametrize("dk, dv, M", [(2, 2, 64), (3, 5, 96), (16, 16, 4096), (64, 32, 50000)])
def test_flash_block_sizes_fit_and_are_maximal(loop_order, dk, dv, M):
    br, bc = flash_block_sizes(dk, dv, M, loop_order=loop_order)
    width, d = dk + dv, max(dk, dv)

    def words(br, bc):
        extra = 6 if loop_order == "kv_outer" else 4
        return bc * width + br * (width + extra) + br * bc

    assert words(br, bc) <= M
    if loop_order == "kv_outer":
        assert bc == M // (2 * width) and (br == min(bc, d) or words(br + 1, bc) > M)
    else:
        assert br == M // (2 * (width + 4)) and (bc == min(br, d) or words(br, bc + 1) > M)


def test_flash_block_sizes_unknown_order():
    with pytest.raises(ValueError, match="loop_order must be 'kv_outer' or 'q_outer'; got 'x'"):
        flash_block_sizes(2, 2, 64, loop_order="x")


def test_flash_block_sizes_capacity_too_small():
    # Bc = 19 // 8 = 2 and Br = 1 need 2 * 4 + 1 * 10 + 2 = 20 words (20 would fit).
    with pytest.raises(
        ValueError, match="capacity=19 words cannot hold blocks of one row of widths dk=2 and dv=2"
    ):
        flash_block_sizes(2, 2, 19, loop_order="kv_outer")


@pytest.mark.parametrize("function", [textbook_block_size, flash_block_sizes])
def test_block_size_capacity_of_the_wrong_kind(function):
    kwargs = {} if function is textbook_block_size else dict(loop_order="q_outer")
    args = (4, 100.0) if function is textbook_block_size else (4, 4, 100.0)
    with pytest.raises(
        TypeError, match=r"capacity must be a positive integer \(words\); got 100.0"
    ):
        function(*args, **kwargs)


def test_block_size_capacity_not_positive():
    with pytest.raises(ValueError, match=r"capacity must be a positive integer \(words\); got 0"):
        textbook_block_size(4, 0)


# ---------------------------------------------------------------------------------------------
# Argument errors of the algorithms
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_widths_must_match(algorithm, rng):
    q, k, v = qkv(rng, 4, 5, 3, 2)
    with pytest.raises(ValueError, match="q and k must share the last dimension Dk"):
        algorithm(q, k[:, :2], v, capacity=100)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_lengths_must_match_and_be_positive(algorithm, rng):
    q, k, v = qkv(rng, 4, 5, 3, 2)
    with pytest.raises(ValueError, match=r"k and v must have the same number of rows S >= 1"):
        algorithm(q, k, v[:4], capacity=100)
    with pytest.raises(ValueError, match=r"k and v must have the same number of rows S >= 1"):
        algorithm(q, k[:0], v[:0], capacity=100)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_widths_must_be_positive(algorithm, rng):
    q, k, v = qkv(rng, 4, 5, 3, 0)
    with pytest.raises(ValueError, match="the widths Dk and Dv must be positive"):
        algorithm(q, k, v, capacity=100)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_inputs_must_be_2d(algorithm, rng):
    q, k, v = qkv(rng, 4, 5, 3, 2)
    with pytest.raises(ValueError, match=r"q must be a 2-D array \(T, Dk\)"):
        algorithm(q[None], k, v, capacity=100)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_capacity_of_the_algorithms(algorithm, rng):
    with pytest.raises(TypeError, match=r"capacity must be a positive integer \(words\)"):
        algorithm(*qkv(rng, 4, 5, 3, 2), capacity=None)


@pytest.mark.parametrize(
    "algorithm, name",
    [
        (textbook_attention_io, "block"),
        (flash_attention_io, "block_q"),
        (flash_attention2_io, "block_k"),
    ],
)
def test_given_block_sizes_are_checked(algorithm, name, rng):
    with pytest.raises(ValueError, match=f"{name} must be a positive integer; got 0"):
        algorithm(*qkv(rng, 4, 5, 3, 2), capacity=100, **{name: 0})


# ---------------------------------------------------------------------------------------------
# Causal: the tiles above the diagonal are skipped, with what they would have moved
# ---------------------------------------------------------------------------------------------


def test_flash_attention2_causal_by_hand(rng):
    # N = 8, d = 2, M = 64: Br = 4, Bc = 2, as above. Query block 0 (queries 0-3) loads the key
    # blocks starting at 0 and 2 (keys 0-3), query block 1 all four (keys 0-7):
    # loads 16 (Q) + 4 * (4 + 8) = 64 instead of 80; stores unchanged, 24.
    q, k, v = qkv(rng, 8, 8, 2, 2)
    count = flash_attention2_io(q, k, v, capacity=64, is_causal=True)
    assert (count.block_q, count.block_k) == (4, 2)
    assert (count.loads, count.stores) == (16 + 4 * (4 + 8), 24) == (64, 24)
    assert count.peak == 48


def test_flash_attention_causal_with_two_key_blocks_by_hand(rng):
    # N = 8, d = 2, M = 32: Bc = 4, Br = 1, as above. Key block 0 (keys 0-3): K, V in (16), all
    # eight rows of Q, O, l, m in (8 * 6 = 48) and O, l, m out (8 * 4 = 32). Key block 1
    # (keys 4-7): K, V in (16), rows 4-7 only: 4 * 6 = 24 in, 4 * 4 = 16 out.
    # With the initial 32 stores: loads 16 + 48 + 16 + 24 = 104, stores 32 + 32 + 16 = 80.
    q, k, v = qkv(rng, 8, 8, 2, 2)
    count = flash_attention_io(q, k, v, capacity=32, is_causal=True)
    assert (count.block_q, count.block_k) == (1, 4)
    assert (count.loads, count.stores) == (104, 80)
    assert count.peak <= 32


def test_causal_with_more_keys_than_queries_by_hand(rng):
    # T = 4, S = 8, Dk = Dv = 1, Br = 2, Bc = 3 (key blocks 0-2, 3-5, 6-7).
    # FlashAttention-2: query block 0 (last query 1) loads keys 0-2, block 1 (last query 3)
    # keys 0-5: loads 4 + 2 * (3 + 6) = 22, stores 4 * 2 = 8 (without the mask 4 + 2*2*8 = 36).
    # FlashAttention: keys 6-7 come after every query and are never loaded. Keys 0-2: K, V in
    # (6), all 4 rows in (4 * 4 = 16) and out (4 * 3 = 12). Keys 3-5: K, V in (6), the query
    # block holding query 3, rows 2-3: in 2 * 4 = 8, out 2 * 3 = 6. With the initial 12 stores:
    # loads 6 + 16 + 6 + 8 = 36, stores 12 + 12 + 6 = 30.
    q, k, v = qkv(rng, 4, 8, 1, 1)
    count = flash_attention2_io(q, k, v, capacity=100, block_q=2, block_k=3, is_causal=True)
    assert (count.loads, count.stores) == (22, 8)
    count = flash_attention_io(q, k, v, capacity=100, block_q=2, block_k=3, is_causal=True)
    assert (count.loads, count.stores) == (36, 30)


def test_causal_with_more_queries_than_keys_by_hand(rng):
    # T = 8, S = 4, Dk = Dv = 1, Br = 2, Bc = 3 (key blocks 0-2 and 3). FlashAttention-2: query
    # block 0 (last query 1) loads keys 0-2; blocks 1, 2, 3 (last queries 3, 5, 7) all four
    # keys: loads 8 + 2 * (3 + 4 + 4 + 4) = 38, stores 8 * 2 = 16.
    # FlashAttention: keys 0-2 meet all 8 rows (in 8 * 4, out 8 * 3); key 3 the rows from the
    # block holding query 3, rows 2-7 (in 6 * 4, out 6 * 3); K, V in 3 * 2 + 1 * 2.
    # loads 6 + 32 + 2 + 24 = 64, stores 8 * 3 + 24 + 18 = 66.
    q, k, v = qkv(rng, 8, 4, 1, 1)
    count = flash_attention2_io(q, k, v, capacity=100, block_q=2, block_k=3, is_causal=True)
    assert (count.loads, count.stores) == (38, 16)
    count = flash_attention_io(q, k, v, capacity=100, block_q=2, block_k=3, is_causal=True)
    assert (count.loads, count.stores) == (64, 66)


def causal_flash_closed_form(T, S, Dk, Dv, Br, Bc):
    """Algorithm 1, causal: key block from s meets the rows from the query block holding s."""
    loads, stores = 0, T * (Dv + 2)
    for s in range(0, min(S, T), Bc):
        rows = T - s // Br * Br
        loads += min(Bc, S - s) * (Dk + Dv) + rows * (Dk + Dv + 2)
        stores += rows * (Dv + 2)
    return loads, stores


def causal_flash2_closed_form(T, S, Dk, Dv, Br, Bc):
    """FlashAttention-2, causal: query block ending at t loads the first ceil(t / Bc) blocks."""
    keys = sum(min(S, math.ceil(min(T, t + Br) / Bc) * Bc) for t in range(0, T, Br))
    return T * Dk + keys * (Dk + Dv), T * (Dv + 1)


@pytest.mark.parametrize("T, S, Dk, Dv, M", SHAPES)
def test_causal_counts_equal_the_closed_forms(T, S, Dk, Dv, M, rng):
    q, k, v = qkv(rng, T, S, Dk, Dv)
    count = flash_attention_io(q, k, v, capacity=M, is_causal=True)
    want = causal_flash_closed_form(T, S, Dk, Dv, count.block_q, count.block_k)
    assert (count.loads, count.stores) == want
    count = flash_attention2_io(q, k, v, capacity=M, is_causal=True)
    want = causal_flash2_closed_form(T, S, Dk, Dv, count.block_q, count.block_k)
    assert (count.loads, count.stores) == want


@pytest.mark.parametrize("block_q, block_k", [(1, 1), (3, 5), (7, 2), (20, 20)])
@pytest.mark.parametrize("T, S", [(13, 11), (11, 13), (12, 12)])
def test_causal_closed_forms_hold_for_chosen_blocks(T, S, block_q, block_k, rng):
    q, k, v = qkv(rng, T, S, 3, 5)
    blocks = dict(capacity=2000, block_q=block_q, block_k=block_k, is_causal=True)
    count = flash_attention_io(q, k, v, **blocks)
    assert (count.loads, count.stores) == causal_flash_closed_form(T, S, 3, 5, block_q, block_k)
    count = flash_attention2_io(q, k, v, **blocks)
    assert (count.loads, count.stores) == causal_flash2_closed_form(T, S, 3, 5, block_q, block_k)


@pytest.mark.parametrize("algorithm", [flash_attention_io, flash_attention2_io])
@pytest.mark.parametrize("T, S, Dk, Dv, M", SHAPES)
def test_causal_output_is_causal_attention(algorithm, T, S, Dk, Dv, M, rng):
    q, k, v = qkv(rng, T, S, Dk, Dv)
    count = algorithm(q, k, v, capacity=M, is_causal=True)
    want = scaled_dot_product_attention(q, k, v, is_causal=True, implementation="reference")
    np.testing.assert_allclose(count.out, want, rtol=1e-12, atol=1e-13)
    assert count.peak <= M


@pytest.mark.parametrize("algorithm", [flash_attention_io, flash_attention2_io])
def test_causal_traffic_tends_to_half(algorithm, rng):
    """T = S = N, d = 4, M = 256: the causal share of the words falls towards 1/2 as N grows,
    its excess over 1/2 halving with each doubling (the diagonal tiles and the words that move
    once are linear in N, the skipped tiles quadratic)."""
    ratios = []
    for N in (64, 128, 256, 512):
        q, k, v = qkv(rng, N, N, 4, 4)
        full = algorithm(q, k, v, capacity=256).words
        ratios.append(algorithm(q, k, v, capacity=256, is_causal=True).words / full)
    assert all(0.5 < r for r in ratios) and ratios == sorted(ratios, reverse=True)
    assert ratios[-1] < 0.54
    excess = [r - 0.5 for r in ratios]
    for before, after in zip(excess, excess[1:]):
        assert 0.4 < after / before < 0.65


@pytest.mark.parametrize("algorithm", [flash_attention_io, flash_attention2_io])
@pytest.mark.parametrize("bad", [1, None, "yes"])
def test_is_causal_must_be_a_bool(algorithm, bad, rng):
    with pytest.raises(TypeError, match=f"is_causal must be a bool; got {bad!r}"):
        algorithm(*qkv(rng, 4, 4, 2, 2), capacity=64, is_causal=bad)


def test_the_public_names_are_imported_from_sdpa_iomodel():
    # sdpa.iomodel is a package of three modules (the machine, the block sizes, the
    # algorithms); its names stay importable from where they always were
    import sdpa.iomodel as iomodel

    assert sorted(iomodel.__all__) == sorted(
        ["FastMemoryOverflow", "IOCount", "TwoLevelMemory", "flash_attention2_io",
         "flash_attention_io", "flash_block_sizes", "textbook_attention_io", "textbook_block_size"]
    )  # fmt: skip
    assert iomodel.TwoLevelMemory is TwoLevelMemory
    assert iomodel.flash_attention_io is flash_attention_io
    for name in iomodel.__all__:
        assert getattr(iomodel, name).__module__.startswith("sdpa.iomodel."), name
