"""sdpa_book.diagrams.backward_graph: the forward's stages and the gradients flowing back."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from diagram_checks import arrow_ends, build  # noqa: E402

from sdpa_book import diagrams as dg  # noqa: E402
from sdpa_book.diagrams.primitives import MARGIN  # noqa: E402
from sdpa_book.figures import FULL_WIDTH  # noqa: E402


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


def test_backward_graph_columns_fill_the_width_evenly_spaced():
    rects = dg.tagged_rects(build("backward_graph_diagram", T=3, S=5, Dk=7, Dv=2))
    columns = {}
    for rect in rects.values():  # the boxes of a column share its centre
        columns.setdefault(round(rect.cx, 9), []).append(rect)
    spans = sorted((min(r.x0 for r in col), max(r.x1 for r in col)) for col in columns.values())
    assert len(spans) == 4
    gaps = [b[0] - a[1] for a, b in zip(spans, spans[1:])]
    np.testing.assert_allclose(gaps, [gaps[0]] * 3, rtol=0, atol=1e-9)
    np.testing.assert_allclose(
        [spans[0][0], spans[-1][1]], [MARGIN, FULL_WIDTH - MARGIN], rtol=0, atol=1e-9
    )
