"""sdpa_book.diagrams.token_qkv: one token's embedding becoming its query, key and value."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from diagram_checks import assert_legible, shapes  # noqa: E402

from sdpa_book import diagrams as dg  # noqa: E402


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
    rects = dg.tagged_rects(fig)
    assert rects["W_Q"].width / rects["W_Q"].height == pytest.approx(3 / 5)  # (E, Dk) = (5, 3)
    assert rects["q"].width / rects["v"].width == pytest.approx(3 / 2)  # Dk / Dv
    # random entries need two decimals, wider than a cell: none is written
    assert not [t for t in texts if t[:1].isdigit() or t[:1] == "\N{MINUS SIGN}"]
    assert_legible(fig)


def test_token_qkv_writes_whole_entries_in_every_grid():
    # A hand-made token: x = (1, 0, 2, 0); q = x W_Q is row 0 of W_Q plus twice row 2.
    x = np.array([1.0, 0.0, 2.0, 0.0])
    W_q = np.array([[1.0, 0, 1], [0, 3, 0], [2, 0, 1], [0, 0, 5]])
    W_k = np.eye(4, 3)  # k = x[:3] = (1, 0, 2)
    W_v = np.array([[0.0, 1], [1, 0], [1, 1], [4, 4]])  # v = (0, 1) + 2 (1, 1) = (2, 3)
    texts = dg.figure_texts(dg.token_qkv_diagram(x, W_q, W_k, W_v, token="it"))
    # In drawing order: the token, x, then W_Q, q, W_K, k, W_V, v, each after its grid's entries
    # and before its labels; entries row by row.
    entries = [t for t in texts if t.isdigit()]
    assert entries == [
        *"1020",
        *"101030201005",
        *"503",  # q = (1 + 2 * 2, 0, 1 + 2 * 1)
        *"100010001000",
        *"102",
        *"01101144",
        *"23",
    ]


def test_token_qkv_stacks_the_branches_under_the_embedding(token_arrays):
    rects = dg.tagged_rects(dg.token_qkv_diagram(*token_arrays))
    # x on top; the three projections side by side below it, left to right, each above its output
    assert rects["x"].y0 > max(rects[w].y1 for w in ("W_Q", "W_K", "W_V"))
    assert rects["W_Q"].x1 < rects["W_K"].x0 and rects["W_K"].x1 < rects["W_V"].x0
    for W, out in (("W_Q", "q"), ("W_K", "k"), ("W_V", "v")):
        assert rects[out].y1 < rects[W].y0
        # an output's entries line up under its projection's columns
        assert (rects[out].x0, rects[out].x1) == pytest.approx((rects[W].x0, rects[W].x1))


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
    E = 40  # whole numbers, which 0.2 in cells would show, in cells of a twentieth of an inch
    fig = dg.token_qkv_diagram(
        rng.integers(0, 3, E),
        rng.integers(0, 3, (E, 8)),
        rng.integers(0, 3, (E, 8)),
        rng.integers(0, 3, (E, 8)),
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
