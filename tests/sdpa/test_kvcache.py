"""Tests of sdpa.kvcache: decoding with a KVCache reproduces full causal attention."""

from __future__ import annotations

import numpy as np
import pytest
from references import attention_loop_2d, band_by_loop

from sdpa import KVCache, MultiHeadAttention, merge_heads, split_heads


def chunks_of(n, sizes):
    """Split range(n) into consecutive (start, stop) pairs of the given sizes, then ones."""
    bounds, t = [], 0
    for size in sizes:
        bounds.append((t, t + size))
        t += size
    bounds += [(i, i + 1) for i in range(t, n)]
    return bounds


@pytest.mark.parametrize("Hq,Hkv", [(6, 6), (6, 2), (6, 1)])
@pytest.mark.parametrize("schedule", [[], [5], [3, 4, 2]])
def test_decoding_equals_full_causal_attention(rng, Hq, Hkv, schedule):
    B, n, Dk, Dv = 2, 13, 5, 3
    q = rng.standard_normal((B, Hq, n, Dk))
    k = rng.standard_normal((B, Hkv, n, Dk))
    v = rng.standard_normal((B, Hkv, n, Dv))
    cache = KVCache(1, Hkv, Dk, value_dim=Dv, batch_size=B, capacity=2)
    outs = []
    for t0, t1 in chunks_of(n, schedule):
        cache.append(0, k[:, :, t0:t1], v[:, :, t0:t1])
        outs.append(cache.attend(0, q[:, :, t0:t1]))
    got = np.concatenate(outs, axis=2)
    G = Hq // Hkv
    for b in range(B):
        for h in range(Hq):
            causal = band_by_loop(q.shape[2], q.shape[2], is_causal=True)
            ref = attention_loop_2d(
                q[b, h], k[b, h // G], v[b, h // G], causal, scale=1 / np.sqrt(Dk)
            )[0]
            np.testing.assert_allclose(got[b, h], ref, rtol=1e-12, atol=1e-12)


def test_decoding_matches_torch(rng, torch):
    B, Hq, Hkv, n, D = 1, 4, 2, 9, 8
    q = rng.standard_normal((B, Hq, n, D))
    k = rng.standard_normal((B, Hkv, n, D))
    v = rng.standard_normal((B, Hkv, n, D))
    cache = KVCache(1, Hkv, D)
    outs = []
    for t0, t1 in chunks_of(n, [4]):
        cache.append(0, k[:, :, t0:t1], v[:, :, t0:t1])
        outs.append(cache.attend(0, q[:, :, t0:t1]))
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(a) for a in (q, k, v)), is_causal=True, enable_gqa=True
    ).numpy()
    np.testing.assert_allclose(np.concatenate(outs, axis=2), ref, rtol=1e-12, atol=1e-12)


def _mlp(x):
    """A position-wise nonlinearity so that layers do not collapse into one linear map."""
    return np.tanh(x)


def full_model(layers, x):
    """L layers of x <- x + mlp(MHA(x, causal)) on the whole sequence at once."""
    for mha in layers:
        x = x + _mlp(mha(x, is_causal=True))
    return x


def cached_model_step(layers, x, cache):
    """The same model on the new tokens x (B, T, E) only, reading earlier tokens from the cache."""
    for layer, mha in enumerate(layers):
        q = split_heads(x @ mha.W_q, mha.n_heads)  # (B, T, E) -> (B, Hq, T, Dk)
        k = split_heads(x @ mha.W_k, mha.n_kv_heads)  # (B, T, E) -> (B, Hkv, T, Dk)
        v = split_heads(x @ mha.W_v, mha.n_kv_heads)
        cache.append(layer, k, v)
        heads = cache.attend(layer, q)  # (B, Hq, T, Dv)
        x = x + _mlp(merge_heads(heads) @ mha.W_o)
    return x


@pytest.mark.parametrize("schedule", [[], [6], [2, 3]])
def test_multilayer_gqa_model_decoding(rng, schedule):
    E, Hq, Hkv, L, B, n = 24, 6, 2, 3, 2, 11
    layers = [MultiHeadAttention.random(E, Hq, n_kv_heads=Hkv, rng=rng) for _ in range(L)]
    x = rng.standard_normal((B, n, E))
    expected = full_model(layers, x)
    cache = KVCache(L, Hkv, E // Hq, batch_size=B, capacity=1)
    got = np.concatenate(
        [cached_model_step(layers, x[:, t0:t1], cache) for t0, t1 in chunks_of(n, schedule)],
        axis=1,
    )
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)
    assert [cache.length(i) for i in range(L)] == [n] * L


def test_sliding_window_decoding(rng):
    """A window passed to attend is aligned like the causal mask: the last w keys."""
    n, D, w = 10, 4, 3
    q, k, v = (rng.standard_normal((1, 1, n, D)) for _ in range(3))
    cache = KVCache(1, 1, D)
    outs = []
    for t in range(n):
        cache.append(0, k[:, :, t : t + 1], v[:, :, t : t + 1])
        outs.append(cache.attend(0, q[:, :, t : t + 1], window=(w - 1, 0)))
    for t in range(n):
        lo = max(0, t - w + 1)
        s = q[0, 0, t] @ k[0, 0, lo : t + 1].T / np.sqrt(D)
        p = np.exp(s - s.max())
        np.testing.assert_allclose(
            outs[t][0, 0, 0], (p / p.sum()) @ v[0, 0, lo : t + 1], rtol=1e-12, atol=1e-12
        )


def test_return_lse(rng):
    q, k, v = (rng.standard_normal((1, 1, 3, 2)) for _ in range(3))
    cache = KVCache(1, 1, 2)
    cache.append(0, k, v)
    _, lse = cache.attend(0, q[:, :, 2:], return_lse=True)
    s = q[0, 0, 2] @ k[0, 0].T / np.sqrt(2)
    np.testing.assert_allclose(lse[0, 0, 0], np.log(np.exp(s).sum()), rtol=1e-14)


# -- storage: growth, views, dtype ------------------------------------------------------------


def test_geometric_growth_copies_little(rng):
    """n single-token appends: O(log n) reallocations, capacity < 2 n, contents intact."""
    n = 1000
    k = rng.standard_normal((1, 2, n, 3))
    cache = KVCache(1, 2, 3, capacity=1)
    buffers, previous = 0, None
    for t in range(n):
        keys, _ = cache.append(0, k[:, :, t : t + 1], k[:, :, t : t + 1])
        if keys.base is not previous:
            buffers, previous = buffers + 1, keys.base
    assert buffers == 11  # capacities 1, 2, 4, ..., 1024
    assert n <= cache.capacity(0) < 2 * n
    np.testing.assert_array_equal(cache.keys(0), k)


def test_views_are_read_only_and_stable(rng):
    cache = KVCache(1, 1, 2, capacity=2)
    k1, v1 = cache.append(0, np.ones((1, 1, 2, 2)), np.ones((1, 1, 2, 2)))
    assert not k1.flags.writeable and not v1.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        k1[0, 0, 0, 0] = 5.0
    cache.append(0, np.zeros((1, 1, 3, 2)), np.zeros((1, 1, 3, 2)))  # forces a new buffer
    np.testing.assert_array_equal(k1, np.ones((1, 1, 2, 2)))  # the old view is unchanged
    assert cache.keys(0).shape == (1, 1, 5, 2)


def test_views_are_unchanged_by_an_append_after_a_crop(rng):
    # The docstring promises that a view never changes; an append after crop used to write
    # into the buffer under earlier views (the "rejected draft" case of speculative decoding).
    cache = KVCache(1, 1, 2, capacity=8)
    k = rng.standard_normal((1, 1, 5, 2))
    keys, values = cache.append(0, k, k)
    cache.crop(3)
    kept = cache.keys(0)
    new = rng.standard_normal((1, 1, 2, 2))
    cache.append(0, new, new)
    np.testing.assert_array_equal(keys, k)  # all five original tokens, as before the crop
    np.testing.assert_array_equal(values, k)
    np.testing.assert_array_equal(kept, k[:, :, :3])
    np.testing.assert_array_equal(cache.keys(0), np.concatenate([k[:, :, :3], new], axis=2))
    # Without a view below the write position no copy is made: appends stay amortised O(1).
    buffer = cache.keys(0).base
    cache.append(0, new[:, :, :1], new[:, :, :1])
    assert cache.keys(0).base is buffer


def test_float16_cache_rejects_values_it_cannot_hold():
    cache = KVCache(1, 1, 2, dtype=np.float16)
    big = np.full((1, 1, 1, 2), 1e5)  # float16 holds at most 65504
    with pytest.raises(ValueError, match=r"value must fit in float16, the cache's dtype .* 1e\+05"):
        cache.append(0, np.ones((1, 1, 1, 2)), big)
    with pytest.raises(ValueError, match=r"key must fit in float16, the cache's dtype"):
        cache.append(0, -big, np.ones((1, 1, 1, 2)))
    assert cache.length(0) == 0
    keys, _ = cache.append(0, np.full((1, 1, 1, 2), 65504.0), np.ones((1, 1, 1, 2)))
    assert np.isfinite(keys).all()


def test_inputs_not_kept_or_mutated(rng):
    k = rng.standard_normal((1, 1, 2, 2))
    before = k.copy()
    cache = KVCache(1, 1, 2)
    cache.append(0, k, k)
    k[...] = 0.0  # changing the caller's array afterwards does not reach the cache
    np.testing.assert_array_equal(cache.keys(0), before)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_storage_dtype(rng, dtype):
    cache = KVCache(1, 1, 4, dtype=dtype)
    q, k, v = (rng.standard_normal((1, 1, 3, 4)) for _ in range(3))
    keys, values = cache.append(0, k, v)  # float64 in, stored as dtype
    assert keys.dtype == dtype and values.dtype == dtype
    np.testing.assert_array_equal(keys, k.astype(dtype))
    out = cache.attend(0, q.astype(dtype))
    assert out.dtype == dtype


def test_empty_layer_views_and_crop(rng):
    cache = KVCache(2, 3, 4, value_dim=5, batch_size=2)
    assert cache.keys(1).shape == (2, 3, 0, 4) and cache.values(1).shape == (2, 3, 0, 5)
    assert cache.capacity(1) == 0 and cache.nbytes == 0
    k = rng.standard_normal((2, 3, 6, 4))
    v = rng.standard_normal((2, 3, 6, 5))
    cache.append(1, k, v)
    cache.crop(4)
    np.testing.assert_array_equal(cache.keys(1), k[:, :, :4])
    np.testing.assert_array_equal(cache.values(1), v[:, :, :4])
    cache.append(1, k[:, :, 5:], v[:, :, 5:])  # overwrites position 4
    np.testing.assert_array_equal(cache.keys(1)[:, :, 4], k[:, :, 5])


# -- memory accounting --------------------------------------------------------------------------


@pytest.mark.parametrize("Hkv", [32, 8, 1])  # MHA, GQA, MQA with 32 query heads
def test_bytes_per_token_hand_formula(Hkv):
    # LLaMA-2-7B-like: 32 layers, head width 128, float16 storage (2 bytes)
    cache = KVCache(32, Hkv, 128, dtype=np.float16, capacity=1)
    hand = 2 * 32 * Hkv * 128 * 2  # (key + value) * layers * heads * width * bytes
    assert cache.bytes_per_token == hand
    assert cache.bytes_per_token == {32: 524288, 8: 131072, 1: 16384}[Hkv]


def test_nbytes_counts_tokens_and_allocation():
    L, B, Hkv, Dk, Dv, n = 3, 2, 2, 4, 5, 7
    cache = KVCache(L, Hkv, Dk, value_dim=Dv, batch_size=B, dtype=np.float32, capacity=4)
    for layer in range(L):
        cache.append(layer, np.ones((B, Hkv, n, Dk)), np.ones((B, Hkv, n, Dv)))
    per_token = L * B * Hkv * (Dk + Dv) * 4
    assert cache.bytes_per_token == per_token
    assert cache.nbytes == n * per_token
    assert cache.nbytes_allocated == 7 * per_token  # first allocation fits the 7 tokens exactly
    cache.append(0, np.ones((B, Hkv, 1, Dk)), np.ones((B, Hkv, 1, Dv)))
    assert cache.nbytes_allocated == 7 * per_token + 7 * per_token // L  # layer 0 doubled to 14


# -- errors: one per raise ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["n_layers", "n_kv_heads", "batch_size", "capacity"])
def test_error_nonpositive_sizes(name):
    kwargs = dict(n_layers=1, n_kv_heads=1, head_dim=2)
    kwargs[name] = 0
    with pytest.raises(ValueError, match=f"{name} must be a positive integer; got 0"):
        KVCache(**kwargs)


def test_error_size_not_int():
    with pytest.raises(TypeError, match="head_dim must be a non-negative integer"):
        KVCache(1, 1, 2.0)


def test_error_dtype_not_floating():
    with pytest.raises(TypeError, match="dtype must be a floating dtype"):
        KVCache(1, 1, 2, dtype=np.int32)


def test_error_dtype_none():
    # np.dtype(None) is float64: the cache would silently store float64 when the caller meant
    # "the model's dtype".
    with pytest.raises(TypeError, match=r"dtype must be a floating dtype .*; got None"):
        KVCache(1, 1, 2, dtype=None)


def test_error_attend_return_lse_not_bool():
    cache = KVCache(1, 1, 2)
    cache.append(0, np.ones((1, 1, 1, 2)), np.ones((1, 1, 1, 2)))
    with pytest.raises(TypeError, match="return_lse must be a bool; got 'yes'"):
        cache.attend(0, np.ones((1, 1, 1, 2)), return_lse="yes")


def test_error_dtype_not_a_dtype():
    with pytest.raises(
        TypeError,
        match=r"dtype must be a floating dtype \(float16, float32 or float64\); got 'nons",
    ):
        KVCache(1, 1, 2, dtype="nonsense")


@pytest.mark.parametrize("layer", [-1, 2])
def test_error_layer_out_of_range(layer):
    cache = KVCache(2, 1, 2)
    with pytest.raises(ValueError, match=rf"layer must be in \[0, n_layers=2\); got layer={layer}"):
        cache.append(layer, np.ones((1, 1, 1, 2)), np.ones((1, 1, 1, 2)))


def test_error_layer_not_int():
    with pytest.raises(TypeError, match="layer must be an integer"):
        KVCache(2, 1, 2).keys(1.0)


def test_error_key_heads_mismatch():
    cache = KVCache(1, 2, 4, batch_size=3)
    with pytest.raises(
        ValueError,
        match=r"key must have shape \(B, Hkv, T, D\) = \(3, 2, T, 4\).*"
        r"got key.shape=\(3, 4, 1, 4\)",
    ):
        cache.append(0, np.ones((3, 4, 1, 4)), np.ones((3, 2, 1, 4)))


def test_error_value_width_mismatch():
    cache = KVCache(1, 2, 4, value_dim=3)
    with pytest.raises(
        ValueError,
        match=r"value must have shape .* \(1, 2, T, 3\).*"
        r"got value.shape=\(1, 2, 1, 4\)",
    ):
        cache.append(0, np.ones((1, 2, 1, 4)), np.ones((1, 2, 1, 4)))


def test_error_key_value_token_count_mismatch():
    cache = KVCache(1, 1, 2)
    with pytest.raises(ValueError, match="same number of new tokens T"):
        cache.append(0, np.ones((1, 1, 2, 2)), np.ones((1, 1, 3, 2)))


def test_error_query_width_mismatch():
    cache = KVCache(1, 1, 2)
    cache.append(0, np.ones((1, 1, 2, 2)), np.ones((1, 1, 2, 2)))
    with pytest.raises(
        ValueError, match=r"query must have shape \(B, Hq, T, Dk\) = \(1, Hq, T, 2\)"
    ):
        cache.attend(0, np.ones((1, 1, 1, 3)))


def test_error_query_heads_not_multiple():
    cache = KVCache(1, 2, 2)
    cache.append(0, np.ones((1, 2, 2, 2)), np.ones((1, 2, 2, 2)))
    with pytest.raises(
        ValueError, match=r"multiple of the cache's n_kv_heads=2; got query.shape=\(1, 3"
    ):
        cache.attend(0, np.ones((1, 3, 1, 2)))


def test_error_more_queries_than_cached():
    cache = KVCache(1, 1, 2)
    cache.append(0, np.ones((1, 1, 2, 2)), np.ones((1, 1, 2, 2)))
    with pytest.raises(ValueError, match="T=3 new tokens but layer 0 caches only S=2"):
        cache.attend(0, np.ones((1, 1, 3, 2)))


def test_error_crop_negative():
    with pytest.raises(ValueError, match="length must be a non-negative integer"):
        KVCache(1, 1, 2).crop(-1)


def test_error_complex_key():
    with pytest.raises(TypeError, match="key must be a real"):
        KVCache(1, 1, 2).append(0, np.ones((1, 1, 1, 2), complex), np.ones((1, 1, 1, 2)))
