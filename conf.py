"""Sphinx configuration for the sdpa book. Sources live in book/; build with `make html`.

Three things here go beyond a stock configuration:

* **Maths offline.** MathJax 4 and its New Computer Modern font come from the npm packages
  pinned in ``package.json`` (``make html`` runs ``npm ci``); :func:`copy_mathjax` copies the
  few folders the site needs into ``_static/mathjax`` and ``book/_static/mathjax-config.js``
  points MathJax at them. No page loads anything from another host.
* **No stale outputs.** jupyter-cache keys a page on its own code cells only. The cache
  folder and a config value are therefore keyed on a fingerprint of ``src/sdpa`` (and of the
  Python, NumPy and Matplotlib versions): when the package changes, Sphinx sees a changed
  configuration, re-reads every page, and myst-nb finds an empty cache, so every page executes
  against the new code. Reverting the package finds the older cache again.
* **Notebooks a reader can run, and the package.** ``book/_ext/sdpa_notebooks.py`` writes each
  executed page as a notebook for a plain Jupyter (glued values and figures in place, MyST
  turned into Markdown, hidden cells kept and marked) beside its MyST source in ``_sources/``,
  where the theme's download menu offers both; it copies the ``sdpa`` wheel and source archive
  that ``make html`` builds into ``downloads/``, with a pinned ``requirements.txt`` and one
  archive of every notebook.
"""

from __future__ import annotations

import glob
import hashlib
import math
import os
import re
import shutil
import sys
from importlib import metadata
from pathlib import Path

from docutils import nodes

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "book" / "_ext"))  # the book's own extension: sdpa_notebooks

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
    "sdpa_notebooks",  # book/_ext: the reader's notebooks and the package in the site
]

# One .bib file per topic so that chapters can add references independently.
bibtex_bibfiles = sorted(
    Path(p).relative_to(ROOT).as_posix()
    for p in glob.glob(str(ROOT / "book" / "references" / "*.bib"))
)
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

# API reference
autosummary_generate = False
numpydoc_show_class_members = False
numpydoc_validation_checks = set()
autodoc_typehints = "none"
autodoc_member_order = "bysource"

# Maths: MathJax 4 served from this site (see copy_mathjax below and the module docstring).
# The configuration is a static file (not mathjax_config_path, which Sphinx inlines only into
# pages it rewrites), loaded after the extensions' inline settings, before the deferred MathJax.
mathjax_path = "mathjax/tex-chtml.js"

html_theme = "sphinx_book_theme"
html_title = BOOK_TITLE  # the sidebar and the browser tab show the book's own title
html_favicon = "book/_static/favicon.svg"  # also spares the browser a request for /favicon.ico
html_static_path = ["book/_static"]
html_css_files = ["sdpa.css"]
html_js_files = [("mathjax-config.js", {"priority": 510}), "search-snippets.js"]
# The pydata/book themes log a console error on a first visit without a stored mode.
html_context = {"default_mode": "auto"}
html_theme_options = {
    "show_toc_level": 2,
    "use_download_button": True,
}
html_last_updated_fmt = None
html_copy_source = True

nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(np|numpy)\..*"),
    (r"py:class", r"(array_like|ArrayLike|optional|default.*|.*\bof\b.*|callable)"),
]


# --------------------------------------------------------------------------------------------
# The execution cache follows the package.

PACKAGE_DIRS = [ROOT / "src" / "sdpa", ROOT / "src" / "sdpa_book"]
MATHJAX_DIR = ROOT / "node_modules" / "mathjax"
MATHJAX_FONT_DIR = ROOT / "node_modules" / "@mathjax" / "mathjax-newcm-font"
# What the site needs from the npm packages, relative to each package (about 10 MB).
MATHJAX_PARTS = ["tex-chtml.js", "input", "a11y", "ui", "sre", "LICENSE"]
MATHJAX_FONT_PARTS = ["chtml", "LICENSE"]
KEEP_OLD_CACHES = 2  # besides the current one, so that switching back and forth stays cheap


def package_fingerprint(package_dirs: list[Path] = PACKAGE_DIRS) -> str:
    """Hash of everything the executed pages depend on besides their own code."""
    digest = hashlib.sha256()
    for package_dir in package_dirs:
        for path in sorted(package_dir.rglob("*.py")):
            digest.update(path.relative_to(package_dir.parent).as_posix().encode() + b"\0")
            digest.update(path.read_bytes() + b"\0")
    versions = [f"python {sys.version_info[0]}.{sys.version_info[1]}"]
    for dist in ("numpy", "matplotlib"):
        try:
            versions.append(f"{dist} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            versions.append(f"{dist} missing")
    digest.update("\n".join(versions).encode())
    return digest.hexdigest()[:16]


# The pages' kernels inherit this: sdpa_book.glue stores values for MyST-NB only in the build.
os.environ["SDPA_BOOK_BUILD"] = "1"

# A changed value marks the configuration as changed, so Sphinx re-reads (and myst-nb
# re-executes) every page. It is recomputed each time Sphinx loads this file.
sdpa_package_fingerprint = package_fingerprint()


def key_execution_cache(app, config) -> None:
    """Put the jupyter cache in <doctrees>/jupyter-cache/<fingerprint>; prune old ones."""
    if config.nb_execution_cache_path:  # set explicitly (-D or conf): leave it alone
        return
    root = Path(app.doctreedir) / "jupyter-cache"
    current = root / f"sdpa-{config.sdpa_package_fingerprint}"
    config.nb_execution_cache_path = str(current)
    if root.is_dir():
        old = sorted(
            (p for p in root.iterdir() if p.is_dir() and p != current),
            key=lambda p: p.stat().st_mtime,
            reverse=True,
        )
        for stale in old[KEEP_OLD_CACHES:]:
            shutil.rmtree(stale, ignore_errors=True)
    current.mkdir(parents=True, exist_ok=True)
    os.utime(current)


# --------------------------------------------------------------------------------------------
# MathJax from the npm packages, copied into the site.


def check_mathjax(app) -> None:
    if app.builder.format != "html":
        return
    missing = [
        p for p in (MATHJAX_DIR / "tex-chtml.js", MATHJAX_FONT_DIR / "chtml") if not p.exists()
    ]
    if missing:
        from sphinx.errors import ConfigError

        raise ConfigError(
            "MathJax is not installed: missing "
            + ", ".join(str(p) for p in missing)
            + ". Run `make node_modules` (or `npm ci`) in the project folder first."
        )


def _copy_tree_parts(src: Path, dest: Path, parts: list[str]) -> None:
    for part in parts:
        source = src / part
        target = dest / part
        if source.is_dir():
            shutil.copytree(source, target, dirs_exist_ok=True)
        elif source.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, target)


def copy_mathjax(app, exception) -> None:
    """Copy MathJax and its font into _static/mathjax unless the same versions are there."""
    if exception or app.builder.format != "html":
        return
    dest = Path(app.outdir) / "_static" / "mathjax"
    stamp = dest / ".installed"
    versions = "\n".join(
        (d / "package.json").read_text(encoding="utf-8") for d in (MATHJAX_DIR, MATHJAX_FONT_DIR)
    )
    if stamp.exists() and stamp.read_text(encoding="utf-8") == versions:
        return
    shutil.rmtree(dest, ignore_errors=True)
    _copy_tree_parts(MATHJAX_DIR, dest, MATHJAX_PARTS)
    # MathJax looks for fonts in [mathjax]/fonts/<font>-font (see mathjax-config.js).
    _copy_tree_parts(MATHJAX_FONT_DIR, dest / "fonts" / "mathjax-newcm-font", MATHJAX_FONT_PARTS)
    stamp.write_text(versions, encoding="utf-8")


# --------------------------------------------------------------------------------------------
# --------------------------------------------------------------------------------------------
# Reading times on the landing page, computed from the pages themselves.

WORDS_PER_MINUTE = 200  # prose; code a reader reads counts at half speed
READING_TIME = re.compile(r"\[\[minutes:([\w/.-]+)\]\]")


def reading_minutes(text: str) -> int:
    """Minutes to read a MyST page: its prose and visible code, hidden cells and markup excluded."""
    words = 0.0
    cells = re.compile(r"^```\{code-cell\}[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
    for match in cells.finditer(text):
        body = match.group(1)
        if re.search(r"^:tags:.*\b(remove-cell|remove-input|hide-cell|hide-input)\b", body, re.M):
            continue
        code = [line for line in body.splitlines() if line.strip() and not line.startswith(":")]
        words += 0.5 * sum(len(line.split()) for line in code)
    prose = cells.sub("", text)
    prose = re.sub(r"\A---\n.*?\n---\n", "", prose, flags=re.S)  # front matter
    prose = re.sub(r"^(:{3,}|`{3,}).*$|^:\w[\w-]*:.*$|^%.*$|^\(.*\)=$", "", prose, flags=re.M)
    prose = re.sub(r"\{[\w:-]+\}`([^`<]*)(<[^>]*>)?`", r"\1", prose)  # roles: keep their text
    words += len(re.findall(r"[A-Za-z0-9]+(?:[-'][A-Za-z0-9]+)*", prose))
    return max(1, math.ceil(words / WORDS_PER_MINUTE))


def write_reading_times(app, docname, source) -> None:
    """Replace ``[[minutes:docname]]`` by the reading time of that page, e.g. ``8 min``."""

    def minutes(match) -> str:
        path = Path(app.srcdir) / f"{match.group(1)}.md"
        return f"{reading_minutes(path.read_text(encoding='utf-8'))} min"

    if "[[minutes:" in source[0]:
        source[0] = READING_TIME.sub(minutes, source[0])


def landing_page_is_always_outdated(app, env, added, changed, removed) -> list[str]:
    """The landing page shows every page's reading time: re-read it whenever a page changed."""
    return ["index"] if (added or changed or removed) and "index" not in changed else []


# --------------------------------------------------------------------------------------------
# The API reference lists whatever sdpa.__all__ holds when the book is built.

API_MARKER = "% sdpa-api-members"


def api_reference_markdown() -> str:
    """MyST for a summary table and one autodoc entry per name in ``sdpa.__all__``."""
    import inspect

    import sdpa

    names = list(sdpa.__all__)
    # autodoc writes reStructuredText, so every directive sits in an eval-rst block.
    lines = ["```{eval-rst}", ".. autosummary::", ""]
    lines += [f"   {name}" for name in names]
    lines += ["```", ""]
    for name in names:
        obj = getattr(sdpa, name)
        lines += ["```{eval-rst}"]
        if inspect.isclass(obj):
            lines += [
                f".. autoclass:: sdpa.{name}",
                "   :members:",
                "   :special-members: __call__",
            ]
        else:
            lines += [f".. autofunction:: sdpa.{name}"]
        lines += ["```", ""]
    return "\n".join(lines)


def write_api_reference(app, docname, source) -> None:
    if API_MARKER in source[0]:
        source[0] = source[0].replace(API_MARKER, api_reference_markdown())


def break_autosummary_signatures(app, doctree, docname) -> None:
    """Let the API summary's signatures wrap between arguments, not inside a name.

    Autosummary's HTML visitor turns every space of the first column's text into a no-break
    space, so a signature becomes one long word that a narrow column can only split
    mid-identifier ("h / ead_dim"). It rewrites only the paragraph's own text nodes: wrapped in
    an inline node, the text keeps its spaces.
    """
    for table in doctree.findall(nodes.table):
        # autosummary writes its classes as one string: "autosummary longtable"
        if "autosummary" not in " ".join(table.get("classes", [])).split():
            continue
        for paragraph in table.findall(nodes.paragraph):
            for i, child in enumerate(list(paragraph.children)):
                if isinstance(child, nodes.Text) and " " in child:
                    paragraph[i] = nodes.inline("", "", nodes.Text(str(child)))


def setup(app):
    app.connect("source-read", write_api_reference)
    app.connect("source-read", write_reading_times)
    app.connect("env-get-outdated", landing_page_is_always_outdated)
    app.add_config_value("sdpa_package_fingerprint", "", "env", types=frozenset({str}))
    # Before myst-nb reads nb_execution_cache_path in builder-inited.
    app.connect("config-inited", key_execution_cache)
    app.connect("builder-inited", check_mathjax)
    app.connect("build-finished", copy_mathjax)
    app.connect("doctree-resolved", break_autosummary_signatures)
    # Formulas in headings appear in the navigation of every page, so load MathJax everywhere.
    app.set_html_assets_policy("always")
    return {"parallel_read_safe": True, "parallel_write_safe": True}
