"""Masks as geometry: causal, padding and sliding-window masks drawn as grids of may-attend and
masked cells, :func:`mask_geometry_diagram`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral

import numpy as np

from ..figures import ALLOWED_COLOR, FULL_WIDTH, MASKED_COLOR
from .draw import draw_bracket, new_canvas, role_legend
from .matrix import draw_matrix
from .primitives import (
    INK,
    LABEL_PT,
    MARGIN,
    NAME_PT,
    Rect,
    _at_most,
    _line_height,
    _numeric_shape,
    _positive_int,
)


@dataclass(frozen=True)
class _Panel:
    title: str
    subtitle: str
    allowed: np.ndarray  # (T, S), True = may attend
    offset: int | None  # the diagonal's offset S - T to label, if any


@dataclass(frozen=True)
class _PanelGrid:
    """Panels in rows of ``per_row``; each a title, a subtitle, its grid and the grid's labels."""

    per_row: int
    side: float  # left of the first column: "queries i"
    cell: float
    title_h: float
    offset_h: float  # room for the bracket over the first S - T keys
    row_h: float
    height: float


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
        The diagram: white, at most ``sdpa_book.figures.FULL_WIDTH`` wide, not registered
        with pyplot.

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
    T = _at_most(_positive_int(T, "T"), 32, "T")
    S = _at_most(_positive_int(S, "S"), 32, "S")
    w = _positive_int(window, "window")
    lengths = _checked_lengths(lengths, S)
    panels = _mask_panels(T, S, w, lengths)
    grid = _panel_grid(T, S, len(panels))
    fig, ax = new_canvas(FULL_WIDTH, grid.height)
    for k, panel in enumerate(panels):
        _draw_mask_panel(ax, grid, k, panel, T, S)
    role_legend(ax, [("may attend", ALLOWED_COLOR), ("masked", MASKED_COLOR)])
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


def _mask_panels(T: int, S: int, w: int, lengths: list[int]) -> list[_Panel]:
    """The masks, from the package itself: causal (both alignments when ``T != S``), one
    padding mask per length, the sliding window."""
    import sdpa

    aligned = T != S
    panels = []
    if aligned:
        panels.append(_Panel("causal, top-left", "$j \\leq i$", sdpa.causal_mask(T, S), 0))
        panels.append(
            _Panel(
                "causal, bottom-right",
                "$j \\leq i + S - T$",
                sdpa.causal_mask(T, S, alignment="bottom_right"),
                S - T,
            )
        )
    else:
        panels.append(_Panel("causal", "$j \\leq i$", sdpa.causal_mask(T, S), None))
    pad = sdpa.padding_mask(np.array(lengths), S)[:, 0, 0]  # (B, S)
    for n, row in zip(lengths, pad):
        panels.append(
            _Panel(f"padding, length {n}", f"$j < {n}$", np.broadcast_to(row, (T, S)), None)
        )
    alignment = "bottom_right" if aligned else "top_left"
    panels.append(
        _Panel(
            f"sliding window, $w = {w}$",
            f"the {w} most recent key{'s' if w > 1 else ''}",
            sdpa.sliding_window_mask(T, S, (w - 1, 0), alignment=alignment),
            None,
        )
    )
    return panels


def _panel_grid(T: int, S: int, n_panels: int) -> _PanelGrid:
    """Up to four panels a row, the cells as large as fit the column."""
    per_row = min(n_panels, 4)
    n_rows = -(-n_panels // per_row)
    panel_w = FULL_WIDTH / per_row
    side = 0.28
    cell = min(0.22, (panel_w - 0.3 - side / per_row) / S, 1.7 / T)
    title_h = _line_height(NAME_PT) + _line_height(LABEL_PT) + 0.06
    offset_h = 0.3 if S > T else 0.0  # the bracket over the first S - T keys
    below_h = 2 * _line_height(LABEL_PT) + 0.06
    row_h = title_h + offset_h + T * cell + below_h + 0.12
    legend_h = 0.3
    height = MARGIN + n_rows * row_h + legend_h + MARGIN
    return _PanelGrid(per_row, side, cell, title_h, offset_h, row_h, height)


def _draw_mask_panel(ax, grid: _PanelGrid, k: int, panel: _Panel, T: int, S: int) -> None:
    """Panel ``k``: title and subtitle, the (T, S) grid of the mask, its shape and axes."""
    r, c = divmod(k, grid.per_row)
    x_mid = grid.side + (FULL_WIDTH - grid.side) * (c + 0.5) / grid.per_row
    y_top = grid.height - MARGIN - r * grid.row_h
    ax.text(x_mid, y_top, panel.title, ha="center", va="top", fontsize=NAME_PT, color=INK)
    ax.text(
        x_mid,
        y_top - _line_height(NAME_PT),
        panel.subtitle,
        ha="center",
        va="top",
        fontsize=LABEL_PT,
        color=INK,
    )
    cell = grid.cell
    rect = draw_matrix(
        ax,
        x_mid - S * cell / 2,
        y_top - grid.title_h - grid.offset_h - T * cell,
        (T, S),
        unit=cell,
        color=ALLOWED_COLOR,
        fill=1.0,
        masked=~np.asarray(panel.allowed),
        name="keys $j$",
        name_at="below",
        shape_at=None,
        tag=f"mask {k}",
    )
    ax.text(
        rect.cx,
        rect.y0 - 0.05 - _line_height(NAME_PT),
        _numeric_shape((T, S)),
        ha="center",
        va="top",
        fontsize=LABEL_PT,
        color=INK,
    )
    if c == 0:
        ax.text(
            rect.x0 - 0.08,
            rect.cy,
            "queries $i$",
            ha="right",
            va="center",
            rotation=90,
            fontsize=NAME_PT,
            color=INK,
            rotation_mode="anchor",
        )
    if panel.offset:
        _draw_offset(ax, rect, panel.offset, cell)


def _draw_offset(ax, rect: Rect, offset: int, cell: float) -> None:
    """Bracket the diagonal's offset ``S - T``: over the first keys, or beside the first rows."""
    label = f"$S - T = {offset}$"
    if offset > 0:  # query 0 sees keys 0 .. S - T
        draw_bracket(ax, rect.x0, rect.x0 + offset * cell, rect.y1 + 0.04, label, depth=0.05)
    else:  # the first T - S queries see no key
        draw_bracket(
            ax,
            rect.y1 + offset * cell,
            rect.y1,
            rect.x1 + 0.04,
            label,
            side="right",
            depth=0.05,
        )
