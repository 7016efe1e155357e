"""The whole computation with its shapes, ``Q, K -> scores -> ... -> out``:
:func:`attention_pipeline_diagram`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..figures import FULL_WIDTH, KEY, OUTPUT, QUERY, VALUE
from .draw import draw_arrow, draw_box, new_canvas
from .matrix import draw_matrix
from .primitives import (
    MARGIN,
    NAME_PT,
    NEUTRAL,
    SCORES,
    _clear_gap,
    _extent,
    _fit_unit,
    _flag,
    _label_lines,
    _pack,
    _positive_int,
    _stack_size,
    text_size,
)

_ARROW = 0.32  # length of the arrows between the scores, the steps and the weights
_GAP = 0.07  # between a product and the matrices it is made of
_TAGS = {"Q": "Q", "Kt": "K^T", "Z": "scores", "A": "weights", "V": "V", "O": "O"}
_WORDS = {
    "Q": "queries ",
    "Kt": "keys ",
    "Z": "scores ",
    "A": "weights ",
    "V": "values ",
    "O": "out ",
}
_BOTTOM = ("Q", "Z", "A", "O")  # the bottom row; K^T stands above the scores, V above O


class _Spec(NamedTuple):
    shape: tuple[int, int]
    dims: tuple[str, str]
    name: str  # its label: a word (unless compact) and the symbol
    color: str


@dataclass(frozen=True)
class _Step:
    text: str
    width: float
    height: float


@dataclass(frozen=True)
class _Plan:
    """Where the grids and steps go, for one cell side."""

    x: dict[str, float]  # left of each grid of the bottom row (K^T, V stand on Z and O)
    steps_x: list[float]  # left of each step box
    y_q: float  # bottom of the bottom row's grids
    floor: float  # labels beside K^T and V stay above this height (clear of the steps)


def attention_pipeline_diagram(
    T: int, S: int, Dk: int, Dv: int, *, mask: bool = True, compact: bool = False
):
    r"""The whole computation with its shapes: ``Q, K -> scores -> scale -> mask -> softmax ->
    weights -> @ V -> out``.

    The matrices are grids whose proportions follow the sizes, laid out as in a hand
    multiplication: :math:`K^\top` sits above the scores :math:`QK^\top` (row ``i`` of
    :math:`Q` meets column ``j`` of :math:`K^\top` in score ``(i, j)``), and :math:`V` above
    the output :math:`O = AV`. Between the scores and the weights :math:`A` come the steps of
    the softmax; the arrow into the softmax carries :math:`Z`, the scaled, masked scores.

    Parameters
    ----------
    T, S, Dk, Dv : int
        Queries, keys, query/key width, value width.
    mask : bool, default True
        Draw the masking step (a causal mask, top-left aligned as in
        :func:`sdpa.causal_mask`; the weights it sets to zero are grey).
    compact : bool, default False
        A smaller version (about 4.8 in wide): symbols only, the three steps in one box.

    Returns
    -------
    matplotlib.figure.Figure
        The diagram: white, at most ``sdpa_book.figures.FULL_WIDTH`` wide, not registered
        with pyplot.

    Raises
    ------
    TypeError
        If a size is not an integer, or ``mask``/``compact`` not a bool.
    ValueError
        If a size is not positive.

    Examples
    --------
    >>> from sdpa_book.diagrams import attention_pipeline_diagram, figure_texts
    >>> texts = figure_texts(attention_pipeline_diagram(T=4, S=6, Dk=3, Dv=2))
    >>> [t for t in texts if t.startswith("(")]  # Q, scores, weights, O; then K^T, V
    ['(4, 3)', '(4, 6)', '(4, 6)', '(4, 2)', '(3, 6)', '(6, 2)']
    """
    T, S, Dk, Dv = (_positive_int(v, n) for v, n in ((T, "T"), (S, "S"), (Dk, "Dk"), (Dv, "Dv")))
    mask = _flag(mask, "mask")
    compact = _flag(compact, "compact")
    specs = _specs(T, S, Dk, Dv, compact)
    steps = _steps(mask, compact)
    unit, width, height, plan = _fit_unit(
        lambda unit: _layout(unit, specs, steps),
        0.16 if compact else 0.22,
        4.8 if compact else FULL_WIDTH,
        2.6 if compact else 3.6,
    )
    fig, ax = new_canvas(width, height)
    grids = _draw_grids(ax, specs, plan, unit, T, S, mask)
    _draw_steps(ax, steps, plan, grids, compact)
    return fig


def _specs(T: int, S: int, Dk: int, Dv: int, compact: bool) -> dict[str, _Spec]:
    words = {} if compact else _WORDS
    specs = {
        "Q": ((T, Dk), ("T", "D_k"), "$Q$", QUERY),
        "Kt": ((Dk, S), ("D_k", "S"), "$K^\\top$", KEY),
        "Z": ((T, S), ("T", "S"), "$QK^\\top$", SCORES),
        "A": ((T, S), ("T", "S"), "$A$", SCORES),
        "V": ((S, Dv), ("S", "D_v"), "$V$", VALUE),
        "O": ((T, Dv), ("T", "D_v"), "$O = AV$", OUTPUT),
    }
    return {
        k: _Spec(shape, dims, words.get(k, "") + symbol, color)
        for k, (shape, dims, symbol, color) in specs.items()
    }


def _steps(mask: bool, compact: bool) -> list[_Step]:
    """The steps between the scores and the weights (compact: all in one box)."""
    texts = ["$\\div\\sqrt{D_k}$"] + (["causal\nmask"] if mask else []) + ["softmax"]
    if compact:
        texts = ["\n".join(t.replace("\n", " ") for t in texts)]
    sizes = [text_size(t, NAME_PT) for t in texts]
    return [_Step(t, w + 0.2, h + 0.14) for t, (w, h) in zip(texts, sizes)]


def _layout(unit: float, specs: dict[str, _Spec], steps: list[_Step]):
    """``(width, height, plan)`` for cells of side ``unit``: the bottom row Q, scores, steps,
    weights, O, from left to right; K^T above the scores, V above O."""
    labels = {
        k: _stack_size(_label_lines(s.name, s.dims, s.shape, "s", "s")["s"])
        for k, s in specs.items()
    }
    w = {k: _extent(s.shape[1], unit, 0.1) for k, s in specs.items()}
    h = {k: _extent(s.shape[0], unit, 0.1) for k, s in specs.items()}
    step_w = [s.width for s in steps]
    step_h = max(s.height for s in steps)

    def gap(a, b):  # between two grids of the bottom row, their labels apart
        return _clear_gap(w[a], w[b], labels[a][0], labels[b][0], 0.15, _GAP)

    def row(arrow):  # x of Q, the scores, each step, the weights and O
        sizes = [w["Q"], w["Z"], *step_w, w["A"], w["O"]]
        gaps = [gap("Q", "Z"), *[arrow] * (len(steps) + 1), gap("A", "O")]
        return _pack(sizes, gaps, start=MARGIN + max(0.0, (labels["Q"][0] - w["Q"]) / 2))

    xs = row(_ARROW)
    # The labels of K^T (right of it) and of V (left of it) share the space above the steps.
    needed = xs[1] + w["Z"] + 0.1 + labels["Kt"][0] + 0.25 + labels["V"][0] + 0.1
    if needed > xs[-1]:  # lengthen the arrows around the steps evenly
        xs = row(_ARROW + (needed - xs[-1]) / (len(steps) + 1))
    x = {"Q": xs[0], "Z": xs[1], "A": xs[-2], "O": xs[-1]}
    width = x["O"] + w["O"] + max(0.0, (labels["O"][0] - w["O"]) / 2) + MARGIN

    below = max(labels[k][1] for k in _BOTTOM) + 0.06  # the labels under the bottom row
    y_row = MARGIN + below
    row_h = max(h["Q"], step_h)  # the bottom row is centred on the taller of Q and the steps
    y_top_row = y_row + (row_h + h["Q"]) / 2 + _GAP
    floor = y_row + row_h / 2 + step_h / 2 + 0.05
    top = max(
        y_top_row + max(h["Kt"], h["V"]),
        *(max(y_top_row + h[k] / 2 + labels[k][1] / 2, floor + labels[k][1]) for k in ("Kt", "V")),
    )
    plan = _Plan(x, xs[2:-2], y_row + (row_h - h["Q"]) / 2, floor)
    return width, top + MARGIN, plan


def _draw_grids(ax, specs, plan: _Plan, unit: float, T: int, S: int, mask: bool):
    """The bottom row's grids, labelled below, then K^T and V above them; their rectangles."""
    grids = {}
    for key in _BOTTOM:
        spec = specs[key]
        masked = None
        if key == "A" and mask:
            masked = np.triu(np.ones((T, S), dtype=bool), k=1)  # top-left causal: j > i
        grids[key] = draw_matrix(
            ax,
            plan.x[key],
            plan.y_q,
            spec.shape,
            unit=unit,
            color=spec.color,
            name=spec.name,
            dims=spec.dims,
            name_at="below",
            shape_at="below",
            masked=masked,
            fill=0.45 if key in ("Z", "A") else 0.35,
            tag=_TAGS[key],
        )
    for key, over, side in (("Kt", "Z", "right"), ("V", "O", "left")):
        spec = specs[key]
        grids[key] = draw_matrix(
            ax,
            plan.x[over],
            grids[over].y1 + _GAP,
            spec.shape,
            unit=unit,
            color=spec.color,
            name=spec.name,
            dims=spec.dims,
            name_at=side,
            shape_at=side,
            label_floor=plan.floor,
            tag=_TAGS[key],
        )
    return grids


def _draw_steps(ax, steps: list[_Step], plan: _Plan, grids, compact: bool) -> None:
    """The step boxes between the scores and the weights, and the arrows through them; the
    arrow into the softmax (compact: into the weights) carries Z."""
    yc = grids["Z"].cy
    boxes = [
        draw_box(ax, sx, yc - s.height / 2, s.width, s.height, s.text, color=NEUTRAL, fill=0.1)
        for sx, s in zip(plan.steps_x, steps)
    ]
    points = [grids["Z"].right] + [p for b in boxes for p in (b.left, b.right)] + [grids["A"].left]
    for i in range(0, len(points), 2):
        into_softmax = i == len(points) - 4 and not compact
        into_weights = i == len(points) - 2 and compact
        label = "$Z$" if into_softmax or into_weights else None
        draw_arrow(ax, (points[i][0] + 0.03, yc), (points[i + 1][0] - 0.03, yc), label=label)
