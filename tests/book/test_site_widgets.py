"""The interactive figures of the built book, driven in headless Chromium.

Each widget page is opened as ``tests/book/test_site_browser.py`` opens every page (desktop over
http, light; phone from file://, dark), with its rules for requests: nothing may leave the site.
On each, every widget must come alive (BokehJS from the site's ``_static``), with no console
error; its controls must be reachable and movable with the keyboard; and on the phone its text
must be at least 9 CSS px. The phone is a touch device (``has_touch``, ``is_mobile``) and the
widgets must be made for fingers there: every slider 240 px wide or with -/+ buttons, and -/+
buttons of at least 44 x 44 px on every slider of more than 40 steps (a tap moves one step); no
label, menu or readout cut; a readout of at most four lines in any state the menus and the sliders'
ends reach. In both modes the widget follows the theme, light and dark: no bright panel in the
dark, legible text in both. Then each widget is driven (a slider moved with the arrow keys, an
option chosen) and what it displays, the readout and the data of its figure, is compared with
the package's values for that setting. Without JavaScript the static picture shows instead.

Build the site first (``make html``). Without a built site or Chromium the tests skip, except
under ``SDPA_REQUIRE_REFERENCES=1`` (CI), where they fail.
"""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from site_server import serve
from test_site_browser import CHROMIUM, CHROMIUM_ARGS, MODES, SITE, _allowed, site  # noqa: F401

import sdpa
from sdpa_book.widgets import flash_states, kv_cache_bytes, mask_weights, rope_states

pytestmark = pytest.mark.browser

# The pages that carry a widget, and the widget's name (data-sdpa-widget).
WIDGET_PAGES = {
    "formula/scaling.html": "softmax",
    "llm/masking.html": "masks",
    "cost/memory-efficient.html": "flash-loop",
    "modern/rope.html": "rope",
    "lm/induction-heads.html": "lm-attention",
    "modern/kv-cache.html": "kv-cache",
}
TIMEOUT_MS = 180_000
MIN_TEXT_PX = 9.0
MIN_CONTRAST = 4.5  # WCAG AA for text
MIN_TRACK_PX = 240  # a slider without -/+ buttons, on the phone
MAX_STEPS_WITHOUT_BUTTONS = 40  # beyond, a finger cannot hit one step on the track
MIN_TARGET_PX = 44  # a -/+ button (WCAG 2.5.5)
MAX_READOUT_LINES = 4  # on the phone

# The lowest contrast between the widget's text (labels, menus, readout) and what is behind it.
CONTRAST_JS = """
(root) => {
  const rgba = (s) => (s.match(/[\\d.]+/g) || []).map(Number);
  const lum = ([r, g, b]) => {
    const f = (c) => { c /= 255; return c <= 0.03928 ? c / 12.92 : ((c + 0.055) / 1.055) ** 2.4; };
    return 0.2126 * f(r) + 0.7152 * f(g) + 0.0722 * f(b);
  };
  const behind = (el) => {
    for (let e = el; e; e = e.parentElement) {
      const c = rgba(getComputedStyle(e).backgroundColor);
      if (c.length === 3 || (c.length === 4 && c[3] > 0.5)) return c.slice(0, 3);
    }
    return [255, 255, 255];
  };
  let worst = 21, what = "";
  for (const el of root.querySelectorAll("label, output, select, button, .sdpa-widget-readout, .sdpa-widget-title")) {
    if (el.offsetParent === null) continue;
    const a = lum(rgba(getComputedStyle(el).color)), b = lum(behind(el));
    const ratio = (Math.max(a, b) + 0.05) / (Math.min(a, b) + 0.05);
    if (ratio < worst) { worst = ratio; what = el.tagName + " " + el.textContent.slice(0, 30); }
  }
  return [worst, what];
}
"""

# The smallest font size of the widget's own text and of its Bokeh figure's text properties.
TEXT_SIZES_JS = """
(root) => {
  const sizes = [];
  for (const el of root.querySelectorAll("label, output, select, option, p, span")) {
    if (el.offsetParent !== null && el.textContent.trim())
      sizes.push(parseFloat(getComputedStyle(el).fontSize));
  }
  for (const m of root.sdpaDocument.all_models) {
    for (const [k, v] of Object.entries(m.properties || {})) {
      if (k.endsWith("font_size")) {
        const value = m[k];
        const px = typeof value === "string" ? value : (value && value.value);
        if (typeof px === "string" && px.endsWith("px")) sizes.push(parseFloat(px));
      }
    }
  }
  return sizes;
}
"""


# The sliders' widths, steps and -/+ buttons, and every piece of text cut by its box: a label,
# output, button, title or readout whose text overflows, or a menu narrower than its longest
# option (a copy of it at its natural width measures what it needs).
FINGERS_JS = """
(root) => {
  const box = (el) => el.getBoundingClientRect();
  const sliders = [], cut = [];
  for (const s of root.querySelectorAll('input[type="range"]')) {
    const buttons = Array.from(root.querySelectorAll(`button[aria-controls="${s.id}"]`))
      .filter(b => b.offsetParent !== null).map(b => [box(b).width, box(b).height]);
    sliders.push({name: s.name, width: box(s).width, buttons: buttons,
                  steps: Math.round((Number(s.max) - Number(s.min)) / Number(s.step))});
  }
  for (const el of root.querySelectorAll("label, output, button, .sdpa-widget-title, .sdpa-widget-readout")) {
    if (el.offsetParent !== null && el.scrollWidth > el.clientWidth)
      cut.push(`${el.tagName} "${el.textContent}": ${el.scrollWidth} > ${el.clientWidth} px`);
  }
  for (const sel of root.querySelectorAll("select")) {
    const copy = sel.cloneNode(true);
    copy.style.cssText = "position: absolute; visibility: hidden; width: max-content; max-width: none";
    sel.parentElement.appendChild(copy);
    const need = box(copy).width, have = box(sel).width;
    copy.remove();
    if (need > have + 0.5) cut.push(`menu ${sel.name}: needs ${need} px, has ${have} px`);
  }
  return {sliders: sliders, cut: cut};
}
"""

# The readout's most lines (its height over its line height) over the states a reader reaches
# with each menu's every option and each slider's two ends, one control at a time; the
# controls are put back after.
READOUT_LINES_JS = """
(root) => {
  const readout = root.querySelector(".sdpa-widget-readout");
  const lines = () => Math.round(readout.getBoundingClientRect().height /
                                 parseFloat(getComputedStyle(readout).lineHeight));
  let most = lines(), text = readout.textContent;
  const look = () => { const n = lines(); if (n > most) { most = n; text = readout.textContent; } };
  for (const c of root.querySelectorAll("[data-sdpa-control]")) {
    const before = c.value;
    const values = c.tagName === "SELECT" ? Array.from(c.options, o => o.value) : [c.min, c.max];
    for (const value of values) {
      c.value = value;
      c.dispatchEvent(new Event("input", {bubbles: true}));
      look();
    }
    c.value = before;
    c.dispatchEvent(new Event("input", {bubbles: true}));
  }
  return [most, text];
}
"""

# The longest readouts a reader can reach beyond one control at a time: the KV calculator with
# every control far from its default (the most digits, a sharing, a fractional G, MLA).
LONG_STATES = {
    "kv-cache": [
        dict(layers=128, heads=113, kvheads="16", dh="256", dtype="4", log2ctx=20, batch=64,
             share="3"),
        dict(layers=127, heads=128, kvheads="0", latent="1024", dtype="1", log2ctx=20, batch=63,
             share="3"),
        dict(layers=100, heads=100, kvheads="8", latent="0", dh="256", dtype="1", log2ctx=17,
             batch=1, share="8"),
    ],
}  # fmt: skip
SET_AND_COUNT_LINES_JS = """
([root, state]) => {
  for (const [name, value] of Object.entries(state)) {
    const c = root.querySelector(`[data-sdpa-control][name="${name}"]`);
    c.value = String(value);
    c.dispatchEvent(new Event("input", {bubbles: true}));
  }
  const readout = root.querySelector(".sdpa-widget-readout");
  return [Math.round(readout.getBoundingClientRect().height /
                     parseFloat(getComputedStyle(readout).lineHeight)), readout.textContent];
}
"""

# The relative luminance of the widget's panel (what is behind its readout) and of each of its
# figures' backgrounds.
BRIGHTNESS_JS = """
(root) => {
  const lum = (c) => {
    const [r, g, b] = c.map(x => { x /= 255; return x <= 0.03928 ? x / 12.92 : ((x + 0.055) / 1.055) ** 2.4; });
    return 0.2126 * r + 0.7152 * g + 0.0722 * b;
  };
  const parse = (s) => (s.match(/[\\d.]+/g) || []).map(Number);
  let panel = [255, 255, 255];
  for (let e = root.querySelector(".sdpa-widget-readout"); e; e = e.parentElement) {
    const c = parse(getComputedStyle(e).backgroundColor);
    if (c.length === 3 || (c.length === 4 && c[3] > 0.5)) { panel = c.slice(0, 3); break; }
  }
  const probe = document.createElement("span");
  document.body.appendChild(probe);
  const figures = [];
  for (const m of root.sdpaDocument.all_models) {
    if (typeof m.background_fill_color !== "string" || !Array.isArray(m.renderers)) continue;
    probe.style.color = m.background_fill_color;
    figures.push(lum(parse(getComputedStyle(probe).color).slice(0, 3)));
  }
  probe.remove();
  return {panel: lum(panel), figures: figures};
}
"""


TICKS_JS = """
(root) => {
  const out = [];
  for (const p of root.sdpaDocument.all_models) {
    if (!Array.isArray(p.below) || !p.x_range) continue;
    for (const [axes, r] of [[p.below, p.x_range], [p.left, p.y_range]]) for (const axis of axes) {
      const lo = Math.min(r.start, r.end), hi = Math.max(r.start, r.end);
      const ticks = axis.ticker.get_ticks(lo, hi, r, NaN).major;
      out.push([axis.axis_label || "", Array.from(ticks).filter(x => x >= lo && x <= hi)]);
    }
  }
  return out;
}
"""


def _set_theme(visit, theme: str) -> None:
    """Switch the page's theme as the theme's button does (the widget follows it)."""
    visit.page.evaluate("t => { document.documentElement.dataset.theme = t; }", theme)
    visit.page.wait_for_timeout(50)  # the widgets' observer recolours the figures


def _check_theme(widget, theme: str) -> None:
    bright = widget.evaluate(BRIGHTNESS_JS)
    if theme == "dark":  # no bright panel, no white figure
        assert bright["panel"] < 0.1, f"a bright panel in the dark theme: {bright}"
        assert bright["figures"] and max(bright["figures"]) < 0.1, bright
    else:
        assert bright["panel"] > 0.8 and min(bright["figures"]) > 0.8, bright
    contrast, where = widget.evaluate(CONTRAST_JS)
    assert contrast >= MIN_CONTRAST, f"{theme}: text contrast {contrast:.2f} at {where}"


def _check_fingers(widget, mode: str) -> None:
    found = widget.evaluate(FINGERS_JS)
    assert not found["cut"], found["cut"]
    for s in found["sliders"]:
        has_buttons = len(s["buttons"]) == 2 and all(
            w >= MIN_TARGET_PX and h >= MIN_TARGET_PX for w, h in s["buttons"]
        )
        if s["steps"] > MAX_STEPS_WITHOUT_BUTTONS:
            assert has_buttons, f"{s['name']}: {s['steps']} steps, buttons {s['buttons']}"
        if mode == "phone":
            assert s["width"] >= MIN_TRACK_PX or has_buttons, s


def _check_step_buttons(visit, widget, name: str, tap: bool) -> None:
    """The first slider's + and - buttons move it by one step each, and change the readout."""
    slider = widget.locator('input[type="range"]').first
    if not slider.count():
        return
    ident, step = slider.get_attribute("id"), float(slider.get_attribute("step"))
    up = widget.locator(f'button[aria-controls="{ident}"][data-sdpa-step="1"]')
    down = widget.locator(f'button[aria-controls="{ident}"][data-sdpa-step="-1"]')
    if slider.input_value() == slider.get_attribute("max"):
        up, down, step = down, up, -step
    before, text = float(slider.input_value()), visit.readout(name)
    up.tap() if tap else up.click()
    assert float(slider.input_value()) == pytest.approx(before + step)
    assert visit.readout(name) != text
    down.tap() if tap else down.click()
    assert float(slider.input_value()) == pytest.approx(before)
    assert visit.readout(name) == text


@pytest.fixture(scope="module")
def server():
    with serve(SITE) as base:
        yield base


@pytest.fixture(scope="module")
def browser(site):  # noqa: F811 - the site fixture of test_site_browser
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        chromium = pw.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS, headless=True)
        yield chromium
        chromium.close()


class Visit:
    """One page open in a browser context, with what went wrong on it."""

    def __init__(self, browser, url: str, mode: str, javascript: bool = True):
        self.problems: list[str] = []
        self.context = browser.new_context(
            color_scheme=MODES[mode]["scheme"],
            viewport=MODES[mode]["viewport"],
            service_workers="block",
            java_script_enabled=javascript,
            has_touch=mode == "phone",  # a phone: touch events, the mobile viewport
            is_mobile=mode == "phone",
        )
        self.page = self.context.new_page()
        page, problems = self.page, self.problems
        page.on("request", lambda r: _allowed(r.url, mode) or problems.append(f"request: {r.url}"))
        page.on("console", lambda m: m.type == "error" and problems.append(f"console: {m.text}"))
        page.on("pageerror", lambda e: problems.append(f"uncaught: {e}"))
        page.on("requestfailed", lambda r: problems.append(f"failed: {r.url}"))
        page.goto(url, wait_until="load", timeout=TIMEOUT_MS)
        if javascript:
            # BokehJS comes when a widget nears the screen: go to the first one
            page.locator(".sdpa-widget").first.scroll_into_view_if_needed()
            page.wait_for_selector(".sdpa-widget.sdpa-widget-live", timeout=TIMEOUT_MS)

    def widget(self, name: str):
        return self.page.locator(f'.sdpa-widget[data-sdpa-widget="{name}"]')

    def readout(self, name: str) -> str:
        return self.widget(name).locator(".sdpa-widget-readout").inner_text()

    def source(self, name: str, source: str) -> dict:
        """The data of the Bokeh source ``source`` the widget's figure draws (NaN as None)."""
        return self.widget(name).evaluate(
            """(root, name) => {
                const data = root.sdpaModel(name).data, out = {};
                for (const k of Object.keys(data))
                  out[k] = Array.from(data[k], x => (typeof x === "number" && isNaN(x)) ? null : x);
                return out;
            }""",
            source,
        )

    def ticks(self, name: str) -> list:
        """``(axis label, major ticks)`` of each axis of the widget's figures, as Bokeh
        computes them for the axis's range (the ticks inside it)."""
        return self.widget(name).evaluate(TICKS_JS)

    def choose(self, name: str, control: str, value: str) -> None:
        self.widget(name).locator(f'select[name="{control}"]').select_option(value)

    def slide(self, name: str, control: str, key: str, times: int = 1) -> None:
        """Move a slider with the keyboard: focus it, press ``key``."""
        slider = self.widget(name).locator(f'input[type="range"][name="{control}"]')
        slider.focus()
        for _ in range(times):
            self.page.keyboard.press(key)

    def close(self) -> None:
        self.context.close()


def _url(server: str, page: str, mode: str) -> str:
    return f"{server}/{page}" if MODES[mode]["transport"] == "http" else (SITE / page).as_uri()


@pytest.fixture(scope="module")
def desktop(browser, server):
    """Each widget page open on the desktop, over http (shared by the driving tests)."""
    visits = {}
    yield lambda page: visits.setdefault(
        page, Visit(browser, _url(server, page, "desktop"), "desktop")
    )
    for visit in visits.values():
        visit.close()


def _numbers(text: str) -> list[float]:
    return [
        float(x) for x in re.findall(r"-?\d+(?:\.\d+)?", text.replace(",", "").replace("−", "-"))
    ]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("page", list(WIDGET_PAGES))
def test_widget_comes_alive_offline(browser, server, page, mode):
    if not (SITE / page).exists():
        pytest.fail(f"{page} is not in the built site")
    visit = Visit(browser, _url(server, page, mode), mode)
    try:
        name = WIDGET_PAGES[page]
        widget = visit.widget(name)
        assert widget.count() == 1
        assert widget.locator(".sdpa-widget-static").count() == 0  # the live figure replaced it
        assert widget.locator(".sdpa-widget-readout").inner_text().strip()
        assert widget.locator(".sdpa-widget-readout").get_attribute("aria-live") == "polite"
        assert widget.locator("canvas").count() >= 1
        # every control has a label and takes the keyboard focus
        for control in widget.locator("[data-sdpa-control]").all():
            ident = control.get_attribute("id")
            assert widget.locator(f'label[for="{ident}"]').count() == 1
            control.focus()
            assert control.evaluate("c => document.activeElement === c")
        # the arrow keys move a slider and change the readout
        slider = widget.locator('input[type="range"]').first
        if slider.count():
            before, text = slider.input_value(), visit.readout(name)
            slider.focus()
            visit.page.keyboard.press(
                "ArrowLeft" if before == slider.get_attribute("max") else "ArrowRight"
            )
            assert slider.input_value() != before and visit.readout(name) != text
        # made for fingers: slider widths, -/+ buttons that move one step, nothing cut
        _check_fingers(widget, mode)
        _check_step_buttons(visit, widget, name, tap=mode == "phone")
        for label, ticks in visit.ticks(name):  # positions and blocks are whole numbers
            if "key" in label or "query" in label:
                assert ticks and all(t == int(t) for t in ticks), (label, ticks)
        if mode == "phone":
            lines, text = widget.evaluate(READOUT_LINES_JS)
            assert lines <= MAX_READOUT_LINES, f"{lines} lines: {text}"
            for state in LONG_STATES.get(name, []):
                lines, text = visit.page.evaluate(
                    SET_AND_COUNT_LINES_JS, [widget.element_handle(), state]
                )
                assert lines <= MAX_READOUT_LINES, f"{lines} lines: {text}"
        # the theme: the mode's own, then the other one, as the theme's button switches it
        theme = MODES[mode]["scheme"]
        _check_theme(widget, theme)
        other = "light" if theme == "dark" else "dark"
        _set_theme(visit, other)
        _check_theme(widget, other)
        _check_fingers(widget, mode)
        if mode == "phone":
            sizes = widget.evaluate(TEXT_SIZES_JS)
            assert sizes and min(sizes) >= MIN_TEXT_PX, sorted(sizes)[:5]
            width = visit.page.evaluate("document.documentElement.scrollWidth")
            assert width <= MODES[mode]["viewport"]["width"], f"page scrolls sideways: {width}"
        assert not visit.problems, visit.problems
    finally:
        visit.close()


def test_without_javascript_the_static_picture_shows(browser, server):
    visit = Visit(browser, _url(server, "llm/masking.html", "desktop"), "desktop", javascript=False)
    try:
        widget = visit.widget("masks")
        picture = widget.locator("img.sdpa-widget-static")
        assert picture.is_visible()
        assert picture.evaluate("img => img.complete && img.naturalWidth > 0")
        assert widget.locator(".sdpa-widget-controls").is_hidden()
    finally:
        visit.close()


def test_softmax_widget_shows_the_package_softmax(desktop):
    visit = desktop("formula/scaling.html")
    spec = visit.widget("softmax").evaluate(
        "root => JSON.parse(root.querySelector('script.sdpa-widget-data').textContent).data"
    )
    for dk, scaled, tau in [("64", "1", 1.0), ("1024", "0", 0.5), ("4", "1", 3.0)]:
        visit.choose("softmax", "dk", dk)
        visit.choose("softmax", "scale", scaled)
        slider = visit.widget("softmax").locator('input[name="tau"]')
        slider.focus()
        visit.page.keyboard.press("Home")  # 0.1
        visit.slide("softmax", "tau", "ArrowRight", round((tau - 0.1) / 0.1))
        assert float(slider.input_value()) == pytest.approx(tau)
        z = np.array(spec["scores"][dk]) * (1 / math.sqrt(int(dk)) if scaled == "1" else 1)
        want = sdpa.softmax(z / tau)
        shown = visit.source("softmax", "weights")["w"]
        np.testing.assert_allclose(shown, want, rtol=1e-9, atol=1e-12)
        numbers = _numbers(visit.readout("softmax").split("weights")[1])[: len(want)]
        np.testing.assert_allclose(numbers, want, atol=6e-4)


def test_mask_widget_shows_the_package_weights(desktop):
    visit = desktop("llm/masking.html")
    for kind, T, S in [
        ("causal-tl", 8, 5),
        ("causal-br", 8, 3),
        ("window", 5, 8),
        ("padding", 3, 8),
        ("none", 5, 5),
    ]:
        visit.choose("masks", "kind", kind)
        visit.choose("masks", "T", str(T))
        visit.choose("masks", "S", str(S))
        weights, allowed = mask_weights(kind, T, S)
        shown = visit.source("masks", "weights")
        got = np.full((T, S), np.nan)
        for x, y, w in zip(shown["x"], shown["y"], shown["w"]):
            got[y, x] = np.nan if w is None else w
        np.testing.assert_array_equal(~np.isnan(got), allowed, err_msg=f"{kind} {T} {S}")
        np.testing.assert_allclose(got[allowed], weights[allowed], atol=5e-5)
        empty = int((~allowed.any(axis=1)).sum())
        text = visit.readout("masks")
        assert (f"{empty} quer" in text) == (empty > 0), text
        # whole positions only on both axes, every one of them when there are few
        for label, ticks in visit.ticks("masks"):
            n = S if label.startswith("key") else T
            assert ticks == list(range(n)), (kind, T, S, label, ticks)


def test_flash_widget_steps_through_the_package_loop(desktop):
    visit = desktop("cost/memory-efficient.html")
    slider = visit.widget("flash-loop").locator('input[name="step"]')
    for mask in ("full", "causal"):
        visit.choose("flash-loop", "mask", mask)
        states = flash_states(is_causal=mask == "causal")
        # the slider ends at the mask's last tile, as many as the package's loop computes
        tiles = len(sdpa_tiles(is_causal=mask == "causal"))
        assert len(states["tiles"]) == tiles
        assert int(slider.get_attribute("max")) == tiles
        visit.slide("flash-loop", "step", "End")
        assert int(slider.input_value()) == tiles
        assert visit.readout("flash-loop").startswith(f"Tile {tiles} of {tiles}:")
        visit.slide("flash-loop", "step", "Home")
        for n in range(1, len(states["tiles"]) + 1):
            if n > 1:
                visit.slide("flash-loop", "step", "ArrowRight")
            step = states["steps"][n - 1]
            shown = visit.source("flash-loop", "outputs")
            want = [math.nan if o is None else o for o in step["out"]]
            np.testing.assert_allclose([math.nan if o is None else o for o in shown["out"]], want)
            text = visit.readout("flash-loop")
            i0, j0 = states["tiles"][n - 1]
            assert text.startswith(f"Tile {n} of {len(states['tiles'])}: queries {i0}–"), text
            assert f"m = {step['m'][i0]:.3f}, l = {step['l'][i0]:.3f}" in text
        # the last tile: the exact attention
        exact = sdpa.scaled_dot_product_attention(*_flash_inputs(), is_causal=mask == "causal")[
            :, 0
        ]
        np.testing.assert_allclose(visit.source("flash-loop", "outputs")["out"], exact, atol=2e-6)
    # back to no mask: the slider reaches the full loop's last tile again
    visit.choose("flash-loop", "mask", "full")
    visit.slide("flash-loop", "step", "End")
    tiles = len(sdpa_tiles(is_causal=False))
    assert int(slider.get_attribute("max")) == tiles == int(slider.input_value())


def sdpa_tiles(is_causal: bool) -> list:
    """The tiles ``sdpa.blocked_attention`` computes on the widget's inputs (its own trace)."""
    tiles = []
    sdpa.blocked_attention(*_flash_inputs(), block_q=4, block_k=2, is_causal=is_causal,
                           on_tile=lambda i, j: tiles.append((i, j)))  # fmt: skip
    return tiles


def _flash_inputs():
    rng = np.random.default_rng(0)
    return rng.standard_normal((8, 4)), rng.standard_normal((8, 4)), rng.standard_normal((8, 1))


def test_rope_widget_score_depends_on_the_offset(desktop):
    visit = desktop("modern/rope.html")
    rng = np.random.default_rng(3)
    q, k = rng.standard_normal(8), rng.standard_normal(8)
    assert np.allclose(rope_states()["scores"][0][0], q @ k / math.sqrt(8), atol=1e-6)
    seen = {}
    for i, j in [(0, 3), (4, 7), (9, 12), (12, 2), (15, 15)]:
        visit.slide("rope", "i", "Home")
        visit.slide("rope", "i", "ArrowRight", i)
        visit.slide("rope", "j", "Home")
        visit.slide("rope", "j", "ArrowRight", j)
        rq = sdpa.apply_rotary_embedding(q[None], [i])[0]
        rk = sdpa.apply_rotary_embedding(k[None], [j])[0]
        want = rq @ rk / math.sqrt(8)
        text = visit.readout("rope")
        score = float(re.search(r"score (-?\d+\.\d+)", text).group(1))
        assert score == pytest.approx(want, abs=6e-5), text
        seen.setdefault(j - i, set()).add(round(score, 4))
    assert len(seen[3]) == 1  # (0, 3), (4, 7), (9, 12): one score


def test_lm_widget_shows_each_heads_map(desktop):
    visit = desktop("lm/induction-heads.html")
    maps = visit.widget("lm-attention").evaluate(
        "root => JSON.parse(root.querySelector('script.sdpa-widget-data').textContent).data"
    )
    T, steps = maps["T"], maps["steps"]
    last = str(len(steps) - 1)
    shown_before = None
    for step, layer, head, seq in [
        (last, "0", "0", "0"), (last, "1", "2", "1"), (last, "1", "3", "2"), ("0", "1", "3", "2")
    ]:  # fmt: skip
        visit.choose("lm-attention", "step", step)
        visit.choose("lm-attention", "layer", layer)
        visit.choose("lm-attention", "head", head)
        visit.choose("lm-attention", "seq", seq)
        shown = visit.source("lm-attention", "weights")
        got = np.full((T, T), np.nan)
        for x, y, w in zip(shown["x"], shown["y"], shown["w"]):
            got[y, x] = np.nan if w is None else w
        causal = np.tril(np.ones((T, T), dtype=bool))
        np.testing.assert_array_equal(~np.isnan(got), causal)
        np.testing.assert_allclose(np.nansum(got, axis=1), 1, atol=T * 5e-4)
        tri = maps["maps"][f"{step}/{layer}/{head}/{seq}"]
        np.testing.assert_allclose(got[causal], np.concatenate(tri) / 1000)  # thousandths
        assert shown_before is None or not np.array_equal(got[causal], shown_before)
        shown_before = got[causal]
        text = visit.readout("lm-attention")
        assert text.startswith(f"Step {steps[int(step)]}, layer {layer}, head {head}:"), text
        assert "score" in text
    assert steps[0] == 0 and steps == sorted(steps)


def _set_kv(visit, **s) -> str:
    """Set the KV calculator's controls (menus by value, sliders with the keyboard); its readout."""
    widget = visit.widget("kv-cache")
    for name in ("kvheads", "dh", "latent", "dtype", "share"):
        if name in s:
            visit.choose("kv-cache", name, s[name])
    for name in ("layers", "heads", "log2ctx", "batch"):
        if name in s:
            slider = widget.locator(f'input[name="{name}"]')
            low, high = int(slider.get_attribute("min")), int(slider.get_attribute("max"))
            if s[name] - low <= high - s[name]:  # from the nearer end: fewer key presses
                visit.slide("kv-cache", name, "Home")
                visit.slide("kv-cache", name, "ArrowRight", s[name] - low)
            else:
                visit.slide("kv-cache", name, "End")
                visit.slide("kv-cache", name, "ArrowLeft", high - s[name])
            assert int(slider.input_value()) == s[name]
    return visit.readout("kv-cache")


UNITS = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def test_kv_cache_calculator_matches_the_python_formula(desktop):
    visit = desktop("modern/kv-cache.html")
    settings = [
        dict(layers=32, heads=32, kvheads="8", dh="128", latent="0", dtype="2", log2ctx=15,
             batch=1, share="1"),
        dict(layers=80, heads=64, kvheads="0", dh="128", latent="0", dtype="4", log2ctx=12,
             batch=8, share="2"),
        dict(layers=61, heads=128, kvheads="1", dh="64", latent="512", dtype="1", log2ctx=17,
             batch=3, share="3"),
        dict(layers=24, heads=12, kvheads="16", dh="256", latent="0", dtype="2", log2ctx=20,
             batch=2, share="1"),
        dict(layers=1, heads=1, kvheads="1", dh="64", latent="0", dtype="1", log2ctx=10,
             batch=1, share="8"),
    ]  # fmt: skip
    for s in settings:
        text = _set_kv(visit, **s)
        kv = int(s["kvheads"])
        kv_heads = s["heads"] if kv == 0 else min(kv, s["heads"])
        shape = dict(
            layers=s["layers"],
            kv_heads=kv_heads,
            head_dim=int(s["dh"]),
            dtype_bytes=int(s["dtype"]),
            latent=int(s["latent"]),
            rope_dim=64 if int(s["latent"]) else 0,
            layers_per_cache=int(s["share"]),
        )
        want = kv_cache_bytes(2 ** s["log2ctx"], batch=s["batch"], **shape)
        per_token = int(re.search(r"([\d,]+) bytes per token", text).group(1).replace(",", ""))
        assert per_token == kv_cache_bytes(1, **shape), text
        amount, unit = re.search(r"= ([\d.]+) (bytes|[KMGT]iB)\.", text).groups()
        assert float(amount) * UNITS[unit] == pytest.approx(want, rel=5e-3), text
        assert 1 <= float(amount) < 1024 or unit == "bytes", text  # a readable unit
        point = visit.source("kv-cache", "point")
        assert point["y"][0] == pytest.approx(want / 2**30, rel=1e-12)


def test_kv_cache_calculator_speaks_the_books_words(desktop):
    visit = desktop("modern/kv-cache.html")
    widget = visit.widget("kv-cache")
    labels = " | ".join(widget.locator("label").all_inner_texts())
    assert "H_q" in labels and "H_kv" in labels and "GQA groups" not in labels, labels
    assert "sharing one KV cache" in labels, labels
    # plurals: one layer, one KV head, one byte, one sequence
    text = _set_kv(visit, layers=1, heads=4, kvheads="1", dh="64", latent="0", dtype="1",
                   batch=1, share="1", log2ctx=10)  # fmt: skip
    assert text.startswith("1 layer × 1 KV head × (64 + 64) × 1 byte = 128 bytes per token"), text
    assert "× 1 sequence =" in text
    # eight layers a cache, one layer: one cache
    assert _set_kv(visit, share="8").startswith("1 cache for 1 layer × 1 KV head ×")
    _set_kv(visit, share="1")
    for wrong in ("1 layers", "1 KV heads", "1 bytes", "1 sequences"):
        assert wrong not in text, text
    text = _set_kv(visit, layers=2, kvheads="2", dtype="2", batch=2)
    assert text.startswith("2 layers × 2 KV heads × (64 + 64) × 2 bytes ="), text
    assert "× 2 sequences =" in text
    # under GQA the query heads change nothing, and the readout says why
    _set_kv(visit, layers=32, heads=32, kvheads="8", dh="128", dtype="2", log2ctx=15)
    gqa = visit.readout("kv-cache")
    assert "H_q has no effect" in gqa and "G = 4" in gqa, gqa
    other = _set_kv(visit, heads=64)
    assert "G = 8" in other
    assert _numbers(other.split(".")[0]) == _numbers(gqa.split(".")[0])  # the same bytes
    # under multi-head attention they do, and no note says otherwise
    mha = _set_kv(visit, kvheads="0")
    assert "no effect" not in mha and "64 KV heads" in mha, mha
    # under MLA neither kind of head nor the head width matters
    mla = _set_kv(visit, latent="512")
    assert "MLA: H_q, H_kv and the head width have no effect" in mla, mla
    assert _set_kv(visit, dh="256", kvheads="2").split(". MLA")[0] == mla.split(". MLA")[0]
    _set_kv(visit, latent="0")
    # layers sharing one cache divide the bytes by the sharing
    one = _set_kv(visit, share="1", kvheads="8", dh="128", heads=32)
    per_one = int(re.search(r"([\d,]+) bytes per token", one).group(1).replace(",", ""))
    two = _set_kv(visit, share="2")
    per_two = int(re.search(r"([\d,]+) bytes per token", two).group(1).replace(",", ""))
    assert per_two * 2 == per_one and two.startswith("16 caches for 32 layers ×"), two
    # no more key/value heads than query heads
    assert "H_kv is at most H_q = 4" in _set_kv(visit, share="1", heads=4, kvheads="16")


def test_bokehjs_is_served_by_the_site_to_the_widget_pages_only(site):  # noqa: F811
    from importlib import metadata

    name = f"bokeh/bokeh-{metadata.version('bokeh')}.min.js"
    assert (SITE / "_static" / name).stat().st_size > 500_000
    for page in WIDGET_PAGES:
        html = (SITE / page).read_text(encoding="utf-8")
        assert f'data-bokeh="{name}"' in html, page  # fetched by sdpa-widgets.js, when near
        assert f'src="../_static/{name}' not in html, page  # never with the page itself
        assert "cdn.bokeh.org" not in html and "cdn.jsdelivr" not in html
        # the page's own data: at most 300 KB beyond the library
        start = html.index('<div class="sdpa-widget"')
        assert html.index("</script></div>", start) - start < 300_000, page
    assert "bokeh" not in (SITE / "index.html").read_text(encoding="utf-8")


def test_bokehjs_comes_when_a_widget_nears_the_screen(browser, server):
    # A reader who opens a widget page gets the text and the static picture; BokehJS (1.27 MB)
    # is fetched when a widget comes within 600 px of the screen, and the figure comes alive.
    far = 0
    for page in WIDGET_PAGES:
        context = browser.new_context(viewport=MODES["phone"]["viewport"], is_mobile=True)
        try:
            tab = context.new_page()
            fetched = []
            tab.on("request", lambda r, seen=fetched: "/bokeh/" in r.url and seen.append(r.url))
            tab.goto(f"{server}/{page}", wait_until="networkidle", timeout=TIMEOUT_MS)
            top = tab.locator(".sdpa-widget").first.evaluate("w => w.getBoundingClientRect().top")
            if top > MODES["phone"]["viewport"]["height"] + 700:  # far below the first screen
                far += 1
                assert not fetched, page
                assert tab.locator(".sdpa-widget-live").count() == 0
                assert tab.locator(".sdpa-widget-static").first.is_visible()
            tab.locator(".sdpa-widget").first.scroll_into_view_if_needed()
            tab.wait_for_selector(".sdpa-widget.sdpa-widget-live", timeout=TIMEOUT_MS)
            assert len(fetched) == 1, (page, fetched)
        finally:
            context.close()
    assert far >= 3  # most widgets sit below the first screen: the deferral is exercised
