"""Open every page of the built book in headless Chromium, over http and from file://.

For each page the test asserts what a reader with no network needs: no console error and no
failed request, no request to any host but 127.0.0.1 (every other request is aborted and
reported), every formula typeset by MathJax (no raw TeX left in the text, no MathJax error), and
every image loaded. It saves a full-page screenshot of each page in
``_build/screenshots/<mode>/``: light colours over http, dark colours from file://.

Build the site first (``make html``); ``make test`` does. Without a built site or Chromium the
tests skip, except under ``SDPA_REQUIRE_REFERENCES=1`` (CI), where they fail.
"""

from __future__ import annotations

import functools
import http.server
import os
import re
import shutil
import threading
from pathlib import Path
from urllib.parse import urlsplit

import pytest

pytestmark = pytest.mark.browser

ROOT = Path(__file__).resolve().parents[1]
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
]
TIMEOUT_MS = 30_000

# Raw TeX that MathJax would have replaced: delimiters, and $...$ spans that look like maths.
RAW_TEX = re.compile(r"\\\(|\\\)|\\\[|\\\]|\$\$|\\begin\{|\\frac|\\sqrt|\$[^$\s][^$\n]{0,80}[\\^_{}][^$\n]{0,80}\$")


def _skip_or_fail(reason: str) -> None:
    if REQUIRE:
        pytest.fail(reason)
    pytest.skip(reason)


def _pages() -> list[str]:
    if not (SITE / "index.html").exists():
        return []
    skip = {"_static", "_sources", "_images", "_sphinx_design_static", ".doctrees"}
    return sorted(
        p.relative_to(SITE).as_posix()
        for p in SITE.rglob("*.html")
        if not skip.intersection(p.relative_to(SITE).parts)
    )


PAGES = _pages()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format, *args):  # noqa: A002 - the base class's name
        pass


@pytest.fixture(scope="module")
def server():
    """Serve the site on 127.0.0.1 on a free port, for the duration of this module."""
    handler = functools.partial(_QuietHandler, directory=str(SITE))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()
    httpd.server_close()
    thread.join(timeout=5)


@pytest.fixture(scope="module")
def browser():
    if not Path(CHROMIUM).exists():
        _skip_or_fail(f"Chromium not found at {CHROMIUM}; install it with `apt-get install chromium`")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _skip_or_fail("playwright is not installed; `pip install -e .[test]`")
    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module", autouse=True)
def fresh_screenshots():
    for mode in ("http-light", "file-dark"):
        shutil.rmtree(SCREENSHOTS / mode, ignore_errors=True)
        (SCREENSHOTS / mode).mkdir(parents=True, exist_ok=True)


def _allowed(url: str, origin: str | None) -> bool:
    parts = urlsplit(url)
    if parts.scheme in ("data", "blob", "about"):
        return True
    if origin is None:  # file:// mode: only files
        return parts.scheme == "file"
    return parts.scheme == "http" and parts.hostname == "127.0.0.1"


# Runs in the page: wait for MathJax and the images, then report what a reader would see.
INSPECT_JS = """
async () => {
  if (window.MathJax && MathJax.startup && MathJax.startup.promise) {
    await MathJax.startup.promise;
  }
  const images = Array.from(document.images);
  images.forEach((img) => { img.loading = "eager"; });
  await Promise.all(images.map((img) => img.complete ? null :
      new Promise((done) => { img.addEventListener("load", done); img.addEventListener("error", done); })));
  await document.fonts.ready;

  const article = document.querySelector("article") || document.body;
  const mathNodes = Array.from(article.querySelectorAll(".math"));
  const untypeset = mathNodes.filter((node) => !node.querySelector("mjx-container"))
      .map((node) => node.textContent.trim().slice(0, 80));
  const errors = Array.from(document.querySelectorAll("mjx-merror, mjx-container [data-mjx-error]"))
      .map((node) => (node.getAttribute("data-mjx-error") || node.textContent).slice(0, 80));

  // The text a reader sees, without code (where $ and backslashes are legitimate) or MathJax.
  const copy = article.cloneNode(true);
  copy.querySelectorAll("pre, code, script, style, mjx-container, .highlight, textarea, .MathJax_Preview")
      .forEach((node) => node.remove());

  return {
    mathNodes: mathNodes.length,
    containers: article.querySelectorAll("mjx-container").length,
    untypeset,
    errors,
    text: copy.textContent,
    mathjax: Boolean(window.MathJax && MathJax.version),
    mathjaxVersion: window.MathJax ? String(MathJax.version) : null,
    images: images.map((img) => ({src: img.currentSrc || img.src, ok: img.complete && img.naturalWidth > 0})),
  };
}
"""


def _check_page(browser, url: str, origin: str | None, scheme: str, shot: Path) -> None:
    context = browser.new_context(
        color_scheme=scheme, viewport={"width": 1280, "height": 900}, service_workers="block"
    )
    problems: list[str] = []

    def route(route):
        if _allowed(route.request.url, origin):
            route.continue_()
        else:
            problems.append(f"request to another host: {route.request.url}")
            route.abort()

    context.route("**/*", route)
    page = context.new_page()
    page.on("console", lambda m: m.type == "error" and problems.append(f"console error: {m.text}"))
    page.on("pageerror", lambda e: problems.append(f"uncaught exception: {e}"))
    page.on("requestfailed", lambda r: problems.append(f"failed request: {r.url} ({r.failure})"))
    page.on(
        "response",
        lambda r: r.status >= 400 and problems.append(f"HTTP {r.status}: {r.url}"),
    )
    try:
        page.goto(url, wait_until="load", timeout=TIMEOUT_MS)
        report = page.evaluate(INSPECT_JS)
        page.screenshot(path=str(shot), full_page=True)
    finally:
        context.close()

    if not report["mathjax"]:
        problems.append("MathJax did not load")
    elif not report["mathjaxVersion"].startswith("4."):
        problems.append(f"MathJax {report['mathjaxVersion']} loaded, expected the bundled 4.x")
    if report["untypeset"]:
        problems.append(f"formulas left untypeset: {report['untypeset'][:5]}")
    if report["mathNodes"] and report["containers"] < report["mathNodes"]:
        problems.append(f"{report['mathNodes']} formulas but {report['containers']} MathJax containers")
    if report["errors"]:
        problems.append(f"MathJax errors: {report['errors'][:5]}")
    raw = sorted(set(RAW_TEX.findall(report["text"])))
    if raw:
        problems.append(f"raw TeX in the text: {raw[:5]}")
    broken = [img["src"] for img in report["images"] if not img["ok"]]
    if broken:
        problems.append(f"images that did not load: {broken}")
    assert not problems, f"{url}:\n  " + "\n  ".join(problems)


def _shot_path(mode: str, page: str) -> Path:
    return SCREENSHOTS / mode / (page.removesuffix(".html").replace("/", "__") + ".png")


@pytest.fixture
def site_pages():
    if not PAGES:
        _skip_or_fail(f"the site is not built: no {SITE / 'index.html'}; run `make html` first")
    return PAGES


@pytest.mark.parametrize("page", PAGES or ["(site not built)"])
def test_page_over_http(page, site_pages, browser, server):
    _check_page(browser, f"{server}/{page}", "127.0.0.1", "light", _shot_path("http-light", page))


@pytest.mark.parametrize("page", PAGES or ["(site not built)"])
def test_page_from_file(page, site_pages, browser):
    url = (SITE / page).resolve().as_uri()
    _check_page(browser, url, None, "dark", _shot_path("file-dark", page))


def test_site_has_every_book_page(site_pages):
    """The walk above covers the book: every source page produced an html page."""
    sources = {
        p.relative_to(ROOT / "book").with_suffix(".html").as_posix()
        for p in (ROOT / "book").rglob("*.md")
        if "_static" not in p.parts
    }
    missing = sorted(sources - set(site_pages))
    assert not missing, f"pages missing from {SITE}: {missing}"


def test_search_works_over_http(site_pages, browser, server):
    """Site search finds the book's central word when the site is served over http."""
    context = browser.new_context()
    context.route(
        "**/*", lambda r: r.continue_() if _allowed(r.request.url, "127.0.0.1") else r.abort()
    )
    page = context.new_page()
    try:
        page.goto(f"{server}/search.html?q=softmax", wait_until="load", timeout=TIMEOUT_MS)
        page.wait_for_selector("#search-results li", timeout=TIMEOUT_MS)
        hits = page.locator("#search-results li").count()
    finally:
        context.close()
    assert hits >= 1
