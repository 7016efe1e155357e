"""sdpa_book.diagrams.backward_graph: the forward's stages and the gradients flowing back."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from diagram_checks import arrow_ends, assert_legible, assert_reads_on_a_phone, build  # noqa: E402

from sdpa_book import diagrams as dg  # noqa: E402


def test_backward_graph_shows_each_stage_with_its_shape():
    T, S, Dk, Dv = 3, 5, 7, 2
    fig = build("backward_graph_diagram", T=T, S=S, Dk=Dk, Dv=Dv)
    # each box: the formula, then the shape in letters = in numbers
    texts = {
        t.splitlines()[0].split(" = ")[0].strip("$"): t.splitlines()[1]
        for t in dg.figure_texts(fig)
        if t.count("\n") == 1
    }
    expected = {
        "Q": "$(T, D_k)$ = (3, 7)",
        "K": "$(S, D_k)$ = (5, 7)",
        "Z": "$(T, S)$ = (3, 5)",
        "A": "$(T, S)$ = (3, 5)",
        "V": "$(S, D_v)$ = (5, 2)",
        "O": "$(T, D_v)$ = (3, 2)",
        "dO": "$(T, D_v)$ = (3, 2)",
        "dV": "$(S, D_v)$ = (5, 2)",
        "dA": "$(T, S)$ = (3, 5)",
        "\\delta_i": "$(T,)$ = (3,)",
        "dZ": "$(T, S)$ = (3, 5)",
        "dQ": "$(T, D_k)$ = (3, 7)",
        "dK": "$(S, D_k)$ = (5, 7)",
    }
    assert texts == expected


def test_backward_graph_puts_each_gradient_beside_what_it_is_the_gradient_of():
    rects = dg.tagged_rects(build("backward_graph_diagram"))
    for x in ("Q", "K", "Z", "A", "O", "V"):  # same row, the gradient on the right
        assert rects[f"d{x}"].x0 > rects[x].x1 and rects[f"d{x}"].cy == pytest.approx(rects[x].cy)
    # the forward from the top down (V under O, feeding it from below), one column
    column = [rects[x] for x in ("Q", "K", "Z", "A", "O", "V")]
    assert all(a.y0 > b.y1 for a, b in zip(column, column[1:]))
    assert len({round(r.cx, 9) for r in column}) == 1
    # the row term sits between dZ and dA, in the backward's column
    assert rects["dA"].y1 < rects["delta"].y0 and rects["delta"].y1 < rects["dZ"].y0
    assert rects["delta"].cx == pytest.approx(rects["dZ"].cx)


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


def test_backward_graph_links_pass_no_other_box():
    from matplotlib.patches import FancyArrowPatch

    fig = build("backward_graph_diagram", T=3, S=5, Dk=7, Dv=2)
    rects = dg.tagged_rects(fig)
    for arrow in fig.axes[0].patches:
        if not isinstance(arrow, FancyArrowPatch):
            continue
        points = arrow.get_path().interpolated(50).vertices  # in inches, the head's too
        ends = [min(rects, key=lambda k: _distance(rects[k], p)) for p in (points[0], points[-1])]
        for k, r in rects.items():
            inside = [p for p in points[3:-3] if r.x0 < p[0] < r.x1 and r.y0 < p[1] < r.y1]
            assert k in ends or not inside, (ends, k)


def _distance(r, p) -> float:
    dx = max(r.x0 - p[0], 0.0, p[0] - r.x1)
    dy = max(r.y0 - p[1], 0.0, p[1] - r.y1)
    return (dx * dx + dy * dy) ** 0.5


@pytest.mark.parametrize("sizes", [{"T": 3, "S": 5, "Dk": 4, "Dv": 2}, {}])
def test_backward_graph_reads_on_a_phone(sizes):
    assert_reads_on_a_phone(build("backward_graph_diagram", **sizes))


@pytest.mark.parametrize(("T", "S"), [(1024, 4096), (99_999, 99_999)])
def test_backward_graph_puts_long_shapes_on_a_line_of_their_own(T, S):
    fig = dg.backward_graph_diagram(T=T, S=S, Dk=128, Dv=128)
    assert f"$Z = QK^\\top/\\sqrt{{D_k}}$\n$(T, S)$\n({T}, {S})" in dg.figure_texts(fig)
    assert_reads_on_a_phone(fig)
    assert_legible(fig)  # the two columns apart, however long the shapes


def test_backward_graph_changes_with_the_sizes():
    a = dg.figure_texts(build("backward_graph_diagram", T=3, S=5, Dk=7, Dv=2))
    b = dg.figure_texts(build("backward_graph_diagram", T=3, S=6, Dk=7, Dv=2))
    assert any("(3, 6)" in t for t in b) and not any("(3, 6)" in t for t in a)
    assert not any(
        any(ch.isdigit() for ch in t) for t in dg.figure_texts(dg.backward_graph_diagram())
    )  # symbols only


def test_backward_graph_rejects_some_sizes_without_the_others():
    with pytest.raises(
        ValueError, match="give all four sizes T, S, Dk, Dv or none; got T, S without Dk, Dv"
    ):
        dg.backward_graph_diagram(T=3, S=5)


def test_backward_graph_rejects_a_size_too_long_to_draw():
    with pytest.raises(
        ValueError, match="S must be at most 99999 to be drawn legibly; got S=100000"
    ):
        dg.backward_graph_diagram(T=3, S=100_000, Dk=7, Dv=2)


def test_backward_graph_rejects_a_size_that_is_not_an_integer():
    with pytest.raises(TypeError, match="Dv must be a positive integer; got '2'"):
        dg.backward_graph_diagram(T=3, S=5, Dk=7, Dv="2")
