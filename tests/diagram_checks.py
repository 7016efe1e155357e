"""Helpers the diagram tests share (tests/sdpa_book/diagrams/): one drawing per set of arguments,
and readers of what a figure shows (its shape labels, grey cells, arrows) and of its legibility."""

from __future__ import annotations

import functools
import io
import itertools
import re

import numpy as np
from matplotlib.text import Text

from sdpa_book import diagrams as dg
from sdpa_book.figures import FULL_WIDTH, MIN_FONT_PT


@functools.cache
def build(name: str, *args, **kwargs):
    """A diagram, drawn once per test session for each set of (hashable) arguments: tests only
    read figures, so they share them (drawing is most of the time these tests take)."""
    return getattr(dg, name)(*args, **kwargs)


def shapes(fig) -> list[str]:
    """The numeric shape labels, e.g. "(4, 3)", in drawing order."""
    return [t for t in dg.figure_texts(fig) if t.startswith("(") and t[1:2].isdigit()]


def masked_corners(fig) -> dict[str, list[tuple[float, float]]]:
    """{grid tag: bottom-left corners of its grey (masked) cells}, from the drawn paths."""
    corners = {}
    for patch in fig.axes[0].patches:
        label = patch.get_label() or ""
        if label.startswith("_masked "):
            squares = patch.get_path().to_polygons(closed_only=False)
            corners[label[len("_masked ") :]] = [
                tuple(np.round(sq.min(axis=0), 9)) for sq in squares
            ]
    return corners


def arrow_ends(arrow) -> tuple[np.ndarray, np.ndarray]:
    """Tail and tip of a straight arrow, from its path in data coordinates (the drawn tip stops
    about a line width short of the end point, so that the head's point lands on it)."""
    path = arrow.get_path()
    vertices = path.vertices[path.codes != path.CLOSEPOLY]  # the closing vertex is (0, 0)
    start = vertices[0]
    return start, vertices[np.argmax(np.linalg.norm(vertices - start, axis=1))]


def assert_legible(fig) -> None:
    """White, at most FULL_WIDTH wide, fonts >= MIN_FONT_PT, texts inside and apart."""
    width, height = fig.get_size_inches()
    assert width <= FULL_WIDTH + 1e-9
    assert fig.get_facecolor() == (1.0, 1.0, 1.0, 1.0)
    fig.draw_without_rendering()  # lays out the legends; nothing is rasterised
    renderer = fig.canvas.get_renderer()
    texts = [t for t in fig.findobj(Text) if t.get_visible() and t.get_text().strip()]
    assert texts, "a diagram without text"
    boxes = []
    for t in texts:
        assert t.get_fontsize() >= MIN_FONT_PT, (t.get_text(), t.get_fontsize())
        box = t.get_window_extent(renderer)
        # inside the canvas (1 px of tolerance for antialiasing)
        assert box.x0 >= -1 and box.y0 >= -1, t.get_text()
        assert box.x1 <= width * fig.dpi + 1 and box.y1 <= height * fig.dpi + 1, t.get_text()
        boxes.append((t.get_text(), box.shrunk(0.97, 0.9)))
    for (a, box_a), (b, box_b) in itertools.combinations(boxes, 2):
        assert not box_a.overlaps(box_b), f"texts overlap: {a!r} and {b!r}"


def read_grey_cells(rect, corners, T: int, S: int) -> np.ndarray:
    """The may-attend pattern of a (T, S) grid at ``rect``, read back from its grey cells."""
    cell = rect.width / S
    allowed = np.ones((T, S), dtype=bool)
    for x, y in corners:
        j = int(round((x - rect.x0) / cell))
        i = T - 1 - int(round((y - rect.y0) / cell))
        allowed[i, j] = False
    return allowed


def drawn_masks(fig, T: int, S: int) -> list[np.ndarray]:
    """The may-attend pattern of each mask panel, in order."""
    rects, greys = dg.tagged_rects(fig), masked_corners(fig)
    panels = sorted((tag for tag in rects if tag.startswith("mask ")), key=lambda t: int(t[5:]))
    return [read_grey_cells(rects[tag], greys.get(tag, []), T, S) for tag in panels]


def loop_mask(T, S, keep) -> np.ndarray:
    return np.array([[keep(i, j) for j in range(S)] for i in range(T)])


PHONE_COLUMN_PX = 342  # the book's column on a 390 px phone (the screen less its padding)
# Matplotlib's SVG draws each text as a group scaled by fontsize / 100, of glyphs that may carry
# a scale of their own (mathtext's smaller sub- and superscripts).
_GROUP = re.compile(r'<g\b[^>]*transform="[^"]*scale\(([-\d.e]+) -[-\d.e]+\)"[^>]*>(.*?)</g>', re.S)
_USE = re.compile(r"<use\b[^>]*>")
_USE_SCALE = re.compile(r'transform="[^"]*scale\(([-\d.e]+)\)')
_VIEWBOX_WIDTH = re.compile(r'<svg\b[^>]*viewBox="\s*[-\d.e]+\s+[-\d.e]+\s+([-\d.e]+)')


def smallest_text_px(fig) -> dict[str, float]:
    """The smallest glyph of ``fig``, in CSS px, on a 390 px phone and at 1280 px, saved as the
    book saves it (SVG, ``bbox_inches="tight"``: 0.1 in of padding) and shown at its natural
    size (1 pt = 4/3 px) or, on the phone, shrunk to the column."""
    buffer = io.StringIO()
    fig.savefig(buffer, format="svg", bbox_inches="tight")
    svg = buffer.getvalue()
    sizes = [
        100 * abs(float(scale)) * (float(own[1]) if (own := _USE_SCALE.search(use)) else 1.0)
        for scale, body in _GROUP.findall(svg)
        for use in _USE.findall(body)
        if 'href="#STIXSize' not in use  # a stretched radical: a shape, not text
    ]
    natural_px = float(_VIEWBOX_WIDTH.search(svg)[1]) * 4 / 3  # the viewBox is in points
    pt = min(sizes)
    return {
        "desktop": pt * 4 / 3,
        "phone": pt * 4 / 3 * min(1.0, PHONE_COLUMN_PX / natural_px),
    }


def assert_reads_on_a_phone(fig) -> None:
    """At most 4.8 in wide, and the smallest glyph at least 9 CSS px on a 390 px phone and 10 px
    at 1280 px, measured from the saved SVG as the browser test measures the page's figures."""
    assert fig.get_size_inches()[0] <= 4.8 + 1e-9, fig.get_size_inches()
    px = smallest_text_px(fig)
    assert px["phone"] >= 9.0 and px["desktop"] >= 10.0, px
