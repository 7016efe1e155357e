"""The theme's icons without Font Awesome's script: a small stylesheet draws the few the book shows.

pydata-sphinx-theme loads ``fontawesome.js`` (1.5 MB) on every page to replace each
``<i class="fa-solid fa-bars">`` of the header and sidebars by an SVG of that icon. The book's
template (``book/_templates/layout.html``) drops that script (with the Jinja filter
``sdpa_without_fontawesome`` registered here), and once the html build has finished this
extension collects the icons the written pages name, takes each one's outline from the theme's
own copy of Font Awesome (so the shapes are the theme's), and writes ``_static/sdpa-icons.css``:
one rule per icon drawing it as a CSS mask filled with the text colour (so it follows the light
and dark themes), sized as Font Awesome's own SVGs are (1.25 em wide, 1 em high). An icon that
the theme's Font Awesome does not have fails the build.
"""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import quote

from markupsafe import Markup
from sphinx.errors import ExtensionError
from sphinx.util import logging

logger = logging.getLogger(__name__)

CSS_NAME = "sdpa-icons.css"
# Font Awesome's style classes: the long and short names of its three free sets.
STYLES = {"fa-solid": "fas", "fas": "fas", "fa-regular": "far", "far": "far",
          "fa-brands": "fab", "fab": "fab"}  # fmt: skip
# Classes of Font Awesome that are not icons (sizes, fixed width, animations).
NOT_ICONS = {"fa-lg", "fa-fw", "fa-xs", "fa-sm", "fa-xl", "fa-2xs", "fa-2xl", "fa-spin"}
_I_TAG = re.compile(r'<i\b[^>]*\bclass="([^"]*\bfa-[^"]*)"')
_SCRIPT = re.compile(r"\n?\s*<script[^>]*fontawesome\.js[^>]*></script>")


def without_fontawesome(markup: str) -> Markup:
    """The theme's preload markup without the ``<script>`` that loads fontawesome.js."""
    return Markup(_SCRIPT.sub("", str(markup)))


def register_filter(app) -> None:
    if app.builder.format == "html":
        app.builder.templates.environment.filters["sdpa_without_fontawesome"] = without_fontawesome


def fontawesome_js() -> Path:
    import pydata_sphinx_theme

    theme = Path(pydata_sphinx_theme.__file__).parent / "theme" / "pydata_sphinx_theme"
    return theme / "static" / "scripts" / "fontawesome.js"


def icon_sets(script: str) -> dict[str, dict[str, tuple[int, int, str]]]:
    """Font Awesome's icons by set ("fas", "far", "fab"): name -> (width, height, SVG path).

    The bundle defines each set as an object literal ``x={name:[width,height,[aliases],
    unicode,path],...}`` and registers it right after with ``f("fas",x)``.
    """
    icon = re.compile(
        r'(?:"([a-z0-9-]+)"|([a-z0-9]+)):\[(\d+),(\d+),\[([^\]]*)\],"[0-9a-f]+","([^"]+)"\]'
    )
    sets: dict[str, dict[str, tuple[int, int, str]]] = {}
    for call in re.finditer(r'\b(\w+)\("(fa[srb])",(\w+)\)', script):
        start = script.rfind(f"{call[3]}={{", 0, call.start())
        if start < 0 or call[2] in sets:
            continue
        found: dict[str, tuple[int, int, str]] = {}
        for m in icon.finditer(script, start, call.start()):
            entry = (int(m[3]), int(m[4]), m[6])
            found[m[1] or m[2]] = entry
            for alias in re.findall(r'"([a-z0-9-]+)"', m[5]):
                found.setdefault(alias, entry)
        sets[call[2]] = found
    return sets


def icons_used(pages: list[str]) -> set[tuple[str, str]]:
    """The (set, name) of every Font Awesome icon the pages' ``<i>`` elements name."""
    used = set()
    for page in pages:
        for classes in _I_TAG.findall(page):
            names = classes.split()
            style = next((STYLES[n] for n in names if n in STYLES), "fas")
            used |= {
                (style, n[3:])
                for n in names
                if n.startswith("fa-") and n not in STYLES and n not in NOT_ICONS
            }
    return used


def stylesheet(used: set[tuple[str, str]], sets: dict) -> str:
    """One mask rule per icon, and the size Font Awesome gives its SVGs."""
    missing = sorted(f"{s} {n}" for s, n in used if n not in sets.get(s, {}))
    if missing:
        raise ExtensionError(f"icons the theme's Font Awesome does not have: {missing}")
    selector = ", ".join(f"i.{name}" for name in STYLES)
    lines = [
        "/* The theme's Font Awesome icons, drawn without its script (book/_ext/sdpa_icons.py).",
        "   Icons: Font Awesome Free, CC BY 4.0, https://fontawesome.com/license/free */",
        f"{selector} {{",
        "  display: inline-block; box-sizing: content-box; width: 1.25em; height: 1em;",
        "  vertical-align: -0.125em; background-color: currentColor;",
        "  -webkit-mask: var(--sdpa-icon) center / contain no-repeat;",
        "  mask: var(--sdpa-icon) center / contain no-repeat;",
        "}",
        "i.fa-lg { font-size: 1.25em; line-height: 0.05em; vertical-align: -0.2em; }",
    ]
    for style, name in sorted(used):
        width, height, path = sets[style][name]
        svg = f"<svg xmlns='http://www.w3.org/2000/svg' viewBox='0 0 {width} {height}'>"
        svg += f"<path d='{path}'/></svg>"
        prefix = {"fas": "fa-solid", "far": "fa-regular", "fab": "fa-brands"}[style]
        lines.append(
            f'i.{prefix}.fa-{name}, i.{style}.fa-{name} {{ --sdpa-icon: url("data:image/svg+xml,'
            f'{quote(svg, safe=" =/:,.-")}"); }}'
        )
    return "\n".join(lines) + "\n"


def write_icons(app, exception) -> None:
    if exception or app.builder.format != "html":
        return
    outdir = Path(app.outdir)
    pages = [
        p.read_text(encoding="utf-8")
        for p in outdir.rglob("*.html")
        if "_static" not in p.relative_to(outdir).parts
    ]
    used = icons_used(pages)
    css = stylesheet(used, icon_sets(fontawesome_js().read_text(encoding="utf-8")))
    target = outdir / "_static" / CSS_NAME
    if not target.exists() or target.read_text(encoding="utf-8") != css:
        target.write_text(css, encoding="utf-8")
        logger.info("sdpa_icons: %d icons in %s", len(used), CSS_NAME)


def setup(app):
    app.add_css_file(CSS_NAME)
    app.connect("builder-inited", register_filter)
    app.connect("build-finished", write_icons)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
