"""The book's figure style: colours with fixed roles, font sizes, SVG output.

Importing ``sdpa_book`` applies :func:`apply_style`: Matplotlib's defaults become the book's
(fonts of at least 9 pt, the colour-blind-safe Okabe-Ito cycle, white backgrounds) and, inside a
Jupyter kernel, figures are emitted as SVG, crisp on any screen. Figures themselves are drawn with
``sdpa.plotting`` (``new_figure``, ``heatmap``, ``mask_plot``) and the diagrams of
``sdpa_book.diagrams``.
"""

from __future__ import annotations

from sdpa.plotting import ALLOWED_COLOR, MASKED_COLOR, MAX_WIDTH

__all__ = [
    "ALLOWED_COLOR",
    "COLORS",
    "FULL_WIDTH",
    "KEY",
    "MASKED_COLOR",
    "MIN_FONT_PT",
    "OUTPUT",
    "QUERY",
    "VALUE",
    "apply_style",
]

FULL_WIDTH = MAX_WIDTH  # inches; a multi-panel figure spans the content column
MIN_FONT_PT = 9  # no text smaller; figures are not shrunk at 1280 px, so none renders under 9 px

# Okabe & Ito (2008), "Color universal design": distinguishable with every common colour-vision
# deficiency. Order: blue, orange, bluish green, vermillion, reddish purple, sky blue, yellow, black.
COLORS = ["#0072b2", "#e69f00", "#009e73", "#d55e00", "#cc79a7", "#56b4e9", "#f0e442", "#000000"]

# Roles, the same in every plot and diagram of the book.
QUERY = "#e69f00"  # orange
KEY = "#0072b2"  # blue
VALUE = "#009e73"  # bluish green
OUTPUT = "#cc79a7"  # reddish purple

STYLE = {
    "font.size": 10,
    "axes.titlesize": 10,
    "axes.labelsize": 10,
    "xtick.labelsize": MIN_FONT_PT,
    "ytick.labelsize": MIN_FONT_PT,
    "legend.fontsize": MIN_FONT_PT,
    "legend.title_fontsize": MIN_FONT_PT,
    "figure.titlesize": 11,
    "figure.facecolor": "white",
    "axes.facecolor": "white",
    "savefig.facecolor": "white",
    "svg.fonttype": "path",  # text as outlines: the same glyphs on every reader's machine
    "svg.hashsalt": "sdpa",  # deterministic ids, so rebuilt figures are byte-identical
    "axes.spines.top": False,
    "axes.spines.right": False,
    "lines.linewidth": 1.8,
}


def apply_style() -> None:
    """Set the book's Matplotlib defaults; in a Jupyter kernel, also emit figures as SVG.

    Examples
    --------
    >>> import matplotlib as mpl
    >>> from sdpa_book.figures import apply_style, MIN_FONT_PT
    >>> apply_style()
    >>> mpl.rcParams["xtick.labelsize"] == MIN_FONT_PT
    True
    """
    import matplotlib as mpl
    from cycler import cycler

    mpl.rcParams.update(STYLE)
    mpl.rcParams["axes.prop_cycle"] = cycler(color=COLORS)
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover - IPython comes with Jupyter
        return
    shell = get_ipython()
    if shell is not None and "IPKernelApp" in shell.config:
        from matplotlib_inline.backend_inline import set_matplotlib_formats

        set_matplotlib_formats("svg")
