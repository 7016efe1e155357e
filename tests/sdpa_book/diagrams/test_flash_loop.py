"""sdpa_book.diagrams.flash_loop: the tiled loop between slow and fast memory, its tiles
numbered in the loop's order, and the causal loop's skipped tiles.

The causal numbering is checked against the trace of the package's own loop
(``sdpa.blocked_attention(..., on_tile=...)``), the skipped tiles and the grey scores against
the mask's definition (key after query), and the text sizes against the phone rule: a figure W
inches wide is shrunk to a phone's column of about 325 CSS px by min(1, 325 / 96 W), and
mathtext draws sub- and superscripts at 70 % of their text.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from diagram_checks import assert_legible, assert_reads_on_a_phone, build, shapes  # noqa: E402
from matplotlib.path import Path  # noqa: E402

import sdpa  # noqa: E402
from sdpa_book import diagrams as dg  # noqa: E402
from sdpa_book.diagrams.primitives import PHONE_WIDTH  # noqa: E402


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
        "scores,",
        "never stored",
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
    # S = 41 with blocks of 10: the last key block is one key wide, too narrow for its numbers.
    T, S, Bq, Bk = 12, 41, 4, 10
    fig = build("flash_loop_diagram", T, S, Bq, Bk, 3, 2)
    ax, tiles = fig.axes[0], dg.tagged_rects(fig)["tiles"]
    fig.canvas.draw()
    to_data = ax.transData.inverted()
    numbers = [t for t in ax.texts if t.get_text().isdigit()]
    # the full-width columns j = 0 to 3 are numbered, the narrow column j = 4 is not
    assert sorted(int(t.get_text()) for t in numbers) == [1, 2, 3, 4, 6, 7, 8, 9, 11, 12, 13, 14]
    column = tiles.width * Bk / S
    for t in numbers:
        (x0, _), (x1, _) = to_data.transform(t.get_window_extent().get_points())
        j = (int(t.get_text()) - 1) % 5
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


def test_flash_loop_numbers_every_tile_but_the_narrow_column_at_the_books_sizes():
    # The memory-efficient page's sizes: 5 query blocks (the last of 44 rows) x 6 key blocks
    # (the last of 20 keys); every tile but those of the last, narrow column carries its
    # number in loop order, the digits' height (not a line's) deciding what fits.
    fig = build("flash_loop_diagram", 300, 500, 64, 96, 64, 32)
    numbers = sorted(int(t) for t in dg.figure_texts(fig) if t.isdigit())
    assert numbers == [i * 6 + j + 1 for i in range(5) for j in range(5)]


# ---------------------------------------------------------------------------------------------
# Causal
# ---------------------------------------------------------------------------------------------

CAUSAL = [(6, 10, 2, 5), (10, 6, 3, 2), (8, 8, 2, 2), (12, 12, 3, 4), (384, 384, 64, 64)]


def traced_tiles(T, S, Bq, Bk):
    """The tiles ``(query block, key block)`` the package's causal loop computes, in order."""
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((T, 2)), rng.standard_normal((S, 2)), np.ones((S, 1))
    trace = []
    sdpa.blocked_attention(
        q, k, v, block_q=Bq, block_k=Bk, is_causal=True, on_tile=lambda i, j: trace.append((i, j))
    )
    return [(i // Bq, j // Bk) for i, j in trace]


def numbered_tiles(fig, T, S, Bq, Bk) -> dict[int, tuple[int, int]]:
    """``{number: (query block, key block)}``: the tile each number of the scores grid is in."""
    tiles = dg.tagged_rects(fig)["tiles"]
    cell_w, cell_h = tiles.width / S, tiles.height / T
    found = {}
    for t in fig.axes[0].texts:
        if t.get_text().isdigit():
            x, y = t.get_position()
            assert tiles.x0 < x < tiles.x1 and tiles.y0 < y < tiles.y1, t.get_text()
            query, key = (tiles.y1 - y) / cell_h, (x - tiles.x0) / cell_w
            found[int(t.get_text())] = (int(query // Bq), int(key // Bk))
    return found


@pytest.mark.parametrize("T, S, Bq, Bk", CAUSAL)
def test_causal_numbers_follow_the_packages_loop(T, S, Bq, Bk):
    fig = build("flash_loop_diagram", T, S, Bq, Bk, 3, 2, is_causal=True)
    trace = traced_tiles(T, S, Bq, Bk)
    found = numbered_tiles(fig, T, S, Bq, Bk)
    assert found, "no tile numbered"
    for number, tile in found.items():
        assert trace[number - 1] == tile, number
    # every tile computed is numbered where it is wide and tall enough (here: all but a
    # last, partial row or column)
    full = [n for n, (a, b) in enumerate(trace, 1) if (a + 1) * Bq <= T and (b + 1) * Bk <= S]
    assert set(full) <= set(found)


@pytest.mark.parametrize("T, S, Bq, Bk", CAUSAL)
def test_causal_skipped_tiles_are_those_above_the_diagonal(T, S, Bq, Bk):
    fig = build("flash_loop_diagram", T, S, Bq, Bk, 3, 2, is_causal=True)
    rects = dg.tagged_rects(fig)
    skipped = {
        tuple(int(n) for n in tag[8:].split(",")) for tag in rects if tag.startswith("skipped ")
    }
    n_q, n_k = -(-T // Bq), -(-S // Bk)
    # a tile is skipped when its first key comes after its last query
    above = {(a, b) for a in range(n_q) for b in range(n_k) if b * Bk > min(T, (a + 1) * Bq) - 1}
    assert skipped == above
    assert not skipped & set(numbered_tiles(fig, T, S, Bq, Bk).values())
    for a, b in skipped:  # the dashed outline covers the tile
        r, tiles = rects[f"skipped {a},{b}"], rects["tiles"]
        assert r.x0 == pytest.approx(tiles.x0 + b * Bk * tiles.width / S)
        assert r.y1 == pytest.approx(tiles.y1 - a * Bq * tiles.height / T)


@pytest.mark.parametrize("T, S, Bq, Bk", CAUSAL[:4])
def test_causal_grey_scores_are_the_keys_after_their_query(T, S, Bq, Bk):
    fig = build("flash_loop_diagram", T, S, Bq, Bk, 3, 2, is_causal=True)
    tiles = dg.tagged_rects(fig)["tiles"]
    (grey,) = [p for p in fig.axes[0].patches if p.get_label() == "_masked tiles"]
    path = Path(grey.get_xy())
    cell_w, cell_h = tiles.width / S, tiles.height / T
    drawn = np.array(
        [
            [
                path.contains_point((tiles.x0 + (j + 0.5) * cell_w, tiles.y1 - (i + 0.5) * cell_h))
                for j in range(S)
            ]
            for i in range(T)
        ]
    )
    np.testing.assert_array_equal(drawn, np.triu(np.ones((T, S), bool), k=1))


def test_without_the_mask_nothing_is_grey_or_skipped():
    fig = build("flash_loop_diagram", 8, 8, 2, 2, 3, 2)
    assert not [p for p in fig.axes[0].patches if p.get_label() == "_masked tiles"]
    assert not [tag for tag in dg.tagged_rects(fig) if tag.startswith("skipped")]


def test_causal_counts_only_the_tiles_computed():
    # 8 x 8 scores in 2 x 2 tiles: 4 * 5 / 2 = 10 tiles computed of 16
    numbers = [
        t
        for t in dg.figure_texts(build("flash_loop_diagram", 8, 8, 2, 2, 3, 2, is_causal=True))
        if t.isdigit()
    ]
    assert sorted(map(int, numbers)) == list(range(1, 11))


@pytest.mark.parametrize(
    "args, causal",
    [
        ((300, 500, 64, 96, 64, 32), False),
        ((384, 384, 64, 64, 64, 32), True),
        ((6, 10, 2, 5, 3, 7), True),
        ((1024, 1024, 128, 128, 64, 64), True),
    ],
)
def test_text_reads_on_a_phone_and_a_desktop(args, causal):
    """At most PHONE_WIDTH (3.7 in) wide, and its text legible on a phone and a desktop."""
    fig = build("flash_loop_diagram", *args, is_causal=causal)
    assert fig.get_size_inches()[0] <= PHONE_WIDTH + 1e-9
    assert_reads_on_a_phone(fig)


@pytest.mark.parametrize(
    "args", [(6, 10, 2, 5, 3, 7), (10, 6, 3, 2, 3, 7), (1024, 1024, 128, 128, 64, 64)]
)
def test_causal_diagram_is_legible(args):
    assert_legible(build("flash_loop_diagram", *args, is_causal=True))


def test_flash_loop_rejects_is_causal_that_is_not_a_bool():
    with pytest.raises(TypeError, match="is_causal must be a bool; got 1"):
        dg.flash_loop_diagram(6, 8, 2, 2, 3, 2, is_causal=1)
