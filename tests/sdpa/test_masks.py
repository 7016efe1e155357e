"""Tests of sdpa.masks: causal, sliding-window and padding masks against independent
constructions (np.tril, explicit double loops), and one test per error."""

from __future__ import annotations

import numpy as np
import pytest
from references import band_by_loop

from sdpa import causal_mask, padding_mask, sliding_window_mask

SIZES = [(0, 0), (1, 1), (3, 3), (3, 7), (7, 3), (5, 11), (11, 5), (0, 5), (5, 0)]


@pytest.mark.parametrize("T, S", SIZES)
def test_causal_mask_top_left_is_tril_zero(T, S):
    mask = causal_mask(T, S)
    assert mask.dtype == bool and mask.shape == (T, S)
    np.testing.assert_array_equal(mask, np.tril(np.ones((T, S)), 0).astype(bool))


@pytest.mark.parametrize("T, S", SIZES)
def test_causal_mask_bottom_right_is_tril_s_minus_t(T, S):
    mask = causal_mask(T, S, alignment="bottom_right")
    assert mask.dtype == bool and mask.shape == (T, S)
    np.testing.assert_array_equal(mask, np.tril(np.ones((T, S)), S - T).astype(bool))


def test_causal_mask_square_by_default_and_alignments_agree_when_square():
    np.testing.assert_array_equal(causal_mask(5), causal_mask(5, 5))
    np.testing.assert_array_equal(causal_mask(5), causal_mask(5, alignment="bottom_right"))


def test_causal_mask_by_hand():
    expected = np.array([[1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], bool)
    np.testing.assert_array_equal(causal_mask(4, 5, alignment="bottom_right"), expected)
    # top-left with more keys than queries: the extra keys at the end are never visible
    np.testing.assert_array_equal(causal_mask(2, 3), [[True, False, False], [True, True, False]])


WINDOWS = [(0, 0), (1, 0), (2, 1), (0, 3), (None, 0), (1, None), (None, None), (20, 20)]


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("T, S", [(3, 7), (7, 3), (5, 5), (0, 3), (3, 0)])
def test_sliding_window_mask_matches_double_loop(T, S, window, alignment):
    mask = sliding_window_mask(T, S, window, alignment=alignment)
    assert mask.dtype == bool and mask.shape == (T, S)
    np.testing.assert_array_equal(mask, band_by_loop(T, S, window=window, alignment=alignment))


def test_sliding_window_by_hand():
    expected = np.array([[1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1]], dtype=bool)
    np.testing.assert_array_equal(sliding_window_mask(3, 4, (1, 1)), expected)
    np.testing.assert_array_equal(
        sliding_window_mask(2, 4, [0, 0], alignment="bottom_right"), [[0, 0, 1, 0], [0, 0, 0, 1]]
    )


@pytest.mark.parametrize("alignment", ["top_left", "bottom_right"])
def test_causal_window_is_causal_mask_and_band(alignment):
    T, S, w = 5, 11, 3
    band = sliding_window_mask(T, S, (w - 1, 0), alignment=alignment)
    offset = 0 if alignment == "top_left" else S - T
    too_old = np.tril(np.ones((T, S)), offset - w).astype(bool)  # j <= i + o - w
    expected = causal_mask(T, S, alignment=alignment) & ~too_old
    np.testing.assert_array_equal(band, expected)
    # an unbounded left side with right = 0 is exactly the causal mask
    np.testing.assert_array_equal(
        sliding_window_mask(T, S, (None, 0), alignment=alignment),
        causal_mask(T, S, alignment=alignment),
    )


def test_numpy_integer_sizes_are_accepted():
    np.testing.assert_array_equal(causal_mask(np.int64(3), np.int32(5)), causal_mask(3, 5))
    np.testing.assert_array_equal(
        sliding_window_mask(3, 5, (np.int64(1), np.uint8(0))), sliding_window_mask(3, 5, (1, 0))
    )


def test_padding_mask_matches_loop():
    lengths = [3, 0, 7, 1]
    S = 7
    mask = padding_mask(lengths, S)
    assert mask.dtype == bool and mask.shape == (4, 1, 1, S)
    for b, n in enumerate(lengths):
        for j in range(S):
            assert mask[b, 0, 0, j] == (j < n)


def test_padding_mask_accepts_arrays_and_empty_batch():
    np.testing.assert_array_equal(
        padding_mask(np.array([2], dtype=np.uint8), 3), [[[[True, True, False]]]]
    )
    assert padding_mask(np.array([], dtype=int), 3).shape == (0, 1, 1, 3)
    assert padding_mask([0, 0], 0).shape == (2, 1, 1, 0)


# --- errors: one test per raise ------------------------------------------------------------


@pytest.mark.parametrize("T", [2.0, "3", None, True])
def test_non_integer_size_raises(T):
    with pytest.raises(TypeError, match=r"T must be a non-negative integer; got"):
        causal_mask(T)


def test_negative_size_raises():
    with pytest.raises(ValueError, match=r"S must be a non-negative integer; got -1"):
        causal_mask(3, -1)


@pytest.mark.parametrize(
    "f",
    [
        lambda: causal_mask(3, alignment="bottom-right"),
        lambda: sliding_window_mask(3, 3, (1, 0), alignment="left"),
    ],
)
def test_bad_alignment_raises(f):
    with pytest.raises(ValueError, match=r"alignment must be 'top_left' or 'bottom_right'; got"):
        f()


@pytest.mark.parametrize("window", [(1,), (1, 2, 3), 2, (-1, 0), (0, 1.5), (True, 0), "ab"])
def test_bad_window_raises(window):
    with pytest.raises(
        ValueError,
        match=r"window must be a pair \(left, right\) of non-negative integers or None; got",
    ):
        sliding_window_mask(3, 3, window)


def test_missing_window_raises():
    with pytest.raises(ValueError, match=r"window must be a pair \(left, right\); got None"):
        sliding_window_mask(3, 3, None)


def test_padding_lengths_of_wrong_kind_raise():
    with pytest.raises(TypeError, match=r"lengths must be an array of integers; got dtype float64"):
        padding_mask([1.0, 2.0], 3)


def test_padding_lengths_of_wrong_shape_raise():
    with pytest.raises(
        ValueError,
        match=r"lengths must be 1-D with one length per sequence; got shape \(2, 1\)",
    ):
        padding_mask([[1], [2]], 3)


@pytest.mark.parametrize("lengths", [[4, 1], [-1, 2]])
def test_padding_lengths_out_of_range_raise(lengths):
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, S=3\]; got"):
        padding_mask(lengths, 3)


def test_padding_negative_S_raises():
    with pytest.raises(ValueError, match=r"S must be a non-negative integer; got -2"):
        padding_mask([1], -2)
