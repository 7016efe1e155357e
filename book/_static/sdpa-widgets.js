/* The book's interactive figures (src/sdpa_book/widgets.py): each .sdpa-widget holds its Bokeh
   document, the states the package computed, and the code that shows the state its controls
   select. This script embeds the document with BokehJS (served from this site), connects the
   controls, and swaps the static picture for the live figure. Without BokehJS nothing changes:
   the static picture stays; with it, the picture is removed (not only hidden). */
(function () {
  "use strict";

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
    const show = new Function("v", "D", "model", spec.code);
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
        const v = controlValues(controls);
        controls.forEach(function (c) {
          const out = c.parentElement.querySelector("output");
          if (out) out.textContent = c.value;
        });
        readout.textContent = show(v, spec.data, model);
      }
      controls.forEach(function (c) {
        c.addEventListener("input", refresh);
        c.addEventListener("change", refresh);
      });
      refresh();
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

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", setupAll);
  } else {
    setupAll();
  }
})();
