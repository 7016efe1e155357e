"""Interactive figures offline: BokehJS served from the site, loaded by the pages that use it.

A page shows a widget of ``sdpa_book.widgets`` as HTML output (a ``div.sdpa-widget`` holding its
Bokeh document and data). This extension copies ``bokeh.min.js`` from the installed ``bokeh``
package into ``_static/bokeh/`` once the build has finished (unless that version is there
already), and adds ``sdpa-widgets.js`` and ``sdpa-widgets.css`` to each page whose body holds a
widget; the script fetches BokehJS when a widget comes near the screen (1.27 MB a reader who
never scrolls to the figure does not download). The script's file name carries Bokeh's version, which must match the Python
package's that wrote the documents; a browser caches it once for every page. No page loads
anything from another host.
"""

from __future__ import annotations

import shutil
from pathlib import Path

MARKER = 'class="sdpa-widget"'


def bokeh_js() -> tuple[Path, str]:
    """The installed BokehJS and the name the site serves it under (with the version)."""
    import bokeh

    path = Path(bokeh.__file__).parent / "server" / "static" / "js" / "bokeh.min.js"
    return path, f"bokeh/bokeh-{bokeh.__version__}.min.js"


def add_widget_files(app, pagename, templatename, context, doctree) -> None:
    """Load BokehJS and the widgets' script and style on the pages that show a widget."""
    if MARKER not in context.get("body", ""):
        return
    _, name = bokeh_js()
    # BokehJS is not loaded with the page: sdpa-widgets.js fetches it (named here, relative to
    # _static) when a widget comes near the screen.
    app.add_js_file("sdpa-widgets.js", priority=601, defer="defer", **{"data-bokeh": name})
    app.add_css_file("sdpa-widgets.css")


def copy_bokeh(app, exception) -> None:
    if exception or app.builder.format != "html":
        return
    source, name = bokeh_js()
    target = Path(app.outdir) / "_static" / name
    if target.exists() and target.stat().st_size == source.stat().st_size:
        return
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(source, target)
    license_file = source.parents[3] / "LICENSE.txt"
    if license_file.exists():
        shutil.copy2(license_file, target.parent / "LICENSE.txt")


def setup(app):
    app.connect("html-page-context", add_widget_files)
    app.connect("build-finished", copy_bokeh)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
