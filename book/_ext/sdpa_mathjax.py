"""Maths typeset when the book is built: SVG with MathML for screen readers, no script in the page.

Sphinx writes each formula as TeX in a ``span.math`` or ``div.math`` (``\\(...\\)``, ``\\[...\\]``)
and bibliography entries keep BibTeX's ``$...$``. Once the html build has written its pages, this
extension hands every formula of each page it wrote to MathJax 4 running under Node (the npm
packages pinned in ``package.json``; ``sdpa_maths_render.mjs``), in one process for the whole
build, and puts the result in place of the TeX: an SVG drawing (no web font to download, and it
takes the text colour, so the dark theme needs nothing) beside the formula's MathML, which screen
readers read (MathJax's assistive MathML). Each page holds its glyph outlines once, in a hidden
``<svg>`` the formulas point into. The reader's browser loads no MathJax at all: formulas in
headings, which the navigation repeats on every page, cost no script either.

A page Sphinx did not rewrite keeps its typeset maths (a page holding TeX is the mark of one to
do), so a rebuild with no change typesets only the pages Sphinx writes every time (the
bibliography and the landing page: 0.3 s). A TeX error, an unknown macro included, fails the
build, naming the page and the formula.
"""

from __future__ import annotations

import html
import json
import re
import shutil
import subprocess
import time
from pathlib import Path

from sphinx.errors import ConfigError, ExtensionError
from sphinx.util import logging

logger = logging.getLogger(__name__)

# Relative to the configuration directory.
MATHJAX_DIR = Path("node_modules") / "mathjax"
MATHJAX_FONT_DIR = Path("node_modules") / "@mathjax" / "mathjax-newcm-font"
RENDERER = Path(__file__).with_name("sdpa_maths_render.mjs")
CSS_NAME = "sdpa-maths.css"
# A display formula breaks into lines at this width (CSS px), measured in the theme's text, whose
# x-height is EX_PX: at 1280 px the content column is 688 px wide, a docstring's (dd) 656 px;
# less a margin for readers whose system font is wider. A narrower screen scrolls it in its box.
DISPLAY_WIDTH = 640
EX_PX = 9
NODE_TIMEOUT = 120  # seconds, for every page of the book at once

# Sphinx's markup (sphinx.ext.mathjax, and MyST's amsmath blocks): \(...\) in a span, \[...\] in
# a div, the div possibly holding an equation number first.
_INLINE = re.compile(r'(<span class="math notranslate nohighlight">)\\\((.*?)\\\)(</span>)', re.S)
_DISPLAY = re.compile(
    r'(<div class="math notranslate nohighlight"[^>]*>(?:\s*<span class="eqno">.*?</span>)?)'
    r"\s*\\\[(.*?)\\\](\s*</div>)",
    re.S,
)
# A bibliography entry (sphinxcontrib-bibtex) and the $...$ maths in its text.
_CITATION = re.compile(r'(<div class="citation"[^>]*>)(.*?)(</div>)', re.S)
_DOLLARS = re.compile(r"(?<![\\$])\$([^$<>]+?)(?<!\\)\$")
_GLYPHS_ID = "sdpa-maths-glyphs"


def check_mathjax(app) -> None:
    """Stop an html build early, with the command to run, when MathJax or Node is missing."""
    if app.builder.format != "html":
        return
    root = Path(app.confdir)
    required = (root / MATHJAX_DIR / "node-main.mjs", root / MATHJAX_FONT_DIR / "svg")
    missing = [str(p) for p in required if not p.exists()]
    if missing:
        raise ConfigError(
            f"MathJax is not installed: missing {', '.join(missing)}. "
            "Run `make node_modules` (or `npm ci`) in the project folder first."
        )
    if shutil.which("node") is None:
        raise ConfigError("Node.js (`node`) is needed to typeset the book's maths; install it.")


def _visit_inline(self, node) -> None:
    # MyST may replace the mathjax renderers when the builder starts: look them up when used.
    self.builder.app.registry.html_inline_math_renderers["mathjax"][0](self, node)


def _visit_block(self, node) -> None:
    self.builder.app.registry.html_block_math_renderers["mathjax"][0](self, node)


def formulas(page: str) -> list[tuple[str, bool]]:
    """The formulas of a written page, in order, as (TeX, display); the TeX unescaped."""
    found: list[tuple[int, str, bool]] = []
    found += [(m.start(), html.unescape(m[2]), False) for m in _INLINE.finditer(page)]
    found += [(m.start(), html.unescape(m[2]), True) for m in _DISPLAY.finditer(page)]
    for citation in _CITATION.finditer(page):
        found += [
            (citation.start(2) + m.start(), html.unescape(m[1]), False)
            for m in _DOLLARS.finditer(citation[2])
        ]
    return [(tex, display) for _, tex, display in sorted(found, key=lambda f: f[0])]


def typeset(page: str, rendered: dict[tuple[str, bool], str], glyphs: str) -> str:
    """The page with each formula replaced by its rendering and the glyphs after ``<body>``."""
    page = _INLINE.sub(lambda m: m[1] + rendered[html.unescape(m[2]), False] + m[3], page)
    page = _DISPLAY.sub(lambda m: m[1] + rendered[html.unescape(m[2]), True] + m[3], page)

    def citation(m: re.Match) -> str:
        body = _DOLLARS.sub(lambda d: rendered[html.unescape(d[1]), False], m[2])
        return m[1] + body + m[3]

    page = _CITATION.sub(citation, page)
    hidden = (
        f'<svg id="{_GLYPHS_ID}" style="display: none" aria-hidden="true" '
        f'xmlns="http://www.w3.org/2000/svg">{glyphs}</svg>'
    )
    return re.sub(r"(<body[^>]*>)", lambda m: m[1] + hidden, page, count=1)


def _run_node(app, pages: list[list[tuple[str, bool]]]) -> dict:
    root = Path(app.confdir)
    request = {
        "mathjax": str((root / MATHJAX_DIR).resolve()),
        "font": str((root / MATHJAX_FONT_DIR).resolve()),
        "width": DISPLAY_WIDTH,
        "ex": EX_PX,
        "pages": pages,
    }
    result = subprocess.run(
        ["node", str(RENDERER)],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        timeout=NODE_TIMEOUT,
        check=False,
    )
    if result.returncode != 0:
        raise ExtensionError(f"MathJax (node {RENDERER.name}) failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout)


def typeset_site(app, exception) -> None:
    """Typeset the maths of every page this build wrote (those still holding TeX)."""
    if exception or app.builder.format != "html":
        return
    start = time.perf_counter()
    outdir = Path(app.outdir)
    todo: dict[Path, tuple[str, list[tuple[str, bool]]]] = {}
    for path in sorted(outdir.rglob("*.html")):
        if "_static" in path.relative_to(outdir).parts:
            continue
        page = path.read_text(encoding="utf-8")
        found = formulas(page)
        if found:
            todo[path] = (page, list(dict.fromkeys(found)))
    css = outdir / "_static" / CSS_NAME
    if not todo and css.exists():
        return
    reply = _run_node(app, [found for _, found in todo.values()])
    errors = [
        f"{path.relative_to(outdir)}: {error}"
        for path, result in zip(todo, reply["pages"], strict=True)
        for error in result["errors"]
    ]
    if errors:
        raise ExtensionError("TeX errors in the book's maths:\n  " + "\n  ".join(errors))
    for (path, (page, found)), result in zip(todo.items(), reply["pages"], strict=True):
        rendered = dict(zip(found, result["html"], strict=True))
        path.write_text(typeset(page, rendered, result["glyphs"]), encoding="utf-8")
    css.write_text(_stylesheet(reply["css"]), encoding="utf-8")
    logger.info(
        "sdpa_mathjax: typeset %d formulas on %d pages with MathJax %s in %.1f s",
        sum(len(found) for _, found in todo.values()),
        len(todo),
        reply["version"],
        time.perf_counter() - start,
    )


def _stylesheet(mathjax_css: str) -> str:
    """MathJax's own rules for its SVG output, and the book's: a display formula wider than the
    screen scrolls inside its box instead of widening the page."""
    return (
        "/* MathJax 4's stylesheet for SVG output (written by book/_ext/sdpa_mathjax.py). */\n"
        + mathjax_css
        + "\n/* The book's: a display formula too wide for a phone scrolls in its own box. */\n"
        + 'mjx-container[jax="SVG"][display="true"] {\n'
        + "  max-width: 100%;\n  overflow-x: auto;\n  overflow-y: hidden;\n}\n"
    )


def setup(app):
    app.add_html_math_renderer(
        "sdpa_svg", inline_renderers=(_visit_inline, None), block_renderers=(_visit_block, None)
    )
    app.add_css_file(CSS_NAME)
    app.connect("builder-inited", check_mathjax)
    app.connect("build-finished", typeset_site)
    return {"version": "2", "parallel_read_safe": True, "parallel_write_safe": True}
