"""Tests of sdpa.multihead: split/merge, and MultiHeadAttention against explicit per-head loops
(PyTorch's nn.MultiheadAttention is compared in tests/conformance/test_torch.py)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sdpa import MultiHeadAttention, causal_mask, merge_heads, split_heads

B, T, S = 2, 5, 7


def softmax_rows(scores):
    """Plain float64 softmax of each row (no masking needed by the callers that use it)."""
    e = np.exp(scores - scores.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def loop_multihead(mha, x_q, x_kv_k, x_kv_v, allowed=None):
    """Explicit per-head loop: head h projects with its own column block and reads the key/value
    block of head h // G; heads are concatenated and projected by W_o."""
    Hq, Hkv, Dk, Dv = mha.n_heads, mha.n_kv_heads, mha.head_dim, mha.value_dim
    G = Hq // Hkv
    zero = lambda n: np.zeros(n)  # noqa: E731
    b_q = mha.b_q if mha.b_q is not None else zero(Hq * Dk)
    b_k = mha.b_k if mha.b_k is not None else zero(Hkv * Dk)
    b_v = mha.b_v if mha.b_v is not None else zero(Hkv * Dv)
    b_o = mha.b_o if mha.b_o is not None else zero(mha.W_o.shape[1])
    outs, all_weights = [], []
    for b in range(x_q.shape[0]):
        heads, weights_b = [], []
        for h in range(Hq):
            g = h // G
            q = x_q[b] @ mha.W_q[:, h * Dk : (h + 1) * Dk] + b_q[h * Dk : (h + 1) * Dk]
            k = x_kv_k[b] @ mha.W_k[:, g * Dk : (g + 1) * Dk] + b_k[g * Dk : (g + 1) * Dk]
            v = x_kv_v[b] @ mha.W_v[:, g * Dv : (g + 1) * Dv] + b_v[g * Dv : (g + 1) * Dv]
            scores = q @ k.T / math.sqrt(Dk)
            if allowed is not None:
                scores = np.where(allowed, scores, -np.inf)
            w = softmax_rows(scores)
            heads.append(w @ v)
            weights_b.append(w)
        outs.append(np.concatenate(heads, axis=-1) @ mha.W_o + b_o)
        all_weights.append(np.stack(weights_b))
    return np.stack(outs), np.stack(all_weights)


# --- split and merge --------------------------------------------------------------------------


def test_split_heads_takes_contiguous_column_blocks(rng):
    x = rng.standard_normal((B, T, 12))
    heads = split_heads(x, 3)
    assert heads.shape == (B, 3, T, 4)
    for h in range(3):
        np.testing.assert_array_equal(heads[:, h], x[..., 4 * h : 4 * (h + 1)])


@pytest.mark.parametrize(
    "shape, n_heads",
    [((T, 12), 3), ((B, T, 12), 4), ((3, B, T, 10), 5), ((T, 7), 1), ((T, 7), 7)],
)
def test_split_then_merge_is_the_identity(shape, n_heads, rng):
    x = rng.standard_normal(shape)
    heads = split_heads(x, n_heads)
    assert heads.shape == (*shape[:-2], n_heads, shape[-2], shape[-1] // n_heads)
    np.testing.assert_array_equal(merge_heads(heads), x)


def test_merge_then_split_is_the_identity(rng):
    x = rng.standard_normal((B, 3, T, 4))
    np.testing.assert_array_equal(split_heads(merge_heads(x), 3), x)


def test_split_heads_returns_a_view_and_does_not_modify_input(rng):
    x = rng.standard_normal((B, T, 12))
    x.flags.writeable = False
    heads = split_heads(x, 3)
    assert np.shares_memory(heads, x)
    merge_heads(heads)
    assert split_heads(x.tolist(), 3).shape == (B, 3, T, 4)


# --- MultiHeadAttention against the loop ----------------------------------------------------------


@pytest.mark.parametrize("n_heads, n_kv_heads", [(4, 4), (4, 2), (4, 1), (6, 3), (1, 1)])
@pytest.mark.parametrize("bias", [False, True])
def test_self_attention_matches_per_head_loop(n_heads, n_kv_heads, bias, rng):
    E = 12
    mha = MultiHeadAttention.random(E, n_heads, n_kv_heads=n_kv_heads, rng=rng, bias=bias)
    if bias:  # random biases, so that a misplaced bias cannot hide behind zeros
        for name in ("b_q", "b_k", "b_v", "b_o"):
            setattr(mha, name, rng.standard_normal(getattr(mha, name).shape))
    x = rng.standard_normal((B, T, E))
    out, weights = mha(x, return_weights=True)
    ref_out, ref_weights = loop_multihead(mha, x, x, x)
    assert out.shape == (B, T, E) and weights.shape == (B, n_heads, T, T)
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(weights, ref_weights, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("n_kv_heads", [3, 1])
def test_cross_attention_with_other_widths_matches_loop(n_kv_heads, rng):
    E, Ek, Ev, Hq, Dk, Dv, E_out = 11, 5, 7, 3, 4, 2, 13
    mha = MultiHeadAttention(
        rng.standard_normal((E, Hq * Dk)),
        rng.standard_normal((Ek, n_kv_heads * Dk)),
        rng.standard_normal((Ev, n_kv_heads * Dv)),
        rng.standard_normal((Hq * Dv, E_out)),
        n_heads=Hq,
        n_kv_heads=n_kv_heads,
        b_q=rng.standard_normal(Hq * Dk),
        b_k=rng.standard_normal(n_kv_heads * Dk),
        b_v=rng.standard_normal(n_kv_heads * Dv),
        b_o=rng.standard_normal(E_out),
    )
    assert (mha.head_dim, mha.value_dim) == (Dk, Dv)
    x_q = rng.standard_normal((B, T, E))
    x_k, x_v = rng.standard_normal((B, S, Ek)), rng.standard_normal((B, S, Ev))
    out, weights = mha(x_q, x_k, x_v, return_weights=True)
    ref_out, ref_weights = loop_multihead(mha, x_q, x_k, x_v)
    assert out.shape == (B, T, E_out) and weights.shape == (B, Hq, T, S)
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(weights, ref_weights, rtol=1e-12, atol=1e-13)


def test_value_defaults_to_key(rng):
    mha = MultiHeadAttention.random(8, 2, rng=rng)
    x, memory = rng.standard_normal((B, T, 8)), rng.standard_normal((B, S, 8))
    np.testing.assert_array_equal(mha(x, memory), mha(x, memory, memory))
    np.testing.assert_array_equal(mha(x), mha(x, x, x))


@pytest.mark.parametrize("n_kv_heads", [4, 2, 1])
def test_causal_and_mask_options_match_loop(n_kv_heads, rng):
    mha = MultiHeadAttention.random(16, 4, n_kv_heads=n_kv_heads, rng=rng)
    x = rng.standard_normal((B, T, 16))
    out, weights = mha(x, is_causal=True, return_weights=True)
    ref_out, ref_weights = loop_multihead(mha, x, x, x, causal_mask(T))
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-13)
    np.testing.assert_allclose(weights, ref_weights, rtol=1e-12, atol=1e-13)
    # the same through attn_mask, and a window (1, 0) through the window option
    np.testing.assert_allclose(mha(x, attn_mask=causal_mask(T)), out, rtol=1e-15)
    band = np.tril(np.ones((T, T)), 0).astype(bool) & np.triu(np.ones((T, T)), -1).astype(bool)
    ref_window, _ = loop_multihead(mha, x, x, x, band)
    np.testing.assert_allclose(mha(x, window=(1, 0)), ref_window, rtol=1e-12, atol=1e-13)


def test_bottom_right_alignment_in_cross_attention(rng):
    mha = MultiHeadAttention.random(8, 2, rng=rng)
    x, memory = rng.standard_normal((B, T, 8)), rng.standard_normal((B, S, 8))
    allowed = np.tril(np.ones((T, S)), S - T).astype(bool)
    ref_out, _ = loop_multihead(mha, x, memory, memory, allowed)
    out = mha(x, memory, is_causal=True, causal_alignment="bottom_right")
    np.testing.assert_allclose(out, ref_out, rtol=1e-12, atol=1e-13)


def test_dropout_passes_through(rng):
    mha = MultiHeadAttention.random(8, 2, rng=rng)
    x = rng.standard_normal((B, T, 8))
    a = mha(x, dropout_p=0.5, rng=np.random.default_rng(3))
    b = mha(x, dropout_p=0.5, rng=np.random.default_rng(3))
    np.testing.assert_array_equal(a, b)
    assert not np.allclose(a, mha(x))


def test_unbatched_input(rng):
    mha = MultiHeadAttention.random(8, 2, rng=rng)
    x = rng.standard_normal((T, 8))
    np.testing.assert_allclose(mha(x), mha(x[None])[0], rtol=1e-15)


# --- construction ---------------------------------------------------------------------------


def test_random_is_reproducible_and_has_glorot_shapes():
    a = MultiHeadAttention.random(12, 3, n_kv_heads=1, rng=np.random.default_rng(0))
    b = MultiHeadAttention.random(12, 3, n_kv_heads=1, rng=np.random.default_rng(0))
    for name in ("W_q", "W_k", "W_v", "W_o"):
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name))
    assert a.W_q.shape == (12, 12) and a.W_k.shape == (12, 4) and a.W_v.shape == (12, 4)
    assert a.W_o.shape == (12, 12)
    limit = math.sqrt(6 / (12 + 4))
    assert np.abs(a.W_k).max() <= limit
    assert a.b_q is None


def test_random_with_bias_and_head_dim_and_dtype():
    mha = MultiHeadAttention.random(
        10, 2, head_dim=3, bias=True, rng=np.random.default_rng(1), dtype=np.float32
    )
    assert mha.W_q.shape == (10, 6) and mha.W_o.shape == (6, 10)
    assert mha.W_q.dtype == np.float32
    np.testing.assert_array_equal(mha.b_q, 0.0)
    x = np.random.default_rng(2).standard_normal((B, T, 10)).astype(np.float32)
    assert mha(x).dtype == np.float32


def test_repr_names_the_sizes(rng):
    text = repr(MultiHeadAttention.random(16, 4, n_kv_heads=2, rng=rng))
    assert text == (
        "MultiHeadAttention(d_model=16, n_heads=4, n_kv_heads=2, head_dim=4, value_dim=4, "
        "bias=False)"
    )


# --- errors: one test per raise -------------------------------------------------------------------


def test_split_heads_needs_two_dimensions():
    with pytest.raises(
        ValueError,
        match=r"x must have at least 2 dimensions \(\.\.\., T, E\); got x.shape=\(12,\)",
    ):
        split_heads(np.zeros(12), 3)


@pytest.mark.parametrize("n_heads", [0, 5])
def test_split_heads_needs_a_divisor(n_heads):
    with pytest.raises(
        ValueError,
        match=rf"n_heads={n_heads} must be positive and divide the last axis of x; got "
        rf"x.shape=\(5, 12\)",
    ):
        split_heads(np.zeros((T, 12)), n_heads)


def test_split_heads_needs_an_integer():
    with pytest.raises(TypeError, match=r"n_heads must be a non-negative integer; got 2.0"):
        split_heads(np.zeros((T, 12)), 2.0)


def test_merge_heads_needs_three_dimensions():
    with pytest.raises(
        ValueError,
        match=r"x must have at least 3 dimensions \(\.\.\., H, T, D\); got x.shape=\(5, 4\)",
    ):
        merge_heads(np.zeros((T, 4)))


def weights(E=12, Hq=3, Hkv=3, Dk=4, Dv=4):
    return dict(
        W_q=np.zeros((E, Hq * Dk)),
        W_k=np.zeros((E, Hkv * Dk)),
        W_v=np.zeros((E, Hkv * Dv)),
        W_o=np.zeros((Hq * Dv, E)),
    )


@pytest.mark.parametrize("n_heads, n_kv_heads", [(0, None), (3, 2), (3, 0)])
def test_head_counts_must_divide(n_heads, n_kv_heads):
    with pytest.raises(
        ValueError,
        match=r"n_kv_heads must be positive and divide n_heads; got n_heads=",
    ):
        MultiHeadAttention(**weights(), n_heads=n_heads, n_kv_heads=n_kv_heads)


def test_w_q_columns_must_split_into_heads():
    with pytest.raises(
        ValueError,
        match=r"W_q must have Hq \* Dk columns with Hq=n_heads=5; got W_q.shape=\(12, 12\)",
    ):
        MultiHeadAttention(**weights(), n_heads=5, n_kv_heads=1)


def test_w_k_shape_must_match_heads_and_dk():
    w = weights()
    w["W_k"] = np.zeros((12, 8))
    with pytest.raises(
        ValueError,
        match=r"W_k must be a matrix of shape \(any, 12\); got W_k.shape=\(12, 8\)",
    ):
        MultiHeadAttention(**w, n_heads=3)


def test_w_v_columns_must_split_into_kv_heads():
    w = weights(Hq=2, Hkv=2)
    w["W_v"] = np.zeros((12, 5))
    with pytest.raises(
        ValueError,
        match=r"W_v must have Hkv \* Dv columns with Hkv=2; got W_v.shape=\(12, 5\)",
    ):
        MultiHeadAttention(**w, n_heads=2)


def test_w_o_rows_must_be_heads_times_dv():
    w = weights()
    w["W_o"] = np.zeros((10, 12))
    with pytest.raises(
        ValueError,
        match=r"W_o must be a matrix of shape \(12, any\); got W_o.shape=\(10, 12\)",
    ):
        MultiHeadAttention(**w, n_heads=3)


def test_weights_must_be_matrices():
    w = weights()
    w["W_q"] = np.zeros(12)
    with pytest.raises(
        ValueError,
        match=r"W_q must be a matrix of shape \(any, any\); got W_q.shape=\(12,\)",
    ):
        MultiHeadAttention(**w, n_heads=3)


def test_weights_must_be_real():
    w = weights()
    w["W_v"] = w["W_v"].astype(complex)
    with pytest.raises(
        TypeError,
        match=r"W_v must be a real floating, integer or bool array; got dtype complex128",
    ):
        MultiHeadAttention(**w, n_heads=3)


def test_bias_shape_must_match():
    with pytest.raises(ValueError, match=r"b_k must have shape \(12,\); got b_k.shape=\(4,\)"):
        MultiHeadAttention(**weights(), n_heads=3, b_k=np.zeros(4))


@pytest.mark.parametrize("which", ["query", "key", "value"])
def test_input_width_must_match_projection(which):
    mha = MultiHeadAttention.random(12, 3, rng=np.random.default_rng(0))
    args = dict(query=np.zeros((B, T, 12)), key=np.zeros((B, S, 12)), value=np.zeros((B, S, 12)))
    args[which] = np.zeros((B, S, 10))
    with pytest.raises(
        ValueError,
        match=rf"{which} must have shape \(\.\.\., L, 12\) to match W_{which[0]}.shape=\(12, ",
    ):
        mha(**args)


def test_random_needs_n_heads_dividing_d_model():
    with pytest.raises(
        ValueError, match=r"n_heads=5 must divide d_model=12 when head_dim is not given"
    ):
        MultiHeadAttention.random(12, 5, rng=np.random.default_rng(0))


def test_random_needs_a_generator():
    with pytest.raises(TypeError, match=r"rng must be a numpy.random.Generator"):
        MultiHeadAttention.random(12, 3, rng=0)


@pytest.mark.parametrize("dtype", [np.int32, bool, np.complex128, None, "float"])
def test_random_needs_a_floating_dtype(dtype):
    # int32 Glorot weights all round to zero: an all-zero model, silently.
    expected = "None" if dtype is None else str(np.dtype(dtype))
    if dtype == "float":
        return  # "float" is float64: accepted
    with pytest.raises(TypeError, match=rf"dtype must be a floating dtype .*; got {expected}"):
        MultiHeadAttention.random(12, 3, rng=np.random.default_rng(0), dtype=dtype)


def test_random_bias_flag_must_be_a_bool():
    with pytest.raises(TypeError, match=r"bias must be a bool; got 'yes'"):
        MultiHeadAttention.random(12, 3, rng=np.random.default_rng(0), bias="yes")


def test_call_flags_and_rng_are_validated():
    mha = MultiHeadAttention.random(12, 3, rng=np.random.default_rng(0))
    x = np.zeros((2, 12))
    with pytest.raises(TypeError, match=r"return_weights must be a bool; got 'no'"):
        mha(x, return_weights="no")
    with pytest.raises(TypeError, match=r"rng must be a numpy.random.Generator"):
        mha(x, rng=1)


# -- deprecated names (kept for one release) ---------------------------------------------


def test_d_k_is_a_deprecated_alias_of_head_dim():
    rng = np.random.default_rng(1)
    with pytest.warns(DeprecationWarning, match="d_k is deprecated .* use head_dim"):
        old = MultiHeadAttention.random(10, 2, d_k=3, rng=rng)
    assert old.W_q.shape == (10, 2 * 3)  # 2 heads of width 3, as head_dim=3 gives
    assert old.head_dim == 3


def test_d_k_and_head_dim_together_are_an_error():
    with pytest.raises(TypeError, match="head_dim and its deprecated name d_k were both given"):
        MultiHeadAttention.random(10, 2, head_dim=3, d_k=3, rng=np.random.default_rng(1))


@pytest.mark.parametrize("old, new", [("d_k", "head_dim"), ("d_v", "value_dim")])
def test_deprecated_width_attributes(old, new):
    mha = MultiHeadAttention.random(12, 4, head_dim=5, rng=np.random.default_rng(0))
    with pytest.warns(
        DeprecationWarning, match=f"MultiHeadAttention.{old} is deprecated .* use {new}"
    ):
        assert getattr(mha, old) == 5
