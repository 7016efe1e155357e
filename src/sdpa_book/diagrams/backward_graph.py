"""The backward pass as a graph: the forward's stages and the gradients flowing back through
them, :func:`backward_graph_diagram`."""

from __future__ import annotations

from typing import NamedTuple

from ..figures import FULL_WIDTH, KEY, OUTPUT, QUERY, VALUE
from .draw import draw_arrow, draw_box, new_canvas, role_legend
from .primitives import (
    GRADIENT,
    INK,
    LABEL_PT,
    MARGIN,
    SCORES,
    Rect,
    _mathtext_shape,
    _numeric_shape,
    _pack,
    _packed_length,
    _positive_int,
    _shade,
    text_size,
)


class _Node(NamedTuple):
    column: int  # from the left
    band: int  # from the top: 0 inputs, 1 forward, 2 the row term, 3 backward, 4 input gradients
    formula: str
    dims: tuple[str, ...]
    color: str


_NODES = {
    "Q": _Node(0, 0, "$Q$", ("T", "D_k"), QUERY),
    "K": _Node(0, 1, "$K$", ("S", "D_k"), KEY),
    "Z": _Node(1, 1, "$Z = QK^\\top/\\sqrt{D_k}$", ("T", "S"), SCORES),
    "A": _Node(2, 1, "$A = \\mathrm{softmax}(Z)$", ("T", "S"), SCORES),
    "V": _Node(3, 0, "$V$", ("S", "D_v"), VALUE),
    "O": _Node(3, 1, "$O = AV$", ("T", "D_v"), OUTPUT),
    "dO": _Node(3, 3, "$dO = \\partial\\mathcal{L}/\\partial O$", ("T", "D_v"), GRADIENT),
    "dV": _Node(3, 4, "$dV = A^\\top dO$", ("S", "D_v"), GRADIENT),
    "dA": _Node(2, 3, "$dA = dO\\,V^\\top$", ("T", "S"), GRADIENT),
    "delta": _Node(2, 2, "$\\delta_i = do_i \\cdot o_i$", ("T",), GRADIENT),
    "dZ": _Node(1, 3, "$dZ = A \\odot (dA - \\delta)$", ("T", "S"), GRADIENT),
    "dQ": _Node(0, 4, "$dQ = dZ\\,K/\\sqrt{D_k}$", ("T", "D_k"), GRADIENT),
    "dK": _Node(0, 3, "$dK = dZ^\\top Q/\\sqrt{D_k}$", ("S", "D_k"), GRADIENT),
}
# (from, to, the side of each box the arrow leaves and enters)
_FORWARD = [
    ("Q", "Z", "right", "top"),
    ("K", "Z", "right", "left"),
    ("Z", "A", "right", "left"),
    ("A", "O", "right", "left"),
    ("V", "O", "bottom", "top"),
]
_BACKWARD = [
    ("dO", "dA", "left", "right"),
    ("dO", "dV", "bottom", "top"),
    ("dA", "dZ", "left", "right"),
    ("dO", "delta", "top", "right"),
    ("delta", "dZ", "left", "top"),
    ("dZ", "dK", "left", "right"),
    ("dZ", "dQ", "bottom", "right"),
]
_GAP_Y = 0.22  # between two bands
_LEGEND_H = 0.3


def backward_graph_diagram(
    *, T: int | None = None, S: int | None = None, Dk: int | None = None, Dv: int | None = None
):
    r"""The forward's stages as a graph, and the gradients flowing back through it.

    Top, the forward: :math:`Q, K \to Z = QK^\top/\sqrt{D_k} \to A = \mathrm{softmax}(Z) \to
    O = AV`, with :math:`V`. Bottom, in the gradient colour, the backward: from
    :math:`dO`, :math:`dV = A^\top dO` and :math:`dA = dO\,V^\top`; the row term
    :math:`\delta_i = do_i \cdot o_i`; :math:`dZ = A \odot (dA - \delta)`; then
    :math:`dQ = dZ\,K/\sqrt{D_k}` and :math:`dK = dZ^\top Q/\sqrt{D_k}`. Each gradient sits
    under (or beside) what it is the gradient of, and has its shape.

    Parameters
    ----------
    T, S, Dk, Dv : int, optional
        Sizes: when given (all four), each node also shows its numeric shape.

    Returns
    -------
    matplotlib.figure.Figure
        The diagram: white, at most ``sdpa_book.figures.FULL_WIDTH`` wide, not registered
        with pyplot.

    Raises
    ------
    TypeError
        If a size is not an integer.
    ValueError
        If a size is not positive, or only some of the four are given.

    Examples
    --------
    >>> from sdpa_book.diagrams import backward_graph_diagram, figure_texts
    >>> texts = figure_texts(backward_graph_diagram(T=3, S=5, Dk=4, Dv=2))
    >>> [t.splitlines()[0] for t in texts if t.startswith("$d")]  # the gradients
    ['$dO = \\partial\\mathcal{L}/\\partial O$', '$dV = A^\\top dO$', '$dA = dO\\,V^\\top$',
     '$dZ = A \\odot (dA - \\delta)$', '$dQ = dZ\\,K/\\sqrt{D_k}$',
     '$dK = dZ^\\top Q/\\sqrt{D_k}$']
    >>> [t for t in texts if t.startswith("$dQ")]
    ['$dQ = dZ\\,K/\\sqrt{D_k}$\n$(T, D_k)$\n(3, 4)']
    """
    value = _checked_sizes(T, S, Dk, Dv)
    texts = {k: _node_text(node, value) for k, node in _NODES.items()}
    box_size = {
        k: (text_size(t, LABEL_PT)[0] + 0.18, text_size(t, LABEL_PT)[1] + 0.1)
        for k, t in texts.items()
    }
    col_w = [max(box_size[k][0] for k, n in _NODES.items() if n.column == c) for c in range(4)]
    band_h = [max(box_size[k][1] for k, n in _NODES.items() if n.band == b) for b in range(5)]
    gap_x = (FULL_WIDTH - 2 * MARGIN - sum(col_w)) / 3  # the columns fill the width
    height = MARGIN + _packed_length(band_h, _GAP_Y) + _LEGEND_H + MARGIN
    fig, ax = new_canvas(FULL_WIDTH, height)
    lefts = _pack(col_w, gap_x, start=MARGIN)
    tops = _pack(band_h, _GAP_Y, start=height - MARGIN, down=True)
    col_x = [left + w / 2 for left, w in zip(lefts, col_w)]
    band_y = [top - h / 2 for top, h in zip(tops, band_h)]
    boxes = {}
    for k, node in _NODES.items():
        w, h = box_size[k]
        boxes[k] = draw_box(
            ax,
            col_x[node.column] - w / 2,
            band_y[node.band] - h / 2,
            w,
            h,
            texts[k],
            color=node.color,
            fill=0.15 if node.color == GRADIENT else 0.3,
            fontsize=LABEL_PT,
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
    sizes = {n: _positive_int(v, n) for n, v in sizes.items()}
    return {"T": sizes["T"], "S": sizes["S"], "D_k": sizes["Dk"], "D_v": sizes["Dv"]}


def _node_text(node: _Node, value: dict[str, int] | None) -> str:
    """The formula, the symbolic shape and, with sizes, the numeric shape."""
    lines = [node.formula, _mathtext_shape(node.dims)]
    if value is not None:
        lines.append(_numeric_shape([value[d] for d in node.dims]))
    return "\n".join(lines)


def _draw_links(ax, boxes: dict[str, Rect]) -> None:
    """The forward's arrows in ink, the backward's in the gradient colour, and their legend."""
    gradient = _shade(GRADIENT)
    for links, color in ((_FORWARD, INK), (_BACKWARD, gradient)):
        for a, b, start, end in links:
            p0 = getattr(boxes[a], start)
            p1 = getattr(boxes[b], end)
            draw_arrow(ax, p0, p1, color=color, linewidth=1.4)
    role_legend(
        ax, [("forward", INK, {"line": True}), ("backward: gradients", gradient, {"line": True})]
    )
