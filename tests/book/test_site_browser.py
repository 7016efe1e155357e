"""Open every page of the built book in headless Chromium, as a reader on a desktop and on a phone.

Each page is opened twice: on a **desktop** (1280 x 900, light colours, over http from 127.0.0.1)
and on a **phone** (390 x 844, dark colours, from file://). For each visit the test asserts what a
reader with no network needs: no console error, no failed request and no request to any host but
127.0.0.1; every formula typeset when the book was built (an SVG whose glyphs all resolve, beside
MathML for screen readers; no raw TeX left in the text, no MathJax error, no MathJax script); every
image loaded and described by alt text; and, over http, working links to the page's downloadable
sources (.md, and .ipynb for executed pages). It also asserts that nothing is clipped: on the
desktop no table, formula or figure is wider than the content column and no figure is shrunk below
3/4 of its size (so its 9-point text stays at least 9 px); on the phone the page never scrolls
sideways, and a table too wide for the screen scrolls inside a container that shows a cue; in
both, exactly one search box or button is in view. A screenshot of each visit is saved in
``_build/screenshots/<mode>/``: the first screen, or the whole page with
``SDPA_FULL_SCREENSHOTS=1`` (for a review by eye; a long page takes seconds to capture).

The pages are visited once per mode by a module fixture (a few at a time, to keep the run short);
each page then has its own test that reports what was found there.

Build the site first (``make html``; ``make test`` does). Without a built site or Chromium the
tests skip, except under ``SDPA_REQUIRE_REFERENCES=1`` (CI), where they fail.
"""

from __future__ import annotations

import asyncio
import os
import re
from pathlib import Path
from urllib.parse import urljoin, urlsplit

import pytest
from site_server import serve

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[2]
SITE = Path(os.environ.get("SDPA_SITE_DIR", ROOT / "_build" / "html"))
SCREENSHOTS = SITE.parent / "screenshots"  # _build/screenshots for the default site
CHROMIUM = os.environ.get("SDPA_CHROMIUM", "/usr/bin/chromium")
REQUIRE = os.environ.get("SDPA_REQUIRE_REFERENCES") == "1"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    # Belt and braces: a request to another host is reported below, and cannot leave the machine.
    "--host-resolver-rules=MAP * ~NOTFOUND , EXCLUDE 127.0.0.1",
]
CONCURRENCY = 2  # pages open at once: overlaps waiting without crowding 2 cores
FULL_SCREENSHOTS = os.environ.get("SDPA_FULL_SCREENSHOTS") == "1"
TIMEOUT_MS = 180_000  # generous: a busy shared machine can be 10 times slower than an idle one

# Raw TeX that MathJax would have replaced: delimiters, commands, and $...$ spans with maths in them.
RAW_TEX = re.compile(
    r"\\\(|\\\)|\\\[|\\\]|\$\$|\\begin\{|\\frac|\\sqrt|\\operatorname"
    r"|\$[^$\s][^$\n]{0,80}[\\^_{}][^$\n]{0,80}\$"
)


def _pages() -> list[str]:
    if not (SITE / "index.html").exists():
        return []
    skip = {"_static", "_sources", "_images", "_sphinx_design_static"}
    return sorted(
        p.relative_to(SITE).as_posix()
        for p in SITE.rglob("*.html")
        if not skip.intersection(p.relative_to(SITE).parts)
    )


PAGES = _pages()
# The pages made from book/*.md (the others are Sphinx's: search, index of names).
SOURCE_PAGES = {
    p.relative_to(ROOT / "book").with_suffix(".html").as_posix()
    for p in (ROOT / "book").rglob("*.md")
    if "_static" not in p.parts
}
# How a page is opened: transport, colour scheme and viewport.
MODES = {
    "desktop": {"transport": "http", "scheme": "light", "viewport": {"width": 1280, "height": 900}},
    "phone": {"transport": "file", "scheme": "dark", "viewport": {"width": 390, "height": 844}},
}
MIN_FIGURE_SCALE = 0.75  # 9-point figure text renders at >= 9 px (1 pt = 4/3 px at scale 1)
# Smallest figure text a reader can read, in CSS px, by mode (the book's style: 9 px on a 390 px
# phone, 10 px at 1280 px), checked on every page.
MIN_TEXT_PX = {"desktop": 10.0, "phone": 9.0}

# A matplotlib SVG draws text as glyph paths: each string is a group whose transform ends in
# scale(s -s), s = font size / 100 (matplotlib's TextToPath.FONT_SCALE), holding <use> glyphs with
# an optional scale of their own (mathtext's smaller sub- and superscripts).
_GLYPH_GROUP = re.compile(
    r'<g\b[^>]*transform="[^"]*scale\(([-\d.e]+) -[-\d.e]+\)"[^>]*>(.*?)</g>', re.S
)
_USE = re.compile(r"<use\b[^>]*>")
_USE_SCALE = re.compile(r'transform="[^"]*scale\(([-\d.e]+)\)')
# Mathtext stretches a radical or a big delimiter to a height by drawing a glyph of STIX's size
# variants at whatever font size gives that height: a shape, not text, so it is not measured.
_STRETCHED = re.compile(r'href="#STIXSize')
_VIEWBOX = re.compile(r'<svg\b[^>]*viewBox="\s*[-\d.e]+[\s,]+[-\d.e]+[\s,]+([-\d.e]+)')
FONT_SCALE = 100  # matplotlib.textpath.TextToPath.FONT_SCALE
FIGURE_TEXT: dict[str, dict[str, list]] = {mode: {} for mode in MODES}  # mode -> page -> figures


def smallest_text_px(svg: str, rendered_width: float) -> float | None:
    """The smallest glyph of a matplotlib SVG, in CSS px, when the image is ``rendered_width`` px wide.

    A glyph's size in the SVG's user units is ``FONT_SCALE * s * u`` (``s`` its group's scale,
    ``u`` its own, 1 if none); the image maps ``viewBox`` width user units onto ``rendered_width``
    CSS px. Stretched radicals and delimiters are shapes, not text, and are left out. ``None``
    if the SVG has no text drawn as glyphs.
    """
    box = _VIEWBOX.search(svg)
    sizes = []
    for group_scale, body in _GLYPH_GROUP.findall(svg):
        for use in _USE.findall(body):
            if _STRETCHED.search(use):
                continue
            own = _USE_SCALE.search(use)
            sizes.append(FONT_SCALE * abs(float(group_scale)) * (float(own[1]) if own else 1.0))
    if not box or not sizes:
        return None
    return min(sizes) * rendered_width / float(box[1])


def _figure_text(report: dict) -> list[tuple[str, float]]:
    """(figure file, smallest text in CSS px) for each SVG figure of a page with text."""
    found = []
    for fig in report["figures"]:
        name = urlsplit(fig["src"]).path.rsplit("/", 1)[-1]
        path = SITE / "_images" / name
        if not name.endswith(".svg") or not path.exists():
            continue
        px = smallest_text_px(path.read_text(encoding="utf-8"), fig["width"])
        if px is not None:
            found.append((name, round(px, 2)))
    return found


def _skip_or_fail(reason: str) -> None:
    if REQUIRE:
        pytest.fail(reason)
    pytest.skip(reason)


def _shot_path(mode: str, page: str) -> Path:
    m = MODES[mode]
    folder = f"{mode}-{m['scheme']}-{m['viewport']['width']}"
    return SCREENSHOTS / folder / (page.removesuffix(".html").replace("/", "__") + ".png")


def _allowed(url: str, mode: str) -> bool:
    parts = urlsplit(url)
    if parts.scheme in ("data", "blob", "about"):
        return True
    if MODES[mode]["transport"] == "file":
        return parts.scheme == "file"
    return parts.scheme == "http" and parts.hostname == "127.0.0.1"


# Runs in the page: wait for the images, then report what a reader would see.
INSPECT_JS = """
async () => {
  const images = Array.from(document.images);
  images.forEach((img) => { img.loading = "eager"; });
  await Promise.all(images.map((img) => img.complete ? null : new Promise((done) => {
    img.addEventListener("load", done);
    img.addEventListener("error", done);
  })));
  await document.fonts.ready;

  const article = document.querySelector("article") || document.body;
  const mathNodes = Array.from(article.querySelectorAll(".math"));
  const untypeset = mathNodes.filter((node) => !node.querySelector("mjx-container"))
      .map((node) => node.textContent.trim().slice(0, 80));
  const errors = Array.from(document.querySelectorAll("mjx-merror, [data-mjx-error]"))
      .map((node) => (node.getAttribute("data-mjx-error") || node.textContent).slice(0, 80));
  // Maths typeset at build time: each formula an SVG drawing glyphs defined on the page, and
  // MathML beside it that screen readers read.
  const containers = Array.from(document.querySelectorAll("mjx-container"));
  const notSvg = containers.filter((node) => node.getAttribute("jax") !== "SVG").length;
  const unspoken = containers.filter((node) => {
    const math = node.querySelector("mjx-assistive-mml > math");
    return !math || !math.textContent.trim();
  }).map((node) => node.outerHTML.slice(0, 80));
  const missingGlyphs = Array.from(new Set(
    Array.from(document.querySelectorAll("mjx-container use"))
      .map((use) => (use.getAttribute("href") || use.getAttribute("xlink:href") || "").slice(1))
      .filter((id) => !document.getElementById(id))));
  const mathjaxScripts = Array.from(document.scripts)
      .filter((script) => /mathjax/i.test(script.src)).map((script) => script.src);

  // The text a reader sees, without code (where $ and backslashes are legitimate) or MathJax.
  const copy = article.cloneNode(true);
  copy.querySelectorAll("pre, code, script, style, mjx-container, .highlight, textarea")
      .forEach((node) => node.remove());

  // Layout: what is wider than the content column, what scrolls, how much figures are shrunk.
  const column = article.getBoundingClientRect();
  const describe = (node) => {
    const id = node.id || (node.closest("[id]") || {}).id || "";
    return `${node.tagName.toLowerCase()}#${id}`;
  };
  const wide = [];
  const selectors = "table, mjx-container[display='true'], img, figure, div.math, .cell_output";
  article.querySelectorAll(selectors).forEach((node) => {
    const box = node.getBoundingClientRect();
    if (box.width === 0) return;
    const scroller = node.closest(".pst-scrollable-table-container, div.math, mjx-container[display='true']");
    const clipped = box.right > column.right + 1 || box.left < column.left - 1;
    const inner = node.scrollWidth > node.clientWidth + 1 && getComputedStyle(node).overflowX !== "visible";
    if (clipped || inner) {
      wide.push({what: describe(node), width: Math.round(Math.max(box.width, node.scrollWidth)),
                 column: Math.round(column.width), scrolls: !!scroller || inner,
                 cue: !!scroller && scroller.classList.contains("pst-scrollable-table-container")
                      && getComputedStyle(scroller).backgroundImage.includes("gradient")});
    }
  });
  const figures = images.filter((img) => img.closest("article") && img.naturalWidth > 0)
    .map((img) => ({src: img.currentSrc || img.src, alt: (img.getAttribute("alt") || "").trim(),
                    scale: img.clientWidth / img.naturalWidth, natural: img.naturalWidth,
                    width: img.getBoundingClientRect().width}));

  // Search boxes and buttons a reader can see (the theme can add a second one to the header).
  const searches = Array.from(document.querySelectorAll(
      ".search-button__button, input[type='search'], form.bd-search"))
    .filter((node) => {
      const box = node.getBoundingClientRect();
      return box.width > 0 && box.height > 0 && getComputedStyle(node).visibility !== "hidden";
    }).length;

  return {
    pageScroll: document.documentElement.scrollWidth - window.innerWidth,
    searches,
    wide,
    figures,
    mathNodes: mathNodes.length,
    containers: article.querySelectorAll("mjx-container").length,
    untypeset,
    errors,
    text: copy.textContent,
    notSvg,
    unspoken,
    missingGlyphs,
    mathjaxScripts,
    mathjaxInPage: !!window.MathJax,
    images: images.map((img) => ({src: img.currentSrc || img.src, ok: img.complete && img.naturalWidth > 0})),
    downloads: Array.from(document.querySelectorAll("a.dropdown-item[href*='_sources/']"))
      .map((a) => a.getAttribute("href")),
  };
}
"""


def _judge_layout(report: dict, mode: str) -> list[str]:
    """Nothing clipped: the desktop fits the column; the phone scrolls only inside containers;
    no figure text under ``MIN_TEXT_PX[mode]`` (``report["figureText"]``: the pairs of
    :func:`_figure_text`).
    """
    problems = []
    if report.get("searches", 1) != 1:
        problems.append(f"{report['searches']} search boxes or buttons in view, not one")
    small = [(n, px) for n, px in report.get("figureText", []) if px < MIN_TEXT_PX[mode]]
    if small:
        problems.append(f"figure text under {MIN_TEXT_PX[mode]:g} px: {small}")
    missing_alt = [f["src"].rsplit("/", 1)[-1] for f in report["figures"] if not f["alt"]]
    if missing_alt:
        problems.append(f"images without alt text: {missing_alt}")
    if mode == "desktop":
        if report["wide"]:
            problems.append(f"wider than the content column: {report['wide'][:5]}")
        shrunk = [
            (f["src"].rsplit("/", 1)[-1], round(f["scale"], 2))
            for f in report["figures"]
            if f["natural"] > 100 and f["scale"] < MIN_FIGURE_SCALE
        ]
        if shrunk:
            problems.append(f"figures shrunk below {MIN_FIGURE_SCALE} of their size: {shrunk}")
    else:
        if report["pageScroll"] > 1:
            problems.append(f"the page scrolls sideways by {report['pageScroll']} px")
        no_cue = [w for w in report["wide"] if w["what"].startswith("table") and not w["cue"]]
        if no_cue:
            problems.append(f"wide tables that scroll without a visible cue: {no_cue[:5]}")
        cut = [w for w in report["wide"] if not w["scrolls"]]
        if cut:
            problems.append(f"cut off with no way to see the rest: {cut[:5]}")
    return problems


def _judge(report: dict) -> list[str]:
    problems = []
    if report["mathjaxScripts"] or report["mathjaxInPage"]:
        problems.append(f"MathJax runs in the page: {report['mathjaxScripts']}")
    if report["notSvg"]:
        problems.append(f"{report['notSvg']} formulas not typeset as SVG when the book was built")
    if report["unspoken"]:
        problems.append(f"formulas without MathML for screen readers: {report['unspoken'][:3]}")
    if report["missingGlyphs"]:
        problems.append(f"formulas draw glyphs the page lacks: {report['missingGlyphs'][:5]}")
    if report["untypeset"]:
        problems.append(f"formulas left untypeset: {report['untypeset'][:5]}")
    if report["containers"] < report["mathNodes"]:
        problems.append(
            f"{report['mathNodes']} formulas but {report['containers']} MathJax containers"
        )
    if report["errors"]:
        problems.append(f"MathJax errors: {report['errors'][:5]}")
    raw = sorted(set(RAW_TEX.findall(report["text"])))
    if raw:
        problems.append(f"raw TeX in the text: {raw[:5]}")
    broken = [img["src"] for img in report["images"] if not img["ok"]]
    if broken:
        problems.append(f"images that did not load: {broken}")
    return problems


async def _visit(browser, mode: str, page_name: str, url: str) -> list[str]:
    from playwright.async_api import Error as PlaywrightError

    problems: list[str] = []
    context = await browser.new_context(
        color_scheme=MODES[mode]["scheme"],
        viewport=MODES[mode]["viewport"],
        service_workers="block",
    )
    page = await context.new_page()

    def on_request(request):
        if not _allowed(request.url, mode):
            problems.append(f"request to another host: {request.url}")

    page.on("request", on_request)
    page.on("console", lambda m: m.type == "error" and problems.append(f"console error: {m.text}"))
    page.on("pageerror", lambda e: problems.append(f"uncaught exception: {e}"))
    page.on("requestfailed", lambda r: problems.append(f"failed request: {r.url} ({r.failure})"))
    page.on("response", lambda r: r.status >= 400 and problems.append(f"HTTP {r.status}: {r.url}"))
    try:
        await page.goto(url, wait_until="load", timeout=TIMEOUT_MS)
        report = await page.evaluate(INSPECT_JS)
        problems += _judge(report)
        report["figureText"] = FIGURE_TEXT[mode][page_name] = _figure_text(report)
        if page_name in SOURCE_PAGES:
            problems += _judge_layout(report, mode)
        if MODES[mode]["transport"] == "http" and page_name in SOURCE_PAGES:
            if not report["downloads"]:
                problems.append("no download links to the page's source")
            for href in report["downloads"]:
                response = await context.request.get(urljoin(url, href))
                if response.status != 200 or not await response.body():
                    problems.append(f"download link {href} gives HTTP {response.status}")
        await page.screenshot(
            path=str(_shot_path(mode, page_name)), full_page=FULL_SCREENSHOTS, timeout=TIMEOUT_MS
        )
    except PlaywrightError as error:
        problems.append(f"{type(error).__name__}: {error}")
    finally:
        await context.close()
    return problems


async def _crawl(mode: str, base: str, pages: list[str]) -> dict[str, list[str]]:
    from playwright.async_api import async_playwright

    limit = asyncio.Semaphore(CONCURRENCY)
    async with async_playwright() as pw:
        browser = await pw.chromium.launch(
            executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True
        )

        async def one(name: str) -> list[str]:
            async with limit:
                http = MODES[mode]["transport"] == "http"
                url = f"{base}/{name}" if http else (SITE / name).resolve().as_uri()
                return await _visit(browser, mode, name, url)

        try:
            found = await asyncio.gather(*(one(name) for name in pages))
        finally:
            await browser.close()
    return dict(zip(pages, found))


@pytest.fixture(scope="module")
def server():
    """Serve the site on 127.0.0.1 on a free port while this module runs."""
    with serve(SITE) as base:
        yield base


@pytest.fixture(scope="module")
def site():
    if not PAGES:
        _skip_or_fail(f"the site is not built: no {SITE / 'index.html'}; run `make html` first")
    if not Path(CHROMIUM).exists():
        _skip_or_fail(
            f"Chromium not found at {CHROMIUM}; install it with `apt-get install chromium`"
        )
    try:
        import playwright  # noqa: F401
    except ImportError:
        _skip_or_fail("playwright is not installed; `pip install -e .[test]`")
    return PAGES


@pytest.fixture(scope="module")
def visits(request, site, server) -> dict[str, dict[str, list[str]]]:
    """Open the selected pages in each mode; the problems found on each page, by mode.

    Only the pages of the ``test_page`` cases that pytest will run are opened, so that
    ``-k masking`` checks one page in seconds instead of crawling the whole site.
    """
    wanted: dict[str, set[str]] = {mode: set() for mode in MODES}
    for item in request.session.items:
        params = getattr(getattr(item, "callspec", None), "params", {})
        if getattr(item, "originalname", None) == "test_page" and params.get("page") in PAGES:
            wanted[params["mode"]].add(params["page"])
    for mode in MODES:
        folder = _shot_path(mode, "x.html").parent
        folder.mkdir(parents=True, exist_ok=True)
        for page in wanted[mode]:
            _shot_path(mode, page).unlink(missing_ok=True)
    found = {mode: asyncio.run(_crawl(mode, server, sorted(wanted[mode]))) for mode in MODES}
    _write_figure_text()
    return found


def _write_figure_text() -> None:
    """Record the smallest figure text of every page visited, merged into the last runs' record."""
    import json

    record = SCREENSHOTS / "figure-text.json"
    table = json.loads(record.read_text()) if record.exists() else {}
    for mode, pages in FIGURE_TEXT.items():
        for page, figures in pages.items():
            table.setdefault(page, {})[mode] = figures
    record.write_text(json.dumps(table, indent=1, sort_keys=True))


@pytest.mark.parametrize("page", PAGES or ["(site not built)"])
@pytest.mark.parametrize("mode", list(MODES))
def test_page(mode, page, visits):
    problems = visits[mode][page]
    assert not problems, f"{mode} {page}:\n  " + "\n  ".join(problems)
    assert _shot_path(mode, page).stat().st_size > 0


def test_site_has_every_book_page(site):
    """The walk covers the book: every source page produced an html page."""
    missing = sorted(SOURCE_PAGES - set(site))
    assert not missing, f"pages missing from {SITE}: {missing}"


def test_search_works_over_http(site, server):
    """Site search finds the book's central word over http, with snippets of prose only."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        try:
            page = browser.new_page()
            page.goto(f"{server}/search.html?q=softmax", wait_until="load", timeout=TIMEOUT_MS)
            page.wait_for_selector("#search-results li p.context", timeout=TIMEOUT_MS)
            page.wait_for_load_state("networkidle", timeout=TIMEOUT_MS)
            hits = page.locator("#search-results li").count()
            snippets = page.locator("#search-results li p.context").all_inner_texts()
        finally:
            browser.close()
    assert hits >= 5
    assert len(snippets) >= 3
    menu = re.compile(r"\b(Light|Dark|System Settings|Contents)\b")
    for snippet in snippets:
        assert not menu.search(snippet), f"theme menu text in a search snippet: {snippet[:200]!r}"
        assert "\\" not in snippet and "$" not in snippet, (
            f"raw TeX in a search snippet: {snippet[:200]!r}"
        )


def test_layout_judge_catches_clipping_and_shrinking():
    fig = {"src": "a/fig.svg", "alt": "A plot.", "scale": 1.0, "natural": 600}
    table = {"what": "table#t", "width": 900, "column": 752, "scrolls": True, "cue": True}
    ok = {"wide": [], "figures": [fig], "pageScroll": 0}
    assert _judge_layout(ok, "desktop") == []
    assert "wider than the content column" in _judge_layout({**ok, "wide": [table]}, "desktop")[0]
    shrunk = {**ok, "figures": [{**fig, "scale": 0.5}]}
    assert "shrunk below" in _judge_layout(shrunk, "desktop")[0]
    no_alt = {**ok, "figures": [{**fig, "alt": ""}]}
    assert "without alt text" in _judge_layout(no_alt, "phone")[0]
    # On a phone a wide table may scroll, with a cue; a page may not scroll sideways.
    assert _judge_layout({**ok, "wide": [table]}, "phone") == []
    assert (
        "without a visible cue"
        in _judge_layout({**ok, "wide": [{**table, "cue": False}]}, "phone")[0]
    )
    assert "scrolls sideways" in _judge_layout({**ok, "pageScroll": 40}, "phone")[0]
    cut = {"what": "img#f", "width": 500, "column": 350, "scrolls": False, "cue": False}
    assert "cut off" in _judge_layout({**ok, "wide": [cut]}, "phone")[0]


def test_smallest_text_px_by_hand():
    """A 9 pt label on a 4 in figure: 9 user units of a 288-unit viewBox; 12 px at 384 px wide."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with matplotlib.rc_context({"svg.fonttype": "path"}):
        fig = plt.figure(figsize=(4.0, 2.0))
        fig.text(0.1, 0.5, "key token j", fontsize=9)
        fig.text(0.1, 0.2, "weights", fontsize=12)
        buffer = io.StringIO()
        fig.savefig(buffer, format="svg")
        plt.close(fig)
    svg = buffer.getvalue()
    assert 'viewBox="0 0 288 144"' in svg  # 4 in x 72 user units (pt) per inch
    # Natural size: 4 in x 96 px = 384 px, so 9 pt -> 9 * 384 / 288 = 12 px (1 pt = 4/3 px).
    assert smallest_text_px(svg, 384) == pytest.approx(12.0)
    # The same figure in a 358 px phone column: 9 * 358 / 288 = 11.19 px; at half size, 6 px.
    assert smallest_text_px(svg, 358) == pytest.approx(11.1875)
    assert smallest_text_px(svg, 192) == pytest.approx(6.0)
    # Mathtext: a subscript's glyphs carry their own smaller scale (0.7 of 10 pt in DejaVu).
    with matplotlib.rc_context({"svg.fonttype": "path", "mathtext.fontset": "dejavusans"}):
        fig = plt.figure(figsize=(4.0, 2.0))
        fig.text(0.1, 0.5, r"$a_{ij}$", fontsize=10)
        buffer = io.StringIO()
        fig.savefig(buffer, format="svg")
        plt.close(fig)
    assert smallest_text_px(buffer.getvalue(), 384) == pytest.approx(10 * 0.7 * 4 / 3, rel=0.02)
    # A radical stretched to a height is a shape, not text: the 10 pt digits are the smallest.
    with matplotlib.rc_context({"svg.fonttype": "path", "mathtext.fontset": "dejavusans"}):
        fig = plt.figure(figsize=(4.0, 2.0))
        fig.text(0.1, 0.5, r"scaled by $1/\sqrt{2}$", fontsize=10)
        buffer = io.StringIO()
        fig.savefig(buffer, format="svg")
        plt.close(fig)
    assert "STIXSize" in buffer.getvalue()
    assert smallest_text_px(buffer.getvalue(), 384) == pytest.approx(10 * 4 / 3)
    assert smallest_text_px("<svg viewBox='0 0 10 10'></svg>", 100) is None


def test_layout_judge_checks_figure_text():
    fig = {"src": "a/fig.svg", "alt": "A plot.", "scale": 1.0, "natural": 600}
    ok = {"wide": [], "figures": [fig], "pageScroll": 0, "figureText": [("fig.svg", 9.5)]}
    assert _judge_layout(ok, "phone") == []
    assert "figure text under 10 px" in _judge_layout(ok, "desktop")[0]
    tiny = {**ok, "figureText": [("fig.svg", 8.99)]}
    assert "figure text under 9 px" in _judge_layout(tiny, "phone")[0]
    assert "2 search boxes" in _judge_layout({**ok, "searches": 2}, "phone")[0]
