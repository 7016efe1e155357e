"""sdpa_book.diagrams.transformer_block: sublayers reading from and adding to the residual
stream."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from diagram_checks import build  # noqa: E402

from sdpa_book import diagrams as dg  # noqa: E402


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
