// Two fixes of the text as readers meet it: search snippets (below) and inline maths that keep
// their punctuation (at the end).
//
// Search results show a snippet of each page: Sphinx takes it from the page's main region, which
// in this theme also holds the header's buttons ("Light", "Dark"), the page's own table of
// contents (for print), and the TeX of formulas (the search index holds it as written).
// Keep the prose, and write each formula as plain text.
(function () {
  const NOT_PROSE = [
    ".bd-header-article", ".header-article-items", ".bd-sidebar-secondary", ".bd-toc",
    ".theme-switch-button", ".dropdown", "nav", ".onlyprint", "div.cell_input",
    ".toctree-wrapper", ".admonition.overview", ".prev-next-area", "footer", "div.highlight",
  ].join(", ");

  // \(Q K^\top / \sqrt{D_k}\) -> Q Kᵀ / √Dk: enough to read a snippet. Greek letters, named
  // operators, roots and fractions keep a written form, so that no formula leaves a gap in the
  // prose (a snippet is plain text: the search page does not typeset it).
  const SYMBOLS = {
    "\\top": "ᵀ", "\\cdot": "·", "\\times": "×", "\\to": "→", "\\le": "≤", "\\leq": "≤",
    "\\ge": "≥", "\\geq": "≥", "\\ne": "≠", "\\neq": "≠", "\\infty": "∞", "\\sum": "Σ",
    "\\prod": "Π", "\\approx": "≈", "\\in": "∈", "\\pm": "±", "\\partial": "∂", "\\odot": "⊙",
    "\\otimes": "⊗", "\\circ": "∘", "\\sim": "∼", "\\propto": "∝", "\\ell": "ℓ", "\\nabla": "∇",
    "\\ldots": "…", "\\dots": "…", "\\cdots": "…", "\\lVert": "‖", "\\rVert": "‖", "\\Vert": "‖",
    "\\lceil": "⌈", "\\rceil": "⌉", "\\lfloor": "⌊", "\\rfloor": "⌋", "\\mid": "|",
    "\\vert": "|", "\\quad": " ", "\\qquad": " ", "\\alpha": "α", "\\beta": "β",
    "\\gamma": "γ", "\\delta": "δ", "\\epsilon": "ε", "\\varepsilon": "ε", "\\eta": "η",
    "\\theta": "θ", "\\kappa": "κ", "\\lambda": "λ", "\\mu": "μ", "\\pi": "π", "\\rho": "ρ",
    "\\sigma": "σ", "\\tau": "τ", "\\phi": "φ", "\\varphi": "φ", "\\psi": "ψ", "\\omega": "ω",
    "\\Delta": "Δ", "\\Theta": "Θ", "\\Lambda": "Λ", "\\Sigma": "Σ", "\\Phi": "Φ", "\\Omega": "Ω",
    "\\Pi": "Π", "\\Psi": "Ψ", "\\Gamma": "Γ", "\\nu": "ν", "\\xi": "ξ", "\\zeta": "ζ",
    "\\chi": "χ", "\\oplus": "⊕", "\\cup": "∪", "\\cap": "∩", "\\emptyset": "∅",
  };
  // Commands whose name is the word they print: \log z -> log z.
  const NAMED = /\\(log|ln|exp|max|min|sin|cos|tanh|arg|lim|det)(?![a-zA-Z])/g;
  // Commands that only style their argument: \operatorname{lse} -> lse.
  const STYLE = /\\(?:operatorname|mathrm|text|textbf|mathbf|mathit|mathcal|mathbb|boldsymbol)\*?\s*\{([^{}]*)\}/g;
  // A root or a fraction's part longer than one symbol is bracketed: √(2E), (a + b) / 2.
  const group = (a) => (/[\s+\-−·×/]/.test(a.trim()) ? `(${a.trim()})` : a.trim());
  function texToText(tex) {
    // a literal brace, \{, survives as one (set aside while groups are unwrapped)
    let text = tex.replace(/\\[()\[\]]|\$\$?/g, "").replace(/\\\{/g, "\u0001").replace(/\\\}/g, "\u0002");
    text = text.replace(/\\(?:left|right|bigg|Bigg|big|Big)(?![a-zA-Z])/g, "");
    text = text.replace(/\^\s*\\top(?![a-zA-Z])/g, "ᵀ");  // x^\top -> xᵀ
    for (const [command, symbol] of Object.entries(SYMBOLS)) {
      text = text.replace(new RegExp(command.replace(/\\/g, "\\\\") + "(?![a-zA-Z])", "g"), symbol);
    }
    text = text.replace(NAMED, "$1 ");
    let before;
    do {  // innermost braces first, until none is left
      before = text;
      text = text.replace(STYLE, "$1");
      text = text.replace(/\\sqrt\s*\{([^{}]*)\}/g, (_, a) => `√${group(a)}`);
      text = text.replace(/\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}/g,
                          (_, a, b) => `${group(a)} / ${group(b)}`);
      // a superscript stays one (e^(-2000), s^2); a subscript joins its base (D_k -> Dk)
      text = text.replace(/\^\{([^{}]*)\}/g, (_, a) => `^${group(a)}`);
      text = text.replace(/_\{([^{}]*)\}/g, "$1").replace(/(^|[^\\^])\{([^{}]*)\}/g, "$1$2");
    } while (text !== before);
    return text.replace(/\\[a-zA-Z]+\*?/g, "").replace(/\\./g, "").replace(/[{}_&\\]/g, "")
      .replace(/~/g, " ").replace(/\u0001/g, "{").replace(/\u0002/g, "}").replace(/\s+/g, " ").trim();
  }

  function keepProse() {
    if (typeof Search === "undefined" || !Search.htmlToText || Search.htmlToText.sdpaProse) return;
    const original = Search.htmlToText;
    Search.htmlToText = function (htmlString, anchor) {
      const page = new DOMParser().parseFromString(htmlString, "text/html");
      page.querySelectorAll(NOT_PROSE).forEach((node) => node.remove());
      page.querySelectorAll(".math").forEach((node) => {
        const text = texToText(node.textContent);  // prose keeps its own spaces around inline maths
        node.textContent = node.tagName === "SPAN" ? text : ` ${text} `;
      });
      return original.call(this, page.documentElement.outerHTML, anchor).replace(/\s+/g, " ");
    };
    Search.htmlToText.sdpaProse = true;
  }
  // searchtools.js is loaded after this file and searches once the document is ready.
  document.addEventListener("DOMContentLoaded", keepProse);
})();

// Inline maths keep the punctuation that follows them. A typeset formula is an inline box, and a
// browser may break the line between it and the comma after it, which then opens the next line.
// The formula and its punctuation go into one span that does not wrap (sdpa.css), while the
// formula itself may still break inside. Loaded on every page, with the snippets above.
(function () {
  const PUNCTUATION = /^[,.;:!?)\]’”]+/;
  function keepPunctuation() {
    document.querySelectorAll("span.math").forEach((math) => {
      // A formula that is all of a link ([$E$](...), then a comma) brings its link along.
      let unit = math;
      while (!unit.nextSibling && unit.parentElement.childNodes.length === 1
             && /^(A|SPAN|EM|STRONG)$/.test(unit.parentElement.tagName)) {
        unit = unit.parentElement;
      }
      const next = unit.nextSibling;
      if (!next || next.nodeType !== Node.TEXT_NODE) return;
      const mark = next.textContent.match(PUNCTUATION);
      if (!mark || unit.parentElement.classList.contains("math-punct")) return;
      const pair = document.createElement("span");
      pair.className = "math-punct";
      unit.before(pair);
      pair.append(unit, mark[0]);
      next.textContent = next.textContent.slice(mark[0].length);
    });
  }
  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", keepPunctuation);
  } else {
    keepPunctuation();
  }
})();
