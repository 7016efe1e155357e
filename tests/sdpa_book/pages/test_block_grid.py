"""The block-grid figure of sdpa_book.pages.block_grid: tiles sorted from the mask, drawn by kind."""

from __future__ import annotations

import numpy as np
import pytest
from mods import causal_mask

from sdpa import create_block_mask
from sdpa_book.pages.block_grid import (
    EMPTY,
    ENTRY_COLORS,
    FULL,
    PARTIAL,
    block_grid,
    block_kinds,
    block_legend_handles,
)

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")


@pytest.fixture
def ax():
    import matplotlib.pyplot as plt

    from sdpa.plotting import new_figure

    fig, ax = new_figure()
    yield ax
    plt.close(fig)


def test_kinds_of_a_causal_mask_by_hand():
    # 8 x 8 scores in tiles of 4 x 4: the diagonal tiles partial, below full, above empty.
    allowed, kinds = block_kinds(create_block_mask(causal_mask, None, None, 8, 8, BLOCK_SIZE=4))
    np.testing.assert_array_equal(allowed, np.tri(8, dtype=bool))
    np.testing.assert_array_equal(kinds, [[PARTIAL, EMPTY], [FULL, PARTIAL]])


def test_a_shorter_last_tile_counts_only_its_entries():
    # 7 queries and 5 keys in tiles of (3, 2): the last row of tiles has one query, the last
    # column one key; "key 4 only" fills the last column exactly and leaves the others empty.
    mask = create_block_mask(lambda b, h, i, j: j == 4, None, None, 7, 5, BLOCK_SIZE=(3, 2))
    _, kinds = block_kinds(mask)
    np.testing.assert_array_equal(kinds, [[EMPTY, EMPTY, FULL]] * 3)


def test_rectangular_tiles_with_partial_ones_by_hand():
    # keys 0 to 2 allowed for every query: in tiles of (2, 2) the first column of tiles is
    # full, the second partial (key 2 of keys 2, 3), the third (keys 4, 5) empty.
    mask = create_block_mask(lambda b, h, i, j: j < 3, None, None, 4, 6, BLOCK_SIZE=2)
    _, kinds = block_kinds(mask)
    np.testing.assert_array_equal(kinds, [[FULL, PARTIAL, EMPTY]] * 2)


def test_kinds_agree_with_the_block_mask_s_own_blocks(rng):
    # An irregular mask: the package's non-empty blocks and its full-block counts.
    allowed_in = rng.random((37, 29)) < 0.02
    allowed_in[:, :5] = True  # a full column of tiles
    mask = create_block_mask(
        lambda b, h, i, j: allowed_in[i, j], None, None, 37, 29, BLOCK_SIZE=(8, 5)
    )
    allowed, kinds = block_kinds(mask)
    np.testing.assert_array_equal(allowed, allowed_in)
    np.testing.assert_array_equal(kinds != EMPTY, mask.to_dense()[0, 0])
    np.testing.assert_array_equal((kinds == FULL).sum(axis=1), mask.full_kv_num_blocks[0, 0])


def test_the_batch_entry_and_head_are_chosen():
    lengths = np.array([[2, 6], [4, 8]])  # keys kept per (batch entry, head)
    mask = create_block_mask(lambda b, h, i, j: j < lengths[b, h], 2, 2, 3, 8, BLOCK_SIZE=(3, 2))
    for b in range(2):
        for h in range(2):
            allowed, kinds = block_kinds(mask, b, h)
            np.testing.assert_array_equal(allowed[0], np.arange(8) < lengths[b, h])
            assert (kinds == FULL).sum() == lengths[b, h] // 2


def test_the_image_codes_each_entry_by_its_tile(ax):
    mask = create_block_mask(causal_mask, None, None, 8, 8, BLOCK_SIZE=4)
    codes = np.asarray(block_grid(ax, mask).get_array())
    i, j = np.indices((8, 8))
    upper_left, lower_right = (i < 4) & (j < 4), (i >= 4) & (j >= 4)
    diagonal = upper_left | lower_right
    expected = np.where(diagonal, np.where(i >= j, 2, 1), np.where(i >= 4, 3, 0))
    np.testing.assert_array_equal(codes, expected)
    # the tiles' edges are drawn, and the edges labelled
    assert len(ax.lines) == 2
    assert [t.get_text() for t in ax.get_xticklabels()] == ["0", "4"]
    assert (ax.get_xlabel(), ax.get_ylabel()) == ("key j", "query i")


def test_the_image_of_a_shorter_last_tile_has_the_matrix_shape(ax):
    mask = create_block_mask(causal_mask, None, None, 10, 7, BLOCK_SIZE=4)
    assert np.asarray(block_grid(ax, mask).get_array()).shape == (10, 7)


def test_legend_has_one_distinct_colour_per_entry_state():
    handles = block_legend_handles()
    labels = [p.get_label() for p in handles]
    assert labels == [
        "full tile",
        "partial tile: allowed",
        "partial tile: masked",
        "empty tile: skipped",
    ]
    colours = [matplotlib.colors.to_hex(p.get_facecolor()) for p in handles]
    assert colours == list(reversed(ENTRY_COLORS)) and len(set(colours)) == 4


def test_block_mask_must_be_a_block_mask():
    with pytest.raises(TypeError, match="block_mask must be a BlockMask .*; got ndarray"):
        block_kinds(np.ones((4, 4), dtype=bool))


@pytest.mark.parametrize("name", ["b", "h"])
def test_batch_entry_and_head_must_be_in_the_mask(name):
    mask = create_block_mask(causal_mask, None, None, 4, 4, BLOCK_SIZE=2)
    with pytest.raises(ValueError, match=rf"{name} must be in \[0, 1\) .*; got 1"):
        block_kinds(mask, **{name: 1})


def test_batch_entry_must_be_an_int():
    mask = create_block_mask(causal_mask, None, None, 4, 4, BLOCK_SIZE=2)
    with pytest.raises(TypeError, match="b must be an int; got 0.0"):
        block_kinds(mask, b=0.0)


def test_ax_must_be_an_axes():
    mask = create_block_mask(causal_mask, None, None, 4, 4, BLOCK_SIZE=2)
    with pytest.raises(TypeError, match="ax must be a matplotlib Axes; got NoneType"):
        block_grid(None, mask)
