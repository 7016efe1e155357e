"""The tiled (FlashAttention-2) loop: what sits in fast memory, what stays in slow memory, and
the order in which the tiles of scores are computed, :func:`flash_loop_diagram`.

Drawn for a phone: at most ``_MAX_WIDTH`` inches wide, the two memories one above the other,
words and numbers at ``_TEXT_PT`` and maths (whose scripts mathtext draws at 70 %) at
``_MATH_PT``, so that every glyph stays at 9 CSS px or more in a 390 px phone's column and at
10 px or more on a desktop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from ..figures import KEY, MASKED_COLOR, OUTPUT, QUERY, VALUE
from .draw import _add, _outline, draw_arrow, draw_box, new_canvas
from .matrix import draw_matrix
from .primitives import (
    FAST_MEMORY,
    INK,
    MARGIN,
    NEUTRAL,
    PHONE_WIDTH,
    SCORES,
    SLOW_MEMORY,
    Rect,
    _at_most,
    _block_rect,
    _clear_gap,
    _fit_unit,
    _flag,
    _line_height,
    _matrix_size,
    _mix,
    _pack,
    _positive_int,
    text_size,
)

_TEXT_PT = 10  # words and numbers
_MATH_PT = 11  # maths: its 7.7 pt scripts stay at 9 CSS px in a phone's column
_MAX_WIDTH = PHONE_WIDTH  # inches: a phone's column shrinks it to about 0.91
_MAX_HEIGHT = 6.5  # inches: the grids shrink (to a unit that fits) before the figure grows
_PAD = 0.1  # inside a memory's panel
_ARROWS_H = 0.5  # between the two memories
_BESIDE = 0.07  # between a grid and the labels beside it
_TITLE_H = _line_height(_MATH_PT) + 0.06  # a panel's title
_UPRIGHT = {"lse", "m", "l"}  # one number per query row: drawn as columns
_ARROW_LABELS = ["load $Q_i$", "load $K_j$, $V_j$", "write $O_i$, lse$_i$"]
# Digits have no descenders: their ink is the cap height, 0.73 of the font size in DejaVu Sans,
# not the line's height that text_size measures, so a number fits a tile that tall (+ margin).
_DIGIT_H = 0.73 * _TEXT_PT / 72


def _pt(text: str) -> float:
    """Maths (between dollars) at ``_MATH_PT``, words and numbers at ``_TEXT_PT``."""
    return _MATH_PT if "$" in text else _TEXT_PT


class _Item(NamedTuple):
    shape: tuple[int, ...]
    dims: tuple[str, ...]
    name: str
    color: str
    blocks: tuple[int | None, int | None] = (None, None)  # heavier lines every (rows, cols)

    def labels(self) -> list[tuple[str, float]]:
        """Name, symbolic shape and numeric shape, each with its font size."""
        inner = ", ".join(self.dims) + ("," if len(self.dims) == 1 else "")
        names = [(line, _pt(line)) for line in self.name.split("\n")]
        return [*names, (f"$({inner})$", _MATH_PT), (str(tuple(self.shape)), _TEXT_PT)]


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
    w: dict[str, float]  # width of every grid
    h: dict[str, float]  # height of every grid
    right: float  # right edge of what the panel holds
    panel_h: float  # height the panel needs
    below: float  # room for the labels under the bottom row


@dataclass(frozen=True)
class _FlashPlan:
    slow: _MemoryPlan
    fast: _MemoryPlan
    arrows: list[float]  # x of each arrow between the memories


class _Tiles(NamedTuple):
    """The score tiles: the sizes, and the tiles the loop computes in its order."""

    T: int
    S: int
    Bq: int
    Bk: int
    order: list[tuple[int, int]]  # (query block, key block), in the order computed
    is_causal: bool

    def span(self, a: int, b: int) -> tuple[tuple[int, int], tuple[int, int]]:
        """The queries and the keys of tile ``(a, b)``, as ``(start, stop)``."""
        rows = (a * self.Bq, min(self.T, (a + 1) * self.Bq))
        return rows, (b * self.Bk, min(self.S, (b + 1) * self.Bk))


def _visit_order(T: int, S: int, Bq: int, Bk: int, is_causal: bool) -> list[tuple[int, int]]:
    """The tiles ``(a, b)`` in the order the loop computes them: query blocks outside, key
    blocks inside; causal, a query block stops at the key block holding its last query."""
    n_k = -(-S // Bk)
    order = []
    for a in range(-(-T // Bq)):
        last_query = min(T, (a + 1) * Bq) - 1
        stop = min(n_k, last_query // Bk + 1) if is_causal else n_k
        order += [(a, b) for b in range(stop)]
    return order


def flash_loop_diagram(T: int, S: int, Bq: int, Bk: int, Dk: int, Dv: int, *, is_causal=False):
    r"""The tiled (FlashAttention-2) loop: what sits in fast memory, what stays in slow memory.

    Top, slow memory: :math:`Q` ``(T, Dk)`` cut into blocks of ``Bq`` rows, :math:`K^\top`
    ``(Dk, S)`` and :math:`V` ``(S, Dv)`` into blocks of ``Bk`` keys, the output :math:`O`
    ``(T, Dv)`` and :math:`\operatorname{lse}` ``(T,)``; the scores ``(T, S)`` are never stored,
    only computed tile by tile, each tile numbered in the order the loop computes it (for each
    query block, the key blocks left to right) where the number fits. Bottom, fast memory: one
    query block :math:`Q_i`, one key/value block :math:`K_j, V_j`, the score tile
    ``(Bq, Bk)``, and the running :math:`m`, :math:`\ell` and accumulator of the query block;
    arrows between the two load and write. Heavy outlines mark a tile being computed and the
    blocks it reads and writes.

    With ``is_causal`` (query ``i`` attends keys ``j <= i``, aligned top left): the masked
    scores, above the diagonal, are grey; the tiles entirely above it are skipped (no number,
    a dashed outline) and the loop's numbers count only the tiles computed.

    Parameters
    ----------
    T, S : int
        Queries and keys.
    Bq, Bk : int
        Tile sizes: query rows and key columns per tile (at most ``T`` and ``S``; at most 12
        blocks along each side).
    Dk, Dv : int
        Query/key and value widths.
    is_causal : bool, default False
        Draw the causal loop: masked scores, skipped tiles, numbers of the tiles computed.

    Returns
    -------
    matplotlib.figure.Figure
        The diagram: white, at most 3.7 in wide (a phone's column), not registered with
        pyplot.

    Raises
    ------
    TypeError
        If a size is not an integer, or ``is_causal`` not a bool.
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

    Causal, the tiles of keys 4 to 7 for queries 0 to 3 lie above the diagonal: never
    computed, and the loop's numbers count the four it computes.

    >>> texts = figure_texts(flash_loop_diagram(6, 8, 2, 4, 3, 2, is_causal=True))
    >>> [t for t in texts if t.isdigit()]
    ['1', '2', '3', '4']
    """
    T, S, Bq, Bk, Dk, Dv = (
        _positive_int(v, n)
        for v, n in ((T, "T"), (S, "S"), (Bq, "Bq"), (Bk, "Bk"), (Dk, "Dk"), (Dv, "Dv"))
    )
    is_causal = _flag(is_causal, "is_causal")
    if Bq > T:
        raise ValueError(
            f"Bq must be at most T: a query block holds at most T rows; got Bq={Bq}, T={T}"
        )
    if Bk > S:
        raise ValueError(
            f"Bk must be at most S: a key block holds at most S keys; got Bk={Bk}, S={S}"
        )
    _at_most(-(-T // Bq), 12, "the number of query blocks T / Bq")
    _at_most(-(-S // Bk), 12, "the number of key blocks S / Bk")
    tiles = _Tiles(T, S, Bq, Bk, _visit_order(T, S, Bq, Bk, is_causal), is_causal)
    current = _current(tiles)
    slow, fast = _memories(T, S, Bq, Bk, Dk, Dv)
    unit, width, height, plan = _fit_unit(
        lambda unit: _layout(unit, slow, fast), 0.2, _MAX_WIDTH, _MAX_HEIGHT
    )
    fig, ax = new_canvas(width, height)
    right = max(plan.slow.right, plan.fast.right)
    slow_box = _panel(ax, slow, height - MARGIN, plan.slow.panel_h, right)
    grids = _draw_memory(ax, slow, plan.slow, slow_box, unit)
    _draw_tiles(ax, grids["tiles"], tiles, current)
    _highlight_blocks(ax, grids, (T, S, Dk, Dv), tiles.span(*current))
    fast_top = slow_box.y0 - _ARROWS_H
    fast_box = _panel(ax, fast, fast_top, plan.fast.panel_h, right)
    _draw_memory(ax, fast, plan.fast, fast_box, unit)
    _draw_traffic(ax, slow_box, fast_box, plan.arrows)
    return fig


def _current(tiles: _Tiles) -> tuple[int, int]:
    """The tile shown being computed: the second key block of the second query block, or the
    nearest one the loop computes."""
    a = min(1, tiles.order[-1][0])
    return max((t for t in tiles.order if t[0] == a and t[1] <= 1), key=lambda t: t[1])


def _memories(T: int, S: int, Bq: int, Bk: int, Dk: int, Dv: int) -> tuple[_Memory, _Memory]:
    """Slow memory holds the whole matrices (in blocks); fast memory one block of each."""
    slow = _Memory(
        "slow memory (HBM)",
        SLOW_MEMORY,
        {
            "Q": _Item((T, Dk), ("T", "D_k"), "$Q$", QUERY, (Bq, None)),
            "tiles": _Item((T, S), ("T", "S"), "scores,\nnever stored", SCORES, (Bq, Bk)),
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


# --------------------------------------------------------------------------------------------
# Layout


def _stack(lines: list[tuple[str, float]]) -> tuple[float, float]:
    """Width and height of a stack of label lines."""
    width = max(text_size(t, pt)[0] for t, pt in lines)
    return width, sum(_line_height(pt) for _, pt in lines)


def _layout(unit: float, slow: _Memory, fast: _Memory):
    """``(width, height, plan)`` for cells of side ``unit``: slow memory, the traffic and fast
    memory, stacked."""
    s, f = _memory_layout(unit, slow), _memory_layout(unit, fast)
    x0 = MARGIN + _PAD + 0.2
    widths = [text_size(label, _MATH_PT)[0] + 0.06 + 0.25 for label in _ARROW_LABELS]
    arrows = _pack([0.0] * len(widths), widths[:-1], start=x0)
    width = max(s.right, f.right, arrows[-1] + widths[-1]) + MARGIN
    height = MARGIN + s.panel_h + _ARROWS_H + f.panel_h + MARGIN
    return width, height, _FlashPlan(s, f, arrows)


def _memory_layout(unit: float, memory: _Memory) -> _MemoryPlan:
    """The bottom row's places (each gap clearing the labels), the panel's right edge and
    height (the title beside the grids standing on the row, where they leave room)."""
    items = memory.items
    size = {k: _matrix_size(it.shape, unit, column=k in _UPRIGHT) for k, it in items.items()}
    w = {k: wh[0] for k, wh in size.items()}
    h = {k: wh[1] for k, wh in size.items()}
    labels = {k: _stack(it.labels()) for k, it in items.items()}
    row = memory.row
    gaps = [
        _clear_gap(w[a], w[b], labels[a][0], labels[b][0], 0.12, 0.07) for a, b in zip(row, row[1:])
    ]
    x = dict(zip(row, _pack([w[k] for k in row], gaps)))
    # Above the bottom row: the grids standing on it and their labels, as (left, right, top),
    # the tops measured from the row's top.
    above = []
    for k, under, side in memory.over:
        label_w, label_h = labels[k]
        label_x = x[under] - _BESIDE - label_w if side == "left" else x[under] + w[k] + _BESIDE
        label_top = max(0.07 + h[k] / 2 + label_h / 2, 0.1 + label_h)
        above += [(x[under], x[under] + w[k], 0.07 + h[k] + 0.06)]  # 0.06 below the panel's top
        above += [(label_x, label_x + label_w, label_top + 0.03)]
    spans = [(x[k] + (w[k] - max(w[k], labels[k][0])) / 2, w[k], labels[k][0]) for k in row]
    shift = MARGIN + _PAD - min([left for left, _, _ in spans] + [a[0] for a in above])
    x = {k: v + shift for k, v in x.items()}
    right = max([left + max(wk, lw) for left, wk, lw in spans] + [a[1] for a in above]) + shift
    title_end = MARGIN + _PAD + text_size(memory.title, _MATH_PT)[0] + 0.1
    under_title = [top for left, _, top in above if left + shift < title_end]
    band = max([top for _, _, top in above] + [max(under_title, default=0.0) + _TITLE_H])
    below = max(labels[k][1] for k in row) + 0.06
    panel_h = band + max(h[k] for k in row) + below + _PAD
    return _MemoryPlan(x, w, h, right + _PAD, panel_h, below)


# --------------------------------------------------------------------------------------------
# Drawing


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
        MARGIN + _PAD,
        y_top - 0.05,
        memory.title,
        ha="left",
        va="top",
        fontsize=_MATH_PT,
        color=INK,
    )
    return rect


def _write(ax, rect: Rect, side: str, lines, floor: float | None = None) -> None:
    """Label lines below a grid (centred), or beside it (centred on it, above ``floor``)."""
    total = sum(_line_height(pt) for _, pt in lines)
    if side == "below":
        x, y, ha = rect.cx, rect.y0 - 0.05, "center"
    else:
        x = rect.x0 - _BESIDE if side == "left" else rect.x1 + _BESIDE
        ha = "right" if side == "left" else "left"
        y = max(rect.cy + total / 2, (floor or -1e9) + total)
    for text, pt in lines:
        step = _line_height(pt)
        ax.text(x, y - step / 2, text, ha=ha, va="center_baseline", fontsize=pt, color=INK)
        y -= step


def _draw_memory(ax, memory: _Memory, plan: _MemoryPlan, box: Rect, unit: float):
    """The bottom row of grids, then the two grids standing on it; ``{tag: Rect}``."""
    y_row = box.y0 + _PAD + plan.below
    grids = {}
    for k in memory.row:
        it = memory.items[k]
        grids[k] = _grid(ax, plan.x[k], y_row, it, unit, k)
        _write(ax, grids[k], "below", it.labels())
    floor = max(grids[k].y1 for k in memory.row) + 0.1
    for k, under, side in memory.over:
        it = memory.items[k]
        grids[k] = _grid(ax, plan.x[under], grids[under].y1 + 0.07, it, unit, k)
        _write(ax, grids[k], side, it.labels(), floor=floor)
    return grids


def _grid(ax, x: float, y: float, it: _Item, unit: float, tag: str) -> Rect:
    return draw_matrix(
        ax,
        x,
        y,
        it.shape,
        unit=unit,
        color=it.color,
        name_at=None,
        shape_at=None,
        tag=tag,
        row_blocks=it.blocks[0],
        col_blocks=it.blocks[1],
        linestyle="--" if tag == "tiles" else "-",
        fill=0.2 if tag == "tiles" else 0.35,
        column=tag in _UPRIGHT,
    )


def _highlight(ax, rect: Rect, color):
    """Mark the block being worked on: a stronger tint and a heavy outline."""
    from matplotlib.colors import to_rgba

    _outline(ax, rect, INK, linewidth=2.0, fill=to_rgba(color, 0.55))


def _draw_tiles(ax, grid: Rect, tiles: _Tiles, current: tuple[int, int]) -> None:
    """Grey the masked scores and dash the skipped tiles (causal); highlight the current
    tile; number the tiles computed, in the loop's order, where the number fits."""
    size = (tiles.T, tiles.S)
    if tiles.is_causal:
        _draw_masked(ax, grid, tiles.T, tiles.S)
        computed = set(tiles.order)
        for a in range(-(-tiles.T // tiles.Bq)):
            for b in range(-(-tiles.S // tiles.Bk)):
                if (a, b) not in computed:
                    _skipped(ax, _block_rect(grid, size, *tiles.span(a, b)), (a, b))
    _highlight(ax, _block_rect(grid, size, *tiles.span(*current)), SCORES)
    for number, (a, b) in enumerate(tiles.order, start=1):
        part = _block_rect(grid, size, *tiles.span(a, b))
        text = str(number)
        if text_size(text, _TEXT_PT)[0] + 0.04 <= part.width and _DIGIT_H + 0.04 <= part.height:
            ax.text(part.cx, part.cy, text, ha="center", va="center", fontsize=_TEXT_PT, color=INK)


def _skipped(ax, rect: Rect, tile: tuple[int, int]) -> None:
    """A tile the loop never computes: a dashed outline, tagged ``"skipped a,b"``."""
    from matplotlib.patches import Rectangle

    outline = Rectangle(
        (rect.x0, rect.y0),
        rect.width,
        rect.height,
        facecolor="none",
        edgecolor=INK,
        linewidth=0.8,
        linestyle=(0, (2, 2)),
        label=f"_tag skipped {tile[0]},{tile[1]}",
    )
    _add(ax, outline)


def _draw_masked(ax, grid: Rect, T: int, S: int) -> None:
    """The causal mask's hidden scores, key ``j`` after query ``i``: one grey staircase."""
    from matplotlib.patches import Polygon

    cell_w, cell_h = grid.width / S, grid.height / T
    n = min(T, S)
    corners = [(S, 0), (1, 0)]  # (key, query) corners, queries counted downwards
    for i in range(n):
        corners += [(i + 1, i + 1), (i + 2, i + 1)] if i + 1 < n else [(i + 1, i + 1)]
    corners.append((S, n))
    points = [(grid.x0 + j * cell_w, grid.y1 - i * cell_h) for j, i in corners]
    _add(
        ax,
        Polygon(
            points,
            closed=True,
            facecolor=_mix(MASKED_COLOR, 0.55),
            edgecolor="none",
            label="_masked tiles",
        ),
    )


def _highlight_blocks(ax, grids, sizes, span) -> None:
    """Highlight the blocks of Q, O, lse, K^T and V that the current tile reads and writes."""
    T, S, Dk, Dv = sizes
    rows_i, cols_j = span
    _highlight(ax, _block_rect(grids["Q"], (T, Dk), rows_i, (0, Dk)), QUERY)
    _highlight(ax, _block_rect(grids["O"], (T, Dv), rows_i, (0, Dv)), OUTPUT)
    _highlight(ax, _block_rect(grids["lse"], (T, 1), rows_i, (0, 1)), OUTPUT)
    _highlight(ax, _block_rect(grids["K^T"], (Dk, S), (0, Dk), cols_j), KEY)
    _highlight(ax, _block_rect(grids["V"], (S, Dv), cols_j, (0, Dv)), VALUE)


def _draw_traffic(ax, slow_box: Rect, fast_box: Rect, xs: list[float]) -> None:
    """Traffic between the two memories: loads into fast memory, the results written back."""
    y_a, y_b = slow_box.y0 - 0.04, fast_box.y1 + 0.04
    for n, (x, text) in enumerate(zip(xs, _ARROW_LABELS)):
        ends = ((x, y_b), (x, y_a)) if n == 2 else ((x, y_a), (x, y_b))
        draw_arrow(ax, *ends, label=text, label_side="right", fontsize=_pt(text))
