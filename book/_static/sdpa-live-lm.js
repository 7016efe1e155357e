/* The book's trained language model, run in the reader's browser (book/lm/live-model.md).

   The page holds the model's float32 parameters and the grammar's automaton as JSON
   (src/sdpa_book/pages/live_model.py). This script reproduces sdpa.nn.DecoderLM.forward for the
   book's model, in float64 arithmetic from the float32 weights: token embedding; per block a
   pre-norm causal multi-head attention (layer norm, eps from the data; RoPE in the halves layout,
   pair i = features (i, i + Dk/2), angle t * base^(-2i/Dk); scores q.k / sqrt(Dk); softmax) and a
   pre-norm MLP with the tanh form of GELU; a final layer norm and the unembedding. Then it draws
   the reader's sentence, the next-word probabilities and every head's attention map, in plain
   HTML and SVG. window.sdpaLiveLM exposes the forward pass to the browser test. */
(function () {
  "use strict";

  // -- the model ------------------------------------------------------------------------------

  function decodeWeights(b64) {
    const bytes = Uint8Array.from(atob(b64), (c) => c.charCodeAt(0));
    return new Float32Array(bytes.buffer); // little-endian, as every browser's platform
  }

  function Model(data) {
    const flat = decodeWeights(data.weights);
    this.config = data.config;
    this.p = {};
    for (const [name, [offset, shape]] of Object.entries(data.params)) {
      const size = shape.reduce((a, b) => a * b, 1);
      this.p[name] = flat.subarray(offset, offset + size);
    }
  }

  // rows (T x n, an array of Float64Array) times W (n x m, row-major), plus an optional bias
  function matmul(rows, W, m, bias) {
    return rows.map((x) => {
      const out = new Float64Array(m);
      if (bias) for (let j = 0; j < m; j++) out[j] = bias[j];
      for (let i = 0; i < x.length; i++) {
        const xi = x[i], base = i * m;
        for (let j = 0; j < m; j++) out[j] += xi * W[base + j];
      }
      return out;
    });
  }

  function layerNorm(rows, w, b, eps) {
    return rows.map((x) => {
      const n = x.length;
      let mean = 0;
      for (let i = 0; i < n; i++) mean += x[i];
      mean /= n;
      let v = 0;
      for (let i = 0; i < n; i++) v += (x[i] - mean) * (x[i] - mean);
      const r = 1 / Math.sqrt(v / n + eps);
      const out = new Float64Array(n);
      for (let i = 0; i < n; i++) out[i] = (x[i] - mean) * r * w[i] + b[i];
      return out;
    });
  }

  function gelu(u) {
    return 0.5 * u * (1 + Math.tanh(Math.sqrt(2 / Math.PI) * (u + 0.044715 * u * u * u)));
  }

  // Head h's slice of row x (features h Dk .. (h+1) Dk), rotated for position t (RoPE).
  function headRow(x, h, Dk, t, base, rotate) {
    const v = x.slice(h * Dk, (h + 1) * Dk);
    if (!rotate) return v;
    const half = Dk / 2, out = new Float64Array(Dk);
    for (let i = 0; i < half; i++) {
      const angle = t * Math.pow(base, -(2 * i) / Dk);
      const c = Math.cos(angle), s = Math.sin(angle);
      out[i] = v[i] * c - v[i + half] * s;
      out[i + half] = v[i] * s + v[i + half] * c;
    }
    return out;
  }

  // tokens: array of ids. Returns {logits: T arrays of V, attention: [layer][head][query] rows of
  // length T (zero beyond the query: causal)}.
  Model.prototype.forward = function (tokens) {
    const c = this.config, p = this.p, E = c.d_model, H = c.n_heads, Dk = c.head_dim;
    const T = tokens.length;
    let x = tokens.map((t) => Float64Array.from(p.token_embedding.subarray(t * E, (t + 1) * E)));
    const attention = [];
    for (let l = 0; l < c.n_layers; l++) {
      const pre = "blocks." + l + ".";
      const h = layerNorm(x, p[pre + "attn_norm.weight"], p[pre + "attn_norm.bias"], c.eps);
      const q = matmul(h, p[pre + "attn.w_q"], H * Dk);
      const k = matmul(h, p[pre + "attn.w_k"], H * Dk);
      const v = matmul(h, p[pre + "attn.w_v"], H * Dk);
      const merged = x.map(() => new Float64Array(H * Dk));
      const maps = [];
      for (let hd = 0; hd < H; hd++) {
        const qs = q.map((r, t) => headRow(r, hd, Dk, t, c.rope_base, true));
        const ks = k.map((r, t) => headRow(r, hd, Dk, t, c.rope_base, true));
        const vs = v.map((r, t) => headRow(r, hd, Dk, t, c.rope_base, false));
        const rows = [];
        for (let i = 0; i < T; i++) {
          const z = new Float64Array(T);
          let top = -Infinity;
          for (let j = 0; j <= i; j++) {
            let s = 0;
            for (let d = 0; d < Dk; d++) s += qs[i][d] * ks[j][d];
            z[j] = s / Math.sqrt(Dk);
            top = Math.max(top, z[j]);
          }
          let sum = 0;
          for (let j = 0; j <= i; j++) sum += (z[j] = Math.exp(z[j] - top));
          for (let j = 0; j <= i; j++) z[j] /= sum;
          for (let j = i + 1; j < T; j++) z[j] = 0;
          for (let j = 0; j <= i; j++) {
            for (let d = 0; d < Dk; d++) merged[i][hd * Dk + d] += z[j] * vs[j][d];
          }
          rows.push(z);
        }
        maps.push(rows);
      }
      attention.push(maps);
      const o = matmul(merged, p[pre + "attn.w_o"], E);
      x = x.map((r, t) => r.map((xi, e) => xi + o[t][e]));
      const h2 = layerNorm(x, p[pre + "mlp_norm.weight"], p[pre + "mlp_norm.bias"], c.eps);
      const u = matmul(h2, p[pre + "mlp.w_in"], c.d_ff, p[pre + "mlp.b_in"]).map((r) => r.map(gelu));
      const m = matmul(u, p[pre + "mlp.w_out"], E, p[pre + "mlp.b_out"]);
      x = x.map((r, t) => r.map((xi, e) => xi + m[t][e]));
    }
    const hf = layerNorm(x, p["final_norm.weight"], p["final_norm.bias"], c.eps);
    return { logits: matmul(hf, p.unembedding, c.vocab_size), attention: attention };
  };

  function softmax(logits) {
    const top = Math.max(...logits);
    const e = Array.from(logits, (z) => Math.exp(z - top));
    const s = e.reduce((a, b) => a + b, 0);
    return e.map((x) => x / s);
  }

  // -- the widget -----------------------------------------------------------------------------

  // A light sequential ramp (white to the book's dark blue), as the book's heatmaps read.
  function colour(w) {
    const a = [255, 255, 255], b = [8, 48, 107];
    const t = Math.sqrt(Math.max(0, Math.min(1, w)));
    return "rgb(" + a.map((x, i) => Math.round(x + (b[i] - x) * t)).join(",") + ")";
  }

  function el(tag, attrs, children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined) continue;
      if (k === "text") node.textContent = v;
      else if (k === "on") for (const [ev, f] of Object.entries(v)) node.addEventListener(ev, f);
      else node.setAttribute(k, v);
    }
    for (const child of children || []) node.append(child);
    return node;
  }

  const SVG = "http://www.w3.org/2000/svg";
  function svg(tag, attrs) {
    const node = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs || {})) node.setAttribute(k, v);
    return node;
  }

  function heatmap(rows, words, cell, labelled) {
    const T = words.length, left = labelled ? 66 : 0, bottom = labelled ? 66 : 0;
    const root = svg("svg", {
      width: left + T * cell, height: T * cell + bottom, role: "img", class: "sdpa-live-map",
    });
    for (let i = 0; i < T; i++) {
      for (let j = 0; j < T; j++) {
        const masked = j > i;
        const rect = svg("rect", {
          x: left + j * cell, y: i * cell, width: cell, height: cell,
          fill: masked ? "#d9d9d9" : colour(rows[i][j]),
        });
        if (labelled && !masked) {
          const tip = svg("title");
          tip.textContent = words[i] + " \u2192 " + words[j] + ": " + rows[i][j].toFixed(3);
          rect.append(tip);
        }
        root.append(rect);
      }
    }
    if (labelled) {
      words.forEach((w, i) => {
        const row = svg("text", {
          x: left - 4, y: i * cell + cell / 2, "text-anchor": "end", "dominant-baseline": "central",
        });
        row.textContent = w;
        const col = svg("text", {
          x: 0, y: 0, "text-anchor": "end", "dominant-baseline": "central",
          transform: "translate(" + (left + j0(i, cell)) + "," + (T * cell + 4) + ") rotate(-90)",
        });
        col.textContent = w;
        root.append(row, col);
      });
    }
    return root;
  }
  function j0(j, cell) {
    return j * cell + cell / 2;
  }

  function Widget(root) {
    const data = JSON.parse(root.querySelector("script.sdpa-live-lm-data").textContent);
    this.root = root;
    this.data = data;
    this.model = new Model(data);
    this.vocab = data.vocab;
    this.index = Object.fromEntries(data.vocab.map((w, i) => [w, i]));
    this.words = data.starters[0].split(" ");
    const first = data.heads && data.heads.length ? data.heads[0] : { layer: 0, head: 0 };
    this.layer = first.layer;
    this.head = first.head;
    this.showAll = false;
    this.build();
    this.typed.value = this.words.join(" ");
    this.update();
  }

  Widget.prototype.grammarState = function (words) {
    let s = this.data.grammar.start;
    for (const w of words) {
      const step = this.data.grammar.states[s][w];
      if (!step) return null;
      s = step[0];
    }
    return s;
  };

  Widget.prototype.build = function () {
    const self = this, root = this.root;
    root.querySelector(".sdpa-live-static").remove();
    this.sentence = el("div", { class: "sdpa-live-sentence", "aria-live": "polite" });
    this.typed = el("input", {
      type: "text", id: "sdpa-live-typed", autocomplete: "off", spellcheck: "false",
      "aria-describedby": "sdpa-live-note",
      on: { input: () => self.fromText(self.typed.value) },
    });
    this.note = el("p", { class: "sdpa-live-note", id: "sdpa-live-note" });
    const back = el("button", {
      type: "button", class: "sdpa-live-action", text: "\u232b word", "aria-label": "Remove the last word",
      on: { click: () => self.setWords(self.words.slice(0, -1)) },
    });
    const clear = el("button", {
      type: "button", class: "sdpa-live-action", text: "Clear",
      on: { click: () => self.setWords([]) },
    });
    const starters = el("div", { class: "sdpa-live-row" }, [el("span", { class: "sdpa-live-label", text: "Start from:" })]);
    for (const s of this.data.starters) {
      starters.append(el("button", {
        type: "button", class: "sdpa-live-starter", text: s + " \u2026",
        on: { click: () => self.setWords(s.split(" ")) },
      }));
    }
    this.wordButtons = el("div", { class: "sdpa-live-words" });
    const all = el("input", {
      type: "checkbox", id: "sdpa-live-all",
      on: { change: () => { self.showAll = all.checked; self.update(); } },
    });
    this.next = el("ol", { class: "sdpa-live-next" });
    this.thumbs = el("div", { class: "sdpa-live-thumbs" });
    this.map = el("div", { class: "sdpa-live-mapbox" });
    this.readout = el("p", { class: "sdpa-live-readout", "aria-live": "polite" });
    root.append(
      el("p", { class: "sdpa-live-title", text: "The trained model, running in this page" }),
      el("div", { class: "sdpa-live-row" }, [this.sentence, back, clear]),
      el("div", { class: "sdpa-live-row" }, [
        el("label", { for: "sdpa-live-typed", class: "sdpa-live-label", text: "Or type:" }), this.typed,
      ]),
      this.note,
      starters,
      el("div", { class: "sdpa-live-row" }, [
        el("span", { class: "sdpa-live-label", text: "Add a word:" }),
        el("label", { class: "sdpa-live-check", for: "sdpa-live-all" }, [all, " every word, not only the grammar's"]),
      ]),
      this.wordButtons,
      el("p", { class: "sdpa-live-heading", text: "The model's most likely next words (tap to add):" }),
      this.next,
      el("p", { class: "sdpa-live-heading", text: "Every head's attention (rows: queries, columns: keys); tap a head to enlarge it:" }),
      this.thumbs,
      this.map,
      this.readout,
    );
    root.classList.add("sdpa-live-ready");
    window.addEventListener("resize", () => self.drawMaps());
  };

  Widget.prototype.fromText = function (text) {
    const tokens = text.replace(/\./g, " . ").toLowerCase().split(/\s+/).filter(Boolean);
    const unknown = tokens.filter((w) => !(w in this.index));
    const known = tokens.filter((w) => w in this.index).slice(0, this.data.config.max_len);
    this.setWords(known, true);
    if (unknown.length) {
      const said = "Not in the model's vocabulary, left out: " + unknown.join(", ") + ".";
      this.note.textContent = (said + " " + this.note.textContent).trim();
    }
  };

  Widget.prototype.setWords = function (words, typing) {
    this.words = words.slice(0, this.data.config.max_len);
    if (!typing) this.typed.value = this.words.join(" ");
    this.update();
  };

  Widget.prototype.update = function () {
    const self = this, words = this.words, max = this.data.config.max_len;
    this.sentence.textContent = words.length ? words.join(" ") : "(no words yet: tap or type one)";
    const state = this.grammarState(words);
    const allowed = state === null ? {} : this.data.grammar.states[state];
    const notes = [];
    if (state === null) notes.push("This is not a sentence of the training grammar; the model still predicts.");
    if (words.length >= max) notes.push("The model reads at most " + max + " words.");
    this.note.textContent = notes.join(" ");
    // the word buttons: the grammar's next words, or every word, by class
    this.wordButtons.replaceChildren();
    for (const [cls, list] of Object.entries(this.data.classes)) {
      const shown = list.filter((w) => self.showAll || w in allowed);
      if (!shown.length) continue;
      const group = el("div", { class: "sdpa-live-group" }, [el("span", { class: "sdpa-live-class", text: cls })]);
      for (const w of shown) {
        group.append(el("button", {
          type: "button", class: "sdpa-live-word" + (w in allowed ? " sdpa-live-allowed" : ""),
          "data-word": w, text: w, disabled: words.length >= max ? "disabled" : null,
          on: { click: () => self.setWords(words.concat([w])) },
        }));
      }
      this.wordButtons.append(group);
    }
    this.next.replaceChildren();
    this.result = null;
    if (!words.length) {
      this.thumbs.replaceChildren();
      this.map.replaceChildren();
      this.readout.textContent = "The model predicts from the first word on.";
      return;
    }
    this.result = this.model.forward(words.map((w) => this.index[w]));
    const probs = softmax(this.result.logits[words.length - 1]);
    const order = probs.map((p, i) => i).sort((a, b) => probs[b] - probs[a] || a - b).slice(0, 8);
    for (const i of order) {
      const w = this.vocab[i], g = allowed[w];
      const item = el("li", {}, [el("button", {
        type: "button", class: "sdpa-live-choice", "data-word": w, "data-p": String(probs[i]),
        disabled: words.length >= max ? "disabled" : null,
        on: { click: () => self.setWords(words.concat([w])) },
      }, [
        el("span", { class: "sdpa-live-w", text: w }),
        el("span", { class: "sdpa-live-bar" }, [el("span", { style: "width:" + (100 * probs[i]).toFixed(1) + "%" })]),
        el("span", { class: "sdpa-live-p", text: probs[i].toFixed(3) }),
        el("span", { class: "sdpa-live-g", text: "grammar " + (g ? g[1].toFixed(3) : "0") }),
      ])]);
      this.next.append(item);
    }
    this.drawMaps();
  };

  Widget.prototype.drawMaps = function () {
    if (!this.result) return;
    const self = this, words = this.words, T = words.length, att = this.result.attention;
    this.thumbs.replaceChildren();
    att.forEach((maps, l) => maps.forEach((rows, h) => {
      const name = (this.data.heads || []).find((x) => x.layer === l && x.head === h);
      const pressed = l === this.layer && h === this.head;
      const cell = Math.max(1, Math.floor(56 / T));
      this.thumbs.append(el("button", {
        type: "button", class: "sdpa-live-thumb", "aria-pressed": String(pressed),
        "data-head": l + "." + h,
        "aria-label": "Head " + l + "." + h + (name ? ", " + name.name : ""),
        on: { click: () => { self.layer = l; self.head = h; self.drawMaps(); } },
      }, [el("span", { text: l + "." + h }), heatmap(rows, words, cell, false)]));
    }));
    const rows = att[this.layer][this.head];
    const width = Math.max(200, this.map.clientWidth || this.root.clientWidth || 320) - 70;
    const cell = Math.max(12, Math.min(26, Math.floor(width / T)));
    const big = heatmap(rows, words, cell, true);
    const name = (this.data.heads || []).find((x) => x.layer === this.layer && x.head === this.head);
    big.setAttribute("aria-label", "Attention map of head " + this.layer + "." + this.head);
    this.map.replaceChildren(el("p", {
      class: "sdpa-live-heading",
      text: "Head " + this.layer + "." + this.head + (name ? " (" + name.name + ")" : ""),
    }), big);
    const last = rows[T - 1];
    let best = 0;
    for (let j = 1; j < T; j++) if (last[j] > last[best]) best = j;
    this.readout.textContent = "Head " + this.layer + "." + this.head + ": from the last word, \u201c" +
      words[T - 1] + "\u201d, most weight (" + last[best].toFixed(2) + ") on \u201c" + words[best] +
      "\u201d (position " + best + ").";
  };

  // -- start ----------------------------------------------------------------------------------

  const widgets = [];
  function start() {
    for (const root of document.querySelectorAll(".sdpa-live-lm:not(.sdpa-live-ready)")) {
      widgets.push(new Widget(root));
    }
    window.sdpaLiveLM = {
      widgets: widgets,
      // the forward pass on token ids (or words): plain arrays, for the browser test
      forward: (tokens) => {
        const w = widgets[0];
        const ids = tokens.map((t) => (typeof t === "string" ? w.index[t] : t));
        const r = w.model.forward(ids);
        return {
          logits: r.logits.map((x) => Array.from(x)),
          attention: r.attention.map((maps) => maps.map((rows) => rows.map((x) => Array.from(x)))),
        };
      },
      setWords: (words) => widgets[0].setWords(words),
    };
  }
  if (document.readyState === "loading") document.addEventListener("DOMContentLoaded", start);
  else start();
})();
