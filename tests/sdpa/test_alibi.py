"""Tests for sdpa.alibi: slopes from the paper's rule, the bias by loops, attention with it."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sdpa import alibi_bias, alibi_slopes, scaled_dot_product_attention

# ---------------------------------------------------------------------------------------------
# slopes


def test_slopes_for_8_heads_are_halvings():
    np.testing.assert_array_equal(
        alibi_slopes(8), [1 / 2, 1 / 4, 1 / 8, 1 / 16, 1 / 32, 1 / 64, 1 / 128, 1 / 256]
    )


@pytest.mark.parametrize(
    "n, expected",
    [
        (1, [1 / 256]),
        (2, [1 / 16, 1 / 256]),
        (4, [1 / 4, 1 / 16, 1 / 64, 1 / 256]),
        (16, [2 ** (-k / 2) for k in range(1, 17)]),  # start 2**-0.5, ratio 2**-0.5
    ],
)
def test_slopes_for_powers_of_two(n, expected):
    np.testing.assert_allclose(alibi_slopes(n), expected, rtol=1e-15)


@pytest.mark.parametrize(
    "n, expected",
    [
        # 3 heads: the 2 slopes for H=2, then slope k=1 of H=4
        (3, [2**-4, 2**-8, 2**-2]),
        # 6 heads: the 4 slopes for H=4, then slopes k=1, 3 of H=8
        (6, [2**-2, 2**-4, 2**-6, 2**-8, 2**-1, 2**-3]),
        # 12 heads: the 8 slopes for H=8, then slopes k=1, 3, 5, 7 of H=16 (2**(-k/2))
        (
            12,
            [
                2**-1,
                2**-2,
                2**-3,
                2**-4,
                2**-5,
                2**-6,
                2**-7,
                2**-8,
                2**-0.5,
                2**-1.5,
                2**-2.5,
                2**-3.5,
            ],
        ),
    ],
)
def test_slopes_for_other_head_counts_written_by_hand(n, expected):
    np.testing.assert_allclose(alibi_slopes(n), expected, rtol=1e-15)


def paper_rule(n: int) -> list[float]:
    """The rule of Press et al., recursive as they state it, with a start value 2**(-8/n)."""
    if math.log2(n).is_integer():
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]
    closest = 2 ** math.floor(math.log2(n))
    return paper_rule(closest) + paper_rule(2 * closest)[0::2][: n - closest]


def test_slopes_match_the_recursive_rule_for_many_head_counts():
    for n in range(1, 97):
        np.testing.assert_allclose(alibi_slopes(n), paper_rule(n), rtol=1e-13, err_msg=f"n={n}")


def test_slopes_are_distinct_and_in_unit_interval():
    for n in (5, 12, 40, 96):
        s = alibi_slopes(n)
        assert s.dtype == np.float64 and s.shape == (n,)
        assert np.all((s > 0) & (s < 1))
        assert len(np.unique(s)) == n


# ---------------------------------------------------------------------------------------------
# bias


def bias_by_loops(n_heads, T, S, alignment):
    slopes = paper_rule(n_heads)
    o = 0 if alignment == "top_left" else S - T
    out = np.zeros((n_heads, T, S))
    for h in range(n_heads):
        for i in range(T):
            for j in range(S):
                out[h, i, j] = -slopes[h] * abs((i + o) - j)
    return out


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("H, T, S", [(3, 5, 7), (4, 7, 5), (6, 1, 9), (2, 4, 4)])
def test_bias_values_by_loops(H, T, S, alignment):
    bias = alibi_bias(H, T, S, alignment=alignment)
    assert bias.shape == (H, T, S) and bias.dtype == np.float64
    np.testing.assert_allclose(bias, bias_by_loops(H, T, S, alignment), rtol=1e-15, atol=0)


def test_bias_hand_values():
    # one head (slope 1/256), 2 new queries after 3 cached keys: queries at positions 3, 4
    np.testing.assert_array_equal(
        alibi_bias(1, 2, 5, alignment="bottom_right")[0] * 256,
        [[-3, -2, -1, 0, -1], [-4, -3, -2, -1, 0]],
    )
    np.testing.assert_array_equal(
        alibi_bias(1, 2, 5)[0] * 256, [[0, -1, -2, -3, -4], [-1, 0, -1, -2, -3]]
    )


def test_bottom_right_rows_are_the_last_rows_of_the_full_bias():
    full = alibi_bias(5, 9, 9)
    np.testing.assert_array_equal(alibi_bias(5, 3, 9, alignment="bottom_right"), full[:, 6:])
    np.testing.assert_array_equal(alibi_bias(5, 1, 9, alignment="bottom_right"), full[:, 8:])


# ---------------------------------------------------------------------------------------------
# attention with the bias


def manual_attention(q, k, v, bias, causal_offset):
    """softmax(q k^T / sqrt(Dk) + bias, causal) v, written out in float64."""
    T, S = q.shape[-2], k.shape[-2]
    scores = q @ np.swapaxes(k, -1, -2) / math.sqrt(q.shape[-1]) + bias
    future = np.arange(S)[None, :] > np.arange(T)[:, None] + causal_offset
    scores = np.where(future, -np.inf, scores)
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    return weights @ v


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_attention_with_bias_equals_bias_added_to_scores(rng, alignment):
    B, H, T, S, Dk, Dv = 2, 6, 3, 7, 5, 4
    q = rng.normal(size=(B, H, T, Dk))
    k = rng.normal(size=(B, H, S, Dk))
    v = rng.normal(size=(B, H, S, Dv))
    bias = alibi_bias(H, T, S, alignment=alignment)
    out = scaled_dot_product_attention(
        q, k, v, attn_mask=bias, is_causal=True, causal_alignment=alignment
    )
    offset = 0 if alignment == "top_left" else S - T
    np.testing.assert_allclose(out, manual_attention(q, k, v, bias, offset), rtol=1e-12, atol=1e-13)


def test_attention_with_bias_matches_torch(torch, rng):
    H, T, Dk = 4, 9, 8
    q, k, v = rng.normal(size=(3, 2, H, T, Dk))
    bias = alibi_bias(H, T, T)
    causal_bias = np.where(np.tril(np.ones((T, T), dtype=bool)), bias, -np.inf)
    expected = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(a) for a in (q, k, v)), attn_mask=torch.from_numpy(causal_bias)
    ).numpy()
    out = scaled_dot_product_attention(q, k, v, attn_mask=bias, is_causal=True)
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-13)


def test_decoding_with_bottom_right_bias_equals_full_attention(rng):
    H, T, D = 4, 8, 6
    q, k, v = rng.normal(size=(3, H, T, D))
    full = scaled_dot_product_attention(q, k, v, attn_mask=alibi_bias(H, T, T), is_causal=True)
    for t in range(T):  # query t against the keys 0..t, as with a KV cache
        step = scaled_dot_product_attention(
            q[:, t : t + 1],
            k[:, : t + 1],
            v[:, : t + 1],
            attn_mask=alibi_bias(H, 1, t + 1, alignment="bottom_right"),
            is_causal=True,
            causal_alignment="bottom_right",
        )
        np.testing.assert_allclose(step[:, 0], full[:, t], rtol=1e-12, atol=1e-13)


def test_key_position_form_is_equivalent_under_causal_mask(rng):
    # slope * j differs from -slope * (i - j) by a per-row constant, which softmax ignores
    H, T, D = 3, 6, 4
    q, k, v = rng.normal(size=(3, H, T, D))
    key_form = alibi_slopes(H)[:, None, None] * np.arange(T)[None, None, :]  # (H, 1, S)
    a = scaled_dot_product_attention(q, k, v, attn_mask=alibi_bias(H, T, T), is_causal=True)
    b = scaled_dot_product_attention(q, k, v, attn_mask=key_form, is_causal=True)
    np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-13)


def test_bias_keeps_float32_attention_float32(rng):
    q = rng.normal(size=(2, 4, 8)).astype(np.float32)
    out = scaled_dot_product_attention(q, q, q, attn_mask=alibi_bias(2, 4, 4), is_causal=True)
    assert out.dtype == np.float32


def test_empty_sizes():
    assert alibi_bias(2, 0, 3).shape == (2, 0, 3)
    assert alibi_bias(2, 3, 0).shape == (2, 3, 0)


# ---------------------------------------------------------------------------------------------
# errors


@pytest.mark.parametrize("n", [0, -4])
def test_bad_head_count_value_raises(n):
    with pytest.raises(ValueError, match=r"n_heads must be (at least 1|a non-negative integer)"):
        alibi_slopes(n)


@pytest.mark.parametrize("n", [2.0, True, "8", None])
def test_bad_head_count_kind_raises(n):
    with pytest.raises(TypeError, match="n_heads must be a non-negative integer"):
        alibi_slopes(n)


def test_zero_heads_message():
    with pytest.raises(ValueError, match="n_heads must be at least 1; got 0"):
        alibi_bias(0, 2, 2)


def test_negative_length_raises():
    with pytest.raises(ValueError, match="S must be a non-negative integer; got -1"):
        alibi_bias(2, 3, -1)


def test_non_integer_length_raises():
    with pytest.raises(TypeError, match="T must be a non-negative integer; got 2.5"):
        alibi_bias(2, 2.5, 3)


def test_unknown_alignment_raises():
    with pytest.raises(
        ValueError, match="alignment must be 'top_left' or 'bottom_right'; got 'left'"
    ):
        alibi_bias(2, 3, 3, alignment="left")
