// MathJax 4 configuration of the sdpa book, loaded on every page before the deferred MathJax.
// MathJax and its font are copied from the npm packages into _static/mathjax by book/_ext/sdpa_mathjax.py, so
// every formula renders with no network, over http and from file://.
(function () {
  // Keep what Sphinx extensions configured before us (myst-nb tells MathJax which classes hold maths).
  const config = window.MathJax || {};
  config.loader = config.loader || {};
  // [mathjax] is the folder that tex-chtml.js was loaded from; the font sits beside it.
  config.loader.paths = Object.assign({}, config.loader.paths, { fonts: "[mathjax]/fonts" });
  // Long display formulas break across lines to fit the column (a phone included) instead of
  // hiding their end behind a scrollbar; in-line formulas may break at operators too.
  config.output = Object.assign(
    { font: "mathjax-newcm", displayOverflow: "linebreak", linebreaks: { inline: true, width: "100%" } },
    config.output
  );
  config.options = config.options || {};
  // MyST marks each page "mathjax_ignore" and lets MathJax into the elements it typeset itself
  // (processHtmlClass). Bibliography entries come from BibTeX, where $...$ is maths: let MathJax
  // into them too, and accept $ as a delimiter (a literal dollar there is written \$).
  const process = config.options.processHtmlClass || "tex2jax_process|mathjax_process|math|output_area";
  config.options.processHtmlClass = process + "|citation";
  config.tex = Object.assign({ inlineMath: [["\\(", "\\)"], ["$", "$"]], processEscapes: true }, config.tex);

  // Browsers refuse to start a Web Worker from a file:// page, and MathJax runs speech and
  // braille in one: with them on, MathJax.startup.promise never resolves. Over http they stay on.
  if (window.location.protocol === "file:") {
    config.options.enableSpeech = false;
    config.options.enableBraille = false;
    config.options.menuOptions = { settings: { speech: false, braille: false } };
  }
  window.MathJax = config;
})();
