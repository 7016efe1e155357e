"""sdpa_book.diagrams.heads: multi-head attention, and query heads grouped over key/value heads."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from diagram_checks import build, shapes  # noqa: E402

from sdpa_book import diagrams as dg  # noqa: E402


def test_multihead_labels_every_shape_it_was_given():
    T, E, H, Dk, Dv = 5, 11, 3, 2, 7
    fig = build("multihead_diagram", T, E, H, Dk, Dv)
    # X (T, E); W_Q, W_K (E, H Dk), W_V (E, H Dv); Q, K (T, H Dk), V (T, H Dv); a head's out
    # (T, Dv); the concatenation (T, H Dv); W_O (H Dv, E); out (T, E)
    assert shapes(fig) == ["(5, 11)", "(5, 6)", "(5, 6)", "(5, 21)", "(5, 7)", "(5, 21)", "(5, 11)"]
    texts = dg.figure_texts(fig)
    assert "$W_Q$\n$(E, HD_k)$\n(11, 6)" in texts and "$W_V$\n$(E, HD_v)$\n(11, 21)" in texts
    assert "$W_O$\n$(HD_v, E)$\n(21, 11)" in texts
    assert [t for t in texts if t.startswith("head ")] == ["head 0", "head 1", "head 2"]


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
    # numbered from 0, as in the code: heads 0, 1 and H - 1 = 7
    assert [t for t in texts if t.startswith("head ")] == ["head 0", "head 1", "head 7"]
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


def _label_in(fig, rect) -> str:
    """The one text drawn inside ``rect``."""
    inside = [
        t.get_text()
        for t in fig.axes[0].texts
        if rect.x0 < t.get_position()[0] < rect.x1 and rect.y0 < t.get_position()[1] < rect.y1
    ]
    assert len(inside) == 1, inside
    return inside[0]


def test_grouped_heads_number_from_0_and_label_key_head_h_floordiv_G():
    Hq, kv = 8, (8, 2, 1)
    fig = build("grouped_heads_diagram", Hq, kv)
    rects = dg.tagged_rects(fig)
    ends = [line.get_xydata() for line in fig.axes[0].lines if len(line.get_xydata()) == 2]
    # hand-computed: with G = 4, query heads 0-3 share key head 0 and 4-7 key head 1
    expected = {8: "01234567", 2: "00001111", 1: "00000000"}
    for p, Hkv in enumerate(kv):
        keys = [rects[f"{p}: key {g}"] for g in range(Hkv)]
        for h in range(Hq):
            q = rects[f"{p}: query {h}"]
            assert _label_in(fig, q) == str(h)
            (link,) = [e for e in ends if np.allclose(e[0], q.bottom)]
            (key,) = [r for r in keys if r.x0 <= link[1][0] <= r.x1]
            assert _label_in(fig, key) == expected[Hkv][h]


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
