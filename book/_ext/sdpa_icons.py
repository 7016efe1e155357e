"""The theme's icons without Font Awesome's script: each drawn as the inline SVG that script made.

pydata-sphinx-theme loads ``fontawesome.js`` (1.5 MB) on every page to replace each
``<i class="fa-solid fa-bars">`` of the header and sidebars by an ``<svg>`` of that icon, and to
add its own style sheet. The book's template (``book/_templates/layout.html``) drops that script
(with the Jinja filter ``sdpa_without_fontawesome`` registered here). Once the html build has
written its pages, this extension does the script's work in advance: it replaces each such ``<i>``
(or ``<span>``) by the same ``<svg>`` (same classes, outline taken from the theme's own copy of
Font Awesome) and writes Font Awesome's style sheet, taken from the same file, to
``_static/sdpa-icons.css``. The pages look as they did, with a few kB of icons instead of the
script. An icon the theme's Font Awesome lacks fails the build. The theme's style sheet, which
bundles Font Awesome's web-font rules, loses those of the icons no page shows
(``trim_theme_css``); an icon the theme's script adds later (``SCRIPT_ICONS``) keeps its rule and
shows in the web font.
"""

from __future__ import annotations

import re
from pathlib import Path

from markupsafe import Markup
from sphinx.errors import ExtensionError
from sphinx.util import logging

logger = logging.getLogger(__name__)

CSS_NAME = "sdpa-icons.css"
# Font Awesome's style classes (long and short names of its three free sets) and the set each
# names; an icon with none is solid, as in Font Awesome.
STYLES = {"fa-solid": "fas", "fas": "fas", "fa-regular": "far", "far": "far",
          "fa-brands": "fab", "fab": "fab"}  # fmt: skip
# Classes of Font Awesome that are not icons (sizes, fixed width, animations).
NOT_ICONS = {"fa-lg", "fa-fw", "fa-xs", "fa-sm", "fa-xl", "fa-2xs", "fa-2xl", "fa-spin"}
# An empty <i> or <span> with a class "fa-...": the elements fontawesome.js replaces.
_I_ELEMENT = re.compile(r'<(i|span)\b([^>]*?)\bclass="((?:[^"]* )?fa-[^"]*)"([^>]*)>\s*</\1>')
_ICON_RULE = re.compile(r'(?<=\})((?:\.fa-[a-z0-9-]+,?)+)\{--fa:"[^"]*"\}')
# The theme's style sheet, and the icons its script adds to a page (the search dialog's close).
THEME_CSS = Path("_static") / "styles" / "pydata-sphinx-theme.css"
SCRIPT_ICONS = {"xmark"}
_SCRIPT = re.compile(r"\n?\s*<script[^>]*fontawesome\.js[^>]*></script>")
# The style sheet fontawesome.js adds to a page: a string in the script, ":root, :host {...".
_CSS = re.compile(r'="(:root, :host \{(?:[^"\\]|\\.)*)"')


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


def _icon(classes: str) -> tuple[str, str, list[str]]:
    """(set, icon name, other classes) of an ``<i>``'s classes."""
    names = classes.split()
    style = next((STYLES[n] for n in names if n in STYLES), "fas")
    icons = [n for n in names if n.startswith("fa-") and n not in STYLES and n not in NOT_ICONS]
    if len(icons) != 1:
        raise ExtensionError(f"expected one Font Awesome icon in class={classes!r}")
    others = [n for n in names if n not in STYLES and n != icons[0]]
    # fontawesome.js puts its own classes first, then the size classes, then the page's own.
    others.sort(key=lambda n: 0 if n in NOT_ICONS else 1)
    return style, icons[0][3:], others


def icons_used(pages: list[str]) -> set[tuple[str, str]]:
    """The (set, name) of every Font Awesome icon the pages' ``<i>`` and ``<span>`` name."""
    return {_icon(m[3])[:2] for page in pages for m in _I_ELEMENT.finditer(page)}


def inline_icons(page: str, sets: dict) -> str:
    """The page with each Font Awesome ``<i>`` replaced by the SVG fontawesome.js made of it."""

    def svg(m: re.Match) -> str:
        style, name, others = _icon(m[3])
        if name not in sets.get(style, {}):
            raise ExtensionError(f"the theme's Font Awesome has no icon {style} {name}")
        width, height, path = sets[style][name]
        attributes = (m[2] + m[4]).strip()
        classes = " ".join(["svg-inline--fa", f"fa-{name}", *others])
        # Decorative unless titled, as fontawesome.js has it.
        hidden = "" if "title=" in attributes else ' aria-hidden="true"'
        return (
            f'<svg class="{classes}"{" " + attributes if attributes else ""} data-prefix="{style}"'
            f' data-icon="{name}" role="img" viewBox="0 0 {width} {height}"{hidden}>'
            f'<path fill="currentColor" d="{path}"></path></svg>'
        )

    return _I_ELEMENT.sub(svg, page)


def fontawesome_css(script: str) -> str:
    """The style sheet fontawesome.js adds to each page, whitespace collapsed."""
    import json

    found = _CSS.search(script)
    if not found:
        raise ExtensionError("Font Awesome's style sheet not found in the theme's fontawesome.js")
    css = json.loads(f'"{found[1]}"')
    return re.sub(r"\s+", " ", css).strip() + "\n"


def trim_theme_css(css: str, keep: set[str]) -> str:
    """The theme's style sheet without Font Awesome's rules for icons no page names.

    Font Awesome's web-font style sheet, bundled in the theme's, gives each of its ~2,000 icon
    classes a rule ``.fa-name{--fa:"\\f0c9"}`` (66 kB): only an ``<i class="fa-name">`` the
    pages hold, or one a script adds (``keep``), needs its rule.
    """

    def rule(m: re.Match) -> str:
        names = re.findall(r"\.fa-([a-z0-9-]+)", m[1])
        return m[0] if keep.intersection(names) else ""

    return _ICON_RULE.sub(rule, css)


def write_icons(app, exception) -> None:
    """Put the icons in the pages this build wrote, and Font Awesome's style sheet in _static."""
    if exception or app.builder.format != "html":
        return
    outdir = Path(app.outdir)
    script = fontawesome_js().read_text(encoding="utf-8")
    sets = icon_sets(script)
    changed = 0
    used: set[str] = set(SCRIPT_ICONS)
    for path in outdir.rglob("*.html"):
        if "_static" in path.relative_to(outdir).parts:
            continue
        page = path.read_text(encoding="utf-8")
        used |= {name for _, name in icons_used([page])}
        done = inline_icons(page, sets)
        if done != page:
            path.write_text(done, encoding="utf-8")
            changed += 1
    css = "/* Font Awesome Free's style sheet, from the theme's fontawesome.js (sdpa_icons). */\n"
    css += fontawesome_css(script)
    target = outdir / "_static" / CSS_NAME
    if not target.exists() or target.read_text(encoding="utf-8") != css:
        target.write_text(css, encoding="utf-8")
    # Sphinx copies the theme's file afresh on every build; a trimmed one shows no .fa-bars rule.
    theme_css = outdir / THEME_CSS
    text = theme_css.read_text(encoding="utf-8")
    trimmed = trim_theme_css(text, used)
    if trimmed != text:
        theme_css.write_text(trimmed, encoding="utf-8")
    if changed:
        logger.info("sdpa_icons: icons drawn as inline SVG on %d pages", changed)


def setup(app):
    app.add_css_file(CSS_NAME)
    app.connect("builder-inited", register_filter)
    app.connect("build-finished", write_icons)
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
