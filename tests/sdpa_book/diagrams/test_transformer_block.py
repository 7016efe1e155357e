"""sdpa_book.diagrams.transformer_block: sublayers reading from and adding to the residual
stream."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from diagram_checks import assert_reads_on_a_phone, build  # noqa: E402

from sdpa_book import diagrams as dg  # noqa: E402


def _stream(fig):
    """The residual stream: the thick line's x and its top and bottom."""
    (line,) = [t for t in fig.axes[0].lines if t.get_linewidth() == 3.0]
    xs, ys = line.get_xdata(), line.get_ydata()
    assert xs[0] == xs[1]  # vertical
    return xs[0], max(ys), min(ys)


def _adds(fig) -> dict[str, tuple[float, float]]:
    """``{sublayer: centre of its ⊕}``."""
    return {
        p.get_label()[5:]: p.center
        for p in fig.axes[0].patches
        if (p.get_label() or "").startswith("_add ")
    }


def test_transformer_block_pre_norm_normalises_a_copy_before_each_sublayer():
    fig = build("transformer_block_diagram", norm="pre", T=5, E=16)
    rects = dg.tagged_rects(fig)
    x_s, top, bottom = _stream(fig)
    adds = _adds(fig)
    for n, sub in ((1, "attention"), (2, "mlp")):
        norm = rects[f"norm {n}"]
        # on the branch right of the stream, before the sublayer, on its row
        assert x_s < norm.x0 and norm.x1 < rects[sub].x0
        assert norm.cy == pytest.approx(rects[sub].cy)
        # the sublayer's output comes back to the stream, under the branch
        assert adds[sub][0] == pytest.approx(x_s) and bottom < adds[sub][1] < rects[sub].y0
    assert adds["attention"][1] > rects["mlp"].y1  # attention, then the MLP, down the stream
    texts = dg.figure_texts(fig)
    assert texts.count("(5, 16)") == 2 and texts.count("$(T, E)$") == 2
    assert "causal multi-head\nattention" in texts and "MLP" in texts


def test_transformer_block_post_norm_normalises_the_stream_after_each_add():
    fig = build("transformer_block_diagram", norm="post")
    rects = dg.tagged_rects(fig)
    x_s, _, _ = _stream(fig)
    adds = _adds(fig)
    for n, sub in ((1, "attention"), (2, "mlp")):
        norm = rects[f"norm {n}"]
        assert norm.x0 < x_s < norm.x1  # on the stream itself
        assert norm.y1 < adds[sub][1]  # after (under) the add
        assert rects[sub].x0 > x_s  # the sublayer reads the stream directly
    assert adds["mlp"][1] < rects["norm 1"].y0
    assert not [t for t in dg.figure_texts(fig) if t.startswith("(") and t[1:2].isdigit()]


def test_transformer_block_writes_the_ends_beside_the_stream():
    fig = build("transformer_block_diagram", norm="pre", T=5, E=16)
    x_s, top, bottom = _stream(fig)
    where = {}
    for t in fig.axes[0].texts:
        where.setdefault(t.get_text(), []).append(t.get_position())
    (start,), (end,) = where["input $X$"], where["out"]
    assert start[0] > x_s and end[0] > x_s  # right of the stream
    assert start[1] > max(y for _, y in _adds(fig).values())  # by its start, before the adds
    assert end[1] < min(y for _, y in _adds(fig).values())  # by its end, after them


@pytest.mark.parametrize(
    "kwargs",
    [
        {"norm": "pre", "T": 8, "E": 16},
        {"norm": "post", "T": 8, "E": 16},
        {"norm": "post", "T": 1024, "E": 4096},
        {"attention_only": True},
    ],
)
def test_transformer_block_reads_on_a_phone(kwargs):
    assert_reads_on_a_phone(build("transformer_block_diagram", **kwargs))


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
