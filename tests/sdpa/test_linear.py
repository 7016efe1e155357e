"""Tests of sdpa.linear: linear attention against its explicit quadratic form, built here."""

from __future__ import annotations

import numpy as np
import pytest

from sdpa import elu_feature_map, linear_attention


def quadratic_form(q, k, v, phi, *, causal=False, offset=0, eps=1e-6):
    """The O(n^2) definition in float64 loops: o_i = sum_j s_ij v_j / (eps + sum_j s_ij)."""
    q, k, v = (np.asarray(a, dtype=np.float64) for a in (q, k, v))
    T, S = q.shape[0], k.shape[0]
    out = np.zeros((T, v.shape[1]))
    for i in range(T):
        num, den = np.zeros(v.shape[1]), 0.0
        for j in range(S):
            if causal and j > i + offset:
                continue
            s = float(np.dot(phi(q[i]), phi(k[j])))
            num += s * v[j]
            den += s
        if den + eps > 0:
            out[i] = num / (den + eps)
    return out


def elu1_by_hand(x):
    """elu(x) + 1 written from its definition, independently of the package."""
    x = np.asarray(x, dtype=np.float64)
    return np.array([xi + 1.0 if xi > 0 else np.exp(xi) for xi in x.ravel()]).reshape(x.shape)


def test_elu_feature_map_hand_values():
    x = np.array([-1.0, 0.0, 0.5, 3.0])
    expected = [np.exp(-1.0), 1.0, 1.5, 4.0]
    np.testing.assert_allclose(elu_feature_map(x), expected, rtol=1e-15)


def test_elu_feature_map_no_overflow_and_dtype():
    x = np.array([-1000.0, 1000.0], dtype=np.float32)
    y = elu_feature_map(x)
    assert y.dtype == np.float32
    np.testing.assert_array_equal(y, np.array([0.0, 1001.0], dtype=np.float32))


@pytest.mark.parametrize("T,S", [(5, 7), (7, 5), (6, 6), (1, 11)])
def test_noncausal_equals_quadratic_form(rng, T, S):
    q = rng.standard_normal((T, 3))
    k = rng.standard_normal((S, 3))
    v = rng.standard_normal((S, 4))
    np.testing.assert_allclose(
        linear_attention(q, k, v), quadratic_form(q, k, v, elu1_by_hand), rtol=1e-12, atol=1e-13
    )


@pytest.mark.parametrize("chunk_size", [1, 2, 3, 64])
@pytest.mark.parametrize(
    "T,S,alignment",
    [
        (9, 9, "top_left"),
        (5, 9, "bottom_right"),
        (9, 5, "bottom_right"),
        (5, 9, "top_left"),
        (9, 5, "top_left"),
    ],
)
def test_causal_equals_masked_quadratic_form(rng, chunk_size, T, S, alignment):
    q = rng.standard_normal((T, 3))
    k = rng.standard_normal((S, 3))
    v = rng.standard_normal((S, 4))
    offset = S - T if alignment == "bottom_right" else 0
    got = linear_attention(
        q, k, v, is_causal=True, causal_alignment=alignment, chunk_size=chunk_size
    )
    np.testing.assert_allclose(
        got,
        quadratic_form(q, k, v, elu1_by_hand, causal=True, offset=offset),
        rtol=1e-12,
        atol=1e-13,
    )


def test_causal_rows_that_see_no_key_are_zero(rng):
    q = rng.standard_normal((6, 3))
    k = rng.standard_normal((2, 3))
    v = rng.standard_normal((2, 4))
    out = linear_attention(q, k, v, is_causal=True, causal_alignment="bottom_right", eps=0.0)
    np.testing.assert_array_equal(out[:4], 0.0)  # queries at positions -4..-1 see nothing
    np.testing.assert_allclose(out[4], v[0], rtol=1e-14)  # sees only key 0


def test_future_keys_do_not_change_past_outputs(rng):
    q, k, v = rng.standard_normal((3, 8, 4))
    out = linear_attention(q, k, v, is_causal=True, chunk_size=3)
    k2, v2 = k.copy(), v.copy()
    k2[5:] += 10.0
    v2[5:] -= 7.0
    out2 = linear_attention(q, k2, v2, is_causal=True, chunk_size=3)
    np.testing.assert_array_equal(out[:5], out2[:5])
    assert np.abs(out[5:] - out2[5:]).min() > 1e-3


def test_custom_feature_map_and_width_change(rng):
    """A callable that changes the width (F != Dk): phi(x) = [relu(x), relu(-x), 1]."""

    def phi(x):
        x = np.asarray(x)
        return np.concatenate([np.maximum(x, 0), np.maximum(-x, 0), np.ones_like(x[..., :1])], -1)

    q = rng.standard_normal((4, 3))
    k = rng.standard_normal((6, 3))
    v = rng.standard_normal((6, 2))
    np.testing.assert_allclose(
        linear_attention(q, k, v, feature_map=phi),
        quadratic_form(q, k, v, phi),
        rtol=1e-12,
        atol=1e-13,
    )
    np.testing.assert_allclose(
        linear_attention(q, k, v, feature_map=phi, is_causal=True, chunk_size=2),
        quadratic_form(q, k, v, phi, causal=True),
        rtol=1e-12,
        atol=1e-13,
    )


def test_constant_feature_map_gives_the_mean_of_values(rng):
    """phi = 1 makes every weight equal: the output is the (prefix) mean of the values."""
    q = rng.standard_normal((5, 3))
    k = rng.standard_normal((5, 3))
    v = rng.standard_normal((5, 2))
    ones = lambda x: np.ones_like(x)  # noqa: E731
    out = linear_attention(q, k, v, feature_map=ones, eps=0.0)
    np.testing.assert_allclose(out, np.broadcast_to(v.mean(0), (5, 2)), rtol=1e-14)
    out = linear_attention(q, k, v, feature_map=ones, eps=0.0, is_causal=True)
    prefix_mean = np.cumsum(v, 0) / np.arange(1, 6)[:, None]
    np.testing.assert_allclose(out, prefix_mean, rtol=1e-14)


@pytest.mark.parametrize("is_causal", [False, True])
def test_broadcasting_leading_dims(rng, is_causal):
    q = rng.standard_normal((2, 3, 5, 4))  # (B, H, T, Dk)
    k = rng.standard_normal((1, 3, 6, 4))  # broadcasts over B
    v = rng.standard_normal((2, 1, 6, 2))  # broadcasts over H
    out = linear_attention(
        q, k, v, is_causal=is_causal, causal_alignment="bottom_right", chunk_size=2
    )
    assert out.shape == (2, 3, 5, 2)
    for b in range(2):
        for h in range(3):
            ref = quadratic_form(
                q[b, h], k[0, h], v[b, 0], elu1_by_hand, causal=is_causal, offset=1
            )
            np.testing.assert_allclose(out[b, h], ref, rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("dtype,tol", [(np.float16, 2e-3), (np.float32, 2e-6), (np.float64, 1e-13)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_dtypes_preserved_and_accurate(rng, dtype, tol, is_causal):
    q, k, v = (rng.standard_normal((7, 4)).astype(dtype) for _ in range(3))
    out = linear_attention(q, k, v, is_causal=is_causal, chunk_size=3)
    assert out.dtype == dtype
    ref = quadratic_form(q, k, v, elu1_by_hand, causal=is_causal)
    np.testing.assert_allclose(out.astype(np.float64), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("size", [1e30, 1e-30])
def test_features_far_from_one_neither_overflow_nor_underflow(rng, is_causal, size):
    # Features of 1e30 are finite in float32, but the sums over keys (1e60) are not: the
    # result was NaN. Expected: the quadratic form in float64, where nothing overflows.
    phi = lambda x: np.abs(x) * size + 1e-3 * size  # noqa: E731 (finite, positive features)
    q, k, v = (rng.standard_normal(s).astype(np.float32) for s in ((6, 4), (9, 4), (9, 3)))
    out = linear_attention(q, k, v, feature_map=phi, is_causal=is_causal, eps=0.0)
    assert out.dtype == np.float32 and np.isfinite(out).all()
    want = quadratic_form(
        *(a.astype(np.float64) for a in (q, k, v)), phi, causal=is_causal, eps=0.0
    )
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


def test_integer_inputs_compute_in_float64():
    q = np.array([[1, 0], [0, 1]])
    out = linear_attention(q, q, np.array([[1, 0], [0, 1]]), eps=0.0)
    assert out.dtype == np.float64
    # phi([1, 0]) = [2, 1], phi([0, 1]) = [1, 2]: sims [[5, 4], [4, 5]], weights /9
    np.testing.assert_allclose(out, [[5 / 9, 4 / 9], [4 / 9, 5 / 9]], rtol=1e-15)


def test_inputs_not_mutated(rng):
    q, k, v = rng.standard_normal((3, 5, 4))
    copies = [a.copy() for a in (q, k, v)]
    linear_attention(q, k, v, is_causal=True)
    for a, c in zip((q, k, v), copies):
        np.testing.assert_array_equal(a, c)


def test_empty_sequences():
    out = linear_attention(np.ones((3, 2)), np.ones((0, 2)), np.ones((0, 4)))
    np.testing.assert_array_equal(out, np.zeros((3, 4)))
    out = linear_attention(np.ones((0, 2)), np.ones((3, 2)), np.ones((3, 4)), is_causal=True)
    assert out.shape == (0, 4)


# -- errors: one per raise ------------------------------------------------------------------


def test_error_dk_mismatch():
    with pytest.raises(ValueError, match=r"share the last dimension Dk; got query.shape=\(4, 3\)"):
        linear_attention(np.ones((4, 3)), np.ones((5, 2)), np.ones((5, 2)))


def test_error_s_mismatch():
    with pytest.raises(ValueError, match=r"sequence length S.*value.shape=\(4, 2\)"):
        linear_attention(np.ones((4, 3)), np.ones((5, 3)), np.ones((4, 2)))


def test_error_too_few_dims():
    with pytest.raises(ValueError, match=r"query must have at least 2 dimensions"):
        linear_attention(np.ones(3), np.ones((5, 3)), np.ones((5, 2)))


def test_error_leading_dims_do_not_broadcast():
    with pytest.raises(
        ValueError, match="leading dimensions of query, key and value must broadcast"
    ):
        linear_attention(np.ones((2, 4, 3)), np.ones((3, 5, 3)), np.ones((3, 5, 2)))


def test_error_complex_input():
    with pytest.raises(TypeError, match="query must be a real"):
        linear_attention(np.ones((2, 2), complex), np.ones((2, 2)), np.ones((2, 2)))


def test_error_is_causal_not_bool():
    with pytest.raises(TypeError, match="is_causal must be a bool"):
        linear_attention(np.ones((2, 2)), np.ones((2, 2)), np.ones((2, 2)), is_causal=1)


def test_error_bad_alignment():
    with pytest.raises(ValueError, match="causal_alignment must be 'top_left' or 'bottom_right'"):
        linear_attention(np.ones((2, 2)), np.ones((2, 2)), np.ones((2, 2)), causal_alignment="x")


def test_error_feature_map_not_callable():
    with pytest.raises(TypeError, match="feature_map must be callable"):
        linear_attention(np.ones((2, 2)), np.ones((2, 2)), np.ones((2, 2)), feature_map="elu")


def test_error_feature_map_negative():
    with pytest.raises(ValueError, match="non-negative features"):
        linear_attention(np.ones((2, 2)), np.ones((2, 2)), np.ones((2, 2)), feature_map=np.negative)


def test_error_feature_map_wrong_shape():
    with pytest.raises(
        ValueError, match=r"keeping every axis but the last; got query.shape=\(2, 2\)"
    ):
        linear_attention(
            np.ones((2, 2)), np.ones((2, 2)), np.ones((2, 2)), feature_map=lambda x: np.ones(3)
        )


def test_error_feature_map_not_real():
    with pytest.raises(TypeError, match="feature_map must return a real array"):
        linear_attention(
            np.ones((2, 2)),
            np.ones((2, 2)),
            np.ones((2, 2)),
            feature_map=lambda x: x.astype(complex),
        )


def test_error_feature_widths_differ():
    calls = iter([np.ones((2, 3)), np.ones((2, 4))])
    with pytest.raises(ValueError, match="same feature width F; got 3 and 4"):
        linear_attention(
            np.ones((2, 2)), np.ones((2, 2)), np.ones((2, 2)), feature_map=lambda x: next(calls)
        )


@pytest.mark.parametrize("eps", [-1e-6, float("nan"), float("inf")])
def test_error_bad_eps(eps):
    with pytest.raises(ValueError, match="eps must be a finite, non-negative real number; got"):
        linear_attention(np.ones((2, 2)), np.ones((2, 2)), np.ones((2, 2)), eps=eps)


def test_error_eps_not_real():
    with pytest.raises(TypeError, match="eps must be a finite, non-negative real number; got"):
        linear_attention(np.ones((2, 2)), np.ones((2, 2)), np.ones((2, 2)), eps="small")


@pytest.mark.parametrize("chunk_size,exc", [(0, ValueError), (-1, ValueError), (2.0, TypeError)])
def test_error_bad_chunk_size(chunk_size, exc):
    with pytest.raises(exc, match="chunk_size must be a"):
        linear_attention(
            np.ones((2, 2)), np.ones((2, 2)), np.ones((2, 2)), is_causal=True, chunk_size=chunk_size
        )
