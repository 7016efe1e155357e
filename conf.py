"""Sphinx configuration for the sdpa book. Sources live in book/; build with `make html`."""

from __future__ import annotations

import glob
import os

project = "sdpa: scaled dot-product attention"
author = "the sdpa authors"
copyright = "2026, the sdpa authors"

extensions = [
    "myst_nb",
    "sphinx.ext.autodoc",
    "sphinx.ext.doctest",
    "sphinx.ext.mathjax",
    "numpydoc",
    "sphinx_copybutton",
    "sphinx_design",
    "sphinx_togglebutton",
    "sphinxcontrib.bibtex",
]

# One .bib file per topic so that chapters can add references independently.
bibtex_bibfiles = sorted(glob.glob("book/references/*.bib"))
bibtex_default_style = "plain"
bibtex_reference_style = "author_year"

exclude_patterns = ["_build", "**/.ipynb_checkpoints"]

# MyST and MyST-NB
myst_enable_extensions = ["dollarmath", "amsmath", "colon_fence", "deflist", "substitution"]
myst_heading_anchors = 3
nb_execution_mode = os.environ.get("SDPA_NB_EXECUTION_MODE", "cache")
nb_execution_raise_on_error = True
nb_execution_timeout = 180
nb_render_markdown_format = "myst"
nb_merge_streams = True

# API reference
numpydoc_show_class_members = False
numpydoc_validation_checks = set()
autodoc_typehints = "none"

html_theme = "sphinx_book_theme"
html_title = "sdpa"
html_context = {"default_mode": "auto"}
html_theme_options = {
    "show_toc_level": 2,
    "use_download_button": True,
}

nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(np|numpy)\..*"),
    (r"py:class", r"(array_like|ArrayLike|optional|default.*|.*\bof\b.*|callable)"),
]


def setup(app):
    # Formulas in headings appear in the navigation of every page, so load MathJax everywhere.
    app.set_html_assets_policy("always")
