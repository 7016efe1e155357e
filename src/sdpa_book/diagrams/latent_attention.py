"""Multi-head latent attention's key/value path: what is cached and what each head recomputes,
:func:`latent_attention_diagram`."""

from __future__ import annotations

from ..figures import KEY, VALUE
from .draw import _outline, draw_arrow, draw_box, new_canvas
from .phone import LEGEND_ROW, PHONE_CANVAS, _legend, _lines_size, _write, _write_lines
from .primitives import INK, MARGIN, NEUTRAL, Rect, _mix, _numeric_shape, _positive_int

_PAD = 0.07  # inside a box, around its lines
_DROP = 0.5  # from one row of boxes to the next (the arrows, with their labels beside them)
_GAP = 0.14  # between two boxes of a row
_CACHE = 0.06  # the cache's outline, outside its boxes
_LEGEND_H = 2 * LEGEND_ROW + 0.06  # the legend at the foot: one entry a row


def latent_attention_diagram(
    *,
    E: int | None = None,
    Dc: int | None = None,
    Dr: int | None = None,
    Dn: int | None = None,
    Dv: int | None = None,
):
    r"""One token's path through multi-head latent attention, down to one head's key and value.

    The token's row :math:`x_j` is projected down to the latent :math:`c_j` (``Dc`` numbers)
    and, apart, to the rotated key :math:`k^R_j` (``Dr`` numbers) that every head shares: these
    two are the cache (solid outline). Head :math:`h` recomputes its key :math:`k_{h,j}` and
    value :math:`v_{h,j}` from the latent by its up-projections (dashed: never stored).

    Parameters
    ----------
    E, Dc, Dr, Dn, Dv : int, optional
        The model's width, the latent's, the rotated key's, a head's key width without
        position and its value width: when given (all five), the shape labels show the numbers.

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
        If a size is not positive, or only some of the five are given.

    Examples
    --------
    >>> from sdpa_book.diagrams import figure_texts, latent_attention_diagram
    >>> texts = figure_texts(latent_attention_diagram(E=48, Dc=16, Dr=8, Dn=12, Dv=12))
    >>> [t for t in texts if t.startswith("(")]  # x, then the cache, then what a head makes
    ['(48,)', '(16,)', '(8,)', '(12,)', '(12,)']
    """
    sizes = {"E": E, "Dc": Dc, "Dr": Dr, "Dn": Dn, "Dv": Dv}
    given = [name for name, n in sizes.items() if n is not None]
    if given and len(given) < len(sizes):
        raise ValueError(
            "give all five sizes E, Dc, Dr, Dn, Dv or none; got "
            + ", ".join(f"{name}={n!r}" for name, n in sizes.items())
        )
    numbers = {
        name: _numeric_shape((_positive_int(n, name),))
        for name, n in sizes.items()
        if n is not None
    }
    boxes = {  # tag: (lines, colour, stored)
        "x": (["$x_j$", "$(E,)$"], NEUTRAL, True),
        "latent": (["latent $c_j$", "$(D_c,)$"], _mix(KEY, 0.5, VALUE), True),
        "rope key": (["$k^R_j$", "$(D_r,)$"], KEY, True),
        "key": (["$k_{h,j}$", "$(D_n,)$"], KEY, False),
        "value": (["$v_{h,j}$", "$(D_v,)$"], VALUE, False),
    }
    letters = {"x": "E", "latent": "Dc", "rope key": "Dr", "key": "Dn", "value": "Dv"}
    for tag, name in letters.items():
        if name in numbers:
            boxes[tag][0].append(numbers[name])
    size = {tag: _box_size(lines) for tag, (lines, _, _) in boxes.items()}
    where = _layout(size)
    shift = max(0.0, MARGIN - _labels_span(where)[0])  # room for the labels on the left
    where = {tag: Rect(r.x0 + shift, r.y0, r.x1 + shift, r.y1) for tag, r in where.items()}
    width = max(max(r.x1 for r in where.values()) + _CACHE, _labels_span(where)[1]) + MARGIN
    height = max(r.y1 for r in where.values()) + MARGIN
    fig, ax = new_canvas(min(PHONE_CANVAS, width), height)
    _draw_boxes(ax, boxes, where)
    _arrows(ax, where)
    _legend(
        ax,
        [
            ("cached per token", "white", {"edgecolor": INK, "linewidth": 1.6}),
            ("recomputed by head $h$", "white", {"edgecolor": INK, "linestyle": "--"}),
        ],
        ncols=1,
    )
    return fig


def _draw_boxes(ax, boxes: dict, where: dict[str, Rect]) -> None:
    """Each box with its lines (dashed when not stored), and the outline around the cache."""
    for tag, (lines, color, stored) in boxes.items():
        r = where[tag]
        draw_box(ax, r.x0, r.y0, r.width, r.height, color=color, fill=0.2,
                 linestyle="-" if stored else "--", tag=tag)  # fmt: skip
        _write_lines(ax, r.cx, r.y1 - _PAD, lines)
    latent, rope = where["latent"], where["rope key"]
    cache = Rect(
        latent.x0 - _CACHE,
        min(latent.y0, rope.y0) - _CACHE,
        rope.x1 + _CACHE,
        max(latent.y1, rope.y1) + _CACHE,
    )
    _outline(ax, cache, INK, linewidth=1.6)


def _box_size(lines: list[str]) -> tuple[float, float]:
    w, h = _lines_size(lines)
    return w + 2 * _PAD + 0.06, h + 2 * _PAD


def _layout(size: dict[str, tuple[float, float]]) -> dict[str, Rect]:
    """From the foot up: the legend; the key and the value side by side, under the latent;
    the latent and, right of it, the rotated key; the row ``x`` above both."""
    (kw, kh), (vw, vh) = size["key"], size["value"]
    y = MARGIN + _LEGEND_H
    x0 = MARGIN + _CACHE
    key = Rect(x0, y, x0 + kw, y + kh)
    value = Rect(key.x1 + _GAP, y, key.x1 + _GAP + vw, y + vh)
    y = max(key.y1, value.y1) + _DROP
    (cw, ch), (rw, rh) = size["latent"], size["rope key"]
    cx = (key.cx + value.cx) / 2
    latent = Rect(cx - cw / 2, y, cx + cw / 2, y + ch)
    # right of the latent, clear of the value under it and of the arrow's label between them
    rx0 = max(latent.x1, value.x1) + 2 * _CACHE + 0.5
    rope = Rect(rx0, y, rx0 + rw, y + rh)
    y = max(latent.y1, rope.y1) + _CACHE + _DROP
    (xw, xh) = size["x"]
    xc = (latent.cx + rope.cx) / 2
    x = Rect(xc - xw / 2, y, xc + xw / 2, y + xh)
    return {"x": x, "latent": latent, "rope key": rope, "key": key, "value": value}


def _projections(where: dict[str, Rect]) -> list[tuple[tuple, tuple, str]]:
    """``(start, end, label)`` of each projection's arrow: from the row to the cache, from the
    latent to the head's key and value."""
    x, latent, rope, key, value = (where[t] for t in ("x", "latent", "rope key", "key", "value"))
    top = max(latent.y1, rope.y1) + _CACHE  # the cache's outline
    bottom = min(latent.y0, rope.y0) - _CACHE
    return [
        ((x.cx - 0.25 * (x.cx - latent.cx), x.y0), (latent.cx, top), r"$\times W_{DKV}$"),
        ((x.cx + 0.25 * (rope.cx - x.cx), x.y0), (rope.cx, top), "$\\times W_{KR}$,\nrotate"),
        ((latent.cx - 0.3 * (latent.cx - key.cx), bottom), key.top, r"$\times W_{UK,h}$"),
        ((latent.cx + 0.3 * (value.cx - latent.cx), bottom), value.top, r"$\times W_{UV,h}$"),
    ]


def _label_place(start, end, label: str) -> tuple[float, float, int, list[str], float]:
    """Where ``label`` goes on the outer side of a slanting arrow, clear of it over the
    label's height: ``(x, y, side, lines, height)``, ``side`` 1 for right of it, -1 left."""
    (x0, y0), (x1, y1) = start, end
    lines = label.split("\n")
    h = _lines_size(lines)[1]
    clear = 0.06 + 0.5 * h * abs(x1 - x0) / max(abs(y1 - y0), 1e-9)
    side = 1 if x1 > x0 else -1  # right of an arrow going right, left of one going left
    return (x0 + x1) / 2 + side * clear, (y0 + y1) / 2, side, lines, h


def _labels_span(where: dict[str, Rect]) -> tuple[float, float]:
    """The left edge of the labels left of their arrows, the right edge of those right."""
    left, right = float("inf"), float("-inf")
    for start, end, label in _projections(where):
        x, _, side, lines, _ = _label_place(start, end, label)
        w = _lines_size(lines)[0]
        left, right = (min(left, x - w), right) if side < 0 else (left, max(right, x + w))
    return left, right


def _arrows(ax, where: dict[str, Rect]) -> None:
    """The projections, each an arrow labelled with its matrix beside its middle."""
    for start, end, label in _projections(where):
        draw_arrow(ax, start, end)
        x, y, side, lines, h = _label_place(start, end, label)
        for i, line in enumerate(lines):
            _write(ax, x, y + h / 2 - (i + 0.5) * h / len(lines), line,
                   ha="left" if side > 0 else "right")  # fmt: skip
    rope = where["rope key"]
    _write(ax, rope.cx, rope.y0 - _CACHE - 0.08, "shared by\nall heads", va="top")
