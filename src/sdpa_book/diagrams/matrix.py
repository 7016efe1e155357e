"""Matrices drawn as grids of cells whose proportions follow their shapes (:func:`draw_matrix`),
and the stacks of labels (name, symbolic shape, numeric shape) written beside them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral

import numpy as np

from ..figures import MASKED_COLOR
from .draw import _add
from .primitives import (
    INK,
    LABEL_PT,
    MAX_CELLS,
    NAME_PT,
    Rect,
    _fmt_value,
    _fontsize,
    _grid_shape,
    _label_lines,
    _matrix_size,
    _mix,
    _positive_int,
    _shade,
    _stack_line_height,
    text_size,
)

_SIDES = ("above", "below", "left", "right")


@dataclass(frozen=True)
class _Grid:
    """Where a grid is drawn: bottom left ``(x, y)``, size, and its rows and columns of cells."""

    x: float
    y: float
    width: float
    height: float
    rows: int
    cols: int

    @property
    def cell_w(self) -> float:
        return self.width / self.cols

    @property
    def cell_h(self) -> float:
        return self.height / self.rows


def draw_matrix(
    ax,
    x: float,
    y: float,
    shape: Sequence[int],
    *,
    unit: float,
    color,
    name: str | None = None,
    dims: Sequence[str] | None = None,
    name_at: str | None = "above",
    shape_at: str | None = "below",
    values=None,
    masked=None,
    row_blocks: int | None = None,
    col_blocks: int | None = None,
    fill: float = 0.35,
    min_size: float = 0.1,
    linestyle: str = "-",
    label_floor: float | None = None,
    label_align: str = "center",
    column: bool = False,
    tag: str | None = None,
    name_pt: float = NAME_PT,
    label_pt: float = LABEL_PT,
    value_pt: float = LABEL_PT,
    decimals: int | None = None,
) -> Rect:
    """A matrix drawn as a grid of cells, its bottom left at ``(x, y)``, labelled with its shape.

    The grid is ``cols * unit`` wide and ``rows * unit`` high (at least ``min_size``), so
    matrices drawn with one ``unit`` keep their proportions: a ``(T, S)`` grid beside a
    ``(T, Dk)`` grid shows which is wider. A 1-D ``shape`` ``(n,)`` is drawn as one row.

    Parameters
    ----------
    ax : matplotlib Axes
        Where to draw, usually from :func:`new_canvas` (coordinates in inches).
    x, y : float
        Bottom left corner, in inches.
    shape : (rows, cols) or (n,) of int
        The shape the grid stands for; its numeric label, e.g. ``(4, 3)``.
    unit : float
        Side of one cell, in inches.
    color : colour
        The role colour (``sdpa_book.figures.QUERY``, ...): a tint fills the cells.
    name : str, optional
        Name label, e.g. ``"$Q$"``.
    dims : sequence of str, optional
        Symbolic sizes, e.g. ``("T", "D_k")``: a mathtext label ``$(T, D_k)$``.
    name_at, shape_at : {"above", "below", "left", "right"} or None
        Where the name and the shape labels go (None: not drawn). On the same side, the name
        comes first.
    values : array_like of shape ``shape``, optional
        Numbers written in the cells (with ``decimals`` decimals) when every one of them fits
        its cell.
    masked : array_like of bool of shape ``shape``, optional
        Cells drawn in ``sdpa_book.figures.MASKED_COLOR`` (``True`` = masked).
    row_blocks, col_blocks : int, optional
        Draw a heavier line every ``row_blocks`` rows / ``col_blocks`` columns (tiles, heads).
    fill : float, default 0.35
        How much of ``color`` the cells hold (1: the full colour).
    min_size : float, default 0.1
        Smallest side, in inches, so that a very thin matrix stays visible.
    linestyle : str, default "-"
        Of the outline (``"--"`` for a matrix that is never stored).
    label_floor : float, optional
        Labels beside the grid (``"left"``/``"right"``) are centred on it but kept above this
        height, clear of what lies below them.
    label_align : {"center", "top"}, default "center"
        Labels beside the grid are centred on it, or start at its top (clear of arrows that
        arrive from above).
    column : bool, default False
        Draw a 1-D ``shape`` as a column (one number per row of a matrix beside it, like
        ``lse``) rather than as a row.
    tag : str, optional
        Stored as the label ``"_tag <tag>"`` of the grid's outline (a patch), so that tests
        can find the grid (:func:`tagged_rects`), and ``"_masked <tag>"`` of the path of its
        masked cells; not shown.
    name_pt, label_pt, value_pt : float, default 10, 9, 9
        Font sizes, in points, of the name, of the two shape labels and of the values; each at
        least ``sdpa_book.figures.MIN_FONT_PT``.
    decimals : int, optional
        Decimals of the values written in the cells; default two (one from 10 on).

    Returns
    -------
    Rect
        The grid's rectangle.

    Raises
    ------
    TypeError
        If a size of ``shape`` or ``decimals`` is not an integer.
    ValueError
        If ``shape`` is not one or two positive sizes, ``dims`` does not match it,
        ``values``/``masked`` have another shape, a label side is unknown, a font size is
        under ``MIN_FONT_PT`` or ``decimals`` outside 0 to 6.

    Examples
    --------
    >>> from sdpa_book.diagrams import new_canvas, draw_matrix, figure_texts
    >>> from sdpa_book.figures import QUERY
    >>> fig, ax = new_canvas(2.0, 1.6)
    >>> r = draw_matrix(ax, 0.5, 0.5, (4, 3), unit=0.15, color=QUERY, name="$Q$",
    ...                 dims=("T", "D_k"))
    >>> round(r.width, 2), round(r.height, 2)
    (0.45, 0.6)
    >>> figure_texts(fig)
    ['$Q$', '$(T, D_k)$', '(4, 3)']
    """
    from matplotlib.patches import Rectangle

    shape, hidden, values = _checked_matrix(shape, dims, masked, values)
    name_pt, label_pt, value_pt = (_fontsize(f) for f in (name_pt, label_pt, value_pt))
    decimals = _checked_decimals(decimals)
    sides = _label_lines(name, dims, shape, name_at, shape_at, name_pt, label_pt)
    labels = _checked_labels(sides)
    rows, cols = _grid_shape(shape, column)
    width, height = _matrix_size(shape, unit, min_size, column)
    grid = _Grid(x, y, width, height, rows, cols)
    edge = _shade(color)
    _add(ax, Rectangle((x, y), width, height, facecolor=_mix(color, fill), edgecolor="none"))
    if hidden is not None:
        _draw_masked_cells(ax, grid, hidden.reshape(rows, cols), tag)
    # Cell lines (only while cells stay distinguishable), then the block lines and the outline.
    _draw_cell_lines(ax, grid, "white" if fill >= 0.8 else _mix(edge, 0.45))
    _draw_block_lines(ax, grid, edge, row_blocks, col_blocks)
    _add(
        ax,
        Rectangle(
            (x, y),
            width,
            height,
            facecolor="none",
            edgecolor=edge,
            linewidth=1.1,
            linestyle=linestyle,
            label=f"_tag {tag}" if tag else None,
        ),
    )
    if values is not None:
        _draw_values(ax, grid, values.reshape(rows, cols), value_pt, decimals)
    rect = Rect(x, y, x + width, y + height)
    for side, lines in labels.items():
        _label_stack(ax, rect, side, lines, floor=label_floor, align=label_align)
    return rect


def _checked_matrix(shape, dims, masked, values):
    """``shape`` as a tuple of ints, ``masked`` as booleans and ``values`` as floats (or None),
    after checking that they agree."""
    if not isinstance(shape, (tuple, list)) or len(shape) not in (1, 2):
        raise ValueError(f"shape must be (rows, cols) or (n,); got {shape!r}")
    shape = tuple(_positive_int(n, "shape") for n in shape)
    if dims is not None and len(dims) != len(shape):
        raise ValueError(
            f"dims must name each of the {len(shape)} sizes of shape={shape}; got {dims!r}"
        )
    if masked is not None:
        masked = np.asarray(masked, dtype=bool)
        if masked.shape != shape:
            raise ValueError(f"masked must have the matrix's shape {shape}; got {masked.shape}")
    if values is not None:
        if np.shape(values) != shape:
            raise ValueError(f"values must have the matrix's shape {shape}; got {np.shape(values)}")
        values = np.asarray(values, dtype=float)
    return shape, masked, values


def _checked_decimals(decimals) -> int | None:
    """``decimals`` as an int from 0 to 6, or None."""
    if decimals is None:
        return None
    if isinstance(decimals, (bool, np.bool_)) or not isinstance(decimals, Integral):
        raise TypeError(f"decimals must be None or an integer; got {decimals!r}")
    if not 0 <= decimals <= 6:
        raise ValueError(f"decimals must lie in [0, 6]; got {decimals!r}")
    return int(decimals)


def _checked_labels(
    sides: dict[str, list[tuple[str, float]]],
) -> dict[str, list[tuple[str, float]]]:
    """The label lines of :func:`_label_lines`, once every side they go on is known."""
    for side in sides:
        if side not in _SIDES:
            raise ValueError(
                f"a label side must be 'above', 'below', 'left' or 'right'; got {side!r}"
            )
    return sides


def _draw_masked_cells(ax, grid: _Grid, hidden: np.ndarray, tag: str | None) -> None:
    """Grey the cells where ``hidden`` (rows, cols) is True: one path of squares, or an image
    when there are too many cells for a square each."""
    x, y, width, height = grid.x, grid.y, grid.width, grid.height
    cell_w, cell_h = grid.cell_w, grid.cell_h
    if hidden.size > 64 * 64:
        from matplotlib.colors import to_rgba

        image = np.zeros((grid.rows, grid.cols, 4))
        image[hidden] = to_rgba(MASKED_COLOR)
        ax.imshow(
            image,
            extent=(x, x + width, y, y + height),
            interpolation="nearest",
            aspect="auto",
            zorder=1.5,
        )
        return
    from matplotlib.patches import PathPatch
    from matplotlib.path import Path

    squares = [
        (
            (x + j * cell_w, y + height - (i + 1) * cell_h),
            (x + (j + 1) * cell_w, y + height - (i + 1) * cell_h),
            (x + (j + 1) * cell_w, y + height - i * cell_h),
            (x + j * cell_w, y + height - i * cell_h),
        )
        for i, j in zip(*np.nonzero(hidden))
    ]
    if squares:  # a single artist however many cells
        path = Path.make_compound_path(*(Path(sq + (sq[0],), closed=True) for sq in squares))
        _add(
            ax,
            PathPatch(
                path,
                facecolor=MASKED_COLOR,
                edgecolor="none",
                label=f"_masked {tag}" if tag else None,
            ),
        )


def _draw_cell_lines(ax, grid: _Grid, color) -> None:
    """Thin lines between the cells, along each side whose cells stay distinguishable."""
    from matplotlib.collections import LineCollection

    x, y, width, height = grid.x, grid.y, grid.width, grid.height
    cell_w, cell_h = grid.cell_w, grid.cell_h
    segments = []
    if grid.rows <= MAX_CELLS * 2 and cell_h >= 0.03:
        segments += [
            ((x, y + i * cell_h), (x + width, y + i * cell_h)) for i in range(1, grid.rows)
        ]
    if grid.cols <= MAX_CELLS * 2 and cell_w >= 0.03:
        segments += [
            ((x + j * cell_w, y), (x + j * cell_w, y + height)) for j in range(1, grid.cols)
        ]
    if segments:
        _add(ax, LineCollection(segments, colors=[color], linewidths=0.6))


def _draw_block_lines(ax, grid: _Grid, color, row_blocks, col_blocks) -> None:
    """Heavier lines every ``row_blocks`` rows (from the top) and ``col_blocks`` columns."""
    from matplotlib.collections import LineCollection

    x, y, width, height = grid.x, grid.y, grid.width, grid.height
    cell_w, cell_h = grid.cell_w, grid.cell_h
    blocks = []
    if row_blocks:
        blocks += [
            ((x, y + height - i * cell_h), (x + width, y + height - i * cell_h))
            for i in range(row_blocks, grid.rows, row_blocks)
        ]
    if col_blocks:
        blocks += [
            ((x + j * cell_w, y), (x + j * cell_w, y + height))
            for j in range(col_blocks, grid.cols, col_blocks)
        ]
    if blocks:
        _add(ax, LineCollection(blocks, colors=[color], linewidths=1.6))


def _draw_values(
    ax, grid: _Grid, values: np.ndarray, fontsize: float = LABEL_PT, decimals: int | None = None
) -> None:
    """Write ``values`` (rows, cols) in the cells, only if every number fits its cell."""
    labels = [[_fmt_value(v, decimals) for v in row] for row in values]
    widest = max(text_size(t, fontsize)[0] for row in labels for t in row)
    if grid.cell_w < widest + 0.06 or grid.cell_h < 0.17 * fontsize / LABEL_PT:
        return
    top = grid.y + grid.height
    for i, row in enumerate(labels):
        for j, text in enumerate(row):
            ax.text(
                grid.x + (j + 0.5) * grid.cell_w,
                top - (i + 0.5) * grid.cell_h,
                text,
                ha="center",
                va="center",
                fontsize=fontsize,
                color=INK,
            )


def _label_stack(
    ax,
    rect: Rect,
    side: str,
    lines: Sequence[tuple[str, float]],
    gap: float = 0.05,
    floor: float | None = None,
    align: str = "center",
):
    """Write ``lines`` (text, fontsize) as a stack beside ``rect``; return the Text artists.

    Beside (``left``/``right``), the stack is centred on ``rect`` (``align="top"``: starts at
    its top), and its bottom stays at or above ``floor`` when given.
    """
    texts = []
    total = sum(_stack_line_height(t, fs) for t, fs in lines)
    if side == "above":
        x, y, ha = rect.cx, rect.y1 + gap + total, "center"
    elif side == "below":
        x, y, ha = rect.cx, rect.y0 - gap, "center"
    elif side == "left":
        x, y, ha = rect.x0 - gap - 0.02, rect.cy + total / 2, "right"
    elif side == "right":
        x, y, ha = rect.x1 + gap + 0.02, rect.cy + total / 2, "left"
    else:
        raise ValueError(f"a label side must be 'above', 'below', 'left' or 'right'; got {side!r}")
    if align == "top" and side in ("left", "right"):
        y = rect.y1 + 0.03
    if floor is not None and side in ("left", "right"):
        y = max(y, floor + total)
    for text, fs in lines:
        h = _stack_line_height(text, fs)
        texts.append(
            ax.text(x, y - h / 2, text, ha=ha, va="center_baseline", fontsize=fs, color=INK)
        )
        y -= h
    return texts
