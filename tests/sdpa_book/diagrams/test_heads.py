"""sdpa_book.diagrams.heads: multi-head attention, and query heads grouped over key/value heads."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from diagram_checks import assert_reads_on_a_phone, build, shapes  # noqa: E402

from sdpa_book import diagrams as dg  # noqa: E402


def test_multihead_labels_every_shape_it_was_given():
    T, E, H, Dk, Dv = 5, 11, 3, 2, 7
    fig = build("multihead_diagram", T, E, H, Dk, Dv)
    # X (T, E); Q, K (T, H Dk), V (T, H Dv); a head's out (T, Dv); the concatenation (T, H Dv);
    # out (T, E)
    assert shapes(fig) == ["(5, 11)", "(5, 6)", "(5, 6)", "(5, 21)", "(5, 7)", "(5, 21)", "(5, 11)"]
    texts = dg.figure_texts(fig)
    # the projections W_Q, W_K (E, H Dk), W_V (E, H Dv) and W_O (H Dv, E), letters and numbers
    assert [t for t in texts if t.startswith("$W")] == [
        "$W_Q$ $(E, HD_k)$\n(11, 6)",
        "$W_K$ $(E, HD_k)$\n(11, 6)",
        "$W_V$ $(E, HD_v)$\n(11, 21)",
        "$W_O$ $(HD_v, E)$\n(21, 11)",
    ]
    assert ["$Q$", "$(T, HD_k)$", "(5, 6)"] == texts[texts.index("$Q$") :][:3]
    assert ["each head", "$(T, D_v)$", "(5, 7)"] == texts[texts.index("each head") :][:3]
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


def test_multihead_is_one_column_from_the_input_down_to_the_output():
    rects = dg.tagged_rects(build("multihead_diagram", 5, 11, 3, 2, 7))
    # X; the three projections side by side; Q, K, V under them; the heads; the
    # concatenation; W_O; out: each level wholly under the one before
    levels = [["X"], ["W_Q", "W_K", "W_V"], ["Q", "K", "V"], ["head 0", "head 1", "head 2"]]
    levels += [["concat"], ["W_O"], ["out"]]
    for upper, lower in zip(levels, levels[1:]):
        assert min(rects[a].y0 for a in upper) > max(rects[b].y1 for b in lower), (upper, lower)
    for row in levels[1:4]:  # side by side, left to right
        assert all(rects[a].x1 < rects[b].x0 for a, b in zip(row, row[1:])), row
    for W, out in (("W_Q", "Q"), ("W_K", "K"), ("W_V", "V"), ("W_O", "out")):
        assert rects[W].cx == pytest.approx(rects[out].cx)  # each projection above its result


def test_multihead_feeds_head_h_from_block_h_of_q_k_and_v():
    T, E, H, Dk, Dv = 5, 11, 3, 2, 7
    fig = build("multihead_diagram", T, E, H, Dk, Dv)
    rects = dg.tagged_rects(fig)
    links = [ln.get_xydata() for ln in fig.axes[0].lines if len(ln.get_xydata()) == 2]
    for h in range(H):
        head = rects[f"head {h}"]
        for tag in ("Q", "K", "V"):
            grid = rects[tag]
            # the middle of block h: columns h D to (h + 1) D - 1 of the H D, D = Dk or Dv
            x = grid.x0 + (h + 0.5) * grid.width / H
            (link,) = [ln for ln in links if np.allclose(ln[0], (x, grid.y0))]
            assert head.x0 <= link[1][0] <= head.x1
            assert link[1][1] == pytest.approx(head.y1, abs=0.02)


def test_multihead_draws_the_first_two_and_the_last_of_many_heads():
    fig = build("multihead_diagram", 4, 32, 8, 4, 4)
    texts = dg.figure_texts(fig)
    # numbered from 0, as in the code: heads 0, 1 and H - 1 = 7
    assert [t for t in texts if t.startswith("head ")] == ["head 0", "head 1", "head 7"]
    assert "\N{HORIZONTAL ELLIPSIS}" in texts


@pytest.mark.parametrize("sizes", [(5, 12, 3, 4, 4), (5, 11, 3, 2, 7), (2, 512, 8, 64, 64)])
def test_multihead_reads_on_a_phone(sizes):
    assert_reads_on_a_phone(build("multihead_diagram", *sizes))


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
    assert "cached: 3 key and 3 value heads" in dg.figure_texts(fig)


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


def test_grouped_heads_stack_the_panels_one_under_the_other():
    kv = (8, 2, 1)
    rects = dg.tagged_rects(build("grouped_heads_diagram", 8, kv))
    for p in range(len(kv)):
        queries = [rects[f"{p}: query {h}"] for h in range(8)]
        values = [rects[t] for t in rects if t.startswith(f"{p}: value ")]
        # the query heads over the key/value heads, the panel under the one before
        assert min(q.y0 for q in queries) > max(v.y1 for v in values)
        if p:
            above = [r for t, r in rects.items() if t.startswith(f"{p - 1}: ")]
            assert max(q.y1 for q in queries) < min(r.y0 for r in above)
        # every panel spans the same width: query head 0 and Hq - 1 in the same places
        assert queries[0].x0 == pytest.approx(rects["0: query 0"].x0)
        assert queries[-1].x1 == pytest.approx(rects["0: query 7"].x1)


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


@pytest.mark.parametrize("kv", [(8, 2, 1), 2, (6, 3, 2, 1)])
def test_grouped_heads_reads_on_a_phone(kv):
    Hq = 6 if kv == (6, 3, 2, 1) else 8
    assert_reads_on_a_phone(build("grouped_heads_diagram", Hq, kv))


def test_grouped_heads_leaves_the_numbers_out_of_narrow_boxes():
    fig = build("grouped_heads_diagram", 32, (32, 8, 1))
    assert not [t for t in dg.figure_texts(fig) if t.isdigit()]  # 32 heads: boxes too narrow
    assert_reads_on_a_phone(fig)


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
