"""A parallel build (``-j N``) reads the slowest pages first, each in a process of its own.

Sphinx cuts the pages, in alphabetical order, into a few chunks of about a dozen and gives each
chunk to one process; the pages execute while they are read. The book's slowest pages (the ones
that train models, ``sdpa_slow_pages``) sit close together in that order, so one chunk held most of
the execution time and a two-process build of every page took about as long as a serial one
(182 s of reading for 193 s of execution on the 2-core machine). Here each slow page is a chunk
of its own, handed out first in the configured order, and the other pages follow in Sphinx's
chunks: the other process reads the quick pages meanwhile.

Only the order and grouping of the reading change: what each page produces does not depend on
which process reads it.
"""

from __future__ import annotations

from collections.abc import Sequence

import sphinx.builders
from sphinx.util.parallel import make_chunks

SLOW_FIRST: list[str] = []  # set from the configuration at builder-inited


def slow_first_chunks(docnames: Sequence[str], nproc: int, maxbatch: int = 10) -> list[list[str]]:
    """``make_chunks``, with each of ``SLOW_FIRST`` alone in a chunk of its own, ahead of the rest."""
    present = set(docnames)
    slow = [name for name in SLOW_FIRST if name in present]
    rest = [name for name in docnames if name not in set(slow)]
    return [[name] for name in slow] + (make_chunks(rest, nproc, maxbatch) if rest else [])


def install(app) -> None:
    """Put the chunking in place of Sphinx's (names of pages the book lacks are passed over:
    ``tests/book/test_notebooks.py`` checks that the book's list names its pages)."""
    SLOW_FIRST[:] = app.config.sdpa_slow_pages
    sphinx.builders.make_chunks = slow_first_chunks  # the name Sphinx's builders call


def setup(app):
    # Pages whose execution takes longest, slowest first (document names, without .md).
    app.add_config_value("sdpa_slow_pages", [], "", types=frozenset({list}))
    app.connect("env-before-read-docs", lambda app, env, docnames: install(app))
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
