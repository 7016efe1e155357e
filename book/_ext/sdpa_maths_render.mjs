// Typesets the book's formulas once, when the book is built, for book/_ext/sdpa_mathjax.py.
//
// Reads one JSON object on stdin:
//   {mathjax, font, width, pages: [[[tex, display], ...], ...]}
// (the folders of the mathjax and @mathjax/mathjax-newcm-font npm packages, the width in CSS px
// at which a display formula breaks into lines, and each page's formulas) and writes one on stdout:
//   {version, css, pages: [{html: [...], glyphs, errors: [...]}, ...]}
// where html[i] is formula i as an SVG with its MathML beside it for screen readers (MathJax's
// assistive MathML), glyphs is the page's shared <defs> of glyph outlines (a formula draws its
// glyphs by reference, so a glyph used a hundred times on a page is stored once), and css is the
// stylesheet the output needs. SVG output needs no web font; the reader's browser runs no MathJax.
import { pathToFileURL } from "node:url";
import path from "node:path";

const chunks = [];
for await (const chunk of process.stdin) chunks.push(chunk);
const request = JSON.parse(Buffer.concat(chunks).toString("utf8"));

const { default: MathJax } = await import(pathToFileURL(path.join(request.mathjax, "node-main.mjs")).href);
await MathJax.init({
  loader: {
    load: ["input/tex", "output/svg", "a11y/assistive-mml"],
    paths: { mathjax: request.mathjax, "mathjax-newcm": request.font },
  },
  // An unknown macro is an error (not red text in the page) so that the build reports it.
  tex: { packages: { "[-]": ["noundefined"] } },
  output: {
    font: "mathjax-newcm",
    fontCache: "global",
    // A long display formula breaks into lines at the desktop column's width (on a phone its
    // container scrolls, see sdpa-maths.css); in-line formulas may break at operators, so a
    // paragraph wraps as it did when MathJax ran in the browser.
    displayOverflow: "linebreak",
    linebreaks: { inline: true, width: "100%" },
  },
});

const adaptor = MathJax.startup.adaptor;
const cache = MathJax.startup.output.fontCache;
// Attributes that only MathJax's in-browser explorer and menu read: dropping them halves the
// markup (data-latex repeats the whole formula on every piece of a broken in-line formula).
const UNUSED = / data-(?:latex|mml-node|c|mjx-texclass|semantic-[a-z-]+)="[^"]*"/g;
const metrics = { em: 16, ex: 8, containerWidth: request.width };

const pages = request.pages.map((formulas) => {
  cache.clearCache();
  const errors = [];
  const html = formulas.map(([tex, display]) => {
    const node = MathJax.tex2svg(tex, { display, ...metrics });
    const error = adaptor.tags(node, "mjx-merror")[0] || adaptor.tags(node, "merror")[0];
    if (error) errors.push(`${tex}: ${adaptor.getAttribute(error, "data-mjx-error") || adaptor.textContent(error)}`);
    return adaptor.outerHTML(node).replace(UNUSED, "");
  });
  const defs = adaptor.outerHTML(cache.getCache());
  return { html, glyphs: defs, errors };
});

process.stdout.write(
  JSON.stringify({ version: MathJax.version, css: adaptor.textContent(MathJax.svgStylesheet()), pages })
);
