"""sdpa_book.diagrams: thread blocks over query tiles, drawn from a page's sizes."""

from __future__ import annotations

import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

from diagram_checks import arrow_ends, assert_legible, assert_reads_on_a_phone  # noqa: E402
from matplotlib.patches import FancyArrowPatch  # noqa: E402

from sdpa_book.diagrams import (  # noqa: E402
    figure_texts,
    gpu_blocks_diagram,  # noqa: E402
    tagged_rects,
)

# B = 2, H = 3, T = 700 in tiles of 128: ceil(700 / 128) = 6 tiles, 2 * 3 * 6 = 36 blocks, by
# hand; the last block is (1, 2, 5). S, Dk, Dv all differ so a swapped shape cannot pass.
SIZES = dict(B=2, H=3, T=700, S=900, Dk=48, Dv=80)


@pytest.fixture(scope="module")
def fig():
    return gpu_blocks_diagram(**SIZES, block_q=128, n_sm=132)


def test_shapes_and_count_come_from_the_sizes(fig):
    texts = figure_texts(fig)
    assert [t for t in texts if t.startswith("(") and "," in t and t[1].isdigit()][:4] == [
        "(700, 48)", "(900, 48)", "(900, 80)", "(700, 80)",
    ]  # fmt: skip
    assert "blocks (b, h, i): 2 × 3 × 6 = 36 on 132 SMs" in texts


def test_draws_the_first_two_blocks_and_the_last(fig):
    texts = figure_texts(fig)
    assert [t for t in texts if t in ("(0, 0, 0)", "(0, 0, 1)", "(1, 2, 5)")] == [
        "(0, 0, 0)", "(0, 0, 1)", "(1, 2, 5)",
    ]  # fmt: skip
    assert "…" in texts  # 33 blocks left out
    assert texts.count("$Q_i$") == texts.count("m, ℓ, acc") == 3


def test_each_block_holds_its_sram_with_the_three_tiles_and_the_state(fig):
    rects = tagged_rects(fig)
    for tag in ("0 0 0", "0 0 1", "1 2 5"):
        block, sram = rects[f"block {tag}"], rects[f"sram {tag}"]
        assert block.x0 < sram.x0 < sram.x1 < block.x1 and block.y0 < sram.y0 < sram.y1 < block.y1
        for part in ("Q", "K", "V", f"state {tag}"):
            r = rects[part if part.startswith("state") else f"{part} {tag}"]
            assert sram.x0 < r.x0 < r.x1 < sram.x1 and sram.y0 < r.y0 < r.y1 < sram.y1


def test_every_block_reads_k_and_v_and_writes_o(fig):
    rects = tagged_rects(fig)
    arrows = [arrow_ends(a) for a in fig.axes[0].patches if isinstance(a, FancyArrowPatch)]
    assert len(arrows) == 3 * 4  # Q, K, V in and O out, for each of the three blocks

    def from_to(src, dst):
        return sum(
            src.y0 - 1e-6 <= s[1] <= src.y1 + 1e-6 and src.x0 <= s[0] <= src.x1
            and abs(e[1] - dst.y1) < 0.02 and dst.x0 <= e[0] <= dst.x1
            for s, e in arrows
        )  # fmt: skip

    for tag in ("0 0 0", "0 0 1", "1 2 5"):
        for name in "QKV":
            assert from_to(rects[name], rects[f"{name} {tag}"]) == 1, (name, tag)
    assert sum(abs(e[1] - rects["O"].y1) < 0.02 for _, e in arrows) == 3


def test_a_grid_of_three_blocks_or_fewer_draws_them_all_without_an_ellipsis():
    fig = gpu_blocks_diagram(1, 1, 200, 64, 16, 16, block_q=128, n_sm=4)
    texts = figure_texts(fig)
    assert "(0, 0, 0)" in texts and "(0, 0, 1)" in texts and "…" not in texts
    assert "blocks (b, h, i): 1 × 1 × 2 = 2 on 4 SMs" in texts
    assert_legible(fig)


def test_reads_on_a_phone(fig):
    assert fig.get_size_inches()[0] == pytest.approx(3.7)
    assert_legible(fig)
    assert_reads_on_a_phone(fig)


def test_the_page_sizes_read_on_a_phone():
    fig = gpu_blocks_diagram(2, 16, 4096, 4096, 128, 128, block_q=224, n_sm=132)
    assert "(1, 15, 18)" in figure_texts(fig)  # ceil(4096 / 224) = 19 tiles
    assert_legible(fig)
    assert_reads_on_a_phone(fig)


def test_rejects_a_size_that_is_not_an_integer():
    with pytest.raises(TypeError, match="T must be a positive integer; got 4.5"):
        gpu_blocks_diagram(1, 1, 4.5, 8, 4, 4, block_q=2, n_sm=1)


def test_rejects_a_size_that_is_not_positive():
    with pytest.raises(ValueError, match="n_sm must be a positive integer; got 0"):
        gpu_blocks_diagram(1, 1, 8, 8, 4, 4, block_q=2, n_sm=0)


def test_rejects_a_tile_longer_than_the_queries():
    with pytest.raises(ValueError, match="block_q must be at most T = 8; got block_q=9"):
        gpu_blocks_diagram(1, 1, 8, 8, 4, 4, block_q=9, n_sm=1)


def test_rejects_sizes_whose_labels_do_not_fit():
    with pytest.raises(ValueError, match="labels that fit in the width; got '\\(1234567, 4\\)'"):
        gpu_blocks_diagram(1, 1, 1234567, 8, 4, 4, block_q=2, n_sm=1)
