"""sdpa_book.diagrams.pipeline: the whole computation, Q, K -> scores -> ... -> out, with shapes."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from diagram_checks import build, masked_corners, shapes  # noqa: E402

from sdpa_book import diagrams as dg  # noqa: E402


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
        "causal mask",
        "softmax",
        "$Z$",
    ):
        assert label in texts, label


def test_pipeline_stacks_two_hand_multiplications():
    rects = dg.tagged_rects(build("attention_pipeline_diagram", 3, 5, 7, 2))
    Q, Kt, Z, A, V, O = (rects[t] for t in ("Q", "K^T", "scores", "weights", "V", "O"))
    # Q K^T: K^T stands on the scores, Q on their left, row for row
    assert Kt.y0 > Z.y1 and (Kt.x0, Kt.x1) == pytest.approx((Z.x0, Z.x1))
    assert Q.x1 < Z.x0 and (Q.y0, Q.y1) == pytest.approx((Z.y0, Z.y1))
    # A V: V stands on O, A on its left, row for row; A is under the scores
    assert V.y0 > O.y1 and (V.x0, V.x1) == pytest.approx((O.x0, O.x1))
    assert A.x1 < O.x0 and (A.y0, A.y1) == pytest.approx((O.y0, O.y1))
    assert A.y1 < Z.y0 and A.cx == pytest.approx(Z.cx)
    # the steps, in order from the scores down to the weights, on the scores' centre line
    chain = [Z, *(rects[f"step {k}"] for k in range(3)), A]
    assert all(upper.y0 > lower.y1 for upper, lower in zip(chain, chain[1:]))
    assert [r.cx for r in chain] == pytest.approx([Z.cx] * 5)


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
    assert grey_cells(fig) == 0 and "causal mask" not in dg.figure_texts(fig)


def test_pipeline_changes_when_a_size_changes():
    a = build("attention_pipeline_diagram", 3, 5, 7, 2)
    b = build("attention_pipeline_diagram", 3, 9, 7, 2)
    assert "(3, 9)" in shapes(b) and "(3, 9)" not in shapes(a)
    ratio = lambda fig: dg.tagged_rects(fig)["scores"].width / dg.tagged_rects(fig)["Q"].width  # noqa: E731
    assert ratio(a) == pytest.approx(5 / 7) and ratio(b) == pytest.approx(9 / 7)


def test_pipeline_compact_is_smaller_and_still_labelled():
    full = build("attention_pipeline_diagram", 3, 5, 7, 2)
    small = build("attention_pipeline_diagram", 3, 5, 7, 2, compact=True)
    assert small.get_size_inches()[1] < 0.85 * full.get_size_inches()[1]
    assert small.get_size_inches()[0] <= full.get_size_inches()[0]
    assert shapes(small) == shapes(full)
    texts = dg.figure_texts(small)
    # symbols without words; the steps in one box, so no arrow carries Z
    assert "$Q$" in texts and "queries $Q$" not in texts and "$Z$" not in texts
    assert "$\\div\\sqrt{D_k}$\ncausal mask\nsoftmax" in texts


def test_pipeline_rejects_a_size_that_is_not_an_integer():
    with pytest.raises(TypeError, match="Dk must be a positive integer; got 2.0"):
        dg.attention_pipeline_diagram(4, 6, 2.0, 2)


def test_pipeline_rejects_a_size_that_is_not_positive():
    with pytest.raises(ValueError, match="S must be a positive integer; got 0"):
        dg.attention_pipeline_diagram(4, 0, 2, 2)


def test_pipeline_rejects_a_mask_flag_that_is_not_a_bool():
    with pytest.raises(TypeError, match="mask must be a bool; got 'causal'"):
        dg.attention_pipeline_diagram(4, 6, 2, 2, mask="causal")
