"""Drawing on a canvas in inches: the canvas, boxes, arrows, brackets, legends and lines, and
the two readers that tests and examples use (:func:`figure_texts`, :func:`tagged_rects`).

Matrices drawn as grids have their own module, :mod:`sdpa_book.diagrams.matrix`.
"""

from __future__ import annotations

from ..figures import FULL_WIDTH
from .primitives import (
    INK,
    LABEL_PT,
    NAME_PT,
    NEUTRAL,
    Rect,
    _fontsize,
    _mix,
    _positive_number,
    _shade,
)

# ----------------------------------------------------------------------------------------------
# Adding artists without the data-limit bookkeeping (the canvas is fixed, in inches)


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
    """A heavy outline around ``rect``, over what is drawn there (filled with ``fill``, if given)."""
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


def _line(ax, start, end, color, *, linewidth: float = 0.9, linestyle: str = "-"):
    """A straight line from ``start`` to ``end`` with round caps: links, fans, separators."""
    _segment(
        ax,
        [start[0], end[0]],
        [start[1], end[1]],
        color=color,
        linewidth=linewidth,
        linestyle=linestyle,
        solid_capstyle="round",
    )


# ----------------------------------------------------------------------------------------------
# The canvas, boxes, arrows, brackets and legends


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
        Of the edge, e.g. ``"--"`` for a box that stands for something not stored.
    rounded : bool, default True
        Round the corners (else square).
    tag : str, optional
        Name for :func:`tagged_rects` (not shown).

    Returns
    -------
    Rect
        The box, to attach arrows and labels to its edges.

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
        Where to draw, usually from :func:`new_canvas` (coordinates in inches).
    start, end : (float, float)
        Tail and head, in inches.
    label : str, optional
        Written beside the arrow's middle.
    label_side : {"above", "below", "left", "right"}, default "above"
        Where the label sits relative to the arrow's midpoint.
    color : colour
        Of the arrow (the label is always in ink).
    linestyle : str, default "-"
        Matplotlib's line style, e.g. ``"--"`` for a dashed arrow.
    linewidth : float, default 1.2
        In points.
    curve : float, default 0.0
        Bend of the arrow (``arc3`` radius); 0 is straight.
    fontsize : float, default MIN_FONT_PT
        Of the label; at least ``sdpa_book.figures.MIN_FONT_PT``.

    Returns
    -------
    matplotlib.patches.FancyArrowPatch
        The arrow, already added to ``ax``.

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
        Where to draw, usually from :func:`new_canvas` (coordinates in inches).
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
        Of the bracket (the label is always in ink).
    fontsize : float, default MIN_FONT_PT
        Of the label; at least ``sdpa_book.figures.MIN_FONT_PT``.

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
    ax,
    entries,
    *,
    loc: str = "lower center",
    anchor=(0.5, 0.0),
    ncols: int | None = None,
    fontsize: float = LABEL_PT,
):
    """A legend of colour roles: one patch per ``(label, colour)`` entry, no frame.

    Parameters
    ----------
    ax : matplotlib Axes
        The axes the legend belongs to (placed in its fractions, 0 to 1).
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
    fontsize : float, default MIN_FONT_PT
        Of the labels; at least ``sdpa_book.figures.MIN_FONT_PT``.

    Returns
    -------
    matplotlib.legend.Legend
        One entry per role, in the order given.

    Raises
    ------
    ValueError
        If ``entries`` is empty, or ``fontsize`` is under ``MIN_FONT_PT``.

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
    fontsize = _fontsize(fontsize)
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
        fontsize=fontsize,
        handlelength=1.4,
        handleheight=1.0,
        columnspacing=1.2,
        borderaxespad=0.1,
        borderpad=0.1,
    )


# ----------------------------------------------------------------------------------------------
# Reading a figure back (tests, examples)


def figure_texts(fig) -> list[str]:
    """The non-empty texts a figure shows, in drawing order: labels, then legends and titles.

    Parameters
    ----------
    fig : matplotlib.figure.Figure
        A diagram, or any figure.

    Returns
    -------
    list of str
        Labels in drawing order (one string per label, however many lines), then the legend's
        entries and the titles.

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


def tagged_rects(fig) -> dict[str, Rect]:
    """``{tag: Rect}`` of the grids and boxes drawn with a ``tag`` in ``fig`` (in inches).

    Diagrams tag what they draw (``"Q"``, ``"scores"``, ``"head 1"``, ...), so that tests can
    check proportions and positions without knowing the layout.

    Parameters
    ----------
    fig : matplotlib.figure.Figure
        A diagram, or a figure drawn with the helpers.

    Returns
    -------
    dict of str to Rect
        Each tag and the rectangle of the grid or box drawn with it.

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
