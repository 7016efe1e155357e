"""Interactive figures of the book: every state computed by ``sdpa`` while the page runs.

A widget is a figure with controls (sliders and menus, the browser's own form controls, so that
keyboards and screen readers work with them as with any form) and a text readout of what the
figure shows, announced to screen readers when it changes. Its figure is drawn by Bokeh in the
reader's browser; the states it can show are computed here, by the package, and embedded in the
page as data. A control selects among them; where a control is continuous (a temperature, a
context length) a few lines of JavaScript evaluate the formula, and the book's browser test checks
what they display against the package.

Each function returns a :class:`Widget`, which a notebook displays as HTML: the Bokeh document,
its data, the controls and a static picture of the default state (Matplotlib, as a PNG), which is
what a reader sees without JavaScript or in a downloaded notebook. The book's extension
``sdpa_widgets`` serves BokehJS from the site's own ``_static`` folder and adds it, with
``sdpa-widgets.js`` (which connects controls, data and figure), to the pages that have a widget.
Without Bokeh installed (a reader's plain Jupyter) a widget shows the static picture alone.
"""

from __future__ import annotations

import base64
import hashlib
import html
import io
import itertools
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

import sdpa

__all__ = [
    "Control",
    "Widget",
    "flash_loop_widget",
    "kv_cache_bytes",
    "kv_cache_widget",
    "lm_attention_widget",
    "mask_widget",
    "rope_widget",
    "softmax_widget",
]

# The figures' text, in CSS pixels: at least 9 on any screen (Bokeh draws at CSS pixel size).
TICK_PX = "11px"
LABEL_PX = "12px"
CELL_PX = "10px"
PLOT_HEIGHT = 230
# Colours with the roles of sdpa_book.figures (Okabe-Ito); no import of Matplotlib needed here.
BLUE, ORANGE, GREEN, VERMILLION, PURPLE = "#0072b2", "#e69f00", "#009e73", "#d55e00", "#cc79a7"
MASKED = "#c8c8c8"
# A sequential palette from white to the book's blue (cells of weight 0 to 1).
PALETTE = [
    "#ffffff", "#e8f1f8", "#d1e3f1", "#b9d5ea", "#a2c7e3", "#8bb9dc", "#74abd5", "#5c9dce",
    "#458fc7", "#2e81c0", "#1773b9", "#0065a9", "#005896", "#004a83", "#003d70", "#00305d",
]  # fmt: skip
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8": 1}


@dataclass
class Control:
    """One control of a widget: a slider (``kind="range"``) or a menu (``kind="select"``).

    A slider comes with a - and a + button beside it, each moving it by one step: the one-step
    control a finger needs on a phone, where a slider of many steps moves several at a touch.

    Parameters
    ----------
    name : str
        The key of its value in the widget's JavaScript (``v.name``).
    label : str
        What a reader and a screen reader see beside it.
    kind : {"range", "select"}
        A slider over numbers or a menu of named options.
    value : int, float or str
        The initial value (the state the static picture shows).
    low, high, step : float
        For a slider: its range and step (arrow keys move by one step).
    options : sequence of (str, str)
        For a menu: ``(value, text)`` pairs.
    """

    name: str
    label: str
    kind: str
    value: object
    low: float = 0
    high: float = 1
    step: float = 1
    options: Sequence[tuple[str, str]] = field(default_factory=list)

    def __post_init__(self):
        if self.kind not in ("range", "select"):
            raise ValueError(f"kind must be 'range' or 'select'; got {self.kind!r}")
        if self.kind == "select" and str(self.value) not in [v for v, _ in self.options]:
            raise ValueError(f"value {self.value!r} is not one of the options of {self.name!r}")
        if self.kind == "range" and not self.low <= float(self.value) <= self.high:
            raise ValueError(f"value {self.value!r} is outside [{self.low}, {self.high}]")

    def html(self, prefix: str) -> str:
        ident = f"{prefix}-{self.name}"
        label = f'<label for="{ident}">{html.escape(self.label)}</label>'
        if self.kind == "range":
            # -/+ buttons beside every slider: a finger moves a long slider (Layers 1-128) by
            # one step only with them; the keyboard's arrows do the same on the slider itself
            def step(sign, glyph, word):
                return (
                    f'<button type="button" class="sdpa-step" data-sdpa-step="{sign}"'
                    f' aria-controls="{ident}" aria-label="{html.escape(self.label)}: {word}">'
                    f"{glyph}</button>"
                )

            return (
                f'<div class="sdpa-control sdpa-control-range">{label}<div class="sdpa-slider">'
                + step("-1", "−", "one step down")
                + f'<input type="range" id="{ident}" name="{self.name}" data-sdpa-control="range"'
                f' min="{self.low:g}" max="{self.high:g}" step="{self.step:g}"'
                f' value="{float(self.value):g}">'
                + step("1", "+", "one step up")
                + f'<output for="{ident}" aria-hidden="true">{float(self.value):g}</output>'
                "</div></div>"
            )
        options = "".join(
            f'<option value="{html.escape(v)}"{" selected" if v == str(self.value) else ""}>'
            f"{html.escape(text)}</option>"
            for v, text in self.options
        )
        return (
            f'<div class="sdpa-control">{label}<select id="{ident}" name="{self.name}"'
            f' data-sdpa-control="select">{options}</select></div>'
        )


class Widget:
    """An interactive figure: a Bokeh figure, its controls, its data, and a static picture.

    Parameters
    ----------
    name : str
        A short identifier, unique on its page (the HTML ids derive from it).
    title : str
        The widget's label, shown above it and read by screen readers.
    alt : str
        What the static picture (the default state) shows, in words.
    controls : list of Control
        The controls, in the order shown.
    data : dict
        The states computed by the package, as JSON-able lists and numbers (``D`` in the code).
    code : str
        The body of a JavaScript function ``(v, D, model)`` that shows the state the controls
        select: ``v`` maps each control's name to its value (a number for a slider, a string
        for a menu), ``model(name)`` returns a Bokeh model by name. It returns the readout text.
    layout : callable
        Builds the Bokeh layout (called only when Bokeh is installed).
    static : callable
        Draws the default state with Matplotlib and returns the figure.
    """

    def __init__(self, *, name, title, alt, controls, data, code, layout, static):
        self.name, self.title, self.alt = name, title, alt
        self.controls, self.data, self.code = list(controls), data, code
        self.layout, self.static = layout, static

    def __repr__(self) -> str:
        return f"Widget({self.name!r}: {self.title})"

    def static_png(self) -> bytes:
        """The default state as a PNG (Matplotlib), for readers without JavaScript."""
        import matplotlib.pyplot as plt

        fig = self.static()
        buffer = io.BytesIO()
        fig.savefig(buffer, format="png", dpi=110, bbox_inches="tight")
        plt.close(fig)
        return buffer.getvalue()

    def data_json(self) -> str:
        return json.dumps(self.data, separators=(",", ":"), allow_nan=False)

    def bokeh_item(self) -> dict | None:
        """The Bokeh document as ``bokeh.embed.json_item`` gives it; None without Bokeh."""
        try:
            from bokeh.embed import json_item
        except ImportError:
            return None
        return json_item(self.layout())

    def _repr_html_(self) -> str:
        prefix = "sdpa-w-" + hashlib.sha256(self.name.encode()).hexdigest()[:8]
        png = base64.b64encode(self.static_png()).decode("ascii")
        title = html.escape(self.title)
        picture = (
            f'<img class="sdpa-widget-static" src="data:image/png;base64,{png}"'
            f' alt="{html.escape(self.alt)}">'
        )
        item = self.bokeh_item()
        if item is None:
            return f'<figure class="sdpa-widget-static-only">{picture}<figcaption>{title}</figcaption></figure>'
        spec = {"item": item, "data": self.data, "code": self.code}
        payload = json.dumps(spec, separators=(",", ":"), allow_nan=False).replace("</", "<\\/")
        controls = "".join(c.html(prefix) for c in self.controls)
        return (
            f'<div class="sdpa-widget" id="{prefix}" role="group" aria-labelledby="{prefix}-title"'
            f' data-sdpa-widget="{html.escape(self.name)}">'
            f'<p class="sdpa-widget-title" id="{prefix}-title">{title}</p>'
            f'<div class="sdpa-widget-controls" hidden>{controls}</div>'
            f'<div class="sdpa-widget-plot" id="{prefix}-plot" role="img"'
            f' aria-label="{html.escape(self.alt)} (described in the readout below)" hidden></div>'
            f"{picture}"
            f'<p class="sdpa-widget-readout" aria-live="polite" hidden></p>'
            f'<script type="application/json" class="sdpa-widget-data">{payload}</script>'
            "</div>"
        )


# --------------------------------------------------------------------------------------------
# Bokeh and Matplotlib helpers


def _figure(**kwargs):
    from bokeh.plotting import figure

    options = dict(
        height=PLOT_HEIGHT,
        sizing_mode="stretch_width",
        tools="",
        toolbar_location=None,
        background_fill_color="white",
        border_fill_color="white",
        min_border_left=40,
        min_border_right=10,
    )
    options.update(kwargs)
    fig = figure(**options)
    for axis in (fig.xaxis, fig.yaxis):
        axis.major_label_text_font_size = TICK_PX
        axis.axis_label_text_font_size = LABEL_PX
        axis.axis_label_text_font_style = "normal"
    fig.title.text_font_size = LABEL_PX
    fig.grid.grid_line_alpha = 0.4
    return fig


def _heatmap(name, T, S, title, x_label="key j", y_label="query i", labels=True, height=None):
    """A (T, S) grid of cells, filled by weight (NaN: masked), with the weights written in."""
    from bokeh.models import AdaptiveTicker, ColumnDataSource, LinearColorMapper

    source = ColumnDataSource(name=name, data={"x": [], "y": [], "w": [], "t": [], "c": []})
    mapper = LinearColorMapper(palette=PALETTE, low=0, high=1, nan_color=MASKED)
    fig = _figure(
        title=title,
        height=height or PLOT_HEIGHT + 20,
        x_range=(-0.5, S - 0.5),
        y_range=(T - 0.5, -0.5),
        x_axis_label=x_label,
        y_axis_label=y_label,
        name=name + "-figure",
    )
    fig.rect("x", "y", 1, 1, source=source, fill_color={"field": "w", "transform": mapper},
             line_color="white")  # fmt: skip
    if labels:
        fig.text("x", "y", text="t", source=source, text_align="center",
                 text_baseline="middle", text_font_size=CELL_PX, text_color="c")  # fmt: skip
    fig.grid.visible = False
    # whole positions only: Bokeh's default ticker puts ticks at 0.5 on a range of 3 keys
    for axis in (fig.xaxis, fig.yaxis):
        axis.ticker = AdaptiveTicker(mantissas=[1, 2, 5], min_interval=1, num_minor_ticks=0)
    return fig, source


# The JavaScript that fills a heatmap's source from a (T, S) list of rows (null: masked).
HEATMAP_JS = """
function fill(src, rows, fig, T, S) {
  const x = [], y = [], w = [], t = [], c = [];
  for (let i = 0; i < rows.length; i++) for (let j = 0; j < rows[i].length; j++) {
    const a = rows[i][j];
    x.push(j); y.push(i); w.push(a === null ? NaN : a);
    t.push(a === null || !showText ? "" : a.toFixed(2).replace(/^0/, ""));
    c.push(a !== null && a > 0.55 ? "white" : "black");
  }
  src.data = {x: x, y: y, w: w, t: t, c: c};
  if (fig) { fig.x_range.end = S - 0.5; fig.y_range.start = T - 0.5; }
}
"""


def _static_heatmap(rows, title, x_label="key j", y_label="query i", text=True):
    from matplotlib.colors import ListedColormap

    from sdpa.plotting import new_figure

    a = np.array([[np.nan if w is None else w for w in row] for row in rows], dtype=float)
    fig, ax = new_figure(width=3.7, height=3.0)
    cmap = ListedColormap(PALETTE).with_extremes(bad=MASKED)
    ax.imshow(np.ma.masked_invalid(a), cmap=cmap, vmin=0, vmax=1)
    if text:
        for (i, j), w in np.ndenumerate(a):
            if not np.isnan(w):
                ax.text(j, i, f"{w:.2f}".lstrip("0"), ha="center", va="center", fontsize=9,
                        color="white" if w > 0.55 else "black")  # fmt: skip
    ax.set(title=title, xlabel=x_label, ylabel=y_label)
    return fig


def _rows(weights, allowed=None, digits=4):
    """A (T, S) array as JSON rows, rounded; masked entries (``allowed`` False) as None."""
    w = np.round(np.asarray(weights, dtype=float), digits)
    if allowed is None:
        allowed = np.ones(w.shape, dtype=bool)
    return [[float(a) if ok else None for a, ok in zip(r, m)] for r, m in zip(w, allowed)]


# --------------------------------------------------------------------------------------------
# a. softmax against temperature and D_k


SOFTMAX_DKS = (4, 16, 64, 256, 1024)


def softmax_widget(S: int = 8, seed: int = 0) -> Widget:
    """The weights of one row of ``S`` scores against the temperature and ``D_k``.

    For each ``D_k`` the scores are ``q . k_j`` of standard normal vectors (their spread grows
    as ``sqrt(D_k)``); the weights are ``softmax(s * z / tau)`` with ``s = 1 / sqrt(D_k)``
    (scaled) or 1, the temperature ``tau`` a continuous slider evaluated in JavaScript.

    Examples
    --------
    >>> w = softmax_widget()
    >>> sorted(w.data["scores"]) == [str(d) for d in sorted(SOFTMAX_DKS, key=str)]
    True
    """
    rng = np.random.default_rng(seed)
    scores = {}
    for dk in SOFTMAX_DKS:
        q = rng.standard_normal(dk)
        k = rng.standard_normal((S, dk))
        scores[str(dk)] = [float(z) for z in k @ q]
    data = {"scores": scores}
    controls = [
        Control(
            "dk", "Key width D_k", "select", "64", options=[(str(d), str(d)) for d in SOFTMAX_DKS]
        ),
        Control(
            "scale",
            "Scale",
            "select",
            "1",
            options=[("1", "scaled by 1/√D_k"), ("0", "not scaled")],
        ),  # fmt: skip
        Control("tau", "Temperature τ", "range", 1.0, low=0.1, high=4.0, step=0.1),
    ]
    code = """
const z = D.scores[v.dk];
const s = (v.scale === "1" ? 1 / Math.sqrt(Number(v.dk)) : 1) / v.tau;
const x = z.map(a => a * s), m = Math.max(...x);
const e = x.map(a => Math.exp(a - m)), sum = e.reduce((a, b) => a + b, 0);
const w = e.map(a => a / sum);
model("weights").data = {j: w.map((_, j) => j), w: w};
const top = Math.max(...w);
return `D_k = ${v.dk}, ${v.scale === "1" ? "scaled" : "not scaled"}, τ = ${v.tau.toFixed(1)}: ` +
  `weights ${w.map(a => a.toFixed(3)).join(", ")}; the largest is ${top.toFixed(3)}.`;
"""

    def default_weights():
        z = np.array(scores["64"]) / np.sqrt(64)
        return sdpa.softmax(z)

    def layout():
        from bokeh.models import ColumnDataSource

        w = default_weights()
        source = ColumnDataSource(name="weights", data={"j": list(range(S)), "w": w.tolist()})
        fig = _figure(title="Weights of one query over its keys", y_range=(0, 1.02),
                      x_axis_label="key j", y_axis_label="weight")  # fmt: skip
        fig.vbar(x="j", top="w", width=0.7, source=source, color=BLUE)
        fig.xaxis.ticker = list(range(S))
        return fig

    def static():
        from sdpa.plotting import new_figure

        fig, ax = new_figure(width=3.7, height=2.4)
        ax.bar(range(S), default_weights(), color=BLUE)
        ax.set(ylim=(0, 1), xlabel="key j", ylabel="weight",
               title="D_k = 64, scaled, τ = 1")  # fmt: skip
        return fig

    return Widget(
        name="softmax",
        title="The softmax of one row of scores: choose D_k, the scale and the temperature",
        alt=f"Bar chart of the {S} weights of one query at D_k = 64, scaled, temperature 1.",
        controls=controls,
        data=data,
        code=code,
        layout=layout,
        static=static,
    )


# --------------------------------------------------------------------------------------------
# b. masks


MASK_KINDS = {
    "none": "no mask",
    "causal-tl": "causal, top-left aligned",
    "causal-br": "causal, bottom-right aligned",
    "window": "sliding window (2 back), bottom-right",
    "padding": "padding (last 2 keys)",
}
MASK_LENGTHS = (3, 5, 8)


def mask_weights(kind: str, T: int, S: int, seed: int = 0):
    """The weights and the allowed entries of the mask explorer's state ``(kind, T, S)``.

    Examples
    --------
    >>> w, allowed = mask_weights("causal-br", 3, 5)
    >>> allowed.astype(int)
    array([[1, 1, 1, 0, 0],
           [1, 1, 1, 1, 0],
           [1, 1, 1, 1, 1]])
    >>> bool(np.allclose(w.sum(axis=1), 1))
    True
    """
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((8, 4))[:T]
    k = rng.standard_normal((8, 4))[:S]
    v = rng.standard_normal((8, 2))[:S]
    options = {}
    if kind == "causal-tl":
        options = dict(is_causal=True)
    elif kind == "causal-br":
        options = dict(is_causal=True, causal_alignment="bottom_right")
    elif kind == "window":
        options = dict(is_causal=True, causal_alignment="bottom_right", window=(2, 0))
    elif kind == "padding":
        options = dict(attn_mask=sdpa.padding_mask([S - 2], S).reshape(S))
    elif kind != "none":
        raise ValueError(f"unknown mask kind {kind!r}")
    _, weights = sdpa.scaled_dot_product_attention(q, k, v, return_weights=True, **options)
    # a masked score is -inf, its weight exactly 0; an allowed one is far from underflowing
    return weights, weights > 0


def mask_widget() -> Widget:
    """The mask explorer: the weights of ``T`` queries over ``S`` keys under five masks.

    Examples
    --------
    >>> w = mask_widget()
    >>> len(w.data["states"]) == len(MASK_KINDS) * len(MASK_LENGTHS) ** 2
    True
    """
    states = {}
    for kind in MASK_KINDS:
        for T in MASK_LENGTHS:
            for S in MASK_LENGTHS:
                weights, allowed = mask_weights(kind, T, S)
                states[f"{kind}/{T}/{S}"] = _rows(weights, allowed, digits=4)
    data = {"states": states, "kinds": MASK_KINDS}
    controls = [
        Control("kind", "Mask", "select", "causal-br", options=list(MASK_KINDS.items())),
        Control("T", "Queries T", "select", "5", options=[(str(n), str(n)) for n in MASK_LENGTHS]),
        Control("S", "Keys S", "select", "8", options=[(str(n), str(n)) for n in MASK_LENGTHS]),
    ]
    code = (
        "const showText = true;\n"
        + HEATMAP_JS
        + """
const rows = D.states[`${v.kind}/${v.T}/${v.S}`];
fill(model("weights"), rows, model("weights-figure"), rows.length, rows[0].length);
const allowed = rows.map(r => r.filter(a => a !== null).length);
const empty = allowed.filter(n => n === 0).length;
// row 0 with each run of masked keys said once ("4 masked"), not once per key
const row0 = [];
for (const a of rows[0]) {
  const last = row0[row0.length - 1];
  if (a !== null) row0.push(a.toFixed(2));
  else if (last && typeof last === "object") last.n += 1;
  else row0.push({n: 1});
}
return `${D.kinds[v.kind]}, T = ${v.T}, S = ${v.S}: keys per query ${allowed.join(", ")}` +
  (empty ? `; ${empty} quer${empty > 1 ? "ies attend" : "y attends"} to nothing (weights 0)` : "") +
  ". Row 0: " + row0.map(a => typeof a === "object" ? `${a.n} masked` : a).join(", ") + ".";
"""
    )

    def layout():
        fig, source = _heatmap("weights", 5, 8, "Attention weights (grey: masked)")
        return fig

    def static():
        return _static_heatmap(states["causal-br/5/8"], "Causal, bottom-right, T = 5, S = 8")

    return Widget(
        name="masks",
        title="Mask explorer: the weights under each mask, for T queries and S keys",
        alt="Heat map of the attention weights of 5 queries over 8 keys under a causal mask "
        "aligned bottom-right: masked entries grey, each row summing to one.",
        controls=controls,
        data=data,
        code=code,
        layout=layout,
        static=static,
    )


# --------------------------------------------------------------------------------------------
# c. the FlashAttention loop, tile by tile


def flash_states(T=8, S=8, Dk=4, block_q=4, block_k=2, is_causal=False, seed=0):
    """The online softmax's state after each tile of :func:`sdpa.blocked_attention`.

    The tiles come from ``on_tile``, in the loop's order. After a tile of query block ``b``
    has been computed, that block's rows hold the state of a loop that has seen the keys up to
    the tile's last one: ``blocked_attention`` over those keys gives its output and log-sum-exp,
    from which ``m`` (the largest scaled score so far), ``l = exp(lse - m)`` and
    ``acc = out * l`` follow. ``Dv = 1``: one number per query.

    Returns
    -------
    dict
        ``tiles`` (first query, first key of each tile, in order), ``exact`` (the output),
        ``steps`` (after tile ``n``: ``m``, ``l``, ``acc``, ``out`` per query, None before the
        row's first tile).

    Examples
    --------
    >>> s = flash_states()
    >>> len(s["tiles"]), len(s["steps"])
    (8, 8)
    >>> bool(np.allclose(s["steps"][-1]["out"], s["exact"]))
    True
    """
    rng = np.random.default_rng(seed)
    q, k, v = (
        rng.standard_normal((T, Dk)),
        rng.standard_normal((S, Dk)),
        rng.standard_normal((S, 1)),
    )
    tiles = []
    exact, _ = sdpa.blocked_attention(q, k, v, block_q=block_q, block_k=block_k,
                                      is_causal=is_causal, on_tile=lambda i, j: tiles.append((i, j)))  # fmt: skip
    scale = 1 / math.sqrt(Dk)
    state = {name: [None] * T for name in ("m", "l", "acc", "out")}
    steps = []
    for i0, j0 in tiles:
        i1, j1 = min(i0 + block_q, T), min(j0 + block_k, S)
        # the queries up to the block's last, so that a causal row i sees keys <= i (rows
        # before i0 are finished already; the block's rows are the ones this tile updates)
        out, lse = sdpa.blocked_attention(q[:i1], k[:j1], v[:j1], block_q=block_q,
                                          block_k=block_k, is_causal=is_causal)  # fmt: skip
        out, lse = out[i0:], lse[i0:]
        scores = scale * q[i0:i1] @ k[:j1].T
        if is_causal:
            scores = np.where(np.arange(j1) <= np.arange(i0, i1)[:, None], scores, -np.inf)
        m = scores.max(axis=1)
        l = np.exp(lse - m)
        for r, i in enumerate(range(i0, i1)):
            state["m"][i] = round(float(m[r]), 6)
            state["l"][i] = round(float(l[r]), 6)
            state["acc"][i] = round(float(out[r, 0] * l[r]), 6)
            state["out"][i] = round(float(out[r, 0]), 6)
        steps.append({name: list(values) for name, values in state.items()})
    return {"tiles": tiles, "exact": [round(float(o), 6) for o in exact[:, 0]], "steps": steps,
            "T": T, "S": S, "block_q": block_q, "block_k": block_k}  # fmt: skip


def flash_loop_widget(T=8, S=8, block_q=4, block_k=2) -> Widget:
    """The FlashAttention loop stepped tile by tile: tiles in fast memory, ``m``, ``l``, ``acc``.

    Examples
    --------
    >>> w = flash_loop_widget()
    >>> sorted(w.data)
    ['causal', 'full']
    """
    data = {
        "full": flash_states(T, S, block_q=block_q, block_k=block_k),
        "causal": flash_states(T, S, block_q=block_q, block_k=block_k, is_causal=True),
    }
    n = len(data["full"]["tiles"])
    controls = [
        Control(
            "mask",
            "Mask",
            "select",
            "full",
            options=[("full", "none (every tile)"), ("causal", "causal (skips tiles)")],
        ),  # fmt: skip
        Control("step", "Tiles computed", "range", 3, low=1, high=n, step=1),
    ]
    code = """
const F = D[v.mask], n = Math.min(v.step, F.tiles.length), st = F.steps[n - 1];
control("step").max = F.tiles.length;  // the causal mask skips tiles: its slider is shorter
const [i0, j0] = F.tiles[n - 1];
const tx = [], ty = [], tc = [];
const nq = Math.ceil(F.T / F.block_q), nk = Math.ceil(F.S / F.block_k);
const index = new Map(F.tiles.map(([a, b], t) => [`${a}/${b}`, t]));
for (let a = 0; a < nq; a++) for (let b = 0; b < nk; b++) {
  const t = index.get(`${a * F.block_q}/${b * F.block_k}`);
  tx.push(b); ty.push(a);
  tc.push(t === undefined ? "#c8c8c8" : t === n - 1 ? "#e69f00" : t < n - 1 ? "#8bb9dc" : "white");
}
model("tiles").data = {x: tx, y: ty, c: tc};
const rows = F.exact.map((_, i) => i);
model("outputs").data = {i: rows, exact: F.exact, out: st.out.map(o => o === null ? NaN : o)};
const f = a => a === null ? "–" : a.toFixed(3);
const i1 = Math.min(i0 + F.block_q, F.T), j1 = Math.min(j0 + F.block_k, F.S);
return `Tile ${n} of ${F.tiles.length}: queries ${i0}–${i1 - 1}, keys ${j0}–${j1 - 1} in fast memory. ` +
  `Row ${i0}: m = ${f(st.m[i0])}, l = ${f(st.l[i0])}, acc = ${f(st.acc[i0])}, ` +
  `out = acc/l = ${f(st.out[i0])} (exact ${F.exact[i0].toFixed(3)}).`;
"""

    def layout():
        from bokeh.layouts import column
        from bokeh.models import ColumnDataSource

        F = data["full"]
        nq, nk = -(-T // block_q), -(-S // block_k)
        tiles = ColumnDataSource(name="tiles", data={"x": [], "y": [], "c": []})
        grid = _figure(title="Orange: in fast memory, blue: done",
                       height=150, x_range=(-0.5, nk - 0.5), y_range=(nq - 0.5, -0.5),
                       x_axis_label="key block", y_axis_label="query block")  # fmt: skip
        grid.rect("x", "y", 0.92, 0.92, source=tiles, fill_color="c", line_color="#333333")
        grid.xaxis.ticker = list(range(nk))
        grid.yaxis.ticker = list(range(nq))
        grid.grid.visible = False
        outputs = ColumnDataSource(name="outputs",
                                   data={"i": list(range(T)), "exact": F["exact"], "out": [0.0] * T})  # fmt: skip
        lo, hi = min(F["exact"] + [0]), max(F["exact"] + [0])
        for name in ("causal",):
            for stp in data[name]["steps"]:
                vals = [o for o in stp["out"] if o is not None]
                lo, hi = min([lo, *vals]), max([hi, *vals])
        pad = 0.1 * (hi - lo)
        out = _figure(title="Output: bars so far, dots exact", height=190,
                      y_range=(lo - pad, hi + pad), x_axis_label="query i", y_axis_label="out")  # fmt: skip
        out.vbar(x="i", top="out", width=0.6, source=outputs, color=PURPLE)
        out.scatter(x="i", y="exact", source=outputs, size=9, color="black")
        out.xaxis.ticker = list(range(T))
        return column(grid, out, sizing_mode="stretch_width")

    def static():
        from sdpa.plotting import new_figure

        F = data["full"]
        st = F["steps"][2]
        fig, ax = new_figure(width=3.7, height=2.4)
        ax.bar(range(T), [np.nan if o is None else o for o in st["out"]], color=PURPLE,
               label="after 3 tiles")  # fmt: skip
        ax.plot(range(T), F["exact"], "o", color="black", label="exact")
        ax.set(xlabel="query i", ylabel="out", title="Output after 3 of 8 tiles")
        ax.legend(fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.3), ncol=2)
        return fig

    return Widget(
        name="flash-loop",
        title="The FlashAttention loop, tile by tile: step through the tiles",
        alt="The output of 8 queries after 3 of the 8 tiles: the first four rows partly "
        "computed, the others not yet, beside the exact output.",
        controls=controls,
        data=data,
        code=code,
        layout=layout,
        static=static,
    )


# --------------------------------------------------------------------------------------------
# d. RoPE


def rope_states(n_positions=16, Dk=8, seed=3):
    """Scores of a query and a key rotated by RoPE at every pair of positions.

    Returns
    -------
    dict
        ``scores[i][j] = rope(q, i) . rope(k, j) / sqrt(Dk)`` (rotations by
        :func:`sdpa.apply_rotary_embedding`), and the first feature pair of the rotated query
        and key at each position.

    Examples
    --------
    >>> s = rope_states()
    >>> a = np.array(s["scores"])
    >>> bool(np.allclose(a[2, 5], a[5, 8]))  # the same offset j - i, the same score
    True
    """
    rng = np.random.default_rng(seed)
    q, k = rng.standard_normal(Dk), rng.standard_normal(Dk)
    positions = np.arange(n_positions)
    rq = sdpa.apply_rotary_embedding(np.tile(q, (n_positions, 1)), positions)
    rk = sdpa.apply_rotary_embedding(np.tile(k, (n_positions, 1)), positions)
    half = Dk // 2  # rotate-half layout: pair 0 is features (0, Dk/2)
    return {
        "scores": [[round(float(s), 6) for s in row] for row in rq @ rk.T / math.sqrt(Dk)],
        "q": [[round(float(a), 6) for a in r[[0, half]]] for r in rq],
        "k": [[round(float(a), 6) for a in r[[0, half]]] for r in rk],
        "n": n_positions,
    }


def _along_offsets(scores):
    """The score at each offset ``d = j - i``, from the first pair of positions that has it."""
    n = len(scores)
    offsets = list(range(-(n - 1), n))
    return offsets, [scores[max(-d, 0)][max(-d, 0) + d] for d in offsets]


def rope_widget(n_positions=16) -> Widget:
    """RoPE: move the query's and the key's positions; the score depends on the offset only.

    Examples
    --------
    >>> rope_widget().data["n"]
    16
    """
    data = rope_states(n_positions)
    controls = [
        Control("i", "Query position i", "range", 2, low=0, high=n_positions - 1),
        Control("j", "Key position j", "range", 5, low=0, high=n_positions - 1),
    ]
    code = """
const sc = D.scores, i = v.i, j = v.j, d = j - i;
const q = D.q[i], k = D.k[j];
model("vectors").data = {x0: [0, 0], y0: [0, 0], x1: [q[0], k[0]], y1: [q[1], k[1]],
  c: ["#e69f00", "#0072b2"]};
model("point").data = {d: [d], s: [sc[i][j]]};
const i0 = Math.max(-d, 0), j0 = i0 + d;
return `Query at i = ${i}, key at j = ${j}: offset j − i = ${d}, score ${sc[i][j].toFixed(4)}` +
  ` (at i = ${i0}, j = ${j0}, the same offset: ${sc[i0][j0].toFixed(4)}).`;
"""

    def layout():
        from bokeh.layouts import column
        from bokeh.models import ColumnDataSource

        r = max(math.hypot(*p) for p in data["q"] + data["k"]) * 1.15
        q, k = data["q"][2], data["k"][5]
        vectors = ColumnDataSource(
            name="vectors",
            data={"x0": [0, 0], "y0": [0, 0], "x1": [q[0], k[0]], "y1": [q[1], k[1]],
                  "c": [ORANGE, BLUE]},
        )  # fmt: skip
        # square, so that a rotation looks like one
        plane = _figure(title="Pair 0: query orange, key blue", height=280, width=280,
                        sizing_mode="fixed", x_range=(-r, r), y_range=(-r, r))  # fmt: skip
        plane.segment("x0", "y0", "x1", "y1", color="c", line_width=3, source=vectors)
        plane.scatter("x1", "y1", color="c", size=9, source=vectors)
        offsets, along = _along_offsets(data["scores"])
        curve = ColumnDataSource(name="curve", data={"d": offsets, "s": along})
        point = ColumnDataSource(name="point", data={"d": [3], "s": [data["scores"][2][5]]})
        pad = 0.1 * (max(along) - min(along))
        line = _figure(title="Score against the offset j − i", height=200,
                       x_range=(offsets[0] - 0.5, offsets[-1] + 0.5),
                       y_range=(min(along) - pad, max(along) + pad),
                       x_axis_label="offset j − i", y_axis_label="score")  # fmt: skip
        line.line("d", "s", source=curve, color=BLUE)
        line.scatter("d", "s", source=point, size=10, color=ORANGE)
        return column(plane, line, sizing_mode="stretch_width")

    def static():
        from sdpa.plotting import new_figure

        offsets, along = _along_offsets(data["scores"])
        fig, ax = new_figure(width=3.7, height=2.4)
        ax.plot(offsets, along, color=BLUE)
        ax.plot([3], [data["scores"][2][5]], "o", color=ORANGE)
        ax.set(xlabel="offset j − i", ylabel="score", title="Query at 2, key at 5: offset 3")
        return fig

    return Widget(
        name="rope",
        title="RoPE: move the query and the key; their score depends on the offset only",
        alt="The score of a rotated query and key against their offset j − i, with the point "
        "of query position 2 and key position 5 marked.",
        controls=controls,
        data=data,
        code=code,
        layout=layout,
        static=static,
    )


# --------------------------------------------------------------------------------------------
# e. a trained model's attention maps


def lm_attention_widget(
    model, sequences, names, scores=None, tokens_shown=None, snapshots=None
) -> Widget:
    """The attention map of every layer and head of a trained ``DecoderLM`` on a few sequences,
    and, with ``snapshots``, at several steps of its training.

    Parameters
    ----------
    model : sdpa.nn.DecoderLM
        The model; its ``forward(..., return_attention=True)`` gives the weights.
    sequences : (N, T) array_like of int
        Token sequences, one map per sequence, layer and head.
    names : sequence of str
        What each sequence is (the menu's text).
    scores : dict, optional
        ``{label: callable(weights (T, T), sequence index) -> float}``: numbers shown in the
        readout for the chosen map (for example a head's previous-token score).
    tokens_shown : int, optional
        Show only the first positions (default all).
    snapshots : sequence of (int, sdpa.nn.DecoderLM), optional
        The model at earlier training steps, ``(step, model)`` in order, the last of them
        ``model`` itself: a menu chooses the step (the last is shown first). Without them, the
        one state of ``model``. The maps are keyed ``"state/layer/head/sequence"``, ``state``
        the index of the snapshot (0 without); each map holds the causal rows' weights in
        thousandths (integers: a page of several states stays small).

    Examples
    --------
    >>> from sdpa.nn import DecoderLM
    >>> m = DecoderLM(vocab_size=5, d_model=8, n_layers=1, n_heads=2, max_len=6,
    ...               rng=np.random.default_rng(0))
    >>> w = lm_attention_widget(m, [[0, 1, 2, 3, 4, 0]], ["a sequence"])
    >>> sorted(w.data["maps"])
    ['0/0/0/0', '0/0/1/0']
    """
    tokens = np.asarray(sequences)
    states = list(snapshots) if snapshots else [(None, model)]
    if states[-1][1] is not model:
        raise ValueError("the last of the snapshots must be the model itself")
    T = tokens.shape[1] if tokens_shown is None else tokens_shown
    maps, numbers = {}, {}
    for k, (_, state) in enumerate(states):
        _, weights = state.forward(tokens, return_attention=True)  # per layer: (N, H, T, T)
        for (layer, head, s), entry in _attention_maps(weights, T, scores).items():
            maps[f"{k}/{layer}/{head}/{s}"], numbers[f"{k}/{layer}/{head}/{s}"] = entry
    n_layers, n_heads = model.n_layers, model.n_heads
    last = len(states) - 1
    data = {"maps": maps, "numbers": numbers, "T": T, "steps": [step for step, _ in states]}
    controls = [
        Control(
            "layer",
            "Layer",
            "select",
            str(n_layers - 1),
            options=[(str(i), str(i)) for i in range(n_layers)],
        ),  # fmt: skip
        Control("head", "Head", "select", "0", options=[(str(h), str(h)) for h in range(n_heads)]),
        Control(
            "seq",
            "Sequence",
            "select",
            "0",
            options=[(str(s), name) for s, name in enumerate(names)],
        ),  # fmt: skip
    ]
    if len(states) > 1:
        steps = [(str(k), str(step)) for k, (step, _) in enumerate(states)]
        controls.insert(0, Control("step", "Training step", "select", str(last), options=steps))
    code = (
        "const showText = false;\n"
        + HEATMAP_JS
        + """
const k = v.step === undefined ? 0 : v.step, step = D.steps[k];
const key = `${k}/${v.layer}/${v.head}/${v.seq}`;
const tri = D.maps[key].map(r => r.map(x => x / 1000));
const rows = tri.map((r, i) => r.concat(Array(D.T - i - 1).fill(null)));
fill(model("weights"), rows, null, D.T, D.T);
const nums = D.numbers[key] || {};
const top = tri.map(r => r.indexOf(Math.max(...r)));
const last = D.T - 1;
return (step === null ? "Layer" : `Step ${step}, layer`) + ` ${v.layer}, head ${v.head}: ` +
  Object.entries(nums).map(([k, x]) => `${k} ${x.toFixed(3)}`).join(", ") +
  `${Object.keys(nums).length ? "; " : ""}the last query (${last}) puts its largest weight, ` +
  `${Math.max(...tri[last]).toFixed(3)}, on position ${top[last]}.`;
"""
    )

    def layout():
        fig, _ = _heatmap("weights", T, T, "Attention weights (grey: masked)",
                          x_label="key position", y_label="query position", labels=False,
                          height=330)  # fmt: skip
        return fig

    def static():
        key = f"{last}/{n_layers - 1}/0/0"
        rows = [[x / 1000 for x in r] + [None] * (T - len(r)) for r in maps[key]]
        return _static_heatmap(rows, f"Layer {n_layers - 1}, head 0, {names[0]}",
                               x_label="key position", y_label="query position", text=False)  # fmt: skip

    choose = "the training step, " if len(states) > 1 else ""
    return Widget(
        name="lm-attention",
        title=f"A trained model's attention: choose {choose}the layer, the head and the sequence",
        alt=f"Heat map of the attention weights of layer {n_layers - 1}, head 0 on {names[0]}.",
        controls=controls,
        data=data,
        code=code,
        layout=layout,
        static=static,
    )


def _attention_maps(weights, T: int, scores) -> dict:
    """``{(layer, head, sequence): (map, numbers)}`` from a forward pass's weights (per layer
    ``(N, H, T, T)``): each map the causal rows in thousandths, the numbers ``scores``'s."""
    out = {}
    allowed = np.tril(np.ones((T, T), dtype=bool))
    for layer, w in enumerate(weights):
        for head, s in itertools.product(range(w.shape[1]), range(w.shape[0])):
            a = w[s, head, :T, :T]
            assert np.all(a[~allowed] == 0)
            rows = [[round(1000 * float(x)) for x in row[: i + 1]] for i, row in enumerate(a)]
            numbers = {
                label: round(float(f(w[s, head], s)), 4) for label, f in (scores or {}).items()
            }
            out[layer, head, s] = rows, numbers
    return out


# --------------------------------------------------------------------------------------------
# f. the KV-cache memory calculator


def kv_cache_bytes(
    context: int,
    *,
    layers: int,
    kv_heads: int,
    head_dim: int,
    dtype_bytes: int,
    batch: int = 1,
    latent: int = 0,
    rope_dim: int = 0,
    layers_per_cache: int = 1,
) -> int:
    """Bytes of a KV cache holding ``context`` tokens of ``batch`` sequences.

    Multi-head and grouped-query attention store a key and a value of ``head_dim`` per KV head,
    layer and token: ``2 * layers * kv_heads * head_dim``. Multi-head latent attention (MLA)
    stores instead one latent of width ``latent`` and a shared RoPE key of ``rope_dim`` per
    layer and token, whatever the number of heads. With cross-layer sharing, groups of
    ``layers_per_cache`` consecutive layers read one cache, written by the group's first layer:
    ``ceil(layers / layers_per_cache)`` caches in place of ``layers``.

    Parameters
    ----------
    context : int
        Tokens per sequence.
    layers, kv_heads, head_dim : int
        The model's shape: layers, key/value heads (``H_kv``), width of one head
        (``D_k = D_v``).
    dtype_bytes : int
        Bytes per number (4 float32, 2 bfloat16, 1 float8).
    batch : int, default 1
        Sequences.
    latent, rope_dim : int, default 0
        MLA's latent width and decoupled RoPE width; ``latent = 0`` is not MLA.
    layers_per_cache : int, default 1
        Layers sharing one KV cache (1: every layer keeps its own).

    Returns
    -------
    int
        The bytes.

    Raises
    ------
    ValueError
        If ``layers_per_cache`` is not a positive whole number.

    Examples
    --------
    Llama-2-7B's shape, 32 layers of 32 heads of 128, in 16 bits: half a MiB per token.

    >>> kv_cache_bytes(1, layers=32, kv_heads=32, head_dim=128, dtype_bytes=2)
    524288
    >>> kv_cache_bytes(4096, layers=32, kv_heads=32, head_dim=128, dtype_bytes=2) / 2**30
    2.0

    Pairs of layers sharing one cache halve it:

    >>> kv_cache_bytes(4096, layers=32, kv_heads=32, head_dim=128, dtype_bytes=2,
    ...                layers_per_cache=2) / 2**30
    1.0
    """
    if isinstance(layers_per_cache, bool) or not (
        isinstance(layers_per_cache, (int, np.integer)) and layers_per_cache >= 1
    ):
        raise ValueError(
            f"layers_per_cache must be a whole number of layers, at least 1; "
            f"got {layers_per_cache!r}"
        )
    per_token = (latent + rope_dim) if latent else 2 * kv_heads * head_dim
    caches = -(-int(layers) // int(layers_per_cache))  # the last group may be smaller
    return int(context) * int(batch) * caches * int(per_token) * int(dtype_bytes)


KV_SHARING = (1, 2, 3, 4, 8)
# The calculator's readout, in JavaScript: the formula of the page with the setting's numbers
# (plurals right), the total in a readable unit, and what the setting makes irrelevant.
KV_CACHE_JS = """
const n = (k, one, many) => `${k.toLocaleString("en-US")} ${k === 1 ? one : many || one + "s"}`;
const Hq = v.heads, kvChoice = Number(v.kvheads), lat = Number(v.latent), dh = Number(v.dh);
const Hkv = kvChoice === 0 ? Hq : Math.min(kvChoice, Hq), bytes = Number(v.dtype);
const share = Number(v.share), caches = Math.ceil(v.layers / share);
const per = lat > 0 ? lat + D.rope_dim : 2 * Hkv * dh;   // numbers per cache and token
const total = ctx => ctx * v.batch * caches * per * bytes;
const ctx = 2 ** v.log2ctx, b = total(ctx);
const xs = [], ys = [];
for (let p = 10; p <= 20; p++) { xs.push(2 ** p); ys.push(total(2 ** p) / 2 ** 30); }
model("curve").data = {x: xs, y: ys};
model("point").data = {x: [ctx], y: [b / 2 ** 30]};
const units = [["TiB", 2 ** 40], ["GiB", 2 ** 30], ["MiB", 2 ** 20], ["KiB", 2 ** 10]];
const [unit, size] = units.find(([, s]) => b >= s) || ["bytes", 1];
const amount = unit === "bytes" ? String(b) : (b / size).toPrecision(3);
const who = share > 1 ? `${n(caches, "cache")} for ${n(v.layers, "layer")}` : n(v.layers, "layer");
const what = lat > 0 ? `(${lat} + ${D.rope_dim})` : `${n(Hkv, "KV head")} × (${dh} + ${dh})`;
const notes = [];
if (lat > 0) notes.push("MLA: H_q, H_kv and the head width have no effect");
else if (kvChoice > Hq) notes.push(`H_kv is at most H_q = ${Hq}`);
else if (kvChoice > 0) {  // GQA or MQA: the bytes depend on H_kv alone
  notes.push(`H_q has no effect, only H_kv (G = ${+(Hq / Hkv).toFixed(2)})`);
}
return `${who} × ${what} × ${n(bytes, "byte")} = ` +
  `${(caches * per * bytes).toLocaleString("en-US")} bytes per token; × ${ctx.toLocaleString("en-US")}` +
  ` tokens × ${n(v.batch, "sequence")} = ${amount} ${unit}.` +
  (notes.length ? " " + notes.join("; ") + "." : "");
"""


def kv_cache_widget() -> Widget:
    """A calculator of KV-cache memory: layers and their sharing, heads (``H_q``, ``H_kv``), MLA,
    number format, context length and batch.

    Examples
    --------
    >>> w = kv_cache_widget()
    >>> [c.name for c in w.controls]
    ['layers', 'heads', 'share', 'kvheads', 'dh', 'latent', 'dtype', 'log2ctx', 'batch']
    """
    controls = [
        Control("layers", "Layers", "range", 32, low=1, high=128),
        Control("heads", "Query heads H_q", "range", 32, low=1, high=128),
        Control(
            "share",
            "Layers sharing one KV cache",
            "select",
            "1",
            options=[(str(k), str(k) if k > 1 else "1 (each layer its own)") for k in KV_SHARING],
        ),  # fmt: skip
        Control(
            "kvheads",
            "Key/value heads H_kv",
            "select",
            "8",
            options=[("0", "H_q (multi-head)"), ("1", "1 (multi-query)")]
            + [(str(g), str(g)) for g in (2, 4, 8, 16)],
        ),  # fmt: skip
        Control(
            "dh",
            "Head width D_k = D_v",
            "select",
            "128",
            options=[(d, d) for d in ("64", "128", "256")],
        ),
        Control(
            "latent",
            "MLA latent width",
            "select",
            "0",
            options=[("0", "none (no MLA)")] + [(d, d) for d in ("256", "512", "1024")],
        ),  # fmt: skip
        Control(
            "dtype",
            "Number format",
            "select",
            "2",
            options=[
                ("4", "float32, 4 bytes"),
                ("2", "bfloat16, 2 bytes"),
                ("1", "float8, 1 byte"),
            ],
        ),  # fmt: skip
        Control("log2ctx", "Context length, log2 of tokens", "range", 15, low=10, high=20),
        Control("batch", "Sequences in the batch B", "range", 1, low=1, high=64),
    ]
    data = {"rope_dim": 64}

    def default_curve():
        contexts = [2**p for p in range(10, 21)]
        return contexts, [
            kv_cache_bytes(c, layers=32, kv_heads=8, head_dim=128, dtype_bytes=2) / 2**30
            for c in contexts
        ]

    def layout():
        from bokeh.models import ColumnDataSource

        x, y = default_curve()
        curve = ColumnDataSource(name="curve", data={"x": x, "y": y})
        point = ColumnDataSource(name="point", data={"x": [2**15], "y": [y[5]]})
        fig = _figure(title="Memory against context length", x_axis_type="log",
                      y_axis_type="log", x_axis_label="tokens", y_axis_label="GiB")  # fmt: skip
        fig.line("x", "y", source=curve, color=BLUE, line_width=2)
        fig.scatter("x", "y", source=point, size=10, color=ORANGE)
        return fig

    def static():
        from sdpa.plotting import new_figure

        x, y = default_curve()
        fig, ax = new_figure(width=3.7, height=2.4)
        ax.loglog(x, y, color=BLUE)
        ax.plot([2**15], [y[5]], "o", color=ORANGE)
        ax.set(xlabel="tokens", ylabel="GiB", title="32 layers, 8 KV heads of 128, bfloat16")
        return fig

    return Widget(
        name="kv-cache",
        title="KV-cache memory: layers and their sharing, heads, MLA, number format, context",
        alt="KV-cache memory against the context length, from 1,024 to about a million tokens, "
        "for 32 layers of 8 KV heads of width 128 in bfloat16; 32,768 tokens marked.",
        controls=controls,
        data=data,
        code=KV_CACHE_JS,
        layout=layout,
        static=static,
    )
