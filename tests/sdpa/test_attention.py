"""Tests of sdpa.scaled_dot_product_attention.

Four kinds: hand-computed cases; comparison with ``references.attention_loop``, a float64
reference written with explicit Python loops (it shares no code with the package); properties;
and one test per error. Sizes are all different (B=2, H=3, T=5, S=7, Dk=11, Dv=4) so that a swapped axis
cannot pass.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from cases import DK, DV, MASK_SHAPES, B, H, S, T
from hypothesis import given, settings
from hypothesis import strategies as st
from references import attention_loop, attention_loop_2d

from sdpa import causal_mask, padding_mask, scaled_dot_product_attention, sliding_window_mask

RAISE_ON_TROUBLE = dict(over="raise", invalid="raise", divide="raise")
F64 = dict(rtol=1e-12, atol=1e-13)  # float64 against the float64 loop reference


def sdpa_all(*args, **kwargs):
    return scaled_dot_product_attention(*args, return_weights=True, return_lse=True, **kwargs)


def assert_matches_reference(got, ref, **tol):
    tol = tol or F64
    for g, r in zip(got, ref):
        assert g.shape == r.shape
        np.testing.assert_allclose(g, r, **tol)


def randn(rng, *shape):
    return rng.standard_normal(shape)


# --- hand-computed cases ----------------------------------------------------------------------

CAT_Q = np.array([[0, 1]])  # "cat" after W_Q = I
THE_CAT_SLEEPS_K = np.array([[1, 1], [0, 1], [1, 2]])
THE_CAT_SLEEPS_V = np.array([[1, 0], [0, 2], [1, 2]])


def test_the_cat_sleeps_unscaled_by_hand():
    # raw scores [1, 1, 2] -> weights [e, e, e^2] / (2e + e^2); out = w0 V0 + w1 V1 + w2 V2
    e = math.e
    w = np.array([e, e, e * e]) / (2 * e + e * e)
    expected_out = [w[0] * 1 + w[2] * 1, w[1] * 2 + w[2] * 2]
    out, weights, lse = sdpa_all(CAT_Q, THE_CAT_SLEEPS_K, THE_CAT_SLEEPS_V, scale=1.0)
    np.testing.assert_allclose(weights, [w], rtol=1e-15)
    np.testing.assert_allclose(out, [expected_out], rtol=1e-15)
    np.testing.assert_allclose(lse, [math.log(2 * e + e * e)], rtol=1e-15)
    # the seed's rounded numbers
    np.testing.assert_allclose(weights, [[0.212, 0.212, 0.576]], atol=5e-4)
    np.testing.assert_allclose(out, [[0.788, 1.576]], atol=5e-4)


def test_the_cat_sleeps_scaled_by_hand():
    # default scale 1/sqrt(2): scores [1, 1, 2] / sqrt(2)
    a, b = math.exp(1 / math.sqrt(2)), math.exp(2 / math.sqrt(2))
    w = np.array([a, a, b]) / (2 * a + b)
    out, weights = scaled_dot_product_attention(
        CAT_Q, THE_CAT_SLEEPS_K, THE_CAT_SLEEPS_V, return_weights=True
    )
    np.testing.assert_allclose(weights, [w], rtol=1e-15)
    np.testing.assert_allclose(out, [[w[0] + w[2], 2 * w[1] + 2 * w[2]]], rtol=1e-15)
    # scaling flattens the distribution: the weight on "sleeps" drops below the unscaled 0.576
    assert 0.45 < w[2] < 0.576


def test_two_keys_give_one_and_e_over_one_plus_e():
    e = math.e
    out, weights = scaled_dot_product_attention(
        [[1.0]], [[0.0], [1.0]], [[1.0, 0.0], [0.0, 1.0]], scale=1.0, return_weights=True
    )
    np.testing.assert_allclose(weights, [[1 / (1 + e), e / (1 + e)]], rtol=1e-15)
    np.testing.assert_allclose(out, [[1 / (1 + e), e / (1 + e)]], rtol=1e-15)


def test_single_key_gets_all_the_weight():
    out, weights, lse = sdpa_all([[2.0, -1.0]], [[0.5, 3.0]], [[7.0, -2.0, 0.25]])
    np.testing.assert_array_equal(weights, [[1.0]])
    np.testing.assert_allclose(out, [[7.0, -2.0, 0.25]], rtol=1e-15)
    np.testing.assert_allclose(lse, [(2.0 * 0.5 - 3.0) / math.sqrt(2)], rtol=1e-15)


def test_default_scale_is_one_over_sqrt_dk(rng):
    q, k, v = randn(rng, T, DK), randn(rng, S, DK), randn(rng, S, DV)
    np.testing.assert_allclose(
        scaled_dot_product_attention(q, k, v),
        scaled_dot_product_attention(q, k, v, scale=1 / math.sqrt(DK)),
        rtol=1e-15,
    )
    np.testing.assert_allclose(
        scaled_dot_product_attention(q, k, v, scale=0.3),
        scaled_dot_product_attention(q * 0.3, k, v, scale=1.0),
        rtol=1e-13,
    )


# --- comparison with the loop reference over shapes -----------------------------------------

SHAPES = {
    "2d": ((T, DK), (S, DK), (S, DV)),
    "2d-T>S": ((S, DK), (T, DK), (T, DV)),
    "3d": ((H, T, DK), (H, S, DK), (H, S, DV)),
    "4d": ((B, H, T, DK), (B, H, S, DK), (B, H, S, DV)),
    "4d-broadcast": ((B, 1, T, DK), (1, H, S, DK), (H, S, DV)),
    "5d": ((B, 1, H, T, 6), (1, 4, H, S, 6), (1, 1, H, S, DV)),
    "2d-q-3d-kv": ((T, DK), (H, S, DK), (H, S, DV)),
    "S=1": ((B, T, DK), (B, 1, DK), (B, 1, DV)),
    "T=1": ((B, 1, DK), (B, S, DK), (B, S, DV)),
    "Dk=1": ((B, T, 1), (B, S, 1), (B, S, DV)),
}


@pytest.mark.parametrize("name", SHAPES)
def test_matches_loop_reference(name, rng):
    q_shape, k_shape, v_shape = SHAPES[name]
    q, k, v = randn(rng, *q_shape), randn(rng, *k_shape), randn(rng, *v_shape)
    got = sdpa_all(q, k, v)
    assert_matches_reference(got, attention_loop(q, k, v))
    lead = np.broadcast_shapes(q_shape[:-2], k_shape[:-2], v_shape[:-2])
    assert got[0].shape == (*lead, q_shape[-2], v_shape[-1])


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("window", [None, (1, 0), (2, 1), (0, 0), (None, 1), (3, None)])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("T_, S_", [(T, S), (S, T), (T, T)])
def test_causal_and_window_match_loop_reference(T_, S_, is_causal, window, alignment, rng):
    q, k, v = randn(rng, 2, T_, 3), randn(rng, 2, S_, 3), randn(rng, 2, S_, DV)
    got = sdpa_all(q, k, v, is_causal=is_causal, window=window, causal_alignment=alignment)
    ref = attention_loop(q, k, v, is_causal=is_causal, window=window, alignment=alignment)
    assert_matches_reference(got, ref)


def test_window_equals_sliding_window_mask(rng):
    q, k, v = randn(rng, H, T, DK), randn(rng, H, S, DK), randn(rng, H, S, DV)
    for alignment in ("top_left", "bottom_right"):
        mask = sliding_window_mask(T, S, (2, 1), alignment=alignment)
        np.testing.assert_allclose(
            scaled_dot_product_attention(q, k, v, window=(2, 1), causal_alignment=alignment),
            scaled_dot_product_attention(q, k, v, mask),
            rtol=1e-15,
        )


# --- masks ---------------------------------------------------------------------------------


def random_mask(rng, shape, kind):
    if kind == "bool":
        return rng.random(shape) < 0.7
    bias = rng.standard_normal(shape)
    bias[rng.random(shape) < 0.2] = -np.inf
    return bias


@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("mask_shape", MASK_SHAPES, ids=str)
def test_mask_shapes_match_loop_reference(mask_shape, kind, rng):
    q, k, v = randn(rng, B, H, T, DK), randn(rng, B, H, S, DK), randn(rng, B, H, S, DV)
    mask = random_mask(rng, mask_shape, kind)
    got = sdpa_all(q, k, v, mask)
    assert_matches_reference(got, attention_loop(q, k, v, mask))


def test_bool_mask_equals_minus_inf_bias(rng):
    q, k, v = randn(rng, B, T, DK), randn(rng, B, S, DK), randn(rng, B, S, DV)
    mask = rng.random((B, T, S)) < 0.6
    bias = np.where(mask, 0.0, -np.inf)
    for a, b in zip(sdpa_all(q, k, v, mask), sdpa_all(q, k, v, bias)):
        np.testing.assert_allclose(a, b, rtol=1e-15, atol=0)


def test_padding_mask_removes_padded_keys(rng):
    lengths = [7, 3]
    q, k, v = randn(rng, B, H, T, DK), randn(rng, B, H, S, DK), randn(rng, B, H, S, DV)
    out = scaled_dot_product_attention(q, k, v, padding_mask(lengths, S))
    for b, n in enumerate(lengths):
        np.testing.assert_allclose(
            out[b], scaled_dot_product_attention(q[b], k[b, :, :n], v[b, :, :n]), rtol=1e-13
        )


def test_is_causal_combines_with_mask_by_and(rng):
    # PyTorch raises when both are given; we follow JAX and take the logical AND.
    q, k, v = randn(rng, H, T, DK), randn(rng, H, S, DK), randn(rng, H, S, DV)
    mask = rng.random((H, T, S)) < 0.7
    for alignment in ("top_left", "bottom_right"):
        combined = mask & causal_mask(T, S, alignment=alignment)
        np.testing.assert_allclose(
            scaled_dot_product_attention(q, k, v, mask, is_causal=True, causal_alignment=alignment),
            scaled_dot_product_attention(q, k, v, combined),
            rtol=1e-15,
        )
        bias = np.where(mask, rng.standard_normal((H, T, S)), -np.inf)
        got = sdpa_all(q, k, v, bias, is_causal=True, causal_alignment=alignment)
        ref = attention_loop(q, k, v, bias, is_causal=True, alignment=alignment)
        assert_matches_reference(got, ref)


@pytest.mark.parametrize(
    "how",
    [
        dict(attn_mask=np.arange(S) != 4),
        dict(is_causal=True),  # key 4 is in the future of queries 0..3 (T=S)
        dict(window=(1, 0)),
    ],
    ids=["bool-mask", "causal", "window"],
)
def test_nan_in_a_masked_out_key_does_not_reach_the_output(how, rng):
    # Replacement semantics: masked scores become -inf, they are not added to. PyTorch adds
    # -inf to the scores, so NaN + -inf = NaN reaches its output (tested in the conformance file).
    q, k, v = randn(rng, S, DK), randn(rng, S, DK), randn(rng, S, DV)
    k_nan = k.copy()
    k_nan[4] = np.nan
    with np.errstate(**RAISE_ON_TROUBLE):
        out, weights, lse = sdpa_all(q, k_nan, v, **how)
    rows = slice(None) if "attn_mask" in how else slice(0, 4)  # rows that cannot see key 4
    assert np.isfinite(out[rows]).all() and np.isfinite(lse[rows]).all()
    ref_out, ref_w, _ = sdpa_all(q, k, v, **how)
    np.testing.assert_allclose(out[rows], ref_out[rows], rtol=1e-14)
    np.testing.assert_allclose(weights[rows], ref_w[rows], rtol=1e-14)


def test_nan_in_a_key_with_a_float_bias_stays_nan(rng):
    # A float mask is a bias that is *added* (NaN + -inf = NaN), as documented: only bool,
    # causal and window masks replace.
    q, k, v = randn(rng, T, DK), randn(rng, S, DK), randn(rng, S, DV)
    k[4] = np.nan
    bias = np.where(np.arange(S) == 4, -np.inf, 0.0)
    assert np.isnan(scaled_dot_product_attention(q, k, v, bias)).all()


@pytest.mark.parametrize("implementation", ["reference", "tiled"])
def test_nan_in_a_masked_out_value_does_not_reach_the_output(rng, implementation):
    # Policy: a position hidden by a bool mask is absent, its value included (PyTorch's math
    # path spreads it through 0 * nan). Expected: the same call with the value removed.
    q, k, v = randn(rng, T, DK), randn(rng, S, DK), randn(rng, S, DV)
    v_nan = v.copy()
    v_nan[4] = np.nan
    mask = np.arange(S) != 4
    out = scaled_dot_product_attention(q, k, v_nan, mask, implementation=implementation)
    ref = attention_loop_2d(q, np.delete(k, 4, 0), np.delete(v, 4, 0))[0]
    np.testing.assert_allclose(out, ref, **F64)


@pytest.mark.parametrize("implementation", ["reference", "tiled"])
def test_nan_in_a_value_hidden_by_the_causal_mask(rng, implementation):
    # Issue 9: the reference path gave 3 NaN rows (0 * nan, as PyTorch's math path), the tiled
    # path none. Policy, both paths: only the rows that may attend the NaN value are NaN.
    q, k, v = randn(rng, 4, DK), randn(rng, 4, DK), randn(rng, 4, 1)
    v_nan = v.copy()
    v_nan[3] = np.nan
    out = scaled_dot_product_attention(q, k, v_nan, is_causal=True, implementation=implementation)
    assert np.isnan(out[3]).all()
    ref = attention_loop(q, k, v, is_causal=True)[0]
    np.testing.assert_allclose(out[:3], ref[:3], **F64)


# --- fully masked rows and empty dimensions ----------------------------------------------------


def test_fully_masked_rows_give_zeros_and_minus_inf(rng):
    q, k, v = randn(rng, B, T, DK), randn(rng, B, S, DK), randn(rng, B, S, DV)
    mask = rng.random((B, T, S)) < 0.7
    mask[0, 2] = False
    mask[1, 0] = False
    with np.errstate(**RAISE_ON_TROUBLE):
        out, weights, lse = sdpa_all(q, k, v, mask)
        out_b, weights_b, lse_b = sdpa_all(q, k, v, np.where(mask, 0.0, -np.inf))
    for o, w, lse_ in ((out, weights, lse), (out_b, weights_b, lse_b)):
        np.testing.assert_array_equal(o[0, 2], 0.0)
        np.testing.assert_array_equal(o[1, 0], 0.0)
        np.testing.assert_array_equal(w[0, 2], 0.0)
        assert lse_[0, 2] == lse_[1, 0] == -np.inf
        others = np.ones((B, T), dtype=bool)
        others[0, 2] = others[1, 0] = False
        np.testing.assert_allclose(w.sum(-1)[others], 1.0, rtol=1e-14)
    assert_matches_reference((out, weights, lse), attention_loop(q, k, v, mask))


def test_causal_bottom_right_with_more_queries_than_keys_masks_the_first_rows(rng):
    q, k, v = randn(rng, S, DK), randn(rng, T, DK), randn(rng, T, DV)  # T'=7 queries, S'=5 keys
    with np.errstate(**RAISE_ON_TROUBLE):
        out, weights, lse = sdpa_all(q, k, v, is_causal=True, causal_alignment="bottom_right")
    np.testing.assert_array_equal(out[:2], 0.0)  # queries 0 and 1 precede every key
    np.testing.assert_array_equal(lse[:2], -np.inf)
    np.testing.assert_allclose(weights[2:].sum(-1), 1.0, rtol=1e-14)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_no_keys_at_all(dtype):
    q = np.ones((B, H, T, DK), dtype=dtype)
    with np.errstate(**RAISE_ON_TROUBLE):
        k, v = np.ones((B, H, 0, DK), dtype), np.ones((B, H, 0, DV), dtype)
        out, weights, lse = sdpa_all(q, k, v)
    assert out.shape == (B, H, T, DV) and weights.shape == (B, H, T, 0) and lse.shape == (B, H, T)
    assert out.dtype == weights.dtype == dtype
    assert lse.dtype == np.promote_types(dtype, np.float32)  # float16's lse is float32
    np.testing.assert_array_equal(out, 0.0)
    np.testing.assert_array_equal(lse, -np.inf)


def test_no_queries_at_all(rng):
    out, weights, lse = sdpa_all(np.zeros((B, 0, DK)), randn(rng, B, S, DK), randn(rng, B, S, DV))
    assert out.shape == (B, 0, DV) and weights.shape == (B, 0, S) and lse.shape == (B, 0)


def test_zero_width_keys_use_scale_one_and_uniform_weights(rng):
    v = randn(rng, H, S, DV)
    with np.errstate(**RAISE_ON_TROUBLE):
        out, weights, lse = sdpa_all(np.zeros((H, T, 0)), np.zeros((H, S, 0)), v)
    np.testing.assert_allclose(weights, 1 / S, rtol=1e-15)
    mean = np.broadcast_to(v.mean(axis=-2, keepdims=True), out.shape)
    np.testing.assert_allclose(out, mean, rtol=1e-13)
    np.testing.assert_allclose(lse, math.log(S), rtol=1e-15)
    # all scores are 0: a float bias alone decides, whatever the scale
    bias = randn(rng, S)
    ref = attention_loop(np.zeros((T, 0)), np.zeros((S, 0)), v[0], bias)
    got = sdpa_all(np.zeros((T, 0)), np.zeros((S, 0)), v[0], bias, scale=5.0)
    assert_matches_reference(got, ref)


# --- grouped-query and multi-query attention ---------------------------------------------------


@pytest.mark.parametrize("Hkv", [1, 2, 3, 6])
def test_gqa_equals_repeated_kv_heads(Hkv, rng):
    Hq, G = 6, 6 // Hkv
    q, k, v = randn(rng, B, Hq, T, DK), randn(rng, B, Hkv, S, DK), randn(rng, B, Hkv, S, DV)
    k_rep, v_rep = np.repeat(k, G, axis=-3), np.repeat(v, G, axis=-3)  # h -> h // G
    for mask in (
        None,
        rng.random((B, Hq, T, S)) < 0.7,
        rng.random((Hq, 1, S)) < 0.7,
        randn(rng, B, 1, T, S),
        rng.random((T, S)) < 0.7,
    ):
        got = sdpa_all(q, k, v, mask, is_causal=True, enable_gqa=True)
        expected = sdpa_all(q, k_rep, v_rep, mask, is_causal=True)
        for g, e in zip(got, expected):
            np.testing.assert_allclose(g, e, rtol=1e-14, atol=1e-15)


def test_gqa_head_h_reads_kv_head_h_over_g_in_the_loop_reference(rng):
    q, k, v = randn(rng, 6, T, 3), randn(rng, 2, S, 3), randn(rng, 2, S, DV)
    got = sdpa_all(q, k, v, enable_gqa=True)
    assert_matches_reference(got, attention_loop(q, k, v, enable_gqa=True))
    # not tiling: head 1 must read kv head 0, which np.tile would replace by kv head 1
    tiled = scaled_dot_product_attention(q, np.tile(k, (3, 1, 1)), np.tile(v, (3, 1, 1)))
    assert not np.allclose(got[0][1], tiled[1])


def test_gqa_5d_with_broadcast_batch(rng):
    q = randn(rng, B, 1, 6, T, 3)
    k, v = randn(rng, 1, 4, 3, S, 3), randn(rng, B, 4, 3, S, DV)
    got = sdpa_all(q, k, v, enable_gqa=True)
    assert got[0].shape == (B, 4, 6, T, DV)
    assert_matches_reference(got, attention_loop(q, k, v, enable_gqa=True))


def test_mqa_by_broadcasting_equals_enable_gqa(rng):
    q, k, v = randn(rng, B, H, T, DK), randn(rng, B, 1, S, DK), randn(rng, B, 1, S, DV)
    np.testing.assert_allclose(
        scaled_dot_product_attention(q, k, v),
        scaled_dot_product_attention(q, k, v, enable_gqa=True),
        rtol=1e-15,
    )


# --- properties ---------------------------------------------------------------------------------


@settings(max_examples=30, deadline=None)
@given(
    T_=st.integers(1, 6),
    S_=st.integers(1, 6),
    Dk=st.integers(1, 4),
    Dv=st.integers(1, 3),
    is_causal=st.booleans(),
    alignment=st.sampled_from(["top_left", "bottom_right"]),
    seed=st.integers(0, 2**32 - 1),
    magnitude=st.sampled_from([0.1, 1.0, 30.0]),
)
def test_property_rows_sum_to_one_and_key_permutation_changes_nothing(
    T_, S_, Dk, Dv, is_causal, alignment, seed, magnitude
):
    g = np.random.default_rng(seed)
    q, k, v = (magnitude * g.standard_normal(s) for s in ((T_, Dk), (S_, Dk), (S_, Dv)))
    mask = g.random((T_, S_)) < 0.8
    out, weights, lse = sdpa_all(q, k, v, mask, is_causal=is_causal, causal_alignment=alignment)
    alive = (mask & causal_mask(T_, S_, alignment=alignment) if is_causal else mask).any(-1)
    np.testing.assert_allclose(weights.sum(-1), np.where(alive, 1.0, 0.0), rtol=1e-13)
    assert np.all(weights >= 0)
    # permuting keys, values and the mask's key axis together changes nothing; the causal
    # mask is positional, so the permutation test runs without it
    perm = g.permutation(S_)
    out1 = scaled_dot_product_attention(q, k, v, mask)
    out2 = scaled_dot_product_attention(q, k[perm], v[perm], mask[:, perm])
    np.testing.assert_allclose(out1, out2, rtol=1e-12, atol=1e-12 * magnitude)


def test_permuting_queries_permutes_outputs(rng):
    q, k, v = randn(rng, B, T, DK), randn(rng, B, S, DK), randn(rng, B, S, DV)
    perm = rng.permutation(T)
    np.testing.assert_allclose(
        scaled_dot_product_attention(q[:, perm], k, v),
        scaled_dot_product_attention(q, k, v)[:, perm],
        rtol=1e-14,
    )


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_causal_outputs_do_not_depend_on_later_tokens(alignment, rng):
    # self-attention over S tokens; the queries are the last T_ of them under bottom-right
    T_ = S if alignment == "top_left" else T
    o = S - T_
    q, k, v = randn(rng, H, T_, DK), randn(rng, H, S, DK), randn(rng, H, S, DV)
    out = scaled_dot_product_attention(q, k, v, is_causal=True, causal_alignment=alignment)
    for cut in range(1, T_):
        q2, k2, v2 = q.copy(), k.copy(), v.copy()
        q2[:, cut:] = randn(rng, H, T_ - cut, DK)
        k2[:, cut + o :] = randn(rng, H, S - cut - o, DK) * 10
        v2[:, cut + o :] = randn(rng, H, S - cut - o, DV) * 10
        out2 = scaled_dot_product_attention(q2, k2, v2, is_causal=True, causal_alignment=alignment)
        np.testing.assert_allclose(out2[:, :cut], out[:, :cut], rtol=1e-14, atol=0)
        assert not np.allclose(out2[:, cut:], out[:, cut:])  # the change did reach later rows


def test_output_is_a_convex_combination_of_values(rng):
    q, k, v = randn(rng, T, DK) * 5, randn(rng, S, DK), randn(rng, S, DV)
    out = scaled_dot_product_attention(q, k, v)
    assert np.all(out <= v.max(axis=0) + 1e-12) and np.all(out >= v.min(axis=0) - 1e-12)


# --- dtypes -------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_floating_dtype_is_preserved(dtype, rng):
    q, k, v = (randn(rng, *s).astype(dtype) for s in ((H, T, DK), (H, S, DK), (H, S, DV)))
    out, weights, lse = sdpa_all(q, k, v, rng.random((T, S)) < 0.7, is_causal=True)
    assert out.dtype == weights.dtype == dtype
    assert lse.dtype == np.promote_types(dtype, np.float32)  # float16's lse is float32


def test_float16_is_computed_in_float32(rng):
    q, k, v = (randn(rng, *s).astype(np.float16) for s in ((H, T, DK), (H, S, DK), (H, S, DV)))
    out, weights, lse = sdpa_all(q, k, v)
    expected = sdpa_all(q.astype(np.float32), k.astype(np.float32), v.astype(np.float32))
    np.testing.assert_array_equal(out, expected[0].astype(np.float16))
    np.testing.assert_array_equal(weights, expected[1].astype(np.float16))
    assert lse.dtype == np.float32  # as FlashAttention: float16 overflows beyond 65504
    np.testing.assert_array_equal(lse, expected[2])


def test_float32_matches_float64_reference(rng):
    shapes = ((B, H, T, DK), (B, H, S, DK), (B, H, S, DV))
    q, k, v = (randn(rng, *s).astype(np.float32) for s in shapes)
    got = sdpa_all(q, k, v, is_causal=True)
    assert_matches_reference(got, attention_loop(q, k, v, is_causal=True), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dtype", [np.int64, np.int8, np.uint8, bool])
def test_integer_and_bool_inputs_compute_in_float64(dtype):
    q = CAT_Q.astype(dtype)
    k = THE_CAT_SLEEPS_K.astype(dtype)
    v = THE_CAT_SLEEPS_V.astype(dtype)
    out = scaled_dot_product_attention(q, k, v, scale=1.0)
    assert out.dtype == np.float64
    as_float = (a.astype(np.float64) for a in (q, k, v))
    np.testing.assert_array_equal(out, scaled_dot_product_attention(*as_float, scale=1.0))


@pytest.mark.parametrize(
    "dtypes, expected",
    [
        ((np.float32, np.float64, np.float32), np.float64),
        ((np.float16, np.float32, np.float16), np.float32),
        ((np.float32, np.int64, np.float32), np.float64),
        ((np.float16, np.float16, np.float64), np.float64),
    ],
)
def test_mixed_dtypes_promote_with_result_type(dtypes, expected, rng):
    q, k, v = (randn(rng, *s).astype(d) for s, d in zip(((T, DK), (S, DK), (S, DV)), dtypes))
    out, weights, lse = sdpa_all(q, k, v)
    assert out.dtype == weights.dtype == lse.dtype == expected


def test_float_mask_of_another_dtype_does_not_change_the_output_dtype(rng):
    q, k, v = (randn(rng, *s).astype(np.float32) for s in ((T, DK), (S, DK), (S, DV)))
    assert scaled_dot_product_attention(q, k, v, randn(rng, T, S)).dtype == np.float32


# --- inputs are never modified -------------------------------------------------------------------


def test_read_only_inputs_are_not_modified(rng):
    q, k, v = randn(rng, B, T, DK), randn(rng, B, S, DK), randn(rng, B, S, DV)
    mask = rng.random((B, T, S)) < 0.7
    bias = np.where(mask, randn(rng, B, T, S), -np.inf)
    arrays = (q, k, v, mask, bias)
    copies = [a.copy() for a in arrays]
    for a in arrays:
        a.flags.writeable = False
    for m in (mask, bias):
        sdpa_all(q, k, v, m, is_causal=True, window=(2, 2))
        sdpa_all(q, k, v, m, dropout_p=0.3, rng=np.random.default_rng(0))
    for a, c in zip(arrays, copies):
        np.testing.assert_array_equal(a, c)


@pytest.mark.parametrize("implementation", ["reference", "tiled"])
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_results_are_writeable_arrays_of_their_own(rng, implementation, dtype):
    # The results are not copied once more when the implementation made them for the call;
    # they must still never be read-only views, nor share memory with an input, with each
    # other or with the next call's results. Keys and values broadcast over the batch.
    q = randn(rng, B, 3, T, DK).astype(dtype)
    k, v = randn(rng, 1, 3, S, DK).astype(dtype), randn(rng, 1, 3, S, DV).astype(dtype)
    first = scaled_dot_product_attention(
        q, k, v, is_causal=True, implementation=implementation, return_lse=True
    )
    second = scaled_dot_product_attention(
        q, k, v, is_causal=True, implementation=implementation, return_lse=True
    )
    for a, b in zip(first, second):
        assert a.flags.writeable and a.shape[:2] == (B, 3)
        assert not any(np.shares_memory(a, x) for x in (q, k, v, b, *second))
        np.testing.assert_array_equal(a, b)
        a[...] = 0
    np.testing.assert_array_equal(first[0], 0)
    assert second[0].any()


def test_non_contiguous_views_and_lists_are_accepted(rng):
    big_q = randn(rng, B, 2 * T, DK + 3)
    q = big_q[:, ::2, 1 : DK + 1]  # strided view
    k = np.asfortranarray(randn(rng, B, S, DK))
    v = randn(rng, B, DV, S).transpose(0, 2, 1)  # transposed view
    mask = (rng.random((B, S, T)) < 0.7).transpose(0, 2, 1)
    expected = sdpa_all(*(np.ascontiguousarray(a) for a in (q, k, v, mask)))
    for g, e in zip(sdpa_all(q, k, v, mask), expected):
        np.testing.assert_allclose(g, e, rtol=1e-14)
    from_lists = sdpa_all(q.tolist(), k.tolist(), v.tolist(), mask.tolist())
    for g, e in zip(from_lists, expected):
        np.testing.assert_allclose(g, e, rtol=1e-14)


# --- dropout -----------------------------------------------------------------------------------


def test_dropout_scales_kept_weights_by_one_over_keep_probability(rng):
    # with V = identity, the output *is* the dropped-out weight matrix
    q, k = randn(rng, T, DK), randn(rng, S, DK)
    p = 0.4
    out, weights = scaled_dot_product_attention(
        q, k, np.eye(S), dropout_p=p, rng=np.random.default_rng(5), return_weights=True
    )
    np.testing.assert_allclose(weights, scaled_dot_product_attention(q, k, np.eye(S)), rtol=1e-15)
    kept = out != 0
    assert kept.any() and (~kept).any()
    np.testing.assert_allclose(out[kept], weights[kept] / (1 - p), rtol=1e-14)


def test_dropout_is_unbiased_on_average(rng):
    # N independent draws in one call: the batch axis broadcasts, each element gets its own mask
    N, p = 4000, 0.5
    q, k, v = randn(rng, T, 3), randn(rng, S, 3), randn(rng, S, DV)
    out, weights = scaled_dot_product_attention(q, k, v, return_weights=True)
    draws = scaled_dot_product_attention(
        np.broadcast_to(q, (N, T, 3)), k, v, dropout_p=p, rng=np.random.default_rng(11)
    )
    # out_d = sum_j w_j v_j keep_j / (1 - p): variance sum_j (w_j v_j)^2 p / (1 - p)
    std_error = np.sqrt((weights**2 @ v**2) * p / (1 - p) / N)
    assert np.all(np.abs(draws.mean(axis=0) - out) < 5 * std_error)


def test_dropout_is_reproducible_with_the_same_seed(rng):
    q, k, v = randn(rng, H, T, DK), randn(rng, H, S, DK), randn(rng, H, S, DV)
    a = scaled_dot_product_attention(q, k, v, dropout_p=0.3, rng=np.random.default_rng(7))
    b = scaled_dot_product_attention(q, k, v, dropout_p=0.3, rng=np.random.default_rng(7))
    c = scaled_dot_product_attention(q, k, v, dropout_p=0.3, rng=np.random.default_rng(8))
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, c)


def test_dropout_of_one_gives_zeros_and_zero_needs_no_rng(rng):
    q, k, v = randn(rng, T, DK), randn(rng, S, DK), randn(rng, S, DV)
    with np.errstate(**RAISE_ON_TROUBLE):
        out = scaled_dot_product_attention(q, k, v, dropout_p=1.0, rng=np.random.default_rng(0))
    np.testing.assert_array_equal(out, 0.0)
    np.testing.assert_array_equal(
        scaled_dot_product_attention(q, k, v, dropout_p=0.0),
        scaled_dot_product_attention(q, k, v, dropout_p=0.0, rng=np.random.default_rng(0)),
    )


@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_dropout_preserves_dtype(dtype, rng):
    q, k, v = (randn(rng, *s).astype(dtype) for s in ((T, DK), (S, DK), (S, DV)))
    out = scaled_dot_product_attention(q, k, v, dropout_p=0.5, rng=np.random.default_rng(1))
    assert out.dtype == dtype


# --- return values --------------------------------------------------------------------------------


def test_return_tuple_order_is_out_weights_lse(rng):
    q, k, v = randn(rng, H, T, DK), randn(rng, H, S, DK), randn(rng, H, S, DV)
    out = scaled_dot_product_attention(q, k, v)
    assert isinstance(out, np.ndarray) and out.shape == (H, T, DV)
    ref_out, ref_w, ref_lse = attention_loop(q, k, v)
    pair = scaled_dot_product_attention(q, k, v, return_weights=True)
    assert isinstance(pair, tuple) and len(pair) == 2
    np.testing.assert_allclose(pair[1], ref_w, **F64)
    pair = scaled_dot_product_attention(q, k, v, return_lse=True)
    assert len(pair) == 2 and pair[1].shape == (H, T)
    np.testing.assert_allclose(pair[1], ref_lse, **F64)
    triple = scaled_dot_product_attention(q, k, v, return_weights=True, return_lse=True)
    assert len(triple) == 3
    assert_matches_reference(triple, (ref_out, ref_w, ref_lse))


def test_weights_and_lse_are_consistent(rng):
    q, k, v = randn(rng, B, H, T, DK), randn(rng, B, H, S, DK), randn(rng, B, H, S, DV)
    bias = randn(rng, T, S)
    out, weights, lse = sdpa_all(q, k, v, bias)
    scores = q @ np.swapaxes(k, -1, -2) / math.sqrt(DK) + bias
    np.testing.assert_allclose(weights, np.exp(scores - lse[..., None]), rtol=1e-12)
    np.testing.assert_allclose(out, weights @ v, rtol=1e-12, atol=1e-14)


# --- errors: one test per raise -------------------------------------------------------------------


def q_k_v(q_shape=(T, DK), k_shape=(S, DK), v_shape=(S, DV)):
    return np.zeros(q_shape), np.zeros(k_shape), np.zeros(v_shape)


@pytest.mark.parametrize("which", ["query", "key", "value"])
def test_fewer_than_two_dimensions_raise(which):
    args = dict(zip(("query", "key", "value"), q_k_v()))
    args[which] = np.zeros(3)
    with pytest.raises(
        ValueError,
        match=rf"{which} must have at least 2 dimensions \(\.\.\., L, D\); got "
        rf"{which}.shape=\(3,\)",
    ):
        scaled_dot_product_attention(**args)


def test_dk_mismatch_raises():
    with pytest.raises(
        ValueError,
        match=r"query and key must share the last dimension Dk; got query.shape=\(5, 11\), "
        r"key.shape=\(7, 3\)",
    ):
        scaled_dot_product_attention(*q_k_v(k_shape=(S, 3)))


def test_s_mismatch_raises():
    with pytest.raises(
        ValueError,
        match=r"key and value must share the sequence length S \(axis -2\); got key.shape=\(7, "
        r"11\), value.shape=\(5, 4\)",
    ):
        scaled_dot_product_attention(*q_k_v(v_shape=(T, DV)))


def test_batch_shapes_that_do_not_broadcast_raise():
    with pytest.raises(
        ValueError,
        match=r"batch and head dimensions of query, key and value must broadcast .*got "
        r"query.shape=\(2, 5, 11\), key.shape=\(3, 7, 11\)",
    ):
        scaled_dot_product_attention(*q_k_v((B, T, DK), (H, S, DK), (H, S, DV)))


def test_gqa_batch_shapes_that_do_not_broadcast_raise():
    with pytest.raises(
        ValueError,
        match=r"the batch dimensions of query, key and value must broadcast; got query.shape=\(2, "
        r"6, 5, 11\)",
    ):
        args = q_k_v((2, 6, T, DK), (3, 3, S, DK), (3, 3, S, DV))
        scaled_dot_product_attention(*args, enable_gqa=True)


def test_gqa_heads_that_do_not_divide_raise():
    with pytest.raises(
        ValueError,
        match=r"query heads Hq=6 must be a multiple of the key/value heads Hkv=4; got "
        r"query.shape=\(6, 5, 11\), key.shape=\(4, 7, 11\)",
    ):
        scaled_dot_product_attention(*q_k_v((6, T, DK), (4, S, DK), (4, S, DV)), enable_gqa=True)


def test_gqa_key_and_value_heads_differ_raises():
    with pytest.raises(
        ValueError,
        match=r"key and value must have the same number of heads; got key.shape=\(3, 7, 11\), "
        r"value.shape=\(2, 7, 4\)",
    ):
        scaled_dot_product_attention(*q_k_v((6, T, DK), (3, S, DK), (2, S, DV)), enable_gqa=True)


def test_gqa_without_a_heads_axis_raises():
    with pytest.raises(
        ValueError,
        match=r"enable_gqa=True needs a heads axis \(\.\.\., H, L, D\) in query; got "
        r"query.shape=\(5, 11\)",
    ):
        scaled_dot_product_attention(*q_k_v(), enable_gqa=True)


@pytest.mark.parametrize(
    "mask_shape", [(S + 1,), (T + 1, S), (B + 1, 1, 1, S), (1, 1, 1, T, S)], ids=str
)
def test_mask_that_does_not_broadcast_raises(mask_shape):
    with pytest.raises(
        ValueError,
        match=r"attn_mask must broadcast to the attention weights of shape \(2, 3, 5, 7\) "
        r"\(\.\.\., H, T, S\); got attn_mask.shape=",
    ):
        args = q_k_v((B, H, T, DK), (B, H, S, DK), (B, H, S, DV))
        scaled_dot_product_attention(*args, np.ones(mask_shape, bool))


def test_gqa_mask_is_checked_against_the_query_heads():
    with pytest.raises(
        ValueError,
        match=r"attn_mask must broadcast to the attention weights of shape \(6, 5, 7\)",
    ):
        args = q_k_v((6, T, DK), (3, S, DK), (3, S, DV))
        scaled_dot_product_attention(*args, np.ones((3, T, S), bool), enable_gqa=True)


def test_zero_dimensional_mask_raises():
    with pytest.raises(
        ValueError,
        match=r"attn_mask must have at least one dimension \(S,\); got a 0-d array",
    ):
        scaled_dot_product_attention(*q_k_v(), np.array(True))


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint8])
def test_integer_mask_raises_and_says_convert_to_bool(dtype):
    with pytest.raises(
        TypeError,
        match=r"attn_mask has integer dtype .*convert it to bool with True = may attend",
    ):
        scaled_dot_product_attention(*q_k_v(), np.ones((T, S), dtype))


@pytest.mark.parametrize(
    "mask",
    [np.ones(S, complex), np.array(["a"] * S), np.array([None] * S)],
    ids=["complex", "str", "object"],
)
def test_mask_of_another_kind_raises(mask):
    with pytest.raises(
        TypeError,
        match=r"attn_mask must be a bool array \(True = may attend\) or a float bias; got dtype",
    ):
        scaled_dot_product_attention(*q_k_v(), mask)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_float_mask_with_nan_or_plus_inf_raises(bad):
    bias = np.zeros(S)
    bias[2] = bad
    with pytest.raises(
        ValueError,
        match=r"attn_mask as a float bias must not contain NaN or \+inf",
    ):
        scaled_dot_product_attention(*q_k_v(), bias)


def test_a_float64_bias_that_rounds_to_float32s_largest_is_kept():
    # float32's largest is (2 - 2**-23) * 2**127; a float64 below it + half an ulp (2**103)
    # rounds down to it, and from that half ulp on becomes inf.
    top = float(np.finfo(np.float32).max)
    q, k, v = (a.astype(np.float32) for a in q_k_v())
    for sign in (1.0, -1.0):
        kept = np.zeros(S)
        kept[:-1] = sign * (top + 2.0**103 - 2.0**80)  # every key but the last, equal
        out = scaled_dot_product_attention(q, k, v, kept[None], implementation="reference")
        expected = v[..., :-1, :].mean(axis=-2) if sign > 0 else v[..., -1, :]
        np.testing.assert_allclose(out[..., 0, :], expected, rtol=1e-5, atol=1e-6)
        refused = np.zeros(S)
        refused[1] = sign * (top + 2.0**103)
        with pytest.raises(ValueError, match="attn_mask"):
            scaled_dot_product_attention(q, k, v, refused)


@pytest.mark.parametrize("which", ["query", "key", "value"])
@pytest.mark.parametrize("dtype", [complex, object])
def test_complex_and_object_inputs_raise(which, dtype):
    args = dict(zip(("query", "key", "value"), q_k_v()))
    args[which] = args[which].astype(dtype)
    with pytest.raises(
        TypeError,
        match=rf"{which} must be a real floating, integer or bool array; got dtype",
    ):
        scaled_dot_product_attention(**args)


def test_bad_causal_alignment_raises():
    with pytest.raises(
        ValueError,
        match=r"causal_alignment must be 'top_left' or 'bottom_right'; got 'bottom-right'",
    ):
        scaled_dot_product_attention(*q_k_v(), is_causal=True, causal_alignment="bottom-right")


@pytest.mark.parametrize("window", [(1,), 3, (-1, 0), (0, 2.5), (1, 2, 3)], ids=str)
def test_bad_window_raises(window):
    with pytest.raises(
        ValueError,
        match=r"window must be a pair \(left, right\) of non-negative integers or None; got",
    ):
        scaled_dot_product_attention(*q_k_v(), window=window)


@pytest.mark.parametrize("flag", ["is_causal", "enable_gqa", "return_weights", "return_lse"])
@pytest.mark.parametrize("value", [1, "no", None])
def test_non_bool_flag_raises(flag, value):
    # return_weights="no" used to return the weights (a non-empty string is true)
    with pytest.raises(TypeError, match=rf"{flag} must be a bool; got {value!r}"):
        scaled_dot_product_attention(*q_k_v((1, T, DK), (1, S, DK), (1, S, DV)), **{flag: value})


def test_numpy_bools_are_bools():
    out = scaled_dot_product_attention(*q_k_v(), is_causal=np.True_, return_lse=np.False_)
    assert out.shape == (T, DV)


def test_a_wrong_rng_raises_even_without_dropout():
    with pytest.raises(TypeError, match=r"rng must be a numpy.random.Generator, .* got int"):
        scaled_dot_product_attention(*q_k_v(), rng=0)


@pytest.mark.parametrize("which", ["query", "key", "value", "attn_mask"])
def test_masked_arrays_raise_and_point_to_attn_mask(which):
    # np.asarray drops the mask of a numpy.ma array: the masked entries would be used.
    args = dict(zip(("query", "key", "value"), q_k_v()))
    args["attn_mask"] = None
    data = args[which] if which != "attn_mask" else np.zeros((T, S), dtype=bool)
    args[which] = np.ma.masked_array(data, mask=np.zeros(data.shape, dtype=bool))
    hint = "a plain bool array" if which == "attn_mask" else "the plain array, and .* attn_mask"
    with pytest.raises(
        TypeError,
        match=rf"{which} must not be a numpy.ma.MaskedArray: its mask "
        rf"would be silently ignored; pass {hint}",
    ):
        scaled_dot_product_attention(**args)


@pytest.mark.parametrize("which", ["query", "attn_mask"])
def test_ragged_input_names_the_argument(which):
    args = dict(zip(("query", "key", "value"), q_k_v()))
    args[which] = [[0.0, 1.0], [2.0]]
    with pytest.raises(ValueError, match=rf"^{which} must be an array or a rectangular nested "):
        scaled_dot_product_attention(**args)


def test_none_input_names_the_argument():
    with pytest.raises(TypeError, match=r"^key must be an array; got None"):
        scaled_dot_product_attention(np.zeros((T, DK)), None, np.zeros((S, DV)))


def test_scale_beyond_the_working_dtype_raises():
    q = np.zeros((T, DK), np.float32)
    with pytest.raises(ValueError, match=r"scale must fit in float32, .*; got 1e\+300"):
        scaled_dot_product_attention(q, q, q, scale=1e300)


def test_reference_path_refuses_what_cannot_fit_in_memory():
    # (2, 10**6, 10**6) float64 weights: 16 TB. Broadcast views cost nothing to pass in.
    q = np.broadcast_to(np.zeros((1, 1, 4)), (2, 10**6, 4))
    with pytest.raises(
        MemoryError,
        match=r"the reference path's scores and weights of shape \(2, 1000000, 1000000\) in "
        r"float64 would take about .* TiB \(48000000000000 bytes\), more than the .* "
        r"available; use implementation='tiled'",
    ):
        scaled_dot_product_attention(q, q, q, return_weights=True)


@pytest.mark.parametrize("scale", [np.inf, -np.inf, np.nan])
def test_non_finite_scale_raises(scale):
    with pytest.raises(ValueError, match=r"scale must be a finite real number or None; got"):
        scaled_dot_product_attention(*q_k_v(), scale=scale)


@pytest.mark.parametrize("scale", ["1", True, 1j])
def test_scale_of_wrong_kind_raises(scale):
    with pytest.raises(TypeError, match=r"scale must be a finite real number or None; got"):
        scaled_dot_product_attention(*q_k_v(), scale=scale)


@pytest.mark.parametrize("p", [-0.1, 1.5, np.nan])
def test_dropout_outside_unit_interval_raises(p):
    with pytest.raises(ValueError, match=r"dropout_p must be a real number in \[0, 1\]; got"):
        scaled_dot_product_attention(*q_k_v(), dropout_p=p, rng=np.random.default_rng(0))


def test_dropout_of_wrong_kind_raises():
    with pytest.raises(TypeError, match=r"dropout_p must be a real number in \[0, 1\]; got '0.1'"):
        scaled_dot_product_attention(*q_k_v(), dropout_p="0.1")


def test_dropout_without_rng_raises():
    with pytest.raises(
        TypeError,
        match=r"dropout_p=0.5 > 0 needs an explicit rng=np.random.default_rng\(seed\)",
    ):
        scaled_dot_product_attention(*q_k_v(), dropout_p=0.5)


def test_dropout_with_a_legacy_random_state_raises():
    with pytest.raises(
        TypeError,
        match=r"rng must be a numpy.random.Generator, e.g. np.random.default_rng\(0\); got "
        r"RandomState",
    ):
        scaled_dot_product_attention(*q_k_v(), dropout_p=0.5, rng=np.random.RandomState(0))


def test_options_after_the_star_are_keyword_only():
    with pytest.raises(TypeError, match="positional arguments but 7 were given"):
        scaled_dot_product_attention(*q_k_v(), None, 0.0, False, 1.0)
