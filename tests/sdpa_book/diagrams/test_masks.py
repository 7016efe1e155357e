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
    # each panel headed by its kind, its detail and its rule, with this diagram's numbers
    assert texts.count("padding") == 2 and "length 4" in texts and "length 6" in texts
    assert "$j < 4$" in texts and "$j < 6$" in texts and "$j \\leq i$" in texts
    assert "sliding window" in texts and "$w = 3$" in texts and "$i - 3 < j \\leq i$" in texts
    assert texts.count("(6, 6)") == 4 and texts[-2:] == ["may attend", "masked"]
    assert "$S - T" not in " ".join(texts)  # no alignment to explain when T == S
    assert "top-left" not in texts


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
    assert texts.count("causal") == 2 and "top-left" in texts and "bottom-right" in texts
    assert "$j \\leq i + 4$" in texts and "$i + 2 < j \\leq i + 4$" in texts
    assert "$S - T = 4$" in texts and texts.count("(3, 7)") == 4


def test_masks_with_more_queries_leave_the_first_rows_empty():
    T, S = 5, 3
    fig = build("mask_geometry_diagram", T, S)
    bottom_right = drawn_masks(fig, T, S)[1]
    np.testing.assert_array_equal(bottom_right, loop_mask(T, S, lambda i, j: j <= i - 2))
    texts = dg.figure_texts(fig)
    assert "$S - T = -2$" in texts and "$j \\leq i - 2$" in texts
    assert "$i - 5 < j \\leq i - 2$" in texts  # the default window of 3, bottom-right


def test_masks_change_when_a_size_changes():
    a, b = build("mask_geometry_diagram", 5, 3), build("mask_geometry_diagram", 5, 6)
    assert "(5, 6)" in dg.figure_texts(b) and "(5, 6)" not in dg.figure_texts(a)
    assert dg.tagged_rects(b)["mask 0"].width > dg.tagged_rects(a)["mask 0"].width
    # the default padding keeps S - S // 3 keys
    assert "length 2" in dg.figure_texts(a) and "length 4" in dg.figure_texts(b)


def _panel_rows(fig) -> list[int]:
    """How many mask panels stand in each row, from the top (grids whose tops are level)."""
    tops = [round(r.y1, 6) for tag, r in dg.tagged_rects(fig).items() if tag.startswith("mask ")]
    return [tops.count(top) for top in sorted(set(tops), reverse=True)]


def test_masks_stand_three_a_row_or_two_by_two():
    assert _panel_rows(build("mask_geometry_diagram", 6, 6, window=3, lengths=(4,))) == [3]
    assert _panel_rows(build("mask_geometry_diagram", 3, 7, window=2, lengths=(5,))) == [2, 2]
    assert _panel_rows(build("mask_geometry_diagram", 5, 3)) == [2, 2]
    assert _panel_rows(build("mask_geometry_diagram", 6, 6, window=3, lengths=(4, 6))) == [2, 2]
    assert _panel_rows(build("mask_geometry_diagram", 4, 9, lengths=(1, 2, 3))) == [3, 3]


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
