"""Sliding-window attention (``window=(left, right)``): the band, its alignments, its reach."""

from __future__ import annotations

import numpy as np
import pytest
from references import attention_loop_2d, band_by_loop

from sdpa import MultiHeadAttention, scaled_dot_product_attention, sliding_window_mask

WINDOWS = [(2, 0), (0, 2), (1, 3), (3, None), (None, 1), (0, 0), (20, 20)]
SHAPES = [(7, 7), (5, 9), (9, 5)]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("T,S", SHAPES)
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_mask_equals_loop(window, T, S, alignment):
    np.testing.assert_array_equal(
        sliding_window_mask(T, S, window, alignment=alignment),
        band_by_loop(T, S, window=window, alignment=alignment),
    )


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("T,S", SHAPES)
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("causal", [False, True])
def test_windowed_attention_equals_loop_reference(rng, window, T, S, alignment, causal):
    q = rng.standard_normal((2, T, 4))
    k = rng.standard_normal((2, S, 4))
    v = rng.standard_normal((2, S, 3))
    out = scaled_dot_product_attention(
        q, k, v, is_causal=causal, causal_alignment=alignment, window=window
    )
    allowed = band_by_loop(T, S, window=window, is_causal=causal, alignment=alignment)
    for b in range(2):
        np.testing.assert_allclose(
            out[b],
            attention_loop_2d(q[b], k[b], v[b], allowed, scale=0.5)[0],
            rtol=1e-12,
            atol=1e-13,
        )


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_window_equals_explicit_mask_and_torch(rng, torch, alignment):
    T, S, window = 6, 10, (2, 1)
    q = rng.standard_normal((2, 3, T, 8))
    k = rng.standard_normal((2, 3, S, 8))
    v = rng.standard_normal((2, 3, S, 5))
    allowed = band_by_loop(T, S, window=window, is_causal=True, alignment=alignment)
    out = scaled_dot_product_attention(
        q, k, v, is_causal=True, causal_alignment=alignment, window=window
    )
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(torch.from_numpy(a) for a in (q, k, v)), attn_mask=torch.from_numpy(allowed)
    ).numpy()
    np.testing.assert_allclose(out, ref, rtol=1e-12, atol=1e-12)


def test_window_combines_with_user_mask(rng):
    T = S = 8
    q, k, v = (rng.standard_normal((T, 4)) for _ in range(3))
    user = rng.random((T, S)) < 0.7
    out = scaled_dot_product_attention(q, k, v, user, window=(2, 2))
    allowed = band_by_loop(T, S, window=(2, 2)) & user
    np.testing.assert_allclose(
        out, attention_loop_2d(q, k, v, allowed, scale=0.5)[0], rtol=1e-12, atol=1e-13
    )


@pytest.mark.parametrize("L", [1, 2, 3])
@pytest.mark.parametrize("window", [(2, 0), (1, 2)])
def test_receptive_field_grows_by_window_per_layer(rng, L, window):
    """After L windowed layers, output i depends on input j iff i - L*left <= j <= i + L*right.

    Checked by perturbation: change input token j and see which outputs move.
    """
    n, E = 20, 8
    left, right = window
    layers = [MultiHeadAttention.random(E, 2, rng=rng) for _ in range(L)]

    def model(x):
        for mha in layers:
            x = x + np.tanh(mha(x, window=window))
        return x

    x = rng.standard_normal((n, E))
    base = model(x)
    for j in range(n):
        x2 = x.copy()
        x2[j] += 0.5
        moved = np.abs(model(x2) - base).max(axis=-1) > 1e-12
        expected = np.array([i - L * left <= j <= i + L * right for i in range(n)])
        np.testing.assert_array_equal(moved, expected, err_msg=f"perturbing input {j}")


@pytest.mark.parametrize("window", [(0, 0), (37, 3), (None, 64), (300, None)])
@pytest.mark.parametrize("T,S", [(700, 1100), (1100, 700)])  # several tiles of either side
@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("causal", [False, True])
def test_tiled_equals_reference_for_windows(rng, window, T, S, alignment, causal):
    """Tiles outside the band are skipped, tiles across its edge masked: same result."""
    q = rng.standard_normal((T, 16))
    k = rng.standard_normal((S, 16))
    v = rng.standard_normal((S, 8))
    kwargs = dict(is_causal=causal, causal_alignment=alignment, window=window, return_lse=True)
    out, lse = scaled_dot_product_attention(q, k, v, implementation="tiled", **kwargs)
    out_ref, lse_ref = scaled_dot_product_attention(q, k, v, implementation="reference", **kwargs)
    np.testing.assert_allclose(out, out_ref, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(lse, lse_ref, rtol=1e-12, atol=1e-12)
