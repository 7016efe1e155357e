"""The tiled (FlashAttention) loop: what sits in fast memory, what stays in slow memory,
:func:`flash_loop_diagram`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from ..figures import FULL_WIDTH, KEY, OUTPUT, QUERY, VALUE
from .draw import _outline, draw_arrow, draw_box, new_canvas
from .matrix import draw_matrix
from .primitives import (
    FAST_MEMORY,
    INK,
    LABEL_PT,
    MARGIN,
    NAME_PT,
    NEUTRAL,
    SCORES,
    SLOW_MEMORY,
    Rect,
    _at_most,
    _block_rect,
    _clear_gap,
    _fit_unit,
    _label_lines,
    _line_height,
    _matrix_size,
    _pack,
    _positive_int,
    _stack_size,
    text_size,
)

_PAD = 0.1  # inside a memory's panel
_TITLE_H = _line_height(NAME_PT) + 0.08  # a panel's title
_UPRIGHT = {"lse", "m", "l"}  # one number per query row: drawn as columns
_LOOP = [  # (indent, line) of the loop written beside fast memory
    (0, "for each query block $i$:"),
    (1, "load $Q_i$; $m = -\\infty$, $\\ell = 0$, acc $= 0$"),
    (1, "for each key block $j$:"),
    (2, "load $K_j$, $V_j$"),
    (2, "tile $= Q_i K_j^\\top / \\sqrt{D_k}$"),
    (2, "update $m$, $\\ell$, acc"),
    (1, "write $O_i =$ acc $/\\, \\ell$"),
    (1, "write $\\mathrm{lse}_i = m + \\log \\ell$"),
]
_INDENT = 0.18
_LOOP_STEP = 1.45 * LABEL_PT / 72  # roots and superscripts need more than one line
_ARROW_LABELS = ["load $Q_i$", "load $K_j$, $V_j$", "write $O_i$, lse$_i$"]
# Digits have no descenders: their ink is the cap height, 0.73 of the font size in DejaVu Sans,
# not the line's height that text_size measures, so a number fits a tile that tall (+ margin).
_DIGIT_H = 0.73 * LABEL_PT / 72


class _Item(NamedTuple):
    shape: tuple[int, ...]
    dims: tuple[str, ...]
    name: str
    color: str
    blocks: tuple[int | None, int | None] = (None, None)  # heavier lines every (rows, cols)


@dataclass(frozen=True)
class _Memory:
    """A memory's panel: a bottom row of grids labelled below, and two grids standing on it."""

    title: str
    color: str
    items: dict[str, _Item]
    row: tuple[str, ...]  # the bottom row, left to right
    over: tuple[tuple[str, str, str], ...]  # (grid, the grid it stands on, side of its labels)


@dataclass(frozen=True)
class _MemoryPlan:
    x: dict[str, float]  # left of each grid of the bottom row
    h: dict[str, float]  # height of every grid
    right: float  # right edge of the panel
    panel_h: float  # height the panel needs
    below: float  # room for the labels under the bottom row


@dataclass(frozen=True)
class _FlashPlan:
    slow: _MemoryPlan
    fast: _MemoryPlan
    fast_h: float  # fast memory's panel: as tall as the loop written beside it, at least


def flash_loop_diagram(T: int, S: int, Bq: int, Bk: int, Dk: int, Dv: int):
    r"""The tiled (FlashAttention) loop: what sits in fast memory, what stays in slow memory.

    Top, slow memory: :math:`Q` ``(T, Dk)`` cut into blocks of ``Bq`` rows, :math:`K^\top`
    ``(Dk, S)`` and :math:`V` ``(S, Dv)`` into blocks of ``Bk`` keys, the output :math:`O`
    ``(T, Dv)`` and :math:`\operatorname{lse}` ``(T,)``; the scores ``(T, S)`` are never stored,
    only visited tile by tile, in the numbered order (for each query block, every key block).
    Bottom, fast memory: one query block :math:`Q_i`, one key/value block :math:`K_j, V_j`,
    the score tile ``(Bq, Bk)``, and the running :math:`m`, :math:`\ell` and accumulator of
    the query block. Heavy outlines mark the blocks of the tile being computed.

    Parameters
    ----------
    T, S : int
        Queries and keys.
    Bq, Bk : int
        Tile sizes: query rows and key columns per tile (at most ``T`` and ``S``; at most 12
        blocks along each side).
    Dk, Dv : int
        Query/key and value widths.

    Returns
    -------
    matplotlib.figure.Figure
        The diagram: white, at most ``sdpa_book.figures.FULL_WIDTH`` wide, not registered
        with pyplot.

    Raises
    ------
    TypeError
        If a size is not an integer.
    ValueError
        If a size is not positive, a tile is larger than its side (``Bq > T``, ``Bk > S``), or
        there are more than 12 blocks along a side.

    Examples
    --------
    >>> from sdpa_book.diagrams import flash_loop_diagram, figure_texts
    >>> texts = figure_texts(flash_loop_diagram(T=6, S=8, Bq=2, Bk=4, Dk=3, Dv=2))
    >>> [t for t in texts if t.startswith("(")]  # slow: Q, tiles, O, lse, K^T, V; fast: Q_i, ...
    ['(6, 3)', '(6, 8)', '(6, 2)', '(6,)', '(3, 8)', '(8, 2)',
     '(2, 3)', '(2, 4)', '(2, 2)', '(2,)', '(2,)', '(3, 4)', '(4, 2)']
    >>> [t for t in texts if t.isdigit()]  # the tiles' order: 3 query blocks x 2 key blocks
    ['1', '2', '3', '4', '5', '6']
    """
    T, S, Bq, Bk, Dk, Dv = (
        _positive_int(v, n)
        for v, n in ((T, "T"), (S, "S"), (Bq, "Bq"), (Bk, "Bk"), (Dk, "Dk"), (Dv, "Dv"))
    )
    if Bq > T:
        raise ValueError(
            f"Bq must be at most T: a query block holds at most T rows; got Bq={Bq}, T={T}"
        )
    if Bk > S:
        raise ValueError(
            f"Bk must be at most S: a key block holds at most S keys; got Bk={Bk}, S={S}"
        )
    n_q, n_k = -(-T // Bq), -(-S // Bk)
    _at_most(n_q, 12, "the number of query blocks T / Bq")
    _at_most(n_k, 12, "the number of key blocks S / Bk")
    current = (min(1, n_q - 1), min(1, n_k - 1))  # the tile being computed: (i, j)
    slow, fast = _memories(T, S, Bq, Bk, Dk, Dv)
    labels = {
        k: _stack_size(_label_lines(it.name, it.dims, it.shape, "s", "s")["s"])
        for k, it in {**slow.items, **fast.items}.items()
    }
    loop_w = max(text_size(t)[0] + d * _INDENT for d, t in _LOOP) + 0.1
    unit, width, height, plan = _fit_unit(
        lambda unit: _layout(unit, slow, fast, labels, loop_w), 0.2, FULL_WIDTH, 5.8
    )
    fig, ax = new_canvas(width, height)
    slow_box = _panel(ax, slow, height - MARGIN, plan.slow.panel_h, plan.slow.right)
    grids = _draw_memory(ax, slow, plan.slow, slow_box, unit, 0.0)
    _draw_tiles(ax, grids["tiles"], (T, S), (Bq, Bk), current)
    _highlight_blocks(ax, grids, (T, S, Bq, Bk, Dk, Dv), current)
    fast_box = _panel(ax, fast, MARGIN + plan.fast_h, plan.fast_h, plan.fast.right)
    h = plan.fast.h
    content_h = max(h["K_j^T"], h["V_j"]) + 0.07 + h["Q_i"] + plan.fast.below
    lift = max(0.0, (plan.fast_h - _TITLE_H - _PAD - content_h) / 2)  # centred beside the loop
    _draw_memory(ax, fast, plan.fast, fast_box, unit, lift)
    _draw_loop(ax, plan.fast.right + 0.3, MARGIN + plan.fast_h)
    _draw_traffic(ax, slow_box, fast_box)
    return fig


def _memories(T: int, S: int, Bq: int, Bk: int, Dk: int, Dv: int) -> tuple[_Memory, _Memory]:
    """Slow memory holds the whole matrices (in blocks); fast memory one block of each."""
    slow = _Memory(
        "slow memory (HBM)",
        SLOW_MEMORY,
        {
            "Q": _Item((T, Dk), ("T", "D_k"), "$Q$", QUERY, (Bq, None)),
            "tiles": _Item((T, S), ("T", "S"), "scores: never stored", SCORES, (Bq, Bk)),
            "O": _Item((T, Dv), ("T", "D_v"), "$O$", OUTPUT, (Bq, None)),
            "lse": _Item((T,), ("T",), "lse", OUTPUT, (Bq, None)),
            "K^T": _Item((Dk, S), ("D_k", "S"), "$K^\\top$", KEY, (None, Bk)),
            "V": _Item((S, Dv), ("S", "D_v"), "$V$", VALUE, (Bk, None)),
        },
        ("Q", "tiles", "O", "lse"),
        (("K^T", "tiles", "left"), ("V", "O", "right")),
    )
    fast = _Memory(
        "fast memory (SRAM)",
        FAST_MEMORY,
        {
            "Q_i": _Item((Bq, Dk), ("B_q", "D_k"), "$Q_i$", QUERY),
            "tile": _Item((Bq, Bk), ("B_q", "B_k"), "score tile", SCORES),
            "acc": _Item((Bq, Dv), ("B_q", "D_v"), "acc", OUTPUT),
            "m": _Item((Bq,), ("B_q",), "$m$", NEUTRAL),
            "l": _Item((Bq,), ("B_q",), "$\\ell$", NEUTRAL),
            "K_j^T": _Item((Dk, Bk), ("D_k", "B_k"), "$K_j^\\top$", KEY),
            "V_j": _Item((Bk, Dv), ("B_k", "D_v"), "$V_j$", VALUE),
        },
        ("Q_i", "tile", "acc", "m", "l"),
        (("K_j^T", "tile", "left"), ("V_j", "acc", "right")),
    )
    return slow, fast


def _layout(unit: float, slow: _Memory, fast: _Memory, labels, loop_w: float):
    """``(width, height, plan)`` for cells of side ``unit``: slow memory on top, fast memory
    and the loop below."""
    s = _memory_layout(unit, slow, labels)
    f = _memory_layout(unit, fast, labels)
    loop_h = len(_LOOP) * _LOOP_STEP + _line_height(NAME_PT)
    fast_h = max(f.panel_h, loop_h + _TITLE_H + _PAD)  # the loop is written beside it
    width = max(s.right, f.right + 0.3 + loop_w) + MARGIN + 0.05
    height = MARGIN + s.panel_h + 0.55 + fast_h + MARGIN
    return width, height, _FlashPlan(s, f, fast_h)


def _memory_layout(unit: float, memory: _Memory, labels) -> _MemoryPlan:
    """The bottom row's places (each gap clearing the labels), the panel's right edge and
    height."""
    size = {k: _matrix_size(it.shape, unit, column=k in _UPRIGHT) for k, it in memory.items.items()}
    w = {k: wh[0] for k, wh in size.items()}
    h = {k: wh[1] for k, wh in size.items()}
    row = memory.row
    (left, _, _), (right, under_right, _) = memory.over
    first, last = row[0], row[-1]
    x0 = MARGIN + _PAD
    x0 += max(0.0, (labels[first][0] - w[first]) / 2, labels[left][0] + 0.12 - w[first] - 0.1)
    gaps = [
        _clear_gap(w[a], w[b], labels[a][0], labels[b][0], 0.12, 0.07) for a, b in zip(row, row[1:])
    ]
    x = dict(zip(row, _pack([w[k] for k in row], gaps, start=x0)))
    right_edge = max(
        x[last] + w[last] / 2 + labels[last][0] / 2,
        x[under_right] + w[under_right] + 0.1 + labels[right][0],
    )
    below = max(labels[k][1] for k in row) + 0.06
    top_h = max(h[left], h[right], labels[right][1], labels[left][1])
    panel_h = _TITLE_H + top_h + 0.07 + h[first] + below + _PAD
    return _MemoryPlan(x, h, right_edge + _PAD, panel_h, below)


def _panel(ax, memory: _Memory, y_top: float, panel_h: float, right: float) -> Rect:
    """The memory's tinted panel, its top at ``y_top``, and its title."""
    rect = draw_box(
        ax,
        MARGIN,
        y_top - panel_h,
        right - MARGIN,
        panel_h,
        None,
        color=memory.color,
        fill=0.08,
        tag=memory.title,
    )
    ax.text(
        MARGIN + _PAD, y_top - 0.05, memory.title, ha="left", va="top", fontsize=NAME_PT, color=INK
    )
    return rect


def _draw_memory(ax, memory: _Memory, plan: _MemoryPlan, box: Rect, unit: float, lift: float):
    """The bottom row of grids (``lift`` above the panel's bottom and the labels), then the two
    grids standing on it; ``{tag: Rect}``."""
    y_row = box.y0 + _PAD + plan.below + lift
    grids = {}
    for k in memory.row:
        it = memory.items[k]
        grids[k] = draw_matrix(
            ax,
            plan.x[k],
            y_row,
            it.shape,
            unit=unit,
            color=it.color,
            name=it.name,
            dims=it.dims,
            name_at="below",
            shape_at="below",
            tag=k,
            row_blocks=it.blocks[0],
            col_blocks=it.blocks[1],
            linestyle="--" if k == "tiles" else "-",
            fill=0.2 if k == "tiles" else 0.35,
            column=k in _UPRIGHT,
        )
    floor = grids[memory.row[0]].y1 + 0.1
    for k, under, side in memory.over:
        it = memory.items[k]
        grids[k] = draw_matrix(
            ax,
            plan.x[under],
            grids[under].y1 + 0.07,
            it.shape,
            unit=unit,
            color=it.color,
            name=it.name,
            dims=it.dims,
            name_at=side,
            shape_at=side,
            tag=k,
            row_blocks=it.blocks[0],
            col_blocks=it.blocks[1],
            label_floor=floor,
        )
    return grids


def _highlight(ax, rect: Rect, color):
    """Mark the block being worked on: a stronger tint and a heavy outline."""
    from matplotlib.colors import to_rgba

    _outline(ax, rect, INK, linewidth=2.0, fill=to_rgba(color, 0.55))


def _draw_tiles(ax, tiles: Rect, sizes, blocks, current) -> None:
    """Number the score tiles in loop order (where the number fits); highlight the current."""
    (T, S), (Bq, Bk) = sizes, blocks
    n_q, n_k = -(-T // Bq), -(-S // Bk)
    for a in range(n_q):
        for b in range(n_k):
            part = _block_rect(
                tiles, (T, S), (a * Bq, min(T, (a + 1) * Bq)), (b * Bk, min(S, (b + 1) * Bk))
            )
            if (a, b) == current:
                _highlight(ax, part, SCORES)
            number = str(a * n_k + b + 1)
            number_w = text_size(number, LABEL_PT)[0]
            if number_w + 0.04 <= part.width and _DIGIT_H + 0.04 <= part.height:
                ax.text(
                    part.cx, part.cy, number, ha="center", va="center", fontsize=LABEL_PT, color=INK
                )


def _highlight_blocks(ax, grids, sizes, current) -> None:
    """Highlight the blocks of Q, O, lse, K^T and V that the current tile reads and writes."""
    T, S, Bq, Bk, Dk, Dv = sizes
    i, j = current
    rows_i = (i * Bq, min(T, (i + 1) * Bq))
    cols_j = (j * Bk, min(S, (j + 1) * Bk))
    _highlight(ax, _block_rect(grids["Q"], (T, Dk), rows_i, (0, Dk)), QUERY)
    _highlight(ax, _block_rect(grids["O"], (T, Dv), rows_i, (0, Dv)), OUTPUT)
    _highlight(ax, _block_rect(grids["lse"], (T, 1), rows_i, (0, 1)), OUTPUT)
    _highlight(ax, _block_rect(grids["K^T"], (Dk, S), (0, Dk), cols_j), KEY)
    _highlight(ax, _block_rect(grids["V"], (S, Dv), cols_j, (0, Dv)), VALUE)


def _draw_loop(ax, x: float, y_top: float) -> None:
    """The loop's pseudo-code, on fixed baselines whatever the height of the maths."""
    ax.text(x, y_top - 0.05, "the loop", ha="left", va="top", fontsize=NAME_PT, color=INK)
    y = y_top - _TITLE_H - 0.1
    for depth, text in _LOOP:
        ax.text(
            x + depth * _INDENT, y, text, ha="left", va="baseline", fontsize=LABEL_PT, color=INK
        )
        y -= _LOOP_STEP


def _draw_traffic(ax, slow_box: Rect, fast_box: Rect) -> None:
    """Traffic between the two memories: loads into fast memory, the results written back."""
    y_a, y_b = slow_box.y0 - 0.04, fast_box.y1 + 0.04
    for n, text in enumerate(_ARROW_LABELS):
        x_arrow = fast_box.x0 + fast_box.width * (0.2 + 0.3 * n)
        ends = ((x_arrow, y_b), (x_arrow, y_a)) if n == 2 else ((x_arrow, y_a), (x_arrow, y_b))
        draw_arrow(ax, *ends, label=text, label_side="right")
