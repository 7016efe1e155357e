"""The book's diagrams (sdpa_book.diagrams): each draws, shows the shapes it was given, keeps the
proportions of the sizes, changes when a size changes, and stays legible (fonts of at least
MIN_FONT_PT, no text clipped or overlapping other text, at most FULL_WIDTH wide)."""

from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from matplotlib.patches import Patch  # noqa: E402
from matplotlib.text import Text  # noqa: E402

from sdpa_book import diagrams as dg  # noqa: E402
from sdpa_book.figures import FULL_WIDTH, KEY, MIN_FONT_PT, QUERY  # noqa: E402


@functools.cache
def build(name: str, *args, **kwargs):
    """A diagram, drawn once per test session for each set of (hashable) arguments: tests only
    read figures, so they share them (drawing is most of the time these tests take)."""
    return getattr(dg, name)(*args, **kwargs)


def shapes(fig) -> list[str]:
    """The numeric shape labels, e.g. "(4, 3)", in drawing order."""
    return [t for t in dg.figure_texts(fig) if t.startswith("(") and t[1:2].isdigit()]


def masked_corners(fig) -> dict[str, list[tuple[float, float]]]:
    """{grid tag: bottom-left corners of its grey (masked) cells}, from the drawn paths."""
    corners = {}
    for patch in fig.axes[0].patches:
        label = patch.get_label() or ""
        if label.startswith("_masked "):
            squares = patch.get_path().to_polygons(closed_only=False)
            corners[label[len("_masked ") :]] = [
                tuple(np.round(sq.min(axis=0), 9)) for sq in squares
            ]
    return corners


def arrow_ends(arrow) -> tuple[np.ndarray, np.ndarray]:
    """Tail and tip of a straight arrow, from its path in data coordinates (the drawn tip stops
    about a line width short of the end point, so that the head's point lands on it)."""
    path = arrow.get_path()
    vertices = path.vertices[path.codes != path.CLOSEPOLY]  # the closing vertex is (0, 0)
    start = vertices[0]
    return start, vertices[np.argmax(np.linalg.norm(vertices - start, axis=1))]


def assert_legible(fig) -> None:
    """White, at most FULL_WIDTH wide, fonts >= MIN_FONT_PT, texts inside and apart."""
    width, height = fig.get_size_inches()
    assert width <= FULL_WIDTH + 1e-9
    assert fig.get_facecolor() == (1.0, 1.0, 1.0, 1.0)
    fig.draw_without_rendering()  # lays out the legends; nothing is rasterised
    renderer = fig.canvas.get_renderer()
    texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]
    assert texts, "a diagram without text"
    boxes = []
    for t in texts:
        assert t.get_fontsize() >= MIN_FONT_PT, (t.get_text(), t.get_fontsize())
        box = t.get_window_extent(renderer)
        # inside the canvas (1 px of tolerance for antialiasing)
        assert box.x0 >= -1 and box.y0 >= -1, t.get_text()
        assert box.x1 <= width * fig.dpi + 1 and box.y1 <= height * fig.dpi + 1, t.get_text()
        boxes.append((t.get_text(), box.shrunk(0.97, 0.9)))
    for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2):
        assert not box_a.overlaps(box_b), f"texts overlap: {a!r} and {b!r}"


# ----------------------------------------------------------------------------------------------
# Helpers


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


def test_role_legend_rejects_no_entries():
    fig, ax = dg.new_canvas(4.0, 1.0)
    with pytest.raises(ValueError, match="entries must hold at least one"):
        dg.role_legend(ax, [])


def test_text_size_grows_with_the_text_and_the_lines():
    w1, h1 = dg.text_size("(4, 3)")
    w2, _ = dg.text_size("(1024, 64)")
    w3, h3 = dg.text_size("(4, 3)\n(4, 3)")
    assert 0 < w1 < w2 and w3 == pytest.approx(w1) and h3 == pytest.approx(2 * h1)
    assert dg.text_size("(4, 3)", 18)[0] == pytest.approx(2 * w1, rel=0.05)


# ----------------------------------------------------------------------------------------------
# Every diagram, at representative and extreme sizes: legible


LEGIBLE = [
    ("attention_pipeline_diagram", (3, 5, 7, 2), {}),
    ("attention_pipeline_diagram", (3, 5, 7, 2), {"compact": True}),
    ("attention_pipeline_diagram", (1, 7, 1, 1), {}),
    ("attention_pipeline_diagram", (1024, 1024, 64, 64), {}),
    ("attention_pipeline_diagram", (1024, 1024, 64, 64), {"compact": True}),
    ("multihead_diagram", (5, 11, 3, 2, 7), {}),
    ("multihead_diagram", (2, 512, 8, 64, 64), {}),
    ("grouped_heads_diagram", (8, (8, 2, 1)), {}),
    ("grouped_heads_diagram", (6, (6, 3, 2, 1)), {}),
    ("grouped_heads_diagram", (32, (32, 8, 1)), {}),
    ("mask_geometry_diagram", (6, 6), {"window": 3, "lengths": (4, 6)}),
    ("mask_geometry_diagram", (3, 7), {"window": 2, "lengths": (5,)}),
    ("mask_geometry_diagram", (5, 3), {}),
    ("kv_cache_diagram", (5, 3), {}),
    ("kv_cache_diagram", (1, 1), {}),
    ("kv_cache_diagram", (20, 12), {}),
    ("flash_loop_diagram", (6, 10, 2, 5, 3, 7), {}),
    ("flash_loop_diagram", (1024, 1024, 128, 128, 64, 64), {}),
    ("backward_graph_diagram", (), {"T": 3, "S": 5, "Dk": 7, "Dv": 2}),
    ("backward_graph_diagram", (), {}),
    ("transformer_block_diagram", (), {"norm": "pre", "T": 5, "E": 16}),
    ("transformer_block_diagram", (), {"norm": "post", "T": 1024, "E": 4096}),
]


@pytest.mark.parametrize(
    ("name", "args", "kwargs"),
    LEGIBLE,
    ids=[f"{n.removesuffix('_diagram')}{a}{k or ''}" for n, a, k in LEGIBLE],
)
def test_diagram_is_legible(name, args, kwargs):
    assert_legible(build(name, *args, **kwargs))


# ----------------------------------------------------------------------------------------------
# 1. token -> q, k, v


@pytest.fixture
def token_arrays(rng):
    E, Dk, Dv = 5, 3, 2
    return (
        rng.standard_normal(E),
        rng.standard_normal((E, Dk)),
        rng.standard_normal((E, Dk)),
        rng.standard_normal((E, Dv)),
    )


def test_token_qkv_labels_the_shapes_and_values_it_was_given(token_arrays):
    x, W_q, W_k, W_v = token_arrays
    fig = dg.token_qkv_diagram(x, W_q, W_k, W_v, token="sat")
    texts = dg.figure_texts(fig)
    assert shapes(fig) == ["(5,)", "(5, 3)", "(3,)", "(5, 3)", "(3,)", "(5, 2)", "(2,)"]
    assert "\u201csat\u201d" in texts and "$W_Q$" in texts and "$q = x\\,W_Q$" in texts
    # the query's values, computed here by a float64 loop, are written in its cells
    q = [sum(x[e] * W_q[e, d] for e in range(5)) for d in range(3)]
    for value in q:
        assert f"{value:.2f}".replace("-", "\N{MINUS SIGN}") in texts
    rects = dg.tagged_rects(fig)
    assert rects["W_Q"].width / rects["W_Q"].height == pytest.approx(3 / 5)  # (E, Dk) = (5, 3)
    assert rects["q"].width / rects["v"].width == pytest.approx(3 / 2)  # Dk / Dv
    assert_legible(fig)


def test_token_qkv_changes_with_the_width(rng):
    E = 4
    figs = [
        dg.token_qkv_diagram(
            rng.standard_normal(E),
            rng.standard_normal((E, d)),
            rng.standard_normal((E, d)),
            rng.standard_normal((E, 2)),
        )
        for d in (3, 6)
    ]
    assert "(4, 6)" in shapes(figs[1]) and "(4, 6)" not in shapes(figs[0])
    assert dg.tagged_rects(figs[1])["q"].width > dg.tagged_rects(figs[0])["q"].width


def test_token_qkv_hides_values_when_the_cells_are_too_narrow(rng):
    E = 40
    fig = dg.token_qkv_diagram(
        rng.standard_normal(E),
        rng.standard_normal((E, 8)),
        rng.standard_normal((E, 8)),
        rng.standard_normal((E, 8)),
    )
    assert not [t for t in dg.figure_texts(fig) if t[:1].isdigit() or t[:1] == "\N{MINUS SIGN}"]
    assert_legible(fig)


def test_token_qkv_rejects_a_token_that_is_not_a_string(token_arrays):
    with pytest.raises(TypeError, match="token must be a str; got int"):
        dg.token_qkv_diagram(*token_arrays, token=3)


def test_token_qkv_rejects_a_missing_array(token_arrays):
    x, W_q, W_k, W_v = token_arrays
    with pytest.raises(TypeError, match="W_k must be a 2-D array of real numbers; got None"):
        dg.token_qkv_diagram(x, W_q, None, W_v)


def test_token_qkv_rejects_a_complex_array(token_arrays):
    x, W_q, W_k, W_v = token_arrays
    with pytest.raises(
        TypeError, match="x must be a 1-D array of real numbers; got dtype complex128"
    ):
        dg.token_qkv_diagram(x + 1j, W_q, W_k, W_v)


def test_token_qkv_rejects_an_embedding_that_is_not_a_row(token_arrays):
    x, W_q, W_k, W_v = token_arrays
    with pytest.raises(ValueError, match=r"x must be a non-empty 1-D array; got x.shape=\(1, 5\)"):
        dg.token_qkv_diagram(x[None], W_q, W_k, W_v)


def test_token_qkv_rejects_a_projection_with_the_wrong_rows(token_arrays):
    x, W_q, W_k, W_v = token_arrays
    with pytest.raises(ValueError, match=r"W_v must have E = 5 rows.*W_v.shape=\(4, 2\)"):
        dg.token_qkv_diagram(x, W_q, W_k, W_v[:4])


def test_token_qkv_rejects_query_and_key_widths_that_differ(token_arrays):
    x, W_q, W_k, W_v = token_arrays
    with pytest.raises(
        ValueError,
        match=r"W_q and W_k must share the width Dk; got W_q.shape=\(5, 3\), W_k.shape=\(5, 2\)",
    ):
        dg.token_qkv_diagram(x, W_q, W_k[:, :2], W_v)


def test_token_qkv_rejects_a_width_too_large_to_draw(rng):
    E = 49
    with pytest.raises(ValueError, match="E must be at most 48 to be drawn legibly; got E=49"):
        dg.token_qkv_diagram(np.ones(E), np.ones((E, 2)), np.ones((E, 2)), np.ones((E, 2)))


# ----------------------------------------------------------------------------------------------
# 2. the pipeline


def test_pipeline_labels_every_shape_it_was_given():
    T, S, Dk, Dv = 3, 5, 7, 2
    fig = build("attention_pipeline_diagram", T, S, Dk, Dv)
    # Q (T, Dk), scores (T, S), weights (T, S), O (T, Dv), K^T (Dk, S), V (S, Dv)
    assert shapes(fig) == ["(3, 7)", "(3, 5)", "(3, 5)", "(3, 2)", "(7, 5)", "(5, 2)"]
    texts = dg.figure_texts(fig)
    for label in (
        "queries $Q$",
        "keys $K^\\top$",
        "scores $QK^\\top$",
        "weights $A$",
        "values $V$",
        "out $O = AV$",
        "$(T, D_k)$",
        "$(D_k, S)$",
        "$(S, D_v)$",
        "$\\div\\sqrt{D_k}$",
        "causal\nmask",
        "softmax",
        "$Z$",
    ):
        assert label in texts, label


def test_pipeline_grids_keep_the_proportions_of_the_sizes():
    T, S, Dk, Dv = 3, 5, 7, 2
    rects = dg.tagged_rects(build("attention_pipeline_diagram", T, S, Dk, Dv))
    unit = rects["Q"].width / Dk
    expected = {
        "Q": (Dk, T),
        "K^T": (S, Dk),
        "scores": (S, T),
        "weights": (S, T),
        "V": (Dv, S),
        "O": (Dv, T),
    }
    for tag, (cols, rows) in expected.items():
        assert (rects[tag].width, rects[tag].height) == pytest.approx((cols * unit, rows * unit)), (
            tag
        )


def test_pipeline_greys_the_causal_cells_of_the_weights_only_with_a_mask():
    T, S = 3, 5

    def grey_cells(fig):
        return sum(len(corners) for corners in masked_corners(fig).values())

    # top-left causal: query i sees keys j <= i, so row i masks S - 1 - i keys
    assert grey_cells(build("attention_pipeline_diagram", T, S, 7, 2)) == sum(
        S - 1 - i for i in range(T)
    )
    fig = build("attention_pipeline_diagram", T, S, 7, 2, mask=False)
    assert grey_cells(fig) == 0 and "causal\nmask" not in dg.figure_texts(fig)


def test_pipeline_changes_when_a_size_changes():
    a = build("attention_pipeline_diagram", 3, 5, 7, 2)
    b = build("attention_pipeline_diagram", 3, 9, 7, 2)
    assert "(3, 9)" in shapes(b) and "(3, 9)" not in shapes(a)
    ratio = lambda fig: dg.tagged_rects(fig)["scores"].width / dg.tagged_rects(fig)["Q"].width  # noqa: E731
    assert ratio(a) == pytest.approx(5 / 7) and ratio(b) == pytest.approx(9 / 7)


def test_pipeline_compact_is_smaller_and_still_labelled():
    full = build("attention_pipeline_diagram", 3, 5, 7, 2)
    small = build("attention_pipeline_diagram", 3, 5, 7, 2, compact=True)
    assert small.get_size_inches()[0] < 0.75 * full.get_size_inches()[0]
    assert shapes(small) == shapes(full)
    assert "$\\div\\sqrt{D_k}$\ncausal mask\nsoftmax" in dg.figure_texts(small)


def test_pipeline_rejects_a_size_that_is_not_an_integer():
    with pytest.raises(TypeError, match="Dk must be a positive integer; got 2.0"):
        dg.attention_pipeline_diagram(4, 6, 2.0, 2)


def test_pipeline_rejects_a_size_that_is_not_positive():
    with pytest.raises(ValueError, match="S must be a positive integer; got 0"):
        dg.attention_pipeline_diagram(4, 0, 2, 2)


def test_pipeline_rejects_a_mask_flag_that_is_not_a_bool():
    with pytest.raises(TypeError, match="mask must be a bool; got 'causal'"):
        dg.attention_pipeline_diagram(4, 6, 2, 2, mask="causal")


# ----------------------------------------------------------------------------------------------
# 3. multi-head attention, grouped heads


def test_multihead_labels_every_shape_it_was_given():
    T, E, H, Dk, Dv = 5, 11, 3, 2, 7
    fig = build("multihead_diagram", T, E, H, Dk, Dv)
    # X (T, E); W_Q, W_K (E, H Dk), W_V (E, H Dv); Q, K (T, H Dk), V (T, H Dv); a head's out
    # (T, Dv); the concatenation (T, H Dv); W_O (H Dv, E); out (T, E)
    assert shapes(fig) == ["(5, 11)", "(5, 6)", "(5, 6)", "(5, 21)", "(5, 7)", "(5, 21)", "(5, 11)"]
    texts = dg.figure_texts(fig)
    assert "$W_Q$\n$(E, HD_k)$\n(11, 6)" in texts and "$W_V$\n$(E, HD_v)$\n(11, 21)" in texts
    assert "$W_O$\n$(HD_v, E)$\n(21, 11)" in texts
    assert [t for t in texts if t.startswith("head ")] == ["head 1", "head 2", "head 3"]


def test_multihead_grids_keep_the_proportions_and_split_into_heads():
    T, E, H, Dk, Dv = 5, 11, 3, 2, 7
    fig = build("multihead_diagram", T, E, H, Dk, Dv)
    rects = dg.tagged_rects(fig)
    unit = rects["X"].width / E
    for tag, cols in (("Q", H * Dk), ("K", H * Dk), ("V", H * Dv), ("concat", H * Dv), ("out", E)):
        assert rects[tag].width == pytest.approx(cols * unit), tag
        assert rects[tag].height == pytest.approx(T * unit), tag
    # H - 1 heavy lines split Q, K, V and the concatenation into heads
    from matplotlib.collections import LineCollection

    heavy = [
        c
        for c in fig.axes[0].collections
        if isinstance(c, LineCollection) and c.get_linewidths()[0] == 1.6
    ]
    assert [len(c.get_segments()) for c in heavy] == [H - 1] * 4


def test_multihead_draws_the_first_two_and_the_last_of_many_heads():
    fig = build("multihead_diagram", 4, 32, 8, 4, 4)
    texts = dg.figure_texts(fig)
    assert [t for t in texts if t.startswith("head ")] == ["head 1", "head 2", "head 8"]
    assert "\N{HORIZONTAL ELLIPSIS}" in texts


def test_multihead_changes_when_a_size_changes():
    a, b = build("multihead_diagram", 5, 11, 3, 2, 7), build("multihead_diagram", 5, 11, 2, 3, 4)
    assert "(5, 8)" in shapes(b) and "(5, 8)" not in shapes(a)  # concatenation (T, H Dv)
    assert dg.tagged_rects(b)["concat"].width < dg.tagged_rects(a)["concat"].width


def test_multihead_rejects_a_size_that_is_not_positive():
    with pytest.raises(ValueError, match="H must be a positive integer; got -2"):
        dg.multihead_diagram(5, 12, -2, 4, 4)


def test_grouped_heads_join_each_query_head_to_the_key_of_its_group():
    Hq = 6
    fig = build("grouped_heads_diagram", Hq, (6, 3, 2, 1))
    rects = dg.tagged_rects(fig)
    ends = [line.get_xydata() for line in fig.axes[0].lines if len(line.get_xydata()) == 2]
    for p, Hkv in enumerate((6, 3, 2, 1)):
        G = Hq // Hkv
        for h in range(Hq):
            q = rects[f"{p}: query {h}"]
            (link,) = [e for e in ends if np.allclose(e[0], q.bottom)]
            # the link ends on top of key head h // G (hand-computed group), the closest one
            keys = [rects[f"{p}: key {g}"] for g in range(Hkv)]
            nearest = min(range(Hkv), key=lambda g: abs(keys[g].cx - link[1][0]))
            assert nearest == h // G and link[1][1] == pytest.approx(keys[nearest].y1)
        assert f"{p}: key {Hkv}" not in rects and f"{p}: value {Hkv - 1}" in rects
    assert "cached:\n3 key and 3 value heads" in dg.figure_texts(fig)  # narrow: two lines


def test_grouped_heads_name_the_three_kinds():
    fig = build("grouped_heads_diagram", 8, (8, 2, 1))
    texts = dg.figure_texts(fig)
    assert [t for t in texts if "(" in t and "A)" in t] == [
        "multi-head (MHA)",
        "grouped-query (GQA)",
        "multi-query (MQA)",
    ]
    assert "$H_q = 8$, $H_{kv} = 2$, $G = 4$" in texts
    assert "cached: 2 key and 2 value heads" in texts and "cached: 1 key and 1 value head" in texts
    assert texts[-3:] == ["query head", "key head", "value head"]


def test_grouped_heads_changes_with_the_number_of_key_value_heads():
    a, b = build("grouped_heads_diagram", 8, 2), build("grouped_heads_diagram", 8, (8, 4))
    keys = lambda fig: sorted(t for t in dg.tagged_rects(fig) if t.startswith("0: key "))  # noqa: E731
    assert len(keys(a)) == 2 and len(keys(b)) == 8


def test_grouped_heads_rejects_a_count_that_does_not_divide():
    with pytest.raises(
        ValueError,
        match="Hkv must divide Hq, so that query heads form equal groups; got Hq=8, Hkv=3",
    ):
        dg.grouped_heads_diagram(8, [8, 3])


def test_grouped_heads_rejects_too_many_panels():
    with pytest.raises(ValueError, match="Hkv must hold one to four head counts .*; got 5"):
        dg.grouped_heads_diagram(8, [8, 4, 2, 1, 1])


def test_grouped_heads_rejects_a_count_that_is_not_an_integer():
    with pytest.raises(TypeError, match="Hkv must be a positive integer; got 2.0"):
        dg.grouped_heads_diagram(8, 2.0)


def test_grouped_heads_rejects_too_many_query_heads():
    with pytest.raises(ValueError, match="Hq must be at most 64 to be drawn legibly; got Hq=96"):
        dg.grouped_heads_diagram(96, 8)


# ----------------------------------------------------------------------------------------------
# 4. masks as geometry


def read_grey_cells(rect, corners, T: int, S: int) -> np.ndarray:
    """The may-attend pattern of a (T, S) grid at ``rect``, read back from its grey cells."""
    cell = rect.width / S
    allowed = np.ones((T, S), dtype=bool)
    for x, y in corners:
        j = int(round((x - rect.x0) / cell))
        i = T - 1 - int(round((y - rect.y0) / cell))
        allowed[i, j] = False
    return allowed


def drawn_masks(fig, T: int, S: int) -> list[np.ndarray]:
    """The may-attend pattern of each mask panel, in order."""
    rects, greys = dg.tagged_rects(fig), masked_corners(fig)
    panels = sorted((tag for tag in rects if tag.startswith("mask ")), key=lambda t: int(t[5:]))
    return [read_grey_cells(rects[tag], greys.get(tag, []), T, S) for tag in panels]


def loop_mask(T, S, keep) -> np.ndarray:
    return np.array([[keep(i, j) for j in range(S)] for i in range(T)])


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


# ----------------------------------------------------------------------------------------------
# 5. KV cache


def test_kv_cache_rows_grow_by_one_key_per_step():
    P, N = 5, 3
    fig = build("kv_cache_diagram", P, N)
    rects = dg.tagged_rects(fig)
    cell = rects["prefill"].width / P
    assert rects["prefill"].height == pytest.approx(P * cell)  # P queries x P keys
    for k in range(1, N + 1):
        assert rects[f"step {k}"].width == pytest.approx((P + k) * cell)  # 1 query x P + k keys
        assert rects[f"step {k}"].height == pytest.approx(cell)
        assert rects[f"step {k}"].x0 == pytest.approx(rects["prefill"].x0)  # key 0 aligned


def test_kv_cache_prefill_is_causal_and_each_step_sees_every_cached_key():
    P, N = 4, 2
    fig = build("kv_cache_diagram", P, N)
    # only the prefill masks anything (decoding rows have no grey cells): key j > i is in the
    # future of prompt query i
    greys = masked_corners(fig)
    assert list(greys) == ["prefill"]
    prefill = read_grey_cells(dg.tagged_rects(fig)["prefill"], greys["prefill"], P, P)
    np.testing.assert_array_equal(prefill, loop_mask(P, P, lambda i, j: j <= i))


def test_kv_cache_labels_the_cache_and_the_steps():
    fig = build("kv_cache_diagram", 5, 3)
    texts = dg.figure_texts(fig)
    assert [t for t in texts if t.startswith("step")] == [
        "step 1: query 5",
        "step 2: query 6",
        "step 3: query 7",
    ]
    assert [t for t in texts if t.startswith("cache")] == [
        "cache: 5 keys, 5 values",
        "cache: 6 keys, 6 values",
        "cache: 7 keys, 7 values",
        "cache: 8 keys, 8 values",
    ]
    assert (
        "5 keys and values written at once" in texts
        and "prefill: 5 queries\nat once, causal" in texts
    )
    assert [t for t in texts if t.isdigit()] == [str(j) for j in range(8)]  # key positions


def test_kv_cache_changes_with_the_prompt():
    a, b = build("kv_cache_diagram", 5, 3), build("kv_cache_diagram", 1, 1)
    assert "cache: 8 keys, 8 values" in dg.figure_texts(
        a
    ) and "cache: 8 keys, 8 values" not in dg.figure_texts(b)
    assert "cache: 1 key, 1 value" in dg.figure_texts(b)


def test_kv_cache_rejects_a_count_that_is_not_positive():
    with pytest.raises(ValueError, match="new_tokens must be a positive integer; got 0"):
        dg.kv_cache_diagram(5, 0)


def test_kv_cache_rejects_too_many_tokens_to_draw():
    with pytest.raises(
        ValueError,
        match="prompt_len \\+ new_tokens must be at most 32 to be drawn legibly; got prompt_len \\+ new_tokens=33",
    ):
        dg.kv_cache_diagram(30, 3)


# ----------------------------------------------------------------------------------------------
# 6. the FlashAttention loop


def test_flash_loop_labels_slow_and_fast_memory_with_the_given_shapes():
    T, S, Bq, Bk, Dk, Dv = 6, 10, 2, 5, 3, 7
    fig = build("flash_loop_diagram", T, S, Bq, Bk, Dk, Dv)
    # slow: Q (T, Dk), scores (T, S), O (T, Dv), lse (T,), K^T (Dk, S), V (S, Dv);
    # fast: Q_i (Bq, Dk), tile (Bq, Bk), acc (Bq, Dv), m (Bq,), l (Bq,), K_j^T (Dk, Bk), V_j (Bk, Dv)
    assert shapes(fig) == [
        "(6, 3)",
        "(6, 10)",
        "(6, 7)",
        "(6,)",
        "(3, 10)",
        "(10, 7)",
        "(2, 3)",
        "(2, 5)",
        "(2, 7)",
        "(2,)",
        "(2,)",
        "(3, 5)",
        "(5, 7)",
    ]
    texts = dg.figure_texts(fig)
    for label in (
        "slow memory (HBM)",
        "fast memory (SRAM)",
        "$m$",
        "$\\ell$",
        "acc",
        "lse",
        "load $Q_i$",
        "load $K_j$, $V_j$",
        "write $O_i$, lse$_i$",
        "scores: never stored",
    ):
        assert label in texts, label


def test_flash_loop_numbers_the_tiles_in_loop_order():
    T, S, Bq, Bk = 6, 10, 2, 5  # 3 query blocks x 2 key blocks
    fig = build("flash_loop_diagram", T, S, Bq, Bk, 3, 2)
    rects = dg.tagged_rects(fig)
    tiles = rects["tiles"]
    numbers = {
        int(t.get_text()): t.get_position() for t in fig.axes[0].texts if t.get_text().isdigit()
    }
    assert sorted(numbers) == list(range(1, 7))
    # tile n = i * n_k + j + 1: the inner loop runs over key blocks j (left to right), the
    # outer over query blocks i (top to bottom)
    for n, (x, y) in numbers.items():
        i, j = divmod(n - 1, 2)
        assert tiles.x0 + j * tiles.width / 2 < x < tiles.x0 + (j + 1) * tiles.width / 2
        assert tiles.y1 - (i + 1) * tiles.height / 3 < y < tiles.y1 - i * tiles.height / 3


def test_flash_loop_numbers_only_tiles_they_fit_in():
    # S = 11 with blocks of 5: the last key block is one key wide, too narrow for its numbers.
    T, S, Bq, Bk = 6, 11, 2, 5
    fig = build("flash_loop_diagram", T, S, Bq, Bk, 3, 2)
    ax, tiles = fig.axes[0], dg.tagged_rects(fig)["tiles"]
    fig.canvas.draw()
    to_data = ax.transData.inverted()
    numbers = [t for t in ax.texts if t.get_text().isdigit()]
    # the full-width columns j = 0, 1 are numbered, the narrow column j = 2 is not
    assert sorted(int(t.get_text()) for t in numbers) == [1, 2, 4, 5, 7, 8]
    column = tiles.width * Bk / S
    for t in numbers:
        (x0, _), (x1, _) = to_data.transform(t.get_window_extent().get_points())
        j = (int(t.get_text()) - 1) % 3
        assert tiles.x0 + j * column <= x0 < x1 <= tiles.x0 + (j + 1) * column


def test_flash_loop_grids_keep_the_proportions_in_both_memories():
    T, S, Bq, Bk, Dk, Dv = 6, 10, 2, 5, 3, 7
    rects = dg.tagged_rects(build("flash_loop_diagram", T, S, Bq, Bk, Dk, Dv))
    unit = rects["Q"].height / T
    expected = {
        "Q": (Dk, T),
        "tiles": (S, T),
        "O": (Dv, T),
        "lse": (1, T),
        "K^T": (S, Dk),
        "V": (Dv, S),
        "Q_i": (Dk, Bq),
        "tile": (Bk, Bq),
        "acc": (Dv, Bq),
        "m": (1, Bq),
        "l": (1, Bq),
        "K_j^T": (Bk, Dk),
        "V_j": (Dv, Bk),
    }
    for tag, (cols, rows) in expected.items():
        assert (rects[tag].width, rects[tag].height) == pytest.approx((cols * unit, rows * unit)), (
            tag
        )
    # fast memory sits below slow memory
    assert rects["fast memory (SRAM)"].y1 < rects["slow memory (HBM)"].y0


def test_flash_loop_changes_with_the_tile_size():
    a, b = (
        build("flash_loop_diagram", 8, 8, 2, 2, 4, 4),
        build("flash_loop_diagram", 8, 8, 4, 2, 4, 4),
    )
    count = lambda fig: len([t for t in dg.figure_texts(fig) if t.isdigit()])  # noqa: E731
    assert (count(a), count(b)) == (16, 8)
    ratio = lambda fig: dg.tagged_rects(fig)["tile"].height / dg.tagged_rects(fig)["Q"].height  # noqa: E731
    assert (ratio(a), ratio(b)) == pytest.approx((2 / 8, 4 / 8))  # Bq / T


def test_flash_loop_with_large_sizes_labels_them():
    fig = build("flash_loop_diagram", 1024, 1024, 128, 128, 64, 64)
    assert "(1024, 1024)" in shapes(fig) and "(128, 128)" in shapes(fig)


def test_flash_loop_rejects_a_query_block_larger_than_the_queries():
    with pytest.raises(
        ValueError, match="Bq must be at most T: a query block holds at most T rows; got Bq=8, T=6"
    ):
        dg.flash_loop_diagram(6, 8, 8, 2, 3, 2)


def test_flash_loop_rejects_a_key_block_larger_than_the_keys():
    with pytest.raises(
        ValueError, match="Bk must be at most S: a key block holds at most S keys; got Bk=9, S=8"
    ):
        dg.flash_loop_diagram(6, 8, 2, 9, 3, 2)


def test_flash_loop_rejects_too_many_blocks_to_draw():
    with pytest.raises(ValueError, match="the number of query blocks T / Bq must be at most 12"):
        dg.flash_loop_diagram(26, 8, 2, 2, 3, 2)


def test_flash_loop_rejects_a_tile_size_that_is_not_an_integer():
    with pytest.raises(TypeError, match="Bk must be a positive integer; got None"):
        dg.flash_loop_diagram(6, 8, 2, None, 3, 2)


# ----------------------------------------------------------------------------------------------
# 7. the backward graph


def test_backward_graph_shows_each_stage_with_its_shape():
    T, S, Dk, Dv = 3, 5, 7, 2
    fig = build("backward_graph_diagram", T=T, S=S, Dk=Dk, Dv=Dv)
    texts = {
        t.splitlines()[0].split(" = ")[0].strip("$"): t.splitlines()[1:]
        for t in dg.figure_texts(fig)
        if t.count("\n") == 2
    }
    expected = {
        "Q": ("T, D_k", "(3, 7)"),
        "K": ("S, D_k", "(5, 7)"),
        "Z": ("T, S", "(3, 5)"),
        "A": ("T, S", "(3, 5)"),
        "V": ("S, D_v", "(5, 2)"),
        "O": ("T, D_v", "(3, 2)"),
        "dO": ("T, D_v", "(3, 2)"),
        "dV": ("S, D_v", "(5, 2)"),
        "dA": ("T, S", "(3, 5)"),
        "\\delta_i": ("T,", "(3,)"),
        "dZ": ("T, S", "(3, 5)"),
        "dQ": ("T, D_k", "(3, 7)"),
        "dK": ("S, D_k", "(5, 7)"),
    }
    assert {k: (v[0][2:-2], v[1]) for k, v in texts.items()} == expected


def test_backward_graph_puts_each_gradient_under_what_it_is_the_gradient_of():
    rects = dg.tagged_rects(build("backward_graph_diagram"))
    for x in ("O", "A", "Z", "K"):
        assert rects[f"d{x}"].y1 < rects[x].y0 and rects[f"d{x}"].cx == pytest.approx(rects[x].cx)
    assert rects["dV"].cx == pytest.approx(rects["V"].cx) and rects["dQ"].cx == pytest.approx(
        rects["Q"].cx
    )
    # the row term sits between the forward and the backward rows
    assert rects["dA"].y1 < rects["delta"].y0 and rects["delta"].y1 < rects["A"].y0


def test_backward_graph_links_follow_the_chain_rule():
    from matplotlib.patches import FancyArrowPatch

    fig = build("backward_graph_diagram")
    rects = dg.tagged_rects(fig)

    def touching(point):
        tol = 0.02  # inches: the drawn tip stops a line width short
        return {
            k
            for k, r in rects.items()
            if r.x0 - tol <= point[0] <= r.x1 + tol and r.y0 - tol <= point[1] <= r.y1 + tol
        }

    links = set()
    for arrow in fig.axes[0].patches:
        if isinstance(arrow, FancyArrowPatch):
            (a,), (b,) = (touching(end) for end in arrow_ends(arrow))
            links.add((a, b))
    assert links == {
        ("Q", "Z"),
        ("K", "Z"),
        ("Z", "A"),
        ("A", "O"),
        ("V", "O"),
        ("dO", "dV"),
        ("dO", "dA"),
        ("dA", "dZ"),
        ("dO", "delta"),
        ("delta", "dZ"),
        ("dZ", "dQ"),
        ("dZ", "dK"),
    }


def test_backward_graph_changes_with_the_sizes():
    a = dg.figure_texts(build("backward_graph_diagram", T=3, S=5, Dk=7, Dv=2))
    b = dg.figure_texts(build("backward_graph_diagram", T=3, S=6, Dk=7, Dv=2))
    assert any("(3, 6)" in t for t in b) and not any("(3, 6)" in t for t in a)
    assert not any(
        "(" in t.splitlines()[-1][:2] and t.splitlines()[-1][1:2].isdigit()
        for t in dg.figure_texts(dg.backward_graph_diagram())
    )  # symbols only


def test_backward_graph_rejects_some_sizes_without_the_others():
    with pytest.raises(
        ValueError, match="give all four sizes T, S, Dk, Dv or none; got T, S without Dk, Dv"
    ):
        dg.backward_graph_diagram(T=3, S=5)


def test_backward_graph_rejects_a_size_that_is_not_an_integer():
    with pytest.raises(TypeError, match="Dv must be a positive integer; got '2'"):
        dg.backward_graph_diagram(T=3, S=5, Dk=7, Dv="2")


# ----------------------------------------------------------------------------------------------
# 8. the transformer block


def test_transformer_block_pre_norm_normalises_a_copy_before_each_sublayer():
    fig = build("transformer_block_diagram", norm="pre", T=5, E=16)
    rects = dg.tagged_rects(fig)
    stream_y = [t for t in fig.axes[0].lines if t.get_linewidth() == 3.0][0].get_ydata()[0]
    for n, sub in ((1, "attention"), (2, "mlp")):
        norm = rects[f"norm {n}"]
        assert norm.x1 < rects[sub].x0 and norm.y0 > stream_y  # on the branch, before it
    assert rects["attention"].x1 < rects["norm 2"].x0  # attention, then the MLP
    texts = dg.figure_texts(fig)
    assert texts.count("(5, 16)") == 2 and texts.count("$(T, E)$") == 2
    assert "causal multi-head\nattention" in texts and "MLP" in texts


def test_transformer_block_post_norm_normalises_the_stream_after_each_add():
    fig = build("transformer_block_diagram", norm="post")
    rects = dg.tagged_rects(fig)
    stream_y = [t for t in fig.axes[0].lines if t.get_linewidth() == 3.0][0].get_ydata()[0]
    adds = {
        p.get_label()[5:]: p.center[0]
        for p in fig.axes[0].patches
        if p.get_label().startswith("_add ")
    }
    for n, sub in ((1, "attention"), (2, "mlp")):
        norm = rects[f"norm {n}"]
        assert norm.y0 < stream_y < norm.y1  # on the stream itself
        assert adds[sub] < norm.x0  # after the add
    assert not [t for t in dg.figure_texts(fig) if t.startswith("(") and t[1:2].isdigit()]


def test_transformer_block_attention_only_has_one_sublayer():
    rects = dg.tagged_rects(build("transformer_block_diagram", attention_only=True))
    assert "attention" in rects and "mlp" not in rects and "norm 2" not in rects


def test_transformer_block_rejects_an_unknown_norm():
    with pytest.raises(ValueError, match="norm must be 'pre' or 'post'; got 'sandwich'"):
        dg.transformer_block_diagram(norm="sandwich")


def test_transformer_block_rejects_one_size_without_the_other():
    with pytest.raises(ValueError, match="give both sizes T and E or neither; got T=5, E=None"):
        dg.transformer_block_diagram(T=5)


def test_transformer_block_rejects_attention_only_that_is_not_a_bool():
    with pytest.raises(TypeError, match="attention_only must be a bool; got 1"):
        dg.transformer_block_diagram(attention_only=1)
