"""The tiled (memory-efficient) path against the reference formula.

The reference path is itself checked against PyTorch and hand-computed values in
test_attention.py and tests/conformance/test_torch.py; here every feature of the tiled path must
agree with it to rounding, for tile sizes that divide nothing, tiles of one element and tiles
larger than the whole problem. Tile skipping is checked against masks built independently
with the public mask helpers.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys

import numpy as np
import pytest
from references import attention_loop_2d

import sdpa
import sdpa.attention as attention_module
import sdpa.tiled as tiled_module
from sdpa import causal_mask, scaled_dot_product_attention, sliding_window_mask
from sdpa.problem import prepare_attention
from sdpa.tiled import TileStats, attention_tiled, tile_map
from sdpa.tuning import svml_exp2, tile_exponential

TOL = {
    np.float64: dict(rtol=1e-12, atol=1e-12),
    np.float32: dict(rtol=1e-5, atol=1e-6),
    np.float16: dict(rtol=2e-3, atol=2e-3),
}
B, H, T, S, DK, DV = 2, 3, 13, 11, 6, 5  # every size different, none a multiple of another


def normal(rng, shape, dtype=np.float64):
    return rng.standard_normal(shape).astype(dtype)


def qkv(rng, dtype=np.float64, *, t=T, s=S, hq=H, hkv=H, dk=DK, dv=DV):
    return (
        normal(rng, (B, hq, t, dk), dtype),
        normal(rng, (B, hkv, s, dk), dtype),
        normal(rng, (B, hkv, s, dv), dtype),
    )


def tiled(
    q,
    k,
    v,
    attn_mask=None,
    is_causal=False,
    *,
    block_q,
    block_k,
    num_threads=None,
    stats=None,
    **kwargs,
):
    """The tiled path with chosen tile sizes; returns ``(out, lse)`` shaped as the public API."""
    problem = prepare_attention(q, k, v, attn_mask, is_causal, **kwargs)
    out, lse = attention_tiled(
        problem, block_q=block_q, block_k=block_k, num_threads=num_threads, stats=stats
    )
    return problem.finish(out, lse=lse)


def reference(q, k, v, attn_mask=None, is_causal=False, **kwargs):
    return scaled_dot_product_attention(
        q, k, v, attn_mask, 0.0, is_causal, implementation="reference", return_lse=True, **kwargs
    )


def assert_same(got, want, dtype=np.float64):
    out, lse = got
    out_ref, lse_ref = want
    assert out.dtype == out_ref.dtype and out.shape == out_ref.shape
    assert lse.dtype == lse_ref.dtype and lse.shape == lse_ref.shape
    assert not np.isnan(out).any()
    np.testing.assert_allclose(out, out_ref, **TOL[dtype])
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(lse_ref))
    np.testing.assert_allclose(lse, lse_ref, **TOL[dtype])


BLOCKS = [(1, 1), (3, 5), (4, 2), (64, 64), (2, 100)]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("block_q, block_k", BLOCKS)
def test_tile_sizes_match_reference(rng, dtype, block_q, block_k):
    q, k, v = qkv(rng, dtype)
    got = tiled(q, k, v, block_q=block_q, block_k=block_k)
    assert_same(got, reference(q, k, v), dtype)


@pytest.mark.parametrize("block_q, block_k", BLOCKS)
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("t, s", [(T, S), (S, T), (7, 7)])
def test_causal_both_alignments(rng, block_q, block_k, alignment, t, s):
    # With T > S and top-left... every row has a key; bottom-right with T > S leaves the first
    # T - S rows without any key: out 0, lse -inf.
    q, k, v = qkv(rng, t=t, s=s)
    kw = dict(causal_alignment=alignment)
    got = tiled(q, k, v, None, True, block_q=block_q, block_k=block_k, **kw)
    assert_same(got, reference(q, k, v, None, True, **kw))


WINDOWS = [(0, 0), (2, 0), (1, 3), (None, 1), (3, None), (20, 20)]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_windows(rng, window, is_causal, alignment):
    q, k, v = qkv(rng)
    kw = dict(window=window, causal_alignment=alignment)
    for block_q, block_k in [(1, 1), (3, 2), (4, 5)]:
        got = tiled(q, k, v, None, is_causal, block_q=block_q, block_k=block_k, **kw)
        assert_same(got, reference(q, k, v, None, is_causal, **kw))


MASK_SHAPES = [
    (S,),
    (T, S),
    (1, S),
    (H, 1, S),
    (H, T, S),
    (B, 1, 1, S),
    (B, 1, T, S),
    (B, H, 1, S),
    (B, H, T, S),
    (1, 1, T, 1),
]


@pytest.mark.parametrize("shape", MASK_SHAPES)
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_every_mask_shape(rng, shape, kind):
    q, k, v = qkv(rng)
    if kind == "bool":
        mask = rng.random(shape) < 0.6
    else:
        mask = normal(rng, shape)
        mask[rng.random(shape) < 0.3] = -np.inf
    for is_causal in (False, True):
        for block_q, block_k in [(1, 1), (4, 3), (64, 64)]:
            got = tiled(q, k, v, mask, is_causal, block_q=block_q, block_k=block_k)
            assert_same(got, reference(q, k, v, mask, is_causal))


def test_rows_fully_masked_inside_some_tiles(rng):
    # Keys come in tiles of 4: 0-3, 4-7, 8-10. Row 0 may see key 9 only (its first two tiles
    # are entirely masked for it, while other rows of the same tiles are not), row 1 only key 0
    # (masked in the later tiles), row 2 nothing at all (out 0, lse -inf), row 3 keys 3 and 4
    # (one key on each side of a tile boundary).
    q, k, v = qkv(rng)
    mask = rng.random((T, S)) < 0.5
    mask[0] = False
    mask[0, 9] = True
    mask[1] = False
    mask[1, 0] = True
    mask[2] = False
    mask[3] = False
    mask[3, [3, 4]] = True
    want = reference(q, k, v, mask)
    for block_q, block_k in [(1, 4), (3, 4), (T, 4), (2, 1)]:
        got = tiled(q, k, v, mask, block_q=block_q, block_k=block_k)
        assert_same(got, want)
    out, lse = got
    np.testing.assert_array_equal(out[..., 2, :], 0.0)
    np.testing.assert_array_equal(lse[..., 2], -np.inf)
    # Row 0 attends key 9 alone: its output is value 9, its lse the scaled score of key 9.
    np.testing.assert_allclose(out[..., 0, :], v[..., 9, :], rtol=1e-12, atol=1e-12)
    score = np.einsum("bhd,bhd->bh", q[..., 0, :], k[..., 9, :]) / np.sqrt(DK)
    np.testing.assert_allclose(lse[..., 0], score, rtol=1e-12)


def test_float_bias_with_minus_inf_and_large_values(rng):
    # A bias whose rows are -inf in whole tiles, and float32 scores around 1e4: no overflow,
    # no NaN, no warning (pytest turns warnings into errors).
    q, k, v = qkv(rng, np.float32)
    q *= 300.0
    bias = np.zeros((T, S), dtype=np.float32)
    bias[:, :6] = -np.inf
    bias[5] = -np.inf
    got = tiled(q, k, v, bias, block_q=3, block_k=3)
    assert_same(got, reference(q, k, v, bias), np.float32)
    assert np.isneginf(got[1][..., 5]).all()


@pytest.mark.parametrize("hkv", [1, 3])
@pytest.mark.parametrize("mask_shape", [None, (6, T, S), (B, 6, 1, S), (1, S)])
def test_grouped_query_attention(rng, hkv, mask_shape):
    q, k, v = qkv(rng, hq=6, hkv=hkv)
    mask = None if mask_shape is None else rng.random(mask_shape) < 0.7
    for is_causal in (False, True):
        for block_q, block_k in [(1, 1), (4, 3), (32, 32)]:
            kw = dict(enable_gqa=True)
            got = tiled(q, k, v, mask, is_causal, block_q=block_q, block_k=block_k, **kw)
            assert_same(got, reference(q, k, v, mask, is_causal, **kw))


def test_broadcast_heads_and_batch(rng):
    # Without enable_gqa: one key/value head broadcast to every query head (multi-query
    # attention), and a batch axis of size one in the queries.
    q = normal(rng, (1, 4, T, DK))
    k = normal(rng, (B, 1, S, DK))
    v = normal(rng, (B, 1, S, DV))
    for block_q, block_k in [(2, 3), (64, 64)]:
        got = tiled(q, k, v, None, True, block_q=block_q, block_k=block_k)
        assert_same(got, reference(q, k, v, None, True))


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_dtypes_are_preserved(rng, dtype):
    q, k, v = qkv(rng, dtype)
    got = tiled(q, k, v, None, True, block_q=4, block_k=3)
    assert got[0].dtype == dtype and got[1].dtype == np.promote_types(dtype, np.float32)
    assert_same(got, reference(q, k, v, None, True), dtype)


def test_integer_and_mixed_inputs(rng):
    q = rng.integers(-3, 4, (T, DK))
    k = rng.integers(-3, 4, (S, DK))
    v = rng.integers(-3, 4, (S, DV))
    got = tiled(q, k, v, block_q=4, block_k=3)
    assert got[0].dtype == np.float64
    assert_same(got, reference(q, k, v))
    q32 = q.astype(np.float32)
    got = tiled(q32, k.astype(np.float64), v.astype(np.float32), block_q=4, block_k=3)
    assert got[0].dtype == np.float64
    assert_same(got, reference(q32, k.astype(np.float64), v.astype(np.float32)))


@pytest.mark.parametrize(
    "t, s, dk, dv", [(0, S, DK, DV), (T, 0, DK, DV), (T, S, 0, DV), (T, S, DK, 0), (1, 1, 1, 1)]
)
def test_empty_sizes(rng, t, s, dk, dv):
    q, k, v = qkv(rng, t=t, s=s, dk=dk, dv=dv)
    got = tiled(q, k, v, None, False, block_q=4, block_k=3)
    want = reference(q, k, v)
    assert_same(got, want)
    if s == 0:
        np.testing.assert_array_equal(got[0], 0.0)
        np.testing.assert_array_equal(got[1], -np.inf)


def test_empty_batch(rng):
    q, k, v = (np.zeros((0, H, T, DK)), np.zeros((0, H, S, DK)), np.zeros((0, H, S, DV)))
    out, lse = tiled(q, k, v, block_q=4, block_k=3)
    assert out.shape == (0, H, T, DV) and lse.shape == (0, H, T)


def test_nan_in_a_masked_out_key_does_not_spread(rng):
    q, k, v = qkv(rng)
    k[..., S - 1, :] = np.nan
    mask = np.arange(S) < S - 1
    out, lse = tiled(q, k, v, mask, block_q=4, block_k=3)
    assert np.isfinite(out).all() and np.isfinite(lse).all()
    assert_same((out, lse), reference(q, k, v, mask))


def test_thread_counts_give_identical_results(rng):
    # Work units are independent, so the result does not depend on the number of threads,
    # not even in the last bit.
    q, k, v = qkv(rng, np.float32, t=150, s=140)
    one = tiled(q, k, v, None, True, block_q=8, block_k=16, num_threads=1)
    two = tiled(q, k, v, None, True, block_q=8, block_k=16, num_threads=2)
    three = tiled(q, k, v, None, True, block_q=8, block_k=16, num_threads=3)
    for a, b in zip(one, two):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(one, three):
        np.testing.assert_array_equal(a, b)


def test_inputs_are_not_modified_and_views_work(rng):
    q, k, v = qkv(rng)
    kt = np.ascontiguousarray(np.swapaxes(k, -1, -2))
    k_view = np.swapaxes(kt, -1, -2)  # non-contiguous
    q_view = q[..., ::-1, :]
    for a in (q, kt, v):
        a.flags.writeable = False
    copies = [a.copy() for a in (q, kt, v)]
    got = tiled(q_view, k_view, v, None, True, block_q=4, block_k=3)
    assert_same(got, reference(q_view, k_view, v, None, True))
    for a, c in zip((q, kt, v), copies):
        np.testing.assert_array_equal(a, c)


# -- tiles that are skipped ------------------------------------------------------------------


def band_touches(mask, block_q, block_k):
    """Independent count: tiles of a (T, S) bool mask that hold at least one True."""
    t, s = mask.shape
    n = 0
    for a in range(0, t, block_q):
        for b in range(0, s, block_k):
            n += bool(mask[a : a + block_q, b : b + block_k].any())
    return n


@pytest.mark.parametrize(
    "t, s, is_causal, window, alignment",
    [
        (64, 64, True, None, "top_left"),
        (40, 64, True, None, "bottom_right"),
        (64, 40, True, None, "top_left"),
        (64, 64, False, (8, 0), "top_left"),
        (64, 64, False, (5, 9), "bottom_right"),
        (50, 70, True, (16, None), "top_left"),
    ],
)
@pytest.mark.parametrize("block_q, block_k", [(8, 8), (5, 7), (16, 4)])
def test_tiles_outside_the_band_are_skipped(
    rng, t, s, is_causal, window, alignment, block_q, block_k
):
    if window is None:
        band = causal_mask(t, s, alignment=alignment)
    else:
        band = sliding_window_mask(t, s, window, alignment=alignment)
        if is_causal:
            band &= causal_mask(t, s, alignment=alignment)
    q, k, v = (normal(rng, (t, DK)), normal(rng, (s, DK)), normal(rng, (s, DV)))
    stats = TileStats()
    kw = dict(window=window, causal_alignment=alignment)
    got = tiled(q, k, v, None, is_causal, block_q=block_q, block_k=block_k, stats=stats, **kw)
    assert_same(got, reference(q, k, v, None, is_causal, **kw))
    n_tiles = -(-t // block_q) * -(-s // block_k)
    assert stats.computed == band_touches(band, block_q, block_k)
    assert stats.skipped_band == n_tiles - stats.computed
    assert stats.skipped_band > 0
    # The public map agrees: 0 where the band is empty, 2 where it is full, 1 in between.
    kinds = tile_map(t, s, block_q=block_q, block_k=block_k, is_causal=is_causal, **kw)
    for a in range(kinds.shape[0]):
        for b in range(kinds.shape[1]):
            tile = band[a * block_q : (a + 1) * block_q, b * block_k : (b + 1) * block_k]
            expected = 2 if tile.all() else (1 if tile.any() else 0)
            assert kinds[a, b] == expected, (a, b)


def test_tiles_a_padding_mask_disallows_are_skipped(rng):
    # Sequence 0 has 5 real keys out of 16, sequence 1 all 16: with tiles of 4 keys, two of
    # sequence 0's four key tiles hold only padding and are dropped.
    q, k, v = (normal(rng, (2, 1, 8, DK)), normal(rng, (2, 1, 16, DK)), normal(rng, (2, 1, 16, DV)))
    mask = sdpa.padding_mask([5, 16], 16)
    stats = TileStats()
    got = tiled(q, k, v, mask, block_q=8, block_k=4, stats=stats)
    assert_same(got, reference(q, k, v, mask))
    assert stats.skipped_mask == 2
    assert stats.computed == 8 - 2


def test_tile_map_errors():
    with pytest.raises(ValueError, match="block_q must be a positive integer; got 0"):
        tile_map(4, 4, block_q=0, block_k=2)
    with pytest.raises(TypeError, match="is_causal must be a bool; got 'yes'"):
        tile_map(4, 4, block_q=2, block_k=2, is_causal="yes")
    with pytest.raises(TypeError, match="block_k must be a positive integer; got 2.5"):
        tile_map(4, 4, block_q=2, block_k=2.5)


# -- the dispatcher -----------------------------------------------------------------------


@pytest.fixture
def spy(monkeypatch):
    """Count calls of the tiled path made by scaled_dot_product_attention."""
    calls = []
    real = attention_module.attention_tiled

    def counting(problem, **kwargs):
        calls.append(problem.scores_shape)
        return real(problem, **kwargs)

    monkeypatch.setattr(attention_module, "attention_tiled", counting)
    return calls


def test_the_public_call_runs_the_tiled_path_on_the_threads_the_model_picks(rng, monkeypatch):
    # On two cores, "auto": one causal head of 1024 x 1024 scores on one thread (its work does
    # not repay a second thread's start, see tests/sdpa/test_cost_model.py), eight of 2048 on
    # two; implementation="tiled" on all cores (num_threads left to attention_tiled). The
    # result is the reference's either way.
    import sdpa.cost_model

    monkeypatch.setattr(sdpa.cost_model, "default_num_threads", lambda: 2)
    threads = []
    real = attention_module.attention_tiled

    def spying(problem, **kwargs):
        threads.append(kwargs.get("num_threads"))
        return real(problem, **kwargs)

    monkeypatch.setattr(attention_module, "attention_tiled", spying)
    small, large = normal(rng, (1, 1024, 64), np.float32), normal(rng, (8, 2048, 64), np.float32)
    for x, implementation in ((small, "auto"), (large, "auto"), (small, "tiled")):
        kw = dict(is_causal=True)
        got = scaled_dot_product_attention(x, x, x, implementation=implementation, **kw)
        want = scaled_dot_product_attention(x, x, x, implementation="reference", **kw)
        np.testing.assert_allclose(got, want, **TOL[np.float32])
    assert threads == [1, 2, None]


def test_auto_takes_the_tiled_path_for_large_problems(rng, spy):
    q = normal(rng, (1, 2, 512, 16), np.float32)
    out = scaled_dot_product_attention(q, q, q, is_causal=True)
    assert spy == [(1, 2, 512, 512)]
    ref = scaled_dot_product_attention(q, q, q, is_causal=True, implementation="reference")
    np.testing.assert_allclose(out, ref, **TOL[np.float32])
    assert len(spy) == 1


def test_auto_keeps_the_reference_path_for_weights_dropout_and_small_problems(rng, spy):
    q = normal(rng, (1, 2, 512, 16), np.float32)
    scaled_dot_product_attention(q, q, q, return_weights=True)
    scaled_dot_product_attention(q, q, q, dropout_p=0.1, rng=np.random.default_rng(0))
    scaled_dot_product_attention(q[..., :8, :], q[..., :8, :], q[..., :8, :])
    assert spy == []
    scaled_dot_product_attention(q[..., :8, :], q, q, implementation="tiled")
    assert spy == [(1, 2, 8, 512)]


def test_auto_keeps_many_small_heads_on_the_reference_path(rng, spy):
    # 20000 heads of 4 x 4 scores: 320000 scores, above the old threshold, but 20000 work units
    # of 16 scores each; the tiled path was 32 times slower than the reference path.
    q = normal(rng, (20000, 4, 8), np.float32)
    out = scaled_dot_product_attention(q, q, q)
    assert spy == []
    want = scaled_dot_product_attention(q, q, q, implementation="reference")
    np.testing.assert_array_equal(out, want)


@pytest.mark.parametrize("heads, S", [(8, 16384), (64, 4096), (64, 16384)])
def test_auto_decodes_on_the_reference_path(rng, spy, heads, S):
    # One new token against a long cache: the tiled path pays its per-tile Python overhead on
    # tiles of one row, and was 1.7 to 2.1 times slower than the reference path (B=1, H=64,
    # S=4096: 37.5 ms against 21.5 ms). Through KVCache.attend too.
    q = normal(rng, (1, heads, 1, 64), np.float32)
    k = normal(rng, (1, heads, S, 64), np.float32)
    out = scaled_dot_product_attention(q, k, k, is_causal=True, causal_alignment="bottom_right")
    assert spy == []
    cache = sdpa.KVCache(1, heads, 64, dtype=np.float32, capacity=S)
    cache.append(0, k, k)
    np.testing.assert_array_equal(cache.attend(0, q), out)
    assert spy == []


@pytest.mark.parametrize("Hq, S", [(32, 4096), (32, 16384), (64, 2048), (64, 4096)])
def test_auto_decodes_grouped_queries_on_the_reference_path(rng, spy, Hq, S):
    # Issue 34: one token, Hq query heads over 8 key heads. The reference path's one-row
    # products stream each key head once for its group; the tiled path's units of Hq / 8 rows
    # pay per tile. 32 over 8 at S = 4096: reference 4.7 ms, tiled 6.8 to 8.8 ms, and auto
    # took the tiled path (2-core Xeon).
    q = normal(rng, (1, Hq, 1, 64), np.float32)
    k, v = (normal(rng, (1, 8, S, 64), np.float32) for _ in range(2))
    out = scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert spy == []
    heads = np.repeat(np.arange(8), Hq // 8)  # query head h reads key head h // (Hq / 8)
    want = scaled_dot_product_attention(q, k[:, heads], v[:, heads], implementation="tiled")
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


def test_auto_tiles_one_query_row_over_one_long_key_head(rng, spy):
    # 32 query heads over one key head (multi-query attention), S = 16384: the tiled path's
    # single unit holds 32 rows, and it was 4 to 10 times as fast as the reference path.
    q = normal(rng, (1, 32, 1, 64), np.float32)
    k = normal(rng, (1, 1, 16384, 64), np.float32)
    scaled_dot_product_attention(q, k, k, enable_gqa=True)
    assert spy == [(1, 1, 32, 1, 16384)]


@pytest.mark.parametrize(
    "shape, mask_shape, kw",
    [
        ((2, 3, 300, 16), None, {}),
        ((1, 2, 700, 8), None, dict(is_causal=True)),
        ((3, 500, 8), None, dict(window=(100, 0), causal_alignment="bottom_right")),
        ((2, 4, 90, 8), None, dict(enable_gqa=True)),
        ((5, 40, 8), (5, 40, 40), {}),
        ((256, 40, 8), None, dict(is_causal=True)),  # 16 heads to a unit, a tile each a step
        ((1, 3, 1024, 8), None, dict(is_causal=True)),  # diagonals in squares
        ((2, 4, 768, 8), None, dict(is_causal=True, enable_gqa=True)),  # squares, 2 heads folded
        ((1, 2, 512, 8), None, dict(is_causal=True, causal_alignment="bottom_right")),
        ((2, 1024, 8), (2, 1024, 1024), dict(is_causal=True)),  # a mask: strips
        # float32: keys before a diagonal in squares in pieces of BLOCK_K, two tiles each
        ((1, 1, 2048, 8), None, dict(is_causal=True, dtype=np.float32)),
        ((1, 1, 4096, 8), None, dict(is_causal=True, dtype=np.float32)),
        ((2, 1, 1000, 8), None, dict(window=(300, 0), dtype=np.float32)),
    ],
)
def test_tiling_geometry_counts_what_the_kernel_visits(rng, shape, mask_shape, kw):
    # The counts behind the "auto" rule, against the kernel's own counters.
    from sdpa.cost_model import tiling_geometry
    from sdpa.threads import default_num_threads

    q = normal(rng, shape, kw.pop("dtype", np.float64))
    k = normal(rng, shape[:-3] + (shape[-3] // 2,) + shape[-2:]) if kw.get("enable_gqa") else q
    mask = None if mask_shape is None else np.ones(mask_shape, dtype=bool)
    is_causal = kw.pop("is_causal", False)
    problem = prepare_attention(q, k, k, mask, is_causal, **kw)
    units, tiles, steps, scores, num_threads = tiling_geometry(problem)
    stats, counting = TileStats(), CountingExp()
    attention_tiled(problem, stats=stats, exp=counting)
    assert tiles == stats.computed
    assert steps == stats.steps
    assert units == stats.units
    assert num_threads == min(default_num_threads(), units)
    # scores: the entries each piece computed, counted as the kernel takes its exponential
    # (of every head of a step at once), and no fewer than the band allows
    assert scores == sum(math.prod(shape) for shape in counting.shapes)
    band = np.ones((problem.T, problem.S), dtype=bool)
    if is_causal or kw.get("window"):
        band = problem.band_mask()
    heads = int(np.prod(problem.batch_shape))
    assert scores >= heads * int(band.sum())


def test_tiling_geometry_counts_the_steps_of_a_folded_decoding_call(rng):
    # 32 query heads over 8 key heads, 2 queries against 2048 keys: one unit holds every head,
    # and computes the 8 key heads' tiles of each key block in one step.
    from sdpa.cost_model import tiling_geometry

    q = normal(rng, (1, 32, 2, 16))
    k = normal(rng, (1, 8, 2048, 16))
    problem = prepare_attention(q, k, k, None, False, enable_gqa=True)
    units, tiles, steps, _, _ = tiling_geometry(problem)
    stats = TileStats()
    attention_tiled(problem, stats=stats)
    assert (units, tiles, steps) == (stats.units, stats.computed, stats.steps)
    assert stats.computed == 8 * stats.steps  # 2048 keys in tiles of BLOCK_K, 8 key heads each


def test_implementation_errors(rng):
    q = normal(rng, (4, 3))
    with pytest.raises(ValueError, match="implementation must be 'auto', 'reference' or 'tiled'"):
        scaled_dot_product_attention(q, q, q, implementation="flash")
    with pytest.raises(ValueError, match="never forms the attention weights"):
        scaled_dot_product_attention(q, q, q, implementation="tiled", return_weights=True)
    with pytest.raises(ValueError, match="dropout_p=0.5"):
        scaled_dot_product_attention(
            q, q, q, dropout_p=0.5, implementation="tiled", rng=np.random.default_rng(0)
        )


def test_public_api_returns_lse_from_the_tiled_path(rng):
    q, k, v = qkv(rng, np.float32, hq=4, hkv=2)
    got = scaled_dot_product_attention(
        q, k, v, is_causal=True, enable_gqa=True, implementation="tiled", return_lse=True
    )
    want = reference(q, k, v, None, True, enable_gqa=True)
    assert_same(got, want, np.float32)


@pytest.mark.torch
def test_tiled_agrees_with_pytorch(torch, rng):
    q, k, v = qkv(rng, np.float32, t=200, s=300, hq=4, hkv=2)
    ours = scaled_dot_product_attention(
        q,
        k,
        v,
        is_causal=True,
        enable_gqa=True,
        causal_alignment="bottom_right",
        implementation="tiled",
    )
    from torch.nn.attention.bias import causal_lower_right

    tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
    theirs = torch.nn.functional.scaled_dot_product_attention(
        tq, tk, tv, attn_mask=causal_lower_right(200, 300), enable_gqa=True
    ).numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


# -- large negative float biases (the Hugging Face convention) ------------------------------
#
# The running shift m used to be folded into the first matrix product even when it came from
# a tile whose every key carried a huge negative bias; the product then rounded q.k away (max
# error 0.31 in float32 on the reproducer below). The expected values here come from PyTorch
# and from the reference path, which forms the scores exactly as the formula says.


def biased_problem(dtype, fill, pattern, rng, *, t=8, s=1200, heads=2):
    """q (heads, t, 16), k and v (heads, s, 16), and a (heads, t, s) bias of 0 and ``fill``."""
    q, k, v = (normal(rng, (heads, n, 16), dtype) for n in (t, s, s))
    bias_dtype = np.float32 if dtype == np.float16 else dtype  # float16 cannot hold -1e9
    bias = np.zeros((heads, t, s), dtype=bias_dtype)
    if pattern == "first tile":  # left padding: the first keys are masked for every row
        bias[..., : s // 2] = fill
    elif pattern == "last tile":
        bias[..., s // 2 :] = fill
    elif pattern == "every tile":  # rows with nothing but the fill: still a proper softmax
        bias[...] = fill
    elif pattern == "mixed":  # per head, per row and per tile
        bias[0, ::2, : s // 3] = fill
        bias[0, 1::2] = fill
        bias[1, :, s // 3 : 2 * s // 3] = fill
        bias[1, 3, -5:] = 0.0
        bias[1, 0] = fill
    return q, k, v, bias


FILLS = [
    pytest.param(None, id="finfo.min"),  # the inputs' own dtype's finfo.min
    pytest.param(-1e9, id="-1e9"),
    pytest.param(-1e30, id="-1e30"),
    pytest.param(-1e4, id="-1e4"),
]
PATTERNS = ["first tile", "last tile", "every tile", "mixed"]


def assert_as_accurate(got, want, exact, dtype):
    """``got`` is at most twice as far from ``exact`` as ``want`` is, plus the usual tolerance.

    In float32 a bias of -1e4 rounds every score of its row to a multiple of 2**-10, and the
    last bit of q.k (which BLAS computes in a shape-dependent order) decides some of those
    roundings: no two implementations agree beyond that, so they are compared by accuracy.
    """
    for g, w, e in zip(got, want, exact):
        assert g.dtype == w.dtype and g.shape == w.shape and not np.isnan(g).any()
        np.testing.assert_array_equal(np.isneginf(g), np.isneginf(w))
        finite = np.isfinite(w)
        e = e.astype(np.float64)[finite]
        error_want = np.abs(w[finite].astype(np.float64) - e)
        error_got = np.abs(g[finite].astype(np.float64) - e)
        tol = TOL[dtype]["atol"] + TOL[dtype]["rtol"] * np.abs(e)
        assert (error_got <= 2 * error_want.max() + tol).all()


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
@pytest.mark.parametrize("fill", FILLS)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_large_negative_bias_matches_the_reference(rng, dtype, fill, pattern):
    fill = float(np.finfo(dtype).min) if fill is None else fill
    q, k, v, bias = biased_problem(dtype, fill, pattern, rng)
    want = reference(q, k, v, bias)
    exact = reference(*(a.astype(np.float64) for a in (q, k, v, bias)))
    for block_q, block_k in [(None, None), (3, 100), (8, 1200)]:
        got = tiled(q, k, v, bias, block_q=block_q, block_k=block_k)
        if dtype == np.float64:
            assert_same(got, want, dtype)
        else:
            assert_as_accurate(got, want, exact, dtype)


@pytest.mark.torch
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("fill", FILLS)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_large_negative_bias_is_as_accurate_as_the_reference_against_torch(
    torch, rng, dtype, fill, pattern
):
    fill = float(np.finfo(dtype).min) if fill is None else fill
    q, k, v, bias = biased_problem(dtype, fill, pattern, rng)
    theirs = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(a) for a in (q, k, v, bias))
    ).numpy()
    ours = scaled_dot_product_attention(q, k, v, bias, implementation="reference")
    til = scaled_dot_product_attention(q, k, v, bias, implementation="tiled")
    floor = {np.float32: 1e-6, np.float64: 1e-14}[dtype]
    error_reference = np.abs(ours - theirs).max()
    assert error_reference <= 10 * floor  # the reference path itself agrees with torch
    assert np.abs(til - theirs).max() <= max(2 * error_reference, 10 * floor)


def test_left_padding_with_a_finfo_min_bias_matches_the_reference(rng):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 8, 16)).astype(np.float32)
    k = rng.standard_normal((1, 1200, 16)).astype(np.float32)
    v = rng.standard_normal((1, 1200, 16)).astype(np.float32)
    b = np.zeros((8, 1200), np.float32)
    b[:, :600] = np.finfo(np.float32).min
    ref = scaled_dot_product_attention(q, k, v, b, implementation="reference")
    til = scaled_dot_product_attention(q, k, v, b, implementation="tiled")
    np.testing.assert_allclose(til, ref, rtol=1e-5, atol=1e-6)  # was 0.31 apart
    # and the keys under the fill get no weight: the same as attending keys 600: only
    alone = scaled_dot_product_attention(q, k[:, 600:], v[:, 600:], implementation="reference")
    np.testing.assert_allclose(til, alone, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_rows_under_a_uniform_huge_bias_get_the_uniform_softmax(dtype):
    # Every key of the row carries finfo.min: scale q.k is below the spacing of finfo.min, so
    # every score rounds to finfo.min and the softmax is uniform (hand-computed: out = the
    # mean of the values, lse = finfo.min + log S rounds to finfo.min).
    q = np.full((3, 4), 0.5, dtype)
    k = np.linspace(-1, 1, 40, dtype=dtype).reshape(10, 4)
    v = np.arange(20, dtype=dtype).reshape(10, 2)
    bias = np.full((3, 10), np.finfo(dtype).min, dtype)
    for block_k in (1, 3, 10):
        out, lse = tiled(q, k, v, bias, block_q=2, block_k=block_k)
        np.testing.assert_allclose(out, np.broadcast_to(v.mean(0), (3, 2)), rtol=1e-6)
        np.testing.assert_array_equal(lse, np.finfo(dtype).min)


# -- keys and values shared across the batch ------------------------------------------------


def test_keys_and_values_shared_across_the_batch_minimal():
    q = np.zeros((2, 2, 1, 1))
    k = v = np.zeros((2, 1, 1))
    out = scaled_dot_product_attention(q, k, v, implementation="tiled")  # raised before
    np.testing.assert_array_equal(out, np.zeros((2, 2, 1, 1)))


@pytest.mark.parametrize("is_causal", [False, True])
def test_keys_and_values_shared_across_the_batch(rng, is_causal):
    q = normal(rng, (2, 8, 256, 16))  # (B, H, T, Dk)
    k = normal(rng, (8, 256, 16))  # (H, S, Dk): the same for every batch element
    v = normal(rng, (8, 256, 12))
    got = scaled_dot_product_attention(q, k, v, is_causal=is_causal, return_lse=True)
    assert_same(got, reference(q, k, v, None, is_causal))
    for block_q, block_k in [(5, 7), (300, 300)]:
        got = tiled(q, k, v, None, is_causal, block_q=block_q, block_k=block_k)
        assert_same(got, reference(q, k, v, None, is_causal))


# -- overflow, NaN rows and float16 log-sum-exp ---------------------------------------------


@pytest.mark.parametrize("implementation", ["reference", "tiled"])
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_scores_that_overflow_raise_on_both_paths(implementation, sign):
    # q = k = 1e200: every score is 1e400 * 8 / sqrt(8), beyond float64. The reference path
    # returned a "limit", the tiled path NaN; with k = -q the scores overflow to -inf and the
    # rows were reported as fully masked. Both paths now refuse, naming query and key.
    q = np.full((1, 4, 8), 1e200)
    with pytest.raises(ValueError, match=r"query and key give scores .* range of float64"):
        scaled_dot_product_attention(q, sign * q, q, implementation=implementation)


@pytest.mark.parametrize("implementation", ["reference", "tiled"])
def test_scores_that_overflow_float32_raise(implementation):
    q = np.full((3, 4), 3e19, np.float32)  # q.k = 3.6e39 > 3.4e38
    with pytest.raises(ValueError, match=r"beyond the range of float32 .* or pass float64"):
        scaled_dot_product_attention(q, q, q, implementation=implementation)


@pytest.mark.parametrize("implementation", ["reference", "tiled"])
def test_large_finite_scores_that_fit_are_exact(implementation):
    # Close to the limit but representable: no error, and the hand-computed answer. Scores
    # 1e300 * [1, 0.5] on two keys: the first key takes all the weight.
    q = np.array([[1e150, 0.0]])
    k = np.array([[1e150, 0.0], [0.5e150, 0.0]])
    v = np.array([[1.0], [2.0]])
    out, lse = scaled_dot_product_attention(
        q, k, v, scale=1.0, implementation=implementation, return_lse=True
    )
    np.testing.assert_array_equal(out, [[1.0]])
    np.testing.assert_allclose(lse, [1e300], rtol=1e-15)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(
    "offset, redone, rescaled",
    [
        (-19.0, 0, 0),  # row sum about 40 exp(-19) > exp(-20): the shift 0 stands
        (-200.0, 1, 1),  # exp(-200) is 0 in float32, tiny in float64: redone from an exact step
        (50.0, 0, 1),  # exp(50) > exp(20): the first tile moves the shift
    ],
)
def test_the_shift_zero_holds_only_near_zero(rng, dtype, offset, redone, rescaled):
    # Without a mask a work unit first tries the shift m = 0 for every row, which is exact
    # while the row's scores stay within LAZY_MARGIN (20) of zero. Row 0's scores here are
    # `offset` plus noise of size about 1, the other rows' scores are of size 1; the answer
    # is the float64 loop's either way.
    k = rng.standard_normal((40, 4))
    k[:, 0] = 1.0
    q = rng.standard_normal((6, 4))
    q[0, 0] = 2 * offset  # scale 1/2: scores offset + (noise . k[:, 1:]) / 2
    v = rng.standard_normal((40, 3))
    want_out, _, want_lse = attention_loop_2d(q, k, v)
    stats = TileStats()
    problem = prepare_attention(*(a.astype(dtype) for a in (q, k, v)))
    out, lse = attention_tiled(problem, block_q=8, block_k=16, stats=stats)
    # A row far below zero is seen after the first tile: the unit is redone having wasted one.
    assert (stats.units, stats.computed, stats.redone) == (1, 3 + redone, redone)
    assert stats.rescaled == rescaled
    # A score of size |s| is rounded to within eps |s| / 2 (on the reference path too), and
    # its exponential inherits that relative error: at |s| = 200 that is more than TOL.
    rtol = max(TOL[dtype]["rtol"], 2 * np.finfo(dtype).eps * abs(offset))
    np.testing.assert_allclose(out, want_out, rtol=rtol, atol=TOL[dtype]["atol"])
    np.testing.assert_allclose(lse, want_lse, rtol=TOL[dtype]["rtol"])
    ref_out = scaled_dot_product_attention(
        *(a.astype(dtype) for a in (q, k, v)), implementation="reference"
    )
    ref_err = np.abs(ref_out - want_out).max()
    assert np.abs(out - want_out).max() <= max(2 * ref_err, TOL[dtype]["atol"])


@pytest.mark.parametrize("exp", [np.exp, np.exp2])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("kind", ["none", "causal", "bool", "float"])
def test_base_e_and_base_2_both_give_the_reference(rng, exp, dtype, kind):
    # With exp=np.exp2 the scores are computed in base 2 (a float mask falls back to base e);
    # lse, and m + log(ell) with return_stats, are in natural units either way.
    q, k, v = qkv(rng, dtype, t=70, s=90)
    mask = None
    if kind == "bool":
        mask = rng.random((70, 90)) < 0.8
    elif kind == "float":
        mask = np.where(rng.random((70, 90)) < 0.8, rng.standard_normal((70, 90)), -1e9)
    problem = prepare_attention(q, k, v, mask, kind == "causal")
    out, lse, m, ell = attention_tiled(problem, block_q=16, block_k=32, exp=exp, return_stats=True)
    assert_same(problem.finish(out, lse=lse), reference(q, k, v, mask, kind == "causal"), dtype)
    np.testing.assert_allclose(m + np.log(ell), lse, **TOL[dtype])


@pytest.mark.parametrize("size, retried", [(1.0, 0), (6.0, 24)])
def test_a_unit_that_fails_the_shift_zero_wastes_at_most_its_first_tile(rng, size, retried):
    # 6 heads of 64 queries in blocks of 16: 24 units, one key tile each (64 keys, shorter than
    # a tile: short rows are not folded, see sdpa.tiles.band.heads_per_unit). With scores of
    # size 1 the shift 0 always holds; with scores of size about 36 every unit's first tile
    # fails the lazy step (counted in `retried`) and takes the exact step, each on its own.
    q, k, v = (size * rng.standard_normal((6, 64, 8)) for _ in range(3))
    stats = TileStats()
    problem = prepare_attention(q, k, v)
    out, lse = attention_tiled(problem, block_q=16, block_k=64, num_threads=1, stats=stats)
    assert (stats.units, stats.computed, stats.retried) == (24, 24, retried)
    assert stats.rescaled == (0 if size == 1.0 else 24)
    assert_same(problem.finish(out, lse=lse), reference(q, k, v))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_units_do_not_depend_on_the_units_before_them(rng, dtype):
    # Heads whose scores alternate between size 1 (the shift 0 holds) and size about 40 (it
    # fails): a unit must compute the same bits whichever units its worker ran before, so the
    # result is the same for every thread count and every order the threads take units in.
    q, k, v = (rng.standard_normal((6, 96, 8)) for _ in range(3))
    q[::2] *= 6.5
    k[::2] *= 6.5
    problem = prepare_attention(*(a.astype(dtype) for a in (q, k, v)))
    want = attention_tiled(problem, block_q=16, block_k=32, num_threads=1)
    for num_threads in (2, 3, 5):
        for _ in range(3):
            got = attention_tiled(problem, block_q=16, block_k=32, num_threads=num_threads)
            for g, w in zip(got, want):
                np.testing.assert_array_equal(g, w)


def cpu_has_avx512_skx() -> bool:
    """The AVX-512 subsets NumPy's SKX loops need, read from /proc/cpuinfo (Linux only)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = next(line for line in f if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return False
    return {"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"} <= set(flags)


def test_tile_exponential_follows_the_machine():
    # exp2 only in float32, and only where the CPU has AVX-512 (NumPy's SVML loops), unless
    # the environment turns NumPy's AVX-512 loops off.
    assert tile_exponential(np.float64) is np.exp
    assert tile_exponential("float64") is np.exp
    disabled = os.environ.get("NPY_DISABLE_CPU_FEATURES", "")
    if not disabled and sys.platform == "linux":
        assert svml_exp2() == cpu_has_avx512_skx()
    assert tile_exponential(np.float32) is (np.exp2 if svml_exp2() else np.exp)


CHOICE = """
import time, numpy as np
from sdpa.tuning import tile_exponential
def no_clock(*args):
    raise AssertionError("the exponential was chosen by a timing")
time.perf_counter = time.perf_counter_ns = time.monotonic = time.time = no_clock
print(tile_exponential(np.float32).__name__, tile_exponential(np.float64).__name__)
"""


def run_python(code: str, **env) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


def test_the_exponential_is_chosen_without_a_clock_and_alike_in_every_process():
    # A timing taken in the user's process flipped the choice under load (and with it every
    # tiled result's bits); the choice must come from what the machine is.
    here = [tile_exponential(np.float32).__name__, tile_exponential(np.float64).__name__]
    for _ in range(3):
        assert run_python(CHOICE) == here


def test_without_numpys_avx512_loops_the_exponential_is_exp():
    if not svml_exp2():
        assert tile_exponential(np.float32) is np.exp
        return
    # NumPy 2 names the AVX-512 level X86_V4 (1.x: AVX512_SKX); the later levels go with it.
    off = (
        "X86_V4 AVX512_ICL AVX512_SPR"
        if np.__version__ >= "2"
        else "AVX512_SKX AVX512_CLX AVX512_CNL AVX512_ICL AVX512_SPR"
    )
    assert run_python(CHOICE, NPY_DISABLE_CPU_FEATURES=off) == ["exp", "exp"]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_tiled_result_has_the_same_bits_in_another_process(dtype):
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((2, 300, 16)).astype(dtype) for _ in range(3))
    here = scaled_dot_product_attention(q, k, v, is_causal=True, implementation="tiled")
    code = f"""
import hashlib, numpy as np
from sdpa import scaled_dot_product_attention
rng = np.random.default_rng(5)
q, k, v = (rng.standard_normal((2, 300, 16)).astype(np.{np.dtype(dtype).name}) for _ in range(3))
out = scaled_dot_product_attention(q, k, v, is_causal=True, implementation="tiled")
print(hashlib.sha256(out.tobytes()).hexdigest())
"""
    import hashlib

    assert run_python(code) == [hashlib.sha256(here.tobytes()).hexdigest()]


def test_a_bias_beyond_the_working_dtype_raises():
    q = np.ones((4, 8), np.float32)
    for bad in (1e300, -1e300):
        bias = np.zeros((4, 4))  # float64, cast to float32, the working dtype
        bias[1, 2] = bad
        with pytest.raises(
            ValueError, match=r"attn_mask must fit in float32, the dtype the scores are .* got "
        ):
            scaled_dot_product_attention(q, q, q, bias)


@pytest.mark.parametrize("implementation", ["reference", "tiled"])
def test_a_nan_query_row_gives_nan_lse_on_both_paths(rng, implementation):
    q, k, v = normal(rng, (6, 4)), normal(rng, (5, 4)), normal(rng, (5, 3))
    q[2, 1] = np.nan
    out, lse = scaled_dot_product_attention(q, k, v, implementation=implementation, return_lse=True)
    assert np.isnan(lse[2]) and np.isnan(out[2]).all()  # the tiled path gave lse = -inf
    rest = [0, 1, 3, 4, 5]
    want = reference(q[rest], k, v)
    np.testing.assert_allclose(out[rest], want[0], **TOL[np.float64])
    np.testing.assert_allclose(lse[rest], want[1], **TOL[np.float64])


@pytest.mark.parametrize("implementation", ["reference", "tiled"])
def test_float16_lse_is_float32_and_the_backward_is_exact_with_it(implementation):
    # q = k = 200 in float16, D = 4: every score is 200 * 200 * 4 / 2 = 80000 > 65504. One
    # query, four keys, equal scores: weights 1/4, lse = 80000 + log 4 (hand-computed).
    q = np.full((1, 4), 200.0, np.float16)
    k = np.full((4, 4), 200.0, np.float16)
    v = np.arange(12, dtype=np.float16).reshape(4, 3)
    out, lse = scaled_dot_product_attention(q, k, v, return_lse=True, implementation=implementation)
    assert lse.dtype == np.float32
    np.testing.assert_allclose(lse, [80000 + np.log(4)], rtol=1e-7)
    np.testing.assert_array_equal(out, [v.astype(np.float32).mean(0)])
    d_out = np.ones((1, 3), np.float16)
    d_q, d_k, d_v = sdpa.scaled_dot_product_attention_backward(
        d_out, q, k, v, out=out, lse=lse, implementation=implementation
    )
    np.testing.assert_array_equal(d_v, np.full((4, 3), 0.25))  # was all zeros
    # d_scores_j = P_j (dO . v_j - dO . out) = (3 j + 3 - 6 ... ) / 4: hand-computed below
    d_scores = 0.25 * (v.astype(np.float64).sum(1) - v.astype(np.float64).mean(0).sum())
    np.testing.assert_allclose(d_q, [0.5 * (d_scores @ k.astype(np.float64))], rtol=1e-3)
    np.testing.assert_allclose(d_k, 0.5 * d_scores[:, None] * q.astype(np.float64), rtol=1e-3)


# -- values near the ends of the range -------------------------------------------------------


def float64_attention(q, k, v, is_causal=False):
    """The formula in float64 on float64 copies of the inputs: the accuracy yardstick."""
    allowed = np.tri(len(q), len(k), dtype=bool) if is_causal else None  # top-left causal
    out, _, _ = attention_loop_2d(*(np.asarray(a, np.float64) for a in (q, k, v)), allowed)
    return out


@pytest.mark.parametrize(
    "dtype, score, value, want",
    [
        (np.float32, 0.0, 3e38, 0.0),  # +3e38 on half the keys, -3e38 on the rest: NaN before
        (np.float32, 0.0, 1e37, 1e37),  # inf before
        (np.float32, 15.0, 1.5e31, 1.5e31),  # exp(15) * 1.5e31 * keys overflowed
        (np.float64, 15.0, 1e301, 1e301),
        (np.float32, -18.0, 2e-37, 2e-37),  # came back 32 % short
        (np.float32, -18.0, 3e-41, 3e-41),  # subnormal values came back as 0
        (np.float64, -18.0, 1e-310, 1e-310),
    ],
)
def test_values_near_the_ends_of_the_range_come_back_exact(dtype, score, value, want):
    # Every key has the same score, so each output is the mean of the values: hand-computed.
    S = 20 if value == 3e38 else 8
    q = np.zeros((4, 2), dtype)
    q[:, 0] = score * np.sqrt(2)  # scale 1/sqrt(2): every score is exactly `score`
    k = np.zeros((S, 2), dtype)
    k[:, 0] = 1
    v = np.full((S, 1), value, dtype)
    if value == 3e38:
        v[S // 2 :] *= -1
    for implementation in ("reference", "tiled"):
        out = scaled_dot_product_attention(q, k, v, implementation=implementation)
        finfo = np.finfo(dtype)  # subnormal results are exact to their spacing only
        atol = 4 * finfo.smallest_subnormal
        np.testing.assert_allclose(out, want, rtol=4 * finfo.eps, atol=atol)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("end", ["largest", "smallest"])
def test_the_tiled_path_is_as_accurate_as_the_reference_at_both_ends(rng, dtype, is_causal, end):
    # Random scores up to about 12 (the shift lags or leads the row maximum) and value columns
    # of random sizes near the dtype's largest or smallest normal number: each column's error
    # against the float64 formula, relative to the column's size, is within twice the
    # reference path's (or a few eps).
    finfo = np.finfo(dtype)
    T, S, Dk, Dv = 37, 300, 8, 6
    q = (2 * rng.standard_normal((T, Dk))).astype(dtype)
    k = (2 * rng.standard_normal((S, Dk))).astype(dtype)
    if end == "largest":
        sizes = float(finfo.max) / np.array([1.5, 3, 10, 1e3, 1e6, 1e9])
    else:
        sizes = float(finfo.smallest_normal) * np.array([1, 3, 10, 1e3, 1e6, 1e9])
    v = (rng.uniform(-1, 1, (S, Dv)) * sizes).astype(dtype)
    exact = float64_attention(q, k, v, is_causal)
    size = np.abs(exact).max(axis=0)
    errors = {}
    for implementation in ("reference", "tiled"):
        with np.errstate(over="raise", invalid="raise"):  # on neither path
            out = scaled_dot_product_attention(
                q, k, v, is_causal=is_causal, implementation=implementation
            )
        assert np.isfinite(out).all()
        errors[implementation] = np.abs(out.astype(np.float64) - exact).max(axis=0) / size
    bound = np.maximum(2 * errors["reference"], 16 * finfo.eps)
    assert (errors["tiled"] <= bound).all(), (errors, bound)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("is_causal", [False, True])
def test_scaling_the_values_by_a_power_of_two_scales_the_result_exactly(rng, dtype, is_causal):
    # Multiplying by 2**e is exact while nothing overflows or turns subnormal, so the tiled
    # result for v * 2**e must be the one for v times 2**e, bit for bit, up to values near
    # the largest number and down to values whose results stay normal. Scores up to about 40.
    finfo = np.finfo(dtype)
    q, k = (4 * rng.standard_normal((2, n, 8)).astype(dtype) for n in (70, 600))
    v = rng.uniform(0.5, 1, (2, 600, 5)).astype(dtype) * np.array([1, -1, 1, -1, 1], dtype)
    want = scaled_dot_product_attention(q, k, v, is_causal=is_causal, implementation="tiled")
    for e in (finfo.maxexp - 1, finfo.maxexp - 40, 1 - finfo.maxexp + 3 * finfo.nmant):
        got = scaled_dot_product_attention(
            q, k, np.ldexp(v, e), is_causal=is_causal, implementation="tiled"
        )
        np.testing.assert_array_equal(got, np.ldexp(want, e))


def test_tile_sizes_are_clipped_to_the_problem():
    # block_q = 10**9 with T = 3 sized the workers' buffers for 10**9 rows (37 GiB).
    import tracemalloc

    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal((2, n, 8)) for n in (3, 5, 5))
    tracemalloc.start()
    try:
        out, lse = tiled(q, k, v, block_q=10**9, block_k=10**9)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20
    assert_same((out, lse), reference(q, k, v))
    problem = prepare_attention(q, k, v)
    assert tiled_module.tile_plan_sizes(problem, 10**9, 10**9)[1:] == (3, 5)


class CountingExp:
    """The tiles' exponential (``numpy.exp``, so the scores are in base e), keeping the shape
    of each piece it was applied to: ``pieces`` its rows and keys, ``shapes`` all of it (the
    heads of a step too)."""

    def __init__(self):
        self.pieces, self.shapes = [], []

    def __call__(self, x, out=None):
        self.pieces.append(x.shape[-2:])
        self.shapes.append(x.shape)
        return np.exp(x, out=out)


@pytest.mark.parametrize(
    "kw, block_k, pieces",
    [
        # Causal, one unit of 64 rows, pieces of 16 keys: the piece of keys 16b:16(b+1) meets
        # the rows from 16b on, 64 - 16b of them; 160 x 16 scores rather than 64 x 64.
        (dict(is_causal=True), 16, [(64, 16), (48, 16), (32, 16), (16, 16)]),
        # Window (10, 0), query i sees keys i - 10 .. i: keys 0:16 meet rows 0:26, keys 16:32
        # rows 16:42, keys 32:48 rows 32:58, keys 48:64 rows 48:64.
        (dict(window=(10, 0)), 16, [(26, 16), (26, 16), (26, 16), (16, 16)]),
        # Causal, bottom-right aligned with 32 queries over 64 keys (query i sees keys up to
        # i + 32): keys 0:32 meet every row, keys 32:48 the rows 0:32 too, keys 48:64 rows 16:32.
        (
            dict(is_causal=True, causal_alignment="bottom_right", t=32),
            16,
            [(32, 16), (32, 16), (32, 16), (16, 16)],
        ),
    ],
)
def test_a_piece_computes_only_the_rows_its_keys_are_allowed_to(rng, kw, block_k, pieces):
    t = kw.pop("t", 64)
    q, k, v = (
        rng.standard_normal((t, 8)),
        rng.standard_normal((64, 8)),
        rng.standard_normal((64, 3)),
    )
    exp = CountingExp()
    problem = prepare_attention(q, k, v, **kw)
    out, lse = attention_tiled(problem, block_q=64, block_k=block_k, exp=exp, num_threads=1)
    assert exp.pieces == pieces
    assert_same((out, lse), reference(q, k, v, **kw))


@pytest.mark.parametrize("G", [1, 4])
@pytest.mark.parametrize("n_heads", [1, 3])
def test_strips_of_folded_heads_with_a_mask_and_sinks(rng, G, n_heads):
    # Pieces meeting a run of rows, with G query heads folded over each key head and units of
    # several heads: the run is the same rows of every folded head. A boolean mask, a window and
    # sinks on top; the first rows of each head meet no key of the mask (fully masked rows).
    hq, T_, S_ = n_heads * G, 40, 45
    q = rng.standard_normal((2, hq, T_, 8))
    k, v = rng.standard_normal((2, n_heads, S_, 8)), rng.standard_normal((2, n_heads, S_, 5))
    mask = rng.random((2, hq, T_, S_)) < 0.7
    mask[:, :, :3] = False
    sinks = rng.standard_normal((hq, 1))  # a logit per head
    kw = dict(window=(12, 2), enable_gqa=True, sinks=sinks)
    want = reference(q, k, v, mask, **kw)
    for block_q, block_k in [(40, 8), (13, 5), (7, 45)]:
        problem = prepare_attention(q, k, v, mask, **kw)
        out, lse = attention_tiled(problem, block_q=block_q, block_k=block_k)
        assert_same(problem.finish(out, lse=lse), want)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_a_causal_unit_redone_from_the_exact_step_covers_every_strip(rng, dtype):
    # Rows whose scores all lie far below 0 fail the shift 0 after the first piece; the unit is
    # walked again from the exact step, each later piece meeting fewer rows. Rows 40 on have
    # scores of size 1, rows before them about -60.
    q, k, v = (rng.standard_normal((64, 4)) for _ in range(3))
    k[:, 0] = 1.0
    q[:40, 0] = -120.0  # scale 1/2: scores about -60
    stats = TileStats()
    problem = prepare_attention(*(a.astype(dtype) for a in (q, k, v)), is_causal=True)
    out, lse = attention_tiled(problem, block_q=64, block_k=16, stats=stats)
    assert (stats.units, stats.redone) == (1, 1)
    want_out, _, want_lse = attention_loop_2d(q, k, v, np.tril(np.ones((64, 64), bool)))
    rtol = max(TOL[dtype]["rtol"], 2 * np.finfo(dtype).eps * 60)
    np.testing.assert_allclose(out, want_out, rtol=rtol, atol=TOL[dtype]["atol"])
    np.testing.assert_allclose(lse, want_lse, rtol=TOL[dtype]["rtol"])


def squares_and_strips(problem, **kw):
    """``(out, lse, m, l)`` and the counters of the tiled path with its causal diagonal in
    squares (``block_diagonal`` of ``kw``) and in strips (``block_diagonal=0``)."""
    results = []
    for diagonal in (kw.pop("block_diagonal"), 0):
        stats = TileStats()
        got = attention_tiled(
            problem, block_diagonal=diagonal, stats=stats, return_stats=True, **kw
        )
        results.append((got, stats))
    return results


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(
    "t, s, alignment, hkv, sinks",
    [
        (48, 48, "top_left", 3, False),
        (48, 60, "bottom_right", 3, False),  # the diagonal 12 keys in
        (48, 40, "top_left", 3, False),  # the last rows' diagonals past the keys: strips there
        (48, 48, "top_left", 1, True),  # three query heads folded over one key head, sinks
    ],
)
def test_causal_diagonal_in_squares_agrees_with_strips_and_the_reference(
    rng, dtype, t, s, alignment, hkv, sinks
):
    # Units of 24 rows: squares of 8 rows (block_k), pieces of 2 keys inside them.
    q, k, v = qkv(rng, dtype, t=t, s=s, hq=3, hkv=hkv)
    kw = dict(causal_alignment=alignment, enable_gqa=hkv == 1)
    if sinks:
        kw["sinks"] = normal(rng, (3, 1))
    problem = prepare_attention(q, k, v, None, True, **kw)
    (squares, in_squares), (strips, in_strips) = squares_and_strips(
        problem, block_q=24, block_k=8, block_diagonal=2
    )
    assert in_squares.computed > in_strips.computed  # four pieces to a square's tile
    want = reference(q, k, v, None, True, **kw)
    assert_same(problem.finish(squares[0], lse=squares[1]), want, dtype)
    for a, b in zip(squares, strips):
        np.testing.assert_allclose(a, b, **TOL[dtype])
    # the stats of the backward pass: lse = m + log(l)
    np.testing.assert_allclose(squares[2] + np.log(squares[3]), squares[1], **TOL[dtype])


def test_causal_squares_redo_units_whose_scores_lie_far_below_zero(rng):
    # Rows 0:24 have scores about -60 (too far below the shift 0): their unit is redone from
    # the exact step, its diagonal in squares again; rows 24:48 keep the shift 0.
    q, k, v = (normal(rng, (48, 4)) for _ in range(3))
    k[:, 0] = 1.0
    q[:24, 0] = -120.0  # scale 1/2: scores about -60
    problem = prepare_attention(q, k, v, is_causal=True)
    (squares, stats), (strips, _) = squares_and_strips(
        problem, block_q=24, block_k=8, block_diagonal=4
    )
    assert (stats.units, stats.redone) == (2, 1)
    want_out, _, want_lse = attention_loop_2d(q, k, v, np.tril(np.ones((48, 48), bool)))
    rtol = 2 * np.finfo(np.float64).eps * 60
    np.testing.assert_allclose(squares[0], want_out, rtol=rtol, atol=1e-12)
    np.testing.assert_allclose(squares[1], want_lse, rtol=1e-12)
    np.testing.assert_allclose(squares[0], strips[0], rtol=rtol, atol=1e-12)


def test_causal_squares_with_huge_scores_fold_no_shift_they_cannot(rng):
    # Scores near 1e6 (float64): the exact step's shifts exceed FOLD_LIMIT in some rows, which
    # then subtract their shift after the product, in squares as in strips.
    q, k, v = (normal(rng, (40, 4)) for _ in range(3))
    q *= 1e3
    k *= 1e3
    problem = prepare_attention(q, k, v, is_causal=True)
    (squares, stats), _ = squares_and_strips(problem, block_q=40, block_k=8, block_diagonal=4)
    assert stats.rescaled > 0
    want = reference(q, k, v, None, True)
    np.testing.assert_allclose(squares[0], want[0], rtol=1e-9, atol=1e-9)
    np.testing.assert_allclose(squares[1], want[1], rtol=1e-12)


@pytest.mark.parametrize("num_threads", [1, 2, 3])
def test_causal_squares_give_the_same_bits_on_any_thread_count(rng, num_threads):
    q, k, v = qkv(rng, np.float32, t=64, s=64)
    problem = prepare_attention(q, k, v, is_causal=True)
    kw = dict(block_q=32, block_k=16, block_diagonal=4)
    one = attention_tiled(problem, num_threads=1, **kw)
    got = attention_tiled(problem, num_threads=num_threads, **kw)
    for a, b in zip(one, got):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize(
    "s, alignment, before", [(2048, "top_left", 0), (2560, "bottom_right", 512)]
)
def test_causal_keys_before_squares_come_in_pieces_of_block_k(rng, s, alignment, before):
    # float32 with the default key sizes: squares of BLOCK_K_BAND = 256 rows along the
    # diagonal, pieces of 64 keys inside them, and the keys before the diagonal, which every
    # row meets, in pieces of BLOCK_K = 512 (two tiles in one step). Units of 512 rows (two
    # squares) start at t0 = 0, 512, 1024, 1536; unit t0 has t0 + before keys before its
    # diagonal. Each unit: 4 pieces in squares (a tile of each of its 2 squares), 1 strip of
    # the first square's keys for the rows below it, then the keys before the diagonal.
    from sdpa.tuning import BLOCK_K, BLOCK_K_BAND

    f32 = np.dtype(np.float32)
    assert (BLOCK_K_BAND[f32], BLOCK_K[f32]) == (256, 512), "the counts below assume these"
    q, k, v = (normal(rng, (1, n, 8), np.float32) for n in (2048, s, s))
    problem = prepare_attention(q, k, v, is_causal=True, causal_alignment=alignment)
    left = [(t0 + before) // 256 for t0 in (0, 512, 1024, 1536)]  # tiles before the diagonal
    tiles = sum(4 * 2 + 1 + n for n in left)
    wide, narrow = sum(4 + 1 + -(-n // 2) for n in left), sum(4 + 1 + n for n in left)
    results = {}
    for block_k, steps in ((None, wide), (256, narrow)):
        stats = TileStats()
        kw = dict(block_q=512, block_k=block_k, block_diagonal=64, stats=stats)
        results[block_k] = attention_tiled(problem, **kw)
        assert (stats.units, stats.computed, stats.steps) == (4, tiles, steps)
    want = reference(q, k, v, None, True, causal_alignment=alignment)
    out, lse = results[None]
    assert_same(problem.finish(out, lse=lse), want, np.float32)
    for a, b in zip(results[None], results[256]):
        np.testing.assert_allclose(a, b, **TOL[np.float32])


def test_block_diagonal_errors(rng):
    problem = prepare_attention(*qkv(rng), is_causal=True)
    with pytest.raises(ValueError, match="block_diagonal must be a non-negative integer; got -1"):
        attention_tiled(problem, block_diagonal=-1)
    with pytest.raises(TypeError, match="block_diagonal must be a non-negative integer; got 2.5"):
        attention_tiled(problem, block_diagonal=2.5)
