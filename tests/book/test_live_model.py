"""The book's trained model live in the page (``book/lm/live-model.md``), driven in headless Chromium.

The page's script computes the model's forward pass in JavaScript from the float32 weights the
page carries. Here its logits and every attention map are compared with
:meth:`sdpa.nn.DecoderLM.forward` on sentences drawn from the grammar, the widget is used by
tapping its word buttons on a phone from file:// (dark theme), and the page's first load is
weighed. Build the site first (``make html``); without a built site or Chromium the tests skip,
except under ``SDPA_REQUIRE_REFERENCES=1`` (CI), where they fail.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path

import numpy as np
import pytest
from site_server import serve
from test_site_browser import CHROMIUM, CHROMIUM_ARGS, MODES, SITE, _allowed, site  # noqa: F401

import sdpa
from sdpa.nn import DecoderLM
from sdpa_book.pages.lm import VERB, VERB_OBJ, corpus_data, sentence, trained_lm

pytestmark = pytest.mark.browser

PAGE = "lm/live-model.html"
TIMEOUT_MS = 180_000
ATOL = 1e-5  # the JavaScript forward (float64 from float32 weights) against the package's float32
MIN_TARGET_PX = 44  # touch targets
MAX_FIRST_LOAD = 2_000_000  # bytes, a page with a widget (issue 38)
# What this page brings of its own: its HTML (with the weights), script and style.
MAX_OWN_BYTES = 300_000


@pytest.fixture(scope="module")
def server(site):  # noqa: F811 - the site fixture of test_site_browser
    with serve(SITE) as base:
        yield base


@pytest.fixture(scope="module")
def browser(site):  # noqa: F811
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield chromium
        chromium.close()


class Visit:
    """The page open in a fresh browser context, with what went wrong and what it loaded."""

    def __init__(self, browser, mode: str, server: str, javascript: bool = True, page_name=PAGE):
        self.problems: list[str] = []
        self.bytes: dict[str, int] = {}
        self.context = browser.new_context(
            color_scheme=MODES[mode]["scheme"],
            viewport=MODES[mode]["viewport"],
            service_workers="block",
            java_script_enabled=javascript,
        )
        page = self.page = self.context.new_page()
        problems = self.problems
        page.on("request", lambda r: _allowed(r.url, mode) or problems.append(f"request: {r.url}"))
        page.on("console", lambda m: m.type == "error" and problems.append(f"console: {m.text}"))
        page.on("pageerror", lambda e: problems.append(f"uncaught: {e}"))
        page.on("requestfailed", lambda r: problems.append(f"failed: {r.url}"))
        self.context.on("response", self._count)  # the page's and its workers' responses
        url = (
            f"{server}/{page_name}"
            if MODES[mode]["transport"] == "http"
            else (SITE / page_name).as_uri()
        )
        page.goto(url, wait_until="load", timeout=TIMEOUT_MS)
        if javascript and page_name == PAGE:
            page.wait_for_selector(".sdpa-live-lm.sdpa-live-ready", timeout=TIMEOUT_MS)
        # let the page finish what its first load fetches (MathJax, its workers), and the
        # response events reach this process
        page.wait_for_load_state("networkidle", timeout=TIMEOUT_MS)

    def _count(self, response) -> None:
        try:
            self.bytes[response.url] = len(response.body())  # uncompressed
        except Exception:  # a redirect has no body
            self.bytes.setdefault(response.url, 0)

    def close(self) -> None:
        self.context.close()


def _page_data() -> dict:
    """The data the built page carries: its weights, vocabulary and grammar."""
    html = (SITE / PAGE).read_text(encoding="utf-8")
    start = html.index('class="sdpa-live-lm-data">') + len('class="sdpa-live-lm-data">')
    return json.loads(html[start : html.index("</script>", start)])


def _model_from_page(data: dict) -> DecoderLM:
    """A DecoderLM of the book's sizes holding the weights the page ships."""
    c = data["config"]
    model = DecoderLM(
        vocab_size=c["vocab_size"],
        d_model=c["d_model"],
        n_layers=c["n_layers"],
        n_heads=c["n_heads"],
        d_ff=c["d_ff"],
        max_len=c["max_len"],
        positional="rope",
        norm="layer",
        dtype=np.float32,
        rng=np.random.default_rng(0),
    )
    flat = np.frombuffer(base64.b64decode(data["weights"]), dtype="<f4")
    assert set(data["params"]) == set(model.params)
    for name, (offset, shape) in data["params"].items():
        model.params[name] = flat[offset : offset + int(np.prod(shape))].reshape(shape).copy()
    return model


def _sentences(vocab: list[str]) -> list[list[int]]:
    """60 inputs from the grammar: single sentences, cut after each of a few lengths, and
    streams of several sentences up to the model's 32 tokens."""
    rng = np.random.default_rng(11)
    index = {w: i for i, w in enumerate(vocab)}
    out = []
    for k in range(40):
        words = [w for w, _, _ in sentence(rng)]
        out.append([index[w] for w in words[: 1 + k % len(words)]])
    stream = [index[w] for _ in range(200) for w, _, _ in sentence(rng)]
    out += [stream[s : s + 32] for s in range(0, 400, 20)]
    return out


@pytest.fixture(scope="module")
def desktop(browser, server):
    visit = Visit(browser, "desktop", server)
    yield visit
    visit.close()


def test_the_pages_weights_are_the_trained_model(site, monkeypatch):  # noqa: F811
    # The build keeps the trained model in its doctrees (sdpa_cache); without it, train.
    models = SITE.parent / "doctrees" / "models"
    if models.is_dir():
        monkeypatch.setenv("SDPA_MODEL_CACHE", str(models))
    trained = trained_lm()
    data = _page_data()
    model = _model_from_page(data)
    assert data["vocab"] == corpus_data().vocab
    for name, p in trained.model.params.items():
        np.testing.assert_array_equal(model.params[name], p, err_msg=name)


def test_javascript_forward_equals_the_package_on_sentences_of_the_grammar(desktop):
    data = _page_data()
    model = _model_from_page(data)
    inputs = _sentences(data["vocab"])
    assert len(inputs) >= 50 and max(map(len, inputs)) == 32
    got = desktop.page.evaluate("(xs) => xs.map((x) => window.sdpaLiveLM.forward(x))", inputs)
    for tokens, js in zip(inputs, got):
        logits, weights = model.forward(np.array(tokens), return_attention=True)
        np.testing.assert_allclose(np.array(js["logits"]), logits, rtol=0, atol=ATOL)
        for layer, w in enumerate(weights):  # (H, T, T): every head's map, zero above
            np.testing.assert_allclose(np.array(js["attention"][layer]), w, rtol=0, atol=ATOL)
    assert not desktop.problems, desktop.problems


def _shown(visit) -> list[tuple[str, float, str]]:
    """The next-word list: (word, probability as data, probability as printed)."""
    return visit.page.eval_on_selector_all(
        ".sdpa-live-choice",
        "bs => bs.map(b => [b.dataset.word, Number(b.dataset.p),"
        " b.querySelector('.sdpa-live-p').textContent])",
    )


def test_tapping_word_buttons_builds_a_sentence_on_a_phone_from_file(browser, server):
    data = _page_data()
    model, vocab = _model_from_page(data), data["vocab"]
    visit = Visit(browser, "phone", server)
    page = visit.page
    try:
        page.get_by_role("button", name="Clear", exact=True).click()
        assert page.locator(".sdpa-live-choice").count() == 0  # no word: nothing predicted
        before = None
        words = "these small dogs near a cat".split()
        for k, word in enumerate(words):
            # only the grammar's next words are offered: tap the word's button
            page.click(f'.sdpa-live-words button[data-word="{word}"]')
            sentence_text = page.inner_text(".sdpa-live-sentence")
            assert sentence_text == " ".join(words[: k + 1])
            shown = _shown(visit)
            assert len(shown) == 8 and shown != before
            before = shown
            p = sdpa.softmax(model.forward(np.array([vocab.index(w) for w in words[: k + 1]]))[-1])
            top = np.argsort(-p, kind="stable")[:8]
            assert [w for w, _, _ in shown] == [vocab[i] for i in top]
            probs = np.array([q for _, q, _ in shown])
            np.testing.assert_allclose(probs, p[top], rtol=0, atol=ATOL)
            np.testing.assert_allclose([float(t) for _, _, t in shown], p[top], atol=5.1e-4)
            assert probs.sum() <= 1 + 1e-12 and np.all(np.diff(probs) <= 0)
        # after the subject and a distracting noun, plural verbs lead
        plural = set(VERB["pl"] + VERB_OBJ["pl"])
        assert {w for w, _, _ in shown[:6]} == plural
        offered = page.eval_on_selector_all(
            ".sdpa-live-words button", "bs => bs.map(b => b.dataset.word)"
        )
        assert set(offered) == plural  # the grammar's next words
        # a tap on a predicted word adds it; the eight heads are drawn, one enlarged
        page.click('.sdpa-live-choice[data-word="sleep"]')
        assert page.inner_text(".sdpa-live-sentence").endswith("cat sleep")
        assert page.locator(".sdpa-live-thumb").count() == 8
        page.click('.sdpa-live-thumb[data-head="0.3"]')
        assert "Head 0.3" in page.inner_text(".sdpa-live-readout")
        assert page.locator('.sdpa-live-thumb[aria-pressed="true"]').count() == 1
        # typing: an unknown word is named and left out
        page.fill("#sdpa-live-typed", "a dog with unicorns")
        assert "unicorns" in page.inner_text(".sdpa-live-note")
        assert page.inner_text(".sdpa-live-sentence") == "a dog with"
        _check_fit_for_fingers(visit)
        assert not visit.problems, visit.problems
    finally:
        visit.close()


def _check_fit_for_fingers(visit) -> None:
    page = visit.page
    small = page.eval_on_selector_all(
        ".sdpa-live-lm button, .sdpa-live-lm input[type=text], .sdpa-live-check",
        f"els => els.filter(e => e.offsetParent !== null)"
        f".filter(e => e.getBoundingClientRect().height < {MIN_TARGET_PX}"
        f" || e.getBoundingClientRect().width < {MIN_TARGET_PX}).map(e => e.outerHTML.slice(0, 80))",
    )
    assert not small, small
    cut = page.eval_on_selector_all(
        ".sdpa-live-lm button, .sdpa-live-lm p, .sdpa-live-lm label",
        "els => els.filter(e => e.offsetParent !== null && e.scrollWidth > e.clientWidth + 1)"
        ".map(e => e.textContent.slice(0, 40))",
    )
    assert not cut, cut
    width = page.evaluate("document.documentElement.scrollWidth")
    assert width <= MODES["phone"]["viewport"]["width"], f"the page scrolls sideways: {width}"
    sizes = page.eval_on_selector_all(
        ".sdpa-live-lm button, .sdpa-live-lm span, .sdpa-live-lm p, .sdpa-live-lm text",
        "els => els.filter(e => e.textContent.trim() && e.getClientRects().length)"
        ".map(e => parseFloat(getComputedStyle(e).fontSize))",
    )
    assert min(sizes) >= 9.0, sorted(sizes)[:5]


def test_first_load_weight(browser, server):
    """Every response of a first load, uncompressed. What the page brings of its own (its HTML
    with the weights, its script and style) is at most ``MAX_OWN_BYTES``; the rest is the site's
    shared files, the same for every page: with them the page keeps to issue 38's 2.0 MB for a
    page with a widget, or (while the shared files alone weigh more) adds nothing else."""
    visit = Visit(browser, "desktop", server)
    try:
        total = sum(visit.bytes.values())
        ends = (PAGE, "/_static/sdpa-live-lm.js", "/_static/sdpa-live-lm.css")
        own = {url: n for url, n in visit.bytes.items() if url.split("?")[0].endswith(ends)}
        print(
            f"\n{PAGE}: first load {total:,} bytes in {len(visit.bytes)} responses; "
            f"its own HTML, script and style {sum(own.values()):,}"
        )
        assert len(own) == 3, sorted(own)
        assert sum(own.values()) <= MAX_OWN_BYTES, own
        if total > MAX_FIRST_LOAD:
            shared = [url for url in visit.bytes if url not in own]
            # the theme's and MathJax's files (a worker's blob too) and the search index
            site_wide = ("/_static/", "/_sphinx_design_static/", "/searchindex.js", "blob:")
            others = [u for u in shared if not any(part in u for part in site_wide)]
            assert not others, others
    finally:
        visit.close()


def test_without_javascript_a_summary_says_what_the_widget_shows(browser, server):
    visit = Visit(browser, "desktop", server, javascript=False)
    try:
        static = visit.page.locator(".sdpa-live-static")
        assert static.is_visible()
        text = static.inner_text()
        assert "these small dogs near a cat" in text and "probability" in text
        # the table lists the model's top words after the first starter: plural verbs
        first = visit.page.locator(".sdpa-live-static td").first.inner_text()
        assert first in VERB["pl"] + VERB_OBJ["pl"]
    finally:
        visit.close()


def test_the_script_is_served_by_the_site(site):  # noqa: F811
    assert (SITE / "_static" / "sdpa-live-lm.js").stat().st_size > 5_000
    html = (SITE / PAGE).read_text(encoding="utf-8")
    assert 'src="../_static/sdpa-live-lm.js"' in html and "http" not in _page_data()["weights"]
    assert Path(SITE / "_static" / "sdpa-live-lm.css").exists()
