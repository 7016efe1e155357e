"""Values for the prose: :func:`~sdpa_book.display.glue` and the small formatters the pages glue.

In the book's build (where ``conf.py`` sets ``SDPA_BOOK_BUILD=1`` for the kernels) :func:`~sdpa_book.display.glue`
is MyST-NB's: the value is stored in the notebook's outputs and pasted where a ``{glue}`` role
names it. Anywhere else (a downloaded notebook in plain Jupyter, a script) MyST-NB is neither
needed nor imported: a figure or table is displayed where the page would show it, and a plain
number, which the notebook's text already states, is not shown again.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from decimal import ROUND_CEILING, ROUND_FLOOR, Decimal

import numpy as np

__all__ = ["Plain", "glue", "markdown_table", "round_down", "round_up", "vec"]

BUILD_ENV = "SDPA_BOOK_BUILD"


def _in_book_build() -> bool:
    return os.environ.get(BUILD_ENV) == "1"


def _is_rich(value) -> bool:
    """Figures and objects with a rich (HTML, Markdown, image) representation."""
    if type(value).__name__ == "Figure" and hasattr(value, "savefig"):
        return True
    return any(hasattr(value, f"_repr_{kind}_") for kind in ("html", "markdown", "png", "svg"))


def glue(name: str, value, display: bool = False) -> None:
    """Record ``value`` under ``name`` for the page's ``{glue}`` roles.

    Parameters
    ----------
    name : str
        The key the page's text uses, for example ``{glue:text}`name:.3f```.
    value : object
        A number, a :class:`~sdpa_book.display.Plain` text, a table or a Matplotlib figure.
    display : bool, default False
        Also show the value where the cell runs (MyST-NB's meaning).

    Returns
    -------
    None
        As MyST-NB's ``glue``: a cell that ends with a glue shows nothing more.

    Raises
    ------
    TypeError
        If ``name`` is not a non-empty string.

    Examples
    --------
    Outside the book's build a number shows nothing (the text states it already):

    >>> from sdpa_book import glue
    >>> glue("answer", 42)
    """
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str; got {name!r}")
    if _in_book_build():
        from myst_nb import glue as myst_glue

        if isinstance(value, Plain):
            # MyST-NB reads a glued text back with ``ast.literal_eval``, which would turn
            # "100,663,296" into a tuple; a str's repr reads back as the str itself.
            value = value.text
        myst_glue(name, value, display=display)
    elif display or _is_rich(value):
        from IPython.display import display as show

        show(value)


class Plain:
    """A text that shows as itself: in a cell's output without quotes, in the prose exactly.

    MyST-NB reads a glued value's text back as a Python literal, so a glued ``"100,663,296"``
    written as plain text would come out as the tuple ``(100, 663, 296)``; :func:`glue` hands
    MyST-NB a ``Plain``'s text as a string, which reads back unchanged.

    Examples
    --------
    >>> from sdpa_book import Plain
    >>> Plain("(1, 2)")
    (1, 2)
    """

    def __init__(self, text: str):
        if not isinstance(text, str):
            raise TypeError(f"text must be a str; got {type(text).__name__}")
        self.text = str(text)  # a plain str, also for NumPy's str_ (whose repr names it)

    def __repr__(self) -> str:
        return self.text

    def __eq__(self, other) -> bool:
        return isinstance(other, Plain) and other.text == self.text

    __hash__ = None


def vec(a, fmt: str = "{:g}") -> Plain:
    """A short vector written ``(a, b, c)`` for the prose.

    Examples
    --------
    >>> from sdpa_book import vec
    >>> vec([1.0, 0.5, -2])
    (1, 0.5, -2)
    """
    values = np.ravel(np.asarray(a))
    return Plain("(" + ", ".join(fmt.format(x) for x in values) + ")")


def round_up(x: float, digits: int = 1) -> float:
    """The smallest number of ``digits`` significant digits that is at least ``x``.

    A bound stated in the prose ("agree within 5e-16") must hold: formatting a measured
    4.3e-16 with ``:.0e`` would print 4e-16, below it. Glue ``round_up(x)`` instead, and
    format it with as many significant digits (``:.0e`` for one, ``:.2g`` for two).

    Parameters
    ----------
    x : float
        A non-negative finite number.
    digits : int, default 1
        Significant digits of the result.

    Returns
    -------
    float
        ``x`` rounded up to ``digits`` significant digits (0.0 for 0).

    Raises
    ------
    ValueError
        If ``x`` is negative or not finite, or ``digits`` is smaller than 1.

    Examples
    --------
    >>> from sdpa_book import round_up
    >>> f"{round_up(4.3e-16):.0e}", f"{round_up(2.2e-16):.0e}", f"{round_up(0.123, 2):.2g}"
    ('5e-16', '3e-16', '0.13')
    """
    return _round(x, digits, ROUND_CEILING)


def round_down(x: float, digits: int = 1) -> float:
    """The largest number of ``digits`` significant digits that is at most ``x``.

    The lower bound of :func:`round_up`: "each head puts at least 0.964 of its weight there"
    must hold, and formatting a measured 0.9646 with ``:.3f`` would print 0.965.

    Parameters
    ----------
    x : float
        A non-negative finite number.
    digits : int, default 1
        Significant digits of the result.

    Returns
    -------
    float
        ``x`` rounded down to ``digits`` significant digits (0.0 for 0).

    Raises
    ------
    ValueError
        If ``x`` is negative or not finite, or ``digits`` is smaller than 1.

    Examples
    --------
    >>> from sdpa_book import round_down
    >>> f"{round_down(0.9646, 3):.3g}", f"{round_down(4.9e-16):.0e}"
    ('0.964', '4e-16')
    """
    return _round(x, digits, ROUND_FLOOR)


def _round(x: float, digits: int, rounding: str) -> float:
    x = float(x)
    if not math.isfinite(x) or x < 0:
        raise ValueError(f"x must be a non-negative finite number; got {x!r}")
    if isinstance(digits, bool) or not isinstance(digits, (int, np.integer)) or digits < 1:
        raise ValueError(f"digits must be an int of at least 1; got {digits!r}")
    if x == 0.0:
        return 0.0
    # In decimal, from the shortest text that reads back as x, so that 1e-15 stays 1e-15.
    exact = Decimal(repr(x))
    step = Decimal(1).scaleb(exact.adjusted() - int(digits) + 1)
    return float(exact.quantize(step, rounding=rounding))


def markdown_table(
    rows: Sequence[Sequence],
    header: Sequence[str],
    *,
    fmt: str = "{:g}",
    align: str | None = None,
):
    """A Markdown table, shown as a table by Jupyter and by the book.

    Parameters
    ----------
    rows : sequence of sequences
        One sequence of cells per row; numbers are written with ``fmt``, anything else with
        ``str``.
    header : sequence of str
        Column titles; every row must have as many cells.
    fmt : str, default "{:g}"
        Format of numeric cells.
    align : str, optional
        One letter per column, ``l``, ``c`` or ``r``; default: numbers right, text left.

    Returns
    -------
    IPython.display.Markdown

    Raises
    ------
    ValueError
        If a row or ``align`` does not have one entry per column.

    Examples
    --------
    >>> from sdpa_book import markdown_table
    >>> print(markdown_table([["cat", 0.5], ["mat", 0.25]], ["token", "weight"]).data)
    | token | weight |
    |:--|--:|
    | cat | 0.5 |
    | mat | 0.25 |
    """
    from IPython.display import Markdown

    header = [str(h) for h in header]
    n = len(header)
    rows = [list(r) for r in rows]
    for i, row in enumerate(rows):
        if len(row) != n:
            raise ValueError(
                f"every row must have {n} cells, one per header; row {i} has {len(row)}"
            )

    def is_number(x) -> bool:
        return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)

    if align is None:
        numeric = [bool(rows) and all(is_number(r[c]) for r in rows) for c in range(n)]
        align = "".join("r" if flag else "l" for flag in numeric)
    if len(align) != n or set(align) - set("lcr"):
        raise ValueError(f"align must have one of l, c, r per column ({n}); got {align!r}")
    rule = {"l": ":--", "c": ":-:", "r": "--:"}

    def cell(x) -> str:
        text = fmt.format(x) if is_number(x) else str(x)
        return text.replace("|", "\\|")

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(rule[a] for a in align) + "|"]
    lines += ["| " + " | ".join(cell(x) for x in row) + " |" for row in rows]
    return Markdown("\n".join(lines))
