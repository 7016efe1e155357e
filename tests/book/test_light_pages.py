"""The build steps that keep the book's pages light (book/_ext/sdpa_mathjax.py, sdpa_icons.py).

* Maths: the formulas Sphinx writes as TeX are found in a page (in-line, display with an equation
  number, ``$...$`` in a bibliography entry, HTML entities unescaped), typeset by MathJax under
  Node into SVG with MathML beside it, put back in place, and a TeX error is reported.
* Icons: the icons a page names are found, their outlines read from the theme's Font Awesome,
  and the template's filter drops only Font Awesome's script.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "book" / "_ext"))

import sdpa_icons  # noqa: E402
import sdpa_mathjax  # noqa: E402

PAGE = """<html><body class="x">
<p>Scores <span class="math notranslate nohighlight">\\(a &lt; b\\)</span> then
<span class="math notranslate nohighlight">\\(x^2\\)</span>.</p>
<div class="math notranslate nohighlight" id="equation-e">
<span class="eqno">(1)<a class="headerlink" href="#equation-e">#</a></span>\\[\\frac{1}{2}\\]</div>
<div class="citation" id="id1" role="doc-biblioentry">
<span class="label">Key</span><p>On $O(n^2)$ costs, \\$5 each.</p></div>
</body></html>"""


def test_formulas_are_found_in_order_and_unescaped():
    assert sdpa_mathjax.formulas(PAGE) == [
        ("a < b", False),
        ("x^2", False),
        ("\\frac{1}{2}", True),
        ("O(n^2)", False),
    ]


def test_typeset_puts_each_rendering_in_place():
    rendered = {
        ("a < b", False): "<A/>",
        ("x^2", False): "<X/>",
        ("\\frac{1}{2}", True): "<F/>",
        ("O(n^2)", False): "<O/>",
    }
    page = sdpa_mathjax.typeset(PAGE, rendered, "<defs>G</defs>")
    assert '<span class="math notranslate nohighlight"><A/></span>' in page
    assert '<span class="math notranslate nohighlight"><X/></span>' in page
    # The equation number stays, before the formula.
    assert "#</a></span><F/></div>" in page
    assert "On <O/> costs, \\$5 each." in page
    assert '<body class="x"><svg id="sdpa-maths-glyphs"' in page and "<defs>G</defs></svg>" in page
    assert "\\(" not in page and "\\[" not in page
    assert sdpa_mathjax.formulas(page) == []  # nothing left to do: a rebuild skips the page


def _node_render(pages: list) -> dict:
    if shutil.which("node") is None or not (ROOT / sdpa_mathjax.MATHJAX_DIR).is_dir():
        pytest.skip("Node or MathJax (npm ci) is not installed")
    request = {
        "mathjax": str(ROOT / sdpa_mathjax.MATHJAX_DIR),
        "font": str(ROOT / sdpa_mathjax.MATHJAX_FONT_DIR),
        "width": 640,
        "ex": 9,
        "pages": pages,
    }
    result = subprocess.run(
        ["node", str(sdpa_mathjax.RENDERER)],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(result.stdout)


def test_mathjax_under_node_writes_svg_with_mathml():
    reply = _node_render([[["x^2", False], ["\\frac{a}{b}", True]], [["y", False]]])
    assert reply["version"].startswith("4.")
    first, second = reply["pages"]
    inline, display = first["html"]
    assert inline.startswith('<mjx-container jax="SVG"><svg ')
    assert 'aria-hidden="true"' in inline  # the drawing is hidden, the MathML is read
    assert "<msup><mi>x</mi><mn>2</mn></msup>" in inline  # the MathML a screen reader reads
    assert 'display="true"' in display and "<mfrac><mi>a</mi><mi>b</mi></mfrac>" in display
    # The glyphs are per page: x, 2, a and b on the first, only y on the second.
    assert first["glyphs"].count("<path") == 4, first["glyphs"]
    assert second["glyphs"].count("<path") == 1
    for use in ('href="#MJX-NCM-I-1D465"', 'href="#MJX-NCM-I-1D44E"'):  # italic x, italic a
        assert use in "".join(first["html"]) and use.split('"')[1][1:] in first["glyphs"]
    assert "data-latex" not in inline  # the explorer's attributes are dropped
    assert first["errors"] == [] and "mjx-assistive-mml" in reply["css"]


def test_mathjax_reports_tex_errors():
    reply = _node_render([[["\\frac{1}", False], ["\\nosuchcommand", False]]])
    errors = reply["pages"][0]["errors"]
    assert len(errors) == 2 and "nosuchcommand" in errors[1]


def test_icons_used_reads_style_and_name():
    html = (
        '<i class="fa-solid fa-bars"></i><i class="fab fa-github fa-lg"></i>'
        '<i class="fa-regular fa-file fa-fw"></i><span class="fas fa-list"></span><i class="x"></i>'
        '<span class="sdpa-fa-x">text</span>'
    )
    assert sdpa_icons.icons_used([html]) == {
        ("fas", "bars"),
        ("fab", "github"),
        ("far", "file"),
        ("fas", "list"),
    }


@pytest.fixture(scope="module")
def fontawesome() -> str:
    return sdpa_icons.fontawesome_js().read_text(encoding="utf-8")


def test_icon_outlines_come_from_the_themes_font_awesome(fontawesome):
    sets = sdpa_icons.icon_sets(fontawesome)
    # Font Awesome draws its icons 512 units high; bars is 448 wide, github 512 (its docs).
    assert sets["fas"]["bars"][:2] == (448, 512)
    assert sets["fab"]["github"][:2] == (512, 512)
    assert sets["fas"]["bars"][2].startswith("M")
    assert sets["far"]["file"][2] != sets["fas"]["file"][2]  # outlined and solid differ


def test_icons_become_the_svg_fontawesome_js_made(fontawesome):
    sets = sdpa_icons.icon_sets(fontawesome)
    page = (
        '<button><span class="fa-solid fa-bars"></span></button>'
        '<i class="theme-switch fa-solid fa-sun fa-lg fa-fw" data-mode="light" title="Light"></i>'
    )
    done = sdpa_icons.inline_icons(page, sets)
    assert "<i " not in done
    bars, sun = done.split("</svg>")[:2]
    # As fontawesome.js writes them (seen in the theme's pages before this change).
    assert bars.startswith(
        '<button><svg class="svg-inline--fa fa-bars" data-prefix="fas" data-icon="bars" '
        'role="img" viewBox="0 0 448 512" aria-hidden="true"><path fill="currentColor" d="M0 96'
    )
    assert sun.startswith(
        '</button><svg class="svg-inline--fa fa-sun fa-lg fa-fw theme-switch" data-mode="light" '
        'title="Light" data-prefix="fas" data-icon="sun" role="img" viewBox="0 0 576 512">'
    )  # a titled icon is not hidden from screen readers
    with pytest.raises(Exception, match="no-such-icon"):
        sdpa_icons.inline_icons('<i class="fa-solid fa-no-such-icon"></i>', sets)


def test_font_awesome_style_sheet_is_the_scripts(fontawesome):
    css = sdpa_icons.fontawesome_css(fontawesome)
    assert css.startswith(":root, :host {")
    assert ".svg-inline--fa {" in css and "height: 1em;" in css and "\n" not in css[:-1]


def test_template_filter_drops_only_font_awesome():
    markup = (
        '<script defer src="_static/scripts/fontawesome.js?digest=1"></script>\n'
        '<link rel="preload" as="script" href="_static/scripts/bootstrap.js?digest=1" />'
    )
    kept = sdpa_icons.without_fontawesome(markup)
    assert "fontawesome" not in kept and "bootstrap.js" in kept


def test_theme_css_keeps_the_rules_of_icons_in_use():
    css = (
        '.a{color:red}.fa-bars,.fa-navicon{--fa:"\\f0c9"}.fa-sun{--fa:"\\f185"}'
        '.fa-xmark{--fa:"\\f00d"}.b .fa-sun{width:1em}'
    )
    trimmed = sdpa_icons.trim_theme_css(css, {"bars", "xmark"})
    assert trimmed == '.a{color:red}.fa-bars,.fa-navicon{--fa:"\\f0c9"}.fa-xmark{--fa:"\\f00d"}' + (
        ".b .fa-sun{width:1em}"
    )
