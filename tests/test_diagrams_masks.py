"""sdpa_book.diagrams.masks: causal, padding and sliding-window masks drawn as geometry."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from diagram_checks import build, drawn_masks, loop_mask  # noqa: E402

from sdpa_book import diagrams as dg  # noqa: E402


def test_masks_square_match_hand_computed_causal_padding_and_window():
    T = S = 6
    fig = build("mask_geometry_diagram", T, S, window=3, lengths=(4, 6))
    causal, pad4, pad6, window = drawn_masks(fig, T, S)
    np.testing.assert_array_equal(causal, loop_mask(T, S, lambda i, j: j <= i))
    np.testing.assert_array_equal(pad4, loop_mask(T, S, lambda i, j: j < 4))
    np.testing.assert_array_equal(pad6, np.ones((T, S), dtype=bool))
    np.testing.assert_array_equal(window, loop_mask(T, S, lambda i, j: i - 3 < j <= i))
    texts = dg.figure_texts(fig)
    assert [t for t in texts if t.startswith("padding")] == [
        "padding, length 4",
        "padding, length 6",
    ]
    assert "sliding window, $w = 3$" in texts and "the 3 most recent keys" in texts
    assert texts.count("(6, 6)") == 4 and texts[-2:] == ["may attend", "masked"]
    assert "$S - T" not in " ".join(texts)  # no alignment to explain when T == S


def test_masks_with_more_keys_align_top_left_and_bottom_right():
    T, S = 3, 7
    fig = build("mask_geometry_diagram", T, S, window=2, lengths=(5,))
    top_left, bottom_right, pad, window = drawn_masks(fig, T, S)
    np.testing.assert_array_equal(top_left, loop_mask(T, S, lambda i, j: j <= i))
    # query i sits at key position i + S - T
    np.testing.assert_array_equal(bottom_right, loop_mask(T, S, lambda i, j: j <= i + 4))
    np.testing.assert_array_equal(pad, loop_mask(T, S, lambda i, j: j < 5))
    np.testing.assert_array_equal(window, loop_mask(T, S, lambda i, j: i + 4 - 2 < j <= i + 4))
    texts = dg.figure_texts(fig)
    assert "causal, top-left" in texts and "causal, bottom-right" in texts
    assert "$S - T = 4$" in texts and texts.count("(3, 7)") == 4


def test_masks_with_more_queries_leave_the_first_rows_empty():
    T, S = 5, 3
    fig = build("mask_geometry_diagram", T, S)
    bottom_right = drawn_masks(fig, T, S)[1]
    np.testing.assert_array_equal(bottom_right, loop_mask(T, S, lambda i, j: j <= i - 2))
    assert "$S - T = -2$" in dg.figure_texts(fig)


def test_masks_change_when_a_size_changes():
    a, b = build("mask_geometry_diagram", 5, 3), build("mask_geometry_diagram", 5, 6)
    assert "(5, 6)" in dg.figure_texts(b) and "(5, 6)" not in dg.figure_texts(a)
    assert dg.tagged_rects(b)["mask 0"].width > dg.tagged_rects(a)["mask 0"].width
    # the default padding keeps S - S // 3 keys
    assert "padding, length 2" in dg.figure_texts(a) and "padding, length 4" in dg.figure_texts(b)


def test_masks_reject_a_window_that_is_not_positive():
    with pytest.raises(ValueError, match="window must be a positive integer; got 0"):
        dg.mask_geometry_diagram(4, 4, window=0)


def test_masks_reject_lengths_that_are_not_a_sequence():
    with pytest.raises(TypeError, match="lengths must be a sequence of integers; got 4"):
        dg.mask_geometry_diagram(4, 4, lengths=4)


def test_masks_reject_a_length_that_is_not_an_integer():
    with pytest.raises(TypeError, match="lengths must hold integers; got 2.5"):
        dg.mask_geometry_diagram(4, 4, lengths=[2.5])


def test_masks_reject_a_length_beyond_the_keys():
    with pytest.raises(ValueError, match=r"lengths must lie in \[0, S=4\]; got 5"):
        dg.mask_geometry_diagram(4, 4, lengths=[3, 5])


def test_masks_reject_too_many_lengths():
    with pytest.raises(
        ValueError, match="lengths must hold one to three sequence lengths .*; got 4"
    ):
        dg.mask_geometry_diagram(4, 4, lengths=[1, 2, 3, 4])


def test_masks_reject_too_many_keys_to_draw():
    with pytest.raises(ValueError, match="S must be at most 32 to be drawn legibly; got S=33"):
        dg.mask_geometry_diagram(4, 33)
