"""A paged KV cache drawn from its own block tables: :func:`block_table_diagram`.

:class:`sdpa.PagedKVCache` keeps one pool of fixed-size blocks and gives each sequence a
*block table*, the ids of the blocks that hold its tokens in order. The diagram reads a live
cache: the pool across the middle (its physical blocks, by id), the sequences above and below
it (each one's logical blocks, left to right, under or over its block table), and a line from
each logical block to the physical block its table names. Slots that hold a token are filled,
in the sequence's colour, or in grey for a block that several sequences share (prefix
sharing); free blocks are outlined dashed. Since every number and line comes from the cache,
the picture cannot drift from the page that built it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from sdpa import PagedKVCache

from ..figures import COLORS
from .draw import new_canvas, role_legend
from .primitives import text_size

__all__ = ["SEQUENCE_COLORS", "SHARED_COLOR", "block_table_diagram"]

# One colour per sequence, in the order given (Okabe-Ito: blue, vermillion, bluish green,
# reddish purple); grey for a block that more than one sequence holds.
#: The fill of each sequence's own blocks, in the order the sequences are given.
SEQUENCE_COLORS = (COLORS[0], COLORS[3], COLORS[2], COLORS[4])
#: The fill of a block that several sequences hold (a shared prefix).
SHARED_COLOR = "#9a9a9a"
INK = "#222222"
SLOT_EDGE = "#b8b8b8"

WIDTH = 3.7  # inches: a phone's column at 10 pt text (see sdpa_book.diagrams.phone)
TEXT_PT = 10
MARGIN = 0.08
BLOCK_H = 0.22  # height of a drawn block
LINK_DROP = 0.5  # between a row of sequences and the pool: room for the lines
GAP = 0.1  # between a row and a text beside it
GROUP_GAP = 0.3  # between two sequences side by side
LEGEND_H = 0.3
MAX_BLOCKS = 12  # pool blocks drawn side by side in the width
MAX_SLOTS = 8  # slots drawn per block


@dataclass(frozen=True)
class _Layout:
    height: float
    x0: float  # left edge of pool block 0
    pitch: float  # from one block to the next
    block_w: float
    starts: dict[str, float]  # left edge of each sequence's logical block 0
    above: list[str]  # sequences over the pool; the others are under it
    upper_y: float  # bottom of the upper row of sequences
    pool_y: float  # bottom of the pool
    lower_y: float  # bottom of the lower row


def _check(cache, sequences) -> dict[str, int]:
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache must be an sdpa.PagedKVCache; got {type(cache).__name__}")
    if not isinstance(sequences, Mapping) or not 1 <= len(sequences) <= len(SEQUENCE_COLORS):
        raise ValueError(
            f"sequences must map 1 to {len(SEQUENCE_COLORS)} names to sequence ids; "
            f"got {sequences!r}"
        )
    if cache.num_blocks > MAX_BLOCKS or cache.block_size > MAX_SLOTS:
        raise ValueError(
            f"cache must have at most {MAX_BLOCKS} blocks of at most {MAX_SLOTS} slots to be "
            f"drawn legibly; got num_blocks={cache.num_blocks}, block_size={cache.block_size}"
        )
    for name, seq in sequences.items():
        try:
            cache.length(seq)
        except (KeyError, TypeError) as error:
            raise ValueError(
                f"sequences must hold live sequence ids of cache; got {name!r}: {seq!r}"
            ) from error
    if len(set(sequences.values())) != len(sequences):
        raise ValueError(f"sequences must name each sequence once; got {dict(sequences)!r}")
    return {str(name): seq for name, seq in sequences.items()}


def _label(name: str, table: list[int]) -> str:
    return f"{name}: {table}"


def _layout(cache: PagedKVCache, names: list[str], tables: dict[str, list[int]]) -> _Layout:
    """The pool spans the width right of its label; the sequences, alternately over and under
    it, sit side by side in their row at the pool's pitch, each as wide as its blocks or its
    label (checked to fit)."""
    x0 = MARGIN + text_size("pool", TEXT_PT)[0] + GAP
    pitch = (WIDTH - MARGIN - x0) / cache.num_blocks
    block_w = pitch - min(0.06, 0.2 * pitch)
    above, below = names[0::2], names[1::2]
    starts = {}
    for row in (above, below):
        x = x0
        for n in row:
            starts[n] = x
            blocks_w = len(tables[n]) * pitch
            x += max(blocks_w, text_size(_label(n, tables[n]), TEXT_PT)[0]) + GROUP_GAP
        if x - GROUP_GAP > WIDTH - MARGIN + 1e-9:
            raise ValueError(
                "sequences must fit side by side, two rows of them, in the width; got block "
                f"tables {[tables[n] for n in row]} in one row, over a pool of "
                f"{cache.num_blocks} blocks"
            )
    line = text_size("0", TEXT_PT)[1]
    lower_y = MARGIN + LEGEND_H + line if below else MARGIN + LEGEND_H - BLOCK_H - LINK_DROP
    pool_y = lower_y + BLOCK_H + LINK_DROP
    upper_y = pool_y + BLOCK_H + line + LINK_DROP  # the pool's ids over it
    height = upper_y + BLOCK_H + line + MARGIN
    return _Layout(height, x0, pitch, block_w, starts, above, upper_y, pool_y, lower_y)


def _block(
    ax, x: float, y: float, w: float, filled: int, size: int, color, *, tag: str, free=False
) -> None:
    """A block of ``size`` slots, the first ``filled`` in ``color``, outlined (dashed if free)
    by a patch labelled ``_tag <tag>`` (read back by ``sdpa_book.diagrams.tagged_rects``)."""
    from matplotlib.patches import Rectangle

    slot = w / size
    for s in range(size):
        face = color if s < filled else "white"
        ax.add_patch(
            Rectangle(
                (x + s * slot, y),
                slot,
                BLOCK_H,
                facecolor=face,
                edgecolor=SLOT_EDGE,
                linewidth=0.5,
                zorder=2,
            )
        )
    ax.add_patch(
        Rectangle(
            (x, y),
            w,
            BLOCK_H,
            facecolor="none",
            edgecolor=INK,
            linewidth=1.0,
            linestyle="--" if free else "-",
            zorder=3,
            label=f"_tag {tag}",
        )
    )


def block_table_diagram(cache: PagedKVCache, sequences: Mapping[str, int]):
    """Sequences' block tables pointing into a paged cache's pool, drawn from the cache.

    Parameters
    ----------
    cache : sdpa.PagedKVCache
        At most 12 blocks of at most 8 slots (drawn side by side in a phone's column).
    sequences : mapping of str to int
        One to four short names and the live sequence ids they label. They take turns over
        and under the pool (first over, second under, ...), side by side within a row.

    Returns
    -------
    matplotlib.figure.Figure
        3.7 in wide, text at 10 pt, white; not registered with pyplot. The pool across the
        middle, each block over its id; each sequence's logical blocks in a row (slots filled
        up to its length) with its name and block table, ``"A: [0, 4, 5]"``, on the far side
        from the pool; a line from every logical block to the physical block its table names,
        in the sequence's colour (``sdpa_book.diagrams.paged.SEQUENCE_COLORS``). A block held by several sequences
        is filled in ``SHARED_COLOR``; a free block is outlined dashed. The blocks are
        tagged ``"<name> <i>"`` (logical block ``i``) and ``"pool <id>"``, the lines labelled
        ``"_link <name> <i>"``.

    Raises
    ------
    TypeError
        If ``cache`` is not a PagedKVCache.
    ValueError
        If ``sequences`` does not map one to four names to distinct live sequences of
        ``cache`` that hold every block in use, the pool is too large to draw, or the
        sequences do not fit side by side.

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa import PagedKVCache
    >>> from sdpa_book.diagrams import figure_texts
    >>> cache = PagedKVCache(num_blocks=6, block_size=4, n_kv_heads=1, head_dim=2)
    >>> a = cache.new_sequence()
    >>> cache.append(a, np.ones((1, 6, 2)), np.ones((1, 6, 2)))
    >>> b = cache.fork(a)
    >>> cache.append(b, np.ones((1, 1, 2)), np.ones((1, 1, 2)))  # copies the shared block 1
    >>> [t for t in figure_texts(block_table_diagram(cache, {"A": a, "B": b})) if ":" in t]
    ['A: [0, 1]', 'B: [0, 2]']
    """
    named = _check(cache, sequences)
    names = list(named)
    tables = {n: cache.block_table(named[n]) for n in names}
    lengths = {n: cache.length(named[n]) for n in names}
    holders: dict[int, list[str]] = {}
    filled: dict[int, int] = {}
    size = cache.block_size
    for n in names:
        for i, block in enumerate(tables[n]):
            holders.setdefault(block, []).append(n)
            filled[block] = min(size, lengths[n] - i * size)
    in_use = cache.num_blocks - cache.num_free_blocks
    if len(holders) != in_use:
        raise ValueError(
            f"sequences must include every sequence that holds blocks of cache: {in_use} "
            f"blocks are in use, {len(holders)} of them by {names}"
        )
    layout = _layout(cache, names, tables)
    fig, ax = new_canvas(WIDTH, layout.height)
    colour = dict(zip(names, SEQUENCE_COLORS))

    def fill(block: int, name: str):
        return SHARED_COLOR if len(holders[block]) > 1 else colour[name]

    for n in names:
        _draw_sequence(ax, layout, n, tables[n], lengths[n], size, colour[n], fill)
    _draw_pool(ax, layout, cache, holders, filled, fill)
    _draw_legend(ax, holders, cache)
    return fig


def _draw_sequence(ax, layout: _Layout, name, table, length, size, colour, fill) -> None:
    """One sequence's logical blocks, its label on the far side from the pool, and a line from
    each block to its physical block (to the id over the pool, or to the pool's bottom)."""
    from matplotlib.lines import Line2D

    line = text_size("0", TEXT_PT)[1]
    over = name in layout.above
    y = layout.upper_y if over else layout.lower_y
    x0 = layout.starts[name]
    label_y = y + BLOCK_H + line / 2 if over else y - line / 2
    ax.text(x0, label_y, _label(name, table), ha="left", va="center", fontsize=TEXT_PT, color=INK)
    for i, block in enumerate(table):
        x = x0 + i * layout.pitch
        _block(
            ax,
            x,
            y,
            layout.block_w,
            min(size, length - i * size),
            size,
            fill(block, name),
            tag=f"{name} {i}",
        )
        pool_x = layout.x0 + block * layout.pitch + layout.block_w / 2
        start = (x + layout.block_w / 2, y if over else y + BLOCK_H)
        end = (pool_x, layout.pool_y + BLOCK_H + line if over else layout.pool_y)
        ax.add_line(
            Line2D(
                [start[0], end[0]],
                [start[1], end[1]],
                color=colour,
                linewidth=1.3,
                zorder=1,
                label=f"_link {name} {i}",
            )
        )


def _draw_pool(ax, layout: _Layout, cache, holders, filled, fill) -> None:
    line = text_size("0", TEXT_PT)[1]
    y = layout.pool_y
    ax.text(
        layout.x0 - GAP,
        y + BLOCK_H / 2,
        "pool",
        ha="right",
        va="center",
        fontsize=TEXT_PT,
        color=INK,
    )
    for block in range(cache.num_blocks):
        x = layout.x0 + block * layout.pitch
        held = block in holders
        _block(
            ax,
            x,
            y,
            layout.block_w,
            filled.get(block, 0),
            cache.block_size,
            fill(block, holders[block][0]) if held else "white",
            tag=f"pool {block}",
            free=not held,
        )
        ax.text(
            x + layout.block_w / 2,
            y + BLOCK_H + line / 2,
            str(block),
            ha="center",
            va="center",
            fontsize=TEXT_PT,
            color=INK,
        )


def _draw_legend(ax, holders, cache) -> None:
    entries = []
    if any(len(h) > 1 for h in holders.values()):
        entries.append(("shared block", SHARED_COLOR))
    entries.append(("empty slot", "white"))
    if len(holders) < cache.num_blocks:
        entries.append(("free block", "white", {"linestyle": "--", "edgecolor": INK}))
    role_legend(ax, entries, fontsize=TEXT_PT)
