// Search results show a snippet of each page: Sphinx takes it from the page's main region, which
// in this theme also holds the header's buttons ("Light", "Dark"), the page's own table of
// contents (for print), and the raw TeX of formulas (MathJax typesets them only in a browser).
// Keep the prose, and write each formula as plain text.
(function () {
  const NOT_PROSE = [
    ".bd-header-article", ".header-article-items", ".bd-sidebar-secondary", ".bd-toc",
    ".theme-switch-button", ".dropdown", "nav", ".onlyprint", "div.cell_input",
    ".toctree-wrapper", ".admonition.overview", ".prev-next-area", "footer", "div.highlight",
  ].join(", ");

  // \(Q K^\top / \sqrt{D_k}\) -> Q Kᵀ / √Dk: enough to read a snippet.
  const SYMBOLS = { "\\top": "ᵀ", "\\sqrt": "√", "\\cdot": "·", "\\times": "×", "\\to": "→",
                    "\\le": "≤", "\\ge": "≥", "\\ne": "≠", "\\infty": "∞", "\\sum": "Σ" };
  function texToText(tex) {
    let text = tex.replace(/\\[()\[\]]|\$\$?/g, "");
    for (const [command, symbol] of Object.entries(SYMBOLS)) {
      text = text.replace(new RegExp(command.replace(/\\/g, "\\\\") + "(?![a-zA-Z])", "g"), symbol);
    }
    return text.replace(/\\[a-zA-Z]+\*?/g, "").replace(/[{}^_]|\\[,;!]/g, "").replace(/\s+/g, " ").trim();
  }

  function keepProse() {
    if (typeof Search === "undefined" || !Search.htmlToText || Search.htmlToText.sdpaProse) return;
    const original = Search.htmlToText;
    Search.htmlToText = function (htmlString, anchor) {
      const page = new DOMParser().parseFromString(htmlString, "text/html");
      page.querySelectorAll(NOT_PROSE).forEach((node) => node.remove());
      page.querySelectorAll(".math").forEach((node) => {
        node.textContent = ` ${texToText(node.textContent)} `;
      });
      return original.call(this, page.documentElement.outerHTML, anchor).replace(/\s+/g, " ");
    };
    Search.htmlToText.sdpaProse = true;
  }
  // searchtools.js is loaded after this file and searches once the document is ready.
  document.addEventListener("DOMContentLoaded", keepProse);
})();
