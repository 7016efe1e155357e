"""Heads: multi-head attention split, attended and concatenated (:func:`multihead_diagram`),
and query heads sharing key/value heads, MHA, GQA and MQA (:func:`grouped_heads_diagram`).

Both are drawn for a phone's column (``phone.py``): one column of levels from the top down, at
most ``PHONE_CANVAS`` wide, words at ``TEXT_PT`` and maths with scripts at ``MATH_PT``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..figures import KEY, OUTPUT, QUERY, VALUE
from .draw import _line, draw_arrow, draw_box, draw_bracket, new_canvas
from .matrix import draw_matrix
from .phone import LEGEND_ROW, PHONE_CANVAS, _legend, _lines_size, _write, _write_lines
from .primitives import (
    INK,
    MARGIN,
    NEUTRAL,
    TEXT_PT,
    Rect,
    _at_most,
    _block_rect,
    _mathtext_shape,
    _matrix_size,
    _numeric_shape,
    _pack,
    _packed_length,
    _phone_pt,
    _positive_int,
    _shade,
    text_size,
)

# ----------------------------------------------------------------------------------------------
# Multi-head attention


class _Projection(NamedTuple):
    """``X @ W`` for one of Q, K, V: the result ``(T, H D)`` in ``H`` blocks of ``D`` columns."""

    key: str  # "Q", "K" or "V"
    name: str
    color: str
    dims: tuple[str, str]
    shape: tuple[int, int]
    block: int  # D: columns per head
    W_dims: tuple[str, str]
    W_shape: tuple[int, int]

    @property
    def W_text(self) -> str:
        return _weight_text(self.key, self.W_dims, self.W_shape)

    @property
    def labels(self) -> list[str]:
        return [self.name, _mathtext_shape(self.dims), _numeric_shape(self.shape)]


def _weight_text(key: str, dims, shape) -> str:
    """A projection's box: ``$W_Q$ $(E, HD_k)$`` over its numeric shape."""
    return f"$W_{key}$ {_mathtext_shape(dims)}\n{_numeric_shape(shape)}"


@dataclass(frozen=True)
class _Levels:
    """The multi-head diagram's sizes, and the top of each of its levels, from the top down."""

    unit: float
    top: dict[str, float]  # "X", "W", "QKV", "heads", "concat", "W_O", "out"
    level_h: dict[str, float]
    height: float
    cx: float  # the middle of X, the concatenation, W_O and out (their labels on the right)
    slots: list[float]  # the middles of Q, K and V
    box_w: float  # a projection's box
    box_h: float
    qkv_label_h: float  # the labels over Q, K and V
    heads: list[int | None]  # the heads drawn, None for the ellipsis
    head_x: list[float]  # the left edge of each
    head_w: list[float]  # and its width
    head_h: float


_LEVELS = ("X", "W", "QKV", "heads", "concat", "W_O", "out")
_LEVEL_GAPS = (0.32, 0.24, 0.42, 0.24, 0.22, 0.22)  # after each level but the last
_HEAD_GAP = 0.1  # between two heads


def _drawn_heads(H: int, limit: int = 4) -> list[int | None]:
    """The heads a diagram draws, 0-based: all of them up to ``limit``, else the first two, a
    gap (None) and the last."""
    return list(range(H)) if H <= limit else [0, 1, None, H - 1]


def multihead_diagram(T: int, E: int, H: int, Dk: int, Dv: int):
    r"""Multi-head attention: project, split into heads, attend per head, concatenate, ``W_O``.

    One column, from top to bottom, narrow enough for a phone: the input :math:`X` ``(T, E)``;
    the projections :math:`W_Q, W_K, W_V` side by side, to :math:`Q, K` ``(T, H Dk)`` and
    :math:`V` ``(T, H Dv)``, each drawn as ``H`` blocks of columns (one per head); head
    :math:`h` attends with block :math:`h` of each; the heads' outputs ``(T, Dv)`` are
    concatenated to ``(T, H Dv)`` and projected by :math:`W_O` back to ``(T, E)``. Heads are
    numbered from 0, as in the code; with more than four heads, heads 0, 1 and ``H - 1`` are
    drawn, an ellipsis between them.

    Parameters
    ----------
    T, E, H, Dk, Dv : int
        Tokens, model width, heads, query/key width and value width per head.

    Returns
    -------
    matplotlib.figure.Figure
        The diagram: white, at most 3.7 in wide (a phone's column), not registered with
        pyplot.

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
    ['$W_Q$ $(E, HD_k)$\n(12, 12)', '$W_K$ $(E, HD_k)$\n(12, 12)',
     '$W_V$ $(E, HD_v)$\n(12, 6)', '$W_O$ $(HD_v, E)$\n(6, 12)']
    """
    T, E, H, Dk, Dv = (
        _positive_int(v, n) for v, n in ((T, "T"), (E, "E"), (H, "H"), (Dk, "Dk"), (Dv, "Dv"))
    )
    proj = [
        _Projection("Q", "$Q$", QUERY, ("T", "HD_k"), (T, H * Dk), Dk, ("E", "HD_k"), (E, H * Dk)),
        _Projection("K", "$K$", KEY, ("T", "HD_k"), (T, H * Dk), Dk, ("E", "HD_k"), (E, H * Dk)),
        _Projection("V", "$V$", VALUE, ("T", "HD_v"), (T, H * Dv), Dv, ("E", "HD_v"), (E, H * Dv)),
    ]
    singles = {
        "X": ["input $X$", "$(T, E)$", _numeric_shape((T, E))],
        "concat": ["concatenate", "$(T, HD_v)$", _numeric_shape((T, H * Dv))],
        "out": ["out", "$(T, E)$", _numeric_shape((T, E))],
    }
    head_lines = ["each head", "$(T, D_v)$", _numeric_shape((T, Dv))]
    levels = _multihead_levels((T, E, H, Dk, Dv), proj, singles, head_lines)
    fig, ax = new_canvas(PHONE_CANVAS, levels.height)
    x_rect = _single_grid(ax, levels, "X", (T, E), singles["X"], color=NEUTRAL, fill=0.15)
    # X feeds the three projections through a stem that clears X's labels.
    stem = (x_rect.cx, levels.top["X"] - levels.level_h["X"] - 0.06)
    _line(ax, (x_rect.cx, x_rect.y0), stem, INK, linewidth=1.2)
    grids = [_draw_projection(ax, levels, i, p, stem) for i, p in enumerate(proj)]
    head_boxes = _draw_heads(ax, levels, list(zip(proj, grids)), head_lines)
    _draw_concatenation(ax, levels, head_boxes, (T, E, H, Dv), singles)
    return fig


def _multihead_levels(sizes, proj, singles, head_lines) -> _Levels:
    """The cell side that fits Q, K, V side by side and X across, and the levels' heights."""
    T, E, H, Dk, Dv = sizes
    avail = PHONE_CANVAS - 2 * MARGIN
    slot = avail / 3
    single_w, single_h = (max(v) for v in zip(*(_lines_size(s) for s in singles.values())))
    qkv_w, qkv_label_h = (max(v) for v in zip(*(_lines_size(p.labels) for p in proj)))
    unit = min(
        0.16,
        (slot - 0.2) / (H * max(Dk, Dv)),
        (avail - single_w - 0.12) / max(E, H * Dv),
        0.6 / T,
    )
    box_texts = [p.W_text for p in proj] + [_weight_text("O", ("HD_v", "E"), (H * Dv, E))]
    box_w = max(text_size(t, _phone_pt(t))[0] for t in box_texts) + 0.16
    box_h = max(text_size(t, _phone_pt(t))[1] for t in box_texts) + 0.08
    grid_h = _matrix_size((T, E), unit)[1]
    heads, head_x, head_w, head_h, heads_h = _heads_row(H, head_lines, avail)
    level_h = {
        "X": max(grid_h, single_h),
        "W": box_h,
        "QKV": qkv_label_h + 0.04 + grid_h,
        "heads": heads_h,
        "concat": max(grid_h, single_h),
        "W_O": box_h,
        "out": max(grid_h, single_h),
    }
    sizes_down = [level_h[k] for k in _LEVELS]
    height = _packed_length(sizes_down, _LEVEL_GAPS) + 2 * MARGIN
    tops = _pack(sizes_down, _LEVEL_GAPS, start=height - MARGIN, down=True)
    return _Levels(
        unit=unit,
        top=dict(zip(_LEVELS, tops)),
        level_h=level_h,
        height=height,
        cx=MARGIN + (avail - single_w - 0.1) / 2,
        slots=[MARGIN + slot * (i + 0.5) for i in range(3)],
        box_w=box_w,
        box_h=box_h,
        qkv_label_h=qkv_label_h,
        heads=heads,
        head_x=head_x,
        head_w=head_w,
        head_h=head_h,
    )


def _heads_row(H: int, head_lines: list[str], avail: float):
    """The drawn heads, the left edge and width of each (an ellipsis is narrower), the height
    of a head's box and of the row (its labels on the right), the whole row centred."""
    heads = _drawn_heads(H)
    widths = [0.25 if h is None else text_size(f"head {h}", TEXT_PT)[0] + 0.12 for h in heads]
    label_w, label_h = _lines_size(head_lines)
    row_w = _packed_length([*widths, label_w], [_HEAD_GAP] * (len(widths) - 1) + [0.1])
    lefts = _pack(widths, _HEAD_GAP, start=MARGIN + max(0.0, (avail - row_w) / 2))
    head_h = 0.3
    return heads, lefts, widths, head_h, max(head_h, label_h)


def _single_grid(ax, levels: _Levels, level: str, shape, lines, **kwargs) -> Rect:
    """A grid centred on the middle column whose top is the level's top, its labels right of it
    from its top down."""
    w, h = _matrix_size(shape, levels.unit)
    grid = draw_matrix(
        ax,
        levels.cx - w / 2,
        levels.top[level] - h,
        shape,
        unit=levels.unit,
        name_at=None,
        shape_at=None,
        tag=level,
        **kwargs,
    )
    _write_lines(ax, grid.x1 + 0.08, grid.y1 + 0.02, lines, ha="left")
    return grid


def _draw_projection(ax, levels: _Levels, i: int, p: _Projection, stem) -> Rect:
    """Slot ``i``: the box of ``W`` fed from the stem, the name and shape of ``X W``, and its
    grid in head blocks."""
    cx = levels.slots[i]
    box = draw_box(
        ax,
        cx - levels.box_w / 2,
        levels.top["W"] - levels.box_h,
        levels.box_w,
        levels.box_h,
        p.W_text,
        color=p.color,
        fill=0.12,
        fontsize=_phone_pt(p.W_text),
        tag=f"W_{p.key}",
    )
    draw_arrow(ax, stem, (box.cx, box.y1 + 0.02))
    label_top = levels.top["QKV"]
    _write_lines(ax, cx, label_top, p.labels)
    w, h = _matrix_size(p.shape, levels.unit)
    grid = draw_matrix(
        ax,
        cx - w / 2,
        label_top - levels.qkv_label_h - 0.04 - h,
        p.shape,
        unit=levels.unit,
        color=p.color,
        name_at=None,
        shape_at=None,
        col_blocks=p.block,
        tag=p.key,
    )
    draw_arrow(ax, (box.cx, box.y0 - 0.02), (cx, label_top + 0.03))
    return grid


def _draw_heads(ax, levels: _Levels, projected, head_lines) -> dict[int, Rect]:
    """A box per drawn head (an ellipsis for those left out), fed by its block of Q, K and V,
    and what each head outputs on the right; ``{head: box}``."""
    y = levels.top["heads"] - levels.head_h
    boxes = {}
    for h, x, w in zip(levels.heads, levels.head_x, levels.head_w):
        if h is None:
            _write(ax, x + w / 2, y + levels.head_h / 2, "\N{HORIZONTAL ELLIPSIS}")
            continue
        boxes[h] = draw_box(
            ax, x, y, w, levels.head_h, f"head {h}", fontsize=TEXT_PT, fill=0.1, tag=f"head {h}"
        )
        for (p, grid), offset in zip(projected, (-0.12, 0.0, 0.12)):  # block h of Q, K, V
            part = _block_rect(grid, p.shape, (0, p.shape[0]), (h * p.block, (h + 1) * p.block))
            end = (boxes[h].cx + offset, boxes[h].y1 + 0.01)
            _line(ax, (part.cx, part.y0), end, _shade(p.color))
    last = levels.head_x[-1] + levels.head_w[-1]
    _write_lines(ax, last + 0.1, levels.top["heads"] + 0.02, head_lines, ha="left")
    return boxes


def _draw_concatenation(ax, levels: _Levels, head_boxes, sizes, singles) -> None:
    """The heads' outputs concatenated, projected by W_O, and the output."""
    T, E, H, Dv = sizes
    concat = _single_grid(
        ax, levels, "concat", (T, H * Dv), singles["concat"], color=OUTPUT, fill=0.3, col_blocks=Dv
    )
    for h, box in head_boxes.items():
        part = _block_rect(concat, (T, H * Dv), (0, T), (h * Dv, (h + 1) * Dv))
        draw_arrow(ax, (box.cx, box.y0 - 0.02), (part.cx, part.y1 + 0.03))
    wo_text = _weight_text("O", ("HD_v", "E"), (H * Dv, E))
    wo = draw_box(
        ax,
        levels.cx - levels.box_w / 2,
        levels.top["W_O"] - levels.box_h,
        levels.box_w,
        levels.box_h,
        wo_text,
        color=OUTPUT,
        fill=0.12,
        fontsize=_phone_pt(wo_text),
        tag="W_O",
    )
    draw_arrow(ax, (concat.cx, concat.y0 - 0.03), (wo.cx, wo.y1 + 0.02))
    out = _single_grid(ax, levels, "out", (T, E), singles["out"], color=OUTPUT, fill=0.45)
    draw_arrow(ax, (wo.cx, wo.y0 - 0.02), (out.cx, out.y1 + 0.03))


# ----------------------------------------------------------------------------------------------
# Grouped query heads


@dataclass(frozen=True)
class _Panels:
    """The grouped-heads diagram's sizes: panels one under the other, each a row of query heads
    over its key and value heads."""

    height: float
    panel_h: float  # one panel, from its title to its note
    title_lines: int  # the kind and the sizes on one line, or on two
    title_h: float
    q_h: float  # query heads
    kv_h: float  # a key head, and the value head under it
    links_h: float  # from the query heads down to the key heads
    x0: float  # left of the first query head's slot
    span: float  # the query heads' row


_PANEL_GAP = 0.22
_BRACKET_H = 0.14  # over the query heads: the groups
_TITLE_GAP = 0.08  # under a panel's title


def _kind_of_heads(Hq: int, Hkv: int) -> str:
    if Hkv == Hq:
        return "multi-head (MHA)"
    if Hkv == 1:
        return "multi-query (MQA)"
    return "grouped-query (GQA)"


def _sizes_text(Hq: int, Hkv: int) -> str:
    return f"$H_q = {Hq}$, $H_{{kv}} = {Hkv}$, $G = {Hq // Hkv}$"


def _cached_text(Hkv: int) -> str:
    return f"cached: {Hkv} key and {Hkv} value head{'' if Hkv == 1 else 's'}"


def grouped_heads_diagram(Hq: int, Hkv):
    r"""Query heads in groups of ``G = Hq / Hkv`` sharing one key/value head: MHA, GQA, MQA.

    Each panel draws the ``Hq`` query heads above the ``Hkv`` key/value heads (a key above a
    value) and joins each query head to the key/value head its group shares. ``Hkv = Hq`` is
    multi-head attention (groups of one), ``Hkv = 1`` multi-query attention, anything between
    grouped-query attention. Pass several ``Hkv`` to draw them one under the other, narrow
    enough for a phone. Heads are numbered from 0, as in the code, when the boxes are wide
    enough: query head ``h`` is joined to key/value head ``h // G``, whose key box carries
    that number.

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
        The diagram: white, at most 3.7 in wide (a phone's column), not registered with
        pyplot.

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
    Hq, kv_list = _checked_heads(Hq, Hkv)
    panels = _grouped_panels(Hq, kv_list)
    fig, ax = new_canvas(PHONE_CANVAS, panels.height)
    for p, Hkv_p in enumerate(kv_list):
        _draw_panel(ax, panels, p, Hq, Hkv_p)
    _legend(ax, [("query head", QUERY), ("key head", KEY), ("value head", VALUE)])
    return fig


def _checked_heads(Hq, Hkv) -> tuple[int, list[int]]:
    """``Hq`` and the list of ``Hkv``, each dividing ``Hq``."""
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
    return Hq, kv_list


def _grouped_panels(Hq: int, kv_list: list[int]) -> _Panels:
    """Each panel from the top: its kind and sizes (on one line if they fit), the groups'
    brackets, the query heads, their links, the key and value heads, what is cached. The
    panels one under the other, the legend at the bottom."""
    span = PHONE_CANVAS - 2 * MARGIN - 0.1
    one_line = all(
        text_size(_kind_of_heads(Hq, h), TEXT_PT)[0]
        + text_size(_sizes_text(Hq, h), _phone_pt(_sizes_text(Hq, h)))[0]
        + 0.2
        <= span
        for h in kv_list
    )
    title = [_sizes_text(Hq, kv_list[0])] if one_line else [_kind_of_heads(Hq, 1), "$H_q$"]
    title_h = _lines_size(title)[1]
    q_h, kv_h, links_h = 0.24, 0.2, 0.34
    note_h = _lines_size([_cached_text(1)])[1] + 0.04
    panel_sizes = [title_h, _BRACKET_H, q_h, links_h, 2 * kv_h, note_h]
    panel_h = _packed_length(panel_sizes, [_TITLE_GAP, 0.0, 0.0, 0.0, 0.0])
    n = len(kv_list)
    height = n * panel_h + (n - 1) * _PANEL_GAP + LEGEND_ROW + 0.06 + 2 * MARGIN
    return _Panels(
        height=height,
        panel_h=panel_h,
        title_lines=1 if one_line else 2,
        title_h=title_h,
        q_h=q_h,
        kv_h=kv_h,
        links_h=links_h,
        x0=MARGIN + 0.05,
        span=span,
    )


def _draw_panel(ax, panels: _Panels, p: int, Hq: int, Hkv: int) -> None:
    """Panel ``p``: its title, the ``Hq`` query heads in groups, the ``Hkv`` key/value heads,
    what is cached."""
    top = panels.height - MARGIN - p * (panels.panel_h + _PANEL_GAP)
    x0, span = panels.x0, panels.span
    kind, sizes = _kind_of_heads(Hq, Hkv), _sizes_text(Hq, Hkv)
    if panels.title_lines == 1:
        y = top - panels.title_h / 2
        _write(ax, x0, y, kind, ha="left", va="center_baseline")
        _write(ax, x0 + span, y, sizes, ha="right", va="center_baseline")
    else:
        _write_lines(ax, x0, top, [kind, sizes], ha="left")
    y_q = top - panels.title_h - _TITLE_GAP - _BRACKET_H - panels.q_h  # bottom of the query heads
    pitch = span / Hq  # from one query head to the next
    qw = pitch * (0.78 if Hq > 1 else 0.5)  # a query head's width
    row = (x0, pitch, qw, y_q)
    show_index = _shows_index(qw, Hq)
    queries = _draw_query_heads(ax, panels, p, row, Hq, Hkv, show_index=show_index)
    y_kv = y_q - panels.links_h - 2 * panels.kv_h  # bottom of the value heads
    _draw_kv_heads(ax, panels, p, (*row[:3], y_kv), queries, Hkv, show_index=show_index)
    _write(ax, x0 + span / 2, y_kv - 0.04, _cached_text(Hkv), va="top")
    if p:  # panels apart
        y_sep = top + _PANEL_GAP / 2
        _line(ax, (MARGIN, y_sep), (PHONE_CANVAS - MARGIN, y_sep), "#bbbbbb", linestyle=":")


def _shows_index(qw: float, Hq: int) -> bool:
    """Whether query heads ``qw`` wide (of ``Hq``) are wide enough to carry their numbers."""
    return qw >= text_size(str(Hq - 1), TEXT_PT)[0] + 0.08


def _draw_query_heads(ax, panels: _Panels, p: int, row, Hq: int, Hkv: int, *, show_index: bool):
    """The query heads of panel ``p`` along ``row = (x0, pitch, qw, y)`` (left, from one head to
    the next, a head's width, bottom), and a bracket over each group of ``G``; their boxes."""
    x0, pitch, qw, y = row
    G = Hq // Hkv
    queries = [
        draw_box(
            ax,
            x0 + h * pitch + (pitch - qw) / 2,
            y,
            qw,
            panels.q_h,
            str(h) if show_index else None,
            color=QUERY,
            fill=0.35,
            fontsize=TEXT_PT,
            rounded=qw > 0.1,
            tag=f"{p}: query {h}",
        )
        for h in range(Hq)
    ]
    if G > 1:  # one bracket per group
        for g in range(Hkv):
            first, last = queries[g * G], queries[(g + 1) * G - 1]
            draw_bracket(ax, first.x0, last.x1, y + panels.q_h + 0.03, None, depth=0.05)
    return queries


def _draw_kv_heads(
    ax, panels: _Panels, p: int, row, queries: list[Rect], Hkv: int, *, show_index: bool
) -> None:
    """One key head over one value head per group of ``G`` query heads, under the group, each
    query head linked to its key head; ``row = (x0, pitch, qw, y)`` as for the query heads, y
    the value heads' bottom. With ``show_index`` the key head of group ``g`` carries its
    number ``g`` (from 0)."""
    x0, pitch, qw, y = row
    G = len(queries) // Hkv
    group_w = G * pitch
    kvw = group_w - (pitch - qw) if G > 1 else qw
    for g in range(Hkv):
        kx = x0 + g * group_w + (group_w - kvw) / 2
        key = draw_box(
            ax,
            kx,
            y + panels.kv_h,
            kvw,
            panels.kv_h,
            str(g) if show_index else None,
            color=KEY,
            fill=0.45,
            fontsize=TEXT_PT,
            rounded=False,
            tag=f"{p}: key {g}",
        )
        draw_box(
            ax,
            kx,
            y,
            kvw,
            panels.kv_h,
            None,
            color=VALUE,
            fill=0.45,
            rounded=False,
            tag=f"{p}: value {g}",
        )
        for h in range(g * G, (g + 1) * G):
            spread = (h - g * G - (G - 1) / 2) * min(0.02, kvw / (2 * G))  # fan in, not one point
            _line(ax, queries[h].bottom, (key.cx + spread, key.y1), _shade(QUERY), linewidth=0.9)
