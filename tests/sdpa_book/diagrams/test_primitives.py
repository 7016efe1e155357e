"""sdpa_book.diagrams.primitives: measuring text, and packing rows and columns from sizes and
gaps (the places the diagrams compute rather than type)."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from sdpa_book import diagrams as dg  # noqa: E402
from sdpa_book.diagrams.primitives import (  # noqa: E402
    _clear_gap,
    _fmt_value,
    _has_scripts,
    _integer_valued,
    _pack,
    _packed_length,
    _phone_pt,
)


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


def test_has_scripts_finds_sub_and_superscripts_in_maths_only():
    assert _has_scripts("$W_Q$") and _has_scripts("scores $QK^\\top$")
    assert not _has_scripts("$j \\leq i$") and not _has_scripts("padding_mask")  # not maths
    assert not _has_scripts("$5") and not _has_scripts("")


def test_phone_pt_raises_maths_with_scripts_to_eleven_points():
    # 11 pt scripts are drawn at 0.7 * 11 = 7.7 pt, 10.3 CSS px at full size
    assert _phone_pt("softmax") == 10 and _phone_pt("$(T, D_k)$") == 11
    assert _phone_pt("$W_Q$", 12) == 12 and _phone_pt("$Z$", 9) == 9


def test_fmt_value_writes_the_decimals_asked_for_with_a_true_minus():
    minus = "\N{MINUS SIGN}"
    assert [_fmt_value(v) for v in (0.254, -1.5, 12.0)] == ["0.25", f"{minus}1.50", "12.0"]
    assert [_fmt_value(v, 0) for v in (2.0, -1.0, -0.2)] == ["2", f"{minus}1", "0"]
    assert _fmt_value(3.14159, 3) == "3.142"


def test_integer_valued_needs_every_entry_whole():
    assert _integer_valued(np.array([0.0, 2.0, -3.0]), np.eye(2))
    assert not _integer_valued(np.eye(2), np.array([1.0, 0.5]))
