"""The backward pass as a graph: the forward's stages and the gradients flowing back through
them, :func:`backward_graph_diagram`."""

from __future__ import annotations

from typing import NamedTuple

from ..figures import KEY, OUTPUT, QUERY, VALUE
from .draw import draw_arrow, draw_box, new_canvas
from .phone import LEGEND_ROW, PHONE_CANVAS, _legend
from .primitives import (
    GRADIENT,
    INK,
    MARGIN,
    MATH_PT,
    SCORES,
    Rect,
    _at_most,
    _mathtext_shape,
    _numeric_shape,
    _pack,
    _packed_length,
    _positive_int,
    _shade,
    text_size,
)


class _Node(NamedTuple):
    column: int  # 0 the forward, 1 the backward
    row: int  # from the top
    formula: str
    dims: tuple[str, ...]
    color: str


# The forward runs down the left column, the backward up the right one: each gradient sits on
# the row of what it is the gradient of, and the row term delta on a row of its own.
_NODES = {
    "Q": _Node(0, 0, "$Q$", ("T", "D_k"), QUERY),
    "K": _Node(0, 1, "$K$", ("S", "D_k"), KEY),
    "Z": _Node(0, 2, "$Z = QK^\\top/\\sqrt{D_k}$", ("T", "S"), SCORES),
    "A": _Node(0, 4, "$A = \\mathrm{softmax}(Z)$", ("T", "S"), SCORES),
    "O": _Node(0, 5, "$O = AV$", ("T", "D_v"), OUTPUT),
    "V": _Node(0, 6, "$V$", ("S", "D_v"), VALUE),
    "dQ": _Node(1, 0, "$dQ = dZ\\,K/\\sqrt{D_k}$", ("T", "D_k"), GRADIENT),
    "dK": _Node(1, 1, "$dK = dZ^\\top Q/\\sqrt{D_k}$", ("S", "D_k"), GRADIENT),
    "dZ": _Node(1, 2, "$dZ = A \\odot (dA - \\delta)$", ("T", "S"), GRADIENT),
    "delta": _Node(1, 3, "$\\delta_i = do_i \\cdot o_i$", ("T",), GRADIENT),
    "dA": _Node(1, 4, "$dA = dO\\,V^\\top$", ("T", "S"), GRADIENT),
    "dO": _Node(1, 5, "$dO = \\partial\\mathcal{L}/\\partial O$", ("T", "D_v"), GRADIENT),
    "dV": _Node(1, 6, "$dV = A^\\top dO$", ("S", "D_v"), GRADIENT),
}
_ROWS = 7
# (from, to, the side of each box the arrow leaves and enters, its bend): a link that passes a
# box of its column bends around it, out of the column (or into the gap between the columns)
_FORWARD = [
    ("Q", "Z", "left", "left", 0.3),
    ("K", "Z", "bottom", "top", 0.0),
    ("Z", "A", "bottom", "top", 0.0),
    ("A", "O", "bottom", "top", 0.0),
    ("V", "O", "top", "bottom", 0.0),
]
_BACKWARD = [
    ("dO", "dV", "bottom", "top", 0.0),
    ("dO", "dA", "top", "bottom", 0.0),
    ("dO", "delta", "right", "right", 0.3),
    ("dA", "dZ", "left", "left", -0.3),
    ("delta", "dZ", "top", "bottom", 0.0),
    ("dZ", "dK", "top", "bottom", 0.0),
    ("dZ", "dQ", "right", "right", 0.3),
]
_GAP_Y = 0.16  # between two rows
_BEND_ROOM = 0.24  # outside each column, for the links that bend around a box
_MIN_GAP_X = 0.3  # between the columns
_MAX_SIZE = 99_999  # five digits: two shapes of them still fit side by side on a phone


def backward_graph_diagram(
    *, T: int | None = None, S: int | None = None, Dk: int | None = None, Dv: int | None = None
):
    r"""The forward's stages as a graph, and the gradients flowing back through it.

    Two columns, narrow enough for a phone. Left, the forward, from the top down:
    :math:`Q, K \to Z = QK^\top/\sqrt{D_k} \to A = \mathrm{softmax}(Z) \to O = AV`, with
    :math:`V` feeding :math:`O` from below. Right, in the gradient colour, the backward, from
    the bottom up: from :math:`dO`, :math:`dV = A^\top dO` and :math:`dA = dO\,V^\top`; the
    row term :math:`\delta_i = do_i \cdot o_i` (on a row of its own); :math:`dZ = A \odot (dA -
    \delta)`; then :math:`dK = dZ^\top Q/\sqrt{D_k}` and :math:`dQ = dZ\,K/\sqrt{D_k}`. Each
    gradient sits beside what it is the gradient of, and each box has its shape.

    Parameters
    ----------
    T, S, Dk, Dv : int, optional
        Sizes: when given (all four), each node also shows its numeric shape. Each at most
        99999 (five digits), so that the shapes fit a phone's column.

    Returns
    -------
    matplotlib.figure.Figure
        The diagram: white, at most 3.7 in wide (a phone's column), not registered with
        pyplot.

    Raises
    ------
    TypeError
        If a size is not an integer.
    ValueError
        If a size is not positive or above 99999, or only some of the four are given.

    Examples
    --------
    >>> from sdpa_book.diagrams import backward_graph_diagram, figure_texts
    >>> texts = figure_texts(backward_graph_diagram(T=3, S=5, Dk=4, Dv=2))
    >>> [t.splitlines()[0] for t in texts if t.startswith("$d")]  # the gradients
    ['$dQ = dZ\\,K/\\sqrt{D_k}$', '$dK = dZ^\\top Q/\\sqrt{D_k}$',
     '$dZ = A \\odot (dA - \\delta)$', '$dA = dO\\,V^\\top$',
     '$dO = \\partial\\mathcal{L}/\\partial O$', '$dV = A^\\top dO$']
    >>> [t for t in texts if t.startswith("$dQ")]
    ['$dQ = dZ\\,K/\\sqrt{D_k}$\n$(T, D_k)$ = (3, 4)']
    """
    value = _checked_sizes(T, S, Dk, Dv)
    texts, col_w = _fitted_texts(value)
    box_h = max(text_size(t, MATH_PT)[1] for t in texts.values()) + 0.1
    row_h = [box_h] * _ROWS
    height = MARGIN + _packed_length(row_h, _GAP_Y) + 0.1 + LEGEND_ROW + MARGIN
    fig, ax = new_canvas(PHONE_CANVAS, height)
    col_x = [
        MARGIN + _BEND_ROOM + col_w[0] / 2,
        PHONE_CANVAS - MARGIN - _BEND_ROOM - col_w[1] / 2,
    ]
    row_y = [top - box_h / 2 for top in _pack(row_h, _GAP_Y, start=height - MARGIN, down=True)]
    boxes = {}
    for k, node in _NODES.items():
        w = text_size(texts[k], MATH_PT)[0] + 0.16
        boxes[k] = draw_box(
            ax,
            col_x[node.column] - w / 2,
            row_y[node.row] - box_h / 2,
            w,
            box_h,
            texts[k],
            color=node.color,
            fill=0.15 if node.color == GRADIENT else 0.3,
            fontsize=MATH_PT,
            tag=k,
        )
    _draw_links(ax, boxes)
    return fig


def _checked_sizes(T, S, Dk, Dv) -> dict[str, int] | None:
    """``{"T": T, "S": S, "D_k": Dk, "D_v": Dv}`` (the names of the maths), or None if no size
    is given."""
    sizes = {"T": T, "S": S, "Dk": Dk, "Dv": Dv}
    given = [n for n, v in sizes.items() if v is not None]
    if given and len(given) < 4:
        missing = [n for n in sizes if n not in given]
        raise ValueError(
            f"give all four sizes T, S, Dk, Dv or none; got {', '.join(given)} "
            f"without {', '.join(missing)}"
        )
    if not given:
        return None
    sizes = {n: _at_most(_positive_int(v, n), _MAX_SIZE, n) for n, v in sizes.items()}
    return {"T": sizes["T"], "S": sizes["S"], "D_k": sizes["Dk"], "D_v": sizes["Dv"]}


def _fitted_texts(value: dict[str, int] | None) -> tuple[dict[str, str], list[float]]:
    """Each node's text, and the width of each column: the numeric shape beside the symbolic
    one when both columns then fit the canvas, else on a line of its own."""
    for joined in (True, False):
        texts = {k: _node_text(node, value, joined) for k, node in _NODES.items()}
        col_w = [
            max(text_size(texts[k], MATH_PT)[0] + 0.16 for k, n in _NODES.items() if n.column == c)
            for c in (0, 1)
        ]
        if sum(col_w) + 2 * (MARGIN + _BEND_ROOM) + _MIN_GAP_X <= PHONE_CANVAS:
            break
    return texts, col_w


def _node_text(node: _Node, value: dict[str, int] | None, joined: bool) -> str:
    """The formula over the symbolic shape and, with sizes, the numeric one (beside it when
    ``joined``)."""
    shape = _mathtext_shape(node.dims)
    if value is None:
        return f"{node.formula}\n{shape}"
    numeric = _numeric_shape([value[d] for d in node.dims])
    return (
        f"{node.formula}\n{shape} = {numeric}" if joined else f"{node.formula}\n{shape}\n{numeric}"
    )


def _draw_links(ax, boxes: dict[str, Rect]) -> None:
    """The forward's arrows in ink, the backward's in the gradient colour, and their legend."""
    gradient = _shade(GRADIENT)
    for links, color in ((_FORWARD, INK), (_BACKWARD, gradient)):
        for a, b, start, end, bend in links:
            p0 = getattr(boxes[a], start)
            p1 = getattr(boxes[b], end)
            draw_arrow(ax, p0, p1, color=color, linewidth=1.4, curve=bend)
    _legend(
        ax, [("forward", INK, {"line": True}), ("backward: gradients", gradient, {"line": True})]
    )
