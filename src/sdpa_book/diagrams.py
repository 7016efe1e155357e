r"""Diagrams of how data flows through attention, drawn from a page's own sizes and arrays.

Every diagram here is a function of the sizes (or arrays) a page computes, so its shape labels
are the page's shapes and cannot drift from the text: change ``T`` on the page and the grids,
their proportions and their labels change with it. Each function returns a Matplotlib
``matplotlib.figure.Figure`` with a white background, at most
``sdpa_book.figures.FULL_WIDTH`` inches wide, with no text under
``sdpa_book.figures.MIN_FONT_PT`` points. The figures are not registered with pyplot (no
window, nothing to close); a page glues them like any other figure.

Diagrams
--------
:func:`token_qkv_diagram`
    One token's embedding becoming a query, a key and a value.
:func:`attention_pipeline_diagram`
    ``Q, K -> scores -> scale -> mask -> softmax -> weights -> @ V -> out``, with shapes.
:func:`multihead_diagram`, :func:`grouped_heads_diagram`
    Heads split, attend and concatenate; query heads sharing key/value heads (MHA, GQA, MQA).
:func:`mask_geometry_diagram`
    Causal, padding and sliding-window masks, and the two causal alignments when ``T != S``.
:func:`kv_cache_diagram`
    Prefill, then decoding one token at a time against a growing cache.
:func:`flash_loop_diagram`
    The tiled (FlashAttention) loop: slow memory, fast memory, the running ``m``, ``ℓ``.
:func:`backward_graph_diagram`
    The forward's stages and the gradients flowing back.
:func:`transformer_block_diagram`
    The residual stream with pre-norm or post-norm sublayers.

Drawing helpers
---------------
The diagrams are built from a few helpers, usable on their own: :func:`new_canvas` (a figure
whose data coordinates are inches), :func:`draw_box`, :func:`draw_arrow`, :func:`draw_matrix`
(a grid whose proportions follow its shape, labelled with the shape), :func:`draw_bracket`,
:func:`role_legend` and :func:`text_size`. Two readers serve tests and examples:
:func:`figure_texts` (the texts a figure shows) and :func:`tagged_rects` (where its grids and
boxes are, by name).

Every size is validated up front (a positive integer, shapes that agree, few enough cells to
draw legibly), with an error that names the argument.

Colours have one role each, the same on every diagram and plot of the book: queries
``sdpa_book.figures.QUERY``, keys ``sdpa_book.figures.KEY``, values
``sdpa_book.figures.VALUE``, outputs ``sdpa_book.figures.OUTPUT``, scores and weights
``SCORES``, gradients ``GRADIENT``, masks ``sdpa_book.figures.ALLOWED_COLOR`` and
``sdpa_book.figures.MASKED_COLOR``; memories ``SLOW_MEMORY`` and ``FAST_MEMORY``.
They are colours of the colour-blind-safe Okabe-Ito palette, or greys; the text is always dark
on a light tint, so the diagrams read the same on the book's light and dark pages (their
background is white).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from numbers import Integral, Real

import numpy as np

from .figures import (
    ALLOWED_COLOR,
    COLORS,
    FULL_WIDTH,
    KEY,
    MASKED_COLOR,
    MIN_FONT_PT,
    OUTPUT,
    QUERY,
    VALUE,
)

__all__ = [
    "FAST_MEMORY",
    "GRADIENT",
    "NEUTRAL",
    "SCORES",
    "SLOW_MEMORY",
    "Rect",
    "attention_pipeline_diagram",
    "backward_graph_diagram",
    "draw_arrow",
    "draw_box",
    "draw_bracket",
    "draw_matrix",
    "figure_texts",
    "flash_loop_diagram",
    "tagged_rects",
    "grouped_heads_diagram",
    "kv_cache_diagram",
    "mask_geometry_diagram",
    "multihead_diagram",
    "new_canvas",
    "role_legend",
    "text_size",
    "token_qkv_diagram",
    "transformer_block_diagram",
]

# Roles beyond those of sdpa_book.figures, used only by diagrams (all Okabe-Ito or greys).
SCORES = COLORS[6]  # yellow: scores and weights, (T, S)
GRADIENT = COLORS[3]  # vermillion: gradients flowing back
FAST_MEMORY = COLORS[5]  # sky blue: on-chip fast memory (SRAM)
SLOW_MEMORY = "#8c8c8c"  # grey: off-chip slow memory (HBM)
NEUTRAL = "#6e6e6e"  # grey: inputs, projections, operations
INK = "#222222"  # text and arrows

NAME_PT = 10  # names of matrices and boxes
LABEL_PT = MIN_FONT_PT  # shapes, arrow labels, legends
MARGIN = 0.08  # inches left free around every diagram
MAX_CELLS = 48  # a diagram draws at most this many cells along one side


# ----------------------------------------------------------------------------------------------
# Validation


def _positive_int(value, name: str) -> int:
    """Return ``value`` as an int if it is a positive integer, else raise."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, Integral):
        raise TypeError(f"{name} must be a positive integer; got {value!r}")
    if value < 1:
        raise ValueError(f"{name} must be a positive integer; got {value!r}")
    return int(value)


def _positive_number(value, name: str) -> float:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a positive number; got {value!r}")
    if not value > 0 or not np.isfinite(value):
        raise ValueError(f"{name} must be a positive number; got {value!r}")
    return float(value)


def _flag(value, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool; got {value!r}")
    return bool(value)


def _at_most(value: int, limit: int, name: str, why: str = "to be drawn legibly") -> int:
    if value > limit:
        raise ValueError(f"{name} must be at most {limit} {why}; got {name}={value}")
    return value


def _real_array(value, name: str, ndim: int) -> np.ndarray:
    """A finite real array with ``ndim`` dimensions, none of them empty."""
    if value is None:
        raise TypeError(f"{name} must be a {ndim}-D array of real numbers; got None")
    array = np.asarray(value)
    if array.dtype.kind not in "biuf":
        raise TypeError(f"{name} must be a {ndim}-D array of real numbers; got dtype {array.dtype}")
    if array.ndim != ndim or 0 in array.shape:
        raise ValueError(
            f"{name} must be a non-empty {ndim}-D array; got {name}.shape={array.shape}"
        )
    return array.astype(np.float64)


def _fontsize(fontsize) -> float:
    size = _positive_number(fontsize, "fontsize")
    if size < MIN_FONT_PT:
        raise ValueError(
            f"fontsize must be at least MIN_FONT_PT = {MIN_FONT_PT} pt; got {fontsize!r}"
        )
    return size


# ----------------------------------------------------------------------------------------------
# Geometry and text


@dataclass(frozen=True)
class Rect:
    """An axis-aligned rectangle in inches, ``(x0, y0)`` bottom left to ``(x1, y1)`` top right.

    The helpers return one for what they drew, so that a diagram can attach arrows and labels
    to its edges.

    Examples
    --------
    >>> from sdpa_book.diagrams import Rect
    >>> r = Rect(1.0, 2.0, 3.0, 3.0)
    >>> r.width, r.height, r.center, r.right
    (2.0, 1.0, (2.0, 2.5), (3.0, 2.5))
    """

    x0: float
    y0: float
    x1: float
    y1: float

    @property
    def width(self) -> float:
        return self.x1 - self.x0

    @property
    def height(self) -> float:
        return self.y1 - self.y0

    @property
    def cx(self) -> float:
        return (self.x0 + self.x1) / 2

    @property
    def cy(self) -> float:
        return (self.y0 + self.y1) / 2

    @property
    def center(self) -> tuple[float, float]:
        return (self.cx, self.cy)

    @property
    def left(self) -> tuple[float, float]:
        return (self.x0, self.cy)

    @property
    def right(self) -> tuple[float, float]:
        return (self.x1, self.cy)

    @property
    def top(self) -> tuple[float, float]:
        return (self.cx, self.y1)

    @property
    def bottom(self) -> tuple[float, float]:
        return (self.cx, self.y0)


def text_size(text: str, fontsize: float = LABEL_PT) -> tuple[float, float]:
    """Width and height, in inches, that ``text`` takes at ``fontsize`` points.

    Mathtext (``$D_k$``) is measured as drawn; several lines (``"\\n"``) are stacked at the
    line spacing the helpers use. Diagrams use it to leave room for their labels.

    Parameters
    ----------
    text : str
    fontsize : float, default MIN_FONT_PT

    Returns
    -------
    (width, height) : tuple of float

    Examples
    --------
    >>> from sdpa_book.diagrams import text_size
    >>> w1, h1 = text_size("(4, 3)")
    >>> w2, h2 = text_size("(4, 3)\\n(1024, 64)")
    >>> w2 > w1 and h2 > h1
    True
    """
    lines = str(text).split("\n")
    width = max((_line_width(line, float(fontsize)) for line in lines if line.strip()), default=0.0)
    return width, len(lines) * _line_height(fontsize)


@lru_cache(maxsize=4096)
def _line_width(line: str, fontsize: float) -> float:
    """Width in inches of one line as Matplotlib lays it out (mathtext between dollars)."""
    from matplotlib.font_manager import FontProperties

    renderer = _measuring_renderer()
    ismath = line.count("$") >= 2 and line.count("$") % 2 == 0
    width, _, _ = renderer.get_text_width_height_descent(
        line, FontProperties(size=fontsize), ismath=ismath
    )
    return float(width) / _MEASURE_DPI


_MEASURE_DPI = 720  # fine enough that whole pixels do not round the widths


@lru_cache(maxsize=1)
def _measuring_renderer():
    from matplotlib.backends.backend_agg import RendererAgg

    return RendererAgg(10, 10, _MEASURE_DPI)


def _line_height(fontsize: float) -> float:
    return 1.4 * fontsize / 72


def _mix(color, amount: float, other: str = "white") -> tuple[float, float, float]:
    """``amount`` of ``color`` mixed with ``other`` (white: a tint; black: a shade)."""
    from matplotlib.colors import to_rgb

    c, o = np.array(to_rgb(color)), np.array(to_rgb(other))
    return tuple(float(v) for v in amount * c + (1 - amount) * o)


def _shade(color) -> tuple[float, float, float]:
    return _mix(color, 0.7, "black")


def _mathtext_shape(dims: Sequence[str]) -> str:
    inner = ", ".join(dims)
    return f"$({inner},)$" if len(dims) == 1 else f"$({inner})$"


def _numeric_shape(shape: Sequence[int]) -> str:
    return str(tuple(int(n) for n in shape))


def _fmt_value(value: float) -> str:
    digits = 1 if abs(value) >= 9.995 else 2
    text = f"{round(float(value), digits) + 0.0:.{digits}f}"  # + 0.0: no "-0.00"
    return text.replace("-", "\N{MINUS SIGN}")


# ----------------------------------------------------------------------------------------------
# Drawing helpers


def new_canvas(width: float, height: float):
    """A figure whose data coordinates are inches, origin at the bottom left, axes hidden.

    Parameters
    ----------
    width, height : float
        Size in inches; ``width`` at most ``sdpa_book.figures.FULL_WIDTH``.

    Returns
    -------
    fig : matplotlib.figure.Figure
        White background, not registered with pyplot.
    ax : matplotlib.axes.Axes
        Covers the whole figure; ``ax.get_xlim() == (0, width)``, equal aspect.

    Raises
    ------
    TypeError
        If a size is not a number.
    ValueError
        If a size is not positive, or ``width`` exceeds ``FULL_WIDTH``.

    Examples
    --------
    >>> from sdpa_book.diagrams import new_canvas
    >>> fig, ax = new_canvas(4.0, 1.5)
    >>> [float(v) for v in fig.get_size_inches()], [float(v) for v in ax.get_xlim()]
    ([4.0, 1.5], [0.0, 4.0])
    """
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    width = _positive_number(width, "width")
    height = _positive_number(height, "height")
    if width > FULL_WIDTH + 1e-9:
        raise ValueError(f"width must be at most FULL_WIDTH = {FULL_WIDTH} inches; got {width:.3g}")
    fig = Figure(figsize=(width, height), facecolor="white")
    FigureCanvasAgg(fig)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(0, height)
    ax.set_aspect("equal")
    ax.set_autoscale_on(False)
    ax.axis("off")
    return fig, ax


def draw_box(
    ax,
    x: float,
    y: float,
    width: float,
    height: float,
    text: str | None = None,
    *,
    color=NEUTRAL,
    fill: float = 0.15,
    fontsize: float = NAME_PT,
    linestyle: str = "-",
    rounded: bool = True,
    tag: str | None = None,
) -> Rect:
    """A box with its bottom left at ``(x, y)`` and optional centred text.

    Parameters
    ----------
    ax : matplotlib Axes
        Usually from :func:`new_canvas` (coordinates in inches).
    x, y, width, height : float
        Position and size.
    text : str, optional
        Centred in the box; may hold several lines and mathtext.
    color : colour
        The edge; the face is this colour mixed with white.
    fill : float, default 0.15
        How much of ``color`` the face holds (0: white, 1: ``color``).
    fontsize : float, default 10
        At least ``sdpa_book.figures.MIN_FONT_PT``.
    linestyle : str, default "-"
    rounded : bool, default True
    tag : str, optional
        Name for :func:`tagged_rects` (not shown).

    Returns
    -------
    Rect

    Raises
    ------
    ValueError
        If ``fontsize`` is under ``MIN_FONT_PT`` or ``fill`` is outside ``[0, 1]``.

    Examples
    --------
    >>> from sdpa_book.diagrams import new_canvas, draw_box, figure_texts
    >>> fig, ax = new_canvas(2.0, 1.0)
    >>> draw_box(ax, 0.5, 0.25, 1.0, 0.5, "softmax").center
    (1.0, 0.5)
    >>> figure_texts(fig)
    ['softmax']
    """
    from matplotlib.patches import FancyBboxPatch

    fontsize = _fontsize(fontsize)
    if not 0 <= fill <= 1:
        raise ValueError(f"fill must lie in [0, 1]; got {fill!r}")
    pad = min(0.04, width / 4, height / 4) if rounded else 0.0
    style = f"round,pad=0,rounding_size={pad}" if rounded else "square,pad=0"
    _add(
        ax,
        FancyBboxPatch(
            (x, y),
            width,
            height,
            boxstyle=style,
            facecolor=_mix(color, fill),
            edgecolor=_shade(color),
            linewidth=1.1,
            linestyle=linestyle,
            label=f"_tag {tag}" if tag else None,
        ),
    )
    rect = Rect(x, y, x + width, y + height)
    if text:
        ax.text(
            rect.cx,
            rect.cy,
            text,
            ha="center",
            va="center",
            fontsize=fontsize,
            color=INK,
            linespacing=1.3,
        )
    return rect


def draw_arrow(
    ax,
    start: tuple[float, float],
    end: tuple[float, float],
    *,
    label: str | None = None,
    label_side: str = "above",
    color=INK,
    linestyle: str = "-",
    linewidth: float = 1.2,
    curve: float = 0.0,
    fontsize: float = LABEL_PT,
):
    """An arrow from ``start`` to ``end``, with an optional label beside its middle.

    Parameters
    ----------
    ax : matplotlib Axes
    start, end : (float, float)
        Tail and head, in inches.
    label : str, optional
    label_side : {"above", "below", "left", "right"}, default "above"
        Where the label sits relative to the arrow's midpoint.
    color : colour
    linestyle : str, default "-"
    linewidth : float, default 1.2
    curve : float, default 0.0
        Bend of the arrow (``arc3`` radius); 0 is straight.
    fontsize : float, default MIN_FONT_PT

    Returns
    -------
    matplotlib.patches.FancyArrowPatch

    Raises
    ------
    ValueError
        If ``label_side`` is unknown or ``fontsize`` under ``MIN_FONT_PT``.

    Examples
    --------
    >>> from sdpa_book.diagrams import new_canvas, draw_arrow, figure_texts
    >>> fig, ax = new_canvas(2.0, 1.0)
    >>> arrow = draw_arrow(ax, (0.2, 0.5), (1.8, 0.5), label="load")
    >>> figure_texts(fig)
    ['load']
    """
    from matplotlib.patches import FancyArrowPatch

    fontsize = _fontsize(fontsize)
    offsets = {
        "above": (0, 0.05, "center", "bottom"),
        "below": (0, -0.05, "center", "top"),
        "left": (-0.06, 0, "right", "center"),
        "right": (0.06, 0, "left", "center"),
    }
    if label_side not in offsets:
        raise ValueError(f"label_side must be one of {sorted(offsets)}; got {label_side!r}")
    arrow = FancyArrowPatch(
        start,
        end,
        arrowstyle="-|>,head_length=5,head_width=3",
        mutation_scale=1,
        connectionstyle=f"arc3,rad={curve}",
        color=color,
        linewidth=linewidth,
        linestyle=linestyle,
        shrinkA=0,
        shrinkB=0,
    )
    _add(ax, arrow)
    if label:
        dx, dy, ha, va = offsets[label_side]
        mx, my = (start[0] + end[0]) / 2, (start[1] + end[1]) / 2
        ax.text(mx + dx, my + dy, label, ha=ha, va=va, fontsize=fontsize, color=INK)
    return arrow


def _extent(n: int, unit: float, min_size: float) -> float:
    return max(min_size, n * unit)


def _label_lines(name, dims, shape, name_at, shape_at) -> dict[str, list[tuple[str, float]]]:
    """The label lines of a matrix, grouped by the side they go on."""
    sides: dict[str, list[tuple[str, float]]] = {}
    if name and name_at:
        sides.setdefault(name_at, []).append((name, NAME_PT))
    if shape_at:
        if dims is not None:
            sides.setdefault(shape_at, []).append((_mathtext_shape(dims), LABEL_PT))
        sides.setdefault(shape_at, []).append((_numeric_shape(shape), LABEL_PT))
    return sides


def _stack_line_height(text: str, fontsize: float) -> float:
    """A line of a label stack; a little more for maths with both a sub- and a superscript."""
    tall = "$" in text and "_" in text and "^" in text
    return _line_height(fontsize) * (1.15 if tall else 1.0)


def _stack_size(lines: Sequence[tuple[str, float]]) -> tuple[float, float]:
    width = max((text_size(t, fs)[0] for t, fs in lines), default=0.0)
    return width, sum(_stack_line_height(t, fs) for t, fs in lines)


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


def _grid_shape(shape, column: bool = False) -> tuple[int, int]:
    """(rows, cols) of the grid drawn for ``shape``: a 1-D shape is a row, or a column."""
    if len(shape) == 2:
        return tuple(shape)
    return (shape[0], 1) if column else (1, shape[0])


def _matrix_size(
    shape, unit: float, min_size: float = 0.1, column: bool = False
) -> tuple[float, float]:
    """Width and height, in inches, of the grid :func:`draw_matrix` draws for ``shape``."""
    rows, cols = _grid_shape(shape, column)
    return _extent(cols, unit, min_size), _extent(rows, unit, min_size)


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
) -> Rect:
    """A matrix drawn as a grid of cells, its bottom left at ``(x, y)``, labelled with its shape.

    The grid is ``cols * unit`` wide and ``rows * unit`` high (at least ``min_size``), so
    matrices drawn with one ``unit`` keep their proportions: a ``(T, S)`` grid beside a
    ``(T, Dk)`` grid shows which is wider. A 1-D ``shape`` ``(n,)`` is drawn as one row.

    Parameters
    ----------
    ax : matplotlib Axes
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
        Numbers written in the cells (two decimals) when every one of them fits its cell.
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

    Returns
    -------
    Rect
        The grid's rectangle.

    Raises
    ------
    ValueError
        If ``shape`` is not one or two positive sizes, ``dims`` does not match it, or
        ``values``/``masked`` have another shape.

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
    from matplotlib.collections import LineCollection
    from matplotlib.patches import Rectangle

    if not isinstance(shape, (tuple, list)) or len(shape) not in (1, 2):
        raise ValueError(f"shape must be (rows, cols) or (n,); got {shape!r}")
    shape = tuple(_positive_int(n, "shape") for n in shape)
    if dims is not None and len(dims) != len(shape):
        raise ValueError(
            f"dims must name each of the {len(shape)} sizes of shape={shape}; got {dims!r}"
        )
    rows, cols = _grid_shape(shape, column)
    width, height = _matrix_size(shape, unit, min_size, column)
    rect = Rect(x, y, x + width, y + height)
    cell_w, cell_h = width / cols, height / rows

    face = _mix(color, fill)
    edge = _shade(color)
    _add(ax, Rectangle((x, y), width, height, facecolor=face, edgecolor="none"))
    if masked is not None:
        hidden = np.asarray(masked, dtype=bool)
        if hidden.shape != shape:
            raise ValueError(f"masked must have the matrix's shape {shape}; got {np.shape(masked)}")
        hidden = hidden.reshape(rows, cols)
        if hidden.size <= 64 * 64:  # one path of squares: a single artist however many cells
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
            if squares:
                path = Path.make_compound_path(
                    *(Path(sq + (sq[0],), closed=True) for sq in squares)
                )
                _add(
                    ax,
                    PathPatch(
                        path,
                        facecolor=MASKED_COLOR,
                        edgecolor="none",
                        label=f"_masked {tag}" if tag else None,
                    ),
                )
        else:  # too many cells for one square each: an image of the mask
            from matplotlib.colors import to_rgba

            image = np.zeros((rows, cols, 4))
            image[hidden] = to_rgba(MASKED_COLOR)
            ax.imshow(
                image,
                extent=(x, x + width, y, y + height),
                interpolation="nearest",
                aspect="auto",
                zorder=1.5,
            )

    # Cell lines (only while cells stay distinguishable), then the block lines and the outline.
    segments = []
    if rows <= MAX_CELLS * 2 and cell_h >= 0.03:
        segments += [((x, y + i * cell_h), (x + width, y + i * cell_h)) for i in range(1, rows)]
    if cols <= MAX_CELLS * 2 and cell_w >= 0.03:
        segments += [((x + j * cell_w, y), (x + j * cell_w, y + height)) for j in range(1, cols)]
    grid_color = "white" if fill >= 0.8 else _mix(edge, 0.45)
    if segments:
        _add(ax, LineCollection(segments, colors=[grid_color], linewidths=0.6))
    blocks = []
    if row_blocks:
        blocks += [
            ((x, y + height - i * cell_h), (x + width, y + height - i * cell_h))
            for i in range(row_blocks, rows, row_blocks)
        ]
    if col_blocks:
        blocks += [
            ((x + j * cell_w, y), (x + j * cell_w, y + height))
            for j in range(col_blocks, cols, col_blocks)
        ]
    if blocks:
        _add(ax, LineCollection(blocks, colors=[edge], linewidths=1.6))
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
        if np.shape(values) != shape:
            raise ValueError(f"values must have the matrix's shape {shape}; got {np.shape(values)}")
        labels = [
            [_fmt_value(v) for v in row]
            for row in np.asarray(values, dtype=float).reshape(rows, cols)
        ]
        widest = max(text_size(t)[0] for row in labels for t in row)
        if cell_w >= widest + 0.06 and cell_h >= 0.17:  # only where every number fits its cell
            for i, row in enumerate(labels):
                for j, text in enumerate(row):
                    ax.text(
                        x + (j + 0.5) * cell_w,
                        y + height - (i + 0.5) * cell_h,
                        text,
                        ha="center",
                        va="center",
                        fontsize=LABEL_PT,
                        color=INK,
                    )

    for side, lines in _label_lines(name, dims, shape, name_at, shape_at).items():
        _label_stack(ax, rect, side, lines, floor=label_floor, align=label_align)
    return rect


def _block_rect(
    rect: Rect, shape: Sequence[int], rows: tuple[int, int], cols: tuple[int, int]
) -> Rect:
    """The sub-rectangle of a grid drawn by :func:`draw_matrix` covering ``rows`` x ``cols``."""
    n_rows, n_cols = (1, shape[0]) if len(shape) == 1 else shape
    cw, ch = rect.width / n_cols, rect.height / n_rows
    return Rect(
        rect.x0 + cols[0] * cw,
        rect.y1 - rows[1] * ch,
        rect.x0 + cols[1] * cw,
        rect.y1 - rows[0] * ch,
    )


def tagged_rects(fig) -> dict[str, Rect]:
    """``{tag: Rect}`` of the grids and boxes drawn with a ``tag`` in ``fig`` (in inches).

    Diagrams tag what they draw (``"Q"``, ``"scores"``, ``"head 1"``, ...), so that tests can
    check proportions and positions without knowing the layout.

    Parameters
    ----------
    fig : matplotlib.figure.Figure

    Returns
    -------
    dict of str to Rect

    Examples
    --------
    >>> from sdpa_book.diagrams import attention_pipeline_diagram, tagged_rects
    >>> rects = tagged_rects(attention_pipeline_diagram(T=4, S=6, Dk=3, Dv=2))
    >>> round(rects["scores"].width / rects["Q"].width, 3)  # S / Dk: grids keep the proportions
    2.0
    """
    rects = {}
    for ax in fig.axes:
        for patch in ax.patches:
            label = patch.get_label() or ""
            if label.startswith("_tag "):
                x, y = float(patch.get_x()), float(patch.get_y())
                rects[label[len("_tag ") :]] = Rect(
                    x, y, x + float(patch.get_width()), y + float(patch.get_height())
                )
    return rects


def _add(ax, artist):
    """Add a patch, line or collection to ``ax`` without updating its data limits (fixed: the
    canvas is in inches), which would cost more than drawing it."""
    ax.add_artist(artist)
    return artist


def _segment(ax, xs, ys, **kwargs):
    """A polyline through ``xs``, ``ys`` (``ax.plot`` without the data-limit bookkeeping)."""
    from matplotlib.lines import Line2D

    return _add(ax, Line2D(xs, ys, **kwargs))


def _outline(ax, rect: Rect, color, *, linewidth: float = 2.2, linestyle: str = "-", fill=None):
    from matplotlib.patches import Rectangle

    _add(
        ax,
        Rectangle(
            (rect.x0, rect.y0),
            rect.width,
            rect.height,
            facecolor=fill if fill is not None else "none",
            edgecolor=color,
            linewidth=linewidth,
            linestyle=linestyle,
        ),
    )


def draw_bracket(
    ax,
    start: float,
    stop: float,
    at: float,
    text: str | None = None,
    *,
    side: str = "above",
    depth: float = 0.06,
    color=INK,
    fontsize: float = LABEL_PT,
):
    """A square bracket along ``[start, stop]`` at ``at``, opening towards what it groups.

    ``side="above"``/``"below"``: the bracket spans ``x`` from ``start`` to ``stop`` at height
    ``y = at`` and its label sits above/below it. ``side="left"``/``"right"``: it spans ``y``
    at ``x = at``.

    Parameters
    ----------
    ax : matplotlib Axes
    start, stop : float
        The span grouped, in inches.
    at : float
        The edge of what is grouped.
    text : str, optional
        Label beside the bracket's middle.
    side : {"above", "below", "left", "right"}, default "above"
    depth : float, default 0.06
        Length of the bracket's ends, in inches.
    color : colour
    fontsize : float, default MIN_FONT_PT

    Returns
    -------
    matplotlib.text.Text or None
        The label.

    Raises
    ------
    ValueError
        If ``side`` is unknown or ``stop <= start``.

    Examples
    --------
    >>> from sdpa_book.diagrams import new_canvas, draw_bracket
    >>> fig, ax = new_canvas(2.0, 1.0)
    >>> draw_bracket(ax, 0.2, 1.8, 0.3, "$H$ heads").get_text()
    '$H$ heads'
    """
    if side not in ("above", "below", "left", "right"):
        raise ValueError(f"side must be 'above', 'below', 'left' or 'right'; got {side!r}")
    if not stop > start:
        raise ValueError(f"stop must be greater than start; got start={start}, stop={stop}")
    fontsize = _fontsize(fontsize)
    sign = 1 if side in ("above", "right") else -1
    mid = (start + stop) / 2
    a, b = at, at + sign * depth
    path = [(start, a), (start, b), (stop, b), (stop, a)]
    tick = [(mid, b), (mid, b + sign * depth * 0.6)]
    if side in ("left", "right"):
        path = [(v, u) for u, v in path]
        tick = [(v, u) for u, v in tick]
    _segment(ax, *zip(*path), color=color, linewidth=1.0, solid_capstyle="butt")
    _segment(ax, *zip(*tick), color=color, linewidth=1.0)
    if not text:
        return None
    far = b + sign * (depth * 0.6 + 0.04)
    if side == "above":
        return ax.text(mid, far, text, ha="center", va="bottom", fontsize=fontsize, color=INK)
    if side == "below":
        return ax.text(mid, far, text, ha="center", va="top", fontsize=fontsize, color=INK)
    ha = "left" if side == "right" else "right"
    return ax.text(far, mid, text, ha=ha, va="center", fontsize=fontsize, color=INK)


def role_legend(
    ax, entries, *, loc: str = "lower center", anchor=(0.5, 0.0), ncols: int | None = None
):
    """A legend of colour roles: one patch per ``(label, colour)`` entry, no frame.

    Parameters
    ----------
    ax : matplotlib Axes
    entries : sequence of (str, colour) or (str, colour, dict)
        Label and face colour; the optional dict holds more patch properties (``edgecolor``,
        ``linestyle``, ``hatch``, ...), or ``{"line": True}`` for an arrow's colour drawn as
        a line.
    loc : str, default "lower center"
        Which point of the legend sits at ``anchor``.
    anchor : (float, float), default (0.5, 0.0)
        In axes fractions (0 to 1).
    ncols : int, optional
        Default: all entries on one row.

    Returns
    -------
    matplotlib.legend.Legend

    Raises
    ------
    ValueError
        If ``entries`` is empty.

    Examples
    --------
    >>> from sdpa_book.diagrams import new_canvas, role_legend
    >>> from sdpa_book.figures import QUERY, KEY
    >>> fig, ax = new_canvas(3.0, 1.0)
    >>> legend = role_legend(ax, [("query", QUERY), ("key", KEY)])
    >>> [t.get_text() for t in legend.get_texts()]
    ['query', 'key']
    """
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    entries = list(entries)
    if not entries:
        raise ValueError("entries must hold at least one (label, colour) pair; got none")
    handles = []
    for entry in entries:
        label, color, *extra = entry
        if extra and extra[0].get("line"):
            handles.append(Line2D([], [], color=color, linewidth=1.8, label=label))
            continue
        props = {
            "edgecolor": _shade(color) if color not in ("white", "#ffffff") else NEUTRAL,
            "linewidth": 1.0,
        }
        if extra:
            props.update(extra[0])
        handles.append(Patch(facecolor=color, label=label, **props))
    return ax.legend(
        handles=handles,
        loc=loc,
        bbox_to_anchor=anchor,
        bbox_transform=ax.transAxes,
        ncols=ncols or len(handles),
        frameon=False,
        fontsize=LABEL_PT,
        handlelength=1.4,
        handleheight=1.0,
        columnspacing=1.2,
        borderaxespad=0.1,
        borderpad=0.1,
    )


def figure_texts(fig) -> list[str]:
    """The non-empty texts a figure shows, in drawing order: labels, then legends and titles.

    Parameters
    ----------
    fig : matplotlib.figure.Figure

    Returns
    -------
    list of str

    Examples
    --------
    >>> from sdpa_book.diagrams import attention_pipeline_diagram, figure_texts
    >>> "(5, 7)" in figure_texts(attention_pipeline_diagram(5, 7, 3, 2))  # scores (T, S)
    True
    """
    texts = list(fig.texts)
    titles = []
    for ax in fig.axes:
        texts += ax.texts
        titles += [ax.get_title(loc) for loc in ("left", "center", "right")]
        legend = ax.get_legend()
        if legend is not None:
            texts += legend.get_texts()
    shown = [t.get_text() for t in texts if t.get_visible()]
    return [text for text in shown + titles if text.strip()]


# ----------------------------------------------------------------------------------------------
# 1. One token becoming a query, a key and a value


def token_qkv_diagram(x, W_q, W_k, W_v, *, token: str = "cat"):
    r"""One token's embedding ``x`` becoming its query, key and value: ``q = x W_Q``, ...

    The embedding row ``x (E,)`` is multiplied by the three projection matrices; the vectors
    are drawn as rows of cells (with their values when they fit), the matrices as grids
    labelled with their shapes.

    Parameters
    ----------
    x : (E,) array_like
        The token's embedding.
    W_q, W_k : (E, Dk) array_like
        Query and key projections.
    W_v : (E, Dv) array_like
        Value projection.
    token : str, default "cat"
        The word the embedding stands for.

    Returns
    -------
    matplotlib.figure.Figure

    Raises
    ------
    TypeError
        If an array is not real, or ``token`` is not a str.
    ValueError
        If an array has the wrong number of dimensions, the projections do not have ``E``
        rows, ``W_q`` and ``W_k`` differ in ``Dk``, or a size is too large to draw (more
        than 48).

    Examples
    --------
    >>> import numpy as np
    >>> from sdpa_book.diagrams import token_qkv_diagram, figure_texts
    >>> rng = np.random.default_rng(0)
    >>> E, Dk, Dv = 4, 3, 2
    >>> fig = token_qkv_diagram(rng.standard_normal(E), rng.standard_normal((E, Dk)),
    ...                         rng.standard_normal((E, Dk)), rng.standard_normal((E, Dv)))
    >>> [t for t in figure_texts(fig) if t.startswith("(")]  # x, W_Q, q, W_K, k, W_V, v
    ['(4,)', '(4, 3)', '(3,)', '(4, 3)', '(3,)', '(4, 2)', '(2,)']
    """
    if not isinstance(token, str):
        raise TypeError(f"token must be a str; got {type(token).__name__}")
    x = _real_array(x, "x", 1)
    W_q, W_k, W_v = (_real_array(W, n, 2) for W, n in ((W_q, "W_q"), (W_k, "W_k"), (W_v, "W_v")))
    E = x.shape[0]
    for W, n in ((W_q, "W_q"), (W_k, "W_k"), (W_v, "W_v")):
        if W.shape[0] != E:
            raise ValueError(
                f"{n} must have E = {E} rows, one per entry of x; "
                f"got x.shape={x.shape}, {n}.shape={W.shape}"
            )
    if W_q.shape[1] != W_k.shape[1]:
        raise ValueError(
            f"W_q and W_k must share the width Dk; got W_q.shape={W_q.shape}, W_k.shape={W_k.shape}"
        )
    Dk, Dv = W_q.shape[1], W_v.shape[1]
    for n, v in (("E", E), ("Dk", Dk), ("Dv", Dv)):
        _at_most(v, MAX_CELLS, n)

    branches = [
        ("q", "Q", W_q, ("E", "D_k"), QUERY, ("D_k",)),
        ("k", "K", W_k, ("E", "D_k"), KEY, ("D_k",)),
        ("v", "V", W_v, ("E", "D_v"), VALUE, ("D_v",)),
    ]
    token_text = f"\u201c{token}\u201d"
    token_w = text_size(token_text, NAME_PT)[0] + 0.2
    widest = max(Dk, Dv)
    out_names = [f"${o} = x\\,W_{b}$" for o, b, *_ in branches]
    name_w = max(text_size(n, NAME_PT)[0] for n in out_names)
    # Vector cells: wide enough for two decimals when the row fits, else narrower and blank.
    fixed = 2 * MARGIN + token_w + 0.3 + 0.45 + 0.45 + 0.1
    unit_w = min(0.17, 1.2 / widest, 0.85 / E)  # projection grids: at most 0.85 in high
    room = FULL_WIDTH - fixed - widest * unit_w
    cell = min(0.5, room / (E + widest))
    cell = max(cell, 0.05)
    vec_h = max(min(cell, 0.24), 0.12)

    rows_h = [max(E * unit_w, 0.1) for _ in branches]
    label_above = _line_height(NAME_PT) + 0.07
    label_below = 2 * _line_height(LABEL_PT) + 0.07
    branch_h = [h + label_above + label_below + 0.12 for h in rows_h]
    height = sum(branch_h) + 2 * MARGIN

    x_vec0 = MARGIN + token_w + 0.3
    x_w0 = x_vec0 + E * cell + 0.45
    x_out0 = x_w0 + widest * unit_w + 0.45
    width = max(x_out0 + widest * cell, x_out0 + name_w) + MARGIN
    x_w_name = max(text_size("$W_Q$", NAME_PT)[0], text_size(_mathtext_shape(("E", "D_k")))[0])
    width = min(FULL_WIDTH, max(width, x_w0 + x_w_name + MARGIN))
    fig, ax = new_canvas(width, height)

    # The middle branch sets the height of x and of the token.
    y_top = height - MARGIN
    centres = []
    for h, bh in zip(rows_h, branch_h):
        centres.append(y_top - label_above - 0.06 - h / 2)
        y_top -= bh
    y_mid = centres[1]
    tok = draw_box(ax, MARGIN, y_mid - 0.2, token_w, 0.4, token_text, color=NEUTRAL, fill=0.08)
    x_rect = draw_matrix(
        ax,
        x_vec0,
        y_mid - vec_h / 2,
        (E,),
        unit=cell,
        min_size=vec_h,
        color=NEUTRAL,
        fill=0.12,
        name="embedding $x$",
        dims=("E",),
        values=x,
        tag="x",
    )
    draw_arrow(ax, tok.right, x_rect.left)
    for (o, b, W, dims, color, out_dims), yc, h in zip(branches, centres, rows_h):
        w_rect = draw_matrix(
            ax,
            x_w0,
            yc - h / 2,
            W.shape,
            unit=unit_w,
            color=color,
            fill=0.3,
            name=f"$W_{b}$",
            dims=dims,
            tag=f"W_{b}",
        )
        draw_arrow(ax, (x_rect.x1 + 0.04, x_rect.cy), (w_rect.x0 - 0.02, yc))
        out = x @ W  # (E,) @ (E, D) -> (D,)
        o_rect = draw_matrix(
            ax,
            x_out0,
            yc - vec_h / 2,
            out.shape,
            unit=cell,
            min_size=vec_h,
            color=color,
            fill=0.35,
            name=f"${o} = x\\,W_{b}$",
            dims=out_dims,
            values=out,
            tag=o,
        )
        draw_arrow(ax, (w_rect.x1 + 0.04, yc), (o_rect.x0 - 0.02, yc))
    return fig


# ----------------------------------------------------------------------------------------------
# 2. The whole computation, with shapes


def _fit_unit(layout, unit_max: float, width_max: float, height_max: float):
    """Largest cell side (at most ``unit_max``) for which ``layout(unit)`` fits the bounds.

    ``layout(unit)`` returns ``(width, height, plan)``; returns ``(unit, width, height, plan)``
    for the chosen unit (the smallest tried if none fits: the canvas then says why).
    """

    def fits(result):
        return result[0] <= width_max + 1e-9 and result[1] <= height_max + 1e-9

    best = layout(unit_max)
    if fits(best):
        return (unit_max, *best)
    lo, hi = 1e-6, unit_max  # bisect on a log scale: sizes run from 1 to thousands
    low = layout(lo)
    if not fits(low):
        return (lo, *low)
    for _ in range(40):
        mid = (lo * hi) ** 0.5
        result = layout(mid)
        if fits(result):
            lo, low = mid, result
        else:
            hi = mid
    return (lo, *low)


def attention_pipeline_diagram(
    T: int, S: int, Dk: int, Dv: int, *, mask: bool = True, compact: bool = False
):
    r"""The whole computation with its shapes: ``Q, K -> scores -> scale -> mask -> softmax ->
    weights -> @ V -> out``.

    The matrices are grids whose proportions follow the sizes, laid out as in a hand
    multiplication: :math:`K^\top` sits above the scores :math:`QK^\top` (row ``i`` of
    :math:`Q` meets column ``j`` of :math:`K^\top` in score ``(i, j)``), and :math:`V` above
    the output :math:`O = AV`. Between the scores and the weights :math:`A` come the steps of
    the softmax; the arrow into the softmax carries :math:`Z`, the scaled, masked scores.

    Parameters
    ----------
    T, S, Dk, Dv : int
        Queries, keys, query/key width, value width.
    mask : bool, default True
        Draw the masking step (a causal mask, top-left aligned as in
        :func:`sdpa.causal_mask`; the weights it sets to zero are grey).
    compact : bool, default False
        A smaller version (about 4.8 in wide): symbols only, the three steps in one box.

    Returns
    -------
    matplotlib.figure.Figure

    Raises
    ------
    TypeError
        If a size is not an integer, or ``mask``/``compact`` not a bool.
    ValueError
        If a size is not positive.

    Examples
    --------
    >>> from sdpa_book.diagrams import attention_pipeline_diagram, figure_texts
    >>> texts = figure_texts(attention_pipeline_diagram(T=4, S=6, Dk=3, Dv=2))
    >>> [t for t in texts if t.startswith("(")]  # Q, scores, weights, O; then K^T, V
    ['(4, 3)', '(4, 6)', '(4, 6)', '(4, 2)', '(3, 6)', '(6, 2)']
    """
    T, S, Dk, Dv = (_positive_int(v, n) for v, n in ((T, "T"), (S, "S"), (Dk, "Dk"), (Dv, "Dv")))
    mask = _flag(mask, "mask")
    compact = _flag(compact, "compact")
    words = (
        {}
        if compact
        else {
            "Q": "queries ",
            "Kt": "keys ",
            "Z": "scores ",
            "A": "weights ",
            "V": "values ",
            "O": "out ",
        }
    )
    specs = {
        "Q": ((T, Dk), ("T", "D_k"), "$Q$", QUERY),
        "Kt": ((Dk, S), ("D_k", "S"), "$K^\\top$", KEY),
        "Z": ((T, S), ("T", "S"), "$QK^\\top$", SCORES),
        "A": ((T, S), ("T", "S"), "$A$", SCORES),
        "V": ((S, Dv), ("S", "D_v"), "$V$", VALUE),
        "O": ((T, Dv), ("T", "D_v"), "$O = AV$", OUTPUT),
    }
    names = {k: words.get(k, "") + spec[2] for k, spec in specs.items()}
    tags = {"Q": "Q", "Kt": "K^T", "Z": "scores", "A": "weights", "V": "V", "O": "O"}
    labels = {
        k: _stack_size(_label_lines(names[k], spec[1], spec[0], "s", "s")["s"])
        for k, spec in specs.items()
    }
    step_texts = ["$\\div\\sqrt{D_k}$"] + (["causal\nmask"] if mask else []) + ["softmax"]
    if compact:
        step_texts = ["\n".join(t.replace("\n", " ") for t in step_texts)]
    step_sizes = [text_size(t, NAME_PT) for t in step_texts]
    step_w = [w + 0.2 for w, _ in step_sizes]
    step_h = [h + 0.14 for _, h in step_sizes]
    arrow = 0.32
    gap = 0.07  # between a product and the matrices it is made of

    def layout(unit):
        w = {k: _extent(spec[0][1], unit, 0.1) for k, spec in specs.items()}
        h = {k: _extent(spec[0][0], unit, 0.1) for k, spec in specs.items()}
        x = {}
        x["Q"] = MARGIN + max(0.0, (labels["Q"][0] - w["Q"]) / 2)
        x["Z"] = (
            x["Q"]
            + w["Q"]
            + max(gap, (labels["Q"][0] + labels["Z"][0]) / 2 + 0.15 - (w["Q"] + w["Z"]) / 2)
        )
        steps_x = [x["Z"] + w["Z"] + arrow]
        for sw in step_w[:-1]:
            steps_x.append(steps_x[-1] + sw + arrow)
        x["A"] = steps_x[-1] + step_w[-1] + arrow
        # The labels of K^T (right of it) and of V (left of it) share the space above the steps.
        needed = x["Z"] + w["Z"] + 0.1 + labels["Kt"][0] + 0.25 + labels["V"][0] + 0.1
        x["O"] = (
            x["A"]
            + w["A"]
            + max(gap, (labels["A"][0] + labels["O"][0]) / 2 + 0.15 - (w["A"] + w["O"]) / 2)
        )
        if needed > x["O"]:  # lengthen the arrows around the steps evenly
            extra = (needed - x["O"]) / (len(steps_x) + 1)
            steps_x = [sx + (i + 1) * extra for i, sx in enumerate(steps_x)]
            x["A"] += extra * (len(steps_x) + 1)
            x["O"] += extra * (len(steps_x) + 1)
        width = x["O"] + w["O"] + max(0.0, (labels["O"][0] - w["O"]) / 2) + MARGIN
        below = max(labels[k][1] for k in ("Q", "Z", "A", "O")) + 0.06
        y_row = MARGIN + below
        row_h = max(h["Q"], max(step_h))
        y_top_row = y_row + (row_h + h["Q"]) / 2 + gap
        floor = y_row + row_h / 2 + max(step_h) / 2 + 0.05  # labels beside K^T, V clear the steps
        top = (
            max(
                y_top_row + max(h["Kt"], h["V"]),
                *(
                    max(y_top_row + h[k] / 2 + labels[k][1] / 2, floor + labels[k][1])
                    for k in ("Kt", "V")
                ),
            )
            + MARGIN
        )
        return width, top, (w, h, x, steps_x, y_row, y_top_row)

    width_max = 4.8 if compact else FULL_WIDTH
    unit, width, height, plan = _fit_unit(
        layout, 0.16 if compact else 0.22, width_max, 2.6 if compact else 3.6
    )
    w, h, x, steps_x, y_row, y_top_row = plan
    fig, ax = new_canvas(width, height)
    floor = y_row + max(h["Q"], max(step_h)) / 2 + max(step_h) / 2 + 0.05
    # The bottom row is centred on the taller of the query grid and the step boxes.
    row_h = max(h["Q"], max(step_h))
    y_q = y_row + (row_h - h["Q"]) / 2
    grids = {}
    for key, (shape, dims, _, color) in specs.items():
        if key in ("Kt", "V"):
            continue
        masked = None
        if key == "A" and mask:
            masked = np.triu(np.ones((T, S), dtype=bool), k=1)  # top-left causal: j > i
        grids[key] = draw_matrix(
            ax,
            x[key],
            y_q,
            shape,
            unit=unit,
            color=color,
            name=names[key],
            dims=dims,
            name_at="below",
            shape_at="below",
            masked=masked,
            fill=0.45 if key in ("Z", "A") else 0.35,
            tag=tags[key],
        )
    for key, over, side in (("Kt", "Z", "right"), ("V", "O", "left")):
        shape, dims, _, color = specs[key]
        grids[key] = draw_matrix(
            ax,
            x[over],
            grids[over].y1 + gap,
            shape,
            unit=unit,
            color=color,
            name=names[key],
            dims=dims,
            name_at=side,
            shape_at=side,
            label_floor=floor,
            tag=tags[key],
        )
    yc = grids["Z"].cy
    boxes = [
        draw_box(ax, sx, yc - sh / 2, sw, sh, text, color=NEUTRAL, fill=0.1)
        for sx, sw, sh, text in zip(steps_x, step_w, step_h, step_texts)
    ]
    points = [grids["Z"].right] + [p for b in boxes for p in (b.left, b.right)] + [grids["A"].left]
    for i in range(0, len(points), 2):
        into_softmax = i == len(points) - 4 and not compact
        into_weights = i == len(points) - 2 and compact
        label = "$Z$" if into_softmax or into_weights else None
        draw_arrow(ax, (points[i][0] + 0.03, yc), (points[i + 1][0] - 0.03, yc), label=label)
    return fig


# ----------------------------------------------------------------------------------------------
# 3. Multi-head attention; grouped query heads


def _drawn_heads(H: int, limit: int = 4) -> list[int | None]:
    """The heads a diagram draws, 0-based: all of them up to ``limit``, else the first two, a
    gap (None) and the last."""
    return list(range(H)) if H <= limit else [0, 1, None, H - 1]


def _line(ax, start, end, color, *, linewidth: float = 0.9, linestyle: str = "-"):
    _segment(
        ax,
        [start[0], end[0]],
        [start[1], end[1]],
        color=color,
        linewidth=linewidth,
        linestyle=linestyle,
        solid_capstyle="round",
    )


def multihead_diagram(T: int, E: int, H: int, Dk: int, Dv: int):
    r"""Multi-head attention: project, split into heads, attend per head, concatenate, ``W_O``.

    From top to bottom: the input :math:`X` ``(T, E)``; the projections :math:`W_Q, W_K, W_V`
    to :math:`Q, K` ``(T, H Dk)`` and :math:`V` ``(T, H Dv)``, each drawn as ``H`` blocks of
    columns (one per head); head :math:`h` attends with block :math:`h` of each; the heads'
    outputs ``(T, Dv)`` are concatenated to ``(T, H Dv)`` and projected by :math:`W_O` back to
    ``(T, E)``. With more than four heads, heads 1, 2 and ``H`` are drawn.

    Parameters
    ----------
    T, E, H, Dk, Dv : int
        Tokens, model width, heads, query/key width and value width per head.

    Returns
    -------
    matplotlib.figure.Figure

    Raises
    ------
    TypeError
        If a size is not an integer.
    ValueError
        If a size is not positive.

    Examples
    --------
    >>> from sdpa_book.diagrams import multihead_diagram, figure_texts
    >>> texts = figure_texts(multihead_diagram(T=5, E=12, H=3, Dk=4, Dv=2))
    >>> [t for t in texts if t.startswith("(")]  # X; Q, K, V; one head's out; concat; out
    ['(5, 12)', '(5, 12)', '(5, 12)', '(5, 6)', '(5, 2)', '(5, 6)', '(5, 12)']
    >>> [t for t in texts if t.startswith("$W")]  # the projections and their shapes
    ['$W_Q$\n$(E, HD_k)$\n(12, 12)', '$W_K$\n$(E, HD_k)$\n(12, 12)',
     '$W_V$\n$(E, HD_v)$\n(12, 6)', '$W_O$\n$(HD_v, E)$\n(6, 12)']
    """
    T, E, H, Dk, Dv = (
        _positive_int(v, n) for v, n in ((T, "T"), (E, "E"), (H, "H"), (Dk, "Dk"), (Dv, "Dv"))
    )
    width = FULL_WIDTH
    avail = width - 2 * MARGIN
    slot = avail / 3
    proj = [
        ("Q", "$Q$", QUERY, ("T", "HD_k"), (T, H * Dk), Dk, ("E", "HD_k"), (E, H * Dk)),
        ("K", "$K$", KEY, ("T", "HD_k"), (T, H * Dk), Dk, ("E", "HD_k"), (E, H * Dk)),
        ("V", "$V$", VALUE, ("T", "HD_v"), (T, H * Dv), Dv, ("E", "HD_v"), (E, H * Dv)),
    ]
    label_w = max(
        _stack_size(_label_lines(n, d, s, "s", "s")["s"])[0] for _, n, _, d, s, *_ in proj
    )
    singles = [
        ("X", "input $X$", ("T", "E"), (T, E)),
        ("concat", "concatenate", ("T", "HD_v"), (T, H * Dv)),
        ("out", "out", ("T", "E"), (T, E)),
    ]
    single_label_w = max(
        _stack_size(_label_lines(n, d, s, "s", "s")["s"])[0] for _, n, d, s in singles
    )
    unit = min(
        0.16,
        (slot - label_w - 0.25) / (H * max(Dk, Dv)),
        (avail - 2 * single_label_w - 0.2) / max(E, H * Dv),
        0.7 / T,
    )
    grid_h = _extent(T, unit, 0.1)
    level_h = max(grid_h, 3 * _line_height(LABEL_PT) + 0.02)
    box_text = [f"$W_{n}$\n{_mathtext_shape(d)}\n{_numeric_shape(s)}" for n, *_, d, s in proj]
    box_w = max(text_size(t, LABEL_PT)[0] for t in box_text) + 0.2
    box_h = text_size(box_text[0], LABEL_PT)[1] + 0.1
    head_h = 0.32
    gap = 0.22
    fan = 0.45  # room for the lines from the head blocks to the heads
    heights = [
        level_h,
        gap,
        box_h,
        gap,
        level_h,
        fan,
        head_h,
        gap,
        level_h,
        gap,
        box_h,
        gap,
        level_h,
    ]
    height = sum(heights) + 2 * MARGIN
    fig, ax = new_canvas(width, height)

    tops = list(np.cumsum([0.0] + heights[:-1]))  # distance from the top of the drawing
    top_of = [height - MARGIN - t for t in tops]

    def centred_grid(cx, level, shape, **kwargs):
        w, h = _matrix_size(shape, unit)
        # labels that start at the grid's top: the grid starts at the level's top
        y = top_of[level] - (h if kwargs.get("label_align") == "top" else level_h / 2 + h / 2)
        return draw_matrix(
            ax, cx - w / 2, y, shape, unit=unit, name_at="right", shape_at="right", **kwargs
        )

    cx = MARGIN + avail / 2 - single_label_w / 2
    x_rect = centred_grid(
        cx,
        0,
        (T, E),
        color=NEUTRAL,
        fill=0.15,
        name="input $X$",
        dims=("T", "E"),
        tag="X",
        label_align="top",
    )
    # X feeds the three projections through a stem that clears X's labels.
    stem_y = top_of[0] - level_h
    _line(ax, (x_rect.cx, x_rect.y0), (x_rect.cx, stem_y), INK, linewidth=1.2)
    blocks = {}
    for i, (key, name, color, dims, shape, block, _, _) in enumerate(proj):
        slot_cx = MARGIN + slot * (i + 0.5) - label_w / 2
        box = draw_box(
            ax,
            slot_cx - box_w / 2,
            top_of[2] - box_h,
            box_w,
            box_h,
            box_text[i],
            color=color,
            fill=0.12,
            fontsize=LABEL_PT,
        )
        draw_arrow(ax, (x_rect.cx, stem_y), (box.cx, box.y1 + 0.02))
        grid = centred_grid(
            slot_cx,
            4,
            shape,
            color=color,
            name=name,
            dims=dims,
            col_blocks=block,
            tag=key,
            label_align="top",
        )
        draw_arrow(ax, (box.cx, box.y0 - 0.02), (grid.cx, grid.y1 + 0.03))
        blocks[key] = (grid, shape, block)

    heads = _drawn_heads(H)
    head_w = min(1.05, (avail - 0.3 * len(heads)) / len(heads))
    spread = avail - label_w
    head_boxes = {}
    head_y = top_of[6] - head_h
    for n, h in enumerate(heads):
        hx = MARGIN + spread * (n + 0.5) / len(heads) - head_w / 2
        if h is None:
            ax.text(
                hx + head_w / 2,
                head_y + head_h / 2,
                "\N{HORIZONTAL ELLIPSIS}",
                ha="center",
                va="center",
                fontsize=NAME_PT,
                color=INK,
            )
            continue
        head_boxes[h] = draw_box(
            ax, hx, head_y, head_w, head_h, f"head {h + 1}", color=NEUTRAL, fill=0.1
        )
        for key, color in (("Q", QUERY), ("K", KEY), ("V", VALUE)):
            grid, shape, block = blocks[key]
            part = _block_rect(grid, shape, (0, shape[0]), (h * block, (h + 1) * block))
            # down to the bottom of the level (clear of the labels), then to the head
            fan_y = top_of[4] - level_h
            _line(ax, (part.cx, part.y0), (part.cx, fan_y), _shade(color))
            offset = {"Q": -0.15, "K": 0.0, "V": 0.15}[key]
            _line(
                ax,
                (part.cx, fan_y),
                (head_boxes[h].cx + offset, head_boxes[h].y1 + 0.01),
                _shade(color),
            )
    last = head_boxes[max(head_boxes)]
    _label_stack(
        ax,
        Rect(last.x0, last.y0, last.x1, last.y1),
        "right",
        [("each head", LABEL_PT), ("$(T, D_v)$", LABEL_PT), (_numeric_shape((T, Dv)), LABEL_PT)],
    )

    concat = centred_grid(
        cx,
        8,
        (T, H * Dv),
        color=OUTPUT,
        fill=0.3,
        name="concatenate",
        dims=("T", "HD_v"),
        col_blocks=Dv,
        tag="concat",
        label_align="top",
    )
    for h, box in head_boxes.items():
        part = _block_rect(concat, (T, H * Dv), (0, T), (h * Dv, (h + 1) * Dv))
        draw_arrow(ax, (box.cx, box.y0 - 0.02), (part.cx, part.y1 + 0.03))
    wo_text = f"$W_O$\n{_mathtext_shape(('HD_v', 'E'))}\n{_numeric_shape((H * Dv, E))}"
    wo = draw_box(
        ax,
        cx - box_w / 2,
        top_of[10] - box_h,
        box_w,
        box_h,
        wo_text,
        color=OUTPUT,
        fill=0.12,
        fontsize=LABEL_PT,
    )
    draw_arrow(ax, (concat.cx, concat.y0 - 0.03), (wo.cx, wo.y1 + 0.02))
    out = centred_grid(
        cx,
        12,
        (T, E),
        color=OUTPUT,
        fill=0.45,
        name="out",
        dims=("T", "E"),
        tag="out",
        label_align="top",
    )
    draw_arrow(ax, (wo.cx, wo.y0 - 0.02), (out.cx, out.y1 + 0.03))
    return fig


def _kind_of_heads(Hq: int, Hkv: int) -> str:
    if Hkv == Hq:
        return "multi-head (MHA)"
    if Hkv == 1:
        return "multi-query (MQA)"
    return "grouped-query (GQA)"


def grouped_heads_diagram(Hq: int, Hkv):
    r"""Query heads in groups of ``G = Hq / Hkv`` sharing one key/value head: MHA, GQA, MQA.

    Each panel draws the ``Hq`` query heads above the ``Hkv`` key/value heads (a key above a
    value) and joins each query head to the key/value head its group shares. ``Hkv = Hq`` is
    multi-head attention (groups of one), ``Hkv = 1`` multi-query attention, anything between
    grouped-query attention. Pass several ``Hkv`` to draw them side by side.

    Parameters
    ----------
    Hq : int
        Query heads (at most 64).
    Hkv : int or sequence of int
        Key/value heads, each dividing ``Hq``; a sequence of up to four draws one panel each,
        e.g. ``[8, 2, 1]`` for MHA, GQA and MQA.

    Returns
    -------
    matplotlib.figure.Figure

    Raises
    ------
    TypeError
        If ``Hq`` or an ``Hkv`` is not an integer.
    ValueError
        If a size is not positive, ``Hq`` exceeds 64, an ``Hkv`` does not divide ``Hq``, or
        more than four panels (or none) are asked for.

    Examples
    --------
    >>> from sdpa_book.diagrams import grouped_heads_diagram, figure_texts
    >>> texts = figure_texts(grouped_heads_diagram(8, [8, 2, 1]))
    >>> [t for t in texts if "$H_q" in t]
    ['$H_q = 8$, $H_{kv} = 8$, $G = 1$', '$H_q = 8$, $H_{kv} = 2$, $G = 4$',
     '$H_q = 8$, $H_{kv} = 1$, $G = 8$']
    """
    Hq = _at_most(_positive_int(Hq, "Hq"), 64, "Hq")
    many = isinstance(Hkv, (list, tuple, np.ndarray))
    kv_list = [_positive_int(h, "Hkv") for h in (Hkv if many else [Hkv])]
    if not 1 <= len(kv_list) <= 4:
        raise ValueError(
            f"Hkv must hold one to four head counts (one panel each); got {len(kv_list)}"
        )
    for h in kv_list:
        if Hq % h:
            raise ValueError(
                f"Hkv must divide Hq, so that query heads form equal groups; got Hq={Hq}, Hkv={h}"
            )

    n = len(kv_list)
    panel_w = FULL_WIDTH / n if n > 1 else min(FULL_WIDTH, max(3.6, 0.3 * Hq + 0.6))
    title_h = 2 * _line_height(LABEL_PT) + 0.08
    bracket_h = 0.3
    q_h, kv_h, link_h = 0.26, 0.22, 0.55
    legend_h = 0.32
    notes = [f"cached: {h} key and {h} value head{'' if h == 1 else 's'}" for h in kv_list]
    if max(text_size(t)[0] for t in notes) > panel_w - 0.2:  # narrow panels: two lines
        notes = [t.replace(": ", ":\n") for t in notes]
    note_h = text_size(notes[0])[1] + 0.1
    height = MARGIN + title_h + bracket_h + q_h + link_h + 2 * kv_h + note_h + legend_h + MARGIN
    fig, ax = new_canvas(panel_w * n, height)

    for p, Hkv_p in enumerate(kv_list):
        G = Hq // Hkv_p
        x0 = p * panel_w + 0.12
        span = panel_w - 0.24
        pitch = span / Hq
        qw = pitch * (0.78 if Hq > 1 else 0.5)
        y_title = height - MARGIN
        ax.text(
            x0 + span / 2,
            y_title,
            _kind_of_heads(Hq, Hkv_p),
            ha="center",
            va="top",
            fontsize=NAME_PT,
            color=INK,
        )
        ax.text(
            x0 + span / 2,
            y_title - _line_height(NAME_PT) - 0.02,
            f"$H_q = {Hq}$, $H_{{kv}} = {Hkv_p}$, $G = {G}$",
            ha="center",
            va="top",
            fontsize=LABEL_PT,
            color=INK,
        )
        y_q = y_title - title_h - bracket_h - q_h
        show_index = qw >= 0.17 and Hq <= 32
        queries = []
        for h in range(Hq):
            qx = x0 + h * pitch + (pitch - qw) / 2
            queries.append(
                draw_box(
                    ax,
                    qx,
                    y_q,
                    qw,
                    q_h,
                    str(h + 1) if show_index else None,
                    color=QUERY,
                    fill=0.35,
                    fontsize=LABEL_PT,
                    rounded=qw > 0.1,
                    tag=f"{p}: query {h}",
                )
            )
        if G > 1:  # one bracket per group, the first one labelled
            for g in range(Hkv_p):
                first, last = queries[g * G], queries[(g + 1) * G - 1]
                draw_bracket(
                    ax,
                    first.x0,
                    last.x1,
                    y_q + q_h + 0.04,
                    f"$G = {G}$" if g == 0 else None,
                    depth=0.05,
                )
        y_kv = y_q - link_h - 2 * kv_h
        group_w = G * pitch
        kvw = group_w - (pitch - qw) if G > 1 else qw
        for g in range(Hkv_p):
            kx = x0 + g * group_w + (group_w - kvw) / 2
            key = draw_box(
                ax,
                kx,
                y_kv + kv_h,
                kvw,
                kv_h,
                None,
                color=KEY,
                fill=0.45,
                rounded=False,
                tag=f"{p}: key {g}",
            )
            draw_box(
                ax,
                kx,
                y_kv,
                kvw,
                kv_h,
                None,
                color=VALUE,
                fill=0.45,
                rounded=False,
                tag=f"{p}: value {g}",
            )
            for h in range(g * G, (g + 1) * G):
                spread = (h - g * G - (G - 1) / 2) * min(
                    0.02, kvw / (2 * G)
                )  # fan in, not one point
                _line(
                    ax, queries[h].bottom, (key.cx + spread, key.y1), _shade(QUERY), linewidth=0.9
                )
        ax.text(
            x0 + span / 2,
            y_kv - 0.05,
            notes[p],
            ha="center",
            va="top",
            fontsize=LABEL_PT,
            color=INK,
            linespacing=1.3,
        )
        if p:  # panels apart
            _line(
                ax,
                (p * panel_w, MARGIN + legend_h),
                (p * panel_w, height - MARGIN),
                "#cccccc",
                linewidth=0.8,
                linestyle=":",
            )
    role_legend(ax, [("query head", QUERY), ("key head", KEY), ("value head", VALUE)])
    return fig


# ----------------------------------------------------------------------------------------------
# 4. Masks as geometry


def mask_geometry_diagram(T: int, S: int, *, window: int = 3, lengths=None):
    r"""Masks as geometry: causal, padding and sliding-window masks as grids of may-attend and
    masked cells, and, when ``T != S``, the causal mask aligned top-left against bottom-right.

    Row ``i`` is query ``i``, column ``j`` key ``j``; a cell is blue where the query may attend
    the key and grey where it is masked (``sdpa_book.figures.ALLOWED_COLOR``,
    ``sdpa_book.figures.MASKED_COLOR``). The masks are the package's own
    (:func:`sdpa.causal_mask`, :func:`sdpa.padding_mask`, :func:`sdpa.sliding_window_mask`).
    When ``T != S`` the bottom-right panel labels the diagonal's offset ``S - T``: query ``i``
    sits at key position ``i + S - T``, as when ``T`` new queries follow ``S - T`` cached keys;
    the sliding window is then aligned bottom-right too.

    Parameters
    ----------
    T, S : int
        Queries and keys (each at most 32).
    window : int, default 3
        Width ``w`` of the causal sliding window: each query keeps its ``w`` most recent keys
        (``window=(w - 1, 0)`` in :func:`sdpa.sliding_window_mask`).
    lengths : sequence of int, optional
        Real (unpadded) lengths of up to three sequences, each in ``[0, S]``: one padding panel
        each. Default: one sequence of ``S - S // 3`` keys.

    Returns
    -------
    matplotlib.figure.Figure

    Raises
    ------
    TypeError
        If a size, the window or a length is not an integer.
    ValueError
        If a size or the window is not positive, ``T`` or ``S`` exceeds 32, a length lies
        outside ``[0, S]``, or there are more than three lengths (or none).

    Examples
    --------
    >>> from sdpa_book.diagrams import mask_geometry_diagram, figure_texts
    >>> texts = figure_texts(mask_geometry_diagram(3, 5, window=2, lengths=[4]))
    >>> [t for t in texts if t.startswith("causal")]
    ['causal, top-left', 'causal, bottom-right']
    >>> "$S - T = 2$" in texts  # the bottom-right diagonal's offset
    True
    """
    import sdpa

    T = _at_most(_positive_int(T, "T"), 32, "T")
    S = _at_most(_positive_int(S, "S"), 32, "S")
    w = _positive_int(window, "window")
    if lengths is None:
        lengths = [S - S // 3]
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, (Sequence, np.ndarray)):
        raise TypeError(f"lengths must be a sequence of integers; got {lengths!r}")
    lengths = [int(_nonneg_length(n, S)) for n in lengths]
    if not 1 <= len(lengths) <= 3:
        raise ValueError(
            f"lengths must hold one to three sequence lengths (one panel each); got {len(lengths)}"
        )

    aligned = T != S
    panels = []  # (title, subtitle, allowed (T, S), offset to label or None)
    if aligned:
        panels.append(("causal, top-left", "$j \\leq i$", sdpa.causal_mask(T, S), 0))
        panels.append(
            (
                "causal, bottom-right",
                "$j \\leq i + S - T$",
                sdpa.causal_mask(T, S, alignment="bottom_right"),
                S - T,
            )
        )
    else:
        panels.append(("causal", "$j \\leq i$", sdpa.causal_mask(T, S), None))
    pad = sdpa.padding_mask(np.array(lengths), S)[:, 0, 0]  # (B, S)
    for n, row in zip(lengths, pad):
        panels.append((f"padding, length {n}", f"$j < {n}$", np.broadcast_to(row, (T, S)), None))
    alignment = "bottom_right" if aligned else "top_left"
    panels.append(
        (
            f"sliding window, $w = {w}$",
            f"the {w} most recent key{'s' if w > 1 else ''}",
            sdpa.sliding_window_mask(T, S, (w - 1, 0), alignment=alignment),
            None,
        )
    )

    per_row = min(len(panels), 4)
    n_rows = -(-len(panels) // per_row)
    panel_w = FULL_WIDTH / per_row
    side = 0.28  # left of the first column: "queries i"
    cell = min(0.22, (panel_w - 0.3 - side / per_row) / S, 1.7 / T)
    grid_w, grid_h = S * cell, T * cell
    title_h = _line_height(NAME_PT) + _line_height(LABEL_PT) + 0.06
    offset_h = 0.3 if aligned and S > T else 0.0  # the bracket over the first S - T keys
    below_h = 2 * _line_height(LABEL_PT) + 0.06
    row_h = title_h + offset_h + grid_h + below_h + 0.12
    legend_h = 0.3
    height = MARGIN + n_rows * row_h + legend_h + MARGIN
    fig, ax = new_canvas(FULL_WIDTH, height)

    for k, (title, subtitle, allowed, offset) in enumerate(panels):
        r, c = divmod(k, per_row)
        x_mid = side + (FULL_WIDTH - side) * (c + 0.5) / per_row
        y_top = height - MARGIN - r * row_h
        ax.text(x_mid, y_top, title, ha="center", va="top", fontsize=NAME_PT, color=INK)
        ax.text(
            x_mid,
            y_top - _line_height(NAME_PT),
            subtitle,
            ha="center",
            va="top",
            fontsize=LABEL_PT,
            color=INK,
        )
        y0 = y_top - title_h - offset_h - grid_h
        grid = draw_matrix(
            ax,
            x_mid - grid_w / 2,
            y0,
            (T, S),
            unit=cell,
            color=ALLOWED_COLOR,
            fill=1.0,
            masked=~np.asarray(allowed),
            name="keys $j$",
            name_at="below",
            shape_at=None,
            tag=f"mask {k}",
        )
        ax.text(
            grid.cx,
            grid.y0 - 0.05 - _line_height(NAME_PT),
            _numeric_shape((T, S)),
            ha="center",
            va="top",
            fontsize=LABEL_PT,
            color=INK,
        )
        if c == 0:
            ax.text(
                grid.x0 - 0.08,
                grid.cy,
                "queries $i$",
                ha="right",
                va="center",
                rotation=90,
                fontsize=NAME_PT,
                color=INK,
                rotation_mode="anchor",
            )
        if offset:
            if offset > 0:  # query 0 sees keys 0 .. S - T
                draw_bracket(
                    ax,
                    grid.x0,
                    grid.x0 + offset * cell,
                    grid.y1 + 0.04,
                    f"$S - T = {offset}$",
                    depth=0.05,
                )
            else:  # the first T - S queries see no key
                draw_bracket(
                    ax,
                    grid.y1 + offset * cell,
                    grid.y1,
                    grid.x1 + 0.04,
                    f"$S - T = {offset}$",
                    side="right",
                    depth=0.05,
                )
    role_legend(ax, [("may attend", ALLOWED_COLOR), ("masked", MASKED_COLOR)])
    return fig


def _nonneg_length(n, S: int) -> int:
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, Integral):
        raise TypeError(f"lengths must hold integers; got {n!r}")
    if not 0 <= n <= S:
        raise ValueError(f"lengths must lie in [0, S={S}]; got {n}")
    return int(n)


# ----------------------------------------------------------------------------------------------
# 5. Decoding with a key-value cache


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def kv_cache_diagram(prompt_len: int, new_tokens: int):
    r"""Decoding with a KV cache: the prefill, then one token at a time against a growing cache.

    Each row is a query, each column a key position ``j``. The prefill runs the
    ``prompt_len`` prompt queries at once under a causal mask and writes all their keys and
    values into the cache; each later step runs one new query, writes one key and value
    (outlined) and attends every key cached so far. The rows grow by one key per step: the
    cache growing.

    Parameters
    ----------
    prompt_len : int
        Tokens of the prompt, processed together (``T = prompt_len`` queries).
    new_tokens : int
        Tokens decoded one at a time after it (``T = 1`` each). ``prompt_len + new_tokens``
        is at most 32.

    Returns
    -------
    matplotlib.figure.Figure

    Raises
    ------
    TypeError
        If a count is not an integer.
    ValueError
        If a count is not positive, or the total exceeds 32.

    Examples
    --------
    >>> from sdpa_book.diagrams import kv_cache_diagram, figure_texts
    >>> texts = figure_texts(kv_cache_diagram(prompt_len=4, new_tokens=2))
    >>> [t for t in texts if t.startswith("cache")]
    ['cache: 4 keys, 4 values', 'cache: 5 keys, 5 values', 'cache: 6 keys, 6 values']
    """
    P = _positive_int(prompt_len, "prompt_len")
    N = _positive_int(new_tokens, "new_tokens")
    n = _at_most(P + N, 32, "prompt_len + new_tokens")

    left = [f"prefill: {P} queries" if P > 1 else "prefill: 1 query", "at once, causal"]
    steps = [f"step {k + 1}: query {P + k}" for k in range(N)]
    right = [f"cache: {_count(P + k, 'key')}, {_count(P + k, 'value')}" for k in range(N + 1)]
    left_w = max(text_size(t)[0] for t in left + steps) + 0.2
    right_w = max(text_size(t)[0] for t in right) + 0.2
    cell = min(0.26, (FULL_WIDTH - 2 * MARGIN - left_w - right_w) / n)
    pitch = max(cell, _line_height(LABEL_PT) + 0.02)  # a decode row holds one line of text
    bracket_h = 0.34
    axis_h = 2 * _line_height(LABEL_PT) + 0.08
    legend_h = 0.32
    height = MARGIN + bracket_h + P * cell + 0.22 + N * pitch + axis_h + legend_h + MARGIN
    width = MARGIN + left_w + n * cell + right_w + MARGIN
    legend_w = 4.4  # the three entries of the legend
    fig, ax = new_canvas(min(FULL_WIDTH, max(width, legend_w)), height)
    x0 = MARGIN + left_w + max(0.0, (legend_w - width) / 2)

    # Prefill: P queries against the P keys they write; key j > i is still in the future.
    y_pre = height - MARGIN - bracket_h - P * cell
    future = np.triu(np.ones((P, P), dtype=bool), k=1)
    pre = draw_matrix(
        ax,
        x0,
        y_pre,
        (P, P),
        unit=cell,
        color=ALLOWED_COLOR,
        fill=1.0,
        masked=future,
        name_at=None,
        shape_at=None,
        min_size=cell,
        tag="prefill",
    )
    draw_bracket(
        ax,
        pre.x0,
        pre.x1,
        pre.y1 + 0.04,
        f"{_count(P, 'key')} and {'values' if P > 1 else 'value'} written at once",
        depth=0.05,
    )
    ax.text(
        pre.x0 - 0.1,
        pre.cy,
        "\n".join(left),
        ha="right",
        va="center",
        fontsize=LABEL_PT,
        color=INK,
        linespacing=1.3,
    )
    ax.text(pre.x1 + 0.1, pre.cy, right[0], ha="left", va="center", fontsize=LABEL_PT, color=INK)

    # Decoding: one query per step, which sees every cached key, its own new one included.
    y = y_pre - 0.22
    for k in range(N):
        y -= pitch
        S = P + k + 1
        row = draw_matrix(
            ax,
            x0,
            y + (pitch - cell) / 2,
            (1, S),
            unit=cell,
            color=ALLOWED_COLOR,
            fill=1.0,
            name_at=None,
            shape_at=None,
            min_size=cell,
            tag=f"step {k + 1}",
        )
        new = _block_rect(row, (1, S), (0, 1), (S - 1, S))
        _outline(ax, new, INK, linewidth=2.0)
        ax.text(
            row.x0 - 0.1, row.cy, steps[k], ha="right", va="center", fontsize=LABEL_PT, color=INK
        )
        ax.text(
            row.x1 + 0.1, row.cy, right[k + 1], ha="left", va="center", fontsize=LABEL_PT, color=INK
        )
    # Key positions under the columns (every one if they fit, else every fifth).
    every = 1 if cell >= 0.17 else 5
    for j in range(0, n, every):
        ax.text(
            x0 + (j + 0.5) * cell,
            y - 0.05,
            str(j),
            ha="center",
            va="top",
            fontsize=LABEL_PT,
            color=INK,
        )
    ax.text(
        x0 + n * cell / 2,
        y - 0.05 - _line_height(LABEL_PT),
        "key position $j$",
        ha="center",
        va="top",
        fontsize=LABEL_PT,
        color=INK,
    )
    role_legend(
        ax,
        [
            ("may attend", ALLOWED_COLOR),
            ("masked (future key)", MASKED_COLOR),
            ("written this step", "white", {"edgecolor": INK, "linewidth": 2.0}),
        ],
    )
    return fig


# ----------------------------------------------------------------------------------------------
# 6. The FlashAttention loop


def _highlight(ax, rect: Rect, color):
    """Mark the block being worked on: a stronger tint and a heavy outline."""
    from matplotlib.colors import to_rgba

    _outline(ax, rect, INK, linewidth=2.0, fill=to_rgba(color, 0.55))


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
    i, j = min(1, n_q - 1), min(1, n_k - 1)  # the tile being computed

    def lines(name, dims, shape):
        return _label_lines(name, dims, shape, "s", "s")["s"]

    slow = {  # key: (shape, dims, name, colour)
        "Q": ((T, Dk), ("T", "D_k"), "$Q$", QUERY),
        "tiles": ((T, S), ("T", "S"), "scores: never stored", SCORES),
        "O": ((T, Dv), ("T", "D_v"), "$O$", OUTPUT),
        "lse": ((T,), ("T",), "lse", OUTPUT),
        "K^T": ((Dk, S), ("D_k", "S"), "$K^\\top$", KEY),
        "V": ((S, Dv), ("S", "D_v"), "$V$", VALUE),
    }
    fast = {
        "Q_i": ((Bq, Dk), ("B_q", "D_k"), "$Q_i$", QUERY),
        "tile": ((Bq, Bk), ("B_q", "B_k"), "score tile", SCORES),
        "acc": ((Bq, Dv), ("B_q", "D_v"), "acc", OUTPUT),
        "m": ((Bq,), ("B_q",), "$m$", NEUTRAL),
        "l": ((Bq,), ("B_q",), "$\\ell$", NEUTRAL),
        "K_j^T": ((Dk, Bk), ("D_k", "B_k"), "$K_j^\\top$", KEY),
        "V_j": ((Bk, Dv), ("B_k", "D_v"), "$V_j$", VALUE),
    }
    lab = {k: _stack_size(lines(v[2], v[1], v[0])) for k, v in {**slow, **fast}.items()}
    upright = {"lse", "m", "l"}  # one number per query row: columns
    loop = [
        (0, "for each query block $i$:"),
        (1, "load $Q_i$; $m = -\\infty$, $\\ell = 0$, acc $= 0$"),
        (1, "for each key block $j$:"),
        (2, "load $K_j$, $V_j$"),
        (2, "tile $= Q_i K_j^\\top / \\sqrt{D_k}$"),
        (2, "update $m$, $\\ell$, acc"),
        (1, "write $O_i =$ acc $/\\, \\ell$"),
        (1, "write $\\mathrm{lse}_i = m + \\log \\ell$"),
    ]
    indent = 0.18
    loop_w = max(text_size(t)[0] + d * indent for d, t in loop) + 0.1
    loop_step = 1.45 * LABEL_PT / 72  # roots and superscripts need more than one line
    loop_h = len(loop) * loop_step + _line_height(NAME_PT)
    title_h = _line_height(NAME_PT) + 0.08
    pad = 0.1

    def columns(unit, items, order, x_start, side_labels):
        """x of each grid in ``order`` (a row of grids, labels below), each gap clearing labels."""
        w = {k: _matrix_size(items[k][0], unit, column=k in upright)[0] for k in items}
        x = {}
        left_label, left_grid = side_labels
        first = order[0]
        x[first] = x_start + max(
            0.0, (lab[first][0] - w[first]) / 2, lab[left_label][0] + 0.12 - w[first] - 0.1
        )
        for a, b in zip(order, order[1:]):
            gap = max(0.07, (lab[a][0] + lab[b][0]) / 2 + 0.12 - (w[a] + w[b]) / 2)
            x[b] = x[a] + w[a] + gap
        return w, x

    arrow_labels = ["load $Q_i$", "load $K_j$, $V_j$", "write $O_i$, lse$_i$"]

    def layout(unit):
        """Sizes and places for one unit: slow memory on top, fast memory and the loop below."""
        h = {
            k: _matrix_size(v[0], unit, column=k in upright)[1] for k, v in {**slow, **fast}.items()
        }
        ws, xs = columns(unit, slow, ["Q", "tiles", "O", "lse"], MARGIN + pad, ("K^T", "Q"))
        slow_right = (
            max(
                xs["lse"] + ws["lse"] / 2 + lab["lse"][0] / 2, xs["O"] + ws["O"] + 0.1 + lab["V"][0]
            )
            + pad
        )
        wf, xf = columns(
            unit, fast, ["Q_i", "tile", "acc", "m", "l"], MARGIN + pad, ("K_j^T", "Q_i")
        )
        fast_right = (
            max(
                xf["l"] + wf["l"] / 2 + lab["l"][0] / 2, xf["acc"] + wf["acc"] + 0.1 + lab["V_j"][0]
            )
            + pad
        )
        below = max(lab[k][1] for k in ("Q", "tiles", "O", "lse")) + 0.06
        slow_h = (
            title_h
            + max(h["K^T"], h["V"], lab["V"][1], lab["K^T"][1])
            + 0.07
            + h["Q"]
            + below
            + pad
        )
        below_f = max(lab[k][1] for k in ("Q_i", "tile", "acc", "m", "l")) + 0.06
        fast_h = (
            title_h
            + max(h["K_j^T"], h["V_j"], lab["V_j"][1], lab["K_j^T"][1])
            + 0.07
            + h["Q_i"]
            + below_f
            + pad
        )
        fast_h = max(fast_h, loop_h + title_h + pad)  # the loop is written beside it
        width = max(slow_right, fast_right + 0.3 + loop_w) + MARGIN + 0.05
        height = MARGIN + slow_h + 0.55 + fast_h + MARGIN
        return (
            width,
            height,
            dict(
                ws=ws,
                xs=xs,
                slow_right=slow_right,
                wf=wf,
                xf=xf,
                fast_right=fast_right,
                h=h,
                slow_h=slow_h,
                fast_h=fast_h,
                fast_top=MARGIN + fast_h,
                loop_at=(fast_right + 0.3, MARGIN + fast_h),
            ),
        )

    unit, width, height, plan = _fit_unit(layout, 0.2, FULL_WIDTH, 5.8)
    xs, xf, h = plan["xs"], plan["xf"], plan["h"]
    fig, ax = new_canvas(width, height)

    def panel(x_left, y_top, panel_h, right, title, color):
        rect = draw_box(
            ax,
            x_left,
            y_top - panel_h,
            right - x_left,
            panel_h,
            None,
            color=color,
            fill=0.08,
            tag=title,
        )
        ax.text(x_left + pad, y_top - 0.05, title, ha="left", va="top", fontsize=NAME_PT, color=INK)
        return rect

    def row(items, x, y_base, top_row, blocks):
        """The bottom row of grids at y_base (bottoms aligned... centred), and the top row."""
        grids = {}
        for k, (shape, dims, name, color) in items.items():
            if k in top_row:
                continue
            grids[k] = draw_matrix(
                ax,
                x[k],
                y_base,
                shape,
                unit=unit,
                color=color,
                name=name,
                dims=dims,
                name_at="below",
                shape_at="below",
                tag=k,
                row_blocks=blocks.get(k, (None, None))[0],
                col_blocks=blocks.get(k, (None, None))[1],
                linestyle="--" if k == "tiles" else "-",
                fill=0.2 if k in ("tiles",) else 0.35,
                column=k in upright,
            )
        return grids

    # Slow memory.
    slow_box = panel(
        MARGIN,
        height - MARGIN,
        plan["slow_h"],
        plan["slow_right"],
        "slow memory (HBM)",
        SLOW_MEMORY,
    )
    y_q = slow_box.y0 + pad + max(lab[k][1] for k in ("Q", "tiles", "O", "lse")) + 0.06
    grids = row(
        slow,
        xs,
        y_q,
        ("K^T", "V"),
        {"Q": (Bq, None), "tiles": (Bq, Bk), "O": (Bq, None), "lse": (Bq, None)},
    )
    floor = grids["Q"].y1 + 0.1
    for k, over, side in (("K^T", "tiles", "left"), ("V", "O", "right")):
        shape, dims, name, color = slow[k]
        grids[k] = draw_matrix(
            ax,
            xs[over],
            grids[over].y1 + 0.07,
            shape,
            unit=unit,
            color=color,
            name=name,
            dims=dims,
            name_at=side,
            shape_at=side,
            tag=k,
            row_blocks=Bk if k == "V" else None,
            col_blocks=Bk if k == "K^T" else None,
            label_floor=floor,
        )
    # The tiles in loop order; the one being computed, and its blocks, highlighted.
    tiles = grids["tiles"]
    for a in range(n_q):
        for b in range(n_k):
            part = _block_rect(
                tiles, (T, S), (a * Bq, min(T, (a + 1) * Bq)), (b * Bk, min(S, (b + 1) * Bk))
            )
            if (a, b) == (i, j):
                _highlight(ax, part, SCORES)
            number_w, number_h = text_size(str(a * n_k + b + 1), LABEL_PT)
            if number_w + 0.04 <= part.width and number_h + 0.02 <= part.height:
                ax.text(
                    part.cx,
                    part.cy,
                    str(a * n_k + b + 1),
                    ha="center",
                    va="center",
                    fontsize=LABEL_PT,
                    color=INK,
                )
    rows_i = (i * Bq, min(T, (i + 1) * Bq))
    cols_j = (j * Bk, min(S, (j + 1) * Bk))
    _highlight(ax, _block_rect(grids["Q"], (T, Dk), rows_i, (0, Dk)), QUERY)
    _highlight(ax, _block_rect(grids["O"], (T, Dv), rows_i, (0, Dv)), OUTPUT)
    _highlight(ax, _block_rect(grids["lse"], (T, 1), rows_i, (0, 1)), OUTPUT)
    _highlight(ax, _block_rect(grids["K^T"], (Dk, S), (0, Dk), cols_j), KEY)
    _highlight(ax, _block_rect(grids["V"], (S, Dv), cols_j, (0, Dv)), VALUE)

    # Fast memory.
    fast_h = plan["fast_h"]
    fast_box = panel(
        MARGIN, plan["fast_top"], fast_h, plan["fast_right"], "fast memory (SRAM)", FAST_MEMORY
    )
    below_f = max(lab[k][1] for k in ("Q_i", "tile", "acc", "m", "l")) + 0.06
    content_h = max(h["K_j^T"], h["V_j"]) + 0.07 + h["Q_i"] + below_f
    y_f = fast_box.y0 + pad + below_f + max(0.0, (fast_h - title_h - pad - content_h) / 2)
    fgrids = row(fast, xf, y_f, ("K_j^T", "V_j"), {})
    floor_f = fgrids["Q_i"].y1 + 0.1
    for k, over, side in (("K_j^T", "tile", "left"), ("V_j", "acc", "right")):
        shape, dims, name, color = fast[k]
        fgrids[k] = draw_matrix(
            ax,
            xf[over],
            fgrids[over].y1 + 0.07,
            shape,
            unit=unit,
            color=color,
            name=name,
            dims=dims,
            name_at=side,
            shape_at=side,
            tag=k,
            label_floor=floor_f,
        )

    # The loop.
    x_loop, y_loop = plan["loop_at"]
    ax.text(x_loop, y_loop - 0.05, "the loop", ha="left", va="top", fontsize=NAME_PT, color=INK)
    y = y_loop - title_h - 0.1
    for depth, text in loop:  # on fixed baselines, whatever the height of the maths
        ax.text(
            x_loop + depth * indent, y, text, ha="left", va="baseline", fontsize=LABEL_PT, color=INK
        )
        y -= loop_step

    # Traffic between the two memories: loads into fast memory, the results written back.
    y_a, y_b = slow_box.y0 - 0.04, fast_box.y1 + 0.04
    for n, text in enumerate(arrow_labels):
        x_arrow = fast_box.x0 + fast_box.width * (0.2 + 0.3 * n)
        ends = ((x_arrow, y_b), (x_arrow, y_a)) if n == 2 else ((x_arrow, y_a), (x_arrow, y_b))
        draw_arrow(ax, *ends, label=text, label_side="right")
    return fig


# ----------------------------------------------------------------------------------------------
# 7. The backward pass as a graph


def backward_graph_diagram(
    *, T: int | None = None, S: int | None = None, Dk: int | None = None, Dv: int | None = None
):
    r"""The forward's stages as a graph, and the gradients flowing back through it.

    Top, the forward: :math:`Q, K \to Z = QK^\top/\sqrt{D_k} \to A = \mathrm{softmax}(Z) \to
    O = AV`, with :math:`V`. Bottom, in the gradient colour, the backward: from
    :math:`dO`, :math:`dV = A^\top dO` and :math:`dA = dO\,V^\top`; the row term
    :math:`\delta_i = do_i \cdot o_i`; :math:`dZ = A \odot (dA - \delta)`; then
    :math:`dQ = dZ\,K/\sqrt{D_k}` and :math:`dK = dZ^\top Q/\sqrt{D_k}`. Each gradient sits
    under (or beside) what it is the gradient of, and has its shape.

    Parameters
    ----------
    T, S, Dk, Dv : int, optional
        Sizes: when given (all four), each node also shows its numeric shape.

    Returns
    -------
    matplotlib.figure.Figure

    Raises
    ------
    TypeError
        If a size is not an integer.
    ValueError
        If a size is not positive, or only some of the four are given.

    Examples
    --------
    >>> from sdpa_book.diagrams import backward_graph_diagram, figure_texts
    >>> texts = figure_texts(backward_graph_diagram(T=3, S=5, Dk=4, Dv=2))
    >>> [t.splitlines()[0] for t in texts if t.startswith("$d")]  # the gradients
    ['$dO = \\partial\\mathcal{L}/\\partial O$', '$dV = A^\\top dO$', '$dA = dO\\,V^\\top$',
     '$dZ = A \\odot (dA - \\delta)$', '$dQ = dZ\\,K/\\sqrt{D_k}$',
     '$dK = dZ^\\top Q/\\sqrt{D_k}$']
    >>> [t for t in texts if t.startswith("$dQ")]
    ['$dQ = dZ\\,K/\\sqrt{D_k}$\n$(T, D_k)$\n(3, 4)']
    """
    sizes = {"T": T, "S": S, "Dk": Dk, "Dv": Dv}
    given = [n for n, v in sizes.items() if v is not None]
    if given and len(given) < 4:
        missing = [n for n in sizes if n not in given]
        raise ValueError(
            f"give all four sizes T, S, Dk, Dv or none; got {', '.join(given)} "
            f"without {', '.join(missing)}"
        )
    if given:
        sizes = {n: _positive_int(v, n) for n, v in sizes.items()}
    value = {"T": sizes["T"], "S": sizes["S"], "D_k": sizes["Dk"], "D_v": sizes["Dv"]}

    def text(formula: str, dims: tuple[str, ...]) -> str:
        lines = [formula, _mathtext_shape(dims)]
        if given:
            lines.append(_numeric_shape([value[d] for d in dims]))
        return "\n".join(lines)

    # key: (column, band, formula, dims, colour); bands from the top: 0 inputs, 1 forward,
    # 2 the row term, 3 backward, 4 gradients of the inputs
    nodes = {
        "Q": (0, 0, "$Q$", ("T", "D_k"), QUERY),
        "K": (0, 1, "$K$", ("S", "D_k"), KEY),
        "Z": (1, 1, "$Z = QK^\\top/\\sqrt{D_k}$", ("T", "S"), SCORES),
        "A": (2, 1, "$A = \\mathrm{softmax}(Z)$", ("T", "S"), SCORES),
        "V": (3, 0, "$V$", ("S", "D_v"), VALUE),
        "O": (3, 1, "$O = AV$", ("T", "D_v"), OUTPUT),
        "dO": (3, 3, "$dO = \\partial\\mathcal{L}/\\partial O$", ("T", "D_v"), GRADIENT),
        "dV": (3, 4, "$dV = A^\\top dO$", ("S", "D_v"), GRADIENT),
        "dA": (2, 3, "$dA = dO\\,V^\\top$", ("T", "S"), GRADIENT),
        "delta": (2, 2, "$\\delta_i = do_i \\cdot o_i$", ("T",), GRADIENT),
        "dZ": (1, 3, "$dZ = A \\odot (dA - \\delta)$", ("T", "S"), GRADIENT),
        "dQ": (0, 4, "$dQ = dZ\\,K/\\sqrt{D_k}$", ("T", "D_k"), GRADIENT),
        "dK": (0, 3, "$dK = dZ^\\top Q/\\sqrt{D_k}$", ("S", "D_k"), GRADIENT),
    }
    texts = {k: text(f, d) for k, (_, _, f, d, _) in nodes.items()}
    box_size = {
        k: (text_size(t, LABEL_PT)[0] + 0.18, text_size(t, LABEL_PT)[1] + 0.1)
        for k, t in texts.items()
    }
    col_w = [max(box_size[k][0] for k, n in nodes.items() if n[0] == c) for c in range(4)]
    band_h = [max(box_size[k][1] for k, n in nodes.items() if n[1] == b) for b in range(5)]
    free = FULL_WIDTH - 2 * MARGIN - sum(col_w)
    gap_x = free / 3
    gap_y = 0.22
    legend_h = 0.3
    height = MARGIN + sum(band_h) + 4 * gap_y + legend_h + MARGIN
    fig, ax = new_canvas(FULL_WIDTH, height)
    col_x = [MARGIN + sum(col_w[:c]) + c * gap_x + col_w[c] / 2 for c in range(4)]
    band_y = [height - MARGIN - sum(band_h[:b]) - b * gap_y - band_h[b] / 2 for b in range(5)]
    boxes = {}
    for k, (c, b, _, _, color) in nodes.items():
        w, h = box_size[k]
        boxes[k] = draw_box(
            ax,
            col_x[c] - w / 2,
            band_y[b] - h / 2,
            w,
            h,
            texts[k],
            color=color,
            fill=0.15 if color == GRADIENT else 0.3,
            fontsize=LABEL_PT,
            tag=k,
        )

    def link(a, b, color, start="right", end="left"):
        p0 = getattr(boxes[a], start)
        p1 = getattr(boxes[b], end)
        draw_arrow(ax, p0, p1, color=color, linewidth=1.4)

    # forward
    link("Q", "Z", INK, "right", "top")
    link("K", "Z", INK)
    link("Z", "A", INK)
    link("A", "O", INK)
    link("V", "O", INK, "bottom", "top")
    # backward
    g = _shade(GRADIENT)
    link("dO", "dA", g, "left", "right")
    link("dO", "dV", g, "bottom", "top")
    link("dA", "dZ", g, "left", "right")
    link("dO", "delta", g, "top", "right")
    link("delta", "dZ", g, "left", "top")
    link("dZ", "dK", g, "left", "right")
    link("dZ", "dQ", g, "bottom", "right")
    role_legend(ax, [("forward", INK, {"line": True}), ("backward: gradients", g, {"line": True})])
    return fig


# ----------------------------------------------------------------------------------------------
# 8. A transformer block: the residual stream


def _plus(ax, x: float, y: float, r: float = 0.1, tag: str | None = None):
    """The ⊕ where a sublayer's output is added back to the residual stream."""
    from matplotlib.patches import Circle

    _add(
        ax,
        Circle(
            (x, y),
            r,
            facecolor="white",
            edgecolor=INK,
            linewidth=1.3,
            zorder=3,
            label=f"_add {tag}" if tag else None,
        ),
    )
    _segment(ax, [x - r * 0.6, x + r * 0.6], [y, y], color=INK, linewidth=1.3, zorder=4)
    _segment(ax, [x, x], [y - r * 0.6, y + r * 0.6], color=INK, linewidth=1.3, zorder=4)


def transformer_block_diagram(
    *, norm: str = "pre", attention_only: bool = False, T: int | None = None, E: int | None = None
):
    r"""A transformer block as sublayers reading from and adding to the residual stream.

    The residual stream (thick line) carries ``(T, E)`` from left to right. Pre-norm
    (``norm="pre"``, GPT-2 and most models since): each sublayer normalises a copy of the
    stream, transforms it (causal multi-head attention, then the MLP) and adds the result back
    (⊕); the stream itself is never normalised inside the block. Post-norm (``norm="post"``,
    the original Transformer): the sublayer reads the stream directly and the sum is
    normalised, on the stream.

    Parameters
    ----------
    norm : {"pre", "post"}, default "pre"
    attention_only : bool, default False
        Draw only the attention sublayer (no MLP).
    T, E : int, optional
        Sizes of the stream: when given (both), its shape labels show the numbers.

    Returns
    -------
    matplotlib.figure.Figure

    Raises
    ------
    TypeError
        If ``attention_only`` is not a bool, or a size not an integer.
    ValueError
        If ``norm`` is neither "pre" nor "post", a size is not positive, or only one of
        ``T``, ``E`` is given.

    Examples
    --------
    >>> from sdpa_book.diagrams import transformer_block_diagram, figure_texts
    >>> texts = figure_texts(transformer_block_diagram(norm="pre", T=5, E=16))
    >>> [t for t in texts if t in ("LayerNorm", "MLP")]  # norm -> attention; norm -> MLP
    ['LayerNorm', 'LayerNorm', 'MLP']
    >>> texts.count("(5, 16)")  # the stream's shape, in and out
    2
    """
    if norm not in ("pre", "post"):
        raise ValueError(f"norm must be 'pre' or 'post'; got {norm!r}")
    attention_only = _flag(attention_only, "attention_only")
    if (T is None) != (E is None):
        raise ValueError(f"give both sizes T and E or neither; got T={T!r}, E={E!r}")
    sized = T is not None
    if sized:
        T, E = _positive_int(T, "T"), _positive_int(E, "E")

    sub = [("attention", "causal multi-head\nattention", QUERY)]
    if not attention_only:
        sub.append(("mlp", "MLP", VALUE))
    ln_w = text_size("LayerNorm", NAME_PT)[0] + 0.22
    box_h = 2 * _line_height(NAME_PT) + 0.14
    sub_w = {k: text_size(t, NAME_PT)[0] + 0.26 for k, t in ((k, t) for k, t, _ in sub)}
    end_lines = ["input $X$", "$(T, E)$"] + ([_numeric_shape((T, E))] if sized else [])
    out_lines = ["out", "$(T, E)$"] + ([_numeric_shape((T, E))] if sized else [])
    end_w = 0.1  # the labels of the ends sit under the stream
    r = 0.1
    out_w = 0.0

    def stream_end(stretch: float) -> float:
        """Where the stream ends, with ``stretch`` of spare room at each of its gaps."""
        x = MARGIN + end_w
        for key, _, _ in sub:
            x += 0.25 + stretch + 0.15  # to the branch, then into the first box
            if norm == "pre":
                x += ln_w + 0.15 + stretch / 2
            x += sub_w[key] + 0.15 + 2 * r
            if norm == "post":
                x += 0.2 + stretch / 2 + ln_w
        return x + 0.3 + stretch

    # The stream's gaps widen (or narrow, a little) evenly to fill the column: stream_end grows
    # by 1.5 n + 1 times the stretch.
    spare = FULL_WIDTH - MARGIN - out_w - stream_end(0.0)
    stretch = min(0.5, max(-0.14, spare / (1.5 * len(sub) + 1)))
    width = min(FULL_WIDTH, stream_end(stretch) + out_w + MARGIN)
    title_h = _line_height(NAME_PT) + 0.1
    height = (
        MARGIN + title_h + box_h + 0.45 + 0.25 + len(end_lines) * _line_height(LABEL_PT) + MARGIN
    )
    fig, ax = new_canvas(width, height)

    title = (
        "pre-norm: each sublayer normalises a copy of the stream"
        if norm == "pre"
        else "post-norm (original Transformer): the stream itself is normalised"
    )
    ax.text(MARGIN, height - MARGIN, title, ha="left", va="top", fontsize=NAME_PT, color=INK)
    y_s = MARGIN + _stack_size([(t, NAME_PT) for t in end_lines])[1] + 0.2  # the stream
    y_box = y_s + 0.45  # bottom of the sublayer boxes
    x = MARGIN + end_w
    for i, t in enumerate(end_lines):  # under the start of the stream
        ax.text(
            x,
            y_s - 0.1 - i * _line_height(NAME_PT),
            t,
            ha="left",
            va="top",
            fontsize=LABEL_PT if i else NAME_PT,
            color=INK,
        )
    for n, (key, text, color) in enumerate(sub):
        x += 0.25 + stretch
        branch = x
        x_box = branch + 0.15
        _segment(ax, [branch, branch], [y_s, y_box + box_h / 2], color=INK, linewidth=1.3)
        _segment(ax, [branch, x_box], [y_box + box_h / 2] * 2, color=INK, linewidth=1.3)
        if norm == "pre":
            ln = draw_box(
                ax,
                x_box,
                y_box,
                ln_w,
                box_h,
                "LayerNorm",
                color=NEUTRAL,
                fill=0.1,
                tag=f"norm {n + 1}",
            )
            x_box = ln.x1 + 0.15 + stretch / 2
            draw_arrow(ax, ln.right, (x_box, ln.cy))
        box = draw_box(ax, x_box, y_box, sub_w[key], box_h, text, color=color, fill=0.25, tag=key)
        x_add = box.x1 + 0.15 + r
        _segment(ax, [box.x1, x_add], [box.cy] * 2, color=INK, linewidth=1.3)
        draw_arrow(ax, (x_add, box.cy), (x_add, y_s + r))
        _plus(ax, x_add, y_s, r, tag=key)
        x = x_add + r
        if norm == "post":
            x += 0.2 + stretch / 2
            draw_box(
                ax,
                x,
                y_s - box_h / 4,
                ln_w,
                box_h / 2,
                "LayerNorm",
                color=NEUTRAL,
                fill=0.1,
                tag=f"norm {n + 1}",
            )
            x += ln_w
    x_end = x + 0.3 + stretch
    _segment(
        ax,
        [MARGIN + end_w, x_end],
        [y_s, y_s],
        color=_mix(OUTPUT, 0.8, "black"),
        linewidth=3.0,
        zorder=0.5,
        solid_capstyle="butt",
    )
    draw_arrow(
        ax, (x_end - 0.2, y_s), (x_end, y_s), color=_mix(OUTPUT, 0.8, "black"), linewidth=1.5
    )
    for i, t in enumerate(out_lines):  # under its end
        ax.text(
            x_end,
            y_s - 0.1 - i * _line_height(NAME_PT),
            t,
            ha="right",
            va="top",
            fontsize=LABEL_PT if i else NAME_PT,
            color=INK,
        )
    ax.text(
        (MARGIN + end_w + x_end) / 2,
        y_s - 0.22,
        "residual stream",
        ha="center",
        va="top",
        fontsize=LABEL_PT,
        color=INK,
    )
    return fig
