"""FlashAttention's forward on a GPU, drawn from a page's sizes: :func:`gpu_blocks_diagram`.

A GPU runs the forward as a grid of *thread blocks*, one per (batch, head, query tile). Each
block copies its tile of queries ``Q_i`` from the GPU's slow memory (HBM) into its own fast
memory (SRAM, the streaming multiprocessor's shared memory), keeps its running ``m``, ``l``
and accumulator there, streams every tile ``K_j``, ``V_j`` of the same head past them, and
writes its rows of the output once. The diagram draws the HBM holding ``Q``, ``K``, ``V`` at
the top, three of the blocks in the middle (the first two and the last, with their grid
indices), the HBM receiving ``O`` at the bottom, and the count of blocks against the count of
streaming multiprocessors (SMs) under it.
"""

from __future__ import annotations

from ..figures import KEY, OUTPUT, QUERY, VALUE
from .draw import draw_arrow, draw_box, new_canvas, role_legend
from .primitives import FAST_MEMORY, SLOW_MEMORY, _positive_int
from .primitives import text_size as _text_size

__all__ = ["gpu_blocks_diagram"]

WIDTH = 3.7  # inches: a phone's column with 11 pt subscripts (sdpa_book.diagrams.primitives)
TEXT_PT = 10  # words and numbers
MATH_PT = 11  # maths with subscripts: the scripts stay at 7.7 pt
MARGIN = 0.08
GAP = 0.08
ROW_H = 0.3  # a tile or a state row inside a block
PAD = 0.06  # inside a box
LINE = 1.4 * TEXT_PT / 72  # one line of text at TEXT_PT
ARROW_DROP = 0.42  # between a memory strip and the blocks
LEGEND_H = 0.5  # two rows of legend


def _block_ids(B: int, H: int, n_q: int) -> list[tuple[int, int, int]]:
    """The blocks drawn: the first two of the grid and the last (all of them if fewer)."""
    grid = B * H * n_q
    flat = [0, 1, grid - 1] if grid > 3 else list(range(grid))
    return [(f // (H * n_q), f // n_q % H, f % n_q) for f in dict.fromkeys(flat)]


def _check_fit(text: str, fontsize: float, room: float) -> None:
    width = _text_size(text, fontsize)[0]
    if width > room + 1e-9:
        raise ValueError(
            f"sizes must give labels that fit in the width; got {text!r}, {width:.2f} in wide "
            f"in {room:.2f} in"
        )


def gpu_blocks_diagram(
    B: int, H: int, T: int, S: int, Dk: int, Dv: int, *, block_q: int, n_sm: int
):
    """Thread blocks over query tiles, each with its SRAM, all reading ``K`` and ``V`` from HBM.

    Parameters
    ----------
    B, H, T, S, Dk, Dv : int
        Batch, heads, queries, keys and the two head widths; positive.
    block_q : int
        ``Bq``, the queries of one block's tile; positive.
    n_sm : int
        The GPU's streaming multiprocessors; positive.

    Returns
    -------
    matplotlib.figure.Figure
        3.7 in wide, white, not registered with pyplot. Top, a grey HBM strip holding ``Q``
        ``(T, Dk)``, ``K`` ``(S, Dk)`` and ``V`` ``(S, Dv)`` (the shapes of one batch
        element and head); middle, the
        first two blocks of the grid and its last (tagged ``"block b h i"``), each labelled
        ``"(b, h, i)"`` and holding a sky-blue SRAM (``"sram b h i"``) with the tiles
        ``Q_i``, ``K_j``, ``V_j`` and the state ``m, l, acc``; arrows from ``Q`` to every
        ``Q_i`` and from ``K`` and ``V`` to every block's ``K_j`` and ``V_j``, and from every
        state down to ``O`` ``(T, Dv)`` in a second HBM strip; then the line
        ``"blocks (b, h, i): B × H × ceil(T / Bq) = N on n_sm SMs"`` and a legend of the roles.

    Raises
    ------
    TypeError
        If a size is not an integer.
    ValueError
        If a size is not positive, ``block_q`` exceeds ``T``, or a label would not fit.

    Examples
    --------
    >>> from sdpa_book.diagrams import figure_texts
    >>> fig = gpu_blocks_diagram(1, 2, 256, 256, 64, 64, block_q=64, n_sm=132)
    >>> [t for t in figure_texts(fig) if t.startswith("(0,")]  # (batch, head, query tile)
    ['(0, 0, 0)', '(0, 0, 1)', '(0, 1, 3)']
    >>> figure_texts(fig)[-7]
    'blocks (b, h, i): 1 × 2 × 4 = 8 on 132 SMs'
    """
    B, H, T, S, Dk, Dv = (
        _positive_int(v, n) for v, n in zip((B, H, T, S, Dk, Dv), ("B", "H", "T", "S", "Dk", "Dv"))
    )
    block_q, n_sm = _positive_int(block_q, "block_q"), _positive_int(n_sm, "n_sm")
    if block_q > T:
        raise ValueError(f"block_q must be at most T = {T}; got block_q={block_q}")
    n_q = -(-T // block_q)
    blocks = _block_ids(B, H, n_q)
    height = MARGIN + LEGEND_H + LINE + 2 * (2 * LINE + 2 * PAD) + 2 * ARROW_DROP
    block_h = 2 * ROW_H + 3 * PAD + GAP + LINE + 2 * PAD
    fig, ax = new_canvas(WIDTH, height + block_h + MARGIN)
    top = height + block_h  # the top of the upper strip
    strip_h = 2 * LINE + 2 * PAD
    sources = _strip(
        ax,
        top - strip_h,
        [("Q", (T, Dk), QUERY), ("K", (S, Dk), KEY), ("V", (S, Dv), VALUE)],
    )
    block_y = top - strip_h - ARROW_DROP - block_h
    out_y = block_y - ARROW_DROP - strip_h
    (out,) = _strip(ax, out_y, [("O", (T, Dv), OUTPUT)]).values()
    columns = _columns(len(blocks))
    for (b, h, i), (x0, x1) in zip(blocks, columns):
        tiles, state = _block(ax, x0, x1, block_y, block_h, (b, h, i))
        for name, tile in zip("QKV", tiles):
            src = sources[name]
            spread = (x0 + x1) / 2 / WIDTH - 0.5  # arrows leave each source fanned out
            start = (src.cx + spread * 0.5 * src.width, src.y0)
            draw_arrow(
                ax, start, (tile.cx, tile.y1), color={"Q": QUERY, "K": KEY, "V": VALUE}[name]
            )
        draw_arrow(
            ax, (state.cx, block_y), (out.cx + (state.cx - WIDTH / 2) * 0.3, out.y1), color=OUTPUT
        )
    if B * H * n_q > 3:  # blocks left out between the last two
        ax.text(
            (columns[1][1] + columns[2][0]) / 2,
            block_y + block_h / 2,
            "…",
            ha="center",
            va="center",
            fontsize=TEXT_PT,
        )
    count = f"blocks (b, h, i): {B} × {H} × {n_q} = {B * H * n_q} on {n_sm} SMs"
    _check_fit(count, TEXT_PT, WIDTH - 2 * MARGIN)
    ax.text(
        WIDTH / 2, MARGIN + LEGEND_H + LINE / 2, count, ha="center", va="center", fontsize=TEXT_PT
    )
    entries = [("query", QUERY), ("key", KEY), ("value", VALUE), ("output, state", OUTPUT),
               ("SRAM", FAST_MEMORY), ("HBM", SLOW_MEMORY)]  # fmt: skip
    role_legend(ax, entries, ncols=3, fontsize=TEXT_PT, anchor=(0.5, MARGIN / ax.get_ylim()[1]))
    return fig


def _strip(ax, y: float, items) -> dict:
    """A grey HBM strip at ``y`` labelled "HBM", holding one box per ``(name, shape, colour)``:
    the name over the shape in numbers. Returns ``{name: Rect}``."""
    strip_h = 2 * LINE + 2 * PAD
    draw_box(
        ax, MARGIN, y, WIDTH - 2 * MARGIN, strip_h, color=SLOW_MEMORY, fill=0.12, tag=f"hbm {y:.3f}"
    )
    label_w = _text_size("HBM", TEXT_PT)[0]
    ax.text(MARGIN + PAD, y + strip_h / 2, "HBM", ha="left", va="center", fontsize=TEXT_PT)
    x0 = MARGIN + 2 * PAD + label_w + GAP
    room = (WIDTH - MARGIN - PAD - x0 - GAP * (len(items) - 1)) / len(items)
    rects = {}
    for k, (name, shape, colour) in enumerate(items):
        shape_text = "(" + ", ".join(str(s) for s in shape) + ")"
        _check_fit(shape_text, TEXT_PT, room - PAD)
        x = x0 + k * (room + GAP)
        rects[name] = draw_box(
            ax, x, y + PAD / 2, room, strip_h - PAD, color=colour, fill=0.25, tag=name
        )
        ax.text(
            x + room / 2,
            y + strip_h / 2 + LINE / 2,
            name,
            ha="center",
            va="center",
            fontsize=TEXT_PT,
        )
        ax.text(
            x + room / 2,
            y + strip_h / 2 - LINE / 2,
            shape_text,
            ha="center",
            va="center",
            fontsize=TEXT_PT,
        )
    return rects


def _columns(n: int) -> list[tuple[float, float]]:
    """The x-extents of ``n`` block columns, a gap for an ellipsis before the last of three."""
    dots = 0.22 if n == 3 else 0.0
    width = (WIDTH - 2 * MARGIN - dots - GAP * (n - 1)) / n
    xs, x = [], MARGIN
    for k in range(n):
        if k == 2:
            x += dots
        xs.append((x, x + width))
        x += width + GAP
    return xs


def _block(ax, x0: float, x1: float, y: float, h: float, index):
    """One thread block: its SRAM with the tiles Q_i, K_j, V_j over the state row, its grid
    index under them. Returns the three tiles' Rects and the state's."""
    tag = " ".join(str(v) for v in index)
    draw_box(ax, x0, y, x1 - x0, h, color="#6e6e6e", fill=0.04, tag=f"block {tag}")
    label = "(" + ", ".join(str(v) for v in index) + ")"
    _check_fit(label, TEXT_PT, x1 - x0 - 2 * PAD)
    ax.text((x0 + x1) / 2, y + PAD + LINE / 2, label, ha="center", va="center", fontsize=TEXT_PT)
    sy = y + 2 * PAD + LINE
    sram_h = 2 * ROW_H + 3 * PAD
    draw_box(
        ax, x0 + PAD, sy, x1 - x0 - 2 * PAD, sram_h, color=FAST_MEMORY, fill=0.3, tag=f"sram {tag}"
    )
    inner0, inner1 = x0 + 2 * PAD, x1 - 2 * PAD
    tile_w = (inner1 - inner0 - 2 * PAD) / 3
    tiles = []
    for k, (name, colour) in enumerate([("$Q_i$", QUERY), ("$K_j$", KEY), ("$V_j$", VALUE)]):
        tx = inner0 + k * (tile_w + PAD)
        tiles.append(
            draw_box(ax, tx, sy + 2 * PAD + ROW_H, tile_w, ROW_H, name, color=colour, fill=0.35,
                     fontsize=MATH_PT, tag=f"{name[1]} {tag}")
        )  # fmt: skip
    state = draw_box(ax, inner0, sy + PAD, inner1 - inner0, ROW_H, "m, ℓ, acc", color=OUTPUT,
                     fill=0.3, fontsize=TEXT_PT, tag=f"state {tag}")  # fmt: skip
    return tiles, state
