"""Each executed page offered as a notebook a reader can run, beside its MyST source.

MyST-NB writes each executed page as a notebook (``<builddir>/jupyter_execute/<page>.ipynb``),
but that one is the build's: its Markdown is MyST (``{glue:text}``, ``{ref}``, ``{cite:p}``,
directives), the values glued with ``display=False`` are not in it, and when the page came from
the execution cache it has no outputs at all. This extension writes the reader's notebook of
every executed page instead, into ``_sources/`` where the theme's download menu links it:

* ``markdown``: Markdown from the page's resolved doctree, the one the HTML is written from, so
  every role and directive reads as on the site (links to the site when
  ``sdpa_notebooks_baseurl`` or ``html_baseurl`` is set);
* ``cells``: code cells and outputs from the executed notebook in the execution cache, where
  every glue output is still in the cell that glued it; hidden cells kept, marked and folded;
* ``page``: the two put together in the page's order.

A page the html builder writes gets its notebook from the doctree being written; at the end of
the build, any other page whose notebook is missing, older than its execution or written by
another version of this package gets one too. ``sdpa_downloads`` adds the package and an archive
of every notebook.
"""

from __future__ import annotations

import functools
import json
import sys
from importlib import metadata
from pathlib import Path
from urllib.parse import urljoin

import nbformat
from docutils import nodes
from sphinx.util import logging

from .markdown import SCHEME, escape
from .page import EXPORT, Page, reader_notebook

logger = logging.getLogger(__name__)

RUN_PAGE = "run-it-yourself"  # the page that says how to run the notebooks


def executed_notebook_path(app, docname: str) -> Path:
    # myst-nb writes executed notebooks to <outdir>/../jupyter_execute/<docname>.ipynb.
    return Path(app.outdir).parent / "jupyter_execute" / f"{docname}.ipynb"


def reader_notebook_path(app, docname: str) -> Path:
    return Path(app.outdir) / "_sources" / f"{docname}.ipynb"


def is_notebook(app, docname: str) -> bool:
    """True when myst-nb wrote this page as a notebook since its source last changed."""
    notebook = executed_notebook_path(app, docname)
    source = Path(app.env.doc2path(docname))
    return notebook.exists() and notebook.stat().st_mtime >= source.stat().st_mtime


def executed_notebook(app, docname: str) -> nbformat.NotebookNode:
    """The page's executed notebook as the execution cache holds it: every output, glue included.

    MyST-NB's own copy has no glue outputs and, when the page came from the cache, no outputs at
    all (it writes the notebook it read, not the one it merged with the cache). Without the cache
    (another ``nb_execution_mode``) that copy is all there is.
    """
    path = executed_notebook_path(app, docname)
    notebook = nbformat.reads(path.read_text(encoding="utf-8"), as_version=4)
    if app.config.nb_execution_mode != "cache" or not app.config.nb_execution_cache_path:
        return notebook
    from jupyter_cache import get_cache

    try:
        _, merged = get_cache(app.config.nb_execution_cache_path).merge_match_into_notebook(
            notebook, cell_meta=()
        )
    except KeyError:
        return notebook
    return merged


def _stored_glue(app, docname: str) -> dict:
    path = executed_notebook_path(app, docname).with_suffix(".glue.json")
    glue = json.loads(path.read_text(encoding="utf-8")) if path.exists() else {}
    for output in glue.values():
        data = output.get("data", {})
        for mime, value in data.items():
            if isinstance(value, list):  # multi-line values may be stored as lists of lines
                data[mime] = "".join(value)
    return glue


@functools.cache
def built_with() -> str:
    """The versions the book was built with: ``Python 3.11.9, sdpa 0.1.0, NumPy 2.1.0, ...``."""
    versions = [f"Python {'.'.join(map(str, sys.version_info[:3]))}"]
    for dist, name in [("sdpa", "sdpa"), ("numpy", "NumPy"), ("matplotlib", "Matplotlib")]:
        try:
            versions.append(f"{name} {metadata.version(dist)}")
        except metadata.PackageNotFoundError:
            pass
    return ", ".join(versions)


def _header(app, title: str) -> str:
    where = "the book"
    if RUN_PAGE in app.env.titles:
        where = f'the page "{app.env.titles[RUN_PAGE].astext()}" of the book'
    return "\n".join([
        f"> This notebook is the page **{escape(title)}** of *{escape(app.config.project)}*, "
        f"with the outputs of the run that built the book ({escape(built_with())}).",
        ">",
        f"> It runs in a plain Jupyter with `sdpa`, NumPy and Matplotlib installed: {escape(where)} "
        "says how. Cells the website hides start with a comment that says so, and are folded here.",
    ])  # fmt: skip


def write_reader_notebook(app, docname: str, doctree: nodes.document | None = None) -> Path:
    """Write the page's reader's notebook into ``_sources/`` (its resolved doctree if given)."""
    baseurl = app.config.sdpa_notebooks_baseurl or app.config.html_baseurl
    page_url = (
        urljoin(baseurl.rstrip("/") + "/", app.builder.get_target_uri(docname)) if baseurl else ""
    )
    numbers = app.env.toc_fignumbers.get(docname, {}).get("figure", {})

    def link(refuri: str) -> str | None:
        return urljoin(page_url, refuri) if page_url else None

    def image_path(image: nodes.image) -> Path | None:
        uri = image.get("candidates", {}).get("*", image.get("uri", ""))
        return None if not uri or SCHEME.match(uri) else (Path(app.srcdir) / uri).resolve()

    def number(figure: nodes.figure) -> str | None:
        found = next((numbers[i] for i in figure["ids"] if i in numbers), None)
        if not app.config.numfig or found is None:
            return None
        return app.config.numfig_format["figure"] % ".".join(map(str, found))

    title = app.env.titles[docname].astext() if docname in app.env.titles else docname
    page = Page(
        docname=docname,
        doctree=doctree
        if doctree is not None
        else app.env.get_and_resolve_doctree(docname, app.builder),
        executed=executed_notebook(app, docname),
        glue=_stored_glue(app, docname),
        header=_header(app, title),
        link=link,
        image_path=image_path,
        number=number,
    )
    target = reader_notebook_path(app, docname)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(nbformat.writes(reader_notebook(page)) + "\n", encoding="utf-8")
    return target


def _is_current(app, docname: str) -> bool:
    """True when the page's reader's notebook was written by this package since its execution."""
    path = reader_notebook_path(app, docname)
    if (
        not path.exists()
        or path.stat().st_mtime < executed_notebook_path(app, docname).stat().st_mtime
    ):
        return False
    try:
        return (
            json.loads(path.read_text(encoding="utf-8"))["metadata"]["sdpa_book"]["export"]
            == EXPORT
        )
    except (ValueError, KeyError, TypeError):
        return False


def on_doctree_resolved(app, doctree, docname) -> None:
    """Write the reader's notebook of each page the html builder writes, from its doctree."""
    if app.builder.format == "html" and is_notebook(app, docname):
        write_reader_notebook(app, docname, doctree)


def offer_notebook(app, pagename, templatename, context, doctree) -> None:
    """Let the theme's download menu list the page's .ipynb (runs before the theme's hook)."""
    if doctree is not None and is_notebook(app, pagename):
        context["ipynb_source"] = f"{pagename}.ipynb"


def write_other_notebooks(app, exception) -> None:
    """Write the notebooks of the pages not written in this build, where missing or outdated."""
    if exception or app.builder.format != "html":
        return
    redone = 0
    for docname in sorted(app.env.found_docs):
        # Pages written in this build have theirs (on_doctree_resolved); the others keep
        # theirs unless it is missing or was written by another version of this package.
        if is_notebook(app, docname) and not _is_current(app, docname):
            write_reader_notebook(app, docname)
            redone += 1
    logger.info("sdpa_notebooks: %d reader's notebooks redone at the end of the build", redone)


def setup(app):
    app.add_config_value("sdpa_notebooks_baseurl", "", "html", types=frozenset({str}))
    app.connect("html-page-context", offer_notebook, priority=400)
    app.connect("doctree-resolved", on_doctree_resolved)
    # Before sdpa_downloads (priority 600) archives the notebooks.
    app.connect("build-finished", write_other_notebooks, priority=400)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
