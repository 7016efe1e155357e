"""The whole computation with its shapes, ``Q, K -> scores -> ... -> out``:
:func:`attention_pipeline_diagram`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from ..figures import KEY, OUTPUT, QUERY, VALUE
from .draw import draw_arrow, draw_box, new_canvas
from .matrix import draw_matrix
from .primitives import (
    MARGIN,
    MATH_PT,
    NEUTRAL,
    PHONE_WIDTH,
    SCORES,
    TEXT_PT,
    _extent,
    _fit_unit,
    _flag,
    _label_lines,
    _pack,
    _phone_pt,
    _positive_int,
    _stack_size,
    text_size,
)

_NAME_PT = 12  # the names of the grids
_ARROW = 0.2  # least length of the arrows down from the scores, through the steps, to A
_GAP = 0.07  # between a product and the matrix above it
_SLOT_GAP = 0.15  # between the three columns
_TAGS = {"Q": "Q", "Kt": "K^T", "Z": "scores", "A": "weights", "V": "V", "O": "O"}
_WORDS = {
    "Q": "queries ",
    "Kt": "keys ",
    "Z": "scores ",
    "A": "weights ",
    "V": "values ",
    "O": "out ",
}
# Where each grid's labels go: Q, A and O below, K^T on the left (above Q), the scores on the
# right; V's on its right where the width allows, else above it (_Plan.v_side).
_SIDES = {"Q": "below", "Kt": "left", "Z": "right", "A": "below", "O": "below"}


class _Spec(NamedTuple):
    shape: tuple[int, int]
    dims: tuple[str, str]
    name: str  # its label: a word (unless compact) and the symbol
    color: str


@dataclass(frozen=True)
class _Step:
    text: str
    fontsize: float
    width: float
    height: float


@dataclass(frozen=True)
class _Plan:
    """Where the grids and steps go, for one cell side."""

    x: dict[str, float]  # left of each grid
    y: dict[str, float]  # bottom of each grid
    steps_y: list[float]  # bottom of each step box, from the top one down
    centre: float  # x of the middle column: the scores, the steps and the weights
    floor: float  # the labels beside K^T stay above this height (clear of Q)
    v_side: str  # where V's labels go: "right" or "above"


def attention_pipeline_diagram(
    T: int, S: int, Dk: int, Dv: int, *, mask: bool = True, compact: bool = False
):
    r"""The whole computation with its shapes: ``Q, K -> scores -> scale -> mask -> softmax ->
    weights -> @ V -> out``.

    The matrices are grids whose proportions follow the sizes, laid out as two hand
    multiplications, one above the other, so that the drawing stays narrow enough for a
    phone. At the top :math:`K^\top` sits above the scores :math:`QK^\top`, with :math:`Q` on
    their left (row ``i`` of :math:`Q` meets column ``j`` of :math:`K^\top` in score
    ``(i, j)``). The steps of the softmax lead down from the scores to the weights :math:`A`;
    the arrow into the softmax carries :math:`Z`, the scaled, masked scores. At the bottom
    :math:`V` sits above the output :math:`O = AV`, with :math:`A` on its left.

    Parameters
    ----------
    T, S, Dk, Dv : int
        Queries, keys, query/key width, value width.
    mask : bool, default True
        Draw the masking step (a causal mask, top-left aligned as in
        :func:`sdpa.causal_mask`; the weights it sets to zero are grey).
    compact : bool, default False
        A smaller version: symbols only, the steps in one box.

    Returns
    -------
    matplotlib.figure.Figure
        The diagram: white, at most 3.7 in wide (it reads on a phone), not registered with
        pyplot.

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
    # V's labels beside it make a shorter drawing, above it a narrower one: the larger cells win.
    unit, width, height, plan = max(
        (
            _fit_unit(
                lambda unit, side=side: _layout(unit, specs, steps, compact, side),
                0.18 if compact else 0.2,
                PHONE_WIDTH,
                4.4 if compact else 5.2,
            )
            for side in ("right", "above")
        ),
        key=lambda fit: (round(fit[0], 6), -fit[2]),
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
    """The steps between the scores and the weights, from the top (compact: all in one box)."""
    texts = ["$\\div\\sqrt{D_k}$"] + (["causal mask"] if mask else []) + ["softmax"]
    if compact:
        texts = ["\n".join(texts)]
    pts = [_phone_pt(t, TEXT_PT) for t in texts]  # the box of three: all at the root's size
    sizes = [text_size(t, pt) for t, pt in zip(texts, pts)]
    return [_Step(t, pt, w + 0.2, h + 0.1) for t, pt, (w, h) in zip(texts, pts, sizes)]


def _labels(spec: _Spec) -> tuple[float, float]:
    """Width and height of a grid's label stack: name, symbolic and numeric shape."""
    return _stack_size(
        _label_lines(spec.name, spec.dims, spec.shape, "s", "s", _NAME_PT, MATH_PT)["s"]
    )


def _layout(unit: float, specs: dict[str, _Spec], steps: list[_Step], compact: bool, v_side: str):
    """``(width, height, plan)`` for cells of side ``unit``: three columns, Q | K^T over the
    scores, the steps, A | V over O, the top block above the bottom one; V's labels on
    ``v_side`` (``"right"`` or ``"above"``)."""
    labels = {k: _labels(s) for k, s in specs.items()}
    w = {k: _extent(s.shape[1], unit, 0.1) for k, s in specs.items()}
    h = {k: _extent(s.shape[0], unit, 0.1) for k, s in specs.items()}
    z_w = 0 if compact else text_size("$Z$", MATH_PT)[0] + 0.08  # beside the arrow into softmax
    slots = [
        max(w["Q"], labels["Q"][0], labels["Kt"][0]),
        max(w["Z"], labels["A"][0], *(s.width for s in steps), 2 * z_w),
        max(w["O"], labels["O"][0], labels["V"][0] if v_side == "above" else 0.0),
    ]
    starts = _pack(slots, _SLOT_GAP, start=MARGIN)
    x = {
        "Q": starts[0] + (slots[0] - w["Q"]) / 2,
        "Z": starts[1] + (slots[1] - w["Z"]) / 2,
        "O": starts[2] + (slots[2] - w["O"]) / 2,
    }
    x["Kt"], x["A"], x["V"] = x["Z"], x["Z"], x["O"]
    right = x["Z"] + w["Z"] + 0.07 + labels["Z"][0]  # the scores' labels, beside them
    if v_side == "right":
        right = max(right, x["V"] + w["V"] + 0.07 + labels["V"][0])
    width = max(starts[2] + slots[2], right) + MARGIN

    y = {"A": MARGIN + max(labels["A"][1], labels["O"][1]) + 0.05}
    y["O"] = y["A"]
    y["V"] = y["A"] + h["A"] + _GAP
    if v_side == "above":
        v_top = y["V"] + h["V"] + 0.05 + labels["V"][1]
    else:  # centred beside V: the higher of its top and its labels' top
        v_top = max(y["V"] + h["V"], y["V"] + (h["V"] + labels["V"][1]) / 2)
    steps_h = sum(s.height for s in steps)
    chain = steps_h + (len(steps) + 1) * _ARROW
    # The scores' labels, beside them, stay clear above V's.
    y["Z"] = max(y["A"] + h["A"] + chain, v_top + 0.08 + max(0.0, labels["Z"][1] - h["Z"]) / 2)
    y["Q"] = y["Z"]
    y["Kt"] = y["Z"] + h["Z"] + _GAP
    arrow = (y["Z"] - y["A"] - h["A"] - steps_h) / (len(steps) + 1)  # the chain, spread evenly
    tops = _pack([s.height for s in steps], arrow, start=y["Z"] - arrow, down=True)
    steps_y = [top - s.height for top, s in zip(tops, steps)]
    floor = y["Z"] + h["Z"] + 0.05  # above Q
    kt_labels_top = max(y["Kt"] + (h["Kt"] + labels["Kt"][1]) / 2, floor + labels["Kt"][1])
    height = max(y["Kt"] + h["Kt"], kt_labels_top) + MARGIN
    centre = x["Z"] + w["Z"] / 2
    return width, height, _Plan(x, y, steps_y, centre, floor, v_side)


def _draw_grids(ax, specs, plan: _Plan, unit: float, T: int, S: int, mask: bool):
    """The grids, labelled on their sides: Q, the scores, A, O, then K^T and V."""
    grids = {}
    for key in ("Q", "Z", "A", "O", "Kt", "V"):
        spec = specs[key]
        masked = None
        if key == "A" and mask:
            masked = np.triu(np.ones((T, S), dtype=bool), k=1)  # top-left causal: j > i
        grids[key] = draw_matrix(
            ax,
            plan.x[key],
            plan.y[key],
            spec.shape,
            unit=unit,
            color=spec.color,
            name=spec.name,
            dims=spec.dims,
            name_at=_SIDES.get(key, plan.v_side),
            shape_at=_SIDES.get(key, plan.v_side),
            masked=masked,
            fill=0.45 if key in ("Z", "A") else 0.35,
            label_floor=plan.floor if key == "Kt" else None,
            name_pt=_NAME_PT,
            label_pt=MATH_PT,
            tag=_TAGS[key],
        )
    return grids


def _draw_steps(ax, steps: list[_Step], plan: _Plan, grids, compact: bool) -> None:
    """The step boxes between the scores and the weights, and the arrows down through them; the
    arrow into the softmax carries Z (compact: the steps share one box, no arrow carries Z)."""
    boxes = [
        draw_box(
            ax,
            plan.centre - s.width / 2,
            y,
            s.width,
            s.height,
            s.text,
            color=NEUTRAL,
            fill=0.1,
            fontsize=s.fontsize,
            tag=f"step {k}",
        )
        for k, (y, s) in enumerate(zip(plan.steps_y, steps))
    ]
    points = [grids["Z"].bottom] + [p for b in boxes for p in (b.top, b.bottom)] + [grids["A"].top]
    for i in range(0, len(points), 2):
        into_softmax = i == len(points) - 4 and not compact
        draw_arrow(
            ax,
            (plan.centre, points[i][1] - 0.03),
            (plan.centre, points[i + 1][1] + 0.03),
            label="$Z$" if into_softmax else None,
            label_side="right",
            fontsize=MATH_PT,
        )
