"""sdpa_book.diagrams.draw: the canvas in inches, boxes, arrows, brackets and legends."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from diagram_checks import arrow_ends, assert_legible  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402

from sdpa_book import diagrams as dg  # noqa: E402
from sdpa_book.figures import KEY, QUERY  # noqa: E402


def test_new_canvas_is_in_inches_and_white():
    fig, ax = dg.new_canvas(3.5, 2.0)
    assert tuple(fig.get_size_inches()) == (3.5, 2.0)
    assert ax.get_xlim() == (0.0, 3.5) and ax.get_ylim() == (0.0, 2.0)
    assert fig.get_facecolor() == (1.0, 1.0, 1.0, 1.0)
    assert not ax.axison


def test_new_canvas_rejects_a_width_beyond_the_column():
    with pytest.raises(ValueError, match=r"width must be at most FULL_WIDTH = 7.0 inches; got 7.5"):
        dg.new_canvas(7.5, 1.0)


def test_new_canvas_rejects_a_size_that_is_not_a_number():
    with pytest.raises(TypeError, match="height must be a positive number; got '2'"):
        dg.new_canvas(3.0, "2")


def test_new_canvas_rejects_a_size_that_is_not_positive():
    with pytest.raises(ValueError, match="height must be a positive number; got 0"):
        dg.new_canvas(3.0, 0)


def test_draw_box_returns_its_rectangle_and_centres_its_text():
    fig, ax = dg.new_canvas(3.0, 1.0)
    rect = dg.draw_box(ax, 0.5, 0.2, 2.0, 0.6, "mask")
    assert (rect.x0, rect.y0, rect.x1, rect.y1) == (0.5, 0.2, 2.5, 0.8)
    (text,) = ax.texts
    assert text.get_text() == "mask" and text.get_position() == (1.5, 0.5)
    assert_legible(fig)


def test_draw_box_rejects_a_fill_outside_zero_one():
    fig, ax = dg.new_canvas(3.0, 1.0)
    with pytest.raises(ValueError, match=r"fill must lie in \[0, 1\]; got 1.5"):
        dg.draw_box(ax, 0, 0, 1, 1, fill=1.5)


def test_helpers_reject_text_under_the_minimum_font_size():
    fig, ax = dg.new_canvas(3.0, 1.0)
    with pytest.raises(ValueError, match="fontsize must be at least MIN_FONT_PT = 9 pt; got 8"):
        dg.draw_box(ax, 0, 0, 1, 1, "x", fontsize=8)


def test_draw_arrow_joins_its_points_and_labels_the_middle():
    fig, ax = dg.new_canvas(3.0, 1.0)
    arrow = dg.draw_arrow(ax, (0.2, 0.5), (2.8, 0.5), label="$Z$")
    start, tip = arrow_ends(arrow)
    assert np.allclose(start, (0.2, 0.5)) and np.allclose(tip, (2.8, 0.5), atol=0.02)
    (text,) = ax.texts
    assert text.get_text() == "$Z$" and text.get_position()[0] == pytest.approx(1.5)
    assert text.get_position()[1] > 0.5  # above the arrow
    assert_legible(fig)


def test_draw_arrow_rejects_an_unknown_label_side():
    fig, ax = dg.new_canvas(3.0, 1.0)
    with pytest.raises(ValueError, match="label_side must be one of"):
        dg.draw_arrow(ax, (0, 0), (1, 1), label="x", label_side="middle")


def test_draw_bracket_spans_its_range_and_labels_its_middle():
    fig, ax = dg.new_canvas(3.0, 1.0)
    text = dg.draw_bracket(ax, 0.5, 2.5, 0.3, "$G = 4$")
    (line, tick) = ax.lines
    xs, ys = line.get_data()
    assert (min(xs), max(xs)) == (0.5, 2.5) and min(ys) == 0.3
    assert text.get_position()[0] == 1.5 and text.get_position()[1] > max(ys)
    assert_legible(fig)


def test_draw_bracket_on_the_left_spans_heights():
    fig, ax = dg.new_canvas(3.0, 2.0)
    text = dg.draw_bracket(ax, 0.4, 1.6, 2.0, "rows", side="left")
    xs, ys = ax.lines[0].get_data()
    assert (min(ys), max(ys)) == (0.4, 1.6) and max(xs) == 2.0
    assert text.get_position()[0] < 2.0 and text.get_ha() == "right"


def test_draw_bracket_rejects_an_unknown_side():
    fig, ax = dg.new_canvas(3.0, 1.0)
    with pytest.raises(
        ValueError, match="side must be 'above', 'below', 'left' or 'right'; got 'up'"
    ):
        dg.draw_bracket(ax, 0, 1, 0, side="up")


def test_draw_bracket_rejects_an_empty_span():
    fig, ax = dg.new_canvas(3.0, 1.0)
    with pytest.raises(ValueError, match="stop must be greater than start; got start=1, stop=1"):
        dg.draw_bracket(ax, 1, 1, 0)


def test_role_legend_has_one_patch_per_role():
    fig, ax = dg.new_canvas(4.0, 1.0)
    legend = dg.role_legend(
        ax, [("query", QUERY), ("key", KEY), ("empty", "white", {"linestyle": "--"})]
    )
    assert [t.get_text() for t in legend.get_texts()] == ["query", "key", "empty"]
    handles = legend.legend_handles
    assert all(isinstance(h, Patch) for h in handles)
    assert handles[0].get_facecolor()[:3] == pytest.approx((0xE6 / 255, 0x9F / 255, 0))
    assert_legible(fig)


def test_role_legend_writes_at_the_size_asked_for():
    fig, ax = dg.new_canvas(4.0, 1.0)
    legend = dg.role_legend(ax, [("query", QUERY), ("key", KEY)], fontsize=10)
    assert [t.get_fontsize() for t in legend.get_texts()] == [10, 10]


def test_role_legend_rejects_text_under_the_minimum_font_size():
    fig, ax = dg.new_canvas(4.0, 1.0)
    with pytest.raises(ValueError, match="fontsize must be at least MIN_FONT_PT = 9 pt; got 7"):
        dg.role_legend(ax, [("query", QUERY)], fontsize=7)


def test_role_legend_rejects_no_entries():
    fig, ax = dg.new_canvas(4.0, 1.0)
    with pytest.raises(ValueError, match="entries must hold at least one"):
        dg.role_legend(ax, [])
