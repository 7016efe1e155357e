/* The book's interactive figures (src/sdpa_book/widgets.py): each .sdpa-widget holds its Bokeh
   document, the states the package computed, and the code that shows the state its controls
   select. This script embeds the document with BokehJS (served from this site), connects the
   controls and their -/+ buttons, follows the theme (light or dark), and swaps the static picture
   for the live figure. Without BokehJS nothing changes: the static picture stays; with it, the
   picture is removed (not only hidden).
   BokehJS (1.27 MB) is fetched only when a widget comes near the screen, not with the page: a
   reader on a phone gets the text and the static picture first, and one who never scrolls to
   the figure never downloads it. */
(function () {
  "use strict";

  // The page's <script> tag names BokehJS relative to this file (sdpa_widgets.py).
  const SELF = document.currentScript;
  const NEAR = "600px 0px";  // load BokehJS when a widget is this close to the screen

  // The figures' colours in the dark theme, by Bokeh property: the light theme's are the ones the
  // document was written with. Data colours (cells, bars, lines) stay as they are.
  const DARK = {
    background_fill_color: "#1e2329",
    border_fill_color: "#1e2329",
    outline_line_color: "#9aa0a6",
    axis_line_color: "#c9d1d9",
    major_tick_line_color: "#c9d1d9",
    minor_tick_line_color: "#c9d1d9",
    major_label_text_color: "#e6edf3",
    axis_label_text_color: "#e6edf3",
    text_color: "#e6edf3",  // titles
    grid_line_color: "#6e7681",
  };
  // Glyph colours given as constants: black marks turn light, white separators turn dark.
  const DARK_GLYPH = { black: "#e6edf3", "#333333": "#c9d1d9", white: "#1e2329" };

  function isDark() {
    return document.documentElement.dataset.theme === "dark";
  }

  function themeDocument(doc) {
    const dark = isDark();
    for (const m of doc.all_models) {
      m.sdpaLight = m.sdpaLight || {};
      for (const name of Object.keys(m.properties || {})) {
        const glyph = name === "line_color" || name === "fill_color" || name === "color";
        if (!(name in DARK) && !glyph) continue;
        if (!(name in m.sdpaLight)) {
          const value = m[name];
          m.sdpaLight[name] = value !== null && typeof value === "object" ? value.value : value;
        }
        const light = m.sdpaLight[name];
        if (typeof light !== "string") continue;  // a field of the data, or none
        const want = !dark ? light : glyph ? DARK_GLYPH[light] : DARK[name];
        if (want !== undefined) m.setv({ [name]: want });
      }
    }
  }

  function controlValues(controls) {
    const v = {};
    controls.forEach(function (c) {
      v[c.name] = c.dataset.sdpaControl === "range" ? Number(c.value) : c.value;
    });
    return v;
  }

  function setup(root) {
    const spec = JSON.parse(root.querySelector("script.sdpa-widget-data").textContent);
    const plot = root.querySelector(".sdpa-widget-plot");
    const picture = root.querySelector(".sdpa-widget-static");
    const panel = root.querySelector(".sdpa-widget-controls");
    const readout = root.querySelector(".sdpa-widget-readout");
    const controls = Array.from(root.querySelectorAll("[data-sdpa-control]"));
    const buttons = Array.from(root.querySelectorAll("button[data-sdpa-step]"));
    // show(v, D, model, control): control(name) is the element, so that the code can set a
    // slider's range (the FlashAttention loop's number of tiles depends on the mask)
    const show = new Function("v", "D", "model", "control", spec.code);
    const control = function (name) {
      const found = controls.find(function (c) { return c.name === name; });
      if (!found) throw new Error("sdpa widget: no control named " + name);
      return found;
    };
    plot.hidden = false;
    return Bokeh.embed.embed_item(spec.item, plot.id).then(function () {
      const doc = Bokeh.documents.find(function (d) {
        return d.get_model_by_id(spec.item.root_id) !== null;
      });
      const model = function (name) {
        const found = doc.get_model_by_name(name);
        if (found === null) throw new Error("sdpa widget: no Bokeh model named " + name);
        return found;
      };
      function refresh() {
        readout.textContent = show(controlValues(controls), spec.data, model, control);
        controls.forEach(function (c) {  // after show(), which may have changed a range
          const out = c.parentElement.querySelector("output");
          if (out) out.textContent = c.value;
        });
        buttons.forEach(function (b) {
          const c = document.getElementById(b.getAttribute("aria-controls"));
          const end = b.dataset.sdpaStep === "1" ? c.max : c.min;
          b.disabled = Number(c.value) === Number(end);
        });
      }
      controls.forEach(function (c) {
        c.addEventListener("input", refresh);
        c.addEventListener("change", refresh);
      });
      buttons.forEach(function (b) {
        b.addEventListener("click", function () {
          const c = document.getElementById(b.getAttribute("aria-controls"));
          if (b.dataset.sdpaStep === "1") c.stepUp(); else c.stepDown();
          c.dispatchEvent(new Event("input", { bubbles: true }));
        });
      });
      refresh();
      themeDocument(doc);
      new MutationObserver(function () { themeDocument(doc); }).observe(
        document.documentElement, { attributes: true, attributeFilter: ["data-theme"] });
      root.sdpaModel = model;  // for the browser test: what the figure shows
      root.sdpaDocument = doc;
      panel.hidden = false;
      readout.hidden = false;
      if (picture) picture.remove();  // the live figure replaces it
      root.classList.add("sdpa-widget-live");
    });
  }

  function setupAll() {
    if (!window.Bokeh) return;
    document.querySelectorAll(".sdpa-widget").forEach(function (root) {
      setup(root).catch(function (error) {
        console.error("sdpa widget " + root.id + ": " + error);
      });
    });
  }

  function loadBokeh() {
    if (window.Bokeh) return setupAll();
    const tag = document.createElement("script");
    tag.src = new URL(SELF.dataset.bokeh, SELF.src).href;
    tag.addEventListener("load", setupAll);  // if it fails, the static pictures stay
    document.head.appendChild(tag);
  }

  function start() {
    const roots = document.querySelectorAll(".sdpa-widget");
    if (roots.length === 0) return;
    if (!("IntersectionObserver" in window)) return loadBokeh();
    const observer = new IntersectionObserver(function (entries) {
      if (!entries.some(function (e) { return e.isIntersecting; })) return;
      observer.disconnect();
      loadBokeh();
    }, { rootMargin: NEAR });
    roots.forEach(function (root) { observer.observe(root); });
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", start);
  } else {
    start();
  }
})();
