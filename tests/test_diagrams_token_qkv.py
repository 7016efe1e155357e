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
