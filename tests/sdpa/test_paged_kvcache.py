"""Tests of sdpa.paged_kvcache: the paged cache against a contiguous model of every sequence.

The model is a dict of plain arrays, one per sequence, that appends concatenate and forks copy.
Random sequences of appends, forks and frees (the pool sometimes too small) are checked against
it after every step: the tokens, the blocks each sequence holds, the free count, and that
sharing and copy-on-write never leak a token from one sequence into another. A failed call is
checked to change nothing, the pool's arrays included. One test per error message.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from references import attention_loop

from sdpa import PagedKVCache, scaled_dot_product_attention

HKV, DK, DV = 2, 5, 3


def tokens(rng, n, dtype=np.float64, Hkv=HKV, Dk=DK, Dv=DV):
    """The keys (Hkv, n, Dk) and values (Hkv, n, Dv) of n new tokens."""
    return (
        rng.standard_normal((Hkv, n, Dk)).astype(dtype),
        rng.standard_normal((Hkv, n, Dv)).astype(dtype),
    )


def snapshot(cache, seqs):
    """Everything a failed call must leave alone: the pool, tables, lengths, counts, tokens."""
    return (
        cache._keys.copy(),
        cache._values.copy(),
        list(cache._refs),
        cache.num_free_blocks,
        {s: cache.block_table(s) for s in seqs},
        {s: cache.length(s) for s in seqs},
    )


def assert_unchanged(before, after):
    np.testing.assert_array_equal(after[0], before[0])
    np.testing.assert_array_equal(after[1], before[1])
    assert after[2:] == before[2:]


def check_against_model(cache, model, block_size):
    """Tokens, lengths, blocks held and the free count, from the model and the tables."""
    held = {}
    for seq, (K, V) in model.items():
        got_k, got_v = cache.keys_values(seq)
        np.testing.assert_array_equal(got_k, K)
        np.testing.assert_array_equal(got_v, V)
        L = K.shape[1]
        assert cache.length(seq) == L
        table = cache.block_table(seq)
        assert len(table) == math.ceil(L / block_size) and len(set(table)) == len(table)
        for block in table:
            held[block] = held.get(block, 0) + 1
    assert cache.num_free_blocks == cache.num_blocks - len(held)
    assert [cache._refs[b] for b in sorted(held)] == [held[b] for b in sorted(held)]


# ---------------------------------------------------------------------------------------------
# Against a contiguous model
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
def test_random_appends_for_many_sequences_equal_contiguous_arrays(rng, block_size):
    cache = PagedKVCache(400, block_size, HKV, DK, DV, dtype=np.float64)
    model = {}
    for _ in range(12):
        seq = cache.new_sequence()
        model[seq] = (np.zeros((HKV, 0, DK)), np.zeros((HKV, 0, DV)))
    for _ in range(60):
        seq = int(rng.integers(len(model)))
        key, value = tokens(rng, int(rng.integers(1, 8)))
        cache.append(seq, key, value)
        K, V = model[seq]
        model[seq] = (np.concatenate([K, key], axis=1), np.concatenate([V, value], axis=1))
    check_against_model(cache, model, block_size)


def random_run(seed: int) -> dict[str, int]:
    """80 random appends, forks and frees on a small pool, checked against the model after
    every step; returns how often an append ran out of blocks and how often it copied."""
    rng = np.random.default_rng(seed)
    block_size = int(rng.integers(1, 6))
    cache = PagedKVCache(24, block_size, HKV, DK, DV, dtype=np.float64)
    model = {}
    counts = {"ran out": 0, "copied": 0, "forks": 0}
    for _ in range(80):
        op = rng.choice(["new", "append", "append", "append", "fork", "free"])
        if op == "new" or not model:
            seq = cache.new_sequence()
            model[seq] = (np.zeros((HKV, 0, DK)), np.zeros((HKV, 0, DV)))
        elif op == "append":
            seq = int(rng.choice(list(model)))
            key, value = tokens(rng, int(rng.integers(1, 2 * block_size + 2)))
            before = snapshot(cache, model)
            table = cache.block_table(seq)
            try:
                cache.append(seq, key, value)
            except MemoryError:
                counts["ran out"] += 1
                assert_unchanged(before, snapshot(cache, model))
                continue
            if table and cache.block_table(seq)[len(table) - 1] != table[-1]:
                counts["copied"] += 1
            K, V = model[seq]
            model[seq] = (np.concatenate([K, key], axis=1), np.concatenate([V, value], axis=1))
        elif op == "fork":
            seq = int(rng.choice(list(model)))
            free = cache.num_free_blocks
            child = cache.fork(seq)
            assert cache.num_free_blocks == free
            assert cache.block_table(child) == cache.block_table(seq)
            model[child] = tuple(a.copy() for a in model[seq])
            counts["forks"] += 1
        else:
            seq = int(rng.choice(list(model)))
            cache.free(seq)
            del model[seq]
        check_against_model(cache, model, block_size)
    for seq in list(model):
        cache.free(seq)
    assert cache.num_free_blocks == 24 and not any(cache._refs)
    return counts


def test_random_appends_forks_and_frees_equal_the_model():
    # A small pool, so that some appends run out of blocks: those must change nothing.
    totals = {"ran out": 0, "copied": 0, "forks": 0}
    for seed in range(16):
        for name, n in random_run(seed).items():
            totals[name] += n
    # every path was taken, many times
    assert totals["ran out"] >= 50 and totals["copied"] >= 25 and totals["forks"] >= 100


# ---------------------------------------------------------------------------------------------
# Forks and copy-on-write
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("first_writer", ["parent", "child"])
def test_a_shared_partly_filled_block_is_copied_by_the_first_writer_only(rng, first_writer):
    cache = PagedKVCache(10, 4, HKV, DK, DV)
    parent = cache.new_sequence()
    prompt = tokens(rng, 6, np.float32)  # blocks 0 (full) and 1 (2 of 4 slots)
    cache.append(parent, *prompt)
    child = cache.fork(parent)
    first, second = (parent, child) if first_writer == "parent" else (child, parent)
    a, b = tokens(rng, 1, np.float32), tokens(rng, 1, np.float32)
    cache.append(first, *a)  # copies block 1 into block 2
    assert cache.block_table(first) == [0, 2] and cache.block_table(second) == [0, 1]
    assert cache.num_free_blocks == 7
    cache.append(second, *b)  # block 1 is its own now: written in place
    assert cache.block_table(second) == [0, 1] and cache.num_free_blocks == 7
    for seq, new in ((first, a), (second, b)):
        K, V = cache.keys_values(seq)
        np.testing.assert_array_equal(K, np.concatenate([prompt[0], new[0]], axis=1))
        np.testing.assert_array_equal(V, np.concatenate([prompt[1], new[1]], axis=1))


def test_full_shared_blocks_are_never_copied(rng):
    cache = PagedKVCache(10, 4, HKV, DK, DV)
    parent = cache.new_sequence()
    cache.append(parent, *tokens(rng, 8))  # two full blocks
    children = [cache.fork(parent) for _ in range(3)]
    for seq in (parent, *children):
        cache.append(seq, *tokens(rng, 2))
    tables = [cache.block_table(seq) for seq in (parent, *children)]
    assert all(t[:2] == [0, 1] for t in tables)  # the same block ids: shared, not copied
    assert sorted(t[2] for t in tables) == [2, 3, 4, 5]  # one new block each
    assert cache.num_free_blocks == 10 - 6


def test_forks_of_forks_never_see_each_others_tokens(rng):
    cache = PagedKVCache(40, 3, HKV, DK, DV, dtype=np.float64)
    root = cache.new_sequence()
    prefix = tokens(rng, 5)
    cache.append(root, *prefix)
    a = cache.fork(root)
    b = cache.fork(a)
    c = cache.fork(b)
    written = {}
    for seq in (c, a, root, b):  # every one writes after the forks
        written[seq] = tokens(rng, 4)
        cache.append(seq, *written[seq])
    for seq, new in written.items():
        K, _ = cache.keys_values(seq)
        np.testing.assert_array_equal(K, np.concatenate([prefix[0], new[0]], axis=1))


def test_free_returns_shared_blocks_only_when_the_last_holder_frees(rng):
    cache = PagedKVCache(10, 4, HKV, DK, DV)
    parent = cache.new_sequence()
    cache.append(parent, *tokens(rng, 8))
    child = cache.fork(parent)
    K_child = cache.keys_values(child)[0]
    cache.free(parent)
    assert cache.num_free_blocks == 8  # the child still holds both blocks
    np.testing.assert_array_equal(cache.keys_values(child)[0], K_child)
    cache.free(child)
    assert cache.num_free_blocks == 10


def test_freed_blocks_are_reused_without_showing_old_tokens(rng):
    cache = PagedKVCache(2, 4, HKV, DK, DV, dtype=np.float64)
    old = cache.new_sequence()
    cache.append(old, *tokens(rng, 8))
    cache.free(old)
    new = cache.new_sequence()
    key, value = tokens(rng, 3)
    cache.append(new, key, value)
    K, V = cache.keys_values(new)
    np.testing.assert_array_equal(K, key)
    np.testing.assert_array_equal(V, value)


def test_a_fork_of_an_empty_sequence_takes_its_own_first_block(rng):
    cache = PagedKVCache(4, 2, HKV, DK, DV)
    parent = cache.new_sequence()
    child = cache.fork(parent)
    cache.append(child, *tokens(rng, 1))
    assert cache.block_table(parent) == [] and cache.block_table(child) == [0]


# ---------------------------------------------------------------------------------------------
# Running out of blocks
# ---------------------------------------------------------------------------------------------


def test_running_out_of_blocks_names_the_counts_and_changes_nothing(rng):
    cache = PagedKVCache(5, 4, HKV, DK, DV)
    seqs = [cache.new_sequence() for _ in range(2)]
    cache.append(seqs[0], *tokens(rng, 6))
    cache.append(seqs[1], *tokens(rng, 7))
    before = snapshot(cache, seqs)
    with pytest.raises(
        MemoryError,
        match=r"appending 7 tokens to sequence 1 \(length 7\) needs 2 free blocks, but 1 of 5 "
        r"are free; nothing was appended: free finished sequences or use a larger pool",
    ):
        cache.append(seqs[1], *tokens(rng, 7))
    assert_unchanged(before, snapshot(cache, seqs))
    cache.append(seqs[1], *tokens(rng, 5))  # 12 tokens: 3 blocks, the last one free block
    assert cache.num_free_blocks == 0


def test_running_out_of_blocks_for_a_copy_on_write_changes_nothing(rng):
    cache = PagedKVCache(2, 4, HKV, DK, DV)
    parent = cache.new_sequence()
    cache.append(parent, *tokens(rng, 6))  # both blocks, the second partly filled
    child = cache.fork(parent)
    before = snapshot(cache, [parent, child])
    with pytest.raises(
        MemoryError,
        match=r"needs 1 free block \(one to copy a shared, partly filled last block\), but 0 of 2",
    ):
        cache.append(child, *tokens(rng, 1))
    assert_unchanged(before, snapshot(cache, [parent, child]))


# ---------------------------------------------------------------------------------------------
# Attention through the block table
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("Hq", [2, 6])
def test_attend_equals_attention_on_keys_values_and_on_the_contiguous_cache(rng, Hq):
    cache = PagedKVCache(30, 3, HKV, DK, DV, dtype=np.float64)
    other = cache.new_sequence()
    seq = cache.new_sequence()
    K, V = np.zeros((HKV, 0, DK)), np.zeros((HKV, 0, DV))
    for n in (5, 1, 4, 2):  # interleaved with another sequence's blocks
        key, value = tokens(rng, n)
        cache.append(seq, key, value)
        cache.append(other, *tokens(rng, 2))
        K, V = np.concatenate([K, key], axis=1), np.concatenate([V, value], axis=1)
    query = rng.standard_normal((Hq, 3, DK))
    opts = dict(
        is_causal=True, causal_alignment="bottom_right", enable_gqa=Hq != HKV, return_lse=True
    )
    out, lse = cache.attend(seq, query, **opts)
    gathered = scaled_dot_product_attention(query, *cache.keys_values(seq), **opts)
    np.testing.assert_array_equal(out, gathered[0])
    np.testing.assert_array_equal(lse, gathered[1])
    want, _, want_lse = attention_loop(
        query, K, V, is_causal=True, alignment="bottom_right", enable_gqa=Hq != HKV
    )
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12)


def test_attend_passes_every_keyword_on(rng):
    cache = PagedKVCache(8, 4, HKV, DK, DV, dtype=np.float64)
    seq = cache.new_sequence()
    cache.append(seq, *tokens(rng, 9))
    query = rng.standard_normal((HKV, 2, DK))
    kw = dict(window=(3, 0), is_causal=True, causal_alignment="bottom_right", scale=0.3,
              sinks=np.array([[0.5], [-1.0]]), return_weights=True)  # fmt: skip
    got = cache.attend(seq, query, **kw)
    want = scaled_dot_product_attention(query, *cache.keys_values(seq), **kw)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(("Dk", "Dv"), [(0, DV), (DK, 0), (0, 0)])
def test_widths_of_zero_work_like_the_other_paths(rng, Dk, Dv):
    """Keys of width 0 give scores of 0, so each query weighs the 5 visible tokens equally
    (lse = log 5); values of width 0 give outputs of width 0. The tokens span 3 blocks."""
    cache = PagedKVCache(6, 2, HKV, Dk, Dv, dtype=np.float64)
    seq = cache.new_sequence()
    key, value = tokens(rng, 5, Dk=Dk, Dv=Dv)
    cache.append(seq, key, value)
    K, V = cache.keys_values(seq)
    assert K.shape == (HKV, 5, Dk) and V.shape == (HKV, 5, Dv)
    np.testing.assert_array_equal(V, value)
    out, lse = cache.attend(seq, np.zeros((HKV, 2, Dk)), return_lse=True)
    assert out.shape == (HKV, 2, Dv)
    np.testing.assert_allclose(out, np.broadcast_to(value.mean(axis=1, keepdims=True), out.shape),
                               rtol=1e-15, atol=1e-15)  # fmt: skip
    np.testing.assert_allclose(lse, math.log(5.0), rtol=1e-15)
    empty = cache.new_sequence()
    assert cache.keys_values(empty)[0].shape == (HKV, 0, Dk)


@pytest.mark.parametrize(
    ("pool", "source", "largest", "boundary"),
    [
        # float16: 65504 and half its unit in the last place, 32 / 2
        (np.float16, np.float64, 65504.0, 65520.0),
        # float32: (2 - 2^-23) 2^127 and half of 2^104
        (np.float32, np.float64, (2 - 2.0**-23) * 2.0**127, 2.0**128 - 2.0**103),
    ],
)
def test_values_that_round_to_the_pools_largest_are_kept_and_from_half_an_ulp_on_refused(
    pool, source, largest, boundary
):
    """The range check follows the dtype's rounding: below largest + half an ulp a value
    rounds to largest (accepted, stored as it); from there on it rounds to inf (refused)."""
    cache = PagedKVCache(4, 2, 1, 2, 1, dtype=pool)
    seq = cache.new_sequence()
    below = np.nextafter(source(boundary), 0)
    keys = np.array([[[below, -below], [largest, 1.0]]], dtype=source)  # (1, 2, 2)
    cache.append(seq, keys, np.zeros((1, 2, 1)))
    np.testing.assert_array_equal(cache.keys_values(seq)[0], [[[largest, -largest], [largest, 1]]])
    for bad in (boundary, -boundary):
        with pytest.raises(ValueError, match=r"key must fit in float..+ which would become"):
            cache.append(seq, np.array([[[bad, 0.0]]], dtype=source), np.zeros((1, 1, 1)))
    assert cache.length(seq) == 2


def test_float16_boundary_by_hand():
    """65519.99 rounds to 65504 in float16 and is kept; 65520 would be inf and is refused."""
    cache = PagedKVCache(2, 2, 1, 1, dtype=np.float16)
    seq = cache.new_sequence()
    cache.append(seq, np.array([[[np.float64(65519.99)]]]), np.zeros((1, 1, 1)))
    assert cache.keys_values(seq)[0][0, 0, 0] == 65504.0
    with pytest.raises(ValueError, match=r"key must fit in float16, .*got 6.552e\+04"):
        cache.append(seq, np.array([[[65520.0]]]), np.zeros((1, 1, 1)))


@pytest.mark.skipif(
    np.finfo(np.longdouble).max <= np.finfo(np.float64).max,
    reason="long double is float64 here: nothing beyond float64 to refuse",
)
def test_long_double_values_beyond_a_float64_pool():
    """float64's largest is (2 - 2^-52) 2^1023; half its ulp is 2^970."""
    ld = np.longdouble
    largest = ld(np.finfo(np.float64).max)
    boundary = ld(2) ** 1024 - ld(2) ** 970
    cache = PagedKVCache(2, 2, 1, 1, dtype=np.float64)
    seq = cache.new_sequence()
    cache.append(seq, np.array([[[np.nextafter(boundary, ld(0))]]]), np.zeros((1, 1, 1)))
    assert cache.keys_values(seq)[0][0, 0, 0] == largest
    with pytest.raises(ValueError, match=r"key must fit in float64, the cache's dtype"):
        cache.append(seq, np.array([[[boundary]]]), np.zeros((1, 1, 1)))
    assert cache.length(seq) == 1


def test_float16_pool_stores_float16(rng):
    cache = PagedKVCache(4, 4, HKV, DK, DV, dtype=np.float16)
    seq = cache.new_sequence()
    key, value = tokens(rng, 5)
    cache.append(seq, key, value)
    K, V = cache.keys_values(seq)
    assert K.dtype == V.dtype == np.float16
    np.testing.assert_array_equal(K, key.astype(np.float16))


def test_keys_values_are_arrays_of_the_callers_own(rng):
    cache = PagedKVCache(4, 2, HKV, DK, DV)
    seq = cache.new_sequence()
    cache.append(seq, *tokens(rng, 3))
    K, _ = cache.keys_values(seq)
    K[...] = 7.0
    assert not (cache.keys_values(seq)[0] == 7.0).any()


def test_inputs_are_not_modified_or_kept(rng):
    cache = PagedKVCache(4, 2, HKV, DK, DV)
    seq = cache.new_sequence()
    key, value = tokens(rng, 3)
    before = key.copy()
    cache.append(seq, key, value)
    key[...] = 0.0
    np.testing.assert_array_equal(cache.keys_values(seq)[0], before.astype(np.float32))


def test_repr_names_the_sizes_and_the_state():
    cache = PagedKVCache(4, 2, HKV, DK)
    cache.new_sequence()
    assert repr(cache) == (
        "PagedKVCache(num_blocks=4, block_size=2, n_kv_heads=2, head_dim=5, value_dim=5, "
        "dtype=float32, sequences=1, free_blocks=4)"
    )


# ---------------------------------------------------------------------------------------------
# Bad arguments: one test per message
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        (dict(num_blocks=0), ValueError, "num_blocks must be a positive integer; got 0"),
        (dict(num_blocks=2.0), TypeError, "num_blocks must be a positive integer; got 2.0"),
        (dict(block_size=0), ValueError, "block_size must be a positive integer; got 0"),
        (dict(n_kv_heads=0), ValueError, "n_kv_heads must be a positive integer; got 0"),
        (dict(head_dim=-1), ValueError, "head_dim must be a non-negative integer; got -1"),
        (dict(value_dim=-2), ValueError, "value_dim must be a non-negative integer; got -2"),
        (dict(dtype=np.int32), TypeError, "dtype must be a floating dtype"),
        (dict(dtype=None), TypeError, "dtype must be a floating dtype .*; got None"),
    ],
)
def test_bad_sizes_and_dtypes_raise(kwargs, error, message):
    args = dict(num_blocks=4, block_size=2, n_kv_heads=HKV, head_dim=DK) | kwargs
    with pytest.raises(error, match=message):
        PagedKVCache(**args)


def test_a_pool_that_cannot_fit_in_memory_raises_before_allocating():
    with pytest.raises(MemoryError, match=r"the pool of 1000000000000 blocks of 16 slots"):
        PagedKVCache(10**12, 16, 8, 128)


@pytest.mark.parametrize(
    "method", ["append", "fork", "free", "length", "block_table", "keys_values", "attend"]
)
@pytest.mark.parametrize("seq, state", [(5, "was never handed out"), (0, "was freed")])
def test_unknown_or_freed_sequences_raise_key_error(rng, method, seq, state):
    cache = PagedKVCache(4, 2, HKV, DK, DV)
    cache.free(cache.new_sequence())
    args = {
        "append": tokens(rng, 1),
        "attend": (rng.standard_normal((HKV, 1, DK)),),
    }.get(method, ())
    with pytest.raises(KeyError, match=f"got seq={seq}, which {state}"):
        getattr(cache, method)(seq, *args)


def test_a_sequence_id_that_is_not_an_integer_raises():
    cache = PagedKVCache(4, 2, HKV, DK, DV)
    with pytest.raises(TypeError, match="seq must be an integer; got '0'"):
        cache.length("0")


@pytest.mark.parametrize(
    "which, shape",
    [("key", (HKV, 1, DK + 1)), ("key", (1, 1, DK)), ("value", (HKV, 1, DV + 1)), ("key", (1, DK))],
)
def test_tokens_of_the_wrong_shape_raise_and_change_nothing(rng, which, shape):
    cache = PagedKVCache(4, 2, HKV, DK, DV)
    seq = cache.new_sequence()
    key, value = tokens(rng, 1)
    bad = {"key": key, "value": value} | {which: np.zeros(shape)}
    width = DK if which == "key" else DV
    before = snapshot(cache, [seq])
    with pytest.raises(
        ValueError,
        match=rf"{which} must have shape \(Hkv, n, D\) = \({HKV}, n, {width}\) for this cache; "
        rf"got {which}.shape={re_shape(shape)}",
    ):
        cache.append(seq, bad["key"], bad["value"])
    assert_unchanged(before, snapshot(cache, [seq]))


def re_shape(shape):
    return str(tuple(shape)).replace("(", r"\(").replace(")", r"\)")


@pytest.mark.parametrize("n_key, n_value", [(2, 3), (0, 0)])
def test_token_counts_that_differ_or_are_zero_raise(rng, n_key, n_value):
    cache = PagedKVCache(4, 2, HKV, DK, DV)
    seq = cache.new_sequence()
    with pytest.raises(
        ValueError,
        match=r"key and value must hold the same number n >= 1 of new tokens \(axis 1\); got "
        rf"key.shape=\({HKV}, {n_key}, {DK}\), value.shape=\({HKV}, {n_value}, {DV}\)",
    ):
        cache.append(seq, tokens(rng, n_key)[0], tokens(rng, n_value)[1])
    assert cache.length(seq) == 0 and cache.num_free_blocks == 4


def test_complex_tokens_raise(rng):
    cache = PagedKVCache(4, 2, HKV, DK, DV)
    key, value = tokens(rng, 1)
    with pytest.raises(TypeError, match="key must be a real floating, integer or bool array"):
        cache.append(cache.new_sequence(), key.astype(complex), value)


def test_values_beyond_the_pools_dtype_raise_and_change_nothing(rng):
    cache = PagedKVCache(4, 2, HKV, DK, DV, dtype=np.float16)
    seq = cache.new_sequence()
    key, value = tokens(rng, 3)
    value[0, 1, 0] = 1e5
    before = snapshot(cache, [seq])
    with pytest.raises(ValueError, match=r"value must fit in float16, the cache's dtype"):
        cache.append(seq, key, value)
    assert_unchanged(before, snapshot(cache, [seq]))


@pytest.mark.parametrize("shape", [(1, HKV, 1, DK), (HKV, 1, DK + 1), (DK,)])
def test_a_query_of_the_wrong_shape_raises(rng, shape):
    cache = PagedKVCache(4, 2, HKV, DK, DV)
    seq = cache.new_sequence()
    cache.append(seq, *tokens(rng, 1))
    with pytest.raises(
        ValueError,
        match=rf"query must have shape \(Hq, T, Dk\) = \(Hq, T, {DK}\) for this cache; "
        rf"got query.shape={re_shape(shape)}",
    ):
        cache.attend(seq, np.zeros(shape))
