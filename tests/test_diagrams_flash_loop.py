"""sdpa_book.diagrams.flash_loop: the tiled loop between slow and fast memory."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from diagram_checks import build, shapes  # noqa: E402

from sdpa_book import diagrams as dg  # noqa: E402


def test_flash_loop_labels_slow_and_fast_memory_with_the_given_shapes():
    T, S, Bq, Bk, Dk, Dv = 6, 10, 2, 5, 3, 7
    fig = build("flash_loop_diagram", T, S, Bq, Bk, Dk, Dv)
    # slow: Q (T, Dk), scores (T, S), O (T, Dv), lse (T,), K^T (Dk, S), V (S, Dv);
    # fast: Q_i (Bq, Dk), tile (Bq, Bk), acc (Bq, Dv), m (Bq,), l (Bq,), K_j^T (Dk, Bk), V_j (Bk, Dv)
    assert shapes(fig) == [
        "(6, 3)",
        "(6, 10)",
        "(6, 7)",
        "(6,)",
        "(3, 10)",
        "(10, 7)",
        "(2, 3)",
        "(2, 5)",
        "(2, 7)",
        "(2,)",
        "(2,)",
        "(3, 5)",
        "(5, 7)",
    ]
    texts = dg.figure_texts(fig)
    for label in (
        "slow memory (HBM)",
        "fast memory (SRAM)",
        "$m$",
        "$\\ell$",
        "acc",
        "lse",
        "load $Q_i$",
        "load $K_j$, $V_j$",
        "write $O_i$, lse$_i$",
        "scores: never stored",
    ):
        assert label in texts, label


def test_flash_loop_numbers_the_tiles_in_loop_order():
    T, S, Bq, Bk = 6, 10, 2, 5  # 3 query blocks x 2 key blocks
    fig = build("flash_loop_diagram", T, S, Bq, Bk, 3, 2)
    rects = dg.tagged_rects(fig)
    tiles = rects["tiles"]
    numbers = {
        int(t.get_text()): t.get_position() for t in fig.axes[0].texts if t.get_text().isdigit()
    }
    assert sorted(numbers) == list(range(1, 7))
    # tile n = i * n_k + j + 1: the inner loop runs over key blocks j (left to right), the
    # outer over query blocks i (top to bottom)
    for n, (x, y) in numbers.items():
        i, j = divmod(n - 1, 2)
        assert tiles.x0 + j * tiles.width / 2 < x < tiles.x0 + (j + 1) * tiles.width / 2
        assert tiles.y1 - (i + 1) * tiles.height / 3 < y < tiles.y1 - i * tiles.height / 3


def test_flash_loop_numbers_only_tiles_they_fit_in():
    # S = 11 with blocks of 5: the last key block is one key wide, too narrow for its numbers.
    T, S, Bq, Bk = 6, 11, 2, 5
    fig = build("flash_loop_diagram", T, S, Bq, Bk, 3, 2)
    ax, tiles = fig.axes[0], dg.tagged_rects(fig)["tiles"]
    fig.canvas.draw()
    to_data = ax.transData.inverted()
    numbers = [t for t in ax.texts if t.get_text().isdigit()]
    # the full-width columns j = 0, 1 are numbered, the narrow column j = 2 is not
    assert sorted(int(t.get_text()) for t in numbers) == [1, 2, 4, 5, 7, 8]
    column = tiles.width * Bk / S
    for t in numbers:
        (x0, _), (x1, _) = to_data.transform(t.get_window_extent().get_points())
        j = (int(t.get_text()) - 1) % 3
        assert tiles.x0 + j * column <= x0 < x1 <= tiles.x0 + (j + 1) * column


def test_flash_loop_grids_keep_the_proportions_in_both_memories():
    T, S, Bq, Bk, Dk, Dv = 6, 10, 2, 5, 3, 7
    rects = dg.tagged_rects(build("flash_loop_diagram", T, S, Bq, Bk, Dk, Dv))
    unit = rects["Q"].height / T
    expected = {
        "Q": (Dk, T),
        "tiles": (S, T),
        "O": (Dv, T),
        "lse": (1, T),
        "K^T": (S, Dk),
        "V": (Dv, S),
        "Q_i": (Dk, Bq),
        "tile": (Bk, Bq),
        "acc": (Dv, Bq),
        "m": (1, Bq),
        "l": (1, Bq),
        "K_j^T": (Bk, Dk),
        "V_j": (Dv, Bk),
    }
    for tag, (cols, rows) in expected.items():
        assert (rects[tag].width, rects[tag].height) == pytest.approx((cols * unit, rows * unit)), (
            tag
        )
    # fast memory sits below slow memory
    assert rects["fast memory (SRAM)"].y1 < rects["slow memory (HBM)"].y0


def test_flash_loop_changes_with_the_tile_size():
    a, b = (
        build("flash_loop_diagram", 8, 8, 2, 2, 4, 4),
        build("flash_loop_diagram", 8, 8, 4, 2, 4, 4),
    )
    count = lambda fig: len([t for t in dg.figure_texts(fig) if t.isdigit()])  # noqa: E731
    assert (count(a), count(b)) == (16, 8)
    ratio = lambda fig: dg.tagged_rects(fig)["tile"].height / dg.tagged_rects(fig)["Q"].height  # noqa: E731
    assert (ratio(a), ratio(b)) == pytest.approx((2 / 8, 4 / 8))  # Bq / T


def test_flash_loop_with_large_sizes_labels_them():
    fig = build("flash_loop_diagram", 1024, 1024, 128, 128, 64, 64)
    assert "(1024, 1024)" in shapes(fig) and "(128, 128)" in shapes(fig)


def test_flash_loop_rejects_a_query_block_larger_than_the_queries():
    with pytest.raises(
        ValueError, match="Bq must be at most T: a query block holds at most T rows; got Bq=8, T=6"
    ):
        dg.flash_loop_diagram(6, 8, 8, 2, 3, 2)


def test_flash_loop_rejects_a_key_block_larger_than_the_keys():
    with pytest.raises(
        ValueError, match="Bk must be at most S: a key block holds at most S keys; got Bk=9, S=8"
    ):
        dg.flash_loop_diagram(6, 8, 2, 9, 3, 2)


def test_flash_loop_rejects_too_many_blocks_to_draw():
    with pytest.raises(ValueError, match="the number of query blocks T / Bq must be at most 12"):
        dg.flash_loop_diagram(26, 8, 2, 2, 3, 2)


def test_flash_loop_rejects_a_tile_size_that_is_not_an_integer():
    with pytest.raises(TypeError, match="Bk must be a positive integer; got None"):
        dg.flash_loop_diagram(6, 8, 2, None, 3, 2)


def test_flash_loop_numbers_every_full_tile_at_the_books_sizes():
    # The memory-efficient page's sizes: 5 query blocks (the last of 44 rows) x 6 key blocks
    # (the last of 20 keys); every full 64 x 96 tile carries its number in loop order, the
    # digits' height (not a line's) deciding what fits.
    fig = build("flash_loop_diagram", 300, 500, 64, 96, 64, 32)
    numbers = sorted(int(t) for t in dg.figure_texts(fig) if t.isdigit())
    assert numbers == [i * 6 + j + 1 for i in range(4) for j in range(5)]
