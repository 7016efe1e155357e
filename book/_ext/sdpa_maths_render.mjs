// Typesets the book's formulas once, when the book is built, for book/_ext/sdpa_mathjax.py.
//
// Reads one JSON object on stdin:
//   {mathjax, font, width, ex, pages: [[[tex, display], ...], ...]}
// (the folders of the mathjax and @mathjax/mathjax-newcm-font npm packages, the width in CSS px
// at which a display formula breaks into lines, the x-height of the page's text in CSS px, and
// each page's formulas) and writes one on stdout:
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
const metrics = { em: 16, ex: request.ex, containerWidth: request.width };

// MathJax's markup, made smaller without changing what is drawn or read: in an HTML page an
// <svg> or <math> needs no namespace, <use> takes href, the colour and the relative position
// that MathJax repeats on every formula go once in the style sheet (see STYLE), and a <g> with
// no attribute groups nothing.
const SHORTER = [
  [/ xmlns(?::xlink)?="[^"]*"| role="img"| focusable="false"| unselectable="on"/g, ""],
  [/<g stroke="currentColor" fill="currentColor" stroke-width="0" /g, "<g "],
  [/<mjx-container class="MathJax" jax="SVG"(?: overflow="[a-z]+")?( display="true")? style="position: relative;">/g,
   '<mjx-container jax="SVG"$1>'],
  [/xlink:href=/g, "href="],
  [/><\/use>/g, "/>"],
];
const G_TAG = /<g>|<g [^>]*>|<\/g>|<g [^>]*><\/g>/g;
function shorter(markup) {
  for (const [pattern, replacement] of SHORTER) markup = markup.replace(pattern, replacement);
  // Drop each bare <g> with its </g>, and each empty group: a stack says which </g> is whose.
  const bare = [];
  markup = markup.replace(G_TAG, (tag) => {
    if (tag.endsWith("</g>") && tag !== "</g>") return "";  // <g ...></g>: draws nothing
    if (tag === "</g>") return bare.pop() ? "" : tag;
    bare.push(tag === "<g>");
    return tag === "<g>" ? "" : tag;
  });
  // A glyph moved by a group of its own: the move is the <use>'s x and y.
  return markup.replace(
    /<g transform="translate\((-?[\d.]+),(-?[\d.]+)\)">(<use href="[^"]+")\/><\/g>/g,
    (_, x, y, use) => `${use}${x === "0" ? "" : ` x="${x}"`}${y === "0" ? "" : ` y="${y}"`}/>`
  );
}
const STYLE = `
mjx-container[jax="SVG"] { position: relative; }
mjx-container[jax="SVG"] > svg { fill: currentColor; stroke: currentColor; stroke-width: 0; }
`;

// The promise form: a formula may need a TeX package or a range of the font loaded first (the
// plain form would throw MathJax's "retry" and leave that formula's measures half made).
const render = (tex, display) => MathJax.tex2svgPromise(tex, { display, ...metrics });

const pages = [];
for (const formulas of request.pages) {
  cache.clearCache();
  const errors = [];
  const html = [];
  for (const [tex, display] of formulas) {
    const node = await render(tex, display);
    const error = adaptor.tags(node, "mjx-merror")[0] || adaptor.tags(node, "merror")[0];
    if (error) errors.push(`${tex}: ${adaptor.getAttribute(error, "data-mjx-error") || adaptor.textContent(error)}`);
    html.push(shorter(adaptor.outerHTML(node).replace(UNUSED, "")));
  }
  pages.push({ html, glyphs: adaptor.outerHTML(cache.getCache()), errors });
}

process.stdout.write(
  JSON.stringify({ version: MathJax.version, css: adaptor.textContent(MathJax.svgStylesheet()) + STYLE, pages })
);
