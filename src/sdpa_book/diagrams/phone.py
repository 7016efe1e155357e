"""What the diagrams drawn for a phone's column share: the widest canvas, and text written at the
sizes that read there (stacks of lines, legends).

On a 390 px phone the book's column is 342 CSS px wide, and the book saves a figure with 0.1 in
of padding on each side, so a canvas ``W`` inches wide renders at ``min(1, 342 / (96 (W + 0.2)))``
of its size. A canvas at most :data:`PHONE_CANVAS` (``primitives.PHONE_WIDTH``, 3.7 in) wide keeps words and numbers
at ``TEXT_PT`` (10 pt) above 12 CSS px there and the sub- and superscripts of maths at
``MATH_PT`` (11 pt, its scripts drawn at 70 %: 7.7 pt) at 9.4 px; at 1280 px, where the figure
keeps its size, they are 13.3 and 10.3 px. Nothing here is public: the diagrams of
``heads.py``, ``backward_graph.py``, ``transformer_block.py`` and ``kv_cache.py`` use it.
"""

from __future__ import annotations

from collections.abc import Sequence

from .draw import role_legend
from .primitives import INK, PHONE_WIDTH, TEXT_PT, _phone_pt, text_size

PHONE_CANVAS = PHONE_WIDTH  # inches: the widest canvas whose 7.7 pt scripts reach 9 px on a phone
LEGEND_ROW = 0.24  # inches: one row of a legend at TEXT_PT, with its spacing


def _line_height(text: str) -> float:
    """The height, in inches, of one line of ``text`` at the size it reads at on a phone; a
    little more for maths with both a sub- and a superscript."""
    tall = "$" in text and "_" in text and "^" in text
    return 1.4 * _phone_pt(text) / 72 * (1.15 if tall else 1.0)


def _lines_size(lines: Sequence[str]) -> tuple[float, float]:
    """Width and height, in inches, of ``lines`` written one under the other by
    :func:`_write_lines`.

    Examples
    --------
    >>> from sdpa_book.diagrams.phone import _lines_size
    >>> w1, h1 = _lines_size(["out"])
    >>> w2, h2 = _lines_size(["out", "$(T, D_v)$"])
    >>> w2 > w1 and h2 > h1
    True
    """
    width = max((text_size(t, _phone_pt(t))[0] for t in lines), default=0.0)
    return width, sum(_line_height(t) for t in lines)


def _write(ax, x: float, y: float, text: str, *, ha: str = "center", va: str = "center", **kw):
    """``text`` at ``(x, y)`` in ink, at the size it reads at on a phone (``_phone_pt``)."""
    return ax.text(x, y, text, ha=ha, va=va, fontsize=_phone_pt(text), color=INK, **kw)


def _write_lines(ax, x: float, top: float, lines: Sequence[str], *, ha: str = "center") -> list:
    """``lines`` one under the other from ``top`` down, each its own text at its own size, so
    that a name, a shape in letters and a shape in numbers can be read (and tested) apart."""
    texts = []
    for line in lines:
        h = _line_height(line)
        texts.append(_write(ax, x, top - h / 2, line, ha=ha, va="center_baseline"))
        top -= h
    return texts


def _legend(ax, entries, *, ncols: int | None = None):
    """A legend of colour roles at the foot of the canvas, its words at ``TEXT_PT``; it takes
    ``LEGEND_ROW`` inches per row (``ncols`` entries a row, default all)."""
    return role_legend(ax, entries, ncols=ncols, fontsize=TEXT_PT)
