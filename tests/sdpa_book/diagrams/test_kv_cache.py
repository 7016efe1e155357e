"""sdpa_book.diagrams.kv_cache: the prefill, then decoding against a growing cache."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from diagram_checks import (  # noqa: E402
    assert_reads_on_a_phone,
    build,
    loop_mask,
    masked_corners,
    read_grey_cells,
)

from sdpa_book import diagrams as dg  # noqa: E402


def test_kv_cache_rows_grow_by_one_key_per_step():
    P, N = 5, 3
    fig = build("kv_cache_diagram", P, N)
    rects = dg.tagged_rects(fig)
    cell = rects["prefill"].width / P
    assert rects["prefill"].height == pytest.approx(P * cell)  # P queries x P keys
    for k in range(1, N + 1):
        assert rects[f"step {k}"].width == pytest.approx((P + k) * cell)  # 1 query x P + k keys
        assert rects[f"step {k}"].height == pytest.approx(cell)
        assert rects[f"step {k}"].x0 == pytest.approx(rects["prefill"].x0)  # key 0 aligned
        above = rects[f"step {k - 1}"] if k > 1 else rects["prefill"]
        assert rects[f"step {k}"].y1 < above.y0  # one row per query, down the page


def test_kv_cache_prefill_is_causal_and_each_step_sees_every_cached_key():
    P, N = 4, 2
    fig = build("kv_cache_diagram", P, N)
    # only the prefill masks anything (decoding rows have no grey cells): key j > i is in the
    # future of prompt query i
    greys = masked_corners(fig)
    assert list(greys) == ["prefill"]
    prefill = read_grey_cells(dg.tagged_rects(fig)["prefill"], greys["prefill"], P, P)
    np.testing.assert_array_equal(prefill, loop_mask(P, P, lambda i, j: j <= i))


def test_kv_cache_labels_the_queries_and_the_cache():
    fig = build("kv_cache_diagram", 5, 3)
    texts = dg.figure_texts(fig)
    # rows are queries: the prompt's 0 to 4 at once, then one per step
    assert ["prefill:", "queries 0\N{EN DASH}4"] == texts[texts.index("prefill:") :][:2]
    assert [t for t in texts if t.startswith("query")] == ["query 5", "query 6", "query 7"]
    assert [t for t in texts if t.startswith("cache")] == [
        "cache: 5",
        "cache: 6",
        "cache: 7",
        "cache: 8",
    ]
    assert "5 keys and values written at once" in texts and "decode:" in texts
    assert [t for t in texts if t.isdigit()] == [str(j) for j in range(8)]  # key positions
    assert "key position $j$" in texts


def test_kv_cache_labels_every_second_key_when_the_columns_are_narrow():
    texts = dg.figure_texts(build("kv_cache_diagram", 5, 6))
    assert [t for t in texts if t.isdigit()] == ["0", "2", "4", "6", "8", "10"]


def test_kv_cache_texts_beside_each_row_and_clear_of_the_grid():
    fig = build("kv_cache_diagram", 5, 6)
    rects = dg.tagged_rects(fig)
    at = {t.get_text(): t.get_position() for t in fig.axes[0].texts}
    for k in range(1, 7):
        row = rects[f"step {k}"]
        left, right = at[f"query {4 + k}"], at[f"cache: {5 + k}"]
        assert left[0] < row.x0 and right[0] > row.x1  # the query left, the cache right
        assert left[1] == pytest.approx(row.cy) and right[1] == pytest.approx(row.cy)


@pytest.mark.parametrize(("P", "N"), [(5, 6), (1, 1), (20, 12)])
def test_kv_cache_reads_on_a_phone(P, N):
    assert_reads_on_a_phone(build("kv_cache_diagram", P, N))


def test_kv_cache_changes_with_the_prompt():
    a, b = build("kv_cache_diagram", 5, 3), build("kv_cache_diagram", 1, 1)
    assert "cache: 8" in dg.figure_texts(a) and "cache: 8" not in dg.figure_texts(b)
    assert "1 key and value written at once" in dg.figure_texts(b)
    assert "query 0" in dg.figure_texts(b)


def test_kv_cache_rejects_a_count_that_is_not_positive():
    with pytest.raises(ValueError, match="new_tokens must be a positive integer; got 0"):
        dg.kv_cache_diagram(5, 0)


def test_kv_cache_rejects_too_many_tokens_to_draw():
    with pytest.raises(
        ValueError,
        match="prompt_len \\+ new_tokens must be at most 32 to be drawn legibly; got prompt_len \\+ new_tokens=33",
    ):
        dg.kv_cache_diagram(30, 3)
