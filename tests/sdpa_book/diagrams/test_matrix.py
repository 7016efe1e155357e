"""sdpa_book.diagrams.matrix: grids whose proportions follow their shapes, labelled with them."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from diagram_checks import assert_legible, masked_corners  # noqa: E402

from sdpa_book import diagrams as dg  # noqa: E402
from sdpa_book.figures import KEY, QUERY  # noqa: E402


def test_draw_matrix_sizes_follow_the_shape_and_labels_name_it():
    fig, ax = dg.new_canvas(4.0, 2.5)
    rect = dg.draw_matrix(
        ax, 0.5, 0.6, (5, 7), unit=0.2, color=QUERY, name="$Q$", dims=("T", "D_k"), tag="Q"
    )
    assert (round(rect.width, 9), round(rect.height, 9)) == (1.4, 1.0)  # 7 x 0.2 by 5 x 0.2
    assert dg.tagged_rects(fig) == {"Q": rect}
    assert dg.figure_texts(fig) == ["$Q$", "$(T, D_k)$", "(5, 7)"]
    assert_legible(fig)


def test_draw_matrix_draws_a_vector_as_one_row_with_its_values():
    fig, ax = dg.new_canvas(3.0, 1.2)
    rect = dg.draw_matrix(
        ax, 0.3, 0.5, (3,), unit=0.5, color=KEY, dims=("D_k",), values=[0.25, -1.5, 12.0]
    )
    assert (rect.width, rect.height) == (1.5, 0.5)
    # hand-formatted: two decimals, one from 10 on, a true minus sign
    assert dg.figure_texts(fig) == ["0.25", "\N{MINUS SIGN}1.50", "12.0", "$(D_k,)$", "(3,)"]
    assert_legible(fig)


def test_draw_matrix_writes_its_labels_and_values_at_the_sizes_asked_for():
    fig, ax = dg.new_canvas(3.0, 2.0)
    dg.draw_matrix(
        ax, 0.5, 0.8, (2, 3), unit=0.3, color=KEY, name="$W_K$", dims=("E", "D_k"),
        values=[[1.0, 0.0, -2.0], [0.0, 3.0, 0.0]], decimals=0,
        name_pt=12, label_pt=11, value_pt=10,
    )  # fmt: skip
    sizes = {t.get_text(): t.get_fontsize() for t in ax.texts}
    # whole numbers, row by row, then the name and the two shapes
    minus = "\N{MINUS SIGN}"
    assert [t.get_text() for t in ax.texts][:6] == ["1", "0", f"{minus}2", "0", "3", "0"]
    assert sizes == {"1": 10, "0": 10, f"{minus}2": 10, "3": 10, "$W_K$": 12,
                     "$(E, D_k)$": 11, "(2, 3)": 11}  # fmt: skip
    assert_legible(fig)


def test_draw_matrix_leaves_out_values_wider_than_their_cells():
    # at 10 pt, "-2.00" is about 0.43 in wide: it does not fit cells 0.3 in wide
    fig, ax = dg.new_canvas(3.0, 2.0)
    dg.draw_matrix(ax, 0.5, 0.5, (1, 3), unit=0.3, color=KEY, values=[[1, 0, -2]], value_pt=10)
    assert dg.figure_texts(fig) == ["(1, 3)"]


def test_draw_matrix_rejects_a_label_under_the_minimum_font_size():
    fig, ax = dg.new_canvas(2.0, 2.0)
    with pytest.raises(ValueError, match="fontsize must be at least MIN_FONT_PT = 9 pt; got 8"):
        dg.draw_matrix(ax, 0, 0, (2, 3), unit=0.1, color=KEY, label_pt=8)


def test_draw_matrix_rejects_decimals_that_are_not_an_integer():
    fig, ax = dg.new_canvas(2.0, 2.0)
    with pytest.raises(TypeError, match="decimals must be None or an integer; got 1.5"):
        dg.draw_matrix(ax, 0, 0, (2, 3), unit=0.1, color=KEY, decimals=1.5)


def test_draw_matrix_rejects_decimals_out_of_range():
    fig, ax = dg.new_canvas(2.0, 2.0)
    with pytest.raises(ValueError, match=r"decimals must lie in \[0, 6\]; got -1"):
        dg.draw_matrix(ax, 0, 0, (2, 3), unit=0.1, color=KEY, decimals=-1)


def test_draw_matrix_greys_the_masked_cells():
    fig, ax = dg.new_canvas(2.0, 2.0)
    masked = np.array([[False, True, True], [False, False, True]])
    dg.draw_matrix(ax, 0.2, 0.2, (2, 3), unit=0.4, color=KEY, masked=masked, tag="m")
    corners = sorted(masked_corners(fig)["m"])
    # row 0 is the top row: cells (0, 1), (0, 2) at y = 0.6, cell (1, 2) at y = 0.2
    assert corners == [(0.6, 0.6), (1.0, 0.2), (1.0, 0.6)]


def test_draw_matrix_keeps_a_thin_matrix_visible():
    fig, ax = dg.new_canvas(2.0, 2.0)
    rect = dg.draw_matrix(ax, 0.2, 0.2, (1, 1000), unit=0.001, color=KEY)
    assert rect.height == pytest.approx(0.1) and rect.width == pytest.approx(1.0)


def test_draw_matrix_rejects_a_shape_of_three_sizes():
    fig, ax = dg.new_canvas(2.0, 2.0)
    with pytest.raises(
        ValueError, match=r"shape must be \(rows, cols\) or \(n,\); got \(2, 3, 4\)"
    ):
        dg.draw_matrix(ax, 0, 0, (2, 3, 4), unit=0.1, color=KEY)


def test_draw_matrix_rejects_dims_that_do_not_match_the_shape():
    fig, ax = dg.new_canvas(2.0, 2.0)
    with pytest.raises(ValueError, match=r"dims must name each of the 2 sizes of shape=\(2, 3\)"):
        dg.draw_matrix(ax, 0, 0, (2, 3), unit=0.1, color=KEY, dims=("T",))


def test_draw_matrix_rejects_values_of_another_shape():
    fig, ax = dg.new_canvas(2.0, 2.0)
    with pytest.raises(
        ValueError, match=r"values must have the matrix's shape \(2, 3\); got \(3, 2\)"
    ):
        dg.draw_matrix(ax, 0, 0, (2, 3), unit=0.1, color=KEY, values=np.zeros((3, 2)))


def test_draw_matrix_rejects_a_mask_of_another_shape():
    fig, ax = dg.new_canvas(2.0, 2.0)
    with pytest.raises(
        ValueError, match=r"masked must have the matrix's shape \(2, 3\); got \(2, 2\)"
    ):
        dg.draw_matrix(ax, 0, 0, (2, 3), unit=0.1, color=KEY, masked=np.eye(2, dtype=bool))


def test_draw_matrix_rejects_an_unknown_label_side():
    fig, ax = dg.new_canvas(2.0, 2.0)
    with pytest.raises(
        ValueError, match="a label side must be 'above', 'below', 'left' or 'right'"
    ):
        dg.draw_matrix(ax, 0, 0, (2, 3), unit=0.1, color=KEY, name="$K$", name_at="inside")


def test_draw_matrix_rejects_a_size_that_is_not_an_integer():
    fig, ax = dg.new_canvas(2.0, 2.0)
    with pytest.raises(TypeError, match="shape must be a positive integer; got 2.5"):
        dg.draw_matrix(ax, 0, 0, (2.5, 3), unit=0.1, color=KEY)


@pytest.mark.parametrize(
    "bad",
    [
        {"values": np.zeros((3, 2))},
        {"masked": np.eye(2, dtype=bool)},
        {"name": "$K$", "name_at": "inside"},
        {"name_pt": 7},
        {"decimals": 7},
    ],
    ids=["values", "masked", "label side", "font size", "decimals"],
)
def test_draw_matrix_checks_its_arguments_before_drawing(bad):
    fig, ax = dg.new_canvas(2.0, 2.0)
    with pytest.raises(ValueError):
        dg.draw_matrix(ax, 0, 0, (2, 3), unit=0.1, color=KEY, **bad)
    assert not ax.patches and not ax.collections and not ax.texts  # nothing half drawn
