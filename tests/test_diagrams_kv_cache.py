"""sdpa_book.diagrams.kv_cache: the prefill, then decoding against a growing cache."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from diagram_checks import build, loop_mask, masked_corners, read_grey_cells  # noqa: E402

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


def test_kv_cache_prefill_is_causal_and_each_step_sees_every_cached_key():
    P, N = 4, 2
    fig = build("kv_cache_diagram", P, N)
    # only the prefill masks anything (decoding rows have no grey cells): key j > i is in the
    # future of prompt query i
    greys = masked_corners(fig)
    assert list(greys) == ["prefill"]
    prefill = read_grey_cells(dg.tagged_rects(fig)["prefill"], greys["prefill"], P, P)
    np.testing.assert_array_equal(prefill, loop_mask(P, P, lambda i, j: j <= i))


def test_kv_cache_labels_the_cache_and_the_steps():
    fig = build("kv_cache_diagram", 5, 3)
    texts = dg.figure_texts(fig)
    assert [t for t in texts if t.startswith("step")] == [
        "step 1: query 5",
        "step 2: query 6",
        "step 3: query 7",
    ]
    assert [t for t in texts if t.startswith("cache")] == [
        "cache: 5 keys, 5 values",
        "cache: 6 keys, 6 values",
        "cache: 7 keys, 7 values",
        "cache: 8 keys, 8 values",
    ]
    assert (
        "5 keys and values written at once" in texts
        and "prefill: 5 queries\nat once, causal" in texts
    )
    assert [t for t in texts if t.isdigit()] == [str(j) for j in range(8)]  # key positions


def test_kv_cache_changes_with_the_prompt():
    a, b = build("kv_cache_diagram", 5, 3), build("kv_cache_diagram", 1, 1)
    assert "cache: 8 keys, 8 values" in dg.figure_texts(
        a
    ) and "cache: 8 keys, 8 values" not in dg.figure_texts(b)
    assert "cache: 1 key, 1 value" in dg.figure_texts(b)


def test_kv_cache_rejects_a_count_that_is_not_positive():
    with pytest.raises(ValueError, match="new_tokens must be a positive integer; got 0"):
        dg.kv_cache_diagram(5, 0)


def test_kv_cache_rejects_too_many_tokens_to_draw():
    with pytest.raises(
        ValueError,
        match="prompt_len \\+ new_tokens must be at most 32 to be drawn legibly; got prompt_len \\+ new_tokens=33",
    ):
        dg.kv_cache_diagram(30, 3)
