"""Helpers of the sdpa book: what its pages need besides the attention package itself.

The book's pages import ``sdpa`` for everything they teach, and this package for the
plumbing a reader should not have to read: passing computed values into the prose
(:func:`~sdpa_book.display.glue`),
writing tables, timing, the figure style and the diagrams drawn from a page's own arrays. It ships
in the same wheel as ``sdpa`` so that a page downloaded as a notebook runs with nothing else
installed, but it is the book's module: its functions may change with the book.

Modules
-------
display
    :func:`~sdpa_book.display.glue`, :class:`~sdpa_book.display.Plain`,
    :func:`~sdpa_book.display.vec`, :func:`~sdpa_book.display.markdown_table`,
    :func:`~sdpa_book.display.round_up`, :func:`~sdpa_book.display.round_down`.
timing
    :func:`~sdpa_book.timing.best_time`, :func:`~sdpa_book.timing.loglog_slope`,
    :func:`~sdpa_book.timing.l2_cache`.
checks
    :func:`~sdpa_book.checks.check_count`, the integer check the helpers share.
figures
    The figure style (applied on import: fonts, colours, SVG in notebooks) and colour roles.
diagrams
    Pictures of data flow drawn from a page's own arrays (a GPU's thread blocks and a paged
    cache's block tables among them).
pages
    Helpers of single pages (or of one part): block grids, sparse attention's data, the book's
    trained model, quantised keys and values, training probes (see :mod:`sdpa_book.pages`).
widgets
    Interactive figures: every state computed by ``sdpa`` at build time, BokehJS in the page.
"""

from __future__ import annotations

from .display import Plain, glue, markdown_table, round_down, round_up, vec
from .timing import best_time, l2_cache, loglog_slope

try:
    import matplotlib  # noqa: F401
except ImportError:  # pragma: no cover - without Matplotlib: no figures; glue and tables still work
    pass
else:
    from .figures import apply_style

    apply_style()

__all__ = [
    "Plain",
    "best_time",
    "glue",
    "l2_cache",
    "loglog_slope",
    "markdown_table",
    "round_down",
    "round_up",
    "vec",
]
