"""sdpa_book.diagrams.latent_attention: multi-head latent attention's cache and what a head
recomputes from it."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from diagram_checks import arrow_ends, assert_legible, assert_reads_on_a_phone, build  # noqa: E402

from sdpa_book import diagrams as dg  # noqa: E402

SIZES = dict(E=48, Dc=16, Dr=8, Dn=12, Dv=12)


def _edges(fig) -> dict[str, str]:
    """``{tag: line style}`` of the tagged boxes."""
    return {
        p.get_label()[5:]: p.get_linestyle()
        for p in fig.axes[0].patches
        if (p.get_label() or "").startswith("_tag ")
    }


def test_the_cache_holds_the_latent_and_the_rotated_key_only():
    fig = build("latent_attention_diagram", **SIZES)
    rects = dg.tagged_rects(fig)
    styles = _edges(fig)
    # stored: solid edges; recomputed by each head: dashed
    assert {tag for tag, style in styles.items() if style == "-"} == {"x", "latent", "rope key"}
    assert {tag for tag, style in styles.items() if style == "--"} == {"key", "value"}
    # the outline around the cache encloses the latent and the rotated key, not the rest
    (outline,) = [p for p in fig.axes[0].patches if p.get_linewidth() == pytest.approx(1.6)
                  and not (p.get_label() or "").startswith("_tag ")]  # fmt: skip
    box = outline.get_extents().transformed(fig.axes[0].transData.inverted())
    for tag in ("latent", "rope key"):
        r = rects[tag]
        assert box.x0 < r.x0 and r.x1 < box.x1 and box.y0 < r.y0 and r.y1 < box.y1, tag
    for tag in ("x", "key", "value"):
        r = rects[tag]
        assert r.y0 > box.y1 or r.y1 < box.y0, tag  # above or below it


def test_the_flow_runs_from_the_row_down_to_one_head():
    fig = build("latent_attention_diagram", **SIZES)
    rects = dg.tagged_rects(fig)
    assert rects["x"].y0 > rects["latent"].y1 and rects["x"].y0 > rects["rope key"].y1
    assert rects["latent"].y0 > rects["key"].y1 and rects["latent"].y0 > rects["value"].y1
    assert rects["key"].x1 <= rects["latent"].cx <= rects["value"].x0  # under the latent
    assert rects["rope key"].x0 > rects["value"].x1  # beside the latent, not under it
    # four arrows: x to the latent and to the rotated key, the latent to the key and the value
    tips = sorted(
        tuple(arrow_ends(a)[1])
        for a in fig.axes[0].patches
        if type(a).__name__ == "FancyArrowPatch"
    )
    cache_top = max(rects["latent"].y1, rects["rope key"].y1) + 0.06  # the outline's top
    want = sorted(
        [(rects["latent"].cx, cache_top), (rects["rope key"].cx, cache_top)]
        + [(rects[t].cx, rects[t].y1) for t in ("key", "value")]
    )
    np.testing.assert_allclose(tips, want, atol=0.02)
    texts = dg.figure_texts(fig)
    for matrix in ("W_{DKV}", "W_{KR}", "W_{UK,h}", "W_{UV,h}"):
        assert any(matrix in t for t in texts), matrix
    assert "shared by\nall heads" in texts


def test_the_labels_are_the_page_s_sizes():
    texts = dg.figure_texts(
        build("latent_attention_diagram", E=7168, Dc=512, Dr=64, Dn=128, Dv=128)
    )
    assert [t for t in texts if t.startswith("(") and t[1].isdigit()] == [
        "(7168,)", "(512,)", "(64,)", "(128,)", "(128,)",
    ]  # fmt: skip
    no_numbers = dg.figure_texts(build("latent_attention_diagram"))
    assert not [t for t in no_numbers if t.startswith("(") and t[1].isdigit()]
    assert "$(D_c,)$" in no_numbers and "$(D_r,)$" in no_numbers


@pytest.mark.parametrize("sizes", [SIZES, dict(E=7168, Dc=512, Dr=64, Dn=128, Dv=128), {}])
def test_the_latent_attention_diagram_reads_on_a_phone(sizes):
    fig = build("latent_attention_diagram", **sizes)
    assert_legible(fig)
    assert_reads_on_a_phone(fig)


def test_the_latent_attention_diagram_wants_all_sizes_or_none():
    with pytest.raises(ValueError, match="give all five sizes E, Dc, Dr, Dn, Dv or none; got E=4"):
        dg.latent_attention_diagram(E=4)


@pytest.mark.parametrize(("value", "error"), [(0, ValueError), (2.5, TypeError)])
def test_the_latent_attention_diagram_rejects_a_bad_size(value, error):
    with pytest.raises(error, match="Dc must be a positive integer"):
        dg.latent_attention_diagram(**{**SIZES, "Dc": value})
