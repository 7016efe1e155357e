"""What every diagram shares before it draws: roles and sizes, argument checks, rectangles,
packing a row or a column, and measuring text.

Nothing here draws. The colours, the font sizes and :class:`Rect` are public through
:mod:`sdpa_book.diagrams`; the underscored helpers are used only inside the package.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from numbers import Integral, Real

import numpy as np

from ..figures import COLORS, MIN_FONT_PT

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

# Diagrams drawn to be read on a 390 px phone. The book saves a canvas W inches wide with 0.1 in
# of padding on each side, and a phone shrinks it to the column, PHONE_COLUMN_PX CSS px, by
# min(1, PHONE_COLUMN_PX / (96 (W + 0.2))); 1 pt is 4/3 px at full size, and a sub- or
# superscript is drawn at SCRIPT_SHRINK of its text. A canvas at most PHONE_WIDTH wide, with
# words and numbers at TEXT_PT and maths with scripts at MATH_PT, keeps every glyph at 9 CSS px
# or more on the phone and 10 px or more at 1280 px (where figures keep their size).
PHONE_COLUMN_PX = 342
PHONE_WIDTH = 3.7  # inches: 7.7 pt scripts render at 9.4 px on the phone, 10.3 px at 1280 px
TEXT_PT = 10  # words and numbers
MATH_PT = 11  # text with a sub- or superscript: the scripts are 7.7 pt
SCRIPT_SHRINK = 0.7  # Matplotlib's mathtext draws scripts at 70 % of the text


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
# Geometry


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


def _gap_list(n: int, gaps) -> list[float]:
    """``gaps`` as one gap after each of ``n`` items but the last (a number: the same gap)."""
    if isinstance(gaps, Real):
        return [float(gaps)] * max(n - 1, 0)
    gaps = [float(g) for g in gaps]
    if len(gaps) != max(n - 1, 0):
        raise ValueError(
            f"gaps must hold one gap between each two of the {n} sizes, {max(n - 1, 0)} in all; "
            f"got {len(gaps)}"
        )
    return gaps


def _pack(
    sizes: Sequence[float], gaps=0.0, *, start: float = 0.0, down: bool = False
) -> list[float]:
    """Where each item of a row (or a column) starts, the items laid end to end ``gaps`` apart.

    Parameters
    ----------
    sizes : sequence of float
        Widths of the items of a row (heights of a column), in inches, in order.
    gaps : float or sequence of float, default 0.0
        The space after each item but the last: one number for all, or ``len(sizes) - 1``.
    start : float, default 0.0
        Where the first item starts.
    down : bool, default False
        Lay a column from ``start`` downwards (the numbers returned are then the items' top
        edges) rather than a row from ``start`` rightwards (their left edges).

    Returns
    -------
    list of float
        One start per item: item ``k + 1`` starts ``sizes[k] + gaps[k]`` after item ``k``.

    Raises
    ------
    ValueError
        If ``gaps`` is a sequence of another length than ``len(sizes) - 1``.

    Examples
    --------
    Three boxes 1, 2 and 0.5 in wide, 0.25 in apart, from x = 0.5:

    >>> from sdpa_book.diagrams.primitives import _pack
    >>> _pack([1.0, 2.0, 0.5], 0.25, start=0.5)
    [0.5, 1.75, 4.0]

    A column of levels 1 and 0.5 in high hanging from y = 3, 0.25 in apart (top edges):

    >>> _pack([1.0, 0.5], 0.25, start=3.0, down=True)
    [3.0, 1.75]
    """
    sign = -1.0 if down else 1.0
    starts = [start] if len(sizes) else []
    for size, gap in zip(sizes[:-1], _gap_list(len(sizes), gaps)):
        starts.append(starts[-1] + sign * size + sign * gap)
    return starts


def _packed_length(sizes: Sequence[float], gaps=0.0) -> float:
    """The length a row or column of :func:`_pack` covers: its sizes and the gaps between them.

    Examples
    --------
    >>> from sdpa_book.diagrams.primitives import _packed_length
    >>> _packed_length([1.0, 2.0, 0.5], 0.25)
    4.0
    """
    return sum(sizes) + sum(_gap_list(len(sizes), gaps))


def _clear_gap(
    w_a: float, w_b: float, label_a: float, label_b: float, clearance: float, least: float
) -> float:
    """The gap between two grids ``w_a`` and ``w_b`` wide, side by side, whose labels (``label_a``
    and ``label_b`` wide, centred under them) must stay ``clearance`` apart; at least ``least``."""
    return max(least, (label_a + label_b) / 2 + clearance - (w_a + w_b) / 2)


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


def _extent(n: int, unit: float, min_size: float) -> float:
    return max(min_size, n * unit)


def _grid_shape(shape, column: bool = False) -> tuple[int, int]:
    """(rows, cols) of the grid drawn for ``shape``: a 1-D shape is a row, or a column."""
    if len(shape) == 2:
        return tuple(shape)
    return (shape[0], 1) if column else (1, shape[0])


def _matrix_size(
    shape, unit: float, min_size: float = 0.1, column: bool = False
) -> tuple[float, float]:
    """Width and height, in inches, of the grid ``draw_matrix`` draws for ``shape``."""
    rows, cols = _grid_shape(shape, column)
    return _extent(cols, unit, min_size), _extent(rows, unit, min_size)


def _block_rect(
    rect: Rect, shape: Sequence[int], rows: tuple[int, int], cols: tuple[int, int]
) -> Rect:
    """The sub-rectangle of a grid drawn by ``draw_matrix`` covering ``rows`` x ``cols``."""
    n_rows, n_cols = (1, shape[0]) if len(shape) == 1 else shape
    cw, ch = rect.width / n_cols, rect.height / n_rows
    return Rect(
        rect.x0 + cols[0] * cw,
        rect.y1 - rows[1] * ch,
        rect.x0 + cols[1] * cw,
        rect.y1 - rows[0] * ch,
    )


# ----------------------------------------------------------------------------------------------
# Text: measuring, formatting, colours


def text_size(text: str, fontsize: float = LABEL_PT) -> tuple[float, float]:
    """Width and height, in inches, that ``text`` takes at ``fontsize`` points.

    Mathtext (``$D_k$``) is measured as drawn; several lines (``"\\n"``) are stacked at the
    line spacing the helpers use. Diagrams use it to leave room for their labels.

    Parameters
    ----------
    text : str
        One line or several, with mathtext between dollars.
    fontsize : float, default MIN_FONT_PT
        In points.

    Returns
    -------
    (width, height) : tuple of float
        In inches: the widest line, and the lines' height.

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


def _stack_line_height(text: str, fontsize: float) -> float:
    """A line of a label stack; a little more for maths with both a sub- and a superscript."""
    tall = "$" in text and "_" in text and "^" in text
    return _line_height(fontsize) * (1.15 if tall else 1.0)


def _stack_size(lines: Sequence[tuple[str, float]]) -> tuple[float, float]:
    width = max((text_size(t, fs)[0] for t, fs in lines), default=0.0)
    return width, sum(_stack_line_height(t, fs) for t, fs in lines)


def _label_lines(
    name, dims, shape, name_at, shape_at, name_pt: float = NAME_PT, label_pt: float = LABEL_PT
) -> dict[str, list[tuple[str, float]]]:
    """The label lines of a matrix, grouped by the side they go on: the name at ``name_pt``, the
    symbolic and the numeric shape at ``label_pt``."""
    sides: dict[str, list[tuple[str, float]]] = {}
    if name and name_at:
        sides.setdefault(name_at, []).append((name, name_pt))
    if shape_at:
        if dims is not None:
            sides.setdefault(shape_at, []).append((_mathtext_shape(dims), label_pt))
        sides.setdefault(shape_at, []).append((_numeric_shape(shape), label_pt))
    return sides


def _has_scripts(text: str) -> bool:
    """Whether ``text`` holds mathtext with a sub- or superscript (drawn smaller).

    Examples
    --------
    >>> from sdpa_book.diagrams.primitives import _has_scripts
    >>> _has_scripts("$W_Q$"), _has_scripts("$x^2$"), _has_scripts("$j < 4$"), _has_scripts("a_b")
    (True, True, False, False)
    """
    maths = str(text).split("$")[1::2] if str(text).count("$") >= 2 else []
    return any("_" in m or "^" in m for m in maths)


def _phone_pt(text: str, plain: float = TEXT_PT) -> float:
    """The size at which ``text`` reads on a phone: ``plain``, or at least MATH_PT for maths
    with scripts.

    Examples
    --------
    >>> from sdpa_book.diagrams.primitives import _phone_pt
    >>> _phone_pt("softmax"), _phone_pt("$(T, D_k)$"), _phone_pt("$W_Q$", 12)
    (10, 11, 12)
    """
    return max(plain, MATH_PT) if _has_scripts(text) else plain


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


def _fmt_value(value: float, decimals: int | None = None) -> str:
    """``value`` with ``decimals`` decimals (default: two, one from 10 on) and a true minus."""
    digits = (1 if abs(value) >= 9.995 else 2) if decimals is None else decimals
    text = f"{round(float(value), digits) + 0.0:.{digits}f}"  # + 0.0: no "-0.00"
    return text.replace("-", "\N{MINUS SIGN}")


def _integer_valued(*arrays) -> bool:
    """Whether every entry of every array is a whole number (written without decimals)."""
    return all(np.array_equal(a, np.round(a)) for a in arrays)
