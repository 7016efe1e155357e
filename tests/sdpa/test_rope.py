"""Tests for sdpa.rope: rotary position embeddings against independent references.

References written here, none sharing code with sdpa.rope:
* the RoFormer paper's formula as an explicit block-diagonal rotation matrix (float64 loops);
* the GPT-NeoX / Hugging Face LLaMA style, ``x * cos + rotate_half(x) * sin``;
* Meta's LLaMA style in PyTorch, adjacent features viewed as complex numbers times ``e^{i phi}``.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

import sdpa
from sdpa import apply_rotary_embedding, rotary_cos_sin

# ---------------------------------------------------------------------------------------------
# independent references


def paper_rotation_matrix(position: float, D: int, base: float = 10000.0) -> np.ndarray:
    """R_{Theta, m} of the RoFormer paper: block-diagonal 2x2 rotations, float64."""
    R = np.zeros((D, D))
    for i in range(1, D // 2 + 1):  # the paper counts pairs from 1
        theta = base ** (-2 * (i - 1) / D)
        c, s = math.cos(position * theta), math.sin(position * theta)
        r = 2 * (i - 1)
        R[r, r], R[r, r + 1] = c, -s
        R[r + 1, r], R[r + 1, r + 1] = s, c
    return R


def paper_rope(x: np.ndarray, positions, base: float = 10000.0) -> np.ndarray:
    """Interleaved RoPE by matrix-vector products, one row at a time: (..., T, D)."""
    x = np.asarray(x, dtype=np.float64)
    positions = np.broadcast_to(np.asarray(positions, dtype=np.float64), x.shape[:-1])
    out = np.empty_like(x)
    for idx in np.ndindex(x.shape[:-1]):
        out[idx] = paper_rotation_matrix(float(positions[idx]), x.shape[-1], base) @ x[idx]
    return out


def rotate_half(x: np.ndarray) -> np.ndarray:
    half = x.shape[-1] // 2
    return np.concatenate([-x[..., half:], x[..., :half]], axis=-1)


def neox_rope(x: np.ndarray, positions, base: float = 10000.0) -> np.ndarray:
    """Rotate-half RoPE as written in GPT-NeoX / Hugging Face LLaMA code, in float64."""
    D = x.shape[-1]
    inv_freq = 1.0 / (base ** (np.arange(0, D, 2, dtype=np.float64) / D))
    freqs = np.asarray(positions, dtype=np.float64)[..., None] * inv_freq  # (..., T, D/2)
    emb = np.concatenate([freqs, freqs], axis=-1)  # (..., T, D)
    return x * np.cos(emb) + rotate_half(x) * np.sin(emb)


def halves_to_pairs(D: int) -> list[int]:
    """Feature order that lists the halves layout pair by pair: [0, D/2, 1, D/2 + 1, ...]."""
    return [f for i in range(D // 2) for f in (i, i + D // 2)]


# ---------------------------------------------------------------------------------------------
# agreement with the references


@pytest.mark.parametrize("D, base", [(2, 10000.0), (6, 10000.0), (16, 500.0)])
def test_interleaved_equals_paper_rotation_matrix(rng, D, base):
    x = rng.normal(size=(3, 7, D))  # (B, T, D)
    positions = np.array([0, 1, 2, 5, 11, 100, 4097])
    out = apply_rotary_embedding(x, positions, base=base, interleaved=True)
    np.testing.assert_allclose(out, paper_rope(x, positions, base), rtol=0, atol=1e-12)


@pytest.mark.parametrize("D, base", [(2, 10000.0), (6, 10000.0), (16, 500.0)])
def test_halves_equals_rotate_half_reference(rng, D, base):
    x = rng.normal(size=(2, 3, 5, D))  # (B, H, T, D)
    out = apply_rotary_embedding(x, base=base)
    np.testing.assert_allclose(out, neox_rope(x, np.arange(5), base), rtol=0, atol=1e-12)


def test_layouts_related_by_a_fixed_permutation(rng):
    D = 10
    x = rng.normal(size=(4, 9, D))
    perm = halves_to_pairs(D)
    halves = apply_rotary_embedding(x)
    pairs = apply_rotary_embedding(x[..., perm], interleaved=True)
    np.testing.assert_allclose(halves[..., perm], pairs, rtol=0, atol=1e-14)
    # ... and the two layouts really are different maps
    assert np.abs(halves - apply_rotary_embedding(x, interleaved=True)).max() > 0.1


def test_matches_torch_complex_reference(torch, rng):
    """Meta's LLaMA formulation: adjacent features as complex numbers times polar(1, m theta)."""
    T, D = 11, 12
    x = rng.normal(size=(2, 3, T, D))
    positions = np.arange(40, 40 + T)
    xt = torch.from_numpy(x)
    theta = 1.0 / (10000.0 ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    angles = torch.outer(torch.from_numpy(positions).double(), theta)  # (T, D/2)
    rot = torch.polar(torch.ones_like(angles), angles)
    xc = torch.view_as_complex(xt.reshape(*xt.shape[:-1], D // 2, 2))
    expected = torch.view_as_real(xc * rot).reshape(xt.shape).numpy()
    out = apply_rotary_embedding(x, positions, interleaved=True)
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-12)
    # the halves layout against the same formula in torch after the permutation
    perm = halves_to_pairs(D)
    inv = np.argsort(perm)
    xc = torch.view_as_complex(xt[..., perm].contiguous().reshape(*xt.shape[:-1], D // 2, 2))
    expected_halves = torch.view_as_real(xc * rot).reshape(xt.shape).numpy()[..., inv]
    np.testing.assert_allclose(apply_rotary_embedding(x, positions), expected_halves, atol=1e-12)


def test_float_positions_rotate_by_fractional_angles(rng):
    x = rng.normal(size=(4, 8))
    positions = [0.5, 1.25, -3.0, 1e4 / 3]
    out = apply_rotary_embedding(x, positions, interleaved=True)
    np.testing.assert_allclose(out, paper_rope(x, positions), rtol=0, atol=1e-11)


def test_hand_computed_single_pair():
    # D = 2: one pair with theta = 1, so position p rotates (1, 0) to (cos p, sin p)
    out = apply_rotary_embedding(np.array([[1.0, 0.0], [0.0, 2.0]]), [1, 2])
    expected = [[math.cos(1), math.sin(1)], [-2 * math.sin(2), 2 * math.cos(2)]]
    np.testing.assert_allclose(out, expected, rtol=0, atol=1e-15)


def test_cos_sin_tables_hand_values():
    cos, sin = rotary_cos_sin([0, 1, 3], 4, base=100.0)  # theta = (1, 1/10)
    np.testing.assert_allclose(
        cos, [[1, 1], [math.cos(1), math.cos(0.1)], [math.cos(3), math.cos(0.3)]], atol=1e-15
    )
    np.testing.assert_allclose(
        sin, [[0, 0], [math.sin(1), math.sin(0.1)], [math.sin(3), math.sin(0.3)]], atol=1e-15
    )
    assert cos.dtype == sin.dtype == np.float64


# ---------------------------------------------------------------------------------------------
# properties


@pytest.mark.parametrize("interleaved", [False, True])
def test_norms_of_vectors_and_pairs_are_preserved(rng, interleaved):
    x = rng.normal(size=(3, 5, 13, 8))
    out = apply_rotary_embedding(x, rng.integers(0, 10_000, size=13), interleaved=interleaved)
    np.testing.assert_allclose(np.linalg.norm(out, axis=-1), np.linalg.norm(x, axis=-1), rtol=1e-13)
    if interleaved:
        pair_norm = lambda a: np.hypot(a[..., 0::2], a[..., 1::2])  # noqa: E731
    else:
        pair_norm = lambda a: np.hypot(a[..., :4], a[..., 4:])  # noqa: E731
    np.testing.assert_allclose(pair_norm(out), pair_norm(x), rtol=1e-13)


@pytest.mark.parametrize("interleaved", [False, True])
def test_scores_depend_only_on_relative_position(rng, interleaved):
    D, P = 16, 64
    q, k = rng.normal(size=(2, D))
    positions = np.arange(P)
    qs = apply_rotary_embedding(np.broadcast_to(q, (P, D)), positions, interleaved=interleaved)
    ks = apply_rotary_embedding(np.broadcast_to(k, (P, D)), positions, interleaved=interleaved)
    scores = qs @ ks.T  # scores[m, n] = q_m . k_n, (P, P)
    for offset in range(-(P - 1), P):
        diagonal = np.diagonal(scores, offset)  # all (m, n) with n - m = offset
        np.testing.assert_allclose(diagonal, diagonal[0], rtol=0, atol=1e-12)
        # the formula q . R_{n-m} k, with the explicit matrix, gives the same number
        Rk = paper_rope(k[None], [offset])[0] if interleaved else neox_rope(k, offset)
        np.testing.assert_allclose(diagonal[0], q @ Rk, rtol=0, atol=1e-12)
    # ... and the scores do change with the offset (the property is not trivially true)
    first_row = scores[0]
    assert np.ptp(first_row) > 0.5 * np.abs(first_row).max()


def test_attention_invariant_to_shifting_all_positions(rng):
    q, k, v = rng.normal(size=(3, 2, 6, 8))  # (H, T, D) each
    pos = np.arange(6)
    outs = [
        sdpa.scaled_dot_product_attention(
            apply_rotary_embedding(q, pos + shift),
            apply_rotary_embedding(k, pos + shift),
            v,
            is_causal=True,
        )
        for shift in (0, 1000)
    ]
    np.testing.assert_allclose(outs[0], outs[1], rtol=0, atol=1e-10)


def test_default_positions_and_kv_cache_offsets(rng):
    x = rng.normal(size=(2, 10, 6))
    full = apply_rotary_embedding(x)
    np.testing.assert_array_equal(full, apply_rotary_embedding(x, np.arange(10)))
    # new tokens 7, 8, 9 rotated with positions starting at the cache length 7
    tail = apply_rotary_embedding(x[:, 7:], np.arange(7, 10))
    np.testing.assert_allclose(tail, full[:, 7:], rtol=0, atol=1e-15)


def test_per_sequence_positions_broadcast(rng):
    x = rng.normal(size=(2, 3, 4, 6))  # (B, H, T, D)
    positions = np.array([[0, 1, 2, 3], [5, 6, 7, 8]])[:, None, :]  # (B, 1, T)
    out = apply_rotary_embedding(x, positions)
    assert out.shape == x.shape
    for b in range(2):
        np.testing.assert_allclose(out[b], neox_rope(x[b], positions[b, 0]), rtol=0, atol=1e-12)
    # a scalar position broadcasts to every row (one decoding step)
    np.testing.assert_allclose(
        apply_rotary_embedding(x, 5), neox_rope(x, np.full(4, 5)), atol=1e-12
    )


# ---------------------------------------------------------------------------------------------
# dtypes and inputs


@pytest.mark.parametrize(
    "dtype, atol", [(np.float64, 1e-12), (np.float32, 2e-6), (np.float16, 4e-3)]
)
def test_dtype_preserved_and_accurate(rng, dtype, atol):
    x = rng.normal(size=(5, 8))
    out = apply_rotary_embedding(x.astype(dtype), np.arange(5) * 37)
    assert out.dtype == dtype
    np.testing.assert_allclose(
        out.astype(np.float64),
        neox_rope(x.astype(dtype).astype(np.float64), np.arange(5) * 37),
        rtol=0,
        atol=atol,
    )


def test_integer_input_gives_float64():
    out = apply_rotary_embedding(np.array([[1, 0], [1, 0]]))
    assert out.dtype == np.float64
    np.testing.assert_allclose(out[1], [math.cos(1), math.sin(1)], atol=1e-15)


def test_inputs_not_mutated(rng):
    x = rng.normal(size=(3, 4))
    positions = np.array([3, 1, 4])
    x0, p0 = x.copy(), positions.copy()
    apply_rotary_embedding(x, positions, interleaved=True)
    apply_rotary_embedding(x, positions)
    np.testing.assert_array_equal(x, x0)
    np.testing.assert_array_equal(positions, p0)


def test_empty_inputs():
    assert apply_rotary_embedding(np.zeros((0, 4))).shape == (0, 4)
    assert apply_rotary_embedding(np.zeros((3, 0))).shape == (3, 0)


# ---------------------------------------------------------------------------------------------
# errors: one test per raise


def test_odd_dimension_raises():
    with pytest.raises(ValueError, match=r"last dimension Dk of x must be even.*x.shape=\(3, 5\)"):
        apply_rotary_embedding(np.zeros((3, 5)))


def test_one_dimensional_x_raises():
    with pytest.raises(ValueError, match=r"at least 2 dimensions; got x.shape=\(4,\)"):
        apply_rotary_embedding(np.zeros(4))


def test_complex_x_raises():
    with pytest.raises(TypeError, match="x must be a real floating"):
        apply_rotary_embedding(np.zeros((2, 2), dtype=complex))


def test_positions_not_broadcastable_raises():
    with pytest.raises(
        ValueError, match=r"positions must broadcast to x.shape\[:-1\]=\(2, 3\).*\(4,\)"
    ):
        apply_rotary_embedding(np.zeros((2, 3, 4)), np.arange(4))


def test_positions_that_would_enlarge_x_raise():
    with pytest.raises(ValueError, match=r"got positions.shape=\(5, 3\)"):
        apply_rotary_embedding(np.zeros((3, 4)), np.zeros((5, 3)))


def test_bool_positions_raise():
    with pytest.raises(
        TypeError, match="positions must be an array of integers or real numbers; got dtype bool"
    ):
        apply_rotary_embedding(np.zeros((2, 4)), [True, False])


def test_nonfinite_positions_raise():
    with pytest.raises(ValueError, match="positions must be finite"):
        apply_rotary_embedding(np.zeros((2, 4)), [0.0, np.nan])


@pytest.mark.parametrize("base", [1.0, 0.5, -2.0, float("inf")])
def test_bad_base_value_raises(base):
    with pytest.raises(ValueError, match="base must be a finite real number greater than 1"):
        apply_rotary_embedding(np.zeros((2, 4)), base=base)


@pytest.mark.parametrize("base", ["10000", True, None])
def test_bad_base_kind_raises(base):
    with pytest.raises(TypeError, match="base must be a finite real number greater than 1; got"):
        apply_rotary_embedding(np.zeros((2, 4)), base=base)


def test_non_bool_interleaved_raises():
    with pytest.raises(TypeError, match="interleaved must be a bool; got 'yes'"):
        apply_rotary_embedding(np.zeros((2, 4)), interleaved="yes")


def test_cos_sin_odd_head_dim_raises():
    with pytest.raises(ValueError, match="head_dim must be even.*head_dim=3"):
        rotary_cos_sin(np.arange(3), 3)


@pytest.mark.parametrize("head_dim, exc", [(-2, ValueError), (2.0, TypeError)])
def test_cos_sin_bad_head_dim_raises(head_dim, exc):
    with pytest.raises(exc, match="head_dim must be a non-negative integer"):
        rotary_cos_sin(np.arange(3), head_dim)


def test_cos_sin_missing_head_dim_raises():
    with pytest.raises(TypeError, match="head_dim must be given"):
        rotary_cos_sin(np.arange(3))


def test_cos_sin_dim_is_a_deprecated_alias_of_head_dim():
    with pytest.warns(DeprecationWarning, match="dim is deprecated .* use head_dim"):
        cos, sin = rotary_cos_sin([0, 1, 3], dim=4, base=100.0)
    # theta = (1, 1/10), by hand: the angles p * theta of positions 0, 1, 3
    np.testing.assert_allclose(cos, np.cos([[0, 0], [1, 0.1], [3, 0.3]]), rtol=1e-15)


def test_cos_sin_dim_and_head_dim_together_raise():
    with pytest.raises(TypeError, match="head_dim and its deprecated name dim were both given"):
        rotary_cos_sin(np.arange(3), 4, dim=4)
