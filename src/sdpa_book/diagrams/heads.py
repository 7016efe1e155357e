"""Heads: multi-head attention split, attended and concatenated (:func:`multihead_diagram`),
and query heads sharing key/value heads, MHA, GQA and MQA (:func:`grouped_heads_diagram`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..figures import FULL_WIDTH, KEY, OUTPUT, QUERY, VALUE
from .draw import _line, draw_arrow, draw_box, draw_bracket, new_canvas, role_legend
from .matrix import _label_stack, draw_matrix
from .primitives import (
    INK,
    LABEL_PT,
    MARGIN,
    NAME_PT,
    NEUTRAL,
    Rect,
    _at_most,
    _block_rect,
    _extent,
    _label_lines,
    _line_height,
    _mathtext_shape,
    _matrix_size,
    _numeric_shape,
    _pack,
    _packed_length,
    _positive_int,
    _shade,
    _stack_size,
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
        return f"$W_{self.key}$\n{_mathtext_shape(self.W_dims)}\n{_numeric_shape(self.W_shape)}"


@dataclass(frozen=True)
class _Levels:
    """The multi-head diagram's sizes, and the top of each of its levels, from the top down."""

    unit: float
    level_h: float  # a level of grids, with their labels beside them
    box_w: float  # the projection boxes
    box_h: float
    head_h: float
    top: dict[str, float]  # "X", "W", "QKV", "heads", "concat", "W_O", "out"
    height: float
    cx: float  # the middle of X, the concatenation, W_O and out
    slot: float  # the width given to each of Q, K and V
    label_w: float  # of the labels right of Q, K and V


_LEVELS = ("X", "W", "QKV", "heads", "concat", "W_O", "out")
_LEVEL_GAP = 0.22
_FAN = 0.45  # room for the lines from the head blocks to the heads


def _drawn_heads(H: int, limit: int = 4) -> list[int | None]:
    """The heads a diagram draws, 0-based: all of them up to ``limit``, else the first two, a
    gap (None) and the last."""
    return list(range(H)) if H <= limit else [0, 1, None, H - 1]


def multihead_diagram(T: int, E: int, H: int, Dk: int, Dv: int):
    r"""Multi-head attention: project, split into heads, attend per head, concatenate, ``W_O``.

    From top to bottom: the input :math:`X` ``(T, E)``; the projections :math:`W_Q, W_K, W_V`
    to :math:`Q, K` ``(T, H Dk)`` and :math:`V` ``(T, H Dv)``, each drawn as ``H`` blocks of
    columns (one per head); head :math:`h` attends with block :math:`h` of each; the heads'
    outputs ``(T, Dv)`` are concatenated to ``(T, H Dv)`` and projected by :math:`W_O` back to
    ``(T, E)``. Heads are numbered from 0, as in the code; with more than four heads, heads 0,
    1 and ``H - 1`` are drawn.

    Parameters
    ----------
    T, E, H, Dk, Dv : int
        Tokens, model width, heads, query/key width and value width per head.

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
    proj = [
        _Projection("Q", "$Q$", QUERY, ("T", "HD_k"), (T, H * Dk), Dk, ("E", "HD_k"), (E, H * Dk)),
        _Projection("K", "$K$", KEY, ("T", "HD_k"), (T, H * Dk), Dk, ("E", "HD_k"), (E, H * Dk)),
        _Projection("V", "$V$", VALUE, ("T", "HD_v"), (T, H * Dv), Dv, ("E", "HD_v"), (E, H * Dv)),
    ]
    levels = _multihead_levels(T, E, H, Dk, Dv, proj)
    fig, ax = new_canvas(FULL_WIDTH, levels.height)
    x_rect = _level_grid(
        ax,
        levels,
        "X",
        (T, E),
        color=NEUTRAL,
        fill=0.15,
        name="input $X$",
        dims=("T", "E"),
        tag="X",
    )
    # X feeds the three projections through a stem that clears X's labels.
    stem = (x_rect.cx, levels.top["X"] - levels.level_h)
    _line(ax, (x_rect.cx, x_rect.y0), stem, INK, linewidth=1.2)
    grids = [_draw_projection(ax, levels, i, p, stem) for i, p in enumerate(proj)]
    head_boxes = _draw_heads(ax, levels, list(zip(proj, grids)), H, T, Dv)
    _draw_concatenation(ax, levels, head_boxes, T, E, H, Dv)
    return fig


def _multihead_levels(T: int, E: int, H: int, Dk: int, Dv: int, proj) -> _Levels:
    """The cell side that fits Q, K, V side by side and X across, and the levels' heights."""
    avail = FULL_WIDTH - 2 * MARGIN
    slot = avail / 3
    label_w = max(
        _stack_size(_label_lines(p.name, p.dims, p.shape, "s", "s")["s"])[0] for p in proj
    )
    singles = [
        ("input $X$", ("T", "E"), (T, E)),
        ("concatenate", ("T", "HD_v"), (T, H * Dv)),
        ("out", ("T", "E"), (T, E)),
    ]
    single_label_w = max(_stack_size(_label_lines(*s, "s", "s")["s"])[0] for s in singles)
    unit = min(
        0.16,
        (slot - label_w - 0.25) / (H * max(Dk, Dv)),
        (avail - 2 * single_label_w - 0.2) / max(E, H * Dv),
        0.7 / T,
    )
    level_h = max(_extent(T, unit, 0.1), 3 * _line_height(LABEL_PT) + 0.02)
    box_w = max(text_size(p.W_text, LABEL_PT)[0] for p in proj) + 0.2
    box_h = text_size(proj[0].W_text, LABEL_PT)[1] + 0.1
    head_h = 0.32
    sizes = [level_h, box_h, level_h, head_h, level_h, box_h, level_h]
    gaps = [_LEVEL_GAP, _LEVEL_GAP, _FAN, _LEVEL_GAP, _LEVEL_GAP, _LEVEL_GAP]
    height = _packed_length(sizes, gaps) + 2 * MARGIN
    tops = _pack(sizes, gaps, start=height - MARGIN, down=True)
    return _Levels(
        unit=unit,
        level_h=level_h,
        box_w=box_w,
        box_h=box_h,
        head_h=head_h,
        top=dict(zip(_LEVELS, tops)),
        height=height,
        cx=MARGIN + avail / 2 - single_label_w / 2,
        slot=slot,
        label_w=label_w,
    )


def _level_grid(ax, levels: _Levels, level: str, shape, cx: float | None = None, **kwargs) -> Rect:
    """A grid centred on ``cx`` (default: the middle column) whose top is the level's top, its
    labels right of it, starting at its top."""
    cx = levels.cx if cx is None else cx
    w, h = _matrix_size(shape, levels.unit)
    return draw_matrix(
        ax,
        cx - w / 2,
        levels.top[level] - h,
        shape,
        unit=levels.unit,
        name_at="right",
        shape_at="right",
        label_align="top",
        **kwargs,
    )


def _draw_projection(ax, levels: _Levels, i: int, p: _Projection, stem) -> Rect:
    """Slot ``i``: the box of ``W`` fed from the stem, then the grid of ``X W`` in head blocks."""
    slot_cx = MARGIN + levels.slot * (i + 0.5) - levels.label_w / 2
    box = draw_box(
        ax,
        slot_cx - levels.box_w / 2,
        levels.top["W"] - levels.box_h,
        levels.box_w,
        levels.box_h,
        p.W_text,
        color=p.color,
        fill=0.12,
        fontsize=LABEL_PT,
    )
    draw_arrow(ax, stem, (box.cx, box.y1 + 0.02))
    grid = _level_grid(
        ax,
        levels,
        "QKV",
        p.shape,
        cx=slot_cx,
        color=p.color,
        name=p.name,
        dims=p.dims,
        col_blocks=p.block,
        tag=p.key,
    )
    draw_arrow(ax, (box.cx, box.y0 - 0.02), (grid.cx, grid.y1 + 0.03))
    return grid


def _draw_heads(ax, levels: _Levels, projected, H: int, T: int, Dv: int) -> dict[int, Rect]:
    """A box per drawn head (an ellipsis for those left out), fed by its block of Q, K and V;
    ``{head: box}``."""
    heads = _drawn_heads(H)
    avail = FULL_WIDTH - 2 * MARGIN
    head_w = min(1.05, (avail - 0.3 * len(heads)) / len(heads))
    spread = avail - levels.label_w
    head_y = levels.top["heads"] - levels.head_h
    head_boxes = {}
    for n, h in enumerate(heads):
        hx = MARGIN + spread * (n + 0.5) / len(heads) - head_w / 2
        if h is None:
            ax.text(
                hx + head_w / 2,
                head_y + levels.head_h / 2,
                "\N{HORIZONTAL ELLIPSIS}",
                ha="center",
                va="center",
                fontsize=NAME_PT,
                color=INK,
            )
            continue
        head_boxes[h] = draw_box(
            ax, hx, head_y, head_w, levels.head_h, f"head {h}", color=NEUTRAL, fill=0.1
        )
        _draw_fan(ax, levels, projected, h, head_boxes[h])
    _label_stack(
        ax,
        head_boxes[max(head_boxes)],  # right of the last head
        "right",
        [("each head", LABEL_PT), ("$(T, D_v)$", LABEL_PT), (_numeric_shape((T, Dv)), LABEL_PT)],
    )
    return head_boxes


def _draw_fan(ax, levels: _Levels, projected, h: int, box: Rect) -> None:
    """Lines from block ``h`` of Q, K and V down to head ``h``'s box."""
    fan_y = levels.top["QKV"] - levels.level_h  # the bottom of the level, clear of the labels
    for (p, grid), offset in zip(projected, (-0.15, 0.0, 0.15)):
        part = _block_rect(grid, p.shape, (0, p.shape[0]), (h * p.block, (h + 1) * p.block))
        _line(ax, (part.cx, part.y0), (part.cx, fan_y), _shade(p.color))
        _line(ax, (part.cx, fan_y), (box.cx + offset, box.y1 + 0.01), _shade(p.color))


def _draw_concatenation(ax, levels: _Levels, head_boxes, T: int, E: int, H: int, Dv: int):
    """The heads' outputs concatenated, projected by W_O, and the output."""
    concat = _level_grid(
        ax,
        levels,
        "concat",
        (T, H * Dv),
        color=OUTPUT,
        fill=0.3,
        name="concatenate",
        dims=("T", "HD_v"),
        col_blocks=Dv,
        tag="concat",
    )
    for h, box in head_boxes.items():
        part = _block_rect(concat, (T, H * Dv), (0, T), (h * Dv, (h + 1) * Dv))
        draw_arrow(ax, (box.cx, box.y0 - 0.02), (part.cx, part.y1 + 0.03))
    wo_text = f"$W_O$\n{_mathtext_shape(('HD_v', 'E'))}\n{_numeric_shape((H * Dv, E))}"
    wo = draw_box(
        ax,
        levels.cx - levels.box_w / 2,
        levels.top["W_O"] - levels.box_h,
        levels.box_w,
        levels.box_h,
        wo_text,
        color=OUTPUT,
        fill=0.12,
        fontsize=LABEL_PT,
    )
    draw_arrow(ax, (concat.cx, concat.y0 - 0.03), (wo.cx, wo.y1 + 0.02))
    out = _level_grid(
        ax, levels, "out", (T, E), color=OUTPUT, fill=0.45, name="out", dims=("T", "E"), tag="out"
    )
    draw_arrow(ax, (wo.cx, wo.y0 - 0.02), (out.cx, out.y1 + 0.03))


# ----------------------------------------------------------------------------------------------
# Grouped query heads


@dataclass(frozen=True)
class _Panels:
    """The grouped-heads diagram's sizes: panels side by side, each a column from the top."""

    panel_w: float
    height: float
    q_h: float  # query heads
    kv_h: float  # a key head, and the value head under it
    y_title: float  # top of the titles
    y_q: float  # bottom of the query heads
    y_kv: float  # bottom of the value heads
    legend_h: float  # at the bottom, across the panels
    notes: list[str]  # under each panel: what it caches


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
    grouped-query attention. Pass several ``Hkv`` to draw them side by side. Heads are
    numbered from 0, as in the code, when the boxes are wide enough: query head ``h`` is
    joined to key/value head ``h // G``, whose key box carries that number.

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
        The diagram: white, at most ``sdpa_book.figures.FULL_WIDTH`` wide, not registered
        with pyplot.

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
    fig, ax = new_canvas(panels.panel_w * len(kv_list), panels.height)
    for p, Hkv_p in enumerate(kv_list):
        _draw_panel(ax, panels, p, Hq, Hkv_p)
    role_legend(ax, [("query head", QUERY), ("key head", KEY), ("value head", VALUE)])
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
    """From the top: titles, the groups' brackets, the query heads, their links, the key and
    value heads, a note of what is cached; the legend at the bottom."""
    n = len(kv_list)
    panel_w = FULL_WIDTH / n if n > 1 else min(FULL_WIDTH, max(3.6, 0.3 * Hq + 0.6))
    notes = [f"cached: {h} key and {h} value head{'' if h == 1 else 's'}" for h in kv_list]
    if max(text_size(t)[0] for t in notes) > panel_w - 0.2:  # narrow panels: two lines
        notes = [t.replace(": ", ":\n") for t in notes]
    title_h = 2 * _line_height(LABEL_PT) + 0.08
    q_h, kv_h, legend_h = 0.26, 0.22, 0.32
    sizes = [title_h, q_h, 2 * kv_h, text_size(notes[0])[1] + 0.1, legend_h]  # ..., note, legend
    gaps = [0.3, 0.55, 0.0, 0.0]  # brackets over the query heads; links down to the keys
    height = _packed_length(sizes, gaps) + 2 * MARGIN
    y_title, y_q_top, y_kv_top, _, _ = _pack(sizes, gaps, start=height - MARGIN, down=True)
    return _Panels(
        panel_w, height, q_h, kv_h, y_title, y_q_top - q_h, y_kv_top - 2 * kv_h, legend_h, notes
    )


def _draw_panel(ax, panels: _Panels, p: int, Hq: int, Hkv: int) -> None:
    """Panel ``p``: its title, the ``Hq`` query heads in groups, the ``Hkv`` key/value heads."""
    x0 = p * panels.panel_w + 0.12
    span = panels.panel_w - 0.24
    ax.text(
        x0 + span / 2,
        panels.y_title,
        _kind_of_heads(Hq, Hkv),
        ha="center",
        va="top",
        fontsize=NAME_PT,
        color=INK,
    )
    ax.text(
        x0 + span / 2,
        panels.y_title - _line_height(NAME_PT) - 0.02,
        f"$H_q = {Hq}$, $H_{{kv}} = {Hkv}$, $G = {Hq // Hkv}$",
        ha="center",
        va="top",
        fontsize=LABEL_PT,
        color=INK,
    )
    pitch = span / Hq  # from one query head to the next
    qw = pitch * (0.78 if Hq > 1 else 0.5)  # a query head's width
    queries = _draw_query_heads(ax, panels, p, (x0, pitch, qw), Hq, Hkv)
    _draw_kv_heads(ax, panels, p, (x0, pitch, qw), queries, Hkv, show_index=_shows_index(qw, Hq))
    ax.text(
        x0 + span / 2,
        panels.y_kv - 0.05,
        panels.notes[p],
        ha="center",
        va="top",
        fontsize=LABEL_PT,
        color=INK,
        linespacing=1.3,
    )
    if p:  # panels apart
        _line(
            ax,
            (p * panels.panel_w, MARGIN + panels.legend_h),
            (p * panels.panel_w, panels.height - MARGIN),
            "#cccccc",
            linewidth=0.8,
            linestyle=":",
        )


def _shows_index(qw: float, Hq: int) -> bool:
    """Whether query heads ``qw`` wide (of ``Hq``) are wide enough to carry their numbers."""
    return qw >= 0.17 and Hq <= 32


def _draw_query_heads(ax, panels: _Panels, p: int, row, Hq: int, Hkv: int) -> list[Rect]:
    """The query heads of panel ``p`` along ``row = (x0, pitch, qw)`` (left, from one head to the
    next, a head's width), and a bracket over each group of ``G``; the heads' boxes."""
    x0, pitch, qw = row
    G = Hq // Hkv
    show_index = _shows_index(qw, Hq)
    queries = [
        draw_box(
            ax,
            x0 + h * pitch + (pitch - qw) / 2,
            panels.y_q,
            qw,
            panels.q_h,
            str(h) if show_index else None,
            color=QUERY,
            fill=0.35,
            fontsize=LABEL_PT,
            rounded=qw > 0.1,
            tag=f"{p}: query {h}",
        )
        for h in range(Hq)
    ]
    if G > 1:  # one bracket per group, the first one labelled
        for g in range(Hkv):
            first, last = queries[g * G], queries[(g + 1) * G - 1]
            draw_bracket(
                ax,
                first.x0,
                last.x1,
                panels.y_q + panels.q_h + 0.04,
                f"$G = {G}$" if g == 0 else None,
                depth=0.05,
            )
    return queries


def _draw_kv_heads(
    ax, panels: _Panels, p: int, row, queries: list[Rect], Hkv: int, *, show_index: bool
) -> None:
    """One key head over one value head per group of ``G`` query heads, under the group, each
    query head linked to its key head; ``row`` as for :func:`_draw_query_heads`. With
    ``show_index`` the key head of group ``g`` carries its number ``g`` (from 0)."""
    x0, pitch, qw = row
    G = len(queries) // Hkv
    group_w = G * pitch
    kvw = group_w - (pitch - qw) if G > 1 else qw
    for g in range(Hkv):
        kx = x0 + g * group_w + (group_w - kvw) / 2
        key = draw_box(
            ax,
            kx,
            panels.y_kv + panels.kv_h,
            kvw,
            panels.kv_h,
            str(g) if show_index else None,
            color=KEY,
            fill=0.45,
            fontsize=LABEL_PT,
            rounded=False,
            tag=f"{p}: key {g}",
        )
        draw_box(
            ax,
            kx,
            panels.y_kv,
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
