"""sdpa_book.diagrams.primitives: measuring text, and packing rows and columns from sizes and
gaps (the places the diagrams compute rather than type)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from sdpa_book import diagrams as dg  # noqa: E402
from sdpa_book.diagrams.primitives import _clear_gap, _pack, _packed_length  # noqa: E402


def test_text_size_grows_with_the_text_and_the_lines():
    w1, h1 = dg.text_size("(4, 3)")
    w2, _ = dg.text_size("(1024, 64)")
    w3, h3 = dg.text_size("(4, 3)\n(4, 3)")
    assert 0 < w1 < w2 and w3 == pytest.approx(w1) and h3 == pytest.approx(2 * h1)
    assert dg.text_size("(4, 3)", 18)[0] == pytest.approx(2 * w1, rel=0.05)


def test_pack_lays_a_row_end_to_end_with_one_gap():
    # boxes 1.0, 2.0 and 0.5 wide, 0.25 apart, from x = 0.5: 0.5; 0.5 + 1 + 0.25; 1.75 + 2 + 0.25
    np.testing.assert_allclose(_pack([1.0, 2.0, 0.5], 0.25, start=0.5), [0.5, 1.75, 4.0], atol=0)


def test_pack_takes_a_gap_after_each_item_but_the_last():
    # sizes 0.3, 0.5, 0.7, 1.1 with gaps 0.2, 0.0, 0.4 from 0: 0; 0.5; 1.0; 2.1
    starts = _pack([0.3, 0.5, 0.7, 1.1], [0.2, 0.0, 0.4])
    np.testing.assert_allclose(starts, [0.0, 0.5, 1.0, 2.1], rtol=0, atol=1e-12)


def test_pack_down_gives_the_top_edges_of_a_column():
    # levels 1.0, 0.5 and 2.0 high hanging from y = 5, 0.25 apart: tops 5; 3.75; 3.0
    np.testing.assert_allclose(
        _pack([1.0, 0.5, 2.0], 0.25, start=5.0, down=True), [5.0, 3.75, 3.0], atol=0
    )


def test_pack_of_one_item_or_none():
    assert _pack([0.7], 0.3, start=1.1) == [1.1]
    assert _pack([], 0.3, start=1.1) == []
    assert _packed_length([], 0.3) == 0.0


def test_packed_length_covers_the_sizes_and_the_gaps_between_them():
    # 0.3 + 0.5 + 0.7 + 1.1 of sizes, 3 gaps of 0.2
    assert _packed_length([0.3, 0.5, 0.7, 1.1], 0.2) == pytest.approx(3.2, abs=1e-12)
    assert _packed_length([0.3, 0.5, 0.7], [0.2, 0.1]) == pytest.approx(1.8, abs=1e-12)


@pytest.mark.parametrize("down", [False, True])
def test_the_last_item_of_a_pack_ends_at_its_length(down):
    sizes, gaps, start = [0.3, 0.5, 0.7, 1.1], [0.2, 0.13, 0.05], 0.08
    last = _pack(sizes, gaps, start=start, down=down)[-1]
    end = last - sizes[-1] if down else last + sizes[-1]
    length = _packed_length(sizes, gaps)
    np.testing.assert_allclose(end, start - length if down else start + length, atol=1e-12)


def test_pack_rejects_gaps_that_do_not_fit_between_the_sizes():
    with pytest.raises(
        ValueError,
        match=r"gaps must hold one gap between each two of the 3 sizes, 2 in all; got 3",
    ):
        _pack([0.3, 0.5, 0.7], [0.1, 0.1, 0.1])


def test_clear_gap_keeps_labels_apart_or_the_least_gap():
    # grids 1.0 and 0.5 wide under labels 2.0 and 1.0 wide, to be 0.1 apart: the label
    # centres are (2.0 + 1.0) / 2 + 0.1 = 1.6 apart, the grid centres (1.0 + 0.5) / 2 + gap
    assert _clear_gap(1.0, 0.5, 2.0, 1.0, 0.1, 0.07) == pytest.approx(0.85, abs=1e-12)
    # labels narrower than their grids: the least gap
    assert _clear_gap(1.0, 0.5, 0.25, 0.25, 0.1, 0.07) == 0.07
