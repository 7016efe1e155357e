"""Acceptance tests for parts 2-4 of the 2026 API contract (``../shared/api-2026.md``), written
from the contract alone: attention sinks (``sinks=``), ``sdpa.merge_attention_states`` and
``sdpa.PagedKVCache``.

Expected values come from explicit float64 formulas written here (an extra logit in the
softmax's denominator; attention over all keys at once; a contiguous list of tokens), never from
the code under test. The package's own tests (tests/sdpa/test_sinks.py, test_merge.py,
test_paged_kvcache.py) go further.
"""

from __future__ import annotations

import inspect
import math
import warnings

import numpy as np
import pytest

import sdpa
from sdpa import PagedKVCache, merge_attention_states, scaled_dot_product_attention

IMPLEMENTATIONS = ["reference", "tiled", "auto"]


def _rand(rng, *shape, dtype=np.float64):
    return rng.standard_normal(shape).astype(dtype)


def _with_sinks(q, k, v, sinks, allowed=None):
    """out, weights, lse of a_ij = exp(z_ij) / (sum_j exp(z_ij) + exp(s_i)), in float64 loops."""
    q, k, v = (np.asarray(x, dtype=np.float64) for x in (q, k, v))
    *lead, T, Dk = q.shape
    S = k.shape[-2]
    s = np.broadcast_to(np.asarray(sinks, dtype=np.float64), (*lead, T))
    out = np.zeros((*lead, T, v.shape[-1]))
    weights = np.zeros((*lead, T, S))
    lse = np.zeros((*lead, T))
    for idx in np.ndindex(*lead, T):
        *head, i = idx
        head = tuple(head)
        z = np.array([q[idx] @ k[(*head, j)] / math.sqrt(Dk) for j in range(S)])
        keep = np.ones(S, bool) if allowed is None else np.array([allowed(i, j) for j in range(S)])
        terms = [z[j] for j in range(S) if keep[j]] + [s[idx]]
        m = max(terms)
        total = sum(math.exp(t - m) for t in terms)
        lse[idx] = m + math.log(total)
        for j in range(S):
            if keep[j]:
                weights[(*head, i, j)] = math.exp(z[j] - lse[idx])
        out[idx] = weights[(*head, i)] @ v[head]
    return out, weights, lse


# ---- 2. attention sinks ------------------------------------------------------------------------


def test_sinks_is_keyword_only():
    param = inspect.signature(scaled_dot_product_attention).parameters["sinks"]
    assert param.kind is inspect.Parameter.KEYWORD_ONLY and param.default is None


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_per_head_sink_logit(rng, implementation):
    Hq, T, S = 3, 5, 7
    q, k, v = _rand(rng, 2, Hq, T, 4), _rand(rng, 2, Hq, S, 4), _rand(rng, 2, Hq, S, 6)
    sink = np.array([-1.0, 0.0, 2.5])
    out, lse = scaled_dot_product_attention(
        q, k, v, sinks=sink[:, None], return_lse=True, implementation=implementation
    )
    want_out, want_w, want_lse = _with_sinks(q, k, v, sink[:, None])
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)
    if implementation != "tiled":  # the tiled path never forms the weights
        _, weights = scaled_dot_product_attention(
            q, k, v, sinks=sink[:, None], return_weights=True, implementation=implementation
        )
        np.testing.assert_allclose(weights, want_w, rtol=1e-12, atol=1e-12)
        assert np.all(weights.sum(-1) < 1)


def test_sink_zero_on_equal_scores_is_softmax_plus_one():
    # Every score 0 (a zero query), a sink at 0: each of S keys weighs 1/(S+1).
    S = 4
    q = np.zeros((1, 3, 2))
    k = np.arange(S * 2, dtype=float).reshape(1, S, 2)
    v = np.eye(S)[None]
    out, weights, lse = scaled_dot_product_attention(
        q, k, v, sinks=0.0, return_weights=True, return_lse=True
    )
    np.testing.assert_allclose(weights, np.full((1, 3, S), 1 / (S + 1)), rtol=1e-15)
    np.testing.assert_allclose(out, np.full((1, 3, S), 1 / (S + 1)), rtol=1e-15)
    np.testing.assert_allclose(lse, np.full((1, 3), math.log(S + 1)), rtol=1e-15)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_minus_inf_sink_is_plain_attention(rng, implementation):
    q, k, v = _rand(rng, 2, 6, 4), _rand(rng, 2, 9, 4), _rand(rng, 2, 9, 3)
    plain = scaled_dot_product_attention(q, k, v, return_lse=True, implementation=implementation)
    sunk = scaled_dot_product_attention(
        q, k, v, sinks=-np.inf, return_lse=True, implementation=implementation
    )
    for a, b in zip(plain, sunk):
        np.testing.assert_allclose(b, a, rtol=1e-14, atol=1e-15)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_sinks_with_causal_mask_and_empty_rows(rng, implementation):
    T, S = 6, 4  # bottom-right causal: the first two queries see no key
    q, k, v = _rand(rng, 2, T, 4), _rand(rng, 2, S, 4), _rand(rng, 2, S, 3)
    sinks = _rand(rng, 2, T)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kwargs = dict(is_causal=True, causal_alignment="bottom_right", sinks=sinks)
        out, lse = scaled_dot_product_attention(
            q, k, v, **kwargs, return_lse=True, implementation=implementation
        )
        if implementation != "tiled":  # the tiled path never forms the weights
            _, weights = scaled_dot_product_attention(
                q, k, v, **kwargs, return_weights=True, implementation=implementation
            )
    want_out, want_w, want_lse = _with_sinks(q, k, v, sinks, allowed=lambda i, j: j <= i - 2)
    np.testing.assert_allclose(out, want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-12, atol=1e-12)
    assert np.all(out[:, :2] == 0)
    if implementation != "tiled":
        np.testing.assert_allclose(weights, want_w, rtol=1e-12, atol=1e-12)
        assert np.all(weights[:, :2] == 0)
    np.testing.assert_array_equal(lse[:, :2], sinks[:, :2])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_sinks_with_gqa(rng, implementation):
    q, k, v = _rand(rng, 1, 4, 5, 8), _rand(rng, 1, 2, 6, 8), _rand(rng, 1, 2, 6, 2)
    sinks = np.array([0.3, -0.2, 1.0, 0.0])[:, None]
    out = scaled_dot_product_attention(
        q, k, v, sinks=sinks, enable_gqa=True, implementation=implementation
    )
    want, _, _ = _with_sinks(q, np.repeat(k, 2, axis=1), np.repeat(v, 2, axis=1), sinks)
    np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)


def test_sinks_of_the_wrong_shape_are_refused(rng):
    q, k, v = _rand(rng, 3, 5, 4), _rand(rng, 3, 6, 4), _rand(rng, 3, 6, 4)
    with pytest.raises(ValueError, match="sinks"):
        scaled_dot_product_attention(q, k, v, sinks=np.zeros((3, 6)))


def test_sink_gradient_matches_torch_autograd(rng):
    torch = pytest.importorskip("torch")
    H, T, S = 2, 4, 5
    q, k, v = _rand(rng, H, T, 3), _rand(rng, H, S, 3), _rand(rng, H, S, 2)
    sinks, d_out = _rand(rng, H, 1), _rand(rng, H, T, 2)
    tq, tk, tv, ts = (torch.tensor(x, requires_grad=True) for x in (q, k, v, sinks))
    z = tq @ tk.transpose(-1, -2) / math.sqrt(3)
    col = ts.expand(H, T).unsqueeze(-1)
    a = torch.softmax(torch.cat([z, col], dim=-1), dim=-1)[..., :S]
    (a @ tv).backward(torch.tensor(d_out))
    out, lse = scaled_dot_product_attention(q, k, v, sinks=sinks, return_lse=True)
    for impl in ("reference", "tiled"):
        grads = sdpa.scaled_dot_product_attention_backward(
            d_out, q, k, v, sinks=sinks, out=out, lse=lse, implementation=impl
        )
        assert len(grads) == 4  # d_query, d_key, d_value, d_sinks
        np.testing.assert_allclose(grads[3], ts.grad.numpy(), rtol=1e-10, atol=1e-12)
        for got, want in zip(grads[:3], (tq, tk, tv)):
            np.testing.assert_allclose(got, want.grad.numpy(), rtol=1e-10, atol=1e-12)


# ---- 3. merging partial attention -------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_merge_equals_one_call_over_all_keys(rng, dtype):
    q, k, v = (_rand(rng, 2, 3, n, 8, dtype=dtype) for n in (4, 30, 30))
    whole, whole_lse = scaled_dot_product_attention(q, k, v, return_lse=True)
    cuts = [0, 7, 8, 21, 30]
    outs, lses = [], []
    for a, b in zip(cuts, cuts[1:]):
        o, l_ = scaled_dot_product_attention(q, k[..., a:b, :], v[..., a:b, :], return_lse=True)
        outs.append(o)
        lses.append(l_)
    out, lse = merge_attention_states(outs, lses)
    assert out.dtype == dtype and out.shape == whole.shape
    tol = {np.float16: 5e-3, np.float32: 2e-6, np.float64: 1e-13}[dtype]
    want, _, want_lse = _with_sinks(q, k, v, -np.inf)
    np.testing.assert_allclose(out.astype(float), want, rtol=tol, atol=tol)
    np.testing.assert_allclose(np.asarray(lse, float), want_lse, rtol=tol, atol=tol)


def test_merge_ignores_empty_parts_and_keeps_all_empty_rows_empty(rng):
    out1, lse1 = _rand(rng, 3, 2), np.array([0.5, -np.inf, 1.0])
    out1[1] = 0.0
    out2, lse2 = np.zeros((3, 2)), np.array([-np.inf, -np.inf, 1.0])
    out2[2] = [4.0, -2.0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = merge_attention_states([out1, out2], [lse1, lse2])
    np.testing.assert_allclose(out[0], out1[0], rtol=1e-15)  # only part 1 counts
    assert np.all(out[1] == 0) and lse[1] == -np.inf  # no part has a key
    np.testing.assert_allclose(out[2], (out1[2] + out2[2]) / 2, rtol=1e-15)  # equal lse: mean
    np.testing.assert_allclose(lse[[0, 2]], [0.5, 1.0 + math.log(2)], rtol=1e-15)


def test_merge_of_one_part_returns_it_unchanged(rng):
    out, lse = _rand(rng, 2, 5, 3, dtype=np.float32), _rand(rng, 2, 5, dtype=np.float32)
    got_out, got_lse = merge_attention_states([out], [lse])
    np.testing.assert_array_equal(got_out, out)
    np.testing.assert_array_equal(got_lse, lse)


def test_merge_refuses_bad_parts(rng):
    out, lse = _rand(rng, 5, 3), _rand(rng, 5)
    with pytest.raises(ValueError):
        merge_attention_states([], [])
    with pytest.raises(ValueError):
        merge_attention_states([out, out[:4]], [lse, lse[:4]])
    with pytest.raises(ValueError):
        merge_attention_states([out, out], [lse])
    with pytest.raises(TypeError):
        merge_attention_states(3.0, lse)


# ---- 4. the paged KV cache ---------------------------------------------------------------------


def _tokens(rng, n, Hkv=2, Dk=4, Dv=3):
    return _rand(rng, Hkv, n, Dk, dtype=np.float32), _rand(rng, Hkv, n, Dv, dtype=np.float32)


def test_paged_cache_holds_tokens_in_order_and_takes_blocks_lazily(rng):
    cache = PagedKVCache(num_blocks=10, block_size=4, n_kv_heads=2, head_dim=4, value_dim=3)
    assert cache.num_free_blocks == 10
    seqs = {cache.new_sequence(): ([], []) for _ in range(3)}
    for n, seq in zip([1, 5, 3, 4, 2, 6], [*seqs, *seqs]):
        key, value = _tokens(rng, n)
        cache.append(seq, key, value)
        seqs[seq][0].append(key)
        seqs[seq][1].append(value)
    held = 0
    for seq, (keys, values) in seqs.items():
        K, V = cache.keys_values(seq)
        np.testing.assert_array_equal(K, np.concatenate(keys, axis=1))
        np.testing.assert_array_equal(V, np.concatenate(values, axis=1))
        L = cache.length(seq)
        assert L == K.shape[1] and len(cache.block_table(seq)) == math.ceil(L / 4)
        held += math.ceil(L / 4)
    assert cache.num_free_blocks == 10 - held


def test_paged_attend_equals_attention_on_the_gathered_cache(rng):
    cache = PagedKVCache(8, 3, n_kv_heads=2, head_dim=4, value_dim=3, dtype=np.float64)
    seq = cache.new_sequence()
    key, value = _rand(rng, 2, 7, 4), _rand(rng, 2, 7, 3)
    cache.append(seq, key, value)
    query = _rand(rng, 4, 2, 4)
    out, lse = cache.attend(
        seq,
        query,
        is_causal=True,
        causal_alignment="bottom_right",
        enable_gqa=True,
        return_lse=True,
    )
    want, want_lse = scaled_dot_product_attention(
        query,
        key,
        value,
        is_causal=True,
        causal_alignment="bottom_right",
        enable_gqa=True,
        return_lse=True,
    )
    np.testing.assert_allclose(out, want, rtol=1e-14, atol=1e-15)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-14, atol=1e-15)


def test_fork_shares_full_blocks_and_copies_a_partial_last_block_on_write(rng):
    cache = PagedKVCache(12, 4, n_kv_heads=1, head_dim=2)
    parent = cache.new_sequence()
    prefix = _tokens(rng, 6, Hkv=1, Dk=2, Dv=2)
    cache.append(parent, *prefix)
    free = cache.num_free_blocks
    child = cache.fork(parent)
    assert cache.num_free_blocks == free  # a fork takes no block
    assert cache.block_table(child) == cache.block_table(parent)
    a, b = _tokens(rng, 1, Hkv=1, Dk=2, Dv=2), _tokens(rng, 3, Hkv=1, Dk=2, Dv=2)
    cache.append(child, *a)
    cache.append(parent, *b)
    assert cache.block_table(child)[0] == cache.block_table(parent)[0]  # full block shared
    assert cache.block_table(child)[1] != cache.block_table(parent)[1]  # partial one copied
    K_child, _ = cache.keys_values(child)
    K_parent, _ = cache.keys_values(parent)
    np.testing.assert_array_equal(K_child, np.concatenate([prefix[0], a[0]], axis=1))
    np.testing.assert_array_equal(K_parent, np.concatenate([prefix[0], b[0]], axis=1))
    cache.free(parent)
    K_child_after, _ = cache.keys_values(child)
    np.testing.assert_array_equal(K_child_after, K_child)
    cache.free(child)
    assert cache.num_free_blocks == 12
    with pytest.raises(KeyError):
        cache.free(child)


def test_running_out_of_blocks_changes_nothing(rng):
    cache = PagedKVCache(3, 2, n_kv_heads=1, head_dim=2)
    seq = cache.new_sequence()
    cache.append(seq, *_tokens(rng, 3, Hkv=1, Dk=2, Dv=2))
    before = (cache.keys_values(seq), cache.block_table(seq), cache.length(seq))
    free = cache.num_free_blocks
    with pytest.raises(MemoryError, match=r"(?s)(2|3).*1|1.*(2|3)"):
        cache.append(seq, *_tokens(rng, 4, Hkv=1, Dk=2, Dv=2))  # needs 2 more blocks, 1 free
    after = (cache.keys_values(seq), cache.block_table(seq), cache.length(seq))
    np.testing.assert_array_equal(after[0][0], before[0][0])
    assert after[1:] == before[1:] and cache.num_free_blocks == free


def test_unknown_sequences_and_bad_tokens_are_refused(rng):
    cache = PagedKVCache(4, 2, n_kv_heads=2, head_dim=4, value_dim=3)
    with pytest.raises(KeyError):
        cache.free(99)
    with pytest.raises((KeyError, ValueError)):
        cache.append(99, *_tokens(rng, 1))
    seq = cache.new_sequence()
    with pytest.raises(ValueError, match="key"):
        cache.append(seq, *_tokens(rng, 1, Dk=5))
    with pytest.raises(ValueError):
        cache.append(seq, *_tokens(rng, 0))
    assert cache.length(seq) == 0 and cache.num_free_blocks == 4
