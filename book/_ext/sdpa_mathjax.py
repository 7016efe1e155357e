"""Maths offline: MathJax 4 and its font copied from the npm packages into the site.

MathJax and its New Computer Modern font come from the npm packages pinned in ``package.json``
(``make html`` runs ``npm ci`` into ``node_modules/``). An html build checks that they are there,
and once it has finished copies the few folders the site needs (about 10 MB of the 70 MB the
packages hold) into ``_static/mathjax``, unless the same versions are there already. The
configuration's ``mathjax_path`` and ``book/_static/mathjax-config.js`` point MathJax at them, so
no page loads anything from another host. Formulas in headings appear in the navigation of every
page, so every page loads MathJax.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from sphinx.errors import ConfigError

# Relative to the configuration directory.
MATHJAX_DIR = Path("node_modules") / "mathjax"
MATHJAX_FONT_DIR = Path("node_modules") / "@mathjax" / "mathjax-newcm-font"
# What the site needs from the npm packages, relative to each package.
MATHJAX_PARTS = ["tex-chtml.js", "input", "a11y", "ui", "sre", "LICENSE"]
MATHJAX_FONT_PARTS = ["chtml", "LICENSE"]


def check_mathjax(app) -> None:
    """Stop an html build early, with the command to run, when MathJax is not installed."""
    if app.builder.format != "html":
        return
    root = Path(app.confdir)
    required = (root / MATHJAX_DIR / "tex-chtml.js", root / MATHJAX_FONT_DIR / "chtml")
    missing = [p for p in required if not p.exists()]
    if missing:
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
    mathjax, font = Path(app.confdir) / MATHJAX_DIR, Path(app.confdir) / MATHJAX_FONT_DIR
    dest = Path(app.outdir) / "_static" / "mathjax"
    stamp = dest / ".installed"
    versions = "\n".join((d / "package.json").read_text(encoding="utf-8") for d in (mathjax, font))
    if stamp.exists() and stamp.read_text(encoding="utf-8") == versions:
        return
    shutil.rmtree(dest, ignore_errors=True)
    _copy_tree_parts(mathjax, dest, MATHJAX_PARTS)
    # MathJax looks for fonts in [mathjax]/fonts/<font>-font (see mathjax-config.js).
    _copy_tree_parts(font, dest / "fonts" / "mathjax-newcm-font", MATHJAX_FONT_PARTS)
    stamp.write_text(versions, encoding="utf-8")


def setup(app):
    app.connect("builder-inited", check_mathjax)
    app.connect("build-finished", copy_mathjax)
    app.set_html_assets_policy("always")  # MathJax on every page, for the formulas in headings
    return {"version": "1", "parallel_read_safe": True, "parallel_write_safe": True}
