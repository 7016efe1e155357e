"""Sphinx configuration for the sdpa book: settings only. Sources live in book/; `make html`.

What goes beyond a stock configuration is done by the book's own extensions, in book/_ext/:

* ``sdpa_cache``: the execution cache is keyed on ``src/sdpa`` (and ``src/sdpa_book``, the
  committed benchmark results, Python, NumPy and Matplotlib), so a change to the package
  re-executes every page, and a rebuild with no change executes nothing.
* ``sdpa_mathjax``: the maths is typeset when the book is built, by MathJax 4 under Node (the npm
  packages pinned in ``package.json``): SVG beside MathML for screen readers, no script in the page.
* ``sdpa_icons``: the theme's icons drawn by a small stylesheet, without Font Awesome's 1.5 MB script
  (with ``book/_templates/layout.html``, which also keeps the search index to the search page).
* ``sdpa_reading_time``: ``[[minutes:page]]`` on the landing page becomes that page's reading time.
* ``sdpa_api``: the API page's sections come from each module's ``__all__``.
* ``sdpa_citations``: each entry of the bibliography links back to the pages that cite it.
* ``sdpa_notebooks``: each executed page is offered as a notebook a reader can run in plain
  Jupyter, beside its MyST source in ``_sources/``.
* ``sdpa_downloads``: the ``sdpa`` wheel and source archive that ``make html`` builds, a pinned
  ``requirements.txt`` and one archive of every notebook, in ``downloads/``.
* ``sdpa_widgets``: BokehJS, copied from the installed ``bokeh`` into the site, and the script
  that runs the interactive figures of ``sdpa_book.widgets``, on the pages that have one.
* ``sdpa_parallel``: a parallel build (``-j 2``) reads the slowest pages first, each alone.
"""

import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "book" / "_ext"))  # the book's own extensions

BOOK_TITLE = "Scaled Dot-Product Attention, from Intuition to Kernels"
project = BOOK_TITLE
author = "the sdpa authors"
copyright = "2026, the sdpa authors"

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.doctest",
    "sphinx.ext.mathjax",
    "numpydoc",
    "sphinx_copybutton",
    "sphinx_design",
    "sphinx_togglebutton",
    "sphinxcontrib.bibtex",
    # book/_ext
    "sdpa_cache",
    "sdpa_mathjax",
    "sdpa_icons",
    "sdpa_reading_time",
    "sdpa_api",
    "sdpa_citations",
    "sdpa_notebooks",
    "sdpa_downloads",
    "sdpa_widgets",
    "sdpa_parallel",
]

# One .bib file per topic so that chapters can add references independently.
bibtex_bibfiles = sorted(p.relative_to(ROOT).as_posix() for p in ROOT.glob("book/references/*.bib"))
bibtex_default_style = "plain"
bibtex_reference_style = "author_year"

exclude_patterns = ["_build", "_static", "_ext", "**/.ipynb_checkpoints"]

# Figures and tables are numbered, so {numref} can say "Figure 3".
numfig = True

# MyST and MyST-NB
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist", "substitution"]
myst_heading_anchors = 3
nb_execution_mode = os.environ.get("SDPA_NB_EXECUTION_MODE", "cache")
nb_execution_raise_on_error = True
nb_execution_show_tb = True  # print the failing cell's traceback, not only the page's name
nb_execution_timeout = 180
nb_render_markdown_format = "myst"
nb_merge_streams = True
# The pages' kernels inherit this: sdpa_book.glue stores values for MyST-NB only in the build.
os.environ["SDPA_BOOK_BUILD"] = "1"

# The execution cache (sdpa_cache): what the pages' outputs depend on besides their own code.
# Relative to this folder; Inside the fast path renders the committed benchmark results.
sdpa_cache_packages = ["src/sdpa", "src/sdpa_book", "benchmarks/results/latest.json"]
sdpa_cache_distributions = ["numpy", "matplotlib", "bokeh"]  # and the Python version
# The pages that execute longest (they train models): a parallel build reads each in a process of
# its own, in this order, before the others (sdpa_parallel). The training page comes first: the
# pages of Part VIII reuse the model it trains (sdpa_book.pages.lm) instead of training it again.
# Only the build's time depends on this list.
sdpa_slow_pages = [
    "lm/training",
    "lm/induction-heads",
    "measured/qk-norm",
    "measured/attention-sinks",
    "measured/differential-attention",
    "modern/sparse-attention",
    "gradients/scaling-revisited",
]

# API reference (sdpa_api: sdpa.__all__ is documented in full; other modules skip its names)
sdpa_api_package = "sdpa"
autosummary_generate = False
numpydoc_show_class_members = False
numpydoc_validation_checks = set()
autodoc_typehints = "none"
autodoc_member_order = "bysource"  # for a module with __all__: the order of __all__

# Maths: typeset once the pages are written (sdpa_mathjax), so no page loads MathJax.
html_math_renderer = "sdpa_svg"

html_theme = "sphinx_book_theme"
html_title = BOOK_TITLE  # the sidebar and the browser tab show the book's own title
html_favicon = "book/_static/favicon.svg"  # also spares the browser a request for /favicon.ico
html_static_path = ["book/_static"]
# The theme's page without Font Awesome's script and, but on the search page, the search index.
templates_path = ["book/_templates"]
html_css_files = ["sdpa.css"]
html_js_files = ["search-snippets.js"]
# The pydata/book themes log a console error on a first visit without a stored mode.
html_context = {"default_mode": "auto"}
html_theme_options = {
    "show_toc_level": 2,
    "use_download_button": True,
    # pydata-sphinx-theme 0.20 puts a second search box in the header unless this is empty.
    "navbar_persistent": [],
}
html_last_updated_fmt = None
html_copy_source = True

nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(np|numpy)\..*"),
    (r"py:class", r"(array_like|ArrayLike|optional|default.*|.*\bof\b.*|callable)"),
]
