"""Tests of sdpa.examples: the seeds' worked examples hold the seeds' data and reproduce the
seeds' numbers when the package computes with them."""

from __future__ import annotations

import math

import numpy as np
import pytest

from sdpa import causal_mask, scaled_dot_product_attention, softmax
from sdpa.examples import (
    SOFTMAX_SCORES,
    WorkedExample,
    the_cat_sat_on_mat,
    the_cat_sleeps,
    the_dog_near_the_cats,
)

# --- "The cat sleeps." (001_ec8ea104f99540c1.txt) -------------------------------------------------


def test_the_cat_sleeps_holds_the_seed_data():
    ex = the_cat_sleeps()
    assert isinstance(ex, WorkedExample)
    assert ex.tokens == ("The", "cat", "sleeps")
    np.testing.assert_array_equal(ex.X, [[1, 0], [0, 1], [1, 1]])
    np.testing.assert_array_equal(ex.W_q, [[1, 0], [0, 1]])
    np.testing.assert_array_equal(ex.W_k, [[1, 1], [0, 1]])
    np.testing.assert_array_equal(ex.W_v, [[1, 0], [0, 2]])
    # Step 3 of the walk-through, by hand: Q_cat = [0, 1]; keys and values of the three tokens
    np.testing.assert_array_equal(ex.Q[1], [0, 1])
    np.testing.assert_array_equal(ex.K, [[1, 1], [0, 1], [1, 2]])
    np.testing.assert_array_equal(ex.V, [[1, 0], [0, 2], [1, 2]])
    np.testing.assert_array_equal(ex.Q, ex.X @ ex.W_q)


def test_the_cat_sleeps_reproduces_the_walk_through():
    ex = the_cat_sleeps()
    scores = ex.Q[1] @ ex.K.T
    np.testing.assert_array_equal(scores, [1, 1, 2])  # step 4
    # step 5: the seed adds the exponentials rounded to 3 decimals, 2.718 + 2.718 + 7.389
    np.testing.assert_allclose(np.round(np.exp(scores), 3), [2.718, 2.718, 7.389], rtol=1e-12)
    np.testing.assert_allclose(np.round(np.exp(scores), 3).sum(), 12.825, rtol=1e-12)
    np.testing.assert_allclose(np.exp(scores).sum(), 12.825, atol=1e-3)
    out, weights = scaled_dot_product_attention(ex.Q, ex.K, ex.V, scale=1.0, return_weights=True)
    e = math.e
    np.testing.assert_allclose(weights[1], np.array([e, e, e * e]) / (2 * e + e * e), rtol=1e-15)
    np.testing.assert_allclose(weights[1], [0.212, 0.212, 0.576], atol=5e-4)  # the seed's numbers
    np.testing.assert_allclose(out[1], [0.788, 1.576], atol=5e-4)
    # step 6 by hand from the rounded weights gives the seed's output exactly
    np.testing.assert_allclose(0.212 * ex.V[0] + 0.212 * ex.V[1] + 0.576 * ex.V[2], [0.788, 1.576])
    np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-15)


def test_the_cat_sleeps_arrays_are_read_only():
    ex = the_cat_sleeps()
    for a in (ex.X, ex.Q, ex.K, ex.V, ex.W_q, ex.W_k, ex.W_v):
        assert not a.flags.writeable
    with pytest.raises(ValueError, match="read-only"):
        ex.X[0, 0] = 5
    assert the_cat_sleeps().X[0, 0] == 1  # every call returns fresh, unchanged data


# --- the softmax of the formula walk-through (004_c15d9698e735aad3.txt) -------------------------


def test_softmax_scores_reproduce_the_seed():
    assert SOFTMAX_SCORES == (2.0, 1.0, 0.1)
    np.testing.assert_allclose(softmax(SOFTMAX_SCORES), [0.659, 0.242, 0.099], atol=5e-4)


# --- "the cat sat on mat" (000_8eaea0c5c6ef8cd9.txt) -------------------------------------------


def test_the_cat_sat_on_mat_has_the_seed_shapes_and_values():
    ex = the_cat_sat_on_mat()
    assert ex.tokens == ("the", "cat", "sat", "on", "mat")
    for a in (ex.X, ex.Q, ex.K, ex.V):
        assert a.shape == (1, 5, 4)
        assert not a.flags.writeable
    np.testing.assert_allclose(ex.X[0], np.arange(1, 21).reshape(5, 4) / 10, rtol=1e-15)
    # first and last rows of each matrix, as printed in the seed
    np.testing.assert_array_equal(ex.Q[0, 0], [-0.041, -0.663, -0.448, -0.059])
    np.testing.assert_array_equal(ex.Q[0, 4], [0.015, -3.452, -0.387, 1.961])
    np.testing.assert_array_equal(ex.K[0, 0], [-0.212, -0.097, -0.663, 0.427])
    np.testing.assert_array_equal(ex.K[0, 4], [-1.319, -0.245, -4.812, -0.547])
    np.testing.assert_array_equal(ex.V[0, 0], [-0.329, -0.734, -0.402, 0.250])
    np.testing.assert_array_equal(ex.V[0, 4], [-1.201, -6.440, -2.133, -0.179])
    assert ex.W_q is None  # the seed gives the projections, not the weights


def test_the_cat_sat_on_mat_projections_are_nearly_affine_in_position():
    # The seed's embeddings grow linearly with position, so projections without a bias would
    # too: the second differences along the tokens vanish up to the seed's 3-decimal rounding.
    ex = the_cat_sat_on_mat()
    for a in (ex.X, ex.Q, ex.K, ex.V):
        assert np.abs(np.diff(a[0], n=2, axis=0)).max() <= 2.5e-3


@pytest.mark.parametrize("is_causal", [False, True])
def test_attention_over_the_cat_sat_on_mat(is_causal):
    ex = the_cat_sat_on_mat()
    out, weights = scaled_dot_product_attention(
        ex.Q, ex.K, ex.V, is_causal=is_causal, return_weights=True
    )
    assert out.shape == (1, 5, 4) and weights.shape == (1, 5, 5)
    np.testing.assert_allclose(weights.sum(-1), 1.0, rtol=1e-14)
    if is_causal:
        np.testing.assert_array_equal(weights[0][~causal_mask(5)], 0.0)
        np.testing.assert_array_equal(out[0, 0], ex.V[0, 0])  # the first token sees itself only
    # each output is a weighted average of the value rows
    assert np.all(out <= ex.V.max(axis=1, keepdims=True) + 1e-12)
    assert np.all(out >= ex.V.min(axis=1, keepdims=True) - 1e-12)


# --- "the dog near the cats barks at them" (written for the book) ----------------------------


def test_the_dog_near_the_cats_resolves_agreement():
    """By hand: the query of "barks" (verb, singular) is (6, 6, 0); it scores 12 against "dog"
    (noun, singular), 6 against "cats" (a noun) and against itself (singular), 0 against the
    five others. "them" (pronoun, plural) is the mirror image with "cats"."""
    ex = the_dog_near_the_cats()
    T = len(ex.tokens)
    assert (
        ex.X.shape == (T, 8) and ex.W_q.shape == ex.W_k.shape == (8, 3) and ex.W_v.shape == (8, 2)
    )
    for array in (ex.X, ex.Q, ex.K, ex.V, ex.W_q, ex.W_k, ex.W_v):
        assert not array.flags.writeable
    _, weights = scaled_dot_product_attention(ex.Q, ex.K, ex.V, return_weights=True)
    r = 1 / math.sqrt(3)
    peak = math.exp(12 * r) / (math.exp(12 * r) + 2 * math.exp(6 * r) + 5)
    tok = ex.tokens.index
    assert weights[tok("barks"), tok("dog")] == pytest.approx(peak, rel=1e-12)
    assert weights[tok("them"), tok("cats")] == pytest.approx(peak, rel=1e-12)
    assert round(peak, 3) == 0.937
    for function_word in (0, 2, 3, 6):  # the, near, the, at: zero queries, even attention
        np.testing.assert_allclose(weights[function_word], 1 / T, rtol=1e-12)
    np.testing.assert_array_equal(ex.V[tok("dog")], [1, 0])
    np.testing.assert_array_equal(ex.V[tok("cats")], [0, 1])
