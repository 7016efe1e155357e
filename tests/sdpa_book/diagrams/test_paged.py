"""sdpa_book.diagrams: block tables drawn from a live PagedKVCache."""

from __future__ import annotations

import numpy as np
import pytest

matplotlib = pytest.importorskip("matplotlib")
matplotlib.use("Agg")

from diagram_checks import assert_legible, assert_reads_on_a_phone  # noqa: E402
from matplotlib.colors import to_hex  # noqa: E402

from sdpa import PagedKVCache  # noqa: E402
from sdpa_book.diagrams import figure_texts, tagged_rects  # noqa: E402
from sdpa_book.diagrams.paged import (  # noqa: E402
    SEQUENCE_COLORS,
    SHARED_COLOR,
    block_table_diagram,
)


def tokens(n: int):
    """Keys and values of n tokens for a cache with Hkv = 1, Dk = Dv = 2."""
    return np.ones((1, n, 2)), np.ones((1, n, 2))


def three_sequences():
    """A pool of 8 blocks of 4 slots. A holds 6 tokens (blocks 0, 1); B forks A; C takes
    blocks 2, 3 (5 tokens). A writes 3 tokens: block 1 is shared and partly filled, so A copies
    it to block 4 and takes block 5; B, now alone in block 1, writes 2 there; C writes 2 into
    block 3. By hand: A [0, 4, 5] (9 tokens), B [0, 1] (8), C [2, 3] (7); 6 and 7 free."""
    cache = PagedKVCache(num_blocks=8, block_size=4, n_kv_heads=1, head_dim=2)
    a = cache.new_sequence()
    cache.append(a, *tokens(6))
    b = cache.fork(a)
    c = cache.new_sequence()
    cache.append(c, *tokens(5))
    cache.append(a, *tokens(3))
    cache.append(b, *tokens(2))
    cache.append(c, *tokens(2))
    return cache, {"A": a, "B": b, "C": c}


TABLES = {"A": [0, 4, 5], "B": [0, 1], "C": [2, 3]}
FILLED = [4, 4, 4, 3, 4, 1, 0, 0]  # tokens in each pool block, by hand


@pytest.fixture(scope="module")
def fig():
    cache, seqs = three_sequences()
    return block_table_diagram(cache, seqs)


def slots_in(fig, rect):
    """The slot patches drawn inside ``rect`` (the outline has no face), left to right."""
    slots = [
        p
        for p in fig.axes[0].patches
        if p.get_zorder() == 2
        and rect.x0 - 1e-9 <= p.get_x() < rect.x1 - 1e-9
        and abs(p.get_y() - rect.y0) < 1e-9
    ]
    return sorted(slots, key=lambda p: p.get_x())


def face(patch) -> str:
    return to_hex(patch.get_facecolor())


def test_each_line_joins_a_logical_block_to_the_block_its_table_names(fig):
    rects = tagged_rects(fig)
    links = {
        line.get_label()[len("_link ") :]: line.get_xydata()
        for line in fig.axes[0].lines
        if line.get_label().startswith("_link ")
    }
    assert len(links) == sum(len(t) for t in TABLES.values())
    for name, table in TABLES.items():
        for i, block in enumerate(table):
            start, end = links[f"{name} {i}"]
            assert start[0] == pytest.approx(rects[f"{name} {i}"].cx)
            assert end[0] == pytest.approx(rects[f"pool {block}"].cx)


def test_the_labels_state_the_block_tables_and_the_pool_ids(fig):
    texts = figure_texts(fig)
    for name, table in TABLES.items():
        assert f"{name}: {table}" in texts
    assert [t for t in texts if t.isdigit()] == [str(k) for k in range(8)]
    assert texts[-3:] == ["shared block", "empty slot", "free block"]


def test_filled_slots_count_the_tokens_of_each_block(fig):
    rects = tagged_rects(fig)
    for block, n in enumerate(FILLED):
        slots = slots_in(fig, rects[f"pool {block}"])
        assert len(slots) == 4
        assert [face(s) != "#ffffff" for s in slots] == [k < n for k in range(4)]
    # the rows too: C's second block holds 3 of its 7 tokens
    assert [face(s) != "#ffffff" for s in slots_in(fig, rects["C 1"])] == [1, 1, 1, 0]


def test_a_shared_block_is_grey_and_an_owned_one_takes_its_sequence_colour(fig):
    rects = tagged_rects(fig)
    colour = dict(zip("ABC", SEQUENCE_COLORS))
    assert face(slots_in(fig, rects["pool 0"])[0]) == to_hex(SHARED_COLOR)  # A and B
    assert face(slots_in(fig, rects["A 0"])[0]) == to_hex(SHARED_COLOR)
    assert face(slots_in(fig, rects["B 0"])[0]) == to_hex(SHARED_COLOR)
    for name, table in TABLES.items():
        for block in table[1:]:
            assert face(slots_in(fig, rects[f"pool {block}"])[0]) == to_hex(colour[name])


def test_free_blocks_are_dashed_and_the_rest_solid(fig):
    outlines = {
        p.get_label()[len("_tag pool ") :]: p.get_linestyle()
        for p in fig.axes[0].patches
        if p.get_label().startswith("_tag pool ")
    }
    assert {k for k, style in outlines.items() if style != "-"} == {"6", "7"}


def test_sequences_alternate_over_and_under_the_pool(fig):
    rects = tagged_rects(fig)
    pool = rects["pool 0"]
    assert rects["A 0"].y0 > pool.y1 and rects["C 0"].y0 > pool.y1
    assert rects["B 0"].y1 < pool.y0
    assert rects["C 0"].x0 > rects["A 2"].x1  # side by side in their row


def test_reads_on_a_phone(fig):
    assert fig.get_size_inches()[0] == pytest.approx(3.7)
    assert_legible(fig)
    assert_reads_on_a_phone(fig)


def test_one_sequence_with_no_free_block():
    cache = PagedKVCache(num_blocks=3, block_size=2, n_kv_heads=1, head_dim=2)
    seq = cache.new_sequence()
    cache.append(seq, *tokens(5))
    fig = block_table_diagram(cache, {"only": seq})
    assert_legible(fig)
    assert "only: [0, 1, 2]" in figure_texts(fig)
    assert figure_texts(fig)[-1] == "empty slot"  # nothing shared, nothing free


def test_four_sequences_of_the_largest_pool_read_on_a_phone():
    cache = PagedKVCache(num_blocks=12, block_size=8, n_kv_heads=1, head_dim=2)
    seqs = {}
    for name, n in zip("ABCD", (17, 9, 12, 30)):
        seqs[name] = cache.new_sequence()
        cache.append(seqs[name], *tokens(n))
    fig = block_table_diagram(cache, seqs)
    assert_legible(fig)
    assert_reads_on_a_phone(fig)


def test_rejects_what_is_not_a_cache():
    with pytest.raises(TypeError, match="cache must be an sdpa.PagedKVCache; got dict"):
        block_table_diagram({}, {"A": 0})


@pytest.mark.parametrize("sequences", [{}, {"A": 0, "B": 1, "C": 2, "D": 3, "E": 4}, [0]])
def test_rejects_too_few_or_too_many_sequences(sequences):
    cache = PagedKVCache(num_blocks=8, block_size=2, n_kv_heads=1, head_dim=1)
    with pytest.raises(ValueError, match="sequences must map 1 to 4 names"):
        block_table_diagram(cache, sequences)


@pytest.mark.parametrize("num_blocks, block_size", [(13, 2), (4, 9)])
def test_rejects_a_pool_too_large_to_draw(num_blocks, block_size):
    cache = PagedKVCache(num_blocks=num_blocks, block_size=block_size, n_kv_heads=1, head_dim=1)
    seq = cache.new_sequence()
    with pytest.raises(ValueError, match="at most 12 blocks of at most 8 slots"):
        block_table_diagram(cache, {"A": seq})


def test_rejects_a_freed_sequence():
    cache, seqs = three_sequences()
    cache.free(seqs["C"])
    with pytest.raises(ValueError, match="live sequence ids of cache; got 'C': 2"):
        block_table_diagram(cache, seqs)


def test_rejects_a_sequence_named_twice():
    cache, seqs = three_sequences()
    with pytest.raises(ValueError, match="name each sequence once"):
        block_table_diagram(cache, {"A": seqs["A"], "again": seqs["A"]})


def test_rejects_leaving_out_a_sequence_that_holds_blocks():
    cache, seqs = three_sequences()
    with pytest.raises(ValueError, match="6 blocks are in use, 4 of them by"):
        block_table_diagram(cache, {"A": seqs["A"], "B": seqs["B"]})  # C holds 2 and 3


def test_rejects_sequences_too_wide_for_their_row():
    # A and C share the row over the pool: 6 + 6 blocks at the pool's pitch, and a gap between
    # them, are wider than the pool's 12 blocks. (B, under the pool, is empty.)
    cache = PagedKVCache(num_blocks=12, block_size=1, n_kv_heads=1, head_dim=1)
    seqs = {name: cache.new_sequence() for name in "ABC"}
    for name in "AC":
        cache.append(seqs[name], np.ones((1, 6, 1)), np.ones((1, 6, 1)))
    with pytest.raises(ValueError, match="must fit side by side"):
        block_table_diagram(cache, seqs)
