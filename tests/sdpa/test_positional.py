"""Tests of sdpa.positional: the sinusoidal table of "Attention Is All You Need", section 3.5."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sdpa import sinusoidal_positional_encoding


def loop_table(n_positions, d_model, base=10000.0):
    """The paper's formula with explicit loops: PE[p, 2i] = sin(p / base^(2i/d)),
    PE[p, 2i+1] = cos(p / base^(2i/d))."""
    pe = np.zeros((n_positions, d_model))
    for p in range(n_positions):
        for col in range(d_model):
            i = col // 2
            angle = p / base ** (2 * i / d_model)
            pe[p, col] = math.sin(angle) if col % 2 == 0 else math.cos(angle)
    return pe


@pytest.mark.parametrize("n_positions, d_model", [(7, 4), (11, 16), (5, 7), (3, 1), (50, 64)])
def test_matches_the_papers_formula(n_positions, d_model):
    pe = sinusoidal_positional_encoding(n_positions, d_model)
    assert pe.shape == (n_positions, d_model) and pe.dtype == np.float64
    np.testing.assert_allclose(pe, loop_table(n_positions, d_model), rtol=1e-12, atol=1e-12)


def test_other_base():
    np.testing.assert_allclose(
        sinusoidal_positional_encoding(9, 6, base=100.0),
        loop_table(9, 6, 100.0),
        rtol=1e-12,
        atol=1e-12,
    )


def test_by_hand():
    pe = sinusoidal_positional_encoding(3, 4)
    # d = 4: frequencies 1 and 10000^(-1/2) = 0.01
    expected = [
        [0.0, 1.0, 0.0, 1.0],
        [math.sin(1), math.cos(1), math.sin(0.01), math.cos(0.01)],
        [math.sin(2), math.cos(2), math.sin(0.02), math.cos(0.02)],
    ]
    np.testing.assert_allclose(pe, expected, rtol=1e-15, atol=1e-15)


def test_range_and_unit_pairs():
    pe = sinusoidal_positional_encoding(200, 32)
    assert np.all(np.abs(pe) <= 1.0)
    np.testing.assert_allclose(pe[:, 0::2] ** 2 + pe[:, 1::2] ** 2, 1.0, rtol=1e-14)


def test_odd_width_ends_with_a_sine_column():
    pe = sinusoidal_positional_encoding(10, 5)
    np.testing.assert_allclose(pe[:, 4], np.sin(np.arange(10) / 10000 ** (4 / 5)), rtol=1e-14)
    np.testing.assert_allclose(pe[:, :4], loop_table(10, 5)[:, :4], rtol=1e-14, atol=1e-15)


def test_shift_by_k_is_a_fixed_rotation():
    # PE[p + k] = R(k) PE[p] for each (sin, cos) pair, with R(k) independent of p
    d, k = 8, 3
    pe = sinusoidal_positional_encoding(20, d)
    omega = 10000.0 ** (-np.arange(0, d, 2) / d)
    c, s = np.cos(k * omega), np.sin(k * omega)
    sin_p, cos_p = pe[:-k, 0::2], pe[:-k, 1::2]
    np.testing.assert_allclose(pe[k:, 0::2], sin_p * c + cos_p * s, atol=1e-13)
    np.testing.assert_allclose(pe[k:, 1::2], cos_p * c - sin_p * s, atol=1e-13)


@pytest.mark.parametrize("n_positions, d_model", [(0, 4), (4, 0), (0, 0)])
def test_empty_tables(n_positions, d_model):
    assert sinusoidal_positional_encoding(n_positions, d_model).shape == (n_positions, d_model)


def test_numpy_integers_are_accepted():
    np.testing.assert_array_equal(
        sinusoidal_positional_encoding(np.int64(4), np.int32(6)),
        sinusoidal_positional_encoding(4, 6),
    )


# --- errors: one test per raise -------------------------------------------------------------------


@pytest.mark.parametrize("arg", [4.0, "4", True])
def test_non_integer_size_raises(arg):
    with pytest.raises(TypeError, match=r"d_model must be a non-negative integer; got"):
        sinusoidal_positional_encoding(4, arg)


def test_negative_size_raises():
    with pytest.raises(ValueError, match=r"n_positions must be a non-negative integer; got -1"):
        sinusoidal_positional_encoding(-1, 4)


@pytest.mark.parametrize("base", ["10000", True, None])
def test_base_of_wrong_kind_raises(base):
    with pytest.raises(TypeError, match=r"base must be a finite real number greater than 1; got"):
        sinusoidal_positional_encoding(4, 4, base=base)


@pytest.mark.parametrize("base", [1.0, 0.5, -3.0, np.inf, np.nan])
def test_base_not_above_one_raises(base):
    with pytest.raises(ValueError, match=r"base must be a finite real number greater than 1; got"):
        sinusoidal_positional_encoding(4, 4, base=base)
