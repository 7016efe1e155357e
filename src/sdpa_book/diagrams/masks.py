"""Masks as geometry: causal, padding and sliding-window masks drawn as grids of may-attend and
masked cells, :func:`mask_geometry_diagram`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral

import numpy as np

from ..figures import ALLOWED_COLOR, MASKED_COLOR
from .draw import draw_bracket, new_canvas, role_legend
from .matrix import draw_matrix
from .primitives import (
    INK,
    MARGIN,
    Rect,
    _at_most,
    _line_height,
    _numeric_shape,
    _positive_int,
    text_size,
)

_SIDE = 0.3  # left of the first column of panels: "queries i"
_PANEL_GAP = 0.1  # least space between the headers of two panels side by side
_MAX_CELL = 0.22  # inches
_LEGEND_H = 0.3
# No sub- or superscripts here, so every text is at _PT: on a canvas at most _MAX_WIDTH wide it
# reads at 11.4 CSS px or more on a phone (see primitives.PHONE_WIDTH, which scripts would need).
_MAX_WIDTH = 4.4
_PT = 11


@dataclass(frozen=True)
class _Panel:
    kind: str  # "causal", "padding" or "sliding window"
    detail: str  # "top-left", "length 4", "$w = 3$", or ""
    rule: str  # which keys j query i may attend, e.g. "$j < 4$"
    allowed: np.ndarray  # (T, S), True = may attend
    offset: int | None  # the diagonal's offset S - T to label, if any

    @property
    def header(self) -> list[str]:
        return [self.kind, self.detail, self.rule]


@dataclass(frozen=True)
class _PanelGrid:
    """Panels in rows of ``per_row``; each a header of three lines, its grid and its labels."""

    per_row: int
    panel_w: float
    cell: float
    header_h: float
    offset_h: float  # room for the bracket over the first S - T keys
    row_h: float
    width: float
    height: float


def mask_geometry_diagram(T: int, S: int, *, window: int = 3, lengths=None):
    r"""Masks as geometry: causal, padding and sliding-window masks as grids of may-attend and
    masked cells, and, when ``T != S``, the causal mask aligned top-left against bottom-right.

    Row ``i`` is query ``i``, column ``j`` key ``j``; a cell is blue where the query may attend
    the key and grey where it is masked (``sdpa_book.figures.ALLOWED_COLOR``,
    ``sdpa_book.figures.MASKED_COLOR``). The masks are the package's own
    (:func:`sdpa.causal_mask`, :func:`sdpa.padding_mask`, :func:`sdpa.sliding_window_mask`).
    Each panel is headed by the mask's kind, its detail (alignment, length or window) and the
    keys ``j`` that query ``i`` may attend, with this diagram's numbers. When ``T != S`` the
    bottom-right panel labels the diagonal's offset ``S - T``: query ``i`` sits at key position
    ``i + S - T``, as when ``T`` new queries follow ``S - T`` cached keys; the sliding window
    is then aligned bottom-right too. The panels stand up to three a row, narrow enough for a
    phone.

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
        The diagram: white, at most 4.4 in wide, not registered with pyplot.

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
    >>> [t for t in texts if t.startswith("$j")]  # causal top-left, bottom-right; padding
    ['$j \\leq i$', '$j \\leq i + 2$', '$j < 4$']
    >>> "$S - T = 2$" in texts  # the bottom-right diagonal's offset
    True
    """
    T = _at_most(_positive_int(T, "T"), 32, "T")
    S = _at_most(_positive_int(S, "S"), 32, "S")
    w = _positive_int(window, "window")
    lengths = _checked_lengths(lengths, S)
    panels = _mask_panels(T, S, w, lengths)
    grid = _panel_grid(T, S, panels)
    fig, ax = new_canvas(grid.width, grid.height)
    for k, panel in enumerate(panels):
        _draw_mask_panel(ax, grid, k, panel, T, S)
    role_legend(ax, [("may attend", ALLOWED_COLOR), ("masked", MASKED_COLOR)], fontsize=_PT)
    return fig


def _checked_lengths(lengths, S: int) -> list[int]:
    """One to three lengths in ``[0, S]``; default one sequence of ``S - S // 3`` keys."""
    if lengths is None:
        lengths = [S - S // 3]
    if isinstance(lengths, (str, bytes)) or not isinstance(lengths, (Sequence, np.ndarray)):
        raise TypeError(f"lengths must be a sequence of integers; got {lengths!r}")
    lengths = [int(_nonneg_length(n, S)) for n in lengths]
    if not 1 <= len(lengths) <= 3:
        raise ValueError(
            f"lengths must hold one to three sequence lengths (one panel each); got {len(lengths)}"
        )
    return lengths


def _nonneg_length(n, S: int) -> int:
    if isinstance(n, (bool, np.bool_)) or not isinstance(n, Integral):
        raise TypeError(f"lengths must hold integers; got {n!r}")
    if not 0 <= n <= S:
        raise ValueError(f"lengths must lie in [0, S={S}]; got {n}")
    return int(n)


def _shifted(n: int) -> str:
    """Query ``i``'s key position moved by ``n``, in maths: ``i``, ``i + 2``, ``i - 3``."""
    return "i" if n == 0 else f"i {'+' if n > 0 else '-'} {abs(n)}"


def _mask_panels(T: int, S: int, w: int, lengths: list[int]) -> list[_Panel]:
    """The masks, from the package itself: causal (both alignments when ``T != S``), one
    padding mask per length, the sliding window."""
    import sdpa

    aligned = T != S
    panels = []
    if aligned:
        panels.append(_Panel("causal", "top-left", "$j \\leq i$", sdpa.causal_mask(T, S), 0))
        panels.append(
            _Panel(
                "causal",
                "bottom-right",
                f"$j \\leq {_shifted(S - T)}$",
                sdpa.causal_mask(T, S, alignment="bottom_right"),
                S - T,
            )
        )
    else:
        panels.append(_Panel("causal", "", "$j \\leq i$", sdpa.causal_mask(T, S), None))
    pad = sdpa.padding_mask(np.array(lengths), S)[:, 0, 0]  # (B, S)
    for n, row in zip(lengths, pad):
        panels.append(
            _Panel("padding", f"length {n}", f"$j < {n}$", np.broadcast_to(row, (T, S)), None)
        )
    o = S - T if aligned else 0  # where query i sits among the keys: i + o
    panels.append(
        _Panel(
            "sliding window",
            f"$w = {w}$",
            f"${_shifted(o - w)} < j \\leq {_shifted(o)}$",
            sdpa.sliding_window_mask(
                T, S, (w - 1, 0), alignment="bottom_right" if aligned else "top_left"
            ),
            None,
        )
    )
    return panels


def _offset_label(offset: int) -> str:
    return f"$S - T = {offset}$"


def _panel_grid(T: int, S: int, panels: list[_Panel]) -> _PanelGrid:
    """Up to three panels a row, as many as their headers leave room for in a phone's width;
    the cells as large as fit (at most ``_MAX_CELL``)."""
    line = _line_height(_PT)
    header_w = max(text_size(t, _PT)[0] for p in panels for t in p.header) + _PANEL_GAP
    # Beside a grid whose first rows see no key: a bracket and its label, on the right.
    right = (
        max(
            (0.12 + text_size(_offset_label(p.offset), _PT)[0] for p in panels if p.offset),
            default=0.0,
        )
        if S < T
        else 0.0
    )
    room = _MAX_WIDTH - _SIDE - MARGIN
    n = len(panels)
    most = next((k for k in (3, 2) if header_w * k <= room), 1)
    per_row = -(-n // -(-n // most))  # rows as even as they can be: 4 panels two by two
    panel_w = min(room / per_row, max(header_w, _MAX_CELL * S + 0.15 + right))
    cell = min(_MAX_CELL, (panel_w - 0.15 - right) / S, 1.7 / T)
    header_h = 3 * line + 0.04
    offset_h = 0.3 if S > T else 0.0  # the bracket over the first S - T keys
    below_h = 2 * line + 0.06
    row_h = header_h + offset_h + T * cell + below_h + 0.12
    n_rows = -(-n // per_row)
    width = _SIDE + per_row * panel_w + MARGIN
    height = MARGIN + n_rows * row_h + _LEGEND_H + MARGIN
    return _PanelGrid(per_row, panel_w, cell, header_h, offset_h, row_h, width, height)


def _draw_mask_panel(ax, grid: _PanelGrid, k: int, panel: _Panel, T: int, S: int) -> None:
    """Panel ``k``: its header, the (T, S) grid of the mask, its shape and axes."""
    r, c = divmod(k, grid.per_row)
    x_mid = _SIDE + grid.panel_w * (c + 0.5)
    y_top = grid.height - MARGIN - r * grid.row_h
    line = _line_height(_PT)
    for i, text in enumerate(panel.header):
        if text:
            ax.text(x_mid, y_top - i * line, text, ha="center", va="top", fontsize=_PT, color=INK)
    cell = grid.cell
    grid_x = x_mid - S * cell / 2
    if panel.offset and panel.offset < 0:  # the bracket's label on the right: grid moves left
        grid_x -= (0.12 + text_size(_offset_label(panel.offset), _PT)[0]) / 2
    rect = draw_matrix(
        ax,
        grid_x,
        y_top - grid.header_h - grid.offset_h - T * cell,
        (T, S),
        unit=cell,
        color=ALLOWED_COLOR,
        fill=1.0,
        masked=~np.asarray(panel.allowed),
        name="keys $j$",
        name_at="below",
        shape_at=None,
        name_pt=_PT,
        tag=f"mask {k}",
    )
    ax.text(
        rect.cx,
        rect.y0 - 0.05 - line,
        _numeric_shape((T, S)),
        ha="center",
        va="top",
        fontsize=_PT,
        color=INK,
    )
    if c == 0:
        ax.text(
            rect.x0 - 0.08,
            rect.cy,
            "queries $i$",
            ha="center",
            va="bottom",
            rotation=90,
            fontsize=_PT,
            color=INK,
            rotation_mode="anchor",
        )
    if panel.offset:
        _draw_offset(ax, rect, panel.offset, cell)


def _draw_offset(ax, rect: Rect, offset: int, cell: float) -> None:
    """Bracket the diagonal's offset ``S - T``: over the first keys, or beside the first rows."""
    label = _offset_label(offset)
    if offset > 0:  # query 0 sees keys 0 .. S - T
        draw_bracket(
            ax,
            rect.x0,
            rect.x0 + offset * cell,
            rect.y1 + 0.04,
            label,
            depth=0.05,
            fontsize=_PT,
        )
    else:  # the first T - S queries see no key
        draw_bracket(
            ax,
            rect.y1 + offset * cell,
            rect.y1,
            rect.x1 + 0.04,
            label,
            side="right",
            depth=0.05,
            fontsize=_PT,
        )
